"""The pure parts of the SGLang adapter, without SGLang: streamed chunks into our Output, sampling
parameters, weight buckets and names, and the error when SGLang is missing."""

from __future__ import annotations

import builtins

import pytest
import torch

from rollpacker.rollout.engine import Output, Request, SamplingParams, hf_names, start_output
from rollpacker.rollout.sglang_engine import (
    SGLangEngine,
    Track,
    admits,
    apply_chunk,
    buckets,
    engine_args,
    memory_fraction,
    nccl_env,
    sglang_params,
)
from rollpacker.rollout.sglang_process import SGLANG_VERSION, cpu_binding


def chunk(ids, logprobs, reason=None, retractions=0):
    """A cumulative chunk as SGLang 0.5.23's tokenizer manager streams it with skip_tokenizer_init."""
    meta = {"id": "r", "finish_reason": reason, "num_retractions": retractions,
            "output_token_logprobs": [(lp, t, None) for lp, t in zip(logprobs, ids)]}
    return {"output_ids": list(ids), "meta_info": meta}


def test_cumulative_chunks_append_only_the_new_tokens():
    track = Track(Output(id="r", prompt_ids=[1, 2]))
    assert apply_chunk(track, chunk([5], [-0.5]), now=10.0) == (1, 0)
    assert apply_chunk(track, chunk([5], [-0.5]), now=11.0) == (0, 0)  # a repeated chunk adds nothing
    assert apply_chunk(track, chunk([5, 6, 7], [-0.5, -1.0, -2.0], retractions=1), now=12.0) == (2, 1)
    out = track.out
    assert out.token_ids == [5, 6, 7] and out.logprobs == [-0.5, -1.0, -2.0]
    assert out.first_token_time == 10.0 and out.finish_reason is None and out.num_preemptions == 1
    apply_chunk(track, chunk([5, 6, 7, 9], [-0.5, -1.0, -2.0, -0.1], {"type": "stop", "matched": 9}, 1), now=13.0)
    assert out.token_ids == [5, 6, 7, 9] and out.finish_reason == "stop" and out.finish_time == 13.0
    assert out.num_preemptions == 1 and track.seen == 4


def test_a_stop_string_finishes_at_the_token_completing_it():
    track = Track(Output(id="r", prompt_ids=[1]), stop=("cd",), decode=lambda ids: "".join(chr(97 + t) for t in ids))
    assert apply_chunk(track, chunk([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4]), now=1.0) == (3, 0)  # b c d: stop
    assert track.out.token_ids == [1, 2, 3] and track.out.finish_reason == "stop" and track.seen == 3


@pytest.mark.parametrize("kind,ours", [("length", "length"), ("abort", "abort"), ("stop", "stop")])
def test_finish_reasons(kind, ours):
    track = Track(Output(id="r", prompt_ids=[1]))
    apply_chunk(track, chunk([3], [-1.0], {"type": kind}), now=1.0)
    assert track.out.finish_reason == ours


def test_resumed_output_keeps_its_partial_and_preemptions():
    partial = Output(id="r", prompt_ids=[1], token_ids=[4, 5], logprobs=[-1.0, -2.0], first_token_time=3.0,
                     num_preemptions=2, finish_reason="abort")
    out = start_output(Request(id="r", prompt_ids=[1], params=SamplingParams(max_new_tokens=4),
                               resume_from=partial))
    track = Track(out)  # the SGLang request's own output starts empty: prompt + partial is its prompt
    apply_chunk(track, chunk([6], [-0.3], {"type": "length"}, retractions=1), now=9.0)
    assert out.token_ids == [4, 5, 6] and out.logprobs == [-1.0, -2.0, -0.3]
    assert out.first_token_time == 3.0 and out.num_preemptions == 3 and out.finish_reason == "length"


def test_abort_echo_without_retractions_key_keeps_the_count():
    track = Track(Output(id="r", prompt_ids=[1]), retractions=2)
    meta = {"finish_reason": {"type": "abort", "message": "Abort in waiting queue"}, "output_token_logprobs": []}
    assert apply_chunk(track, {"output_ids": [], "meta_info": meta}, now=1.0) == (0, 0)
    assert track.out.finish_reason == "abort" and track.out.token_ids == []


