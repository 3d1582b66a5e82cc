"""Speculative decoding's pieces without a model: the drafter on hand-built sequences, the cost
table's decisions, the counters and metrics, the settings."""

from __future__ import annotations

import pytest

from rollpacker.rollout.config import EngineConfig
from rollpacker.rollout.drafter import Drafter
from rollpacker.rollout.engine import DraftContext, SpecStats, spec_metrics
from rollpacker.rollout.spec_cost import BACKOFF, PROBE, WINDOW, Acceptance, Realized, SpecCost, expected_tokens


def test_drafts_from_the_prompt():
    d = Drafter(min_n=2, max_n=4)
    prompt = [10, 11, 12, 13, 10, 11]
    d.add("a", prompt, list(prompt))
    draft = d.propose("a", 3)
    assert (draft.tokens, draft.source) == ([12, 13, 10], "prompt")


def test_drafts_from_a_sibling_then_from_itself():
    d = Drafter(min_n=2, max_n=4)
    ahead, behind = [1, 2, 5, 6, 7, 8], [1, 2, 5]
    d.add("a", [1, 2], ahead)
    d.add("b", [1, 2], behind)
    draft = d.propose("b", 8)  # (2, 5) continues with 6, 7, 8 in a; b's own (2, 5) has no continuation yet
    assert (draft.tokens, draft.source) == ([6, 7, 8], "sibling")
    ahead += [7, 8]  # a repeats itself: 1 2 5 6 7 8 7 8
    behind += [6, 7, 8]  # appended after add: seen at the next proposal
    draft = d.propose("a", 2)
    assert (draft.tokens, draft.source) == ([7, 8], "self")
    draft = d.propose("b", 1)  # (5, 6, 7, 8) is followed by 7 in a
    assert (draft.tokens, draft.source) == ([7], "sibling")


def test_drafts_from_the_controllers_context():
    d = Drafter(min_n=2, max_n=4)
    epoch = DraftContext(source="epoch", token_ids=(4, 5, 6))
    d.add("a", [1, 2, 3], [1, 2, 3], [epoch])
    d.add("b", [1, 2, 3], [1, 2, 3], [epoch])  # its siblings bring the same context: indexed once
    draft = d.propose("a", 5)
    assert (draft.tokens, draft.source) == ([4, 5, 6], "epoch")
    assert len(d.prompts[(1, 2, 3)].seqs) == 4  # the prompt, the context once, two requests


def test_the_longest_match_wins_then_the_majority():
    d = Drafter(min_n=1, max_n=3)
    d.add("x", [9], [9, 1, 2, 3, 4])  # (1, 2, 3) -> 4
    d.add("y", [9], [9, 7, 2, 3, 5])  # (2, 3) -> 5 only
    d.add("z", [9], [9, 8, 2, 3, 5])
    d.add("q", [9], [9, 1, 2, 3])
    assert d.propose("q", 1).tokens == [4]  # the 3-gram's one continuation beats the 2-gram's two
    d.add("w", [9], [9, 6, 2, 3])
    draft = d.propose("w", 1)  # (6, 2, 3) nowhere; (2, 3) -> 4 once, 5 twice
    assert (draft.tokens, draft.source) == ([5], "sibling")


def test_no_match_no_draft():
    d = Drafter(min_n=2, max_n=4)
    d.add("a", [1, 2, 3], [1, 2, 3, 4])
    assert d.propose("a", 4) is None


def test_memory_is_bounded_and_freed_with_the_prompts_last_request():
    d = Drafter(min_n=1, max_n=3, max_matches=4, max_tokens=50)
    tokens = [0, 1]
    d.add("a", [0], tokens)
    d.add("b", [0], [0, 1])
    tokens += [1] * 200  # one n-gram, many occurrences
    d.propose("a", 2)
    index = d.prompts[(0,)]
    assert d.num_indexed() == 50
    assert max(len(v) for v in index.table.values()) <= 2 * 4
    d.remove("a")
    assert d.num_indexed() == 50  # b still runs: a's tokens stay its sibling's drafts
    d.remove("b")
    assert d.prompts == {} and d.requests == {} and d.num_indexed() == 0
    with pytest.raises(ValueError, match="min_n"):
        Drafter(min_n=3, max_n=2)


