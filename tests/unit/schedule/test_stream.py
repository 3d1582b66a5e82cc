"""Stream training: the trigger and KV projection (pure logic), and real gloo ranks for the
equivalence with synchronous steps and for whole runs with scale-downs."""

from __future__ import annotations

import pytest
from support.fakes import InstantRewards, single_turn_runner

from rollpacker.schedule.scale_down import (
    ScaleDownDecider,
    StepCost,
    StreamConfig,
    Trigger,
    decode_seconds,
    peak_kv_tokens,
    steps_left,
)


def test_adaptive_trigger_looks_at_5_percent_milestones_between_20_and_50():
    t = Trigger()
    seen = [done for done in range(0, 101) if t.due(done, 100)]
    assert seen == [20, 25, 30, 35, 40, 45, 50]
    t.reset()  # jumps: a look needs a new milestone and 5% new completions since the last look
    assert [t.due(d, 100) for d in (10, 22, 24, 26, 31, 60)] == [False, True, False, False, True, False]


def test_fixed_trigger_fires_once():
    t = Trigger(fixed=0.3)
    assert [t.due(d, 10) for d in (2, 3, 4, 5)] == [False, True, False, False]


def test_peak_kv_projection_by_hand():
    # No history: every request runs to max_new_tokens=10. Two requests (prompt 5, generated 2) and
    # (prompt 3, generated 6): 8 and 4 steps left; the peak is just before the shorter one ends:
    # 7 + 3 steps + 9 + 3 steps = 22 tokens (then only the first is left: 7 + 7 = 14).
    assert peak_kv_tokens([(5, 2), (3, 6)], [], 10) == 22
    # History says responses end at 4 tokens: the first request (at 2) is projected to end at 4; the
    # second (at 6) has outgrown the history and runs to the maximum.
    assert peak_kv_tokens([(5, 2), (3, 6)], [4, 4, 4], 10) == (7 + 1) + (9 + 1)
    assert peak_kv_tokens([], [1, 2], 10) == 0


def test_decode_projection_by_hand():
    # No history: every request runs to max_new_tokens; with history [4, 8], a request at 2 tokens
    # ends at 8 (the 0.9 quantile of the longer ones), one at 5 also at 8, one at 9 at the max.
    assert steps_left([(3, 2), (3, 5), (3, 9)], [4, 8], 10) == [6, 3, 1]
    # Requests with 1, 2 and 3 steps left, a step costing b (requests per replica): on one replica
    # 3 + 2 + 1 = 6 s; on two, ceil(3/2) + 1 + 1 = 4 s.
    assert decode_seconds([3, 1, 2], 1, lambda b: b) == 6
    assert decode_seconds([3, 1, 2], 2, lambda b: b) == 4


def test_step_cost_fit_by_hand():
    cost = StepCost()
    for b, t in ((1, 1.5), (2, 2.0), (3, 2.5)):
        cost.observe(b, t)
    assert cost.fit() is None  # too few polls
    cost.observe(4, 3.0)
    cost.observe(0, 9.0)  # an idle poll says nothing
    assert cost.fit() == pytest.approx((1.0, 0.5))
    flat = StepCost()
    for _ in range(5):
        flat.observe(2, 1.0)
    assert flat.fit() is None  # one batch size: no slope


@pytest.mark.parametrize("a,c,scales", [(0.0, 1.0, False), (1.0, 0.0, True)])
def test_throughput_criterion_weighs_the_slowdown_against_the_training_it_hides(a, c, scales):
    """Four requests with 10 steps left on 2 replicas. Compute-bound steps (a step costs its batch,
    as on these cores): 20 s left as they are, 40 s on one replica; the freed half trains 20 s of
    the 30 s step, which does not beat the 20 s lost. Memory-bound steps (a fixed cost, as on a
    GPU): 10 s either way, so the scale-down pays."""
    decider = ScaleDownDecider(StreamConfig(criterion="throughput"), num_replicas=2, kv_capacity_tokens=10 ** 6,
                        max_new_tokens=10)
    decider.new_round("short")
    decider.train_seconds = 30.0
    for b in (1, 2, 3, 4):
        decider.step_cost.observe(b, a + c * b)
    assert decider.pays([(5, 0)] * 4) == scales
    assert decider.last == pytest.approx({"stay": 10 * (a + 2 * c), "scaled": 10 * (a + 4 * c), "migration": 0.0,
                                          "saved": min(30.0, 5 * (a + 4 * c))})


