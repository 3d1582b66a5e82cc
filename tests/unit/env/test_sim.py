"""Episodes in the simulator: the job's round and episode runner on simulated replicas and environment
workers, timelines computed by hand (turns, environment latency, the worker pool, resident prefill),
tail over episodes (the first R0 finished kept, the ledger exact), the workload's draws and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rollpacker.data.dataset import PromptSampler
from rollpacker.data.lengths import LengthModel, LengthReplay
from rollpacker.env.contract import EnvCall
from rollpacker.env.episode import TurnRequest
from rollpacker.schedule.sync import SyncPolicy
from rollpacker.schedule.tail import TailConfig
from rollpacker.sim.agentic import WORKLOADS
from rollpacker.sim.engine import Replica
from rollpacker.sim.episodes import EpisodeWorkload, ScriptedEnv, SimEnvPool, fit_run, turns_sampler
from rollpacker.sim.simulate import simulate_round
from tests.unit.sim.test_sim import StepCost


class Turns:
    """Turn lengths from a function of (response, turn); one-token prompts."""

    prompt_tokens = 1

    def __init__(self, length):
        self.length = length

    def turn_length(self, row, step, slot, response, turn):
        return self.length(response, turn)


def workload(tmp_path, seconds: float = 0.5, **kw) -> EpisodeWorkload:
    trace = tmp_path / "latency.trace"
    trace.write_text(f"{seconds}\n")
    return EpisodeWorkload(latency=f"trace:{trace}", extra_turn=0.0, **kw)


def one_round(policy, num_replicas, lengths, episodes, cost=StepCost(1.0), max_new_tokens=100):
    reps = [Replica(i, cost, 10**9, watermark=0.0) for i in range(num_replicas)]
    return simulate_round(0, policy, reps, lengths, max_new_tokens=max_new_tokens, env=SimEnvPool(episodes))


def test_an_episodes_turns_and_environment_steps_make_its_timeline(tmp_path):
    # turn 0: 3 tokens (0-3 s), step 0.5 s (-3.5), turn 1: 4 tokens (-7.5), its step (-8.0): done
    policy = SyncPolicy(PromptSampler(4, seed=0), num_prompts=1, group_size=1)
    rnd = one_round(policy, 1, Turns(lambda k, t: [3, 4][t]), workload(tmp_path, turns="fixed:2", obs_tokens=3))
    assert rnd.rollout_s == pytest.approx(8.0)
    [group] = rnd.groups
    [out] = group.outputs
    assert out.finish_time == pytest.approx(8.0) and out.length == 3 + 3 + 4  # two turns and one observation
    assert [t for t, _ in rnd.completions] == pytest.approx([3.0, 7.5])  # the turns, as the engines finish them


@pytest.mark.parametrize("resident, end", [(True, 8.4), (False, 8.8)])
def test_a_resident_session_prefills_only_the_new_observation(tmp_path, resident, end):
    # prefill 0.1 s a token: turn 0 prefills its 1-token prompt (3.1), the step (3.6); turn 1's prompt is 7 tokens,
    # of which its session holds the first turn's 4: 3 prefilled (+0.3 -> 7.9) or all 7 (+0.7 -> 8.3); its step +0.5
    policy = SyncPolicy(PromptSampler(4, seed=0), num_prompts=1, group_size=1)
    rnd = one_round(policy, 1, Turns(lambda k, t: [3, 4][t]),
                    workload(tmp_path, turns="fixed:2", obs_tokens=3, resident=resident), StepCost(1.0, 0.1))
    assert rnd.rollout_s == pytest.approx(end)


def test_one_environment_worker_runs_the_steps_one_at_a_time(tmp_path):
    # two 1-turn episodes of 2 tokens on 2 replicas: both turns end at 2 s; their steps queue on the one worker
    policy = SyncPolicy(PromptSampler(4, seed=0), num_prompts=1, group_size=2)
    one = one_round(policy, 2, Turns(lambda k, t: 2), workload(tmp_path, turns="fixed:1", num_workers=1))
    policy = SyncPolicy(PromptSampler(4, seed=0), num_prompts=1, group_size=2)
    two = one_round(policy, 2, Turns(lambda k, t: 2), workload(tmp_path, turns="fixed:1", num_workers=2))
    assert sorted(o.finish_time for o in one.groups[0].outputs) == pytest.approx([2.5, 3.0])
    assert sorted(o.finish_time for o in two.groups[0].outputs) == pytest.approx([2.5, 2.5])


def test_a_turn_at_its_token_budget_ends_the_episode(tmp_path):
    # the cap is 5 a turn and 5 an episode; turn 0 wants 9: cut at 5, the episode ends there, no step
    policy = SyncPolicy(PromptSampler(4, seed=0), num_prompts=1, group_size=1)
    rnd = one_round(policy, 1, Turns(lambda k, t: 9), workload(tmp_path, turns="fixed:3"), max_new_tokens=5)
    assert rnd.rollout_s == pytest.approx(5.0) and rnd.groups[0].outputs[0].length == 5


def test_a_turn_cut_at_its_own_cap_goes_to_the_environment(tmp_path):
    # 5 a turn, 15 an episode, every turn wants 9: turns 0 and 1 are cut at 5 and stepped (0.5 s each),
    # turn 2 spends the episode's budget and ends it: 5 + 0.5 + 5 + 0.5 + 5 seconds
    policy = SyncPolicy(PromptSampler(4, seed=0), num_prompts=1, group_size=1)
    rnd = one_round(policy, 1, Turns(lambda k, t: 9), workload(tmp_path, turns="fixed:3", max_tokens=15, obs_tokens=0),
                    max_new_tokens=5)
    assert rnd.rollout_s == pytest.approx(16.0) and rnd.groups[0].outputs[0].length == 15


def test_tail_over_episodes_keeps_the_first_r0_to_finish_and_the_ledger_is_exact(tmp_path):
    # P0=1, R0=2, eta_R=2: four 1-turn episodes of 2, 4, 6, 8 tokens, round robin on 2 replicas, each step 0.5 s:
    # episodes 0 and 1 are done at 2.5 and 4.5 s and kept, 2 and 3 are cut then
    policy = TailConfig(eta_prompts=1.0, eta_responses=2.0).build(PromptSampler(8, seed=0), 1, 2, last_step=10)
    rnd = one_round(policy, 2, Turns(lambda k, t: 2 + 2 * k), workload(tmp_path, turns="fixed:1"))
    [group] = rnd.groups
    assert sorted(o.response for o in group.outputs) == [0, 1]
    assert sorted(o.finish_time for o in group.outputs) == pytest.approx([2.5, 4.5])
    assert rnd.rollout_s == pytest.approx(4.5)
    assert sorted(o.id for o in rnd.aborted) == ["0:0:2", "0:0:3"]
    policy.ledger.check(policy.sampler)
    assert policy.ledger.counts()["trained"] == 1 and policy.ledger.counts()["in_flight"] == 0


def test_the_sim_and_the_replay_draw_the_same_turn_lengths():
    model = LengthModel(seed=5).for_cap(400)
    replay = LengthReplay(5, 400)
    assert replay.turn(TurnRequest("3:1:2#4", [1], 400, 0), 17) == min(400, model.turn_length(17, 3, 1, 2, 4))
    assert len({model.turn_length(17, 3, 1, 2, t) for t in range(8)}) > 1  # fresh noise per turn


def test_workload_draws_are_deterministic_and_the_scripted_env_follows_them():
    w = EpisodeWorkload(turns="pareto:1.2:8", latency="lognormal:0.3:1.0", per_episode=False)
    counts = [turns_sampler("pareto:1.2:8")(str(r)) for r in range(2000)]
    assert 1 <= min(counts) and max(counts) == 8 and np.mean(np.array(counts) == 1) > 0.5
    env = ScriptedEnv({"id": "row7"}, w)
    env.workload = EpisodeWorkload(turns=w.turns, latency="lognormal:0:1.0", per_episode=False)  # no sleeping
    env.reset(seed=11)
    turns = w.num_turns("row7", "11")
    results = [env.step("x") for _ in range(turns)]
    assert [r[2] for r in results] == [False] * (turns - 1) + [True]
    pool = SimEnvPool(w, row_key=lambda row: f"row{row}")
    assert pool.workload.step_seconds("row7", "11", 1) == w.step_seconds("row7", "11", 1) > 0


def test_a_named_workload_takes_the_latency_specs_mean_as_its_scale_and_opens_with_a_cold_start():
    w = EpisodeWorkload(workload="agentic", latency="lognormal:2.0:1.0")
    steps = [w.step_seconds(str(r), "e", k) for r in range(3000) for k in (1, 2)]
    assert np.mean(steps) == pytest.approx(2.0, rel=0.15) and np.median(steps) < 0.2  # its shape, at this scale
    assert w.num_turns("5", "e") == WORKLOADS["agentic"].turns("5", "e") and w.reset_seconds("5") > 0
    pool = SimEnvPool(w, row_key=str)
    pool.send([EnvCall("open", "0:0:0", row=5, seed=1)], 0.0)
    assert pool.take(10.0)[0].seconds == w.reset_seconds("5") == pool.free_at[0]
    with pytest.raises(ValueError, match="agentic, light or trace:PATH"):
        EpisodeWorkload(workload="heavy")


def test_an_environment_warmed_ahead_answers_its_rounds_open_with_the_reset_it_ran_before():
    w = EpisodeWorkload(workload="agentic", latency="lognormal:2.0:1.0")
    pool = SimEnvPool(w, row_key=str)
    pool.warm([EnvCall("open", "1:0:0", row=5, seed=1)], 10.0)  # as round 0 ends, 10 s after it began
    pool.shift(12.0)  # round 1 begins as step 0 ends
    pool.send([EnvCall("open", "1:0:0", row=5, seed=1), EnvCall("open", "1:1:0", row=6, seed=2)], 0.0)
    due = 10.0 + w.reset_seconds("5") - 12.0
    assert [r.key for r in pool.take(max(due, 0.0))] == ["1:0:0"]  # its reset ran during the 2 s of training
    assert [r.key for r in pool.take(100.0)] == ["1:1:0"] and not pool.warmed  # the other reset from the round


@pytest.mark.parametrize("spec", ["pareto:1.2", "fixed:0", "gauss:1", "trace:/nonexistent"])
def test_a_bad_turns_spec_says_how_to_write_one(spec):
    with pytest.raises(ValueError, match="--turns"):
        EpisodeWorkload(turns=spec)


def test_fit_run_takes_turns_observations_and_latency_from_a_run(tmp_path):
    (tmp_path / "samples").mkdir()
    episodes = [{"num_turns": n, "turns": [{"trained": True, "tokens": 5}, {"trained": False, "tokens": 7}]}
                for n in (1, 3)]
    (tmp_path / "samples" / "step_0.jsonl").write_text("\n".join(map(json.dumps, episodes)) + "\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"env/step_seconds": 0.2}) + "\n"
                                            + json.dumps({"env/step_seconds": 0.4}) + "\n")
    fitted = fit_run(tmp_path, EpisodeWorkload(latency="lognormal:1.0:0.5"))
    assert fitted.obs_tokens == 7 and fitted.extra_turn == 0.0 and fitted.latency == "lognormal:0.3000:0.5"
    assert sorted({fitted.num_turns(str(r), "e") for r in range(50)}) == [1, 3]
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        fit_run(tmp_path / "elsewhere", EpisodeWorkload())
    with pytest.raises(ValueError, match="--workload agentic: the fit takes the run's turns"):  # its own turns
        fit_run(tmp_path, EpisodeWorkload(workload="agentic"))  # stood in for the run's, said nothing


def test_replayed_lengths_force_each_turn_and_a_turn_short_of_its_budget_reads_as_stopped():
    from rollpacker.env.episode import Done, Episode, StepEnv
    from rollpacker.exchange import RoundLeader
    from rollpacker.rollout.engine import SamplingParams

    replay = LengthReplay(0, 400)
    leader = RoundLeader(policy=None, rows=[0] * 8, encode=lambda row: [1], rewards=None,
                         sampling=SamplingParams(max_new_tokens=400), lengths=replay)
    turn = TurnRequest("2:1:0#3", [1, 2], 400, 7)
    req = leader.request(turn, 5, 0, ())
    assert req.params.max_new_tokens == replay.turn(turn, 5) < 400 and req.params.ignore_eos
    assert leader.request(TurnRequest("2:1:0#3", [1, 2], 1, 7), 5, 0, ()).params.max_new_tokens == 1  # the budget wins

    class Bridge:
        def action_text(self, token_ids):
            return "x"

    def episode(max_tokens):
        return Episode("2:1:0", [1, 2], Bridge(), seed=0, max_turns=4, max_tokens=max_tokens, max_new_tokens=8,
                       max_context=100)

    # cut ("length") short of its budget: forced there, read as the model's stop; the episode goes on
    assert episode(max_tokens=8).on_turn([3, 4], [0.0, 0.0], "length") == StepEnv("x")
    assert episode(max_tokens=2).on_turn([3, 4], [0.0, 0.0], "length") == Done("max_tokens")  # at its budget: cut


def test_sim_episodes_cli_reports_speedups_over_sync(capsys):
    from rollpacker.sim.episodes_cli import main

    figures = main(["--gpus", "8", "--num-steps", "2", "--num-prompts", "8", "--group-size", "4",
                    "--turn-tokens", "512", "--num-workers", "16", "--workload", "agentic",
                    "--policies", "sync,tail+paper,tail,tail+stream+warm"])
    assert figures["rollout_s_sync"] > 0 and figures["rollout_speedup_tail"] > 0 and figures["turns_mean"] >= 1
    assert figures["rollout_speedup_tail_paper"] > 0 and "workload agentic" in capsys.readouterr().out
    assert figures["rollout_speedup_tail_stream_warm"] > 0
    from rollpacker.sim.episodes_cli import EpisodesArgs, config

    assert config(EpisodesArgs(), "tail+paper").schedule == TailConfig(eta_prompts=1.25, eta_long=1.0)
    raced = EpisodesArgs(eta_prompts=3, eta_long=4)
    assert config(raced, "tail+stream").schedule == TailConfig(eta_prompts=3, eta_long=4)
    assert config(raced, "tail+paper").schedule == TailConfig(eta_prompts=3, eta_long=1.0)
    assert config(raced, "sync").schedule == config(EpisodesArgs(), "sync").schedule
    both = config(raced, "tail+stream+warm")
    assert both.warm and both.stream and not config(raced, "tail+stream").warm
    with pytest.raises(ValueError, match="schedule.eta_long=0.5: each η must be a finite number >= 1"):
        config(EpisodesArgs(eta_long=0.5), "tail")
    with pytest.raises(ValueError, match="tail\\+paper"):
        config(EpisodesArgs(), "sync+paper")
    with pytest.raises(SystemExit):
        main(["--latency", "normal:1"])
    said = capsys.readouterr().err
    assert "--latency 'normal:1': write" in said and "lognormal:MEAN_SECONDS:SIGMA or trace:PATH" in said


def test_sim_episodes_says_its_workloads_own_mean_and_refuses_what_it_would_not_read(tmp_path, capsys):
    """The header said --latency's mean for a trace's steps, and a --latency trace under a named workload was
    dropped unsaid; a preset named for no model asked for a --model flag episodes did not have."""
    from rollpacker.sim.episodes_cli import main

    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"steps": [0.1, 0.1]}\n{"steps": [0.1]}\n')
    small = ["--gpus", "8", "--num-steps", "1", "--num-prompts", "4", "--group-size", "2", "--turn-tokens", "256"]
    main([*small, "--workload", f"trace:{trace}"])
    assert f"workload trace:{trace} (mean step 0.1 s)" in capsys.readouterr().out
    latency = tmp_path / "latency.txt"
    latency.write_text("0.1\n")
    with pytest.raises(ValueError, match="--workload agentic with --latency trace:.*give that, or leave --workload"):
        EpisodeWorkload(workload="agentic", latency=f"trace:{latency}")
    assert main([*small, "--preset", "toy-cpu", "--model", "qwen2.5-7b"])["model"] == "qwen2.5-7b"
    with pytest.raises(SystemExit, match="--preset: preset 'nope'.* not found"):
        main([*small, "--preset", "nope"])


@pytest.mark.parametrize("line", ['{"steps": "12"}', '{"steps": [NaN, 1.0]}', '{"steps": [Infinity]}',
                                  '{"steps": [1.0], "reset": NaN}'])
def test_a_trace_of_steps_that_are_not_finite_seconds_is_refused(tmp_path, line):
    """A string's characters read as steps; NaN and inf hung the simulation."""
    from rollpacker.sim.agentic import workload

    trace = tmp_path / "trace.jsonl"
    trace.write_text(line + "\n")
    with pytest.raises(ValueError, match=f"trace:{trace}, line 1: "):
        workload(f"trace:{trace}")


