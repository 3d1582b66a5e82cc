"""The stages of :mod:`rollpacker.gpu_check`, one per process group: ``python -m rollpacker.gpu_check.stages NAME
--device cuda|cpu --out DIR --work DIR --limit-s S --logprobs-impl triton|torch``.

Contract: a stage prints its result as ``GPU_CHECK_RESULT {json}`` each time it measures something (the whole
result so far, so the driver keeps the last line even when a later measurement overruns); the last line has
``ok``. It writes only small files to ``--out`` and models and checkpoints to ``--work``, and destroys its
process group before it exits.

The same code runs on both devices; :data:`SIZES` holds what differs (the GPU sizes the issue names, toy sizes
on CPU). What a stage asserts sets ``ok``; everything else it measures is reported for docs/results.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rollpacker.gpu_check import RESULT, STAGES

GB = 1e9
QWEN7B = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
              num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
              rope_theta=1e6, tie_word_embeddings=False)
"""Qwen2.5-7B's shape (random weights, built in memory: nothing is downloaded)."""
SIZES = {
    "cuda": dict(
        toy_steps=4, toy_args=["--eval-every", "2", "--checkpoint-every", "2", "--data.num-eval-prompts", "64"],
        train_model=dict(model_type="qwen2", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                         max_position_embeddings=32768, tie_word_embeddings=False),
        train_lengths=[4096] * 4, offload_layers=4, offload_lengths=[2048] * 4,
        kernel=dict(hidden=3584, vocab=152064, values_tokens=1024, tokens=(8192, 16384)),
        engine=dict(num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=4, intermediate_size=2816,
                    prompts=32, new=64, kv_mb=2048, small_kv_mb=16, rows=64, context=990),
        spec=dict(model=QWEN7B, kv_mb=8192, rows=32, drafts=8, prompt=512, steps=3),
        judge=dict(vocab_size=1024, hidden_size=2048, intermediate_size=8192, num_hidden_layers=6, seqs=8, length=1024),
        episodes=dict(),
    ),
    "cpu": dict(
        toy_steps=2, toy_args=["--eval-every", "2", "--checkpoint-every", "1", "--data.num-eval-prompts", "4",
                               "--data.num-toy-prompts", "16", "--rollout.num-prompts", "2", "--rollout.group-size",
                               "2", "--rollout.max-new-tokens", "24"],
        train_model=dict(model_type="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=False),
        train_lengths=[64] * 2, offload_layers=2, offload_lengths=[32] * 2,
        kernel=dict(hidden=64, vocab=512, values_tokens=64, tokens=(128,)),
        engine=dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256,
                    prompts=6, new=12, kv_mb=4, small_kv_mb=0.1, rows=6, context=60),
        spec=dict(model=None, kv_mb=4, rows=4, drafts=2, prompt=32, steps=2),
        judge=dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, seqs=2, length=64),
        episodes=dict(rows=8, env_workers=8),
    ),
}


PUSH_BAR = 2.5
"""(b)'s push passes when its mean |log-prob| gap to the fp32 recompute is at most this many times the gap of a
recompute in the engine's dtype, + 1e-4. Measured on CPU with a bf16 TorchEngine, 16 tokens (mean gaps): the
1.34B random model: a correct push 0.022, the recompute in bf16 0.017, the last layer's gate and up swapped
0.108, weights through fp8 0.21, two layers' down projections swapped 0.43; the toy model (three seeds): 0.0011,
0.0013-0.0015, 0.010-0.011 (the same swap), 0.006-0.014 (fp8)."""


