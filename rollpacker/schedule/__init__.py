"""Rollout scheduling policies behind one small contract (``base.py``): sync, tail, sorted and
sorted_partial now; one_step_off and pipe plug in as one file each."""
