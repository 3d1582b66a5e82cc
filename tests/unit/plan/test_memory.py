"""The memory plan (rollpacker.plan.memory): hand counts, the presets it holds, its refusal."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from rollpacker.errors import UserError
from rollpacker.plan.memory import (
    GB,
    QWEN2_5,
    RolloutSetup,
    Shape,
    TrainSetup,
    activations,
    block_saved,
    rollout_phase,
    train_phases,
)

TINY = Shape(vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=2, num_heads=2, num_kv_heads=1,
             head_dim=2, qkv_bias=True)


def test_the_plans_terms_for_a_tiny_model_equal_a_hand_count():
    # a block: q 4x4 + 4, k and v 4x2 + 2 each, o 4x4, the MLP 3 x 4x6, two norms of 4
    assert TINY.layer_params == 20 + 10 + 10 + 16 + 72 + 8 == 136
    assert TINY.root_params == 10 * 4 * 2 + 4 == 84  # embedding, head (untied), final norm
    assert TINY.num_params == 2 * 136 + 84 == 356
    # saved per token in fp32, no padding: each norm 4D (its input) + 4D (normed) + 4D (output) + 4 (1/rms);
    # attention: q, k, v gathered, SDPA's output (4 bytes each), its log-sum-exp per head, the output scattered
    # back and its int64 indices; the MLP: gate, silu(gate), up, their product
    norm = 16 + 16 + 16 + 4
    attention = 4 * (4 + 2 + 2 + 4) + 4 * 2 + 4 * 4 + 8
    mlp = 4 * 4 * 6
    assert block_saved(TINY, 4, 1.0, 8) == 2 * norm + attention + mlp == 280
    assert block_saved(TINY, 4, 1.0, 8, "block") == 16  # a checkpointed block keeps its input
    assert block_saved(TINY, 4, 1.0, 8, "mlp") == 280 - mlp
    setup = TrainSetup(shard_size=1, seq_lens=(8,), response_tokens=4, compute_bytes=4, head="torch",
                       foreach=False, micro_batches=1)
    acts = activations(TINY, setup)
    # 8 tokens: 2 blocks, RoPE's cos and sin (2 x 4 x head_dim), the bucket's int64 index and bool mask
    assert acts["blocks"] == 8 * (2 * 280 + 16 + 9)
    # the final norm without its output (52 - 16) per token; the head's hidden row, lse and target per response token
    assert acts["head"] == 8 * 36 + 4 * (16 + 4 + 8)
    forward = {t.name: t.bytes for t in train_phases(TINY, setup)[0].terms}
    assert forward == {
        "parameters (fp32, sharded)": 4 * 356, "optimizer state (AdamW, fp32, sharded)": 8 * 356,
        "gradients of earlier micro-batches": 0, "unsharded root (embedding, norm, head)": 4 * 84,
        "saved activations": 8 * 585 + 400,
        "log-prob head forward (torch)": 2 * 4 * 10 * 4}  # the [chunk, V] logits and logsumexp's temporary
    # PPO's critic (the blocks, the embedding, the norm and a one-row head: 2 x 136 + 40 + 4 + 4 parameters): its
    # weights and AdamW state, and (two micro-batches) its gradients held whole, in every phase; its own backward
    critic = replace(setup, critic=True, micro_batches=2)
    phases = train_phases(TINY, critic)
    for phase in phases:
        terms = {t.name: t.bytes for t in phase.terms}
        assert terms["critic parameters + optimizer state (sharded)"] == 12 * 320, phase.name
        assert terms["critic gradients accumulated unsharded (fp32)"] == 4 * 320, phase.name
    backward = {t.name: t.bytes for t in next(p for p in phases if p.name == "backward (critic)").terms}
    assert backward["unsharded critic root (embedding, norm, head)"] == 4 * 12 * 4
    assert backward["policy gradients (fp32, sharded)"] == 0  # held whole in the state (two micro-batches)
    engine = RolloutSetup(engine="vllm", tp=1, weight_bytes=4, kv_bytes=0, max_num_seqs=1, prefill_tokens=8,
                          released=False)
    rollout = {t.name: t.bytes for t in rollout_phase(TINY, critic, engine).terms}
    assert rollout["critic parameters + optimizer state (sharded)"] == 12 * 320
    assert not any(name.startswith("critic gradients") for name in rollout)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_saved_is_what_autograd_keeps(kind, dtype):
    """The hand count of a native block's saved tensors equals what ``saved_tensors_hooks`` sees."""
    from rollpacker.model import CausalAttention, ModelArgs, Transformer
    from rollpacker.model.transformer import rope_cos_sin

    cfg = dict(model_type=kind, vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = Transformer(ModelArgs.from_hf(cfg)).to(dtype)
    tokens = 64
    x = torch.randn(tokens, 64, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(tokens), model.inv_freq, dtype)
    attn = CausalAttention([tokens])
    kept = [(b.index, b.valid, b.rows) for b in attn.buckets]
    shared = {t.untyped_storage().data_ptr() for t in (cos, sin, *(x for k in kept for x in k))}
    shared |= {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers[0](x, cos, sin, 0, attn)
    mine = sum(n for ptr, n in saved.items() if ptr not in shared)
    assert mine == tokens * block_saved(Shape.from_hf(cfg), dtype.itemsize, 1.0, tokens)


def test_every_gpu_preset_fits_an_h100_with_ten_percent_headroom(capsys):
    from rollpacker.plan.memory import main

    for preset in ("qwen2.5-7b-8k", "qwen2.5-14b-16k", "qwen2.5-32b-32k"):
        with pytest.raises(SystemExit) as done:
            main(["--preset", preset, "--gpu-memory-gb", "80"])
        assert done.value.code == 0
        last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert last["fits"] is True and last["headroom"] >= 0.10, (preset, last)
        assert 0 < last["peak_gb"] <= 72


@pytest.mark.parametrize("flags, said", [
    (["--world-size", "3"], "--world-size 3: --rollout.tp=2 does not divide the world size 3"),
    (["--rollout.tp", "3"], "--world-size 8: --rollout.tp=3 does not divide the world size 8"),
    (["--rollout.tp", "8"], "--rollout.tp=8 does not divide the model's 4 key-value heads"),
    (["--world-size", "0"], "--world-size 0 and --gpu-memory-gb 80 must be positive"),
    (["--gpu-memory-gb", "nan"], "--world-size 8 and --gpu-memory-gb nan must be positive"),
    (["--preset", "nope"], "preset 'nope': "),
])
def test_the_plan_refuses_what_the_job_refuses_and_sizes_that_are_not_sizes(capsys, flags, said):
    """A plan of a world the job would refuse printed 'fits'; a world or GPU of 0 raised ZeroDivisionError."""
    from rollpacker.plan.memory import main

    with pytest.raises(SystemExit) as done:
        main(["--preset", "qwen2.5-7b-8k", *flags])
    assert done.value.code == 2 and said in capsys.readouterr().err


def test_a_preset_that_cannot_fit_is_refused_naming_the_largest_term_and_the_fix():
    from rollpacker.config import parse
    from rollpacker.plan.memory import QWEN2_5, check_fits

    # the engine named: engine.kind auto is planned as the job resolves it, by what is installed here
    config = parse(["--preset", "qwen2.5-32b-32k", "--train.activation-checkpointing", "none", "--engine.kind", "vllm"])
    with pytest.raises(UserError) as refused:  # said once by run.py, not a traceback on every rank
        check_fits(config, Shape.from_hf(QWEN2_5["Qwen2.5-32B"]), world_size=8, capacity=80 * GB)
    assert str(refused.value) == (
        "memory plan: the backward (blocks) peak is 768.8 GB per GPU, over the 80.0 GB this GPU has. "
        "Largest term: saved activations, 753.4 GB; set train.activation-checkpointing full to shrink it "
        "(python -m rollpacker.plan.memory shows every term)")


def test_checkpointed_blocks_follow_the_mode():
    from rollpacker.model.parallelize import checkpointed

    assert checkpointed(5, "none", 2, "block") == []
    assert checkpointed(3, "full", 2, "mlp") == [(0, "block"), (1, "block"), (2, "block")]
    assert checkpointed(5, "selective", 2, "attention") == [(0, "attention"), (2, "attention"), (4, "attention")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "gemma2", "gemma3", "mistral"])
def test_block_saved_estimates_hugging_face_layers(kind, dtype, tmp_path):
    """The same count estimates the transformers layers of the hf path (Qwen3-MoE's routed experts,
    Gemma's four norms a block and their fp32 scaling, Gemma-2's eager attention, Gemma-3's sliding-window
    masks) within 5% of what autograd keeps over two packed sequences, in fp32 and in bf16: no ``[T, T]``
    mask (SDPA's from transformers, which every layer converted and kept)."""
    from support.models import make_hf_model

    from rollpacker.model.hf_decoder import load_hf, read_config

    path = make_hf_model(tmp_path, kind, hidden_size=128, intermediate_size=256, head_dim=32)
    model, lens = load_hf(path, dtype=dtype), (100, 156)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, 100, (sum(lens),)), torch.cat([torch.arange(n) for n in lens]))
    measured = sum(n for ptr, n in saved.items() if ptr not in params)
    setup = TrainSetup(shard_size=1, seq_lens=lens, response_tokens=0, compute_bytes=dtype.itemsize, head="torch")
    planned = sum(activations(Shape.from_hf(read_config(path)), setup).values())  # the final norm's too
    assert abs(planned - measured) <= 0.05 * measured, (planned, measured)


