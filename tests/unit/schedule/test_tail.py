"""Tail batching's policy on scripted completion orders, with the ledger checked after every event."""

from __future__ import annotations

import copy
from collections import Counter

import pytest

from rollpacker.data.dataset import PromptSampler
from rollpacker.schedule.base import request_id
from rollpacker.schedule.ledger import Ledger
from rollpacker.schedule.sync import SyncConfig, SyncPolicy
from rollpacker.schedule.tail import TailPolicy


class Out(str):
    """A finished response, by name: one whose environment did not fail."""

    finish_reason = "stop"


def play(policy, step, length, reward=lambda row, k: float(k % 2)):
    """Drive one round like the controller: responses finish in order of ``length(row, k)``.

    Returns (round, groups, finished (slot, k) in order, aborted request ids)."""
    rnd = policy.start_round(step)
    rows = list(rnd.prompts)
    running = {(s, k) for s in range(len(rows)) for k in range(rnd.num_responses)}
    finished, aborted = [], []
    while running:
        slot, k = min(running, key=lambda sk: (length(rows[sk[0]], sk[1]), sk))
        running.discard((slot, k))
        finished.append((slot, k))
        decision = policy.on_finished(slot, k, Out(f"out{slot}.{k}"), reward(rows[slot], k))
        policy.ledger.check(policy.sampler) if hasattr(policy, "ledger") else None
        for rid in decision.abort:
            _, s, kk = map(int, rid.split(":"))
            if (s, kk) in running:
                running.discard((s, kk))
                aborted.append(rid)
        for row in decision.launch:
            rows.append(row)
            running |= {(len(rows) - 1, kk) for kk in range(rnd.num_responses)}
        if decision.round_done:
            aborted += [request_id(step, s, kk) for s, kk in sorted(running)]
            break
    groups = policy.end_round([None] * len(aborted))
    return rnd, groups, finished, aborted


def tail(num_rows=40, p0=4, r0=2, **kw):
    return TailPolicy(PromptSampler(num_rows, seed=1), p0, r0, **kw)


def test_short_round_launches_eta_and_cuts_off_at_p0_completions():
    policy = tail(p0=4, r0=4)
    long_row = None

    def length(row, k):
        return 1000 if row == long_row else 10 * row + k

    rnd = policy.start_round(0)
    assert (rnd.kind, len(rnd.prompts), rnd.num_responses) == ("short", 5, 5)  # ceil(1.25*4), ceil(1.25*4)
    long_row = max(rnd.prompts)
    policy = tail(p0=4, r0=4)
    rnd, groups, _, aborted = play(policy, 0, length)
    assert sorted(g.prompt for g in groups) == sorted(r for r in rnd.prompts if r != long_row)
    assert all(len(g.outputs) == 4 for g in groups)
    assert list(policy.ledger.queue) == [(0, long_row)]
    stats = policy.stats()
    assert stats["sched/deferred"] == 1 and stats["sched/long_queue_len"] == 1
    assert len(aborted) == 4 + 5  # one surplus response of each trained prompt, all 5 of the deferred one


def test_eta_times_p0_and_r0_is_rounded_up_as_decimals_are():
    """⌈1.1·100⌉ is 110: the float product (110.00000000000001) must not launch 111."""
    rnd = tail(num_rows=400, p0=100, r0=10, eta_prompts=1.1, eta_responses=1.1).start_round(0)
    assert (len(rnd.prompts), rnd.num_responses) == (110, 11)


def test_each_prompt_keeps_its_first_r0_responses_and_aborts_the_rest_at_once():
    policy = tail(p0=1, r0=2, eta_prompts=1.0, eta_responses=2.0)
    rnd = policy.start_round(3)
    assert rnd.num_responses == 4
    assert policy.on_finished(0, 2, Out("a"), 1.0).abort == []
    decision = policy.on_finished(0, 0, Out("b"), 0.0)
    assert decision.abort == [request_id(3, 0, 1), request_id(3, 0, 3)] and decision.round_done
    assert policy.on_finished(0, 1, Out("late"), 1.0).abort == []  # finished before its abort landed: ignored
    [group] = policy.end_round([None, None])
    assert group.outputs == ["a", "b"] and group.rewards == [1.0, 0.0]


