"""Rollout scheduling policies behind one small contract (``base.py``): sync and tail now;
one_step_off, sorted and pipe plug in as one file each."""
