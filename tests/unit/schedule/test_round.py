"""The round's protocol alone (``schedule/round.py``): scripted observations in, every action out.
No engine, no process: what both drivers (the exchange and the simulator) carry out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from support.fakes import single_turn_runner

from rollpacker.data.dataset import PromptSampler
from rollpacker.schedule.round import Round, RoundState, Seen
from rollpacker.schedule.scale_down import ScaleDownDecider, StreamConfig, StreamRound
from rollpacker.schedule.sync import SyncPolicy


class Scores:
    """Scores every response at once: reward 1 for response 0, 0 for response 1."""

    def __init__(self):
        self.ready, self.rows, self.groups = [], {}, []

    def submit(self, key, row, output, held_out=False):
        self.rows[key] = row
        self.ready.append((key, float(key.endswith(":0"))))

    def submit_group(self, keys, row, outputs):
        assert [o.id for o in outputs] == keys and all(k in self.rows for k in keys)
        self.groups.append((row, keys))

    def poll(self):
        ready, self.ready = self.ready, []
        return ready

    def wait(self, keys):
        return self.poll()


def out(rid: str, tokens: int, reason: str = "stop"):
    return SimpleNamespace(id=rid, prompt_ids=[1, 2], token_ids=[3] * tokens, logprobs=[-0.5] * tokens,
                           finish_reason=reason)


@pytest.mark.parametrize("whole", [(5, "length"), (8, "abort")], ids=["finished", "budget-filled"])
def test_a_stream_round_scales_down_migrates_and_feeds_through_the_protocol_alone(whole):
    """4 prompts x 2 responses on 2 replicas, round-robin: replica 1 runs every response 1. A fixed
    25% trigger scales down once prompt 0 is complete; replica 1's three requests migrate (one a
    whole turn before the abort reached it: its engine finished it, or the abort brings back its
    whole 8-token budget, which left to resume would leave nothing to generate); every complete
    group is fed."""
    policy = SyncPolicy(PromptSampler(4), 4, 2)
    state = RoundState(0, policy.start_round(0), policy, num_replicas=2)
    decider = ScaleDownDecider(StreamConfig(trigger=0.25), num_replicas=2, kv_capacity_tokens=100, max_new_tokens=8)
    hooks, scores = StreamRound(decider), Scores()
    rnd = Round(state, scores, single_turn_runner(), hooks)
    slot = {row: i for i, row in enumerate(state.plan.prompts)}
    rid = {(s, k): f"0:{s}:{k}" for s in range(4) for k in range(2)}

    start = rnd.start(now=9.0)
    assert [turn.id for _, _, turn in start.add] == [rid[s, k] for s in range(4) for k in range(2)]
    assert [state.replica(rid[s, k]) for s in range(4) for k in range(2)] == [0, 1] * 4
    assert not (start.resume or start.abort or start.feed or start.scale_down or start.done)

    # Poll 1: prompt 0 is complete (1 of 4): the trigger fires; replica 1's outstanding requests migrate.
    a = rnd.poll(Seen(now=10.0, finished=[out(rid[0, 0], 4), out(rid[0, 1], 4)]),
                 lambda: [(2, 1)] * len(state.outstanding))
    assert (a.add, a.resume, a.done, a.scale_down) == ([], [], False, True)
    assert a.abort == [(1, rid[1, 1]), (1, rid[2, 1]), (1, rid[3, 1])]
    assert [g.prompt for g in a.feed] == [state.plan.prompts[0]] and a.feed[0].rewards == [1.0, 0.0]
    assert scores.groups == [(state.plan.prompts[0], [rid[0, 0], rid[0, 1]])]  # the group functions' call, at once
    assert (rnd.scaled.at, rnd.scaled.completed_frac, state.active, list(decider.history)) == (10.0, 0.25, 1, [4, 4])
    assert state.migrating == {r for _, r in a.abort} and hooks.fetching

    # Poll 2: the aborted outputs come back; the whole one counts as finished.
    partial = [out(rid[1, 1], 1, "abort"), out(rid[2, 1], 2, "abort"), out(rid[3, 1], *whole)]
    a = rnd.poll(Seen(now=11.0, aborted=partial))
    assert [(replica, o.id) for replica, o in a.resume] == [(0, rid[1, 1]), (0, rid[2, 1])]
    assert (a.add, a.abort, a.feed, a.scale_down, a.done) == ([], [], [], False, False)
    assert rnd.scaled.migration_s is None and not state.migrating and rid[3, 1] not in state.outstanding

    # Poll 3: nothing migrating comes back: the migration took 2.5 s. Prompt 1 completes and is fed.
    a = rnd.poll(Seen(now=12.5, finished=[out(rid[1, 0], 3), out(rid[1, 1], 6)]))
    assert rnd.scaled.migration_s == 2.5 and rnd.scaled.migrated_tokens == (2 + 1) + (2 + 2)
    assert [g.prompt for g in a.feed] == [state.plan.prompts[1]]
    assert (a.add, a.resume, a.abort, a.scale_down, a.done) == ([], [], [], False, False)

    # Poll 4: the rest finish; the round is done, nothing left to abort; prompts 2 and 3 are fed.
    a = rnd.poll(Seen(now=14.0, finished=[out(rid[2, 0], 2), out(rid[3, 0], 7), out(rid[2, 1], 8)]))
    assert (a.add, a.resume, a.abort, a.scale_down, a.done) == ([], [], [], False, True)
    assert [slot[g.prompt] for g in a.feed] == [3, 2]  # completion order

    rnd.end([])
    assert rnd.settle()
    outcome = rnd.finish()
    assert sorted(slot[g.prompt] for g in outcome.groups) == [0, 1, 2, 3] and all(g.streamed for g in outcome.groups)
    assert (outcome.num_launched, outcome.aborted, outcome.num_fed, outcome.last_finish) == (8, [], 4, 14.0)
    assert outcome.generated_tokens == 4 + 4 + whole[0] + 3 + 6 + 2 + 7 + 8  # resumed requests count their whole output
    assert outcome.hook_metrics == {"stream/scaled_down": 1.0, "stream/trigger_completed_frac": 0.25,
                                    "time/migration": 2.5, "stream/streamed_groups": 4.0}
    assert decider.migration_seconds_per_token == pytest.approx(2.5 / 7)
    assert scores.rows[rid[3, 1]] == state.plan.prompts[3]  # the whole one was scored as its row's response
    assert sorted(scores.groups) == sorted((g.prompt, [o.id for o in g.outputs]) for g in outcome.groups)  # once each


def test_launches_of_the_scale_down_poll_go_to_the_kept_replicas_not_into_migration():
    """A launch decided in the poll that scales down is routed again before it is sent: it never
    migrates. 2 prompts x 2 responses on 2 replicas; when prompt 0 completes, the policy launches
    one more prompt and a fixed 50% trigger scales down."""

    class LaunchesOne(SyncPolicy):
        def on_finished(self, slot, response, output, reward):
            decision = super().on_finished(slot, response, output, reward)
            decision.launch = [7] if (slot, response) == (0, 1) else []
            return decision

    policy = LaunchesOne(PromptSampler(8), 2, 2)
    state = RoundState(0, policy.start_round(0), policy, num_replicas=2)
    decider = ScaleDownDecider(StreamConfig(trigger=0.5), num_replicas=2, kv_capacity_tokens=100, max_new_tokens=8)
    rnd = Round(state, Scores(), single_turn_runner(), StreamRound(decider))
    rnd.start()
    a = rnd.poll(Seen(now=1.0, finished=[out("0:0:0", 2), out("0:0:1", 2)]), lambda: [(2, 1)] * 3)
    assert a.scale_down and a.abort == [(1, "0:1:1")] and state.migrating == {"0:1:1"}
    assert [(state.row(turn.id), turn.id, replica) for replica, _, turn in a.add] == [(7, "0:2:0", 0), (7, "0:2:1", 0)]
