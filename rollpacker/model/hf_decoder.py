"""Any Hugging Face decoder as the trainer's model (``--model.impl hf``).

:class:`HFDecoder` holds a ``transformers`` causal LM's decoder (``model``) and output head
(``lm_head``) as its own submodules, and runs them with the native decoder's calling convention:
packed tokens and positions in, the final hidden states (or the fused log-prob head's output) out.

Invariants:

- Parameter names are the Hugging Face ones.
- Packed sequences are told apart by their positions, which restart at 0. Hence attention layers
  only: a decoder with state-space, linear-attention or convolution layers is refused
  (:func:`check_supported`), and so is one whose ``transformers`` code builds its mask without the
  positions (:func:`check_packing`).
- Weights are pushed under the checkpoint's names (:func:`checkpoint_format`).
- Rollout runs on vLLM or SGLang: TorchEngine runs the native decoder only.
- Attention is the native decoder's packed attention (:func:`packed_attention`, registered with
  ``transformers``' ``AttentionInterface``): no ``[T, T]`` mask. A decoder that caps its attention logits
  (Gemma-2's ``attn_logit_softcapping``), which SDPA leaves out and the engines apply, runs
  ``transformers``' eager attention, and one whose layers do not pass the packed sequences on
  (:func:`reaches_attention`) its SDPA, each with the mask ``transformers`` builds from the positions.

Why: the trainer can then train decoders the native one does not implement. Which models pick it,
and how it differs from the native path: ``docs/memory.md`` (Any Hugging Face decoder).
"""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rollpacker.errors import UserError
from rollpacker.model.args import ModelArgs, eos_token_ids, tied_embeddings
from rollpacker.model.attention import CausalAttention, causal_packed_attention

UNSUPPORTED_HEADS = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier")
"""Config keys of architectures whose output head does more than a matmul (and a softcap): refused
unless 1."""
ATTENTION_LAYERS = ("full_attention", "sliding_attention")
"""``layer_types`` whose packed sequences the positions keep apart."""
CALL_WIDE_ROPE = ("dynamic", "longrope")
"""RoPE types whose frequencies ``transformers`` picks from the largest position of the whole call: a packed
sequence beside one past the pretraining length would be rotated as that one."""
RECURRENT_KEYS = ("mamba_", "ssm_", "linear_", "conv_", "conv1d_", "lru_", "time_step_", "state_size")
"""Config key prefixes of state-space, linear-attention and convolution layers (Jamba, Bamba,
Falcon-H1, Zamba, Nemotron-H, LFM2, Qwen3-Next, MiniMax, RecurrentGemma): no attention-only
decoder in ``transformers`` has one."""
PACKED_ATTENTION = "rollpacker_packed"
""":func:`packed_attention`'s name in ``transformers``' ``AttentionInterface``."""


def read_config(path: str | Path) -> dict[str, Any]:
    """A model directory's ``config.json`` as a dict, with ``transformers``' defaults filled in."""
    from transformers import AutoConfig

    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: point at a Hugging Face model directory")
    return AutoConfig.from_pretrained(path).to_dict()


@dataclass(frozen=True, kw_only=True)
class DecoderFacts:
    """What an engine needs of any decoder's config."""

    model_type: str
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    """config.json's, then generation_config.json's (:func:`~rollpacker.model.args.eos_token_ids`)."""
    max_position_embeddings: int
    vocab_size: int
    """Embedding rows: a prompt's token ids lie below it."""
    moe: bool
    """A mixture of experts."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    """The KV cache's shape: what an engine's KV budget holds per token."""


def decoder_facts(path: str | Path) -> DecoderFacts:
    cfg = read_config(path)
    text = cfg.get("text_config") or cfg
    return DecoderFacts(model_type=text["model_type"], tie_word_embeddings=tied_embeddings(cfg),
                        eos_token_ids=eos_token_ids(text.get("eos_token_id", cfg.get("eos_token_id")), path),
                        max_position_embeddings=text.get("max_position_embeddings") or 4096,
                        vocab_size=text.get("vocab_size") or cfg["vocab_size"],
                        moe=bool(text.get("num_experts") or text.get("num_local_experts")),
                        num_layers=text["num_hidden_layers"],
                        num_kv_heads=text.get("num_key_value_heads") or text["num_attention_heads"],
                        head_dim=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])


def config_dtype(path: str | Path) -> torch.dtype | None:
    """The weights' dtype ``config.json`` names (``dtype``, or ``torch_dtype`` before transformers v5)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def resolve_impl(impl: str, path: str | Path) -> str:
    """``model.impl``: native or hf; auto is native when the native decoder implements the model.
    An hf model the hf path cannot run is refused here, before anything starts (:func:`check_supported`)."""
    if impl not in ("auto", "native", "hf"):
        raise ValueError(f"model.impl must be auto, native or hf, got {impl!r}")
    if impl == "auto":
        cfg_file = Path(path) / "config.json"
        try:
            ModelArgs.from_hf(json.loads(cfg_file.read_text()), where=str(cfg_file))
            impl = "native"
        except ValueError:
            impl = "hf"
    if impl == "hf":
        cfg = read_config(path)
        check_supported(cfg.get("text_config") or cfg)
        load_hf(path, meta=True)  # its code: check_packing
    return impl


