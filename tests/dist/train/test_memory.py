"""Real models at real sizes, on real gloo ranks: activation checkpointing, offload, loading from one
rank's host copy, and the Hugging Face model path, in one launch (``pytest -k qwen3_moe`` selects it).
The plan against measured peaks and the checkpointing factor: the slow tier (``bench memory``)."""

from __future__ import annotations

import pytest
from support.jobs import torchrun
from support.models import make_hf_model


def test_memory_settings_keep_the_update_and_hf_path_steps_equal_references_qwen3_moe_gemma2_gemma3_mistral_llama(
        toy_random_dir, tmp_path):
    """One launch: checkpointing, offload and sharded loading keep the update (native model); one 2-rank
    step per architecture equals transformers' single-process step, and on a Qwen2 model the hf
    path's RL step equals the native path's."""
    kinds = ("qwen3_moe", "gemma2", "gemma3", "mistral", "llama")
    paths = [str(make_hf_model(tmp_path / kind, kind)) for kind in ("qwen2", *kinds)]
    out = torchrun("memory_step.py", 2, str(toy_random_dir), *paths, timeout=900)
    assert out.count("OK") == 2, out
    assert out.count("largest gradient difference") == 3 and out.count("largest weight difference") == 2, out
    assert all(f"{tmp_path / kind}: one hf-path step" in out for kind in kinds), out
    assert "qwen2: one RL step, hf path vs native path" in out, out


@pytest.mark.slow
def test_memory_bench_plan_within_fifteen_percent_and_checkpointing_factor():
    """``bench memory``: every case's measured peak within 15% of the plan's; the activations with full
    checkpointing over those without (5M model, 2048 tokens) are the plan's factor, within 15%."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "rollpacker.bench", "memory"], capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["plan_max_rel_error"] <= 0.15, summary
    measured, plan = summary["checkpointing_factor_measured"], summary["checkpointing_factor_plan"]
    assert plan < 0.5 and abs(plan - measured) <= 0.15 * measured, summary