def test_validate_keeps_the_policies_given_and_refuses_what_episodes_do_not_run():
    from rollpacker.sim.validate import ROLLOUT_ALONE, ValidateArgs

    assert ValidateArgs().policies == ROLLOUT_ALONE
    assert ValidateArgs(workload="episodes").policies == ("sync", "tail")
    assert ValidateArgs(workload="episodes", policies=ROLLOUT_ALONE).policies == ROLLOUT_ALONE  # as given
    for given in (dict(regimes=("memory",)), dict(spec_policies=("sync",))):
        with pytest.raises(ValueError, match="with --workload episodes: episodes run in the compute regime alone"):
            ValidateArgs(workload="episodes", **given)


def test_validate_simulates_the_episode_jobs_rounds(tmp_path):
    """The job ``sim validate --workload episodes`` runs, simulated on a flat profile: every step ends, after
    at least its slowest group's environment steps (a group's episodes share them there)."""
    from rollpacker.config import parse
    from rollpacker.jobflags import JobArgs, job_argv, policy_args
    from rollpacker.sim.validate import EPISODES, ValidateArgs, regime_flags, simulate_run

    flat = {"exchange_ms": 1.0, "tp": {"1": {"kv_capacity_tokens": 1_000_000,
                                             "decode_ms": {"32": {"1": 5.0, "64": 5.0}},
                                             "prefill_tok_s": {"32": 1e12}}}}
    args = ValidateArgs(num_steps=2, work_dir=tmp_path, workload="episodes")
    argv = job_argv(JobArgs(), regime_flags("episodes", args), policy_args("sync"), 0, str(tmp_path / "run"))
    assert parse(argv).env.enabled and (tmp_path / "episodes" / "scripted_env.py").is_file()
    times = simulate_run(argv, flat)
    assert len(times) == 2 and min(times) > 0
    assert EPISODES.per_episode is False  # what ScriptedEnv can draw: its row and its reset seed