def check_supported(cfg: dict[str, Any]) -> None:
    """Refuse a decoder config (``transformers``' dict) whose log-probs the hf path would get wrong.

    An output head that scales its logits (:data:`UNSUPPORTED_HEADS`). Layers other than full or
    sliding-window attention: only those build their mask from the positions that tell packed
    sequences apart; a state-space, linear-attention or convolution layer carries its state from one
    sequence into the next. Either sign is enough: a ``layer_types`` entry outside
    :data:`ATTENTION_LAYERS` (chunked or sparse attention too), or a set key of :data:`RECURRENT_KEYS`
    (hybrids that name no ``layer_types``: Jamba, Bamba, Falcon-H1). A RoPE of :data:`CALL_WIDE_ROPE`, which
    ties a sequence's rotation to the longest one packed beside it."""
    name = cfg.get("model_type")
    ropes = [r for r in (cfg.get("rope_scaling"), cfg.get("rope_parameters")) if isinstance(r, dict)]
    ropes += [r for rope in ropes for r in rope.values() if isinstance(r, dict)]  # per layer type (Gemma3's)
    if wide := sorted({r.get("rope_type", r.get("type")) for r in ropes} & set(CALL_WIDE_ROPE)):
        raise UserError(f"{name}: rope_type {wide[0]} takes its frequencies from the longest position in the whole "
                        "forward, so a packed sequence's log-probs would depend on what it is packed with; this "
                        "architecture is not supported (RoPE default, linear, llama3 or yarn are)")
    for key in UNSUPPORTED_HEADS:
        if cfg.get(key) not in (None, 1, 1.0):
            raise UserError(f"{name}: {key}={cfg[key]} scales the output logits, which rollpacker's log-prob head "
                            "does not; this architecture is not supported")
    other = sorted(set(cfg.get("layer_types") or ()) - set(ATTENTION_LAYERS))
    keys = sorted(k for k, v in cfg.items() if k.startswith(RECURRENT_KEYS) and v is not None)
    if other or keys:
        sign = f"layer_types holds {', '.join(other)}" if other else \
            f"{keys[0]} is set (a state-space, linear-attention or convolution layer's)"
        raise UserError(f"{name}: {sign}: only full and sliding-window attention layers keep packed sequences apart "
                        "(the others carry state from one into the next), so its log-probs would be wrong; this "
                        "architecture is not supported: train a decoder of attention layers only")


def packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None,
                     packed: CausalAttention | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``transformers``' attention interface over the native path's packed attention (its length buckets,
    :class:`HFDecoder` passes them as ``packed``): query ``[1, heads, T, head_dim]``, key and value with the
    KV heads -> ``([1, T, heads, head_dim], None)``. ``attention_mask`` is None: no mask is built for
    this implementation, where SDPA's would be a dense ``[T, T]`` one, converted to the compute dtype
    and kept for backward by every layer."""
    if packed is None:
        raise ValueError(f"{type(module).__name__}: rollpacker's packed attention was called without the packed "
                         "sequences: call the HFDecoder, which passes them, not the transformers model it wraps")
    if dropout or softcap:
        raise ValueError(f"{type(module).__name__}: rollpacker's packed attention applies no attention dropout "
                         f"({dropout}) or logit cap ({softcap})")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    return causal_packed_attention(q, k, v, packed.buckets, scale=scaling, window=sliding_window)[None], None


def packed_sequences(positions: torch.Tensor) -> CausalAttention:
    """The packed sequences ``positions`` [T] hold, each starting at position 0."""
    starts = [0, *(torch.nonzero(positions[1:] == 0)[:, 0] + 1).tolist(), len(positions)]
    return CausalAttention([b - a for a, b in zip(starts, starts[1:])], positions.device)


class _Reached(Exception):
    """Raised by :func:`reaches_attention`'s probe at the first attention call: whether ``packed`` came."""


