"""Rollout scheduling policies behind one small contract (``base.py``): sync, tail, sorted,
sorted_partial and one_step_off; RolloutPipe (``pipe``) runs on top of sync or tail.

A policy is one module here: the policy, and beside it its settings class (a
:class:`~rollpacker.schedule.base.PolicyConfig`: settings, capabilities, ``build``, ``check``),
registered in :data:`rollpacker.schedule.config.POLICY_CONFIGS`. The run and the simulator build
a policy with ``config.schedule.build(...)``; nothing outside this package names a policy.
"""
