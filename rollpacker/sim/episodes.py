"""Episodes in the simulator: the workload of multi-turn episodes and the simulated environment workers.

The simulator runs episodes through the job's own :class:`~rollpacker.schedule.runner.EpisodeRunner`
in the job's :class:`~rollpacker.schedule.round.Round`. Only what turns and environment steps cost
is simulated:

- :class:`EpisodeWorkload`: turns per episode, each turn's length, observation tokens and the
  environment's latency per step; :func:`fit_run` takes them from a run;
- :class:`ScriptedEpisode` stands for :class:`~rollpacker.env.episode.Episode`;
  :class:`ScriptedResponse` is a response without environment;
- :class:`SimEnvPool`: environment workers placed and run as :class:`~rollpacker.env.workers.EnvPool` does;
- :class:`ScriptedEnv`: the same workload as a real environment, for ``sim validate --workload episodes``.

Invariant: every draw is deterministic in its key. Why: the simulator is only a transport, so a
policy meets episodes there exactly as in the job. The details: ``docs/simulator.md`` (Episodes).
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import random
import statistics
import zlib
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import numpy as np

from rollpacker.env.contract import EnvCall, EnvReply
from rollpacker.env.episode import Done, StepEnv, TurnRequest
from rollpacker.sim.engine import Seq


def latency_sampler(spec: str):
    """``lognormal:MEAN:SIGMA`` (seconds) or ``trace:PATH`` (seconds, one per line) -> ``draw(key) -> seconds``,
    deterministic in ``key``; a bad spec: ValueError saying the fix."""
    kind, _, rest = spec.partition(":")
    if kind == "lognormal":
        try:
            mean, sigma = (float(x) for x in rest.split(":"))
        except ValueError:
            raise ValueError(f"--latency {spec!r}: write lognormal:MEAN_SECONDS:SIGMA (lognormal:0.3:1.0)") from None
        if mean < 0 or sigma < 0:
            raise ValueError(f"--latency {spec!r}: the mean and sigma must be >= 0")
        mu = math.log(mean) - sigma ** 2 / 2 if mean > 0 else 0.0
        return lambda key: random.Random(key).lognormvariate(mu, sigma) if mean > 0 else 0.0
    if kind == "trace":
        trace = _trace(spec, "--latency", float)
        return lambda key: trace[zlib.crc32(key.encode()) % len(trace)]
    raise ValueError(f"--latency {spec!r}: write lognormal:MEAN_SECONDS:SIGMA or trace:PATH")


def turns_sampler(spec: str):
    """``pareto:ALPHA:MAX``, ``fixed:N`` or ``trace:PATH`` (turn counts, one per line) -> ``draw(row_key) -> turns``."""
    kind, _, rest = spec.partition(":")
    if kind == "pareto":
        try:
            alpha, most = float(rest.split(":")[0]), int(rest.split(":")[1])
        except (ValueError, IndexError):
            raise ValueError(f"--turns {spec!r}: write pareto:ALPHA:MAX_TURNS (pareto:1.2:8)") from None
        if alpha <= 0 or most < 1:
            raise ValueError(f"--turns {spec!r}: ALPHA must be > 0 and MAX_TURNS >= 1")
        return lambda key: min(most, int(random.Random(f"turns/{key}").paretovariate(alpha)))
    if kind == "fixed" and rest.isdigit() and int(rest) >= 1:
        return lambda key: int(rest)
    if kind == "trace":
        trace = _trace(spec, "--turns", int)
        return lambda key: trace[zlib.crc32(f"turns/{key}".encode()) % len(trace)]
    raise ValueError(f"--turns {spec!r}: write pareto:ALPHA:MAX_TURNS, fixed:N or trace:PATH")


def _trace(spec: str, flag: str, kind: type) -> list:
    path = Path(spec.partition(":")[2])
    if not path.is_file():
        raise ValueError(f"{flag} {spec!r}: no file {str(path)!r} (a trace: one value per line)")
    try:
        values = [kind(x) for x in path.read_text().split()]
    except ValueError:
        raise ValueError(f"{flag} {spec!r}: every line of the trace must be a {kind.__name__}") from None
    if not values or min(values) < (1 if kind is int else 0):
        raise ValueError(f"{flag} {spec!r}: the trace must hold values >= {1 if kind is int else 0}, one per line")
    return values


@dataclass(frozen=True, kw_only=True)
class EpisodeWorkload:
    """Episodes' turns, observations and environment latency (the module docstring)."""

    turns: str = "pareto:1.2:8"
    """Turns per episode by row: pareto:ALPHA:MAX (bench episodes' heavy tail), fixed:N or trace:PATH."""
    extra_turn: float = 0.5
    """Chance of one more turn per episode (bench episodes: its first answer's text hashes odd)."""
    latency: str = "lognormal:0.3:1.0"
    """Environment seconds per step: lognormal:MEAN_SECONDS:SIGMA, or trace:PATH (seconds, one per line)."""
    obs_tokens: int = 32
    """Tokens of each observation (with the chat template's turn delimiters)."""
    num_workers: int = 16
    """env.num_workers: environment workers (a worker runs one call at a time)."""
    max_tokens: int = 0
    """env.max_tokens: model tokens of an episode at most (0: the per-turn cap, as the job's default)."""
    resident: bool = True
    """engine.resident_sessions: a turn prefills only the tokens after its previous turn (else all)."""
    per_episode: bool = True
    """Each episode draws its own extra turn and latencies (False: a group's episodes alike, as an environment
    that sees only its row and reset seed)."""
    workload: str = ""
    """A named shape (rollpacker.sim.agentic: agentic, light or trace:PATH): its turns, step latency and cold
    starts in place of --turns, --extra-turn and --latency, whose mean (lognormal:MEAN:...) sets its scale."""

    def __post_init__(self) -> None:
        if not 0 <= self.extra_turn <= 1 or self.obs_tokens < 0 or self.num_workers < 1 or self.max_tokens < 0:
            raise ValueError(f"episodes: extra_turn={self.extra_turn} must be in [0, 1], obs_tokens={self.obs_tokens} "
                             f"and max_tokens={self.max_tokens} >= 0, num_workers={self.num_workers} >= 1")
        self._turns, self._latency, self.shape  # noqa: B018 (a bad spec says so now)

    @cached_property
    def _turns(self):
        return turns_sampler(self.turns)

    @cached_property
    def _latency(self):
        return latency_sampler(self.latency)

    @cached_property
    def shape(self):
        """The named workload (None: none), scaled to ``latency``'s mean."""
        from rollpacker.sim.agentic import Workload, workload

        if not self.workload:
            return None
        shape = workload(self.workload)
        if not self.latency.startswith("lognormal:"):  # a named shape has its own latencies: only their mean is set
            raise ValueError(f"--workload {self.workload} with --latency {self.latency}: the workload takes its step "
                             "latencies from its own shape (a named one's scaled to --latency lognormal:MEAN:SIGMA's "
                             "mean): give that, or leave --workload out")
        return shape.with_mean(float(self.latency.split(":")[1])) if isinstance(shape, Workload) else shape

    def num_turns(self, row_key: str, episode_key: str) -> int:
        """Model turns of an episode of row ``row_key`` (the environment ends it after the last one's step)."""
        if self.shape is not None:
            return self.shape.turns(row_key, episode_key)
        extra = random.Random(f"extra/{row_key}/{episode_key}").random() < self.extra_turn
        return self._turns(row_key) + extra

    def step_seconds(self, row_key: str, episode_key: str, step: int) -> float:
        """Seconds of the environment's ``step``-th step (1-based) in that episode."""
        if self.shape is not None:
            return self.shape.step_seconds(row_key, episode_key, step, "")
        return self._latency(f"{row_key}/{episode_key}/{step}")

    def reset_seconds(self, row_key: str) -> float:
        """Seconds of a reset of row ``row_key``'s environment (a named workload's cold start; else none)."""
        return self.shape.reset_seconds(row_key) if self.shape is not None else 0.0


