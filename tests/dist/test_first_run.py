"""A user's first GPU-week (issue #36) on 2 real ranks, through the ``rollpacker`` launcher
(``python -m rollpacker.launch``) and plain torchrun:

- Ctrl-C mid-run stops after the step, every reward of it scored (reward/errors 0), with a committed
  checkpoint, one line on how to go on and exit 0; the start summary shows a prompt as the engine
  gets it, and each sample's ``prompt_text`` is the decode of the ids the engine received;
- ``--resume auto`` passes over a damaged newest checkpoint with one warning naming the file, a
  reward function failing on 1 row in 10 does not stop the run, every prompt is trained once and
  metrics.jsonl holds each step once; SIGTERM to torchrun stops it the same way;
- a function returning a string for every response stops the run: one line, the last, no traceback;
- a second Ctrl-C during a save stops at once and leaves nothing that resume would pick.

The damaged checkpoints of every kind (shard, .metadata, train state) are unit-tested
(tests/unit/test_faults.py); the stalled rank 0 is tests/dist/test_faults.py's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.jobs import QUIET, job_env

from rollpacker import checkpoint
from rollpacker.bench.faults import worker_pid

NUM_ROWS = 24
SYSTEM = "Add."
FUNCTIONS = '''
def as_string(completions, **kwargs):  # a first-run classic: the reward as text
    return ["1.0" for _ in completions]

def one_in_ten(completions, id, trainer_state, **kwargs):  # fails on rows:3, rows:13, rows:23
    if id[0].endswith("3"):
        raise ValueError(f"row three at step {trainer_state.global_step}")
    return [None]

def down_at_first(completions, **kwargs):  # a sandbox down during torchrun's first attempt only
    import os
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        raise ConnectionError("the sandbox is down")
    return [1.0 for _ in completions]

def siblings(completions, **kwargs):  # a group function (reward.group_funcs): the size of its group
    return [float(len(completions))] * len(completions)
'''


def write_task(tmp_path: Path) -> Path:
    """NUM_ROWS toy problems as chat messages (the toy model's template renders them) and the functions."""
    from rollpacker.toy import task as toy

    rows = [{"prompt": [{"role": "user", "content": r["prompt"][3:-3]}], "answer": r["answer"]}
            for r in toy.make_dataset(NUM_ROWS, seed=0)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "funcs.py").write_text(FUNCTIONS)
    return tmp_path / "rows.jsonl"


def args(tmp_path: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["schedule:tail", "--data.path", str(tmp_path / "rows.jsonl"), "--data.system-prompt", SYSTEM,
            "--rollout.num-prompts", "4", "--rollout.group-size", "2", "--rollout.max-new-tokens", "32",
            "--num-epochs", "1", "--num-steps", "100", "--checkpoint-every", "1", "--eval-every", "0",
            "--metrics.samples-every", "1", "--run-dir", str(run_dir), *QUIET,
            *(() if "--reward.funcs" in extra else ("--reward.funcs", "toy")), *extra]  # the rows are the toy task's


def start(tmp_path: Path, name: str, command: list[str], **env: str) -> tuple[subprocess.Popen, Path, Path]:
    """``command`` in its own session (as a terminal would run it), its output in files."""
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(command, stdout=o, stderr=e, start_new_session=True, cwd=tmp_path,
                                env=job_env(**env))
    return proc, out, err


def launcher(*flags: str) -> list[str]:
    return [sys.executable, "-m", "rollpacker.launch", "--nproc-per-node", "2", *flags]


def torchrun(*flags: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
            "rollpacker.run", *flags]


def wait_until(proc: subprocess.Popen, ready, timeout: float = 600, poll: float = 0.05) -> None:
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, "the job ended before the point the test waits for"
        assert time.time() < deadline, "timed out waiting for the job"
        time.sleep(poll)


def finish(proc: subprocess.Popen, timeout: float = 600) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def stepped(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def no_traceback(text: str) -> None:
    assert "Traceback" not in text, text[-4000:]


@pytest.mark.timeout(1500)
def test_ctrl_c_stops_cleanly_and_resume_passes_a_damaged_checkpoint_training_each_prompt_once(tmp_path):
    from transformers import AutoTokenizer

    from rollpacker.data.chat import encode, render
    from rollpacker.toy.model import toy_model_dir

    write_task(tmp_path)
    run_dir = tmp_path / "run"
    proc, out, err = start(tmp_path, "first", launcher(*args(tmp_path, run_dir)))
    wait_until(proc, lambda: stepped(run_dir) >= 2)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at a terminal: the launcher's process group
    assert finish(proc) == 0, err.read_text()[-4000:]
    said = err.read_text()
    no_traceback(said)
    stopped = checkpoint.latest(run_dir)
    step = int(stopped.name.split("_")[1])
    assert f"rollpacker: SIGINT: stopping after step {step - 1} with a checkpoint" in said, said
    assert said.rstrip().endswith(f"rollpacker: stopped on SIGINT with {step} of 100 steps done; the newest "
                                  f"committed checkpoint is {stopped}: run the same command with --resume auto to go "
                                  "on"), said
    first = records(run_dir)
    assert [r["step"] for r in first] == list(range(step)) and first[-1]["reward/errors"] == 0

    # what the model saw: the summary before step 0, and prompt_text in every sample
    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir())
    shown = out.read_text()
    assert "as the engine gets it" in shown and f"    | {SYSTEM}\n    | Q: " in shown, shown
    for sample in map(json.loads, (run_dir / "samples" / "step_0.jsonl").read_text().splitlines()):
        ids = encode(tokenizer, sample["prompt"], system_prompt=SYSTEM)
        assert sample["prompt_text"] == tokenizer.decode(ids) == render(tokenizer, sample["prompt"],
                                                                        system_prompt=SYSTEM)
        assert sample["prompt_text"].startswith(f"{SYSTEM}\nQ: ")

    # the newest checkpoint damaged; resumed by plain torchrun, with a function failing on 1 row in 10 and a
    # group function, weighted 0, each normalized in its group before the sum (GDPO: its parts from every function)
    (stopped / ".metadata").write_bytes((stopped / ".metadata").read_bytes()[:100])
    resume = args(tmp_path, run_dir, "--resume", "auto", "--reward.funcs", "toy", "funcs.py:one_in_ten",
                  "funcs.py:siblings", "--reward.weights", "1", "1", "0", "--reward.group-funcs", "siblings",
                  "--train.advantage", "gdpo")
    proc, out, err = start(tmp_path, "resumed", torchrun(*resume))
    assert finish(proc) == 0, err.read_text()[-4000:]
    said = err.read_text()
    no_traceback(said)
    previous = run_dir / "checkpoints" / f"step_{step - 1}"
    assert said.count("is damaged") == 1 and (
        f"rollpacker: warning: checkpoint {stopped} is damaged: {stopped / '.metadata'} cannot be read") in said
    assert f"resuming from {previous}" in said
    final = records(run_dir)
    assert [r["step"] for r in final] == list(range(NUM_ROWS // 4))  # each step once
    assert all(r["reward/siblings"] == 2.0 for r in final[step - 1:])  # called on each group of 2, every step
    resumed = [json.loads(line) for r in final[step - 1:]
               for line in (run_dir / "samples" / f"step_{r['step']}.jsonl").read_text().splitlines()]
    assert resumed and all(s["rewards"]["siblings"] == 2.0 for s in resumed)
    trained = json.loads((checkpoint.latest(run_dir) / "train_state.json").read_text())["policy"]["ledger"]["trained"]
    assert sorted(trained) == [[0, row] for row in range(NUM_ROWS)]  # every prompt once
    failed = [r["step"] for r in final if r["reward/errors"]]  # trained on, scored 0: the run went on
    assert failed, final
    for step in failed:  # one line per step, with a count; TRL's trainer_state reached the function: the step
        # scoring it, or the one before (a response of that round whose scoring ended after it was logged)
        said_at = re.search(rf"reward function 'one_in_ten' failed on {final[step]['reward/errors']} of \d+ "
                            rf"responses at step {step}, scored 0 \(--reward.on-error skip\); first on row "
                            rf"'rows:\d*3': raised ValueError: row three at step (\d+)\n", said)
        assert said_at and int(said_at[1]) in (step - 1, step), said[-4000:]
    assert said.count("reward function 'one_in_ten' failed on") == len(failed)


@pytest.mark.timeout(600)
def test_a_ctrl_c_while_the_ranks_start_stops_them_before_the_first_step_and_torchrun_restarts_nothing(tmp_path):
    """Ctrl-C as soon as the ranks exist, before their stop handlers are in: it killed them (a KeyboardInterrupt
    traceback), torchrun (--max-restarts) started them again, and the run trained every step, the stop lost. The
    launcher signals only the ranks whose handlers are in; the others read its stop file once theirs are."""
    from rollpacker.launch import ranks

    write_task(tmp_path)
    run_dir = tmp_path / "run"
    proc, out, err = start(tmp_path, "early", [*launcher("--max-restarts", "2"), *args(tmp_path, run_dir)])
    wait_until(proc, lambda: any(ranks(agent) for agent in ranks(proc.pid)), poll=0.002)
    os.killpg(proc.pid, signal.SIGINT)
    assert finish(proc) == 0, err.read_text()[-4000:]
    said = err.read_text()
    no_traceback(said)
    assert "rollpacker: SIGINT: stopping before the first step (still starting: nothing to save)" in said, said
    assert "attempt" not in said and stepped(run_dir) == 0, said[-4000:]


@pytest.mark.slow  # its message: tests/unit/reward/test_functions.py; a reward function stopping a real job with one
@pytest.mark.timeout(600)  # line and no traceback: tests/dist/test_your_task.py
def test_a_function_returning_a_string_stops_the_run_with_one_line_naming_it(tmp_path):
    write_task(tmp_path)
    proc, out, err = start(tmp_path, "string", launcher(*args(tmp_path, tmp_path / "run", "--reward.funcs",
                                                              "funcs.py:as_string")))
    assert finish(proc) == 1
    said = err.read_text()
    no_traceback(said)
    last = said.rstrip().splitlines()[-1]
    assert re.match(r"rollpacker: reward function 'as_string' failed on (\d+) of \1 responses at step 0: all of "
                    r"them, first on row 'rows:\d+': ", last), said[-4000:]
    assert "returned str '1.0' for a completion; expected a float, an int or None. Stopped before training" in last
    assert said.count("'as_string' failed") == 1
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained on it


@pytest.mark.slow  # two attempts of a job, 30 s of the default tier; a restart that resumes: test_faults.py
@pytest.mark.timeout(600)
def test_an_error_of_an_attempt_torchrun_restarted_is_said_as_that_and_does_not_fail_the_next(tmp_path):
    """The launcher's error file was one for the whole job: after torchrun restarted a failed attempt, the next
    attempt's ranks took it for their own error (no heartbeats: a false "did not answer") and the launcher said
    the old error last and exited 1 for a job that finished."""
    write_task(tmp_path)
    run_dir = tmp_path / "run"
    proc, out, err = start(tmp_path, "restarted", launcher("--max-restarts", "1", *args(
        tmp_path, run_dir, "--reward.funcs", "funcs.py:down_at_first", "--num-steps", "2")))
    said = err.read_text() if finish(proc) else err.read_text()[-4000:]
    assert proc.returncode == 0, said
    assert re.search(r"^\(torchrun's attempt 0, restarted\) rollpacker: reward function 'down_at_first' failed on "
                     r".*the sandbox is down", said, re.M), said[-4000:]
    assert len(records(run_dir)) == 2


@pytest.mark.slow  # the first Ctrl-C's stop and resume: the test above
@pytest.mark.timeout(600)
def test_a_second_ctrl_c_during_a_save_stops_at_once_leaving_nothing_resume_picks(tmp_path):
    write_task(tmp_path)
    run_dir = tmp_path / "run"
    proc, out, err = start(tmp_path, "twice", launcher(*args(tmp_path, run_dir)))

    def saving() -> bool:
        return stepped(run_dir) >= 2 and any(not (p / checkpoint.MARKER).exists()
                                             for p in (run_dir / "checkpoints").glob("step_*"))

    wait_until(proc, saving, poll=0.001)
    stopped = worker_pid(run_dir, 1)  # the save cannot commit without rank 1: the Ctrl-Cs land inside it
    os.kill(stopped, signal.SIGSTOP)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.2)  # a person's second Ctrl-C (two signals at once merge into one)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(1)  # rank 0 aborts at once; rank 1, let go, finds it gone
    os.kill(stopped, signal.SIGCONT)
    assert finish(proc) == 130
    said = err.read_text()
    no_traceback(said)
    assert "rollpacker: stopped at once on a second Ctrl-C at step" in said, said[-4000:]
    partial = [p for p in (run_dir / "checkpoints").glob("step_*") if not (p / checkpoint.MARKER).exists()]
    assert partial, "the save committed before the second Ctrl-C"
    newest = checkpoint.newest_whole(run_dir)
    assert newest == checkpoint.latest(run_dir) and newest not in partial
    assert int(newest.name.split("_")[1]) < int(partial[0].name.split("_")[1])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_step_off_stops_on_sigterm_at_a_boundary_and_resumes_training_each_prompt_once(tmp_path):
    """one_step_off's own loop (a rollout pool and a training pool), through the launcher: SIGTERM to the
    job's process group (Slurm's scancel) mid-run stops it after the step in training, with a committed
    checkpoint and exit 0, the stop naming that step; resumed, every prompt is trained once and every step
    logged once (the batch generated ahead at the stop is drawn again)."""
    write_task(tmp_path)
    run_dir = tmp_path / "run"
    flags = ["schedule:one_step_off", *args(tmp_path, run_dir)[1:], "--train.train-shard-size", "1",
             "--train.rollout-correction", "token_tis"]
    proc, out, err = start(tmp_path, "first", launcher(*flags))
    wait_until(proc, lambda: stepped(run_dir) >= 2)
    os.killpg(proc.pid, signal.SIGTERM)
    assert finish(proc) == 0, err.read_text()[-4000:]
    said = err.read_text()
    no_traceback(said)
    step = int(checkpoint.latest(run_dir).name.split("_")[1])
    assert f"rollpacker: SIGTERM: stopping after step {step - 1} with a checkpoint" in said, said[-4000:]
    assert f"rollpacker: stopped on SIGTERM with {step} of 100 steps done" in said, said[-4000:]
    assert checkpoint.newest_whole(run_dir) == checkpoint.latest(run_dir)
    proc, out, err = start(tmp_path, "resumed", torchrun(*flags, "--resume", "auto"))
    assert finish(proc) == 0, err.read_text()[-4000:]
    assert [r["step"] for r in records(run_dir)] == list(range(NUM_ROWS // 4))  # each step once
    trained = [json.loads(line)["row"] for path in (run_dir / "samples").glob("step_*.jsonl")
               for line in path.read_text().splitlines()]
    assert sorted(trained) == sorted(f"rows:{i}" for i in range(1, NUM_ROWS + 1) for _ in range(2))  # each prompt once
