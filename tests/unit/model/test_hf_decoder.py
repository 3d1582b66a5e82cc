"""The Hugging Face model path (``--model.impl hf``): any transformers decoder behind the trainer's
calling convention, per architecture (``pytest -k qwen3_moe`` selects the Qwen3-MoE ones)."""

from __future__ import annotations

import re

import pytest
import torch
from support.models import GEMMA2_CAPPED, make_hf_model

from rollpacker.errors import UserError
from rollpacker.model.hf_decoder import PACKED_ATTENTION

HF_ONLY = ("qwen3_moe", "gemma2", "gemma3", "mistral")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf")
    return {kind: make_hf_model(root / kind, kind, **GEMMA2_CAPPED if kind == "gemma2" else {})
            for kind in (*HF_ONLY, "llama", "qwen2")}


@pytest.mark.parametrize("kind", [*HF_ONLY, "llama"])
def test_packed_logits_equal_transformers_own(kind, model_dirs):
    """Two sequences packed in one call (positions restarting at 0; longer than Gemma's sliding window)
    give, through the output head and Gemma-2's logit cap, the logits transformers' eager attention (its
    reference, Gemma-2's attention cap applied) computes for each sequence alone."""
    from transformers import AutoModelForCausalLM

    from rollpacker.model.hf_decoder import load_hf

    decoder = load_hf(model_dirs[kind]).eval()
    reference = AutoModelForCausalLM.from_pretrained(model_dirs[kind], dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 100, (n,), generator=g) for n in (21, 13)]
    with torch.no_grad():
        hidden = decoder(torch.cat(seqs), torch.cat([torch.arange(len(s)) for s in seqs]))
        ours = decoder.logits(hidden).split([len(s) for s in seqs])
        for seq, logits in zip(seqs, ours, strict=True):
            torch.testing.assert_close(logits, reference(seq[None]).logits[0].float(), atol=2e-5, rtol=1e-5)
    if kind == "gemma2":
        assert decoder.logit_softcap == 30.0  # transformers' default for Gemma-2: the cap is exercised
    assert decoder.config._attn_implementation == ("eager" if kind == "gemma2" else PACKED_ATTENTION)


