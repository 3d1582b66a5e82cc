"""Real models at real sizes, on real gloo ranks: activation checkpointing, offload, loading from one
rank's host copy, and the Hugging Face model path (``pytest -k qwen3_moe`` selects its test)."""

from __future__ import annotations

from conftest import make_hf_model, torchrun


def test_checkpointing_offload_and_sharded_loading_keep_the_update(toy_random_dir):
    out = torchrun("memory_step.py", 2, str(toy_random_dir))
    assert out.count("OK") == 2, out


def test_hf_path_steps_equal_references_qwen3_moe_gemma2_gemma3_mistral_llama(tmp_path):
    """One 2-rank step per architecture equals transformers' single-process step, and on a Qwen2 model
    the hf path's RL step equals the native path's."""
    kinds = ("qwen3_moe", "gemma2", "gemma3", "mistral", "llama")
    paths = [str(make_hf_model(tmp_path / kind, kind)) for kind in ("qwen2", *kinds)]
    out = torchrun("hf_step.py", 2, *paths, timeout=600)
    assert out.count("OK") == 2, out
    assert all(f"{tmp_path / kind}: one hf-path step" in out for kind in kinds), out
