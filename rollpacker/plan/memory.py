"""The memory plan: what one GPU holds at the peak of training and of rollout, term by term.

``python -m rollpacker.plan.memory [--preset NAME] [--gpu-memory-gb 80] [--world-size 8]`` prints the
terms, the two peaks and whether the larger fits, with its headroom; the last line is JSON with
``fits`` and ``peak_gb``. On GPU the job runs the same computation at start-up
(:func:`check_fits`) and refuses a config that cannot fit, naming the largest term and the
setting that shrinks it. SGLang's ``mem_fraction_static`` comes from the same engine terms
(:attr:`Plan.engine_bytes`, which the job passes to the engine).

Invariants: it models the code, not the allocator (fragmentation is not counted: keep 10%
headroom); an engine's terms follow its capabilities (``EngineKind``), never its name.
``python -m rollpacker.bench memory`` checks the training peak against CPU measurements of real
steps. Every term, and how it was checked: ``docs/memory.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rollpacker.errors import UserError
from rollpacker.model.args import head_dim, tied_embeddings
from rollpacker.model.attention import length_groups
from rollpacker.model.parallelize import checkpointed
from rollpacker.plan.planner import usable_tps
from rollpacker.rollout import ENGINES, resolve_kind

GB = 1e9
CUDA_CONTEXT_BYTES = 2.0 * GB
"""CUDA context, NCCL buffers and cuBLAS workspaces: an allowance, not computed."""
SGLANG_PROCESS_BYTES = CUDA_CONTEXT_BYTES
"""SGLang's scheduler process on each GPU of its TP group: a second CUDA context, its own NCCL buffers
and cuBLAS workspaces (the same allowance)."""
PROMPT_TOKENS = 1024
"""The prompt length the plan assumes when nothing caps prompts (neither data.max_prompt_length nor
engine.max_model_len is set): an assumption, not a bound."""
CHARS_PER_TOKEN = 4
"""An episode's observation, cut at env.max_tool_result_chars characters, in tokens (English text and code)."""

QWEN2_5 = {
    "Qwen2.5-7B": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
                       rope_theta=1e6, max_position_embeddings=131072, tie_word_embeddings=False),
    "Qwen2.5-14B": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=13824,
                        num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, rms_norm_eps=1e-5,
                        rope_theta=1e6, max_position_embeddings=131072, tie_word_embeddings=False),
    "Qwen2.5-32B": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                        num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8, rms_norm_eps=1e-5,
                        rope_theta=1e6, max_position_embeddings=131072, tie_word_embeddings=False),
}
"""config.json values of the released base checkpoints (the -Instruct ones have the same shapes)."""


@dataclass(frozen=True, kw_only=True)
class Shape:
    """What the plan needs of a decoder, from its Hugging Face config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    norms_per_block: int = 2
    """RMSNorms per block: 2, or 4 with Gemma-2/3's norms after attention and after the MLP too."""
    fp32_norms: bool = False
    """Its RMSNorms scale in fp32 and cast after (Gemma's): their normed value is kept in fp32."""
    num_experts: int = 0
    """MoE: experts per layer (0: dense)."""
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    """MoE: the expert every token goes through beside its routed ones, with its sigmoid gate (Qwen2-MoE's)."""
    max_position_embeddings: int = 0
    softcap: bool = False
    """It caps its logits (Gemma-2's ``final_logit_softcapping``): the trainer's head runs the torch path."""
    sliding_window: int = 0
    """The window of its sliding-window layers (0: none): the hf path's packed attention keeps one mask for
    each length bucket wider than it, shared by the layers (:func:`~rollpacker.model.attention.window_mask`)."""
    attn_softcap: bool = False
    """It caps its attention logits (Gemma-2's ``attn_logit_softcapping``): the hf path runs ``transformers``'
    eager attention, whose scores over the whole micro-batch, ``[heads, T, T]``, are kept."""

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Shape:
        cfg = cfg.get("text_config") or cfg
        heads = cfg["num_attention_heads"]
        kind = cfg.get("model_type", "")
        layer_types = cfg.get("layer_types") or ()
        slides = "sliding_attention" in layer_types or not layer_types and cfg.get("use_sliding_window", True)
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or 0, num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim(cfg),
            tie_word_embeddings=tied_embeddings(cfg),
            qkv_bias=kind in ("qwen2", "qwen2_moe") and cfg.get("qkv_bias", True) or bool(cfg.get("attention_bias")),
            qk_norm=kind in ("qwen3", "qwen3_moe", "gemma3_text", "gemma3"),
            norms_per_block=4 if kind in ("gemma2", "gemma3_text", "gemma3") else 2,
            fp32_norms=kind in ("gemma2", "gemma3_text", "gemma3"),
            num_experts=cfg.get("num_experts") or cfg.get("num_local_experts") or 0,
            experts_per_token=cfg.get("num_experts_per_tok") or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0,
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
            max_position_embeddings=cfg.get("max_position_embeddings") or 0,
            softcap=bool(cfg.get("final_logit_softcapping")),
            sliding_window=(cfg.get("sliding_window") or 0) if slides else 0,
            attn_softcap=bool(cfg.get("attn_logit_softcapping")),
        )

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        d = self.hidden_size
        attn = d * (self.q_dim + 2 * self.kv_dim) + self.q_dim * d
        attn += (self.q_dim + 2 * self.kv_dim) * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        if self.num_experts:
            mlp = self.num_experts * 3 * d * self.moe_intermediate_size + self.num_experts * d
            mlp += 3 * d * self.shared_expert_intermediate_size + d * bool(self.shared_expert_intermediate_size)
        else:
            mlp = 3 * d * self.intermediate_size
        return attn + mlp + self.norms_per_block * d

    @property
    def mlp_width(self) -> int:
        """The MLP's activations per token: the dense MLP's, or those of a token's experts (the shared one too)."""
        return max(self.intermediate_size,
                   self.experts_per_token * self.moe_intermediate_size + self.shared_expert_intermediate_size)

    @property
    def root_params(self) -> int:
        """Embedding, final norm and output head (counted once when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.root_params


@dataclass(frozen=True, kw_only=True)
class TrainSetup:
    """How one training rank runs (what the plan needs of the config, the world and the device)."""

    shard_size: int
    """N: ranks one FSDP2 replica is sharded over."""
    seq_lens: tuple[int, ...]
    """The largest micro-batch: its sequences' lengths (prompt + response)."""
    response_tokens: int
    """Tokens of the micro-batch whose log-probs are trained on."""
    compute_bytes: int = 2
    """b: 2 (bf16 mixed precision) or 4 (fp32)."""
    checkpointing: str = "none"
    ac_every: int = 2
    ac_part: str = "block"
    offload: bool = False
    head: str = "fused"
    """The log-prob head: fused (Triton kernel) or torch (chunked)."""
    chunk_size: int = 1024
    foreach: bool = True
    """The optimizer steps all tensors at once (GPU) or one at a time (CPU)."""
    reference: str = "none"
    """The KL reference: none, sharded (FSDP2 like the policy), streamed (host memory, layer by layer) or
    policy (LoRA: the policy with its adapters off, no weights of its own)."""
    softcap: bool = False
    micro_batches: int = 2
    """Micro-batches per rank per step (1: gradients exist only from the backward on)."""
    reduce_every: bool = False
    """Gradients are reduce-scattered after every micro-batch (else only after the last one)."""
    streaming: bool = False
    """Stream training: gradients accumulate unsharded while rollout goes on."""
    gloo: bool = False
    """Collectives run on gloo (CPU), whose reduce-scatter copies its input."""
    lora_params: int = 0
    """LoRA: the adapters' parameters, the only ones trained (0: every parameter trains)."""
    critic: bool = False
    """PPO's critic (train.advantage gae): a decoder's blocks and embedding with a one-row head, trained whole
    beside the policy; its backward comes after the policy's in each micro-batch (its own phase)."""
    critic_shape: Shape | None = None
    """The critic's decoder (train.critic.path's config.json); None: the policy's."""
    teacher: Shape | None = None
    """Distillation's frozen teacher (train.teacher.path's config.json); None: no teacher."""
    teacher_held: str = "sharded"
    """How the teacher is kept, as the KL reference (prepare_reference): sharded (fp32, FSDP2), or with
    train.offload streamed (native decoder: host memory, layer by layer) or offloaded (hf: FSDP2's CPU offload)."""

    @property
    def tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """Attention's length buckets (:func:`~rollpacker.model.attention.length_groups`): (sequences, width)."""
        return [(len(g), max(self.seq_lens[i] for i in g)) for g in length_groups(list(self.seq_lens))]

    @property
    def padded_tokens(self) -> int:
        """Tokens after attention's per-bucket padding."""
        return sum(rows * width for rows, width in self.buckets)


