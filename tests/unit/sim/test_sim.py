"""The cluster simulator: hand-computed timings, the same policy decisions as the real controller,
the cost model's arithmetic, workloads, and the CLI."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from support.fakes import InstantRewards, LengthTableEngine, OneReplica

from rollpacker.data.dataset import PromptSampler
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import SamplingParams
from rollpacker.schedule.config import POLICY_CONFIGS
from rollpacker.schedule.one_step_off import OneStepOffConfig
from rollpacker.schedule.sync import SyncConfig, SyncPolicy
from rollpacker.schedule.tail import TailConfig, TailPolicy
from rollpacker.sim.cost import HARDWARE, MODELS, Calibration, CostModel, ModelShape, fit_calibration
from rollpacker.sim.engine import Replica, Seq
from rollpacker.sim.simulate import SimConfig, simulate, simulate_round, summarize
from rollpacker.sim.workload import LengthModel, length_stats, read_length_trace


def rollout(num_prompts: int, group_size: int, max_new_tokens: int) -> RolloutConfig:
    return RolloutConfig(num_prompts=num_prompts, group_size=group_size, max_new_tokens=max_new_tokens)


class StepCost:
    """``step_s`` per iteration plus ``prefill_s`` per prefilled token: timings by hand."""

    def __init__(self, step_s: float, prefill_s: float = 0.0):
        self.step_s, self.prefill_s = step_s, prefill_s

    def iteration_times(self, num_running, context, num_iters, prefill_tokens=0, prefill_sq=0):
        times = np.full(num_iters, self.step_s)
        times[0] += self.prefill_s * prefill_tokens
        return times


class Table:
    """Lengths from a function of (row, response); one-token prompts."""

    prompt_tokens = 1

    def __init__(self, length):
        self.length = length

    def lengths(self, row, step, slot, num):
        return np.array([self.length(row, k) for k in range(num)])


def replicas(num, cost, kv_capacity=10**9, **kw):
    return [Replica(i, cost, kv_capacity, watermark=0.0, **kw) for i in range(num)]


# ---- hand-computed timings -----------------------------------------------------------------------


def test_one_replica_rollout_time_is_the_longest_response_in_steps():
    policy = SyncPolicy(PromptSampler(10, seed=0), num_prompts=2, group_size=1)
    rows = policy.sampler._order[:2]
    length = {rows[0]: 3, rows[1]: 5}
    rnd = simulate_round(0, policy, replicas(1, StepCost(0.5)), Table(lambda row, k: length[row]), max_new_tokens=100)
    assert rnd.rollout_s == pytest.approx(5 * 0.5)
    assert [t for t, _ in rnd.completions] == pytest.approx([1.5, 2.5])
    assert sorted(len(g.outputs) for g in rnd.groups) == [1, 1]
    assert rnd.generated_tokens == 8 and rnd.num_preemptions == 0


def test_max_new_tokens_cuts_lengths_and_round_robin_spreads_requests():
    policy = SyncPolicy(PromptSampler(10, seed=0), num_prompts=1, group_size=4)
    reps = replicas(2, StepCost(1.0), record=True)
    rnd = simulate_round(0, policy, reps, Table(lambda row, k: 10 * (k + 1)), max_new_tokens=25)
    assert rnd.rollout_s == 25.0  # responses of 10, 20, 25 (cut), 25 (cut) tokens
    assert rnd.completions == [(10.0, "0:0:0"), (20.0, "0:0:1"), (25.0, "0:0:2"), (25.0, "0:0:3")]
    assert [r.busy[0] for r in reps] == [(0.0, 10.0, 2), (0.0, 20.0, 2)]  # responses 0, 2 and 1, 3


def test_preemption_recomputes_the_latest_request_when_the_cache_is_full():
    # Two one-token prompts of 4 new tokens each, 8 tokens of KV. Iteration 1 prefills both (2 tokens)
    # and iterations 1-3 fill the cache (2 x 4 tokens). Before iteration 4 the later request is preempted
    # with its 3 tokens; the first finishes in iteration 4; iteration 5 prefills the other's 1 + 3
    # tokens, which yields its 4th and last token: 5 iterations and 2 + 4 prefilled tokens.
    policy = SyncPolicy(PromptSampler(10, seed=0), num_prompts=1, group_size=2)
    reps = replicas(1, StepCost(1.0, prefill_s=0.25), kv_capacity=8)
    rnd = simulate_round(0, policy, reps, Table(lambda row, k: 4), max_new_tokens=100)
    assert rnd.num_preemptions == 1
    assert rnd.rollout_s == pytest.approx(5 * 1.0 + 0.25 * (2 + 4))
    assert rnd.completions == [(4.5, "0:0:0"), (6.5, "0:0:1")]
    assert [o.length for o in rnd.groups[0].outputs] == [4, 4]


def test_a_request_larger_than_the_cache_is_refused_by_name():
    policy = SyncPolicy(PromptSampler(10, seed=0), num_prompts=1, group_size=1)
    with pytest.raises(ValueError, match="0:0:0 needs 11 tokens of KV but the cache holds 8"):
        simulate_round(0, policy, replicas(1, StepCost(1.0), kv_capacity=8), Table(lambda row, k: 10),
                       max_new_tokens=100)


def test_an_abort_in_the_middle_of_a_run_of_iterations_takes_effect_at_the_next_boundary():
    rep = Replica(0, StepCost(1.0), 10**6)
    rep.command(0.0, [], [Seq("a", 0, 0, 1, 100), Seq("b", 0, 1, 1, 10)])
    assert rep.replan() == 10.0  # b finishes after 10 iterations
    assert [s.id for s in rep.command(3.5, ["a"], [])] == ["a"]  # cut at the boundary 4.0
    assert rep.clock == 4.0 and rep.generated(rep.running["b"]) == 4
    assert rep.replan() == 10.0


def run_out(rep: Replica) -> list[str]:
    """Run ``rep`` until it idles: the ids it finished, in order."""
    done = []
    while rep.replan() is not None:
        done += [s.id for s in rep.advance()[0]]
    return done


def test_a_replica_admits_and_preempts_by_priority_as_torch_engine_does():
    """Lowest priority first, FIFO among equals; the KV full, the newest of the worst priority is preempted
    (here the older request: a frontier turn that came later keeps running)."""
    rep = Replica(0, StepCost(1.0), 10**6, max_num_seqs=1)
    rep.command(0.0, [], [Seq("a", 0, 0, 1, 2, priority=1), Seq("b", 1, 0, 1, 2), Seq("c", 2, 0, 1, 2, priority=1)])
    assert run_out(rep) == ["b", "a", "c"]
    rep = Replica(0, StepCost(1.0), 14, watermark=0.0)
    a, b = Seq("a", 0, 0, 1, 10, priority=1), Seq("b", 1, 0, 1, 10)
    rep.command(0.0, [], [a])
    rep.replan()
    rep.command(2.5, [], [b])  # at the boundary 3.0: a has 3 tokens
    assert run_out(rep) == ["b", "a"] and (a.num_preemptions, b.num_preemptions) == (1, 0)


def test_a_resident_session_holds_kv_and_is_evicted_least_recently_kept_first_before_any_preemption():
    """As TorchEngine: a finished session turn's KV stays counted until its next turn takes it over; a request
    that needs room evicts the least recently kept session, whose next turn then prefills everything."""
    rep = Replica(0, StepCost(1.0, prefill_s=0.1), 20, watermark=0.0)
    rep.command(0.0, [], [Seq("x0", 0, 0, 4, 2, session="x"), Seq("y0", 1, 0, 4, 2, session="y")])
    assert run_out(rep) == ["x0", "y0"] and rep.held == 12  # 4 prompt + 2 generated tokens each, x kept first
    rep.command(rep.clock, [], [Seq("z", 2, 0, 8, 2)])  # 8 + 1 do not fit beside 12 held: x goes
    assert run_out(rep) == ["z"] and list(rep.sessions) == ["y"] and rep.num_session_evictions == 1
    start = rep.clock
    rep.command(start, [], [Seq("x1", 0, 0, 9, 1, session="x"), Seq("y1", 1, 0, 9, 1, session="y")])
    assert run_out(rep) == ["x1", "y1"] and rep.held == 2 * 10
    assert rep.clock - start == pytest.approx(1.0 + 0.1 * (9 + 3))  # x1 prefills all 9, y1 the 3 after its 6
    rep.end_session("x")
    assert rep.held == 10  # y's is kept; a running request grows into it rather than being preempted
    w = Seq("w", 2, 0, 6, 8)
    rep.command(rep.clock, [], [w])
    assert run_out(rep) == ["w"] and w.num_preemptions == 0 and rep.sessions == {} and rep.held == 0


# ---- the same decisions as the real controller ---------------------------------------------------------


class Recorder:
    """Wraps one real policy object and logs what it is told and what it decides."""

    def __init__(self, policy):
        self.policy, self.log = policy, []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def start_round(self, step):
        rnd = self.policy.start_round(step)
        self.log.append(("start", step, rnd.kind, list(rnd.prompts), rnd.num_responses))
        return rnd

    def on_finished(self, slot, response, output, reward):
        d = self.policy.on_finished(slot, response, output, reward)
        heard = reward if self.policy.needs_rewards else "unused"  # the controller may pass one it has anyway
        self.log.append(("finished", slot, response, heard, list(d.abort), list(d.launch), d.round_done))
        return d

    def end_round(self, aborted):
        groups = self.policy.end_round(aborted)
        self.log.append(("end", sorted(o.id for o in aborted),
                         [(g.prompt, g.epoch, [o.id for o in g.outputs], g.rewards if self.needs_rewards else None)
                          for g in groups],
                         list(self.policy.ledger.queue), self.policy.stats()))
        return groups


@pytest.mark.parametrize("filter_zero_variance", [False, True])
def test_tail_policy_decides_the_same_in_the_simulator_and_in_the_real_controller(filter_zero_variance):
    from rollpacker.exchange import RoundLeader, run_round

    def length(row, k):  # every 5th row is a long prompt, response after response
        return 2 + (7 * row + 5 * k) % 13 + (40 if row % 5 == 0 else 0)

    def reward(row, rid):
        return float((row + int(rid.split(":")[2])) % 3 == 0)

    def policy():
        return Recorder(TailPolicy(PromptSampler(40, seed=3), 4, 2, filter_zero_variance=filter_zero_variance))

    simulated, real = policy(), policy()
    for step in range(7):
        simulate_round(step, simulated, replicas(1, StepCost(1.0)), Table(length), max_new_tokens=1000,
                       reward=lambda row, seq: reward(row, seq.id))
        run_round(OneReplica(), LengthTableEngine(length), 1, RoundLeader(
            policy=real, rows=list(range(40)), encode=lambda row: [row], rewards=InstantRewards(reward),
            sampling=SamplingParams(max_new_tokens=1000)).round(step, real.start_round(step)))
    kinds = [entry[2] for entry in real.log if entry[0] == "start"]
    assert "long" in kinds and "short" in kinds
    assert any(entry[4] for entry in real.log if entry[0] == "finished")  # some decisions aborted siblings
    if filter_zero_variance:
        assert any(entry[5] for entry in real.log if entry[0] == "finished")  # and some launched prompts
    assert simulated.log == real.log


# ---- the cost model ----------------------------------------------------------------------------------


def test_model_shapes_give_the_published_sizes_and_kv_bytes():
    assert MODELS["qwen2.5-7b"].num_params == pytest.approx(7.62e9, rel=0.01)
    assert MODELS["qwen2.5-14b"].num_params == pytest.approx(14.7e9, rel=0.01)
    assert MODELS["qwen2.5-32b"].num_params == pytest.approx(32.8e9, rel=0.01)
    assert MODELS["qwen2.5-14b"].kv_bytes_per_token == 2 * 48 * 8 * 128 * 2


def test_decode_iteration_is_the_roofline_plus_overheads():
    calib = Calibration(hbm_efficiency=0.5, step_overhead_s=1e-3, seq_overhead_s=1e-5, allreduce_latency_s=0.0)
    cost = CostModel(HARDWARE["H800"], MODELS["qwen2.5-7b"], 1, calib)
    m = MODELS["qwen2.5-7b"]
    memory = (m.weight_bytes + 1000 * m.kv_bytes_per_token) / (3.35e12 * 0.5)
    assert cost.iteration_times(4, 1000, 1)[0] == pytest.approx(memory + 1e-3 + 4e-5)
    two = CostModel(HARDWARE["H800"], m, 2, calib).iteration_times(4, 1000, 3)
    assert two[0] < cost.iteration_times(4, 1000, 1)[0] and np.all(np.diff(two) > 0)  # context grows


def test_kv_capacity_shrinks_with_the_weights_and_grows_with_tp():
    h800 = HARDWARE["H800"]
    one, two = (CostModel(h800, MODELS["qwen2.5-32b"], tp).kv_capacity_tokens() for tp in (1, 2))
    assert one == 0 and two > 100_000
    with pytest.raises(ValueError, match="no KV cache left"):
        Replica(0, CostModel(h800, MODELS["qwen2.5-32b"], 1), one)


def test_calibration_is_fitted_from_a_measured_decode_curve():
    shape = ModelShape.from_hf_config(Path(__file__).parents[3] / "rollpacker/toy/weights/config.json")
    peak, context = 50e9, 20.0
    per_token = 2 * shape.matmul_params + shape.attention_flops(context)
    slope_ms = per_token / (peak * 0.2) * 1e3  # 20% of peak per request
    profile = {"decode_ms_per_iter": {str(n): 1.5 + slope_ms * n for n in (1, 8, 64)},
               "context_len": [context - 2, context + 2], "summary": {"peak_gflops": peak / 1e9}}
    calib, machine = fit_calibration(profile, shape)
    assert calib.step_overhead_s == pytest.approx(1.5e-3)
    assert calib.decode_flops_efficiency == pytest.approx(0.2)
    cost = CostModel(machine, shape, 1, calib)
    assert 1e3 * cost.iteration_times(64, 64 * 20, 1)[0] == pytest.approx(1.5 + slope_ms * 64, rel=0.01)
    # The planner's profile holds the same curve per TP and context: its TP=1 curve gives the same fit.
    planner_profile = {"peak_gflops": peak / 1e9, "tp": {"1": {"decode_ms": {
        "20": profile["decode_ms_per_iter"], "200": {"1": 99.0, "8": 999.0}}}}}
    assert fit_calibration(planner_profile, shape)[0] == calib
    with pytest.raises(ValueError, match="no CPU peak FLOP/s or no TP=1 curve"):  # a GPU's profile has no peak
        fit_calibration(planner_profile | {"peak_gflops": None}, shape)


# ---- workloads ----------------------------------------------------------------------------------------


def test_prompts_keep_their_length_scale_but_draw_fresh_lengths_each_launch():
    model = LengthModel()
    a, b = model.lengths(7, 0, 3, 8), model.lengths(7, 5, 1, 8)
    assert not np.array_equal(a, b)
    assert np.array_equal(a, model.lengths(7, 0, 3, 8))
    long_rows = [r for r in range(2000) if model.log_scale(r) > np.log(4000)]
    assert long_rows and all(np.median(model.lengths(r, s, 0, 8)) > 1000 for r in long_rows[:5] for s in range(3))


def test_default_mixture_reproduces_the_papers_length_statistics():
    stats = length_stats(LengthModel(), num_steps=100)
    assert 755 * 0.9 <= stats["p75"] <= 1100 * 1.1
    assert 25 * 0.9 <= stats["max_over_median"] <= 32 * 1.1
    assert 8.9 * 0.85 <= stats["short_max_reduction"] <= 8.9 * 1.15
    assert stats["cap_hit_rate"] >= 0.9
    doubled = LengthModel().for_cap(32768)
    assert doubled.median_tokens == 2 * LengthModel().median_tokens
    tiny = LengthModel().for_cap(16)  # its medians scaled under a token were refused, naming settings never set
    assert tiny.median_tokens == 1 and tiny.long_median_tokens > 1 and tiny.lengths(0, 0, 0, 8).max() >= 1


def test_length_trace_reads_a_runs_metrics_jsonl(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"eval/accuracy": 0.5}) + "\n"
                    + json.dumps({"step": 0, "rollout/response_lengths": [1, 2, 3, 4]}) + "\n\n"
                    + json.dumps({"lengths": [5, 6, 7], "group_size": 3}) + "\n")
    assert read_length_trace(path, group_size=2) == [[1, 2], [3, 4], [5, 6, 7]]
    path.write_text(json.dumps({"response_lengths": [1, 2, 3]}) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: 3 lengths are not whole groups of 2"):
        read_length_trace(path, group_size=2)
    for size in (0, None, -2):  # a ZeroDivisionError, a TypeError, "no line holds response lengths"
        path.write_text(json.dumps({"lengths": [1, 2], "group_size": size}) + "\n")
        with pytest.raises(ValueError, match=rf"metrics.jsonl:1: group_size must be a positive int, got {size}"):
            read_length_trace(path, group_size=2)


def test_a_trace_replays_through_the_simulator(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"lengths": [50, 60, 70, 80]}) + "\n" for _ in range(3)))
    cfg = SimConfig(model="qwen2.5-7b", gpus=2, rollout=rollout(4, 4, 64),
                    num_steps=2, schedule=SyncConfig(), trace=str(path))
    results = simulate(cfg)
    assert [r.max_length for r in results] == [64, 64]
    assert summarize(results)["all"]["steps"] == 2


# ---- the whole job and the CLI -----------------------------------------------------------------------------


def test_tail_batching_alternates_short_and_long_rounds_and_shortens_steps():
    cfg = SimConfig(model="qwen2.5-7b", gpus=4, rollout=rollout(16, 4, 4096), num_steps=5)
    tail = simulate(cfg)
    sync = simulate(replace(cfg, schedule=SyncConfig()))
    assert [r.kind for r in tail] == ["short"] * 4 + ["long"]
    assert np.mean([r.rollout_s for r in tail]) < np.mean([r.rollout_s for r in sync])
    assert all(r.step_s == pytest.approx(r.rollout_s + r.reward_s + r.train_s + r.sync_s) for r in tail)


def test_the_planner_picks_each_rounds_tp_from_the_simulated_preemptions():
    from rollpacker.plan.config import PlanConfig
    from rollpacker.plan.planner import Planner

    cfg = SimConfig(model="qwen2.5-14b", gpus=8, rollout=rollout(256, 8, 16384),
                    num_steps=10, planner=True, plan=PlanConfig(quiet_steps=2))
    results = simulate(cfg)
    replay = Planner(cfg.plan, [1, 2, 4, 8], 1)  # the same heuristic, fed the simulated counts independently
    for r in results:
        assert r.tp == replay.tp_for(r.kind), [(x.kind, x.tp, x.num_preemptions) for x in results]
        replay.observe(r.kind, r.num_preemptions)
    assert {1, 2} <= {r.tp for r in results}
    fixed = simulate(replace(cfg, planner=False, num_steps=1))[0]
    for before, r in zip(results, results[1:]):  # a switch costs one more weight push, at the new TP
        push = replace(cfg.cost(), tp=r.tp).sync_s()
        assert r.sync_s == pytest.approx(push * (1 + (r.tp != before.tp)))
    assert results[0].sync_s == fixed.sync_s
    # the job's flags: plan.enabled turns the planner on, plan.initial_tp is the first step's TP
    enabled = simulate(replace(cfg, planner=False, plan=PlanConfig(quiet_steps=2, enabled=True)))
    assert [r.tp for r in enabled] == [r.tp for r in results]
    initial = simulate(replace(cfg, num_steps=1, plan=PlanConfig(quiet_steps=2, initial_tp=4)))
    assert initial[0].tp == 4 and initial[0].sync_s == replace(cfg.cost(), tp=4).sync_s()
    with pytest.raises(ValueError, match=r"rollout.tp=1: the planner can run \[2, 4, 8\] here .* a request of 16640"):
        simulate(replace(cfg, model="qwen2.5-32b", num_steps=1))  # TP 1's KV cache holds no request


def test_the_simulator_command_says_the_tp_each_round_ran_at_under_the_planner(capsys):
    """Its header and JSON said the first TP alone while the planner switched."""
    from rollpacker.sim.__main__ import run

    figures = run(["--model", "qwen2.5-14b", "--gpus", "8", "--num-steps", "6", "--planner", "--plan.quiet-steps", "2",
                   "--rollout.tp", "1", "--rollout.num-prompts", "256", "--rollout.group-size", "8",
                   "--rollout.max-new-tokens", "16384"])
    said = capsys.readouterr().out
    assert figures["tp"] == 1 and figures["tps"] == {"short": [1, 2], "long": [1]}, figures
    assert "no profile guard in a simulation), rollout TP by step: short 1 1 1 1 2; long 1" in said
    figures = run(["--model", "qwen2.5-14b", "--gpus", "8", "--num-steps", "1", "--planner", "--plan.initial-tp", "8",
                   "--rollout.tp", "2", "--rollout.num-prompts", "16"])  # it starts at plan.initial_tp, not rollout.tp
    assert figures["tp"] == 8 and "8 H800 GPUs: 1 rollout replicas of TP 8" in capsys.readouterr().out


def test_the_simulator_routes_as_the_job_and_refuses_what_it_does_not_model():
    base = SimConfig(model="qwen2.5-7b", gpus=8, rollout=rollout(16, 8, 8192), num_steps=2, schedule=SyncConfig())
    by_group = simulate(replace(base, rollout=replace(base.rollout, routing="group")))
    assert [r.rollout_s for r in by_group] != [r.rollout_s for r in simulate(base)]  # not round-robin per request
    # longest first: by the lengths the run kept of the rows' cut responses (a short round's are none), as the job's
    tail = replace(base, gpus=20, rollout=RolloutConfig(num_prompts=32, group_size=6, max_new_tokens=8192, tp=2),
                   num_steps=5, schedule=TailConfig())
    plain, longest = (simulate(replace(tail, rollout=replace(tail.rollout, longest_first=on))) for on in (False, True))
    assert [r.kind for r in plain] == ["short"] * 4 + ["long"]
    assert [r.rollout_s for r in plain[:4]] == [r.rollout_s for r in longest[:4]]
    assert plain[4].rollout_s != longest[4].rollout_s
    with pytest.raises(ValueError, match=r"schedule.pipe \(RolloutPipe\) is not simulated"):
        SimConfig(schedule=SyncConfig(pipe=True))
    with pytest.raises(ValueError, match="rollout.tp=8 does not divide qwen2.5-7b's 28 attention heads and 4 KV"):
        replace(base, gpus=16, rollout=replace(base.rollout, tp=8))


@pytest.mark.parametrize("policy", ["sorted", "sorted_partial"])
def test_sortedrl_runs_in_the_simulator_and_partial_mode_resumes_what_it_cut(policy):
    cfg = SimConfig(model="qwen2.5-7b", gpus=4, rollout=rollout(8, 4, 4096),
                    num_steps=4, schedule=POLICY_CONFIGS[policy](sorted_batches=2))
    results = simulate(cfg, record=True)
    assert [r.kind for r in results] == ["sorted"] * 4
    assert all(len(r.record.groups) == 8 for r in results)  # P0 groups every round
    staleness = [s for r in results for g in r.record.groups for s in g.staleness]
    if policy == "sorted":  # cut responses are generated afresh: tokens thrown away, nothing stale
        assert all(r.wasted_tokens >= 0 for r in results) and sum(r.wasted_tokens for r in results) > 0
        assert not any(staleness)
    else:  # cut responses resume next round; 4 steps consume 2 load groups whole: nothing is thrown away, at any step
        assert [r.wasted_tokens for r in results] == [0] * 4 and max(staleness) >= 1
    # The second round of each load group launches its 8 prompts left, 4 responses each, less (in partial
    # mode) the responses that had finished in the first.
    launched = [results[i].record.num_launched for i in (1, 3)]
    assert all(n < 8 * 4 for n in launched) if policy == "sorted_partial" else launched == [8 * 4] * 2


def test_a_round_that_the_migrated_requests_end_ends_in_the_simulator():
    """sorted_partial with stream training: a carried sibling lets one migrated response that comes back
    whole complete the last group, in the migration's own poll."""
    import hashlib

    from rollpacker.schedule.scale_down import ScaleDownDecider, StreamConfig
    from rollpacker.schedule.sorted import SortedPolicy

    def length(*key):
        return 1 + int(hashlib.md5(repr(key).encode()).hexdigest()[:8], 16) % 40

    class Hashed(Table):
        def lengths(self, row, step, slot, num):
            return np.array([length(0, row, step, slot, k) for k in range(num)])

    policy = SortedPolicy(PromptSampler(11, seed=3), 4, 3, num_batches=4, partial=True, num_epochs=2)
    decider = ScaleDownDecider(StreamConfig(trigger=0.3), num_replicas=2, kv_capacity_tokens=10**9, max_new_tokens=40)
    for step in range(3):  # step 1's migration ends its round
        record = simulate_round(step, policy, replicas(2, StepCost(0.01)), Hashed(None), max_new_tokens=40,
                                reward=lambda row, seq: 1.0, plan=policy.start_round(step), stream=decider)
        assert len(record.groups) == 4


