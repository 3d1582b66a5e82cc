"""The round's runner: every request of a round is an episode (:mod:`rollpacker.env.episode`).

:class:`EpisodeRunner` is the round's episode bookkeeping, pure like the round: nothing here sends,
waits or imports torch. The round's request id of a response (``STEP:SLOT:K``) names its episode;
the policy, the scorer and the trainer see one response per episode (one ``on_finished``).

- With an environment, a launched response opens it (an ``open`` :class:`EnvCall`, reset seeded
  per group); the reply starts the first turn; a finished turn steps the environment with its text,
  whose reply starts the next turn, until the episode is done and its environment closed. An
  episode that a token limit ended first asks its environment for a last reward (a ``finish``),
  if its environment scores such an episode (TRL's ``get_reward``; said in its reset's reply).
- Without one, a launched response is its one turn at once (a single-turn response).
- An episode the policy aborts is cut where it is: its running turn aborted at its engine (its
  tokens kept), or, between turns, at once; its environment is closed after the calls in flight.
  One waiting for its last reward is whole: it ends at once, without that reward.

An environment that fails (its reply has an error, or its reset prompt leaves no room for a turn)
ends its episode trained on nothing (``env.on_error`` skip, counted in ``env/errors``) or stops the
run (fail).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from rollpacker.env.contract import EnvCall, EnvError
from rollpacker.env.episode import LENGTH_REASONS, Done, Episode, Response, StepEnv, TurnRequest, reset_seed
from rollpacker.errors import UserError


@dataclass
class EpisodeStats:
    """A round's episodes, for ``env/`` metrics (none when no environment took part)."""

    turns: list[int] = field(default_factory=list)
    """Model turns of each episode that finished."""
    step_seconds: list[float] = field(default_factory=list)
    """Seconds of each environment call (reset, step) in its worker."""
    errors: int = 0
    causes: list[str] = field(default_factory=list)
    """What each environment error said (the environment, the episode, its row, the cause), in order."""
    env_wait_s: float = 0.0
    """Seconds of polls in which no turn ran at an engine while environment calls were in flight."""
    reset_retries: int = 0
    """Opens tried again (``env.reset_retries``), whatever came of them."""
    steps: int = 0
    """Step calls answered (each episode's actions but its last one's when a token limit ended it)."""
    step_errors: int = 0
    """Step calls that failed: a share of these, not only of the episodes, says the environment is broken."""

    def metrics(self) -> dict[str, float]:
        if not (self.step_seconds or self.errors):
            return {}
        mean = (lambda xs: sum(xs) / len(xs) if xs else 0.0)
        return {"env/turns_mean": mean(self.turns), "env/step_seconds": mean(self.step_seconds),
                "env/errors": float(self.errors), "env/reset_retries": float(self.reset_retries),
                "env/steps": float(self.steps), "env/step_errors": float(self.step_errors),
                "rollout/env_wait_s": self.env_wait_s}


