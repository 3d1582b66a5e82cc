"""The parallelism planner: its heuristic on scripted preemption counts, the default TP from a
profile by hand, the profile file's round trip and refusals, and real gloo ranks switching TP."""

from __future__ import annotations

import json

import pytest
import torch

from rollpacker.config import parse
from rollpacker.errors import UserError
from rollpacker.plan.config import PlanConfig
from rollpacker.plan.planner import Planner, best_tp, candidate_tps, decode_ms, usable_tps
from rollpacker.plan.profile import cache_path, check, load, profile_key, save


def observe_all(planner: Planner, kind: str, counts: list[int]) -> list[int]:
    """The TP after each observed step."""
    out = []
    for n in counts:
        planner.observe(kind, n)
        out.append(planner.tp_for(kind))
    return out


def test_a_jump_in_preemptions_doubles_tp_and_a_quiet_spell_halves_it():
    p = Planner(PlanConfig(), candidate_tps(8, 8, 8), initial=2)
    # 10 (level 0: a jump) -> 4; 10 vs level 10: not above 1.05x; 11 > 1.05 x 10: -> 8;
    # then four quiet steps -> 4, four more -> 2.
    assert observe_all(p, "short", [10, 10, 10]) == [4, 4, 4]
    assert observe_all(p, "short", [11]) == [8]
    assert observe_all(p, "short", [0, 0, 0, 0]) == [8, 8, 8, 4]
    # After quiet steps the level is 0: any preemption is a jump again.
    assert observe_all(p, "short", [0, 0, 0, 3]) == [4, 4, 4, 8]
    # A count that is no jump (2 <= 1.05 x mean(3, 2, 2)) still breaks a quiet spell.
    assert observe_all(p, "short", [2, 2, 0, 0, 0, 2, 0, 0, 0, 0]) == [8] * 9 + [4]
    assert p.tp_for("long") == 2  # long rounds keep their own TP


def test_the_reason_holds_the_numbers():
    p = Planner(PlanConfig(recent_steps=2), [1, 2, 4], initial=1)
    assert p.observe("short", 4) == "short rounds: rollout TP 1 -> 2: 4 preemptions > 1.05 x recent level 0.0"
    assert p.observe("short", 4) is None
    assert p.observe("short", 6) == "short rounds: rollout TP 2 -> 4: 6 preemptions > 1.05 x recent level 4.0"


def test_the_profile_guard_vetoes_a_change_it_estimates_slower():
    p = Planner(PlanConfig(), [1, 2], initial=1)
    slower = {1: 1.0, 2: 3.0}.__getitem__  # seconds of the round just seen, by TP
    assert p.observe("short", 5, slower) == ("short rounds: rollout TP stays 1 (5 preemptions > 1.05 x recent level "
                                             "0.0): the profile estimates the round at 3 s at TP 2 against 1 s")
    assert p.tp_for("short") == 1
    assert p.observe("short", 9, {1: 2.0, 2: 1.5}.__getitem__).startswith("short rounds: rollout TP 1 -> 2")
    assert Planner(PlanConfig(profile_guard=False), [1, 2], 1).observe("short", 5, slower).startswith(
        "short rounds: rollout TP 1 -> 2")


def test_tp_stays_within_a_node_and_odd_worlds_use_their_divisors():
    assert candidate_tps(16, 8, 8) == [1, 2, 4, 8]  # 2 nodes of 8: never 16
    p = Planner(PlanConfig(), candidate_tps(16, 8, 8), initial=8)
    assert observe_all(p, "short", [5, 50, 500]) == [8, 8, 8]  # capped at the node
    assert candidate_tps(3, 2, 3) == [1]  # 3 ranks, 2 KV heads: only TP 1
    assert candidate_tps(3, 3, 3) == [1, 3]
    p = Planner(PlanConfig(quiet_steps=1), candidate_tps(6, 6, 8), initial=2)  # [1, 2, 3, 6]
    assert observe_all(p, "short", [1, 0, 0, 0]) == [6, 3, 1, 1]  # doubling skips 4; halving 6 -> 3 -> 1
    with pytest.raises(UserError, match=r"initial TP 2 \(plan.initial_tp\) is not one of the TPs usable here, "
                                        r"\[1, 3\] "):
        Planner(PlanConfig(), [1, 3], initial=2)


def test_one_tp_for_every_kind_and_the_state_round_trips():
    p = Planner(PlanConfig(per_kind=False), [1, 2], initial=1)
    p.observe("short", 3)
    assert p.tp_for("long") == 2
    q = Planner(PlanConfig(per_kind=False), [1, 2], initial=1)
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q.tp_for("short") == 2 and q.kinds == p.kinds