def test_reward_scheduler_pieces_by_hand():
    from rollpacker.sim.workload import RewardModel, adaptive_timeouts, makespan

    assert makespan([(2.0, 0.0), (1.0, 0.0), (3.0, 1.0)], 2) == 4.0  # the third waits for its release at 1
    assert makespan([2.0, 1.0, 3.0], 2) == 4.0
    assert adaptive_timeouts([1.0, 30.0, 3.0], 30.0) == [1.0, 4.5, 3.0]  # 1.5 x the slowest finished run
    assert adaptive_timeouts([0.5, 30.0], 30.0) == [0.5, 2.0]  # at least 2 s
    assert adaptive_timeouts([30.0, 30.0], 30.0) == [30.0, 30.0]  # nothing finished: no anchor
    one = RewardModel(tasks=("math",), math_workers=1)
    # Scored from their finish times 0.5 and 0.6 on one worker: done at 1.5, then 2.5; rollout ended at 1.
    assert one.exposed_s([("math", 1.0, 0.5), ("math", 1.0, 0.6)], 1.0, gpus=8) == 1.5
    assert one.exposed_s([("math", 0.1, 0.5)], 1.0, gpus=8) == 0.0


# ---- the stream trainer ----------------------------------------------------------------------------------


class TrainCost:
    """One GPU-second of training per token, rollout TP 1: the freed GPUs' queue by hand."""

    tp = 1

    def train_gpu_s(self, tokens, tokens_sq):
        return float(tokens)


