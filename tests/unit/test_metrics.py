"""Metrics helpers against hand-computed values, the JSONL/wandb sink, the live display, the report."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from rollpacker import report
from rollpacker.metrics import LiveDisplay, MetricsConfig, MetricsLogger, Timer, bubble_ratio, length_stats


def test_bubble_ratio_hand_computed():
    # capacity 4: 4 running for 1 s, then 1 running for 3 s -> (0*1 + 3*3) / (4*4)
    assert bubble_ratio([(0.0, 4), (1.0, 1)], capacity=4, end_time=4.0) == pytest.approx(0.5625)
    # starts at the first timestamp, not at 0; 2 of 2 busy for 1 s, then idle for 1 s -> 2 / 4
    assert bubble_ratio([(10.0, 2), (11.0, 0)], capacity=2, end_time=12.0) == pytest.approx(0.5)
    assert bubble_ratio([(0.0, 3)], capacity=3, end_time=5.0) == 0.0  # always full
    assert bubble_ratio([], capacity=3, end_time=5.0) == 0.0
    assert bubble_ratio([(1.0, 2)], capacity=3, end_time=1.0) == 0.0  # no time passed


@pytest.mark.parametrize(
    "samples, capacity, end_time",
    [([(0.0, 1)], 0, 1.0), ([(0.0, 5)], 4, 1.0), ([(1.0, 1), (0.5, 1)], 4, 2.0), ([(0.0, 1)], 4, -1.0)],
)
def test_bubble_ratio_rejects_bad_input(samples, capacity, end_time):
    with pytest.raises(ValueError, match="bubble_ratio"):
        bubble_ratio(samples, capacity, end_time)


def test_length_stats():
    stats = length_stats(list(range(1, 11)))  # 1..10
    assert stats == {
        "rollout/response_len_mean": pytest.approx(5.5),
        "rollout/response_len_p50": pytest.approx(5.5),
        "rollout/response_len_p90": pytest.approx(9.1),  # linear interpolation: 1 + 0.9 * 9
        "rollout/response_len_p99": pytest.approx(9.91),
        "rollout/response_len_max": 10,
    }
    assert length_stats([]) == {}


def test_timer_accumulates_and_pops():
    timer = Timer()
    for _ in range(2):
        with timer("rollout"):
            time.sleep(0.01)
    with pytest.raises(RuntimeError), timer("train"):  # time is kept when the stage raises
        raise RuntimeError("boom")
    times = timer.pop()
    assert set(times) == {"time/rollout", "time/train"}
    assert times["time/rollout"] >= 0.02
    assert timer.pop() == {}
    timer.times = {"time/rollout": 5.0}
    timer.move(1.5, "rollout", "reward")  # the rollout's wait for its last scores is reward time
    assert timer.pop() == {"time/rollout": 3.5, "time/reward": 1.5}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the Timer synchronizes it")
def test_timer_counts_a_phases_queued_cuda_kernels_in_that_phase():
    torch.cuda.synchronize()
    timer = Timer()
    with timer("train"):
        torch.cuda._sleep(int(1e9))  # a kernel spinning ~0.5 s, queued: the host goes on at once
    with timer("rollout"):
        pass
    times = timer.pop()
    assert times["time/train"] > 0.2 and times["time/rollout"] < 0.05, times


def test_config_validates():
    with pytest.raises(ValueError, match="wandb_mode"):
        MetricsConfig(wandb_mode="cloud")
    with pytest.raises(ValueError, match="wandb_project"):
        MetricsConfig(wandb_project="")


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_logger_disabled_writes_jsonl_without_wandb(tmp_path):
    np = pytest.importorskip("numpy")
    wandb_loaded = "wandb" in sys.modules
    logger = MetricsLogger(tmp_path / "run", MetricsConfig(wandb_mode="disabled"), {"seed": 0})
    logger.log(0, {"reward/mean": 0.5, "rollout/response_lengths": [3, 5, 8], "train/loss": np.float32(1.5)})
    logger.log(1, {"reward/mean": 0.75, "rollout/response_lengths": np.array([2, 4])})
    logger.close()
    logger.close()  # idempotent
    assert _read_jsonl(tmp_path / "run" / "metrics.jsonl") == [
        {"step": 0, "reward/mean": 0.5, "rollout/response_lengths": [3, 5, 8], "train/loss": 1.5},
        {"step": 1, "reward/mean": 0.75, "rollout/response_lengths": [2, 4]},
    ]
    assert not (tmp_path / "run" / "wandb").exists()
    assert ("wandb" in sys.modules) == wandb_loaded  # disabled mode never imports wandb
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(2, {})
    with (tmp_path / "run" / "metrics.jsonl").open("a") as f:  # a run killed while writing step 2's record
        f.write('{"step": 2, "reward/mean": 0.')
    with MetricsLogger(tmp_path / "run", MetricsConfig(wandb_mode="disabled"), {"seed": 0}) as resumed:
        resumed.start_at(2)
        resumed.log(2, {"reward/mean": 1.0})
    assert [r["step"] for r in _read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2]
    # a fresh start in the directory (no checkpoint of that run to resume): nothing of it stays, its evaluation neither
    with (tmp_path / "run" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 0, "eval/accuracy": 0.5}\n')
    with MetricsLogger(tmp_path / "run", MetricsConfig(wandb_mode="disabled"), {"seed": 1}) as fresh:
        fresh.start_at(0)
        fresh.log(0, {"reward/mean": 0.0})
    assert _read_jsonl(tmp_path / "run" / "metrics.jsonl") == [{"step": 0, "reward/mean": 0.0}]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device every write fills)")
def test_a_full_disk_under_the_metrics_stops_the_run_in_one_line_naming_the_file(tmp_path):
    """metrics.jsonl is written every step, so a disk that fills meets it before a checkpoint: it was a traceback."""
    from rollpacker.errors import UserError

    logger = MetricsLogger(tmp_path, MetricsConfig(wandb_mode="disabled"), run_config={})
    logger._file = open("/dev/full", "w")  # noqa: SIM115  (the logger's file, closed by it)
    with pytest.raises(UserError, match=r"metrics: writing .*metrics.jsonl failed \(No space left on device; .* MiB "
                                        r"free there\): free disk space, then run again with --resume auto"):
        logger.log(0, {"reward/mean": 1.0})
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "step_0.jsonl").symlink_to("/dev/full")
    with pytest.raises(UserError, match=r"writing .*step_0.jsonl failed \(No space left on device"):
        logger.log_samples(0, "step_0", [{"completion": "x"}])


def test_a_resume_drops_the_sample_files_of_the_steps_it_redoes(tmp_path):
    """Back to an older checkpoint: the abandoned run's samples of later steps stayed, and the report showed them
    as the run's newest. The evaluation of the resumed step stays, as its metrics do."""
    with MetricsLogger(tmp_path, MetricsConfig(wandb_mode="disabled"), {}) as first:
        for step in range(5):
            first.log(step, {"reward/mean": 0.5})
            first.log_samples(step, f"step_{step}", [{"step": step}])
            first.log_samples(step, f"eval_step_{step}", [{"step": step}], "eval_samples")
    (tmp_path / "samples" / "mystep_9.jsonl").write_text("")  # not a step's
    with MetricsLogger(tmp_path, MetricsConfig(wandb_mode="disabled"), {}) as resumed:
        resumed.start_at(2)
    assert sorted(p.stem for p in (tmp_path / "samples").iterdir()) == [
        "eval_step_0", "eval_step_1", "eval_step_2", "mystep_9", "step_0", "step_1"]
    with MetricsLogger(tmp_path, MetricsConfig(wandb_mode="disabled"), {}) as fresh:  # keeps nothing, as its record
        fresh.start_at(0)
    assert [p.stem for p in (tmp_path / "samples").iterdir()] == ["mystep_9"]


