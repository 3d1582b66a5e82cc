"""The exchange's own bookkeeping on rank 0, without ranks: what a migrated request is resumed as."""

from __future__ import annotations

import pytest

from rollpacker.exchange import ExchangeRound
from rollpacker.rollout.types import DraftContext, Output, Request, SamplingParams


def test_a_migrated_request_resumes_with_its_priority_session_and_drafts():
    """A stream scale-down moves a request to a kept replica: the same request from its partial output, still
    first in its frontier group's order (priority) and in its episode's session, its drafts kept."""
    rnd = object.__new__(ExchangeRound)
    rnd.requests, rnd.trace = {}, [(0.0, 1)]
    old = Request(id="3:1:0#1", prompt_ids=[1, 2], params=SamplingParams(max_new_tokens=8, seed=5), priority=2,
                  session="env/3:1:0", draft_context=(DraftContext(token_ids=(7, 8), source="partial"),))
    rnd.add(old)
    partial = Output(id=old.id, prompt_ids=[1, 2], token_ids=[4], logprobs=[-0.5], finish_reason="abort")
    new = rnd.resume(partial)
    assert new.resume_from is partial and rnd.requests[old.id] == (new, 1)
    assert (new.priority, new.session, new.draft_context, new.params) == (2, old.session, old.draft_context,
                                                                          old.params)


def test_a_poll_is_its_slowest_replicas_steps_and_the_rest_exchange_or_idle_when_none_stepped():
    from rollpacker.metrics import Phases

    phases = Phases()
    phases.add(1.0, [(0.2, 0.3), (0.0, 0.6)])  # replica 1 is the slowest: 0.6 s decoding, 0.4 s the rest
    phases.add(0.5, [(0.0, 0.0)])  # nothing stepped (environments, or the final command)
    phases.add(0.1, [(0.0, 0.2)])  # a step longer than the poll's wall clock: no negative exchange
    assert (phases.prefill, phases.decode, phases.exchange, phases.idle) == pytest.approx((0.0, 0.8, 0.4, 0.5))
    assert set(phases.metrics()) == {f"rollout/{n}_seconds" for n in ("prefill", "decode", "exchange", "idle")}


def test_a_rounds_phases_count_the_step_after_adds_as_prefill(monkeypatch):
    """The real exchange, one rank, one step a poll, each step timed 1 s: the first poll's step follows
    the adds (prefill), the other four decode; the final command's poll steps nothing (idle)."""
    import time
    from types import SimpleNamespace

    from support.fakes import InstantRewards, LengthTableEngine, OneReplica

    import rollpacker.exchange
    from rollpacker.exchange import RoundLeader, run_round
    from rollpacker.schedule.eval import EvalPolicy

    policy = EvalPolicy(3, 2)
    leader = RoundLeader(policy=policy, rows=[0, 1, 2], encode=lambda row: [row],
                         rewards=InstantRewards(lambda row, rid: 0.0),
                         sampling=SamplingParams(max_new_tokens=100, temperature=0.0)).round(0, policy.start_round(0))
    clock = iter(range(0, 100, 1))  # perf_counter: a step begins and ends on consecutive ticks
    monkeypatch.setattr(rollpacker.exchange, "time", SimpleNamespace(
        time=time.time, process_time=time.process_time, perf_counter=lambda: float(next(clock))))
    result = run_round(OneReplica(), LengthTableEngine(lambda row, k: 3 + row), 1, leader)
    assert (result.phases.prefill, result.phases.decode) == (1.0, 4.0)
