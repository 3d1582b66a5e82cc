"""The held-out round: the eval policy through the real exchange (one rank, an engine that adds one
token per step), every row once with ``num_responses`` responses each, greedy."""

from __future__ import annotations

import pytest
from support.fakes import InstantRewards, LengthTableEngine, OneReplica

from rollpacker.exchange import RoundLeader, run_round
from rollpacker.rollout.engine import SamplingParams
from rollpacker.schedule.eval import EvalPolicy


@pytest.mark.parametrize("num_responses", [1, 3])
def test_every_held_out_row_once_with_its_responses(num_responses):
    rows = [10, 11, 12, 13, 14]
    policy = EvalPolicy(len(rows), num_responses)
    seen = []

    def encode(row):
        seen.append(row)
        return [row]

    leader = RoundLeader(policy=policy, rows=rows, encode=encode,
                         rewards=InstantRewards(lambda row, rid: float(row % 2)),
                         sampling=SamplingParams(max_new_tokens=100, temperature=0.0)).round(7, policy.start_round(7))
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


def test_eval_metrics_mean_and_unbiased_pass_at_k_per_data_source():
    from rollpacker.schedule.eval import eval_metrics

    rewards = [[1.0, 0.0, 0.0], [1.0, 1.0, 0.5], [0.0, 0.0, 0.0]]  # c = 1, 2, 0 of n = 3
    m = eval_metrics(rewards, [[r >= 1 for r in rs] for rs in rewards], ["a", "b", "a"])
    assert m["eval/mean@3"] == pytest.approx(3.5 / 9) and m["eval/reward_mean"] == pytest.approx(3.5 / 9)
    assert m["eval/pass@1"] == pytest.approx((1 / 3 + 2 / 3 + 0) / 3) and m["eval/accuracy"] == pytest.approx(3 / 9)
    assert m["eval/pass@3"] == pytest.approx(2 / 3)  # n = k: a prompt passes when any response is correct
    assert m["eval/a/pass@3"] == pytest.approx(0.5) and m["eval/b/pass@1"] == pytest.approx(2 / 3)
    assert m["eval/a/mean@3"] == pytest.approx(1 / 6) and m["eval/b/mean@3"] == pytest.approx(2.5 / 3)
    greedy = eval_metrics([[1.0], [0.0]], [[True], [False]], [None, None])  # one greedy response each, no source
    assert greedy == {"eval/accuracy": 0.5, "eval/reward_mean": 0.5, "eval/mean@1": 0.5, "eval/pass@1": 0.5}
    # a file's data_source 2024 beside another file's name (the eval sets' data_source filled in)
    mixed = eval_metrics([[1.0], [0.0], [1.0]], [[True], [False], [True]], [2024, "math500", 2024])
    assert mixed["eval/2024/pass@1"] == 1.0 and mixed["eval/math500/pass@1"] == 0.0
    same = eval_metrics([[1.0], [0.0]], [[True], [False]], [2024, "2024"])  # one key: the second overwrote the first
    assert same["eval/2024/pass@1"] == 0.5 and same["eval/2024/mean@1"] == 0.5


def test_a_held_out_episode_whose_environment_failed_counts_as_unsolved():
    from rollpacker.env.episode import Response
    from rollpacker.schedule.base import Group
    from rollpacker.schedule.eval import eval_rewards

    outputs = [Response(id=f"0:0:{k}", prompt_ids=[1], token_ids=[2], finish_reason=reason)
               for k, reason in enumerate(["stop", "error", "length"])]
    # the failed episode's partial text scored 1.3 (its answer came before the environment broke): not a success
    assert eval_rewards(Group(prompt=0, outputs=outputs, rewards=[1.0, 1.3, None])) == [1.0, 0.0, 0.0]


def test_eval_config_refuses_copies_of_one_greedy_response():
    from rollpacker.schedule.eval import EvalConfig

    with pytest.raises(ValueError, match="eval.n=2 with eval.temperature=0: greedy gives 2 copies"):
        EvalConfig(n=2)
    assert EvalConfig(n=2, temperature=0.6).n == 2