def fit_run(run_dir: Path, workload: EpisodeWorkload) -> EpisodeWorkload:
    """``workload`` with its turns (a trace of the trained episodes' turn counts, no extra turn), observation
    tokens (their mean) and latency (a lognormal of the run's mean ``env/step_seconds``, ``workload``'s
    sigma) taken from the run in ``run_dir`` (its ``samples/`` and ``metrics.jsonl``); the trace is written
    there (``turns.trace``)."""
    from dataclasses import replace

    if workload.workload:  # its turns would stand in for the run's
        raise ValueError(f"--fit {run_dir} with --workload {workload.workload}: the fit takes the run's turns and "
                         "latency, the workload its own; give one of them")
    if not (run_dir / "metrics.jsonl").is_file():
        raise ValueError(f"--fit {run_dir}: no metrics.jsonl there (give the run directory of a run with episodes)")
    samples = [json.loads(line) for path in sorted((run_dir / "samples").glob("step_*.jsonl"))
               for line in path.read_text().splitlines()]
    episodes = [s for s in samples if "num_turns" in s]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["env/step_seconds"] for r in records if r.get("env/step_seconds")]
    if not episodes or not seconds:
        raise ValueError(f"{run_dir}: no episodes in samples/ or no env/step_seconds in metrics.jsonl (a run with "
                         "--env.factory and --metrics.samples-every 1)")
    obs = [t["tokens"] for s in episodes for t in s["turns"] if not t["trained"]]
    trace = run_dir / "turns.trace"
    trace.write_text("\n".join(str(max(1, s["num_turns"])) for s in episodes) + "\n")
    sigma = workload.latency.split(":")[2] if workload.latency.startswith("lognormal:") else "1.0"
    return replace(workload, turns=f"trace:{trace}", extra_turn=0.0, obs_tokens=round(statistics.mean(obs or [0])),
                   latency=f"lognormal:{statistics.mean(seconds):.4f}:{sigma}")


