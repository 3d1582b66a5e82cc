"""The root config: a tree of the components' own configs, built from a named preset, then tyro flags.

Presets are TOML files in the repository's ``configs/`` directory (``--preset NAME``) or any TOML
file (``--preset path/to/file.toml``); flags override them: ``--rollout.num-prompts 32``.
Nothing here imports torch, so ``--help`` and config errors come back at once.

- ``schedule`` is the scheduling policy with its own settings, a tagged union
  (:mod:`rollpacker.schedule.config`): ``schedule:NAME`` or ``--schedule.policy NAME`` on the command
  line, ``[schedule] policy = NAME`` in a preset. NAME may be an out-of-tree ``package.module:Class``.
- The rules here ask a policy's capabilities (stale samples, pools of its own), never its name.
- :meth:`Config.topology` gives the job's ranks on a world size.

Settings live beside their component when its module is torch-free at import, else in the
package's ``config.py``; no component module imports this root config.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import importlib
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from rollpacker.checkpoint import CheckpointConfig
from rollpacker.choices import check_choices, refuse_unused
from rollpacker.data.dataset import DataConfig
from rollpacker.env.config import EnvConfig
from rollpacker.metrics import MetricsConfig
from rollpacker.plan.config import PlanConfig
from rollpacker.reward.config import RewardConfig
from rollpacker.rollout import ENGINES
from rollpacker.rollout.config import EngineConfig, RolloutConfig
from rollpacker.schedule import config as policies
from rollpacker.schedule.base import PolicyConfig, refuse_with_pools
from rollpacker.schedule.config import check_settings, names, policy_name, schedule_args, switched
from rollpacker.schedule.eval import EvalConfig
from rollpacker.schedule.scale_down import StreamConfig
from rollpacker.schedule.sync import SyncConfig
from rollpacker.topology import Topology
from rollpacker.train.config import TrainConfig
from rollpacker.watchdog import DistConfig

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_PRESET = "toy-cpu"
SHIPPED_MODELS = {"toy": "rollpacker.toy.model:toy_model_dir",
                  "toy-tools": "rollpacker.toy.tools_model:model_dir"}
"""``model.path`` names of the models shipped in the package -> the function that returns the directory."""


@dataclass(kw_only=True)
class ModelConfig:
    path: str = ""
    """Hugging Face model directory (config.json, safetensors, tokenizer), or a shipped one: toy (empty), toy-tools."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Engine weights: auto (bfloat16 on GPU, float32 on CPU), float32 or bfloat16; the trainer keeps fp32 masters."""
    chat_template: bool = False
    """Wrap each string prompt in the tokenizer's chat template as a user turn (message lists always are)."""
    chat_template_kwargs: dict[str, bool | int | float | str] = field(default_factory=dict)
    """Keyword arguments of the tokenizer's apply_chat_template, e.g. enable_thinking false for Qwen3."""
    impl: Literal["auto", "native", "hf"] = "auto"
    """Trainer's model: native (Llama, Qwen2, Qwen3), hf (any transformers decoder; rollout on vLLM/SGLang), auto."""

    def __post_init__(self) -> None:
        from rollpacker.data.chat import check_template_kwargs

        check_choices(self, "model")
        check_template_kwargs(self.chat_template_kwargs)
        # a flag's true or false in any case but tyro's (True, False) reaches here a string, which a template reads
        # as true (any non-empty one)
        self.chat_template_kwargs = {key: {"true": True, "false": False}.get(value.lower(), value)
                                     if isinstance(value, str) else value
                                     for key, value in self.chat_template_kwargs.items()}

    @property
    def shipped(self) -> bool:
        """``path`` names a model shipped in the package (:data:`SHIPPED_MODELS`; empty: the toy model)."""
        return not self.path or self.path in SHIPPED_MODELS

    def directory(self) -> Path:
        """``path``, or the shipped model's directory."""
        if not self.shipped:
            return Path(self.path)
        module, _, function = SHIPPED_MODELS[self.path or "toy"].partition(":")
        return getattr(importlib.import_module(module), function)()


