"""The training loops: :mod:`~rollpacker.loops.colocated` (every rank rolls out and trains) and
:mod:`~rollpacker.loops.one_step_off` (a rollout pool and a training pool, overlapped)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

logger = logging.getLogger("rollpacker")


def train(job) -> int:
    """Run ``job`` to its end (collective): the loop its policy needs, the final checkpoint and
    evaluation; returns the step reached."""
    from rollpacker import checkpoint, preempt
    from rollpacker.loops import colocated, one_step_off

    cfg, ctl = job.config, job.controller
    if ctl:
        from rollpacker.summary import planned_steps, start_summary

        ctl.display.num_steps = planned_steps(job)  # its step count and ETA: num_epochs may end the data first
        ctl.display.note(start_summary(job))
    loop = one_step_off if job.meshes.disaggregated else colocated
    step = loop.run(job)
    stop = preempt.requested_anywhere(job.meshes)  # a stop signal ended the loop
    if stop and step >= cfg.num_steps:  # it came during the last step: nothing is left to stop, the run ends
        if ctl:
            logger.info("stop on %s during the last step: the run ends as it would have (export, final eval)", stop)
        stop = None
    if step > job.start_step and job.saved != step:
        job.save(step)  # the final state, also when the data ran out before num_steps (num_epochs) or on a stop
    if stop:  # no export, no final evaluation: the run is not over
        if ctl:
            ctl.close()  # the reward workers, which ignored the signal, stop now
            newest = checkpoint.latest(Path(cfg.run_dir))
            go_on = (f"the newest committed checkpoint is {newest}: run the same command with --resume auto to go on"
                     if newest else "no checkpoint is committed: run the same command again to start")
            print(f"rollpacker: stopped on {stop} with {step} of {cfg.num_steps} steps done; {go_on}",
                  file=sys.stderr, flush=True)
        return step
    if cfg.checkpoint.export_hf:
        export(job, Path(cfg.run_dir))
    if cfg.eval_every and job.engine is not None:
        final = colocated.evaluate(job, step)
        if ctl:
            ctl.metrics.log(step, final)
            logger.info("final eval: %s", final)
    if ctl:
        ctl.close()
        logger.info("done after %d steps: metrics in %s", step, Path(cfg.run_dir) / "metrics.jsonl")
    return step


def export(job, run_dir: Path) -> None:
    """The run's policy into ``run_dir/hf`` (collective); a failed write is a UserError naming the command
    that writes it from the run's newest checkpoint."""
    from rollpacker import checkpoint
    from rollpacker.errors import UserError

    hf = run_dir / "hf"
    try:
        job.export(hf)
    except checkpoint.WRITE_ERRORS as e:
        newest = checkpoint.latest(run_dir)
        again = (f"the run's newest committed checkpoint is {newest}: free disk space or fix the permissions "
                 f"there, then python -m rollpacker.export {newest} --out {hf}" if newest else
                 "free disk space or fix the permissions there, then run again")
        raise UserError(f"export: writing the policy to {hf} failed ({str(e).splitlines()[0]}); {again}") from None