# ---- the engines' footprints (issue 37) ----------------------------------------------------------

QWEN7B = Shape.from_hf(QWEN2_5["Qwen2.5-7B"])


def _rollout(engine: str, **kw):
    from rollpacker.plan.memory import RolloutSetup

    return RolloutSetup(**{**dict(engine=engine, tp=2, weight_bytes=2, kv_bytes=40 * 2**30, max_num_seqs=512,
                                  prefill_tokens=8192, released=engine != "torch", longest=9216), **kw})


def test_each_engines_real_footprint_is_in_the_rollout_phase():
    from rollpacker.plan.memory import SGLANG_PROCESS_BYTES, batched_tokens, decode_workspace, engine_terms

    names = {e: {t.name: t.bytes for t in engine_terms(QWEN7B, _rollout(e))} for e in ("torch", "vllm", "sglang")}
    # vLLM batches max(max_prefill_tokens, max_model_len): the model's 131072 positions unless engine.max_model_len
    assert batched_tokens(QWEN7B, _rollout("vllm")) == 131072
    assert batched_tokens(QWEN7B, _rollout("vllm", max_model_len=10240)) == 10240
    assert batched_tokens(QWEN7B, _rollout("sglang")) == batched_tokens(QWEN7B, _rollout("torch")) == 8192
    assert names["vllm"]["engine activations and logits"] > 5 * names["sglang"]["engine activations and logits"]
    assert names["sglang"]["SGLang scheduler process (allowance)"] == SGLANG_PROCESS_BYTES
    # TorchEngine: 1.5x the running rows' capacities, each under twice its context (28 layers, 2 of the 4 KV
    # heads at TP 2, head_dim 128, bf16), and one layer's more while a group is reallocated; the contexts fit
    # the KV pool, or max_num_seqs rows of 16384 (9216 tokens)
    per_token, most = 2 * 28 * 2 * 128 * 2, 1.5 * (1 + 1 / 28)
    assert decode_workspace(QWEN7B, _rollout("torch")) == pytest.approx(most * (2 * 40 * 2**30 + 512 * 16 * per_token))
    assert decode_workspace(QWEN7B, _rollout("torch", kv_bytes=2**40)) == pytest.approx(most * 512 * 16384 * per_token)
    with_drafts = decode_workspace(QWEN7B, _rollout("torch", longest=8190, draft_tokens=12))  # 8202 tokens: 16384
    assert with_drafts == pytest.approx(most * (2 * 40 * 2**30 + 512 * 24 * per_token))
    assert "TorchEngine decode workspace (bounded by the KV budget)" in names["torch"]
    assert not any("workspace" in n for n in names["vllm"]) and not any("SGLang" in n for n in names["torch"])


