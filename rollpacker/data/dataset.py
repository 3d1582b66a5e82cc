"""Prompt datasets and the stateful sampler that draws them.

A dataset is a list of rows ``{"id", "prompt", "answer", ...}`` (for the LLM judge ``answer`` is
optional and a row may carry its own ``rubric``): either the synthetic toy task
(:mod:`rollpacker.data.toy`, the embedded default) or a JSONL file of real data, one JSON object
per line. Loading is strict: a bad line raises one error that names ``file:line`` and what is
wrong; nothing is skipped except blank lines, unless ``data.skip_bad_lines`` asks to skip bad lines
with a warning that counts them and names the first few.

:class:`PromptSampler` hands out row indices in a seeded permutation per epoch. Its whole state
is a few ints, so a checkpoint can hold it and a resumed run draws exactly the same prompts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from rollpacker.choices import check_choices
from rollpacker.data import toy
from rollpacker.data.rubric import check_rubric

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class DataConfig:
    path: str = ""
    """JSONL of real data: 'prompt' and 'answer' (math), or 'tests' (code); empty = generate the toy task."""
    num_toy_prompts: int = 2048
    """Number of toy problems to generate (only used when path is empty)."""
    toy_seed: int = 0
    """Seed of the toy problem generator."""
    toy_tail_alpha: float = 1.6
    """Pareto exponent of the toy problems' term count (their length tail): larger is thinner; the task's own: 1.3."""
    reward: Literal["toy", "math", "code", "judge"] = "toy"
    """Which reward scores this data (judge: reward.judge's LLM); rows with 'tests' are always scored as code."""
    shuffle_seed: int = 0
    """Seed of the per-epoch prompt order; epoch e is shuffled with (shuffle_seed, e)."""
    eval_path: str = ""
    """JSONL file of held-out prompts for evaluation; empty = held-out toy problems (toy data only)."""
    num_eval_prompts: int = 256
    """Held-out prompts per evaluation (the first this many of the eval set)."""
    skip_bad_lines: bool = False
    """Skip JSONL lines that are not valid rows (logging how many and where) instead of stopping at the first."""

    def __post_init__(self) -> None:
        check_choices(self, "data")
        if self.num_eval_prompts <= 0:
            raise ValueError(f"data.num_eval_prompts must be positive, got {self.num_eval_prompts}")
        if self.toy_tail_alpha <= 0:
            raise ValueError(f"data.toy_tail_alpha must be positive, got {self.toy_tail_alpha}")
        if self.num_toy_prompts <= 0:
            raise ValueError(f"data.num_toy_prompts must be positive, got {self.num_toy_prompts}")
        if self.shuffle_seed < 0:
            raise ValueError(f"data.shuffle_seed must be >= 0, got {self.shuffle_seed}")


class DatasetError(ValueError):
    """A dataset file that cannot be used as is; the message names ``file:line`` and the fix."""


def load_rows(config: DataConfig) -> list[dict]:
    """The rows of ``config``'s dataset: the generated toy task, or the JSONL file at ``config.path``."""
    if not config.path:
        return toy.make_dataset(config.num_toy_prompts, config.toy_seed, config.toy_tail_alpha)
    return read_jsonl(config.path, config.reward, skip_bad=config.skip_bad_lines)


def load_eval_rows(config: DataConfig) -> list[dict]:
    """Held-out rows: the first ``num_eval_prompts`` of ``eval_path``, or fresh toy problems drawn
    with a seed the training set never uses."""
    if config.eval_path:
        return read_jsonl(config.eval_path, config.reward, skip_bad=config.skip_bad_lines)[: config.num_eval_prompts]
    if config.path:
        raise DatasetError("evaluation on real data needs data.eval_path (a JSONL file of held-out prompts)")
    return toy.make_dataset(config.num_eval_prompts, 1_000_003 + config.toy_seed, config.toy_tail_alpha)


def read_jsonl(path: str | Path, reward: str = "math", skip_bad: bool = False) -> list[dict]:
    """Rows of a JSONL file; every line must be an object with string ``prompt`` and either string
    ``answer`` or ``tests``, a non-empty list of ``{"input": str, "output": str}`` (code). For
    ``reward`` judge, ``answer`` is optional and ``rubric``, if there, must be a judge template
    with ``{prompt}`` and ``{response}``: it replaces ``reward.judge.rubric`` for that row.

    ``id`` is optional (a string or an integer, kept as a string); it defaults to
    ``"<file stem>:<line number>"``. Ids must be unique. Other fields are kept as they are.
    Blank lines are skipped; any other bad line raises :class:`DatasetError` naming ``file:line``,
    or, with ``skip_bad``, is left out and counted in one warning.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data.path: no such file: {path} (give a JSONL file, or leave it empty for the "
                                "toy task)")
    rows: list[dict] = []
    first_line_of: dict[str, int] = {}
    bad: list[str] = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                row = _parse_line(raw, path, line_no, reward)
                if row is None:
                    continue
                row_id = row["id"]
                if row_id in first_line_of:
                    raise DatasetError(f"{path}:{line_no}: duplicate id {row_id!r} (first on line "
                                       f"{first_line_of[row_id]}); ids must be unique")
            except DatasetError as e:
                if not skip_bad:
                    raise DatasetError(f"{e} (fix the line, or set data.skip_bad_lines to skip bad lines)") from None
                bad.append(str(e))
                continue
            first_line_of[row_id] = line_no
            rows.append(row)
    if bad:
        logger.warning("%s: skipped %d bad line(s) of %d (data.skip_bad_lines); first: %s",
                       path, len(bad), len(bad) + len(rows), "; ".join(bad[:3]))
    if not rows:
        raise DatasetError(f"{path}: no rows (the file is empty or holds only blank {'or bad ' if bad else ''}lines)")
    return rows


def _parse_line(raw: bytes, path: Path, line_no: int, reward: str) -> dict | None:
    """One JSONL line as a row with a string id, or None for a blank line."""
    where = f"{path}:{line_no}"
    try:
        text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not text.strip():
        return None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object with 'prompt' and 'answer', got {type(row).__name__}")
    required = ("prompt",) if "tests" in row or reward == "judge" else ("prompt", "answer")
    optional = ("answer", "rubric") if reward == "judge" else ()
    for field in required:
        if field not in row:
            raise DatasetError(f"{where}: missing field {field!r}")
    for field in (*required, *optional):
        if field in row and not isinstance(row[field], str):
            value = json.dumps(row[field])[:40]
            raise DatasetError(f"{where}: field {field!r} must be a string, got {type(row[field]).__name__} {value} "
                               "(quote it: \"...\")")
    tests = row.get("tests")
    if "tests" in row and not (isinstance(tests, list) and tests and all(
            isinstance(t, dict) and isinstance(t.get("output"), str) and isinstance(t.get("input", ""), str)
            for t in tests)):
        raise DatasetError(f"{where}: field 'tests' must be a non-empty list of "
                           '{"input": str, "output": str} objects')
    if reward == "judge" and "rubric" in row:
        try:
            check_rubric(row["rubric"], "field 'rubric'")
        except ValueError as e:
            raise DatasetError(f"{where}: {e} (or drop it to use reward.judge.rubric)") from None
    if "id" not in row:
        row["id"] = f"{path.stem}:{line_no}"
    elif isinstance(row["id"], int) and not isinstance(row["id"], bool):
        row["id"] = str(row["id"])
    elif not isinstance(row["id"], str):
        raise DatasetError(f"{where}: field 'id' must be a string or an integer, got {type(row['id']).__name__}")
    return row


class PromptSampler:
    """Row indices in a seeded permutation per epoch, drawn a batch at a time.

    Epoch ``e`` visits every index of ``range(num_rows)`` exactly once, in the order of a
    permutation seeded with ``(seed, e)``. A batch that runs past the end of an epoch continues
    into the next one, so a batch can straddle two epochs (and then may hold an index twice,
    once from each). The rollover is lazy: after the last index of epoch ``e`` is drawn,
    ``epoch == e`` and ``position == num_rows`` until the next draw.

    The state is ``(epoch, position)`` plus the seed and size it was made with;
    :meth:`state_dict` / :meth:`load_state_dict` save and restore it as plain ints.
    """

    def __init__(self, num_rows: int, seed: int = 0) -> None:
        if num_rows <= 0:
            raise ValueError(f"PromptSampler needs at least one row, got num_rows={num_rows}")
        if seed < 0:
            raise ValueError(f"PromptSampler seed must be >= 0, got {seed}")
        self.num_rows = num_rows
        self.seed = seed
        self._epoch = 0
        self._position = 0
        self._order = self._permutation(0)

    @property
    def epoch(self) -> int:
        """The epoch the last drawn index came from (0 before any draw)."""
        return self._epoch

    @property
    def position(self) -> int:
        """How many indices of the current epoch have been drawn, ``0..num_rows``."""
        return self._position

    def _permutation(self, epoch: int) -> list[int]:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows).tolist()

    def draw(self, n: int) -> list[tuple[int, int]]:
        """The next ``n`` indices as ``(epoch, index)`` pairs: a prompt's identity in the ledger."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        out: list[tuple[int, int]] = []
        while len(out) < n:
            if self._position == self.num_rows:
                self._epoch += 1
                self._position = 0
                self._order = self._permutation(self._epoch)
            take = min(n - len(out), self.num_rows - self._position)
            out.extend((self._epoch, row) for row in self._order[self._position:self._position + take])
            self._position += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"num_rows": self.num_rows, "seed": self.seed, "epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a :meth:`state_dict`; the dataset size and seed must match the saved ones."""
        for key, mine in (("num_rows", self.num_rows), ("seed", self.seed)):
            if int(state[key]) != mine:
                raise ValueError(
                    f"sampler checkpoint has {key}={state[key]} but this run has {key}={mine}: "
                    "resume with the same dataset and data.shuffle_seed, or start a fresh run"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_rows:
            raise ValueError(f"sampler checkpoint has epoch={epoch}, position={position}: expected epoch >= 0 and "
                             f"0 <= position <= {self.num_rows}")
        self._epoch, self._position = epoch, position
        self._order = self._permutation(epoch)


def fit_rows(rows: list[dict], encode, max_model_len: int, kv_tokens: int, max_new_tokens: int) -> list[dict]:
    """The rows whose prompt the engines can serve: ``encode(row)`` (its token ids) is non-empty,
    shorter than the context ``max_model_len``, and with up to ``max_new_tokens`` more fits the KV
    cache of ``kv_tokens``. The others are left out (the engine would reject their requests) and
    counted in one warning naming the first few; an error if none is left."""
    kept, dropped = [], []
    for row in rows:
        n = len(encode(row))
        if n == 0 or n >= max_model_len or min(n + max_new_tokens, max_model_len) > kv_tokens:
            dropped.append(f"{row['id']!r} ({n} tokens)")
        else:
            kept.append(row)
    if dropped:
        logger.warning("left out %d of %d prompts that are empty or do not fit the context length %d or the KV "
                       "cache of %d tokens (with rollout.max_new_tokens=%d): %s", len(dropped), len(rows),
                       max_model_len, kv_tokens, max_new_tokens, ", ".join(dropped[:5]))
    if not kept:
        raise DatasetError(f"no prompt fits the context length {max_model_len} and the KV cache of {kv_tokens} tokens "
                           f"with rollout.max_new_tokens={max_new_tokens}: shorten the prompts or raise "
                           "engine.kv_memory_mb / the model's context")
    return kept
