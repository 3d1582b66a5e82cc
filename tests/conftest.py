"""Session fixtures (tiny model directories) and the test environment. The helpers the tests import
live in ``tests/support``: ``models``, ``jobs``, ``fakes``, ``engine_pair``, ``docs``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from support.models import make_hf_model, make_reward_model

os.environ.setdefault("ROLLPACKER_DEVICE", "cpu")  # CPU and gloo where a GPU is visible too (rollpacker.dist.backend);
# the gpu-marked tests use the GPU directly, and `ROLLPACKER_DEVICE=auto pytest ...` runs the rest on it
if not torch.cuda.is_available():  # the Triton kernels' tests run on CPU under Triton's interpreter, which must be
    os.environ.setdefault("TRITON_INTERPRET", "1")  # set before anything imports triton (a unit test may, first)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="session")
def reward_model_dir(tmp_path_factory) -> Path:
    return make_reward_model(tmp_path_factory.mktemp("rm"))


@pytest.fixture(scope="session")
def qwen3_tied_dir(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("qwen3"), "qwen3", head_dim=16, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def toy_random_dir(tmp_path_factory):
    """A random (untrained) model with the toy task's tokenizer: fast, and reward stays near 0."""
    from rollpacker.model import ModelArgs, Transformer, save_model
    from rollpacker.toy.model import build_tokenizer, model_config

    path = tmp_path_factory.mktemp("toyrand")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_hf(model_config(tokenizer)))
    model.init_weights()
    save_model(model, path)
    tokenizer.save_pretrained(path)
    return path