@pytest.mark.parametrize("cls", ["StableLmConfig", "NemotronConfig"])
def test_a_decoder_whose_layers_drop_the_packed_sequences_keeps_transformers_sdpa(cls):
    """StableLM's and Nemotron's decoder layers do not pass the forward's keyword arguments on to attention, so
    the packed sequences would never reach the packed attention: they keep transformers' SDPA and the mask it
    builds from the positions, and their packed logits are still transformers' own."""
    import copy

    from rollpacker.model.hf_decoder import HFDecoder

    causal_lm = tiny_causal_lm(cls)
    reference = copy.deepcopy(causal_lm)
    decoder = HFDecoder(causal_lm)
    assert decoder.config._attn_implementation == "sdpa"
    seqs = [torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(n)) for n in (11, 7)]
    with torch.no_grad():
        ours = decoder.logits(decoder(torch.cat(seqs), torch.cat([torch.arange(len(s)) for s in seqs])))
        for seq, logits in zip(seqs, ours.split([len(s) for s in seqs]), strict=True):
            torch.testing.assert_close(logits, reference(seq[None]).logits[0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3_moe", "gemma2", "gemma3", "mistral"])
def test_auto_picks_native_for_what_it_implements(kind, model_dirs):
    from rollpacker.model.hf_decoder import resolve_impl

    assert resolve_impl("auto", model_dirs[kind]) == ("native" if kind in ("llama", "qwen2") else "hf")
    assert resolve_impl("hf", model_dirs[kind]) == "hf"


def test_hf_models_roll_out_on_vllm_not_torch_engine():
    from rollpacker.job import model_engine

    assert model_engine("hf", "auto", "cpu", False) == "vllm"
    assert model_engine("native", "auto", "cpu", False) == "torch"
    with pytest.raises(UserError, match="model.impl=hf: TorchEngine runs rollpacker's native decoder only"):
        model_engine("hf", "torch", "cpu", False)


def test_qwen3_moe_weights_pushed_under_the_checkpoints_names(model_dirs):
    """transformers 5 fuses a layer's experts into one tensor; what is pushed to vLLM is the
    checkpoint's per-expert tensors, value for value."""
    from safetensors.torch import load_file

    from rollpacker.model.hf_decoder import checkpoint_format, load_hf
    from rollpacker.rollout.engine import hf_names

    path = model_dirs["qwen3_moe"]
    decoder = load_hf(path)
    assert any("experts.gate_up_proj" in n for n, _ in decoder.named_parameters())
    pushed = dict(checkpoint_format(path)(hf_names(decoder.named_parameters(), tied=False)))
    on_disk = load_file(path / "model.safetensors")
    assert pushed.keys() == on_disk.keys()
    assert all(torch.equal(pushed[k], on_disk[k]) for k in on_disk)


def test_capped_logprobs_match_the_plain_version_values_and_grads():
    from rollpacker.train.logprobs import token_logprobs, token_logprobs_entropy
    from rollpacker_kernels.reference import reference_token_logprobs, reference_token_logprobs_entropy

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=g)
    out = token_logprobs(hidden, weight, targets, 0.7, chunk_size=8, softcap=3.0)
    ref = reference_token_logprobs(hidden, weight, targets, 0.7, softcap=3.0)
    torch.testing.assert_close(out, ref)
    upstream = torch.randn(37, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * upstream).sum(), (hidden, weight))
    torch.testing.assert_close(grads, torch.autograd.grad((ref * upstream).sum(), (hidden, weight)))
    # the entropy bonus back-propagates through the cap too
    out, entropy = token_logprobs_entropy(hidden, weight, targets, 0.7, chunk_size=8, softcap=3.0)
    ref, ref_entropy = reference_token_logprobs_entropy(hidden, weight, targets, 0.7, softcap=3.0)
    torch.testing.assert_close((out, entropy), (ref, ref_entropy))
    objective = (out * upstream).sum() + 0.3 * entropy.sum()
    torch.testing.assert_close(torch.autograd.grad(objective, (hidden, weight)),
                               torch.autograd.grad((ref * upstream).sum() + 0.3 * ref_entropy.sum(), (hidden, weight)))
    small = (hidden[:5].detach().requires_grad_(), weight[:9].detach().requires_grad_())
    assert torch.autograd.gradcheck(lambda h, w: token_logprobs(h, w, targets[:5] % 9, 0.7, chunk_size=2, softcap=3.0),
                                    small)
    with pytest.raises(ValueError, match="final_logit_softcapping=3.0"):
        token_logprobs(hidden, weight, targets, softcap=3.0, impl="triton")


@pytest.mark.parametrize(("argv", "message"), [
    (["schedule:one_step_off", "--train.rollout-correction", "token_tis"], "model.impl=hf with schedule:one_step_off"),
    (["--plan.enabled"], "model.impl=hf with plan.enabled"),
])
def test_hf_path_refuses_pools_of_their_own_and_the_planner(argv, message):
    from rollpacker.config import parse
    from rollpacker.job import check_hf

    check_hf(parse([]))
    with pytest.raises(UserError, match=message):  # said once by run.py, not a traceback on every rank
        check_hf(parse(argv))