class ScriptedResponse:
    """A simulated response without environment, as the runner drives an
    :class:`~rollpacker.env.episode.Episode`: one turn (named by its id) of ``target`` tokens (its
    launch's draw of the length model, cut at the cap); ``clock()`` stamps when it finished."""

    def __init__(self, key: str, target: int, prompt_tokens: int, clock: Callable[[], float]):
        self.id, self.target, self.prompt_tokens, self.clock = key, target, prompt_tokens, clock
        self.step, self.slot, self.response = (int(x) for x in key.split(":"))
        self.num_turns, self.partial = 0, None
        self.done: Done | None = None
        self.finished_at: float | None = None

    def next_turn(self) -> TurnRequest:
        return TurnRequest(self.id, range(self.prompt_tokens), self.target, 0)

    def on_turn(self, token_ids, logprobs, finish_reason: str) -> Done:
        self.num_turns, self.finished_at, self.target = 1, self.clock(), len(token_ids)
        self.done = Done("answer")
        return self.done

    def abort(self, partial: Seq | None = None) -> Done:
        self.partial, self.done = partial, Done("abort")
        self.target = partial.target if partial is not None else self.target  # a resumed one keeps its own
        return self.done

    def fail(self, cause: str) -> Done:
        self.done = Done("error", cause)
        return self.done

    def output(self) -> Seq:
        """The response (finished: ``finish_time`` set; cut: its tokens so far, toward its own ``target``)."""
        generated = self.target if self.finished_at is not None else self.partial.generated if self.partial else 0
        return Seq(self.id, self.slot, self.response, self.prompt_tokens, self.target, generated=generated,
                   finish_time=self.finished_at, num_turns=self.num_turns)

    @classmethod
    def maker(cls, lengths, num_responses: int, max_new_tokens: int, clock: Callable[[], float]):
        """``make(key, row, reset)`` for a round's runner: each launch's lengths drawn once, as the job replays them."""
        drawn: dict[tuple[int, int], list[int]] = {}

        def make(key: str, row: int, reset) -> ScriptedResponse:
            step, slot, k = (int(x) for x in key.split(":"))
            if (step, slot) not in drawn:
                drawn[step, slot] = np.minimum(lengths.lengths(row, step, slot, num_responses), max_new_tokens).tolist()
            return cls(key, drawn[step, slot][k], lengths.prompt_tokens, clock)

        return make


