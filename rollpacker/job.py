"""The job: every rank's parts, built once.

Each rank holds the meshes, its slice of a rollout engine replica and of the FSDP2 trainer (one
of the two on one_step_off's disaggregated pools), the stream trainer when stream training or
RolloutPipe is on, and, on rank 0, the :class:`~rollpacker.controller.Controller`. :func:`build`
makes them (collective), restores a checkpoint, and, with the parallelism planner, rebuilds the
engines at its initial TP. A job also pushes the trainer's weights into the engines
(:meth:`Job.push_weights`, through a :mod:`rollpacker.rollout.weights` transport), switches
rollout TP (:meth:`Job.switch_tp`) and saves a checkpoint (:meth:`Job.save`). The loops in
:mod:`rollpacker.loops` run it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollpacker import checkpoint, watchdog
from rollpacker.config import Config
from rollpacker.controller import Controller
from rollpacker.data.dataset import lasting_text
from rollpacker.dist import Meshes, backend, build_meshes, init_distributed
from rollpacker.errors import UserError
from rollpacker.model import checkpoint_dtype, engine_dtype, lora, save_model
from rollpacker.model.args import has_tokenizer
from rollpacker.model.hf_decoder import HFDecoder, config_dtype, read_config, resolve_impl, save_hf
from rollpacker.model.parallelize import build_for_training
from rollpacker.plan.memory import Shape, check_fits, check_rollout_tp
from rollpacker.rollout import ENGINES, build_engine, resolve_kind
from rollpacker.rollout.engine import Engine, text_decoder
from rollpacker.rollout.weights import Broadcast, InProcess, WeightSync
from rollpacker.train.stream import StreamTrainer
from rollpacker.train.trainer import TAKEN, Trainer, compute_device

logger = logging.getLogger("rollpacker")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
"""Weight files of a model directory, which an export does not copy: its own are the trained policy's."""