def test_throughput_criterion_learns_migration_and_realized_savings():
    """Memory-bound steps (1 s each, 10 steps left either way, 5 s of training saved by the freed
    half): it pays until the run shows that recomputing the freed half's 10 tokens costs as much
    (at 0.5 s a token), or, for a round kind whose last scale-down saved only 0.5 s, that a cheaper
    recomputation (at 0.05 s a token) costs as much as that."""
    decider = ScaleDownDecider(StreamConfig(criterion="throughput"), num_replicas=2, kv_capacity_tokens=10 ** 6,
                        max_new_tokens=10)
    for b in (1, 2, 3, 4):
        decider.step_cost.observe(b, 1.0)
    decider.new_round("long")
    decider.learn("short", train_seconds=30.0, saved=0.5)  # realized by short rounds only
    assert decider.pays([(5, 0)] * 4) and decider.last["saved"] == 5.0
    decider.learn_migration(seconds=2.0, tokens=4)
    assert not decider.pays([(5, 0)] * 4) and decider.last["migration"] == 5.0
    decider.learn_migration(seconds=0.2, tokens=4)
    assert decider.pays([(5, 0)] * 4) and decider.last["migration"] == pytest.approx(0.5)
    decider.new_round("short")
    assert not decider.pays([(5, 0)] * 4) and decider.last["saved"] == 0.5


class Sink:
    """The freed ranks' end of a stream round: every batch of groups (their prompts)."""

    def __init__(self):
        self.batches = []

    def send(self, groups) -> None:
        if groups:
            self.batches.append([g.prompt for g in groups])


def four_prompts_on_two_replicas():
    """A sync round of 4 prompts x 2 responses, on 2 replicas (round-robin per request)."""
    from rollpacker.data.dataset import PromptSampler
    from rollpacker.schedule.round import RoundState
    from rollpacker.schedule.sync import SyncPolicy

    policy = SyncPolicy(PromptSampler(4), 4, 2)
    state = RoundState(0, policy.start_round(0), policy, num_replicas=2)
    return state


def test_a_stream_round_scales_down_once_times_the_migration_and_feeds_complete_groups():
    from types import SimpleNamespace

    from rollpacker.schedule.round import Round, Seen
    from rollpacker.schedule.scale_down import StreamRound

    state, sink = four_prompts_on_two_replicas(), Sink()
    decider = ScaleDownDecider(StreamConfig(trigger=0.25), num_replicas=2, kv_capacity_tokens=100, max_new_tokens=8)
    hooks = StreamRound(decider)
    rnd = Round(state, InstantRewards(lambda row, rid: 1.0), single_turn_runner(), hooks)
    turns = rnd.start(now=9.0).add
    assert hooks.priority(3) == 0 and rnd.scaled is None
    first = [turn.id for _, _, turn in turns[:2]]  # slot 0's two responses, on replicas 0 and 1
    outputs = [SimpleNamespace(id=rid, prompt_ids=[1, 2], token_ids=[3] * 4, logprobs=[-0.5] * 4,
                               finish_reason="stop") for rid in first]
    actions = rnd.poll(Seen(now=10.0, finished=outputs), lambda: [(2, 1)] * len(state.outstanding))
    sink.send(actions.feed)
    moved = [rid for _, rid in actions.abort]
    # 1 of 4 prompts complete: the fixed 25% trigger fires; replica 1's outstanding requests migrate
    assert moved == sorted(rid for rid in state.outstanding if state.replica(rid) == 1) and len(moved) == 3
    assert {replica for replica, _ in actions.abort} == {1}
    assert (rnd.scaled.at, rnd.scaled.completed_frac, state.active, list(decider.history)) == (10.0, 0.25, 1, [4, 4])
    assert sink.batches == [[state.slots[0]]]  # the complete, scored group goes to the freed ranks
    aborted = [SimpleNamespace(id=rid, prompt_ids=[1, 2], token_ids=[3], logprobs=[-0.5], finish_reason="abort")
               for rid in moved]
    aborted[-1].finish_reason = "length"  # its engine (SGLang's) finished it before the abort: whole, not resumed
    actions = rnd.poll(Seen(now=11.0, aborted=aborted))
    assert not actions.scale_down  # once per round
    assert [o for _, o in actions.resume] == aborted[:2] and rnd.scaled.migration_s is None  # resumed, not back yet
    actions = rnd.poll(Seen(now=12.5))
    assert actions.resume == [] and rnd.scaled.migration_s == 2.5  # the next report: back and prefilled
    stats = hooks.finish(rnd.scaled, rnd.num_fed)
    assert rnd.scaled is not None and stats == {"stream/scaled_down": 1.0, "stream/trigger_completed_frac": 0.25,
                                                "time/migration": 2.5, "stream/streamed_groups": 1.0}
    assert decider.migration_seconds_per_token == 2.5 / (2 * 3)  # 2 migrated requests of 2 + 1 tokens


