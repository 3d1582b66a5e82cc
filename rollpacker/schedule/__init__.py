"""Rollout scheduling policies behind one small contract (``base.py``): sync now; tail,
one_step_off, sorted and pipe plug in as one file each."""