def reaches_attention(causal_lm: nn.Module) -> bool:
    """Whether the forward's keyword arguments, the packed sequences among them, reach the decoder's attention
    function (StableLM's and Nemotron's layers drop them): its decoder runs on two tokens up to the first
    attention call, stopped there."""
    from transformers import AttentionInterface

    def probe(*args: Any, packed: Any = None, **kwargs: Any) -> None:
        raise _Reached(packed is not None)

    AttentionInterface.register("rollpacker_probe", probe)
    before = causal_lm.config._attn_implementation
    causal_lm.set_attn_implementation("rollpacker_probe")
    device = next(causal_lm.parameters()).device
    try:
        causal_lm.model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), use_cache=False,
                        position_ids=torch.arange(2, device=device)[None], packed=True)
    except _Reached as reached:
        return reached.args[0]
    except Exception:  # noqa: BLE001  (transformers' code, before any attention: it keeps its own)
        return False
    finally:
        causal_lm.set_attn_implementation(before)
    return False


class _MaskBuilt(Exception):
    """Raised by :func:`check_packing`'s spy at the first mask: nothing after it needs to run."""


def check_packing(causal_lm: nn.Module) -> None:
    """Refuse a decoder whose ``transformers`` code builds its attention mask without the positions: packed
    sequences would attend to the ones before them (GPT-OSS, AFMoE, XGLM). Its decoder runs on two packed
    sequences up to the first mask it builds (``masking_utils``, which every mask from the positions goes
    through), stopped there: on the meta device, it computes nothing."""
    import transformers

    masking_utils = getattr(transformers, "masking_utils", None)
    build = getattr(masking_utils, "_preprocess_mask_arguments", None)
    if build is None:  # before it, a mask from positions alone was flash-attention's only
        raise UserError(f"transformers {transformers.__version__} builds no attention mask from the positions "
                        "(its masking_utils), which keep packed sequences apart: upgrade transformers for the hf path")
    seen: list[torch.Tensor | None] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(inspect.signature(build).bind(*args, **kwargs).arguments.get("position_ids"))
        raise _MaskBuilt

    device = next(causal_lm.parameters()).device
    why = "it builds no mask through transformers' masking_utils"
    masking_utils._preprocess_mask_arguments = spy
    try:
        causal_lm.model(input_ids=torch.zeros(1, 4, dtype=torch.long, device=device), use_cache=False,
                        position_ids=torch.tensor([[0, 1, 0, 1]], device=device))
    except _MaskBuilt:
        why = "it builds its mask without the positions"
    except Exception as e:  # noqa: BLE001  (transformers' code, before any mask: said below)
        why = f"its decoder raised before any mask: {type(e).__name__}: {e}"
    finally:
        masking_utils._preprocess_mask_arguments = build
    if not seen or seen[0] is None:
        raise UserError(f"{causal_lm.config.get_text_config().model_type}: transformers' {type(causal_lm).__name__} "
                        f"cannot be shown to tell packed sequences apart ({why}), so each could attend to the ones "
                        "before it and its log-probs would be wrong; this architecture is not supported")


