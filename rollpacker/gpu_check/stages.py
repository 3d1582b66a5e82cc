"""The stages of :mod:`rollpacker.gpu_check`, one per process: ``python -m rollpacker.gpu_check.stages NAME
--device cuda|cpu --out DIR`` prints its result as one ``GPU_CHECK_RESULT {json}`` line.

The same code runs on both devices; :data:`SIZES` holds what differs (the GPU sizes the issue names, toy sizes
on CPU). What a stage asserts sets ``ok``; everything else it measures is reported for docs/results.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from rollpacker.gpu_check import RESULT

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
    ),
}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_bytes(device: str) -> int | None:
    """The CUDA allocator's peak since the last reset; None on CPU (``bench memory`` measures CPU peaks)."""
    return torch.cuda.max_memory_allocated() if device == "cuda" else None


def reset_peak(device: str) -> None:
    synchronize(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def gb(n: float | None) -> float | None:
    """GB to four significant digits (toy sizes are megabytes)."""
    return None if n is None else float(f"{n / GB:.4g}")


def timed_ms(fn, device: str, reps: int = 3) -> float:
    """Median ms of ``fn()`` after one warm-up (CUDA: synchronized wall time)."""
    fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


# ---- (a) the default job ------------------------------------------------------------------------


def stage_toy(device: str, out: Path, size: dict) -> dict:
    """The default job (``auto``: TorchEngine here) for a few steps with checkpoints and evaluation, its
    Hugging Face export, then ``--resume auto`` for two more steps from its last checkpoint."""
    run_dir = out / "toy"
    quiet = ["--metrics.wandb-mode", "disabled", "--metrics.no-live", "--run-dir", str(run_dir)]
    steps = size["toy_steps"]
    first = [sys.executable, "-m", "rollpacker.run", "--num-steps", str(steps), *size["toy_args"], *quiet]
    resumed = [sys.executable, "-m", "rollpacker.run", "--num-steps", str(steps + 2), "--resume", "auto",
               *size["toy_args"], *quiet]
    times = []
    for cmd in (first, resumed):
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        times.append(round(time.perf_counter() - start, 1))
        if proc.returncode:
            return {"ok": False, "error": f"{' '.join(cmd[2:4])} exited {proc.returncode}: {proc.stderr[-1500:]}"}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = sorted({r["step"] for r in rows if "train/loss" in r})
    export = sorted(p.name for p in (run_dir / "hf").iterdir())
    diff = [r["train/rollout_logprob_diff"] for r in rows if "train/rollout_logprob_diff" in r]
    step_s = [round(r["time/step"], 2) for r in rows if "time/step" in r]
    ok = trained == list(range(steps + 2)) and "config.json" in export and any(n.endswith(".safetensors")
                                                                                for n in export)
    return {"ok": ok, "trained_steps": trained, "run_s": times, "step_s": step_s, "hf_export": export,
            "engine_trainer_logprob_diff": [round(d, 5) for d in diff],
            "eval": {k: round(v, 4) for r in rows for k, v in r.items() if k.startswith("eval/")}}


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
    """A trainer at world size 1 on ``device``: the model built on meta, then on the device (or, with
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
    return Trainer(model, cfg, meshes.train, num_steps=2)


def measured_step(trainer, lengths: list[int], vocab: int, device: str) -> tuple[int | None, float]:
    """A small step (AdamW's state is created), then the measured one: (peak bytes, seconds)."""
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
    return peak_bytes(device), time.perf_counter() - start


def planned_train_peak(device: str, model_cfg: dict, lengths: list[int], checkpointing: str, head: str) -> dict:
    from rollpacker.plan.memory import Shape, TrainSetup, train_phases

    cuda = device == "cuda"
    setup = TrainSetup(shard_size=1, seq_lens=tuple(lengths), response_tokens=sum(lengths) // 2,
                       compute_bytes=2 if cuda else 4, checkpointing=checkpointing, head=head, foreach=cuda,
                       micro_batches=1, gloo=not cuda)
    peak = max(train_phases(Shape.from_hf(model_cfg), setup), key=lambda p: p.total)
    return {"plan_gb": gb(peak.total), "plan_phase": peak.name}


def push_and_compare(trainer, model_cfg: dict, device: str) -> dict:
    """The trainer's fp32 shards pushed into a TorchEngine in the engine's dtype (bf16 on GPU), then the
    engine's greedy log-probs against the trainer's own on the same tokens."""
    from rollpacker.model import ModelArgs, empty_model, engine_dtype
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.engine import Request, SamplingParams, generate
    from rollpacker.rollout.torch_engine import TorchEngine
    from rollpacker.train.trainer import Sample

    engine = TorchEngine(empty_model(ModelArgs.from_hf(model_cfg), device, engine_dtype("auto", torch.device(device))),
                         EngineConfig(kv_memory_mb=64, max_num_seqs=8))
    synchronize(device)
    start = time.perf_counter()
    engine.update_weights(trainer.model.named_parameters())
    synchronize(device)
    push_s = time.perf_counter() - start
    prompt = samples([64], model_cfg["vocab_size"], seed=2)[0].prompt_ids
    out = generate(engine, [Request(id="p", prompt_ids=prompt, params=SamplingParams(
        max_new_tokens=16, temperature=0.0, ignore_eos=True))])["p"]
    with torch.no_grad():
        mine = trainer._logprobs(trainer.model, [Sample(prompt, out.token_ids, 0.0, out.logprobs)])
    gap = (mine.float().cpu() - torch.tensor(out.logprobs)).abs().max().item()
    return {"push_s": round(push_s, 3), "engine_dtype": str(engine.dtype), "engine_vs_trainer_max_dlogprob": gap}


def stage_train(device: str, out: Path, size: dict) -> dict:
    """FSDP2 on ``device`` at world size 1: activation checkpointing off and full (with the fused head),
    full with the torch head; each step's measured peak against the plan; the weight push."""
    model_cfg, lengths, res = size["train_model"], size["train_lengths"], {}
    for ac, head in (("none", "fused"), ("full", "fused"), ("full", "torch")):
        trainer = build_trainer(device, model_cfg, activation_checkpointing=ac, micro_batch_tokens=sum(lengths),
                                logprobs_impl="triton" if head == "fused" else "torch")
        peak, seconds = measured_step(trainer, lengths, model_cfg["vocab_size"], device)
        row = {"measured_gb": gb(peak), "step_s": round(seconds, 3)}
        row |= planned_train_peak(device, model_cfg, lengths, ac, head)
        if peak:
            row["plan_rel_error"] = round((row["plan_gb"] * GB - peak) / peak, 3)
        res[f"ac={ac},head={head}"] = row
        if ac == "full" and head == "fused":
            res["push"] = push_and_compare(trainer, model_cfg, device)
        del trainer
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    errors = [abs(r["plan_rel_error"]) for r in res.values() if "plan_rel_error" in r]
    limit = 0.05 if device == "cpu" else 0.5  # fp32 on CPU; a bf16 engine against the fp32 trainer on GPU
    ok = all(e < 0.15 for e in errors) and res["push"]["engine_vs_trainer_max_dlogprob"] < limit
    return {"ok": ok, **res}


def stage_offload(device: str, out: Path, size: dict) -> dict:
    """``train.offload`` on one rank: FSDP2 keeps shards and gradients on the host, so the gradient norm
    and a weight push's ``full_tensor`` run collectives on CPU tensors: they need gloo beside NCCL."""
    import torch.distributed as dist

    model_cfg = dict(size["train_model"], num_hidden_layers=size["offload_layers"])
    lengths = size["offload_lengths"]
    trainer = build_trainer(device, model_cfg, offload=True, activation_checkpointing="full",
                            micro_batch_tokens=sum(lengths))
    peak, seconds = measured_step(trainer, lengths, model_cfg["vocab_size"], device)
    name, param = next(iter(trainer.model.named_parameters()))
    full = param.full_tensor()
    return {"ok": full.shape == param.shape, "backend": str(dist.get_backend()), "measured_gb": gb(peak),
            "step_s": round(seconds, 3), "shard_device": str(param.to_local().device),
            "full_tensor_device": str(full.device)}


# ---- (d) the Triton kernel -----------------------------------------------------------------------


def stage_kernel(device: str, out: Path, size: dict) -> dict:
    """The fused kernel and the chunked torch path on the same bf16 operands (both compute in fp32):
    values and gradients at one size, then forward+backward ms, peak and TFLOP/s at the others."""
    from rollpacker_kernels.logprobs import fused_token_logprobs
    from rollpacker_kernels.reference import chunked_token_logprobs_entropy

    k, g = size["kernel"], torch.Generator(device=device).manual_seed(0)
    d, v = k["hidden"], k["vocab"]
    weight = (torch.randn(v, d, device=device, generator=g) * 0.02).bfloat16()
    paths = {"kernel": fused_token_logprobs, "torch": chunked_token_logprobs_entropy}

    def run(path: str, hidden, w, targets, grads: bool = True):
        lp, ent = paths[path](hidden, w, targets, 0.8)
        if grads:
            (lp.sum() + 0.01 * ent.sum()).backward()
        return lp, ent

    res, n = {}, k["values_tokens"]
    targets = torch.randint(0, v, (n,), device=device, generator=g)
    base = torch.randn(n, d, device=device, generator=g).bfloat16()
    got = {}
    for path in paths:
        h, w = base.clone().requires_grad_(), weight.clone().requires_grad_()
        got[path] = (*run(path, h, w, targets), h.grad, w.grad)
    diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(got["kernel"], got["torch"])]
    res["max_abs_diff"] = dict(zip(("logprob", "entropy", "grad_hidden", "grad_weight"), diffs))
    for t in k["tokens"]:
        h = torch.randn(t, d, device=device, generator=g).bfloat16().requires_grad_()
        w = weight.clone().requires_grad_()
        y = torch.randint(0, v, (t,), device=device, generator=g)
        for path in paths:
            def step(path=path):
                run(path, h, w, y)
                h.grad = w.grad = None
            reset_peak(device)
            held = torch.cuda.memory_allocated() if device == "cuda" else 0
            ms = timed_ms(step, device, reps=2)
            flops = (10 if path == "kernel" else 8) * t * v * d  # logit-sized GEMMs of a forward + backward
            peak = peak_bytes(device)
            res[f"{path}_T{t}"] = {"ms": round(ms, 2), "peak_gb": gb(peak - held if peak else None),
                                   "tflops": round(flops / ms / 1e9, 3)}
    ok = diffs[0] < 1e-3 and diffs[1] < 1e-2
    return {"ok": ok, "hidden": d, "vocab": v, **res}


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


def workspace_peak(engine, batch: list[list[int]], new: int, device: str) -> dict:
    """The decode workspace beside the pool over a batch crossing a length group, against the plan's bound."""
    from rollpacker.plan.memory import RolloutSetup, Shape, decode_workspace
    from rollpacker.rollout.engine import Request, SamplingParams

    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add(Request(id=f"w{i}", prompt_ids=p, params=params))
    reset_peak(device)
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.workspace_bytes)
    a = engine.model.args
    shape = Shape(vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                  num_layers=a.num_layers, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim)
    bound = decode_workspace(shape, RolloutSetup(
        engine="torch", tp=1, weight_bytes=engine.dtype.itemsize, kv_bytes=engine.cache.nbytes,
        max_num_seqs=engine.config.max_num_seqs, prefill_tokens=0, released=False,
        longest=max(map(len, batch)) + new))
    allocated = peak_bytes(device)
    return {"workspace_gb": gb(peak), "kv_pool_gb": gb(engine.cache.nbytes), "weights_gb": gb(engine.weight_bytes),
            "workspace_over_pool": round(peak / engine.cache.nbytes, 2), "plan_bound_gb": gb(bound),
            "within_plan": peak <= bound, "allocated_peak_gb": gb(allocated)}


