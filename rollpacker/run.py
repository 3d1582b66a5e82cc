"""Entry point: ``torchrun --nproc_per_node=N -m rollpacker.run [--preset NAME] [--section.field value …]``.

``python -m rollpacker.run`` is the same program at world size 1; ``rollpacker`` (:mod:`rollpacker.launch`)
launches it under torchrun. The config is parsed (and a checkpoint to resume checked) before torch
is imported, so ``--help`` and config errors come back at once; then :func:`rollpacker.job.build`
builds every rank's parts and :func:`rollpacker.loops.train` runs them.

What the job prints of its own: a user's error once, as one line without a traceback
(:func:`rollpacker.errors.fail`), tyro's help or error box once; a stop signal
(:mod:`rollpacker.preempt`) ends the run after the step in progress, saved, with exit code 0.
"""

from __future__ import annotations

import faulthandler
import io
import json
import logging
import os
import re
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from rollpacker import preempt
from rollpacker.config import Config, PresetError, as_flags, parse
from rollpacker.errors import UserError, fail, report
from rollpacker.model.args import adapter_note, has_tokenizer, score_labels


def checkpoint_step(path: str) -> int:
    """The step checkpoint ``path`` resumes at."""
    from rollpacker import checkpoint

    return int(checkpoint.train_state(Path(path))["step"])


def check_model_dir(path: Path) -> None:
    """Refuse a model directory without a model config or a tokenizer, naming what is missing."""
    if not path.is_dir():
        raise UserError(f"model.path: {path} is not a directory: point it at a Hugging Face model directory "
                        "(config.json, safetensors weights, tokenizer), or leave it empty for the toy model")
    if note := adapter_note(path):
        raise UserError(f"model.path: {note}")
    missing = [name for name in ("config.json",) if not (path / name).is_file()]
    if not has_tokenizer(path):
        missing.append("tokenizer (tokenizer.json or tokenizer_config.json)")
    if missing:
        raise UserError(f"model.path: {path} has no {' and no '.join(missing)}: it is not a Hugging Face model "
                        "directory (save one with save_pretrained, or leave model.path empty for the toy model)")
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError:
        return  # reading it as the model's says what is wrong
    if score_labels(config):
        raise UserError(f"model.path: {path} is a sequence classifier (a reward model), which cannot generate: the "
                        "policy is a causal LM; to reward with it, --reward.funcs judge --reward.judge.model-path "
                        f"{path}")


THEIR_NAMES = {
    "beta": ("TRL", "--train.kl-coef"),
    "kl_loss_coef": ("verl", "--train.kl-coef"),
    "num_generations": ("TRL", "--rollout.group-size"),
    "n": ("verl", "--rollout.group-size"),
    "learning_rate": ("TRL", "--train.lr"),
    "max_completion_length": ("TRL", "--rollout.max-new-tokens"),
    "max_response_length": ("verl", "--rollout.max-new-tokens"),
    "epsilon": ("TRL", "--train.clip-low (and --train.clip-high)"),
    "epsilon_high": ("TRL", "--train.clip-high"),
    "clip_ratio": ("verl", "--train.clip-low and --train.clip-high"),
    "clip_ratio_low": ("verl", "--train.clip-low"),
    "clip_ratio_high": ("verl", "--train.clip-high"),
    "loss_type": ("TRL", "--train.aggregation, with --train.advantage (docs/algorithms.md)"),
    "loss_agg_mode": ("verl", "--train.aggregation"),
    "scale_rewards": ("TRL", "--train.advantage (grpo: the group's std, grpo_batch_std: the batch's, dr_grpo: none)"),
    "adv_estimator": ("verl", "--train.advantage"),
    "num_iterations": ("TRL", "--train.epochs"),
    "ppo_epochs": ("verl", "--train.epochs"),
    "ppo_mini_batch_size": ("verl", "--train.mini-batches (mini-batches a step)"),
    "entropy_coeff": ("verl", "--train.entropy-coef"),
    "max_steps": ("TRL", "--num-steps"),
    "total_training_steps": ("verl", "--num-steps"),
    "num_train_epochs": ("TRL", "--num-epochs"),
    "total_epochs": ("verl", "--num-epochs"),
    "train_batch_size": ("verl", "--rollout.num-prompts (prompts a step)"),
    "per_device_train_batch_size": ("TRL", "--rollout.num-prompts x --rollout.group-size (responses a step)"),
    "mask_truncated_completions": ("TRL", "--train.mask-truncated"),
    "max_grad_norm": ("TRL", "--train.grad-clip"),
    "lr_scheduler_type": ("TRL", "--train.lr-schedule"),
    "gradient_checkpointing": ("TRL", "--train.activation-checkpointing"),
    "model_name_or_path": ("TRL", "--model.path"),
    "dataset_name": ("TRL", "--data.path"),
    "train_files": ("verl", "--data.path"),
    "val_files": ("verl", "--data.eval-path"),
    "output_dir": ("TRL", "--run-dir"),
    "save_steps": ("TRL", "--checkpoint-every"),
    "eval_steps": ("TRL", "--eval-every"),
    "reward_funcs": ("TRL", "--reward.funcs"),
    "reward_weights": ("TRL", "--reward.weights"),
    "lora_r": ("TRL", "--train.lora.rank"),
    "lora_rank": ("verl", "--train.lora.rank"),
    "use_vllm": ("TRL", "--engine.kind vllm"),
}
"""Settings of TRL's GRPOConfig and verl's trainer config by their last name: whose, and rollpacker's flag. Said
when the parser does not know a flag of that name (it offered look-alikes: for --train.beta, AdamW's --train.betas)."""


