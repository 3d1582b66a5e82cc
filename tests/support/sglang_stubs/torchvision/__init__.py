"""Test-support stand-in for torchvision (SGLang on CPU only; see docs/sglang.md).

SGLang imports ``torchvision.transforms`` when its model configs load (the multimodal ones). PyPI's
torchvision is a CUDA build that fails to load beside torch's CPU build. Text generation never uses
it. Here every submodule imports, every name is a placeholder, and calling or instantiating one
raises. Never on the path beside a real torchvision: the SGLang tests refuse to start then.
"""

import importlib.abc
import importlib.machinery
import sys
import types
from pathlib import Path

__version__ = "0.0.0+rollpacker.stub"


class Unavailable:
    """A torchvision name: usable in annotations and as a base class; calling it raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, item: str) -> "Unavailable":
        if item.startswith("__"):
            raise AttributeError(item)
        return Unavailable(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} was called, but torchvision here is rollpacker's test stub "
                           "(tests/support/sglang_stubs): SGLang's CPU text path should never need it")

    def __mro_entries__(self, bases):
        return (object,)

    def __getitem__(self, item) -> "Unavailable":
        return self

    def __or__(self, other) -> "Unavailable":
        return self

    __ror__ = __or__


class _Module(types.ModuleType):
    def __getattr__(self, item: str) -> Unavailable:
        if item.startswith("__"):
            raise AttributeError(item)
        return Unavailable(f"{self.__name__}.{item}")


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``torchvision.<anything>`` importable as a :class:`_Module`."""

    def find_spec(self, name, path=None, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _refuse_beside_a_real_one(name: str) -> None:
    """Raise ImportError when a real ``name`` is installed elsewhere on the path."""
    here = str(Path(__file__).resolve().parents[1])
    others = [p for p in sys.path if p and Path(p).resolve() != Path(here)]
    if importlib.machinery.PathFinder.find_spec(name, others) is not None:
        raise ImportError(f"a real {name} is installed: take rollpacker's test stubs ({here}) off PYTHONPATH")


_refuse_beside_a_real_one("torchvision")
sys.meta_path.insert(0, _Submodules())


def __getattr__(item: str) -> Unavailable:
    if item.startswith("__"):
        raise AttributeError(item)
    return Unavailable(f"torchvision.{item}")