def stage_engine(device: str, out: Path, size: dict) -> dict:
    """A random Qwen2 on ``device``: TorchEngine's greedy tokens and log-probs teacher-forced through
    transformers, fp32 (TF32 off: within 1e-3) and bf16 (the gap, reported); a tiny KV budget (preemption
    by recomputation) gives the same fp32 tokens; the decode workspace's peak."""
    from transformers import AutoModelForCausalLM

    from rollpacker.model import load_model
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.torch_engine import TorchEngine
    from rollpacker.toy.random_model import RandomModelConfig, write

    e = size["engine"]
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    path = out / "random_model"
    shape = {k: e[k] for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size")}
    write(RandomModelConfig(out=path, max_position_embeddings=4096, **shape))
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    batch = prompts(e["prompts"], 258, 8, 4 * e["new"])
    res = {}
    for name, dtype, eps in (("fp32", torch.float32, 1e-4), ("bf16", torch.bfloat16, 5e-2)):
        engine = TorchEngine(load_model(path, dev, dtype), EngineConfig(kv_memory_mb=e["kv_mb"], max_num_seqs=64))
        start = time.perf_counter()
        outs = greedy(engine, batch, e["new"])
        res[f"{name}_rollout_s"] = round(time.perf_counter() - start, 2)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
        res[name] = teacher_forced(hf, outs, eps, device)
        if name == "fp32":
            small = TorchEngine(load_model(path, dev, dtype),
                                EngineConfig(kv_memory_mb=e["small_kv_mb"], max_num_seqs=64))
            again = greedy(small, batch, e["new"])
            res["preemptions"] = small.stats().num_preemptions
            res["preempted_tokens_differ"] = sum(outs[k].token_ids != again[k].token_ids for k in outs)
        del engine, hf
        gc.collect()
    engine = TorchEngine(load_model(path, dev, torch.bfloat16),
                         EngineConfig(kv_memory_mb=e["kv_mb"], max_num_seqs=e["rows"]))
    res["workspace"] = workspace_peak(engine, prompts(e["rows"], 258, e["context"], e["context"] + 10, seed=1),
                                      e["new"], device)
    fp32 = res["fp32"]
    ok = (fp32["not_greedy"] == 0 and fp32["max_abs_dlogprob"] < 1e-3 and res["preemptions"] > 0
          and res["preempted_tokens_differ"] == 0 and res["workspace"]["within_plan"])
    return {"ok": ok, **res}


# ---- (f) the speculative verify cost ------------------------------------------------------------


def stage_spec(device: str, out: Path, size: dict) -> dict:
    """TorchEngine's verify step with k draft tokens against a plain decode step
    (:func:`~rollpacker.rollout.probe.measure_spec_cost`: what ``engine.speculative auto`` and ``sim spec``
    use), on a random Qwen2.5-7B-shaped model in bf16 (toy-shaped on CPU)."""
    from rollpacker.model import ModelArgs, Transformer, engine_dtype
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.probe import measure_spec_cost
    from rollpacker.rollout.torch_engine import TorchEngine

    s = size["spec"]
    cfg = s["model"] or dict(size["train_model"], vocab_size=258)
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_hf(cfg)).to(engine_dtype("auto", torch.device(device)))
    model = model.to_empty(device=device)  # never an fp32 copy of 15 GB
    model.init_weights()
    engine = TorchEngine(model, EngineConfig(kv_memory_mb=s["kv_mb"], max_num_seqs=64, spec_max_tokens=s["drafts"]))
    cost = measure_spec_cost(engine, s["rows"], s["drafts"], s["prompt"], steps=s["steps"])
    ratios = {f"n{n}": {f"k{k}": round(ms[j] / ms[0], 3) for j, k in enumerate(cost.draft_lens) if k}
              for n, ms in zip(cost.rows, cost.ms)}
    return {"ok": all(ms[0] > 0 for ms in cost.ms), "rows": list(cost.rows), "draft_lens": list(cost.draft_lens),
            "plain_decode_ms": {f"n{n}": round(ms[0], 3) for n, ms in zip(cost.rows, cost.ms)},
            "verify_over_plain": ratios, "draft_ms": round(cost.draft_ms, 4), "max_rows": cost.max_rows,
            "peak_gb": gb(peak_bytes(device))}