@dataclass(kw_only=True)
class Config:
    run_dir: str = "runs/toy-cpu"
    """Where metrics, checkpoints and plots go."""
    seed: int = 0
    """Seeds sampling and everything else random."""
    num_steps: int = 200
    """RL steps to run (one optimizer step each)."""
    num_epochs: int = 0
    """Stop after this many passes over the data, deferred prompts flushed (0: num_steps alone decides)."""
    eval_every: int = 25
    """Evaluate on held-out prompts (eval/accuracy; see eval) before step 0 and every this many steps; 0 = never."""
    checkpoint_every: int = 20
    """Save a checkpoint every this many steps, and at the end (0: only at the end, or at a stop signal)."""
    resume: str = ""
    """Checkpoint directory to resume from, or "auto": the newest committed one under run_dir (none: start afresh)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The held-out evaluation: responses per prompt and temperature (greedy, one each by default)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    schedule: policies.ScheduleConfig = field(default_factory=SyncConfig)
    """The scheduling policy and its settings (schedule:NAME; see this module's docstring)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    """Episodes: the environment and tools a response talks to over several turns (none: single-turn responses)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        if _READING_PRESET.get():  # its settings together are checked with the flags on top of them (parse)
            return
        if bad := not_finite(self):  # a comparison with NaN is false: most checks would pass it on
            raise ValueError(f"{', '.join(bad)}: not a finite number; give one (no setting takes NaN or infinity)")
        if self.num_steps <= 0 or min(self.checkpoint_every, self.eval_every, self.num_epochs) < 0:
            raise ValueError(f"num_steps={self.num_steps} must be > 0; checkpoint_every={self.checkpoint_every}, "
                             f"eval_every={self.eval_every} and num_epochs={self.num_epochs} >= 0")
        if self.train.skip and (self.stream.enabled or self.pipe or self.schedule.own_pools):
            pools = ", ".join(f"schedule:{name}" for name in names(lambda c: c.own_pools))
            raise ValueError(f"train.skip (rollout alone) with stream.enabled, schedule.pipe or {pools}: they train "
                             f"during rollout; use {', '.join(names(lambda c: not c.own_pools))}")
        self._check_engine()
        s = self.schedule
        if s.stale_samples and self.train.rollout_correction == "none":
            raise ValueError(
                f"schedule:{s.name} with train.rollout_correction='none': {s.stale_samples}, so its samples are "
                "stale (tokens sampled by earlier steps) and the on-policy loss would treat them as the current "
                "policy's. Set "
                "train.rollout_correction to 'token_tis' (truncated importance sampling) or another correction, "
                f"or use schedule:{s.on_policy_alternative}")
        if self.data.path:
            self._check_data()
        from rollpacker.train.advantages import ADVANTAGES

        t = self.train.teacher  # distillation alone: its loss term trains without advantages
        distilled = t.path and t.in_loss and not t.task_weight
        if self.rollout.group_size < 2 and ADVANTAGES[self.train.advantage].group_baseline and not distilled:
            others = " or ".join(k for k, e in ADVANTAGES.items() if not e.group_baseline)
            alone = " (or train.teacher.task_weight 0: the teacher's loss term alone)" if t.path and t.in_loss else ""
            raise ValueError(f"rollout.group_size={self.rollout.group_size} with train.advantage="
                             f"{self.train.advantage!r}: its baseline is the group's, so a group of one response has "
                             "advantage 0 and the task's reward would train nothing. Set rollout.group_size to 2 or "
                             f"more (TRL's num_generations), or train.advantage to {others}{alone}")
        if self.train.advantage == "gae" and self.train.critic.warmup_steps >= self.num_steps:
            raise ValueError(f"train.critic.warmup_steps={self.train.critic.warmup_steps} is not below num_steps="
                             f"{self.num_steps}: each step would train the critic alone and the policy never. Set it "
                             f"below {self.num_steps}")
        if s.filter_zero_variance and self.rollout.group_size < 2:
            raise ValueError("schedule.filter_zero_variance drops the groups whose rewards are all equal: with "
                             "rollout.group_size=1 that is every group; use a group size of 2 or more")
        signal = ("train.advantage gdpo (it normalizes each reward function's values alone, which may differ where "
                  "their weighted sum does not)" if self.train.advantage == "gdpo" else
                  "train.teacher.path (the teacher's signal differs where the task rewards do not)"
                  if self.train.teacher.path else "")
        if s.filter_zero_variance and signal:
            raise ValueError(f"schedule.filter_zero_variance with {signal}: the filter drops a group whose rewards are "
                             "all equal as having nothing to learn from, and it has; drop the filter")
        if s.filter_zero_variance and self.reward.group_funcs:
            raise ValueError(f"schedule.filter_zero_variance with reward.group_funcs {list(self.reward.group_funcs)}: "
                             "the filter decides on each response's reward as it is scored, before a group function "
                             "has seen its group; drop one of them")
        refuse_with_pools(s, stream=("stream.enabled", self.stream.enabled),
                          planner=("plan.enabled", self.plan.enabled))
        self._refuse_unused()
        if self.pipe:
            self._check_pipe()
        streaming = "stream.enabled" if self.stream.enabled else "schedule.pipe" if self.pipe else ""
        if streaming:
            self._check_streaming(streaming)
        if self.env.enabled:
            self._check_episodes()
        elif given := [f"env.{f.name}" for f in dataclasses.fields(self.env) if getattr(self.env, f.name) != f.default]:
            raise ValueError(f"{', '.join(given)}: given, but there is no environment (responses are single turns "
                             "of rollout.max_new_tokens): set env.factory or env.tools, or leave them out")
        self.schedule.settle(episodes=self.env.enabled)
        budget = self.model_budget
        if self.train.overlong_buffer >= budget[1]:
            raise ValueError(f"train.overlong_buffer={self.train.overlong_buffer} is not below {budget[0]}="
                             f"{budget[1]}, the budget it counts back from: every response would be punished. "
                             f"Set a buffer below {budget[1]} (DAPO: a fifth of it)")
        if self.train.mini_batches > self.rollout.num_prompts:
            raise ValueError(f"train.mini_batches={self.train.mini_batches} exceeds rollout.num_prompts="
                             f"{self.rollout.num_prompts}: a mini-batch holds whole groups, at least one")

    def _refuse_unused(self) -> None:
        """The stream trainer's, the planner's and speculation's settings without them (RolloutPipe reads no
        stream.*; the profiler reads plan.profile*, plan.max_tp)."""
        st, adaptive = self.stream, self.stream.enabled and not self.stream.trigger
        refuse_unused((
            *((st, f"stream.{name}", st.enabled, "stream.enabled") for name in ("trigger", "fetch_cap")),
            *((st, f"stream.{name}", adaptive, "stream.enabled and stream.trigger 0: the adaptive trigger")
              for name in ("length_quantile", "criterion")),
            *((self.plan, f"plan.{name}", self.plan.enabled, "plan.enabled")
              for name in ("initial_tp", "raise_factor", "recent_steps", "quiet_steps", "profile_guard", "per_kind")),
            (self.engine, "engine.spec_max_tokens", self.engine.speculative != "off", "engine.speculative on or auto"),
            *((self.data, f"data.{name}", bool(self.data.path), "data.path: the toy task has no splits")
              for name in ("split", "eval_split")),
        ))

    def _check_engine(self) -> None:
        """What ``engine.kind`` cannot do, refused naming the engines that can (auto: at its start, by the engine
        it resolves to)."""
        engine = ENGINES.get(self.engine.kind)
        if engine is None:
            return
        if self.plan.enabled and not engine.supports_tp_switch:
            switchable = " or ".join(repr(k) for k, e in ENGINES.items() if e.supports_tp_switch)
            raise ValueError(f"plan.enabled with engine.kind={self.engine.kind!r}: {engine.no_tp_switch}; use "
                             f"engine.kind={switchable} with the planner, or a fixed rollout.tp")
        for name, off, why in (("repetition_penalty", 1, "no_repetition_penalty"), ("min_p", 0, "no_min_p")):
            value = getattr(self.rollout, name)
            if getattr(engine, why) and value != off:
                able = " or ".join(repr(k) for k, e in ENGINES.items() if not getattr(e, why))
                raise ValueError(f"rollout.{name}={value} with engine.kind={self.engine.kind!r}: "
                                 f"{getattr(engine, why)}; set rollout.{name}={off}, or engine.kind={able}")
        r = self.rollout
        if engine.no_stop_ids_with_replay and r.replay_lengths and r.stop_token_ids:
            able = " or ".join(repr(k) for k, e in ENGINES.items() if not e.no_stop_ids_with_replay)
            raise ValueError(f"rollout.replay_lengths with rollout.stop_token_ids={r.stop_token_ids} and engine.kind="
                             f"{self.engine.kind!r}: {engine.no_stop_ids_with_replay}; set one of them, or "
                             f"engine.kind={able}")
        if engine.no_top_k_with_top_p and r.top_k and r.top_p < 1:
            able = " or ".join(repr(k) for k, e in ENGINES.items() if not e.no_top_k_with_top_p)
            raise ValueError(f"rollout.top_k={r.top_k} with rollout.top_p={r.top_p} and engine.kind="
                             f"{self.engine.kind!r}: {engine.no_top_k_with_top_p}; set one of them, or "
                             f"engine.kind={able}")

    @property
    def model_budget(self) -> tuple[str, int]:
        """What bounds a response's model tokens, and the bound: an episode's ``env.max_tokens`` (else
        ``rollout.max_new_tokens``) over all its turns, where ``env.max_turns`` turns of ``rollout.max_new_tokens``
        can reach it; else those turns."""
        env, per_turn = self.env, self.rollout.max_new_tokens
        if env.enabled and env.max_tokens > env.max_turns * per_turn:
            return "env.max_turns x rollout.max_new_tokens", env.max_turns * per_turn
        return ("env.max_tokens", env.max_tokens) if env.enabled and env.max_tokens else ("rollout.max_new_tokens",
                                                                                          per_turn)

    @property
    def policy(self) -> str:
        """The scheduling policy's name (``schedule``'s tag)."""
        return self.schedule.name

    def as_dict(self) -> dict[str, Any]:
        """Every setting as plain data, in a preset's layout (the policy's name in ``schedule.policy``)."""
        values = dataclasses.asdict(self)
        values["schedule"] = {"policy": self.policy, **values["schedule"]}
        return values

    @property
    def pipe(self) -> bool:
        """RolloutPipe on: a setting of the policies it composes with (see rollpacker.schedule.config)."""
        return getattr(self.schedule, "pipe", False)

    def _check_data(self) -> None:
        """Data of one's own: a reward function that scores it, and held-out prompts to evaluate on."""
        if not (self.reward.funcs or self.env.factory):  # group_funcs name some of funcs
            raise ValueError(f"data.path {', '.join(self.data.path)} without reward.funcs: the default reward (toy) "
                             "scores only the toy task's '#### N' answers, so every response to other data would score "
                             "0. Name what scores its rows: reward.funcs math (the answer column, boxed or last "
                             "number), FILE.py:FUNCTION (docs/your-task.md), or toy for data in the toy task's format")
        if self.eval_every and not (self.data.eval_path or self.data.eval_split):
            raise ValueError("evaluation on real data needs held-out prompts: data.eval_path (a file in any format "
                             "data.path takes) or data.eval_split (a slice of data.path's file training leaves out, "
                             "e.g. train[90%:] beside data.split train[:90%]), or eval_every=0 "
                             f"(now {self.eval_every})")

    def _check_pipe(self) -> None:
        """What schedule.pipe does not compose with besides the policies that lack it."""
        if self.stream.enabled:
            raise ValueError(
                "schedule.pipe with stream.enabled: pipe's train pool already trains complete groups from the "
                "round's start (the stream trainer's freed ranks, scaled down for the whole run), so a "
                "scale-down decision has nothing to free. Turn one of them off")
        if self.plan.enabled:
            raise ValueError(
                "schedule.pipe with plan.enabled: the parallelism planner sizes rollout TP for every rank "
                "rolling out, and pipe rolls out on half of them. Turn one of them off")

    def _check_episodes(self) -> None:
        """What episodes (``env.factory``, ``env.tools``) do not compose with, and why. (The planner's TP
        switch composes: it lands between steps, and every episode starts and ends within its round.)"""
        s, setting = self.schedule, "env.factory" if self.env.factory else "env.tools"
        if s.carries_responses:
            raise ValueError(f"schedule:{s.name} with {setting}: {s.carries_responses}. An episode carried to a "
                             "later round would go on off-policy (its next turns under newer weights than its "
                             "earlier ones, as partial responses do) with its environment kept open across "
                             "rounds, and a round closes every environment it opened. Use "
                             f"schedule:{s.on_policy_alternative} (on-policy)")
        if self.env.warm and s.own_pools:
            raise ValueError(f"env.warm with schedule:{s.name}: its rollout already runs beside training, so no reset "
                             "waits for a step to train behind; drop env.warm")

    def _check_streaming(self, streaming: str) -> None:
        """Stream training trains each group as soon as it completes, with the step's first weights:
        the group's advantages and its update must be final then."""
        from rollpacker.train.advantages import ADVANTAGES

        t = self.train
        for bad, setting, why, fix in (
                (not ADVANTAGES[t.advantage].per_group, f"train.advantage={t.advantage!r}",
                 "it normalizes over the whole step's batch, known only when rollout ends",
                 "use a per-group estimator (grpo, dr_grpo, rloo)"),
                (t.mini_batches * t.epochs > 1, f"train.mini_batches={t.mini_batches}, train.epochs={t.epochs}",
                 "every update after the first needs the weights the earlier ones make, after rollout ends",
                 "set both to 1"),
                (t.kl_in_reward, "train.kl_in_reward",
                 "a group's advantages then depend on its reference KL, which the freed ranks cannot share",
                 "put the KL in the loss"),
                (t.teacher.in_reward, "train.teacher.path (the teacher's KL in the reward)",
                 "a group's advantages then depend on the teacher's KL, which the freed ranks cannot share",
                 "set train.teacher.in_loss"),
                (t.top_entropy_quantile < 1, f"train.top_entropy_quantile={t.top_entropy_quantile}",
                 "the entropy threshold is the whole step's, known only when rollout ends", "set it to 1")):
            if bad:
                raise ValueError(f"{streaming} with {setting}: stream training trains each group as soon as it "
                                 f"completes, and {why}. Either {fix}, or turn {streaming} off")
        cap, prompts = self.stream.fetch_cap, self.rollout.num_prompts
        if 0 < cap * prompts < 1 - 1e-9:  # a cap meant as one group, not a scale-down that fetches one at most
            raise ValueError(f"stream.fetch_cap={cap} of rollout.num_prompts={prompts} groups is less than one group: "
                             f"set it to {math.ceil(1000 / prompts) / 1000:g} or more, or 0 (every group as it "
                             "completes)")

    def topology(self, world: int) -> Topology:
        """The job's ranks on ``world`` ranks: pools, replicas, training shard groups."""
        s = self.schedule
        return Topology(world, tp=self.rollout.tp, rollout_ranks=s.rollout_pool(world) if s.own_pools else 0,
                        pools=s.own_pools, train_shard_size=self.train.train_shard_size)

    def rollout_ranks(self, world: int) -> int:
        """The ranks that roll out: all of them, or the rollout pool of a policy with pools of its own."""
        return self.topology(world).rollout_ranks

    def check_world(self, world: int) -> None:
        """Errors for settings that do not fit ``world`` ranks, naming the fields."""
        r, topology = self.rollout, self.topology(world)
        topology.check()
        node = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun's ranks per node
        if world > node and node % r.tp and not self.plan.enabled:  # the planner's TPs never cross a node
            raise ValueError(f"rollout.tp={r.tp} does not divide the {node} ranks of a node (LOCAL_WORLD_SIZE): a "
                             "rollout replica would span two nodes (its TP traffic over the network; SGLang starts a "
                             f"replica's schedulers on its first node's GPUs). Set rollout.tp to a divisor of {node}")
        if self.pipe and topology.refused:
            raise ValueError(f"schedule.pipe needs a train pool of whole training replicas: {topology.refused}")
        if (r.num_prompts * r.group_size) % topology.rollout_ranks:
            raise ValueError(
                f"rollout.num_prompts x rollout.group_size = {r.num_prompts} x {r.group_size} = "
                f"{r.num_prompts * r.group_size} responses per step cannot be split evenly over the "
                f"{topology.rollout_ranks} ranks rolling out: make it a multiple of {topology.rollout_ranks}"
            )


def not_finite(settings: Any, prefix: str = "") -> list[str]:
    """The paths of ``settings``' values that are NaN or infinite (``train.lr=nan``), in its sections too."""
    found = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if dataclasses.is_dataclass(value):
            found += not_finite(value, f"{prefix}{f.name}.")
        elif any(isinstance(v, float) and not math.isfinite(v) for v in (value if type(value) is tuple else (value,))):
            found.append(f"{prefix}{f.name}={value}")
    return found


def setting_paths(cls: type = Config, prefix: str = "") -> list[str]:
    """Every setting's path (``train.lr``); a policy's own as ``schedule.NAME`` (all policies')."""
    from rollpacker.schedule.config import POLICY_CONFIGS

    hints = get_type_hints(cls, include_extras=True)
    paths = []
    for f in dataclasses.fields(cls):
        if hints[f.name] is policies.ScheduleConfig:
            paths += sorted({p for c in POLICY_CONFIGS.values() for p in setting_paths(c, f"{prefix}{f.name}.")})
        elif dataclasses.is_dataclass(hints[f.name]):
            paths += setting_paths(hints[f.name], f"{prefix}{f.name}.")
        else:
            paths.append(prefix + f.name)
    return paths


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    """A dataclass from nested dicts, refusing unknown keys by name: ``where`` is the section read (``checkpoint``;
    empty at the top), so that a message names the setting as the file's keys do (``checkpoint.export_hf``)."""
    hints = get_type_hints(cls, include_extras=True)
    fields = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        name = f"{where}.{key}" if where else key
        if key not in fields:
            raise ValueError(f"unknown setting {name!r} (valid: {', '.join(fields)})")
        section = hints[key] is policies.ScheduleConfig or dataclasses.is_dataclass(hints[key])
        if section and not isinstance(value, dict):  # `model = "x"`: a crash later; `train = 5`: the defaults
            raise ValueError(f"{name} = {value!r}: {name} is a section of settings; write them under [{name}] "
                             f"(e.g. {name}.NAME = ...)")
        if hints[key] is policies.ScheduleConfig:  # its policy's settings, checked as any (`eta_prompts = "2"`)
            settings = {k: v for k, v in value.items() if k != "policy"}
            policy = policy_name(value.get("policy", SyncConfig.name), f"{name}.policy")
            check_settings(policy, settings, name)
            value = _build(policies.POLICY_CONFIGS[policy], settings, name)
        elif section:
            value = _build(hints[key], value, name)
        elif isinstance(value, list):
            value = tuple(value)
            _check_items(hints[key], value, name)
        elif _is_tuple(hints[key]):
            value = (value,)  # `funcs = "math"`: one, as a flag with one value gives it
        elif not any(_takes(kind, value) for kind in _kinds(hints[key])):
            names = " or ".join("null" if k is type(None) else k.__name__ for k in _kinds(hints[key]))
            raise ValueError(f"{name} = {value!r} is a {type(value).__name__}, and the setting takes {names}"
                             + (" (true or false, unquoted)" if bool in _kinds(hints[key]) else ""))
        kwargs[key] = value
    return cls(**kwargs)


def _kinds(hint: Any) -> tuple:
    """A setting's types: its union's members (``int | None``: int and None), else itself."""
    hint = get_args(hint)[0] if get_origin(hint) is Annotated else hint
    return get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)


