"""The cluster simulator: hand-computed timings, the same policy decisions as the real controller,
the cost model's arithmetic, workloads, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# ---- hand-computed timings -----------------------------------------------------------------------


# ---- the same decisions as the real controller ---------------------------------------------------------


# ---- the cost model ----------------------------------------------------------------------------------


# ---- workloads ----------------------------------------------------------------------------------------


# ---- the whole job and the CLI -----------------------------------------------------------------------------


def sim_cli(*args: str) -> tuple[str, dict]:
    proc = subprocess.run([sys.executable, "-m", "rollpacker.sim", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(proc.stdout.strip().splitlines()[-1])


def test_cli_preset_run_prints_the_breakdown_and_a_gantt(tmp_path):
    out, figures = sim_cli("--preset", "qwen2.5-7b-8k", "--gpus", "16", "schedule:tail", "--num-steps", "5",
                           "--gantt", str(tmp_path / "gantt.png"))
    assert "short" in out and "long" in out and (tmp_path / "gantt.png").stat().st_size > 0
    assert figures["policy"] == "tail" and figures["short_steps"] == 4 and figures["long_steps"] == 1
    assert figures["step_s"] == pytest.approx(
        sum(figures[k] for k in ("rollout_s", "reward_s", "train_s", "sync_s")), rel=1e-3)


@pytest.mark.slow  # the paper's Table 2, every row simulated
def test_cli_table2_ends_with_max_rel_error_over_the_built_rows():
    out, figures = sim_cli("table2", "--num-steps", "5")
    assert out.count("not yet") == 0
    tail = [rows["+ tail batching"] for rows in figures["rows"].values()]
    assert len(tail) == 3 and all(r["sim"] > 1 for r in tail)
    assert all(len(rows) == 5 for rows in figures["rows"].values())
    assert all(0 < s["scaled_down"] <= 1 and s["hidden_train_s"] > 0 for s in figures["stream"].values())
    assert figures["max_rel_error"] == max(abs(r["rel_error"]) for rows in figures["rows"].values()
                                           for r in rows.values())


def test_cli_fig13c_adaptive_timeouts_only_shorten_the_exposed_scoring():
    out, figures = sim_cli("fig13c", "--num-steps", "5")
    assert "paper 1.6x" in out and figures["paper"] == 1.6
    for kind in ("short", "long", "all"):  # same rollout both ways: only the code runs cut early differ
        assert figures[f"adaptive_{kind}_s"] <= figures[f"fixed_{kind}_s"]
    assert figures["adaptive_short_s"] < figures["fixed_short_s"] - 5  # a 30 s timeout cut to a few seconds
    assert figures["speedup"] == pytest.approx(figures["fixed_all_s"] / figures["adaptive_all_s"], rel=1e-2)


def test_cli_workload_shows_the_mixture_beside_the_papers_statistics():
    out, figures = sim_cli("workload")
    assert "P75" in out and figures["cap_hit_rate"] >= 0.9 and figures["loss"] < 0.05


# ---- the stream trainer ----------------------------------------------------------------------------------
