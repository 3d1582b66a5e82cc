"""The LLM judge: a model scores (prompt, response) pairs, colocated with the actor.

A generative judge (a causal LM) scores against a rubric: the whole judge prompt, a template with
``{prompt}`` and ``{response}`` that ends where the score goes. One forward over the packed prompts
gives the verdict, the most likely next token. :func:`parse_verdict` reads it as an integer from 0 to
``max_score``; the reward is ``score / max_score``.

A reward model (a ``*ForSequenceClassification`` checkpoint) scores the conversation: the prompt, then
the response as the assistant's turn (an episode's turns as they went), in its tokenizer's chat
template (without one: the prompt's text and the response's, as TRL joins them). Its first label's
logit after the last token that is not padding is the reward, as TRL and Hugging Face read it.

Invariants:

- Anything but such a score is a :class:`RewardError` for that sample, never a silent 0.
- A row's own ``rubric`` replaces the configured one for that row (a generative judge's).
- Decoder layers that do not fit stream in from host memory. :func:`choose_resident_layers`
  picks how many stay resident, per batch, from the memory free.
- On CPU the streamed judge's logits equal the resident model's bit for bit.

Why: the judge shares the actor's GPU, so it must fit in what the KV cache leaves. Details and
how it differs from the paper: ``docs/rewards-and-judge.md``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from rollpacker.data.chat import messages
from rollpacker.model.args import ModelArgs, score_labels
from rollpacker.model.attention import CausalAttention
from rollpacker.model.hf import load_model, read_config
from rollpacker.model.offload import OffloadedLayers
from rollpacker.model.transformer import rope_cos_sin
from rollpacker.reward.config import JudgeConfig
from rollpacker.reward.functions import as_trl, prompt_text
from rollpacker.reward.rules import RewardError

logger = logging.getLogger(__name__)

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""torch dtypes of ``JudgeConfig.dtype`` (:data:`~rollpacker.reward.config.JudgeDtype`)."""


def parse_verdict(verdict: str, max_score: int) -> float:
    """The reward in [0, 1] of a verdict: an integer 0..max_score, whitespace around it ignored."""
    text = verdict.strip()
    if not (text.isascii() and text.isdigit()):
        raise RewardError(f"judge verdict {verdict!r} is not a score: expected an integer from 0 to {max_score}")
    score = int(text)
    if score > max_score:
        raise RewardError(f"judge verdict {score} is out of range: expected an integer from 0 to {max_score}")
    return score / max_score


def activation_bytes_per_token(args: ModelArgs, dtype: torch.dtype) -> int:
    """A generous count of what one token keeps alive inside one decoder layer's forward.

    Elements per token: 4 x hidden (residual, normed input, attention and MLP outputs),
    6 x (q + k + v) (projections, rotated copies, the padded per-bucket gathers and the
    attention output), 3 x intermediate (gate, up and their product). Attention scores are not
    counted: the fused attention kernels on GPU do not materialize them.
    """
    qkv = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
    elements = 4 * args.hidden_size + 6 * qkv + 3 * args.intermediate_size
    return elements * dtype.itemsize


def choose_resident_layers(
    *, num_layers: int, layer_bytes: int, fixed_bytes: int, num_tokens: int, bytes_per_token: int, budget_bytes: int,
    more_room: str = "free device memory",
) -> int:
    """K, the decoder layers to keep resident so that a forward of ``num_tokens`` fits the budget.

    With ``room = budget_bytes - fixed_bytes - num_tokens * bytes_per_token`` (``fixed_bytes``:
    embedding, output head, final norm and logits; the second term: activations):

    - K = num_layers when ``room >= num_layers * layer_bytes`` (nothing streams);
    - else K = floor(room / layer_bytes) - 2: the two streaming buffers take two layers' room.
      (K = num_layers - 1 needs as much room as K = num_layers, so it never comes out.)

    Raises :class:`RewardError` when even K = 0 does not fit, naming ``more_room``: what gives the budget more.
    """
    room = budget_bytes - fixed_bytes - num_tokens * bytes_per_token
    if room >= num_layers * layer_bytes:
        return num_layers
    k = room // layer_bytes - 2
    if k < 0:
        need = fixed_bytes + num_tokens * bytes_per_token + 2 * layer_bytes
        raise RewardError(
            f"judge batch of {num_tokens} tokens needs {need / 2**20:.1f} MiB with every layer streamed, "
            f"but {budget_bytes / 2**20:.1f} MiB is available: lower judge.max_batch_tokens or {more_room}"
        )
    return k