def their_names(said: str) -> str:
    """Lines naming rollpacker's flag for each flag the parser's error ``said`` it did not know that is a TRL or verl
    setting's name, as a flag (``--beta``) or as verl's Hydra override (``data.train_files=...``)."""
    lines, hydra = [], False
    unknown = said.partition("Unrecognized options:")[2].split("---")[0]
    for flag in dict.fromkeys(re.findall(r"--[\w.-]+|[\w.]+(?==)", unknown)):
        override = not flag.startswith("--")  # Hydra's key=value
        hydra = hydra or override
        name = flag.rpartition(".")[2].lstrip("-").replace("-", "_")
        if name in THEIR_NAMES:
            whose, ours = THEIR_NAMES[name]
            lines.append(f"\nrollpacker: {flag}{'=...' if override else ''}: {whose}'s {name} is {ours}")
    if hydra:
        lines.append("\nrollpacker: a setting is a flag, --section.name VALUE, not Hydra's section.name=VALUE")
    return "".join(lines)


def parse_once(argv: list[str] | None) -> Config:
    """:func:`rollpacker.config.parse`, with what tyro prints said once for the job: its help by
    rank 0, its error box like any other config error (:func:`rollpacker.errors.fail`)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            return parse(argv)
    except SystemExit as e:
        if e.code not in (None, 0):  # tyro's error box as it drew it, or our own message (--preset)
            box = "\n".join(line.rstrip() for line in err.getvalue().strip("\n").splitlines())
            box += their_names(box)
            report(as_flags(box or str(e.code)), prefix="" if box else "rollpacker: config error: ")
            raise SystemExit(e.code if isinstance(e.code, int) else 2) from None  # no process group yet
        if os.environ.get("RANK", "0") == "0":
            sys.stdout.write(out.getvalue())
        raise SystemExit(0) from None


def flag_names(record: logging.LogRecord) -> bool:
    """A line of ours names settings as the flags the user typed, as an error does (``--env.on-error``)."""
    if record.name.startswith("rollpacker"):
        try:
            record.msg, record.args = as_flags(record.getMessage()), None
        except Exception:  # noqa: BLE001  (a bad format argument: the handler reports it, as without this filter)
            pass
    return True


def unexported(config: Config) -> str:
    """What a finished run's end left unexported (stopped while writing it), as the clause saying how to write it.
    What it exports is what its checkpoint's ``export_flags`` say (else this run's flags): the adapters, the merged
    model, or the whole model."""
    from rollpacker.checkpoint import MARKER, CheckpointError, train_state

    try:
        flags = train_state(Path(config.resume)).get("export_flags")
    except CheckpointError:
        flags = None
    lora, merged = ((config.train.lora.rank, config.train.lora.export_merged) if flags is None
                    else ("--train.lora.rank" in flags, "--train.lora.export-merged" in flags))
    hf = Path(config.run_dir) / "hf"
    files = [hf / "adapter_config.json", *([hf.with_name("hf_merged") / "config.json"] if merged else [])
             ] if lora else [hf / "config.json"]
    committed = (Path(config.resume) / MARKER).stat().st_mtime  # the run's end exports after its last save
    stale = [f.parent for f in files if not f.exists() or f.stat().st_mtime < committed]
    if not config.checkpoint.export_hf or not stale:
        return ""
    state = "an earlier step's" if stale[0].exists() else "missing"
    return (f"; its Hugging Face export {stale[0]} is {state} (stopped while writing it): python -m "
            f"rollpacker.export {config.resume} --out {hf}")


def main(argv: list[str] | None = None) -> None:
    faulthandler.enable()  # a crash in native code (SIGSEGV, SIGABRT) prints every thread's Python stack first
    preempt.install()  # a stop (Ctrl-C, SIGTERM) during setup stops before the first step
    try:
        config = parse_once(argv)
        from rollpacker.checkpoint import resolve_resume

        resolve_resume(config)
        config.check_world(int(os.environ.get("WORLD_SIZE", "1")))  # torchrun's; 1 for python -m rollpacker.run
        if not config.model.shipped:
            check_model_dir(Path(config.model.path))
    except PresetError as e:  # the same on every rank: the first to claim it says it
        fail(str(e), prefix="rollpacker: config error: ")
    except (ValueError, FileNotFoundError, UserError) as e:
        fail(as_flags(str(e)), prefix="rollpacker: config error: ")
    if config.resume and (done := checkpoint_step(config.resume)) >= config.num_steps:
        if os.environ.get("RANK", "0") == "0":  # a requeued job that had finished: no job to build
            print(f"rollpacker: {config.resume} is at step {done} of num_steps {config.num_steps}: nothing to train "
                  f"(raise --num-steps to go on){unexported(config)}", file=sys.stderr, flush=True)
        raise SystemExit(0)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(flag_names)
    if os.environ.get("RANK", "0") == "0":  # something at once: building takes minutes with a real model
        logger = logging.getLogger("rollpacker")
        logger.info("building the job on %s rank(s): model, engines, trainer, data", os.environ.get("WORLD_SIZE", "1"))
        if config.resume:
            logger.info("resuming from %s", config.resume)
    from rollpacker.dist import exit_process
    from rollpacker.job import build
    from rollpacker.loops import train

    job = None
    try:
        job = build(config)
        train(job)
    except UserError as e:  # bad data, a failing reward function, an unusable checkpoint: said once
        if job is not None and job.controller is not None:
            job.controller.close()  # the reward workers stopped
        fail(as_flags(str(e)))
    job.close()
    exit_process(0)


if __name__ == "__main__":
    main()
