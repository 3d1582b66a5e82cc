"""Training side of the RL step: GRPO losses and memory-lean token log-probabilities."""
