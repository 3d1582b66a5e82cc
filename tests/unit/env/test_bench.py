"""``bench episodes``' workloads and environment alone (and the latency specs of bench parity and the
simulator): their shapes, their determinism, bad specs."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest

from rollpacker.bench.episodes import (
    Args,
    WorkloadEnv,
    bench_workload,
    changed_tokens,
    mean_summary,
    run_flags,
    summarize,
)
from rollpacker.sim.agentic import WORKLOADS, workload
from rollpacker.sim.episodes import latency_sampler
from rollpacker.toy.task import make_dataset


def test_lognormal_latency_has_its_mean_and_is_deterministic():
    draw = latency_sampler("lognormal:0.3:1.0")
    xs = [draw(f"k{i}") for i in range(20000)]
    assert statistics.mean(xs) == pytest.approx(0.3, rel=0.05) and max(xs) > 3 * 0.3  # a heavy right tail
    assert [draw("a"), draw("b")] == [draw("a"), draw("b")]
    assert latency_sampler("lognormal:0:1")("x") == 0.0


def test_a_trace_is_replayed_and_bad_specs_say_the_fix(tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("0.1\n0.5\n2.0\n")
    draw = latency_sampler(f"trace:{trace}")
    assert {draw(f"k{i}") for i in range(100)} == {0.1, 0.5, 2.0}
    for spec, fix in (("lognormal:x", "lognormal:MEAN_SECONDS:SIGMA"), ("gamma:1", "trace:PATH"),
                      (f"trace:{tmp_path / 'none'}", "no file"), ("lognormal:-1:1", ">= 0")):
        with pytest.raises(ValueError, match=fix):
            latency_sampler(spec)


def test_agentic_is_shaped_like_coding_agents_tool_calls():
    w = WORKLOADS["agentic"]
    steps = [w.step_seconds(str(row), "e", k, "a") for row in range(400) for k in range(1, 30)]
    p50, p90, p99 = np.percentile(steps, [50, 90, 99])
    assert p50 == pytest.approx(w.median_s, rel=0.3) and 100 < p99 / p50 < 720 and max(steps) == w.median_s * 400
    assert statistics.mean(steps) == pytest.approx(w.mean_step(), rel=0.15)  # the timeout's cut is priced
    assert w.sigma == pytest.approx(2.5, abs=0.01)
    turns = [w.turns(str(row), str(e)) for row in range(2000) for e in range(2)]
    assert np.percentile(turns, 50) <= 3 and np.percentile(turns, 90) >= 8 and max(turns) == 32
    # episodes of one prompt are alike: their turns vary less within a prompt than across prompts
    within = statistics.mean(statistics.pstdev([w.turns(str(r), str(e)) for e in range(8)]) for r in range(300))
    assert within < statistics.pstdev(turns) / 2
    resets = [w.reset_seconds(str(row)) for row in range(500)]
    assert statistics.median(resets) == pytest.approx(10 * w.median_s, rel=0.3)
    draws = (lambda: [w.turns("7", "x"), w.step_seconds("7", "x", 2, "y"), w.reset_seconds("7")])
    assert draws() == draws()


def test_light_is_the_earlier_shape_and_sigma_overrides_keep_the_mean_step():
    light = WORKLOADS["light"]
    steps = [light.step_seconds(str(r), "e", 1, "a") for r in range(20000)]
    assert statistics.mean(steps) == pytest.approx(0.3, rel=0.05)
    assert (light.max_turns, light.reset_seconds("1")) == (8, 0.0)
    for sigma in (1.0, 1.5, 2.5):
        moved = bench_workload("agentic", sigma=sigma, max_turns=8)
        assert (moved.sigma, moved.max_turns, moved.prompt_sigma) == (pytest.approx(sigma), 8, 1.0)
        assert moved.mean_step() == pytest.approx(WORKLOADS["agentic"].mean_step())


def test_a_trace_replays_recorded_episodes_and_bad_specs_say_the_fix(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"steps": [0.1, 0.2], "reset": 1.5, "prompt": "a"}) + "\n"
                     + json.dumps({"steps": [0.3, 0.4, 0.5], "prompt": "a"}) + "\n")
    w = workload(f"trace:{trace}")
    assert {w.turns("1", str(e)) for e in range(50)} == {2, 3} and w.max_turns == 3
    episode = next(str(e) for e in range(50) if w.turns("1", str(e)) == 3)
    assert [w.step_seconds("1", episode, k, "x") for k in (1, 2, 3)] == [0.3, 0.4, 0.5]
    bad = tmp_path / "bad.jsonl"
    for text, fix in (('{"steps": []}', "one step at least"), ("[1, 2]", "one JSON object a line"), ("", "empty")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=fix):
            workload(f"trace:{bad}")
    for spec, fix in (("heavy", "agentic, light or trace:PATH"), (f"trace:{tmp_path / 'none'}", "no file")):
        with pytest.raises(ValueError, match=fix):
            workload(spec)
    with pytest.raises(ValueError, match="drop --sigma"):
        Args(workload=f"trace:{trace}", sigma=1.0)
    with pytest.raises(ValueError, match="--seeds"):
        Args(seeds="0,x")


def test_the_environment_ends_after_its_workloads_turns_and_scores_the_last_answer():
    rows = make_dataset(50, seed=0)
    w = bench_workload("agentic", median_s=1e-6)
    for row in rows[:10]:
        env = WorkloadEnv(row, w)
        env.reset(seed=0, options={})
        turns, done = 0, False
        while not done:
            obs, reward, done, truncated, _ = env.step("A: 0")
            turns += 1
        assert turns == w.turns(str(row["id"]), "A: 0") and reward in (0.0, 1.0) and not truncated


def test_the_ablation_rows_and_the_seeds_mean():
    args = Args(eta_prompts=0.0)
    assert run_flags(args, "tail+paper") == ["schedule:tail", "--schedule.eta-prompts", "1.25",
                                             "--schedule.eta-long", "1.0"]
    assert run_flags(args, "tail") == ["schedule:tail"] and run_flags(args, "sync") == ["schedule:sync"]
    assert run_flags(Args(eta_long=3.0), "tail+stream")[-2:] == ["--schedule.eta-long", "3.0"]
    assert run_flags(args, "tail+warm") == ["schedule:tail", "--env.warm"]
    assert run_flags(args, "sync+warm") == ["schedule:sync", "--env.warm"]
    summary = mean_summary([{"rollout_speedup_tail": 2.0, "tokens_changed": 0, "prompts_lost": 1,
                             "prompts_trained_twice": 0},
                            {"rollout_speedup_tail": 3.0, "tokens_changed": 0, "prompts_lost": 0,
                             "prompts_trained_twice": 0}])
    assert summary == {"rollout_speedup_tail": 2.5, "tokens_changed": 0, "prompts_lost": 1,
                       "prompts_trained_twice": 0, "seeds": 2}


def test_tokens_changed_pairs_what_differs_within_a_row_and_counts_only_trained_prompts(tmp_path):
    """An episode whose new text sorted ahead of its unchanged sibling made the sibling count as changed too;
    a filtered group's samples (written, not trained) counted as trained; steps after the first that trained no
    prompt divided by zero and lost the bench's table."""
    off = [(0, 1, "a", 3), (0, 1, "c-old", 5), (0, 2, "x", 4)]
    on = [(0, 1, "a", 3), (0, 1, "b-new", 7), (0, 2, "x", 4)]
    assert changed_tokens(off, on) == 7 and changed_tokens(off, off) == 0
    assert changed_tokens(off, on[:2]) == 7 + 4  # an episode one run lacks counts whole
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "step_0.jsonl").write_text("".join(
        json.dumps({"row": row, "trained": trained}) + "\n" for row, trained in ((0, True), (0, True), (1, False),
                                                                                 (1, False))))
    records = [{"time/step": 2.0, "time/rollout": 1.0, "sched/trained_prompts": 1},
               {"time/step": 1.0, "time/rollout": 0.5, "sched/trained_prompts": 0}]
    s = summarize(Args(rows=2, group_size=2, epochs=1), records, tmp_path)
    assert (s["lost"], s["twice"], s["prompts"]) == (1, 0, 1) and np.isnan(s["rollout_s"])
