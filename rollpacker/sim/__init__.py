"""A discrete-event simulator of cluster-scale RL jobs: the real scheduling policies, simulated engines.

- :mod:`~rollpacker.sim.cost`: the roofline cost model (also the parallelism planner's);
- :mod:`~rollpacker.sim.workload`: the length mixture (:mod:`rollpacker.data.lengths`) fitted to the
  paper, recorded length traces, reward times;
- :mod:`~rollpacker.sim.engine`: one engine replica (continuous batching, KV cache, preemption);
- :mod:`~rollpacker.sim.simulate`: rounds driven like :func:`rollpacker.exchange.run_round`, and
  the stages of each step;
- :mod:`~rollpacker.sim.paper`: the paper's Table 1 (the calibration) and Table 2 (the check)
  beside the simulator's;
- :mod:`~rollpacker.sim.gantt`: per-replica activity as a PNG.

``python -m rollpacker.sim --help`` lists the commands.
"""
