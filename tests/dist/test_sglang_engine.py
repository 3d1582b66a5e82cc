"""SGLangEngine against transformers on the shipped toy model: greedy tokens and log-probs,
abort/resume, weight updates, memory release. GPU only: skipped without CUDA or SGLang
(``pip install sglang==0.5.23`` on a GPU machine). Written without a GPU: never run yet."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("SGLangEngine needs a CUDA device", allow_module_level=True)
pytest.importorskip("sglang", reason="SGLang not installed: pip install sglang==0.5.23 on a GPU machine")

from rollpacker.data.toy_model import toy_model_dir  # noqa: E402
from rollpacker.model import load_model  # noqa: E402
from rollpacker.rollout.config import EngineConfig  # noqa: E402
from rollpacker.rollout.engine import Request, SamplingParams, generate, reference_logprobs  # noqa: E402
from rollpacker.rollout.sglang_engine import SGLangEngine  # noqa: E402

from vllm_common import hf_greedy, hf_logits, hf_model, perturbed, prompts  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The toy model and a copy with other weights."""
    return toy_model_dir(), perturbed(toy_model_dir(), tmp_path_factory.mktemp("sglang") / "toy_b")


@pytest.fixture(scope="module")
def engine(models):
    """fp32 to compare with transformers exactly: triton attention (flashinfer's kernels are half precision).
    ``build_engine`` makes the same engine with SGLang's default attention backend."""
    eng = SGLangEngine(models[0], EngineConfig(kind="sglang", memory_fraction=0.3, max_num_seqs=16),
                       dtype=torch.float32, attention_backend="triton")
    yield eng
    eng.shutdown()


def greedy(i: int, prompt: list[int], n: int) -> Request:
    return Request(id=f"g{i}", prompt_ids=prompt, params=SamplingParams(max_new_tokens=n, temperature=0,
                                                                        ignore_eos=True))


def test_greedy_matches_transformers(models, engine):
    assert not engine.logprobs_truncated
    reqs = [greedy(i, p, 16) for i, p in enumerate(prompts(4, 12))]
    got = generate(engine, reqs)
    hf = hf_model(models[0])
    for r in reqs:
        out = got[r.id]
        assert out.token_ids == hf_greedy(hf, r.prompt_ids, 16)
        assert out.finish_reason == "length" and out.first_token_time <= out.finish_time
        ref = reference_logprobs(hf_logits(hf, r.prompt_ids, out.token_ids), torch.tensor(out.token_ids), r.params)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-3, rtol=0)


def test_abort_then_resume_continues_greedy(engine):
    prompt = prompts(1, 20, seed=2)[0]
    full = generate(engine, [greedy(0, prompt, 200)])["g0"]
    req = greedy(1, prompt, 200)
    engine.add(req)
    engine.add(greedy(2, prompt[:10], 10))
    while not any(o.id == "g2" for o in engine.step()):  # the short one finishes: the long one is partway
        pass
    partial = engine.abort(req.id)
    assert partial.finish_reason == "abort" and 0 < len(partial.token_ids) < 200
    assert len(partial.logprobs) == len(partial.token_ids)
    with pytest.raises(KeyError):
        engine.abort(req.id)
    done = generate(engine, [Request(id=req.id, prompt_ids=prompt, params=req.params, resume_from=partial)])
    assert done[req.id].token_ids == full.token_ids
    torch.testing.assert_close(done[req.id].logprobs, full.logprobs, atol=1e-3, rtol=0)


def test_bad_requests_raise(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.add(greedy(9, [], 4))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add(greedy(9, [1] * 2000, 4))
    assert not engine.has_unfinished()


def test_update_weights_then_release_and_resume(models, engine):
    """Push the other model's weights under rollpacker's names (prompts longer than a page, so a
    stale radix cache would show); outputs equal transformers' on them, also after a memory release."""
    reqs = [greedy(200 + i, p, 12) for i, p in enumerate(prompts(3, 150, seed=4))]
    generate(engine, reqs)
    engine.update_weights(load_model(models[1]).named_parameters())
    hf = hf_model(models[1])
    expected = {r.id: hf_greedy(hf, r.prompt_ids, 12) for r in reqs}
    assert {k: o.token_ids for k, o in generate(engine, reqs).items()} == expected
    engine.release_memory()
    engine.resume_memory()
    assert {k: o.token_ids for k, o in generate(engine, reqs).items()} == expected
    engine.update_weights(load_model(models[0]).named_parameters())
    assert generate(engine, reqs[:1])[reqs[0].id].token_ids == hf_greedy(hf_model(models[0]), reqs[0].prompt_ids, 12)