@dataclass(frozen=True, kw_only=True)
class Term:
    name: str
    bytes: float
    fix: str = ""
    """The setting that shrinks this term."""


@dataclass(kw_only=True)
class Phase:
    name: str
    terms: list[Term] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(t.bytes for t in self.terms)

    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes)


FEWER_TOKENS = "a smaller train.micro_batch_tokens"
"""The fix of the terms that grow with a micro-batch's tokens."""


# ---- activations --------------------------------------------------------------------------------


def norm_saved(width: int, b: int, fp32: bool = False) -> int:
    """Bytes per token an RMSNorm keeps: its fp32 input (the input itself in fp32), 1/rms, the normed
    value in the compute dtype (``fp32``: in fp32, Gemma's) and the scaled output in the compute dtype
    (the next op saves it)."""
    return 4 * width + ((4 if fp32 else b) + b) * width + 4


def attention_saved(s: Shape, b: int, pad: float, tokens: int) -> float:
    """Bytes per token inside attention: q, k, v gathered per length bucket and SDPA's output and
    log-sum-exp (padded), the output scattered back (the o projection's input) and its int64 indices;
    or, with capped attention's eager one, q, k and v repeated to every head, the output and the scores
    (:func:`scores_saved`); Qwen3's q/k norms."""
    if s.attn_softcap:
        saved = 4 * b * s.q_dim + scores_saved(s, b, tokens)
    else:
        saved = pad * (b * (2 * s.q_dim + 2 * s.kv_dim) + 4 * s.num_heads) + b * s.q_dim + 8
    if s.qk_norm:
        saved += (4 + (4 if s.fp32_norms else b)) * (s.q_dim + s.kv_dim) + 4 * (s.num_heads + s.num_kv_heads)
    return saved


def scores_saved(s: Shape, b: int, tokens: int) -> float:
    """Bytes per token of the ``[heads, T, T]`` scores that eager attention (capped attention's,
    :attr:`Shape.attn_softcap`) keeps over a micro-batch of ``tokens``: the capped scores, the softmax's
    fp32 output and, in bf16, its copy in the compute dtype (which the product with the values keeps)."""
    return s.attn_softcap * s.num_heads * tokens * (b + 4 + (b if b != 4 else 0))


def mlp_saved(s: Shape, b: int) -> float:
    """Bytes per token inside the SwiGLU MLP: gate, silu(gate), up and their product (MoE: for each
    of the token's experts, these and the token's input and output rows; plus the router's logits
    and probabilities)."""
    if s.num_experts:
        per_expert = b * (4 * s.moe_intermediate_size + 2 * s.hidden_size)
        shared = 4 * b * s.shared_expert_intermediate_size + (b + 4) * bool(s.shared_expert_intermediate_size)
        return s.experts_per_token * per_expert + s.num_experts * (b + 4) + shared
    return 4 * b * s.intermediate_size


