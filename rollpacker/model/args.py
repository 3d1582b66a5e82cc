"""Model hyper-parameters, read from and written back to a Hugging Face ``config.json``.

One decoder covers Llama, Qwen2/Qwen2.5 and Qwen3; the differences are three switches:
``qkv_bias``/``o_bias`` (Qwen2 has biases on q/k/v only, Llama and Qwen3 follow
``attention_bias``), ``qk_norm`` (Qwen3's per-head RMSNorm on q and k) and
``tie_word_embeddings``. Anything else a config asks for that this decoder does not implement
(sliding windows, MLP biases, unknown RoPE scaling) is refused with the field named.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
CLASS_HEAD_DIMS = {"qwen3": 128, "gemma": 256, "gemma2": 256, "gemma3_text": 256}
"""``head_dim`` of a config.json without one, where its transformers config class has its own default (not
hidden_size // num_attention_heads)."""


def head_dim(cfg: dict[str, Any]) -> int:
    """A config.json's ``head_dim``, as transformers reads it."""
    return (cfg.get("head_dim") or CLASS_HEAD_DIMS.get(cfg.get("model_type"))
            or cfg["hidden_size"] // cfg["num_attention_heads"])


def tied_embeddings(cfg: dict[str, Any]) -> bool:
    """A config.json's ``tie_word_embeddings``, as transformers reads it: without the key, its config class's default
    (Gemma's and GPT-2's True, Llama's and Qwen2's False)."""
    if "tie_word_embeddings" in cfg:
        return bool(cfg["tie_word_embeddings"])
    return _class_ties(cfg.get("model_type") or "")


@functools.cache
def _class_ties(model_type: str) -> bool:
    from transformers import AutoConfig

    try:
        return bool(AutoConfig.for_model(model_type).tie_word_embeddings)
    except ValueError:  # a model type transformers does not know: what our own decoder reads
        return False


@dataclass(kw_only=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)
    """The config.json this came from, written back unchanged on save."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], where: str = "config.json", *,
                model_dir: str | Path | None = None) -> ModelArgs:
        """The args of ``config.json``'s ``cfg``; ``model_dir``: the checkpoint it came from, whose
        ``generation_config.json`` may add EOS ids (:func:`eos_token_ids`)."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{where}: model_type={model_type!r} is not supported; "
                f"expected one of {SUPPORTED_MODEL_TYPES}"
            )
        for key, bad in (("use_sliding_window", True), ("mlp_bias", True)):
            if cfg.get(key) == bad:
                raise ValueError(f"{where}: {key}={bad} is not supported by rollpacker's decoder")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{where}: hidden_act={cfg['hidden_act']!r} is not supported (silu only)")
        rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})  # transformers': rope_scaling wins
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"{where}: rope_type={rope_type!r} is not supported (default, llama3)")
        if rope_type == "llama3":  # the pretraining length: a top-level one wins, else the model's, as transformers
            rope["original_max_position_embeddings"] = cfg.get("original_max_position_embeddings") or rope.get(
                "original_max_position_embeddings") or cfg.get("max_position_embeddings", 4096)
            if missing := [key for key in ("factor", "low_freq_factor", "high_freq_factor") if key not in rope]:
                raise ValueError(f"{where}: rope_type llama3 without {', '.join(missing)}")
        num_heads = cfg["num_attention_heads"]
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim(cfg),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope if rope_type == "llama3" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=tied_embeddings(cfg),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos_token_ids(cfg.get("eos_token_id"), model_dir),
            hf_config=dict(cfg),
        )

    @property
    def kv_elements_per_token(self) -> int:
        """Elements of K and V one token occupies over all layers (before tensor parallelism)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def eos_token_ids(eos: int | list[int] | None, model_dir: str | Path | None = None) -> tuple[int, ...]:
    """The ids a model's responses end at: ``eos`` (config.json's ``eos_token_id``: an int, a list or
    None), then those the optional ``generation_config.json`` of ``model_dir`` adds, each once.

    Hugging Face's ``generate`` stops at generation_config.json's ids. Qwen2.5/Qwen3 instruct list
    [151645, 151643] there but 151645 alone in config.json. Every engine and the trainer take their
    EOS ids from here."""
    ids = [eos] if isinstance(eos, int) else list(eos or ())
    gen_file = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if gen_file is not None and gen_file.is_file():
        try:
            extra = json.loads(gen_file.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{gen_file}: not a JSON object ({e}); fix the file or delete it") from None
        ids += [extra] if isinstance(extra, int) else list(extra or ())
    return tuple(dict.fromkeys(ids))


def score_labels(cfg: dict[str, Any]) -> int:
    """The labels of a sequence-classification checkpoint's ``score`` head, from its ``config.json``
    (a reward model has one); 0 for any other model."""
    if not any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or ()):
        return 0
    return len(cfg.get("id2label") or {}) or cfg.get("num_labels") or 2  # Hugging Face's default: 2


def has_tokenizer(path: Path) -> bool:
    """Whether the model directory ``path`` holds a tokenizer's files."""
    return any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


def adapter_note(path: Path) -> str | None:
    """Why ``path``, holding no ``config.json``, is no model if it is a PEFT adapter directory (a LoRA run's
    ``hf``), naming what to point at instead; None for any other directory."""
    adapter = Path(path) / "adapter_config.json"
    if (Path(path) / "config.json").is_file() or not adapter.is_file():
        return None
    try:
        base = json.loads(adapter.read_text()).get("base_model_name_or_path")
    except (json.JSONDecodeError, AttributeError):
        base = None
    return (f"{path} is a PEFT adapter directory (LoRA), not a model: point at the merged model (a run's hf_merged, "
            f"written with --train.lora.export-merged), or merge the adapter into its base ({base}) with peft")