def test_queue_grows_until_p0_then_a_long_round_takes_the_oldest_p0_without_speculation():
    policy = tail(num_rows=100, p0=4, r0=2)
    deferred = []
    for step in range(4):
        slow = {}

        def length(row, k):
            slow.setdefault("row", row)  # the first prompt asked about is the slow one
            return 1000 if row == slow["row"] else row + k

        rnd, groups, _, _ = play(policy, step, length)
        assert rnd.kind == "short" and len(groups) == 4
        deferred += list(policy.ledger.queue)[len(deferred):]
    assert len(policy.ledger.queue) == 4 and list(policy.ledger.queue) == deferred
    rnd, groups, _, aborted = play(policy, 4, lambda row, k: 1000 + row)
    assert rnd.kind == "long" and rnd.num_responses == 2 and rnd.prompts == [r for _, r in deferred]
    assert len(groups) == 4 and not aborted and not policy.ledger.queue
    assert policy.ledger.counts() == Counter(trained=20)


def test_an_over_provisioned_long_round_keeps_its_first_p0_and_requeues_the_rest_in_front_oldest_first():
    policy = tail(num_rows=12, p0=2, r0=2, eta_prompts=2, eta_long=2, num_epochs=1)
    for step in range(2):  # short rounds launch 4, keep 2, defer 2
        rnd, groups, _, _ = play(policy, step, lambda row, k: 1000 + row + k)
        assert rnd.kind == "short" and len(groups) == 2
    queue = list(policy.ledger.queue)
    assert len(queue) == 4
    # the queue's two newest finish first: the long round keeps them, the two oldest go back in front, in order
    rnd, groups, _, aborted = play(policy, 2, lambda row, k: -[r for _, r in queue].index(row))
    assert rnd.kind == "long" and rnd.prompts == [r for _, r in queue] and rnd.keep == 2
    assert [(g.epoch, g.prompt) for g in groups] == queue[2:] and len(aborted) == 4
    assert list(policy.ledger.queue) == queue[:2] and policy.stats()["sched/deferred"] == 2
    step = 3
    while not policy.done():  # the epoch's end flushes: every prompt trained once
        play(policy, step, lambda row, k: row + k)
        step += 1
        assert step < 50
    assert policy.ledger.rows(0, "trained") == list(range(12)) and not policy.ledger.queue


def test_epoch_limit_trains_every_prompt_exactly_once_and_flushes_the_queue():
    num_rows, policy = 22, tail(num_rows=22, p0=4, r0=2, num_epochs=2)
    step = 0
    while not policy.done():
        play(policy, step, lambda row, k: 1000 if row % 5 == 0 else row + k)
        step += 1
        assert step < 100
    for epoch in (0, 1):
        assert policy.ledger.rows(epoch, "trained") == list(range(num_rows))
    assert not policy.ledger.queue and policy.ledger.counts() == Counter(trained=2 * num_rows)
    with pytest.raises(RuntimeError, match="no prompt left"):
        policy.start_round(step)


def test_last_step_flushes_the_whole_queue_in_one_long_round():
    policy = tail(p0=4, r0=2, last_step=1)
    play(policy, 0, lambda row, k: 1000 if row % 2 else row + k)
    queued = list(policy.ledger.queue)
    assert 0 < len(queued) < 4
    rnd, groups, _, _ = play(policy, 1, lambda row, k: row + k)
    assert rnd.kind == "long" and [(g.epoch, g.prompt) for g in groups] == queued


def test_the_last_step_with_an_empty_queue_launches_only_what_it_keeps():
    """A short round there deferred its over-provisioned prompts into a queue no later round would flush."""
    policy = tail(p0=4, r0=2, last_step=0)
    rnd, groups, _, _ = play(policy, 0, lambda row, k: 1000 if row % 2 else row + k)
    assert rnd.kind == "short" and len(rnd.prompts) == len(groups) == 4
    assert not policy.ledger.queue and policy.ledger.counts().get("deferred", 0) == 0


def test_zero_variance_groups_are_filtered_counted_and_replaced():
    policy = tail(p0=4, r0=2, filter_zero_variance=True)
    flat = set()

    def reward(row, k):
        return 1.0 if row in flat else float(k % 2)

    rnd = policy.start_round(0)
    flat.add(rnd.prompts[0])
    policy = tail(p0=4, r0=2, filter_zero_variance=True)
    rnd, groups, _, _ = play(policy, 0, lambda row, k: row + k, reward)
    assert len(rnd.prompts) == 5
    assert len(groups) == 4 and flat.isdisjoint(g.prompt for g in groups)
    assert policy.stats()["sched/filtered"] == 1
    assert policy.ledger.counts()["filtered"] == 1
    assert all(key[1] not in flat for key in policy.ledger.queue)


