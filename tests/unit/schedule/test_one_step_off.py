"""``one_step_off`` (verl's one-step-off-policy recipe): the policy's staleness on a scripted
round, the composition rules, and real 2-rank runs (1 rollout rank, 1 training rank) over two
epochs, then resumed from a checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollpacker.config import Config
from rollpacker.data.dataset import PromptSampler
from rollpacker.jobflags import policy_args
from rollpacker.plan.config import PlanConfig
from rollpacker.rollout.config import RolloutConfig
from rollpacker.schedule.one_step_off import OneStepOffConfig, OneStepOffPolicy
from rollpacker.schedule.scale_down import StreamConfig
from rollpacker.train.config import TrainConfig


def test_policy_stamps_the_staleness_of_its_weights():
    policy = OneStepOffPolicy(PromptSampler(8, 0), 2, 2)
    for step, weights_step, lag in ((0, 0, 0), (1, 0, 1), (2, 1, 1), (3, 3, 0)):
        policy.weights_step = weights_step
        plan = policy.start_round(step)
        assert plan.kind == "sync" and len(plan.prompts) == 2
        for k in (1, 0):  # scripted completion order: every second response first
            for slot in range(2):
                decision = policy.on_finished(slot, k, SimpleNamespace(id=f"{slot}:{k}"), None)
        assert decision.round_done
        groups = policy.end_round([])
        assert [g.staleness for g in groups] == [[lag, lag], [lag, lag]]
        assert policy.stats()["sched/staleness_max"] == lag
    policy.weights_step = 5
    with pytest.raises(ValueError, match="weights of step 5"):
        policy.start_round(4)


@pytest.mark.parametrize("kwargs,match", [
    ({}, "train.rollout_correction='none'.*use schedule:sync"),
    ({"train": TrainConfig(rollout_correction="token_tis"), "stream": StreamConfig(enabled=True)}, "stream.enabled"),
    ({"train": TrainConfig(rollout_correction="token_tis"), "plan": PlanConfig(enabled=True)}, "plan.enabled"),
])
def test_composition_is_explicit(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Config(schedule=OneStepOffConfig(), **kwargs)


def test_pools_must_fit_the_world():
    config = Config(schedule=OneStepOffConfig(), train=TrainConfig(rollout_correction="token_tis"))
    config.check_world(2)
    assert config.rollout_ranks(4) == 2 and Config().rollout_ranks(4) == 4
    with pytest.raises(ValueError, match="at least 2 ranks"):
        config.check_world(1)
    with pytest.raises(ValueError, match="rollout_ranks=2 must be between 1 and 1 on 2 ranks"):
        Config(schedule=OneStepOffConfig(rollout_ranks=2),
               train=TrainConfig(rollout_correction="token_tis")).check_world(2)
    with pytest.raises(ValueError, match=r"rollout.tp=2 does not divide the 1 rollout ranks"):
        Config(schedule=OneStepOffConfig(), train=TrainConfig(rollout_correction="token_tis"),
               rollout=RolloutConfig(tp=2)).check_world(2)
    with pytest.raises(ValueError, match="train.train_shard_size=2 does not divide the 3 training ranks"):
        Config(schedule=OneStepOffConfig(rollout_ranks=1),
               train=TrainConfig(rollout_correction="token_tis", train_shard_size=2)).check_world(4)
    assert policy_args("one_step_off") == ["schedule:one_step_off", "--train.rollout-correction", "token_tis"]


def test_the_rollout_pool_knows_the_trainers_parameters_from_the_model_directory():
    """The weight broadcast goes by position: the rollout pool's names and shapes (from the model
    directory's architecture, on the meta device) are the trainer's, in order."""
    import torch

    from rollpacker.model import load_model
    from rollpacker.rollout.weights import parameter_shapes
    from rollpacker.toy.model import toy_model_dir

    trainer_side = parameter_shapes(load_model(toy_model_dir(), torch.device("cpu"), torch.float32), toy_model_dir())
    assert trainer_side == parameter_shapes(None, toy_model_dir()) and len(trainer_side) > 10