def test_a_pipe_round_runs_on_the_rollout_pool_from_the_start_frontier_first():
    from rollpacker.schedule.round import Round, RoundHooks, Seen
    from rollpacker.schedule.scale_down import PipeRound

    state = four_prompts_on_two_replicas()
    decider = ScaleDownDecider(StreamConfig(), num_replicas=2, kv_capacity_tokens=100, max_new_tokens=8)
    hooks = PipeRound(decider)
    rnd = Round(state, InstantRewards(lambda row, rid: 1.0), single_turn_runner(), hooks)
    start = rnd.start(now=5.0)
    assert start.scale_down and state.active == 1 and {state.replica(rid) for rid in state.outstanding} == {0}
    assert [hooks.priority(slot) for slot in (0, 3)] == [0, 3]  # earliest group first
    assert not hooks.scale_down_now(lambda: []) and rnd.poll(Seen(now=6.0)).resume == []
    stats = hooks.finish(rnd.scaled, rnd.num_fed)
    assert rnd.scaled is not None and stats["stream/scaled_down"] == 0.0 and stats["time/migration"] == 0.0
    none = RoundHooks()  # a round without a stream trainer: nothing happens
    assert not none.begin(state) and none.priority(3) == 0 and none.finish(None, 0) == {}


class LateRewards(InstantRewards):
    """Each score is ready a poll after its response finished, as reward workers' are."""

    def __init__(self, reward):
        super().__init__(reward)
        self.next = []

    def poll(self):
        done, self.done, self.next = self.next, [], self.done
        return done


def test_a_one_shot_fetch_waits_for_a_scored_group_and_a_pipe_round_feeds_all_round():
    """stream.fetch_cap fetches once, capped: at the scale-down the complete group is not scored yet, so the
    shot waits for it (it was spent on nothing). RolloutPipe feeds the train pool every group, fetch_cap or not."""
    from types import SimpleNamespace

    from rollpacker.schedule.round import Round, Seen
    from rollpacker.schedule.scale_down import PipeRound, StreamRound

    def finished(*rids):
        return [SimpleNamespace(id=rid, prompt_ids=[1, 2], token_ids=[3] * 4, logprobs=[-0.5] * 4,
                                finish_reason="stop") for rid in rids]

    config = StreamConfig(trigger=0.25, fetch_cap=0.5)
    state = four_prompts_on_two_replicas()
    rnd = Round(state, LateRewards(lambda row, rid: 1.0), single_turn_runner(),
                StreamRound(ScaleDownDecider(config, num_replicas=2, kv_capacity_tokens=100, max_new_tokens=8)))
    rnd.start(now=0.0)
    actions = rnd.poll(Seen(now=1.0, finished=finished("0:0:0", "0:0:1")), lambda: [(2, 1)] * len(state.outstanding))
    assert actions.scale_down and actions.feed == []  # prompt 0 complete, its scores not in
    aborted = [SimpleNamespace(id=rid, prompt_ids=[1, 2], token_ids=[3], logprobs=[-0.5], finish_reason="abort")
               for _, rid in actions.abort]
    fed = rnd.poll(Seen(now=2.0, aborted=aborted)).feed
    fed += rnd.poll(Seen(now=3.0, finished=finished("0:1:0", "0:1:1", "0:2:0", "0:2:1"))).feed
    fed += rnd.poll(Seen(now=4.0)).feed
    assert [g.prompt for g in fed] == [state.slots[0]]  # once (what is scored then, up to 0.5 of the 4 groups)

    state = four_prompts_on_two_replicas()
    rnd = Round(state, InstantRewards(lambda row, rid: 1.0), single_turn_runner(),
                PipeRound(ScaleDownDecider(config, num_replicas=2, kv_capacity_tokens=100, max_new_tokens=8)))
    rnd.start(now=0.0)
    fed = [len(rnd.poll(Seen(now=1.0 + s, finished=finished(f"0:{s}:0", f"0:{s}:1"))).feed) for s in range(4)]
    assert fed == [1, 1, 1, 1]