def stream_round(scale_down):
    """Four prompts of two responses on two replicas (replica 0 runs every response 0, replica 1
    every response 1), one-token prompts of 2, 4, 10 and 10 tokens, 1 s per iteration plus 0.5 s
    per prefilled token."""
    policy = SyncPolicy(PromptSampler(10, seed=0), num_prompts=4, group_size=2)
    length = dict(zip(policy.sampler._order[:4], (2, 4, 10, 10)))
    reps = replicas(2, StepCost(1.0, prefill_s=0.5), record=True)
    rnd = simulate_round(0, policy, reps, Table(lambda row, k: length[row]), max_new_tokens=10, stream=scale_down)
    return rnd, reps


def test_a_scale_down_migrates_by_recomputation_and_the_freed_gpus_train_what_completes():
    from rollpacker.schedule.scale_down import ScaleDownDecider, StreamConfig
    from rollpacker.sim.simulate import streamed_gpu_s

    decider = ScaleDownDecider(StreamConfig(trigger=0.25), num_replicas=2, kv_capacity_tokens=1, max_new_tokens=10)
    rnd, reps = stream_round(decider)
    # Iteration 1 prefills 4 one-token prompts per replica (1 + 4 x 0.5 = 3 s), iteration 2 ends at 4 s with
    # prompt 0's responses: 1 of 4 prompts complete, the fixed 25% trigger fires. Replica 1's three requests
    # (2 tokens each) move to replica 0, which prefills them again (3 x 3 tokens: 1 + 4.5 s) beside its own
    # three; then prompt 1 finishes after one more iteration (10.5 s), prompts 2 and 3 after six (16.5 s).
    assert (rnd.scaled_at, rnd.scaled_frac, rnd.num_freed) == (4.0, 0.25, 1)
    assert reps[1].busy == [(0.0, 4.0, 4)]  # runs of iterations: (start, end, requests running)
    assert reps[0].busy == [(0.0, 4.0, 4), (4.0, 10.5, 6), (10.5, 16.5, 4)]
    assert rnd.rollout_s == 16.5 and rnd.num_preemptions == 0
    assert [t for t, _ in rnd.completions] == [4.0] * 2 + [10.5] * 2 + [16.5] * 4
    # The migrated responses end with the lengths they would have had; no token is lost or generated twice.
    assert sorted(sorted(o.length for o in g.outputs) for g in rnd.groups) == [[2, 2], [4, 4], [10, 10], [10, 10]]
    assert rnd.generated_tokens == 2 * (2 + 4 + 10 + 10)
    assert list(decider.history) == [2, 2, 4, 4, 10, 10, 10, 10]
    # Every complete group is fed to the freed GPU as it completes (prompt 0's at the scale-down).
    assert [(t, sorted(o.length for o in g.outputs)) for t, g in rnd.streamed] == [
        (4.0, [2, 2]), (10.5, [4, 4]), (16.5, [10, 10]), (16.5, [10, 10])]
    assert all(g.streamed for g in rnd.groups)
    # One freed GPU, one GPU-second per token: prompt 0's 2 x 3 tokens train from 4 s to 10 s; prompt 1's
    # 2 x 5 tokens from 10.5 s, cut at the rollout's end, 16.5 s (6 of 10); prompts 2 and 3 come too late.
    assert streamed_gpu_s(rnd, TrainCost(), prompt_tokens=1) == 6 + 6


