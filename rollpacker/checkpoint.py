"""Checkpoints that resume exactly: model and optimizer shards (torch.distributed.checkpoint), the
step, the LR schedule, the adaptive KL coefficient, a moving KL reference, PPO's critic (its weights, optimizer
and LR schedule), the scheduling policy's state
(sampler position, sample ledger) and the reward scheduler's (adaptive-timeout anchors).

The model's frozen parameters are not saved (:func:`trained_state`): with LoRA a checkpoint holds the
adapters and their optimizer state; the base comes from ``model.path`` again at resume, and must be the
base the adapters were trained on (each frozen parameter's norm is saved to check it: :func:`check_base`).

Layout: ``RUN_DIR/checkpoints/step_N/`` holds DCP's shard files, ``train_state.json`` and, written
last by rank 0 after every rank finished, the ``COMMITTED`` marker. A directory without the
marker is an interrupted save: resuming from it is refused, and ``latest`` skips it.

A committed checkpoint can still be damaged later (a truncated copy, a disk error, a file deleted
by hand). ``--resume auto`` (:func:`newest_whole`) checks that every file the newest one needs is
there and readable (:func:`verify`: ``train_state.json`` parses, DCP's ``.metadata`` loads, each
shard holds the bytes the metadata indexes) and falls back to the previous committed one, with
one warning naming the damaged file, so a ``torchrun --max-restarts`` job does not fail the same
way each restart. A checkpoint that cannot be read is a :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from rollpacker.errors import UserError

MARKER = "COMMITTED"
WRITE_ERRORS = (OSError, SafetensorError)
"""What a failed write raises: the system's error, or safetensors' own for the same (it is no OSError)."""
logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class CheckpointConfig:
    keep: int = 0
    """Keep the newest this many committed checkpoints, deleting older ones once a new one is committed (0 = all)."""
    export_hf: bool = True
    """At the run's end, also write the policy as a Hugging Face model (weights, config, tokenizer) in run_dir/hf."""
    export_hf_each: bool = False
    """Also write it in each checkpoint (checkpoints/step_N/hf), to evaluate or serve that step: the model's size
    again per checkpoint kept."""

    def __post_init__(self) -> None:
        if self.keep < 0:
            raise ValueError(f"checkpoint.keep must be >= 0 (0 keeps every checkpoint), got {self.keep}")


class CheckpointError(UserError):
    """A checkpoint that cannot be used (missing, interrupted, another run's) or a save that failed on some
    rank (disk full, quota, permission; then raised on every rank)."""


