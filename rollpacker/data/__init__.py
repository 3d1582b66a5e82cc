"""Datasets, the stateful prompt sampler, and the synthetic toy task with its toy model."""
