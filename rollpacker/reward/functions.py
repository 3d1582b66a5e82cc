"""Reward functions: the built-ins and the user's own, called the same way.

``reward.funcs`` lists them: a built-in name (``toy``, ``math``, ``code``, ``judge``), or a
reference, ``package.module:function`` or ``path/to/file.py:function``. A function follows TRL's
``reward_funcs`` convention or verl's ``compute_score``, told apart by its parameters
(``solution_str`` is verl's).

Invariants:

- None means "does not apply to this row". The scheduler sums the others with ``reward.weights``.
- A function is called on one response at a time, as each finishes (TRL's lists hold one item),
  in a worker process that can be killed when it hangs; one named in ``reward.group_funcs`` is
  called once per group, on the group's responses, once the policy completes it (TRL's batch call,
  the batch one prompt's group).
- A verl dict's ``score`` is the reward; its other numbers become ``reward/NAME/KEY`` metrics.

Why TRL's and verl's conventions: a user's existing function runs unchanged. Both conventions in
full: ``docs/rewards.md``. The judge runs batched on the controller's device (:class:`JudgeFunction`).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollpacker.errors import UserError
from rollpacker.imports import accepted, awaited, load, short, target

BUILTINS = {"toy": "rollpacker.reward.rules:toy", "math": "rollpacker.reward.rules:math",
            "code": "rollpacker.reward.code:code", "judge": ""}
"""Built-in name -> the function it stands for (the judge runs on the controller, see :class:`JudgeFunction`)."""
ENVIRONMENT = "environment"
"""``reward/environment``: the mean of the environments' rewards over the responses they scored."""
OWN = ("mean", "accuracy", "errors", "seconds_total", "overlong_penalty_mean", "zero_variance_frac")
"""``reward/`` metrics the controller and the scheduler log that are not a reward's mean."""
RESERVED = (*OWN, ENVIRONMENT)
"""``reward/`` metric names the controller and the scheduler use themselves (a function of one is prefixed)."""
VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


class RewardFunctionError(UserError):
    """A reward function that cannot be loaded, or that failed on a row; the message names both."""


class BadValue(Exception):
    """A function returned something that is not a reward, or cannot be given what it takes; the message says what."""


@dataclass(frozen=True)
class Ref:
    """What a worker needs to call a function: plain data, so it pickles."""

    name: str
    """Its metric name: ``reward/NAME``."""
    target: str
    """``package.module:function`` or ``/absolute/path/file.py:function``."""
    convention: str = "trl"
    """``trl`` or ``verl``."""
    environments: bool = False
    """It is given TRL's ``environments`` (it names them, or takes ``**kwargs``): an episode's environment
    then sends a copy of itself (:class:`~rollpacker.env.trl.EnvState`)."""
    asynchronous: bool = False
    """An ``async def`` function: awaited concurrently in the controller (:func:`acall`), not in a worker."""
    per_group: bool = False
    """Called once per group with the group's responses (``reward.group_funcs``), not once per response."""


@dataclass
class TrainerState:
    """What TRL's ``trainer_state`` (transformers' ``TrainerState``) holds that a run has, under its names:
    the step being scored and where the run is. Passed to TRL-convention functions as ``trainer_state``."""

    global_step: int = 0
    """The RL step whose responses are scored (0-based; TRL counts optimizer steps done, the same number)."""
    epoch: float = 0.0
    """Passes over the training data the steps before this one drew, fractional (0 at step 0, as TRL's)."""
    max_steps: int = 0
    """The run's num_steps."""
    num_train_epochs: int = 0
    """The run's num_epochs (0: num_steps alone decides)."""
    train_batch_size: int = 0
    """Responses per step: rollout.num_prompts x rollout.group_size."""
    is_world_process_zero: bool = True
    """Always: rewards are scored for rank 0, the controller."""
    is_local_process_zero: bool = True
    log_history: list[dict] = field(default_factory=list)
    """Empty: the metrics are in run_dir/metrics.jsonl."""


def names(specs: tuple[str, ...]) -> list[str]:
    """Each spec's metric name: the built-in's name or the function's, with the module or file stem
    before it (``stem.function``) where two share a name or it is a reserved one."""
    base = [s if s in BUILTINS else s.rsplit(":", 1)[1] for s in specs]

    def stem(spec: str) -> str:
        where = spec.rsplit(":", 1)[0]
        return Path(where).stem if where.endswith(".py") else where.rsplit(".", 1)[-1]

    return [f"{stem(s)}.{b}" if s not in BUILTINS and (base.count(b) > 1 or b in RESERVED or b in BUILTINS) else b
            for s, b in zip(specs, base)]


