"""The parallelism planner: its heuristic on scripted preemption counts, the default TP from a
profile by hand, the profile file's round trip and refusals, and real gloo ranks switching TP."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import torchrun
from rollpacker.config import parse
from rollpacker.plan.config import PlanConfig
from rollpacker.plan.planner import Planner, best_tp, candidate_tps, decode_ms
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
    with pytest.raises(ValueError, match="initial TP 2"):
        Planner(PlanConfig(), [1, 3], initial=2)


def test_one_tp_for_every_kind_and_the_state_round_trips():
    p = Planner(PlanConfig(per_kind=False), [1, 2], initial=1)
    p.observe("short", 3)
    assert p.tp_for("long") == 2
    q = Planner(PlanConfig(per_kind=False), [1, 2], initial=1)
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q.tp_for("short") == 2 and q.kinds == p.kinds
    with pytest.raises(ValueError, match="TP 2 for all rounds is not usable"):
        Planner(PlanConfig(), [1], initial=1).load_state_dict(p.state_dict())


def entry(capacity: int, ms_at_1: float, ms_at_4: float) -> dict:
    return {"kv_capacity_tokens": capacity, "decode_ms": {"100": {"1": ms_at_1, "4": ms_at_4}}}


def test_default_tp_from_a_profile_by_hand():
    e = entry(1000, 2.0, 8.0)  # 2 ms + 2 ms per extra request
    assert decode_ms(e, 2, 100) == 4.0
    assert decode_ms(e, 6, 100) == 12.0  # extended past the last point
    profile = {"key": {"world": 4}, "tp": {"1": entry(200, 2.0, 8.0), "2": entry(1000, 3.0, 6.0)}}
    # 8 requests of 40 + 60 tokens. TP 1: 4 replicas of 2 requests, both fit (200 // 100): one wave
    # of 60 steps at 4 ms = 0.24 s. TP 2: 2 replicas of 4 requests, all fit: 60 steps at 6 ms = 0.36 s.
    tp, estimates = best_tp(profile, [1, 2], 8, 40, 60)
    assert tp == 1 and estimates == pytest.approx({1: 0.24, 2: 0.36})
    # 200 new tokens: TP 1's 200 KV tokens hold one request of 240 at a time (at least one runs):
    # 2 waves x 200 steps x 2 ms = 0.8 s; TP 2 holds all 4: one wave x 200 x 6 ms = 1.2 s.
    assert best_tp(profile, [1, 2], 8, 40, 200)[1] == pytest.approx({1: 0.8, 2: 1.2})
    with pytest.raises(ValueError, match="none of the usable TPs"):
        best_tp(profile, [4], 8, 40, 60)


def test_profile_round_trips_and_a_mismatch_is_refused(tmp_path):
    config = parse(["--plan.profile-dir", str(tmp_path)])
    from rollpacker.data.toy_model import toy_model_dir

    key = profile_key(config, toy_model_dir(), "cpu test", 2)
    profile = {"key": key, "tp": {"1": entry(100, 1.0, 2.0)}}
    path = cache_path(config, key)
    save(profile, path)
    assert load(path, key) == profile
    other = profile_key(parse(["--engine.memory-mb", "3"]), toy_model_dir(), "cpu test", 4)
    with pytest.raises(ValueError, match=r"world: profile has 2, this run 4.*'memory_mb': 3"):
        load(path, other)
    assert cache_path(config, other) != path  # another setup, another cache entry
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load(path, key)
    with pytest.raises(ValueError, match="not a rollpacker profile"):
        check({"tp": {}}, key, "x.json")


RUN = ["--data.num-toy-prompts", "32", "--rollout.num-prompts", "4", "--rollout.group-size", "4",
       "--rollout.max-new-tokens", "64", "--eval-every", "0", "--metrics.wandb-mode", "disabled", "--metrics.no-live",
       "--plan.profile-batches", "1", "4", "--plan.profile-contexts", "32", "--plan.profile-steps", "2"]


def launch(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_the_profiler_cli_writes_a_profile_the_planner_reads(tmp_path):
    path = tmp_path / "profile.json"
    flags = ["--plan.profile", str(path), "--plan.profile-batches", "1", "2", "--plan.profile-contexts", "16", "40",
             "--plan.profile-steps", "2"]
    proc = subprocess.run([sys.executable, "-m", "rollpacker.plan.profile", *flags], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote {path}" in proc.stdout and "TP 1: KV capacity" in proc.stdout
    profile = json.loads(path.read_text())
    assert profile["key"]["world"] == 1 and list(profile["tp"]) == ["1"]
    entry = profile["tp"]["1"]
    assert set(entry["decode_ms"]) == {"16", "40"} and set(entry["decode_ms"]["16"]) == {"1", "2"}
    assert entry["kv_capacity_tokens"] > 0 and entry["kv_bytes_per_token"] == 2 * 4 * 2 * 32 * 4  # toy model, fp32
    assert best_tp(profile, [1], 16, 20, 50)[0] == 1


def test_switching_tp_between_steps_rolls_out_like_a_fixed_tp(tmp_path):
    out = torchrun("tp_switch.py", 2, str(tmp_path), timeout=600)
    assert out.count("OK") == 2, out


def test_a_run_with_the_planner_switches_tp_in_process(tmp_path):
    # A KV budget that TP 1 overflows (3.35 MiB less 2.90 MiB of weights per rank: 14 blocks): the first
    # preemptions double TP; one quiet step (quiet_steps 1) halves it again. Without the profile
    # guard, which would keep TP 1 here: on CPU gloo, TP 2 is the slower one.
    proc = launch("-m", "rollpacker.run", "--run-dir", str(tmp_path / "run"), "--num-steps", "5", *RUN,
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
    proc = launch("-m", "rollpacker.run", "--run-dir", str(tmp_path / "run2"), "--num-steps", "1", *RUN,
                  "--plan.enabled", "--plan.profile", str(wrong))
    assert proc.returncode != 0
    assert "world: profile has 8, this run 2" in proc.stderr


def test_planner_bench_smoke(capsys):
    from rollpacker.bench.__main__ import main

    main(["planner", "--steps", "2", "--memory-mb", "3.35", "--", *RUN[:8], "--plan.profile-batches", "1", "4",
          "--plan.profile-contexts", "32", "--plan.profile-steps", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["tp_switches"] >= 0 and summary["tp_switches_paper"] >= 0
    assert summary["speedup_planner"] > 0 and summary["speedup_paper"] > 0 and summary["speedup_tp2"] > 0
    assert {"preemptions_short_tp1", "rollout_short_tp2", "step_time_planner"} <= set(summary)
    assert any(line.startswith("TP of short rounds") for line in lines)


def test_engine_memory_mb_gives_the_kv_cache_what_the_weights_leave():
    from rollpacker.data.toy_model import toy_model_dir
    from rollpacker.model import load_model
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.torch_engine import TorchEngine

    model = load_model(toy_model_dir())
    weights = sum(p.nbytes for p in model.parameters())  # tied embedding counted once
    block = 16 * 2 * 4 * 2 * 32 * 4  # tokens x (K, V) x layers x KV heads x head dim x fp32
    engine = TorchEngine(model, EngineConfig(memory_mb=4.0))
    assert engine.weight_bytes == weights and engine.num_blocks == (4 * 2**20 - weights) // block
    with pytest.raises(ValueError, match=r"engine.memory_mb=2.9 \(this rank's weights: 2.90 MiB\) holds no"):
        TorchEngine(load_model(toy_model_dir()), EngineConfig(memory_mb=2.9))
