"""TorchEngine's batched sampling: temperature, repetition penalty, min-p, top-k and top-p per request,
seeded per position, in vLLM's order (penalty, temperature, min-p, top-k, then top-p over what is left).
A request's log-probs are its model's at its temperature whatever truncates or penalizes its draw.

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
    min_p: torch.Tensor | None
    penalties: torch.Tensor | None = None
    """[B, 1] repetition penalties; None when no row has one."""
    seen: torch.Tensor | None = None
    """[B, vocab] bool: the tokens of each row's prompt and response so far (with ``penalties``)."""

    @classmethod
    def of(cls, seqs: list[Seq], vocab: int, device: torch.device, drafted: list[list[int]] | None = None) -> Sampling:
        """The settings of rows ``seqs``; ``drafted``: the draft tokens before each row's position (a verify step)."""
        params = [s.req.params for s in seqs]
        penalties, seen = None, None
        if any(p.repetition_penalty != 1 for p in params):
            penalties = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
            rows = [s.tokens + (drafted[i] if drafted else []) for i, s in enumerate(seqs)]
            index = torch.tensor([i for i, row in enumerate(rows) for _ in row], device=device)
            seen = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=device)
            seen[index, torch.tensor([t for row in rows for t in row], device=device)] = True
        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        if not sampled:
            return cls(None, [], None, None, None, None, penalties, seen)
        min_p = [params[i].min_p for i in sampled]
        return cls(
            torch.tensor([p.temperature or 1.0 for p in params], device=device)[:, None],
            sampled,
            torch.tensor(sampled, device=device),
            torch.tensor([params[i].top_k or vocab for i in sampled], device=device),
            torch.tensor([params[i].top_p for i in sampled], device=device),
            torch.tensor(min_p, device=device) if any(min_p) else None,
            penalties, seen,
        )

    def advance(self, tokens: torch.Tensor) -> None:
        """Every row drew ``tokens`` [B]: the penalty counts them from now on."""
        if self.seen is not None:
            self.seen[torch.arange(len(tokens), device=tokens.device), tokens] = True


def sample_tokens(seqs: list[Seq], logits: torch.Tensor, sampling: Sampling, offsets: list[int] | None = None,
              tp_group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [B, vocab] fp32 -> the next token of every row [B] (the same on every TP rank)
    and its log-prob [B]. Row ``i`` draws response position ``len(tokens) + offsets[i]`` (a
    verify step's later draft positions)."""
    if sampling.temperatures is not None:
        logits = logits / sampling.temperatures
    logprobs = torch.log_softmax(logits, dim=-1)
    drawn = logprobs
    if sampling.penalties is not None:  # on logits / T as on logits: the penalty keeps a logit's sign
        p = sampling.penalties
        penalized = torch.where(sampling.seen, torch.where(logits > 0, logits / p, logits * p), logits)
        drawn = torch.log_softmax(penalized, dim=-1)
    chosen, tokens = drawn.max(dim=-1)  # greedy: the first most likely token
    if sampling.sampled:
        u = torch.tensor([uniform(seqs[i].seed, len(seqs[i].out.token_ids) + (offsets[i] if offsets else 0))
                          for i in sampling.sampled], device=logits.device)
        idx = sampling.sampled_index
        tokens[idx] = sample(drawn[idx], sampling.top_k, sampling.top_p, u, sampling.min_p)
    if tp_group is not None:
        dist.broadcast(tokens, group=tp_group, group_src=0)
    if sampling.sampled or tp_group is not None or drawn is not logprobs:
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return tokens, chosen


def sample(logprobs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor,
           min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse-CDF sampling of one token per row with min-p, top-k, then top-p truncation (top-p over the
    mass the first two keep, as vLLM and Hugging Face renormalize). logprobs: [B, V]; top_k, top_p, u (the
    uniform draws, in [0, 1]: a float32 draw may round up to 1), min_p: [B]. Top-k keeps every token
    tied with the k-th, as Hugging Face's and vLLM's do. The token returned is always a kept one.

    The truncation walks a row in descending-probability order; the draw walks the kept tokens in
    vocabulary order. A row's probabilities differ in their last bits with what shares its batch,
    which would reorder a near-uniform row's descending walk and move its draw to another token; in
    vocabulary order they move the draw's boundaries by as much, so the token stays the same but
    for a draw that far from a boundary.
    """
    vocab = logprobs.shape[1]
    probs, order = logprobs.exp().sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=probs.device)[None, :]
    kept = probs >= probs.gather(1, top_k.clamp(1, vocab)[:, None] - 1)  # the k-th and all tied with it
    if min_p is not None:
        kept &= probs >= min_p[:, None] * probs[:, :1]
    before = (probs * kept).cumsum(-1) - probs  # kept mass strictly before each token
    kept &= (before < top_p[:, None] * (probs * kept).sum(-1, keepdim=True)) | (rank == 0) | (top_p[:, None] >= 1)
    kept = probs * kept
    cdf = torch.zeros_like(kept).scatter_(1, order, kept).cumsum(-1)  # in vocabulary order
    total = cdf[:, -1:]
    # strictly below the kept mass: u * total rounds up to it when u rounds to 1 (float32), and a target at
    # the total would land past the last kept token, on whatever ids follow it
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp(max=vocab - 1).squeeze(1)  # clamp: a NaN row