def save(path: Path, trainer, step: int, controller: dict[str, Any] | None, trainer_rank: int = 0,
         keep: int = 0, also: Callable[[], None] | None = None, control: Any = None) -> None:
    """Collective. ``controller`` (rank 0's plain-data state: the policy's sampler and ledger, the
    reward timeouts' anchors) matters on rank 0 only. ``trainer`` is None on ranks that do not
    train (one_step_off's rollout pool); ``trainer_rank``, the first rank that does, sends its LR
    schedule to rank 0. Saving over a committed checkpoint first takes its marker away, then its
    files, so a crash midway leaves it marked interrupted. Nothing is saved right after a step
    skipped for a non-finite update (``trainer.skipping``).

    A write that fails on any rank removes the partial directory and raises :class:`CheckpointError`
    on every rank, naming the ranks and the error; earlier checkpoints are untouched. ``also``
    (collective, on every rank) writes more into ``path`` once the state is saved, before the commit:
    its write failing fails the save the same way. Once the new one is committed, those of higher steps
    are not (a run that went back left them), and all but the newest ``keep`` committed checkpoints (0: all)
    are deleted. Its plain data goes over ``control`` (the gloo control plane; None: the default group)."""
    import torch.distributed as dist

    from rollpacker import watchdog
    from rollpacker.dist import broadcast

    watchdog.phase("checkpoint")
    rank = dist.get_rank()
    skipping = broadcast(trainer.skipping if trainer is not None else 0, control, src=trainer_rank)
    if skipping:  # these weights just produced a non-finite update: keep the previous checkpoint newest
        if rank == 0:
            logger.warning("checkpoint: not saving step %d: the last %d step(s) were skipped for a non-finite update; "
                           "the newest committed checkpoint stays %s", step, skipping, latest(path.parent.parent))
        return
    if rank == 0:  # an older save of this step (damaged, or a run redone): its marker first, then the rest
        (path / MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier(group=control)
    failed = _save_trainer(path, trainer) if trainer is not None else {}
    info = broadcast((trainer.scheduler.state_dict(), model_shapes(trainer), trainer.kl.value,
                      bool(trainer.config.ref_sync_steps),
                      trainer.critic_scheduler.state_dict() if trainer.critic is not None else None,
                      frozen_norms(trainer.model))
                     if trainer is not None else None, control, src=trainer_rank)
    failed = _everyones(failed, control)
    if also is not None and not failed:
        try:
            also()
        except WRITE_ERRORS as e:
            failed = {rank: _first_line(e)}
        failed = _everyones(failed, control)
    if rank == 0 and not failed:
        meta = {"step": step, "job": os.environ.get("TORCHELASTIC_RUN_ID"), "world_size": dist.get_world_size(),
                "scheduler": info[0], "model": info[1],
                "kl_coef": info[2], "reference": info[3], "critic": info[4], "frozen": info[5], **(controller or {})}
        try:
            (path / "train_state.json").write_text(json.dumps(meta))
            (path / MARKER).write_text("")
        except OSError as e:
            (path / MARKER).unlink(missing_ok=True)
            failed = {0: _first_line(e)}
    verdict = broadcast(failed, control)
    if verdict:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier(group=control)
        newest = latest(path.parent.parent)
        whys = "; ".join(f"rank {r}: {why}" for r, why in sorted(verdict.items()))
        there = next(p for p in path.parents if p.exists())  # a first save's checkpoints/ may be what failed
        free = shutil.disk_usage(there).free / 2**20
        raise CheckpointError(
            f"checkpoint: saving step {step} to {path} failed on rank(s) {sorted(verdict)} ({whys}; "
            f"{free:.1f} MiB free in {there} on rank {rank}). The partial "
            f"save was removed; the newest committed checkpoint is {newest or 'none'}, which --resume auto picks. "
            f"Free disk space or fix the permissions under {path.parent}, then resume")
    if rank == 0 and keep:
        prune(path.parent, keep)
    dist.barrier(group=control)


def leave_later(run_dir: Path, step: int) -> None:
    """Un-commit the checkpoints newer than ``step``, where a resume starts: they are of the run this one went
    back from (``--resume auto`` passed a damaged one, or a resume from an older one), whose records of those
    steps ``metrics.jsonl`` drops now. Else ``keep`` would delete this run's and ``--resume auto`` would go back
    to theirs, without their records. Their files go as this run saves their steps."""
    for later in committed(run_dir):
        if int(later.name.split("_")[1]) > step:
            (later / MARKER).unlink(missing_ok=True)
            logger.warning("checkpoint: %s is of the run this one went back from (it resumes at step %d): no longer "
                           "committed, so --resume auto and checkpoint.keep see this run's", later, step)


def _save_trainer(path: Path, trainer) -> dict[int, str]:
    """Collective over the trainer's group: its model and optimizer state into ``path`` (DCP); the
    ranks that failed (rank -> why)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {"model": trained_state(trainer.model), "optim": get_optimizer_state_dict(trainer.model, trainer.optimizer),
             **moved_reference(trainer), **critic_state(trainer)}
    try:
        dcp.save(state, checkpoint_id=str(path), process_group=trainer.group)
    except CheckpointException as e:  # every rank of the group gets every rank's failure
        to_global = (lambda r: dist.get_global_rank(trainer.group, r)) if trainer.group is not None else int
        return {to_global(r): _first_line(exc) for r, (exc, _) in e.failures.items()}
    except OSError as e:
        return {dist.get_rank(): _first_line(e)}
    return {}


def _everyones(failed: dict[int, str], group: Any = None) -> dict[int, str]:
    """Collective over ``group``: every rank's failures (rank -> why), on every rank."""
    import torch.distributed as dist

    failures = [None] * dist.get_world_size(group)
    dist.all_gather_object(failures, failed, group=group)
    return {r: why for f in failures for r, why in f.items()}


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def prune(checkpoints: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` committed checkpoints under ``checkpoints``, and the
    interrupted saves older than the newest committed one; returns what was deleted."""
    steps = sorted((int(p.name.split("_")[1]), p) for p in checkpoints.glob("step_*") if p.name[5:].isdigit())
    committed = [p for _, p in steps if (p / MARKER).exists()]
    newest = int(committed[-1].name.split("_")[1]) if committed else -1
    doomed = committed[:-keep] + [p for n, p in steps if not (p / MARKER).exists() and n < newest]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def committed(run_dir: Path) -> list[Path]:
    """The committed checkpoints under ``run_dir/checkpoints``, newest first."""
    done = [p for p in (run_dir / "checkpoints").glob("step_*") if p.name[5:].isdigit() and (p / MARKER).exists()]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]), reverse=True)


def latest(run_dir: Path) -> Path | None:
    """The newest committed checkpoint under ``run_dir/checkpoints``."""
    return next(iter(committed(run_dir)), None)


def train_state(path: Path) -> dict[str, Any]:
    """``path/train_state.json``; a :class:`CheckpointError` naming it if it cannot be read."""
    file = path / "train_state.json"
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"resume: {file} cannot be read ({_first_line(e)}); resume from an earlier "
                              "checkpoint (--resume auto falls back to one by itself)") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CheckpointError(f"resume: {file} holds no step: it is not a rollpacker train state")
    return meta


def verify(path: Path) -> str | None:
    """Why the committed checkpoint ``path`` cannot be resumed from, naming the damaged file, or None:
    its train state parses, DCP's ``.metadata`` loads, and each shard file it indexes is there with
    at least the bytes the index says it holds."""
    import torch.distributed.checkpoint as dcp

    try:
        train_state(path)
    except CheckpointError as e:
        return str(e).removeprefix("resume: ").split("; resume from")[0]
    try:
        index = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001  (a truncated or garbled pickle: whatever it raises says why)
        return f"{path / '.metadata'} cannot be read ({_first_line(e)})"
    sizes: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    for name, needed in sorted(sizes.items()):
        try:
            size = (path / name).stat().st_size
        except OSError as e:
            return f"{path / name} cannot be read ({_first_line(e)})"
        if size < needed:
            return f"{path / name} is truncated ({size} bytes; its index in .metadata needs {needed})"
    return None


def newest_whole(run_dir: Path, announce: bool = True) -> Path | None:
    """The newest committed checkpoint under ``run_dir`` that :func:`verify` finds whole (None: there is
    none). Each damaged one passed over is one warning (``announce``: printed here) naming the file. No
    whole one among several committed is a :class:`CheckpointError`."""
    found = committed(run_dir)
    damaged = []
    for path in found:
        why = verify(path)
        if why is None:
            return path
        damaged.append(why)
        if announce:
            print(f"rollpacker: warning: checkpoint {path} is damaged: {why}; resuming from the one before it",
                  file=sys.stderr, flush=True)
    if damaged:
        raise CheckpointError(f"resume: every committed checkpoint under {run_dir / 'checkpoints'} is damaged "
                              f"({'; '.join(damaged)}): move them away to start afresh")
    return None


def restarted() -> bool:
    """Whether torchrun restarted this node's ranks (it counts a restart only on the node whose rank failed)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"


def saved_by_this_job(path: Path) -> bool:
    """Whether checkpoint ``path`` was saved by this torchrun job (its TORCHELASTIC_RUN_ID; in an attempt before this
    one), not by an earlier job in the same run_dir. One whose train state cannot be read counts as this job's."""
    try:
        return train_state(path).get("job") == os.environ.get("TORCHELASTIC_RUN_ID")
    except CheckpointError:
        return True


def resolve_resume(config, restart: bool | None = None) -> None:
    """``config.resume``: "auto" becomes the newest committed checkpoint under ``run_dir`` that is whole
    (:func:`newest_whole`; or nothing); a checkpoint named must be whole too, and match the policy. None: a
    ``run_dir`` holding a committed checkpoint is refused, not overwritten.

    A torchrun restart (``restart``; by default :func:`restarted`) resumes as "auto" where the attempts before saved a
    committed checkpoint in ``run_dir`` (:func:`saved_by_this_job`): from PATH (or afresh) again would un-commit every
    step they saved. A PATH that is no committed checkpoint stays, so that its error (a typo) is said again, not
    trained past; so does a fresh start over an earlier job's run, refused again, not resumed."""
    named = config.resume not in ("", "auto")
    newest = latest(Path(config.run_dir))
    if (restarted() if restart is None else restart) and newest and saved_by_this_job(newest) and (
            not named or (Path(config.resume) / MARKER).exists()):
        config.resume = "auto"
    if not config.resume:
        if newest := latest(Path(config.run_dir)):
            raise UserError(f"run_dir {config.run_dir} holds a run (its newest checkpoint: {newest.name}), which a "
                            "fresh start would overwrite: resume it with --resume auto, or start afresh in a new "
                            "run_dir (or delete that one)")
        return
    if config.resume == "auto":
        newest = newest_whole(Path(config.run_dir), announce=os.environ.get("RANK", "0") == "0")
        config.resume = str(newest) if newest else ""
    elif (Path(config.resume) / MARKER).exists():  # else check() says what is missing
        if why := verify(Path(config.resume)):
            raise CheckpointError(f"resume: checkpoint {config.resume} is damaged: {why}; resume from an earlier "
                                  "one, or with --resume auto, which passes over damaged ones")
    if config.resume:
        check(Path(config.resume), config.policy)
        check_lora_alpha(Path(config.resume), config.train.lora.rank, config.train.lora.alpha)


def moved_reference(trainer) -> dict[str, Any]:
    """``{"reference": its state}`` when ``train.ref_sync_steps`` moves the KL reference (a checkpoint keeps it
    then), else nothing."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {"reference": get_model_state_dict(trainer.reference)} if trainer.config.ref_sync_steps else {}


def critic_state(trainer) -> dict[str, Any]:
    """``{"critic": its weights, "critic_optim": its optimizer's state}`` with PPO's critic, else nothing."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if trainer.critic is None:
        return {}
    return {"critic": get_model_state_dict(trainer.critic),
            "critic_optim": get_optimizer_state_dict(trainer.critic, trainer.critic_optimizer)}


def trained_state(model) -> dict[str, Any]:
    """The model's state dict without its frozen parameters, a tied alias of one included."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    return {k: v for k, v in state.items() if k not in frozen}


def model_shapes(trainer) -> dict[str, list[int]]:
    """The trained model's parameter names and (global) shapes: what a checkpoint must match."""
    return {name: list(p.shape) for name, p in trainer.model.named_parameters()}


def frozen_norms(model) -> dict[str, float]:
    """Each frozen parameter's L2 norm (float64): what a checkpoint keeps of the parameters it does not save.
    Collective over the model's ranks."""
    import torch
    from torch.distributed.tensor import DTensor

    norms = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            norm = torch.linalg.vector_norm(p.detach(), dtype=torch.float64)
            norms[name] = (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()
    return norms


def check_base(path: Path, saved: dict[str, float] | None, mine: dict[str, float]) -> None:
    """Refuse a checkpoint whose frozen parameters (not saved: with LoRA, the base model) had other values than
    this run's: its adapters were trained on another base, e.g. the instruct model of the same shapes."""
    differ = sorted(n for n in (saved or {}).keys() & mine.keys() if not math.isclose(saved[n], mine[n], rel_tol=1e-6))
    if differ:
        raise CheckpointError(
            f"resume: {path} was trained on another base model: {len(differ)} of the {len(saved)} frozen parameters "
            f"it does not save differ from model.path's ({', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''}). "
            "Resume with the model.path the run started with, or start afresh")


def check(path: Path, policy: str | None = None, world_size: int | None = None, any_world: bool = False) -> None:
    """Refuse a checkpoint that is missing, interrupted, or written by another scheduling policy or
    another world size (``world_size``: this run's, by default torchrun's ``WORLD_SIZE``; ``any_world``:
    whatever it was, for a read of the weights alone)."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"resume: {path} is a file: give its checkpoint's directory ({path.parent})")
    if not path.is_dir():
        raise CheckpointError(f"resume: checkpoint directory {path} does not exist")
    if not (path / MARKER).exists():
        run_dir = path.parent if path.name == "checkpoints" else path
        if (run_dir / "checkpoints").is_dir():  # TRL and verl take the run's directory
            newest = latest(run_dir)
            raise CheckpointError(f"resume: {path} is a run's directory, not a checkpoint: resume with --resume auto "
                                  f"--run-dir {run_dir} (its newest whole checkpoint), or --resume "
                                  f"{newest or run_dir / 'checkpoints' / 'step_N'}")
        raise CheckpointError(f"resume: {path} has no {MARKER} marker: the save was interrupted; pick an earlier one")
    meta = train_state(path)
    saved = (meta.get("policy") or {}).get("name")
    if policy and saved and saved != policy:
        raise CheckpointError(f"resume: {path} was written by policy {saved!r}, this run uses {policy!r}: "
                         f"resume with schedule:{saved}")
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    if not any_world and meta.get("world_size", world_size) != world_size:
        raise CheckpointError(f"resume: {path} was written by {meta['world_size']} ranks, this run has {world_size}: "
                         f"launch it with {meta['world_size']} ranks (torchrun --nproc_per_node), or start afresh")


def check_lora_alpha(path: Path, rank: int, alpha: float) -> None:
    """Refuse resuming LoRA adapters under another ``train.lora.alpha`` than they trained with (the run's
    ``export_flags`` say it): their update is scaled by alpha / rank, so the policy would change unseen."""
    flags = train_state(path).get("export_flags", [])
    if not rank or "--train.lora.alpha" not in flags:
        return
    saved = float(flags[flags.index("--train.lora.alpha") + 1])
    if saved != alpha:
        raise CheckpointError(f"resume: {path} trained its LoRA adapters with train.lora.alpha {saved:g}, this run "
                              f"sets {alpha:g}: an adapter's update is scaled by alpha / rank, so the policy would "
                              f"change at resume. Resume (or export) with train.lora.alpha {saved:g}")


def check_model(path: Path, saved: dict[str, list[int]] | None, mine: dict[str, list[int]]) -> None:
    """Refuse a checkpoint of another model, listing the parameters that differ (a few of each kind)."""
    if saved is None or saved == mine:
        return
    missing = [n for n in mine if n not in saved]
    extra = [n for n in saved if n not in mine]
    shapes = [f"{n} {saved[n]} vs {mine[n]}" for n in mine if n in saved and saved[n] != mine[n]]
    diffs = [f"{len(items)} {what}: {', '.join(items[:3])}{', ...' if len(items) > 3 else ''}"
             for what, items in (("not in the checkpoint", missing), ("only in the checkpoint", extra),
                                 ("with other shapes (checkpoint vs this model)", shapes)) if items]
    adapters = [any(".lora_A." in n for n in names) for names in (saved, mine)]
    bare = [{n.removeprefix("model."): shape for n, shape in names.items()} for names in (saved, mine)]
    if bare[0] == bare[1]:  # the one model, named by the other implementation (Hugging Face's: model.layers...)
        impl = "hf" if any(n.startswith("model.") for n in saved) else "native"
        raise CheckpointError(f"resume: {path} was written by this model under model.impl {impl}, which names its "
                              f"parameters otherwise: resume with --model.impl {impl}")
    fix = {(True, False): "it holds LoRA adapters: give the run's train.lora settings (train.lora.rank)",
           (False, True): "it holds no LoRA adapters: drop train.lora.rank",
           (True, True): "its LoRA adapters sit on other modules or have another rank: give the run's "
                         "train.lora.target_modules and train.lora.rank"}.get(
        tuple(adapters), "load it with the model the run started with (model.path)")
    raise CheckpointError(f"resume: {path} was written by a different model: parameters {'; '.join(diffs)}. "
                          f"{fix[0].upper()}{fix[1:]}; a resume may instead start afresh")


def load(path: Path, trainer, weights_only: bool = False) -> dict[str, Any]:
    """Collective over the trainer's ranks: restores the trainer in place (None on a rank that does
    not train); returns the saved train state (step, controller state). ``weights_only``: the trained
    weights alone, whatever world size wrote them (an export: DCP reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    check(path, any_world=weights_only)
    meta = train_state(path)
    if trainer is not None:
        check_model(path, meta.get("model"), model_shapes(trainer))
        check_base(path, meta.get("frozen"), frozen_norms(trainer.model))
        state = {"model": trained_state(trainer.model)}
        if not weights_only:
            state["optim"] = get_optimizer_state_dict(trainer.model, trainer.optimizer)
            if meta.get("reference"):  # saved moved: resumed as it was (not with ref_sync_steps off: the initial one)
                state |= moved_reference(trainer)
            if trainer.critic is not None and not meta.get("critic"):
                raise CheckpointError(f"resume: {path} holds no critic (it was written with train.advantage other "
                                      "than gae): resume with the advantage it was written with, or start afresh")
            state |= critic_state(trainer)
        try:
            dcp.load(state, checkpoint_id=str(path), process_group=trainer.group)
        except (Exception, CheckpointException) as e:  # noqa: BLE001  (damaged past what verify() sees: one line)
            raise CheckpointError(f"resume: {path} cannot be read ({_first_line(e)}): move it away and resume "
                                  "with --resume auto, which takes the checkpoint before it") from None
        set_model_state_dict(trainer.model, state["model"], options=StateDictOptions(strict=False))
        if "reference" in state:
            set_model_state_dict(trainer.reference, state["reference"])
        if "critic" in state:
            set_model_state_dict(trainer.critic, state["critic"])
            set_optimizer_state_dict(trainer.critic, trainer.critic_optimizer, state["critic_optim"])
            trainer.critic_scheduler.load_state_dict(meta["critic"])
        if not weights_only:
            set_optimizer_state_dict(trainer.model, trainer.optimizer, state["optim"])
            trainer.scheduler.load_state_dict(meta["scheduler"])
            if changed := trainer.take_settings():
                logger.info("resume: %s (this run's flags; the optimizer's moments and the schedule's step are the "
                            "checkpoint's)", ", ".join(changed))
            if trainer.kl.target and meta.get("kl_coef"):  # the adaptive coefficient goes on; a fixed one is the flag's
                trainer.kl.value = meta["kl_coef"]
    return meta
