"""Test-support stand-in for sgl_kernel (SGLang on CPU only; see docs/sglang.md).

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports CPU kernels from sgl_kernel at module import
(KV-cache moves, request-to-token writes, speculative decoding). Each call site is gated on Intel
AMX or on features we do not use, so dense generation calls none of them. Here every name imports
and raises if called. One op is real: ``torch.ops.sgl_kernel.murmur_hash32_cpu``, the hash of
SGLang's seeded sampling, ported to torch (its values equal SGLang's Triton kernel's; the SGLang
tests check this). Never on the path beside a real sgl_kernel: importing this raises then.
"""

import importlib.machinery
import sys
from pathlib import Path

import torch

__version__ = "0.0.0+rollpacker.stub"

_HERE = Path(__file__).resolve().parents[1]
if importlib.machinery.PathFinder.find_spec(
        "sgl_kernel", [p for p in sys.path if p and Path(p).resolve() != _HERE]) is not None:
    raise ImportError(f"a real sgl_kernel is installed: take rollpacker's test stubs ({_HERE}) off PYTHONPATH")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} was called, but sgl_kernel here is rollpacker's test stub "
                                  "(tests/support/sglang_stubs): this SGLang path needs the real CPU kernels")

    unavailable.__name__ = name
    return unavailable


_MASK = 0xFFFFFFFF


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _MASK


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One MurmurHash3 x86_32 block: ``k`` scrambled into ``h`` (uint32 values held in int64)."""
    k = _rotl((k * 0xCC9E2D51) & _MASK, 15)
    h = _rotl(h ^ ((k * 0x1B873593) & _MASK), 13)
    return (h * 5 + 0xE6546B64) & _MASK


def murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """[rows, cols] uint32 hashes of (seed low, seed high, position, column) per row and column,
    four 4-byte blocks finalized as 16 bytes, as SGLang's ``murmur_hash32_kernel``."""
    s = seed.to(torch.int64)  # bit pattern of the uint64 seed
    h = torch.zeros(s.shape[0], 1, dtype=torch.int64)
    for block in ((s & _MASK), (s >> 32) & _MASK, positions.to(torch.int64) & _MASK):
        h = _mix(h, block[:, None])
    h = _mix(h.expand(-1, col_indices.shape[0]), (col_indices.to(torch.int64) & _MASK)[None, :]) ^ 16
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & _MASK
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & _MASK
    return (h ^ (h >> 16)).to(torch.uint32)


_library = torch.library.Library("sgl_kernel", "DEF")
_library.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
_library.impl("murmur_hash32_cpu", murmur_hash32, "CPU")
