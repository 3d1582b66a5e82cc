"""``--rollout.replay-lengths``: the forced response lengths are the simulator's (LengthModel) draws,
deterministic, cut at max_new_tokens, with the paper's long tail."""

from __future__ import annotations

import statistics

from rollpacker.data.lengths import LengthReplay
from rollpacker.sim.workload import LengthModel


def test_lengths_are_the_simulators_draws_cut_at_the_cap():
    lengths = LengthReplay(seed=3, max_new_tokens=512).draw
    model = LengthModel(seed=3).for_cap(512)
    for row, step, slot in [(0, 0, 0), (7, 2, 5), (123, 9, 1)]:
        group = [min(512, int(x)) for x in model.lengths(row, step, slot, 8)]
        assert [lengths(row, step, slot, k) for k in range(8)] == group  # prefix-stable: any group size
    other = LengthReplay(seed=4, max_new_tokens=512).draw
    assert other(7, 2, 5, 0) != lengths(7, 2, 5, 0) or other(7, 2, 5, 1) != lengths(7, 2, 5, 1)


def test_the_tail_is_the_papers():
    lengths = LengthReplay(seed=0, max_new_tokens=512).draw
    draws = [lengths(row, 0, row, k) for row in range(128) for k in range(8)]
    assert 1 <= min(draws) and max(draws) == 512
    assert max(draws) / statistics.median(draws) >= 20  # Fig. 2a: the longest is 25-32x the median


def test_a_resumed_partial_keeps_its_first_length():
    """sorted_partial resumes a partial in a later round under a new request id: it keeps the length
    it was launched with (the simulator resumes a partial towards its own target), however often."""
    from types import SimpleNamespace

    replay = LengthReplay(seed=1, max_new_tokens=512)
    first = replay("0:3:1", row=9, step=0, slot=3, response=1)
    assert first == replay.draw(9, 0, 3, 1)
    again = replay("1:0:1", row=9, step=1, slot=0, response=1, earlier=SimpleNamespace(id="0:3:1"))
    third = replay("2:4:1", row=9, step=2, slot=4, response=1, earlier=SimpleNamespace(id="1:0:1"))
    assert again == third == first
    assert any(replay.draw(9, s, 0, 1) != first for s in (1, 2, 3))  # a fresh draw would differ
    # what no next round resumes is forgotten: the lengths given are of this step and the last, not the run's
    for step in range(3, 8):
        for slot in range(4):
            replay(f"{step}:{slot}:0", row=slot, step=step, slot=slot, response=0)
    assert sorted({int(rid.split(":")[0]) for rid in replay.given}) == [6, 7]


def test_a_partial_resumed_after_its_resume_was_aborted_while_queued_keeps_its_first_length():
    """sorted_partial resumes 0:3:1 at step 1 as 1:0:1, aborted while queued (no new token): its step-0 output is
    kept and resumed at step 2, whose length was forgotten (drawn afresh: the simulator keeps its target)."""
    from types import SimpleNamespace

    replay = LengthReplay(seed=1, max_new_tokens=512)
    first = replay("0:3:1", row=9, step=0, slot=3, response=1)
    assert replay("1:0:1", row=9, step=1, slot=0, response=1, earlier=SimpleNamespace(id="0:3:1")) == first
    for step in (2, 3, 4):  # queued and aborted at each
        assert replay(f"{step}:0:1", row=9, step=step, slot=0, response=1, earlier=SimpleNamespace(id="0:3:1")) == first
    resumed = LengthReplay(seed=1, max_new_tokens=512)
    resumed.load({"step": 4, "given": {"0:3:1": first, "4:0:1": first}})  # a checkpoint of lengths alone
    assert resumed("5:0:1", row=9, step=5, slot=0, response=1, earlier=SimpleNamespace(id="4:0:1")) == first


def test_a_small_cap_draws_lengths_within_it():
    """The mixture scales with the cap, its medians a token at least: a cap of 32 was refused (medians under 1)."""
    lengths = LengthReplay(seed=0, max_new_tokens=16).draw
    draws = [lengths(row, 0, row, k) for row in range(64) for k in range(4)]
    assert 1 <= min(draws) and max(draws) == 16
