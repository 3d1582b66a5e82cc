"""The reward scheduler (paper §4.3): each response is scored the moment it finishes, overlapped
with the rest of the rollout.

The controller calls :meth:`RewardScheduler.submit` for every finished response and hands what
:meth:`~RewardScheduler.poll` returns to the policy. When only scores can move the round on, it
waits in :meth:`~RewardScheduler.wait` for those it needs, a second at a time between exchanges with
the other ranks (who wait in a collective meanwhile): that wait is the round's exposed reward time.

Invariants:

- A response's reward is composed here, once: the weighted sum of the functions that apply to its
  row, plus its environment's step rewards.
- Plain functions run in killable worker processes; the judge runs here, one packed batch per poll.
- A failure is an error naming the function, the row and the cause. ``reward.on_error`` decides.
- A step whose rewards are noise stops the run before it trains (:meth:`~RewardScheduler.take_metrics`).

Why: scored as each response finishes, rewards hide under the rollout, all but the last few.
The failure rules: ``docs/rewards.md``; the scheduler and the judge: ``docs/rewards-and-judge.md``.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection

from rollpacker.errors import UserError
from rollpacker.imports import warm_up
from rollpacker.reward.code import TESTS_FORMAT, AdaptiveTimeout, valid_tests
from rollpacker.reward.config import RewardConfig, check_judge_path
from rollpacker.reward.functions import (
    BUILTINS,
    ENVIRONMENT,
    Ref,
    RewardFunctionError,
    TrainerState,
    names,
    parameters,
    required_columns,
    resolve,
)
from rollpacker.reward.rules import RewardError
from rollpacker.reward.workers import Scored, score

logger = logging.getLogger(__name__)


class RewardFunction:
    """One entry of ``reward.funcs`` as the scheduler runs it: in a worker, on one response at a time."""

    on_controller = False
    """Whether it runs here, batched (the judge), instead of in the workers."""
    columns: tuple[str, ...] = ()
    """The row columns without which it does not apply (the built-ins'; a user function may apply to any row)."""

    def __init__(self, ref: Ref, weight: float, cfg: RewardConfig):
        self.ref, self.name, self.weight, self.cfg = ref, ref.name, weight, cfg

    def check_row(self, row: dict) -> None:
        """Raise ValueError if ``row`` is unfit for this function (its columns are checked when it applies)."""

    def extra(self, row: dict) -> dict:
        """Columns the call gets besides the row's."""
        return {}

    def timeout(self, extra: dict) -> float:
        return self.cfg.timeout

    def observe(self, row: dict, info: dict) -> None:
        """Learn from one response it scored (code: the timeouts' anchors)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class MatchFunction(RewardFunction):
    """``toy`` and ``math``: the row's ``answer`` checked by rule."""

    columns = ("answer",)

    def check_row(self, row: dict) -> None:
        answer = row["answer"]
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"field 'answer' must be a string or a number for reward.funcs {self.name}, got "
                             f"{type(answer).__name__} {json.dumps(answer, default=str)[:40]} (a function of your "
                             "own gets the column as it is)")
        if not str(answer).strip():
            raise ValueError(f"field 'answer' is empty: reward.funcs {self.name} has nothing to check a response "
                             "against")


class CodeFunction(RewardFunction):
    """``code``: the row's ``tests`` run in the sandbox, each with its adaptive timeout."""

    columns = ("tests",)

    def __init__(self, ref: Ref, weight: float, cfg: RewardConfig):
        from rollpacker.reward.sandbox import Sandbox

        super().__init__(ref, weight, cfg)
        Sandbox(cfg.sandbox)  # raises SandboxUnavailable, saying how to enable isolation, before the run starts
        self.timeouts = AdaptiveTimeout.from_config(cfg)

    def check_row(self, row: dict) -> None:
        if row.get("tests") is not None and not valid_tests(row["tests"]):
            raise ValueError(f"field 'tests' must be {TESTS_FORMAT}")

    def extra(self, row: dict) -> dict:
        if not row.get("tests"):
            return {}
        return {"timeouts": self.timeouts.timeouts(row["tests"]), "sandbox": self.cfg.sandbox}

    def timeout(self, extra: dict) -> float:
        return self.cfg.timeout + sum(extra.get("timeouts", ()))

    def observe(self, row: dict, info: dict) -> None:
        if row.get("tests"):
            self.timeouts.observe(row["tests"], info)

    def state_dict(self) -> dict:
        return self.timeouts.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.timeouts.load_state_dict(state)


