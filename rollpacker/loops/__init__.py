"""The training loops: :mod:`~rollpacker.loops.colocated` (every rank rolls out and trains) and
:mod:`~rollpacker.loops.one_step_off` (a rollout pool and a training pool, overlapped)."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger("rollpacker")


def train(job) -> int:
    """Run ``job`` to its end (collective): the loop its policy needs, the final checkpoint and
    evaluation; returns the step reached."""
    from rollpacker import preempt
    from rollpacker.loops import colocated, one_step_off

    cfg, ctl = job.config, job.controller
    loop = one_step_off if job.meshes.disaggregated else colocated
    step = loop.run(job)
    stop = job.meshes.broadcast(preempt.requested() if ctl else None)  # a stop signal ended the loop
    if step > job.start_step and not (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
        job.save(step)  # the final state, also when the data ran out before num_steps (num_epochs) or on a stop
    if stop and ctl:
        logger.info("stopped on %s after %d steps: checkpoint saved, resume with --resume auto", stop, step)
    if cfg.checkpoint.export_hf and not stop:
        job.export(Path(cfg.run_dir) / "hf")
    if cfg.eval_every and job.engine is not None and not stop:
        final = colocated.evaluate(job, step)
        if ctl:
            ctl.metrics.log(step, final)
            logger.info("final eval: %s", final)
    if ctl:
        ctl.close()
        logger.info("done after %d steps: metrics in %s", step, Path(cfg.run_dir) / "metrics.jsonl")
    return step
