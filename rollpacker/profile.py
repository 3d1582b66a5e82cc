"""``torchrun --nproc_per_node=N -m rollpacker.profile [run flags]``: the planner's offline profile.

It takes ``rollpacker.run``'s flags and writes the profile the parallelism planner reads
(:mod:`rollpacker.plan.profile`: what it measures, where it is cached, when it is valid).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from rollpacker.config import as_flags, parse
from rollpacker.errors import UserError, fail
from rollpacker.plan.profile import cache_path, device_name, measure, profile_key, save, say_noisy, summary


def main(argv: list[str] | None = None) -> None:
    try:
        config = parse(argv)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"rollpacker.profile: config error: {e}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from rollpacker.dist import build_meshes, exit_process
    from rollpacker.job import join
    from rollpacker.model import engine_dtype
    from rollpacker.run import check_model_dir

    try:
        if not config.model.shipped:
            check_model_dir(Path(config.model.path))
        model_dir, _ = join(config)  # the job's device, groups and NCCL settings: what the profile is of
    except UserError as e:  # a model or engine setting the job refuses: said as the job says it
        fail(as_flags(str(e)), prefix="rollpacker.profile: config error: ")
    meshes = build_meshes(1, 0)
    dtype = engine_dtype(config.model.dtype, meshes.device)
    key = profile_key(config, model_dir, device_name(meshes.device), meshes.world_size, dtype)
    rank = meshes.rank  # a profiled vLLM engine's shutdown destroys the process group
    try:
        profile = measure(config, meshes, model_dir, dtype, key)
    except UserError as e:  # settings it cannot profile: said once
        fail(as_flags(str(e)), prefix="rollpacker.profile: config error: ")
    if rank == 0:
        path = Path(config.plan.profile) if config.plan.profile else cache_path(config, key)
        save(profile, path)
        print(summary(profile))
        print(f"wrote {path}")
        say_noisy(profile)
    exit_process(0)


if __name__ == "__main__":
    main()