def test_an_export_names_its_tensors_dtype_and_a_biased_output_head_is_refused(model_dirs, tmp_path):
    """The model trains in fp32; exported in bf16, its config says bf16, so transformers loads it so.
    Phi's output head adds a bias the log-prob head does not: refused, not trained on wrong log-probs."""
    import json

    from transformers import AutoModelForCausalLM, PhiConfig

    from rollpacker.model.hf_decoder import HFDecoder, load_hf, save_hf

    save_hf(load_hf(model_dirs["gemma2"]), tmp_path / "out", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").dtype == torch.bfloat16
    phi = AutoModelForCausalLM.from_config(PhiConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="PhiForCausalLM: its output head has a bias"):
        HFDecoder(phi)


def test_an_export_of_merged_weights_keeps_the_persistent_buffers(tmp_path):
    """GLM-4-MoE's router bias is a buffer, not a parameter: an export of the parameters (the job's, LoRA's merged
    weights) left it out, and transformers loaded it as zeros, routing to other experts."""
    from transformers import AutoModelForCausalLM

    from rollpacker.model.hf_decoder import HFDecoder, save_hf
    from rollpacker.model.lora import merged_weights

    causal_lm = tiny_causal_lm("Glm4MoeConfig", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               first_k_dense_replace=0, n_group=1, topk_group=1)
    decoder = HFDecoder(causal_lm)
    bias = {n: b for n, b in decoder.state_dict().items() if n.endswith("e_score_correction_bias")}
    assert bias and not any(n in dict(decoder.named_parameters()) for n in bias)
    for b in bias.values():
        b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(0)))
    save_hf(decoder, tmp_path / "out", weights=merged_weights(decoder))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    for name, b in bias.items():
        torch.testing.assert_close(reloaded.state_dict()[name], b)
    tokens = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits[0], decoder.logits(decoder(tokens[0], torch.arange(9))))


def test_engine_settings_the_resolved_engine_does_not_read_are_refused_before_it_starts():
    """engine.memory_mb sizes TorchEngine alone, vLLM picks its own KV block, and vLLM's CPU build samples wrong
    tokens under speculation: each was unread, unsaid, or a traceback at the first request."""
    from rollpacker.config import parse
    from rollpacker.job import check_engine

    vllm, sglang = ["--engine.kind", "vllm"], ["--engine.kind", "sglang"]
    for flags, device, said in (
            ([*vllm, "--engine.memory-mb", "512"], "cpu", "engine.memory_mb=512.0 with vLLM: only TorchEngine"),
            ([*sglang, "--engine.memory-mb", "512"], "cuda", "engine.memory_mb=512.0 with SGLang: only TorchEngine"),
            ([*vllm, "--engine.block-size", "32"], "cuda", "engine.block_size=32 with vLLM: vLLM picks its own"),
            ([*vllm, "--engine.speculative", "auto"], "cpu",
             "engine.speculative=auto with vLLM on CPU and rollout.temperature=0.8: vLLM's CPU build samples")):
        with pytest.raises(UserError, match=re.escape(said)):
            check_engine(parse(flags), device)
    for flags, device in ((["--engine.kind", "torch", "--engine.memory-mb", "512"], "cpu"),  # TorchEngine's
                          ([*sglang, "--engine.block-size", "32"], "cuda"),
                          ([*vllm, "--engine.speculative", "auto"], "cuda"),
                          ([*vllm, "--engine.speculative", "on", "--rollout.temperature", "0"], "cpu"),
                          ([*vllm, "--engine.speculative", "on", "--rollout.temperature", "0", "--eval.temperature",
                            "0.6", "--eval-every", "0"], "cpu")):  # no evaluation: its temperature unread
        check_engine(parse(flags), device)


def tiny_causal_lm(cls: str, **kw):
    """A tiny random transformers causal LM of config class ``cls`` (kwargs over a small shared shape)."""
    import transformers

    base = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, eos_token_id=100, head_dim=16)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**(base | kw))).float().eval()


QWEN3_NEXT = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  layer_types=["linear_attention", "full_attention"])
MAMBA = dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8)


