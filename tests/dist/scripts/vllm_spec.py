"""Run by tests/dist/rollout/test_vllm_engine.py (slow tier): vLLM's own n-gram speculation through the
adapter, greedy on the toy model, against TorchEngine; a sampled request refused on CPU."""

import os

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from rollpacker.rollout import build_engine  # noqa: E402
from rollpacker.rollout.config import EngineConfig  # noqa: E402
from rollpacker.rollout.engine import Request, SamplingParams, generate, spec_metrics  # noqa: E402
from rollpacker.toy import task as toy  # noqa: E402
from rollpacker.toy.model import toy_model_dir  # noqa: E402


def main() -> None:
    path = toy_model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    params = SamplingParams(max_new_tokens=120, temperature=0)
    reqs = [Request(id=str(i), prompt_ids=tok.encode(r["prompt"]), params=params)
            for i, r in enumerate(toy.make_dataset(4, seed=5))]
    expected = generate(build_engine(EngineConfig(), path, "cpu", torch.float32), reqs)
    vllm = build_engine(EngineConfig(kind="vllm", speculative="on", spec_max_tokens=4, kv_memory_mb=16,
                                     memory_fraction=0.05), path, "cpu", torch.float32)
    got = generate(vllm, reqs)
    for r in reqs:
        assert got[r.id].token_ids == expected[r.id].token_ids, r.id
        torch.testing.assert_close(got[r.id].logprobs, expected[r.id].logprobs, atol=1e-4, rtol=0)
    metrics = spec_metrics(vllm.stats().spec)
    assert metrics["rollout/spec_acceptance/ngram"] > 0, metrics
    try:
        vllm.add(Request(id="s", prompt_ids=reqs[0].prompt_ids, params=SamplingParams(max_new_tokens=4, seed=1)))
    except ValueError as e:
        assert "NaN log-probs" in str(e), e
    else:
        raise AssertionError("a sampled request with speculation was accepted on CPU")
    print("OK", metrics, flush=True)


if __name__ == "__main__":
    main()
