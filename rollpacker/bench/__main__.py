"""``python -m rollpacker.bench <name> [--flags]``: run one benchmark; ``<name> --help`` lists its flags."""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "engine": "rollpacker.bench.engine",
    "step": "rollpacker.bench.step",
    "schedulers": "rollpacker.bench.schedulers",
    "rewards": "rollpacker.bench.rewards",
    "planner": "rollpacker.bench.planner",
    "logprobs": "rollpacker_kernels.bench",
    "faults": "rollpacker.bench.faults",
    "regime": "rollpacker.bench.regime",
    "algorithms": "rollpacker.bench.algorithms",
    "spec-engine": "rollpacker.bench.spec_engine",
    "spec": "rollpacker.bench.spec",
    "memory": "rollpacker.bench.memory",
    "sessions": "rollpacker.bench.sessions",
    "episodes": "rollpacker.bench.episodes",
    "parity": "rollpacker.bench.parity",
}
"""Subcommand -> module with a ``main(argv)``."""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHES:
        names = ", ".join(BENCHES)
        sys.exit(f"usage: python -m rollpacker.bench {{{names}}} [--flags]  (got {argv[:1] or 'nothing'})")
    importlib.import_module(BENCHES[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
