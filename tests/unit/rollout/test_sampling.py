"""TorchEngine's sampler keeps Hugging Face's and vLLM's token set: the draw never escapes the filters,
and top-k keeps every token tied with the k-th."""

from __future__ import annotations

import torch

from rollpacker.model import load_model
from rollpacker.rollout.config import EngineConfig
from rollpacker.rollout.engine import Request, SamplingParams, generate, reference_logprobs
from rollpacker.rollout.torch_engine import TorchEngine
from rollpacker.rollout.torch_engine.sampling import sample, uniform

ROUNDS_TO_ONE = 26598937
"""A seed whose first draw is at least 1 - 2**-25: 1.0 in float32."""


def test_a_draw_that_rounds_to_one_stays_inside_the_filters(qwen2_dir):
    """A draw of 1 (a float32 draw past 1 - 2**-25) ran past the kept tokens onto the last vocabulary id."""
    assert uniform(ROUNDS_TO_ONE, 0) < 1 and torch.tensor([uniform(ROUNDS_TO_ONE, 0)]).item() == 1.0
    logprobs = torch.log_softmax(torch.tensor([[0.0, 3.0, 2.0, 1.0, 2.9, 0.5]]), -1).expand(3, 6)
    ones = torch.ones(3)
    # top-k 1; top-p 0.3 (the likeliest alone); min-p 0.9 of the likeliest (1 and 4): never the last id, 5
    drawn = sample(logprobs, torch.tensor([1, 6, 6]), torch.tensor([1.0, 0.3, 1.0]), ones, torch.tensor([0, 0, 0.9]))
    assert drawn.tolist() == [1, 1, 4]
    eng = TorchEngine(load_model(qwen2_dir), EngineConfig(block_size=4))
    top1, greedy = (SamplingParams(max_new_tokens=1, ignore_eos=True, temperature=t, top_k=1, seed=ROUNDS_TO_ONE)
                    for t in (1.0, 0))
    outs = generate(eng, [Request(id="top1", prompt_ids=[1, 2, 3, 4], params=top1),
                          Request(id="greedy", prompt_ids=[1, 2, 3, 4], params=greedy)])
    assert outs["top1"].token_ids == outs["greedy"].token_ids != [eng.model.args.vocab_size - 1]


def test_top_k_keeps_every_token_tied_with_the_kth():
    """As Hugging Face's TopKLogitsWarper, vLLM and ``reference_logprobs(truncated=True)``: in proportion."""
    logits = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.5, 0.0])
    n = 20000
    u = torch.arange(n, dtype=torch.float64).div(n).float()
    drawn = sample(torch.log_softmax(logits, -1).expand(n, 6), torch.full((n,), 2), torch.ones(n), u)
    shares = torch.bincount(drawn, minlength=6).float() / n
    tokens = torch.arange(6)
    want = reference_logprobs(logits.expand(6, 6), tokens, SamplingParams(max_new_tokens=1, top_k=2),
                              truncated=True).exp()
    assert set(drawn.tolist()) == {0, 1, 2, 3}
    torch.testing.assert_close(shares, want, atol=1e-3, rtol=0)