def test_state_dict_mid_round_requeues_in_flight_prompts_first():
    policy = tail(p0=4, r0=2)
    play(policy, 0, lambda row, k: 1000 if row % 3 == 0 else row + k)
    rnd = policy.start_round(1)
    state = policy.state_dict()
    resumed = tail(p0=4, r0=2)
    resumed.load_state_dict(state)
    in_flight = [(policy.sampler.epoch, r) for r in rnd.prompts]
    assert list(resumed.ledger.queue)[:len(in_flight)] == in_flight
    resumed.ledger.check(resumed.sampler)


def test_sync_stops_at_the_epoch_limit_and_filters_after_the_round():
    policy = SyncPolicy(PromptSampler(10, seed=0), 4, 2, num_epochs=1, filter_zero_variance=True)
    seen = []
    while not policy.done():
        rnd, groups, _, _ = play(policy, 0, lambda row, k: row + k, lambda row, k: float(row % 2 and k))
        seen += rnd.prompts
    assert sorted(seen) == list(range(10)) and len(rnd.prompts) == 2


def test_sync_refill_keeps_p0_groups_while_the_data_lasts():
    """DAPO's dynamic sampling under sync: a dropped group's slot goes to a fresh prompt, whose own
    group may be dropped and replaced in turn; the last round runs out of data first."""
    policy = SyncPolicy(PromptSampler(10, seed=0), 4, 2, num_epochs=1, filter_zero_variance=True, refill=True)
    flat = lambda row, k: 1.0 if row % 3 == 0 else float(k % 2)  # noqa: E731  (rows 0, 3, 6, 9: all equal)
    rnd, groups, finished, _ = play(policy, 0, lambda row, k: row + k, flat)
    dropped = [row for row in rnd.prompts if row % 3 == 0]
    assert len(groups) == 4 and all(g.prompt % 3 for g in groups) and len(dropped) > 0
    assert len(finished) == 2 * (4 + policy.stats()["sched/filtered"])  # every launched response, refills too
    seen = [g.prompt for g in groups]
    while not policy.done():
        _, groups, _, _ = play(policy, 1, lambda row, k: row + k, flat)
        seen += [g.prompt for g in groups]
    assert sorted(seen) == [1, 2, 4, 5, 7, 8]  # each kept once; the last round kept what was left
    with pytest.raises(ValueError, match="schedule.refill replaces the groups schedule.filter_zero_variance drops"):
        SyncConfig(refill=True)


@pytest.mark.parametrize("name", ["sync_refill", "tail"])
def test_a_round_whose_every_group_has_equal_rewards_stops_drawing_at_max_gen_batches(name):
    """Unlimited epochs and a reward that is 0 everywhere: the round would draw prompts forever."""
    from rollpacker.errors import UserError

    sampler = PromptSampler(10, seed=0)
    policy = (TailPolicy(sampler, 4, 2, filter_zero_variance=True, max_gen_batches=3) if name == "tail"
              else SyncPolicy(sampler, 4, 2, filter_zero_variance=True, refill=True, max_gen_batches=3))
    with pytest.raises(UserError, match=r"a round drew 12 prompts \(schedule.max_gen_batches=3 times "
                                        r"rollout.num_prompts\) and schedule.filter_zero_variance still dropped"):
        play(policy, 0, lambda row, k: row + k, lambda row, k: 0.0)


def test_filtering_groups_of_one_response_is_refused(capsys):
    from rollpacker.config import parse

    with pytest.raises(SystemExit):
        parse(["--schedule.filter-zero-variance", "--rollout.group-size", "1", "--train.advantage", "reinforce_pp"])
    assert "with rollout.group_size=1 that is every group" in capsys.readouterr().err


