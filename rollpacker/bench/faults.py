"""``python -m rollpacker.bench faults --runs 20``: the chaos benchmark.

Each run is the 2-rank toy job (tail batching, one epoch of a small dataset, a checkpoint every
step) under ``torchrun --max-restarts`` with ``--resume auto``, and one fault injected at a seeded
random point: SIGKILL of a random rank mid-round, SIGKILL of a random rank during a save, SIGSTOP
of a random rank (the collective timeout fires, torchrun restarts the group), or a full disk during
a save (a random rank's file-size limit drops to 1 MiB with ``prlimit``, so its next shard write
fails with EFBIG; the restarted group has the normal limit again). The final ledger is compared
with an uninterrupted run's. Last line JSON: ``runs``, ``recovered`` (a fault landed, exit 0 and the
ledger matches), ``not_injected`` (runs that ended before their fault's point), ``prompts_lost``,
``prompts_trained_twice``, ``hangs`` (runs killed at the outer time limit) and ``mean_recovery_s``
(from the fault to the first step the restarted group trains: fault detection, torchrun's restart,
model loading, the resume and one step; over recovered runs).

``--workload episodes``: every response an episode of ``bench episodes``' agentic environment, so
faults land with environments in flight. Each environment made records itself and its closing; the
JSON adds ``envs_made``, ``envs_unclosed`` (made and never closed) and ``workers_left`` (environment
workers alive after their run ended); a run recovers only with both 0.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import tyro

FAULTS = ("kill_rank", "kill_during_save", "stop_rank", "disk_full")
NUM_ROWS = 24
ARGS = ["schedule:tail", "--data.num-toy-prompts", str(NUM_ROWS), "--rollout.num-prompts", "4",
        "--rollout.group-size", "2", "--rollout.max-new-tokens", "32", "--num-steps", "100", "--num-epochs", "1",
        "--checkpoint-every", "1", "--eval-every", "0", "--metrics.wandb-mode", "disabled", "--metrics.no-live",
        "--resume", "auto", "--dist.timeout-s", "15", "--dist.first-step-timeout-s", "90",
        "--dist.checkpoint-timeout-s", "15"]
"""A fault during step 0 or its checkpoint meets the first-step timeout: 90 s fits the toy model's loading. A
stopped rank in a later checkpoint (a save of the toy model takes about a second) is named at 15 s too."""


EPISODE_ARGS = ["--env.max-turns", "8", "--env.max-tokens", "256", "--env.num-workers", "8", "--env.timeout", "30",
                "--env.warm"]
"""Episodes of the agentic workload capped at 8 turns (a run's steps stay about as long as single-turn ones), the
next round's environments warmed ahead (a fault also lands while they are open)."""


def episode_flags(run_dir: Path) -> list[str]:
    """The flags of ``--workload episodes``: the agentic environment, recording its environments in
    ``RUN_DIR.envs/``."""
    from rollpacker.bench.episodes import ENV_FILE

    log = run_dir.with_suffix(".envs")
    log.mkdir(parents=True, exist_ok=True)
    env_file = run_dir.with_suffix(".env.py")
    env_file.write_text(ENV_FILE.format(workload="agentic", sigma=0.0, max_turns=8, median_s=0.0, log=str(log)))
    return ["--env.factory", f"{env_file}:make_env", *EPISODE_ARGS]


def environments(run_dir: Path) -> dict[str, int]:
    """``envs_made``, ``envs_unclosed`` and ``workers_left`` of the run in ``run_dir`` (``--workload episodes``)."""
    log = run_dir.with_suffix(".envs")
    made = {p.stem: int(p.read_text()) for p in log.glob("*.made")}
    closed = {p.stem for p in log.glob("*.closed")}
    alive = {pid for pid in made.values() if Path(f"/proc/{pid}").exists()
             and b"multiprocessing" in Path(f"/proc/{pid}/cmdline").read_bytes()}
    return {"envs_made": len(made), "envs_unclosed": len(made.keys() - closed), "workers_left": len(alive)}


def launch(run_dir: Path, episodes: bool = False) -> tuple[subprocess.Popen, Path]:
    log = run_dir.with_suffix(".log")
    flags = episode_flags(run_dir) if episodes else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=3",
           "-m", "rollpacker.run", *ARGS, *flags, "--run-dir", str(run_dir)]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # pytorch#135712, as in train.sbatch
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, start_new_session=True, env=env)
    return proc, log


