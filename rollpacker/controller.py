"""The controller: rank 0's part of the job.

It holds what only rank 0 has: the data rows, the tokenizer, the scheduling policy, the reward
scheduler, the metrics sinks and live display, and the parallelism planner. It builds rank 0's
side of the exchange once per run (:class:`~rollpacker.exchange.RoundLeader`, one for training and
one for evaluation) and starts each round on it. It turns the round's result into the batch to
train (each response's reward and group, the step's global normalizer) and its metrics
(:meth:`~rollpacker.exchange.RoundResult.metrics`). The RL math (advantages, the loss) is the
trainer's: :mod:`rollpacker.train`. The loops that call both are in :mod:`rollpacker.loops`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from rollpacker.config import Config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rollpacker.data.lengths import LengthReplay
    from rollpacker.dist import Meshes
    from rollpacker.env.setup import Environments
    from rollpacker.exchange import ExchangeRound, GroupSink, RoundLeader, RoundResult
    from rollpacker.metrics import LiveDisplay, MetricsLogger
    from rollpacker.plan.planner import Planner
    from rollpacker.reward.scheduler import RewardScheduler
    from rollpacker.rollout.engine import SamplingParams
    from rollpacker.schedule.base import Group, Policy, RoundPlan
    from rollpacker.schedule.drafts import DraftMemory
    from rollpacker.schedule.round import RoundHooks
    from rollpacker.train.trainer import Sample

logger = logging.getLogger("rollpacker")

SHOWN_ERRORS = 3
"""Environment errors said per round (each once); the rest are counted in ``env/errors``."""
STEP_CALLS_READ = 8
"""Step calls a round needs before ``env.max_error_frac`` reads the share of them that failed."""


@dataclasses.dataclass
class Controller:
    config: Config
    rows: list[dict]
    eval_rows: list[dict] | None
    """Held-out prompts (``eval_every``), None without evaluation."""
    tokenizer: PreTrainedTokenizerBase
    rewards: RewardScheduler
    """Scores each response as it finishes."""
    policy: Policy
    metrics: MetricsLogger
    display: LiveDisplay
    max_model_len: int
    """The engines' context length: a longer prompt is a data error."""
    kv_tokens: int = 1 << 62
    """The engines' KV cache capacity, in tokens: one request must fit it, an episode's last turn too."""
    planner: Planner | None = None
    """The parallelism planner, with ``plan.enabled``."""
    replay: LengthReplay | None = None
    """With ``rollout.replay_lengths``: the forced response lengths."""
    drafts: DraftMemory | None = None
    """What earlier rounds generated per prompt: drafts (``engine.speculative``) and longest-first estimates."""
    group_ids: itertools.count = dataclasses.field(default_factory=itertools.count)
    """Numbers each trained group's samples (the trainer's advantage groups)."""
    leader: RoundLeader | None = None
    """Rank 0's side of every training round (:meth:`build_leaders`)."""
    eval_leader: RoundLeader | None = None
    """Rank 0's side of every held-out round (with ``eval_every``)."""
    envs: Environments | None = None
    """How each episode starts and reaches its environment, if any (:meth:`build_envs`)."""
    closed: bool = False
    """:meth:`close` ran."""
    epochs_before: float = 0.0
    """Passes over the data the steps before the round :meth:`plan_round` planned last had drawn (TRL's epoch)."""

    @classmethod
    def build(cls, config: Config, model_dir: Path, meshes: Meshes, max_model_len: int, kv_tokens: int, *,
              drafting: bool = False, sink: GroupSink | None = None) -> Controller:
        """Rank 0's parts; ``max_model_len`` and ``kv_tokens`` (KV cache capacity) are the engines':
        prompts they would reject are left out of the data and counted. ``drafting``: the engines
        take drafts from the controller (``EngineKind.own_drafter`` is False); ``sink``: the
        freed ranks of stream training."""
        from transformers import AutoTokenizer

        from rollpacker.data.dataset import (
            PromptSampler,
            check_held_out,
            eval_field,
            fit_rows,
            load_eval_rows,
            load_rows,
        )
        from rollpacker.data.lengths import LengthReplay
        from rollpacker.metrics import LiveDisplay, MetricsLogger
        from rollpacker.reward.scheduler import build_functions, check_columns, check_row
        from rollpacker.schedule.drafts import DraftMemory

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        drafting = drafting and config.engine.speculative != "off"
        # the user's reward code imported: its errors come first
        functions = build_functions(config.reward, environment=bool(config.env.factory))
        check = functools.partial(check_row, functions) if functions else None  # a row no function scores: an error
        fit = functools.partial(fit_rows, encode=row_encoder(tokenizer, config),
                                max_model_len=max_model_len, kv_tokens=kv_tokens,
                                max_new_tokens=config.rollout.max_new_tokens,
                                max_prompt_length=config.data.max_prompt_length,
                                skip_bad=config.data.skip_bad_lines,
                                kv_setting="engine.memory_mb (the KV cache gets what the weights' shard at rollout.tp "
                                "leaves)" if config.engine.memory_mb else "engine.kv_memory_mb")
        rows = fit(load_rows(config.data, check), field="data.path" if config.data.path else "the toy task's rows")
        eval_rows = (fit(load_eval_rows(config.data, check), field=eval_field(config.data)) if config.eval_every
                     else None)
        held_out = "data.eval_path" if config.data.eval_path else "data.eval_split" if config.data.eval_split else ""
        if held_out and not config.eval_every:  # a preset's eval_every=0 under a flag naming held-out prompts
            logger.warning("%s is not read: eval_every=0 turns evaluation off (set eval_every to the steps between "
                           "evaluations to run them)", held_out)
        check_held_out(config.data, rows, eval_rows)
        check_columns(functions, rows, "data.path")
        check_columns(functions, eval_rows or [], "data.eval_path")
        ctl = cls(config=config, rows=rows, eval_rows=eval_rows, tokenizer=tokenizer,
                   rewards=reward_scheduler(config, tokenizer, meshes.device, functions),
                   policy=config.schedule.build(PromptSampler.for_data(rows, config.data),
                                                 config.rollout.num_prompts, config.rollout.group_size,
                                                 num_epochs=config.num_epochs, last_step=config.num_steps - 1),
                   metrics=MetricsLogger(Path(config.run_dir), config.metrics, config.as_dict()),
                   display=LiveDisplay(config.metrics.live, num_steps=config.num_steps), max_model_len=max_model_len,
                   kv_tokens=kv_tokens,
                   replay=LengthReplay(config.seed, config.rollout.max_new_tokens) if config.rollout.replay_lengths
                   else None,
                   drafts=DraftMemory(keep_tokens=drafting) if drafting or config.rollout.longest_first else None)
        ctl.build_envs(model_dir)
        ctl.build_leaders(sink)
        return ctl

    def build_envs(self, model_dir: Path) -> None:
        """How each episode starts: the environment's workers and chat bridge with one (``env``), and
        how an episode's prompt is encoded (as a row's, with its tools)."""
        from rollpacker.env.parsers import PARSERS
        from rollpacker.env.render import ChatBridge
        from rollpacker.env.setup import Environments
        from rollpacker.env.workers import EnvPool, EnvSpec
        from rollpacker.model.hf_decoder import decoder_facts

        cfg = self.config
        if not cfg.env.enabled:
            self.envs = Environments.none(cfg.rollout.max_new_tokens, seed=cfg.seed, max_context=self.max_model_len)
            self.envs.check_prompts([*self.rows, *(self.eval_rows or [])])
            return
        bridge = ChatBridge(self.tokenizer, template_kwargs=cfg.model.chat_template_kwargs, stop=cfg.rollout.stop,
                            template_breaks=cfg.env.template_breaks, keep=PARSERS[cfg.env.tool_parser].markers,
                            eos=decoder_facts(model_dir).eos_token_ids)  # the ids a turn stops at
        # reward functions taking TRL's `environments` get a copy of each episode's environment
        spec = EnvSpec.from_config(cfg.env, states=any(f.ref.environments for f in self.rewards.functions),
                                   sandbox=cfg.reward.sandbox)
        self.envs = Environments(cfg=cfg.env, pool=EnvPool(cfg.env, spec), bridge=bridge,
                                 encode=functools.partial(encode, self.tokenizer, cfg), seed=cfg.seed,
                                 max_new_tokens=cfg.rollout.max_new_tokens,
                                 max_context=min(self.max_model_len, self.kv_tokens),  # what a turn may reach
                                 templated=cfg.model.chat_template or cfg.model.shipped)  # the toy models: raw

    def build_leaders(self, sink: GroupSink | None = None) -> None:
        """Rank 0's side of the exchange for the run: training rounds (their groups fed to ``sink``),
        and held-out rounds (``eval.n`` responses per prompt, greedy unless ``eval.temperature``)."""
        from rollpacker.exchange import RoundLeader
        from rollpacker.schedule.eval import EvalPolicy
        from rollpacker.schedule.round import Routing

        cfg = self.config
        self.leader = RoundLeader(policy=self.policy, rows=self.rows, encode=self.encode_prompt, rewards=self.rewards,
                                  sampling=self.sampling, envs=self.envs, lengths=self.replay,
                                  progress=self.display.update, make_samples=self.group_samples, sink=sink,
                                  routing=Routing(by_group=cfg.rollout.routing == "group",
                                                  longest_first=cfg.rollout.longest_first),
                                  memory=self.drafts, draft_context=bool(self.drafts and self.drafts.keep_tokens))
        if self.eval_rows is not None:
            sampling = dataclasses.replace(self.sampling, temperature=cfg.eval.temperature)
            self.eval_leader = RoundLeader(policy=EvalPolicy(len(self.eval_rows), cfg.eval.n), rows=self.eval_rows,
                                           encode=self.encode_prompt, rewards=self.rewards, sampling=sampling,
                                           envs=self.envs, env_tag="eval/", held_out=True)

    def build_planner(self, profile: dict, world: int, num_kv_heads: int) -> None:
        """The planner over the TPs usable on ``world`` ranks whose KV cache holds the longest request (the rows
        were fitted to the starting engines'), starting at ``plan.initial_tp`` or the profile's best TP for a round
        without tail batching."""
        from rollpacker.plan.planner import Planner, best_tp, usable_tps

        cfg = self.config
        lengths = [len(self.encode_prompt(r)) for r in self.rows]
        longest = min(self.max_model_len, max(lengths) + cfg.rollout.max_new_tokens)
        candidates = [t for t in usable_tps(world, num_kv_heads, cfg.plan)
                      if profile["tp"].get(str(t), {}).get("kv_capacity_tokens", 0) >= longest]
        prompt_len = round(sum(lengths[:64]) / len(lengths[:64]))
        initial, estimates = best_tp(profile, candidates, cfg.rollout.num_prompts * cfg.rollout.group_size,
                                     prompt_len, cfg.rollout.max_new_tokens, max_num_seqs=cfg.engine.max_num_seqs)
        initial = cfg.plan.initial_tp or initial
        logger.info("plan: estimated round without tail batching (s) by TP: %s; starting at TP %d (usable: %s)",
                    {t: round(v, 3) for t, v in estimates.items()}, initial, candidates)
        self.planner = Planner(cfg.plan, candidates, initial, profile=profile, world=world, prompt_len=prompt_len,
                               max_num_seqs=cfg.engine.max_num_seqs)

    @property
    def sampling(self) -> SamplingParams:
        """The rollout's sampling settings."""
        return self.config.rollout.sampling()

    def plan_round(self, step: int) -> RoundPlan:
        """The policy's plan of ``step``'s training round; its reward functions' ``trainer_state.epoch`` is the
        data the steps before it drew (TRL's, 0 at step 0), not this round's draw too."""
        self.epochs_before = self.epochs_drawn()
        return self.policy.start_round(step)

    def train_round(self, step: int, plan: RoundPlan, hooks: RoundHooks | None = None) -> ExchangeRound:
        """Training round ``plan`` of ``step`` for the exchange, with ``hooks``; the live display starts the step."""
        self.display.start_step(step, len(plan.prompts) * plan.num_responses)  # tail's over-provisioned round too
        self.rewards.state = self.trainer_state(step, self.epochs_before)
        return self.leader.round(step, plan, hooks)

    def trainer_state(self, step: int, epoch: float):
        """TRL's ``trainer_state`` for the reward functions at ``step``, ``epoch`` passes over the data drawn."""
        from rollpacker.reward.functions import TrainerState

        cfg = self.config
        return TrainerState(global_step=step, epoch=epoch, max_steps=cfg.num_steps, num_train_epochs=cfg.num_epochs,
                            train_batch_size=cfg.rollout.num_prompts * cfg.rollout.group_size)

    def epochs_drawn(self) -> float:
        """Passes over the data the policy's sampler has drawn; 0 for a policy of the user's without one."""
        sampler = getattr(self.policy, "sampler", None)
        return sampler.epochs_drawn if sampler else 0.0

    def warm(self, step: int) -> None:
        """With ``env.warm``: open the environments of the first episodes of ``step``'s round now, as the policy
        will plan it (planned on a copy of it), so their resets run while the step before trains."""
        from rollpacker.schedule.round import opens_ahead

        if step < self.config.num_steps:
            self.envs.warm(lambda: opens_ahead(self.policy, step, self.envs.seed), self.rows)

    def eval_round(self, step: int) -> ExchangeRound:
        """A held-out round: every eval row once (its reward functions told the step, as a training round's)."""
        self.rewards.state = self.trainer_state(step, self.epochs_drawn())  # before the step draws its prompts
        return self.eval_leader.round(step, self.eval_leader.policy.start_round(step))

    def encode_prompt(self, row: dict) -> list[int]:
        ids = encode(self.tokenizer, self.config, row["prompt"])
        if not ids or len(ids) >= self.max_model_len:
            raise ValueError(f"data row {row['id']!r}: its prompt is {len(ids)} tokens; the context length is "
                             f"{self.max_model_len}")
        return ids

    def retire_solved(self, result: RoundResult) -> None:
        """With ``data.retire_solved``: the sampler hears the rewards of the round's groups, trained and filtered,
        and leaves the solved ones' prompts out of later epochs. An episode whose environment failed is not
        heard (``reward/accuracy`` leaves it out too)."""
        sampler = getattr(self.policy, "sampler", None)
        if self.config.data.retire_solved and sampler is not None:
            for group in result.groups + result.filtered:
                sampler.observe(group.prompt, [self.solved(o, r) for o, r in zip(group.outputs, group.rewards)
                                               if o.finish_reason != "error"])

    def solved(self, output: Any, reward: float | None) -> bool:
        """Whether a scored response counts as correct: ``reward.correct``'s value >= 1, else (none named, or it
        returned None: a row of another task) its reward >= 1. An episode whose environment failed is not."""
        name = self.config.reward.correct
        if output.finish_reason == "error":
            return False
        value = self.rewards.values.get(output.id, {}).get("rewards", {}).get(name) if name else None
        if value is None:
            value = reward
        return value is not None and value >= 1.0

    def trained_rewards(self, group: Group) -> list[tuple[Any, float]]:
        """A scored group's ``(output, reward)`` pairs to train on (a failed reward is 0 already: reward.on_error)."""
        return list(zip(group.outputs, group.rewards))

    @property
    def model_budget(self) -> int:
        """A response's model-token budget (:attr:`rollpacker.config.Config.model_budget`)."""
        return self.config.model_budget[1]

    def overlong(self, output: Any) -> float:
        """DAPO's overlong punishment of ``output`` (``train.overlong_buffer``; 0 when off): of its
        model tokens against its model-token budget (:attr:`model_budget`); none for one that trains nothing
        (its environment failed)."""
        from rollpacker.train.advantages import overlong_penalty

        train = self.config.train
        return overlong_penalty(output.num_model_tokens, self.model_budget, train.overlong_buffer,
                                train.overlong_penalty) * (output.finish_reason != "error")

    def group_samples(self, group: Group) -> list[Sample]:
        """The trainer samples of a scored group (:meth:`trained_rewards`), their rewards and overlong
        punishments, one group number for all of them. A response trains its model's tokens;
        its environment's step rewards (part of its reward) mark where they were earned. One whose
        environment failed is ``failed``, none of its tokens trained: outside its group's advantage statistics.
        With ``train.advantage gdpo`` the reward's parts go apart (:meth:`reward_parts`), for the trainer to
        normalize each in the group."""
        from rollpacker.train.trainer import Sample

        number, gdpo = next(self.group_ids), self.config.train.advantage == "gdpo"
        return [Sample(o.prompt_ids, o.token_ids, 0.0 if gdpo else r, o.logprobs, group=number,
                       truncated=o.truncated, shaping=self.overlong(o),
                       loss_mask=[False] * len(o.token_ids) if o.finish_reason == "error" else o.loss_mask,
                       token_rewards={} if gdpo else dict(o.step_rewards), failed=o.finish_reason == "error",
                       parts=self.reward_parts(o) if gdpo else ())
                for o, r in self.trained_rewards(group)]

    def reward_parts(self, output: Any) -> tuple[tuple[float, float | None], ...]:
        """GDPO's parts of ``output``'s reward (:attr:`~rollpacker.train.trainer.Sample.parts`): each reward
        function's weight and value (None: it did not apply, or failed), then its environment's rewards, summed."""
        if self.rewards.functions and output.id not in self.rewards.values:
            raise RuntimeError(f"train.advantage gdpo: response {output.id!r} trains with no reward function's value "
                               "recorded (a bug: its parts would be lost silently)")
        values = self.rewards.values.get(output.id, {}).get("rewards", {})
        env = sum(output.step_rewards.values()) if output.step_rewards else None
        return (*((f.weight, values.get(f.name)) for f in self.rewards.functions), (1.0, env))

    def make_batch(self, result: RoundResult) -> tuple[list[Sample], int]:
        """The samples left to train (those the stream trainer has not taken) and the step's global
        normalizer, over every sample trained in the step (:func:`rollpacker.train.losses.normalizer`)."""
        from rollpacker.train.losses import normalizer
        from rollpacker.train.trainer import trained_lengths

        cfg = self.config
        per_group = [(g, self.group_samples(g)) for g in result.groups]
        samples = [s for g, group in per_group if not g.streamed for s in group]
        lengths = trained_lengths([s for _, group in per_group for s in group], cfg.train.mask_truncated)
        return samples, normalizer(cfg.train.aggregation, lengths, self.model_budget)

    def round_stats(self, result: RoundResult) -> dict[str, Any]:
        """The round's metrics (:meth:`~rollpacker.exchange.RoundResult.metrics`), the policy's, and the
        reward functions' (:meth:`~rollpacker.reward.scheduler.RewardScheduler.take_metrics`)."""
        self.check_environments(result)
        trained = [pair for g in result.groups for pair in self.trained_rewards(g)]
        self.envs.check_tool_calls([o for o, _ in trained], self.rewards.state.global_step)
        sampler = getattr(self.policy, "sampler", None)
        retired = {"sched/retired": sampler.num_retired} if self.config.data.retire_solved else {}
        penalties, solved = [self.overlong(o) for o, _ in trained], [self.solved(o, r) for o, r in trained]
        return {**result.metrics(trained, penalties, solved), **self.policy.stats(), **retired,
                **result.hook_metrics, **self.envs.take_metrics(),
                **self.rewards.take_metrics(keys=[o.id for o, _ in trained])}  # reward/NAME, reward/errors, ...

    def check_environments(self, result: RoundResult, where: str = "") -> None:
        """Stop the run (an :class:`~rollpacker.env.contract.EnvError`, said once) when more than
        ``env.max_error_frac`` of the round's episodes failed in their environment: a broken environment
        would train on nothing, step after step. ``where``: the round, for the message (default: this step)."""
        from rollpacker.env.contract import EnvError

        failed, frac = len(result.env_errors), self.config.env.max_error_frac
        steps, broken = (int(result.hook_metrics.get(k, 0)) for k in ("env/steps", "env/step_errors"))
        calls_broken = steps >= STEP_CALLS_READ and broken > frac * steps  # a share of a few calls says nothing
        if failed and frac < 1 and (failed > frac * result.num_launched or calls_broken):
            where = where or f"at step {self.rewards.state.global_step}"
            raise EnvError(f"{failed} of {result.num_launched} episodes {where} failed in their environment ("
                           f"{broken} of its {steps} step calls), more than --env.max-error-frac {frac:g}; the first: "
                           f"{result.env_errors[0]}. Stopped before "
                           "using them: fix the environment, then run again with --resume auto "
                           "(--env.max-error-frac 1 goes on without them)")

    def write_samples(self, step: int, result: RoundResult, rows: list[dict] | None = None, name: str = "") -> None:
        """Every scored response of ``result`` (its filtered groups' too, not trained) to
        ``run_dir/samples/NAME.jsonl`` (default ``step_N``) when ``metrics.samples_every`` says the step is
        due; ``rows``: the round's data (the training rows). The round's environment errors are said first,
        each once (at most ``SHOWN_ERRORS``)."""
        causes = result.env_errors
        for cause in causes[:SHOWN_ERRORS]:
            logger.warning("step %d: an episode ended untrained (env.on_error skip, env/errors): %s", step, cause)
        if len(causes) > SHOWN_ERRORS:
            logger.warning("step %d: %d more environment errors (env/errors)", step, len(causes) - SHOWN_ERRORS)
        rows = self.rows if rows is None else rows
        groups = [(g, not name) for g in result.groups] + [(g, False) for g in result.filtered]  # eval: untrained
        values = self.rewards.take_values([o.id for g, _ in groups for o in g.outputs])
        every = self.config.metrics.samples_every
        if not every or step % every:
            return
        from rollpacker.data.chat import prompt_text

        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=False)
        table = "eval_samples" if name else "samples"
        self.metrics.log_samples(step, name or f"step_{step}", [
            {"step": step, "kind": result.kind, "row": rows[g.prompt]["id"],
             "data_source": rows[g.prompt].get("data_source"),
             "prompt": rows[g.prompt]["prompt"] if o.prompt is None else o.prompt,  # its reset's, if it gave one
             "prompt_text": prompt_text(self.tokenizer, o.prompt_ids),
             "answer": rows[g.prompt].get("answer"), "completion": self.rewards.decode(o.token_ids),
             "reward": reward, **values.get(o.id, {"rewards": {}, "extra": {}, "reward_error": None}),
             "length": len(o.token_ids), "finish_reason": o.finish_reason,
             "trained": trained and o.finish_reason != "error", **o.describe(decode)}
            for g, trained in groups for o, reward in zip(g.outputs, g.rewards)], table)

    def end_step(self, step: int, result: RoundResult, stats: dict[str, Any]) -> None:
        """Log the step; the planner takes the round's preemptions (for the next round of its kind)."""
        if self.planner:
            lengths = result.trained_lengths or [1]
            why = self.planner.observe_round(result.kind, result.num_preemptions, result.num_launched,
                                             round(sum(lengths) / len(lengths)))
            if why:
                logger.info("plan: after step %d: %s", step, why)
        self.metrics.log(step, stats)
        self.display.end_step(step, stats)

    def state_dict(self, policy_state: dict[str, Any] | None = None) -> dict[str, Any]:
        """What a checkpoint keeps of rank 0: the policy's state (or ``policy_state``), the reward
        scheduler's, the planner's, the drafts' and the replayed lengths'."""
        state = {"policy": {"name": self.policy.name, **(policy_state or self.policy.state_dict())},
                 "rewards": self.rewards.state_dict()}
        if self.planner:
            state["planner"] = self.planner.state_dict()
        if self.drafts:
            state["drafts"] = self.drafts.state_dict()
        if self.replay:  # the forced lengths of the partials the next round resumes
            state["replay"] = {"step": self.replay.step, "given": self.replay.given}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict({k: v for k, v in state["policy"].items() if k != "name"})
        self.rewards.load_state_dict(state["rewards"])
        if self.planner and "planner" in state:  # a checkpoint saved without the planner: start afresh
            for note in self.planner.load_state_dict(state["planner"]):
                logger.info("%s", note)
        if self.drafts and "drafts" in state:  # saved without speculation or longest-first: start empty
            self.drafts.load_state_dict(state["drafts"])
        if self.replay and "replay" in state:
            self.replay.load(state["replay"])

    def close(self) -> None:
        """Stop the environment and reward workers, flush the metrics; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if self.envs:
            self.envs.close()
        self.rewards.close()
        self.metrics.close()
        self.display.close()


def reward_scheduler(config: Config, tokenizer, device, functions=None):
    """The run's :class:`~rollpacker.reward.scheduler.RewardScheduler` (``functions``: its reward
    functions built already; else built here)."""
    from rollpacker.reward.scheduler import RewardScheduler, build_functions

    functions = build_functions(config.reward, environment=bool(config.env.factory)) if functions is None else functions
    return RewardScheduler(config.reward, functools.partial(response_text, tokenizer, config.rollout.stop), device,
                           functions=functions)


def response_text(tokenizer, stop: tuple[str, ...], token_ids: list[int]) -> str:
    """What the reward and the samples see of a response: its text, cut before a stop string."""
    from rollpacker.data.chat import cut_at_stop

    return cut_at_stop(tokenizer.decode(token_ids, skip_special_tokens=True), stop)


def row_encoder(tokenizer, config: Config) -> Callable[[dict], list[int]]:
    """A data row -> the token ids of its episodes' first prompt, as far as the row says it: its prompt, with
    ``env.tools``' schemas in the chat template (what fits the engines is measured on it)."""
    from rollpacker.env.tools import load_tools, schemas

    tools = schemas(load_tools(config.env.tools)) if config.env.tools else None
    return lambda row: encode(tokenizer, config, row["prompt"], tools)


def encode(tokenizer, config: Config, prompt: str | list[dict], tools: list[dict] | None = None) -> list[int]:
    """The token ids of ``prompt`` (a string or chat messages; ``tools``: an episode's tool schemas),
    as :func:`rollpacker.data.chat.encode` makes them."""
    from rollpacker.data.chat import encode as encode_prompt

    return encode_prompt(tokenizer, prompt, chat_template=config.model.chat_template,
                         system_prompt=config.data.system_prompt, template_kwargs=config.model.chat_template_kwargs,
                         tools=tools)