def test_a_step_in_flight_when_its_episode_is_cut_keeps_its_worker_into_the_next_round(tmp_path):
    from rollpacker.env.contract import EnvCall

    pool = SimEnvPool(workload(tmp_path, turns="fixed:3", num_workers=2))  # every step 0.5 s
    pool.send([EnvCall("open", "0:0:0", row=1), EnvCall("step", "0:0:0")], 0.0)
    pool.send([EnvCall("close", "0:0:0")], 0.1)  # cut: its close waits for the step (0.5 s)
    pool.shift(0.2)  # the next round begins: the worker is busy 0.3 s more, the episode still hosted there
    assert pool.free_at == pytest.approx([0.3, 0.0])
    pool.send([EnvCall("open", "1:0:0", row=2)], 0.0)
    assert pool.home["1:0:0"] == 1  # the worker hosting the fewest
    pool.send([EnvCall("open", "1:0:1", row=2), EnvCall("step", "1:0:1")], 0.3)
    assert pool.home["1:0:1"] == 0 and "0:0:0" not in pool.home  # closed by then
    assert [(r.kind, r.key) for r in pool.take(0.8)] == [
        ("open", "0:0:0"), ("open", "1:0:0"), ("step", "0:0:0"), ("close", "0:0:0"), ("open", "1:0:1"),
        ("step", "1:0:1")]


def test_every_environment_is_closed_at_the_rounds_end(tmp_path):
    policy = TailConfig(eta_prompts=1.0, eta_responses=2.0).build(PromptSampler(8, seed=0), 1, 2, last_step=10)
    pool = SimEnvPool(workload(tmp_path, turns="fixed:2"))
    reps = [Replica(i, StepCost(1.0), 10**9, watermark=0.0) for i in range(2)]
    simulate_round(0, policy, reps, Turns(lambda k, t: 2 + 2 * k), max_new_tokens=100, env=pool)
    closes = [key for _, key in pool.closing]
    assert sorted(closes) == [f"0:0:{k}" for k in range(4)]