def test_sglang_keeps_its_process_while_the_trainer_trains():
    from rollpacker.plan.memory import engine_kept

    kept = {e: sum(t.bytes for t in engine_kept(QWEN7B, _rollout(e))) for e in ("torch", "vllm", "sglang")}
    assert kept["vllm"] == 0 and kept["sglang"] == 2 * GB
    assert kept["torch"] == QWEN7B.num_params * 2 / 2  # TorchEngine keeps its weight shard


@pytest.mark.parametrize("kv_memory_mb, max_num_seqs, num_requests, most_new", [(0.5, 4, 6, 40), (1, 16, 24, 200)])
def test_torch_engine_workspace_under_the_plans_bound(toy_random_dir, monkeypatch, kv_memory_mb, max_num_seqs,
                                                       num_requests, most_new):
    """The measured workspace, reallocations included, stays under the plan's bound and reaches a good part
    of it (the bound is what the code does, not a guess): ``max_num_seqs`` rows of the longest context when
    few requests run, and when many run, preempted by the KV budget, the running contexts the pool holds.
    A group is reallocated a layer at a time, each old layer's store freed before the next is made."""
    import random
    import weakref

    from rollpacker.model import load_model
    from rollpacker.plan.memory import RolloutSetup, decode_workspace
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.engine import Request, SamplingParams
    from rollpacker.rollout.torch_engine import TorchEngine
    from rollpacker.rollout.torch_engine.kv import LengthGroup

    model = load_model(toy_random_dir)
    engine = TorchEngine(model, EngineConfig(kv_memory_mb=kv_memory_mb, max_num_seqs=max_num_seqs))
    realloc, peak, reallocs = LengthGroup._realloc, 0, 0

    def watched(group, remake):  # the workspace while a layer's new store and its old one are both held
        nonlocal peak, reallocs
        old = [weakref.ref(store.untyped_storage()) for store in group.stores]

        def remake_watched(store):
            nonlocal peak
            new = remake(store)
            peak = max(peak, engine.workspace_bytes + new.nbytes)
            return new

        realloc(group, remake_watched)
        assert all(ref() is None for ref in old)  # freed: no view of an old store was kept
        reallocs += 1

    monkeypatch.setattr(LengthGroup, "_realloc", watched)
    rng, longest = random.Random(0), 0
    for i in range(num_requests):
        prompt, new = [rng.randrange(3, 40) for _ in range(rng.randrange(8, 30))], rng.randrange(20, most_new)
        engine.add(Request(id=str(i), prompt_ids=prompt, params=SamplingParams(max_new_tokens=new, ignore_eos=True)))
        longest = max(longest, len(prompt) + new)
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.workspace_bytes)
    assert reallocs > 2
    args = model.args
    shape = Shape(vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                  num_layers=args.num_layers, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                  head_dim=args.head_dim)

    def bound(kv_bytes: float) -> float:
        return decode_workspace(shape, RolloutSetup(engine="torch", tp=1, weight_bytes=4, kv_bytes=kv_bytes,
                                                    max_num_seqs=max_num_seqs, prefill_tokens=8192, released=False,
                                                    longest=longest))

    assert 0.3 * bound(engine.cache.nbytes) < peak <= bound(engine.cache.nbytes), (peak, bound(engine.cache.nbytes))
    assert peak > engine.cache.nbytes  # beside the pool, more than the pool itself
    by_pool = bound(engine.cache.nbytes) < bound(2**40)
    assert by_pool == (max_num_seqs > 4) and (engine.num_preemptions > 0) == by_pool