def block_saved(s: Shape, b: int, pad: float, tokens: int, part: str = "none") -> float:
    """Bytes per token one block keeps for backward over a micro-batch of ``tokens``; ``part`` is the
    checkpointed part (none, block, attention or mlp): a checkpointed module keeps only its input."""
    if part == "block":
        return b * s.hidden_size
    attn = 0 if part == "attention" else attention_saved(s, b, pad, tokens)
    mlp = 0 if part == "mlp" else mlp_saved(s, b)
    post_norms = s.norms_per_block - 2  # Gemma's, after attention and after the MLP: the residual add keeps no output
    norms = s.norms_per_block * norm_saved(s.hidden_size, b, s.fp32_norms) - post_norms * b * s.hidden_size
    return norms + attn + mlp


def activations(s: Shape, t: TrainSetup) -> dict[str, float]:
    """Bytes the forward keeps for backward: ``blocks`` (the decoder's, with checkpointing only each
    checkpointed module's input), ``head`` (the final norm's and the log-prob head's), and
    ``recompute``, the most one checkpointed module rebuilds in backward."""
    b, pad = t.compute_bytes, t.padded_tokens / t.tokens
    parts = dict(checkpointed(s.num_layers, t.checkpointing, t.ac_every, t.ac_part))
    per_token = sum(block_saved(s, b, pad, t.tokens, parts.get(i, "none")) for i in range(s.num_layers))
    per_token += 2 * b * s.head_dim + 9  # RoPE's cos and sin, the buckets' index and mask (shared by the blocks)
    # packed attention's sliding-window masks, one for each bucket wider than the window, shared by the blocks
    window = 0 if s.attn_softcap else s.sliding_window  # (eager attention keeps no mask)
    masks = sum(b * w * -(-w // 16) * 16 for _, w in t.buckets if window and w > window)
    # the final norm (its output is not kept)
    head = t.tokens * (norm_saved(s.hidden_size, b, s.fp32_norms) - b * s.hidden_size)
    head += t.response_tokens * (b * s.hidden_size + 4 + 8)  # the head's hidden rows, log-sum-exp and targets
    whole = block_saved(s, b, pad, t.tokens)
    recompute = max((whole - block_saved(s, b, pad, t.tokens, p) for p in set(parts.values())), default=0)
    return {"blocks": t.tokens * per_token + masks, "head": head, "recompute": t.tokens * recompute}


def head_forward(s: Shape, t: TrainSetup) -> float:
    """Transient bytes of the log-prob head's forward: the torch path's fp32 ``[chunk, V]`` logits and
    log-sum-exp's temporary of the same size (and an fp32 copy of a bf16 head); the fused kernel's
    per-token statistics."""
    if t.head == "fused":
        return 16 * t.response_tokens
    chunk, b, v, d = min(t.chunk_size, t.response_tokens), t.compute_bytes, s.vocab_size, s.hidden_size
    return (2 + t.softcap) * chunk * v * 4 + (4 * v * d + 4 * chunk * d if b != 4 else 0)


def head_backward(s: Shape, t: TrainSetup) -> float:
    """Bytes of the log-prob head's backward, its weight's gradient included: the torch path's fp32
    gradient (and fp32 copy of a bf16 head), ``[chunk, V]`` logits block and hidden gradient; the
    fused kernel's fp32 hidden-gradient accumulator and weight-gradient scratch rows."""
    b, d, v, r = t.compute_bytes, s.hidden_size, s.vocab_size, t.response_tokens
    if t.head == "fused":
        return 16 * r + 4 * r * d + (4 * min(8192, v) * d if b != 4 else 0) + b * r * d + b * v * d
    chunk = min(t.chunk_size, r)
    logits = (1 + t.softcap) * chunk * v * 4
    if b == 4:
        return 4 * v * d + logits + 4 * r * d
    return 2 * 4 * v * d + max(logits + 4 * chunk * d, b * v * d) + b * r * d


def block_backward(s: Shape, t: TrainSetup) -> float:
    """Transient bytes at the peak of one block's backward, its MLP's: the activation gradients
    (three ``[T, I]``), the gradient flowing between blocks (two ``[T, D]``) and the down
    projection's weight gradient; or, when larger, capped attention's: its ``[heads, T, T]`` scores'
    gradient, in the compute dtype, then in fp32 beside the softmax's. (The block's reduce-scatter comes
    after, with less alive.)"""
    b, width = t.compute_bytes, s.mlp_width
    scores = s.attn_softcap * s.num_heads * t.tokens ** 2 * (b + 8)
    return max(t.tokens * (3 * width + 2 * s.hidden_size) * b + b * s.hidden_size * width, scores)


def reduce_scatter(num_params: int, t: TrainSetup, held: float = 0.0) -> float:
    """FSDP2's reduce-scatter of a group's gradients, the larger of two moments: the unsharded
    gradients beside their flat copy in the fp32 reduce dtype, then that copy beside the output shard
    (and gloo's own copy of its input, on CPU) and ``held``, a gradient autograd still holds."""
    n = t.shard_size
    copy_in = num_params * (t.compute_bytes + 4)
    return max(copy_in, num_params * (4 + 4 / n + (4 if t.gloo and n > 1 else 0)) + held)


LORA_DIMS = {"q_proj": ("hidden_size", "q_dim"), "k_proj": ("hidden_size", "kv_dim"),
             "v_proj": ("hidden_size", "kv_dim"), "o_proj": ("q_dim", "hidden_size"),
             "gate_proj": ("hidden_size", "intermediate_size"), "up_proj": ("hidden_size", "intermediate_size"),
             "down_proj": ("intermediate_size", "hidden_size")}
"""A decoder layer's linears: (in, out) features, as :class:`Shape` names them."""


def lora_params(s: Shape, rank: int, targets: tuple[str, ...]) -> int:
    """Parameters of rank-``rank`` adapters (A: r x in, B: out x r) on ``targets`` of every layer."""
    names = LORA_DIMS if targets == ("all-linear",) else [  # peft's suffixes too: self_attn.q_proj
        n for n in dict.fromkeys(t.rpartition(".")[2] for t in targets) if n in LORA_DIMS]
    if not names:  # no adapter counted: the plan would price training every parameter
        raise UserError(f"memory plan: train.lora.target_modules names {', '.join(targets)}, none of them a linear "
                        f"the plan counts: name some of {', '.join(LORA_DIMS)}, or all-linear")
    return s.num_layers * sum(rank * (getattr(s, LORA_DIMS[n][0]) + getattr(s, LORA_DIMS[n][1])) for n in names)


def trained_params(s: Shape, t: TrainSetup) -> int:
    """Parameters with gradients and optimizer state: the adapters', or all of them."""
    return t.lora_params or s.num_params


def gradients(s: Shape, t: TrainSetup, trained: int | None = None) -> Term:
    """The gradients held before a micro-batch's backward: none in a step's only micro-batch; else
    the earlier ones', sharded in fp32 when every micro-batch reduces, else unsharded (FSDP2 keeps
    gradients it does not reduce-scatter whole, in fp32), as stream training's always are.
    ``trained``: the parameters with gradients (None: the policy's, :func:`trained_params`)."""
    trained = trained_params(s, t) if trained is None else trained
    if t.micro_batches == 1 and not t.streaming:
        return Term(name="gradients of earlier micro-batches", bytes=0)
    if t.reduce_every and not t.streaming:
        return Term(name="gradients (fp32, sharded)", bytes=(not t.offload) * 4 * trained / t.shard_size,
                    fix="train.offload")
    return Term(name="gradients accumulated unsharded (fp32)", bytes=4 * trained,
                fix="train.reduce-every-micro-batch" if not t.streaming else "stream.enabled false")


def train_phases(s: Shape, t: TrainSetup) -> list[Phase]:
    """The training peaks, per rank: the forward (at the log-prob head), the head's backward, the
    blocks' backward (the last block first), the KL reference's and the teacher's forwards, the critic's
    backward, and the optimizer step."""
    b, n, device = t.compute_bytes, t.shard_size, 0 if t.offload else 1
    off, trained = "train.offload", trained_params(s, t)
    state = [Term(name="parameters (fp32, sharded)", bytes=device * 4 * (s.num_params + t.lora_params) / n, fix=off),
             Term(name="optimizer state (AdamW, fp32, sharded)", bytes=device * 8 * trained / n, fix=off),
             gradients(s, t), *frozen_state(s, t), *critic_state(s, t)]
    root = Term(name="unsharded root (embedding, norm, head)", bytes=b * s.root_params)
    block_trained = t.lora_params or s.num_layers * s.layer_params
    sharded_grads = 0 if state[2].bytes else device * 4 * block_trained / n  # first micro-batch
    head_grad = 0 if t.lora_params else b * s.vocab_size * s.hidden_size  # LoRA: the head is frozen
    acts = activations(s, t)
    fix = "train.activation-checkpointing full" if t.checkpointing == "none" else FEWER_TOKENS
    saved = Term(name="saved activations", bytes=acts["blocks"] + acts["head"], fix=fix)
    head_fix = "train.logprobs-impl triton" if t.head == "torch" else ""
    phases = [
        Phase(name="forward (log-prob head)", terms=[
            *state, root, saved,
            Term(name=f"log-prob head forward ({t.head})", bytes=head_forward(s, t), fix=head_fix)]),
        Phase(name="backward (log-prob head)", terms=[
            *state, root, saved,
            Term(name=f"log-prob head backward ({t.head})", bytes=head_backward(s, t), fix=head_fix)]),
        Phase(name="backward (blocks)", terms=[
            *state, root, Term(name="saved activations", bytes=acts["blocks"], fix=fix),
            Term(name="head gradient (unsharded)", bytes=head_grad),
            Term(name="recomputed activations (one checkpointed module)", bytes=acts["recompute"], fix=FEWER_TOKENS),
            Term(name="unsharded blocks in flight (2)", bytes=2 * b * s.layer_params),
            Term(name="block backward (activation and weight gradients)", bytes=block_backward(s, t),
                 fix=FEWER_TOKENS)]),
        Phase(name="backward (root reduce-scatter)", terms=[
            *state, Term(name="the blocks' gradients (fp32, sharded)", bytes=sharded_grads, fix=off),
            Term(name="root gradients reduce-scatter (the embedding's gradient held)",
                 bytes=0 if t.lora_params else reduce_scatter(s.root_params, t, held=head_grad))])]
    if t.reference != "none":  # before the policy's forward of a micro-batch, as the teacher's: none of its activations
        gathered = 0 if t.reference == "streamed" else b * (2 * s.layer_params + s.root_params)  # streamed: held
        phases.append(Phase(name="forward (KL reference)", terms=[
            *state, root, Term(name="KL reference in flight (2 blocks, root, one block's activations)",
                               bytes=gathered + reference_activations(s, t),
                               fix=FEWER_TOKENS)]))
    if t.teacher is not None:
        phases.append(teacher_phase(t, [*state, root]))
    if t.critic:  # after the policy's backward, with its gradients
        policy_grads = 0 if state[2].bytes else device * 4 * trained / n  # else held in the state already
        phases.append(critic_phase(t, [*state, Term(name="policy gradients (fp32, sharded)", bytes=policy_grads,
                                                    fix=off)], critic_of(s, t)))
    largest = (t.lora_params / s.num_layers if t.lora_params else max(s.vocab_size * s.hidden_size, s.layer_params)) / n
    temp = 4 * trained / n if t.foreach else 2 * 4 * largest
    phases.append(Phase(name="optimizer step", terms=[
        *state[:2], Term(name="gradients (fp32, sharded)", bytes=device * 4 * trained / n, fix=off),
        *frozen_state(s, t), *critic_state(s, t), Term(name="AdamW temporaries", bytes=device * temp, fix=off)]))
    return phases


def teacher_phase(t: TrainSetup, held: list[Term]) -> Phase:
    """The teacher's no-grad forward: it runs before the policy's forward of its micro-batch (Trainer._loss,
    or the step's first pass, Trainer._frozen), so none of the policy's activations are alive; ``held``: the
    state and the policy's root. Streamed, its root and its two layer buffers are in the state."""
    s, b = t.teacher, t.compute_bytes
    gathered = 0 if t.teacher_held == "streamed" else b * (2 * s.layer_params + s.root_params)
    return Phase(name="forward (teacher)", terms=[*held, Term(
        name="teacher in flight (2 blocks, root, one block's activations)",
        bytes=gathered + reference_activations(s, t), fix=FEWER_TOKENS)])


def critic_phase(t: TrainSetup, held: list[Term], c: Shape) -> Phase:
    """The critic's backward (its shape ``c``), after the policy's: no vocabulary head, its root unsharded;
    ``held``: the state and the policy's gradients."""
    b, acts = t.compute_bytes, activations(c, t)
    fix = "train.activation-checkpointing full" if t.checkpointing == "none" else FEWER_TOKENS
    return Phase(name="backward (critic)", terms=[
        *held, Term(name="unsharded critic root (embedding, norm, head)", bytes=b * (c.vocab_size + 2) * c.hidden_size),
        Term(name="saved activations", bytes=acts["blocks"], fix=fix),
        Term(name="recomputed activations (one checkpointed module)", bytes=acts["recompute"], fix=FEWER_TOKENS),
        Term(name="unsharded blocks in flight (2)", bytes=2 * b * c.layer_params),
        Term(name="block backward (activation and weight gradients)", bytes=block_backward(c, t),
             fix=FEWER_TOKENS)])


def critic_of(s: Shape, t: TrainSetup) -> Shape:
    """The critic's decoder: its own (train.critic.path), or the policy's ``s``."""
    return t.critic_shape or s


def critic_state(s: Shape, t: TrainSetup, held: bool = True) -> list[Term]:
    """What PPO's critic keeps on the device: its fp32 shards and AdamW state, and (``held``: while it trains)
    its gradients as the policy's."""
    if not t.critic:
        return []
    params = critic_params(critic_of(s, t))
    state = Term(name="critic parameters + optimizer state (sharded)",
                 bytes=(not t.offload) * 12 * params / t.shard_size, fix="train.offload")
    grads = gradients(s, t, trained=params)
    return [state, replace(grads, name=f"critic {grads.name}")] if held else [state]


def critic_params(s: Shape) -> int:
    """PPO's critic's parameters: the blocks, the embedding, the final norm and a one-row head (no vocabulary)."""
    return s.num_layers * s.layer_params + s.vocab_size * s.hidden_size + 2 * s.hidden_size


def frozen_state(s: Shape, t: TrainSetup) -> list[Term]:
    """What the frozen models keep on the device: the KL reference's and the teacher's (:func:`held_state`)."""
    teacher = held_state(t.teacher, t.teacher_held, t, "teacher") if t.teacher is not None else []
    return held_state(s, t.reference, t, "KL reference") + teacher


def held_state(s: Shape, held: str, t: TrainSetup, name: str) -> list[Term]:
    """What a frozen model kept as ``held`` keeps on the device: its fp32 shards (the trainer reshards its root after
    each no-grad forward), or (streamed) its root and the two layer buffers the layers stream through; nothing
    offloaded to FSDP2's host shards or as the policy with its adapters off."""
    if held == "sharded":
        return [Term(name=f"{name} (fp32, sharded)", bytes=4 * s.num_params / t.shard_size, fix="train.offload")]
    if held == "streamed":
        return [Term(name=f"{name} root and 2 layer buffers (streamed layers)",
                     bytes=t.compute_bytes * (s.root_params + 2 * s.layer_params))]
    return []


def held_host(s: Shape, held: str, t: TrainSetup) -> float:
    """Host memory per rank of a frozen model kept as ``held``: whole when streamed, its fp32 shard when offloaded."""
    return {"streamed": t.compute_bytes * s.num_params, "offloaded": 4 * s.num_params / t.shard_size}.get(held, 0.0)


def reference_activations(s: Shape, t: TrainSetup) -> float:
    """A no-grad forward keeps one block's transients: ~ q, k, v, the MLP's three [T, I], and the
    head's logits chunk; capped attention's ``[heads, T, T]`` scores, two in the compute dtype and the
    softmax's in fp32."""
    width, b = s.mlp_width, t.compute_bytes
    chunk = min(t.chunk_size, t.response_tokens) * s.vocab_size * 4 * 2 if t.head == "torch" else 0
    scores = s.attn_softcap * s.num_heads * t.tokens ** 2 * (2 * b + 4)
    return t.tokens * b * (3 * s.hidden_size + s.q_dim + 2 * s.kv_dim + 3 * width) + chunk + scores


@dataclass(frozen=True, kw_only=True)
class RolloutSetup:
    engine: str
    """torch, vllm or sglang."""
    tp: int
    weight_bytes: int
    """Bytes per engine weight element (bf16 2, fp32 4)."""
    kv_bytes: float
    """The engine's KV cache budget per rank."""
    kv_setting: str = "engine.kv_memory_mb"
    """The setting that sizes it."""
    max_num_seqs: int
    prefill_tokens: int
    """engine.max_prefill_tokens."""
    released: bool
    """The engine frees its weights and KV cache while the trainer trains (vLLM/SGLang on GPU)."""
    max_model_len: int = 0
    """engine.max_model_len (0: the model's max_position_embeddings)."""
    longest: int = 0
    """The longest context a request reaches (prompt + response; 0: max_model_len)."""
    draft_tokens: int = 0
    """Most draft tokens a request verifies in a step (engine.spec_max_tokens; 0: speculation off)."""


def rollout_phase(s: Shape, t: TrainSetup, r: RolloutSetup) -> Phase:
    n, device = t.shard_size, 0 if t.offload else 1
    held = 4 * (s.num_params + t.lora_params) + 8 * trained_params(s, t)  # fp32 parameters, AdamW's moments
    terms = [Term(name="trainer parameters + optimizer state (sharded)", bytes=device * held / n,
                  fix="train.offload"),
             *engine_terms(s, r)]
    return Phase(name="rollout", terms=terms + frozen_state(s, t) + critic_state(s, t, held=False))


def engine_terms(s: Shape, r: RolloutSetup) -> list[Term]:
    """What the engine holds on one GPU while it rolls out."""
    terms = [Term(name=f"engine weights (TP {r.tp} shard)", bytes=engine_weights(s, r), fix="a larger rollout.tp"),
             Term(name="engine KV cache budget", bytes=r.kv_bytes, fix=f"a smaller {r.kv_setting}"),
             Term(name="engine activations and logits", bytes=engine_activations(s, r),
                  fix="a smaller engine.max_prefill_tokens (vLLM: engine.max_model_len too)")]
    kind = ENGINES[r.engine]
    if kind.decode_workspace:
        terms.append(Term(name=f"{kind.title} decode workspace (bounded by the KV budget)",
                          bytes=decode_workspace(s, r), fix=f"a smaller {r.kv_setting} or engine.max_num_seqs"))
    return terms + scheduler_process(r)


def engine_kept(s: Shape, r: RolloutSetup) -> list[Term]:
    """What the engine keeps on the GPU while the trainer trains: its weights unless it releases them,
    and SGLang's scheduler process."""
    releasing = " or ".join(k for k, e in ENGINES.items() if e.releases_weights)
    kept = [Term(name="engine weights kept while training", bytes=0.0 if r.released else engine_weights(s, r),
                 fix=f"engine.kind {releasing} (they release it)")]
    return kept + scheduler_process(r)


def scheduler_process(r: RolloutSetup) -> list[Term]:
    """The allowance for an engine's own scheduler process on the GPU (SGLang's), if it runs one."""
    kind = ENGINES[r.engine]
    return [Term(name=f"{kind.title} scheduler process (allowance)", bytes=SGLANG_PROCESS_BYTES)
            ] if kind.scheduler_process else []


def batched_tokens(s: Shape, r: RolloutSetup) -> int:
    """The most tokens one engine forward takes: vLLM's ``max_num_batched_tokens``, which the adapter
    sets to max(max_prefill_tokens, max_model_len), and which its start-up profile run allocates;
    ``engine.max_prefill_tokens`` for the others."""
    if ENGINES[r.engine].batches_model_len:
        return max(r.prefill_tokens, r.max_model_len or s.max_position_embeddings)
    return r.prefill_tokens


def engine_activations(s: Shape, r: RolloutSetup) -> float:
    """One forward of :func:`batched_tokens` tokens (hidden states, the TP shard's q/k/v and MLP
    activations) and the sampler's fp32 logits for every running request."""
    d, inner = s.hidden_size, (s.q_dim + 2 * s.kv_dim + 3 * max(s.intermediate_size, s.moe_intermediate_size)) / r.tp
    return batched_tokens(s, r) * (3 * d + inner) * r.weight_bytes + 3 * r.max_num_seqs * s.vocab_size * 4


def decode_workspace(s: Shape, r: RolloutSetup) -> float:
    """TorchEngine's decode workspace beside its KV pool (``DecodeBatch`` in rollout/torch_engine/kv.py).
    A running request's row holds its power-of-two length group's capacity: under twice its context and
    drafts, 16 tokens at least; a group holds at most 1.5x the rows it uses. So the workspace is at most
    1.5x the running rows' capacities, bounded by the longest context for each of ``max_num_seqs`` rows and
    by the running contexts, which the KV pool holds: 3x the pool, plus 1.5x 16 tokens (or twice the
    drafts) per request. A group is reallocated a layer at a time: one layer more while it is."""
    per_token = 2 * s.num_layers * max(1, s.num_kv_heads // r.tp) * s.head_dim * r.weight_bytes
    cap = r.max_model_len or s.max_position_embeddings
    longest = min(r.longest, cap) if r.longest and cap else r.longest or cap
    top = max(16, 1 << (max(longest + r.draft_tokens, 1) - 1).bit_length())
    by_rows = r.max_num_seqs * top
    by_pool = 2 * r.kv_bytes / per_token + r.max_num_seqs * max(16, 2 * r.draft_tokens)
    return 1.5 * (1 + 1 / s.num_layers) * min(by_rows, by_pool) * per_token


def engine_weights(s: Shape, r: RolloutSetup) -> float:
    return s.num_params * r.weight_bytes / r.tp


# ---- a config's plan ----------------------------------------------------------------------------


@dataclass(kw_only=True)
class Plan:
    shape: Shape
    phases: list[Phase]
    capacity: float
    """Bytes of one GPU."""
    host_bytes: float
    """Host memory per rank for offloaded state."""
    engine_bytes: float = 0.0
    """What the engine holds on one GPU while it rolls out (:func:`engine_terms`): SGLang sizes itself by it."""

    @property
    def peak_phase(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def peak(self) -> float:
        return self.peak_phase.total

    @property
    def headroom(self) -> float:
        return 1 - self.peak / self.capacity

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    def refusal(self) -> str:
        """Why a config that does not fit is refused, and what to change."""
        phase = self.peak_phase
        term = phase.largest()
        fix = f"; set {term.fix} to shrink it" if term.fix else ""
        return (f"memory plan: the {phase.name} peak is {self.peak / GB:.1f} GB per GPU, over the "
                f"{self.capacity / GB:.1f} GB this GPU has. Largest term: {term.name}, {term.bytes / GB:.1f} GB"
                f"{fix} (python -m rollpacker.plan.memory shows every term)")

    def table(self) -> str:
        lines = [f"{'term':<52} {'GB':>8}"]
        for phase in self.phases:
            lines.append(f"-- {phase.name} --")
            lines += [f"{t.name:<52} {t.bytes / GB:>8.2f}" for t in phase.terms if t.bytes]
            lines.append(f"{'= ' + phase.name + ' peak':<52} {phase.total / GB:>8.2f}")
        lines.append(f"peak {self.peak / GB:.2f} GB of {self.capacity / GB:.1f} GB: "
                     f"{'fits' if self.fits else 'DOES NOT FIT'}, headroom {100 * self.headroom:.1f}%"
                     + (f"; host memory per rank for offloaded state {self.host_bytes / GB:.1f} GB"
                        if self.host_bytes else ""))
        return "\n".join(lines)

    def summary(self) -> dict[str, Any]:
        return {"fits": self.fits, "peak_gb": round(self.peak / GB, 2), "headroom": round(self.headroom, 4),
                "peak_phase": self.peak_phase.name, "capacity_gb": round(self.capacity / GB, 2),
                **{f"{p.name.replace(' ', '_')}_gb": round(p.total / GB, 2) for p in self.phases}}


def model_shape(path: str, setting: str = "model.path") -> Shape:
    """The shape of the model at ``path`` (``setting``'s): its config.json, or a known checkpoint named like
    its last component (the presets name ``Qwen/Qwen2.5-7B`` and the like)."""
    cfg_file = Path(path) / "config.json"
    if cfg_file.is_file():
        try:
            return Shape.from_hf(json.loads(cfg_file.read_text()))
        except json.JSONDecodeError as e:
            raise UserError(f"memory plan: {cfg_file} ({setting}) is not JSON: {e}") from None
        except KeyError as e:
            raise UserError(f"memory plan: {cfg_file} ({setting}) has no {e}: the plan reads a Llama-style decoder's "
                            "config (num_attention_heads, hidden_size, num_hidden_layers, vocab_size)") from None
    name = Path(path).name.removesuffix("-Instruct")
    if name in QWEN2_5:
        return Shape.from_hf(QWEN2_5[name])
    raise FileNotFoundError(f"memory plan: {cfg_file} not found and {Path(path).name!r} is not a known checkpoint "
                            f"({', '.join(QWEN2_5)}); point {setting} at a Hugging Face model directory")


def longest_sample(config) -> int:
    """The tokens of the plan's longest sample: its prompt and the response's budget, within
    engine.max_model_len when that is set (the engine holds no more). The prompt is data.max_prompt_length
    when set (longer prompts are left out, fit_rows); else, with engine.max_model_len, any prompt shorter
    than it is served, so a sample can reach it; with neither, :data:`PROMPT_TOKENS` (assumed). An
    episode's budget is its model tokens (:attr:`~rollpacker.config.Config.model_budget`) and an observation
    between each two turns (of env.max_tool_result_chars)."""
    env, cap = config.env, config.engine.max_model_len
    prompt = config.data.max_prompt_length or cap or PROMPT_TOKENS
    budget = config.model_budget[1]
    if env.enabled:
        budget += (env.max_turns - 1) * env.max_tool_result_chars // CHARS_PER_TOKEN
    return min(prompt + budget, cap) if cap else prompt + budget


def frozen_models(t) -> dict[str, Any]:
    """The teacher's and the critic's shapes (train.teacher.path, train.critic.path), and how train.offload
    keeps the teacher (prepare_reference): streamed when the native decoder runs it (a known name without
    config.json too), in FSDP2's CPU offload when transformers' does."""
    out: dict[str, Any] = {}
    if t.advantage == "gae" and t.critic.path:
        out["critic_shape"] = model_shape(t.critic.path, "train.critic.path")
    if t.teacher.path:
        out["teacher"] = model_shape(t.teacher.path, "train.teacher.path")
        out["teacher_held"] = "sharded"
        if t.offload:
            from rollpacker.model.hf_decoder import resolve_impl

            native = not (Path(t.teacher.path) / "config.json").is_file() or resolve_impl(
                "auto", t.teacher.path) == "native"
            out["teacher_held"] = "streamed" if native else "offloaded"
    return out


def setups(config, world_size: int, device: str = "cuda", shape: Shape | None = None, tp: int = 0
           ) -> tuple[TrainSetup, RolloutSetup]:
    """What the plan needs of ``config`` on ``world_size`` ranks of ``device`` (``shape``: the model's,
    for LoRA's adapters and its logit cap; read from the config's model for LoRA when None; the teacher's and
    the critic's are read from their paths), its engine at rollout TP ``tp`` (0: the run's, or TP 1 with the
    planner)."""
    t, e = config.train, config.engine
    if t.lora.rank and shape is None:
        shape = model_shape(str(config.model.directory()))
    mixed = t.mixed_precision and device == "cuda"
    longest = longest_sample(config)
    tokens = max(t.micro_batch_tokens, longest)
    seq_lens = (longest,) * (tokens // longest) + ((tokens % longest,) if tokens % longest else ())
    softcap = bool(shape and shape.softcap)  # the fused kernel caps no logit: auto runs torch (resolve_impl)
    fused = t.logprobs_impl == "triton" or t.logprobs_impl == "auto" and device == "cuda"
    head = "fused" if fused and not softcap else "torch"
    reference = "none" if not t.kl_coef else "policy" if t.lora.rank else "streamed" if t.offload else "sharded"
    train = TrainSetup(shard_size=config.topology(world_size).shard, seq_lens=seq_lens, response_tokens=tokens,
                       compute_bytes=2 if mixed else 4, checkpointing=t.activation_checkpointing,
                       ac_every=t.ac_every, ac_part=t.ac_part, offload=t.offload, head=head,
                       foreach=device == "cuda", reference=reference, reduce_every=t.reduce_every_micro_batch,
                       streaming=config.stream.enabled or config.pipe, gloo=device != "cuda",
                       lora_params=lora_params(shape, t.lora.rank, t.lora.target_modules) if t.lora.rank else 0,
                       critic=t.advantage == "gae", softcap=softcap, **frozen_models(t))
    kind = resolve_kind(e.kind, device, config.plan.enabled)
    weight_bytes = 4 if config.model.dtype == "float32" or (config.model.dtype == "auto" and device != "cuda") else 2
    tp = tp or (1 if config.plan.enabled else config.rollout.tp)
    kv_bytes, kv_setting = e.kv_memory_mb * 2**20, "engine.kv_memory_mb"
    if ENGINES[kind].memory_mb and e.memory_mb:  # TorchEngine's KV gets what its weight shard leaves of it
        shape = shape or model_shape(str(config.model.directory()))
        kv_bytes, kv_setting = e.memory_mb * 2**20 - shape.num_params * weight_bytes / tp, "engine.memory_mb"
        if kv_bytes <= 0:  # TorchEngine refuses to start: no KV block
            raise UserError(f"engine.memory_mb={e.memory_mb:g} holds not even the engine's weight shard at rollout TP "
                            f"{tp} ({shape.num_params * weight_bytes / tp / 2**20:.0f} MiB): raise it, leaving room "
                            "for the KV cache")
    rollout = RolloutSetup(engine=kind, tp=tp, weight_bytes=weight_bytes, kv_bytes=kv_bytes, kv_setting=kv_setting,
                           max_num_seqs=e.max_num_seqs, prefill_tokens=e.max_prefill_tokens,
                           released=device == "cuda" and ENGINES[kind].releases_weights, max_model_len=e.max_model_len,
                           longest=longest, draft_tokens=e.spec_max_tokens if e.speculative != "off" else 0)
    return train, rollout


def plan(shape: Shape, train: TrainSetup, rollout: RolloutSetup, capacity: float, *,
         context: float = CUDA_CONTEXT_BYTES) -> Plan:
    phases = train_phases(shape, train)
    for phase in phases:
        phase.terms += engine_kept(shape, rollout)
    phases.append(rollout_phase(shape, train, rollout))
    for phase in phases:
        phase.terms.append(Term(name="CUDA context, NCCL, cuBLAS (allowance)", bytes=context))
    critic = train.critic * 16 * critic_params(critic_of(shape, train))  # its weights, gradients and AdamW state
    host = (4 * shape.num_params + 12 * trained_params(shape, train) + critic
            ) / train.shard_size if train.offload else 0.0
    host += held_host(shape, train.reference, train)
    if train.teacher is not None:
        host += held_host(train.teacher, train.teacher_held, train)
    return Plan(shape=shape, phases=phases, capacity=capacity, host_bytes=host,
                engine_bytes=sum(t.bytes for t in engine_terms(shape, rollout)))


def config_plan(config, world_size: int, capacity: float, shape: Shape | None = None) -> Plan:
    """The plan of ``config`` on ``world_size`` GPUs of ``capacity`` bytes each. With the planner, the worst
    TP it may run (:func:`~rollpacker.plan.planner.usable_tps`): the engine's kept weights are largest at TP 1;
    with engine.memory_mb its KV cache grows with TP, and its decode workspace, the smaller of two bounds,
    can peak at a TP between."""
    shape = shape or model_shape(str(config.model.directory()))
    check_rollout_tp(config, shape, str(config.model.directory()))
    train, rollout = setups(config, world_size, shape=shape)
    if not config.plan.enabled:
        return plan(shape, train, rollout, capacity)
    return max((plan(shape, train, setups(config, world_size, shape=shape, tp=tp)[1], capacity)
                for tp in usable_tps(world_size, shape.num_kv_heads, config.plan)), key=lambda p: p.peak)


def check_rollout_tp(config, shape: Shape, path: str) -> None:
    """Each rank of a replica holds whole key-value heads: rollout.tp divides them (the planner's TPs do)."""
    if not config.plan.enabled and shape.num_kv_heads % config.rollout.tp:
        raise UserError(f"rollout.tp={config.rollout.tp} does not divide the model's {shape.num_kv_heads} key-value "
                        f"heads ({path}): each rank of a replica holds whole heads; set rollout.tp to a divisor of "
                        f"{shape.num_kv_heads}")


def check_fits(config, shape: Shape, world_size: int, capacity: float) -> Plan:
    """The job's start-up check on GPU: the plan, or a UserError naming what does not fit."""
    p = config_plan(config, world_size, capacity, shape)
    if not p.fits:
        raise UserError(p.refusal())
    return p


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rollpacker.plan.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen2.5-7b-8k", help="a preset name or .toml path")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU, GB (1e9 bytes)")
    parser.add_argument("--world-size", type=int, default=8, help="GPUs of the job (FSDP2 shards over them)")
    args, overrides = parser.parse_known_args(argv)
    from rollpacker.config import as_flags, parse

    if args.world_size <= 0 or not 0 < args.gpu_memory_gb < math.inf:
        parser.error(f"--world-size {args.world_size} and --gpu-memory-gb {args.gpu_memory_gb:g} must be positive "
                     "(and finite): the job's GPUs and the memory of one")
    try:
        config = parse(["--preset", args.preset, *overrides])
    except FileNotFoundError as e:  # a preset that is not there
        parser.error(str(e))
    try:  # what the job refuses on these GPUs (rollout.tp not dividing them, ...) has no plan either
        config.check_world(args.world_size)
    except ValueError as e:
        parser.error(f"--world-size {args.world_size}: {as_flags(str(e))}")
    try:
        p = config_plan(config, args.world_size, args.gpu_memory_gb * GB)
    except (FileNotFoundError, UserError) as e:  # no model there, settings no plan holds
        parser.error(as_flags(str(e)))
    s = p.shape
    print(f"{args.preset}: {s.num_params / 1e9:.2f}B parameters ({s.num_layers} layers, hidden {s.hidden_size}), "
          f"{args.world_size} GPUs of {args.gpu_memory_gb:g} GB")
    print(p.table())
    print(json.dumps({"preset": args.preset, "world_size": args.world_size, **p.summary()}))
    sys.exit(0)


if __name__ == "__main__":
    main()