def test_tensorboard_mirrors_the_record_and_a_resume_replaces_the_steps_it_redoes(tmp_path):
    """Numbers are scalars, lists histograms, text left out; a resume from step 1 hides the first run's steps 1-2
    (TensorBoard's purge_step), as it drops their records from metrics.jsonl."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run_dir, config = tmp_path / "run", MetricsConfig(wandb_mode="disabled", tensorboard=True)
    with MetricsLogger(run_dir, config, {}) as logger:
        for step in range(3):
            logger.log(step, {"reward/mean": 0.1 * step, "rollout/response_lengths": [1, 2, 3 + step],
                              "sched/round_kind": "short", "train/kl_coef": None})
    with MetricsLogger(run_dir, config, {}) as logger:
        logger.start_at(1)
        for step in (1, 2, 3):
            logger.log(step, {"reward/mean": 1.0 + step, "rollout/response_lengths": [step]})
    events = accumulator.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    assert tags["scalars"] == ["reward/mean"] and tags["histograms"] == ["rollout/response_lengths"]
    scalars = [(e.step, round(e.value, 6)) for e in events.Scalars("reward/mean")]
    assert scalars == [(0, 0.0), (1, 2.0), (2, 3.0), (3, 4.0)]
    assert [(e.step, e.histogram_value.num) for e in events.Histograms("rollout/response_lengths")] == [
        (0, 3), (1, 1), (2, 1), (3, 1)]


def test_logger_offline_writes_jsonl_and_wandb_files(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ERROR_REPORTING"):
        monkeypatch.setenv(var, "")  # recorded, so the test's changes are undone afterwards
        monkeypatch.delenv(var)
    run_dir = tmp_path / "run"
    with MetricsLogger(run_dir, MetricsConfig(wandb_mode="offline", wandb_run_name="t"), {"lr": 1e-6}) as logger:
        logger.log(0, {"reward/mean": 0.25, "rollout/response_lengths": [1, 2, 3], "sched/round_kind": "short"})
        logger.log(1, {"reward/mean": 0.5, "rollout/response_lengths": []})
        sample = {"step": 1, "prompt": [{"role": "user", "content": "1+1"}], "completion": "2", "reward": 1.0,
                  "rewards": {"toy": 1.0, "other": None}, "length": 2, "finish_reason": "stop", "answer": 2}
        path = logger.log_samples(1, "step_1", [sample, {**sample, "answer": "x"}])
        # ... and a wandb table of them, though the answers of two files may be a number and text
        assert path == run_dir / "samples" / "step_1.jsonl" and _read_jsonl(path)[0] == sample
        assert os.environ["WANDB_ERROR_REPORTING"] == "false"  # no usage telemetry sent anywhere
    records = _read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert records[0]["rollout/response_lengths"] == [1, 2, 3]
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb")), "no offline wandb run written"


def test_wandb_gets_each_steps_samples_with_its_record_in_step_order(tmp_path):
    """one_step_off writes batch k+1's samples before step k's record: wandb, which drops a step logged after
    a later one, gets every table with its own step's record; the evaluation's table is a table of its own."""
    pytest.importorskip("wandb")

    class Run:  # the wandb run's two calls, recorded: the order is what is checked
        def __init__(self):
            self.logged = []

        def log(self, data, step):
            self.logged.append((step, sorted(data)))

        def finish(self):
            pass

    with MetricsLogger(tmp_path, MetricsConfig(wandb_mode="disabled"), {}) as logger:
        logger._wandb_run = run = Run()
        logger.log(0, {"reward/mean": 0.0})
        logger.log_samples(2, "step_2", [{"reward": 1.0}])  # the next batch, scored first
        logger.log_samples(1, "eval_step_1", [{"reward": 1.0}], table="eval_samples")
        logger.log(1, {"reward/mean": 0.5})
        logger.log(2, {"reward/mean": 1.0})
        logger.log_samples(3, "step_3", [{"reward": 1.0}])  # its step never logged: at close, still in order
    assert run.logged == [(0, ["reward/mean"]), (1, ["eval_samples", "reward/mean"]), (2, ["reward/mean", "samples"]),
                          (3, ["samples"])]


def test_live_display_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    display = LiveDisplay(enabled=True, stream=out)
    for step in range(2):
        display.start_step(step, num_launched=8)
        display.update(4, 8, tokens_per_s=100.0)
        display.end_step(step, {"time/step": 1.5, "reward/mean": 0.25, "reward/accuracy": 0.5,
                                "rollout/response_len_mean": 12.0, "train/loss": 3.0})
    display.close()
    lines = out.getvalue().splitlines()
    expected = "step {} | time/step 1.5s | reward/mean 0.25 | reward/accuracy 0.5 | rollout/response_len_mean 12"
    assert lines == [expected.format(s) for s in range(2)]


def test_a_step_past_the_planned_count_raises_the_count_it_is_shown_against():
    """The count is planned from the data left: tail's held-back prompts took one step more, shown as step 9/8."""
    out = io.StringIO()
    display = LiveDisplay(enabled=True, stream=out, num_steps=2)
    for step in range(3):
        display.start_step(step, num_launched=8)
        display.end_step(step, {"time/step": 1.5})
    assert [line.split(" | ")[0] for line in out.getvalue().splitlines()] == ["step 0/2", "step 1/2", "step 2/3"]


