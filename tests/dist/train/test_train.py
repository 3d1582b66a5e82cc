"""The trainer and the RL loop on real gloo ranks."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.jobs import QUIET, launch_job, torchrun


def test_two_rank_step_equals_single_process_reference(toy_random_dir):
    out = torchrun("train_step.py", 2, str(toy_random_dir))
    assert out.count("OK") == 2, out


SMALL = ("--data.num-toy-prompts", "8", "--rollout.num-prompts", "4", "--rollout.group-size", "2",
         "--rollout.max-new-tokens", "24", "--eval-every", "0", *QUIET)
"""The export tests' 2-rank job, ``--num-steps`` and ``--run-dir`` given after it."""


def run_failing_its_export(run_dir: Path) -> subprocess.CompletedProcess:
    """A 1-step job in ``run_dir`` whose final export fails (a file where the export's directory goes)."""
    run_dir.mkdir()
    (run_dir / ".hf.partial").write_text("")
    return launch_job(*SMALL, "--num-steps", "1", "--run-dir", str(run_dir))


def test_a_failed_final_export_is_said_once_naming_the_command_that_writes_it(tmp_path):
    """The run's end writes its policy to run_dir/hf; a write that fails there (here: a file where the
    export's directory goes) is one line, no traceback, naming the committed checkpoint and the command
    that exports it, which then does."""
    run_dir = tmp_path / "run"
    proc = run_failing_its_export(run_dir)
    newest, hf = run_dir / "checkpoints" / "step_1", run_dir / "hf"
    # one line, no traceback of ours (torchrun prints its own on a failed rank)
    assert proc.returncode == 1 and not re.search(r'File ".*/rollpacker/', proc.stderr), proc.stderr[-4000:]
    said = f"rollpacker: export: writing the policy to {hf} failed ([Errno 17] File exists: "
    assert proc.stderr.count(said) == 1, proc.stderr[-4000:]
    assert (f"the run's newest committed checkpoint is {newest}: free disk space or fix the permissions there, then "
            f"python -m rollpacker.export {newest} --out {hf}\n") in proc.stderr
    proc = launch_job(str(newest), "--out", str(hf), nproc=1, module="rollpacker.export")  # the same fault: said
    assert proc.returncode == 1 and proc.stderr.endswith(f"rollpacker: export: writing {hf} failed ([Errno 17] File "
                                                         f"exists: '{run_dir / '.hf.partial'}'): free disk space or "
                                                         "fix the permissions there, then run this again\n")
    (run_dir / ".hf.partial").unlink()
    hf.mkdir()  # --out . from inside it: Path(".").with_name failed after the whole build ("has an empty name")
    proc = launch_job(str(newest), "--out", ".", nproc=1, module="rollpacker.export", cwd=hf)
    assert proc.returncode == 0 and (hf / "model.safetensors").is_file(), proc.stderr[-4000:]


