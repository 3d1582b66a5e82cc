"""``python -m rollpacker.export CHECKPOINT [--out DIR] [-- the run's flags]``: a checkpoint's policy as
a Hugging Face model, after the run.

A run writes its policy as a Hugging Face model at its end (``run_dir/hf``) and, with
``checkpoint.export_hf_each``, in each checkpoint. This writes it for any committed checkpoint, as
verl's model merger does for its own: one process on CPU builds the policy as the run did (the
checkpoint's ``export_flags``: ``model.path``, ``model.impl``, ``train.lora.*``; flags after ``--`` change
them, e.g. a model directory moved since), loads the checkpoint's
trained weights, whatever world size wrote them (DCP reshards), and exports them as the run's end
does: weights in the dtype of the model's ``config.json``, config and tokenizer; a PEFT adapter
directory for a LoRA run.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

from rollpacker.checkpoint import WRITE_ERRORS
from rollpacker.config import as_flags, parse
from rollpacker.errors import UserError, fail
from rollpacker.jobflags import split_run_args


@dataclass
class Args:
    """Write a checkpoint's policy as a Hugging Face model."""

    checkpoint: tyro.conf.Positional[Path]
    """A committed checkpoint directory (run_dir/checkpoints/step_N), or a run's directory: its newest."""
    out: Path | None = None
    """Where to write it (default: CHECKPOINT/hf, where checkpoint.export_hf_each puts it)."""


def export(checkpoint_dir: Path, out: Path, run_argv: list[str]) -> Path:
    """Collective on a one-rank group of this process: the policy of ``checkpoint_dir``, built as the
    run of ``run_argv`` built it, written to ``out``."""
    from rollpacker import checkpoint
    from rollpacker.dist import build_meshes
    from rollpacker.job import Job, build_trainer, join
    from rollpacker.topology import Topology

    if (checkpoint_dir / "checkpoints").is_dir():  # a run's directory: its newest whole checkpoint
        checkpoint_dir = checkpoint.newest_whole(checkpoint_dir) or checkpoint_dir
    checkpoint.check(checkpoint_dir, any_world=True)  # before the policy is built
    saved = checkpoint.train_state(checkpoint_dir).get("export_flags", [])  # the run's; flags given go after
    config = parse([*saved, *run_argv, "--dist.device", "cpu"])
    config.train.kl_coef, config.train.teacher.path = 0.0, ""  # the policy alone: no KL reference, no teacher
    path, impl = join(config)
    meshes = build_meshes(topology=Topology(1))
    trainer = build_trainer(config, impl, meshes)
    checkpoint.load(checkpoint_dir, trainer, weights_only=True)
    Job(config=config, meshes=meshes, model_dir=path, engine=None, trainer=trainer).export(out)
    return out


def main(argv: list[str] | None = None) -> None:
    own, run_argv = split_run_args(sys.argv[1:] if argv is None else argv)
    args = tyro.cli(Args, args=own, prog="python -m rollpacker.export")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = args.out or args.checkpoint / "hf"
    try:
        export(args.checkpoint, out, run_argv)
    except (ValueError, FileNotFoundError, UserError) as e:  # a checkpoint's errors are worded for a resume
        fail(as_flags(str(e).replace("resume: ", "", 1)), prefix="rollpacker: export: ")
    except WRITE_ERRORS as e:
        fail(f"writing {out} failed ({str(e).splitlines()[0]}): free disk space or fix the permissions there, then "
             "run this again", prefix="rollpacker: export: ")


if __name__ == "__main__":
    main()
