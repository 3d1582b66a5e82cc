"""The driver of ``python -m rollpacker.gpu_check``: the preflight, then each stage in a process group of its own
under its own limit, then the summary.

Invariants: every line printed is also appended to ``OUT/results.jsonl`` as it is made; a stage's output goes
straight to ``OUT/NAME.log``, so a stage killed on its limit (its whole group: the toy job's workers too) keeps
the measurements it printed; the summary is written even when the driver is stopped (SIGTERM, Ctrl-C) or
``git`` is missing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rollpacker.gpu_check import DEFAULT_STAGES, RESULT, STAGES

ROOT = Path(__file__).resolve().parents[2]
KILL_GRACE_S = 5
"""How long a stage's group has between SIGTERM and SIGKILL."""


class Stopped(Exception):
    """The driver was asked to stop (SIGTERM or SIGINT)."""


def stage_env(device: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """A stage's environment: our code first on the path, the device chosen explicitly (the test suite
    forces CPU through ROLLPACKER_DEVICE), Triton's interpreter on CPU only, the preflight's ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env |= {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "ROLLPACKER_DEVICE": "cpu" if device == "cpu" else "auto", "PYTHONUNBUFFERED": "1"}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env | (extra or {})


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s whole process group, SIGKILL to what is left after at most :data:`KILL_GRACE_S`
    (no wait once the leader is gone); nothing if the group is empty."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_in_group(cmd: list[str], limit_s: float, log: Path, env: dict[str, str]) -> int | None:
    """Run ``cmd`` as the leader of a new process group, its output into ``log``; kill the whole group when it
    exits or after ``limit_s``. Returns its exit code, None on a timeout."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return proc.wait(limit_s)
        except subprocess.TimeoutExpired:
            return None
        finally:
            kill_group(proc)  # a timeout, a stop, or children left behind by a finished stage


def stage_row(name: str, text: str, rc: int | None, seconds: float, limit_s: float, log: Path) -> dict:
    """A stage's line: its last result (every measurement it printed); it passes when that result says ok and
    the stage exited 0, or hung only after printing it (said in ``error``)."""
    row = {"stage": name, "letter": STAGES[name].letter, "seconds": round(seconds, 1), "limit_s": limit_s}
    lines = [line for line in text.splitlines() if line.startswith(RESULT)]
    result = json.loads(lines[-1].removeprefix(RESULT)) if lines else {}
    finished, passed = "ok" in result, bool(result.pop("ok", False))
    ok = passed and rc in (0, None)  # None: a limit reached after the result (below) keeps it
    if finished and not passed:  # it failed, and exits 1 for it: its own error is the cause to show
        result.setdefault("error", f"failed (log: {log.name})")
        if rc is None:
            result["exit"] = f"hung at exit after its result; killed after {limit_s} s"
    elif rc is None and finished:  # its exit hung (a process group's teardown, say): its result stands
        result["error"] = f"hung at exit after its result; killed after {limit_s} s (log: {log.name})"
    elif rc is None:
        ok, result["error"] = False, f"timed out after {limit_s} s; kept what it printed before (log: {log.name})"
    elif not finished:
        result["error"] = f"exited {rc} before its result: {text.strip()[-600:]}"
    elif rc != 0:  # a crash in its teardown (NCCL's, CUDA's) after an ok result
        result["error"] = f"exited {rc} after its result (log: {log.name})"
    return row | {"ok": ok} | result


def run_stage(name: str, args: argparse.Namespace, impl: str, env: dict[str, str]) -> dict:
    """Stage ``name`` in its own process group under its limit; its line (``stopped`` added when the driver was
    stopped meanwhile). Its output goes to ``OUT/NAME.log``."""
    limit = STAGES[name].cuda_s if args.device == "cuda" else STAGES[name].cpu_s
    cmd = [sys.executable, "-m", "rollpacker.gpu_check.stages", name, "--device", args.device, "--out",
           str(args.out), "--work", str(args.work), "--limit-s", str(limit), "--logprobs-impl", impl,
           "--started", str(time.time())]
    log = args.out / f"{name}.log"
    start, stopped = time.perf_counter(), None
    try:
        rc = run_in_group(cmd, limit, log, env)
    except Stopped as e:  # run_in_group killed the group
        rc, stopped = -1, str(e)
    row = stage_row(name, log.read_text(errors="replace"), rc, time.perf_counter() - start, limit, log)
    if stopped:
        row |= {"error": f"the check was stopped ({stopped}) during this stage; kept what it printed before",
                "stopped": stopped}
    return row


def git_commit() -> str | None:
    """This tree's commit (``-dirty`` when changed), else the one ``.whl/COMMIT`` was fetched at, else None."""
    try:
        proc = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                              text=True, cwd=ROOT, timeout=30)
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass  # no git here (a GPU machine gets the working tree without it)
    recorded = ROOT / ".whl" / "COMMIT"
    return recorded.read_text().strip() + " (.whl/COMMIT)" if recorded.is_file() else None


