"""The driver of ``python -m rollpacker.gpu_check``: each stage in its own process under its own limit."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rollpacker.gpu_check import RESULT, STAGES


def stage_env(device: str) -> dict[str, str]:
    """A stage's environment: our code first on the path, the device chosen explicitly (the test suite
    forces CPU through ROLLPACKER_DEVICE), Triton's interpreter on CPU only."""
    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env |= {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
            "ROLLPACKER_DEVICE": "cpu" if device == "cpu" else "auto", "PYTHONUNBUFFERED": "1"}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def run_stage(name: str, device: str, out: Path) -> dict:
    """Stage ``name`` in a fresh process under its limit; its result line, or why there is none. Its
    output goes to ``out/NAME.log``."""
    limit = STAGES[name].cuda_s if device == "cuda" else STAGES[name].cpu_s
    cmd = [sys.executable, "-m", "rollpacker.gpu_check.stages", name, "--device", device, "--out", str(out)]
    start = time.perf_counter()
    log = out / f"{name}.log"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=stage_env(device))
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"), None
    log.write_text(text)
    head = {"stage": name, "letter": STAGES[name].letter, "seconds": round(time.perf_counter() - start, 1),
            "limit_s": limit}
    lines = [line for line in text.splitlines() if line.startswith(RESULT)]
    if rc is None:
        return head | {"ok": False, "error": f"timed out after {limit} s (its log: {log})"}
    if not lines:
        return head | {"ok": False, "error": f"exited {rc} without a result: {text.strip()[-600:]}"}
    result = json.loads(lines[-1].removeprefix(RESULT))
    return head | {"ok": bool(result.pop("ok")) and rc == 0} | result


def versions(device: str) -> dict:
    """The summary line's facts: versions, the GPU, this commit and the date."""
    import torch
    import transformers

    facts = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
             "date": datetime.date.today().isoformat()}
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:
        facts["triton"] = None
    if device == "cuda":
        facts["gpu"] = torch.cuda.get_device_name()
        facts["gpu_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    facts["commit"] = git.stdout.strip() or None
    return facts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rollpacker.gpu_check", description=__doc__)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: every stage at toy size")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_check"), help="results.jsonl and stage logs")
    parser.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES), metavar="STAGE",
                        help=f"a subset of {', '.join(STAGES)}")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("python -m rollpacker.gpu_check: no CUDA device is visible; --device cpu runs the toy check")
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    rows = []
    for name in (s for s in STAGES if s in args.stages):
        rows.append(run_stage(name, args.device, args.out))
        line = json.dumps(rows[-1])
        print(line, flush=True)
        with results.open("a") as f:
            f.write(line + "\n")
    summary = {"gpu_check": "summary", "ok": all(r["ok"] for r in rows), "failed": [r["stage"] for r in rows
                                                                                    if not r["ok"]],
               "seconds": round(sum(r["seconds"] for r in rows), 1), **versions(args.device)}
    print(json.dumps(summary), flush=True)
    with results.open("a") as f:
        f.write(json.dumps(summary) + "\n")
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
