"""Measuring an engine on this machine: random prompts, decode-step timings, peak matmul FLOP/s.

Shared by the planner's profiler (``rollpacker.plan.profile``) and the engine benchmark
(``rollpacker.bench.engine``).
"""

from __future__ import annotations

import time


def peak_flops(size: int, reps: int) -> float:
    """Best FLOP/s of a ``size``-square fp32 matmul on this machine and thread count."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    c = torch.empty(size, size)
    torch.mm(a, b, out=c)  # warm-up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best


def random_prompts(num: int, length: int, vocab_size: int, avoid: set[int], seed: int) -> list[list[int]]:
    """``num`` prompts of ``length`` ids drawn uniformly from the vocabulary minus ``avoid``."""
    import torch

    allowed = torch.tensor([t for t in range(vocab_size) if t not in avoid])
    g = torch.Generator().manual_seed(seed)
    return allowed[torch.randint(len(allowed), (num, length), generator=g)].tolist()


def greedy_requests(prompts: list[list[int]], new_tokens: int, tag: str) -> list:
    """Greedy requests of ``new_tokens`` each (EOS ignored), one per prompt, ids ``{tag}-{i}``."""
    from rollpacker.rollout.engine import Request, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [Request(id=f"{tag}-{i}", prompt_ids=p, params=params) for i, p in enumerate(prompts)]


def decode_step_ms(engine, num_running: int, prompt_len: int, vocab_size: int, avoid: set[int],
                   steps: int, seed: int, sampling=None, ragged: int = 0) -> list[float]:
    """ms of each of ``steps`` pure decode ``step()`` calls with ``num_running`` requests in flight,
    greedy or with ``sampling``'s temperature, top-p and top-k (a seed per request, as a run's).
    Every prompt has ``prompt_len`` tokens, or with ``ragged`` (the longest allowed) lengths spread
    evenly over ``prompt_len / 4 .. 7 * prompt_len / 4`` (mean ``prompt_len``), as a rollout's running
    requests are."""
    import dataclasses

    if ragged and num_running > 1:
        lengths = [min(ragged, round(prompt_len * (0.25 + 1.5 * i / (num_running - 1)))) for i in range(num_running)]
        prompts = [random_prompts(1, n, vocab_size, avoid, seed * 7919 + i)[0] for i, n in enumerate(lengths)]
    else:
        prompts = random_prompts(num_running, prompt_len, vocab_size, avoid, seed)
    reqs = greedy_requests(prompts, steps + 3, f"curve{num_running}")  # none finishes while timed
    if sampling is not None:
        for i, r in enumerate(reqs):
            r.params = dataclasses.replace(sampling, max_new_tokens=steps + 3, ignore_eos=True, seed=seed * 100_003 + i)
    for r in reqs:
        engine.add(r)
    engine.step()  # prefill of all of them
    engine.step()  # one untimed decode step
    if engine.stats().num_running != num_running:
        raise RuntimeError(f"probe: {engine.stats().num_running} running, expected {num_running}")
    prefilled = engine.stats().num_prefill_tokens
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    if engine.stats().num_prefill_tokens != prefilled:
        raise RuntimeError("probe: a timed step was a prefill, not a decode")
    for r in reqs:
        engine.abort(r.id)
    return [1e3 * t for t in times]
