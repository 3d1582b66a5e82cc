"""The controller's batch and metrics: rewards with DAPO's overlong punishment added, one group
number per group, the step's global count over streamed groups too, and the round's metrics."""

from __future__ import annotations

import pytest

from rollpacker.config import Config
from rollpacker.controller import Controller
from rollpacker.data.dataset import PromptSampler
from rollpacker.exchange import RoundResult
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import Output
from rollpacker.schedule.base import Group
from rollpacker.schedule.sync import SyncPolicy
from rollpacker.train.config import TrainConfig


class Rewards:
    """The reward scheduler's one method the metrics read."""

    def take_metrics(self) -> dict[str, float]:
        return {"reward/errors": 1, "reward/seconds_total": 1.5}


def output(n: int, reason: str = "stop") -> Output:
    return Output(id=f"r{n}", prompt_ids=[1, 2], token_ids=list(range(n)), logprobs=[-0.5] * n, finish_reason=reason)


def round_result(groups: list[Group]) -> RoundResult:
    lengths = sum(len(o.token_ids) for g in groups for o in g.outputs)
    return RoundResult(kind="sync", groups=groups, num_launched=6, num_aborted=1, generated_tokens=lengths + 7,
                       running_trace=[(1.0, 6), (2.0, 3)], start=0.0, last_finish=3.0, end=4.0, num_preemptions=2)


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_make_batch_and_round_stats(mask_truncated):
    train = TrainConfig(overlong_buffer=20, overlong_penalty=0.5, aggregation="seq-mean-token-sum-norm",
                        mask_truncated=mask_truncated)
    config = Config(train=train, rollout=RolloutConfig(max_new_tokens=100))
    ctl = Controller(config=config, rows=[], eval_rows=None, tokenizer=None, rewards=Rewards(),
                     policy=SyncPolicy(PromptSampler(4, 0), 1, 1), metrics=None, display=None, max_model_len=200)
    streamed = Group(prompt=0, outputs=[output(10), output(90)], rewards=[1.0, 0.0], streamed=True)
    kept = Group(prompt=1, outputs=[output(100, "length"), output(5), output(7)], rewards=[0.0, 0.0, 1.0])
    result = round_result([streamed, kept])
    samples, count = ctl.make_batch(result)
    # The streamed group is not in the batch.
    # Overlong (buffer 20 before 100, penalty 0.5): 90 tokens -> -0.25, 100 -> -0.5.
    assert [(len(s.response_ids), s.reward, s.truncated) for s in samples] == [
        (100, -0.5, True), (5, 0.0, False), (7, 1.0, False)]
    assert len({s.group for s in samples}) == 1
    # seq-mean-token-sum-norm counts every trained response (streamed too), times 100 tokens.
    assert count == (4 if mask_truncated else 5) * 100
    stats = ctl.round_stats(result)
    assert stats["reward/mean"] == pytest.approx(2 / 5) and stats["reward/accuracy"] == pytest.approx(2 / 5)
    assert stats["reward/errors"] == 1 and stats["rollout/truncated"] == 1
    assert stats["reward/overlong_penalty_mean"] == pytest.approx(-0.75 / 5)
    assert stats["rollout/response_lengths"] == [10, 90, 100, 5, 7]
    assert stats["rollout/wasted_tokens"] == 7 and stats["reward/seconds_total"] == 1.5
    assert stats["time/reward_exposed"] == 1.0 and stats["sched/trained_prompts"] == 2
