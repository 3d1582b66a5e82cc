"""The controller's batch and metrics: rewards with DAPO's overlong punishment added, one group
number per group, the step's global count over streamed groups too, and the round's metrics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollpacker.config import Config
from rollpacker.controller import Controller
from rollpacker.data.dataset import PromptSampler
from rollpacker.env.episode import Response
from rollpacker.env.setup import Environments
from rollpacker.exchange import RoundResult
from rollpacker.rollout.config import RolloutConfig
from rollpacker.schedule.base import Group
from rollpacker.schedule.sync import SyncPolicy
from rollpacker.train.config import TrainConfig

NO_ENVS = Environments.none(8)
"""The controller's environments where the tests' rounds come without them (round_stats asks for their metrics)."""


class Rewards:
    """What the metrics read of the reward scheduler: the step it scores, and its metrics."""

    def __init__(self):
        from rollpacker.reward.functions import TrainerState

        self.state = TrainerState()

    def take_metrics(self, keys=None) -> dict[str, float]:
        return {"reward/errors": 1, "reward/seconds_total": 1.5}


def output(n: int, reason: str = "stop") -> Response:
    """A single-turn response: the one-turn episode, every token the model's."""
    return Response(id=f"r{n}", prompt_ids=[1, 2], token_ids=list(range(n)), logprobs=[-0.5] * n, finish_reason=reason,
                    loss_mask=[True] * n, num_turns=1)


def round_result(groups: list[Group]) -> RoundResult:
    lengths = sum(len(o.token_ids) for g in groups for o in g.outputs)
    return RoundResult(kind="sync", groups=groups, num_launched=6, cut=[], generated_tokens=lengths + 7,
                       model_tokens=lengths + 7 - 12, wasted_tokens=7,  # 12 an environment's
                       running_trace=[(1.0, 6), (2.0, 3)], start=0.0, last_finish=3.0,
                       rollout_end=3.5, end=4.0, num_preemptions=2)


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_make_batch_and_round_stats(mask_truncated):
    train = TrainConfig(overlong_buffer=20, overlong_penalty=0.5, aggregation="seq-mean-token-sum-norm",
                        mask_truncated=mask_truncated)
    config = Config(train=train, rollout=RolloutConfig(max_new_tokens=100))
    ctl = Controller(config=config, rows=[], eval_rows=None, tokenizer=None, rewards=Rewards(),
                     policy=SyncPolicy(PromptSampler(4, 0), 1, 1), metrics=None, display=None, max_model_len=200,
                     envs=NO_ENVS)
    streamed = Group(prompt=0, outputs=[output(10), output(90)], rewards=[1.0, 0.0], streamed=True)
    kept = Group(prompt=1, outputs=[output(100, "length"), output(5), output(7)], rewards=[0.0, 0.0, 1.0])
    result = round_result([streamed, kept])
    samples, count = ctl.make_batch(result)
    # The streamed group is not in the batch.
    # Overlong (buffer 20 before 100, penalty 0.5): 90 tokens -> -0.25, 100 -> -0.5.
    assert [(len(s.response_ids), s.reward + s.shaping, s.truncated) for s in samples] == [
        (100, -0.5, True), (5, 0.0, False), (7, 1.0, False)]
    assert len({s.group for s in samples}) == 1
    # seq-mean-token-sum-norm counts every trained response (streamed too), times 100 tokens.
    assert count == (4 if mask_truncated else 5) * 100
    stats = ctl.round_stats(result)
    assert stats["reward/mean"] == pytest.approx(2 / 5) and stats["reward/accuracy"] == pytest.approx(2 / 5)
    assert stats["reward/zero_variance_frac"] == 0  # both groups' responses differ
    solved = Group(prompt=2, outputs=[output(3), output(4)], rewards=[1.0, 1.0])  # nothing to learn from
    assert ctl.round_stats(round_result([solved, kept]))["reward/zero_variance_frac"] == 0.5
    dropped = round_result([kept])  # --schedule.filter-zero-variance dropped the flat group: the share counts it
    dropped.filtered = [solved]
    assert ctl.round_stats(dropped)["reward/zero_variance_frac"] == 0.5
    every = round_result([])  # the filter dropped every group: the warning sign itself (the share went unlogged)
    every.filtered = [solved]
    assert ctl.round_stats(every)["reward/zero_variance_frac"] == 1 and "reward/mean" not in ctl.round_stats(every)
    assert stats["reward/errors"] == 1 and stats["rollout/truncated"] == 1
    assert stats["reward/overlong_penalty_mean"] == pytest.approx(-0.75 / 5)
    assert stats["rollout/response_lengths"] == [10, 90, 100, 5, 7]
    assert stats["rollout/wasted_tokens"] == 7 and stats["reward/seconds_total"] == 1.5
    assert stats["time/reward_exposed"] == 1.0 and stats["sched/trained_prompts"] == 2
    # Rollout ends when the final command came back (3.5), not after the reward wait (4.0): 3 of 6 idle from 2.0.
    assert stats["rollout/bubble_ratio"] == pytest.approx(3 * 1.5 / (6 * 3.5))
    assert stats["rollout/tokens_per_s"] == pytest.approx((212 + 7 - 12) / 3.5)  # the model's tokens: not observations


