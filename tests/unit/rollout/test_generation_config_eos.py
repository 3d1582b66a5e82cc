"""A checkpoint's EOS ids are config.json's and generation_config.json's, as transformers' ``generate`` stops
at them (Qwen2.5/Qwen3 instruct list a second EOS there), for TorchEngine and the vLLM and SGLang adapters."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rollpacker.model import load_model, read_args
from rollpacker.model.hf_decoder import decoder_facts
from rollpacker.rollout.config import EngineConfig
from rollpacker.rollout.engine import Request, SamplingParams, generate
from rollpacker.rollout.torch_engine import TorchEngine

PROMPT = [1, 2, 3, 4, 5, 6]


def greedy(path):
    eng = TorchEngine(load_model(path), EngineConfig(block_size=4))
    return generate(eng, [Request(id="a", prompt_ids=PROMPT, params=SamplingParams(max_new_tokens=30,
                                                                                   temperature=0))])["a"]


def test_a_second_eos_in_generation_config_ends_the_response_as_in_transformers(qwen2_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    path = shutil.copytree(qwen2_dir, tmp_path / "model")
    plain = greedy(path).token_ids
    assert 100 not in plain and plain[0] != plain[-1]  # config.json's EOS (100) never comes: the run is long
    second = plain[-1]  # greedy emits it after other tokens: the response must end at its first one
    gen_file = path / "generation_config.json"
    gen_file.write_text(json.dumps(json.loads(gen_file.read_text()) | {"eos_token_id": [100, second]}))

    out = greedy(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False,
                           pad_token_id=0)[0, len(PROMPT):].tolist()
    assert want == plain[:plain.index(second) + 1]
    assert out.finish_reason == "stop" and out.token_ids == want
    assert read_args(path).eos_token_ids == decoder_facts(path).eos_token_ids == (100, second)  # vLLM's, SGLang's


def test_eos_ids_are_config_json_first_each_once(tmp_path):
    from rollpacker.model.args import eos_token_ids

    assert eos_token_ids(7, tmp_path) == (7,)  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [8, 7]}))
    assert eos_token_ids(7, tmp_path) == (7, 8)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert eos_token_ids([7, 9], tmp_path) == (7, 9) and eos_token_ids(None, tmp_path) == (9,)
    assert eos_token_ids([7, 8]) == (7, 8)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        eos_token_ids(7, tmp_path)
