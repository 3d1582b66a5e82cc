"""``python -m rollpacker.sim growth``: tail batching's rollout speedup against how fast the decode
step grows with the running requests, by batch shape.

Tail batching saves the time a sync round spends decoding its few longest responses while the
other slots sit empty. That saving is real time only if an iteration with few requests running is
cheaper than a full one by little: the flatter the decode step, the larger the gain. This command
simulates ``sync`` and ``tail`` on ``bench regime``'s workload (the 51M random model's prompts,
replayed lengths from the paper's mixture, cap 1024, 2 ranks; :func:`rollpacker.sim.validate.
simulate_run`, the same simulator ``validate`` checks against runs here) on engines whose decode
iteration costs ``d * (1 + growth * (running - 1))``: growth 0 is an ideal HBM-bound GPU replica,
and this CPU's 2-rank vLLM job, one core per rank, grows by about 0.09-0.16 per request (its
step(8)/step(1) measured 1.6-2.1). Prefill and the control exchange cost nothing, the KV cache is
unbounded: only the step's growth and the batch shape vary. Last line JSON:
``speedup_tail_<P0>x<R0>_g<growth>`` (mean over seeds).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

STEP_MS = 20.0
"""One request's decode iteration (the 51M model's on one core; speedups do not depend on it)."""
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(kw_only=True)
class GrowthArgs:
    growths: tuple[float, ...] = (0.0, 0.01, 0.04, 0.15)
    """Growth of the decode step per extra running request, as a fraction of one request's step."""
    shapes: tuple[str, ...] = ("4x2", "8x4", "16x8", "32x8")
    """Batch shapes P0xR0 (prompts per step x responses per prompt)."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """Seeds of the prompts and replayed lengths; the table shows their mean and range."""
    num_steps: int = 40
    """Steps simulated per policy (the first is not counted)."""
    work_dir: Path = Path("runs/validate")
    """Where ``validate`` keeps the regime's random model (written there if missing)."""

    def __post_init__(self) -> None:
        for shape in self.shapes:
            p0, _, r0 = shape.partition("x")
            if not (p0.isdigit() and r0.isdigit() and int(p0) > 0 and int(r0) > 0):
                raise ValueError(f"--shapes: {shape!r} is not P0xR0 (e.g. 16x8)")
        if self.num_steps < 2:
            raise ValueError(f"--num-steps must be >= 2 (the first step is not counted), got {self.num_steps}")
        if any(not 0 <= g < math.inf for g in self.growths):
            raise ValueError(f"--growths: {self.growths} must be >= 0 (a decode step's growth per running request)")


def linear_profile(growth: float) -> dict:
    """A profile (``python -m rollpacker.profile``'s format) whose decode iteration costs
    ``STEP_MS * (1 + growth * (running - 1))`` at every context, with free prefill and exchange."""
    decode = {str(b): STEP_MS * (1 + growth * (b - 1)) for b in BATCHES}
    return {"exchange_ms": 0.0, "tp": {"1": {"kv_capacity_tokens": 10**9, "decode_ms": {"64": decode},
                                             "prefill_tok_s": {"64": 1e12}}}}


def speedup(shape: str, growth: float, seed: int, args: GrowthArgs) -> float:
    """Simulated sync rollout time per step over tail's, steps after the first."""
    from rollpacker.jobflags import JobArgs, MemoryRegime, job_argv, memory_regime_flags, policy_args
    from rollpacker.schedule.sync import SyncConfig
    from rollpacker.schedule.tail import TailConfig
    from rollpacker.sim.validate import rollout_per_step, simulate_run

    p0, r0 = map(int, shape.split("x"))
    flags = memory_regime_flags(MemoryRegime(model_dir=args.work_dir / "regime-model", num_steps=args.num_steps,
                                 num_prompts=p0, group_size=r0)) + ["--engine.max-num-seqs", str(BATCHES[-1])]
    sync, tail = (rollout_per_step(simulate_run(job_argv(JobArgs(), flags, policy_args(p), seed, ""),
                                                linear_profile(growth))) for p in (SyncConfig.name, TailConfig.name))
    return sync / tail


def main(argv: list[str]) -> dict:
    import tyro

    args = tyro.cli(GrowthArgs, args=argv, prog="python -m rollpacker.sim growth")
    figures, cells = {}, {}
    for shape in args.shapes:
        for growth in args.growths:
            runs = [speedup(shape, growth, seed, args) for seed in args.seeds]
            figures[f"speedup_tail_{shape}_g{growth:g}"] = round(statistics.mean(runs), 3)
            cells[shape, growth] = f"{statistics.mean(runs):.2f} ({min(runs):.2f}-{max(runs):.2f})"
    print(f"tail's rollout speedup over sync, simulated: bench regime's workload (cap 1024, 2 ranks), "
          f"{args.num_steps} steps, seeds {', '.join(map(str, args.seeds))} (mean, range); a decode step of "
          f"d * (1 + growth * (running - 1))")
    width = max(18, *(len(c) + 2 for c in cells.values()))
    print(f"{'P0 x R0':<10}" + "".join(f"{'growth ' + format(g, 'g'):>{width}}" for g in args.growths))
    for shape in args.shapes:
        print(f"{shape:<10}" + "".join(f"{cells[shape, g]:>{width}}" for g in args.growths))
    return figures
