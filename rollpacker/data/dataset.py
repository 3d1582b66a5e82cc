"""Prompt datasets and the stateful sampler that draws them.

A dataset is a list of rows ``{"id", "prompt", ...}``: a synthetic toy task (:mod:`rollpacker.toy.task`,
the embedded default, or :mod:`rollpacker.toy.tools`: ``data.toy_task``) or a file read with Hugging
Face ``datasets``.
A prompt is a string or chat messages; the other columns are kept for the reward functions.
:class:`PromptSampler` hands out row indices in a seeded permutation per epoch.

Invariants:

- Loading is strict: a bad row raises one :class:`DatasetError` naming the file, the row and what
  is wrong, unless ``data.skip_bad_lines``. The reward functions' checks run here too
  (:meth:`~rollpacker.reward.scheduler.RewardScheduler.check_row`).
- A row's id is stable for a given file and split: its ``data.id_key`` column, else ``"<file stem>:<n>"``
  (``"<file stem>:<split>:<n>"`` for a split joined after the first one: ``test`` of ``train+test``).
- The sampler's whole state is a few ints, so a resumed run draws exactly the same prompts.

Why: a bad row is cheapest to fix before the run starts, and nothing is dropped silently.
The formats, columns and ids: ``docs/your-task.md`` (Data).
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import logging
import re
import tempfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rollpacker.choices import check_choices
from rollpacker.errors import UserError

logger = logging.getLogger(__name__)

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
"""File suffix -> the ``datasets`` builder that reads it."""
ROLES = ("system", "developer", "user", "assistant", "tool")
"""A message's roles: OpenAI's (developer: gpt-oss's template takes its instructions so), as TRL passes them."""


@dataclass(kw_only=True)
class DataConfig:
    path: tuple[str, ...] = ()
    """Training prompts: JSONL, JSON, parquet or arrow files, saved datasets or Hub ids (NAME:CONFIG picks a
    config), one or more (verl's train_files; a row of several without data_source gets its file's name); empty =
    the toy task."""
    split: str = "train"
    """Split of path to read (a local file has one, train; slices work: train[:90%])."""
    prompt_key: str = "prompt"
    """Column of the prompt: a string, or a list of chat messages ({"role", "content"})."""
    answer_key: str = "answer"
    """Column of the reference answer ("a.b" reads key b of dict column a); "answer" absent: verl's
    reward_model.ground_truth."""
    id_key: str = "id"
    """Column of each row's unique id (a string or an integer); empty, or a row without it: the row is numbered
    (file_stem:n). A dataset whose id column repeats (several rows of one problem) sets it empty."""
    system_prompt: str = ""
    """A system turn put before each prompt that has none (string prompts need model.chat_template)."""
    num_toy_prompts: int = 2048
    """Number of toy problems to generate (only used when path is empty)."""
    toy_task: Literal["arithmetic", "tools"] = "arithmetic"
    """The generated task when path is empty: arithmetic (worked sums) or tools (problems a calculator tool decides)."""
    toy_seed: int = 0
    """Seed of the toy problem generator."""
    toy_tail_alpha: float = 1.6
    """Pareto exponent of the toy problems' term count (their length tail): larger is thinner; the task's own: 1.3."""
    shuffle: bool = True
    """Shuffle the prompts each epoch; off, every epoch goes in the dataset's order (a curriculum sorted by hand)."""
    shuffle_seed: int = 0
    """Seed of the per-epoch prompt order; epoch e is shuffled with (shuffle_seed, e)."""
    max_prompt_length: int = 0
    """Leave out prompts longer than this many tokens, counted in one warning (verl's filter_overlong_prompts);
    0 = only those the context and the KV cache cannot serve."""
    eval_path: tuple[str, ...] = ()
    """Held-out prompts for evaluation, one or more sets in any format path takes (verl's val_files; eval metrics per
    data_source, which a row of several sets lacking one takes from its file's name); empty = held-out toy problems
    (toy data only)."""
    eval_split: str = ""
    """Split of eval_path (empty: its one split, a local file's; a dataset of several, as a Hub id's, names its
    held-out one: test); without eval_path, of path (a held-out slice: train[90%:])."""
    num_eval_prompts: int = 256
    """Held-out prompts per evaluation (the first this many of each eval set)."""
    eval_trained_rows: bool = False
    """Evaluate rows training reads too, on purpose (the training set's accuracy, or a few prompts overfit as a
    first check); off: an eval set sharing rows with training is refused."""
    skip_bad_lines: bool = False
    """Skip rows (and JSON lines) that are not valid, logging how many and where, instead of stopping at the first."""
    retire_solved: float = 0.0
    """Leave a prompt out of later epochs once this share of a group of it solved it (as reward/accuracy counts:
    reward.correct; 1.0: every response; POLARIS' and Skywork-OR1's filtering of solved prompts); 0 = off."""

    def __post_init__(self) -> None:
        check_choices(self, "data")
        for name in ("path", "eval_path"):  # a single source given in code, as a string
            value = getattr(self, name)
            if isinstance(value, (str, Path)):
                setattr(self, name, (str(value),) if value else ())
        if self.num_eval_prompts <= 0:
            raise ValueError(f"data.num_eval_prompts must be positive, got {self.num_eval_prompts}")
        if self.toy_tail_alpha <= 0:
            raise ValueError(f"data.toy_tail_alpha must be positive, got {self.toy_tail_alpha}")
        if self.num_toy_prompts <= 0:
            raise ValueError(f"data.num_toy_prompts must be positive, got {self.num_toy_prompts}")
        if self.shuffle_seed < 0:
            raise ValueError(f"data.shuffle_seed must be >= 0, got {self.shuffle_seed}")
        if self.max_prompt_length < 0:
            raise ValueError(f"data.max_prompt_length must be >= 0 (0 = no limit), got {self.max_prompt_length}")
        if not 0 <= self.retire_solved <= 1:
            raise ValueError(f"data.retire_solved must be in [0, 1] (a share of a group's responses), got "
                             f"{self.retire_solved}")
        for name in ("split", "prompt_key", "answer_key"):
            if not getattr(self, name):
                raise ValueError(f"data.{name} must not be empty")


class DatasetError(UserError, ValueError):
    """A dataset that cannot be used as it is; the message names the file, the row and the fix."""


RowCheck = Callable[[dict], None]
"""A caller's check of a loaded row: raises ValueError saying what is wrong with it."""


def load_rows(config: DataConfig, check: RowCheck | None = None) -> list[dict]:
    """The rows of ``config``'s dataset: the generated toy task, or the data at ``config.path``."""
    if not config.path:
        return toy_rows(config, config.num_toy_prompts, config.toy_seed)
    return read_sources(config.path, config, check=check)


TOY_TASKS = {"arithmetic": "rollpacker.toy.task", "tools": "rollpacker.toy.tools"}
"""``data.toy_task`` -> the module whose ``rows(config, num, seed, keep)`` generates it (imported when used)."""
TOY_HELD_OUT = 8
"""One toy problem in this many (by a hash of its prompt) is held out: only evaluation draws it. A small task's
problems repeat (there are 124 two-term sums), so held-out problems of the training mix must come from a part
of the problem space training never sees. (The shipped toy models' SFT drew both parts: docs/results.md,
"The toy model".)"""


def toy_held_out(problem: dict) -> bool:
    """Whether a toy problem is in the held-out part of its task's problem space."""
    return zlib.crc32(str(problem["prompt"]).encode()) % TOY_HELD_OUT == 0


def toy_rows(config: DataConfig, num: int, seed: int, *, held_out: bool = False) -> list[dict]:
    """The first ``num`` problems of ``config.toy_task`` drawn with ``seed`` from the held-out part of the
    problem space (``held_out``) or from the training part."""
    task = importlib.import_module(TOY_TASKS[config.toy_task])
    return task.rows(config, num, seed, keep=lambda problem: toy_held_out(problem) == held_out)


def eval_field(config: DataConfig) -> str:
    """Where the held-out rows come from, for messages: ``data.eval_path``, a slice of ``data.path``, or toy rows."""
    return ("data.eval_path" if config.eval_path else "data.path (read with data.eval_split)" if config.path
            else "the toy eval rows")


def load_eval_rows(config: DataConfig, check: RowCheck | None = None) -> list[dict]:
    """Held-out rows: the first ``num_eval_prompts`` of each set of ``eval_path`` (of ``path`` when only
    ``eval_split`` is given: a slice training leaves out), or toy problems of the
    training mix from the part of the problem space training never draws, with a seed training never uses."""
    sources = config.eval_path or (config.path if config.eval_split else ())  # a held-out slice of path's file
    if sources:
        return read_sources(sources, config, split=config.eval_split, check=check, field=eval_field(config),
                            first=config.num_eval_prompts)
    if config.path:
        raise DatasetError("evaluation on real data needs data.eval_path (held-out prompts in any format data.path "
                           "takes), or eval_every=0")
    return toy_rows(config, config.num_eval_prompts, 1_000_003 + config.toy_seed, held_out=True)


def check_held_out(config: DataConfig, rows: list[dict], eval_rows: list[dict] | None) -> None:
    """The held-out rows (a slice of ``path``, or ``eval_path``: a training file named again too) must be rows
    training does not read: raise DatasetError naming how many it shares and the fix. A row is known by its prompt
    and answer, not its id: one file's ids differ as it is read (named beside another file of its name, or as the
    second split of ``train+test``), and another split's rows may be numbered alike."""
    if not eval_rows or config.eval_trained_rows:
        return
    trained = set(map(_content, rows))
    shared = [row["id"] for row in eval_rows if _content(row) in trained]
    if shared:
        split = f"data.eval_split {config.eval_split!r}" if config.eval_split else ""
        where = (f"data.eval_path {' '.join(config.eval_path)}" + (f" ({split})" if split else "")
                 if config.eval_path else f"{split} of data.path")
        raise DatasetError(f"{where} holds {len(shared)} of the rows training reads too (data.split "
                           f"{config.split!r}), {shared[0]!r} first, so its evaluation would not be held out: set "
                           f"data.split to the rest (e.g. train[:90%] beside train[90%:]), data.eval_path to a "
                           "held-out file, or data.eval_trained_rows to evaluate them on purpose")


def _content(row: dict) -> str:
    answer = row.get("answer")  # a code or judge row has none
    if isinstance(answer, float) and answer.is_integer():  # Arrow reads a column of 1 and 2.5 as floats
        answer = int(answer)
    return json.dumps([row["prompt"], answer], sort_keys=True, default=str)


def read_sources(sources: tuple[str, ...], config: DataConfig, *, split: str | None = None,
                 check: RowCheck | None = None, field: str = "data.path", first: int | None = None) -> list[dict]:
    """The rows of each source in turn (the ``first`` of each): :func:`read_rows`. Of several, a row without a
    ``data_source`` takes its file's name (verl's datasets name theirs), and ids must be unique across them.
    Their names: :func:`_names`. Every row has every file's columns, None where
    its file lacks one (as one file's rows are): a reward function naming a column gets None, not a TypeError."""
    rows, where_of = [], {}
    _refuse_repeats(sources, field)
    for source, name in zip(sources, _names(sources)):
        every = read_rows(source, config, split=split, check=check, field=field, name=name)
        if first is not None and len(every) > first:
            logger.info("%s: %s: evaluating its first %d of %d rows (data.num_eval_prompts)", field, source, first,
                        len(every))
        for row in every[:first]:
            if row["id"] in where_of:
                raise DatasetError(f"{field}: {source} and {where_of[row['id']]} both have a row with id {row['id']!r};"
                                   " ids must be unique across the files (give each its own ids, or leave them out)")
            where_of[row["id"]] = source
            if len(sources) > 1 and row.get("data_source") is None:
                row["data_source"] = name
            rows.append(row)
    columns = dict.fromkeys(key for row in rows for key in row)
    if field == "data.path" and config.answer_key != "answer" and all(row["answer"] is None for row in rows):
        # a typo: every reward 0 (an eval set of other tasks may have no answers)
        ours = {"id", "answer", "prompt"} - {config.prompt_key}  # what make_row adds
        raise DatasetError(f"{field}: data.answer_key {config.answer_key!r} names a column no row of "
                           f"{', '.join(sources)} has (its columns: {', '.join(k for k in columns if k not in ours)})"
                           ": name one of those")
    return [{**columns, **row} for row in rows]  # splits joined (train+test) may differ in columns too


def _refuse_repeats(sources: tuple[str, ...], field: str) -> None:
    """Refuse a file named twice (``a.jsonl ./a.jsonl``): its rows would be read, and trained on, twice."""
    seen: dict[object, str] = {}
    for source in sources:
        path = Path(source).expanduser()
        key = path.resolve() if path.exists() else source
        if key in seen:
            raise DatasetError(f"{field} names {source} twice (as {seen[key]} and {source}): list each file once")
        seen[key] = source


def _names(sources: tuple[str, ...]) -> list[str]:
    """Each source's name: its stem (:func:`_stem`); files of one stem (verl's ``gsm8k/train.parquet`` and
    ``math/train.parquet``) with their folder, and then, in one folder, with their suffix (``math.parquet``,
    ``math.jsonl``); Hub datasets of one name as given (``openai/gsm8k:main``), and so files still named alike
    (``a/data/train.jsonl`` and ``b/data/train.jsonl``)."""
    paths = [Path(source).expanduser() for source in sources]
    names = [_stem(path) for path in paths]
    names = [n if names.count(n) == 1 else s if _is_hub(p) else f"{p.resolve().parent.name}/{n}"
             for s, p, n in zip(sources, paths, names)]
    names = [n if names.count(n) == 1 else f"{n}{p.suffix}" for p, n in zip(paths, names)]
    return [n if names.count(n) == 1 else s for s, n in zip(sources, names)]


def read_rows(source: str | Path, config: DataConfig | None = None, *, split: str | None = None,
              check: RowCheck | None = None, field: str = "data.path", name: str | None = None) -> list[dict]:
    """Rows of a dataset file, saved dataset or Hub id, each checked (:func:`make_row`, then ``check``); a row
    without an id is ``NAME:N`` (``name``, else the file's; N its line or row), or ``NAME:SPLIT:N`` if ``split``
    joins it from a split other than its first (``train+test``).

    A bad row raises :class:`DatasetError` naming the file and row, or, with ``skip_bad_lines``,
    is left out and counted in one warning. Ids must be unique.
    """
    config = config or DataConfig(path=str(source))
    path = Path(source).expanduser()  # verl's configs say ~/data/...
    split = config.split if split is None else split
    numbered, by_line, skipped = _read(path, split, config.skip_bad_lines, field)
    rows: list[dict] = []
    where_of: dict[str, str] = {}
    numbered_ids: set[str] = set()  # the ids that are a row's number, not its id_key's
    bad: list[str] = []
    for part, n, record in numbered:
        where = f"{path}:{n}" if by_line else f"{path}: {f'split {part} ' if part else ''}row {n}"
        number = f"{name or _stem(path)}:{f'{part}:' if part else ''}{n}"
        try:
            row = make_row(record, number, config)
            if check:
                check(row)
        except ValueError as e:
            why = f"{where}: {e}"
            if "'answer'" in why and isinstance(record, dict) and _lookup(record, config.answer_key) is None:
                columns = ", ".join(str(k) for k, v in record.items() if v is not None)[:200]
                why += (f" (data.answer_key reads column {config.answer_key!r}, which this row lacks; its columns: "
                        f"{columns}: set data.answer_key to the one holding the answer)")
            if not config.skip_bad_lines:
                raise DatasetError(f"{why} (fix the row, or set data.skip_bad_lines to skip bad rows)") from None
            bad.append(why)
            continue
        if row["id"] == number and number in numbered_ids:  # the same row read again
            flag = "data.eval_split" if "eval" in field else "data.split"
            raise DatasetError(f"{where}: read twice ({flag} {split!r} names it in two parts that "
                               f"repeat or overlap): set {flag} to parts apart, such as train[:60%]+train[60%:]")
        if row["id"] in where_of:  # the data's layout, not a bad row: skipping rows would lose them
            raise DatasetError(f"{where}: duplicate id {row['id']!r} (first at {where_of[row['id']]}) in column "
                               f"{config.id_key!r} (data.id_key), whose ids must be unique: set data.id_key to a "
                               "column of unique ids, or to '' to number the rows")
        where_of[row["id"]] = where
        if row["id"] == number:
            numbered_ids.add(number)
        rows.append(row)
    bad = skipped + bad
    if bad:
        logger.warning("%s: skipped %d bad row(s), kept %d (data.skip_bad_lines); first: %s",
                       path, len(bad), len(rows), "; ".join(bad[:3]))
    if not rows:
        raise DatasetError(f"{path}: no rows (the data is empty or holds only blank {'or bad ' if bad else ''}rows)")
    return rows


def _read(path: Path, split: str, skip_bad: bool, field: str) -> tuple[list[tuple[str, int, dict]], bool, list[str]]:
    """The records of ``split`` of ``path`` as ``datasets`` reads them, each with its number (:func:`_sliced`),
    whether the numbers are lines (JSON lines), and (``skip_bad``) the lines left out because they are not
    JSON objects."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a file it cannot read is said once, below
    if path.is_dir():
        try:
            data = datasets.load_from_disk(str(path))
        except FileNotFoundError:  # not save_to_disk's: a dataset repository's files (a Hub snapshot)?
            return _sliced(_hub(path, field), None, split, path, field), False, []
        except ValueError as e:
            raise DatasetError(f"{field}: {path} is a directory but not a dataset saved with save_to_disk "
                               f"({e})") from None
        except Exception as e:  # noqa: BLE001  (an empty one: save_to_disk wrote no shard, load_from_disk's IndexError)
            raise DatasetError(f"{field}: {path}: load_from_disk cannot read it ({type(e).__name__}: {e}); a dataset "
                               "of no rows is saved without data: give one with rows") from None
        splits = dict(data) if isinstance(data, datasets.DatasetDict) else {"train": data}
        return _sliced(splits, None, split, path, field), False, []
    kind = FORMATS.get(path.suffix.lower())
    if _is_hub(path):
        return _sliced(_hub(path, field), None, split, path, field), False, []
    if not path.exists():
        raise DatasetError(f"{field}: no such file or directory: {path} (give a dataset file or directory, a Hub id "
                           "as OWNER/NAME, or leave data.path empty for the toy task)")
    if kind is None:
        raise DatasetError(f"{field}: {path} is not a dataset file: give a .jsonl, .json, .parquet or .arrow file "
                           "(or a directory written by save_to_disk, or a Hub id)")
    lines = _record_lines(path) if path.suffix.lower() == ".jsonl" else None
    null_first = kind == "json" and _null_first(path)  # pyarrow's JSON reader dies of it (SIGSEGV): never given one
    if null_first and lines is None:
        raise DatasetError(f"{field}: {path} begins with null: give a JSON array of objects, or one object a line")
    if not null_first:  # a JSON lines file that begins with null: its lines are read below
        try:
            records = _load(path, kind, field)
            if lines is None or len(records) == len(lines):
                return _sliced({"train": records}, lines, split, path, field), lines is not None, []
        except DatasetError:
            if lines is None:
                raise
    bad = _bad_lines(path)  # why datasets could not read it (or read other than one record a line), by line
    if bad and not skip_bad:
        n, why = bad[0]
        raise DatasetError(f"{path}:{n}: {why} (fix the line, or set data.skip_bad_lines to skip bad rows)")
    skipped = {n for n, _ in bad}  # a set once: per line, a dict of the bad ones was O(lines x bad)
    lines = [n for n in lines if n not in skipped]
    if not lines:
        first = f": line {bad[0][0]}: {bad[0][1]}" if bad else ""
        raise DatasetError(f"{path}: no rows (the data is empty or holds only blank or bad rows{first})")
    keep = set(lines)
    with tempfile.TemporaryDirectory() as tmp, path.open("rb") as f:
        good = Path(tmp) / path.name  # its good lines without blank ones (which datasets reads only sometimes)
        good.write_bytes(b"".join(raw for n, raw in enumerate(f, start=1) if n in keep))
        records = _load(good, kind, field, shown=path)
    by_line = len(records) == len(lines)  # else datasets read a line as several records: number them as rows
    return (_sliced({"train": records}, lines if by_line else None, split, path, field), by_line,
            [f"{path}:{n}: {why}" for n, why in bad])


def _sliced(splits: dict[str, Sequence], lines: list[int] | None, split: str, path: Path,
            field: str) -> list[tuple[str, int, dict]]:
    """The records ``split`` names, in ``datasets``' syntax (``train``, ``train[:90%]``, ``train[10:]+test``),
    each as ``(part, number, record)``: its number is its line (``lines``: those of the one split's records),
    else its row in its split, from 1; ``part`` is its split's name if that is not the first split named
    (``test`` of ``train+test``; numbers restart there), else empty. A slice keeps the numbers its records
    have in the whole: ``train[5:]`` starts at 6. An empty ``split`` is the one split there is (an eval set's
    without ``data.eval_split``: never ``data.split``, a slice of the training file)."""
    import datasets

    if not split and len(splits) > 1:
        raise DatasetError(f"{field}: {path} has the splits {', '.join(splits)}: name the held-out one with "
                           "data.eval_split (e.g. test)")
    split = split or next(iter(splits))
    try:
        parts = datasets.ReadInstruction.from_spec(split).to_absolute({k: len(v) for k, v in splits.items()})
    except (ValueError, AssertionError) as e:
        flag = "data.eval_split" if "eval" in field else "data.split"
        raise DatasetError(f"{field}: {path} has no split {split!r} ({e}); it has {', '.join(splits)} (set {flag}: "
                           "a split, or a slice such as train[:90%])") from None
    records = {p.splitname: _records(splits[p.splitname]) for p in parts}
    first = parts[0].splitname if parts else ""
    return [("" if p.splitname == first else p.splitname, lines[i] if lines else i + 1, records[p.splitname][i])
            for p in parts for i in range(p.from_, p.to)]


def _load(path: Path, kind: str, field: str, shown: Path | None = None) -> list[dict]:
    """The records of the file at ``path`` (``shown`` in messages: the user's file of a cleaned copy)."""
    import datasets

    shown = shown or path
    if not path.stat().st_size:
        raise DatasetError(f"{shown}: no rows (the data is empty)")
    try:
        return _records(datasets.load_dataset(kind, data_files=str(path), split="train"))
    except Exception as e:  # noqa: BLE001  (datasets wraps pyarrow's errors in its own)
        cause = e.__cause__ or e
        if "corresponds to no data" in str(cause) or "BatchSize must be greater than 0" in str(cause):  # json, parquet
            raise DatasetError(f"{shown}: no rows (the data is empty)") from None  # as datasets 4 says it
        raise DatasetError(f"{field}: {shown} cannot be read as {kind}: {type(cause).__name__}: {cause}") from None


def _records(data: Sequence) -> list[dict]:
    """A split's rows as dicts: a ``datasets.Dataset``'s through Arrow's ``to_list`` (200k rows of chat messages:
    2.9 s, against 10.5 s row by row), unless a feature decodes (an image: its row gives the decoded one)."""
    from datasets.features.features import require_decoding

    features = getattr(data, "features", None)
    if features is None or any(require_decoding(f) for f in features.values()):
        return list(data)
    return data.to_list()


def _is_hub(path: Path) -> bool:
    """``path`` names a Hub dataset, ``NAME`` or ``NAME:CONFIG`` (or ``DIR:CONFIG``, a dataset repository's files):
    nothing local has that name, it does not end as a dataset file does (a missing ``train.jsonl`` is a missing
    file), and it is no path to a missing directory (absolute, from ``~`` or ``..``, or deeper than OWNER/NAME;
    a missing ``OWNER/NAME`` is the Hub's)."""
    name = str(path).partition(":")[0]
    local = Path(name).is_absolute() or name.startswith(("~", "..")) or name.count("/") > 1
    return not path.exists() and path.suffix.lower() not in FORMATS and (not local or Path(name).is_dir())


def _stem(path: Path) -> str:
    """A source's name in its rows' ids: a local file's stem (``train`` of ``train.jsonl``); a Hub dataset's
    name without its owner and config (``gsm8k`` of ``openai/gsm8k:main``, ``s1K-1.1`` of ``simplescaling/s1K-1.1``)."""
    return path.name.partition(":")[0] if _is_hub(path) else path.stem


def _hub(path: Path, field: str) -> dict:
    """The splits ``datasets.load_dataset`` reads for ``path``: a Hub dataset (needs network, or the datasets
    cache), or a dataset repository's files in a directory (a Hub snapshot); ``NAME:CONFIG`` picks a config."""
    import datasets

    name, _, config = str(path).partition(":")
    if path.is_dir():
        name, config, what = str(path), "", (f"{path} is a directory that neither load_from_disk (a dataset saved "
                                             "with save_to_disk) nor datasets.load_dataset reads")
    else:
        what = f"{name} is neither a local file nor a dataset on the Hugging Face Hub that can be reached"
    try:
        return dict(datasets.load_dataset(name, config or None))
    except Exception as e:  # noqa: BLE001  (no network, no such dataset, no such config: all said by datasets)
        hint = "" if config else "; a dataset of several configs is named NAME:CONFIG, as openai/gsm8k:main"
        raise DatasetError(f"{field}: {what} ({type(e).__name__}: {str(e)[:300]}){hint}") from None


def _record_lines(path: Path) -> list[int]:
    """The line numbers of a JSON lines file's records: its lines that are not blank."""
    with path.open("rb") as f:
        return [n for n, raw in enumerate(f, start=1) if raw.strip()]


def _null_first(path: Path) -> bool:
    """Whether a JSON file's first value is null (pyarrow 26's JSON reader dies of it: SIGSEGV)."""
    with path.open("rb") as f:
        return f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"null")


def _bad_lines(path: Path) -> list[tuple[int, str]]:
    """``(line, why)`` for each line of a JSON lines file that is not a JSON object in UTF-8."""
    bad = []
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                value = json.loads(raw.decode("utf-8-sig" if n == 1 else "utf-8").rstrip("\r\n"))
            except UnicodeDecodeError as e:
                bad.append((n, f"not valid UTF-8 ({e.reason} at byte {e.start})"))
            except json.JSONDecodeError as e:
                bad.append((n, f"invalid JSON ({e.msg} at column {e.colno})"))
            else:
                if not isinstance(value, dict):
                    bad.append((n, f"expected a JSON object, got {type(value).__name__}"))
    return bad


def make_row(record: dict, default_id: str, config: DataConfig) -> dict:
    """A record as a row: every column kept, ``prompt`` from ``prompt_key`` (a string or chat messages),
    ``answer`` from ``answer_key`` (any value: the built-in functions check theirs), ``id`` from ``id_key``, a
    string (``default_id`` without one). With
    the default ``answer_key`` a row without ``answer`` takes verl's ``reward_model.ground_truth``; with
    another, ``answer`` is only that column's (None when the row lacks it: never the row's own ``answer`` column).
    Raises ValueError saying what is wrong."""
    row = dict(record)
    if row.get(config.prompt_key) is None:  # datasets fills a column a record lacks with None
        raise ValueError(f"missing field {config.prompt_key!r} (the prompt; data.prompt_key names its column, one "
                         f"of this row's: {', '.join(k for k, v in row.items() if v is not None)})")
    row["prompt"] = check_prompt(row[config.prompt_key], config.prompt_key)
    key = config.answer_key
    answer = _lookup(row, key)
    if answer is None and key == "answer":
        key, answer = "reward_model.ground_truth", _lookup(row, "reward_model.ground_truth")
    elif answer is None:  # another answer_key: never the row's own answer column (a reward check says it is missing)
        row["answer"] = None
    if answer is not None:
        row["answer"] = answer  # as the file has it (TRL and verl pass it so); the built-ins check theirs
    value = _lookup(row, config.id_key) if config.id_key else None
    if value is None:
        row["id"] = default_id
    elif isinstance(value, int) and not isinstance(value, bool):
        row["id"] = str(value)
    elif isinstance(value, str):
        row["id"] = value
    else:
        raise ValueError(f"field {config.id_key!r} (the row's id: data.id_key) must be a string or an integer, got "
                         f"{type(value).__name__} {value!r}; set data.id_key to a column of unique ids, or to '' to "
                         "number the rows")
    return row


def _lookup(row: dict, key: str):
    """``row[key]``, where ``a.b`` reads key ``b`` of the dict in column ``a``; None when absent."""
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            return None
        value = value[part]
    return value


def check_prompt(prompt, name: str = "prompt"):
    """``prompt`` if it is a string with more than whitespace, or a non-empty list of chat messages
    with a known role each; else a ValueError saying what is wrong.

    A message keeps every key (``tool_calls``, ``name``, ``tool_call_id``: the template gets them as
    TRL and verl pass them) but those that are None, which Arrow writes for a key other messages of
    the column have, at any depth of its tool calls too (Arrow gives an ``add`` call's arguments the
    ``code: null`` of a ``python`` call in another row, which the template would render; a null
    argument cannot be told from those, and goes too). Its ``content`` is a string, or None (kept)
    when it has ``tool_calls``. A message's content may be empty: an environment's reset can write the
    whole prompt (docs/environments.md)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"field {name!r} is {'empty' if not prompt else 'only whitespace'}: give the question "
                             "(a row whose environment's reset writes the whole prompt takes "
                             '[{"role": "user", "content": ""}])')
        return prompt
    if not isinstance(prompt, list) or not prompt:
        value = json.dumps(prompt, default=str)[:40]
        raise ValueError(f"field {name!r} must be a string or a list of chat messages ({{\"role\", \"content\"}}), "
                         f"got {type(prompt).__name__} {value}")
    turns = []
    for i, message in enumerate(prompt):
        content = message.get("content") if isinstance(message, dict) else None
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and (isinstance(content, str) or content is None and message.get("tool_calls"))):
            raise ValueError(f"field {name!r}: message {i} is not a {{\"role\": str, \"content\": str}} object "
                             f"(content may be null with tool_calls): {json.dumps(message, default=str)[:80]}")
        if message["role"] not in ROLES:
            raise ValueError(f"field {name!r}: message {i} has role {message['role']!r}; expected one of "
                             f"{', '.join(ROLES)}")
        turn = {k: _without_nulls(v) if k == "tool_calls" else v for k, v in message.items() if v is not None}
        turn.setdefault("content", None)  # OpenAI's tool-call turn: content null
        turns.append(turn)
    return turns


def _without_nulls(value):
    """``value`` without the None values of its dicts, at any depth."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


class PromptSampler:
    """Row indices in a seeded permutation per epoch, drawn a batch at a time.

    Epoch ``e`` visits every index of ``range(num_rows)`` exactly once, in the order of a
    permutation seeded with ``(seed, e)`` (in row order without ``shuffle``). A batch that runs past
    the end of an epoch continues into the next one, so a batch can straddle two epochs (and then
    may hold an index twice, once from each). The rollover is lazy: after the last index of epoch
    ``e`` is drawn, ``epoch == e`` and ``position == sizes[e]`` until the next draw.

    With ``retire_solved`` (``data.retire_solved``), a row whose group :meth:`observe` saw solved by
    that share of its responses is left out of every epoch after the current one: the epoch's order
    is its permutation without the rows retired when it began, so epochs shrink (``sizes``).

    The state is ``(epoch, position)``, the retired rows and the epochs' sizes, plus the seed and size
    it was made with and ``digest`` (:func:`rows_digest`, the rows it orders); :meth:`state_dict` /
    :meth:`load_state_dict` save and restore it as plain data.
    """

    def __init__(self, num_rows: int, seed: int = 0, retire_solved: float = 0.0, shuffle: bool = True,
                 digest: str = "") -> None:
        if num_rows <= 0:
            raise ValueError(f"PromptSampler needs at least one row, got num_rows={num_rows}")
        if seed < 0:
            raise ValueError(f"PromptSampler seed must be >= 0, got {seed}")
        self.num_rows = num_rows
        self.seed = seed
        self.shuffle = shuffle
        """Off: every epoch in row order."""
        self.digest = digest
        """The rows' :func:`rows_digest` ("" unknown): a resume on other rows of the same count says so."""
        self.retire_solved = retire_solved
        self.retired: set[int] = set()
        """Rows out of the current epoch's order and every later one's."""
        self.retiring: set[int] = set()
        """Rows solved since the current epoch began: out from the next one."""
        self.sizes = [num_rows]
        """Rows of each epoch so far."""
        self._epoch = 0
        self._position = 0
        self._order = self._permutation(0)

    def __deepcopy__(self, memo: dict) -> PromptSampler:
        """A copy that draws on alone, sharing the epoch's order (replaced at a rollover, never changed):
        ``env.warm`` plans each next round on a copy of the policy, so copying costs no pass over the rows."""
        new = memo[id(self)] = copy.copy(self)
        new.retired, new.retiring, new.sizes = set(self.retired), set(self.retiring), list(self.sizes)
        return new

    @property
    def epoch(self) -> int:
        """The epoch the last drawn index came from (0 before any draw)."""
        return self._epoch

    @property
    def position(self) -> int:
        """How many indices of the current epoch have been drawn, ``0..sizes[epoch]``."""
        return self._position

    @classmethod
    def for_data(cls, rows: list[dict], data: DataConfig) -> PromptSampler:
        """The sampler of ``rows`` as ``data`` (``data.*``) orders and retires them."""
        return cls(len(rows), data.shuffle_seed, data.retire_solved, data.shuffle, rows_digest(rows))

    @property
    def num_retired(self) -> int:
        """Rows retired, from the current epoch on or from the next."""
        return len(self.retired | self.retiring)

    @property
    def epochs_drawn(self) -> float:
        """Passes over the data drawn so far, fractional."""
        return self._epoch + self._position / max(1, len(self._order))

    def _permutation(self, epoch: int) -> list[int]:
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows).tolist() if self.shuffle else (
            range(self.num_rows))
        return [row for row in order if row not in self.retired]

    def remaining(self, num_epochs: int) -> int | None:
        """Rows left to draw within ``num_epochs`` epochs, as the rows retired so far leave them; None when
        unlimited (0) while any row is left."""
        live = self.num_rows - self.num_retired
        now = len(self._order) - self._position
        if not num_epochs:
            return None if live else now
        return 0 if self._epoch >= num_epochs else now + (num_epochs - self._epoch - 1) * live

    def observe(self, row: int, solved: list[bool]) -> bool:
        """A group of ``row`` was scored, ``solved`` saying which responses are correct (as ``reward/accuracy``
        counts them): with ``retire_solved``, retire the row from the next epoch on when that share of them solved
        it. True if it was."""
        if not self.retire_solved or not solved or row in self.retired:
            return False
        # the share as a decimal: 0.28 of 25 is 7 (the float product, 7.000000000000001, would ask for 8)
        if sum(solved) >= round(self.retire_solved * len(solved), 9):
            self.retiring.add(row)
        return row in self.retiring

    def draw(self, n: int) -> list[tuple[int, int]]:
        """The next ``n`` indices as ``(epoch, index)`` pairs: a prompt's identity in the ledger."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        out: list[tuple[int, int]] = []
        while len(out) < n:
            if self._position == len(self._order):
                if self.num_retired == self.num_rows:
                    raise ValueError("sampler: every row is retired: draw at most remaining(num_epochs) rows")
                self._epoch += 1
                self._position = 0
                self.retired |= self.retiring
                self.retiring = set()
                self._order = self._permutation(self._epoch)
                self.sizes.append(len(self._order))
            take = min(n - len(out), len(self._order) - self._position)
            out.extend((self._epoch, row) for row in self._order[self._position:self._position + take])
            self._position += take
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"num_rows": self.num_rows, "seed": self.seed, "shuffle": self.shuffle, "epoch": self._epoch,
                "position": self._position, "retired": sorted(self.retired), "retiring": sorted(self.retiring),
                "sizes": list(self.sizes), "digest": self.digest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the dataset size, seed and shuffling must match the saved ones. Other
        rows of the same count (another ``digest``) are said once: the position and retired rows go on by index."""
        saved = {"num_rows": int(state["num_rows"]), "seed": int(state["seed"]),
                 "shuffle": bool(state.get("shuffle", True))}  # a checkpoint from before data.shuffle: shuffled
        for key, mine in (("num_rows", self.num_rows), ("seed", self.seed), ("shuffle", self.shuffle)):
            if saved[key] != mine:
                raise ValueError(
                    f"sampler checkpoint has {key}={saved[key]} but this run has {key}={mine}: "
                    "resume with the same dataset, data.shuffle and data.shuffle_seed, or start a fresh run"
                    + (" (the rows that fit count: data.max_prompt_length, rollout.max_new_tokens and the "
                       "context length as they were)" if key == "num_rows" else "")
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        self.retired, self.retiring = set(state.get("retired", ())), set(state.get("retiring", ()))
        self.sizes = list(state.get("sizes", [self.num_rows] * (epoch + 1)))  # saved before retirement: all whole
        if epoch < 0 or len(self.sizes) != epoch + 1 or not 0 <= position <= self.sizes[-1]:
            raise ValueError(f"sampler checkpoint has epoch={epoch}, position={position}, sizes={self.sizes}: expected "
                             f"epoch >= 0, one size per epoch and 0 <= position <= the last")
        self._epoch, self._position = epoch, position
        self._order = self._permutation(epoch)
        if state.get("digest") and self.digest and state["digest"] != self.digest:  # "": saved before digests
            logger.warning("resume: the data's rows differ from the checkpoint's (%d rows, as there, but other ids "
                           "or prompts): its position (epoch %d, %d rows drawn) and retired rows go on by row "
                           "index over these rows; resume on the checkpoint's data for the same order",
                           self.num_rows, epoch, position)


def rows_digest(rows: Sequence[dict]) -> str:
    """A digest of the rows' ids and prompts, in order: a resume on another file of as many rows tells by it;
    "" (unknown) for prompts JSON cannot order (dict keys of mixed types)."""
    digest = hashlib.sha256()
    try:
        for row in rows:
            digest.update(json.dumps([row["id"], row["prompt"]], sort_keys=True, default=lasting_text).encode())
    except TypeError:
        return ""
    return digest.hexdigest()[:16]


def lasting_text(value: Any) -> str:
    """A value JSON does not hold, as text that another process writes alike (no ``at 0x...`` address)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", str(value))


def fit_rows(rows: list[dict], encode, max_model_len: int, kv_tokens: int, max_new_tokens: int,
             max_prompt_length: int = 0, skip_bad: bool = False, field: str = "data.path",
             kv_setting: str = "engine.kv_memory_mb") -> list[dict]:
    """The rows whose prompt the engines can serve: ``encode(row)`` (its token ids) is non-empty,
    shorter than the context ``max_model_len``, and with up to ``max_new_tokens`` more fits the KV
    cache of ``kv_tokens``; and at most ``max_prompt_length`` tokens long (``data.max_prompt_length``,
    0 = any). The others are left out (the engine would reject their requests) and counted in one
    warning naming the first few; an error if none is left. A row the chat template refuses
    (:class:`~rollpacker.data.chat.TemplateRefused`) raises :class:`DatasetError` naming it, or, with
    ``skip_bad`` (``data.skip_bad_lines``), is left out and counted in one warning. ``field``: the rows' setting,
    ``kv_setting``: the one that sizes the KV cache, for the messages."""
    from rollpacker.data.chat import TemplateRefused

    kept, dropped, refused = [], [], []
    for row in rows:
        try:
            n = len(encode(row))
        except TemplateRefused as e:
            if not skip_bad:
                raise DatasetError(f"row {row['id']!r}: {e} (or set data.skip_bad_lines to skip such rows)") from None
            refused.append(f"row {row['id']!r}: {e}")
            continue
        if n == 0 or n >= max_model_len or min(n + max_new_tokens, max_model_len) > kv_tokens or (
                max_prompt_length and n > max_prompt_length):
            dropped.append(f"{row['id']!r} ({n} tokens)")
        else:
            kept.append(row)
    if refused:
        logger.warning("left out %d of %d prompts the chat template refuses (data.skip_bad_lines); first: %s",
                       len(refused), len(rows), "; ".join(refused[:3]))
    if dropped:
        limit = f", longer than data.max_prompt_length={max_prompt_length}" if max_prompt_length else ""
        logger.warning("left out %d of %d prompts of %s that are empty%s or do not fit the context length %d or the "
                       "KV cache of %d tokens (with rollout.max_new_tokens=%d): %s", len(dropped), len(rows), field,
                       limit, max_model_len, kv_tokens, max_new_tokens, ", ".join(dropped[:5]))
    if not kept and not dropped:  # every row refused: the lengths were not the cause
        raise DatasetError(f"the chat template refuses every prompt of {field}: {refused[0]} (data.skip_bad_lines "
                           "left each out)")
    if not kept:
        raise DatasetError(f"no prompt of {field} fits the context length {max_model_len} and the KV cache of "
                           f"{kv_tokens} tokens with rollout.max_new_tokens={max_new_tokens}"
                           + (f" and data.max_prompt_length={max_prompt_length}" if max_prompt_length else "")
                           + ": shorten the prompts, or raise "
                           + ("data.max_prompt_length, " if max_prompt_length else "")
                           + f"{kv_setting} or the model's context")
    return kept
