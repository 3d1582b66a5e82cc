"""Hugging Face model directories: ``config.json`` plus one or several safetensors shards.

Loading builds the decoder on the meta device and assigns the checkpoint's tensors
(``load_state_dict(assign=True)``), so no memory is spent on a random init. Names map by
stripping Hugging Face's ``model.`` prefix. Every problem names the tensor and the file.

A sequence-classification checkpoint (a reward model: ``*ForSequenceClassification``) loads with its
``score`` head as the output head: the decoder's logits are then its scores, one per label.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from rollpacker.model.args import ModelArgs, adapter_note, score_labels
from rollpacker.model.transformer import Transformer

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def read_config(path: str | Path) -> dict:
    """A model directory's ``config.json``."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(adapter_note(path) or f"{cfg_file} not found: point at a Hugging Face model directory")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None


def read_args(path: str | Path) -> ModelArgs:
    """The model args of the directory ``path`` (EOS ids: config.json's and generation_config.json's)."""
    return ModelArgs.from_hf(read_config(path), where=str(Path(path) / "config.json"), model_dir=path)


def _shard_files(path: Path) -> dict[Path, list[str]]:
    """Shard file -> names it should hold (an empty list: whatever the single file holds)."""
    if (path / INDEX).is_file():
        shards: dict[Path, list[str]] = {}
        for key, file in json.loads((path / INDEX).read_text())["weight_map"].items():
            shards.setdefault(path / file, []).append(key)
        return shards
    if (path / SINGLE).is_file():
        return {path / SINGLE: []}
    raise FileNotFoundError(f"{path}: neither {SINGLE} nor {INDEX} found")


def load_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> Transformer:
    """Load a Hugging Face model directory into a :class:`Transformer` on ``device`` (a sequence
    classifier's ``score`` head as its output head).

    ``dtype`` converts every tensor; ``None`` keeps the checkpoint's own.
    """
    path = Path(path)
    cfg = read_config(path)
    args, labels = ModelArgs.from_hf(cfg, where=str(path / "config.json"), model_dir=path), score_labels(cfg)
    if labels:
        args = replace(args, tie_word_embeddings=False)  # the score head is its own
    with torch.device("meta"):
        model = Transformer(args)
        if labels:
            model.lm_head = nn.Linear(args.hidden_size, labels, bias=False)
    expected = model.state_dict()
    if args.tie_word_embeddings:
        expected.pop("lm_head.weight")
    state: dict[str, torch.Tensor] = {}
    for file, keys in _shard_files(path).items():
        if not file.is_file():
            raise FileNotFoundError(f"{file}: shard missing; the index puts {keys[0]} (and {len(keys) - 1} more) there")
        with safe_open(file, framework="pt", device=str(device)) as f:
            for key in f.keys():
                name = key.removeprefix("model.")
                if labels and name == "score.weight":
                    name = "lm_head.weight"
                if name == "lm_head.weight" and args.tie_word_embeddings or "rotary_emb" in name:
                    continue
                if name not in expected:
                    raise ValueError(f"{file}: tensor {key} is not a parameter of a {args.model_type} decoder")
                shape = tuple(f.get_slice(key).get_shape())
                want = tuple(expected[name].shape)
                if shape != want:
                    raise ValueError(f"{file}: tensor {key} has shape {shape}, but config.json implies {want}")
                t = f.get_tensor(key)
                state[name] = t.to(dtype) if dtype is not None else t
    missing = sorted(set(expected) - set(state))
    if missing:
        first = missing[0] if missing[0] == "lm_head.weight" else f"model.{missing[0]}"  # the checkpoint's name
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} tensor(s), e.g. {first}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model


def empty_model(args: ModelArgs, device: torch.device | str, dtype: torch.dtype) -> Transformer:
    """A :class:`Transformer` of ``args`` with uninitialized weights, to be filled in place (an
    engine rebuilt from the trainer's live weights)."""
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    return model


def save_model(model: Transformer, path: str | Path, max_shard_bytes: int = 5 << 30, *, write: bool = True,
               dtype: torch.dtype | None = None, weights=None) -> None:
    """Write ``model`` as a Hugging Face directory (``config.json`` is written back unchanged), its
    tensors in ``dtype`` (None: as they are); ``weights``: (name, tensor) pairs to write instead of its
    state dict (LoRA's merged weights).

    DTensor parameters are gathered with ``full_tensor()``, a collective: call it on every rank
    of their mesh, with ``write`` True on the one rank that writes (the others keep no copy).
    """
    path = Path(path)
    state = {}
    for name, t in model.state_dict().items() if weights is None else weights:
        if name == "lm_head.weight" and model.args.tie_word_embeddings:
            continue
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        if write:
            state[name if name == "lm_head.weight" else f"model.{name}"] = t.detach().to("cpu", dtype).contiguous()
    if not write:
        return
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    (path / "config.json").write_text(json.dumps(model.args.hf_config, indent=2) + "\n")
    if len(shards) == 1:
        save_file(shards[0], path / SINGLE, metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def checkpoint_dtype(args: ModelArgs) -> torch.dtype | None:
    """The dtype ``config.json`` names for the weights (``dtype``, or ``torch_dtype`` before transformers
    v5), or None when it names none."""
    name = args.hf_config.get("dtype") or args.hf_config.get("torch_dtype")
    found = getattr(torch, name, None) if isinstance(name, str) else None
    return found if isinstance(found, torch.dtype) else None


def engine_dtype(name: str, device: torch.device) -> torch.dtype:
    """``model.dtype`` as a torch dtype: auto is bfloat16 on GPU, float32 on CPU."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        name, torch.bfloat16 if device.type == "cuda" else torch.float32)
