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

logger = logging.getLogger("rollpacker")


@dataclass
class Args:
    """Write a checkpoint's policy as a Hugging Face model."""

    checkpoint: tyro.conf.Positional[Path]
    """A committed checkpoint directory (run_dir/checkpoints/step_N), or a run's directory: its newest."""
    out: Path | None = None
    """Where to write it (default: CHECKPOINT/hf, where checkpoint.export_hf_each puts it)."""


def export(checkpoint_dir: Path, out: Path | None, run_argv: list[str]) -> Path:
    """Collective on a one-rank group of this process: the policy of ``checkpoint_dir``, built as the
    run of ``run_argv`` built it, written to ``out`` (None: the checkpoint's ``hf``, of the one a run's directory
    resolves to); returns where."""
    from rollpacker import checkpoint
    from rollpacker.dist import build_meshes
    from rollpacker.job import Job, build_trainer, join
    from rollpacker.topology import Topology

    checkpoint_dir = whole_checkpoint(checkpoint_dir)
    out = (out or checkpoint_dir / "hf").resolve()  # a run's directory's hf is its end's export: not replaced unasked
    saved = checkpoint.train_state(checkpoint_dir).get("export_flags", [])  # the run's; flags given go after
    config = parse([*saved, *run_argv, "--dist.device", "cpu"])
    if not config.model.shipped:
        from rollpacker.run import check_model_dir

        try:
            check_model_dir(Path(config.model.path))
        except UserError as e:
            raise UserError(f"{e}. The checkpoint's run read it there: a model moved since is given after --, as "
                            "-- --model.path NEW") from None
    check_out(out, checkpoint_dir, lora=bool(config.train.lora.rank), model=config.model.path)
    checkpoint.check_lora_alpha(checkpoint_dir, config.train.lora.rank, config.train.lora.alpha)
    config.train.kl_coef, config.train.teacher.path = 0.0, ""  # the policy alone: no KL reference, no teacher
    path, impl = join(config)
    meshes = build_meshes(topology=Topology(1))
    trainer = build_trainer(config, impl, meshes)
    checkpoint.load(checkpoint_dir, trainer, weights_only=True)
    Job(config=config, meshes=meshes, model_dir=path, engine=None, trainer=trainer).export(out)
    return out


def whole_checkpoint(path: Path) -> Path:
    """The committed, undamaged checkpoint ``path`` names: itself, or a run's (or its ``checkpoints``) newest whole
    one; else a :class:`UserError` worded for this command (a checkpoint's own are for a resume)."""
    from rollpacker import checkpoint

    run_dir = path.parent if path.name == "checkpoints" else path
    if not (path / checkpoint.MARKER).exists() and (run_dir / "checkpoints").is_dir():
        newest = checkpoint.latest(run_dir)
        if newest is None:
            raise UserError(f"{run_dir} holds no committed checkpoint to export (its saves were interrupted)")
        path = checkpoint.newest_whole(run_dir, announce=False)  # every one damaged: its error names them
        if path != newest:
            logger.warning("export: %s is damaged (%s): exporting %s, the newest whole one", newest,
                           checkpoint.verify(newest), path)
    elif not (path / checkpoint.MARKER).exists():
        raise UserError(f"{path} is not a committed checkpoint (no {checkpoint.MARKER} marker): give a run's "
                        "directory, or one of its checkpoints/step_N")
    elif why := checkpoint.verify(path):  # newest_whole verified a run's already
        raise UserError(f"checkpoint {path} is damaged: {why}; export an earlier one")
    checkpoint.check(path, any_world=True)
    return path


def check_out(out: Path, checkpoint_dir: Path, lora: bool, model: str = "") -> None:
    """Refuse an ``out`` whose directory the export would replace whole (it, and a LoRA run's ``out``_merged,
    are written afresh) while it holds what is not an earlier export: a run's directory, the checkpoint, the run's
    ``model.path`` (a model directory holds a config.json, as an export does)."""
    out = out.resolve()
    for path in (out, *([out.with_name(out.name + "_merged")] if lora else [])):
        if path.exists() and not path.is_dir():
            raise UserError(f"--out {out}: {path} is a file, and the export writes a directory there; name a "
                            "directory (default: CHECKPOINT/hf)")
        for held, what in ((checkpoint_dir, "the checkpoint"), *([(Path(model), "model.path")] if model else [])):
            if held.resolve().is_relative_to(path):
                raise UserError(f"--out {out}: the export replaces {path} whole, and it holds {what} {held}; name a "
                                "directory of its own (default: CHECKPOINT/hf)")
        exported = any((path / name).is_file() for name in ("config.json", "adapter_config.json"))
        if path.is_dir() and any(path.iterdir()) and not exported:
            raise UserError(f"--out {out}: the export replaces {path} whole, and it holds files that are not an "
                            f"export's ({', '.join(sorted(p.name for p in path.iterdir())[:3])}, ...); name a new "
                            "directory, or an earlier export's")


def main(argv: list[str] | None = None) -> None:
    own, run_argv = split_run_args(sys.argv[1:] if argv is None else argv)
    args = tyro.cli(Args, args=own, prog="python -m rollpacker.export")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        export(args.checkpoint, args.out, run_argv)
    except (ValueError, FileNotFoundError, UserError) as e:  # a checkpoint's errors are worded for a resume
        fail(as_flags(str(e).replace("resume: ", "", 1)), prefix="rollpacker: export: ")
    except WRITE_ERRORS as e:
        fail(f"writing {args.out or 'CHECKPOINT/hf'} failed ({str(e).splitlines()[0]}): free disk space or fix the "
             "permissions there, then run this again", prefix="rollpacker: export: ")


if __name__ == "__main__":
    main()
