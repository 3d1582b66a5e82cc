"""Measuring an engine on this machine: random prompts, decode-step timings, peak matmul FLOP/s.

Shared by the planner's profiler (``rollpacker.profile``), the engine benchmark
(``rollpacker.bench.engine``) and TorchEngine's speculation cost (:func:`measure_spec_cost`).
"""

from __future__ import annotations

import time


def peak_flops(size: int, reps: int, device: str = "cpu") -> float:
    """Best FLOP/s of a ``size``-square fp32 matmul on ``device`` (CPU: this thread count; CUDA: as
    the backends' TF32 setting says)."""
    import torch

    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    c = torch.empty(size, size, device=device)
    torch.mm(a, b, out=c)  # warm-up
    clock, best = time.perf_counter if device == "cpu" else step_clock(device), float("inf")
    for _ in range(reps):
        t = clock()
        torch.mm(a, b, out=c)
        best = min(best, clock() - t)
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
        lengths = [min(ragged, max(1, round(prompt_len * (0.25 + 1.5 * i / (num_running - 1)))))
                   for i in range(num_running)]
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


def step_clock(device):
    """The clock that times an engine step: on CPU this process's CPU time (the engine's own work,
    whatever else runs on a shared machine), on a GPU the wall time after synchronizing."""
    import torch

    if torch.device(device).type == "cpu":
        return time.process_time

    def wall() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return wall


def verify_step_ms(engine, num_running: int, draft_lens: list[int], prompt_len: int, vocab_size: int,
                   avoid: set[int], steps: int, seed: int) -> list[float]:
    """Per draft length in ``draft_lens``: the fastest of ``steps`` TorchEngine verify steps, in ms
    (:meth:`~rollpacker.rollout.torch_engine.TorchEngine.verify_step`; see :func:`step_clock`) of ``num_running``
    greedy
    requests of ``prompt_len`` prompt tokens, each verifying that many draft tokens (after one
    untimed step). The requests carry a seed, so the engine's own seed generator is left alone."""
    import dataclasses

    prompts = random_prompts(num_running, prompt_len, vocab_size, avoid, seed)
    new = 3 + (steps + 1) * sum(k + 1 for k in draft_lens)
    reqs = greedy_requests(prompts, new, f"spec-probe{num_running}")
    for r in reqs:
        r.params = dataclasses.replace(r.params, seed=0)
        engine.add(r)
    engine.step()  # prefill of all of them
    engine.step()  # their first decode step
    if engine.stats().num_running != num_running:
        raise RuntimeError(f"probe: {engine.stats().num_running} running, expected {num_running}")
    clock = step_clock(engine.device)
    times: dict[int, list[float]] = {k: [] for k in draft_lens}
    for _ in range(steps + 1):  # the draft lengths interleaved: a shared machine's load hits them alike
        for k in draft_lens:
            drafts = {r.id: [prompts[i][-1]] * k for i, r in enumerate(reqs)}
            start = clock()
            engine.verify_step(drafts)
            times[k].append(clock() - start)
    fastest = [1e3 * min(times[k][1:]) for k in draft_lens]  # the first round warms up
    for r in reqs:
        engine.abort(r.id)
    return fastest


def measure_spec_cost(engine, max_rows: int, max_draft: int, prompt_len: int, steps: int = 5):
    """TorchEngine's :class:`~rollpacker.rollout.spec_cost.SpecCost`: verify-step time at 1, 2, 4, ...
    ``max_rows`` running requests and 0, 1, 2, 4, ... ``max_draft`` draft tokens each."""
    from rollpacker.rollout.spec_cost import SpecCost

    lens, steps = spec_probe(engine.max_model_len, max_draft, steps, kv_tokens=engine.kv_capacity_tokens)
    new = 3 + (steps + 1) * sum(k + 1 for k in lens)  # tokens each probe request generates
    prompt_len = max(1, min(prompt_len, engine.max_model_len - new - 1, engine.kv_capacity_tokens - new))
    blocks = (lambda tokens: -(-tokens // engine.config.block_size))
    # requests the engine runs at once: its rows, and the KV cache to their ends and as it admits them (a spare
    # block per running request), whose prompts one step prefills (verify_step_ms times them all from its second)
    fits = min(engine.config.max_num_seqs, engine.num_blocks // blocks(prompt_len + new),
               (engine.num_blocks + 1) // (blocks(prompt_len) + 1))
    rows = [n for n in (1, 2, 4, 8, 16, 32, 64)
            if n <= min(max_rows, fits) and n * prompt_len <= engine.config.max_prefill_tokens] or [1]
    args = engine.model.args
    ms = [verify_step_ms(engine, n, lens, prompt_len, args.vocab_size, set(args.eos_token_ids), steps, seed=n)
          for n in rows]
    return SpecCost.smoothed(tuple(rows), tuple(lens), ms, draft_ms(max_draft, step_clock("cpu")))


def spec_probe(max_model_len: int, max_draft: int, steps: int = 5,
               kv_tokens: int | None = None) -> tuple[list[int], int]:
    """The draft lengths and timed steps of :func:`measure_spec_cost` whose probe requests fit ``max_model_len``
    and a KV cache of ``kv_tokens`` (a request finishing mid-probe leaves a verify step nothing to verify; one the
    cache cannot hold is refused): fewer steps, then fewer lengths between 0 and ``max_draft``; a ValueError where
    even the fewest do not fit."""
    lens = sorted({0, max_draft, *(k for k in (1, 2, 4, 8, 16) if k < max_draft)})
    room = min(max_model_len, kv_tokens + 1 if kv_tokens is not None else max_model_len)
    while 4 + (steps + 1) * sum(k + 1 for k in lens) >= room:  # a prompt token and the probe's tokens
        if steps > 1:
            steps -= 1
        elif len(lens) > 2:
            lens.pop(-2)
        else:
            held = f"a {max_model_len}-token context" if room == max_model_len else \
                f"a KV cache of {kv_tokens} tokens (engine.kv_memory_mb)"
            raise ValueError(f"engine.speculative=auto measures verify steps of up to {max_draft} draft tokens "
                             f"(engine.spec_max_tokens), which {held} cannot hold: lower engine.spec_max_tokens, "
                             "or set engine.speculative on or off")
    return lens, steps


def draft_ms(k: int, clock, num_siblings: int = 4, length: int = 256) -> float:
    """The drafter's mean ms per ``k``-token draft, indexing included: ``num_siblings`` requests of
    one prompt, each a noisy copy of one text from a small vocabulary, drafted for at every token."""
    import random

    from rollpacker.rollout.drafter import Drafter

    rng = random.Random(0)
    drafter, text = Drafter(), [rng.randrange(16) for _ in range(length)]
    prompt = [rng.randrange(16) for _ in range(32)]
    seqs = [list(prompt) for _ in range(num_siblings)]
    for i, seq in enumerate(seqs):
        drafter.add(f"s{i}", prompt, seq)
    start = clock()
    for t in text:
        for i, seq in enumerate(seqs):
            seq.append(t if rng.random() < 0.9 else rng.randrange(16))
            drafter.propose(f"s{i}", k)
    return 1e3 * (clock() - start) / (length * num_siblings)
