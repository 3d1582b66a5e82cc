"""Tail batching over episodes, through the round's protocol alone (scripted engines and
environments of ``test_round_episodes``, no model, no process): a short round keeps the first R0
episodes of each prompt to finish and the first P0 prompts to complete, cuts the rest, closes
their environments and ends their engine sessions (those cut at the round's end: with the round's
last actions); a deferred prompt's episodes are regenerated from scratch in a long round; the
ledger is exact after every round.

``test_round_episodes`` already checks, under tail: each episode heard once, every environment
opened closed once, every trained episode's session ended once, every prompt trained once over the run
(ledger counts), ids and seeds stable."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest

from rollpacker.data.dataset import PromptSampler
from rollpacker.env.episode import Response
from rollpacker.schedule.round import Round, RoundState
from rollpacker.schedule.runner import EpisodeRunner
from rollpacker.schedule.tail import TailConfig
from tests.unit.env.test_round import Driver, Scores, check_episode, make

SEED = 3
P0, R0 = 4, 2


class Sessions(Driver):
    """The scripted driver (which records each session the round ends, once: as its environment closes,
    or with the round's last actions for the episodes whose turns they abort), also recording the
    replica of each episode's turns."""

    def __init__(self):
        super().__init__()
        self.replica_of: dict[str, int] = {}

    def apply(self, a) -> None:
        for replica, _, turn in a.add:
            self.replica_of[turn.id.rpartition("#")[0]] = replica
        super().apply(a)

    def check_sessions(self) -> None:
        """Every episode opened has its session ended, on the replica that ran its turns."""
        assert set(self.ended) == set(self.env_log)
        assert all(replica == self.replica_of.get(key, replica) for key, replica in self.ended.items())


def tail_round(policy, step: int, driver: Sessions):
    """One round; its plan, outcome, state and the episodes in finish order."""
    plan = policy.start_round(step)
    state = RoundState(step, plan, policy, num_replicas=2)
    rnd = Round(state, Scores(), EpisodeRunner(make, seed=SEED, environment=True))
    a = rnd.start(now=driver.now)
    for _ in range(500):
        driver.apply(a)
        if a.done:
            break
        a = rnd.poll(driver.seen(), driver.generated)
    else:
        pytest.fail("the round did not end")
    rnd.end(driver.seen().aborted)
    assert rnd.settle()
    outcome = rnd.finish()
    driver.apply(SimpleNamespace(add=[], resume=[], abort=[], env=outcome.env))
    return plan, outcome, state


def test_a_short_round_keeps_the_first_episodes_to_finish_and_cuts_closes_and_ends_the_rest():
    policy = TailConfig().build(PromptSampler(12), P0, R0, num_epochs=1)
    driver = Sessions()
    plan, outcome, state = tail_round(policy, 0, driver)
    assert plan.kind == "short" and state.num_launched == 5 * 3  # ⌈1.25 P0⌉ prompts, ⌈1.25 R0⌉ episodes each
    by_slot, complete = collections.defaultdict(list), []
    for out in state.outputs:  # episodes in finish order
        _, slot, _ = state.owner[out.id]
        by_slot[slot].append(out.id)
        if len(by_slot[slot]) == R0:
            complete.append(slot)
    kept = {state.owner[g.outputs[0].id][1]: [o.id for o in g.outputs] for g in outcome.groups}
    assert sorted(kept) == sorted(complete[:P0])  # the first P0 prompts to complete
    for slot, ids in kept.items():
        assert sorted(ids) == sorted(by_slot[slot][:R0])  # their first R0 episodes to finish
    for g in outcome.groups:
        for o in g.outputs:
            check_episode(o, driver)
    trained = {o.id for g in outcome.groups for o in g.outputs}
    cut = [o for o in outcome.aborted if o.id not in trained]
    assert cut and all(isinstance(o, Response) and o.finish_reason == "abort" for o in cut)
    opened = set(driver.env_log)
    assert len(opened) == state.num_launched and all(calls[-1] == "close" for calls in driver.env_log.values())
    driver.check_sessions()  # kept, surplus or cut: every episode's session ended


def test_deferred_prompts_regenerate_their_episodes_from_scratch_and_the_ledger_is_exact():
    policy = TailConfig().build(PromptSampler(12), P0, R0, num_epochs=1)
    driver, trained, deferred_at = Sessions(), [], {}
    long_rounds = 0
    for step in range(30):
        if policy.done():
            break
        plan, outcome, state = tail_round(policy, step, driver)
        rows = [g.prompt for g in outcome.groups]
        trained += rows
        if plan.kind == "long":
            long_rounds += 1
            assert not plan.carried  # nothing of a cut episode is resumed
            for g in outcome.groups:
                assert g.prompt in deferred_at and deferred_at[g.prompt] < step
                for o in g.outputs:  # a fresh episode of this round: opened anew, every turn run here
                    assert o.id.startswith(f"{step}:") and driver.env_log[o.id][0] == "open"
                    assert driver.turns[f"{o.id}#0"][1] == o.prompt_ids == [g.prompt + 1, 5]
                    check_episode(o, driver)
        for key in policy.ledger.queue:
            deferred_at.setdefault(key[1], step)
        counts = policy.ledger.counts()
        assert counts["trained"] == len(trained) == len(set(trained))
        assert counts["deferred"] == len(policy.ledger.queue) and counts["in_flight"] == 0
        policy.ledger.check(policy.sampler)
        driver.check_sessions()
    assert long_rounds and sorted(trained) == list(range(12))