def test_an_episodes_budget_over_its_turns_is_the_longest_response_of_seq_mean_token_sum_norm():
    """Dr. GRPO's constant is the longest response allowed: an episode's model tokens over its turns
    (env.max_tokens), not one turn's (rollout.max_new_tokens), which they pass."""
    from rollpacker.env.config import EnvConfig

    config = Config(train=TrainConfig(aggregation="seq-mean-token-sum-norm"), rollout=RolloutConfig(max_new_tokens=100),
                    env=EnvConfig(factory="toy", max_tokens=300))
    ctl = Controller(config=config, rows=[], eval_rows=None, tokenizer=None, rewards=Rewards(),
                     policy=SyncPolicy(PromptSampler(4, 0), 1, 1), metrics=None, display=None, max_model_len=400,
                     envs=NO_ENVS)
    _, count = ctl.make_batch(round_result([Group(prompt=0, outputs=[output(250), output(5)], rewards=[1.0, 0.0])]))
    assert count == 2 * 300


def test_an_episode_cut_by_its_turn_limit_or_its_environments_time_limit_is_truncated():
    """env.max_turns and the environment's truncated cut an episode unfinished, as a token limit does (verifiers'
    is_truncated): train.mask_truncated masks it and rollout/truncated counts it. They read "stop" as a response,
    so both took them as finished."""
    ctl = Controller(config=Config(train=TrainConfig(mask_truncated=True)), rows=[], eval_rows=None, tokenizer=None,
                     rewards=Rewards(), policy=SyncPolicy(PromptSampler(4, 0), 1, 1), metrics=None, display=None,
                     max_model_len=200, envs=NO_ENVS)
    ends = ["max_turns", "truncated", "terminated", "answer"]
    outputs = [output(4) for _ in ends]
    for o, reason in zip(outputs, ends):
        o.reason = reason
    group = Group(prompt=0, outputs=outputs, rewards=[1.0, 0.0, 1.0, 0.0])
    samples, count = ctl.make_batch(round_result([group]))
    assert [s.truncated for s in samples] == [True, True, False, False] and count == 2 * 4
    assert ctl.round_stats(round_result([group]))["rollout/truncated"] == 2


def test_reward_correct_counts_its_functions_value_not_the_weighted_total():
    """TRL's accuracy + format pair: a well-formed wrong answer totals 1; reward.correct accuracy counts it wrong.
    A row of another task, where the function returns None, is decided by its reward."""
    config = Config()
    config.reward.correct = "accuracy"
    rewards = Rewards()
    rewards.values = {"r3": {"rewards": {"accuracy": 0.0, "fmt": 1.0}}, "r4": {"rewards": {"accuracy": 1.0}},
                      "r5": {"rewards": {"accuracy": None, "code": 1.0}}}
    ctl = Controller(config=config, rows=[], eval_rows=None, tokenizer=None, rewards=rewards,
                     policy=SyncPolicy(PromptSampler(4, 0), 1, 1), metrics=None, display=None, max_model_len=200,
                     envs=NO_ENVS)
    group = Group(prompt=0, outputs=[output(3), output(4), output(5), output(6)], rewards=[1.0, 1.0, 1.0, 0.0])
    assert [ctl.solved(o, r) for o, r in zip(group.outputs, group.rewards)] == [False, True, True, False]
    assert ctl.round_stats(round_result([group]))["reward/accuracy"] == pytest.approx(2 / 4)
    config.reward.correct = ""
    assert ctl.round_stats(round_result([group]))["reward/accuracy"] == pytest.approx(3 / 4)