def versions(device: str, gpu: str | None = None) -> dict:
    """The summary line's facts: versions, the GPU (``gpu``, the name the preflight's probe read: the driver never
    initializes CUDA, whose context it would hold on the GPU through every stage), this commit and the date. Never
    raises."""
    facts: dict = {"device": device, "date": datetime.date.today().isoformat(), "commit": git_commit()}
    for module in ("torch", "triton", "transformers"):
        try:
            facts[module] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - a missing or broken package is a fact here
            facts[module] = None
    return facts | ({"gpu": gpu} if device == "cuda" else {})


def emit(row: dict, results: Path) -> None:
    line = json.dumps(row, default=str)
    print(line, flush=True)
    with results.open("a") as f:
        f.write(line + "\n")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rollpacker.gpu_check", description=__doc__)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: every stage at toy size")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_check"),
                        help="results.jsonl, the stage logs and the toy job's metrics (small)")
    parser.add_argument("--work", type=Path, default=None,
                        help="models and checkpoints (default: a temporary folder, removed at the end)")
    parser.add_argument("--stages", nargs="+", choices=list(STAGES), default=DEFAULT_STAGES, metavar="STAGE",
                        help=f"which of {', '.join(STAGES)} (default: all but episodes)")
    args = parser.parse_args(argv)
    args.stages = [s for s in STAGES if s in args.stages]  # in order, each once
    return args


def stop(signum, frame) -> None:
    raise Stopped(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> None:
    from rollpacker.gpu_check.preflight import preflight

    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    temporary = args.work is None
    args.work = Path(tempfile.mkdtemp(prefix="rollpacker-gpu-check-")) if temporary else args.work
    args.work.mkdir(parents=True, exist_ok=True)
    results, rows, facts = args.out / "results.jsonl", [], {}
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        check = preflight(args.device, args.out, args.work, stage_env(args.device))
        # now: a stopped check has seconds left for its summary, not for imports
        facts = versions(args.device, check.facts.get("gpu"))
        emit(check.row(args.stages), results)
        env = stage_env(args.device, check.env)
        for name in args.stages:
            if name in check.skip:
                rows.append({"stage": name, "letter": STAGES[name].letter, "ok": None, "skipped": check.skip[name]})
            else:
                rows.append(run_stage(name, args, check.logprobs_impl, env))
            emit(rows[-1], results)
            if rows[-1].get("stopped"):
                break
    except Stopped as e:
        print(f"python -m rollpacker.gpu_check: stopped ({e}); the summary follows", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        ran = {r["stage"] for r in rows}
        summary = {"gpu_check": "summary", "ok": bool(rows) and len(rows) == len(args.stages) and all(
            r["ok"] for r in rows), "failed": [r["stage"] for r in rows if r["ok"] is False],
            "skipped": [r["stage"] for r in rows if r["ok"] is None],
            "not_run": [s for s in args.stages if s not in ran],
            "seconds": round(sum(r.get("seconds", 0) for r in rows), 1), **(facts or versions(args.device))}
        emit(summary, results)
        if temporary:
            shutil.rmtree(args.work, ignore_errors=True)
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