def test_chunk_without_logprobs_or_with_mismatched_tokens_raises():
    track = Track(Output(id="r", prompt_ids=[1]))
    with pytest.raises(RuntimeError, match="return_logprob"):
        apply_chunk(track, {"output_ids": [3], "meta_info": {"finish_reason": None}}, now=1.0)
    bad = chunk([3], [-1.0])
    bad["meta_info"]["output_token_logprobs"] = [(-1.0, 4, None)]
    with pytest.raises(RuntimeError, match="token 4 for token 3"):
        apply_chunk(track, bad, now=1.0)


def test_sampling_params():
    p = SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.9, top_k=0, stop_token_ids=(5,))
    got = sglang_params(p, remaining=6, eos_ids=(257,), seed=11)
    assert got["max_new_tokens"] == 6 and got["top_k"] == -1 and got["sampling_seed"] == 11
    assert got["stop_token_ids"] == [5, 257] and got["temperature"] == 0.7 and got["top_p"] == 0.9
    assert got["min_p"] == 0
    got = sglang_params(SamplingParams(max_new_tokens=4, top_k=20, ignore_eos=True), 4, (257,), 0)
    assert got["stop_token_ids"] == [] and got["ignore_eos"] and got["top_k"] == 20
    with pytest.raises(ValueError, match="sampler asserts on min-p with a per-request seed"):  # auto picked SGLang
        sglang_params(SamplingParams(max_new_tokens=4, min_p=0.1), 4, (257,), 0)
    with pytest.raises(ValueError, match="cuts top-p on the whole distribution's mass.*set one of rollout.top_k"):
        sglang_params(SamplingParams(max_new_tokens=4, top_k=3, top_p=0.4), 4, (257,), 0)
    with pytest.raises(ValueError, match="counts only the tokens it generated, not the prompt's"):
        sglang_params(SamplingParams(max_new_tokens=4, repetition_penalty=1.2), 4, (257,), 0)
    with pytest.raises(ValueError, match="ignores stop token ids too: set one of rollout.replay_lengths and rollout"):
        sglang_params(SamplingParams(max_new_tokens=4, ignore_eos=True, stop_token_ids=(5,)), 4, (257,), 0)


def test_what_sglang_never_starts():
    """Measured on SGLang 0.5.23's CPU path, a pool of 304 tokens in pages of 16: a 100-token prompt with 170
    to generate ran, with 176 its stream waited forever (and so did every request after it)."""
    assert admits(100, 170, 16, 304) and admits(112, 175, 16, 304)
    assert not admits(100, 176, 16, 304) and not admits(113, 170, 16, 304)


def test_buckets_bound_their_size_and_keep_order():
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 1, 100, 2])]
    got = list(buckets(iter(tensors), bucket_bytes=25 * 4))
    assert [[name for name, _ in b] for b in got] == [["t0", "t1"], ["t2"], ["t3", "t4"], ["t5"], ["t6"]]
    assert all(sum(t.numel() * 4 for _, t in b) <= 25 * 4 or len(b) == 1 for b in got)


def test_buckets_pull_lazily():
    pulled = []

    def named():
        for i in range(6):
            pulled.append(i)
            yield f"t{i}", torch.zeros(4)

    it = buckets(named(), bucket_bytes=32)
    assert [n for n, _ in next(it)] == ["t0", "t1"] and pulled == [0, 1, 2]  # one tensor past the bucket


def test_hf_names_on_rollpacker_parameters():
    named = [("embed_tokens.weight", torch.ones(2)), ("layers.0.mlp.up_proj.weight", torch.ones(2)),
             ("lm_head.weight", torch.ones(2))]
    assert [n for n, _ in hf_names(named, tied=True)] == ["model.embed_tokens.weight",
                                                          "model.layers.0.mlp.up_proj.weight"]
    assert [n for n, _ in hf_names(named, tied=False)][-1] == "lm_head.weight"


