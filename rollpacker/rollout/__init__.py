"""Rollout engines behind one contract (``engine.py``): TorchEngine now, SGLangEngine on GPU."""
