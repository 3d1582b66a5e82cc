"""``python -m rollpacker.sim validate`` end to end on a tiny compute-bound run: profile, runs (one speculative),
simulation, each phase beside the run's. The simulator's bound on a small sync job is held on a recorded one:
tests/unit/sim/test_validate.py."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # a benchmark: profile, two runs, simulation
def test_validate_profiles_runs_and_simulates(tmp_path):
    small = ["--rollout.num-prompts", "4", "--rollout.group-size", "2", "--rollout.max-new-tokens", "64",
             "--plan.profile-batches", "1", "8", "--plan.profile-contexts", "32", "--plan.profile-steps", "2"]
    cmd = [sys.executable, "-m", "rollpacker.sim", "validate", "--regimes", "compute", "--policies", "tail",
           "--num-steps", "3", "--repeats", "1", "--work-dir", str(tmp_path), "--", *small]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    profile = json.loads((tmp_path / "compute" / "profile.json").read_text())
    assert sorted(profile["tp"]["1"]["decode_ms"]) == ["32"] and profile["exchange_ms"] > 0
    for policy in ("tail",):
        metrics = tmp_path / "compute" / policy / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        rollouts = [r["time/rollout"] + r["time/reward"] for r in records if "time/rollout" in r]
        assert len(rollouts) == 3
        assert abs(figures[f"measured_s_compute_{policy}"] - sum(rollouts[1:]) / 2) < 1e-4  # steps after the first
        assert figures[f"simulated_s_compute_{policy}"] > 0
        assert max(n for r in records if "time/rollout" in r for n in r["rollout/response_lengths"]) <= 64  # the cap
    # the speculative run: the profile holds verify-step costs, the run its acceptance rates
    assert profile["tp"]["1"]["spec"]["draft_lens"][0] == 0 and figures["simulated_s_compute_tail+spec"] > 0
    spec_run = (tmp_path / "compute" / "tail+spec" / "metrics.jsonl").read_text()
    assert "rollout/spec_accept_rate" in spec_run and "compute   tail+spec" in proc.stdout
    errors = []
    for label in ("tail", "tail+spec"):
        m, s = figures[f"measured_s_compute_{label}"], figures[f"simulated_s_compute_{label}"]
        errors.append((abs(s / m - 1), 5e-5 * (1 + s / m) / m + 5e-5))  # the figures are rounded to 4 decimals
    error, rounding = max(errors)
    assert abs(figures["sim_max_rel_error"] - error) <= rounding
    assert figures["spread_max"] == 0 and figures["loaded"] == (figures["other_cores_max"] > 0.25)
    assert "compute   tail" in proc.stdout and "$ -m torch.distributed.run" in proc.stdout

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # same flags: nothing runs again
    assert again.returncode == 0, again.stderr[-4000:]
    assert "$ " not in again.stdout
    assert json.loads(again.stdout.strip().splitlines()[-1]) == figures