def test_the_train_stage_shrinks_by_the_hidden_work_over_every_gpu():
    from rollpacker.schedule.scale_down import ScaleDownDecider, StreamConfig
    from rollpacker.sim.simulate import step_times, streamed_gpu_s

    rnd, _ = stream_round(ScaleDownDecider(StreamConfig(trigger=0.25), num_replicas=2, kv_capacity_tokens=1,
                                    max_new_tokens=10))
    cfg = SimConfig(model="qwen2.5-7b", gpus=2, rollout=RolloutConfig(tp=1), reward_scheduler=True, stream=True)
    cost = cfg.cost()
    streamed = step_times(0, rnd, cfg, cost)
    plain = step_times(0, replace(rnd, scaled_at=None), cfg, cost)
    hidden = streamed_gpu_s(rnd, cost, cfg.lengths.prompt_tokens)
    lens = cfg.lengths.prompt_tokens + np.array([2, 2, 4, 4, 10, 10, 10, 10], dtype=np.float64)
    assert hidden == pytest.approx(cost.train_gpu_s(lens[:4].sum(), (lens[:4] ** 2).sum()))  # prompts 0, 1: in time
    assert plain.train_s == pytest.approx(cost.train_s(lens.sum(), (lens**2).sum(), cfg.gpus))
    assert plain.train_s == pytest.approx(cost.train_gpu_s(lens.sum(), (lens**2).sum()) / cfg.gpus
                                          + cfg.calib.train_overhead_s)
    assert streamed.train_s == pytest.approx(plain.train_s - hidden / cfg.gpus)
    assert streamed.hidden_train_s == pytest.approx(hidden / cfg.gpus)
    assert (streamed.scaled_down, streamed.scaled_frac, plain.scaled_down) == (True, 0.25, False)