@pytest.mark.slow  # a requeue's three jobs and seven export runs; a failed export said and written: the test above
def test_a_requeued_run_says_its_export_is_an_earlier_steps_and_the_export_refuses_what_it_would_lose(tmp_path):
    """After a failed final export and a run on whose export fails in turn, the requeued run says its
    run_dir/hf is an earlier step's; the export refuses an --out it would replace holding what is not an
    export, a moved model directory and a damaged checkpoint, each in one line naming the fix."""
    run_dir = tmp_path / "run"
    assert run_failing_its_export(run_dir).returncode == 1
    newest, hf = run_dir / "checkpoints" / "step_1", run_dir / "hf"
    (run_dir / ".hf.partial").unlink()
    assert launch_job(str(newest), "--out", str(hf), nproc=1, module="rollpacker.export").returncode == 0
    # a run on to step 2 whose final export fails in turn, then requeued: its run_dir/hf is step 1's, said so
    (run_dir / ".hf.partial").write_text("")
    more = [*SMALL, "--num-steps", "2", "--run-dir", str(run_dir), "--resume", "auto"]
    assert launch_job(*more).returncode == 1
    proc = launch_job(*more)
    assert proc.returncode == 0 and proc.stderr.rstrip().endswith(
        f"nothing to train (raise --num-steps to go on); its Hugging Face export {hf} is an earlier step's (stopped "
        f"while writing it): python -m rollpacker.export {run_dir / 'checkpoints' / 'step_2'} --out {hf}"), (
        proc.stderr[-4000:])
    (run_dir / ".hf.partial").unlink()
    # an --out the export would replace whole while it holds what is not an export: refused, nothing touched (the
    # run's own directory was deleted, its checkpoints and metrics with it)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "plan.txt").write_text("mine")
    plan = tmp_path / "notes" / "plan.txt"
    for out, said in ((run_dir, f"the export replaces {run_dir} whole, and it holds the checkpoint {newest}"),
                      (tmp_path / "notes", "holds files that are not an export's (plan.txt, ...)"),
                      (plan, f"{plan} is a file, and the export writes a directory there")):  # was a failed rename
        proc = launch_job(str(newest), "--out", str(out), nproc=1, module="rollpacker.export")
        assert proc.returncode == 1 and said in proc.stderr.splitlines()[-1], proc.stderr[-4000:]
    assert newest.is_dir() and (run_dir / "metrics.jsonl").is_file() and plan.read_text() == "mine"
    assert sorted(p.name for p in plan.parent.iterdir()) == ["plan.txt"]  # no .plan.txt.partial left
    # the run's model directory moved since: said with the fix (it was errno 2 on its config.json)
    proc = launch_job(str(newest), "--out", str(tmp_path / "out"), "--", "--model.path", str(tmp_path / "moved"),
                      nproc=1, module="rollpacker.export")
    assert proc.returncode == 1 and proc.stderr.splitlines()[-1] == (
        f"rollpacker: export: --model.path: {tmp_path / 'moved'} is not a directory: point it at a Hugging Face model "
        "directory (config.json, safetensors weights, tokenizer), or leave it empty for the toy model. The "
        "checkpoint's run read it there: a model moved since is given after --, as -- --model.path NEW"), proc.stderr
    # a damaged checkpoint is one line naming its file, worded for the export (not DCP's tracebacks)
    damaged = tmp_path / "copy" / "checkpoints" / "step_1"
    shutil.copytree(newest, damaged)
    (damaged / ".metadata").unlink()
    for given, said in ((damaged, f"checkpoint {damaged} is damaged: {damaged / '.metadata'} cannot be read"),
                        (damaged.parent, f"every committed checkpoint under {damaged.parent} is damaged "
                                         f"({damaged / '.metadata'} cannot be read")):
        proc = launch_job(str(given), "--out", str(tmp_path / "out"), nproc=1, module="rollpacker.export")
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
        assert proc.stderr.splitlines()[-1].startswith(f"rollpacker: export: {said}"), proc.stderr[-4000:]