@dataclass
class Job:
    config: Config
    meshes: Meshes
    model_dir: Path
    engine: Engine | None
    """This rank's slice of a rollout replica (``engine.kind``); None on one_step_off's training pool."""
    trainer: Trainer | None
    """This rank's shard of the trainer; None on one_step_off's rollout pool."""
    controller: Controller | None = None
    """Rank 0's parts; None elsewhere."""
    stream: StreamTrainer | None = None
    """The stream trainer (every rank), with stream.enabled or schedule.pipe."""
    weights: WeightSync = field(default_factory=InProcess)
    """How the trainer's weights reach the engines: in-process, or broadcast between one_step_off's pools."""
    start_step: int = 0
    saved: int = -1
    """The step of the last checkpoint this run saved (-1: none)."""

    @property
    def rank0(self) -> bool:
        return self.meshes.rank == 0

    def push_weights(self) -> None:
        """The trainer's current weights into the engines (collective), through :attr:`weights`."""
        self.weights.push(self.engine, self.trainer.model if self.trainer is not None else None)

    def switch_tp(self, tp: int) -> dict[str, float]:
        """Rebuild the rollout engines on TP-``tp`` sub-meshes, at a step boundary (collective), when
        ``tp`` is not the current TP: the old engine's memory is freed first; the new one is loaded from
        the trainer's live parameters (resharded in memory, not read from disk)."""
        switched = tp != self.meshes.rollout_tp.size()
        stats = {"plan/rollout_tp": tp, "plan/switched": float(switched)}
        if not switched:
            return stats
        self.engine.release_memory()
        self.engine = None
        gc.collect()
        if self.meshes.device.type == "cuda":
            torch.cuda.empty_cache()
        self.meshes.set_rollout_tp(tp)
        dtype = engine_dtype(self.config.model.dtype, self.meshes.device)
        self.engine = ENGINES[self.config.engine.kind].empty(self.trainer.model.args, self.config.engine,
                                                             self.meshes.device, dtype, self.meshes.rollout_tp)
        self.engine.decode = stop_decoder(self.config, self.model_dir)
        self.push_weights()
        if self.stream:
            self.stream.retarget(self.engine.kv_capacity_tokens)
        return stats

    def save(self, step: int, policy_state: dict[str, Any] | None = None) -> None:
        """Collective: the checkpoint of ``step``, with the policy's current state or ``policy_state`` (and
        the policy as a Hugging Face model in it, with ``checkpoint.export_hf_each``)."""
        path = Path(self.config.run_dir) / "checkpoints" / f"step_{step}"
        state = self.controller.state_dict(policy_state) if self.controller else None
        if state is not None:  # rank 0's, which writes train_state.json
            state["export_flags"], state["settings"] = export_flags(self.config), settings(self.config)
        also = (lambda: self.export(path / "hf")) if self.config.checkpoint.export_hf_each else None
        with watchdog.waiting("checkpoint", self.config.dist.checkpoint_timeout_s):
            checkpoint.save(path, self.trainer, step, state, trainer_rank=self.meshes.train_ranks[0],
                            keep=self.config.checkpoint.keep, also=also, control=self.meshes.control)
        self.saved = step

    def export(self, path: Path) -> None:
        """Collective over the training ranks: the policy as a Hugging Face directory (weights in the
        dtype of the model's ``config.json``, its config and tokenizer), to serve or evaluate. With
        LoRA, ``path`` is a PEFT adapter directory (with the tokenizer) for the base model, and with
        ``train.lora.export_merged`` the merged weights go to ``path`` + ``_merged`` as above."""
        if self.trainer is None:
            return
        with watchdog.waiting("export", self.config.dist.checkpoint_timeout_s):
            self._export(path, writer=self.meshes.rank == self.meshes.train_ranks[0])

    def _export(self, path: Path, writer: bool) -> None:
        """Each directory is written afresh beside ``path`` and then put in its place: what an earlier export
        left there (a full model's weights beside a LoRA adapter) would be loaded with it."""
        model, lora_cfg = self.trainer.model, self.config.train.lora
        merged = path.with_name(path.name + "_merged")
        if lora_cfg.rank:
            with self._fresh(path, writer) as fresh:
                lora.save_adapter(model, lora_cfg, fresh, self.model_dir, write=writer)
                self._finish(fresh, path, writer, "the LoRA adapters as a PEFT adapter directory")
            if not lora_cfg.export_merged:
                if writer:
                    shutil.rmtree(merged, ignore_errors=True)  # an earlier export's: not this run's policy
                return
            path = merged
        weights = lora.merged_weights(model)
        with self._fresh(path, writer) as fresh:
            if isinstance(model, HFDecoder):
                save_hf(model, fresh, write=writer, dtype=config_dtype(self.model_dir), weights=weights)
            else:
                save_model(model, fresh, write=writer, dtype=checkpoint_dtype(model.args), weights=weights)
            self._finish(fresh, path, writer, "the policy as a Hugging Face model")

    @staticmethod
    @contextlib.contextmanager
    def _fresh(path: Path, writer: bool) -> Iterator[Path]:
        """An empty directory beside ``path`` to export into (made by the writer), removed if the export fails
        (a disk that filled up kept the half-written weights)."""
        fresh = path.with_name(f".{path.name}.partial")
        if writer:
            shutil.rmtree(fresh, ignore_errors=True)
            fresh.mkdir(parents=True)
        try:
            yield fresh
        except BaseException:
            if writer:
                shutil.rmtree(fresh, ignore_errors=True)
            raise

    def _finish(self, fresh: Path, path: Path, writer: bool, what: str) -> None:
        """The tokenizer and the rest of the model directory that is neither weights nor their config into
        ``fresh``, which then replaces ``path``."""
        if not writer:
            return
        for file in self.model_dir.iterdir():
            weights = file.suffix in WEIGHT_SUFFIXES or file.name.endswith(".index.json")
            if file.is_file() and not weights and file.name != "config.json":
                shutil.copy2(file, fresh / file.name)
        shutil.rmtree(path, ignore_errors=True)
        fresh.rename(path)
        logger.info("%s: %s", what, path)

    def close(self) -> None:
        """The controller's workers stopped, then the engine shut down, last: vLLM's shutdown destroys the
        default process group."""
        if self.controller is not None:
            self.controller.close()
        if self.engine is not None:
            self.engine.shutdown()


def stop_decoder(config: Config, model_dir: Path):
    """The engines' token ids -> text for ``rollout.stop``; None without stop strings (no tokenizer loaded)."""
    return text_decoder(model_dir) if config.rollout.stop else None


def join(config: Config) -> tuple[Path, str]:
    """Join the job's process group as ``config`` asks (``dist.device``, gloo beside NCCL for offload, the
    engine's NCCL settings), its engine kind resolved for its model; the model's directory and its
    implementation (:func:`~rollpacker.model.hf_decoder.resolve_impl`)."""
    path = config.model.directory()
    impl = resolve_impl(config.model.impl, path)
    if impl == "hf":
        check_hf(config)
    device_type, _ = backend(config.dist.device)
    config.engine.kind = model_engine(impl, config.engine.kind, device_type, config.plan.enabled)
    check_engine(config, device_type)
    init_distributed(config.dist.device, cpu_collectives=config.train.offload, nccl_env=engine_nccl_env(config))
    return path, impl


