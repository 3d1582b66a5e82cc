"""Metrics: stage timers, bubble ratio, length statistics, the JSONL + wandb + TensorBoard sink, a live display.

Metric names are namespaced (``rollout/``, ``reward/``, ``train/``, ``time/``, ``sched/``) and
the same in the JSONL file, wandb, the console and :mod:`rollpacker.report`'s plots.

- :func:`bubble_ratio` is SortedRL's eq. 4, computed from change points of the number of running
  requests rather than from fixed time slices: between two change points the count is constant,
  so the sum over slices is exact.
- :class:`MetricsLogger` runs on rank 0 only. ``run_dir/metrics.jsonl`` is the record of a run
  (one JSON object per step, list-valued metrics kept whole); wandb is a mirror of it where
  list-valued metrics become histograms. wandb runs ``offline`` by default and never reaches a
  server unless ``wandb_mode="online"``; its usage telemetry is switched off
  (``WANDB_ERROR_REPORTING=false`` unless the environment says otherwise). With ``tensorboard``,
  ``run_dir/tensorboard`` gets the same (numbers as scalars, lists as histograms); a resumed run
  hides what the earlier one logged from its first step on (``purge_step``), as it drops those records.
- :class:`LiveDisplay` draws a rich progress bar only when stdout is a terminal; elsewhere (CI,
  Slurm logs) it prints one plain summary line per step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO

import numpy as np

from rollpacker.choices import check_choices

logger = logging.getLogger(__name__)

WandbMode = Literal["offline", "online", "disabled"]
SUMMARY_KEYS = (
    "time/step", "reward/mean", "reward/accuracy", "reward/errors", "rollout/tokens_per_s", "rollout/response_len_mean",
    "eval/accuracy",
)


@dataclass(kw_only=True)
class MetricsConfig:
    wandb_mode: WandbMode = "offline"
    """wandb mode: "offline" (files under the run dir, no network), "online" or "disabled"."""
    wandb_project: str = "rollpacker"
    """wandb project name."""
    wandb_run_name: str = ""
    """wandb run name; empty lets wandb pick one."""
    live: bool = True
    """Show a live progress bar on rank 0 when stdout is a terminal."""
    samples_every: int = 0
    """Write every scored response of every this many steps to run_dir/samples/step_N.jsonl; 0 = never."""
    tensorboard: bool = False
    """Also write TensorBoard event files to run_dir/tensorboard (pip install tensorboard; rollpacker[tensorboard])."""

    def __post_init__(self) -> None:
        check_choices(self, "metrics")
        if self.samples_every < 0:
            raise ValueError(f"metrics.samples_every must be >= 0 (0 = never), got {self.samples_every}")
        if not self.wandb_project:
            raise ValueError("metrics.wandb_project must not be empty")


# ---------------------------------------------------------------------------------------------
# Pure helpers


def bubble_ratio(samples: list[tuple[float, int]], capacity: int, end_time: float) -> float:
    """Idle share of the rollout capacity over ``[samples[0][0], end_time]`` (SortedRL eq. 4).

    ``samples`` are change points ``(timestamp, num_running)``: ``num_running`` requests run from
    ``timestamp`` until the next change point (or ``end_time``). Returns
    ``sum((capacity - num_running) * dt) / (capacity * total_time)``; 0.0 when no time passed.
    """
    if capacity <= 0:
        raise ValueError(f"bubble_ratio: capacity must be positive, got {capacity}")
    if not samples:
        return 0.0
    times = [t for t, _ in samples] + [end_time]
    if any(b < a for a, b in zip(times, times[1:])):
        raise ValueError(f"bubble_ratio: timestamps must be non-decreasing and <= end_time={end_time}")
    idle = 0.0
    for (t, num_running), t_next in zip(samples, times[1:]):
        if not 0 <= num_running <= capacity:
            raise ValueError(f"bubble_ratio: {num_running} running at t={t} is outside 0..capacity={capacity}")
        idle += (capacity - num_running) * (t_next - t)
    total = end_time - samples[0][0]
    return idle / (capacity * total) if total > 0 else 0.0


@dataclass
class Phases:
    """Where a round's polls spent their seconds (the job's and the simulator's alike): each poll's
    wall time is its slowest replica's engine steps (``prefill``: those that prefilled a request;
    ``decode``: the others) and the rest (``exchange``: the command, the reports and rank 0's
    round), or, when no replica stepped, ``idle`` (waiting on environments; the final command)."""

    prefill: float = 0.0
    decode: float = 0.0
    exchange: float = 0.0
    idle: float = 0.0

    def add(self, wall: float, engines: Sequence[tuple[float, float]]) -> None:
        """A poll of ``wall`` seconds whose replicas stepped ``(prefill_s, decode_s)`` each."""
        prefill, decode = max(engines, key=sum, default=(0.0, 0.0))
        if not prefill + decode:
            self.idle += wall
            return
        self.prefill, self.decode = self.prefill + prefill, self.decode + decode
        self.exchange += max(0.0, wall - prefill - decode)

    def metrics(self) -> dict[str, float]:
        return {f"rollout/{name}_seconds": value for name, value in dataclasses.asdict(self).items()}


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """Mean, median, p90, p99 and max of response lengths; ``{}`` when there are none."""
    if len(lengths) == 0:
        return {}
    arr = np.asarray(lengths, dtype=np.float64)
    return {
        "rollout/response_len_mean": float(arr.mean()),
        "rollout/response_len_p50": float(np.percentile(arr, 50)),
        "rollout/response_len_p90": float(np.percentile(arr, 90)),
        "rollout/response_len_p99": float(np.percentile(arr, 99)),
        "rollout/response_len_max": float(arr.max()),
    }


def synchronize_cuda() -> None:
    """Wait for the kernels this process queued on its current CUDA device, if it has initialized CUDA;
    nothing on CPU (torch is not even imported for it)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timer:
    """Accumulates wall time per stage: ``with timer("rollout"): ...`` adds to ``time/rollout``.

    On CUDA each phase boundary synchronizes the device (:func:`synchronize_cuda`), so the kernels a phase
    queued (the optimizer's, the push's copies and collectives) count in that phase, not in the next one.
    On CPU nothing changes."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        from rollpacker import watchdog

        watchdog.phase(name)  # named by a collective timeout
        synchronize_cuda()
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize_cuda()
            key = f"time/{name}"
            self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - start

    def move(self, seconds: float, src: str, dst: str) -> None:
        """Count ``seconds`` timed in stage ``src`` as stage ``dst``'s."""
        self.times[f"time/{src}"] -= seconds
        self.times[f"time/{dst}"] = self.times.get(f"time/{dst}", 0.0) + seconds

    def pop(self) -> dict[str, float]:
        """The accumulated times, resetting them to nothing."""
        times, self.times = self.times, {}
        return times

