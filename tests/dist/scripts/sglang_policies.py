"""Run on 2 gloo ranks by tests/dist/rollout/test_sglang_run.py: the toy job on SGLang under each policy
given, one job after another in this one torchrun launch. Each job is built and trained by the
code ``rollpacker.run`` runs (:func:`rollpacker.job.build`, :func:`rollpacker.loops.train`); only
the engines are shared: each rank's SGLang engine starts once (tens of seconds on CPU) and every
job's trainer pushes its initial weights into it before the job starts. one_step_off goes first
(its rollout rank has no trainer: the engine it gets must hold the initial weights already).
Args: the run directory root, then a JSON list of [name, flags]."""

import json
import logging
import sys
from pathlib import Path


def main(root: Path, runs: list[tuple[str, list[str]]]) -> None:
    # imported here, not above: each job's reward workers are spawned, and spawn imports this file in each of them
    import torch.distributed as dist

    import rollpacker.job
    from rollpacker.config import parse
    from rollpacker.dist import exit_process
    from rollpacker.loops import train

    build_engine = rollpacker.job.build_engine
    engines: dict[str, object] = {}

    def shared_engine(config, model_path, device, dtype, tp_mesh=None, plan_bytes=0.0):
        """This rank's one engine, built by the job's first call."""
        if "engine" not in engines:
            engines["engine"] = build_engine(config, model_path, device, dtype, tp_mesh, plan_bytes)
        return engines["engine"]

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rollpacker.job.build_engine = shared_engine
    for name, flags in runs:
        job = rollpacker.job.build(parse([*flags, "--run-dir", str(root / name)]))
        if job.engine is not None and job.trainer is not None:
            job.engine.resume_memory()  # a freed (stream) or pipe training rank may end its last job released
            job.engine.update_weights(job.trainer.model.named_parameters())
        train(job)
        print(f"{name} done on rank {dist.get_rank()}", flush=True)
    if "engine" in engines:
        engines["engine"].shutdown()
    exit_process(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