def worker_pid(run_dir: Path, rank: int) -> int | None:
    """The live torchrun worker of ``rank`` running with ``run_dir``."""
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or str(run_dir).encode() not in (entry / "cmdline").read_bytes():
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in env):
            return int(entry.name)
    return None


def lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def saving(run_dir: Path) -> bool:
    return any(not (p / "COMMITTED").exists() for p in (run_dir / "checkpoints").glob("step_*"))


def trained(run_dir: Path) -> list[tuple[int, int]]:
    from rollpacker import checkpoint

    newest = checkpoint.latest(run_dir)
    if newest is None:
        return []
    return [tuple(r) for r in json.loads((newest / "train_state.json").read_text())["policy"]["ledger"]["trained"]]


def inject(fault: str, run_dir: Path, proc: subprocess.Popen, rng: random.Random, deadline: float) -> float | None:
    """Wait for the fault's random point and inject it; the time it was injected, or None if the run ended first."""
    after, rank, delay = rng.randint(1, 3), rng.randint(0, 1), rng.uniform(0.0, 0.5)
    while proc.poll() is None and time.time() < deadline:
        ready = lines(run_dir) >= after and (fault != "kill_during_save" or saving(run_dir))
        if ready:
            if fault != "kill_during_save":
                time.sleep(delay)
            pid = worker_pid(run_dir, rank)
            if pid is None:
                continue
            if fault == "disk_full":
                subprocess.run(["prlimit", f"--pid={pid}", "--fsize=1048576"], check=True)
            else:
                os.kill(pid, signal.SIGSTOP if fault == "stop_rank" else signal.SIGKILL)
            return time.time()
        time.sleep(0.002)
    return None


def one_run(i: int, fault: str, work: Path, rng: random.Random, limit_s: float, reference: list,
            episodes: bool = False) -> dict:
    run_dir = work / f"run_{i:02d}"
    proc, log = launch(run_dir, episodes)
    deadline = time.time() + limit_s
    injected = inject(fault, run_dir, proc, rng, deadline)
    # metrics lines since torchrun saw the group fail, the fewest (a resume from an older checkpoint first drops
    # the records it redoes); when one more came: the restarted group's first step
    fewest = resumed = None
    while proc.poll() is None and time.time() < deadline:
        if injected and fewest is None and "failed (exitcode" in log.read_text():
            fewest = lines(run_dir)
        if fewest is not None and resumed is None:
            now = lines(run_dir)
            if now > fewest:
                resumed = time.time()
            fewest = min(fewest, now)
        time.sleep(0.05)
    hang = proc.poll() is None
    if hang:
        kill(proc, run_dir)
    got, want = Counter(trained(run_dir)), Counter(reference)
    lost = sum((want - got).values())
    twice = sum(n - 1 for n in got.values() if n > 1)
    envs = settled(run_dir) if episodes else {}
    ok = injected is not None and proc.returncode == 0 and not hang and got == want and not envs.get("envs_unclosed")
    ok = ok and not envs.get("workers_left")
    return {"run": i, "fault": fault, "injected": injected is not None, "exit": proc.returncode, "hang": hang,
            "recovered": ok, "prompts_lost": lost, "prompts_trained_twice": twice,
            "recovery_s": round(resumed - injected, 1) if resumed and injected else None, **envs}