class EpisodeRunner:
    """The episodes of one round (the module docstring). ``make(key, row, reset)`` builds episode
    ``key`` of dataset row ``row`` from its environment's reset ``(prompt or None, info)``, or from
    none (None: the row's own prompt); ``environment``: episodes open an environment first."""

    def __init__(self, make: Callable[[str, int, Any], Episode], *, seed: int, environment: bool,
                 on_error: str = "skip"):
        self.make, self.seed, self.environment, self.on_error = make, seed, environment, on_error
        self.rows: dict[str, int] = {}
        """Episode -> its dataset row, for every episode opened and not yet ended."""
        self.live: dict[str, Episode] = {}
        """Episodes started (their environment reset, if any)."""
        self.running: dict[str, str] = {}
        """Turn id -> its episode, for every turn sent to an engine and not back."""
        self.budgets: dict[str, int] = {}
        """Turn id -> its token budget (``max_new_tokens``), for every running turn."""
        self.waiting: set[str] = set()
        """Episodes whose environment call (open, step, finish) is in flight."""
        self.finishes: set[str] = set()
        """Episodes whose environment scores the episode a token limit ends (its reset's reply said so)."""
        self.resume: dict[str, Any] = {}
        """Episode -> the partial response its first turn continues (carried from an earlier round)."""
        self.sessions: set[str] = set()
        """Episodes whose turns asked their engine to keep their KV (:attr:`TurnRequest.session`)."""
        self.calls: list[EnvCall] = []
        """Environment calls to send (:meth:`take_calls`)."""
        self.turns: list[tuple[str, TurnRequest]] = []
        """(episode, turn) to send to an engine (:meth:`take_turns`)."""
        self.ended: list[str] = []
        """Episodes with a session that ended since :meth:`take_ended`: their engine sessions can go."""
        self.early: list[Response] = []
        """Episodes that ended as they opened (:meth:`on_env` returns them)."""
        self.env_seconds: dict[str, float] = {}
        """Episode -> seconds its environment's calls took so far."""
        self.stats = EpisodeStats()
        self._last_now: float | None = None

    def open(self, key: str, row: int, group: str, resume: Any = None) -> None:
        """Open episode ``key`` of dataset row ``row`` in prompt group ``group`` (:meth:`RoundPlan.group`);
        ``resume``: a partial response of it (an earlier round's) that its first turn continues."""
        self.rows[key] = row
        if resume is not None:
            self.resume[key] = resume
        if not self.environment:
            self.early += self._start(key, None)
            return
        self.waiting.add(key)
        self.calls.append(EnvCall("open", key, row=row, seed=reset_seed(self.seed, group)))

    @staticmethod
    def key(turn_id: str) -> str:
        """The episode of turn ``turn_id`` (``EPISODE#TURN``, or the episode itself)."""
        return turn_id.partition("#")[0]

    @property
    def idle(self) -> list[str]:
        """Episodes with no turn at an engine: waiting for their environment, or their turn not sent yet."""
        return sorted(self.waiting | {key for key, _ in self.turns})

    def on_env(self, replies: list[Any], now: float) -> list[Response]:
        """The environment workers' replies -> the episodes that finished (and those that ended opening)."""
        self._wait(now)
        done, self.early = self.early, []
        for reply in replies:
            self.stats.reset_retries += reply.retries  # whatever came of them: an aborted episode's ran too
            if reply.kind == "close" or reply.key not in self.waiting:
                continue  # a close, or the reply of an episode aborted meanwhile (or of an earlier round)
            self.waiting.discard(reply.key)
            self.stats.step_seconds.append(reply.seconds)
            self.env_seconds[reply.key] = self.env_seconds.get(reply.key, 0.0) + reply.seconds
            self.stats.steps += reply.kind == "step"
            self.stats.step_errors += reply.kind == "step" and bool(reply.error)
            if reply.error:
                done += self._failed(reply.key, reply.error)
            elif reply.kind == "open":
                self.finishes.update([reply.key] if reply.finishes else [])
                done += self._start(reply.key, reply.value, reply.state)
            else:
                episode = self.live[reply.key]
                episode.env_state = reply.state if reply.state is not None else episode.env_state
                if reply.kind == "finish":
                    done.append(self._end(reply.key, episode.on_finish(reply.value)))
                else:
                    done += self._next(reply.key, episode.on_step(reply.value))
        return done

    def on_turns(self, outputs: list[Any]) -> list[Response]:
        """Turns that finished at the engines -> the episodes that finished."""
        return [r for out in outputs for r in self._turn(out, out.finish_reason)]

    def migrated(self, out: Any) -> list[Response] | None:
        """A migrating turn's output as its abort brought it back. A whole turn (its engine finished it,
        or it fills the turn's budget: "length") goes on as finished -> the episodes that finished;
        None: tokens are left to generate, it resumes."""
        if out.finish_reason != "abort":
            return self._turn(out, out.finish_reason)
        return self._turn(out, "length") if len(out.token_ids) >= self.budgets.get(out.id, 1 << 62) else None

    def abort(self, keys: list[str]) -> tuple[list[str], list[Response]]:
        """Cut episodes ``keys`` -> (turn ids to abort at the engines, episodes cut at once: those
        between turns). A turn aborted comes back to :meth:`cut`."""
        turns = {key: tid for tid, key in self.running.items()}
        abort, cut = [], []
        for key in keys:
            if key in turns:
                abort.append(turns[key])
            elif key in self.rows:
                self.turns = [(k, t) for k, t in self.turns if k != key]
                cut.append(self._end(key, self._episode(key).abort()))
        return abort, cut

    def cut(self, out: Any) -> Response | None:
        """The partial output of an aborted turn -> its episode, cut (None: not ours, or ended already)."""
        key = self.running.pop(out.id, None)
        self.budgets.pop(out.id, None)
        if key is None:
            return None
        return self._end(key, self.live[key].abort(out))

    def close_all(self) -> list[Response]:
        """The round is over: every episode still open is cut."""
        self.running.clear()
        self.budgets.clear()
        self.turns.clear()
        return [self._end(key, self._episode(key).abort()) for key in sorted(self.rows)]

    def take_calls(self) -> list[EnvCall]:
        calls, self.calls = self.calls, []
        return calls

    def take_ended(self, aborting: list[str] = ()) -> list[str]:
        """Episodes whose engine sessions can go: those ended since the last call, and those of the
        turns ``aborting`` (their episodes end once the aborts are back)."""
        ended, self.ended = self.ended, []
        return ended + sorted({key for key in map(self.key, aborting) if key in self.sessions})

    def take_turns(self) -> list[tuple[str, TurnRequest]]:
        """The turns to send now; each is running from here on."""
        turns, self.turns = self.turns, []
        for key, turn in turns:
            self.running[turn.id], self.budgets[turn.id] = key, turn.max_new_tokens
            if turn.session:
                self.sessions.add(key)
        return turns

    def _episode(self, key: str) -> Episode:
        """Episode ``key``; one whose environment never opened is an empty episode of its row."""
        if key not in self.live:
            self.live[key] = self.make(key, self.rows[key], None)
        return self.live[key]

    def _start(self, key: str, reset: Any, state: Any = None) -> list[Response]:
        """Episode ``key`` from its environment's reset (and the copy of its environment, ``state``): its first
        turn, or (no room for one) its failure."""
        try:
            episode = self.live[key] = self.make(key, self.rows[key], reset)
        except EnvError as e:
            return self._failed(key, str(e))
        episode.env_state = state
        turn, resume = episode.next_turn(), self.resume.pop(key, None)
        self.turns.append((key, turn if resume is None else replace(turn, resume_from=resume)))
        return []

    def _turn(self, out: Any, finish_reason: str) -> list[Response]:
        """Turn ``out`` finished (``finish_reason``) -> the episodes that finished."""
        key = self.running.pop(out.id, None)
        self.budgets.pop(out.id, None)
        if key is None:
            return []  # its episode was cut meanwhile
        return self._next(key, self.live[key].on_turn(out.token_ids, out.logprobs, finish_reason))

    def _next(self, key: str, what: StepEnv | TurnRequest | Done) -> list[Response]:
        if isinstance(what, StepEnv):
            self.waiting.add(key)
            self.calls.append(EnvCall("step", key, action=what.action))
            return []
        if isinstance(what, TurnRequest):
            self.turns.append((key, what))
            return []
        self.stats.turns.append(self.live[key].num_turns)
        if key in self.finishes and what.reason in LENGTH_REASONS:  # its environment's last word first
            self.waiting.add(key)
            self.calls.append(EnvCall("finish", key))
            return []
        return [self._end(key, what)]

    def _failed(self, key: str, error: str) -> list[Response]:
        self.stats.errors += 1
        self.stats.causes.append(error)
        if self.on_error == "fail":
            raise UserError(f"{error} (--env.on-error fail stops the run; skip ends such an episode untrained and "
                            "counts it in env/errors)")
        return [self._end(key, self._episode(key).fail(error))]

    def _end(self, key: str, done: Done) -> Response:
        """Episode ``key`` ended (``done``): its environment is closed, its session can go; its output."""
        episode = self.live.pop(key)
        episode.env_seconds = self.env_seconds.pop(key, 0.0)
        self.rows.pop(key)
        self.waiting.discard(key)
        self.finishes.discard(key)
        self.resume.pop(key, None)
        if self.environment:
            self.calls.append(EnvCall("close", key))
        if key in self.sessions:
            self.sessions.discard(key)
            self.ended.append(key)
        return episode.output()

    def _wait(self, now: float) -> None:
        """Count the poll that just ended as waiting for environments if no turn ran and some call was in flight."""
        if self._last_now is not None and self.waiting and not self.running:
            self.stats.env_wait_s += now - self._last_now
        self._last_now = now
