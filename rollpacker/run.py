"""Entry point: ``torchrun --nproc_per_node=N -m rollpacker.run [--preset NAME] [--section.field value …]``.

``python -m rollpacker.run`` is the same program at world size 1. The config is parsed (and a
checkpoint to resume checked) before torch is imported, so ``--help`` and config errors come back
at once; then :func:`rollpacker.job.build` builds every rank's parts and
:func:`rollpacker.loops.train` runs them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from rollpacker.config import Config, parse
from rollpacker.errors import UserError, fail


def resolve_resume(config: Config) -> None:
    """``resume``: "auto" becomes the newest committed checkpoint under ``run_dir`` (or nothing);
    a checkpoint must match the policy."""
    from rollpacker import checkpoint

    if config.resume == "auto":
        newest = checkpoint.latest(Path(config.run_dir))
        config.resume = str(newest) if newest else ""
    if config.resume:
        checkpoint.check(Path(config.resume), config.policy)


def check_model_dir(path: Path) -> None:
    """Refuse a model directory without a model config or a tokenizer, naming what is missing."""
    if not path.is_dir():
        raise UserError(f"model.path: {path} is not a directory: point it at a Hugging Face model directory "
                        "(config.json, safetensors weights, tokenizer), or leave it empty for the toy model")
    missing = [name for name in ("config.json",) if not (path / name).is_file()]
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        missing.append("a tokenizer (tokenizer.json or tokenizer_config.json)")
    if missing:
        raise UserError(f"model.path: {path} has no {' and no '.join(missing)}: it is not a Hugging Face model "
                        "directory (save one with save_pretrained, or leave model.path empty for the toy model)")


def main(argv: list[str] | None = None) -> None:
    try:
        config = parse(argv)
        if config.resume:
            resolve_resume(config)
        config.check_world(int(os.environ.get("WORLD_SIZE", "1")))  # torchrun's; 1 for python -m rollpacker.run
        if config.model.path:
            check_model_dir(Path(config.model.path))
        if config.env.enabled:  # the round runs one request per response until the episode runner lands in it
            raise UserError("env.factory / env.tools: the training loop does not run episodes yet (rollpacker.env "
                            "has the environments, workers and trainer mask; the round's episode runner is next), "
                            "so this run would ignore the environment: leave env unset for now")
    except (ValueError, FileNotFoundError, UserError) as e:  # the same on every rank: the first to claim it says it
        fail(e, prefix="rollpacker: config error: ")  # (rank 0 alone raced the others' exit: torchrun killed it)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if config.resume and os.environ.get("RANK", "0") == "0":
        logging.getLogger("rollpacker").info("resuming from %s", config.resume)
    import torch.distributed as dist

    from rollpacker.job import build
    from rollpacker.loops import train

    job = None
    try:
        job = build(config)
        train(job)
    except UserError as e:  # bad data, a failing reward function, an unusable checkpoint: said once
        if job is not None and job.controller is not None:
            job.controller.close()  # the reward workers stopped
        fail(e)
    job.close()
    if dist.is_initialized():  # vLLM's shutdown destroys it
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
