"""The parallelism planner: its heuristic on scripted preemption counts, the default TP from a
profile by hand, the profile file's round trip and refusals, and real gloo ranks switching TP."""

from __future__ import annotations

import json

import pytest
from support.jobs import launch_job, torchrun

from rollpacker.plan.planner import best_tp


def entry(capacity: int, ms_at_1: float, ms_at_4: float) -> dict:
    return {"kv_capacity_tokens": capacity, "decode_ms": {"100": {"1": ms_at_1, "4": ms_at_4}}}


RUN = ["--data.num-toy-prompts", "32", "--rollout.num-prompts", "4", "--rollout.group-size", "4",
       "--rollout.max-new-tokens", "64", "--eval-every", "0", "--metrics.wandb-mode", "disabled", "--metrics.no-live",
       "--plan.profile-batches", "1", "4", "--plan.profile-contexts", "32", "--plan.profile-steps", "2"]


@pytest.mark.slow  # the CLI runs in sim validate's slow tests; the run below profiles at its start
def test_the_profiler_cli_writes_a_profile_the_planner_reads(tmp_path):
    path = tmp_path / "profile.json"
    flags = ["--plan.profile", str(path), "--plan.profile-batches", "1", "2", "--plan.profile-contexts", "16", "40",
             "--plan.profile-steps", "2"]
    proc = launch_job(*flags, nproc=1, module="rollpacker.profile", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote {path}" in proc.stdout and "TP 1: KV capacity" in proc.stdout
    profile = json.loads(path.read_text())
    assert profile["key"]["world"] == 1 and list(profile["tp"]) == ["1"]
    entry = profile["tp"]["1"]
    assert set(entry["decode_ms"]) == {"16", "40"} and set(entry["decode_ms"]["16"]) == {"1", "2"}
    assert entry["kv_capacity_tokens"] > 0 and entry["kv_bytes_per_token"] == 2 * 4 * 2 * 32 * 4  # toy model, fp32
    assert best_tp(profile, [1], 16, 20, 50, max_num_seqs=256)[0] == 1


def test_the_profiler_cli_says_a_setting_the_job_refuses_in_one_line():
    """A model or engine setting the job refuses at its join was a traceback of the profiler."""
    proc = launch_job("--engine.kind", "vllm", "--engine.block-size", "32", nproc=1, module="rollpacker.profile",
                      timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.rstrip().endswith("rollpacker.profile: config error: --engine.block-size=32 with vLLM: vLLM "
                                         "picks its own KV block size (128 tokens on CPU); leave it out")
    proc = launch_job("--model.path", "/nonexistent/model", nproc=1, module="rollpacker.profile", timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]  # a FileNotFoundError's
    assert proc.stderr.splitlines()[-1].startswith("rollpacker.profile: config error: --model.path: /nonexistent/model "
                                                   "is not a directory: point it at a Hugging Face model directory")


@pytest.mark.slow  # the in-process run below switches TP too; this one checks the rollouts token by token
def test_switching_tp_between_steps_rolls_out_like_a_fixed_tp(tmp_path):
    out = torchrun("tp_switch.py", 2, str(tmp_path), timeout=600)
    assert out.count("OK") == 2, out


def test_a_run_with_the_planner_switches_tp_in_process(tmp_path):
    # A KV budget that TP 1 overflows (3.35 MiB less 2.90 MiB of weights per rank: 14 blocks): the first
    # preemptions double TP; one quiet step (quiet_steps 1) halves it again. Without the profile
    # guard, which would keep TP 1 here: on CPU gloo, TP 2 is the slower one.
    proc = launch_job("--run-dir", str(tmp_path / "run"), "--num-steps", "5", *RUN,
                      "--plan.enabled", "--plan.initial-tp", "1", "--plan.quiet-steps", "1", "--plan.no-profile-guard",
                      "--plan.profile-dir", str(tmp_path / "profiles"), "--engine.memory-mb", "3.35")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    tps = [r["plan/rollout_tp"] for r in rows]
    assert tps[0] == 1 and 2 in tps, tps
    for before, after in zip(rows, rows[1:]):  # each step's preemptions decide the next step's TP
        if before["plan/rollout_tp"] == 1 and before["rollout/preemptions"] > 0:
            assert after["plan/rollout_tp"] == 2
        if before["plan/rollout_tp"] == 2 and before["rollout/preemptions"] == 0:
            assert after["plan/rollout_tp"] == 1
    switched = [r for r in rows if r["plan/switched"]]
    assert switched and all(r["time/tp_switch"] > 0 for r in switched)
    assert "rollout TP 1 -> 2" in proc.stderr and "preemptions > 1.05 x recent level" in proc.stderr
    assert len(list((tmp_path / "profiles").glob("profile-*.json"))) == 1  # profiled once, cached

    # The profile is reused, and one made for another setup is refused with the difference named.
    wrong = tmp_path / "wrong.json"
    profile = json.loads(next((tmp_path / "profiles").glob("profile-*.json")).read_text())
    profile["key"]["world"] = 8
    wrong.write_text(json.dumps(profile))
    proc = launch_job("--run-dir", str(tmp_path / "run2"), "--num-steps", "1", *RUN,
                      "--plan.enabled", "--plan.profile", str(wrong))
    assert proc.returncode != 0
    assert "world: profile has 8, this run 2" in proc.stderr
    assert proc.stderr.count(f"rollpacker: {wrong}: the profile is for another setup") == 1  # ours, not a traceback
    # one measured under another plan.max_tp lacks a TP this run may pick (the planner's switch to it raised a
    # KeyError mid-run); a missing file is named as plan.profile's
    del profile["tp"]["2"]
    wrong.write_text(json.dumps(profile | {"key": profile["key"] | {"world": 2}}))
    for path, said in ((wrong, f"rollpacker: {wrong}: the profile holds TPs [1], not [2], which this run may pick "
                               "([1, 2]: --plan.max-tp, the node's size)"),
                       (tmp_path / "missing.json", "missing.json: no such file (--plan.profile: write one")):
        proc = launch_job("--run-dir", str(tmp_path / "run2"), "--num-steps", "1", *RUN, "--plan.enabled",
                          "--plan.profile", str(path), "--engine.memory-mb", "3.35")
        assert proc.returncode != 0 and proc.stderr.count(said) == 1, proc.stderr[-3000:]


@pytest.mark.slow  # 30 s; the planner's run: the test above; its TPs' divisibility and limits: tests/unit/plan
def test_the_planner_never_picks_a_tp_whose_kv_cache_cannot_hold_a_request(tmp_path):
    """At 3 MiB a rank, TP 1's KV cache (0.1 MiB after its weights: 48 tokens) holds no request of the data (a
    prompt and 64 new tokens), TP 2's does: the profile says TP 1 is faster (CPU gloo), and the planner started
    there, where the engines refused every request the run had fitted to TP 2's cache."""
    proc = launch_job("--run-dir", str(tmp_path / "run"), "--num-steps", "2", *RUN, "--rollout.tp", "2",
                      "--plan.enabled", "--plan.quiet-steps", "1", "--plan.profile-dir", str(tmp_path / "profiles"),
                      "--engine.memory-mb", "3.0")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["plan/rollout_tp"] for r in rows] == [2, 2] and "starting at TP 2 (usable: [2])" in proc.stderr


@pytest.mark.slow  # the switch is the test above's; every response is an episode, so it runs on the episode path
def test_episodes_run_with_the_planner_its_switch_landing_between_steps(tmp_path):
    """The toy environment's episodes (a wrong answer gets a second try) under the planner: it switches
    TP between steps as for single-turn responses; every step's episodes finish in their round (none is
    left holding a session or an environment error)."""
    proc = launch_job("--run-dir", str(tmp_path / "run"), "--num-steps", "4", *RUN, "--preset", "toy-env",
                      "--plan.enabled", "--plan.initial-tp", "1", "--plan.quiet-steps", "1", "--plan.no-profile-guard",
                      "--plan.profile-dir", str(tmp_path / "profiles"), "--engine.memory-mb", "3.35")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    tps = [r["plan/rollout_tp"] for r in rows]
    assert tps[0] == 1 and 2 in tps and any(r["plan/switched"] for r in rows), tps
    assert all(r["env/errors"] == 0 and r["rollout/resident_sessions"] == 0 and r["env/turns_mean"] >= 1
               for r in rows)
    assert all(r["sched/trained_prompts"] == 4 for r in rows)


@pytest.mark.slow  # a benchmark's plumbing
def test_planner_bench_smoke(capsys):
    from rollpacker.bench.__main__ import main

    main(["planner", "--steps", "2", "--memory-mb", "3.35", "--", *RUN[:8], "--plan.profile-batches", "1", "4",
          "--plan.profile-contexts", "32", "--plan.profile-steps", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    base = summary["step_time_tp1"]
    for v in ("planner", "paper", "tp2"):  # the fixed-TP-1 step time over the variant's, both rounded to 1e-3
        t = summary[f"step_time_{v}"]
        assert (base - 5e-4) / (t + 5e-4) - 5e-4 <= summary[f"speedup_{v}"] <= (base + 5e-4) / (t - 5e-4) + 5e-4
    assert summary["tp_switches"] in (0, 1, 2) and summary["tp_switches_paper"] in (0, 1, 2)  # one per step at most
    assert {"preemptions_short_tp1", "rollout_short_tp2", "step_time_planner"} <= set(summary)
    assert any(line.startswith("TP of short rounds") for line in lines)