@pytest.mark.parametrize("capacity,scaled", [(39, None), (40, 0.5), (60, 0.25)])
def test_a_projected_kv_overflow_cancels_the_scale_down(capacity, scaled):
    from rollpacker.schedule.scale_down import ScaleDownDecider, StreamConfig

    # The adaptive trigger looks at 1 and 2 of 4 prompts complete. At 1 (4 s): six requests of 1 + 2 tokens,
    # none of the history [2, 2] longer, so each runs to max_new_tokens (8 more): peak 6 x 3 + 6 x 7 = 60
    # tokens. At 2 (6 s, without a scale-down): four requests of 1 + 4 tokens, 6 more each: 4 x 5 + 4 x 5 = 40.
    rnd, _ = stream_round(ScaleDownDecider(StreamConfig(), num_replicas=2, kv_capacity_tokens=capacity,
                                           max_new_tokens=10))
    assert (rnd.scaled_at is not None, rnd.scaled_frac) == (scaled is not None, scaled or 0.0)
    if scaled is None:
        assert rnd.rollout_s == 12.0 and rnd.streamed == [] and rnd.num_freed == 0  # as without a stream trainer


def test_stream_without_the_reward_scheduler_is_refused():
    with pytest.raises(ValueError, match="sim.stream needs sim.reward_scheduler"):
        SimConfig(stream=True)


