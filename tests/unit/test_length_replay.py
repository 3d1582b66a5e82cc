"""``--rollout.replay-lengths``: the forced response lengths are the simulator's (LengthModel) draws,
deterministic, cut at max_new_tokens, with the paper's long tail."""

from __future__ import annotations

import statistics

from rollpacker.round import length_replay
from rollpacker.sim.workload import LengthModel


def test_lengths_are_the_simulators_draws_cut_at_the_cap():
    lengths = length_replay(seed=3, max_new_tokens=512)
    model = LengthModel(seed=3).for_cap(512)
    for row, step, slot in [(0, 0, 0), (7, 2, 5), (123, 9, 1)]:
        group = [min(512, int(x)) for x in model.lengths(row, step, slot, 8)]
        assert [lengths(row, step, slot, k) for k in range(8)] == group  # prefix-stable: any group size
    assert length_replay(seed=4, max_new_tokens=512)(7, 2, 5, 0) != lengths(7, 2, 5, 0) or \
        length_replay(seed=4, max_new_tokens=512)(7, 2, 5, 1) != lengths(7, 2, 5, 1)


def test_the_tail_is_the_papers():
    lengths = length_replay(seed=0, max_new_tokens=512)
    draws = [lengths(row, 0, row, k) for row in range(128) for k in range(8)]
    assert 1 <= min(draws) and max(draws) == 512
    assert max(draws) / statistics.median(draws) >= 20  # Fig. 2a: the longest is 25-32x the median