def test_a_group_of_one_is_refused_where_the_advantage_takes_the_groups_baseline():
    """GRPO's advantage of a group of one response is 0: a run would train nothing (TRL refuses
    num_generations < 2); an estimator whose baseline is the step's batch takes it."""
    from rollpacker.config import Config
    from rollpacker.rollout.config import RolloutConfig
    from rollpacker.train.config import TeacherConfig, TrainConfig

    for advantage in ("grpo", "rloo", "gdpo"):
        with pytest.raises(ValueError, match=rf"rollout.group_size=1 with train.advantage='{advantage}': its baseline "
                                             r"is the group's, .* or train.advantage to reinforce_pp or gae"):
            Config(rollout=RolloutConfig(group_size=1), train=TrainConfig(advantage=advantage))
    assert Config(rollout=RolloutConfig(group_size=1), train=TrainConfig(advantage="reinforce_pp"))
    # on-policy distillation as a loss term trains a response alone; with the task's reward too, that trains nothing
    assert Config(rollout=RolloutConfig(group_size=1), train=TrainConfig(teacher=TeacherConfig(
        path="teacher", in_loss=True, task_weight=0.0)))
    with pytest.raises(ValueError, match=r"the task's reward would train nothing.*\(or train.teacher.task_weight 0: "
                                         r"the teacher's loss term alone\)"):
        Config(rollout=RolloutConfig(group_size=1), train=TrainConfig(teacher=TeacherConfig(path="teacher",
                                                                                            in_loss=True)))


def test_retired_prompts_leave_later_epochs_and_the_ledger_accounts_for_the_rest():
    """Every row trains in epoch 0; the solved ones (a third) are out of epoch 2, and out of epoch 1 unless
    their epoch-0 group ended after epoch 1 began (a round draws ahead); the ledger checks every event."""
    num_rows, solved = 22, {row for row in range(22) if row % 3 == 0}
    policy = TailPolicy(PromptSampler(num_rows, seed=1, retire_solved=1.0), 4, 2, num_epochs=3)
    step = 0
    while not policy.done():
        _, groups, _, _ = play(policy, step, lambda row, k: 1000 if row % 5 == 0 else row + k,
                               reward=lambda row, k: 1.0 if row in solved else float(k % 2))
        for g in groups:
            policy.sampler.observe(g.prompt, [r >= 1 for r in g.rewards])
        step += 1
    assert policy.ledger.rows(0, "trained") == list(range(num_rows))
    assert policy.ledger.rows(2, "trained") == sorted(set(range(num_rows)) - solved)
    late = set(policy.ledger.rows(1, "trained")) & solved
    assert set(policy.ledger.rows(1, "trained")) - late == set(range(num_rows)) - solved and len(late) < 2
    assert policy.sampler.sizes == [num_rows, num_rows - len(solved) + len(late), num_rows - len(solved)]


def test_a_copy_plays_on_alone_as_the_policy_would():
    """env.warm plans each next round on a deep copy of the policy (the sampler and ledger copy their
    containers only): the copy, played through epoch rollovers and retirements, leaves the original as it
    was, and the original then plays the same rounds."""
    solved = {row for row in range(22) if row % 3 == 0}
    policy = TailPolicy(PromptSampler(22, seed=1, retire_solved=1.0), 4, 2, num_epochs=4)

    def rounds(p, steps):
        out = []
        for step in range(steps):
            rnd, groups, _, _ = play(p, step, lambda row, k: 1000 if row % 5 == 0 else row + k,
                                     reward=lambda row, k: 1.0 if row in solved else float(k % 2))
            for g in groups:
                p.sampler.observe(g.prompt, [r >= 1 for r in g.rewards])
            out.append((rnd.kind, rnd.prompts, [g.prompt for g in groups]))
        return out

    rounds(policy, 3)
    before = (policy.sampler.state_dict(), policy.ledger.state_dict())
    ahead = rounds(copy.deepcopy(policy), 12)
    assert (policy.sampler.state_dict(), policy.ledger.state_dict()) == before
    assert rounds(policy, 12) == ahead and policy.sampler.epoch >= 2 and policy.sampler.retired


def test_filtered_groups_come_back_with_their_rewards():
    policy = SyncPolicy(PromptSampler(4, seed=0), 2, 2, filter_zero_variance=True)
    rnd = policy.start_round(0)
    decisions = [policy.on_finished(slot, k, Out(f"o{slot}.{k}"), 1.0 if slot == 0 else float(k))
                 for slot in range(2) for k in range(2)]
    filtered = [g for d in decisions for g in d.filtered]
    assert [(g.prompt, g.rewards) for g in filtered] == [(rnd.prompts[0], [1.0, 1.0])]