def cost() -> SpecCost:
    """A step of n requests costs 1 + n (k + 1) / 4 ms: overhead, then compute per token."""
    rows, lens = (1, 2, 4, 8, 16), (0, 1, 2, 4, 8)
    return SpecCost(rows, lens, tuple(tuple(1 + n * (k + 1) / 4 for k in lens) for n in rows))


def test_cost_table_interpolates_and_says_when_drafts_pay():
    c = cost()
    assert c.step_ms(4, 3) == pytest.approx(1 + 4 * 4 / 4)  # between measured draft lengths
    assert c.step_ms(3, 0) == pytest.approx((c.step_ms(2, 0) + c.step_ms(4, 0)) / 2)
    assert c.max_rows == 16  # 1 + 16 * 9 / 4 = 37 < 9 * 5: a sure 8-token draft still pays at 16
    flat = SpecCost((1,), (0, 1), ((1.0, 2.5),))
    assert flat.max_rows == 0  # a 1-token draft costs more than two plain steps
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    # one request, sure drafts: the longest draft; a poor acceptance: none; many requests: none
    assert c.draft_len(1, [(8, 0.99)], 8) == 8
    assert c.draft_len(1, [(8, 0.05)], 8) == 0
    assert 0 < c.draft_len(1, [(8, 0.6)], 8) < 8
    assert c.draft_len(16, [(8, 0.6)] * 16, 8) < c.draft_len(2, [(8, 0.6)] * 2, 8)
    slow_drafter = SpecCost(c.rows, c.draft_lens, c.ms, draft_ms=10.0)  # drafting dearer than any gain
    assert c.worth_drafting(1, [0.9], 8) and not slow_drafter.worth_drafting(1, [0.9], 8)
    assert slow_drafter.max_rows == 0 and not c.worth_drafting(16, [0.05] * 16, 8)
    smoothed = SpecCost.smoothed((1, 2), (0, 1), [[2.0, 1.5], [1.0, 3.0]])
    assert smoothed.ms == ((2.0, 2.0), (1.0, 3.0))


def test_realized_payoff_backs_off_where_drafting_does_not_pay():
    """``auto``'s realized payoff: it drafts once it timed a plain step; a window of drafted steps
    slower than the plain ones holds drafting off for BACKOFF steps, doubled at the next failure; a
    paying window keeps it on, with a plain probe every PROBE drafted steps; tokens are normalized
    by the table's plain step at each batch size."""
    table = SpecCost((1, 4), (0, 1), ((1.0, 2.0), (2.0, 3.0)))
    assert (table.plain_ms(2), table.plain_ms(4), table.plain_ms(8)) == (4 / 3, 2.0, 4.0)  # in proportion beyond
    r = Realized()
    assert not r.allows()  # no plain rate yet
    r.record(4, False, 4, 1.0, plain_ms=10.0)  # 4 tokens in 1 s at n=4: as fast as the table says
    assert r.allows()
    for _ in range(WINDOW):  # 8 tokens in 3 s: slower than plain
        r.record(4, True, 8, 3.0, plain_ms=10.0)
    assert r.num_backoffs == 1
    for _ in range(BACKOFF):  # the steps it drafts nothing
        assert not r.allows()
        r.record(4, False, 4, 1.0, plain_ms=10.0)
    assert r.allows()
    for _ in range(WINDOW):
        r.record(4, True, 8, 3.0, plain_ms=10.0)
    for _ in range(2 * BACKOFF):
        assert not r.allows()
        r.record(4, False, 4, 1.0, plain_ms=10.0)
    assert r.allows() and r.num_backoffs == 2
    # at n=2 the table's plain step is cheaper (7.5 ms): 2 tokens in 0.75 s is plain speed, 3 tokens in 1 s pays
    for _ in range(PROBE - 1):
        r.record(2, True, 3, 1.0, plain_ms=7.5)
        assert r.allows()
    r.record(2, True, 3, 1.0, plain_ms=7.5)
    assert not r.allows() and r.num_backoffs == 2 and r.failures == 0  # a plain probe is due, not a back-off
    r.record(2, False, 2, 0.75, plain_ms=7.5)
    assert r.allows()
    for _ in range(WINDOW):  # at n=2, 2.5 tokens in 1 s is slower than plain (2 in 0.75 s) although more tokens
        r.record(2, True, 2.5, 1.0, plain_ms=7.5)
    assert not r.allows() and r.num_backoffs == 3