@dataclass
class StageRun:
    """One stage's context and its result so far."""

    device: str
    out: Path
    """Small results only (logs, metrics)."""
    work: Path
    """Models and checkpoints."""
    size: dict
    deadline: float
    """``time.perf_counter()`` by which the stage must have printed its last measurement."""
    logprobs_impl: str = "triton"
    """The trainer's head: torch where Triton cannot compile (the preflight says)."""
    result: dict = field(default_factory=dict)

    def report(self, **measured) -> None:
        """Add ``measured`` to the result and print the whole of it: a stage killed later keeps it."""
        self.result.update(measured)
        print(RESULT + json.dumps(self.result, default=str), flush=True)

    def left_s(self) -> float:
        return self.deadline - time.perf_counter()


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    synchronize(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def gb(n: float | None) -> float | None:
    """GB to four significant digits (toy sizes are megabytes)."""
    return None if n is None else float(f"{n / GB:.4g}")


def memory(device: str) -> dict[str, float | None]:
    """The CUDA allocator's peaks since the last reset, allocated and reserved (fragmentation and the cache),
    and the device's free memory now (the CUDA context and NCCL included); None on CPU (``bench memory``
    measures CPU peaks)."""
    if device != "cuda":
        return {"peak_allocated_gb": None, "peak_reserved_gb": None, "free_gb": None}
    return {"peak_allocated_gb": gb(torch.cuda.max_memory_allocated()),
            "peak_reserved_gb": gb(torch.cuda.max_memory_reserved()), "free_gb": gb(torch.cuda.mem_get_info()[0])}


def once_ms(fn, device: str) -> float:
    """``fn()``'s synchronized wall time in ms."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return 1e3 * (time.perf_counter() - start)


def timed_ms(fn, device: str, reps: int = 3) -> float:
    """Median ms of ``fn()`` after one warm-up (CUDA: synchronized wall time)."""
    fn()
    return statistics.median(once_ms(fn, device) for _ in range(reps))


# ---- (a) the default job ------------------------------------------------------------------------


def stage_toy(run: StageRun) -> bool:
    """The default job (``auto``: TorchEngine here) for a few steps with checkpoints and evaluation, its
    Hugging Face export, then ``--resume auto`` for two more steps from its last checkpoint. Its run folder
    is in the work folder; its metrics are copied to ``OUT/toy_metrics.jsonl``, its output is this log."""
    run_dir, steps, size = run.work / "toy", run.size["toy_steps"], run.size
    shutil.rmtree(run_dir, ignore_errors=True)
    flags = [*size["toy_args"], "--metrics.wandb-mode", "disabled", "--metrics.no-live", "--run-dir", str(run_dir),
             "--train.logprobs-impl", "auto" if run.logprobs_impl == "triton" else run.logprobs_impl]
    job = [sys.executable, "-m", "rollpacker.run"]
    times, before = [], []

    def trained_before_resume() -> list[str]:  # the first run's records of its steps, as written
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [line for line in lines if json.loads(line)["step"] < steps]

    for more in ([], ["--resume", "auto"]):
        if more:
            before = trained_before_resume()
        start = time.perf_counter()
        rc = subprocess.run([*job, "--num-steps", str(steps + (2 if more else 0)), *more, *flags]).returncode
        times.append(round(time.perf_counter() - start, 1))
        if (run_dir / "metrics.jsonl").is_file():
            shutil.copyfile(run_dir / "metrics.jsonl", run.out / "toy_metrics.jsonl")
        run.report(run_s=times)
        if rc:
            run.report(error=f"rollpacker.run {' '.join(more) or '(first run)'} exited {rc}: its output is above")
            return False
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = sorted({r["step"] for r in rows if "train/loss" in r})
    export = sorted(p.name for p in (run_dir / "hf").iterdir())
    diff = [r["train/rollout_logprob_diff"] for r in rows if "train/rollout_logprob_diff" in r]
    resumed = before == trained_before_resume()  # a run that started over would rewrite them (new timings)
    run.report(trained_steps=trained, resumed=resumed,
               step_s=[round(r["time/step"], 2) for r in rows if "time/step" in r],
               hf_export=export, engine_trainer_logprob_diff=[round(d, 5) for d in diff],
               eval={k: round(v, 4) for r in rows for k, v in r.items() if k.startswith("eval/")})
    return resumed and trained == list(range(steps + 2)) and "config.json" in export and any(
        n.endswith(".safetensors") for n in export)


# ---- (b) and (c) the trainer ---------------------------------------------------------------------


def samples(lengths: list[int], vocab: int, seed: int = 0) -> list:
    """Half prompt, half response each; groups of two."""
    from rollpacker.train.trainer import Sample

    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(2, vocab, (n,), generator=g).tolist()

    return [Sample(ids(n // 2), ids(n - n // 2), float(i % 2), [-1.0] * (n - n // 2), group=i // 2)
            for i, n in enumerate(lengths)]


def build_trainer(device: str, model_cfg: dict, offload: bool = False, **train_kw):
    """(trainer, meshes) at world size 1 on ``device``: the model built on meta, then on the device (or, with
    ``offload``, FSDP2's host shards), weights initialized there."""
    from rollpacker.dist import build_meshes, init_distributed
    from rollpacker.model import ModelArgs, Transformer
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Trainer

    init_distributed(device if device == "cpu" else "auto", cpu_collectives=offload)
    meshes = build_meshes(1, 0)
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_hf(model_cfg))
    model.to_empty(device="cpu" if offload else meshes.device)
    model.init_weights()
    cfg = TrainConfig(lr=1e-5, warmup_steps=0, offload=offload, **train_kw)
    return Trainer(model, cfg, meshes.train, num_steps=2), meshes


def measured_step(trainer, lengths: list[int], vocab: int, device: str) -> dict:
    """A small step (AdamW's state is created), then the measured one: its seconds and memory."""
    from rollpacker.train.losses import normalizer

    for batch, measure in ((samples([16, 16], vocab, seed=1), False), (samples(lengths, vocab), True)):
        total = normalizer(trainer.config.aggregation, [len(s.response_ids) for s in batch], max(lengths))
        if measure:
            reset_peak(device)
        start = time.perf_counter()
        stats = trainer.step(batch, total)
        synchronize(device)
        if any(v != v for v in stats.values()):
            raise RuntimeError(f"a NaN in the step's metrics: {stats}")
    return {"step_s": round(time.perf_counter() - start, 3), **memory(device)}


def planned_train_peak(device: str, model_cfg: dict, lengths: list[int], checkpointing: str, head: str) -> dict:
    from rollpacker.plan.memory import Shape, TrainSetup, train_phases

    cuda = device == "cuda"
    setup = TrainSetup(shard_size=1, seq_lens=tuple(lengths), response_tokens=sum(lengths) // 2,
                       compute_bytes=2 if cuda else 4, checkpointing=checkpointing, head=head, foreach=cuda,
                       micro_batches=1, gloo=not cuda)
    peak = max(train_phases(Shape.from_hf(model_cfg), setup), key=lambda p: p.total)
    return {"plan_gb": gb(peak.total), "plan_phase": peak.name}


def recomputed_logprobs(weights, model_cfg: dict, dtype: torch.dtype, compute: torch.dtype, prompt: list[int],
                        tokens: list[int], device: str) -> torch.Tensor:
    """``tokens``' log-probs after ``prompt`` [len(tokens)], recomputed in ``compute`` (TF32 off) by our
    Transformer from ``weights`` (``(name, tensor)`` pairs, the trainer's) rounded to ``dtype``."""
    from rollpacker.model import CausalAttention, ModelArgs, empty_model

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    ref = empty_model(ModelArgs.from_hf(model_cfg), device, compute)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, tensor in weights:
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            params[name.removeprefix("model.")].copy_(tensor.to(dtype))
        ids = torch.tensor(prompt + tokens, device=device)
        hidden = ref(ids, torch.arange(len(ids), device=device), CausalAttention([len(ids)], device))
        logprobs = torch.log_softmax(ref.logits(hidden[len(prompt) - 1:-1]), -1)
    return logprobs.gather(1, torch.tensor(tokens, device=device)[:, None]).squeeze(1).cpu()


def compare_push(engine, weights, model_cfg: dict, device: str) -> dict:
    """The engine's greedy log-probs after a push against an fp32 recompute from ``weights()`` (the pushed
    pairs) rounded to the engine's dtype; within the bar when the mean gap is at most :data:`PUSH_BAR` times a
    recompute's in the engine's dtype (the rounding of its activations, which grows with the model) + 1e-4."""
    from rollpacker.rollout.engine import Request, SamplingParams, generate

    prompt = samples([64], model_cfg["vocab_size"], seed=2)[0].prompt_ids
    out = generate(engine, [Request(id="p", prompt_ids=prompt, params=SamplingParams(
        max_new_tokens=16, temperature=0.0, ignore_eos=True))])["p"]
    fp32 = recomputed_logprobs(weights(), model_cfg, engine.dtype, torch.float32, prompt, out.token_ids, device)
    own = recomputed_logprobs(weights(), model_cfg, engine.dtype, engine.dtype, prompt, out.token_ids, device)
    gap, rounding = (torch.tensor(out.logprobs) - fp32).abs(), (own - fp32).abs().mean().item()
    bar = PUSH_BAR * rounding + 1e-4
    return {"engine_dtype": str(engine.dtype), "tokens": len(out.token_ids), "max_dlogprob": gap.max().item(),
            "mean_dlogprob": gap.mean().item(), "recompute_in_engine_dtype_mean_dlogprob": rounding,
            "bar": bar, "within_bar": gap.mean().item() <= bar}


def push_and_compare(trainer, model_cfg: dict, device: str) -> dict:
    """The trainer's fp32 shards pushed into a TorchEngine in the engine's dtype (bf16 on GPU), timed, then
    :func:`compare_push`."""
    from rollpacker.model import ModelArgs, empty_model, engine_dtype
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.torch_engine import TorchEngine

    engine = TorchEngine(empty_model(ModelArgs.from_hf(model_cfg), device, engine_dtype("auto", torch.device(device))),
                         EngineConfig(kv_memory_mb=64, max_num_seqs=8))
    push_ms = once_ms(lambda: engine.update_weights(trainer.model.named_parameters()), device)
    return {"push_s": round(push_ms / 1e3, 3), "weights_exact": pushed_exactly(engine, trainer.model.named_parameters())
            } | compare_push(engine, trainer.model.named_parameters, model_cfg, device)


def pushed_exactly(engine, weights) -> bool:
    """Whether each engine parameter is the trainer's full tensor in the engine's dtype, bit for bit. The log-probs'
    bar cannot see a stale push: at a small lr a step moves bf16 weights less than their rounding."""
    params = dict(engine.model.named_parameters())
    with torch.no_grad():
        for name, tensor in weights:
            param = params.get(name.removeprefix("model."))  # a tied lm_head is the embedding's
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if param is not None and not torch.equal(param, full.to(param.device, param.dtype)):
                return False
    return True


def stage_train(run: StageRun) -> bool:
    """FSDP2 on the device at world size 1: activation checkpointing off and full (with the fused head),
    full with the torch head; each step's measured peak against the plan; the weight push."""
    model_cfg, lengths, device = run.size["train_model"], run.size["train_lengths"], run.device
    configs = [("none", "fused"), ("full", "fused"), ("full", "torch")]
    if run.logprobs_impl == "torch":  # Triton cannot compile here (the preflight line says why)
        configs = [("none", "torch"), ("full", "torch")]
    errors = []
    for ac, head in configs:
        trainer, _ = build_trainer(device, model_cfg, activation_checkpointing=ac, micro_batch_tokens=sum(lengths),
                                   logprobs_impl="triton" if head == "fused" else "torch")
        row = measured_step(trainer, lengths, model_cfg["vocab_size"], device)
        row |= planned_train_peak(device, model_cfg, lengths, ac, head)
        if row["peak_allocated_gb"]:  # the plan counts allocated bytes
            row["plan_rel_error"] = round((row["plan_gb"] - row["peak_allocated_gb"]) / row["peak_allocated_gb"], 3)
            errors.append(abs(row["plan_rel_error"]))
        run.report(**{f"ac={ac},head={head}": row})
        if (ac, head) == configs[1]:  # full checkpointing, the fused head where it runs
            run.report(push=push_and_compare(trainer, model_cfg, device))
        del trainer
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    push = run.result["push"]
    right_dtype = push["engine_dtype"] == ("torch.bfloat16" if device == "cuda" else "torch.float32")
    return all(e < 0.15 for e in errors) and right_dtype and push["within_bar"] and push["weights_exact"]


def cpu_collectives(groups: dict) -> dict[str, str | None]:
    """An all-reduce of a CPU tensor over each of ``groups`` (name -> process group): None where it ran, the
    error where the group has no CPU backend. An NCCL-only group raises even at one rank, where DTensor and
    FSDP2 skip their own collectives."""
    import torch.distributed as dist

    ran = {}
    for name, group in groups.items():
        try:
            dist.all_reduce(torch.zeros(1), group=group)
            ran[name] = None
        except RuntimeError as e:
            ran[name] = str(e)[:300]
    return ran


def stage_offload(run: StageRun) -> bool:
    """``train.offload`` on one rank: FSDP2 keeps shards and gradients on the host, so the gradient norm and a
    weight push's ``full_tensor`` run collectives on CPU tensors: every group they use needs gloo beside NCCL.
    At world size 1 they skip their collectives, so a CPU all-reduce over each group proves it."""
    import torch.distributed as dist

    model_cfg = dict(run.size["train_model"], num_hidden_layers=run.size["offload_layers"])
    lengths = run.size["offload_lengths"]
    trainer, meshes = build_trainer(run.device, model_cfg, offload=True, activation_checkpointing="full",
                                    micro_batch_tokens=sum(lengths), logprobs_impl=run.logprobs_impl)
    groups = {"world": dist.group.WORLD} | {f"train.{d}": meshes.train.get_group(d)
                                            for d in meshes.train.mesh_dim_names}
    collectives = cpu_collectives(groups)
    run.report(backend=str(dist.get_backend()), cpu_collectives=collectives)
    run.report(**measured_step(trainer, lengths, model_cfg["vocab_size"], run.device))
    name, param = next(iter(trainer.model.named_parameters()))
    full = param.full_tensor()
    run.report(shard_device=str(param.to_local().device), full_tensor_device=str(full.device))
    return full.shape == param.shape and all(error is None for error in collectives.values())


# ---- (d) the Triton kernel -----------------------------------------------------------------------


KERNEL_CONFIGS = {"kernel": {}, "kernel_32x64x32_w8": dict(block_t=32, block_v=64, block_d=32, num_warps=8),
                  "kernel_ieee": dict(precision="ieee")}
"""The kernel's default (64x128x32, 8 warps, TF32 dots on the bf16 operands), a smaller tile, and the default tile
in fp32 FMA (no tensor cores), which the trainer used before: what TF32 buys. Compiled with Triton 3.6 for sm_90 on
bf16 operands, the first two fit in registers and the third spills (docs/results.md). Timed side by side on the
GPU, they choose the default."""

COMPILE = """import json, sys
from rollpacker.gpu_check.stages import KERNEL_CONFIGS
from rollpacker_kernels.logprobs import compiled
arch = int(sys.argv[1])
print(json.dumps({name: compiled(arch, **config) for name, config in KERNEL_CONFIGS.items()}))"""
"""A process compiling the kernels of :data:`KERNEL_CONFIGS` for ``sm_ARCH`` (argv[1]) with no interpreter."""


def compiling(device: str) -> tuple[str, subprocess.Popen]:
    """Start compiling the kernels ahead of time for this GPU's architecture (sm_90, the lent H200's, on CPU), on
    the host beside the stage's GPU work: ``sm_ARCH`` and the process, which prints one JSON line."""
    arch = "".join(map(str, torch.cuda.get_device_capability())) if device == "cuda" else "90"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return f"sm_{arch}", subprocess.Popen([sys.executable, "-c", COMPILE, arch], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env)


def compiled_result(proc: subprocess.Popen, left_s: float) -> dict:
    """What the compiling process printed, or why not: ``error`` when it failed, ``skipped`` when out of time."""
    try:
        stdout, stderr = proc.communicate(timeout=max(1.0, left_s))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"skipped": "not compiled before the stage's deadline"}
    return json.loads(stdout.splitlines()[-1]) if proc.returncode == 0 else {"error": stderr.strip()[-600:]}