def test_the_simulator_drives_the_decision_the_controllers_stream_trainer_uses():
    from types import SimpleNamespace

    from rollpacker.schedule.scale_down import ScaleDownDecider, StreamConfig
    from rollpacker.topology import Topology
    from rollpacker.train.stream import StreamTrainer

    meshes = SimpleNamespace(topology=Topology(2, tp=1, train_shard_size=1), rank=0)  # 2 replicas, shard groups of 1
    trainer = StreamTrainer(StreamConfig(), None, meshes, kv_capacity_tokens=50, max_new_tokens=10)
    decider = trainer.decider
    assert type(decider) is ScaleDownDecider and decider.kept_replicas == 1 and not decider.refused
    # The controller asks the StreamTrainer's ScaleDownDecider (consider, history, kept_replicas): driven the same way,
    # it decides what a ScaleDownDecider decides alone, and its history is the simulator's. With 50 tokens of KV it
    # scales down at 2 of 4 prompts (6 s); replica 1's two requests of 1 + 4 tokens are prefilled again on
    # replica 0 (1 + 5 s) and need 5 more iterations: 17 s.
    alone, _ = stream_round(ScaleDownDecider(StreamConfig(), num_replicas=2, kv_capacity_tokens=50, max_new_tokens=10))
    driven, _ = stream_round(decider)
    assert (driven.scaled_at, driven.scaled_frac, driven.rollout_s) == (alone.scaled_at, alone.scaled_frac,
                                                                          alone.rollout_s) == (6.0, 0.5, 17.0)
    assert list(decider.history) == [2, 2, 4, 4, 10, 10, 10, 10] and decider.trigger.milestone == 10