def test_reward_metrics_leave_out_episodes_whose_environment_failed():
    """A failed episode (finish_reason "error", counted in env/errors) is out of its group's advantages:
    its reward (0, or whatever its functions gave) is out of reward/mean and reward/accuracy too."""
    ctl = Controller(config=Config(), rows=[], eval_rows=None, tokenizer=None, rewards=Rewards(),
                     policy=SyncPolicy(PromptSampler(4, 0), 1, 1), metrics=None, display=None, max_model_len=200,
                     envs=NO_ENVS)
    failed = output(4, "error")
    failed.loss_mask, failed.info = [True, True, False, True], {"tool_calls": 3.0}  # 3 model tokens, 1 env's
    group = Group(prompt=0, outputs=[output(3), failed, output(5)], rewards=[1.0, 5.0, 0.0])
    stats = ctl.round_stats(round_result([group]))
    assert stats["reward/mean"] == pytest.approx(0.5) and stats["reward/accuracy"] == pytest.approx(0.5)
    assert stats["rollout/env_tokens"] == 0 and "env/info/tool_calls" not in stats
    assert stats["rollout/model_tokens"] == 3 + 5  # the trained episodes'
    ctl.config.train.overlong_buffer = 8  # DAPO's punishment near the budget (400): none for a failed episode
    assert ctl.overlong(output(398)) < 0 and ctl.overlong(output(398, "error")) == 0
    ctl.config.train.overlong_buffer = 0
    lost = Group(prompt=1, outputs=[output(2, "error"), output(3, "error")], rewards=[0.0, 0.0])
    assert stats["sched/failed_prompts"] == 0
    assert ctl.round_stats(round_result([group, lost]))["sched/failed_prompts"] == 1  # trained nothing
    samples = ctl.group_samples(group)  # it trains none of its tokens
    assert [s.failed for s in samples] == [False, True, False] and samples[1].loss_mask == [False] * 4
    assert [s.num_model_tokens for s in samples] == [3, 0, 5]
    assert stats["rollout/response_lengths"] == [3, 4, 5]
    stats = ctl.round_stats(round_result([]))  # nothing trained (every group filtered out): no reward to mean
    assert "reward/mean" not in stats and "reward/accuracy" not in stats and stats["sched/trained_prompts"] == 0


def test_a_prompt_retires_on_what_its_working_episodes_solved():
    """data.retire_solved counts solved responses as reward/accuracy does: a failed episode that scored 1 once
    retired a prompt nobody solved, and one that scored 0 kept a prompt every working episode solved."""
    config = Config()
    config.data.retire_solved = 1.0
    sampler = PromptSampler(4, 0, retire_solved=1.0)
    ctl = Controller(config=config, rows=[], eval_rows=None, tokenizer=None, rewards=Rewards(),
                     policy=SyncPolicy(sampler, 2, 2), metrics=None, display=None, max_model_len=200, envs=NO_ENVS)
    ctl.retire_solved(round_result([Group(prompt=0, outputs=[output(3), output(4, "error")], rewards=[0.0, 1.0]),
                                    Group(prompt=1, outputs=[output(3), output(4, "error")], rewards=[1.0, 0.0])]))
    assert sampler.retiring == {1}


def test_samples_hold_every_scored_response_and_the_prompt_each_episode_had(tmp_path):
    """A filtered group's responses were scored but never written (and their reward values never taken);
    an episode whose reset gave the prompt was written with its row's (empty) one."""
    import json
    from dataclasses import replace

    from rollpacker.metrics import MetricsConfig, MetricsLogger
    from rollpacker.toy.model import build_tokenizer

    class Scored(Rewards):
        values = {"r3": {"rewards": {"f": 1.0}, "extra": {}}, "r4": {"rewards": {"f": 0.0}, "extra": {}}}

        def take_values(self, keys):
            return {k: self.values.pop(k) for k in keys if k in self.values}

        def decode(self, ids):
            return str(ids)

    config = Config()
    config.metrics.samples_every = 1
    rewards = Scored()
    ctl = Controller(config=config, rows=[{"id": "a", "prompt": ""}, {"id": "b", "prompt": "Q: 1+1"}],
                     eval_rows=None, tokenizer=build_tokenizer(), rewards=rewards,
                     policy=SyncPolicy(PromptSampler(2, 0), 1, 1),
                     metrics=MetricsLogger(tmp_path, MetricsConfig(wandb_mode="disabled"), {}), display=None,
                     max_model_len=200, envs=NO_ENVS)
    result = round_result([Group(prompt=0, outputs=[replace(output(3), prompt="Q: 2+2")], rewards=[1.0])])
    result.filtered = [Group(prompt=1, outputs=[output(4)], rewards=[0.0])]
    ctl.write_samples(0, result)
    rows = [json.loads(line) for line in (tmp_path / "samples" / "step_0.jsonl").read_text().splitlines()]
    assert [(r["row"], r["prompt"], r["trained"], r["rewards"]) for r in rows] == [
        ("a", "Q: 2+2", True, {"f": 1.0}), ("b", "Q: 1+1", False, {"f": 0.0})]
    assert rewards.values == {}


