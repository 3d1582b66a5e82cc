"""The reward scheduler (paper §4.3): each response is scored the moment it finishes, overlapped
with the rest of the rollout.

The controller calls :meth:`RewardScheduler.submit` for every finished response and hands the
scores that :meth:`poll` returns to the scheduling policy; when nothing is left running it
blocks in :meth:`wait`, and that wait is the round's exposed reward time. Scoring runs in the
killable worker processes of :class:`~rollpacker.reward.workers.RewardPool` (``num_workers``
> 0), or inline in the controller when ``num_workers`` = 0 (for debugging: nothing can kill a
hung reward there). A sample whose reward failed comes back as None and is counted; the
trainer's ``reward.on_error`` says whether it is trained with reward 0 or dropped. Code rows
(with ``tests``) get the adaptive per-test timeouts, whose anchors go into the checkpoint.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from rollpacker.reward.code import AdaptiveTimeout
from rollpacker.reward.config import RewardConfig
from rollpacker.reward.rules import RewardError
from rollpacker.reward.workers import score as score_sample

logger = logging.getLogger(__name__)


class RewardScheduler:
    def __init__(self, cfg: RewardConfig, kind: str, decode: Callable[[list[int]], str]):
        self.cfg, self.kind, self.decode = cfg, kind, decode
        self.timeouts = AdaptiveTimeout.from_config(cfg)
        self.pool = None
        if cfg.num_workers:
            from rollpacker.reward.workers import RewardPool

            self.pool = RewardPool(cfg)
        self._inline: list[tuple[Any, float | None]] = []
        self._tests: dict[Any, list[dict]] = {}
        self.seconds = 0.0
        """Scoring time of the samples scored since :meth:`take_seconds`, summed (workers run in parallel)."""

    def submit(self, key: Any, row: dict, output) -> None:
        response = self.decode(output.token_ids)
        if "tests" in row:
            self._tests[key] = row["tests"]
            kind, payload = "code", {"response": response, "tests": row["tests"],
                                     "timeouts": self.timeouts.timeouts(row["tests"])}
        else:
            kind, payload = self.kind, {"response": response, "answer": row["answer"]}
        if self.pool:
            self.pool.submit(key, kind, payload)
            return
        start = time.perf_counter()
        try:
            score, info = score_sample(kind, payload, self.cfg.sandbox)
            if kind == "code":
                self.timeouts.observe(self._tests.pop(key), info)
        except RewardError as e:
            score = self._failed(key, str(e))
        self.seconds += time.perf_counter() - start
        self._inline.append((key, score))

    def poll(self) -> list[tuple[Any, float | None]]:
        """Scores finished since the last call: ``(key, reward or None if it failed)``; never waits."""
        if not self.pool:
            done, self._inline = self._inline, []
            return done
        return [self._result(s) for s in self.pool.poll()]

    def wait(self) -> list[tuple[Any, float | None]]:
        """Like :meth:`poll`, after every submitted sample is scored."""
        if self.pool:
            return [self._result(s) for s in self.pool.drain()]
        return self.poll()

    def _result(self, scored) -> tuple[Any, float | None]:
        self.seconds += scored.seconds
        tests = self._tests.pop(scored.key, None)
        if scored.error:
            return scored.key, self._failed(scored.key, scored.error)
        if tests is not None:
            self.timeouts.observe(tests, scored.info)
        return scored.key, scored.score

    def take_seconds(self) -> float:
        """The summed scoring time since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def _failed(self, key, error: str) -> None:
        logger.warning("reward_error on %s: %s", key, error)
        return None

    def state_dict(self) -> dict:
        return {"timeouts": self.timeouts.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.timeouts.load_state_dict(state["timeouts"])

    def close(self) -> None:
        if self.pool:
            self.pool.close()