def test_a_resume_under_other_plan_settings_goes_on_from_the_checkpoints_tps():
    """A lowered plan.max_tp refused the resume; a changed plan.per_kind dropped the checkpoint's TPs unsaid."""
    per_kind = Planner(PlanConfig(), [1, 2, 4], initial=1)
    per_kind.observe("short", 3)
    per_kind.observe("long", 3)
    per_kind.observe("long", 30)
    assert (per_kind.tp_for("short"), per_kind.tp_for("long")) == (2, 4)
    saved = json.loads(json.dumps(per_kind.state_dict()))
    lower = Planner(PlanConfig(max_tp=2), [1, 2], initial=1)
    notes = lower.load_state_dict(saved)
    assert notes == ["plan: the checkpoint's TP 4 for long rounds is not usable here (usable: [1, 2]): they resume "
                     "at TP 2", "plan: resumed at TP 2 for short rounds, 2 for long rounds"]
    assert lower.kinds["long"].history == [3, 30]
    one = Planner(PlanConfig(per_kind=False), [1, 2, 4], initial=1)
    assert one.load_state_dict(saved)[0] == ("plan: the checkpoint kept a TP per round kind (short 2, long 4); "
                                            "plan.per_kind is off: every round resumes at long's")
    assert one.tp_for("sync") == one.tp_for("short") == 4
    again = Planner(PlanConfig(), [1, 2, 4], initial=1)
    again.load_state_dict(one.state_dict())
    assert again.tp_for("short") == again.tp_for("sorted") == 4 and again.kinds["short"].history == [3, 30]


def entry(capacity: int, ms_at_1: float, ms_at_4: float) -> dict:
    return {"kv_capacity_tokens": capacity, "decode_ms": {"100": {"1": ms_at_1, "4": ms_at_4}},
            "prefill_tok_s": {"100": 1e4}}


def test_default_tp_from_a_profile_by_hand():
    e = entry(1000, 2.0, 8.0)  # 2 ms + 2 ms per extra request
    assert decode_ms(e, 2, 100) == 4.0
    assert decode_ms(e, 6, 100) == 12.0  # extended past the last point
    noisy = {"decode_ms": {"256": {"1": 1.1, "4": 18.7, "16": 39.2, "64": 8.9}}}  # a loaded CPU's, as profiled
    assert decode_ms(noisy, 128, 256) == 8.9 and decode_ms(noisy, 40, 256) == pytest.approx(24.05)  # not 0 past it


def test_a_profile_whose_decode_times_fall_with_the_batch_is_said_noisy(caplog):
    from rollpacker.plan.profile import say_noisy

    say_noisy({"tp": {"1": entry(1000, 2.0, 8.0)}})
    assert not caplog.records
    say_noisy({"tp": {"1": entry(1000, 2.0, 8.0), "2": entry(1000, 20.7, 3.2)}})
    [record] = caplog.records
    assert record.getMessage().startswith("plan: the profile's decode step times fall as the batch grows (TP 2 "
                                          "context 100: batch 1 20.7 ms, batch 4 3.2 ms): it was measured on a busy")
    profile = {"key": {"world": 4}, "tp": {"1": entry(200, 2.0, 8.0), "2": entry(1000, 3.0, 6.0)}}
    # 8 requests of 40 + 60 tokens. TP 1: 4 replicas of 2 requests, both fit (200 // 100): one wave
    # of 60 steps at 4 ms = 0.24 s. TP 2: 2 replicas of 4 requests, all fit: 60 steps at 6 ms = 0.36 s.
    tp, estimates = best_tp(profile, [1, 2], 8, 40, 60, max_num_seqs=256)
    assert tp == 1 and estimates == pytest.approx({1: 0.24, 2: 0.36})
    # 200 new tokens: TP 1's 200 KV tokens hold one request of 240 at a time (at least one runs):
    # 2 waves x 200 steps x 2 ms = 0.8 s; TP 2 holds all 4: one wave x 200 x 6 ms = 1.2 s.
    assert best_tp(profile, [1, 2], 8, 40, 200, max_num_seqs=256)[1] == pytest.approx({1: 0.8, 2: 1.2})
    # engine.max_num_seqs 1 (the KV cache held more, and the estimate ran them at once): 2 waves x 60 x 2 ms at
    # TP 1, 4 waves x 60 x 3 ms at TP 2
    assert best_tp(profile, [1, 2], 8, 40, 60, max_num_seqs=1)[1] == pytest.approx({1: 0.24, 2: 0.72})
    with pytest.raises(ValueError, match="none of the usable TPs"):
        best_tp(profile, [4], 8, 40, 60, max_num_seqs=256)


def test_profile_round_trips_and_a_mismatch_is_refused(tmp_path):
    config = parse(["--plan.profile-dir", str(tmp_path)])
    from rollpacker.toy.model import toy_model_dir

    key = profile_key(config, toy_model_dir(), "cpu test", 2, torch.float32)
    profile = {"key": key, "tp": {"1": entry(100, 1.0, 2.0)}}
    path = cache_path(config, key)
    save(profile, path)
    assert load(path, key) == profile and [p.name for p in tmp_path.iterdir()] == [path.name]
    other = profile_key(parse(["--engine.memory-mb", "3"]), toy_model_dir(), "cpu test", 4, torch.float32)
    with pytest.raises(ValueError, match=r"world: profile has 2, this run 4.*'memory_mb': 3"):
        load(path, other)
    assert cache_path(config, other) != path  # another setup, another cache entry
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load(path, key)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=f"{path}: not valid JSON"):  # not UTF-8: the file named too
        load(path, key)
    with pytest.raises(ValueError, match="not a rollpacker profile"):
        check({"tp": {}}, key, "x.json")
    broken = {"1": {k: v for k, v in entry(100, 1.0, 2.0).items() if k != "decode_ms"}}
    for tps in (broken, [entry(100, 1.0, 2.0)]):  # the planner raised a KeyError or a TypeError reading them
        with pytest.raises(ValueError, match="not a rollpacker profile"):
            check({"key": key, "tp": tps}, key, "x.json")


