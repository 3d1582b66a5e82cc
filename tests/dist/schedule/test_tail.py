"""Tail batching for real: 2 gloo ranks, the shipped toy model, two epochs of a small dataset,
and SIGKILLs mid-round and mid-save followed by ``--resume auto``. The reference and the killed run
decode speculatively, with drafts from deferred prompts' cut responses and the first epoch's, and
dispatch long rounds longest first (#30): the ledger and the resume equality hold unchanged."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.jobs import NUM_ROWS, finish, kill_when, ledger, steps, trained
from support.jobs import start_job as launch

SPEC = ("--engine.speculative", "on", "--rollout.longest-first")
"""Every draft verified (``on``, not ``auto``: no measured cost table, so the kill and resume decode alike)."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("tail_reference")
    finish(launch(run_dir, *SPEC))
    return run_dir


def test_two_epochs_train_every_prompt_exactly_once(reference):
    assert trained(reference) == {0: list(range(NUM_ROWS)), 1: list(range(NUM_ROWS))}
    state = ledger(reference)
    assert state["queue"] == [] and state["filtered"] == []
    records = steps(reference).values()
    kinds = [r["sched/round_kind"] for r in records]
    assert "long" in kinds and "short" in kinds, kinds
    assert sum(r["sched/trained_prompts"] for r in records) == 2 * NUM_ROWS
    assert any(r["sched/deferred"] for r in records) and any(r["rollout/wasted_tokens"] for r in records)
    for r in records:
        assert len(r["rollout/response_lengths"]) == 2 * r["sched/trained_prompts"]
    accepted = lambda source: sum(r.get(f"rollout/spec_acceptance/{source}", 0) for r in records)  # noqa: E731
    assert accepted("partial") > 0 and accepted("epoch") > 0  # the controller's drafts reached the engines


def test_the_run_ends_with_its_policy_as_a_hugging_face_model(reference, tmp_path):
    """``run_dir/hf``: the final checkpoint's weights (trained away from the start), the shipped tokenizer."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoTokenizer

    from rollpacker.checkpoint import latest
    from rollpacker.model import load_model
    from rollpacker.toy.model import toy_model_dir

    dcp_to_torch_save(latest(reference), tmp_path / "final.pt")
    final = torch.load(tmp_path / "final.pt")["model"]
    exported = load_model(reference / "hf").state_dict()
    assert set(exported) == set(final) and all(torch.equal(exported[k], final[k]) for k in final)
    start = load_model(toy_model_dir()).state_dict()
    assert not all(torch.equal(exported[k], start[k]) for k in start)
    text = "Q: 3+5-2\nA:"
    assert AutoTokenizer.from_pretrained(reference / "hf").encode(text) == AutoTokenizer.from_pretrained(
        toy_model_dir()).encode(text)


def test_sigkill_mid_round_and_mid_save_then_resume_loses_and_repeats_nothing(reference, tmp_path):
    def lines() -> int:
        path = tmp_path / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def saving() -> bool:  # a checkpoint directory without its commit marker: a save in progress
        return any(not (p / "COMMITTED").exists() for p in (tmp_path / "checkpoints").glob("step_*"))

    # 1. mid-round: step 3's metrics are out, step 4's round is running
    assert kill_when(launch(tmp_path, *SPEC), tmp_path, lambda: lines() >= 3 and (time.sleep(0.2) or True))
    # 2. mid-save, after resuming: caught while a checkpoint directory has no marker yet
    start = lines()
    caught = kill_when(launch(tmp_path, *SPEC, "--resume", "auto"), tmp_path, lambda: lines() > start and saving())
    assert caught, "the run ended before a save could be interrupted"
    assert saving()  # the interrupted save is on disk; --resume auto must skip it
    finish(launch(tmp_path, *SPEC, "--resume", "auto"))

    assert trained(tmp_path) == trained(reference)
    got, want = steps(tmp_path), steps(reference)
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step]["sched/round_kind"] == want[step]["sched/round_kind"]
        assert got[step]["train/loss"] == pytest.approx(want[step]["train/loss"], rel=1e-6, abs=1e-9), step


def test_sync_refill_trains_p0_groups_a_step_and_every_row_once(tmp_path):
    """DAPO's dynamic sampling under sync: a dropped group's slot goes to a fresh prompt."""
    from support.jobs import QUIET, launch_job

    proc = launch_job("schedule:sync", "--schedule.filter-zero-variance", "--schedule.refill", "--data.num-toy-prompts",
                      str(NUM_ROWS), "--rollout.num-prompts", "4", "--rollout.group-size", "4",
                      "--rollout.max-new-tokens", "96", "--num-epochs", "1", "--num-steps", "100", "--eval-every", "0",
                      "--checkpoint-every", "0", "--checkpoint.no-export-hf", *QUIET, "--run-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [steps(tmp_path)[s] for s in sorted(steps(tmp_path))]
    kept, dropped = [r["sched/trained_prompts"] for r in records], [r["sched/filtered"] for r in records]
    assert kept[:-1] == [4] * (len(kept) - 1) and 0 < kept[-1] <= 4  # the last round kept what was left
    assert sum(kept) + sum(dropped) == NUM_ROWS and sum(dropped) > 0


@pytest.mark.slow  # the sampler's retiring is unit-tested (tests/unit/data/test_data.py); the ledger under it, here
def test_solved_prompts_retire_from_the_next_epoch_and_the_rest_train_once(tmp_path):
    """``--data.retire-solved 1``: a prompt all 4 responses solved (a zero-variance group, so filtered) is not
    drawn again; every other prompt of epoch 0 is, once."""
    finish(launch(tmp_path, "--schedule.filter-zero-variance", "--data.retire-solved", "1",
                  "--rollout.group-size", "4"))
    state = ledger(tmp_path)
    drawn = {e: sorted(row for epoch, row in state["trained"] + state["filtered"] if epoch == e) for e in (0, 1)}
    assert drawn[0] == list(range(NUM_ROWS)) and state["queue"] == []
    retired = set(range(NUM_ROWS)) - set(drawn[1])
    assert retired and retired <= {row for epoch, row in state["filtered"] if epoch == 0}
    retired_metric = max(r["sched/retired"] for r in steps(tmp_path).values())
    assert len(drawn[1]) == len(set(drawn[1])) and retired_metric >= len(retired)


def test_zero_variance_filter_accounts_for_every_prompt(tmp_path):
    finish(launch(tmp_path, "--schedule.filter-zero-variance", "--num-epochs", "1", "--rollout.group-size", "4"))
    state = ledger(tmp_path)
    rows = sorted(row for _, row in state["trained"] + state["filtered"])
    assert rows == list(range(NUM_ROWS)) and state["queue"] == []
    records = steps(tmp_path).values()
    assert sum(r["sched/filtered"] for r in records) == len(state["filtered"]) > 0
    assert sum(r["sched/trained_prompts"] for r in records) == len(state["trained"])
