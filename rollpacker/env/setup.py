"""What rank 0 needs to run a round's episodes: the environment workers, and how an episode starts.

:class:`Episodes` is built once per run by the controller; the exchange gives each round an
:class:`~rollpacker.schedule.episodes.EpisodeRunner` over it (:meth:`Episodes.runner`) and carries
the runner's environment calls to the workers (:meth:`Episodes.send`) and their replies back
(:meth:`Episodes.poll`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rollpacker.env.config import EnvConfig
from rollpacker.env.contract import EnvError
from rollpacker.env.episode import Episode
from rollpacker.env.info import TOOL_INFO
from rollpacker.env.workers import EnvPool, EnvSpec
from rollpacker.schedule.episodes import EnvCall, EpisodeRunner


@dataclass(kw_only=True)
class Episodes:
    """The run's environment workers and episode settings (see the module docstring)."""

    cfg: EnvConfig
    pool: EnvPool
    bridge: Any
    """The tokenizer's :class:`~rollpacker.env.render.ChatBridge`."""
    encode: Callable[[Any, list[dict] | None], list[int]]
    """An episode's prompt (a string or chat messages) and its tools' schemas -> its token ids."""
    seed: int
    max_new_tokens: int
    """Per turn (``rollout.max_new_tokens``); also the episode's model tokens unless ``env.max_tokens``."""
    max_context: int
    """The engines' context length."""

    def make(self, key: str, row: dict, reset: tuple[Any, dict] | None) -> Episode:
        """Episode ``key`` of ``row`` from its environment's reset ``(prompt or None, info)`` (None: the
        row's). An :class:`EnvError` if the reset prompt leaves no token for the first turn."""
        prompt, info = reset or (None, {})
        ids = self.encode(row["prompt"] if prompt is None else prompt, info.get("tools"))
        if len(ids) >= self.max_context:
            raise EnvError(f"{EnvSpec.from_config(self.cfg).name}: episode {key!r} (row {row['id']!r}): its reset "
                           f"prompt is {len(ids)} tokens and the context length is {self.max_context}: no token is "
                           "left for the first turn; raise --engine.max-model-len or shorten the environment's prompt")
        return Episode(key, ids, self.bridge, seed=self.seed, max_turns=self.cfg.max_turns,
                       max_tokens=self.cfg.max_tokens or self.max_new_tokens, max_new_tokens=self.max_new_tokens,
                       max_context=self.max_context, info_keys=TOOL_INFO if self.cfg.tools else ())

    def runner(self, rows: Sequence[dict]) -> EpisodeRunner:
        """A round's episodes over the data ``rows``."""
        return EpisodeRunner(lambda key, row, reset: self.make(key, rows[row], reset), seed=self.seed,
                             on_error=self.cfg.on_error)

    def send(self, calls: list[EnvCall], rows: Sequence[dict], tag: str = "") -> None:
        """Hand ``calls`` to the workers, in order, their episodes named ``TAG + key`` (the held-out
        rounds' episodes share a step's ids with the training round's, not their names)."""
        for call in calls:
            key = tag + call.key
            if call.kind == "open":
                self.pool.open_episode(key, rows[call.row], call.seed)
            elif call.kind == "step":
                self.pool.step_episode(key, call.action)
            else:
                self.pool.close_episode(key)

    def poll(self, tag: str = "") -> list[Any]:
        """The workers' replies ready now for the episodes sent with ``tag`` (named by their keys again);
        those of the others (a close after the rounds they served) are dropped."""
        out = []
        for reply in self.pool.poll():
            if isinstance(reply.key, str) and reply.key.startswith(tag) and (tag or "/" not in reply.key):
                out.append(dataclasses.replace(reply, key=reply.key[len(tag):]))
        return out

    def close(self) -> None:
        """Let the closes sent run (a short wait), then stop the workers."""
        try:
            self.pool.drain(timeout=self.cfg.timeout)
        except TimeoutError:
            pass
        self.pool.close()