def test_live_display_names_the_step_ended_when_the_next_rollout_has_started():
    """one_step_off starts step k+1's rollout before it logs step k."""
    out = io.StringIO()
    display = LiveDisplay(enabled=True, stream=out)
    display.start_step(0, num_launched=8)
    for step in range(2):
        display.start_step(step + 1, num_launched=8)
        display.end_step(step, {"reward/mean": 0.5})
    assert out.getvalue().splitlines() == ["step 0 | reward/mean 0.5", "step 1 | reward/mean 0.5"]


def test_live_display_on_a_terminal_prints_the_summary():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    display = LiveDisplay(enabled=True, stream=out)
    display.start_step(3, num_launched=4)
    display.update(2, 4, tokens_per_s=50.0)
    display.update(5, 6, tokens_per_s=50.0)  # a refill launched 2 more: the bar counts of 6, not past 4
    display._progress.refresh()
    assert "5/6" in out.getvalue() and "5/4" not in out.getvalue()
    display.end_step(3, {"reward/mean": 1.0})
    display.close()
    assert "step 3 | reward/mean 1" in out.getvalue()



def test_live_display_on_a_terminal_keeps_log_lines_rows_of_its_steps_and_the_cursor(monkeypatch):
    """A log line written to stderr under the bar was wiped by its next redraw; one_step_off's step 0 row stayed
    for the whole run (start_step(k + 1) came before end_step(k)); an exit without close() left the cursor hidden."""
    import logging

    class Tty(io.StringIO):
        def isatty(self):
            return True

    out, handler = Tty(), logging.StreamHandler(sys.__stderr__)
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    display = LiveDisplay(enabled=True, stream=out, num_steps=4)
    display.start_step(0, num_launched=8)
    assert handler.stream is not sys.__stderr__  # above the bar, through its console
    logging.getLogger("rollpacker.test").warning("a warning under the bar")
    for step in range(2):
        display.start_step(step + 1, num_launched=8)
        display.end_step(step, {"reward/mean": 0.5})
        assert [t.description for t in display._progress.tasks] == [f"step {step + 1}", f"step {step + 1} rollout"]
    assert "a warning under the bar" in out.getvalue()
    assert out.getvalue().rfind("\x1b[?25h") > out.getvalue().rfind("\x1b[?25l")  # shown while the bar is up
    display.close()
    assert handler.stream is sys.__stderr__


