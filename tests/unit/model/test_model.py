"""The decoder against transformers' own Llama/Qwen2/Qwen3 on tiny random models (fp32, CPU),
and Hugging Face directory load/save: bit-identical round trips and one clear error per bad input.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from rollpacker.model import CausalAttention, Transformer, load_model, save_model

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.1,  # larger than HF's 0.02 so logits are far from zero and differences show
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {
    "llama": (LlamaConfig, {}),
    "llama-tied": (LlamaConfig, {"tie_word_embeddings": True}),
    "llama-bias": (LlamaConfig, {"attention_bias": True}),
    "llama3-rope": (LlamaConfig, {"rope_parameters": LLAMA3_ROPE}),
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, {"head_dim": 32}),  # != hidden_size / num_heads = 16
}
SEQ_LENS = [7, 90, 1, 33]  # 90 > original_max_position_embeddings=64 of the llama3 case


def hf_model(case: str):
    """A seeded random transformers model whose biases and norm weights are not HF's 0 and 1."""
    config_cls, extra = CASES[case]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_cls(**TINY, **extra), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


def hf_dir(tmp_path: Path, case: str, **save_kwargs) -> tuple[torch.nn.Module, Path]:
    model = hf_model(case)
    path = tmp_path / f"hf-{case}"
    model.save_pretrained(path, **save_kwargs)
    return model, path


def packed_logits(model: Transformer, seqs: list[torch.Tensor]) -> torch.Tensor:
    tokens = torch.cat(seqs)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.no_grad():
        return model.logits(model(tokens, positions, CausalAttention([len(s) for s in seqs])))


