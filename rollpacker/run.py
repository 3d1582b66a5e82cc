"""Entry point: ``torchrun --nproc_per_node=N -m rollpacker.run [--preset NAME] [--section.field value …]``.

``python -m rollpacker.run`` is the same program at world size 1. The config is parsed (and a
checkpoint to resume checked) before torch is imported, so ``--help`` and config errors come back
at once; then :func:`rollpacker.job.build` builds every rank's parts and
:func:`rollpacker.loops.train` runs them.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from rollpacker.config import Config, parse


def resolve_resume(config: Config) -> None:
    """``resume``: "auto" becomes the newest committed checkpoint under ``run_dir`` (or nothing);
    a checkpoint must match the policy."""
    from rollpacker import checkpoint

    if config.resume == "auto":
        newest = checkpoint.latest(Path(config.run_dir))
        config.resume = str(newest) if newest else ""
    if config.resume:
        checkpoint.check(Path(config.resume), config.policy)


def main(argv: list[str] | None = None) -> None:
    try:
        config = parse(argv)
        if config.resume:
            resolve_resume(config)
        config.check_world(int(os.environ.get("WORLD_SIZE", "1")))  # torchrun's; 1 for python -m rollpacker.run
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"rollpacker: config error: {e}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if config.resume and os.environ.get("RANK", "0") == "0":
        logging.getLogger("rollpacker").info("resuming from %s", config.resume)
    import torch.distributed as dist

    from rollpacker.job import build
    from rollpacker.loops import train

    job = build(config)
    train(job)
    job.close()
    if dist.is_initialized():  # vLLM's shutdown destroys it
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