class ScriptedEpisode:
    """One simulated episode of ``turns`` model turns (None: its environment never opened), as the runner
    drives an :class:`~rollpacker.env.episode.Episode`; ``clock()`` stamps when it is done; ``resident``:
    its turns keep their KV at their replica for the next (``engine.resident_sessions``)."""

    def __init__(self, key: str, row: int, turns: int | None, *, lengths, prompt_tokens: int, obs_tokens: int,
                 max_new_tokens: int, max_tokens: int, clock: Callable[[], float], resident: bool = True):
        self.id, self.row, self.turns, self.lengths = key, row, turns or 0, lengths
        self.step, self.slot, self.response = (int(x) for x in key.split(":"))
        self.prompt_tokens, self.obs_tokens, self.clock, self.resident = prompt_tokens, obs_tokens, clock, resident
        self.max_new_tokens, self.max_tokens = max_new_tokens, max_tokens or max_new_tokens
        self.num_turns = self.model_tokens = self.env_tokens = 0
        self.done: Done | None = None
        self.finished_at: float | None = None

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.model_tokens + self.env_tokens

    def budget(self) -> int:
        """The next turn's most tokens: the turn's cap, or the episode's model tokens left."""
        return min(self.max_new_tokens, self.max_tokens - self.model_tokens)

    def next_turn(self) -> TurnRequest:
        """The next turn: the conversation so far as its prompt, its length as its token budget."""
        length = self.lengths.turn_length(self.row, self.step, self.slot, self.response, self.num_turns)
        return TurnRequest(f"{self.id}#{self.num_turns}", range(self.context), min(self.budget(), length), 0,
                           session=self.id if self.resident else None)

    def on_turn(self, token_ids, logprobs, finish_reason: str) -> StepEnv | Done:
        left = self.max_tokens - self.model_tokens
        self.num_turns += 1
        self.model_tokens += len(token_ids)
        if len(token_ids) >= left or not token_ids:  # as Episode.on_turn: a turn cut at its own cap goes on
            return self._end("max_tokens")
        return StepEnv("")

    def on_step(self, result: Any):
        if self.num_turns >= self.turns:
            return self._end("terminated")
        self.env_tokens += self.obs_tokens
        return self.next_turn()

    def abort(self, partial: Seq | None = None) -> Done:
        if partial is not None and self.done is None:
            self.model_tokens += partial.generated
        return self._end("abort")

    def fail(self, cause: str) -> Done:
        return self._end("error", cause)

    def _end(self, reason: str, detail: str = "") -> Done:
        if self.done is None:
            self.done = Done(reason, detail)
            self.finished_at = None if reason in ("abort", "error") else self.clock()
        return self.done

    def output(self) -> Seq:
        """The episode as one response (a :class:`~rollpacker.sim.engine.Seq` of all its tokens after the
        prompt; unfinished: ``finish_time`` None, it reads "abort")."""
        tokens = self.model_tokens + self.env_tokens
        return Seq(self.id, self.slot, self.response, self.prompt_tokens, tokens, generated=tokens,
                   finish_time=self.finished_at, num_turns=self.num_turns)