def build(config: Config) -> Job:
    """Every rank's parts (collective)."""
    path, impl = join(config)
    for setting, other in (("train.teacher.path", config.train.teacher.path),
                           ("train.critic.path", config.train.critic.path)):
        if other:
            check_tokenizer(path, other, setting)
    world = torch.distributed.get_world_size()
    config.check_world(world)
    shape = Shape.from_hf(read_config(path))
    check_rollout_tp(config, shape, path)
    streaming = config.stream.enabled or config.pipe
    meshes = build_meshes(stream=streaming, topology=config.topology(world))
    watchdog.start(config.dist)  # collective timeouts, heartbeats: a timeout names the silent ranks
    check_same_resume(config, meshes.control)
    torch.manual_seed(config.seed)
    engine = trainer = None  # disaggregated pools (one_step_off): engines on the rollout pool, the trainer on the rest
    dtype = engine_dtype(config.model.dtype, meshes.device)
    plan_bytes = 0.0
    if meshes.device.type == "cuda":  # the memory plan: refuse a config that cannot fit (rollpacker.plan.memory)
        plan = check_fits(config, shape, world,
                          torch.cuda.get_device_properties(meshes.device).total_memory)
        logger.info("memory plan: peak %.1f GB per GPU (%s), headroom %.0f%%", plan.peak / 1e9,
                    plan.peak_phase.name, 100 * plan.headroom)
        plan_bytes = plan.engine_bytes
    if meshes.rank in meshes.rollout_ranks:
        engine = build_engine(config.engine, path, meshes.device, dtype, meshes.rollout_tp, plan_bytes)
        engine.decode = stop_decoder(config, path)
    elif ENGINES[config.engine.kind].needs_world_groups:  # the engines' start makes groups over the whole world
        ENGINES[config.engine.kind].join_world(path, config.engine, config.rollout.tp, dtype)
    if meshes.rank in meshes.train_ranks:
        trainer = build_trainer(config, impl, meshes)
    job = Job(config=config, meshes=meshes, model_dir=path, engine=engine, trainer=trainer)
    if meshes.disaggregated:  # one_step_off: the training pool broadcasts its weights to the rollout pool
        job.weights = Broadcast.connect(meshes, dtype, trainer.model if trainer else None, path)
    if streaming:
        job.stream = StreamTrainer(config.stream, trainer, meshes, max_new_tokens=config.rollout.max_new_tokens,
                                   kv_capacity_tokens=engine.kv_capacity_tokens, pipe=config.pipe)
    if job.rank0:
        job.controller = Controller.build(config, path, meshes, engine.max_model_len, engine.kv_capacity_tokens,
                                          drafting=not ENGINES[config.engine.kind].own_drafter, sink=job.stream)
    if config.plan.enabled:
        build_planner(job)
    if config.resume:
        with watchdog.waiting("checkpoint", config.dist.checkpoint_timeout_s):
            state = checkpoint.load(Path(config.resume), trainer)
        job.start_step = state["step"]
        if job.controller:
            say_changed(state.get("settings"), config)
            try:
                job.controller.load_state_dict(state)
            except ValueError as e:  # a dataset or policy setting the checkpoint's state does not fit
                raise checkpoint.CheckpointError(f"resume: {config.resume}: {e}") from None
        job.push_weights()  # the engines get the checkpoint's weights
    if job.controller:
        job.controller.metrics.start_at(job.start_step)  # each step once in metrics.jsonl
        if config.resume:  # the later checkpoints' records are gone: so are they, for --resume auto
            checkpoint.leave_later(Path(config.run_dir), job.start_step)
    return job


def check_same_resume(config: Config, group: torch.distributed.ProcessGroup) -> None:
    """Collective: every rank resumes from the checkpoint rank 0 does. A torchrun restart is one for every rank,
    though torchrun counts it only on the node that failed: the others' ranks resolve the resume again as a restart's.
    Each resolves ``--resume auto`` on its own filesystem view; a node's that lags (a network filesystem's cache)
    would load an older step's shards beside the newest's, or skip the load the others wait in."""
    seen: list[tuple[str, bool] | None] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(seen, (config.resume, checkpoint.restarted()), group=group)
    if any(restarted for _, restarted in seen):
        if not checkpoint.restarted():
            checkpoint.resolve_resume(config, restart=True)
            if torch.distributed.get_rank() == 0:  # it said the first attempt's resume as it started
                logger.info("torchrun restarted another node's ranks: resuming from %s", config.resume or "nothing")
        torch.distributed.all_gather_object(seen, (config.resume, True), group=group)
    if other := next((rank for rank, (path, _) in enumerate(seen) if path != seen[0][0]), None):
        raise UserError(f"resume: rank 0 resumes from {seen[0][0] or 'nothing (a fresh start)'}, rank {other} from "
                        f"{seen[other][0] or 'nothing (a fresh start)'}: the nodes do not see the same run_dir "
                        "(a network filesystem not yet showing every node the newest checkpoint); run again once "
                        "they do, or name the checkpoint with --resume PATH")