def stage_kernel(run: StageRun) -> bool:
    """The kernel's values and times (:func:`kernel_timings`) while the host compiles it ahead of time for the GPU:
    registers, local memory and shared memory per kernel and configuration, reported even when the timings fail.
    Fails when a kernel does not compile or its values are off."""
    arch, compiler = compiling(run.device)
    try:
        diffs = kernel_timings(run)
    finally:
        run.report(compiled={arch: compiled_result(compiler, run.left_s())})
    return "error" not in run.result["compiled"][arch] and all(
        d["logprob"] < 1e-3 and d["entropy"] < 1e-2 for d in diffs.values())


def kernel_timings(run: StageRun) -> dict[str, dict[str, float]]:
    """The fused kernel at each of :data:`KERNEL_CONFIGS` and the chunked torch path on the same bf16 operands (fp32
    logits of exact products): values and gradients at the smallest size, then forward+backward ms, peak and TFLOP/s
    at the others, smallest first; a size whose two calls would pass the deadline (scaled from the last size
    measured) is skipped. Each configuration's largest gaps to torch."""
    from functools import partial

    from rollpacker_kernels.logprobs import fused_token_logprobs
    from rollpacker_kernels.reference import chunked_token_logprobs_entropy

    k, device = run.size["kernel"], run.device
    g = torch.Generator(device=device).manual_seed(0)
    d, v = k["hidden"], k["vocab"]
    weight = (torch.randn(v, d, device=device, generator=g) * 0.02).bfloat16()
    kernels = {name: partial(fused_token_logprobs, **config) for name, config in KERNEL_CONFIGS.items()}
    paths = {"kernel": kernels.pop("kernel"), "torch": chunked_token_logprobs_entropy, **kernels}  # alternative last

    def inputs(t: int):
        h = torch.randn(t, d, device=device, generator=g).bfloat16().requires_grad_()
        return h, weight.clone().requires_grad_(), torch.randint(0, v, (t,), device=device, generator=g)

    def call(path: str, h, w, y):
        lp, ent = paths[path](h, w, y, 0.8)
        (lp.sum() + 0.01 * ent.sum()).backward()
        grads = h.grad, w.grad
        h.grad = w.grad = None
        return lp, ent, *grads

    n = k["values_tokens"]
    h, w, y = inputs(n)
    got = {path: call(path, h, w, y) for path in paths}
    diffs = {path: dict(zip(("logprob", "entropy", "grad_hidden", "grad_weight"),
                            ((a.float() - b.float()).abs().max().item() for a, b in zip(got[path], got["torch"]))))
             for path in KERNEL_CONFIGS}
    last = {path: (n, once_ms(lambda path=path: call(path, h, w, y), device)) for path in paths}  # compiled
    run.report(hidden=d, vocab=v, **{f"max_abs_diff{p.removeprefix('kernel')}": diff for p, diff in diffs.items()},
               **{f"{path}_T{n}_ms": round(ms, 2) for path, (_, ms) in last.items()})
    for t in sorted(k["tokens"]):
        h, w, y = inputs(t)
        for path in paths:
            seen, ms = last[path]
            if 2 * ms / 1e3 * t / seen > run.left_s():  # a warm-up and one timed call
                run.report(**{f"{path}_T{t}": {"skipped": f"about {2 * ms / 1e3 * t / seen:.0f} s, "
                                                          f"{run.left_s():.0f} s left"}})
                continue
            reset_peak(device)
            held = torch.cuda.memory_allocated() if device == "cuda" else 0
            times = [once_ms(lambda path=path: call(path, h, w, y), device)]  # the warm-up
            while len(times) < 3 and run.left_s() > 2 * times[-1] / 1e3:
                times.append(once_ms(lambda path=path: call(path, h, w, y), device))
            ms = statistics.median(times[1:] or times)
            last[path] = (t, ms)
            flops = (8 if path == "torch" else 10) * t * v * d  # logit-sized GEMMs of a forward + backward
            mem = memory(device)
            peak = mem["peak_allocated_gb"] and mem["peak_allocated_gb"] - gb(held)
            run.report(**{f"{path}_T{t}": {"ms": round(ms, 2), "timed_calls": len(times) - 1, "peak_gb": peak,
                                           **mem, "tflops": round(flops / ms / 1e9, 3)}})
    return diffs


