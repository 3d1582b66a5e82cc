"""``python -m rollpacker.bench episodes`` at tiny sizes: sync and tail over the heavy-tailed toy
environment (2 ranks each), and the speculation pair; every prompt trained once under both, no
token changed by speculation, the summary line as the issue names it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.jobs import job_env


@pytest.mark.slow  # a benchmark's plumbing; the bench's parts: tests/unit/env/test_bench.py
def test_episodes_bench_smoke(tmp_path):
    cmd = [sys.executable, "-m", "rollpacker.bench", "episodes", "--policies", "sync,tail", "--rows", "4",
           "--num-prompts", "2", "--group-size", "2", "--max-turns", "3", "--turn-tokens", "16",
           "--workload", "light", "--median-s", "0.01", "--env-workers", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=job_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert {"rollout_speedup_tail", "step_speedup_tail", "env_wait_s_sync", "env_wait_s_tail"} <= set(summary)
    assert summary["rollout_speedup_tail"] > 0 and summary["step_speedup_tail"] > 0
    assert (summary["tokens_changed"], summary["prompts_lost"], summary["prompts_trained_twice"]) == (0, 0, 0)
    assert "tokens changed by speculation (auto vs off, sync, 8 episodes): 0" in proc.stdout  # 2 steps x 2 x 2
    reused = next(line for line in proc.stdout.splitlines() if line.startswith("prefill tokens reused"))
    assert all(int(n) > 0 for n in reused.split()[3:])  # resident sessions served later turns under both


@pytest.mark.slow  # a benchmark's plumbing; its parts: tests/unit/env/test_parity.py
def test_parity_bench_smoke(tmp_path):
    cmd = [sys.executable, "-m", "rollpacker.bench", "parity", "--policies", "sync,tail", "--seeds", "0",
           "--steps", "2", "--eval-every", "2", "--latency", "lognormal:0.02:1.0", "--env-workers", "2",
           "--", "--data.num-eval-prompts", "16", "--rollout.num-prompts", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=job_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert {"eval_gain_sync", "eval_gain_tail", "tool_rate_sync", "tool_rate_tail", "parity_tail"} <= set(summary)
    # plain tail lets every episode of a round finish: no step cut one, so there is no mean of cut episodes
    assert summary["cut_turns_tail"] is None and "bar: tail's gain" in proc.stdout
