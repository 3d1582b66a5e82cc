"""``python -m rollpacker.bench rewards``: what the reward scheduler hides, on a toy code workload.

A round of ``--responses`` programs "finishes" over a rollout of ``--rollout-seconds``, at times
drawn from a long-tailed distribution (most early, a few at the very end, like real response
lengths). The programs solve a toy problem (print the sum of the integers on stdin): most are
correct and fast, some correct but slow, some wrong, and some loop forever. Each is scored in
the code sandbox through the real :class:`~rollpacker.reward.scheduler.RewardScheduler` in four
ways, side by side:

- **sync**: every response is scored after the rollout ends (all of reward is exposed);
- **async**: each response is submitted the moment it finishes, overlapping the rollout;
- with a **fixed** ``--fixed-timeout`` (veRL-style 30 s) or the **adaptive** timeout
  (min(max(T_min, λ·T_anchor), T_max), anchors learned from a warm-up round of correct runs).

It prints the exposed reward time (after the last response finished) and the step time (rollout
+ exposed reward) of each, with the ratios against sync + fixed.

Then a remote reward model: each call waits on the network (``--remote-median-s``, lognormal), scored
as each response finishes, by a plain ``def`` in the workers (one call per worker) and by an
``async def`` awaited in the controller (``reward.max_concurrent`` at once), the same waits side by
side. Last line: JSON.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass

import numpy as np
import tyro

from rollpacker.env.episode import Response
from rollpacker.reward.config import RewardConfig
from rollpacker.reward.scheduler import RewardScheduler

PROGRAMS = {
    "correct": "import sys\nprint(sum(map(int, sys.stdin.read().split())))\n",
    "slow": "import sys, time\ntime.sleep(0.3)\nprint(sum(map(int, sys.stdin.read().split())))\n",
    "wrong": "import sys\nprint(sum(map(int, sys.stdin.read().split())) + 1)\n",
    "loop": "while True:\n    pass\n",
}
TESTS = [{"input": "1 2 3\n", "output": "6\n"}, {"input": "10 -4\n", "output": "6\n"}]


@dataclass
class Args:
    responses: int = 48
    """Responses per round."""
    rollout_seconds: float = 8.0
    """Length of the simulated rollout the responses finish over."""
    loop_fraction: float = 0.06
    """Share of responses that never terminate."""
    slow_fraction: float = 0.15
    """Share of correct but slow (0.3 s per test) responses."""
    wrong_fraction: float = 0.2
    """Share of wrong responses."""
    fixed_timeout: float = 30.0
    """The fixed per-test timeout compared against the adaptive one."""
    workers: int = 2
    """Reward worker processes."""
    remote_median_s: float = 0.5
    """The remote reward model's median seconds per call (lognormal, sigma 0.5)."""
    seed: int = 0
    """Seeds the workload."""

    def __post_init__(self) -> None:
        fractions = (self.loop_fraction, self.slow_fraction, self.wrong_fraction)
        if min(self.remote_median_s, self.fixed_timeout, self.rollout_seconds) <= 0:  # failed in a later phase
            raise ValueError(f"--remote-median-s, --fixed-timeout and --rollout-seconds must be positive, got "
                             f"{self.remote_median_s}, {self.fixed_timeout} and {self.rollout_seconds}")
        if self.responses <= 0 or self.workers <= 0 or min(fractions) < 0 or sum(fractions) > 1:
            raise ValueError(f"--responses and --workers must be positive, got {self.responses} and {self.workers}; "
                             "--loop-fraction, --slow-fraction and --wrong-fraction >= 0 with a sum <= 1 (the rest "
                             f"correct), got {' + '.join(map(str, fractions))}")


def workload(args: Args) -> tuple[list[str], list[float]]:
    """The responses (markdown code blocks) and their finish times, sorted."""
    rng = np.random.default_rng(args.seed)
    kinds = rng.choice(["loop", "slow", "wrong", "correct"], size=args.responses,
                       p=[args.loop_fraction, args.slow_fraction, args.wrong_fraction,
                          1 - args.loop_fraction - args.slow_fraction - args.wrong_fraction])
    finish = np.sort(rng.pareto(1.5, args.responses))
    finish = args.rollout_seconds * finish / finish[-1]
    return [f"```python\n{PROGRAMS[k]}```" for k in kinds], finish.tolist()


def remote(completions, **kwargs) -> list[float]:
    """A remote reward model called by a plain ``def``: the call waits for its answer."""
    time.sleep(float(completions[0]))
    return [1.0]