def check_scores(cfg: JudgeConfig, tokenizer=None) -> bool:
    """Whether the judge is a reward model (its score is the reward); a generative judge's verdicts 0..max_score
    must each be one token of its tokenizer (``tokenizer``: loaded from ``cfg.model_path`` when not given), or a
    ValueError naming the setting."""
    from transformers import AutoTokenizer

    if score_labels(read_config(cfg.model_path)) > 0:
        return True
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(cfg.model_path)
    for score in range(cfg.max_score + 1):
        if len(tokenizer.encode(str(score), add_special_tokens=False)) != 1:
            raise ValueError(f"reward.judge.max_score={cfg.max_score}: {str(score)!r} is several tokens for the "
                             "judge's tokenizer; scores must be single tokens (try reward.judge.max_score=9)")
    return False


class Judge:
    """Scores (prompt, response) pairs with a judge model or a reward model on ``device`` (the actor's),
    many per call."""

    def __init__(self, cfg: JudgeConfig, device: torch.device | str = "cpu"):
        from transformers import AutoTokenizer

        if not cfg.model_path:
            raise ValueError("judge.model_path is empty: point it at a Hugging Face model directory")
        self.cfg = cfg
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self.reward_model = check_scores(cfg, self.tokenizer)
        """A reward model: its score is the reward (no rubric, no verdict)."""
        model = load_model(cfg.model_path, "cpu", DTYPES[cfg.dtype])
        blocks = list(model.layers)
        del model.layers  # what remains: embedding, final norm, output head
        self.model = model.to(self.device)
        self.model.tie_weights()
        self.layers = OffloadedLayers(blocks, model.args, self.device)
        del blocks  # the host copies in self.layers are all that is left of the layers
        if cfg.resident_layers > len(self.layers):
            raise ValueError(f"judge.resident_layers={cfg.resident_layers} but the judge has {len(self.layers)} layers")
        weights = {p.data_ptr(): p for p in self.model.parameters()}.values()  # tied weights once
        self.fixed_bytes = sum(p.numel() * p.element_size() for p in weights)
        self.bytes_per_token = activation_bytes_per_token(model.args, self.layers.host[0].dtype)

    def encode(self, prompt: str | list[dict], response: str, rubric: str | None = None,
               turns: list[dict] | None = None) -> list[int]:
        """Token ids of the judge's input for one pair (``prompt``: a string or chat messages): the rubric
        (a data row's own, or the configured one) filled in, or a reward model's conversation
        (``turns``: an episode's messages after its prompt, in place of the response). Raises
        :class:`RewardError` where the reward model's chat template refuses the conversation."""
        if not self.reward_model:
            return self.tokenizer.encode((rubric or self.cfg.rubric).format(prompt=prompt_text(prompt),
                                                                            response=response))
        tok = self.tokenizer
        if tok.chat_template:  # a prefill leads the first assistant turn, as TRL scores it
            head, tail = as_trl({"prompt": messages(prompt), "completion": response, "messages": turns})
            conversation = head + tail
            try:
                text = tok.apply_chat_template(conversation, tokenize=False)
            except Exception as e:  # the template refuses the conversation (roles that do not alternate, a tool's)
                raise RewardError(f"the reward model's chat template refused the conversation: "
                                  f"{type(e).__name__}: {e}") from None
        else:
            text = prompt_text(prompt) + response
        ids = tok.encode(text, add_special_tokens=False)  # the template has them, as TRL encodes it
        while ids and ids[-1] == tok.pad_token_id:  # scored after the last token that is not padding
            ids.pop()
        return ids

    def _budget_bytes(self) -> int:
        if self.device.type != "cuda":
            return int(self.cfg.cpu_memory_gib * 2**30)
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        held = self.fixed_bytes + self.layers.device_bytes()  # ours to give back
        return int(self.cfg.memory_fraction * (free + cached + held))

    def num_resident_for(self, seq_lens: list[int]) -> int:
        """K for a batch: the configured one, or :func:`choose_resident_layers` on memory free now."""
        if self.cfg.resident_layers >= 0:
            return self.cfg.resident_layers
        logits_bytes = len(seq_lens) * self.model.lm_head.out_features * 4
        return choose_resident_layers(
            num_layers=len(self.layers), layer_bytes=self.layers.layer_bytes,
            fixed_bytes=self.fixed_bytes + logits_bytes, num_tokens=sum(seq_lens),
            bytes_per_token=self.bytes_per_token, budget_bytes=self._budget_bytes(),
            more_room="raise judge.memory_fraction or free device memory" if self.device.type == "cuda"
            else "raise judge.cpu_memory_gib",
        )

    @torch.inference_mode()
    def last_logits(self, seqs: list[list[int]]) -> torch.Tensor:
        """Token ids of packed judge inputs -> the logits [N, vocab or labels] (fp32) after each."""
        seq_lens = [len(s) for s in seqs]
        k = self.num_resident_for(seq_lens)
        if k != self.layers.num_resident:
            logger.debug("judge: %d of %d layers resident for %d tokens", k, len(self.layers), sum(seq_lens))
        self.layers.set_resident(k)
        tokens = torch.tensor([t for s in seqs for t in s], device=self.device)  # [T]
        positions = torch.cat([torch.arange(n) for n in seq_lens]).to(self.device)  # [T]
        x = self.model.embed_tokens(tokens)  # [T, hidden]
        cos, sin = rope_cos_sin(positions, self.model.inv_freq, x.dtype)
        x = self.layers(x, cos, sin, CausalAttention(seq_lens, self.device))
        last = torch.tensor(seq_lens, device=self.device).cumsum(0) - 1  # [N]
        return self.model.logits(self.model.norm(x)[last])

    def score(self, pairs: Sequence[tuple[str, str]], rubrics: Sequence[str | None] | None = None
              ) -> list[float | RewardError]:
        """Rewards of (prompt, response) pairs (a generative judge's in [0, 1]), or the :class:`RewardError`
        of each pair that could not be scored. ``rubrics``: a rubric per pair (None: the configured one)."""
        rubrics = [None] * len(pairs) if rubrics is None else rubrics
        encoded: list[list[int] | RewardError] = []
        for (prompt, response), rubric in zip(pairs, rubrics, strict=True):
            try:
                encoded.append(self.encode(prompt, response, rubric))
            except RewardError as e:  # the reward model's template refused this pair: the others are scored
                encoded.append(e)
        scored = iter(self.score_ids([ids for ids in encoded if not isinstance(ids, RewardError)]))
        return [ids if isinstance(ids, RewardError) else next(scored) for ids in encoded]

    def score_ids(self, seqs: Sequence[list[int]]) -> list[float | RewardError]:
        """Like :meth:`score`, for judge prompts already encoded (:meth:`encode`). They are packed
        in order, a new forward whenever the next would pass ``max_batch_tokens``."""
        results: list[float | RewardError | None] = [None] * len(seqs)
        batches: list[list[int]] = []
        size = 0
        max_tokens = self.cfg.max_tokens
        for i, ids in enumerate(seqs):
            if len(ids) > max_tokens:
                results[i] = RewardError(f"judge input is {len(ids)} tokens, over judge.max_tokens={max_tokens}")
                continue
            if not ids:  # no last token of its own to score
                results[i] = RewardError("judge input is empty: no rubric text, prompt or response to score")
                continue
            if not batches or size + len(ids) > self.cfg.max_batch_tokens:
                batches.append([])
                size = 0
            batches[-1].append(i)
            size += len(ids)
        for batch in batches:
            try:
                logits = self.last_logits([seqs[i] for i in batch])
                scores = ([_finite(score) for score in logits[:, 0].tolist()] if self.reward_model
                          else [self._reward(token) for token in logits.argmax(-1).tolist()])
            except torch.OutOfMemoryError as e:
                scores = [RewardError(f"judge ran out of device memory on {len(batch)} pairs ({e}); "
                                      "lower judge.memory_fraction or judge.max_batch_tokens")] * len(batch)
            except RewardError as e:
                scores = [e] * len(batch)
            for i, score in zip(batch, scores):
                results[i] = score
        return results

    def _reward(self, token: int) -> float | RewardError:
        """A generative judge's verdict token as its reward."""
        try:
            return parse_verdict(self.tokenizer.decode([token]), self.cfg.max_score)
        except RewardError as e:
            return e


def _finite(score: float) -> float | RewardError:
    """A reward model's score, or the error of one that is not a number (an overflow: judge.dtype float16)."""
    if math.isfinite(score):
        return score
    return RewardError(f"the reward model scored {score}, not a reward (an overflow in its dtype? float16 holds up "
                       "to 65504: --reward.judge.dtype bfloat16 or float32 hold more)")