def test_sglang_memory_fraction_leaves_sglang_its_kv_budget():
    """SGLang 0.5.23 (kv_cache_configurator._profile_available_bytes): KV = (free after its weights) - (free before)
    x (1 - mem_fraction_static), capped at max_total_tokens; it refuses to start when that is not positive."""
    from rollpacker.plan.memory import engine_terms
    from rollpacker.rollout.sglang_engine import memory_fraction

    def sglang_memory_fraction(shape, setup, free):
        return memory_fraction(sum(t.bytes for t in engine_terms(shape, setup)), free)

    setup = _rollout("sglang")
    weights = QWEN7B.num_params * 2 / 2
    misc = 0.5 * GB  # besides its weights: its TP group's NCCL buffers, cuBLAS workspaces
    for free in (78 * GB, 60 * GB):
        fraction = sglang_memory_fraction(QWEN7B, setup, free)
        before = free - 1 * GB  # its scheduler's own CUDA context comes first
        assert (before - weights - misc) - before * (1 - fraction) >= setup.kv_bytes
        assert fraction * free >= sum(t.bytes for t in engine_terms(QWEN7B, setup))
    before = 78 * GB
    assert (before - weights - misc) - before * (1 - 0.1) < 0  # the 0.1 it was given before: SGLang refused
    with pytest.raises(ValueError, match="SGLang needs 5.*GB per GPU .* but 4.0 GB are free; set a smaller "
                                         "engine.kv_memory_mb"):
        sglang_memory_fraction(QWEN7B, setup, 4 * GB)


