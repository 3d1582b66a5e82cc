"""The held-out round: the eval policy through the real exchange (one rank, an engine that adds one
token per step), every row once with ``num_responses`` responses each, greedy."""

from __future__ import annotations

import pytest

from rollpacker.exchange import RoundLeader, run_round
from rollpacker.rollout.engine import SamplingParams
from rollpacker.schedule.eval import EvalPolicy

from conftest import InstantRewards, LengthTableEngine, OneReplica


@pytest.mark.parametrize("num_responses", [1, 3])
def test_every_held_out_row_once_with_its_responses(num_responses):
    rows = [10, 11, 12, 13, 14]
    policy = EvalPolicy(len(rows), num_responses)
    seen = []

    def encode(row):
        seen.append(row)
        return [row]

    leader = RoundLeader(step=7, plan=policy.start_round(7), policy=policy, rows=rows, encode=encode,
                         rewards=InstantRewards(lambda row, rid: float(row % 2)),
                         sampling=SamplingParams(max_new_tokens=100, temperature=0.0))
    result = run_round(OneReplica(), LengthTableEngine(lambda row, k: 2 + row % 3 + k), 1, leader)
    assert result.kind == "eval" and seen == rows and result.num_launched == len(rows) * num_responses
    assert [g.prompt for g in result.groups] == list(range(len(rows)))  # slot order, every row once
    for g in result.groups:
        assert sorted(o.id.split(":")[2] for o in g.outputs) == [str(k) for k in range(num_responses)]
        assert g.rewards == [float(rows[g.prompt] % 2)] * num_responses
    assert all(o.id.startswith("7:") for g in result.groups for o in g.outputs)


def test_an_empty_eval_set_is_refused():
    with pytest.raises(ValueError, match="0 rows"):
        EvalPolicy(0)
