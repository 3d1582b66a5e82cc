"""The reward scheduler's config: the reward functions and their weights, worker pool, failure
policy, adaptive code timeouts, sandbox, LLM judge.

Plain dataclasses only (no torch): configs are parsed before anything heavy is imported.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollpacker.choices import check_choices
from rollpacker.reward.rubric import check_rubric
from rollpacker.reward.sandbox import SandboxConfig

OnError = Literal["skip", "fail"]
JudgeDtype = Literal["auto", "float32", "bfloat16", "float16"]
DEFAULT_RUBRIC = (
    "You are grading a response to a task.\n\n"
    "Task:\n{prompt}\n\nResponse:\n{response}\n\n"
    "Rate how correct and complete the response is, from 0 (wrong or missing) to 9 (fully correct). "
    "Answer with one digit.\nScore: "
)


@dataclass(kw_only=True)
class JudgeConfig:
    model_path: str = ""
    """Hugging Face directory of the judge and its tokenizer, needed when reward.funcs has judge: a causal LM (its
    verdict on the rubric) or a reward model (a *ForSequenceClassification checkpoint: its score is the reward)."""
    rubric: str = DEFAULT_RUBRIC
    """The judge prompt: {prompt} and {response} in a template ending where the score goes (a row's 'rubric' wins;
    a reward model scores the conversation in its chat template instead)."""
    max_score: int = 9
    """Verdicts are the integers 0..max_score, each a single token; reward = verdict / max_score (a causal LM's).
    The default rubric asks for a score up to it."""
    dtype: JudgeDtype = "auto"
    """Judge weights' dtype: auto (the checkpoint's own), float32, bfloat16 or float16."""
    resident_layers: int = -1
    """Decoder layers kept on the device, the rest streamed from host memory (-1: chosen per batch from memory)."""
    max_tokens: int = 4096
    """Longest judge input (rubric, prompt and response) in tokens; a longer one is a reward_error."""
    max_batch_tokens: int = 16384
    """Tokens packed into one judge forward: the most one reward poll scores between two rollout exchanges."""
    memory_fraction: float = 0.8
    """GPU: share of the device memory available when a batch starts that the judge may use."""
    cpu_memory_gib: float = 8.0
    """CPU: the judge's memory budget in GiB (nothing reports free memory there)."""

    def __post_init__(self) -> None:
        check_choices(self, "judge")
        check_rubric(self.rubric)
        if self.max_score < 1:
            raise ValueError(f"judge.max_score must be >= 1, got {self.max_score}")
        # the default rubric's range is max_score's, a preset's default too (a flag's max_score rebuilds it from that)
        if re.sub(r"to \d+ \(fully", "to 9 (fully", self.rubric) == DEFAULT_RUBRIC:
            self.rubric = DEFAULT_RUBRIC.replace("to 9 (fully", f"to {self.max_score} (fully")
        if self.resident_layers < -1:
            raise ValueError(f"judge.resident_layers must be -1 (auto) or >= 0, got {self.resident_layers}")
        if self.max_tokens <= 0:
            raise ValueError(f"judge.max_tokens must be positive, got {self.max_tokens}")
        if self.max_batch_tokens < self.max_tokens:
            raise ValueError(
                f"judge.max_batch_tokens ({self.max_batch_tokens}) must be >= judge.max_tokens ({self.max_tokens})"
            )
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"judge.memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.cpu_memory_gib <= 0:
            raise ValueError(f"judge.cpu_memory_gib must be positive, got {self.cpu_memory_gib}")