def test_the_plan_counts_lora_adapters_as_peft_makes_them(qwen2_dir):
    """The plan's adapter count is PEFT's on a real model; with LoRA only the adapters hold gradients
    and AdamW state, so the 32B preset fits without offload (the full model does not)."""
    from rollpacker.config import parse
    from rollpacker.model import load_model, lora
    from rollpacker.model.config import LoraConfig
    from rollpacker.model.hf_decoder import read_config
    from rollpacker.plan.memory import GB, Shape, config_plan, lora_params, model_shape

    for targets in (("q_proj", "v_proj"), ("all-linear",), ("self_attn.q_proj", "v_proj")):  # peft's suffixes too
        model = lora.apply(load_model(qwen2_dir), LoraConfig(rank=4, target_modules=targets))
        made = sum(p.numel() for n, p in model.named_parameters() if lora.is_adapter(n))
        assert lora_params(Shape.from_hf(read_config(qwen2_dir)), 4, targets) == made
    flags = ["--preset", "qwen2.5-32b-32k", "--train.no-offload"]
    shape = model_shape(str(parse(flags).model.directory()))
    full = config_plan(parse(flags), 8, 80 * GB, shape)
    adapted = config_plan(parse([*flags, "--train.lora.rank", "64"]), 8, 80 * GB, shape)
    assert not full.fits and adapted.fits and adapted.peak < full.peak
    # a target no layer has counted no adapter, and the plan priced training every parameter (the job refuses it)
    with pytest.raises(UserError, match="train.lora.target_modules names q_prj, none of them a linear the plan"):
        config_plan(parse([*flags, "--train.lora.rank", "64", "--train.lora.target-modules", "q_prj"]), 8, 80 * GB)


def test_a_config_json_the_plan_cannot_read_is_refused_naming_the_file_and_setting(tmp_path, capsys):
    """A config.json of another layout (GPT-2's n_head) or not JSON was a KeyError or JSONDecodeError traceback."""
    from rollpacker.plan.memory import main

    for text, said in (('{"model_type": "gpt2", "n_head": 2, "n_layer": 2, "vocab_size": 50}',
                        "has no 'num_attention_heads': the plan reads a Llama-style"), ("{not json", "is not JSON")):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(SystemExit) as done:
            main(["--preset", "qwen2.5-7b-8k", "--model.path", str(tmp_path)])
        assert done.value.code == 2 and f"config.json (--model.path) {said}" in capsys.readouterr().err


def test_torch_engines_memory_mb_and_the_planners_tps_are_planned_as_they_run():
    """engine.memory_mb sizes TorchEngine's KV cache as what its weight shard leaves; with the planner on,
    the engine may run any TP: its weights are planned as at TP 1."""
    from rollpacker.config import parse
    from rollpacker.plan.memory import config_plan, setups

    flags = ["--preset", "qwen2.5-7b-8k", "--engine.kind", "torch"]
    _, fixed = setups(parse(flags), 8, shape=QWEN7B)
    _, by_memory = setups(parse([*flags, "--engine.memory-mb", "50000"]), 8, shape=QWEN7B)
    assert (fixed.kv_bytes, fixed.kv_setting) == (40960 * 2**20, "engine.kv_memory_mb")
    assert by_memory.kv_bytes == 50000 * 2**20 - QWEN7B.num_params * 2 / 2  # what TP 2's bf16 weight shard leaves
    assert by_memory.kv_setting == "engine.memory_mb"
    _, planned = setups(parse([*flags, "--plan.enabled"]), 8, shape=QWEN7B)
    assert (fixed.tp, planned.tp) == (2, 1)
    # engine.memory_mb holds weights and KV cache at any TP the planner runs: planned as the worst of TP 1, 2 and 4
    memory = [*flags, "--engine.memory-mb", "50000"]
    at = [config_plan(parse([*memory, "--rollout.tp", str(tp)]), 4, 80 * GB, QWEN7B).peak for tp in (1, 2, 4)]
    assert config_plan(parse([*memory, "--plan.enabled"]), 4, 80 * GB, QWEN7B).peak == max(at)


def test_an_episode_is_planned_at_its_model_tokens_and_observations_within_the_engines_context():
    """An episode's sample holds env.max_tokens model tokens (rollout.max_new_tokens is a turn's; its turns may
    hold fewer) and an observation between each two turns: planned at that, within engine.max_model_len when set."""
    from rollpacker.config import parse
    from rollpacker.plan.memory import PROMPT_TOKENS, setups

    flags = ["--preset", "qwen2.5-7b-8k", "--rollout.max-new-tokens", "1024", "--engine.max-model-len", "0"]
    _, single = setups(parse(flags), 8, shape=QWEN7B)
    episode = [*flags, "--env.factory", "toy", "--env.max-tokens", "8192", "--env.max-turns", "9"]
    train, rollout = setups(parse(episode), 8, shape=QWEN7B)
    assert single.longest == PROMPT_TOKENS + 1024
    assert rollout.longest == PROMPT_TOKENS + 8192 + 8 * 4000 // 4 == max(train.seq_lens)  # 8 observations of 4000
    _, turns = setups(parse([*episode, "--env.max-turns", "5"]), 8, shape=QWEN7B)  # 5 turns of 1024 reach 5120
    assert turns.longest == PROMPT_TOKENS + 5 * 1024 + 4 * 4000 // 4
    _, capped = setups(parse([*episode, "--engine.max-model-len", "12288"]), 8, shape=QWEN7B)
    assert capped.longest == 12288