# ---- (e) TorchEngine against transformers ------------------------------------------------------------


def prompts(num: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(num)]


def greedy(engine, batch: list[list[int]], new: int, tag: str = "r") -> dict:
    from rollpacker.rollout.engine import Request, SamplingParams, generate

    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    return generate(engine, [Request(id=f"{tag}{i}", prompt_ids=p, params=params) for i, p in enumerate(batch)])


def teacher_forced(hf, outs: dict, eps: float, device: str) -> dict:
    """transformers' log-probs on the engine's own tokens: tokens more than ``eps`` below transformers'
    best (not greedy up to ties), and the largest log-prob difference."""
    worst_gap = worst = 0.0
    not_greedy = total = 0
    for o in outs.values():
        ids = torch.tensor(o.prompt_ids + o.token_ids, device=device)
        with torch.no_grad():
            lp = torch.log_softmax(hf(input_ids=ids[None]).logits[0].float(), -1)
        rows = lp[len(o.prompt_ids) - 1: len(o.prompt_ids) - 1 + len(o.token_ids)]
        chosen = rows.gather(1, torch.tensor(o.token_ids, device=device)[:, None]).squeeze(1)
        gap = rows.max(-1).values - chosen
        not_greedy, total = not_greedy + int((gap > eps).sum()), total + len(o.token_ids)
        worst_gap = max(worst_gap, gap.max().item())
        worst = max(worst, (chosen - torch.tensor(o.logprobs, device=device)).abs().max().item())
    return {"tokens": total, "not_greedy": not_greedy, "worst_gap_to_best": worst_gap, "max_abs_dlogprob": worst}


