"""TorchEngine's speculative decoding: model-free drafts verified in one forward, tokens unchanged.

- A verify step runs each row's newest token and its draft (:class:`VerifyAttention`).
- At each draft position it samples the token a plain step would, with that position's own draw,
  and keeps the draft while it matches, then that token: the output is plain decoding's.
- ``auto`` drafts only where the engine's measured step cost (:mod:`~rollpacker.rollout.spec_cost`)
  says it pays, and backs off where its drafted steps realize fewer tokens per second than its plain ones.
  The drafts come from :mod:`~rollpacker.rollout.drafter`.
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from rollpacker.rollout.drafter import Draft
from rollpacker.rollout.engine import Output, SpecStats
from rollpacker.rollout.spec_cost import SpecCost
from rollpacker.rollout.torch_engine.kv import DecodeBatch, LengthGroup
from rollpacker.rollout.torch_engine.sampling import Sampling

SPEC_COSTS: dict[tuple, SpecCost] = {}
"""Measured verify-step costs of this process, by model, TP size, device and engine settings."""


class VerifyAttention:
    """Verify-step attention backend: each row appends the K/V of its ``width`` queries (its newest
    token, then its draft, padded) to its workspace row and attends causally over its context and
    them. Columns past a row's accepted tokens are left behind: masked, and overwritten later."""

    def __init__(self, batch: DecodeBatch, width: int):
        self.batch, self.width, self.scale = batch, width, batch.scale
        self.plans = [self._plan(g) for g in batch.order]

    def _plan(self, g: LengthGroup) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The group's flat K and V write positions [rows, width, 2, kv, d], hidden columns
        [rows, 1, width, 1, attended] and attended width."""
        n, w, dev = len(g.seqs), self.width, g.device
        base, step = g.verify_index(w)
        lengths = [len(s.tokens) for s in g.seqs]
        newest = torch.tensor(lengths, device=dev) - 1  # the column of each row's first query
        attended = max(lengths) - 1 + w
        columns = newest[:, None] + torch.arange(w, device=dev)  # [rows, width]
        hidden = torch.arange(attended, device=dev) > columns[:, :, None]
        return base + newest.view(n, 1, 1, 1, 1) * step, hidden.view(n, 1, w, 1, attended), attended

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        w, kv_heads, d = self.width, kv.shape[2], q.shape[2]
        group_size = q.shape[1] // kv_heads
        outs = []
        for g, (index, hidden, attended) in zip(self.batch.order, self.plans):
            n, lo, hi = g.stop - g.start, g.start * w, g.stop * w
            g.flat[layer].put_(index, kv[lo:hi])
            qg = q[lo:hi].mul(self.scale).view(n, w, kv_heads, group_size, d).transpose(1, 2)
            scores = torch.bmm(qg.reshape(n * kv_heads, w * group_size, d), g.k_mats[layer][..., :attended])
            scores.view(n, kv_heads, w, group_size, attended).masked_fill_(hidden, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.bmm(probs, g.v_mats[layer][:, :attended]).view(n, kv_heads, w, group_size, d)
            outs.append(out.transpose(1, 2).reshape(n * w, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class Speculation:
    """TorchEngine's verify steps (a mixin): what :meth:`TorchEngine._decode` calls when drafts
    pay. It uses the engine's ``running``, ``drafter``, ``decoder``, ``spec``, ``spec_cost``, ``realized`` and
    its ``_sample``, ``_append`` and ``_decode``."""

    def _propose(self) -> int:
        """Set each running request's draft for this step; the longest draft's length (0: plain decode).

        ``on`` verifies every draft the drafter has (up to ``spec_max_tokens``); ``auto`` drafts only
        up to the cost table's ``max_rows`` running requests, where its realized payoff allows
        (:class:`~rollpacker.rollout.spec_cost.Realized`), and cuts drafts to the length that
        maximizes expected tokens per millisecond (:meth:`SpecCost.draft_len`)."""
        mode, n, cost = self.config.speculative, len(self.running), self.spec_cost
        for seq in self.running:
            seq.draft = None
        if mode == "off" or mode == "auto" and (cost is None or n > cost.max_rows or not self.realized.allows()):
            return 0
        k_max = self.config.spec_max_tokens
        if mode == "auto" and not cost.worth_drafting(n, [s.acceptance.rate for s in self.running], k_max):
            for seq in self.running:  # not even full drafts would pay at their acceptance: don't draft
                seq.acceptance.fade()
            return 0
        self.num_proposing_steps += 1  # drafting costs this step whether or not a draft comes of it
        start = time.perf_counter()
        for seq in self.running:
            room = seq.max_len - len(seq.tokens) - 1  # a verify step appends up to draft + 1 tokens
            if room > 0:
                seq.draft = self.drafter.propose(seq.req.id, min(k_max, room))
                self.spec.num_asked += 1
        self.spec.draft_seconds += time.perf_counter() - start
        drafted = [s for s in self.running if s.draft is not None]
        k = max((len(s.draft.tokens) for s in drafted), default=0)
        if mode == "auto" and drafted:
            k = cost.draft_len(n, [(len(s.draft.tokens), s.acceptance.rate) for s in drafted], k)
            for s in drafted:
                s.draft = Draft(s.draft.tokens[:k], s.draft.source) if k else None
        for seq in self.running:
            if seq.draft is None:
                seq.acceptance.fade()
        return k

    def _force(self, drafts: dict[str, list[int]]) -> int:
        """Set the given drafts (by request id; cut to each request's room) instead of the drafter's."""
        for seq in self.running:
            tokens = drafts.get(seq.req.id, [])[: max(0, seq.max_len - len(seq.tokens) - 1)]
            seq.draft = Draft(list(tokens), "forced") if tokens else None
        return max((len(s.draft.tokens) for s in self.running if s.draft is not None), default=0)

    def _verify(self, batch: DecodeBatch, num_draft: int) -> list[Output]:
        """One forward over every row's newest token and draft (padded to ``num_draft``): at each
        draft position, the token the engine samples there with that position's own draw; a row
        keeps its draft while it matches, then the first sampled token that differs (or the one
        after a fully accepted draft)."""
        width, seqs, limit = num_draft + 1, batch.seqs, self.max_model_len - 1
        drafts = [s.draft.tokens if s.draft is not None else [] for s in seqs]
        tokens = [t for s, d in zip(seqs, drafts) for t in (s.tokens[-1], *d, *[0] * (num_draft - len(d)))]
        positions = [min(len(s.tokens) - 1 + j, limit) for s in seqs for j in range(width)]
        dev = self.device
        hidden = self.decoder(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev),
                              VerifyAttention(batch, width))
        picked = [b * width + j for b, d in enumerate(drafts) for j in range(len(d) + 1)]
        rows = [s for s, d in zip(seqs, drafts) for _ in range(len(d) + 1)]
        offsets = [j for d in drafts for j in range(len(d) + 1)]
        logits = self.model.logits(hidden[torch.tensor(picked, device=dev)])
        before = [d[:j] for d in drafts for j in range(len(d) + 1)]  # what the penalty counts besides the row's tokens
        sampling = Sampling.of(rows, self.model.args.vocab_size, dev, before)
        sampled, logprobs = self._sample(rows, logits, sampling, offsets)
        sampled, logprobs = sampled.tolist(), logprobs.tolist()
        kept_tokens, kept_logprobs, verified, i = [], [], [], 0
        for seq, draft in zip(seqs, drafts):
            accepted = 0
            while accepted < len(draft) and sampled[i + accepted] == draft[accepted]:
                accepted += 1
            kept_tokens.append(sampled[i:i + accepted + 1])
            kept_logprobs.append(logprobs[i:i + accepted + 1])
            i += len(draft) + 1
            verified.append((seq, len(draft), accepted, len(seq.tokens)))
        self.spec.num_verify_steps += 1
        done = self._append(seqs, kept_tokens, kept_logprobs)
        for seq, drafted, accepted, before in verified:
            emitted = len(seq.tokens) - before
            if emitted <= accepted:  # a stop among the accepted tokens: the draft after it was never emitted, and
                drafted = accepted = emitted - 1  # the stop counts as the row's own token (accepted + 1 emitted)
            self.spec.count(seq.draft.source if seq.draft is not None else "none", drafted, accepted)
            if drafted:
                seq.acceptance.update(drafted, accepted)
        batch.resync()
        return done

    def verify_step(self, drafts: dict[str, list[int]]) -> list[Output]:
        """One decode step that verifies ``drafts`` (request id -> draft tokens) instead of the
        drafter's: how :func:`~rollpacker.rollout.probe.verify_step_ms` times verify steps."""
        with torch.inference_mode():
            if self._admit():
                raise RuntimeError("verify_step with requests waiting for their prefill: step() first")
            return self._decode(drafts)

    def calibrate(self) -> SpecCost:
        """Measure :attr:`spec_cost` (``engine.speculative=auto``'s verify-step cost) on this engine,
        with the requests in flight set aside; TP rank 0's table is every rank's. A process measures
        once per model, TP size and engine settings. Counters are left as they were."""
        key = (repr(self.model.args), dist.get_world_size(self.tp_group) if self.tp_group else 1, str(self.device),
               self.dtype, self.config.block_size, self.config.spec_max_tokens, self.config.max_num_seqs,
               self.max_model_len, self.num_blocks, self.config.max_prefill_tokens)
        if key not in SPEC_COSTS:
            from rollpacker.rollout.probe import measure_spec_cost

            saved = (self.waiting, self.num_preemptions, self.num_generated_tokens, self.num_prefill_tokens, self.spec)
            self.waiting, self.calibrating, self.spec = deque(), True, SpecStats()
            try:
                context = min(128, self.max_model_len // 4)
                cost = measure_spec_cost(self, min(32, self.config.max_num_seqs), self.config.spec_max_tokens, context)
            finally:
                self.calibrating = False
                (self.waiting, self.num_preemptions, self.num_generated_tokens, self.num_prefill_tokens,
                 self.spec) = saved
            if self.tp_group is not None:
                box = [cost]
                dist.broadcast_object_list(box, group=self.tp_group, group_src=0)
                cost = box[0]
            SPEC_COSTS[key] = cost
        self.spec_cost = SPEC_COSTS[key]
        return self.spec_cost