class JudgeFunction(RewardFunction):
    """``judge``: an LLM scores (prompt, response) against a rubric (a row's own ``rubric`` wins), or a reward
    model scores the conversation."""

    on_controller = True

    def check_row(self, row: dict) -> None:
        from rollpacker.reward.rubric import check_rubric

        if row.get("rubric") is not None:
            if not isinstance(row["rubric"], str):
                raise ValueError(f"field 'rubric' must be a string, got {type(row['rubric']).__name__} "
                                 f"{row['rubric']!r}")
            try:
                check_rubric(row["rubric"], "field 'rubric'")
            except ValueError as e:
                raise ValueError(f"{e} (or drop it to use reward.judge.rubric)") from None


def build_functions(cfg: RewardConfig, environment: bool = False) -> list[RewardFunction]:
    """``reward.funcs`` resolved (:meth:`RewardConfig.functions`; ``environment``: responses are episodes):
    each imported (a RewardFunctionError if it cannot be) and weighted."""
    kinds = {"toy": MatchFunction, "math": MatchFunction, "code": CodeFunction}
    specs = cfg.functions(environment)
    weights = cfg.weights or (1.0,) * len(specs)
    functions = []
    for spec, name, weight in zip(specs, names(specs), weights):
        if spec == "judge":
            from rollpacker.reward.judge import check_scores

            check_judge_path(cfg.judge.model_path)
            check_scores(cfg.judge)  # before the run starts: the judge is loaded at its first batch
            functions.append(JudgeFunction(Ref("judge", ""), weight, cfg))
        else:
            functions.append(kinds.get(spec, RewardFunction)(resolve(spec, name, name in cfg.group_funcs), weight, cfg))
            if not environment and any(p.name == "environments" and p.default is p.empty  # TRL: a default stays
                                       for p in parameters(functions[-1].ref)):
                raise RewardFunctionError(f"reward function {name} ({spec}) takes environments, which an env.factory "
                                          "of TRL's shape gives, and this run has none: set --env.factory to one, or "
                                          "drop the function")
    return functions


def check_row(functions: list[RewardFunction], row: dict) -> None:
    """Raise ValueError if none of ``functions`` can score ``row``, or one that applies finds it unfit
    (the data loader's check: a row that would fail later is refused before the run starts)."""
    applies = [f for f in functions if all(row.get(c) is not None for c in f.columns)]
    if not applies:
        needs = " or ".join(f"{c!r} ({f.name})" for f in functions for c in f.columns)
        raise ValueError(f"missing field {needs}: no reward function of reward.funcs applies to this row")
    for f in applies:
        f.check_row(row)


def check_columns(functions: list[RewardFunction], rows: list[dict], field: str) -> None:
    """Raise RewardFunctionError if a function of ``functions`` takes a column no row of ``rows`` (``field``'s)
    has: each of its calls would fail."""
    columns = {key for row in rows for key in row} - {"prompt"}  # given as prompts
    for f in functions if rows else ():
        if f.ref.target not in BUILTINS.values() and (missing := [c for c in required_columns(f.ref)
                                                               if c not in columns]):
            raise RewardFunctionError(
                f"reward function {f.name} ({f.ref.target}) takes {', '.join(map(repr, missing))}, a column no row of "
                f"{field} has (its columns: {', '.join(sorted(columns - {'id'}))}): add the column, or give the "
                "parameter a default (or take the columns as **kwargs)")


@dataclass
class _Failures:
    """One function's calls in a step, how many failed, and the first failure."""

    calls: int = 0
    failed: int = 0
    first: str = ""
    """``row 'ID': cause`` of the failure of the earliest submitted response (not of whichever failed first:
    which of two hung calls times out first is a race, and the message should not depend on it)."""
    first_order: int = -1

    def add(self, counted: _Counted, error: str | None) -> None:
        self.calls += 1
        if error is not None:
            self.failed += 1
            if not self.first or counted.order < self.first_order:
                self.first, self.first_order = f"row {counted.row_id!r}: {error}", counted.order