def near_tie(logprobs: torch.Tensor, a: int, b: int, eps: float) -> bool:
    """Whether tokens ``a`` and ``b`` are both within ``eps`` of the best of ``logprobs`` [vocab]: a tie that
    rounding may break either way."""
    best = logprobs.max()
    return bool(best - logprobs[a] <= eps and best - logprobs[b] <= eps)


def preempted_against_first(hf, outs: dict, again: dict, eps: float, device: str) -> dict:
    """The preempted run's tokens against the first run's: where they first differ, a near-tie of transformers'
    fp32 log-probs (:func:`near_tie`) is tolerated, anything else (another token, another length) counts as a
    difference; before it, how far the log-probs moved."""
    ties = differ = 0
    moved = 0.0
    for key, first in outs.items():
        a, b = first.token_ids, again[key].token_ids
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        moved = max([moved] + [abs(p - q) for p, q in zip(first.logprobs[:i], again[key].logprobs[:i])])
        if i == len(a) == len(b):
            continue
        if i < min(len(a), len(b)):
            ids = torch.tensor(first.prompt_ids + a[:i], device=device)
            with torch.no_grad():
                lp = torch.log_softmax(hf(input_ids=ids[None]).logits[0, -1].float(), -1)
            if near_tie(lp, a[i], b[i], eps):
                ties += 1
                continue
        differ += 1
    return {"preempted_near_ties": ties, "preempted_tokens_differ": differ, "preempted_max_dlogprob": moved}


