"""Speculative decoding in the simulator (rollpacker.sim.speculation): verify-step costs, the draft
length each iteration takes, acceptance traces, and whole simulated jobs with speculation off and on."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.spec_cost import expected_tokens
from rollpacker.schedule.sync import SyncConfig
from rollpacker.sim.cost import HARDWARE, MODELS, Calibration, CostModel, ProfiledCost
from rollpacker.sim.simulate import SimConfig, simulate
from rollpacker.sim.speculation import Drafts, SpecSimConfig, SpeculativeCost, read_drafts, tail_s

NO_OVERHEADS = Calibration(step_overhead_s=0.0, seq_overhead_s=0.0, allreduce_latency_s=0.0)
SEVEN_B = CostModel(HARDWARE["H800"], MODELS["qwen2.5-7b"], 1, NO_OVERHEADS)


def test_a_verify_iteration_reads_the_weights_once_and_multiplies_the_flops():
    m, hw = MODELS["qwen2.5-7b"], HARDWARE["H800"]
    # one request: bound by reading the weights, so 9 queries cost what 1 does
    assert SEVEN_B.iteration_times(1, 500, 1, queries=9)[0] == SEVEN_B.iteration_times(1, 500, 1)[0]
    # 1024 requests: compute-bound, 9 queries cost 9 times the FLOPs
    flops = 9 * (2 * m.matmul_params * 1024 + m.attention_flops(1024 * 500)) / (hw.flops * 0.5)
    assert SEVEN_B.iteration_times(1024, 1024 * 500, 1, queries=9)[0] == pytest.approx(flops)


def test_each_token_costs_the_best_verify_step_over_its_expected_tokens():
    a = 0.6
    spec = SpeculativeCost(SEVEN_B, Drafts(a), max_tokens=8, draft_s=0.0)
    plain = SEVEN_B.iteration_times(1, 500, 3)
    # memory-bound: the longest draft is free, so each token costs a plain step over 1 + a + ... + a^8
    assert spec.draft_len(1, 500) == 8
    assert spec.iteration_times(1, 500, 3) == pytest.approx(plain / expected_tokens(a, 8))
    # compute-bound: no draft pays
    assert spec.draft_len(1024, 1024 * 500) == 0
    assert np.array_equal(spec.iteration_times(1024, 1024 * 500, 2), SEVEN_B.iteration_times(1024, 1024 * 500, 2))
    # a draft for half the requests: the other half emit one token a verify step
    half = SpeculativeCost(SEVEN_B, Drafts(a, drafted=0.5), max_tokens=8, draft_s=0.0)
    assert half.iteration_times(1, 500, 3) == pytest.approx(plain / (1 + 0.5 * (expected_tokens(a, 8) - 1)))
    assert SpeculativeCost(SEVEN_B, Drafts(a, drafted=0.0), 8, 0.0).draft_len(1, 500) == 0  # none drafted: none pays
    # drafts of 3 tokens: a longer step verifies no more of them, so it pays no more
    short = SpeculativeCost(SEVEN_B, Drafts(a, length=3), max_tokens=8, draft_s=0.0)
    assert short.iteration_times(1, 500, 3) == pytest.approx(plain / expected_tokens(a, 3))
    assert Drafts(a, length=2.5).tokens(8) == pytest.approx((1 - a**3.5) / (1 - a))  # the mean: between 2 and 3
    assert expected_tokens(a, 2) < Drafts(a, length=2.5).tokens(8) < expected_tokens(a, 3)
    # nothing is ever accepted: plain steps; drafting time makes drafts cost more still
    assert SpeculativeCost(SEVEN_B, Drafts(0.0), 8, 0.0).draft_len(1, 500) == 0
    assert SpeculativeCost(SEVEN_B, Drafts(a), 8, draft_s=1.0).draft_len(1, 500) == 0
    # the prefill is charged as the base model charges it, not sped up
    with_prefill = spec.iteration_times(1, 500, 2, prefill_tokens=400, prefill_sq=400 * 400)
    prefill = SEVEN_B.iteration_times(1, 500, 1, 400, 400 * 400)[0] - plain[0]
    assert with_prefill[0] - spec.iteration_times(1, 500, 1)[0] == pytest.approx(prefill)


def test_a_profiled_verify_step_costs_the_engines_measured_ratio():
    profile = {"tp": {"1": {"kv_capacity_tokens": 10_000, "decode_ms": {"64": {"1": 10.0, "4": 20.0}},
                            "prefill_tok_s": {"64": 1000.0},
                            "spec": {"rows": [1, 4], "draft_lens": [0, 2], "ms": [[1.0, 1.5], [2.0, 6.0]],
                                     "draft_ms": 0.1}}}}
    cost = ProfiledCost.from_profile(profile)
    assert cost.iteration_times(1, 64, 1, queries=3)[0] == pytest.approx(0.015)  # 10 ms x 1.5 / 1.0
    assert cost.iteration_times(4, 256, 1, queries=3)[0] == pytest.approx(0.060)  # 20 ms x 6.0 / 2.0
    assert cost.spec.draft_ms == 0.1
    del profile["tp"]["1"]["spec"]
    with pytest.raises(ValueError, match="the profile has no verify-step costs"):
        ProfiledCost.from_profile(profile).iteration_times(1, 64, 1, queries=3)


def test_drafts_are_read_from_a_runs_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0, "rollout/spec_accept_rate": 0.5, "rollout/spec_drafted_frac": 0.25,
                                "rollout/spec_draft_len": 3.5})
                    + "\n\n" + json.dumps({"eval/accuracy": 0.3}) + "\n"
                    + json.dumps({"step": 1, "rollout/spec_accept_rate": 1.0}) + "\n")
    # a rate of 1 would make a draft's tokens endless; what a line lacks (a run from before it was measured)
    # is the flags'
    assert read_drafts(path, Drafts(0.0)) == [Drafts(0.5, 0.25, 3.5), Drafts(0.99)]
    assert SpecSimConfig(trace=str(path), drafted=0.5, draft_len=4).drafts() == [Drafts(0.5, 0.25, 3.5),
                                                                                  Drafts(0.99, 0.5, 4.0)]
    assert SpecSimConfig().drafts() == [Drafts(0.6, 0.93, 3.3)] and SpecSimConfig(draft_len=0).drafts()[0].length > 8
    path.write_text("{oops\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: invalid JSON"):
        read_drafts(path, Drafts(0.0))
    path.write_text(json.dumps({"step": 0}) + "\n")
    with pytest.raises(ValueError, match="no line has rollout/spec_accept_rate"):
        read_drafts(path, Drafts(0.0))
    with pytest.raises(ValueError, match=r"speculation.accept_rate must be in \[0, 1\), got 1.0"):
        SpecSimConfig(accept_rate=1.0)
    with pytest.raises(ValueError, match=r"speculation.drafted must be in \[0, 1\], got 1.5"):
        SpecSimConfig(drafted=1.5)


def test_the_tail_phase_is_where_no_replica_runs_more_than_eight():
    busy = [[(0.0, 4.0, 20), (4.0, 6.0, 8)], [(0.0, 5.0, 9), (5.0, 7.0, 2)]]
    assert tail_s(busy, 7.0) == 2.0  # from the last run of more than 8 (replica 1's, ending at 5)
    assert tail_s([[(0.0, 3.0, 4)]], 3.0) == 3.0


def test_speculation_shortens_rollout_and_changes_no_length():
    cfg = SimConfig(model="qwen2.5-7b", gpus=4, num_steps=5,
                    rollout=RolloutConfig(num_prompts=16, group_size=4, max_new_tokens=4096, tp=1))
    off = simulate(cfg)
    on = simulate(replace(cfg, speculation=SpecSimConfig(enabled=True, accept_rate=0.6)))
    none_accepted = simulate(replace(cfg, speculation=SpecSimConfig(enabled=True, accept_rate=0.0)))
    assert [r.rollout_s for r in none_accepted] == [r.rollout_s for r in off]
    assert all(b.rollout_s < 0.75 * a.rollout_s for a, b in zip(off, on))
    for fewer in (dict(drafted=0.5), dict(draft_len=2)):  # drafts for half the requests; drafts of 2 tokens
        less = simulate(replace(cfg, speculation=SpecSimConfig(enabled=True, accept_rate=0.6, **fewer)))
        assert all(b.rollout_s < c.rollout_s < a.rollout_s for a, b, c in zip(off, on, less))
    assert [(r.kind, r.trained_tokens, r.max_length) for r in on] == [(r.kind, r.trained_tokens, r.max_length)
                                                                        for r in off]
    sync = replace(cfg, schedule=SyncConfig())
    assert simulate(sync)[0].rollout_s > simulate(replace(sync, speculation=SpecSimConfig(enabled=True)))[0].rollout_s


def test_the_spec_command_prints_both_and_ends_with_the_speedups(capsys, tmp_path):
    from rollpacker.sim.__main__ import main, spec

    figures = spec(["--preset", "qwen2.5-7b-8k", "--num-steps", "5", "--speculation.accept-rate", "0.5",
                    "schedule:tail"])
    out = capsys.readouterr().out
    assert "accept rate 0.5" in out and "\noff " in out and "\non " in out
    assert figures["accept_rate"] == 0.5 and figures["sim_rollout_speedup_spec"] > 1
    assert figures["sim_tail_speedup_spec"] > 1 and figures["sim_long_round_speedup_spec"] > 1
    with pytest.raises(SystemExit, match="error: acceptance trace: no such file: .*nope"):  # one line, no traceback
        main(["spec", "--speculation.trace", str(tmp_path / "nope")])