async def remote_awaited(completions, **kwargs) -> list[float]:
    """The same, by an ``async def``."""
    await asyncio.sleep(float(completions[0]))
    return [1.0]


def one_round(scheduler: RewardScheduler, responses: list[str], finish: list[float], overlap: bool) -> dict:
    row = {"id": "bench", "prompt": "", "tests": TESTS}
    start = time.perf_counter()
    for i, (text, at) in enumerate(zip(responses, finish)):
        if overlap:
            time.sleep(max(0.0, start + at - time.perf_counter()))
            scheduler.submit(i, row, Response(id=str(i), prompt_ids=[], token_ids=text))  # decode is the identity
    time.sleep(max(0.0, start + finish[-1] - time.perf_counter()))
    rollout_end = time.perf_counter()
    if not overlap:
        for i, text in enumerate(responses):
            scheduler.submit(i, row, Response(id=str(i), prompt_ids=[], token_ids=text))  # decode is the identity
    scores = dict(scheduler.wait())
    end = time.perf_counter()
    metrics = scheduler.take_metrics()
    return {"exposed": end - rollout_end, "step": end - start, "reward_seconds": metrics["reward/seconds_total"],
            "passed": sum(s == 1.0 for s in scores.values()), "errors": metrics["reward/errors"]}


def main(argv: list[str] | None = None) -> None:
    args = tyro.cli(Args, args=sys.argv[1:] if argv is None else argv, prog="python -m rollpacker.bench rewards")
    responses, finish = workload(args)
    warmup = [f"```python\n{PROGRAMS['correct']}```"] * 4
    results = {}
    for timeout in ("fixed", "adaptive"):
        fixed = args.fixed_timeout
        cfg = RewardConfig(funcs=("code",), num_workers=args.workers, timeout=5.0, max_error_frac=1.0,
                           **({"timeout_min": fixed, "timeout_max": fixed} if timeout == "fixed" else {}))
        scheduler = RewardScheduler(cfg, decode=lambda text: text)
        try:
            one_round(scheduler, warmup, [0.0] * len(warmup), overlap=False)  # anchors from correct runs
            for overlap in (False, True):
                name = f"{'async' if overlap else 'sync'}_{timeout}"
                results[name] = one_round(scheduler, responses, finish, overlap)
                print(f"{name:<16} exposed {results[name]['exposed']:7.2f} s   step {results[name]['step']:7.2f} s   "
                      f"reward time {results[name]['reward_seconds']:7.2f} s   passed {results[name]['passed']}"
                      f"/{args.responses}   flagged {results[name]['errors']}", flush=True)
        finally:
            scheduler.close()
    rng = np.random.default_rng(args.seed)
    waits = [str(w) for w in args.remote_median_s * rng.lognormal(0.0, 0.5, args.responses)]  # the responses' calls
    for name in ("remote", "remote_awaited"):
        cfg = RewardConfig(funcs=(f"rollpacker.bench.rewards:{name}",), num_workers=args.workers, timeout=60.0)
        scheduler = RewardScheduler(cfg, decode=lambda text: text)
        try:
            results[name] = one_round(scheduler, waits, finish, overlap=True)
        finally:
            scheduler.close()
        print(f"{name:<16} exposed {results[name]['exposed']:7.2f} s   step {results[name]['step']:7.2f} s   "
              f"reward time {results[name]['reward_seconds']:7.2f} s", flush=True)
    base = results["sync_fixed"]
    print(f"\n{'':<16}{'exposed (s)':>12}{'step (s)':>10}{'step speedup':>14}")
    for name, r in results.items():
        if not name.startswith("remote"):
            print(f"{name:<16}{r['exposed']:>12.2f}{r['step']:>10.2f}{base['step'] / r['step']:>13.2f}x")
    print(f"remote reward model: step {results['remote']['step']:.2f} s with one call per worker, "
          f"{results['remote_awaited']['step']:.2f} s awaited together")
    summary = {f"exposed_{name}": round(r["exposed"], 3) for name, r in results.items()}
    summary |= {f"step_{name}": round(r["step"], 3) for name, r in results.items()}
    summary |= {"exposed_ratio": round(base["exposed"] / max(results["async_adaptive"]["exposed"], 1e-3), 2),
                "step_speedup": round(base["step"] / results["async_adaptive"]["step"], 2),
                "remote_step_speedup": round(results["remote"]["step"] / results["remote_awaited"]["step"], 2)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