def workspace_peak(engine, batch: list[list[int]], new: int, device: str) -> dict:
    """The decode workspace beside the pool over a batch crossing a length group, against the plan's bound.
    On CUDA also the allocator's peak above the weights and the pool: the workspace with its reallocations'
    transients, prefill's activations and the sampler's logits, against the plan's two terms for them."""
    from rollpacker.plan.memory import RolloutSetup, Shape, decode_workspace, engine_activations
    from rollpacker.rollout.engine import Request, SamplingParams

    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add(Request(id=f"w{i}", prompt_ids=p, params=params))
    reset_peak(device)
    held = torch.cuda.memory_allocated() if device == "cuda" else None
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.workspace_bytes)
    a = engine.model.args
    shape = Shape(vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                  num_layers=a.num_layers, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim)
    setup = RolloutSetup(engine="torch", tp=1, weight_bytes=engine.dtype.itemsize, kv_bytes=engine.cache.nbytes,
                         max_num_seqs=engine.config.max_num_seqs, prefill_tokens=engine.config.max_prefill_tokens,
                         released=False, longest=max(map(len, batch)) + new)
    bound, acts = decode_workspace(shape, setup), engine_activations(shape, setup)
    above = None if held is None else torch.cuda.max_memory_allocated() - held
    return {"workspace_gb": gb(peak), "kv_pool_gb": gb(engine.cache.nbytes), "weights_gb": gb(engine.weight_bytes),
            "workspace_over_pool": round(peak / engine.cache.nbytes, 2), "plan_bound_gb": gb(bound),
            "within_plan": peak <= bound, "allocated_above_pool_gb": gb(above), "plan_activations_gb": gb(acts),
            "allocated_within_plan": None if above is None else above <= bound + acts, **memory(device)}