def settled(run_dir: Path, grace_s: float = 10.0) -> dict[str, int]:
    """:func:`environments` once its workers had ``grace_s`` to close what they held (an orphan closes its
    environments as it unwinds, then exits)."""
    deadline = time.monotonic() + grace_s
    while (envs := environments(run_dir))["envs_unclosed"] + envs["workers_left"] and time.monotonic() < deadline:
        time.sleep(0.2)
    return envs


@dataclass
class Args:
    runs: int = 20
    """Faulty runs."""
    seed: int = 0
    """Seeds the faults, ranks and points."""
    limit_s: float = 900.0
    """Outer time limit of one run (past it: a hang)."""
    work_dir: str = ""
    """Where runs go (empty: a temporary directory, removed after unless a run failed)."""
    workload: str = "single"
    """single (one response per prompt's sample) or episodes (bench episodes' agentic environment: faults land
    with environments in flight; every environment made must be closed, no worker may outlive its run)."""

    def __post_init__(self) -> None:
        if self.workload not in ("single", "episodes"):
            raise ValueError(f"--workload {self.workload!r}: write single or episodes")
        if self.runs < 1 or self.limit_s <= 0:
            raise ValueError(f"--runs must be >= 1 and --limit-s > 0, got {self.runs} and {self.limit_s:g}")


def kill(proc: subprocess.Popen, run_dir: Path) -> None:
    """A run's torchrun and its workers, which run in sessions of their own."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for rank in (0, 1):
        while (pid := worker_pid(run_dir, rank)) is not None:
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> None:
    args = tyro.cli(Args, args=argv, prog="python -m rollpacker.bench faults", description=__doc__.split("\n\n")[0])
    if args.work_dir:
        work = Path(args.work_dir).resolve()
        work.mkdir(parents=True, exist_ok=True)
        bench(args, work)
        return
    work = Path(tempfile.mkdtemp(prefix="rollpacker-faults-"))  # its runs' checkpoints: 120 MB a run
    if bench(args, work):
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"bench faults: a run did not recover: its logs and checkpoints are kept in {work}", file=sys.stderr)


def bench(args: Args, work: Path) -> bool:
    """The reference run and ``args.runs`` faulty ones in ``work``, each a JSON line, then their summary's:
    whether every faulty run recovered."""
    episodes = args.workload == "episodes"
    proc, log = launch(work / "reference", episodes)
    try:
        code = proc.wait(timeout=args.limit_s)
    except subprocess.TimeoutExpired:
        kill(proc, work / "reference")
        sys.exit(f"bench faults: the uninterrupted reference run took over --limit-s {args.limit_s:g} s (killed); "
                 f"raise it, or see {log}")
    if code != 0:
        sys.exit(f"bench faults: the uninterrupted reference run failed; see {log}")
    reference = trained(work / "reference")
    rng = random.Random(args.seed)
    results = []
    for i in range(args.runs):
        fault = FAULTS[i % len(FAULTS)] if args.runs >= len(FAULTS) else rng.choice(FAULTS)
        result = one_run(i, fault, work, rng, args.limit_s, reference, episodes)
        print(json.dumps(result), flush=True)
        results.append(result)
    recoveries = [r["recovery_s"] for r in results if r["recovered"] and r["recovery_s"] is not None]
    print(json.dumps({
        "runs": len(results),
        "recovered": sum(r["recovered"] for r in results),
        "not_injected": sum(not r["injected"] for r in results),
        "prompts_lost": sum(r["prompts_lost"] for r in results),
        "prompts_trained_twice": sum(r["prompts_trained_twice"] for r in results),
        "hangs": sum(r["hang"] for r in results),
        "mean_recovery_s": round(sum(recoveries) / len(recoveries), 1) if recoveries else None,
        **({key: sum(r[key] for r in results) for key in ("envs_made", "envs_unclosed", "workers_left")}
           if episodes else {}),
    }))
    return all(r["recovered"] for r in results)


if __name__ == "__main__":
    main()
