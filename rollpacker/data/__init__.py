"""Datasets, the stateful prompt sampler, the synthetic toy task with its toy model, and the paper's
long-tailed response lengths (replayed by runs, drawn by the simulator)."""