def stage_engine(run: StageRun) -> bool:
    """A random Qwen2 on the device: TorchEngine's greedy tokens and log-probs teacher-forced through
    transformers, fp32 (TF32 off: within 1e-3) and bf16 (the gap, reported); a tiny KV budget (preemption
    by recomputation) gives the same fp32 tokens up to a near-tie; the decode workspace's peak."""
    from transformers import AutoModelForCausalLM

    from rollpacker.model import load_model
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.torch_engine import TorchEngine
    from rollpacker.toy.random_model import RandomModelConfig, write

    e, device = run.size["engine"], run.device
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    path = run.work / "random_model"
    shape = {k: e[k] for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size")}
    write(RandomModelConfig(out=path, max_position_embeddings=4096, **shape))
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    batch = prompts(e["prompts"], 258, 8, 4 * e["new"])
    for name, dtype, eps in (("fp32", torch.float32, 1e-4), ("bf16", torch.bfloat16, 5e-2)):
        engine = TorchEngine(load_model(path, dev, dtype), EngineConfig(kv_memory_mb=e["kv_mb"], max_num_seqs=64))
        start = time.perf_counter()
        outs = greedy(engine, batch, e["new"])
        run.report(**{f"{name}_rollout_s": round(time.perf_counter() - start, 2)})
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
        run.report(**{name: teacher_forced(hf, outs, eps, device)})
        if name == "fp32":
            small = TorchEngine(load_model(path, dev, dtype),
                                EngineConfig(kv_memory_mb=e["small_kv_mb"], max_num_seqs=64))
            again = greedy(small, batch, e["new"])
            run.report(preemptions=small.stats().num_preemptions,
                       **preempted_against_first(hf, outs, again, eps, device))
        del engine, hf
        gc.collect()
    engine = TorchEngine(load_model(path, dev, torch.bfloat16),
                         EngineConfig(kv_memory_mb=e["kv_mb"], max_num_seqs=e["rows"]))
    run.report(workspace=workspace_peak(engine, prompts(e["rows"], 258, e["context"], e["context"] + 10, seed=1),
                                        e["new"], device))
    res = run.result
    return (res["fp32"]["not_greedy"] == 0 and res["fp32"]["max_abs_dlogprob"] < 1e-3 and res["preemptions"] > 0
            and res["preempted_tokens_differ"] == 0 and res["preempted_max_dlogprob"] < 1e-3
            and res["workspace"]["within_plan"] and res["workspace"]["allocated_within_plan"] is not False)


# ---- (f) the speculative verify cost ------------------------------------------------------------


def stage_spec(run: StageRun) -> bool:
    """TorchEngine's verify step with k draft tokens against a plain decode step
    (:func:`~rollpacker.rollout.probe.measure_spec_cost`: what ``engine.speculative auto`` and ``sim spec``
    use), on a random Qwen2.5-7B-shaped model in bf16 (toy-shaped on CPU). Eager TorchEngine, launch-bound
    at small batches: not vLLM's or SGLang's verify cost."""
    from rollpacker.model import ModelArgs, Transformer, engine_dtype
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.probe import measure_spec_cost
    from rollpacker.rollout.torch_engine import TorchEngine

    s, device = run.size["spec"], run.device
    cfg = s["model"] or dict(run.size["train_model"], vocab_size=258)
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_hf(cfg)).to(engine_dtype("auto", torch.device(device)))
    model = model.to_empty(device=device)  # never an fp32 copy of 15 GB
    model.init_weights()
    engine = TorchEngine(model, EngineConfig(kv_memory_mb=s["kv_mb"], max_num_seqs=64, spec_max_tokens=s["drafts"],
                                             max_prefill_tokens=s["rows"] * s["prompt"]))  # all its rows timed
    reset_peak(device)
    cost = measure_spec_cost(engine, s["rows"], s["drafts"], s["prompt"], steps=s["steps"])
    ratios = {f"n{n}": {f"k{k}": round(ms[j] / ms[0], 3) for j, k in enumerate(cost.draft_lens) if k}
              for n, ms in zip(cost.rows, cost.ms)}
    run.report(engine="torch (eager)", rows=list(cost.rows), draft_lens=list(cost.draft_lens),
               plain_decode_ms={f"n{n}": round(ms[0], 3) for n, ms in zip(cost.rows, cost.ms)},
               verify_over_plain=ratios, draft_ms=round(cost.draft_ms, 4), max_rows=cost.max_rows, **memory(device))
    return all(ms[0] > 0 for ms in cost.ms)


# ---- (g) the judge's layer streaming ------------------------------------------------------------