def test_a_qwen2_moe_shape_counts_its_shared_expert_as_transformers_builds_it():
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    cfg = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shape = Shape.from_hf(cfg.to_dict())
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert shape.mlp_width == 2 * 16 + 40


def test_a_config_without_tie_word_embeddings_ties_as_its_class_does(tmp_path):
    """Gemma's published configs leave the key out (its class ties): the plan counted the head twice (+8.6% at 12B)."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    from rollpacker.sim.cost import ModelShape

    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8).to_dict()
    del cfg["tie_word_embeddings"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Gemma2Config(**cfg))
    assert Shape.from_hf(cfg).num_params == sum(p.numel() for p in model.parameters())
    assert ModelShape.from_hf_config(_model_dir(tmp_path, "gemma2", **cfg)).tied_embeddings


# ---- the audit of the plan's inputs (teacher, critic, the planner's TPs, the prompt) --------------------------


def _model_dir(tmp_path, name: str, **cfg) -> str:
    """A Hugging Face model directory holding only its config.json (the plan reads no weights)."""
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def test_a_distillation_teacher_is_planned_as_the_job_holds_it(tmp_path):
    """The teacher (train.teacher.path) is held like the KL reference: fp32 shards on every GPU in every phase,
    rollout included, and its own forward; with train.offload streamed (native) or in FSDP2's CPU offload (hf).
    A 32B teacher beside the 7B preset was planned as no teacher: 65.8 GB, 'fits'."""
    from rollpacker.config import parse
    from rollpacker.plan.memory import config_plan

    teacher = Shape.from_hf(QWEN2_5["Qwen2.5-32B"])
    flags = ["--preset", "qwen2.5-7b-8k", "--engine.kind", "vllm"]
    alone = config_plan(parse(flags), 8, 80 * GB, QWEN7B)
    taught = config_plan(parse([*flags, "--train.teacher.path", _model_dir(tmp_path, "t32", **QWEN2_5["Qwen2.5-32B"])]),
                         8, 80 * GB, QWEN7B)
    for phase in taught.phases:
        assert {t.name: t.bytes for t in phase.terms}["teacher (fp32, sharded)"] == 4 * teacher.num_params / 8
    forward = {t.name: t.bytes for t in next(p for p in taught.phases if p.name == "forward (teacher)").terms}
    assert forward["teacher in flight (2 blocks, root, one block's activations)"] > 2 * 2 * teacher.layer_params
    assert taught.peak == pytest.approx(alone.peak + 4 * teacher.num_params / 8) and not taught.fits
    # train.offload: a native teacher streamed (its root on the GPU, whole in host memory), an hf one offloaded
    offload = [*flags, "--train.offload"]
    streamed = config_plan(parse([*offload, "--train.teacher.path", str(tmp_path / "t32")]), 8, 80 * GB, QWEN7B)
    rollout = {t.name: t.bytes for t in streamed.phases[-1].terms}
    assert rollout["teacher root and 2 layer buffers (streamed layers)"] == 2 * (teacher.root_params +
                                                                             2 * teacher.layer_params)
    flight = "teacher in flight (2 blocks, root, one block's activations)"  # streamed: the root and buffers held
    sharded_forward = forward[flight]
    forward = {t.name: t.bytes for t in next(p for p in streamed.phases if p.name == "forward (teacher)").terms}
    assert sharded_forward - forward[flight] == 2 * (teacher.root_params + 2 * teacher.layer_params)
    base = config_plan(parse(offload), 8, 80 * GB, QWEN7B)
    assert streamed.host_bytes == pytest.approx(base.host_bytes + 2 * teacher.num_params)
    gemma = dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256)
    hf = config_plan(parse([*offload, "--train.teacher.path", _model_dir(tmp_path, "gemma", **gemma)]), 8, 80 * GB,
                     QWEN7B)
    assert not any(t.name.startswith("teacher (") or t.name.startswith("teacher root") for t in hf.phases[-1].terms)
    assert hf.host_bytes == pytest.approx(base.host_bytes + 4 * Shape.from_hf(gemma).num_params / 8)


def test_a_model_that_caps_its_logits_is_planned_with_the_torch_head_the_trainer_runs():
    """Gemma-2's final_logit_softcapping makes the trainer's auto head torch (the fused kernel caps nothing): the
    plan assumed the fused kernel, 6 GiB low in the head's phases for Gemma-2 9B's 256k vocabulary."""
    from rollpacker.config import parse
    from rollpacker.plan.memory import plan, setups
    from rollpacker.train.logprobs import resolve_impl

    gemma = Shape.from_hf(dict(model_type="gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                               num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                               final_logit_softcapping=30.0))
    assert resolve_impl("auto", torch.device("cuda"), softcap=30.0) == "torch"
    config = parse(["--preset", "qwen2.5-7b-8k"])
    train, rollout = setups(config, 8, shape=gemma)
    assert (train.head, train.softcap) == ("torch", True)
    uncapped = replace(gemma, softcap=False)
    fused = setups(config, 8, shape=uncapped)[0]
    assert fused.head == "fused"
    head = (lambda p: next(ph.total for ph in p.phases if ph.name == "backward (log-prob head)"))
    assert head(plan(gemma, train, rollout, 80 * GB)) > head(plan(uncapped, fused, rollout, 80 * GB)) + 4 * GB


def test_capped_attention_is_planned_with_the_eager_scores_the_hf_path_keeps():
    """Gemma-2's attn_logit_softcapping makes the hf path run transformers' eager attention (SDPA leaves the cap
    out), whose [heads, T, T] scores over the micro-batch the plan counts: kept by the block recomputed in the
    backward (full checkpointing), and their gradient. Gemma-2 9B at the 7B preset's 16384 tokens then does not
    fit an H100, and the refusal names the fix."""
    from rollpacker.config import parse
    from rollpacker.plan.memory import activations, check_fits, plan, setups

    gemma = Shape.from_hf(dict(model_type="gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                               num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                               final_logit_softcapping=30.0, attn_logit_softcapping=50.0))
    uncapped = replace(gemma, attn_softcap=False)
    config = parse(["--preset", "qwen2.5-7b-8k"])
    train, rollout = setups(config, 8, shape=gemma)
    assert (train.checkpointing, train.tokens, train.compute_bytes) == ("full", 16384, 2)
    scores = 16 * 16384**2
    capped, plain = activations(gemma, train), activations(uncapped, train)
    assert capped["blocks"] == plain["blocks"]  # a checkpointed block keeps only its input
    # the capped scores, the fp32 softmax and its bf16 copy (beside them, eager's q, k and v repeated to every head)
    assert capped["recompute"] - plain["recompute"] == pytest.approx(scores * (2 + 4 + 2), rel=0.01)
    blocks = (lambda p: next(ph for ph in p.phases if ph.name == "backward (blocks)"))
    assert blocks(plan(uncapped, train, rollout, 80 * GB)).total < 40 * GB
    assert blocks(plan(gemma, train, rollout, 80 * GB)).largest().bytes == scores * (2 + 8)
    with pytest.raises(UserError) as refused:
        check_fits(config, gemma, world_size=8, capacity=80 * GB)
    assert "Largest term: block backward (activation and weight gradients), 42.9 GB; set a smaller " \
           "train.micro_batch_tokens to shrink it" in str(refused.value)


def test_the_kl_reference_forward_is_planned_beside_none_of_the_policys_activations():
    """The reference's log-probs are taken before the policy's forward of a micro-batch (Trainer._loss) or in the
    step's no-grad first pass, as the teacher's: its phase counted the policy's saved activations too."""
    from rollpacker.config import parse
    from rollpacker.plan.memory import config_plan

    plan = config_plan(parse(["--preset", "qwen2.5-7b-8k", "--engine.kind", "vllm", "--train.kl-coef", "0.01",
                              "--train.activation-checkpointing", "none"]), 8, 80 * GB, QWEN7B)
    phases = {p.name: {t.name: t.bytes for t in p.terms} for p in plan.phases}
    forward, reference = phases["forward (log-prob head)"], phases["forward (KL reference)"]
    assert "saved activations" not in reference and forward["saved activations"] > 1e9
    flight = "KL reference in flight (2 blocks, root, one block's activations)"
    assert {n for n in forward if not n.startswith("log-prob head")} - {"saved activations"} \
        == set(reference) - {flight}
    # train.offload: streamed, its root and two layer buffers are held in every phase, not in flight again
    streamed = config_plan(parse(["--preset", "qwen2.5-7b-8k", "--engine.kind", "vllm", "--train.kl-coef", "0.01",
                                  "--train.activation-checkpointing", "none", "--train.offload"]), 8, 80 * GB, QWEN7B)
    held = 2 * (QWEN7B.root_params + 2 * QWEN7B.layer_params)
    for phase in streamed.phases:
        assert {t.name: t.bytes for t in phase.terms}["KL reference root and 2 layer buffers (streamed layers)"] == held
    streamed_reference = next(p for p in streamed.phases if p.name == "forward (KL reference)")
    assert reference[flight] - {t.name: t.bytes for t in streamed_reference.terms}[flight] == held