def _takes(kind: Any, value: Any) -> bool:
    """Whether a preset's ``value`` is one of ``kind`` (tyro takes a default as it is: a quoted "false" stayed a
    string, which reads as true; 4.5 prompts passed every check). Other kinds (choices, paths) check their own."""
    if kind is type(None):
        return value is None
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind in (int, float, str):
        return isinstance(value, (int, float) if kind is float else kind)
    return True


def _check_items(hint: Any, value: tuple, where: str) -> None:
    """Refuse a preset's list that is not the tuple setting's: another number of values (``betas = [0.9]``: an
    IndexError in the optimizer), or values of another kind (``stop_token_ids = ["a"]``)."""
    kinds = next((get_args(k) for k in _kinds(hint) if get_origin(k) is tuple), ())
    if not kinds:
        return
    if kinds[-1] is Ellipsis:
        kinds = (kinds[0],) * len(value)
    elif len(kinds) != len(value):
        raise ValueError(f"{where} = {list(value)!r} holds {len(value)} values, and the setting takes {len(kinds)}")
    for kind, item in zip(kinds, value):
        if not any(_takes(k, item) for k in _kinds(kind)):
            raise ValueError(f"{where} = {list(value)!r}: {item!r} is a {type(item).__name__}, and the setting takes "
                             f"{' or '.join(getattr(k, '__name__', str(k)) for k in _kinds(kind))}")


