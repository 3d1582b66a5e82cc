"""The decoder model, its Hugging Face load/save and its parallelization."""

from rollpacker.model.args import ModelArgs
from rollpacker.model.attention import AttentionBackend, CausalAttention
from rollpacker.model.hf import empty_model, engine_dtype, load_model, read_args, save_model
from rollpacker.model.transformer import Transformer

__all__ = ["AttentionBackend", "CausalAttention", "ModelArgs", "Transformer", "empty_model", "engine_dtype",
           "load_model", "read_args", "save_model"]