# ---------------------------------------------------------------------------------------------
# Sinks


def _plain(value: Any) -> Any:
    """numpy/torch scalars and arrays as Python numbers and lists; everything else unchanged."""
    return value.tolist() if hasattr(value, "tolist") else value


class MetricsLogger:
    """Appends one JSON line per step to ``run_dir/metrics.jsonl`` and mirrors it to wandb.

    Rank 0 only. The file is opened for appending, so a resumed run continues the same record;
    :meth:`start_at` first drops the records of the steps the run does again, so that each step is
    there once. The evaluation of the step it starts at (a finished run's final evaluation, of the
    weights the resumed run starts from) is held, not lost: the run's record of that step takes it
    in, unless it has its own evaluation; until then it stays in the file (a run that dies first keeps it).
    """

    def __init__(self, run_dir: Path, config: MetricsConfig, run_config: dict) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        _drop_torn_line(self.path)
        self._file: TextIO | None = self.path.open("a", encoding="utf-8")
        self._wandb_run = None
        self._held: tuple[int, dict[str, Any], int] | None = None
        """(step, its ``eval/`` metrics, where their line starts) kept by :meth:`start_at` as the file's last line,
        for the run's record of that step to take in."""
        self._tables: dict[int, dict[str, Any]] = {}
        """Step -> its wandb tables not logged yet: they go with the step's record (wandb drops a step logged
        after a later one, and one_step_off writes batch k+1's samples before step k's record)."""
        if config.wandb_mode != "disabled":
            self._wandb_run = _init_wandb(self.run_dir, config, run_config)
        self._tensorboard_on, self._tensorboard, self._purge_step = config.tensorboard, None, None
        """The TensorBoard writer is made at the first record: it takes the step a resume starts from."""
        if config.tensorboard:
            try:
                import torch.utils.tensorboard  # noqa: F401
            except ImportError as e:
                raise ImportError("metrics.tensorboard needs TensorBoard: `pip install tensorboard` (or "
                                  "rollpacker[tensorboard]), or drop --metrics.tensorboard") from e

    def start_at(self, step: int) -> None:
        """Drop the records of ``step`` and later: this run logs them (again, after a resume). The evaluation
        of a resumed ``step`` stays, as that step's last line, until this run's record of the step replaces it;
        a fresh start (step 0) keeps nothing of an earlier run's (its evaluation would read as this run's). The
        sample files of those steps go too: a resume from an older checkpoint left the abandoned run's, and the
        report showed them as the run's newest."""
        if self._file is None:
            return
        for path in (self.run_dir / "samples").glob("*step_*.jsonl"):
            of = _step_of_name(path.stem)
            held = step and path.stem.startswith("eval_")  # the resumed step's evaluation, as its record's
            if of is not None and of >= step + held:
                path.unlink()
        if not self.path.stat().st_size:
            return
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if _step_of(line) < step]
        evaluated = {k: v for line in lines if _step_of(line) == step
                     for k, v in json.loads(line).items() if k.startswith("eval/")} if step else {}
        self._held = (step, evaluated, len("".join(kept).encode())) if evaluated else None
        self._purge_step = step
        if len(kept) < len(lines):
            self._file.close()
            held = [json.dumps({"step": step, **evaluated}) + "\n"] if evaluated else []
            self.path.write_text("".join(kept + held), encoding="utf-8")
            self._file = self.path.open("a", encoding="utf-8")
            logger.info("%s: dropped the %d records of step %d and later, which this run does again", self.path,
                        len(lines) - len(kept), step)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if "step" in metrics:
            raise ValueError("MetricsLogger.log: pass the step as the `step` argument, not as a metric")
        if self._file is None:
            raise RuntimeError(f"MetricsLogger for {self.path} is closed")
        metrics = {k: _plain(v) for k, v in metrics.items()}
        if self._held is not None and self._held[0] <= step:
            held, evaluated, end = self._held
            self._held = None
            if held == step:  # this record takes the held evaluation's line (the file's last) in
                self._file.truncate(end)
                if not any(k.startswith("eval/") for k in metrics):
                    metrics |= evaluated
        with _writing(self.path):
            self._file.write(json.dumps({"step": step, **metrics}) + "\n")
            self._file.flush()
        if self._wandb_run is not None:
            import wandb

            data = {}
            for early in [s for s in self._tables if s <= step]:
                data |= self._tables.pop(early)
            for key, value in metrics.items():
                if isinstance(value, (list, tuple)):
                    if value:  # wandb cannot histogram nothing; the JSONL keeps the empty list
                        data[key] = wandb.Histogram(value)
                elif value is not None:
                    data[key] = value
            self._wandb_run.log(data, step=step)
        if self._tensorboard_on:
            self._log_tensorboard(step, metrics)

    def _log_tensorboard(self, step: int, metrics: dict[str, Any]) -> None:
        """Numbers as scalars, non-empty lists of numbers as histograms; text (a round's kind) is left out."""
        if self._tensorboard is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=self._purge_step)
        for key, value in metrics.items():
            if isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
                self._tensorboard.add_histogram(key, np.asarray(value, dtype=np.float64), step)
            elif isinstance(value, (int, float)):
                self._tensorboard.add_scalar(key, value, step)
        self._tensorboard.flush()

    def log_samples(self, step: int, name: str, samples: list[dict[str, Any]], table: str = "samples") -> Path:
        """Write ``samples`` (one JSON object per response) to ``run_dir/samples/NAME.jsonl``, replacing it,
        and to the wandb table ``table`` with ``step``'s record; a value JSON has no type for (what a reward
        function logged) as its ``str``."""
        path = self.run_dir / "samples" / f"{name}.jsonl"
        with _writing(path):
            path.parent.mkdir(exist_ok=True)
            path.write_text("".join(json.dumps(s, default=str) + "\n" for s in samples), encoding="utf-8")
        if self._wandb_run is not None and samples:
            import wandb

            columns = list(dict.fromkeys(k for s in samples for k in s))  # rows may differ (an episode's fields)
            rows = [[v if isinstance(v, (int, float, str)) or v is None else json.dumps(v, default=str)
                     for v in (s.get(c) for c in columns)] for s in samples]
            # a column may hold a number in one row and text in another (the answers of two files, what a reward
            # function logged): wandb's typed table would raise on it, so types may mix
            self._tables.setdefault(step, {})[table] = wandb.Table(columns=columns, data=rows, allow_mixed_types=True)
        return path

    def close(self) -> None:
        """Flush and close the JSONL file and finish the wandb run; safe to call twice."""
        self._held = None  # its line stays the step's record
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb_run is not None:
            for step in sorted(self._tables):  # samples of a step whose record never came (a stopped run)
                self._wandb_run.log(self._tables.pop(step), step=step)
            self._wandb_run.finish()
            self._wandb_run = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard, self._tensorboard_on = None, False

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drop_torn_line(path: Path) -> None:
    """Cut a last line a killed run left unfinished (no newline), so the next record starts a line of its own."""
    if not path.is_file() or not path.stat().st_size:
        return
    with path.open("rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        f.truncate(data.rfind(b"\n") + 1)
    logger.warning("%s: dropped its last line, cut off unfinished (%d bytes): the run writing it was stopped",
                   path, len(data) - data.rfind(b"\n") - 1)


def _step_of_name(stem: str) -> int | None:
    """The step of a sample file's name (``step_N``, ``eval_step_N``); None for another file's."""
    prefix, _, number = stem.rpartition("step_")
    return int(number) if prefix in ("", "eval_") and number.isdigit() else None


def _step_of(line: str) -> int:
    """The step of a metrics.jsonl line (-1 for one that is not a record: kept, the report names it)."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return -1
    return step if isinstance(step, int) else -1


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    """A write of ``path`` whose OSError (a full disk, a quota) stops the run in one line naming the file and the
    free space, as a checkpoint's does."""
    import shutil

    from rollpacker.errors import UserError

    try:
        yield
    except OSError as e:
        free = shutil.disk_usage(next(p for p in path.parents if p.exists())).free / 2**20
        raise UserError(f"metrics: writing {path} failed ({e.strerror or e}; {free:.1f} MiB free there): free disk "
                        "space, then run again with --resume auto (the steps after the last checkpoint are done "
                        "again, their records replaced)") from None


def _init_wandb(run_dir: Path, config: MetricsConfig, run_config: dict):
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # else wandb posts usage telemetry
    try:
        import wandb
    except ImportError as e:
        raise ImportError("wandb is not installed: `pip install wandb`, or set metrics.wandb_mode=disabled") from e
    try:
        return wandb.init(
            mode=config.wandb_mode,
            dir=run_dir,
            project=config.wandb_project,
            name=config.wandb_run_name or None,
            config=json.loads(json.dumps(run_config, default=str)),
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )
    except Exception as e:
        raise RuntimeError(
            f"wandb.init (mode={config.wandb_mode}, dir={run_dir}) failed: {e}; "
            "set metrics.wandb_mode=disabled to run without wandb"
        ) from e


def format_summary(step: int, summary: dict[str, Any], progress: str = "") -> str:
    """One line: ``step 3/200 | 0:01:02 elapsed, ETA 0:40:10 | time/step 12.3s | reward/mean 0.41 | ...``
    (``progress``: what follows the step number; missing keys left out)."""
    parts = [f"step {step}{progress}"]
    for key in SUMMARY_KEYS:
        value = summary.get(key)
        if value is None:
            continue
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        parts.append(f"{key} {text}{'s' if key.startswith('time/') else ''}")
    return " | ".join(parts)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class LiveDisplay:
    """Per-step progress on rank 0: a rich progress bar on a terminal, plain lines elsewhere.

    Each step's line says the step of ``num_steps``, the run's elapsed time and its ETA (the mean
    time of this run's steps so far times the steps left), and the step's summary: step time,
    reward, reward errors, tokens/s. On a terminal (``enabled`` and the stream a TTY) a bar shows
    the run's steps and, below it, the current rollout (responses done of launched, tokens/s); the
    lines print above them. Elsewhere (CI, Slurm logs): one line per step, nothing else.
    """

    def __init__(self, enabled: bool = True, *, stream: TextIO | None = None, num_steps: int = 0) -> None:
        self._stream = stream if stream is not None else sys.stdout
        self._use_bar = enabled and self._stream.isatty()
        self._progress = None
        self._tasks: dict[int, Any] = {}
        """Each step's rollout row (one_step_off starts step k + 1's before it ends step k's)."""
        self._run = None
        self._handlers: list[tuple[logging.StreamHandler, Any]] = []
        """The log handlers routed above the bar while it is up, and their own streams."""
        self._step = 0
        self.num_steps = num_steps
        self._start = time.monotonic()
        """When the run began (the display is built with the controller): the elapsed time's origin."""
        self._first: tuple[int, float] | None = None
        """(step, time) when this run's first step began: the ETA's origin (model loading is not a step)."""

    def start_step(self, step: int, num_launched: int) -> None:
        self._step = step
        self._first = self._first or (step, time.monotonic())
        if not self._use_bar:
            return
        if self._progress is None:
            self._start_bar(step)
        self._tasks[step] = self._progress.add_task(f"step {step} rollout", total=num_launched, tokens_per_s=0.0,
                                                    clock="", last="")

    def _start_bar(self, step: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[tokens_per_s]:,.0f} tok/s"), TextColumn("{task.fields[clock]}"),
            TextColumn("{task.fields[last]}"), console=Console(file=self._stream), transient=True)
        self._progress.start()  # it sends sys.stderr above the bar; the log handlers hold the stderr before it
        self._progress.console.show_cursor(True)  # rich hides it: an exit without close() left the terminal so
        self._handlers = [(h, h.setStream(sys.stderr)) for h in logging.getLogger().handlers
                          if type(h) is logging.StreamHandler and h.stream is sys.__stderr__]
        self._run = self._progress.add_task("run", total=self.num_steps or None, completed=step, tokens_per_s=0.0,
                                            clock="", last="")

    def note(self, text: str) -> None:
        """Print ``text`` (above the bar, on a terminal)."""
        if self._progress is None:
            print(text, file=self._stream, flush=True)
        else:
            self._progress.console.print(text, markup=False, highlight=False)

    def update(self, num_done: int, num_launched: int, tokens_per_s: float) -> None:
        if (task := self._tasks.get(self._step)) is not None:
            self._progress.update(task, completed=num_done, total=num_launched, tokens_per_s=tokens_per_s)
            self._progress.update(self._run, clock=self.clock(self._step - 1))

    def clock(self, step: int) -> str:
        """``ELAPSED elapsed, ETA T`` once step ``step`` is done: the ETA is the mean time of this run's
        steps so far times the steps left ("" without num_steps)."""
        if not self.num_steps:
            return ""
        now = time.monotonic()
        first_step, first_time = self._first or (step, now)
        done = step + 1 - first_step
        left = max(self.num_steps - step - 1, 0)  # num_epochs' steps are planned: a round may hold prompts back
        eta = f", ETA {_clock((now - first_time) / done * left)}" if done > 0 else ""
        return f"{_clock(now - self._start)} elapsed{eta}"

    def end_step(self, step: int, summary: dict[str, Any]) -> None:
        """Step ``step``'s line (one_step_off ends a step after starting the next one's rollout)."""
        if self.num_steps:  # planned from the data left: a round that held prompts back runs one more
            self.num_steps = max(self.num_steps, step + 1)
        clock = self.clock(step)
        line = format_summary(step, summary, f"/{self.num_steps} | {clock}" if self.num_steps else "")
        if self._progress is None:
            print(line, file=self._stream, flush=True)
            return
        if step in self._tasks:
            self._progress.remove_task(self._tasks.pop(step))
        last = " | ".join(f"{k} {summary[k]:.3g}" for k in ("reward/mean", "reward/errors") if k in summary)
        self._progress.update(self._run, completed=step + 1, total=self.num_steps or None,
                              description=f"step {step + 1}", tokens_per_s=summary.get("rollout/tokens_per_s", 0.0),
                              clock=clock, last=last)
        self._progress.console.print(line, markup=False, highlight=False)

    def close(self) -> None:
        if self._progress is not None:
            for handler, stream in self._handlers:
                handler.setStream(stream)
            self._progress.stop()
            self._progress, self._tasks, self._handlers = None, {}, []

