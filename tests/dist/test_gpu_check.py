"""``python -m rollpacker.gpu_check --device cpu``: every stage of the GPU check at toy size, so it cannot rot
(issue 37). On a GPU the same command is the first-contact check (docs/gpu-check.md)."""

from __future__ import annotations

import json
import subprocess
import sys

from support.jobs import job_env

from rollpacker.gpu_check import STAGES


def test_every_stage_runs_on_cpu_at_toy_size_and_prints_one_json_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rollpacker.gpu_check", "--device", "cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=3600, env=job_env())
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    *stages, summary = lines
    assert [s["stage"] for s in stages] == list(STAGES) and [s["letter"] for s in stages] == list("abcdefg")
    assert all(s["ok"] and s["seconds"] <= s["limit_s"] for s in stages), stages
    assert summary["gpu_check"] == "summary" and summary["ok"] and summary["device"] == "cpu" and summary["torch"]
    assert (tmp_path / "results.jsonl").read_text().splitlines() == proc.stdout.splitlines()
    by = {s["stage"]: s for s in stages}
    assert by["toy"]["trained_steps"] == [0, 1, 2, 3] and "config.json" in by["toy"]["hf_export"]  # resumed at 2
    assert by["train"]["push"]["engine_vs_trainer_max_dlogprob"] < 1e-3
    assert by["offload"]["full_tensor_device"] == "cpu"
    assert by["kernel"]["max_abs_diff"]["logprob"] < 1e-5
    assert by["engine"]["fp32"]["not_greedy"] == 0 and by["engine"]["preemptions"] > 0
    assert by["engine"]["workspace"]["within_plan"]
    assert by["spec"]["draft_lens"][0] == 0 and by["judge"]["bit_equal"]
    assert all((tmp_path / f"{name}.log").is_file() for name in STAGES)



def test_an_unknown_stage_is_refused_naming_the_stages():
    proc = subprocess.run([sys.executable, "-m", "rollpacker.gpu_check", "--device", "cpu", "--stages", "nope"],
                          capture_output=True, text=True, timeout=120, env=job_env())
    assert proc.returncode == 2 and "invalid choice: 'nope' (choose from 'toy', 'train', 'offload'" in proc.stderr