NONE_APPLIES = ""
"""The :class:`_Failures` key of the responses that no function scored (all returned None)."""


@dataclass(slots=True)
class _Counted:
    """What the metrics count of one scored response, kept until its round takes it
    (:meth:`RewardScheduler.take_metrics`): a response the round did not train is counted nowhere."""

    row_id: Any
    order: int
    values: dict[str, float] = field(default_factory=dict)
    """Metric (``NAME``, ``NAME/KEY``, the environment's) -> this response's number."""
    calls: dict[str, str | None] = field(default_factory=dict)
    """Function name (or NONE_APPLIES) -> its error, None where it scored."""
    errored: bool = False
    """Its reward failed (scored 0 under reward.on_error skip)."""
    seconds: float = 0.0
    """Its scoring time."""


@dataclass
class _Tally:
    """What the metrics count of the responses a round takes (:meth:`RewardScheduler.take_metrics`)."""

    sums: collections.Counter[str] = field(default_factory=collections.Counter)
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: int = 0
    """Responses whose reward failed."""
    responses: int = 0
    """Responses scored."""
    failures: dict[str, _Failures] = field(default_factory=lambda: collections.defaultdict(_Failures))
    """Function name (or NONE_APPLIES) -> its calls and failures."""
    seconds: float = 0.0
    """Scoring time, summed (workers run in parallel)."""

    def add(self, counted: _Counted) -> None:
        for metric, value in counted.values.items():
            self.sums[metric] += value
            self.counts[metric] += 1
        for name, error in counted.calls.items():
            self.failures[name].add(counted, error)
        self.errors, self.responses = self.errors + counted.errored, self.responses + 1
        self.seconds += counted.seconds


def _failed(tally: _Tally, name: str, where: str) -> str:
    f = tally.failures[name]
    if name == NONE_APPLIES:
        return f"no reward function scored {f.failed} of {tally.responses} responses at {where} (all returned None)"
    return f"reward function {name!r} failed on {f.failed} of {f.calls} responses at {where}"


@dataclass(frozen=True)
class Members:
    """The key of a group function's call: the responses of the group, in order."""

    keys: tuple


@dataclass
class _Scoring:
    """A response being scored: what each function said so far."""

    row: dict
    order: int
    """When it was submitted (0, 1, ...)."""
    env_reward: float = 0.0
    """Its environment's rewards, summed (an episode's step rewards)."""
    env_scored: bool = False
    """Its environment gave a reward: it is scored even where no function applies."""
    scored: dict[str, Scored] = field(default_factory=dict)
    """Function name -> what it returned, so far."""
    errors: dict[str, str] = field(default_factory=dict)
    """Function name -> what went wrong."""
    extra: dict[str, Any] = field(default_factory=dict)
    """``NAME/KEY`` -> what function NAME said besides numbers: a dict's other values, TRL's ``log_extra``."""
    failed: bool = False
    """An episode whose environment failed: it trains nothing, so no function scores it (a group function's call
    on its group leaves it out) and no metric counts it; its reward is 0."""
    held_out: bool = False
    """A held-out round's: counted apart from the training rounds' (:attr:`RewardScheduler.counted`)."""
    counted: _Counted | None = None
    """What the metrics count of it (made at :meth:`RewardScheduler.submit`)."""

    @property
    def values(self) -> dict[str, float | None]:
        """Function name -> its value (None: did not apply, or failed)."""
        return {name: r.score for name, r in self.scored.items()}


BOTH_S = 0.05
"""Seconds :meth:`RewardScheduler.wait` waits on the workers, then on the async calls, when both run."""
MAX_VALUES = 1 << 18
"""Most per-function values :class:`RewardScheduler` keeps for responses not taken yet (a leak's bound: a round's
are taken at its end, and ``reward.correct`` reads them till then)."""
MAX_COUNTED = 1 << 16
"""Most responses' counts (:class:`_Counted`) kept for a round to take: the oldest go first. A response no round
trains (a filtered group, a deferred prompt's) stays till then: 64 a step filtered reached 700 MB at 1 << 20."""