def test_two_rank_run_writes_metrics_checkpoints_and_resumes(toy_random_dir, tmp_path):
    # the random model's rewards are 0: the entropy bonus makes its weights (and Adam's moments) move all the same;
    # its KL stays far under the target, so the adaptive coefficient falls each step, and the KL reference moves toward
    # the policy each step (a resume must keep both). PPO's critic learns the KL in the reward (a resume must keep its
    # weights, its optimizer and its schedule too)
    common = ["--model.path", str(toy_random_dir), "--run-dir", str(tmp_path), "--rollout.num-prompts", "4",
              "--rollout.group-size", "4", "--rollout.max-new-tokens", "24", "--metrics.wandb-mode", "disabled",
              "--checkpoint-every", "1", "--eval-every", "0", "--train.entropy-coef", "0.01", "--train.kl-coef", "0.05",
              "--train.kl-target", "0.1", "--train.kl-horizon", "32", "--train.ref-sync-steps", "1",
              "--train.kl-in-reward", "--train.advantage", "gae", "--train.lam", "0.9"]
    proc = launch_job(*common, "--num-steps", "3", "--eval-every", "3", "--data.num-eval-prompts", "8",
                      "--checkpoint.export-hf-each", nproc=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # each checkpoint holds the policy of its step as a Hugging Face model; the last one's is the run's export
    exported = {step: load_file(tmp_path / "checkpoints" / f"step_{step}" / "hf" / "model.safetensors")
                for step in (1, 2, 3)}
    final = load_file(tmp_path / "hf" / "model.safetensors")
    assert final.keys() == exported[3].keys() and all(torch.equal(final[k], exported[3][k]) for k in final)
    assert not all(torch.equal(exported[1][k], exported[2][k]) for k in final)  # step 1 trained on
    assert (tmp_path / "checkpoints" / "step_1" / "hf" / "tokenizer.json").is_file()
    # the export tool writes the same from the checkpoint afterwards, on one process (DCP reshards the two ranks'),
    # built from the model the checkpoint names (its export_flags: no flag of the run's to give again)
    out = tmp_path / "exported"
    proc = launch_job(str(tmp_path / "checkpoints" / "step_1"), "--out", str(out), nproc=1, module="rollpacker.export")
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = load_file(out / "model.safetensors")
    assert again.keys() == final.keys() and all(torch.equal(again[k], exported[1][k]) for k in again)
    assert (out / "config.json").read_text() == (tmp_path / "hf" / "config.json").read_text()
    proc = launch_job(str(tmp_path), "--out", str(out), nproc=1, module="rollpacker.export")  # the run's newest
    assert proc.returncode == 0, proc.stderr[-4000:]
    newest = load_file(out / "model.safetensors")
    assert all(torch.equal(newest[k], final[k]) for k in final) and not (tmp_path / ".exported.partial").exists()
    written = (tmp_path / "hf" / "model.safetensors").stat().st_mtime_ns
    proc = launch_job(str(tmp_path), nproc=1, module="rollpacker.export")  # a run's: its newest checkpoint's hf
    assert proc.returncode == 0, proc.stderr[-4000:]  # (it replaced the run's own export, run_dir/hf)
    assert (tmp_path / "hf" / "model.safetensors").stat().st_mtime_ns == written
    assert (tmp_path / "checkpoints" / "step_3" / "hf" / "model.safetensors").stat().st_mtime_ns > written
    straight = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in straight] == [0, 1, 2, 3]  # step 3: the final evaluation
    assert [("eval/accuracy" in r) for r in straight] == [True, False, False, True]
    for key in ("time/rollout", "time/reward", "time/reward_exposed", "reward/seconds_total", "time/train",
                "time/weight_sync", "time/step", "sched/round_kind", "sched/aborted_responses", "rollout/wasted_tokens",
                "rollout/bubble_ratio", "rollout/response_len_p90", "rollout/tokens_per_s", "reward/mean",
                "reward/accuracy", "train/grad_norm"):
        assert key in straight[0], key
    assert len(straight[0]["rollout/response_lengths"]) == 16
    assert straight[0]["train/rollout_logprob_diff"] < 1e-3  # engine and trainer agree on the policy
    assert [r["train/kl_coef"] for r in straight[:3]] == pytest.approx([0.05, 0.05 * 0.9, 0.05 * 0.9 * 0.9])
    assert (tmp_path / "checkpoints" / "step_2" / "COMMITTED").exists()
    # resumed at step 2 (the run's step 2 and final evaluation dropped from its record, done again): step 2 is the
    # uninterrupted run's, bit for bit (seeded sampling, exact fp32 state)
    proc = launch_job(*common, "--num-steps", "3", "--resume", str(tmp_path / "checkpoints" / "step_2"), nproc=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("resume: this run's settings differ from the checkpoint's: --eval-every: 3 -> 0, "
                             "--checkpoint.export-hf-each: True -> False, --data.num-eval-prompts: 8 -> 256 "
                             "(they apply") == 1, (
        proc.stderr[-4000:])
    resumed = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [0, 1, 2]  # each step once
    timing = ("time/", "_per_s", "seconds", "wait_ratio", "bubble_ratio")  # wall-clock measurements
    same = {k: v for k, v in straight[2].items() if not any(t in k for t in timing)}
    assert {k: resumed[2].get(k) for k in same} == same
    assert "train/loss" in same and "train/grad_norm" in same and "rollout/response_lengths" in same
    assert same["critic/vf_loss"] > 0 and same["critic/grad_norm"] > 0
    # on another dataset: one line naming the checkpoint and the way out (it was a traceback of rank 0)
    step_2 = tmp_path / "checkpoints" / "step_2"
    proc = launch_job(*common, "--num-steps", "3", "--data.num-toy-prompts", "100", "--resume", str(step_2), nproc=2)
    assert proc.returncode != 0 and "ValueError" not in proc.stderr, proc.stderr[-4000:]  # torchrun's own traceback
    assert proc.stderr.count(f"rollpacker: resume: {step_2}: sampler checkpoint has num_rows=2048 but this run has "
                             "num_rows=100") == 1, proc.stderr[-4000:]
    # a resume from an older checkpoint that stops before its first save: the later checkpoints, whose steps'
    # records it dropped, are un-committed as it starts (--resume auto went back to them, their records gone)
    (tmp_path / "down.py").write_text("def down(completions, **kwargs):\n    raise ConnectionError('down')\n")
    proc = launch_job(*common, "--num-steps", "3", "--resume", str(tmp_path / "checkpoints" / "step_1"),
                      "--reward.funcs", f"{tmp_path / 'down.py'}:down", nproc=2)
    assert proc.returncode != 0 and "ConnectionError: down" in proc.stderr, proc.stderr[-4000:]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0]
    assert sorted(p.parent.name for p in (tmp_path / "checkpoints").glob("step_*/COMMITTED")) == ["step_1"]


def test_missing_checkpoint_and_bad_world_are_clear_errors(toy_random_dir, tmp_path):
    proc = launch_job("--resume", str(tmp_path / "nowhere"), nproc=1)
    assert proc.returncode != 0 and str(tmp_path / "nowhere") in proc.stderr
    proc = launch_job("--model.path", str(toy_random_dir), "--rollout.num-prompts", "3", "--rollout.group-size", "3",
                      "--metrics.wandb-mode", "disabled", "--run-dir", str(tmp_path), nproc=2)
    assert proc.returncode != 0
    assert "--rollout.num-prompts x --rollout.group-size" in proc.stderr  # the flags, as typed
