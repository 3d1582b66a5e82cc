"""SGLangEngine on CPU (SGLang 0.5.23's CPU platform, torch_native attention) against
transformers, TorchEngine and the trainer: greedy tokens and log-probs, abort and resume, seeded
sampling, weight pushes, memory release; TP 2 across two torchrun ranks; SGLang's seeded-sampling
hash against the stub's port. The ``sglang`` tier (``pytest -m sglang``, after ``bash
launch/install.sh sglang``): each engine lives in a process of its own, so a dying engine fails its
tests, not the session."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from support.engine_pair import make_pair
from support.jobs import DIST_SCRIPTS, SGLANG_STUBS, cause, sglang_env

pytestmark = pytest.mark.sglang

CHECKS = ["greedy_matches_transformers_and_torch_engine",
          "a_repetition_penalty_is_refused_and_the_engine_serves_on", "logprobs_equal_the_trainers",
          "abort_then_resume_continues_greedy", "an_abort_right_after_add_ends_the_request", "bad_requests_raise",
          "a_prompt_at_the_context_edge_is_served", "stop_string_ends_generation_as_on_torch_engine",
          "seeded_sampling_reproduces_and_resumes",
          "a_step_is_a_decode_step", "update_weights_then_release_and_resume", "release_and_push_right_after_a_finish"]
"""The checks of tests/dist/scripts/sglang_engine.py, one engine for all of them."""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("sglang"))


@pytest.fixture(scope="module")
def checks(pair, tmp_path_factory):
    """Run every check in one process with one engine; each check's result."""
    out = tmp_path_factory.mktemp("sglang_checks") / "results.json"
    proc = subprocess.run([sys.executable, str(DIST_SCRIPTS / "sglang_engine.py"), str(pair[0]), str(pair[1]),
                           str(out)], capture_output=True, text=True, timeout=900, env=sglang_env())
    results = json.loads(out.read_text()) if out.exists() else {}
    return results, f"exit {proc.returncode}\n{proc.stdout}\n{cause(proc.stderr)}"


@pytest.mark.parametrize("check", CHECKS)
def test_sglang_engine(checks, check):
    results, log = checks
    assert check in results, f"the script ended before {check}:\n{log}"
    assert results[check] == "ok", results[check]


def test_tp2_across_two_torchrun_ranks(pair):
    """One TP-2 engine over two gloo ranks: greedy equals TorchEngine's, a push from the FSDP2-sharded
    trainer equals TorchEngine's after the same push, abort and memory release across the group. Its
    shutdown leaves nothing in /dev/shm (SGLang's left its schedulers' 24 MB queue, load snapshot and
    semaphores there, run after run)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(DIST_SCRIPTS / "sglang_tp.py"), str(pair[0])]
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=sglang_env())
    assert proc.returncode == 0 and proc.stdout.count("OK") == 2, f"{proc.stdout}\n{cause(proc.stderr)}"
    assert set(os.listdir("/dev/shm")) <= before, sorted(set(os.listdir("/dev/shm")) - before)


def test_seeded_sampling_hash_equals_sglangs_triton_kernel():
    """The sgl_kernel stub's torch port of murmur_hash32 (SGLang's seeded-sampling noise on CPU)
    gives the values of SGLang's own Triton kernel, run here under Triton's interpreter."""
    import importlib.util

    import triton

    spec = importlib.util.spec_from_file_location("stub_sgl_kernel", SGLANG_STUBS / "sgl_kernel" / "__init__.py")
    stub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stub)
    from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32_kernel

    seeds = torch.tensor([0, 7, 2**40 + 3, 2**63 - 1], dtype=torch.int64)
    positions = torch.tensor([0, 5, 1000, 2**31 - 1], dtype=torch.int64)
    cols = torch.arange(300)
    expected = torch.empty((4, 300), dtype=torch.uint32)
    murmur_hash32_kernel[(4, triton.cdiv(300, 128))](seeds, positions, cols, expected, 4, 300, BLOCK_SIZE=128)
    assert torch.equal(stub.murmur_hash32(seeds, positions, cols), expected)


def test_engine_bench_compares_torch_and_sglang_on_the_same_tokens():
    """``bench engine --engines torch sglang`` at tiny sizes: the same greedy tokens, SGLang's tok/s
    and the adapter's overhead against ``sgl.Engine`` driven directly in the JSON line."""
    proc = subprocess.run(
        [sys.executable, "-m", "rollpacker.bench", "engine", "--engines", "torch", "sglang", "--batch-sizes", "1", "4",
         "--max-new-tokens", "8", "--warmup-tokens", "2", "--repeats", "1", "--decode-batch-sizes", "1",
         "--decode-steps", "2", "--matmul-size", "64", "--matmul-reps", "1", "--ragged-requests", "0"],
        capture_output=True, text=True, timeout=900, env=sglang_env())
    assert proc.returncode == 0, cause(proc.stderr)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    for b in (1, 4):
        assert summary[f"same_tokens_sglang_batch{b}"] == 1.0 and summary[f"tok_s_sglang_batch{b}"] > 0
    assert summary["sglang_adapter_overhead"] == summary["sglang_adapter_overhead_batch4"] > -1
    assert "decode_ms_per_iter_sglang" not in summary  # its step() is not one decode step


def test_speculative_arguments_pass_sglangs_own_resolution():
    """``engine.speculative`` under SGLang: its server arguments with the engine's pass SGLang 0.5.23's own
    resolution (a name it lacks, or NGRAM's default tree of 10 with paged KV, refused the engine's start). Run on
    its CPU device: the resolution is the GPU's but for that device's own checks."""
    code = """
import torch
from rollpacker.model import read_args
from rollpacker.rollout import sglang_speculative_args
from rollpacker.rollout.config import EngineConfig
from rollpacker.rollout.sglang_engine import engine_args
from rollpacker.toy.model import TOY_MODEL_DIR
from sglang.srt.server_args import ServerArgs

cfg = EngineConfig(speculative="on", spec_max_tokens=6)
args = engine_args(TOY_MODEL_DIR, cfg, read_args(TOY_MODEL_DIR), 1, torch.float32, on_cpu=True)
server = ServerArgs(**args | sglang_speculative_args(cfg, "cuda"))
server.resolve_once()
print("resolved", server.page_size, server.speculative_num_draft_tokens)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=sglang_env())
    assert proc.returncode == 0 and "resolved 16 7" in proc.stdout, f"{proc.stdout}\n{cause(proc.stderr)}"