def test_the_whole_job_with_the_stream_trainer_hides_training_under_rollout():
    cfg = SimConfig(model="qwen2.5-7b", gpus=4, rollout=rollout(16, 4, 4096),
                    num_steps=3, schedule=SyncConfig(), reward_scheduler=True, stream=True)
    stream, plain = simulate(cfg), simulate(replace(cfg, stream=False))
    assert all(r.scaled_down for r in stream) and not any(r.scaled_down for r in plain)
    for s, p in zip(stream, plain):
        assert s.trained_tokens == p.trained_tokens  # the same responses, trained either way
        assert s.hidden_train_s > 0 and s.train_s == pytest.approx(p.train_s - s.hidden_train_s)
        assert s.rollout_s >= p.rollout_s  # the kept replicas run the migrated requests too


def test_one_step_off_overlaps_the_next_rollout_with_training_on_its_own_gpus():
    """Half the GPUs roll out, half train: the same sync batches (every response of every prompt,
    the same lengths) train in twice the GPU time share; each batch after the first is one step
    stale, and a step is the training GPUs' wait for the batch (its rollout and scoring, less the
    previous step's training they ran under), training and the weight sync."""
    base = SimConfig(model="qwen2.5-7b", gpus=4, rollout=rollout(8, 2, 2048),
                     num_steps=4)
    sync, off = simulate(replace(base, schedule=SyncConfig())), simulate(replace(base, schedule=OneStepOffConfig()),
                                                                    record=True)
    overhead = base.cost().calib.train_overhead_s
    for a, b in zip(sync, off, strict=True):
        assert b.trained_tokens == a.trained_tokens
        assert b.train_s - overhead == pytest.approx(2 * (a.train_s - overhead))
    assert [{s for g in r.record.groups for s in g.staleness} for r in off] == [{0}, {1}, {1}, {1}]
    assert off[0].step_s == pytest.approx(off[0].rollout_s + off[0].reward_s + off[0].train_s + off[0].sync_s)
    for prev, r in zip(off, off[1:]):
        wait = max(0.0, r.rollout_s + r.reward_s - prev.train_s)
        assert r.wait_s == pytest.approx(wait) and r.step_s == pytest.approx(wait + r.train_s + r.sync_s)
    with pytest.raises(ValueError, match="does not divide the 3 GPUs rolling out"):
        SimConfig(schedule=OneStepOffConfig(rollout_ranks=3), gpus=6, rollout=RolloutConfig(tp=2))


def test_one_step_off_carries_environment_work_over_the_time_between_its_round_starts(monkeypatch):
    """A round starts as the last batch trains: the environment workers' carried work is shifted by the
    time from one round's start to the next (its wait, the last batch's training and the sync), not by the step."""
    from rollpacker.sim.episodes import EpisodeWorkload, SimEnvPool

    shifts, shift = [], SimEnvPool.shift
    monkeypatch.setattr(SimEnvPool, "shift", lambda pool, seconds: (shifts.append(seconds), shift(pool, seconds)))
    cfg = SimConfig(model="qwen2.5-7b", gpus=8, rollout=rollout(8, 4, 2048), num_steps=3, schedule=OneStepOffConfig())
    off = simulate(cfg, env_workload=EpisodeWorkload(latency="lognormal:2.0:1.0", obs_tokens=64, num_workers=8))
    starts = [r.wait_s + (prev.train_s if prev else 0.0) + r.sync_s for prev, r in zip([None, *off], off)]
    assert shifts == pytest.approx(starts) and shifts != pytest.approx([r.step_s for r in off])