def test_an_episode_trains_its_model_tokens_with_its_step_rewards_on_their_actions():
    """An episode's sample: the loss mask and step rewards come along; its reward is the round's (its
    environment's plus its functions', composed by the reward side), so the return at its first token
    is the round's reward. The overlong punishment counts model tokens against env.max_tokens, the
    normalizer model tokens."""
    from rollpacker.env.config import EnvConfig

    train = TrainConfig(overlong_buffer=4, overlong_penalty=1.0, aggregation="token-mean")
    config = Config(train=train, rollout=RolloutConfig(max_new_tokens=8), env=EnvConfig(factory="toy", max_tokens=10))
    ctl = Controller(config=config, rows=[], eval_rows=None, tokenizer=None, rewards=Rewards(),
                     policy=SyncPolicy(PromptSampler(4, 0), 1, 1), metrics=None, display=None, max_model_len=200,
                     envs=NO_ENVS)
    mask = [True] * 3 + [False] * 4 + [True] * 5  # 8 model tokens: 2 into the buffer of 4 before 10
    episode = Response(id="0:0:0", prompt_ids=[1], token_ids=list(range(12)), logprobs=[-0.1] * 12,
                            finish_reason="stop", loss_mask=mask, step_rewards={2: 0.25, 11: 0.5}, num_turns=2)
    result = round_result([Group(prompt=0, outputs=[episode], rewards=[0.25 + 0.5 + 1.0])])  # a function gave 1.0
    (sample,), count = ctl.make_batch(result)
    assert sample.loss_mask == mask and sample.token_rewards == {2: 0.25, 11: 0.5}
    assert (sample.reward, sample.shaping) == pytest.approx((1.75, -0.5))  # the round's 1.75, punished 2/4 of 1.0
    assert count == 8  # token-mean counts the model's tokens, not the environment's 4
    stats = ctl.round_stats(result)
    assert (stats["rollout/model_tokens"], stats["rollout/env_tokens"]) == (8, 4)


def test_a_round_where_most_episodes_failed_in_their_environment_stops_the_run():
    from rollpacker.env.config import EnvConfig
    from rollpacker.env.contract import EnvError
    from rollpacker.reward.functions import TrainerState

    def controller(frac):
        rewards = Rewards()
        rewards.state = TrainerState(global_step=3)
        return Controller(config=Config(env=EnvConfig(factory="toy", max_error_frac=frac)), rows=[], eval_rows=None,
                          tokenizer=None, rewards=rewards, policy=SyncPolicy(PromptSampler(4, 0), 1, 1), metrics=None,
                          display=None, max_model_len=200, envs=NO_ENVS)

    result = round_result([Group(prompt=0, outputs=[output(3)], rewards=[1.0])])  # 6 episodes launched
    result.env_errors = ["toy: episode '3:0:1' (row 'r1'): step raised RuntimeError: broken"] * 3
    result.hook_metrics = {"env/steps": 7.0, "env/step_errors": 3.0}
    controller(0.5).check_environments(result)  # 3 of 6: not over half
    with pytest.raises(EnvError, match=r"4 of 6 episodes at step 3 failed in their environment \(3 of its 7 step "
                                       r"calls\), more than --env.max-error-frac 0.5; the first: toy: episode "
                                       r"'3:0:1' \(row 'r1'\).*RuntimeError: broken.*--resume auto"):
        result.env_errors.append(result.env_errors[0])
        controller(0.5).check_environments(result)
    controller(1.0).check_environments(result)  # never
    # most episodes ended by a token limit before stepping; every step call failed: broken all the same
    result.env_errors, result.hook_metrics = result.env_errors[:2], {"env/steps": 8.0, "env/step_errors": 8.0}
    with pytest.raises(EnvError, match=r"2 of 6 episodes at step 3 failed in their environment \(8 of its 8 step"):
        controller(0.5).check_environments(result)
    result.hook_metrics = {"env/steps": 7.0, "env/step_errors": 2.0}  # a few calls: their share says nothing yet
    controller(0.5).check_environments(result)


