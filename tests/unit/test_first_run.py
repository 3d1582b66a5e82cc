"""A user's first run (issue #36), the parts without a job: the launcher's split of its arguments,
messages in the flags' spelling, the progress line, each step once in metrics.jsonl after a
resume, and the report's plots of what a task's author tunes on. The jobs themselves:
tests/dist/test_first_run.py."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from rollpacker import launch, report
from rollpacker.config import as_flags
from rollpacker.launch import option, split
from rollpacker.metrics import LiveDisplay, MetricsConfig, MetricsLogger


def test_the_launcher_gives_torchrun_its_options_and_rollpacker_run_the_rest():
    assert split(["--nproc-per-node", "2", "--max-restarts=3", "--num-steps", "5", "--data.path", "x.jsonl"]) == (
        ["--standalone", "--nproc-per-node", "2", "--max-restarts=3"], ["--num-steps", "5", "--data.path", "x.jsonl"])
    assert split(["--nnodes", "2", "--rdzv-endpoint", "h:29500", "--", "--preset", "qwen2.5-7b-8k"]) == (
        ["--nnodes", "2", "--rdzv-endpoint", "h:29500"], ["--preset", "qwen2.5-7b-8k"])  # no --standalone
    assert split(["--standalone", "schedule:tail", "--help"]) == (["--standalone"], ["schedule:tail", "--help"])
    assert split(["--master-port", "29600", "--nproc-per-node", "2"]) == (  # no --standalone: it ignores the port
        ["--master-port", "29600", "--nproc-per-node", "2"], [])
    assert option(["--standalone", "--max_restarts", "3"], "--max-restarts", "0") == "3"
    assert option(["--max-restarts", "0", "--max-restarts=3"], "--max-restarts", "0") == "3"  # torchrun's: the last
    for cut in (["--max-restarts="], ["--max-restarts"]):  # no value: torchrun's own error says so
        assert option(cut, "--max-restarts", "0") == "0"
    assert option(["--nproc-per-node=2"], "--nproc-per-node", "1") == "2" and option([], "--nnodes", "1") == "1"
    # a typo in torchrun's options: one line and exit 2, not a traceback
    from rollpacker.launch import main

    for argv, said in ((["--nproc-per-node"], "rollpacker: --nproc-per-node needs a value"),
                       (["--max-restarts", "x", "--num-steps", "2"], "rollpacker: --max-restarts needs a whole"),
                       (["--nproc-per-node", "abc"], "rollpacker: --nproc-per-node needs a number of ranks"),
                       (["--num-steps", "2", "--nproc-per-node=2"], "rollpacker: --nproc-per-node is torchrun's "
                        "option: put torchrun's options first, before rollpacker.run's flags (rollpacker [torchrun's")):
        err = io.StringIO()
        with redirect_stderr(err):
            assert main(argv) == 2
        assert err.getvalue().startswith(said), err.getvalue()


NESTED_STOP = """
import os, signal, sys, tempfile
from pathlib import Path
from rollpacker import launch

def ranks(agent):  # a second signal (Ctrl-C beside timeout's SIGTERM) while the first one's handler holds the lock
    if not sent:
        sent.append(os.kill(os.getpid(), signal.SIGTERM))
    return []

sent, launch.ranks = [], ranks
with tempfile.TemporaryDirectory() as tmp:
    run = launch.Launch([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), Path(tmp) / "stop")
    os.kill(os.getpid(), signal.SIGINT)
    print(run.wait(), Path(tmp, "stop").read_text())
