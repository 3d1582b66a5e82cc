"""rollpacker: synchronous on-policy RL post-training with tail batching (the RollPacker paper)."""

__version__ = "0.1.0"
