"""The exchange's own bookkeeping on rank 0, without ranks: what a migrated request is resumed as."""

from __future__ import annotations

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