class RewardScheduler:
    def __init__(self, cfg: RewardConfig, decode: Callable[[list[int]], str], device: Any = "cpu",
                 functions: list[RewardFunction] | None = None):
        """``decode``: token ids -> text; ``device``: where the judge runs (the controller rank's, the actor's)."""
        self.cfg, self.decode, self.device = cfg, decode, device
        self.functions = functions if functions is not None else build_functions(cfg)
        self._by_name = {f.name: f for f in self.functions}
        self.judge = None
        """The :class:`~rollpacker.reward.judge.Judge`, loaded on the first judge sample."""
        self._judge_todo: collections.deque[tuple[Any, tuple | list[int]]] = collections.deque()
        """Judge samples not scored yet: ``(key, (prompt, response, rubric, an episode's turns))``, or
        ``(key, token ids)`` once encoded."""
        here = [f.ref.target for f in self.functions
                if not f.on_controller and (f.ref.asynchronous or not cfg.num_workers)]
        for target in dict.fromkeys(here):  # called in this process (inline, or awaited here), before its pools start
            if failed := warm_up(target, "reward.funcs", imported=True):
                raise UserError(failed)
        self.pool = self.async_calls = None
        pooled = [f.ref.target for f in self.functions if not f.on_controller and not f.ref.asynchronous]
        if cfg.num_workers and pooled:
            from rollpacker.reward.workers import RewardPool

            self.pool = RewardPool(cfg, tuple(dict.fromkeys(pooled)))
        if any(f.ref.asynchronous for f in self.functions):  # awaited here, whatever the workers: 0 too
            from rollpacker.reward.workers import AsyncCalls

            self.async_calls = AsyncCalls(cfg.max_concurrent)
        self._scoring: dict[Any, _Scoring] = {}
        self._submitted = itertools.count()
        self._inline: list[Scored] = []
        self._ready: list[tuple[Any, float]] = []
        """Responses scored by their environment alone (no reward function), not yet polled."""
        self.values: dict[Any, dict[str, dict]] = {}
        """Each scored response's ``rewards`` (the value per function; None: did not apply or failed), ``extra``
        (:attr:`_Scoring.extra`) and ``reward_error`` (function name, or NONE_APPLIES, -> what went wrong; None), until
        :meth:`take_values`."""
        self.counted: dict[bool, dict[Any, _Counted]] = {False: {}, True: {}}
        """Held out (a held-out round's) -> each scored response's counts, until a round takes them
        (:meth:`take_metrics`). A training response scored while an evaluation runs counts with training's."""
        self.state = TrainerState()
        """TRL's ``trainer_state`` of the responses submitted now (the controller sets it each round)."""

    def submit(self, key: Any, row: dict, output, held_out: bool = False) -> None:
        """Start scoring one finished response (``output``: an engine output) of ``row`` (``held_out``: of a
        held-out round); returns at once.
        A response still being scored is not submitted again (sorted_partial rescores a finished response
        each round its prompt runs, and a round does not wait for the rewards it keeps no group of): its
        reward comes once, to whichever round polls it. With group functions it comes once its group's
        :meth:`submit_group` is scored too."""
        if key in self._scoring:
            return
        failed = output.finish_reason == "error"
        order = next(self._submitted)
        scoring = _Scoring(row, order, output.env_reward, bool(output.step_rewards) and not failed, failed=failed,
                           held_out=held_out, counted=_Counted(row["id"], order))
        self._scoring[key] = scoring
        if len(self._scoring) > MAX_VALUES:  # responses waiting for a group the policy never completed
            del self._scoring[next(iter(self._scoring))]
        if scoring.env_scored:  # TRL's rewards/ENV/mean
            scoring.counted.values[ENVIRONMENT] = scoring.env_reward
        if not self.functions:
            self._ready.append((key, self._reward(key, self._scoring.pop(key))))
            return
        if failed:
            self._unscored(key, [f for f in self.functions if not f.ref.per_group])
            return
        sample = self._sample(row, output)
        for f in self.functions:
            if f.ref.per_group:
                continue
            if f.on_controller:
                self._judge_todo.append(((key, f.name), (sample["prompt"], sample["completion"], row.get("rubric"),
                                                         output.messages)))
                continue
            extra = f.extra(row)
            self._dispatch((key, f.name), f, sample | {"columns": sample["columns"] | extra}, f.timeout(extra))

    def submit_group(self, keys: list[Any], row: dict, outputs: list) -> None:
        """Start the group functions' calls on a group the policy completed: the responses ``keys``
        (submitted already), their ``outputs``, of ``row``; returns at once."""
        group = [f for f in self.functions if f.ref.per_group]
        if not group or not all(k in self._scoring for k in keys):
            return  # none, or scored already (a carried group's responses are rescored, not regrouped)
        working = [(k, out) for k, out in zip(keys, outputs) if not self._scoring[k].failed]
        for k in set(keys) - {k for k, _ in working}:
            self._unscored(k, group)
        samples = [self._sample(row, out) for _, out in working]
        for f in group if working else ():
            self._dispatch((Members(tuple(k for k, _ in working)), f.name), f, samples, f.timeout({}))

    def _unscored(self, key: Any, functions: list[RewardFunction]) -> None:
        """An episode whose environment failed: ``functions`` are not called on it, each recorded as None."""
        for f in functions:
            self._ready += self._record(key, f.name, Scored((key, f.name), None, None, 0.0, 0.0))

    def _sample(self, row: dict, output) -> dict:
        """What a function is called on for one response (:func:`~rollpacker.reward.functions.call`)."""
        return {"prompt": row["prompt"] if output.prompt is None else output.prompt,  # an episode's: its reset's
                "completion": self.decode(output.token_ids), "completion_ids": list(output.token_ids),
                "columns": {k: v for k, v in row.items() if k != "prompt"}, "trainer_state": self.state,
                "messages": output.messages,  # an episode's turns
                "environment": output.env_state}  # a copy of its environment, for TRL's `environments`

    def _dispatch(self, key: tuple, f: RewardFunction, sample: dict | list[dict], timeout: float) -> None:
        """Call ``f`` on ``sample`` (one response's, or a group's): awaited, in a worker, or here."""
        if self.async_calls and f.ref.asynchronous:
            self.async_calls.submit(key, f.ref, sample, timeout)
        elif self.pool:
            self.pool.submit(key, f.ref, sample, timeout)
        else:
            start = time.perf_counter()
            value, error, metrics, info = score(f.ref, sample)
            seconds = time.perf_counter() - start
            self._inline.append(Scored(key, value, error, seconds, seconds, metrics, info))

    def poll(self) -> list[tuple[Any, float]]:
        """Rewards finished since the last call, ``(key, reward)``. Never waits for a worker; scores
        one judge batch (one forward) if judge samples are queued."""
        done = self._judge_batch() if self._judge_todo else []
        return self._take_ready() + self._settle(self._finished() + done)

    def wait(self, keys: Collection | None = None, timeout: float | None = None) -> list[tuple[Any, float]]:
        """Like :meth:`poll`, after waiting until the responses ``keys`` are scored (default: until no call
        is left running) or ``timeout`` seconds passed (default: no limit). Raises RuntimeError when one of
        ``keys`` is not being scored (never submitted, or waiting for a group never submitted)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        missing = None if keys is None else set(keys)
        done = []
        while True:
            busy = self._busy()  # before the poll: a call that finishes in between is polled next time
            got = self.poll()
            done += got
            if missing is not None:
                missing -= {key for key, _ in got}
            left = None if deadline is None else deadline - time.monotonic()
            if not (busy if missing is None else missing) or (left is not None and left <= 0):
                return done
            if not busy:
                raise RuntimeError(f"responses {sorted(map(str, missing))[:3]} have no reward and none is being "
                                   "computed: they were not submitted, or their group was not (submit_group)")
            if not self._judge_todo:  # a judge batch is the next poll's
                sources = [s for s in (self.pool, self.async_calls) if s and s.unfinished]
                for source in sources:  # with both, each a short slice: neither's results wait long
                    source.wait(left if len(sources) == 1 else min(left or BOTH_S, BOTH_S))

    def _busy(self) -> bool:
        """Whether a call is running or queued (a worker's, an async one, a judge sample)."""
        return bool(self._judge_todo or (self.pool and self.pool.unfinished)
                    or (self.async_calls and self.async_calls.unfinished))

    def _take_ready(self) -> list[tuple[Any, float]]:
        ready, self._ready = self._ready, []
        return ready

    def _finished(self) -> list[Scored]:
        done = self.async_calls.poll() if self.async_calls else []
        if not self.pool:
            done, self._inline = done + self._inline, []
            return done
        return done + self.pool.poll()

    def _judge_batch(self) -> list[Scored]:
        """Score the judge samples at the head of the queue that fit one forward (at least one)."""
        start = time.perf_counter()
        if self.judge is None:
            from rollpacker.reward.judge import Judge

            logger.info("loading the judge %s on %s", self.cfg.judge.model_path, self.device)
            self.judge = Judge(self.cfg.judge, self.device)
        cfg = self.judge.cfg
        keys, seqs, size, refused = [], [], 0, []
        while self._judge_todo:
            key, sample = self._judge_todo[0]
            try:
                ids = sample if isinstance(sample, list) else self.judge.encode(*sample)
            except RewardError as e:
                self._judge_todo.popleft()
                refused.append(Scored(key, None, str(e), 0.0, 0.0))
                continue
            num_tokens = len(ids) if len(ids) <= cfg.max_tokens else 0  # too long: flagged without a forward
            if keys and size + num_tokens > cfg.max_batch_tokens:
                self._judge_todo[0] = (key, ids)  # next poll's first: encoded once
                break
            self._judge_todo.popleft()
            keys.append(key)
            seqs.append(ids)
            size += num_tokens
        results = self.judge.score_ids(seqs)
        seconds = (time.perf_counter() - start) / max(len(keys), 1)
        return refused + [Scored(key, None, str(r), seconds, seconds) if isinstance(r, RewardError)
                          else Scored(key, r, None, seconds, seconds) for key, r in zip(keys, results)]

    def _settle(self, scored: list[Scored]) -> list[tuple[Any, float]]:
        """Record each function's value; the responses all of whose functions are done, with their rewards."""
        done = []
        for s in scored:
            key, name = s.key
            scoring = self._scoring.get(key.keys[0] if isinstance(key, Members) else key)
            if scoring is not None:
                scoring.counted.seconds += s.seconds
            if isinstance(key, Members):  # a group function's call: one value per response
                n = len(key.keys)
                per = (s.score, s.metrics, s.info) if s.error is None else ([None] * n, [{}] * n, [{}] * n)
                for k, value, metrics, info in zip(key.keys, *per):  # reward/NAME/KEY: a mean over responses
                    if k in self._scoring:
                        done += self._record(k, name, Scored(s.key, value, s.error, 0.0, 0.0, metrics, info))
            elif key in self._scoring:
                done += self._record(key, name, s)
        return done

    def _record(self, key: Any, name: str, s: Scored) -> list[tuple[Any, float]]:
        """Record function ``name``'s value for response ``key``; its reward if that was the last one (a response
        whose group never comes counts nowhere)."""
        scoring = self._scoring[key]
        scoring.scored[name] = s
        if len(scoring.scored) < len(self.functions):
            return []
        for fname, r in () if scoring.failed else scoring.scored.items():
            scoring.counted.calls[fname] = r.error
            if r.error is not None:
                scoring.errors[fname] = f"reward function {fname!r} failed on row {scoring.row['id']!r}: {r.error}"
            else:
                self._by_name[fname].observe(scoring.row, r.info)
                scoring.extra |= {f"{fname}/{k}": v for k, v in r.info.items()}
                for metric, value in ({fname: r.score} | {f"{fname}/{k}": v for k, v in r.metrics.items()}).items():
                    if value is not None:
                        scoring.counted.values[metric] = value
        reward = self._reward(key, self._scoring.pop(key))
        self.values[key] = {"rewards": scoring.values, "extra": scoring.extra, "reward_error": scoring.errors or None}
        if len(self.values) > MAX_VALUES:  # responses scored but never trained (filtered groups)
            del self.values[next(iter(self.values))]
        return [(key, reward)]

    def _reward(self, key: Any, scoring: _Scoring) -> float:
        """The weighted sum over the functions that apply, plus the environment's rewards; a function's
        error is raised (fail) or scored 0 (skip). Its counts wait for the round that takes them."""
        if scoring.failed:
            return 0.0
        counted = self.counted[scoring.held_out]
        counted[key] = scoring.counted
        if len(counted) > MAX_COUNTED:  # responses scored but never trained (deferred prompts', filtered groups)
            del counted[next(iter(counted))]
        values = scoring.values
        applied = [(f.weight, values[f.name]) for f in self.functions if values[f.name] is not None]
        errors = [scoring.errors[f.name] for f in self.functions if f.name in scoring.errors]
        if not errors and not applied and self.functions and not scoring.env_scored:
            none = (f"{', '.join(f.name for f in self.functions)} returned None (does not apply); add a function "
                    "that scores it, or take the row out of the data")
            errors = [f"no reward function scores row {scoring.row['id']!r}: {none}"]
            scoring.counted.calls[NONE_APPLIES] = none
            scoring.errors[NONE_APPLIES] = errors[0]  # its sample's reward_error
        if errors:
            if self.cfg.on_error == "fail":
                raise RewardFunctionError(f"{'; '.join(errors)} (--reward.on-error fail stops the run; skip scores "
                                          "such a response 0 and counts it in reward/errors)")
            scoring.counted.errored = True
            return scoring.env_reward
        return sum(w * v for w, v in applied) + scoring.env_reward

    def take_values(self, keys: list[Any]) -> dict[Any, dict[str, dict]]:
        """The ``rewards`` and ``extra`` of the responses ``keys`` (those scored: :attr:`values`), forgotten here."""
        return {k: self.values.pop(k) for k in keys if k in self.values}

    def take_metrics(self, where: str = "", held_out: bool = False, keys: Collection | None = None
                     ) -> dict[str, float]:
        """Of the responses ``keys`` (those scored; None: every one scored since the last call), the training
        rounds' (``held_out``: the held-out rounds'): ``reward/NAME`` (each function's mean where it applied, and
        of the other numbers it returned), ``reward/environment`` (the environments' rewards, where they gave
        one), ``reward/errors`` and ``reward/seconds_total`` (their summed scoring time). Logs one warning per
        function that failed, with a count. Raises :class:`RewardFunctionError` when the round's rewards
        (``where``: default "step N") are noise (:meth:`verdict`)."""
        where, counted, tally = where or f"step {self.state.global_step}", self.counted[held_out], _Tally()
        for key in list(counted) if keys is None else keys:
            if (c := counted.pop(key, None)) is not None:
                tally.add(c)
        metrics = {f"reward/{k}": tally.sums[k] / n for k, n in tally.counts.items()}
        metrics |= {"reward/errors": tally.errors, "reward/seconds_total": tally.seconds}
        stop = self.verdict(where, tally)
        for name, f in tally.failures.items():
            if f.failed and not stop:  # a stop says it all, once
                logger.warning("%s, scored 0 (--reward.on-error skip); first on %s", _failed(tally, name, where),
                               f.first)
        if stop:
            raise RewardFunctionError(stop)
        return metrics

    def verdict(self, where: str, tally: _Tally) -> str | None:
        """Why the rewards ``tally`` counts must not be trained on, or None: a function failed on every call, or
        more than ``reward.max_error_frac`` of the responses erred."""
        if not tally.errors or self.cfg.max_error_frac >= 1:
            return None
        fix = ("Stopped before training on them: fix it, then run again with --resume auto "
               "(--reward.max-error-frac 1 trains on such responses, scored 0, instead)")
        for name, f in tally.failures.items():
            if name != NONE_APPLIES and f.failed == f.calls:
                return f"{_failed(tally, name, where)}: all of them, first on {f.first}. {fix}"
        if tally.errors <= self.cfg.max_error_frac * tally.responses:
            return None
        name, worst = max(tally.failures.items(), key=lambda item: item[1].failed)
        return (f"{tally.errors} of {tally.responses} responses at {where} had a reward error, more than "
                f"--reward.max-error-frac {self.cfg.max_error_frac:g}: {_failed(tally, name, where)}, first on "
                f"{worst.first}. {fix}")

    def state_dict(self) -> dict:
        return {"functions": {f.name: f.state_dict() for f in self.functions}}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("functions", {})
        if "timeouts" in state and "code" not in saved:  # written before reward.funcs: the code timeouts' anchors
            saved = {"code": state["timeouts"]}
        for f in self.functions:
            if f.name in saved:
                f.load_state_dict(saved[f.name])

    def close(self) -> None:
        if self.pool:
            self.pool.close()
        if self.async_calls:
            self.async_calls.close()
        self.judge = None