class HFDecoder(nn.Module):
    """A ``transformers`` causal LM's decoder and head, called like the native
    :class:`~rollpacker.model.transformer.Transformer` (see the module docstring)."""

    base_model_prefix = "model"
    """The decoder's attribute, as on a ``transformers`` model: PEFT maps fused experts' names through it."""

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        cfg = causal_lm.config.get_text_config()
        check_supported(cfg.to_dict())
        if getattr(cfg, "attn_logit_softcapping", None):  # transformers' SDPA leaves the cap out; eager applies it
            causal_lm.set_attn_implementation("eager")
        elif reaches_attention(causal_lm):  # else transformers' SDPA, with its [T, T] mask
            from transformers import AttentionInterface

            AttentionInterface.register(PACKED_ATTENTION, packed_attention)
            causal_lm.set_attn_implementation(PACKED_ATTENTION)
        check_packing(causal_lm)
        decoder, head = getattr(causal_lm, "model", None), causal_lm.get_output_embeddings()
        if not isinstance(getattr(decoder, "layers", None), nn.ModuleList) or head is None:
            raise ValueError(f"{type(causal_lm).__name__}: expected a decoder at .model with .layers and an output "
                             "head; not a decoder-only causal LM that rollpacker can train")
        if getattr(head, "bias", None) is not None:
            raise ValueError(f"{type(causal_lm).__name__}: its output head has a bias (Phi's), which rollpacker's "
                             "log-prob head does not add; this architecture is not supported")
        self.model, self.lm_head = decoder, head
        self.config = causal_lm.config
        self.__dict__["causal_lm"] = causal_lm  # shares the submodules; not registered (no second names)
        self.logit_softcap = getattr(cfg, "final_logit_softcapping", None)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn: CausalAttention | None = None,
                head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """tokens, positions: [T] (packed sequences, positions restarting at 0) -> final hidden states
        [T, hidden], or ``head(hidden, lm_head.weight)``. ``attn``: the packed sequences (None: read from
        the positions), for :func:`packed_attention`; eager attention builds its mask from the positions."""
        out = self.model(input_ids=tokens[None], position_ids=positions[None], use_cache=False,
                         packed=attn or packed_sequences(positions))
        hidden = out.last_hidden_state[0]
        return hidden if head is None else head(hidden, self.lm_head.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] -> [N, vocab_size] in fp32, capped like the model's own."""
        logits = self.lm_head(hidden).float()
        if self.logit_softcap is not None:
            logits = self.logit_softcap * torch.tanh(logits / self.logit_softcap)
        return logits


def load_hf(path: str | Path, *, meta: bool = False, dtype: torch.dtype = torch.float32) -> HFDecoder:
    """The model at ``path``: its weights in host memory, or (``meta``) its structure only."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if meta:
        with torch.device("meta"):
            causal_lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    else:
        causal_lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return HFDecoder(causal_lm.train())


def save_hf(model: HFDecoder, path: str | Path, *, write: bool = True, dtype: torch.dtype | None = None,
            weights=None) -> None:
    """Write ``model`` as a Hugging Face directory with ``transformers``' own ``save_pretrained`` (the
    checkpoint's names, fused experts split back); ``weights``: (name, tensor) pairs to write instead
    of its parameters (LoRA's merged weights; its persistent buffers, a MoE router's bias, are written
    beside them). DTensor parameters are gathered with ``full_tensor()``, a collective: call it on
    every rank, ``write`` on the one that writes."""
    state, params = {}, dict(model.named_parameters())
    buffers = [(name, t) for name, t in model.state_dict().items() if name not in params]
    for name, t in model.state_dict().items() if weights is None else [*weights, *buffers]:
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        if write:
            state[name] = t.detach().to("cpu", dtype).contiguous()
    if write:
        model.causal_lm.save_pretrained(path, state_dict=state)
        if dtype is not None:  # the config names the tensors' dtype, not the fp32 the model trains in
            config = copy.deepcopy(model.causal_lm.config)
            config.dtype = dtype
            config.save_pretrained(path)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a whole (unsharded) model by name: the source of
    :func:`~rollpacker.model.parallelize.load_sharded`."""
    return dict(model.named_parameters()) | dict(model.named_buffers())


def checkpoint_format(path: str | Path) -> Callable[[Iterable[tuple[str, torch.Tensor]]],
                                                    Iterator[tuple[str, torch.Tensor]]]:
    """A map from the ``transformers`` model's parameter names to the checkpoint's (fused MoE
    experts split per expert), tensor by tensor; the identity for the native decoder's models."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    if resolve_impl("auto", path) == "native":
        return lambda named: iter(named)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))

    def convert(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named:
            yield from revert_weight_conversion(skeleton, {name: tensor}).items()

    return convert