def test_the_gantt_chart_spans_the_simulated_run(tmp_path, monkeypatch):
    """one_step_off's rollout is drawn under the last step's training: the chart is as long as the run."""
    import matplotlib.figure

    from rollpacker.sim.gantt import plot

    ends, save = [], matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **kw: (
        ends.append(fig.axes[0].get_xlim()[1]), save(fig, *a, **kw)))
    cfg = SimConfig(model="qwen2.5-7b", gpus=4, rollout=rollout(8, 2, 2048), num_steps=3, schedule=OneStepOffConfig())
    results = simulate(cfg, record=True)
    assert plot(results, tmp_path / "g.png").is_file() and ends == [pytest.approx(sum(r.step_s for r in results))]


def test_a_critic_adds_its_passes_to_the_train_stage_alone():
    """``sim.critic`` (PPO's critic): the same rollout, the train stage's work 11/6 of the policy's alone (its
    values, forward, recomputation and backward beside the policy's six passes); stream training refuses it."""
    base = SimConfig(model="qwen2.5-7b", gpus=4, rollout=rollout(8, 2, 2048), num_steps=2, schedule=SyncConfig())
    plain, critic = simulate(base), simulate(replace(base, critic=True))
    overhead = base.cost().calib.train_overhead_s
    for a, b in zip(plain, critic, strict=True):
        assert b.rollout_s == a.rollout_s and b.trained_tokens == a.trained_tokens
        assert b.train_s - overhead == pytest.approx(11 / 6 * (a.train_s - overhead))
    with pytest.raises(ValueError, match="sim.stream with sim.critic"):
        SimConfig(critic=True, stream=True, reward_scheduler=True)


def test_a_preset_of_ones_own_is_simulated_on_the_model_named(tmp_path):
    """A .toml of one's own (or a toy preset) was refused asking for --model, which it then could not take."""
    from rollpacker.config import CONFIGS_DIR
    from rollpacker.sim.__main__ import parse

    mine = tmp_path / "my-run.toml"
    mine.write_text((CONFIGS_DIR / "qwen2.5-7b-8k.toml").read_text())
    cfg, _, _ = parse(["--preset", str(mine), "--model", "qwen2.5-14b"])
    assert cfg.model == "qwen2.5-14b" and cfg.gpus == 32 and cfg.rollout.max_new_tokens == 8192
    with pytest.raises(SystemExit, match="names no known model .*: pass --model NAME"):
        parse(["--preset", str(mine)])
    with pytest.raises(SystemExit, match="--model 'nope': not a known model"):
        parse(["--preset", "toy-cpu", "--model", "nope"])


def test_the_cli_embeds_the_runs_rollout_and_schedule_settings():
    from rollpacker.schedule.tail import TailConfig
    from rollpacker.sim.__main__ import parse

    cfg, _, _ = parse(["--preset", "qwen2.5-7b-8k", "schedule:tail", "--schedule.eta-prompts", "1.5",
                       "--rollout.num-prompts", "64", "--gpus", "8"])
    assert cfg.schedule == TailConfig(eta_prompts=1.5) and cfg.gpus == 8
    assert (cfg.rollout.num_prompts, cfg.rollout.group_size, cfg.rollout.max_new_tokens) == (64, 8, 8192)
    new, _, _ = parse(["--preset", "qwen2.5-7b-8k", "schedule:one_step_off", "--schedule.rollout-ranks", "8",
                       "--rollout.tp", "2"])
    assert (new.rollout_pool, new.train_pool, new.num_replicas) == (8, 8, 4)


def test_the_sim_cli_takes_a_policy_first_and_refuses_a_fit_of_no_candidates(capsys):
    from rollpacker.sim.__main__ import WorkloadArgs, main

    with pytest.raises(ValueError, match="--num-candidates must be >= 1"):  # was min() of an empty sequence
        WorkloadArgs(num_candidates=0)
    main(["schedule:tail", "--num-steps", "5"])  # the first form, its policy first (was an unknown command)
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["policy"] == "tail"
    # what was a traceback, silently ignored, or silent nonsense
    small = ["--preset", "qwen2.5-7b-8k", "--gpus", "16", "--num-steps", "2", "--rollout.num-prompts", "16"]
    for flags, said in ((["--gantt-steps", "0", "--gantt", "x.png"], "--gantt-steps must be a positive integer, "
                         "got '0'"),  # an IndexError; -2 plotted 3 steps
                        (["spec", *small, "--gantt", "x.png"], "spec draws no gantt chart")):  # ignored
        with pytest.raises(SystemExit, match=re.escape(said)):
            main(flags if flags[0] == "spec" else [*small, *flags])
    for flags, said in ((["--reward.judge-model", "foo"], "reward.judge_model 'foo' is not a known model"),  # KeyError
                        (["--reward.judge-output-tokens", "-400"], "reward.judge_output_tokens=-400: must be >= 0"),
                        (["--reward.code-timeout-rate", "2"], "reward.code_timeout_rate must be in [0, 1]"),
                        (["--stream", "--reward-scheduler", "--stream-config.criterion", "throughput"],
                         "sim.stream_config.criterion throughput learns")):  # it ran the KV fit, unsaid
        with pytest.raises(SystemExit):
            main([*small, *flags])
        assert said in " ".join(capsys.readouterr().err.replace("│", " ").split()), flags
    # --model=NAME names the preset's model as --model NAME does (its GPU count: the paper's, 32 for 14B)
    main(["--preset", "qwen2.5-7b-8k", "--model=qwen2.5-14b", "--num-steps", "2"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["gpus"] == 32