@dataclass
class SimEnvPool:
    """``workload.num_workers`` simulated environment workers (the module docstring); ``row_key(row)``
    names a dataset row for the workload's draws; ``seed``, the episodes' reset seeds (the run's).
    Without a workload, responses are single turns and the pool has no workers."""

    workload: EpisodeWorkload | None = None
    row_key: Callable[[int], str] = str
    seed: int = 0
    free_at: list[float] = field(default_factory=list)
    """Per worker: when its last call ends."""
    home: dict[str, int] = field(default_factory=dict)
    """Episode -> its worker, until its close has run there."""
    closing: list[tuple[float, str]] = field(default_factory=list)
    """(when it has run, episode) of every close sent."""
    episodes: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    """Episode -> (row key, episode key of the draws, steps so far)."""
    pending: list[tuple[float, int, EnvReply]] = field(default_factory=list)
    warmed: set[str] = field(default_factory=set)
    """Episodes opened ahead (:meth:`warm`) whose round has not opened them yet."""
    _order: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.free_at = self.free_at or [0.0] * (self.workload.num_workers if self.workload else 0)

    def warm(self, opens: list[EnvCall], now: float) -> None:
        """Open ``opens`` at ``now``, ahead of their round (``env.warm``): its open of one is answered by
        this reply, as :meth:`Environments.send <rollpacker.env.setup.Environments.send>` does."""
        self.send(opens, now)
        self.warmed = {call.key for call in opens}

    def send(self, calls: list[EnvCall], now: float) -> None:
        """Queue ``calls`` at ``now``, each on its episode's worker after the calls before it."""
        for call in calls:
            if call.kind == "open" and call.key in self.warmed:
                self.warmed.discard(call.key)
                continue
            reply, seconds = self._run(call, now)
            worker = self.home[call.key]
            end = self.free_at[worker] = max(now, self.free_at[worker]) + seconds
            heapq.heappush(self.pending, (end, next(self._order), reply))
            if call.kind == "close":
                heapq.heappush(self.closing, (end, call.key))

    def shift(self, elapsed: float) -> None:
        """The next round begins ``elapsed`` seconds after this one began (its time starts at 0): what the
        workers still run (the steps of episodes cut in flight, their closes) carries over, as in the job."""
        self.free_at = [max(0.0, t - elapsed) for t in self.free_at]
        self.pending = [(t - elapsed, order, reply) for t, order, reply in self.pending]
        self.closing = [(t - elapsed, key) for t, key in self.closing]
        heapq.heapify(self.pending)
        heapq.heapify(self.closing)

    def _run(self, call: EnvCall, now: float) -> tuple[EnvReply, float]:
        """The reply of ``call`` and its seconds (an open finds its episode a worker)."""
        w = self.workload
        if call.kind == "open":
            while self.closing and self.closing[0][0] <= now:  # closed: the episode is forgotten
                key = heapq.heappop(self.closing)[1]
                del self.home[key], self.episodes[key]
            hosted = Counter(self.home.values())
            self.home[call.key] = min(range(len(self.free_at)), key=lambda i: (hosted[i], i))
            row = self.row_key(call.row)
            draws = call.key if w.per_episode else str(call.seed)
            self.episodes[call.key] = (row, draws, 0)
            seconds = w.reset_seconds(row)
            return EnvReply(call.key, "open", w.num_turns(row, draws), seconds=seconds), seconds
        if call.kind == "step":
            row, draws, steps = self.episodes[call.key]
            self.episodes[call.key] = (row, draws, steps + 1)
            seconds = w.step_seconds(row, draws, steps + 1)
            return EnvReply(call.key, "step", seconds=seconds), seconds
        return EnvReply(call.key, "close"), 0.0

    def next_reply(self) -> float | None:
        """When the next reply is due, while a call other than a close is in flight (None: none is)."""
        if not any(reply.kind != "close" for _, _, reply in self.pending):
            return None
        return self.pending[0][0]

    def take(self, now: float) -> list[EnvReply]:
        """The replies ready by ``now``, in the order they became ready."""
        out = []
        while self.pending and self.pending[0][0] <= now:
            out.append(heapq.heappop(self.pending)[2])
        return out


class ScriptedEnv:
    """:class:`EpisodeWorkload` as an environment (gymnasium's API; the module docstring): it ends after
    the workload's turns of its row and reset seed, each step sleeping the workload's latency."""

    OBSERVATION = "Go on."

    def __init__(self, row: dict, workload: EpisodeWorkload):
        self.row_key, self.workload = str(row["id"]), workload
        self.key, self.turns, self.steps = "", 0, 0

    def reset(self, *, seed: int, options: dict | None = None):
        import time

        self.key, self.steps = str(seed), 0
        self.turns = self.workload.num_turns(self.row_key, self.key)
        time.sleep(self.workload.reset_seconds(self.row_key))
        return None, {}

    def step(self, action: str):
        import time

        self.steps += 1
        time.sleep(self.workload.step_seconds(self.row_key, self.key, self.steps))
        if self.steps >= self.turns:
            return None, 0.0, True, False, {}
        return self.OBSERVATION, None, False, False, {}