def test_missing_sglang_raises_a_clear_import_error(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_sglang(name, *args, **kwargs):
        if name == "sglang" or name.startswith("sglang."):
            raise ImportError("No module named 'sglang'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sglang)
    with pytest.raises(ImportError, match=rf"engine.kind=sglang needs SGLang .*pip install sglang=={SGLANG_VERSION} "
                                          "on a GPU machine"):
        SGLangEngine(tmp_path)
    from rollpacker.rollout import build_engine
    from rollpacker.rollout.config import EngineConfig

    with pytest.raises(ImportError, match="engine.kind=sglang needs SGLang"):
        build_engine(EngineConfig(kind="sglang"), tmp_path, "cuda", torch.bfloat16)


def test_cpu_binding_gives_each_local_rank_its_share_of_the_cores():
    assert cpu_binding([0, 1], 2) == "0|1"
    assert cpu_binding([0, 1, 2, 3], 2) == "0,1|2,3"
    assert cpu_binding([0, 1, 2], 1) == "0,1,2"
    assert cpu_binding([0, 1], 4) == "0|1|0|1"  # more ranks than cores: shared


def test_engine_args_size_the_kv_like_the_other_engines_and_pick_the_cpu_path():
    from rollpacker.model.hf import read_args
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.toy.model import toy_model_dir

    args = read_args(toy_model_dir())
    config = EngineConfig(kind="sglang", kv_memory_mb=4, max_num_seqs=8)
    cpu = engine_args(toy_model_dir(), config, args, 1, torch.float32, on_cpu=True)
    per_token = 2 * args.num_layers * args.num_kv_heads * args.head_dim * 4
    assert cpu["max_total_tokens"] == 4 * 2**20 // per_token and cpu["max_running_requests"] == 8
    assert cpu["context_length"] == args.max_position_embeddings  # SGLang refuses an input 6 tokens before it
    short = engine_args(toy_model_dir(), EngineConfig(kind="sglang", max_model_len=24), args, 1, torch.float32, True)
    assert short["context_length"] == 30
    assert cpu["device"] == "cpu" and cpu["attention_backend"] == "torch_native"
    assert not cpu["enable_memory_saver"] and cpu["enable_deterministic_inference"]
    assert cpu["mem_fraction_static"] == 0.9
    from rollpacker.model.hf_decoder import read_config
    from rollpacker.plan.memory import RolloutSetup, Shape, engine_terms

    setup = RolloutSetup(engine="sglang", tp=2, weight_bytes=2, kv_bytes=config.kv_memory_mb * 2**20,
                         max_num_seqs=config.max_num_seqs, prefill_tokens=config.max_prefill_tokens, released=True,
                         max_model_len=config.max_model_len)
    plan_bytes = sum(t.bytes for t in engine_terms(Shape.from_hf(read_config(toy_model_dir())), setup))
    gpu = engine_args(toy_model_dir(), config, args, 2, torch.bfloat16, on_cpu=False, free_bytes=8e9,
                      plan_bytes=plan_bytes)
    assert gpu["enable_memory_saver"] and "device" not in gpu and gpu["tp_size"] == 2
    # the memory plan's SGLang terms over the free memory: its process's 2 GB allowance dominates the toy model
    assert gpu["mem_fraction_static"] == memory_fraction(plan_bytes, 8e9)
    assert 0.25 < gpu["mem_fraction_static"] < 0.3
    half_heads = 2 * args.num_layers * max(1, args.num_kv_heads // 2) * args.head_dim * 2  # bf16, TP 2
    assert gpu["max_total_tokens"] == 4 * 2**20 // half_heads


def test_the_planner_is_refused_on_sglang_with_the_reason():
    from rollpacker.config import Config
    from rollpacker.plan.config import PlanConfig
    from rollpacker.rollout.config import EngineConfig

    with pytest.raises(ValueError, match="plan.enabled with engine.kind='sglang': a TP switch would restart "
                                         "SGLang's engines, and SGLang's Engine.shutdown kills every child process"):
        Config(engine=EngineConfig(kind="sglang"), plan=PlanConfig(enabled=True))


def test_sglangs_nccl_settings_are_what_its_deterministic_mode_sets_at_tp_2(monkeypatch):
    """SGLang 0.5.23 sets these in the Engine's process only, overriding any value (attention_hook.py)."""
    monkeypatch.delenv("SGLANG_DETERMINISTIC_NCCL_NCHANNELS", raising=False)
    assert nccl_env(1) == {}
    assert nccl_env(2) == {"NCCL_ALGO": "allreduce:tree", "NCCL_MIN_NCHANNELS": "8", "NCCL_MAX_NCHANNELS": "8"}
    monkeypatch.setenv("SGLANG_DETERMINISTIC_NCCL_NCHANNELS", "16")
    assert nccl_env(4)["NCCL_MAX_NCHANNELS"] == "16"
    from rollpacker.config import Config
    from rollpacker.job import engine_nccl_env
    from rollpacker.rollout.config import EngineConfig, RolloutConfig

    assert engine_nccl_env(Config(engine=EngineConfig(kind="sglang"), rollout=RolloutConfig(tp=2)))["NCCL_ALGO"]
    assert engine_nccl_env(Config(engine=EngineConfig(kind="vllm"), rollout=RolloutConfig(tp=2))) == {}