# ---- (g) the judge's layer streaming ------------------------------------------------------------


def stage_judge(device: str, out: Path, size: dict) -> dict:
    """Layers streamed from host memory on the side stream (``model/offload.py``): logits bit-equal to the
    resident model's, and on CUDA more than half the shorter of copy and compute hidden."""
    from rollpacker.model import CausalAttention, ModelArgs, Transformer
    from rollpacker.model.offload import OffloadedLayers
    from rollpacker.model.transformer import rope_cos_sin

    j = size["judge"]
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
    offloaded_ms = timed_ms(hidden, device)
    hidden_ms = compute_ms + copy_ms - offloaded_ms
    overlap = hidden_ms > 0.5 * min(compute_ms, copy_ms) if device == "cuda" else None
    return {"ok": equal and overlap is not False, "bit_equal": equal, "compute_ms": round(compute_ms, 2),
            "copy_ms": round(copy_ms, 2), "offloaded_ms": round(offloaded_ms, 2), "hidden_ms": round(hidden_ms, 2),
            "overlap_over_half": overlap}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rollpacker.gpu_check.stages")
    parser.add_argument("stage", choices=("toy", "train", "offload", "kernel", "engine", "spec", "judge"))
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    try:
        result = globals()[f"stage_{args.stage}"](args.device, args.out, SIZES[args.device])
    except Exception as e:  # the stage failed: say how, in its result line
        traceback.print_exc()
        result = {"ok": False, "error": repr(e)[:600]}
    print(RESULT + json.dumps(result, default=str), flush=True)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