"""


def test_a_stop_signal_during_the_launchers_handling_of_another_is_handled_after_it():
    """The handler's second run, inside the first, waited for the stop file's lock the first held: the launcher
    hung for good, and no rank heard of either stop."""
    out = subprocess.run([sys.executable, "-c", NESTED_STOP], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["-15", "2"], out.stderr  # the agent stopped (no rank yet); the file says SIGINT


@pytest.mark.parametrize("window", ["importing torch", "the agent starting"])
def test_a_stop_while_no_rank_runs_exits_0_saying_so(tmp_path, window):
    """A stop while the launcher imported torch killed it (a KeyboardInterrupt traceback, or SIGTERM's -15); one
    while torchrun's agent started killed the agent, and the launcher blamed an outside kill and exited 143."""
    proc = subprocess.Popen([sys.executable, "-m", "rollpacker.launch", "--nproc-per-node", "1", "--run-dir",
                             str(tmp_path / "run"), "--num-steps", "1"], stderr=subprocess.PIPE, text=True)
    ready = (lambda: bool(launch.ranks(proc.pid))) if window == "the agent starting" else (
        lambda: launch.installed(proc.pid))  # its handlers in (installed reads SIGUSR1's), before torch's import
    deadline = time.monotonic() + 60
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    proc.send_signal(signal.SIGTERM)
    said = proc.communicate(timeout=120)[1]
    assert proc.returncode == 0, said
    assert said.strip() == "rollpacker: stopped on SIGTERM while no rank ran (starting, or between torchrun's " \
                           "attempts): nothing to save"
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_reward_model_as_the_policy_is_refused_saying_where_it_goes(reward_model_dir):
    from rollpacker.errors import UserError
    from rollpacker.run import check_model_dir
    from rollpacker.toy.model import toy_model_dir

    with pytest.raises(UserError, match=f"is a sequence classifier .a reward model., which cannot generate: the "
                                        f"policy is a causal LM; to reward with it, --reward.funcs judge "
                                        f"--reward.judge.model-path {reward_model_dir}"):
        check_model_dir(reward_model_dir)
    check_model_dir(toy_model_dir())  # a causal LM


def test_a_lora_runs_adapter_directory_as_the_policy_is_refused_naming_the_merged_model(tmp_path):
    """A LoRA run's hf is a PEFT adapter, no model: the message names hf_merged and the adapter's base (it said
    config.json and a tokenizer were missing)."""
    import peft

    from rollpacker.errors import UserError
    from rollpacker.run import check_model_dir

    peft.LoraConfig(r=4, base_model_name_or_path="org/base").save_pretrained(str(tmp_path))
    with pytest.raises(UserError, match=r"is a PEFT adapter directory .LoRA., not a model: point at the merged model "
                                        r".a run.s hf_merged, written with --train.lora.export-merged., or merge the "
                                        r"adapter into its base .org/base. with peft"):
        check_model_dir(tmp_path)


def test_a_fresh_start_in_a_run_dir_holding_a_run_is_refused_naming_the_way_on(tmp_path):
    """It would drop the run's metrics and un-commit its checkpoints, silently."""
    from rollpacker import checkpoint
    from rollpacker.checkpoint import resolve_resume
    from rollpacker.config import Config
    from rollpacker.errors import UserError

    resolve_resume(Config(run_dir=str(tmp_path)))  # nothing there: a fresh start
    (tmp_path / "checkpoints" / "step_4").mkdir(parents=True)
    resolve_resume(Config(run_dir=str(tmp_path)))  # a save that never committed holds no run
    (tmp_path / "checkpoints" / "step_4" / checkpoint.MARKER).write_text("")
    with pytest.raises(UserError, match=f"run_dir {tmp_path} holds a run .*step_4.*: resume it with --resume auto"):
        resolve_resume(Config(run_dir=str(tmp_path)))


def test_a_finished_lora_runs_resume_names_a_merged_export_its_end_did_not_write(tmp_path):
    """A LoRA run's end writes run_dir/hf (its adapters), then run_dir/hf_merged with train.lora.export_merged: a
    run stopped between the two finished its steps, and its requeue said nothing of the missing merged model."""
    import os
    import time

    from rollpacker import checkpoint
    from rollpacker.config import Config
    from rollpacker.run import unexported

    step = tmp_path / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / checkpoint.MARKER).write_text("")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "adapter_config.json").write_text("{}")
    config = Config(run_dir=str(tmp_path), resume=str(step))
    config.train.lora.rank, config.train.lora.export_merged = 8, True
    fix = f"(stopped while writing it): python -m rollpacker.export {step} --out {tmp_path / 'hf'}"
    assert unexported(config) == f"; its Hugging Face export {tmp_path / 'hf_merged'} is missing {fix}"
    (tmp_path / "hf_merged").mkdir()
    (tmp_path / "hf_merged" / "config.json").write_text("{}")
    assert unexported(config) == ""
    old = time.time() - 60
    os.utime(tmp_path / "hf_merged" / "config.json", (old, old))  # an earlier end's merged model
    assert unexported(config) == f"; its Hugging Face export {tmp_path / 'hf_merged'} is an earlier step's {fix}"
    config.train.lora.export_merged = False  # its end writes the adapters alone
    assert unexported(config) == ""
    # what the run trained, as its checkpoint says, not this command's flags (without --train.lora.rank: hf/config.json)
    (step / "train_state.json").write_text(json.dumps({"step": 2, "export_flags": ["--train.lora.rank", "8"]}))
    assert unexported(Config(run_dir=str(tmp_path), resume=str(step))) == ""