def export_flags(config: Config) -> list[str]:
    """The run's flags that build its policy as it trained (its model, and LoRA's settings): what
    ``rollpacker.export`` reads from a checkpoint, so that it exports the run's tokenizer and chat template."""
    model = config.model.path if config.model.shipped else str(Path(config.model.path).resolve())  # from anywhere
    lora, flags = config.train.lora, ["--model.path", model, "--model.impl", config.model.impl]
    if lora.rank:
        flags += ["--train.lora.rank", str(lora.rank), "--train.lora.alpha", str(lora.alpha),
                  "--train.lora.target-modules", *lora.target_modules,
                  f"--train.lora.{'' if lora.export_merged else 'no-'}export-merged"]
    return flags


def settings(config: Any, prefix: str = "") -> dict[str, Any]:
    """``config``'s settings flat, ``section.field`` -> value as JSON holds it: each checkpoint keeps the run's,
    so that a resume says which it changed."""
    flat = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        flat |= (settings(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value)
                 else {prefix + f.name: json.loads(json.dumps(value, default=lasting_text))})
    return flat


UNSAID = ("resume", "run_dir", *TAKEN)
"""Settings a resume changes unsaid: where it runs, and the optimizer's (``Trainer.take_settings`` says those as it
applies them); ``metrics.*`` neither (where it logs)."""
SHOWN_CHARS = 80
"""Of each value a resume says changed."""


def say_changed(saved: dict[str, Any] | None, config: Config) -> None:
    """Say once, as a resume starts, which settings differ from the checkpoint's run's: a resume under another
    preset or model (whose shapes match) went on silently with another task, chat template or rewards."""
    now = settings(config)
    changed = [f"{k}: {_shown(saved[k])} -> {_shown(now[k])}" for k in now
               if k in (saved or {}) and saved[k] != now[k] and k not in UNSAID and not k.startswith("metrics.")]
    if changed:
        logger.warning("resume: this run's settings differ from the checkpoint's: %s (they apply from here on: the "
                       "weights, the optimizer's moments and the data's position are the checkpoint's)",
                       ", ".join(changed))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def engine_nccl_env(config: Config) -> dict[str, str]:
    """The NCCL settings the engine's start would set in its own process (``EngineKind.nccl_env``), for
    every rank to export before its first communicator."""
    return ENGINES[config.engine.kind].nccl_env(config.rollout.tp)


def model_engine(impl: str, kind: str, device_type: str, planner: bool) -> str:
    """The engine kind for a model of ``impl``: a Hugging Face model rolls out on an engine that is
    not native-only (auto: SGLang or vLLM on GPU, vLLM on CPU)."""
    kind = resolve_kind(kind, device_type, planner and impl == "native", native=impl == "native")
    if impl != "native" and ENGINES[kind].native_only:
        others = " or ".join(k for k, e in ENGINES.items() if not e.native_only)
        raise UserError(f"model.impl=hf: TorchEngine runs rollpacker's native decoder only (Llama, Qwen2, Qwen3); "
                        f"use engine.kind {others}, or model.impl native if the model is one of those")
    return kind


def check_engine(config: Config, device_type: str) -> None:
    """Engine settings its resolved kind does not read, or cannot serve on ``device_type``: one message before
    any engine starts (each was silently unread, or a traceback at the first request)."""
    e, engine = config.engine, ENGINES[config.engine.kind]
    if e.memory_mb and not engine.memory_mb:
        raise UserError(f"engine.memory_mb={e.memory_mb} with {engine.title}: only TorchEngine (engine.kind torch) "
                        "sizes itself by it; leave it out")
    if engine.no_block_size and e.block_size != type(e).block_size:
        raise UserError(f"engine.block_size={e.block_size} with {engine.title}: {engine.no_block_size}; leave it out")
    sampled = [f"{name}={t}" for name, t, on in (("rollout.temperature", config.rollout.temperature, True),
                                                 ("eval.temperature", config.eval.temperature, config.eval_every))
               if on and t > 0]
    if engine.no_cpu_sampled_speculation and device_type == "cpu" and e.speculative != "off" and sampled:
        raise UserError(f"engine.speculative={e.speculative} with {engine.title} on CPU and {sampled[0]}: "
                        f"{engine.no_cpu_sampled_speculation}: set engine.speculative=off, or engine.kind=torch")


