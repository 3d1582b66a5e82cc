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

The LLM judge (kind ``judge``, :mod:`rollpacker.reward.judge`) runs here, in the controller, on
the device it is given (rank 0's, which the actor shares), loaded on first use. Its samples are
queued at :meth:`submit`; each :meth:`poll` scores one packed batch from the head of the queue (at
most ``judge.max_batch_tokens`` tokens, one forward), so a poll holds rollout up for one forward
at most, and :meth:`wait` scores the rest. An unparseable verdict is a reward_error like any other.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable

from rollpacker.reward.code import AdaptiveTimeout
from rollpacker.reward.config import RewardConfig, check_judge_path
from rollpacker.reward.rules import RewardError
from rollpacker.reward.workers import score as score_sample

logger = logging.getLogger(__name__)


class RewardScheduler:
    def __init__(self, cfg: RewardConfig, kind: str, decode: Callable[[list[int]], str], device: Any = "cpu"):
        """``kind``: data.reward; ``device``: where the judge runs (the controller rank's, the actor's)."""
        if kind == "judge":
            check_judge_path(cfg.judge.model_path)
        self.cfg, self.kind, self.decode, self.device = cfg, kind, decode, device
        self.judge = None
        """The :class:`~rollpacker.reward.judge.Judge`, loaded on the first judge sample."""
        self._judge_todo: collections.deque[tuple[Any, tuple | list[int]]] = collections.deque()
        """Judge samples not scored yet: ``(key, (prompt, response, rubric))``, or ``(key, token ids)`` once encoded."""
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
        elif self.kind == "judge":
            self._judge_todo.append((key, (row["prompt"], response, row.get("rubric"))))
            return
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
        """Scores finished since the last call: ``(key, reward or None if it failed)``. Never waits for
        a worker; scores one judge batch (one forward) if judge samples are queued."""
        done = self._judge_batch() if self._judge_todo else []
        return self._finished() + done

    def wait(self) -> list[tuple[Any, float | None]]:
        """Like :meth:`poll`, after every submitted sample is scored."""
        done = []
        while self._judge_todo:  # the workers score on meanwhile
            done += self._judge_batch()
        if self.pool:
            return [self._result(s) for s in self.pool.drain()] + done
        return self._finished() + done

    def _finished(self) -> list[tuple[Any, float | None]]:
        if not self.pool:
            done, self._inline = self._inline, []
            return done
        return [self._result(s) for s in self.pool.poll()]

    def _judge_batch(self) -> list[tuple[Any, float | None]]:
        """Score the judge samples at the head of the queue that fit one forward (at least one)."""
        start = time.perf_counter()
        if self.judge is None:
            from rollpacker.reward.judge import Judge

            logger.info("loading the judge %s on %s", self.cfg.judge.model_path, self.device)
            self.judge = Judge(self.cfg.judge, self.device)
        cfg = self.judge.cfg
        keys, seqs, size = [], [], 0
        while self._judge_todo:
            key, sample = self._judge_todo[0]
            ids = sample if isinstance(sample, list) else self.judge.encode(*sample)
            num_tokens = len(ids) if len(ids) <= cfg.max_tokens else 0  # too long: flagged without a forward
            if keys and size + num_tokens > cfg.max_batch_tokens:
                self._judge_todo[0] = (key, ids)  # next poll's first: encoded once
                break
            self._judge_todo.popleft()
            keys.append(key)
            seqs.append(ids)
            size += num_tokens
        results = self.judge.score_ids(seqs)
        self.seconds += time.perf_counter() - start
        return [(key, self._failed(key, str(r)) if isinstance(r, RewardError) else r) for key, r in zip(keys, results)]

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
        self.judge = None

