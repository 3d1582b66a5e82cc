"""The parallelism planner (paper §4.2): an offline profile of every rollout TP (``profile.py``)
and the per-step TP choice from preemption counts (``planner.py``); the run switches TP in-process."""