def check_hf(config: Config) -> None:
    """What a Hugging Face model (model.impl hf) does not run with, named with the fix."""
    if config.schedule.own_pools:
        raise UserError(f"model.impl=hf with schedule:{config.policy}: its rollout pool builds the native decoder "
                        "to receive the weights; use a policy without pools of its own, or model.impl native "
                        "(Llama, Qwen2, Qwen3)")
    if config.plan.enabled:
        raise UserError("model.impl=hf with plan.enabled: the parallelism planner profiles and rebuilds the native "
                        "decoder's engines; turn plan.enabled off, or use model.impl native (Llama, Qwen2, Qwen3)")


def build_trainer(config: Config, impl: str, meshes: Meshes) -> Trainer:
    """This rank's shard of the trainer: the policy (with its LoRA adapters), the KL reference (when
    train.kl_coef > 0, unless LoRA's adapters-off policy is the reference), distillation's teacher and
    PPO's critic (train.advantage gae), each built on the meta device and filled from the first training
    rank's host copy (collective over the pool)."""
    t = config.train
    kw = dict(src=meshes.train_ranks[0], group=meshes.train_group, device=compute_device(meshes.train))
    path = str(config.model.directory())
    policy = build_for_training(path, impl, meshes.train, t, **kw)
    reference = build_for_training(path, impl, meshes.train, t, reference=True, **kw) \
        if t.kl_coef and not t.lora.rank else None
    teacher = build_for_training(t.teacher.path, resolve_impl("auto", t.teacher.path), meshes.train, t,
                                 reference=True, **kw) if t.teacher.path else None
    critic_impl = resolve_impl("auto", t.critic.path) if t.critic.path else impl
    critic = build_for_training(t.critic.path or path, critic_impl, meshes.train, t, critic=True,
                                **kw) if t.advantage == "gae" else None
    return Trainer(policy, t, meshes.train, temperature=config.rollout.temperature or 1.0, reference=reference,
                   teacher=teacher, critic=critic, group=meshes.train_group, num_steps=config.num_steps)


def check_tokenizer(student: Path, other: str, setting: str) -> None:
    """Refuse a teacher (train.teacher.path) or a critic (train.critic.path) whose vocabulary is not the
    student's: it would score other tokens than the ones sampled. Its EOS, BOS and pad may differ (a base
    model's EOS beside an instruct model's): it scores the policy's ids, never ends or pads a sequence."""
    from transformers import AutoTokenizer

    where = Path(other)
    if not (where / "config.json").is_file():
        raise UserError(f"{setting}: {where} has no config.json: point it at a Hugging Face model directory")
    if not has_tokenizer(where):
        raise UserError(f"{setting}: {where} has no tokenizer (tokenizer.json or tokenizer_config.json), so its "
                        "vocabulary cannot be checked against model.path's: save the model's tokenizer beside it")
    a, b = (AutoTokenizer.from_pretrained(p).get_vocab() for p in (student, where))
    differ = sorted({t for t in a.keys() | b.keys() if a.get(t) != b.get(t)}, key=lambda t: a.get(t, b.get(t)))
    if differ:
        raise UserError(f"{setting}: {where}'s tokenizer is not model.path's ({student}): "
                        f"{len(differ)} token(s) differ (e.g. {differ[:3]}). It scores the policy's sampled "
                        "tokens, so both must share one vocabulary: pick a model of the same family")
    rows = [vocab_size(p) for p in (student, where)]
    if None not in rows and rows[1] < rows[0]:  # the same tokens, fewer embedding rows (Qwen2.5 0.5B against 7B)
        raise UserError(f"{setting}: {where} has {rows[1]} token embeddings (config.json vocab_size), model.path "
                        f"{rows[0]}: it cannot read every id the policy may sample; pick a model with at least "
                        f"{rows[0]}")


def vocab_size(model_dir: Path) -> int | None:
    """A model directory's ``vocab_size`` (its text model's, in a multimodal config.json), or None."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def build_planner(job: Job) -> None:
    """The profile (measured now if none is cached for this setup), the planner on rank 0, and the
    engines rebuilt at its initial TP (collective)."""
    from rollpacker.plan.profile import obtain

    cfg, meshes = job.config, job.meshes
    profile = obtain(cfg, meshes, job.model_dir, engine_dtype(cfg.model.dtype, meshes.device))
    if job.controller:
        job.controller.build_planner(profile, meshes.world_size, job.trainer.model.args.num_kv_heads)
    job.switch_tp(meshes.broadcast(job.controller.planner.initial if job.controller else None))
