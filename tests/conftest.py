"""Shared fixtures: tiny random Hugging Face model directories, and real multi-rank runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DIST_SCRIPTS = Path(__file__).parent / "dist"


def make_hf_model(path: Path, kind: str = "qwen2", **overrides) -> Path:
    """Save a tiny random Hugging Face model of ``kind`` (llama, qwen2, qwen3) to ``path``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[kind]
    kw = dict(
        vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=100,
    )
    kw.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**kw)).float()
    with torch.no_grad():  # HF initializes biases to 0 and norms to 1: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="session")
def qwen3_tied_dir(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("qwen3"), "qwen3", head_dim=16, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def toy_random_dir(tmp_path_factory):
    """A random (untrained) model with the toy task's tokenizer: fast, and reward stays near 0."""
    from rollpacker.data.toy_model import build_tokenizer, model_config
    from rollpacker.model import ModelArgs, Transformer, save_model

    path = tmp_path_factory.mktemp("toyrand")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_hf(model_config(tokenizer)))
    model.init_weights()
    save_model(model, path)
    tokenizer.save_pretrained(path)
    return path


def torchrun(script: str, nproc: int, *args: str, timeout: float = 300) -> str:
    """Run ``tests/dist/<script>`` on ``nproc`` real gloo ranks; fail the test on a non-zero exit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(DIST_SCRIPTS / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        pytest.fail(f"{script} on {nproc} ranks exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-6000:]}")
    return proc.stdout