@dataclass(kw_only=True)
class RewardConfig:
    funcs: tuple[str, ...] = ()
    """Reward functions, summed: a built-in (toy, math, code, judge: an LLM judge or a reward model),
    package.module:function or file.py:function.
    Empty: toy, or none with an environment (env.factory), whose rewards then count alone (tools alone: toy)."""
    weights: tuple[float, ...] = ()
    """One weight per function of funcs (empty: 1 each); a function returning None for a row is left out of its sum."""
    correct: str = ""
    """The function of funcs, by metric name (reward/NAME), whose value >= 1 marks a response correct: for
    reward/accuracy, eval/accuracy and eval/pass@k, and data.retire_solved; where it returns None (a row of another
    task), the weighted reward decides. Empty: the weighted reward >= 1, right for one 0/1 function (with an
    accuracy and a format function, the format alone would count)."""
    group_funcs: tuple[str, ...] = ()
    """Functions of funcs, by metric name (reward/NAME), called once per group on all its responses when the policy
    completes it (TRL's call on a batch, the batch one prompt's group), not once per response as each finishes."""
    num_workers: int = 2
    """Reward worker processes, killed if they hang (0: score inline in the controller, for debugging)."""
    max_concurrent: int = 64
    """async def functions (a remote reward model, an API judge): calls awaited at once, in the controller, as TRL
    awaits them; a plain def runs in the workers, one call each."""
    timeout: float = 10.0
    """Wall-clock seconds one sample may take to score; a code sample gets its tests' timeouts on top."""
    start_timeout: float = 300.0
    """Seconds a reward worker may take to start: to import reward.funcs' modules and run their warm_up() (a
    verifiers environment's load), counted against no sample's timeout. Longer stops the run."""
    on_error: OnError = "skip"
    """A reward function that raises, hangs or returns a bad value: skip (reward 0, in reward/errors) or fail (stop)."""
    max_error_frac: float = 0.5
    """Stop after a step where a function failed on every call, or over this share of responses erred (1: never)."""
    timeout_factor: float = 1.5
    """Code: lambda, a test's timeout is lambda times the slowest correct run seen on it (RollPacker's code uses 2)."""
    timeout_min: float = 2.0
    """Code: shortest timeout of a test case, in seconds (also the timeout before any correct run)."""
    timeout_max: float = 30.0
    """Code: longest timeout of a test case, in seconds."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Isolation and limits of the code sandbox."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The LLM judge or reward model (reward.funcs judge): run in the controller on the actor's device."""

    def functions(self, environment: bool = False) -> tuple[str, ...]:
        """The reward functions to run: ``funcs``, or by default toy, or none with an environment (``env.factory``)."""
        return self.funcs or (() if environment else ("toy",))

    def __post_init__(self) -> None:
        check_choices(self, "reward")
        from rollpacker.imports import check_spec
        from rollpacker.reward.functions import BUILTINS, names

        for spec in self.funcs:
            check_spec(spec, "reward.funcs", BUILTINS)
        if len(set(self.funcs)) < len(self.funcs):
            raise ValueError(f"reward.funcs names a function twice: {list(self.funcs)}; weight it with reward.weights")
        metric_names = names(self.funcs)
        for name in {n for n in metric_names if metric_names.count(n) > 1}:
            same = [spec for spec, n in zip(self.funcs, metric_names) if n == name]
            raise ValueError(f"reward.funcs: {' and '.join(same)} would both log as reward/{name}; "
                             "rename one function or its file")
        if not all(math.isfinite(w) for w in self.weights):
            raise ValueError(f"reward.weights must be finite, got {list(self.weights)}")
        if self.weights and not self.funcs:
            raise ValueError(f"reward.weights={list(self.weights)} without reward.funcs: name the functions to weight")
        if self.weights and len(self.weights) != len(self.funcs):
            raise ValueError(f"reward.weights has {len(self.weights)} weights for {len(self.funcs)} reward.funcs "
                             f"({', '.join(names(self.funcs))}): give one each, or none for 1 each (a preset's weights "
                             "stay when a flag replaces its reward.funcs)")
        if "judge" in self.funcs:
            check_judge_path(self.judge.model_path)
        if self.correct and self.correct not in names(self.funcs or ("toy",)):
            raise ValueError(f"reward.correct names {self.correct!r}, not the metric name of one of reward.funcs "
                             f"({', '.join(names(self.funcs or ('toy',)))}): name the function whose value >= 1 "
                             "marks a response correct, as reward/NAME logs it")
        for name in self.group_funcs:
            if name in BUILTINS or name not in names(self.funcs):
                why = ("a built-in, which scores each response alone" if name in BUILTINS else
                       f"not the metric name of one of reward.funcs ({', '.join(names(self.funcs)) or 'none'})")
                raise ValueError(f"reward.group_funcs names {name!r}: {why}. Name a function of your own from "
                                 "reward.funcs, as reward/NAME logs it")
        if not 0 <= self.max_error_frac <= 1:
            raise ValueError(f"reward.max_error_frac must be in [0, 1] (1: never stop), got {self.max_error_frac}")
        if self.num_workers < 0:
            raise ValueError(f"reward.num_workers must be >= 0, got {self.num_workers}")
        if self.max_concurrent < 1:
            raise ValueError(f"reward.max_concurrent must be >= 1, got {self.max_concurrent}")
        for name in ("timeout", "start_timeout", "timeout_min"):
            if getattr(self, name) <= 0:
                raise ValueError(f"reward.{name} must be positive, got {getattr(self, name)}")
        if self.timeout_factor < 1:  # under 1, the correct run that set a test's anchor would time out
            raise ValueError(f"reward.timeout_factor must be >= 1 (a test's timeout is this multiple of its slowest "
                             f"correct run), got {self.timeout_factor}")
        if self.timeout_max < self.timeout_min:
            raise ValueError(f"reward.timeout_max ({self.timeout_max}) must be >= reward.timeout_min "
                             f"({self.timeout_min})")


def check_judge_path(model_path: str) -> None:
    """Raise a ValueError naming reward.judge.model_path unless it is a model directory."""
    if not model_path:
        raise ValueError("reward.funcs has judge but reward.judge.model_path is empty: point it at the judge's "
                         "Hugging Face model directory (--reward.judge.model-path DIR)")
    if not (Path(model_path) / "config.json").is_file():
        raise ValueError(f"reward.judge.model_path={model_path!r} is not a Hugging Face model directory "
                         "(no config.json in it)")