def test_config_accepts_tail_and_rejects_eta_below_one_by_name():
    from rollpacker.config import parse
    from rollpacker.schedule.tail import TailConfig

    config = parse(["schedule:tail", "--schedule.eta-prompts", "1.0", "--num-epochs", "2"])
    assert (config.policy, config.schedule.eta_prompts, config.schedule.eta_responses) == ("tail", 1.0, 1.25)
    with pytest.raises(ValueError, match="schedule.eta_prompts"):
        TailConfig(eta_prompts=0.8)
    # 0 became the paper's 1.25 (read as unset); NaN passed the check and crashed the first round's ceil
    for flag, value in (("eta_responses", 0.0), ("eta_prompts", float("nan")), ("eta_long", float("inf"))):
        with pytest.raises(ValueError, match=f"schedule.{flag}={value}: each η must be a finite number >= 1"):
            TailConfig(**{flag: value})


def test_episodes_default_to_no_choice_inside_a_group_and_the_papers_rule_stays_a_flag():
    """Keeping a group's first episodes biases an agent against its slow actions (bench parity): with an
    environment, tail's η_R defaults to 1 (prompts still over-provisioned and deferred whole, at the paper's η_P and
    η_L: raced harder, the agent learned its tool later, bench parity)."""
    from rollpacker.config import parse

    tools = ["--env.tools", "rollpacker.toy.tools:calculator"]
    assert parse(["schedule:tail", *tools]).schedule.eta_responses == 1.0
    assert parse(["schedule:tail", *tools, "--schedule.eta-responses", "1.25"]).schedule.eta_responses == 1.25
    assert parse(["schedule:tail"]).schedule.eta_responses == 1.25
    episodes, single = parse(["schedule:tail", *tools]).schedule, parse(["schedule:tail"]).schedule
    assert (episodes.eta_prompts, episodes.eta_long, single.eta_prompts, single.eta_long) == (1.25, 1.0, 1.25, 1.0)



def test_a_tail_presets_episodes_settle_their_default_with_the_flags(tmp_path):
    """A preset naming tail, episodes turned on by a flag: η_R is the episodes' default (it was settled as
    the preset's single-turn 1.25 before the flags were read); one the preset sets stays."""
    from rollpacker.config import parse

    preset, tools = tmp_path / "mine.toml", ["--env.tools", "rollpacker.toy.tools:calculator"]
    preset.write_text('[schedule]\npolicy = "tail"\n')
    assert parse(["--preset", str(preset), *tools]).schedule.eta_responses == 1.0
    assert parse(["--preset", str(preset)]).schedule.eta_responses == 1.25
    preset.write_text('[schedule]\npolicy = "tail"\neta_responses = 1.5\n')
    assert parse(["--preset", str(preset), *tools]).schedule.eta_responses == 1.5


def test_resume_refuses_a_checkpoint_of_another_policy(tmp_path):
    import json

    from rollpacker import checkpoint

    (tmp_path / "train_state.json").write_text(json.dumps({"step": 1, "policy": {"name": "sync"}}))
    (tmp_path / checkpoint.MARKER).write_text("")
    checkpoint.check(tmp_path, "sync")
    with pytest.raises(checkpoint.CheckpointError, match="schedule:sync"):
        checkpoint.check(tmp_path, "tail")


def test_ledger_refuses_double_launch_and_duplicate_checkpoint_entries():
    ledger = Ledger()
    ledger.launch((0, 1))
    with pytest.raises(ValueError, match="in_flight"):
        ledger.launch((0, 1))
    ledger.settle((0, 1), "trained")
    with pytest.raises(ValueError, match="not in flight"):
        ledger.settle((0, 1), "trained")
    with pytest.raises(ValueError, match="twice"):
        Ledger().load_state_dict({"trained": [[0, 1]], "filtered": [], "queue": [[0, 1]]})


def test_the_zero_variance_filter_leaves_out_an_episode_whose_environment_failed():
    """A failed episode's reward (0) is out of its group's advantages: a group whose working episodes all solved it
    has no signal, though the failed one made the rewards differ."""
    from types import SimpleNamespace

    from rollpacker.schedule.base import zero_variance

    ok, failed = Out("a"), SimpleNamespace(finish_reason="error")
    assert zero_variance([ok, ok, failed], [1.0, 1.0, 0.0]) and not zero_variance([ok, ok], [1.0, 0.0])
    assert zero_variance([failed, failed], [0.0, 0.0])
