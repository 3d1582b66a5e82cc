"""The decoder model, its Hugging Face load/save and its parallelization."""

from rollpacker.model.args import ModelArgs
from rollpacker.model.attention import AttentionBackend, CausalAttention
from rollpacker.model.hf import INDEX, checkpoint_dtype, empty_model, engine_dtype, load_model, read_args, save_model
from rollpacker.model.transformer import Transformer

__all__ = ["INDEX", "AttentionBackend", "CausalAttention", "ModelArgs", "Transformer", "checkpoint_dtype",
           "empty_model", "engine_dtype", "load_model", "read_args", "save_model"]
