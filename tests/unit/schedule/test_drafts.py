"""The controller's draft memory (what earlier rounds generated per prompt) and the round's routing
rules that use it: by group, and longest first (LPT)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rollpacker.data.dataset import PromptSampler
from rollpacker.schedule.drafts import DraftMemory
from rollpacker.schedule.round import RoundState, Routing
from rollpacker.schedule.sync import SyncPolicy


def out(tokens, reason="stop", rid=""):
    return SimpleNamespace(id=rid, token_ids=list(tokens), finish_reason=reason)


def test_a_deferred_prompt_keeps_its_cut_responses_and_a_trained_one_its_finished_responses():
    memory = DraftMemory(max_responses=2)
    # round 1: row 5 deferred (two aborted partials, one finished response), row 6 trained
    memory.end_round([(5, out([1, 2, 3], "abort")), (5, out([4, 5], "abort")), (5, out([9] * 4)),
                      (6, out([7, 8])), (6, out([7], "abort")), (6, out([]))], trained={6})
    assert memory.contexts(5) == [("partial", (9, 9, 9, 9)), ("partial", (1, 2, 3))]  # the 2 longest
    assert memory.length_bound(5) == 4
    assert memory.contexts(6) == [("epoch", (7, 8))]  # finished only; empty outputs are not kept
    assert memory.length_bound(6) == 0  # an epoch's length is no bound: the policy changed since
    # round 2: row 5 cut again (more partials, merged), row 6 not seen
    memory.end_round([(5, out([3] * 6, "abort"))], trained=set())
    assert memory.contexts(5) == [("partial", (3,) * 6), ("partial", (9, 9, 9, 9))]
    # round 3: row 5 trained: its partials go, its finished responses become the epoch source
    memory.end_round([(5, out([1, 1])), (5, out([2, 2, 2])), (5, out([3] * 9, "abort"))], trained={5})
    assert memory.contexts(5) == [("epoch", (2, 2, 2)), ("epoch", (1, 1))]
    assert memory.num_tokens == 2 + 5
    assert memory.contexts(99) == [] and memory.length_bound(99) == 0


def test_the_memory_is_bounded_drops_the_oldest_rows_and_survives_a_checkpoint():
    memory = DraftMemory(max_responses=3, max_tokens=10)
    memory.end_round([(1, out([1] * 4, "abort"))], trained=set())
    memory.end_round([(2, out([2] * 3, "abort")), (3, out([3] * 2))], trained={3})
    assert memory.num_tokens == 9 and list(memory.rows) == [1, 2, 3]
    memory.end_round([(4, out([4] * 5, "abort"))], trained=set())  # 14 tokens: the oldest row dropped
    assert list(memory.rows) == [2, 3, 4] and memory.num_tokens == 10
    memory.end_round([(3, out([3] * 3))], trained={3})  # row 3 is the newest now: row 2 goes
    assert list(memory.rows) == [4, 3] and memory.num_tokens == 8
    restored = DraftMemory(max_responses=3, max_tokens=10)
    restored.load_state_dict(json.loads(json.dumps(memory.state_dict())))  # plain data
    assert restored.rows == memory.rows and restored.num_tokens == memory.num_tokens
    assert [restored.contexts(r) for r in (1, 2, 3, 4)] == [memory.contexts(r) for r in (1, 2, 3, 4)]
    memory.end_round([(3, out([3] * 20))], trained={3})  # one row over the bound alone: nothing kept
    assert not memory.rows and memory.num_tokens == 0
    with pytest.raises(ValueError, match="max_tokens=0"):
        DraftMemory(max_tokens=0)


def test_lengths_only_memory_keeps_no_tokens():
    memory = DraftMemory(keep_tokens=False)
    memory.end_round([(1, out(range(40), "abort")), (1, out(range(7), "abort"))], trained=set())
    assert memory.length_bound(1) == 40 and memory.num_tokens == 47
    # a resume that turns speculation on: lengths are no drafts (nor a token 40 of one); off: tokens become lengths
    drafting = DraftMemory()
    drafting.load_state_dict(json.loads(json.dumps(memory.state_dict())))
    assert drafting.contexts(1) == [] and drafting.num_tokens == 0
    drafting.end_round([(2, out(range(30), "abort"))], trained=set())
    memory.load_state_dict(json.loads(json.dumps(drafting.state_dict())))
    assert memory.contexts(2) == [("partial", (30,))] and memory.length_bound(2) == 30 and memory.num_tokens == 30


def four_rows(memory=None, routing=Routing(), replicas=2, responses=2):
    policy = SyncPolicy(PromptSampler(4), 4, responses)
    return RoundState(0, policy.start_round(0), policy, replicas, routing=routing, memory=memory)


def test_longest_first_dispatches_by_cut_length_to_the_least_loaded_replica():
    memory = DraftMemory()
    state = four_rows(memory, Routing(longest_first=True))
    rows = state.plan.prompts
    lengths = dict(zip(rows, (10, 50, 0, 30)))
    memory.end_round([(row, out([1] * n, "abort")) for row, n in lengths.items() if n], trained=set())
    launches = state.launch(rows)
    assert [new.row for new in launches] == [rows[1], rows[3], rows[0], rows[2]]  # longest first
    replicas = {new.row: [state.replica(rid) for _, rid, _ in new.run] for new in launches}
    # LPT, one request at a time (estimate + 1 each): 50|50, 30|30, 10|10, 0|0 alternate evenly
    assert replicas == {rows[1]: [0, 1], rows[3]: [0, 1], rows[0]: [0, 1], rows[2]: [0, 1]}
    # three replicas: the longest prompt's two requests fill two, the next goes to the idle third
    state = four_rows(memory, Routing(longest_first=True), replicas=3)
    first, second = state.launch(state.plan.prompts)[:2]
    assert [state.replica(rid) for _, rid, _ in first.run] == [0, 1]
    assert state.replica(second.run[0][1]) == 2


def test_group_routing_keeps_a_prompt_on_one_replica_and_plain_routing_is_round_robin():
    state = four_rows(routing=Routing(by_group=True), responses=3)
    launches = state.launch(state.plan.prompts)
    assert [{state.replica(rid) for _, rid, _ in new.run} for new in launches] == [{0}, {1}, {0}, {1}]
    state = four_rows()
    launches = state.launch(state.plan.prompts)
    assert [state.replica(rid) for new in launches for _, rid, _ in new.run] == [0, 1] * 4
    assert [new.row for new in launches] == state.plan.prompts


def test_a_round_feeds_its_outputs_to_the_memory():
    memory = DraftMemory()
    state = four_rows(memory)
    launches = state.launch(state.plan.prompts)
    finished = [out([new.slot + 1] * (k + 2), rid=rid) for new in launches for k, rid, _ in new.run]
    state.finished(finished)
    state.scored((o.id, 1.0) for o in finished)
    assert state.decide().done
    groups = state.finish(state.policy.end_round([]), [])
    assert {g.prompt for g in groups} == set(state.plan.prompts)
    for new in launches:  # every prompt trained: its finished responses are the next epoch's drafts
        assert memory.contexts(new.row) == [("epoch", (new.slot + 1,) * 3), ("epoch", (new.slot + 1,) * 2)]