def test_a_critic_of_its_own_path_is_planned_at_its_own_shape(tmp_path):
    """train.critic.path's decoder, not the policy's, sizes the critic (a 0.5B critic beside 7B was planned as 7B)."""
    from rollpacker.config import parse
    from rollpacker.plan.memory import config_plan, critic_params

    small = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2)
    flags = ["--preset", "qwen2.5-7b-8k", "--engine.kind", "vllm", "--train.advantage", "gae"]
    p = config_plan(parse([*flags, "--train.critic.path", _model_dir(tmp_path, "c", **small)]), 8, 80 * GB, QWEN7B)
    critic = Shape.from_hf(small)
    for phase in p.phases:
        terms = {t.name: t.bytes for t in phase.terms}
        assert terms["critic parameters + optimizer state (sharded)"] == 12 * critic_params(critic) / 8, phase.name
    backward = {t.name: t.bytes for t in next(q for q in p.phases if q.name == "backward (critic)").terms}
    assert backward["unsharded critic root (embedding, norm, head)"] == 2 * (151936 + 2) * 896
    assert backward["unsharded blocks in flight (2)"] == 2 * 2 * critic.layer_params
    same = config_plan(parse(flags), 8, 80 * GB, QWEN7B)
    assert {t.name: t.bytes for t in same.phases[-1].terms}["critic parameters + optimizer state (sharded)"] == (
        12 * critic_params(QWEN7B) / 8)