def _is_tuple(hint: Any) -> bool:
    """Whether a setting's type is a tuple (of several values)."""
    return get_origin(get_args(hint)[0] if get_origin(hint) is Annotated else hint) is tuple


def preset_path(name: str) -> Path:
    path = Path(name) if name.endswith(".toml") else CONFIGS_DIR / f"{name}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIGS_DIR.glob("*.toml"))
        raise FileNotFoundError(f"preset {name!r}: {path} not found (known presets: {', '.join(known)})")
    return path


class PresetError(ValueError):
    """A preset file that does not read: its message names settings as the file's keys are (``num_steps``), not as
    flags."""


_READING_PRESET = contextvars.ContextVar("rollpacker_reading_preset", default=False)
"""Set while a preset is read: each section's settings are checked, the whole's wait for the flags (a preset
naming data.path alone was refused as lacking an eval path that --data.eval-path gave)."""


def load_preset(name: str) -> Config:
    """The preset ``name`` (a configs/ name or a .toml path) as a config, its sections checked: the checks of the
    whole come with the flags on top of it (:func:`parse`)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    path = preset_path(name)
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise PresetError(f"{path}: {e}") from None
    reading = _READING_PRESET.set(True)
    try:
        config = _build(Config, values, "")
    except (TypeError, ValueError) as e:
        raise PresetError(f"{path}: {e}") from None
    finally:
        _READING_PRESET.reset(reading)
    return config


def parse(argv: list[str] | None = None) -> Config:
    """``--preset NAME`` (default toy-cpu), then tyro flags on top of it."""
    import tyro

    args = list(sys.argv[1:] if argv is None else argv)
    preset = DEFAULT_PRESET
    named = [i for i, arg in enumerate(args) if arg == "--preset" or arg.startswith("--preset=")]
    if len(named) > 1:
        raise SystemExit(f"--preset given twice ({' '.join(args[i] for i in named)}): name one")
    if named:
        i = named[0]
        if args[i] == "--preset" and i + 1 >= len(args) or args[i] == "--preset=":
            raise SystemExit("--preset needs a name (or a .toml path)")
        preset = args.pop(i + 1) if args[i] == "--preset" else args[i].split("=", 1)[1]
        args.pop(i)
    default = load_preset(preset)
    args = schedule_args(args, default.policy)
    # the preset's max_gen_batches bounds refills only: kept where the flags leave its rounds refilling
    held, unset = default.schedule.max_gen_batches, PolicyConfig.max_gen_batches
    default.schedule = dataclasses.replace(default.schedule, max_gen_batches=unset)
    if args and args[0].startswith("schedule:"):  # first, where schedule_args puts the policy chosen
        default.schedule = switched(default.schedule, args[0].removeprefix("schedule:").replace("-", "_"))
    config = tyro.cli(Config, default=default, args=args, config=(tyro.conf.CascadeSubcommandArgs,),
                      prog=os.environ.get("ROLLPACKER_PROG", "python -m rollpacker.run"),
                      description=f"rollpacker RL training (preset: {preset}; more with --preset NAME)")
    given = any(a.split("=", 1)[0] in ("--schedule.max-gen-batches", "--schedule.max_gen_batches") for a in args)
    if held != unset and config.schedule.refills and not given:
        config.schedule = dataclasses.replace(config.schedule, max_gen_batches=held)
    return config


@functools.cache
def _settings() -> frozenset[str]:
    return frozenset(setting_paths())


def as_flags(text: str) -> str:
    """``text`` with each config path (``data.eval_path``, ``num_steps``) written as its flag
    (``--data.eval-path``, ``--num-steps``); other words are left alone: file names, and a setting
    that is also an English word (``resume``, ``seed``)."""
    def flag(match: re.Match) -> str:
        word = match.group(0)
        return f"--{word.replace('_', '-')}" if word in _settings() and ("." in word or "_" in word) else word

    return re.sub(r"(?<![\w./-])[a-z][a-z0-9_]*(?:\.[a-z][a-z0-9_]*)*(?![\w/-]|\.\w)", flag, text)
