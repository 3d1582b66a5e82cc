"""SortedRL (``sorted``, ``sorted_partial``) on scripted completion orders, with the ledger checked after
every event, and through the real controller; importance weights by hand; a resume across a weight
change on the real toy model; and two epochs on 2 gloo ranks."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from rollpacker.data.dataset import PromptSampler
from rollpacker.env.episode import Response
from rollpacker.rollout.engine import Output
from rollpacker.schedule.base import request_id
from rollpacker.schedule.sorted import SortedPolicy
from rollpacker.train.config import TrainConfig
from rollpacker.train.losses import policy_objective


def logprob(step: int) -> float:
    """The log-prob the script gives every token sampled at ``step``: tells the segments apart."""
    return -0.1 * (step + 1)


def play(policy, step, length, reward=lambda row, k: float(k % 2)):
    """Drive one round like the controller and the engines: every running response gains one token per
    tick (its token id is the step that sampled it), response (row, k) finishes at ``length(row, k)``
    tokens; when the policy ends the round, the responses still running are aborted with what they have.

    Returns (round, groups, aborted outputs)."""
    rnd = policy.start_round(step)
    rows = rnd.prompts
    running: dict[tuple[int, int], Output] = {}
    for s, row in enumerate(rows):
        for k in range(rnd.num_responses):
            earlier = rnd.carried.get((s, k))
            if earlier is None or earlier.finish_reason == "abort":
                out = Response(id=request_id(step, s, k), prompt_ids=[row], step_rewards={0: 0.5})  # an episode's
                if earlier is not None:  # resumed: the partial tokens and log-probs, then new ones
                    out.token_ids, out.logprobs = list(earlier.token_ids), list(earlier.logprobs)
                running[(s, k)] = out
    while running:
        s, k = min(running, key=lambda sk: (length(rows[sk[0]], sk[1]) - len(running[sk].token_ids), sk))
        ticks = length(rows[s], k) - len(running[(s, k)].token_ids)
        for out in running.values():
            out.token_ids += [step] * ticks
            out.logprobs += [logprob(step)] * ticks
        out = running.pop((s, k))
        out.finish_reason = "stop"
        decision = policy.on_finished(s, k, out, reward(rows[s], k))
        policy.ledger.check(policy.sampler)
        assert not decision.abort and not decision.launch  # sorted launches the whole buffer at the start
        if decision.round_done:
            break
    aborted = list(running.values())
    for out in aborted:
        out.finish_reason = "abort"
    return rnd, policy.end_round(aborted), aborted


def sorted_policy(num_rows=40, p0=2, r0=2, n=3, **kw):
    return SortedPolicy(PromptSampler(num_rows, seed=1), p0, r0, num_batches=n, **kw)


def by_row(length_of_row):
    return lambda row, k: length_of_row(row) + k


# --- load groups and early termination ----------------------------------------------------------


def test_load_group_oversubscribes_and_loads_nothing_until_consumed():
    policy = sorted_policy(p0=2, r0=2, n=3)
    rnd, groups, aborted = play(policy, 0, by_row(lambda row: 10 + row))
    loaded = rnd.prompts
    assert len(loaded) == 6 and rnd.num_responses == 2 and rnd.keep == 2 and rnd.kind == "sorted"
    assert [g.prompt for g in groups] == sorted(loaded)[:2]  # the shortest first
    assert policy.sampler.position == 6 and len(aborted) == 4 * 2
    assert policy.stats()["sched/loaded"] == 6 and policy.stats()["sched/buffer_len"] == 4
    trained = [g.prompt for g in groups]
    for step in (1, 2):  # the rest of the load group, nothing new drawn
        rnd, groups, _ = play(policy, step, by_row(lambda row: 10 + row))
        assert sorted(rnd.prompts) == sorted(set(loaded) - set(trained)) and policy.sampler.position == 6
        assert policy.stats()["sched/loaded"] == 0
        trained += [g.prompt for g in groups]
    assert trained == sorted(loaded) and not policy.ledger.queue
    rnd, _, _ = play(policy, 3, by_row(lambda row: 10 + row))  # consumed: the next load group
    assert len(rnd.prompts) == 6 and set(rnd.prompts).isdisjoint(loaded) and policy.sampler.position == 12


@pytest.mark.parametrize("partial", [False, True])
def test_the_last_step_trains_every_prompt_it_launches(partial):
    """The run's last round completes the whole buffer (its cut would leave the longest prompts untrained for
    good), and a load group starting there loads only the P0 prompts it keeps."""
    policy = sorted_policy(p0=2, r0=2, n=3, partial=partial, last_step=1)
    rnd0, groups0, _ = play(policy, 0, by_row(lambda row: 10 + row))
    rnd, groups, aborted = play(policy, 1, by_row(lambda row: 10 + row))
    assert rnd.keep == 4 and not aborted and sorted(g.prompt for g in groups) == sorted(rnd.prompts)
    assert sorted(g.prompt for g in groups0 + groups) == sorted(rnd0.prompts) and not policy.ledger.queue
    assert policy.ledger.counts() == Counter(trained=6)
    policy = sorted_policy(p0=2, r0=2, n=3, partial=partial, last_step=0)
    rnd, groups, _ = play(policy, 0, by_row(lambda row: 10 + row))
    assert len(rnd.prompts) == len(groups) == 2 and policy.ledger.counts() == Counter(trained=2)


def test_early_termination_counts_complete_groups_only():
    policy = sorted_policy(p0=2, r0=2, n=2)
    rnd = policy.start_round(0)
    policy = sorted_policy(p0=2, r0=2, n=2)
    shortest = min(rnd.prompts)
    rnd, groups, aborted = play(policy, 0, lambda row, k: 1000 if (row, k) == (shortest, 1) else 10 + row + k)
    # the shortest prompt's first response is the first to finish, but its group is not complete
    assert sorted(g.prompt for g in groups) == sorted(rnd.prompts)[1:3]
    assert all(len(g.outputs) == 2 and g.staleness == [0, 0] for g in groups)
    cut = 11 + sorted(rnd.prompts)[2]  # when the second group completes
    assert sorted(len(o.token_ids) for o in aborted) == [cut] * 3
    assert policy.stats()["sched/deferred"] == 2


def test_on_policy_returns_prompts_with_everything_thrown_away():
    policy = sorted_policy(p0=2, r0=2, n=2)
    slow = {}

    def length(row, k):
        slow.setdefault("row", row)  # the first prompt asked about keeps one slow response
        return 500 if (row, k) == (slow["row"], 1) else 10 + row + k

    _, groups, _ = play(policy, 0, length)
    assert slow["row"] not in [g.prompt for g in groups]
    rnd, groups, _ = play(policy, 1, length)
    assert rnd.carried == {} and slow["row"] in rnd.prompts
    assert [g.prompt for g in groups if g.prompt == slow["row"]] == [slow["row"]]
    for g in groups:  # every token sampled by this step's weights
        assert all(set(o.token_ids) == {1} for o in g.outputs) and g.staleness == [0, 0]
    assert policy.stats()["sched/staleness_max"] == 0 and policy.stats()["sched/resumed"] == 0


def test_partial_mode_keeps_partials_and_finished_siblings_and_resumes_them():
    slow = {}

    def length(row, k):
        slow.setdefault("row", row)  # the first prompt asked about keeps one slow response
        return 40 if (row, k) == (slow["row"], 1) else 10 + row + k

    policy = sorted_policy(p0=2, r0=2, n=2, partial=True)
    _, _, aborted = play(policy, 0, length)
    rnd = policy.start_round(1)
    slot = rnd.prompts.index(slow["row"])
    finished, partial = rnd.carried[(slot, 0)], rnd.carried[(slot, 1)]
    assert finished.finish_reason == "stop" and set(finished.token_ids) == {0}
    assert partial.finish_reason == "abort" and partial in aborted and 0 < len(partial.token_ids) < 40
    assert len(rnd.carried) == 4 and policy.stats()["sched/resumed"] == 3  # every aborted response resumes
    policy.end_round([Output(id=request_id(1, s, k), prompt_ids=[], finish_reason="abort")
                      for s in range(len(rnd.prompts)) for k in range(2) if (s, k) != (slot, 0)])
    rnd = policy.start_round(2)  # aborts that brought no new token change nothing
    assert rnd.carried[(rnd.prompts.index(slow["row"]), 1)] is partial
    policy.end_round([])

    policy, slow = sorted_policy(p0=2, r0=2, n=2, partial=True), {}
    play(policy, 0, length)
    _, groups, _ = play(policy, 1, length)  # the slow prompt completes with its kept and its resumed response
    [group] = [g for g in groups if g.prompt == slow["row"]]
    assert group.outputs[0].token_ids == finished.token_ids
    resumed = group.outputs[1]
    assert len(resumed.token_ids) == 40 and resumed.token_ids[:len(partial.token_ids)] == partial.token_ids
    assert set(resumed.token_ids) == {0, 1} and group.staleness == [1, 1]
    assert resumed.logprobs == [logprob(t) for t in resumed.token_ids]  # each token keeps its sampling log-prob


@pytest.mark.parametrize("partial", [False, True])
def test_a_response_finishing_after_the_cut_off(partial):
    policy = sorted_policy(p0=1, r0=2, n=3, partial=partial)
    policy.start_round(0)

    def out(s, k):
        return Output(id=request_id(0, s, k), prompt_ids=[], token_ids=[0], logprobs=[-1.0], finish_reason="stop")

    policy.on_finished(0, 0, out(0, 0), None)
    assert policy.on_finished(0, 1, out(0, 1), None).round_done
    policy.on_finished(1, 0, out(1, 0), None)  # late, would not complete its group
    policy.on_finished(2, 0, out(2, 0), None)
    assert policy.on_finished(2, 1, out(2, 1), None).complete == []  # late, would complete it: dropped
    assert len(policy.end_round([])) == 1
    rnd = policy.start_round(1)  # slots 1 and 2 of round 0 are slots 0 and 1 now
    assert set(rnd.carried) == ({(0, 0), (1, 0)} if partial else set())


@pytest.mark.parametrize("partial,filtered", [(False, False), (True, False), (True, True)])
def test_a_response_the_rounds_end_aborted_after_it_finished(partial, filtered):
    """SGLang may finish a response before the round end's abort reaches it: the abort returns it
    whole. Partial mode keeps it, as finished, unless it would complete its group (then it reruns),
    or the zero-variance filter needs its reward, which the abort did not bring (then it reruns too)."""
    policy = sorted_policy(p0=1, r0=2, n=3, partial=partial, filter_zero_variance=filtered)
    policy.start_round(0)

    def out(s, k, reason):
        return Output(id=request_id(0, s, k), prompt_ids=[], token_ids=[0, 0], logprobs=[-1.0] * 2,
                      finish_reason=reason)

    policy.on_finished(0, 0, out(0, 0, "stop"), 0.0)
    assert policy.on_finished(0, 1, out(0, 1, "stop"), 1.0).round_done
    assert len(policy.end_round([out(1, 0, "length"), out(1, 1, "abort"), out(2, 0, "stop"), out(2, 1, "length")])) == 1
    rnd = policy.start_round(1)  # slots 1 and 2 of round 0 are slots 0 and 1 now
    if not partial:
        assert rnd.carried == {}
        return
    if filtered:
        assert {sk: o.finish_reason for sk, o in rnd.carried.items()} == {(0, 1): "abort"}
        return
    assert {sk: o.finish_reason for sk, o in rnd.carried.items()} == {(0, 0): "length", (0, 1): "abort",
                                                                      (1, 0): "stop"}
    assert policy.stats()["sched/resumed"] == 1  # the partial one; slot 1's second response runs afresh


# --- staleness and the ledger -------------------------------------------------------------------


def lengths(seed):
    """A long-tailed length per (row, response), fixed by the seed."""
    return lambda row, k: 5 + int(200 * (((row * 7919 + k * 104729 + seed * 31) % 1000) / 1000) ** 4)


@pytest.mark.parametrize("partial", [False, True])
def test_two_epochs_train_every_prompt_once_and_staleness_is_exact(partial):
    num_rows = 17
    policy = sorted_policy(num_rows=num_rows, p0=3, r0=3, n=2, partial=partial, num_epochs=2)
    step, seen = 0, []
    while not policy.done():
        rnd, groups, _ = play(policy, step, lengths(step // 5))
        assert len(groups) == rnd.keep == min(3, len(rnd.prompts))
        staleness = []
        for g in groups:  # recomputed from the tokens: each one's id is the step that sampled it
            assert g.staleness == [step - min(o.token_ids) for o in g.outputs]
            assert all(o.logprobs == [logprob(t) for t in o.token_ids] for o in g.outputs)
            assert all(o.finish_reason == "stop" for o in g.outputs)
            staleness += g.staleness
        stats = policy.stats()
        assert stats["sched/staleness_max"] == max(staleness)
        assert stats["sched/staleness_mean"] == pytest.approx(sum(staleness) / len(staleness))
        seen += staleness
        step += 1
        assert step < 100
    for epoch in (0, 1):
        assert policy.ledger.rows(epoch, "trained") == list(range(num_rows))
    assert policy.ledger.counts() == Counter(trained=2 * num_rows) and not policy.buffer
    assert (max(seen) > 0) == partial
    with pytest.raises(RuntimeError, match="no prompt left"):
        policy.start_round(step)


def test_zero_variance_groups_are_filtered_and_do_not_count():
    policy = sorted_policy(num_rows=12, p0=2, r0=2, n=2, num_epochs=1, filter_zero_variance=True)
    assert policy.needs_rewards
    step = filtered = 0
    while not policy.done():
        _, groups, _ = play(policy, step, by_row(lambda row: 10 + row), lambda row, k: float(row % 3 == 0 or k))
        assert all(g.prompt % 3 for g in groups) and len(groups) <= 2
        filtered += policy.stats()["sched/filtered"]
        step += 1
    state = policy.ledger.counts()
    assert state == Counter(trained=8, filtered=4) and filtered == 4


def test_state_dict_round_trip_mid_load_group():
    length = lengths(3)
    policy = sorted_policy(num_rows=30, p0=2, r0=2, n=3, partial=True)
    play(policy, 0, length)
    between = json.loads(json.dumps(policy.state_dict()))
    assert between["buffer"] and all(len(e["responses"]) == 2 for e in between["buffer"])
    rnd = policy.start_round(1)
    during = json.loads(json.dumps(policy.state_dict()))  # mid-round: the buffer as the round found it
    assert during["buffer"] == between["buffer"]
    assert sorted(map(tuple, during["ledger"]["queue"])) == sorted((0, r) for r in rnd.prompts)
    policy.end_round([])
    results = []
    for state in (between, during):
        resumed = sorted_policy(num_rows=30, p0=2, r0=2, n=3, partial=True)
        resumed.load_state_dict(state)
        resumed.ledger.check(resumed.sampler)
        assert all(isinstance(o, Response) and o.step_rewards == {0: 0.5}  # an episode's, its positions numbers
                   for e in resumed.buffer.values() for o in e.outputs if o is not None)
        rnd, groups, _ = play(resumed, 1, length)
        assert len(rnd.carried) == sum(r["output"] is not None for e in state["buffer"] for r in e["responses"])
        results.append(sorted((g.prompt, [o.token_ids for o in g.outputs], g.staleness) for g in groups))
    assert results[0] == results[1] and any(s for _, _, st in results[0] for s in st)
    with pytest.raises(ValueError, match="rollout.group_size=3"):
        sorted_policy(num_rows=30, p0=2, r0=3, n=3, partial=True).load_state_dict(between)


def test_the_controller_resumes_partials_and_scores_kept_responses_again():
    """Through the real controller (one rank, an engine that adds one token per step)."""
    from support.fakes import InstantRewards, LengthTableEngine, OneReplica

    from rollpacker.exchange import RoundLeader, run_round
    from rollpacker.rollout.engine import SamplingParams

    class ResumingEngine(LengthTableEngine):
        def add(self, req):
            super().add(req)
            if req.resume_from is not None:
                self.running[req.id].token_ids = list(req.resume_from.token_ids)
                self.running[req.id].logprobs = list(req.resume_from.logprobs)

        def step(self):
            self.generated += len(self.running)
            return super().step()

    def length(row, k):  # even rows: the second response is slow
        return 5 + row % 7 + (40 if k == 1 and row % 2 == 0 else 0)

    def reward(row, rid):
        return float((row + int(rid.split(":")[2])) % 2)

    engine = ResumingEngine(length)
    policy = SortedPolicy(PromptSampler(12, seed=0), 2, 2, num_batches=2, partial=True, num_epochs=1)
    step, kept, stale, generated, trained = 0, [], [], 0, 0
    while not policy.done():
        engine.generated = 0
        leader = RoundLeader(policy=policy, rows=list(range(12)), encode=lambda row: [row],
                             rewards=InstantRewards(reward), sampling=SamplingParams(max_new_tokens=1000))
        result = run_round(OneReplica(), engine, 1, leader.round(step, policy.start_round(step)))
        assert result.generated_tokens == engine.generated  # resumed prefixes are not counted twice
        # Every token is trained, at this step or after a later one: none wasted, though a step trains what others made.
        assert result.wasted_tokens == 0 and result.metrics([], [], [])["rollout/wasted_tokens"] == 0
        generated, trained = generated + result.generated_tokens, trained + sum(result.trained_lengths)
        for g in result.groups:
            assert g.rewards == [reward(g.prompt, o.id) for o in g.outputs]
            assert [len(o.token_ids) for o in g.outputs] == [length(g.prompt, k) for k in range(2)]
            kept += [o for o in g.outputs if int(o.id.split(":")[0]) < step]  # finished in an earlier round
            stale += g.staleness
        step += 1
    assert kept and max(stale) >= 1 and policy.ledger.rows(0, "trained") == list(range(12))
    assert generated == trained and policy.held_tokens() == 0


# --- config -------------------------------------------------------------------------------------


def test_config_accepts_sorted_and_asks_partial_mode_for_a_correction():
    from rollpacker.config import Config, parse
    from rollpacker.schedule.sorted import SortedConfig, SortedPartialConfig
    from rollpacker.train.config import TrainConfig

    config = parse(["schedule:sorted", "--schedule.sorted-batches", "2"])
    assert (config.policy, config.schedule.sorted_batches, config.train.rollout_correction) == ("sorted", 2, "none")
    with pytest.raises(ValueError, match="sorted_partial with train.rollout_correction='none'"):
        Config(schedule=SortedPartialConfig())
    assert parse(["schedule:sorted_partial", "--train.rollout-correction", "token_tis"]).train.rollout_is_high == 2.0
    with pytest.raises(ValueError, match="schedule.sorted_batches"):
        SortedConfig(sorted_batches=0)
    with pytest.raises(ValueError, match="train.rollout_is_low=0.5 and train.rollout_is_high=0.5"):
        TrainConfig(rollout_is_high=0.5)


# --- importance sampling ------------------------------------------------------------------------


def test_stale_tokens_are_weighted_by_truncated_importance_sampling():
    """Tokens of a partial response resumed under newer weights: the trainer's log-probs (before the
    update) over the engine's, which sampled them, weight each token's term, truncated at 2."""
    proximal = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    behavior = proximal - torch.tensor([[0.0, math.log(3), -math.log(2), 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)  # the last token is padding
    for adv in (1.0, -1.0):
        # token_tis: ratio 1 vs the proximal policy, each token's -A weighted by (1, min(3, 2), 0.5): -3.5 A.
        for mode, want, grad in (("token_tis", -3.5 * adv, [-adv, -2 * adv, -0.5 * adv]),
                                 ("none", -3.0 * adv, [-adv] * 3)):
            logp = proximal.clone().requires_grad_(True)
            loss, stats = policy_objective(logp, logp.detach(), behavior, torch.full((1, 4), adv), mask,
                                           TrainConfig(rollout_correction=mode))
            torch.testing.assert_close(loss, torch.tensor(want), msg=f"{mode} A={adv}")
            torch.testing.assert_close(stats["rollout_ratio"], torch.tensor(4.5))  # exp(proximal - behavior): 1, 3, 0.5
            loss.backward()
            torch.testing.assert_close(logp.grad, torch.tensor([[*grad, 0.0]]), msg=f"{mode} A={adv}")


# --- resume across a weight change, on the real toy model ----------------------------------------


def test_partial_resume_across_a_weight_change_concatenates_each_segments_logprobs():
    from rollpacker.model import CausalAttention, load_model
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.engine import Request, SamplingParams, generate
    from rollpacker.rollout.torch_engine import TorchEngine
    from rollpacker.toy.model import toy_model_dir

    def recompute(model, prompt, tokens):
        """Teacher-forced log-probs of ``tokens`` after ``prompt`` (temperature 1)."""
        seq = torch.tensor(prompt + tokens)
        with torch.no_grad():
            logits = model.logits(model(seq, torch.arange(len(seq)), CausalAttention([len(seq)])))
        picked = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1:-1]
        return picked.gather(1, torch.tensor(tokens)[:, None])[:, 0]

    cpu = torch.device("cpu")
    old_model, new_model = (load_model(toy_model_dir(), cpu, torch.float32) for _ in range(2))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine = TorchEngine(load_model(toy_model_dir(), cpu, torch.float32), EngineConfig(block_size=4))
    prompt = [5, 6, 7, 8, 9, 10, 11]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    engine.add(Request(id="a", prompt_ids=prompt, params=params))
    for _ in range(9):
        engine.step()
    partial = engine.abort("a")
    cut = len(partial.token_ids)
    assert partial.finish_reason == "abort" and 0 < cut < 24
    engine.update_weights(new_model.state_dict().items())  # the trainer's step
    out = generate(engine, [Request(id="a2", prompt_ids=prompt, params=params, resume_from=partial)])["a2"]
    assert len(out.token_ids) == 24 and out.token_ids[:cut] == partial.token_ids
    assert out.logprobs[:cut] == partial.logprobs
    got = torch.tensor(out.logprobs)
    old_lp, new_lp = recompute(old_model, prompt, out.token_ids), recompute(new_model, prompt, out.token_ids)
    torch.testing.assert_close(got[:cut], old_lp[:cut], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[cut:], new_lp[cut:], atol=1e-5, rtol=0)
    assert (old_lp - new_lp).abs().max() > 1e-2  # the weight change shows: each segment has its own weights


# --- for real: 2 gloo ranks ---------------------------------------------------------------------


def test_the_filter_decides_on_a_kept_responses_score_at_the_step_that_trains_it():
    """sorted_partial scores a finished response it kept from an earlier round again at the step that trains it
    (a reward function may read trainer_state.global_step); the zero-variance filter decides on that score."""
    from support.fakes import single_turn_runner

    from rollpacker.rollout.types import Output
    from rollpacker.schedule.round import Round, RoundState, Seen

    step = [0]
    rewards = {("0:0:0", 0): 1.0, ("0:0:0", 1): 0.0, ("0:1:0", 0): 1.0, ("0:1:1", 0): 0.0, ("1:0:1", 1): 1.0}

    class Scores:  # each response scored at once, by the step
        def __init__(self):
            self.ready = []

        def submit(self, key, row, output, held_out=False):
            self.ready.append((key, rewards[key, step[0]]))

        def submit_group(self, keys, row, outputs):
            pass

        def poll(self):
            ready, self.ready = self.ready, []
            return ready

        def wait(self, keys):
            return self.poll()

    def out(rid, n, reason="stop"):
        return Output(id=rid, prompt_ids=[1, 2], token_ids=[3] * n, logprobs=[-0.5] * n, finish_reason=reason)

    policy = sorted_policy(num_rows=4, p0=1, r0=2, n=2, partial=True, filter_zero_variance=True)
    rnd = Round(RoundState(0, policy.start_round(0), policy, num_replicas=1), Scores(), single_turn_runner())
    rnd.start()
    rnd.poll(Seen(now=1.0, finished=[out("0:0:0", 3)]))  # slot 0 keeps this one; slot 1 completes, ending the round
    cut = rnd.poll(Seen(now=2.0, finished=[out("0:1:0", 3), out("0:1:1", 3)])).abort
    rnd.end([out(rid, 2, "abort") for _, rid in cut])
    assert rnd.settle() and len(rnd.finish().groups) == 1
    step[0] = 1  # 0:0:0 scores 0 now; with its new sibling's 1, the group has signal
    rnd = Round(RoundState(1, policy.start_round(1), policy, num_replicas=1), Scores(), single_turn_runner())
    rnd.start()
    rnd.poll(Seen(now=3.0, finished=[out("1:0:1", 5)]))
    rnd.end([])
    assert rnd.settle()
    outcome = rnd.finish()
    assert [g.rewards for g in outcome.groups] == [[0.0, 1.0]] and outcome.filtered == []