def test_acceptance_counts_trials_up_to_the_first_rejection():
    a = Acceptance()
    assert a.rate == 0.5
    a.update(drafted=4, accepted=4)
    assert a.rate == pytest.approx(5 / 6)
    a.update(drafted=4, accepted=1)  # 1 hit in 2 trials (the rejected token ends the draft)
    assert (a.hits, a.trials) == (pytest.approx(0.8 * 4 + 1), pytest.approx(0.8 * 4 + 2))


def test_spec_counters_and_metrics():
    s = SpecStats()
    s.count("sibling", 4, 3)
    s.count("sibling", 4, 1)
    s.count("epoch", 2, 2)
    s.count("none", 0, 0)
    s.num_verify_steps = 2
    m = spec_metrics(s)
    assert m["rollout/spec_acceptance"] == pytest.approx(6 / 10)
    assert m["rollout/spec_acceptance/sibling"] == pytest.approx(4 / 8)
    assert m["rollout/spec_tokens_per_step"] == pytest.approx((6 + 4) / 4)
    assert m["rollout/spec_tokens_per_step/epoch"] == 3.0 and m["rollout/spec_tokens_per_step/none"] == 1.0
    assert "rollout/spec_acceptance/none" not in m
    # trials: each row's accepted tokens, plus its rejected one (3 + 1, 1 + 1, 2 + 0): the geometric rate
    assert m["rollout/spec_accept_rate"] == pytest.approx(6 / 8) and m["rollout/spec_accept_rate/epoch"] == 1.0
    assert m["rollout/spec_accept_rate/sibling"] == pytest.approx(4 / 6)
    assert m["rollout/spec_drafted_frac"] == 3 / 4 and "rollout/spec_drafted_frac/epoch" not in m  # one row had none
    assert m["rollout/spec_draft_len"] == 10 / 3
    before = s.plus(SpecStats())
    s.count("epoch", 2, 0)
    s.num_verify_steps += 1
    delta = s.since(before)
    assert (delta.num_verify_steps, delta.num_drafts, delta.num_accepted_tokens) == (1, {"epoch": 1}, {})
    assert s.plus(delta).num_draft_tokens["epoch"] == 6
    assert spec_metrics(SpecStats()) == {} and "rollout/spec_draft_ms" not in m
    asked = SpecStats(num_asked=4, draft_seconds=0.002)  # asked, nothing verified: the asking's cost alone
    assert spec_metrics(asked) == {"rollout/spec_draft_ms": pytest.approx(0.5)}
    assert asked.plus(asked).since(asked) == asked


def test_settings_are_validated():
    with pytest.raises(ValueError, match="engine.speculative"):
        EngineConfig(speculative="sometimes")
    with pytest.raises(ValueError, match="engine.spec_max_tokens"):
        EngineConfig(spec_max_tokens=0)
    with pytest.raises(ValueError, match="engine.spec_max_tokens"):
        EngineConfig(spec_max_tokens=33)


def test_sglang_and_vllm_pass_their_own_ngram_through():
    from rollpacker.rollout import sglang_speculative_args

    assert sglang_speculative_args(EngineConfig(), "cpu") == {}
    args = sglang_speculative_args(EngineConfig(speculative="auto", spec_max_tokens=6), "cuda")
    assert args["speculative_algorithm"] == "NGRAM" and args["speculative_num_draft_tokens"] == 7  # and the last token
    from rollpacker.errors import UserError

    with pytest.raises(UserError, match="CUDA only"):  # a ValueError came out as each rank's traceback
        sglang_speculative_args(EngineConfig(speculative="on"), "cpu")