def test_messages_name_settings_as_the_flags_typed():
    assert as_flags("data.eval_path: no such file: /d/data.eval_path.jsonl (or leave data.path empty)") == (
        "--data.eval-path: no such file: /d/data.eval_path.jsonl (or leave --data.path empty)")
    assert as_flags("num_steps=0 must be > 0; reward.on_error=fail stops; schedule.pipe with stream.enabled") == (
        "--num-steps=0 must be > 0; --reward.on-error=fail stops; --schedule.pipe with --stream.enabled")
    # file names, modules, English words that are also settings: as they are
    assert as_flags("resume from train.jsonl with my_rewards.py:f in rollpacker.run, seed 3") == (
        "resume from train.jsonl with my_rewards.py:f in rollpacker.run, seed 3")


def test_the_step_line_says_step_of_total_elapsed_eta_reward_errors_and_tokens_per_s():
    out = io.StringIO()
    display = LiveDisplay(enabled=True, stream=out, num_steps=200)
    for step in (17, 18):
        display.start_step(step, num_launched=8)
        display.end_step(step, {"time/step": 1.5, "reward/mean": 0.25, "reward/errors": 3,
                                "rollout/tokens_per_s": 812.5})
    display.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # not a terminal: one plain line per step
    assert re.fullmatch(r"step 18/200 \| 0:00:\d\d elapsed, ETA 0:0\d:\d\d \| time/step 1\.5s \| reward/mean 0\.25 \| "
                        r"reward/errors 3 \| rollout/tokens_per_s 812\.5", lines[1]), lines


def test_a_resumed_run_logs_each_step_once(tmp_path):
    with MetricsLogger(tmp_path, MetricsConfig(wandb_mode="disabled"), {}) as logger:
        for step in range(4):
            logger.log(step, {"reward/mean": step})
    with MetricsLogger(tmp_path, MetricsConfig(wandb_mode="disabled"), {}) as logger:  # resumed from step 2
        logger.start_at(2)
        for step in range(2, 5):
            logger.log(step, {"reward/mean": 10 + step})
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in records] == [(0, 0), (1, 1), (2, 12), (3, 13), (4, 14)]


def test_report_plots_eval_pass_at_k_per_source_and_each_reward_function_with_the_errors(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [{"step": s, "time/step": 1.0, "reward/mean": 0.5, "reward/correct": 0.4, "reward/format": 0.9,
              "reward/errors": s % 2, "reward/seconds_total": 2.0} for s in range(4)]
    for s in (0, 3):
        lines[s] |= {"eval/pass@1": 0.2, "eval/pass@4": 0.5, "eval/mean@4": 0.25, "eval/gsm8k/pass@1": 0.3,
                     "eval/gsm8k/pass@4": 0.6, "eval/gsm8k/mean@4": 0.3, "eval/toy/long/pass@1": 0.1}
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert report.main([str(run_dir)]) == 0
    assert all((run_dir / "plots" / name).stat().st_size for name in ("eval.png", "reward_functions.png"))
    assert sorted(report.eval_series(lines)) == ["eval/gsm8k/mean@4", "eval/gsm8k/pass@1", "eval/gsm8k/pass@4",
                                                 "eval/mean@4", "eval/pass@1", "eval/pass@4", "eval/toy/long/pass@1"]
    import matplotlib.pyplot as plt

    _, ax = plt.subplots()
    assert report.plot_eval([{"step": 0, "eval/mean@4": 1.3}, {"step": 1, "eval/mean@4": -0.5}], ax)
    low, high = ax.get_ylim()  # a reward of 1.3 (or -0.5) is on the plot, not above (below) it
    assert low < -0.5 and high > 1.3
    plt.close("all")


def test_the_rewards_page_tests_a_function_as_it_says_on_its_own_example(tmp_path, monkeypatch, capsys):
    """docs/rewards.md's "Testing your function" runs as written on the page's format_ok and distinct."""
    page = Path(__file__).resolve().parents[2] / "docs" / "rewards.md"
    blocks = dict(re.findall(r"<!-- test: (\S+) -->\n```\w+\n(.*?)```", page.read_text(), re.S))
    (tmp_path / "my_rewards.py").write_text(blocks["my_rewards.py"])
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks["testing"], "testing", "exec"), {})  # noqa: S102 - the page's own snippet
    assert capsys.readouterr().out == "(1.0, {}, {})\n"
    (tmp_path / "my_group_rewards.py").write_text(blocks["my_group_rewards.py"])
    exec(compile(blocks["testing-group"], "testing-group", "exec"), {})  # noqa: S102 - the page's own snippet
    assert capsys.readouterr().out == "[0.5, 0.5, 1.0]\n"