def test_the_profile_key_holds_what_the_measurements_depend_on_and_no_more():
    """Speculation (the verify-step costs) and sampling (the decode steps') were not in it: a profile measured
    without them was reused; a model.dtype that resolves to the same engine dtype is the same profile."""
    from rollpacker.toy.model import toy_model_dir

    def key(*flags: str, dtype=torch.float32) -> dict:
        return profile_key(parse(list(flags)), toy_model_dir(), "cpu test", 2, dtype)

    assert key() == key("--model.dtype", "float32") == key("--run-dir", "elsewhere", "--train.lr", "1e-5")
    for flags in (["--engine.speculative", "auto"], ["--rollout.temperature", "0"], ["--rollout.top-k", "20"],
                  ["--rollout.repetition-penalty", "1.3"], ["--plan.profile-batches", "1", "4", "16", "64", "256"],
                  ["--plan.profile-contexts", "64"], ["--plan.profile-steps", "3"]):
        assert key(*flags) != key(), flags
    assert key("--engine.speculative", "auto") != key("--engine.speculative", "auto", "--engine.spec-max-tokens", "4")
    assert key(dtype=torch.bfloat16) != key()
    # the batch limits cap what an engine that cannot switch TP measures; TorchEngine's probe sets its own
    assert key("--engine.max-num-seqs", "8") == key()
    assert key("--engine.kind", "vllm", "--engine.max-num-seqs", "8") != key("--engine.kind", "vllm")


def test_an_engine_memory_mb_below_a_tps_weight_shard_is_refused_by_name_in_the_plan_and_the_profile():
    """The memory plan counted a negative KV budget and said it fits; the profiler's engine raised a traceback."""
    from rollpacker.dist import build_meshes
    from rollpacker.plan.memory import GB, config_plan
    from rollpacker.plan.profile import measure
    from rollpacker.toy.model import toy_model_dir

    config = parse(["--engine.kind", "torch", "--engine.memory-mb", "1", "--plan.enabled"])  # weights: 1.5 MiB bf16
    with pytest.raises(UserError, match=r"engine.memory_mb=1 holds not even the engine's weight shard at rollout TP 1 "
                                        r"\(1 MiB\): raise it"):
        config_plan(config, 1, 80 * GB)
    with pytest.raises(UserError, match=r"the planner profiles every usable rollout TP \(\[1\]\): at TP 1, "
                                        r"engine.memory_mb=1\.0 \(this rank.s weights: 2.90 MiB\) .*: raise "
                                        r"engine.memory_mb"):
        measure(config, build_meshes(1, 0), toy_model_dir(), torch.float32, {})


def test_a_profile_whose_decode_steps_leave_no_context_is_refused_by_name():
    from rollpacker.dist import build_meshes
    from rollpacker.plan.profile import measure
    from rollpacker.toy.model import toy_model_dir

    config = parse(["--engine.max-model-len", "96", "--plan.profile-steps", "100"])
    with pytest.raises(UserError, match=r"plan.profile_steps=100 decode steps .* do not fit engine.max_model_len=96"):
        measure(config, build_meshes(1, 0), toy_model_dir(), torch.float32, {})


def test_engine_memory_mb_gives_the_kv_cache_what_the_weights_leave():
    from rollpacker.model import load_model
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.torch_engine import TorchEngine
    from rollpacker.toy.model import toy_model_dir

    model = load_model(toy_model_dir())
    weights = sum(p.nbytes for p in model.parameters())  # tied embedding counted once
    block = 16 * 2 * 4 * 2 * 32 * 4  # tokens x (K, V) x layers x KV heads x head dim x fp32
    engine = TorchEngine(model, EngineConfig(memory_mb=4.0))
    assert engine.weight_bytes == weights and engine.num_blocks == (4 * 2**20 - weights) // block
    with pytest.raises(UserError, match=r"engine.memory_mb=2.9 \(this rank's weights: 2.90 MiB\) holds no"):
        TorchEngine(load_model(toy_model_dir()), EngineConfig(memory_mb=2.9))


def test_a_tp_divides_the_node_so_no_replica_spans_two(monkeypatch):
    """Nodes of 6 ranks, 12 ranks in all: TP 4's second replica (ranks 4..7) would span both nodes."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    assert usable_tps(12, 12, PlanConfig()) == [1, 2, 3, 6]
    assert usable_tps(12, 12, PlanConfig(max_tp=4)) == [1, 2, 3]
    assert candidate_tps(12, 12, 6, node=6) == [1, 2, 3, 6] and candidate_tps(12, 12, 6) == [1, 2, 3, 4, 6]