def assert_same_tensors(a: Transformer, b: Transformer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    hf, path = hf_dir(tmp_path, case)
    ours = load_model(path)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen) for n in SEQ_LENS]
    with torch.no_grad():
        want = torch.cat([hf(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
    got = packed_logits(ours, seqs)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert want.std() > 0.1  # logits large enough that a 1e-4 agreement means something
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("edit", ["rope_scaling", "top_level_length", "no_length"])
def test_rope_settings_are_read_as_transformers_reads_them(tmp_path, edit):
    """A config.json of transformers v5 (rope_parameters) given a rope_scaling block (as long-context model cards
    say) scales RoPE in transformers, and was plain RoPE here; a top-level original_max_position_embeddings wins over
    the block's; a llama3 block without one takes max_position_embeddings (it was a KeyError)."""
    _, path = hf_dir(tmp_path, "llama")
    config = json.loads((path / "config.json").read_text())
    rope = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    if edit == "rope_scaling":
        config["rope_scaling"] = rope
    else:
        config["rope_parameters"] = {**config["rope_parameters"], **rope}
        if edit == "top_level_length":
            config["original_max_position_embeddings"] = 16
        else:
            del config["rope_parameters"]["original_max_position_embeddings"]
    (path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seq = torch.randint(0, TINY["vocab_size"], (200,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=seq[None], use_cache=False).logits[0]
    assert (packed_logits(load_model(path), [seq]) - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", ["llama", "llama-tied", "qwen3"])
@pytest.mark.parametrize("max_shard_bytes", [5 << 30, 20_000], ids=["single", "sharded"])
def test_save_load_round_trip_is_bit_identical(tmp_path, case, max_shard_bytes):
    hf, src = hf_dir(tmp_path, case)
    first = load_model(src)
    hf_state = hf.state_dict()
    for name, t in first.state_dict().items():
        key = name if name == "lm_head.weight" else f"model.{name}"
        assert torch.equal(t, hf_state[key]), name

    out = tmp_path / "out"
    save_model(first, out, max_shard_bytes=max_shard_bytes)
    shards = sorted(out.glob("*.safetensors"))
    if max_shard_bytes == 20_000:
        assert (out / "model.safetensors.index.json").is_file() and len(shards) > 2
    else:
        assert [s.name for s in shards] == ["model.safetensors"]
    assert (out / "config.json").read_text() == (src / "config.json").read_text()
    second = load_model(out)
    assert_same_tensors(first, second)

    again = tmp_path / "again"
    save_model(second, again, max_shard_bytes=max_shard_bytes)
    assert (again / "config.json").read_bytes() == (out / "config.json").read_bytes()
    assert_same_tensors(first, load_model(again))


def test_loads_sharded_transformers_directory(tmp_path):
    _, single = hf_dir(tmp_path / "a", "qwen2")
    _, sharded = hf_dir(tmp_path / "b", "qwen2", max_shard_size="20KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    assert_same_tensors(load_model(single), load_model(sharded))


def test_bf16_load_and_tied_embeddings(tmp_path):
    _, path = hf_dir(tmp_path, "llama-tied")
    model = load_model(path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.embed_tokens.weight
    fp32 = load_model(path)
    assert fp32.lm_head.weight is fp32.embed_tokens.weight
    seqs = [torch.arange(5), torch.arange(20, 40)]
    got, want = packed_logits(model, seqs), packed_logits(fp32, seqs)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=0.1, rtol=0.05)


# Each corruption edits a saved directory and returns (file or directory, tensor) its error must name.
def _drop_shard(path: Path) -> tuple[str, str]:
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    file = weight_map["model.layers.1.self_attn.q_proj.weight"]
    (path / file).unlink()
    return file, next(k for k, f in weight_map.items() if f == file)


def _edit_single(path: Path, edit) -> tuple[str, str]:
    state = load_file(path / "model.safetensors")
    key = edit(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return "model.safetensors", key


def _bad_shape(state: dict) -> str:
    key = "model.layers.1.mlp.up_proj.weight"
    state[key] = state[key][:-1].clone()
    return key


def _missing_tensor(state: dict) -> str:
    key = "model.layers.1.post_attention_layernorm.weight"
    del state[key]
    return key


def _extra_tensor(state: dict) -> str:
    key = "model.layers.0.mlp.gate_proj.bias"
    state[key] = torch.zeros(TINY["intermediate_size"])
    return key


CORRUPTIONS = {
    "missing-shard": (FileNotFoundError, _drop_shard),
    "bad-shape": (ValueError, lambda p: _edit_single(p, _bad_shape)),
    # a tensor absent from every file: the error names the directory it should have been in
    "missing-tensor": (ValueError, lambda p: (str(p), _edit_single(p, _missing_tensor)[1])),
    "extra-tensor": (ValueError, lambda p: _edit_single(p, _extra_tensor)),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_bad_checkpoint_error_names_tensor_and_file(tmp_path, corruption):
    error, corrupt = CORRUPTIONS[corruption]
    _, path = hf_dir(tmp_path, "llama", **({"max_shard_size": "20KB"} if corruption == "missing-shard" else {}))
    where, key = corrupt(path)
    # every name must appear, in any order
    with pytest.raises(error, match=f"(?s)(?=.*{re.escape(where)})(?=.*{re.escape(key)})"):
        load_model(path)


def test_bad_config_errors(tmp_path):
    _, path = hf_dir(tmp_path, "llama")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"config\.json: model_type='gpt2' is not supported"):
        load_model(path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(path / "config.json"))):
        load_model(path)
    peft.LoraConfig(r=4, base_model_name_or_path="org/base").save_pretrained(str(path))  # a LoRA run's hf
    with pytest.raises(FileNotFoundError, match=r"PEFT adapter directory .*hf_merged.*\(org/base\)"):
        load_model(path)


def test_a_config_without_head_dim_takes_its_classs_default_and_a_missing_head_is_named_as_saved(tmp_path):
    """transformers' Qwen3Config defaults head_dim to 128, not hidden_size / heads: such a config.json loaded in
    transformers and was refused here, blaming the checkpoint. An untied checkpoint without its output head was
    said to lack model.lm_head.weight, a name no checkpoint has."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(Qwen3Config(**TINY), dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.pop("head_dim") == 128 != TINY["hidden_size"] // TINY["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    seq = torch.randint(0, TINY["vocab_size"], (9,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=seq[None], use_cache=False).logits[0]
    assert (packed_logits(load_model(tmp_path), [seq]) - want).abs().max().item() <= 1e-4
    _edit_single(tmp_path, lambda state: state.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\), e\.g\. lm_head\.weight$"):
        load_model(tmp_path)