def test_the_planners_engine_memory_is_planned_at_every_tp_it_may_run(monkeypatch):
    """With engine.memory_mb TorchEngine's decode workspace, the smaller of two bounds, peaks between TP 1 and the
    world's: TP 2 needs 84.5 GB where TP 1 and 8 need 64.5 and 60.8. The plan is the worst usable TP's (TP 8 is
    not usable: the 7B model has 4 KV heads)."""
    from rollpacker.config import parse
    from rollpacker.plan.memory import config_plan, plan, setups

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    config = parse(["--preset", "qwen2.5-7b-8k", "--engine.kind", "torch", "--plan.enabled",
                    "--engine.memory-mb", "22528", "--engine.max-num-seqs", "64"])
    train, _ = setups(config, 8, shape=QWEN7B)
    at = {tp: plan(QWEN7B, train, setups(config, 8, shape=QWEN7B, tp=tp)[1], 80 * GB).peak for tp in (1, 2, 4)}
    assert max(at, key=at.get) == 2 and at[2] > 80 * GB > at[1]
    planned = config_plan(config, 8, 80 * GB, QWEN7B)
    assert planned.peak == at[2] and not planned.fits


@pytest.mark.parametrize("flags, longest", [
    ([], 10240),  # engine.max_model_len: a prompt of up to 10239 tokens is served, the response stops at 10240
    (["--data.max-prompt-length", "512"], 512 + 8192),
    (["--engine.max-model-len", "0", "--data.max-prompt-length", "4096"], 4096 + 8192),
    (["--engine.max-model-len", "0"], 1024 + 8192),  # nothing caps the prompt: PROMPT_TOKENS assumed
])
def test_the_longest_sample_takes_the_prompt_the_config_allows(flags, longest):
    """The 7B preset's max_model_len (10240) lets prompts of 2048 tokens and more in: 1024 assumed planned 9216."""
    from rollpacker.config import parse
    from rollpacker.plan.memory import setups

    train, rollout = setups(parse(["--preset", "qwen2.5-7b-8k", *flags]), 8, shape=QWEN7B)
    assert rollout.longest == max(train.seq_lens) == longest