def test_the_live_display_on_a_terminal_shows_the_run_and_the_rollout():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    display = LiveDisplay(enabled=True, stream=out, num_steps=10)
    display.note("the summary")
    display.start_step(3, num_launched=4)
    display.update(2, 4, tokens_per_s=50.0)
    display.end_step(3, {"reward/mean": 1.0, "reward/errors": 0, "rollout/tokens_per_s": 50.0})
    display.close()
    assert "the summary" in out.getvalue() and re.search(r"step 3/10 \| 0:00:\d\d elapsed", out.getvalue())


def test_a_resumed_run_keeps_the_evaluation_of_the_step_it_resumes_from(tmp_path):
    """A finished run's final evaluation (an ``eval/`` line at its last step) is of the weights a
    resumed run (more steps) starts from: it goes into that step's line unless the step evaluates
    again, and is written back as it was if the resumed run logs nothing of that step."""
    def run(first: list[tuple[int, dict]], resumed: list[tuple[int, dict]], start: int) -> list[dict]:
        path = tmp_path / "metrics.jsonl"
        path.unlink(missing_ok=True)
        for steps, at in ((first, None), (resumed, start)):
            with MetricsLogger(tmp_path, MetricsConfig(wandb_mode="disabled"), {}) as logger:
                if at is not None:
                    logger.start_at(at)
                for step, metrics in steps:
                    logger.log(step, metrics)
        return [json.loads(line) for line in path.read_text().splitlines()]

    finished = [(0, {"reward/mean": 0.0}), (1, {"reward/mean": 1.0}), (2, {"eval/accuracy": 0.5})]
    assert run(finished, [(2, {"reward/mean": 2.0}), (3, {"reward/mean": 3.0})], 2) == [
        {"step": 0, "reward/mean": 0.0}, {"step": 1, "reward/mean": 1.0},
        {"step": 2, "reward/mean": 2.0, "eval/accuracy": 0.5}, {"step": 3, "reward/mean": 3.0}]
    again = run(finished, [(2, {"eval/accuracy": 0.75, "reward/mean": 2.0})], 2)  # the step evaluates again
    assert again[-1] == {"step": 2, "eval/accuracy": 0.75, "reward/mean": 2.0} and len(again) == 3
    assert run(finished, [], 2) == [{"step": s, **m} for s, m in finished]  # stopped before logging it
    assert len(run(finished, [(1, {"reward/mean": 1.5})], 1)) == 1 + 1  # a step redone: its later evaluation too
    run(finished, [], 2)
    resumed = MetricsLogger(tmp_path, MetricsConfig(wandb_mode="disabled"), {})
    resumed.start_at(2)  # killed before logging step 2: the evaluation is in the file all the same
    assert (tmp_path / "metrics.jsonl").read_text().splitlines()[-1] == '{"step": 2, "eval/accuracy": 0.5}'
    resumed.log(2, {"reward/mean": 2.0})
    resumed.close()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:] == [
        {"step": 1, "reward/mean": 1.0}, {"step": 2, "reward/mean": 2.0, "eval/accuracy": 0.5}]


def test_a_presets_error_names_its_settings_as_the_file_writes_them(tmp_path):
    """A preset's unknown key was answered "(valid: --run-dir, seed, --num-steps, ...)": flags, in a TOML file."""
    (tmp_path / "mine.toml").write_text("num_step = 5\n")
    run = subprocess.run([sys.executable, "-m", "rollpacker.run", "--preset", str(tmp_path / "mine.toml")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "mine.toml: unknown setting 'num_step' (valid: run_dir, seed, num_steps, num_epochs," in run.stderr
