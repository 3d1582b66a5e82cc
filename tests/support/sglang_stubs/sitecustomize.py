"""Test support: SGLang's deterministic mode on CPU, in every process of the SGLang tests (the
spawned schedulers included), patched as each SGLang module loads. See docs/sglang.md.

SGLang's ``enable_deterministic_inference`` (what makes ``sampling_seed`` count) supports GPU
attention backends only and turns on Triton batch-invariant ops that need CUDA. On CPU
(``SGLANG_USE_CPU_ENGINE=1``) two patches let it run with ``torch_native`` attention:

- ``torch_native`` joins the deterministic attention backends (SGLang refuses it otherwise);
- ``enable_batch_invariant_mode`` does nothing (it raises "No supported accelerator").

What this hides: the CPU kernels are not made batch-invariant, so a request's logits may differ
in the last bits with what runs beside it. Seeded sampling itself (SGLang's position-keyed
Gumbel noise from ``murmur_hash32``) is real, with the sgl_kernel stub's port of the hash.
"""

import importlib.abc
import importlib.machinery
import sys


def _allow_torch_native(choices) -> None:
    choices.add_deterministic_attention_backend_choices(["torch_native"])


def _no_batch_invariant_mode(ops) -> None:
    ops.enable_batch_invariant_mode = lambda *args, **kwargs: None


PATCHES = {"sglang.srt.arg_groups.choices": _allow_torch_native,
           "sglang.srt.batch_invariant_ops": _no_batch_invariant_mode}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds the modules of :data:`PATCHES` as usual and patches each once it has run."""

    def find_spec(self, name, path=None, target=None):
        patch = PATCHES.get(name)
        spec = importlib.machinery.PathFinder.find_spec(name, path) if patch else None
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