def convention(fn, spec: str) -> str:
    """``verl`` if ``fn`` takes ``solution_str``, ``trl`` if it takes ``completions``, ``environments`` or
    ``**kwargs``."""
    params = inspect.signature(fn).parameters
    if "solution_str" in params:
        return "verl"
    if "completions" in params or "environments" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return "trl"
    raise RewardFunctionError(
        f"reward.funcs: {spec}: its parameters ({', '.join(params)}) follow neither TRL's convention "
        "(prompts, completions, completion_ids, environments, **columns) -> list[float | None] nor verl's "
        "(data_source, solution_str, ground_truth, extra_info) -> float | dict")


TRL_GIVEN = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra", "environments")
"""What a TRL-convention function gets besides the row's columns."""


def parameters(ref: Ref) -> list[inspect.Parameter]:
    """A TRL-convention function's named parameters; none for verl's, which gets its four arguments whatever the
    row holds."""
    if ref.convention != "trl":
        return []
    params = inspect.signature(load(ref.target, "reward.funcs", RewardFunctionError)).parameters.values()
    return [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def required_columns(ref: Ref) -> list[str]:
    """The row columns a TRL-convention function cannot be called without: its parameters without a default but
    :data:`TRL_GIVEN` (the scheduler gives the prompt as ``prompts``, not as a column)."""
    return [p.name for p in parameters(ref) if p.default is p.empty and p.name not in TRL_GIVEN]


def resolve(spec: str, name: str, per_group: bool = False) -> Ref:
    """The :class:`Ref` of one entry of reward.funcs, its function imported here to check it (fail early);
    ``per_group``: it is named in reward.group_funcs."""
    ref = target(spec, BUILTINS)
    fn = load(ref, "reward.funcs", RewardFunctionError)
    kind = convention(fn, spec)
    if per_group and kind == "verl":
        raise RewardFunctionError(f"reward.group_funcs: {name} ({spec}) follows verl's convention, which scores one "
                                  "response (solution_str); a group function takes TRL's lists (prompts, completions, "
                                  "**columns) and returns one value per completion")
    return Ref(name, ref, kind, environments=kind == "trl" and bool(accepted(fn, {"environments": None})),
               asynchronous=inspect.iscoroutinefunction(fn), per_group=per_group)


Value = tuple["float | None", dict[str, float], dict[str, Any]]
"""A function's value for one response: ``(reward or None, metrics, info)``."""


def call(ref: Ref, sample: dict | list[dict]) -> Value | list[Value]:
    """Call ``ref`` on one response: ``sample`` holds ``prompt``, ``completion`` (text),
    ``completion_ids``, ``columns`` (the row's other columns), optionally ``trainer_state`` and, for
    an episode, ``messages`` (its turns after the prompt: TRL's completion then) and ``environment``
    (a copy of its environment: TRL's ``environments`` hold it). Returns ``(reward or None, metrics,
    info)``: a dict's other numbers and TRL's ``log_metric`` are metrics, the rest and TRL's ``log_extra``
    info. Raises :class:`BadValue` saying what it returned wrong (its own exceptions pass). An ``async
    def`` function is run to its end on this process's event loop. A group function (``ref.per_group``)
    takes a group's samples, a list, in one call, and returns a list: one value each."""
    fn, kwargs, read = _prepared(ref, sample)
    return read(awaited(fn(**kwargs)))


async def acall(ref: Ref, sample: dict | list[dict]) -> Value | list[Value]:
    """:func:`call`, awaiting an ``async def`` function on the running event loop."""
    fn, kwargs, read = _prepared(ref, sample)
    value = fn(**kwargs)
    return read(await value if inspect.isawaitable(value) else value)


def _prepared(ref: Ref, sample: dict | list[dict]) -> tuple[Callable, dict, Callable[[Any], Value | list[Value]]]:
    """``ref``'s function, the keyword arguments of its call on ``sample`` (:func:`call`), and what reads
    what it returned."""
    fn = load(ref.target, "reward.funcs", RewardFunctionError)
    if ref.convention == "verl":
        columns = sample["columns"]
        reward_model = columns.get("reward_model")
        truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        kwargs = dict(data_source=columns.get("data_source"), solution_str=sample["completion"],
                      ground_truth=columns.get("answer") if truth is None else truth,  # as verl passes it
                      extra_info=columns.get("extra_info"))
        return fn, accepted(fn, kwargs), _value
    samples = sample if ref.per_group else [sample]
    logged, extra = {}, {}
    prompts, completions = zip(*map(as_trl, samples))
    kwargs = {**{k: [s["columns"].get(k) for s in samples] for k in samples[0]["columns"]},
              "prompts": list(prompts), "completions": list(completions),
              "completion_ids": [s["completion_ids"] for s in samples],
              "trainer_state": samples[0].get("trainer_state") or TrainerState(),  # as TRL: one object, not a list
              "log_metric": lambda name, value: logged.__setitem__(str(name), float(value)),
              "log_extra": lambda column, values: extra.__setitem__(str(column), values)}
    if all(s.get("environment") is not None for s in samples) and accepted(fn, {"environments": None}):
        kwargs["environments"] = [s["environment"].restore() for s in samples]
    elif (p := inspect.signature(fn).parameters.get("environments")) is not None and p.default is p.empty:
        raise BadValue("takes environments, and this response has no copy of its environment: they are given with "
                       "an env.factory of TRL's shape (a class made without arguments; docs/environments.md), and an "
                       "episode whose environment failed before its reset returned has none")
    n = len(samples)

    def read(values) -> Value | list[Value]:
        if hasattr(values, "tolist"):  # a numpy array or a torch tensor, which TRL takes as a list
            values = values.tolist()
        if not isinstance(values, (list, tuple)):
            raise BadValue(f"returned {type(values).__name__} {short(values)}; a TRL-convention function returns a "
                           "list with one float or None per completion")
        if len(values) != n:
            raise BadValue(f"returned {len(values)} values for {n} completion{'s' * (n > 1)}; a TRL-convention "
                           "function returns one float or None per completion")
        out = []
        for i, value in enumerate(values):
            value = _item(value)
            value, metrics, info = _value(None if is_number(value) and math.isnan(value) else value)  # TRL's None
            out.append((value, logged | metrics, {k: _nth(v, i, n) for k, v in extra.items()} | info))
        return out if ref.per_group else out[0]

    return fn, accepted(fn, kwargs), read


def as_trl(sample: dict) -> tuple[Any, Any]:
    """A sample's prompt and completion as TRL passes them: the completion is an episode's turns, else the text
    (as a message after a chat prompt). A chat prompt ending in an assistant turn (a prefill the model continued)
    loses it, and its text leads the completion's first assistant turn, as TRL's ``bootstrap``."""
    prompt, text, turns = sample["prompt"], sample["completion"], sample.get("messages")
    if not isinstance(prompt, list):
        return prompt, turns or text
    turns = [dict(m) for m in turns] if turns else [{"role": "assistant", "content": text}]
    if prompt and prompt[-1].get("role") == "assistant":
        prompt, prefill = prompt[:-1], prompt[-1].get("content") or ""
        if first := next((m for m in turns if m["role"] == "assistant"), None):
            first["content"] = prefill + (first.get("content") or "")
    return prompt, turns


def _nth(values, i: int, n: int):
    """What TRL's ``log_extra(column, values)`` logged for completion ``i`` of a call on ``n``: a list's item."""
    return values[i] if isinstance(values, (list, tuple)) and len(values) == n else values


def _item(value):
    """A 0-d tensor or array's number, as TRL takes it (its NaN too: TRL's None); any other value as it is."""
    return value.item() if getattr(value, "ndim", None) == 0 and hasattr(value, "item") else value


def _value(value) -> Value:
    """A function's value for one response as ``(reward or None, metrics, info)``: a dict's ``score``
    is the reward, its other numbers metrics and the rest info."""
    metrics, info = {}, {}
    if isinstance(value, dict):
        if "score" not in value:
            raise BadValue(f"returned a dict without 'score' (keys: {', '.join(map(str, value))}); the reward "
                             "goes in 'score', other numbers become metrics")
        for key, v in value.items():
            if key != "score":
                (metrics if is_number(v) else info)[str(key)] = float(v) if is_number(v) else v
        value = value["score"]
    value = _item(value)
    if value is None:
        return None, metrics, info
    if not is_number(value):
        raise BadValue(f"returned {type(value).__name__} {short(value)} for a completion; expected a float, an "
                         "int or None")
    if not math.isfinite(float(value)):
        raise BadValue(f"returned {float(value)} for a completion; a reward must be finite (None: the function does "
                       "not apply)")
    return float(value), metrics, info


def is_number(value) -> bool:
    """Whether a user's ``value`` is a number: a real, a bool, numpy's scalars and its bool."""
    import numpy

    # bools (verl's `return pred == gt`) and numpy scalars too, numpy's bool (no numbers.Real) as TRL takes it
    return isinstance(value, numbers.Real | numpy.bool_)


def completion_text(completion) -> str:
    """A completion as TRL passes it (a string, or messages: an episode's turns) as text: its last
    assistant message, the answer (never a tool's or an environment's message after it)."""
    if isinstance(completion, str):
        return completion
    return next((m["content"] for m in reversed(completion) if m.get("role") == "assistant"), "")


def prompt_text(prompt) -> str:
    """A prompt (a string or chat messages) as text: the messages' contents, a blank line apart (a message
    holding only tool calls has none)."""
    return prompt if isinstance(prompt, str) else "\n\n".join(m.get("content") or "" for m in prompt)
