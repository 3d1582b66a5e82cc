"""TorchEngine's batched sampling: temperature, top-k and top-p per request, seeded per position.

A request's draw at response position ``i`` is a hash of ``(seed, i)`` (:func:`uniform`). So a
token never depends on the batch, preemption or the TP rank, and a resumed request continues
exactly. TP rank 0's tokens are broadcast, so the ranks cannot diverge.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rollpacker.rollout.torch_engine.seq import Seq

MASK64 = (1 << 64) - 1


def uniform(seed: int, index: int) -> float:
    """A uniform draw in [0, 1) from (seed, index): splitmix64 of their combination."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


@dataclass
class Sampling:
    """Per-row sampling settings of a batch, as tensors."""

    temperatures: torch.Tensor | None
    """[B, 1] (1 for greedy rows); None when no row samples."""
    sampled: list[int]
    """Rows with temperature > 0."""
    sampled_index: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None

    @classmethod
    def of(cls, seqs: list[Seq], vocab: int, device: torch.device) -> Sampling:
        params = [s.req.params for s in seqs]
        temps = [p.temperature or 1.0 for p in params]
        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        if not sampled:
            return cls(None, [], None, None, None)
        return cls(
            torch.tensor(temps, device=device)[:, None],
            sampled,
            torch.tensor(sampled, device=device),
            torch.tensor([params[i].top_k or vocab for i in sampled], device=device),
            torch.tensor([params[i].top_p for i in sampled], device=device),
        )


def sample_tokens(seqs: list[Seq], logits: torch.Tensor, sampling: Sampling, offsets: list[int] | None = None,
              tp_group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [B, vocab] fp32 -> the next token of every row [B] (the same on every TP rank)
    and its log-prob [B]. Row ``i`` draws response position ``len(tokens) + offsets[i]`` (a
    verify step's later draft positions)."""
    if sampling.temperatures is not None:
        logits = logits / sampling.temperatures
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen, tokens = logprobs.max(dim=-1)  # greedy: the first most likely token
    if sampling.sampled:
        u = torch.tensor([uniform(seqs[i].seed, len(seqs[i].out.token_ids) + (offsets[i] if offsets else 0))
                          for i in sampling.sampled], device=logits.device)
        idx = sampling.sampled_index
        tokens[idx] = sample(logprobs[idx], sampling.top_k, sampling.top_p, u)
    if tp_group is not None:
        dist.broadcast(tokens, group=tp_group, group_src=0)
    if sampling.sampled or tp_group is not None:
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return tokens, chosen


def sample(logprobs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling of one token per row with top-k/top-p truncation. logprobs: [B, V];
    top_k, top_p, u (the uniform draws): [B].

    The truncation walks a row in descending-probability order; the draw walks the kept tokens in
    vocabulary order. A row's probabilities differ in their last bits with what shares its batch,
    which would reorder a near-uniform row's descending walk and move its draw to another token; in
    vocabulary order they move the draw's boundaries by as much, so the token stays the same but
    for a draw that far from a boundary.
    """
    vocab = logprobs.shape[1]
    probs, order = logprobs.exp().sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=probs.device)[None, :]
    before = probs.cumsum(-1) - probs  # mass strictly before each token
    kept = probs * ((rank < top_k[:, None]) & ((before < top_p[:, None]) | (rank == 0)))
    cdf = torch.zeros_like(kept).scatter_(1, order, kept).cumsum(-1)  # in vocabulary order
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1).squeeze(1)