def test_rows_are_fitted_with_the_schemas_of_the_tools_their_episodes_start_with():
    """With env.tools, a row's prompt is measured with the tools' schemas in the chat template, as its episodes
    start: a row that fits the context alone but not with them is left out (it would fail in every round)."""
    import dataclasses

    from rollpacker.controller import encode, row_encoder
    from rollpacker.data.dataset import DatasetError, fit_rows
    from rollpacker.env.config import EnvConfig
    from rollpacker.toy.tools_model import build_tools_tokenizer

    tokenizer, row = build_tools_tokenizer(), {"id": "r", "prompt": "What is 12 * 34?"}
    plain = Config()
    with_tools = dataclasses.replace(plain, env=EnvConfig(tools=("rollpacker.toy.tools:calculator",)))
    alone, tooled = row_encoder(tokenizer, plain)(row), row_encoder(tokenizer, with_tools)(row)
    assert alone == encode(tokenizer, plain, row["prompt"]) and len(tooled) > len(alone) + 20
    assert "calculator(expression: string)" in tokenizer.decode(tooled)

    def fit(config: Config) -> list[dict]:
        return fit_rows([row], row_encoder(tokenizer, config), max_model_len=len(alone) + 10, kv_tokens=4096,
                        max_new_tokens=4)

    assert fit(plain) == [row]
    with pytest.raises(DatasetError, match="no prompt of data.path fits the context length"):
        fit(with_tools)


def test_the_reward_functions_of_a_held_out_round_are_told_its_step():
    """trainer_state.global_step in an evaluation is the step evaluated (it was the last training round's)."""
    rewards = Rewards()
    ctl = Controller(config=Config(), rows=[], eval_rows=[{"id": "e0", "prompt": "1+1"}], tokenizer=None,
                     rewards=rewards, policy=SyncPolicy(PromptSampler(4, 0), 1, 1), metrics=None,
                     display=SimpleNamespace(update=None), max_model_len=200, envs=NO_ENVS)
    ctl.build_leaders()
    ctl.eval_round(5)
    assert rewards.state.global_step == 5 and rewards.state.max_steps == Config().num_steps


def test_trainer_state_epoch_is_the_data_the_steps_before_drew():
    """TRL's trainer_state.epoch: 0 at step 0, then the passes the steps before drew (a round's own draw not yet);
    an evaluation before step 2 sees step 2's training epoch."""
    rewards = Rewards()
    ctl = Controller(config=Config(), rows=[], eval_rows=[{"id": "e0", "prompt": "1+1"}], tokenizer=None,
                     rewards=rewards, policy=SyncPolicy(PromptSampler(4, 0), 1, 1), metrics=None,
                     display=SimpleNamespace(update=None, start_step=lambda *a: None), max_model_len=200, envs=NO_ENVS)
    ctl.build_leaders()
    epochs = []
    for step in range(3):
        ctl.train_round(step, ctl.plan_round(step))
        epochs.append(rewards.state.epoch)
    ctl.eval_round(3)
    assert epochs == [0.0, 0.25, 0.5] and rewards.state.epoch == 0.75


def test_a_checkpoint_keeps_the_lengths_the_next_round_resumes_with_replay_lengths():
    """``rollout.replay_lengths`` under sorted_partial: a partial resumed after a restart keeps its first length."""
    from rollpacker.data.lengths import LengthReplay

    class Saved(Rewards):
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    def controller() -> Controller:
        return Controller(config=Config(), rows=[], eval_rows=None, tokenizer=None, rewards=Saved(),
                          policy=SyncPolicy(PromptSampler(4, 0), 1, 1), metrics=None, display=None,
                          max_model_len=200, envs=NO_ENVS, replay=LengthReplay(0, 512))

    before, after = controller(), controller()
    first = before.replay("4:2:1", row=7, step=4, slot=2, response=1)
    after.load_state_dict(before.state_dict())
    assert after.replay("5:0:1", row=7, step=5, slot=0, response=1, earlier=SimpleNamespace(id="4:2:1")) == first