def _write_metrics(run_dir, num_steps=4):
    run_dir.mkdir()
    lines = []
    for step in range(num_steps):
        record = {"step": step, "time/rollout": 2.0 + step, "time/train": 1.0, "time/weight_sync": 0.1,
                  "time/ref_logprobs": 0.5, "time/step": 4.0 + step, "reward/mean": 0.1 * step,
                  "reward/accuracy": 0.2 * step, "rollout/response_lengths": [10, 20, 30 + step, 200]}
        if step == 1:
            record.pop("time/weight_sync")  # a missing stage counts as 0
        lines.append(json.dumps(record))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_report_writes_three_plots(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _write_metrics(run_dir)
    assert report.main([str(run_dir)]) == 0
    names = ("step_time.png", "response_lengths.png", "reward.png")
    printed = capsys.readouterr().out.split()
    assert printed == [str(run_dir / "plots" / n) for n in names]
    for name in names:
        assert (run_dir / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_shows_a_few_samples_of_the_last_saved_step(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _write_metrics(run_dir)
    (run_dir / "samples").mkdir()
    rows = [{"step": 10, "prompt": [{"role": "user", "content": f"Q{i}"}], "completion": f"A{i}" + "x" * 700 * (i == 2),
             "reward": [0.5, 1.0, 0.0, 0.2][i], "rewards": {"toy": [0.5, 1.0, 0.0, 0.2][i]}, "length": [9, 3, 40, 7][i],
             "finish_reason": "stop"} for i in range(4)]
    (run_dir / "samples" / "step_10.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "samples" / "step_2.jsonl").write_text(json.dumps({**rows[0], "step": 2}) + "\n")  # older: not shown
    assert report.main([str(run_dir)]) == 0
    assert capsys.readouterr().out.split()[-1] == str(run_dir / "plots" / "samples.md")
    text = (run_dir / "plots" / "samples.md").read_text()
    assert text.startswith("# Samples of step 10 (4 responses")
    sections = text.split("\n## ")[1:]
    assert [s.split(":")[0] for s in sections] == ["best reward", "worst reward", "longest", "shortest"]
    assert '"Q1"' in sections[0] and '"Q2"' in sections[1] and '"Q2"' in sections[2] and '"Q1"' in sections[3]
    assert "x" * 590 + " [...]" in sections[1] and "x" * 700 not in text  # cut, with a mark
    assert 'rewards: {"toy": 1.0}' in sections[0]


def test_the_step_time_stack_adds_up_to_the_step():
    """A stage inside another (the wait for the last scores) is not stacked twice; one_step_off's step is its
    wait, training and sync (its batch's rollout and scoring ran under the last step's training)."""
    colocated = {"time/rollout": 5.0, "time/reward": 1.0, "time/reward_exposed": 0.5, "time/migration": 0.2,
                 "time/train": 3.0, "time/weight_sync": 1.0, "time/step": 10.0}
    one_step_off = {"time/rollout": 6.0, "time/reward": 1.0, "time/wait_prev_gen": 2.0, "time/train": 3.0,
                    "time/weight_sync": 1.0, "time/step": 6.0}
    for record in (colocated, one_step_off):
        assert sum(report.stacked(record).values()) == record["time/step"]


def test_report_skips_what_is_always_null_and_shows_samples_without_a_reward(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _write_metrics(run_dir)
    records = [json.loads(line) | {"env/info/tool_calls_frac": None, "eval/pass@1": None}
               for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "samples").mkdir()
    rows = [{"step": 3, "prompt": "Q", "completion": "A", "reward": reward, "length": 2, "finish_reason": "stop"}
            for reward in (None, 0.5)]  # None: a failed score
    (run_dir / "samples" / "step_3.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report.main([str(run_dir)]) == 0
    assert [Path(p).name for p in capsys.readouterr().out.split()] == [
        "step_time.png", "response_lengths.png", "reward.png", "samples.md"]
    assert "## best reward: reward 0.5" in (run_dir / "plots" / "samples.md").read_text()


def test_report_plots_a_run_whose_loss_reward_and_eval_went_non_finite(tmp_path, capsys):
    """A diverged run is the one a user most needs plotted: its NaN or infinite points are left out of the plot
    (whose axis cannot scale to one), not the cause of a crash."""
    run_dir = tmp_path / "run"
    _write_metrics(run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for i, record in enumerate(records):
        record |= {"eval/pass@1": [0.5, float("nan"), float("inf")][i % 3], "eval/mean@4": float("-inf")}
    records[1] |= {"reward/accuracy": float("inf"), "time/train": float("nan")}
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert report.main([str(run_dir)]) == 0
    assert [Path(p).name for p in capsys.readouterr().out.split()] == [
        "step_time.png", "response_lengths.png", "reward.png", "eval.png"]


def test_the_prompt_check_of_sync_counts_the_groups_the_filter_dropped(tmp_path, monkeypatch):
    from rollpacker import checkpoint

    records = [{"step": s, "sched/trained_prompts": trained, "sched/filtered": 4 - trained}
               for s, trained in enumerate([2, 1, 2])]
    monkeypatch.setattr(checkpoint, "newest_whole", lambda run_dir, announce: tmp_path / "step_3")
    monkeypatch.setattr(checkpoint, "train_state", lambda path: {"step": 3, "policy": {
        "name": "sync", "sampler": {"num_rows": 100, "epoch": 0, "position": 12}}})
    assert report.prompt_ledger(tmp_path, records).endswith("12 drawn in order and 5 trained and 7 filtered, each once")


def test_the_prompt_check_of_a_run_resumed_here_from_another_runs_checkpoint_is_not_a_verdict(tmp_path, monkeypatch):
    """Its metrics.jsonl starts at the resume's step, the ledger at step 0: it said prompts were lost."""
    from rollpacker import checkpoint

    records = [{"step": s, "sched/trained_prompts": 4} for s in (2, 3)]
    monkeypatch.setattr(checkpoint, "newest_whole", lambda run_dir, announce: tmp_path / "step_4")
    monkeypatch.setattr(checkpoint, "train_state", lambda path: {"step": 4, "policy": {
        "name": "sync", "sampler": {"num_rows": 100, "epoch": 0, "position": 16}}})
    assert report.prompt_ledger(tmp_path, records) == (
        f"prompts (checkpoint {tmp_path / 'step_4'}, step 4): not checked, as metrics.jsonl starts at step 2 (a run "
        "resumed here from another's checkpoint: that run's metrics.jsonl holds the rest)")


def test_the_reward_plot_draws_the_evaluations_as_they_are():
    """A running mean over 10 points of eval/accuracy was one over 10 evaluations (100 steps at eval_every 10),
    labelled a 10-step mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [{"step": s, "reward/mean": s / 600, **({"eval/accuracy": s / 600} if s % 10 == 0 else {})}
               for s in range(601)]
    fig, ax = plt.subplots()
    try:
        assert report.plot_reward(records, ax)
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert "reward/mean (10-step mean)" in lines and list(lines["eval/accuracy"].get_ydata()) == [
            s / 600 for s in range(0, 601, 10)]
    finally:
        plt.close(fig)


def test_the_step_time_plot_leaves_out_the_final_evaluations_record():
    """The final evaluation is a record of its own at step num_steps, of no stage: it was an empty bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [{"step": s, "time/step": 1.0, "time/rollout": 0.75, "time/train": 0.25} for s in range(4)]
    fig, ax = plt.subplots()
    try:
        assert report.plot_step_time([*records, {"step": 4, "eval/accuracy": 0.5}], ax)
        assert sorted({bar.get_x() + bar.get_width() / 2 for bar in ax.patches}) == [0, 1, 2, 3]
    finally:
        plt.close(fig)


def test_the_reward_functions_plot_leaves_out_the_controllers_own_reward_metrics():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    own = {"reward/mean": 0.5, "reward/accuracy": 0.5, "reward/zero_variance_frac": 0.25, "reward/errors": 0,
           "reward/overlong_penalty_mean": 0.0, "reward/seconds_total": 1.0}
    fig, ax = plt.subplots()
    try:
        assert not report.plot_reward_functions([{"step": 0, **own}], ax)  # no function of the user's: no plot
        assert report.plot_reward_functions([{"step": 0, **own, "reward/correct": 0.5}], ax)
        assert [line.get_label() for line in ax.get_lines()] == ["reward/correct"]
    finally:
        plt.close(fig)


def test_report_missing_dir_and_file(tmp_path, capsys):
    assert report.main([str(tmp_path / "nope")]) == 2
    assert str(tmp_path / "nope") in capsys.readouterr().err
    assert report.main([str(tmp_path)]) == 2
    assert str(tmp_path / "metrics.jsonl") in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 0.5}\n')  # its file given: it "did not exist"
    assert report.main([str(tmp_path / "metrics.jsonl")]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'metrics.jsonl'} is a file; pass the run's output "
                                       f"directory ({tmp_path}?)\n")


def test_report_malformed_line_names_file_and_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 0.5}\n{"step": 1, "reward\n')
    assert report.main([str(tmp_path)]) == 2
    assert f"{tmp_path / 'metrics.jsonl'}:2" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "rollout/response_lengths": 7}\n')
    assert report.main([str(tmp_path)]) == 2
    assert f"{tmp_path / 'metrics.jsonl'}:1" in capsys.readouterr().err


def test_pass_at_k_against_hand_computed_values():
    from rollpacker.schedule.eval import pass_at_k

    assert pass_at_k(4, 1, 1) == 0.25  # one draw: c / n
    assert pass_at_k(4, 1, 2) == 0.5  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # C(7,5)=21, C(10,5)=252
    assert pass_at_k(4, 2, 4) == pass_at_k(4, 1, 4) == 1.0  # n = k: any correct sample is drawn
    assert pass_at_k(4, 0, 4) == pass_at_k(4, 0, 1) == 0.0  # c = 0
    assert pass_at_k(3, 2, 2) == 1.0  # n - c < k
    with pytest.raises(ValueError, match="n=2, c=3, k=1"):
        pass_at_k(2, 3, 1)


def test_the_prompt_check_says_how_many_trained_prompts_lost_every_episode_to_their_environment(tmp_path,
                                                                                                monkeypatch):
    """A group whose episodes all failed counts as trained (it was drawn, and its place taken) but trained nothing."""
    from rollpacker import checkpoint

    records = [{"step": s, "sched/trained_prompts": 4, "sched/failed_prompts": failed}
               for s, failed in enumerate([1, 0])]
    monkeypatch.setattr(checkpoint, "newest_whole", lambda run_dir, announce: tmp_path / "step_2")
    monkeypatch.setattr(checkpoint, "train_state", lambda path: {"step": 2, "policy": {
        "name": "sync", "sampler": {"num_rows": 100, "epoch": 0, "position": 8}}})
    assert report.prompt_ledger(tmp_path, records).endswith(
        "8 drawn in order and trained, each once\n  1 of them trained nothing: every episode of theirs failed in its "
        "environment (env/errors; the step's samples say why)")


def test_a_wandb_table_of_rows_with_other_fields_puts_each_value_under_its_column(tmp_path):
    """Columns were the first row's keys and each row its values in order: a row with a field more (an episode's
    messages) or in another order put values under the wrong columns, with no error (mixed types allowed)."""
    pytest.importorskip("wandb")

    with MetricsLogger(tmp_path, MetricsConfig(wandb_mode="disabled"), {}) as logger:
        logger._wandb_run = type("Run", (), {"log": lambda self, data, step: None, "finish": lambda self: None})()
        logger.log_samples(0, "step_0", [{"reward": 1.0, "text": "a"}, {"turns": 2, "text": "b", "reward": 0.0}])
        table = logger._tables[0]["samples"]
    assert table.columns == ["reward", "text", "turns"]
    assert table.data == [[1.0, "a", None], [0.0, "b", 2]]


def test_the_report_leaves_out_an_unfinished_last_line(tmp_path, capsys):
    """A run writing its metrics (or one that stopped mid-line) left the report with no plot: the job's own
    logger drops that line at a resume; the report leaves it out, saying so."""
    run_dir = tmp_path / "run"
    _write_metrics(run_dir)
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 99, "reward/me')
    assert report.main([str(run_dir)]) == 0
    said = capsys.readouterr().err
    assert said.count(f"note: {run_dir / 'metrics.jsonl'}:5: left out, unfinished") == 1, said
    assert (run_dir / "plots" / "reward.png").exists()
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, oops}\n{"step": 2}\n')
    assert report.main([str(run_dir)]) == 2  # a bad line within the file is not a line being written


def test_the_report_leaves_out_a_samples_files_unfinished_line_and_says_where_it_cannot_write(tmp_path, capsys):
    """A samples file cut mid-line (samples are written as a step ends) stopped the report after its plots, and
    a plots path it could not write was a traceback."""
    run_dir = tmp_path / "run"
    _write_metrics(run_dir)
    sample = {"step": 3, "reward": 1.0, "length": 4, "finish_reason": "stop", "prompt": "p", "completion": "c"}
    (run_dir / "samples").mkdir()
    (run_dir / "samples" / "step_3.jsonl").write_text(json.dumps(sample) + "\n" + json.dumps(sample)[:20])
    assert report.main([str(run_dir)]) == 0
    assert f"note: {run_dir / 'samples' / 'step_3.jsonl'}:2: left out, unfinished" in capsys.readouterr().err
    assert "# Samples of step 3 (1 responses" in (run_dir / "plots" / "samples.md").read_text()
    shutil.rmtree(run_dir / "plots")
    (run_dir / "plots").write_text("")
    assert report.main([str(run_dir)]) == 2
    assert f"{run_dir / 'plots'}: cannot write the plots there (File exists); it must be a directory" in (
        capsys.readouterr().err)