def stage_judge(run: StageRun) -> bool:
    """Layers streamed from host memory on the side stream (``model/offload.py``): logits bit-equal to the
    resident model's, and on CUDA more than half the shorter of copy and compute hidden."""
    from rollpacker.model import CausalAttention, ModelArgs, Transformer
    from rollpacker.model.offload import OffloadedLayers
    from rollpacker.model.transformer import rope_cos_sin

    j, device = run.size["judge"], run.device
    cfg = dict(model_type="qwen2", num_attention_heads=16 if device == "cuda" else 4, num_key_value_heads=4 if
               device == "cuda" else 2, max_position_embeddings=4096,
               **{k: j[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")})
    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_hf(cfg))
    model.init_weights()
    model = model.to(torch.bfloat16)
    layers = OffloadedLayers(list(model.layers), model.args, device)
    del model.layers
    model.to(device)
    seqs = [list(range(1, j["length"] + 1))] * j["seqs"]
    tokens = torch.tensor([t for q in seqs for t in q], device=device)
    positions = torch.cat([torch.arange(len(q)) for q in seqs]).to(device)

    def hidden():
        with torch.inference_mode():
            x = model.embed_tokens(tokens)
            cos, sin = rope_cos_sin(positions, model.inv_freq, x.dtype)
            return model.norm(layers(x, cos, sin, CausalAttention([len(q) for q in seqs], device)))

    layers.set_resident(len(layers))
    resident = hidden()
    compute_ms = timed_ms(hidden, device)
    layers.set_resident(0)
    buffer = torch.empty_like(layers.host[0], device=device)
    copy_ms = timed_ms(lambda: [buffer.copy_(h, non_blocking=True) for h in layers.host], device)
    equal = torch.equal(hidden(), resident)
    run.report(bit_equal=equal, compute_ms=round(compute_ms, 2), copy_ms=round(copy_ms, 2))
    offloaded_ms = timed_ms(hidden, device)
    hidden_ms = compute_ms + copy_ms - offloaded_ms
    overlap = hidden_ms > 0.5 * min(compute_ms, copy_ms) if device == "cuda" else None
    run.report(offloaded_ms=round(offloaded_ms, 2), hidden_ms=round(hidden_ms, 2), overlap_over_half=overlap)
    return equal and overlap is not False


# ---- (h) issue 47's measurement, where a decode step is flat --------------------------------------


def stage_episodes(run: StageRun) -> bool:
    """``bench episodes``' sync, tail and tail+warm runs on one rank, one seed, its agentic workload: on a GPU the
    toy model's decode step is flat in the running requests, as the issue's speedups assume (on two CPU cores it
    is not). Each run's figures are reported as it ends, with the speedups over sync so far; a run the deadline
    would cut (the last one's time) is skipped. It passes when every run trains each prompt once."""
    from rollpacker.bench import episodes as bench

    args = bench.Args(policies="sync,tail,tail+warm", seeds="0", nproc=1, **run.size["episodes"])
    env_file, policies = bench.write_env_file(args, run.work), args.policies.split(",")
    results, last_s = {}, 0.0
    for policy in policies:
        if last_s > run.left_s():
            run.report(**{policy: {"skipped": f"about {last_s:.0f} s, {run.left_s():.0f} s left"}})
            continue
        start, folder = time.perf_counter(), run.work / "episodes" / policy
        records = bench.job(args, 0, env_file, bench.run_flags(args, policy), folder, [])
        results[policy] = bench.summarize(args, records, folder)
        last_s = time.perf_counter() - start
        run.report(**{policy: {k: round(v, 4) for k, v in results[policy].items()} | {"run_s": round(last_s, 1)}},
                   **bench.speedups(results))
    return len(results) == len(policies) and all(r["lost"] == r["twice"] == 0 for r in results.values())


def main(argv: list[str] | None = None) -> None:
    from rollpacker.dist import exit_process

    parser = argparse.ArgumentParser(prog="python -m rollpacker.gpu_check.stages")
    parser.add_argument("stage", choices=list(STAGES))
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--out", type=Path, required=True, help="small results only")
    parser.add_argument("--work", type=Path, required=True, help="models and checkpoints")
    parser.add_argument("--limit-s", type=float, default=600, help="the driver's limit on this stage")
    parser.add_argument("--logprobs-impl", choices=("triton", "torch"), default="triton")
    parser.add_argument("--started", type=float, default=time.time(),
                        help="when the driver launched the stage (time.time()): its limit counts from there")
    args = parser.parse_args(argv)
    margin = max(5.0, 0.1 * args.limit_s)  # the stage's own exit: destroying the group, the interpreter
    left = args.limit_s - max(0.0, time.time() - args.started)  # less the imports before main
    run = StageRun(args.device, args.out, args.work, SIZES[args.device], time.perf_counter() + left - margin,
                   args.logprobs_impl)
    torch.manual_seed(0)
    try:
        ok = globals()[f"stage_{args.stage}"](run)
    except Exception as e:  # the stage failed: say how, in its result line
        traceback.print_exc()
        ok = False
        run.result["error"] = repr(e)[:600]
    run.report(ok=bool(ok))
    exit_process(0 if ok else 1)


if __name__ == "__main__":
    main()