@pytest.mark.parametrize(("cls", "kw", "said"), [
    ("Qwen3NextConfig", QWEN3_NEXT, "qwen3_next: layer_types holds linear_attention: only full and sliding-window"),
    ("FalconH1Config", MAMBA, "falcon_h1: mamba_chunk_size is set (a state-space, linear-attention or convolution"),
    ("JambaConfig", dict(num_experts=2, attn_layer_period=2, attn_layer_offset=1), "jamba: mamba_conv_bias is set"),
    ("Lfm2Config", dict(layer_types=["conv", "full_attention"]), "lfm2: layer_types holds conv: only full"),
    ("FalconH1Config", MAMBA | dict(lm_head_multiplier=0.5), "falcon_h1: lm_head_multiplier=0.5 scales the output"),
    # transformers rotates every packed sequence at the frequencies of the longest position in the call
    ("LlamaConfig", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "llama: rope_type dynamic takes"),
])
def test_hybrid_decoders_and_scaled_heads_are_refused(cls, kw, said):
    """State-space, linear-attention and convolution layers carry state from one packed sequence into the
    next, and Falcon-H1 scales its logits: each refused, not trained on wrong log-probs."""
    from rollpacker.model.hf_decoder import HFDecoder

    with pytest.raises(UserError, match=re.escape(said)):
        HFDecoder(tiny_causal_lm(cls, **kw))


def packing_leaks(causal_lm) -> bool:
    """Whether transformers' ``causal_lm`` run on two packed sequences (positions restarting at 0) gives the
    second one other hidden states than run alone."""
    g = torch.Generator().manual_seed(0)
    first, second = torch.randint(0, 100, (21,), generator=g), torch.randint(0, 100, (13,), generator=g)
    with torch.no_grad():
        packed = causal_lm.model(input_ids=torch.cat([first, second])[None], use_cache=False,
                                 position_ids=torch.cat([torch.arange(21), torch.arange(13)])[None])
        alone = causal_lm.model(input_ids=second[None], use_cache=False)
    return not torch.allclose(packed.last_hidden_state[0, 21:], alone.last_hidden_state[0], atol=1e-3)


def test_qwen3_next_is_refused_before_the_job_starts_because_packing_leaks(tmp_path):
    """Why the rule: transformers' Qwen3-Next run on two packed sequences (positions restarting at 0)
    gives the second one other hidden states than run alone. resolve_impl says so once, at the start."""
    from rollpacker.model.hf_decoder import resolve_impl

    causal_lm = tiny_causal_lm("Qwen3NextConfig", **QWEN3_NEXT)
    assert packing_leaks(causal_lm)
    causal_lm.save_pretrained(tmp_path)
    for impl in ("auto", "hf"):
        with pytest.raises(UserError, match="qwen3_next: layer_types holds linear_attention"):
            resolve_impl(impl, tmp_path)


def test_a_decoder_whose_mask_ignores_the_positions_is_refused_before_the_job_starts(tmp_path):
    """transformers' GPT-OSS builds its mask without the positions: run on two packed sequences, the second
    attends to the first (its hidden states differ from its own run alone). resolve_impl says so at the start."""
    from rollpacker.model.hf_decoder import HFDecoder, resolve_impl

    causal_lm = tiny_causal_lm("GptOssConfig", num_local_experts=4, num_experts_per_tok=2)
    assert packing_leaks(causal_lm) and not packing_leaks(tiny_causal_lm("LlamaConfig"))  # Llama's mask: positions
    said = "gpt_oss: transformers' GptOssForCausalLM cannot be shown to tell packed sequences apart (it builds its mask"
    with pytest.raises(UserError, match=re.escape(said)):
        HFDecoder(causal_lm)
    causal_lm.save_pretrained(tmp_path)
    for impl in ("auto", "hf"):
        with pytest.raises(UserError, match=re.escape(said)):
            resolve_impl(impl, tmp_path)


@pytest.mark.parametrize(("cls", "kw"), [
    ("LlamaConfig", {}), ("Qwen2Config", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    ("Qwen3Config", {}), ("MistralConfig", dict(sliding_window=4)), ("GemmaConfig", {}), ("Gemma2Config", {}),
    ("Gemma3TextConfig", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
])
def test_attention_only_decoders_are_not_refused(cls, kw):
    from rollpacker.model.hf_decoder import HFDecoder

    decoder = HFDecoder(tiny_causal_lm(cls, **kw))
    tokens = torch.randint(0, 100, (9,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert decoder(tokens, torch.arange(9)).shape == (9, 64)
