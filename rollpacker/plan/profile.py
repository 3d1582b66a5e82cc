"""The planner's offline profiling phase (its command: ``torchrun -m rollpacker.profile [run flags]``).

It takes the flags of ``rollpacker.run`` and measures, for every rollout TP the world can run,
decode step time by batch and context, prefill throughput, KV footprint and capacity, and the
control exchange's cost. With speculation on, it also records TorchEngine's verify-step costs.

Invariants:

- A profile is JSON under a ``key``: model architecture, device, world size, engine dtype and KV
  settings, format version.
- A run reads the cached profile for its key, and profiles first when there is none.
- A profile named with ``plan.profile`` whose key differs is refused, with the differences listed.

Why: the planner and the simulator price TPs they have not run from this one measurement. What is
measured, and who reads it: ``docs/planner.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import statistics
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollpacker.errors import UserError

logger = logging.getLogger("rollpacker")
VERSION = 1


def profile_key(config, model_dir: Path, device: str, world: int, dtype) -> dict[str, Any]:
    """What the measurements depend on: the model's architecture, the device, the world, the engine's dtype
    (``dtype``: resolved, so "auto" and what it resolves to share one), KV settings and speculation, the
    sampling its decode steps do, and the points it measures (plan.profile_batches, _contexts, _steps). An
    engine that cannot switch TP is measured as the run builds it: its batch limits cap the decode batches."""
    from rollpacker.rollout import ENGINES

    e, r = config.engine, config.rollout
    own = e.kind != "auto" and not ENGINES[e.kind].supports_tp_switch
    return {
        "version": VERSION,
        "model": hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:16],
        "device": device,
        "world": world,
        "dtype": str(dtype).removeprefix("torch."),
        "engine": {"kind": e.kind, "block_size": e.block_size, "kv_memory_mb": e.kv_memory_mb, "memory_mb": e.memory_mb,
                   "max_model_len": e.max_model_len,
                   "spec_max_tokens": e.spec_max_tokens if e.speculative != "off" else 0}
        | ({"max_num_seqs": e.max_num_seqs, "max_prefill_tokens": e.max_prefill_tokens} if own else {}),
        "sampling": {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "min_p": r.min_p,
                     "repetition_penalty": r.repetition_penalty},
        "points": {"batches": sorted(config.plan.profile_batches), "contexts": sorted(config.plan.profile_contexts),
                   "steps": config.plan.profile_steps},
    }


def cache_path(config, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(config.plan.profile_dir) / f"profile-{digest}.json"


def device_name(device) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.machine()} x{os.cpu_count()}, {torch.get_num_threads()} threads per rank"


def check(profile: Any, key: dict, where: str) -> dict:
    """``profile`` if it is a profile for ``key``; a ValueError naming every difference otherwise."""
    if not isinstance(profile, dict) or not isinstance(profile.get("key"), dict) or not _entries(profile.get("tp")):
        raise ValueError(f"{where}: not a rollpacker profile (write one with python -m rollpacker.profile)")
    have = profile["key"]
    diffs = [f"{k}: profile has {have.get(k)!r}, this run {v!r}" for k, v in key.items() if have.get(k) != v]
    if diffs:
        raise ValueError(f"{where}: the profile is for another setup ({'; '.join(diffs)}); profile again with "
                         "python -m rollpacker.profile and the run's flags, or drop --plan.profile to use the "
                         "cache")
    return profile


def _entries(tps: Any) -> bool:
    """Whether ``tps`` are a profile's TP entries, each with the KV capacity and the decode and prefill curves."""
    def numbers(d: Any) -> bool:
        return isinstance(d, dict) and all(isinstance(v, (int, float)) for v in d.values())

    return isinstance(tps, dict) and all(
        isinstance(e, dict) and isinstance(e.get("kv_capacity_tokens"), int) and isinstance(e.get("decode_ms"), dict)
        and all(numbers(row) for row in e["decode_ms"].values()) and numbers(e.get("prefill_tok_s"))
        for e in tps.values())


def load(path: Path, key: dict) -> dict:
    try:
        profile = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return check(profile, key, str(path))


def measure(config, meshes, model_dir: Path, dtype, key: dict) -> dict:
    """Profile every usable TP (collective over all ranks); leaves the meshes at the TP they had."""
    import torch

    from rollpacker.model import empty_model, load_model, read_args
    from rollpacker.plan.planner import usable_tps
    from rollpacker.rollout import ENGINES, resolve_kind
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.probe import decode_step_ms, measure_spec_cost, peak_flops
    from rollpacker.rollout.torch_engine import TorchEngine

    p, device, world = config.plan, meshes.device, meshes.world_size
    args = read_args(model_dir)
    limit = (config.engine.max_model_len or args.max_position_embeddings) - p.profile_steps - 8
    if limit < 1:
        raise UserError(f"plan.profile_steps={p.profile_steps} decode steps (and 8 tokens of prompt) do not fit "
                        f"engine.max_model_len={config.engine.max_model_len or args.max_position_embeddings}: lower "
                        "plan.profile_steps or raise engine.max_model_len")
    contexts = sorted({min(c, limit) for c in p.profile_contexts})
    batches = sorted(p.profile_batches)
    avoid = set(args.eos_token_ids)
    probe_tokens = max(batches) * (max(contexts) + p.profile_steps + 8)
    out: dict[str, Any] = {"key": key, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "tp": {},
                           "peak_gflops": peak_flops(512, 5) / 1e9 if device.type == "cpu" else None}
    before = meshes.rollout_tp.size()
    r = config.rollout  # decode steps sample as the run's do
    sampling = r.sampling(stop=(), stop_token_ids=())

    slowest = functools.partial(_slowest, meshes)

    def curves(engine) -> dict[str, dict]:
        """Decode ms by context and batch, and prefill tokens/s by context, of ``engine``."""
        found: dict[str, dict] = {"decode_ms": {}, "prefill_tok_s": {}}
        for c in contexts:
            found["decode_ms"][str(c)] = {
                str(b): slowest(statistics.median(decode_step_ms(engine, b, c, args.vocab_size, avoid,
                                                                 p.profile_steps, seed=b, sampling=sampling,
                                                                 ragged=limit)))
                for b in batches}
            n = max(1, min(max(batches), 2048 // c))
            found["prefill_tok_s"][str(c)] = n * c / (slowest(_prefill_ms(engine, n, c, args.vocab_size, avoid)) / 1e3)
        return found

    kind = resolve_kind(config.engine.kind, device.type)
    if not ENGINES[kind].supports_tp_switch:  # the run's own engine at the run's TP: the planner cannot switch it
        return out | _own_engine(config, meshes, model_dir, dtype, kind, curves)
    weights = load_model(model_dir, device, dtype)
    for tp in usable_tps(world, args.num_kv_heads, p):
        meshes.set_rollout_tp(tp)
        try:
            sized = TorchEngine(empty_model(args, device, dtype), config.engine, meshes.rollout_tp)  # the run's KV
        except UserError as e:  # engine.memory_mb leaves this TP's weight shard no KV block
            raise UserError(f"the planner profiles every usable rollout TP ({usable_tps(world, args.num_kv_heads, p)})"
                            f": at TP {tp}, {e}") from None
        entry = {"kv_capacity_tokens": sized.kv_capacity_tokens,
                 "kv_bytes_per_token": 2 * args.num_layers * sized.num_kv_heads * args.head_dim * dtype.itemsize,
                 "weight_bytes": sized.weight_bytes, "decode_ms": {}, "prefill_tok_s": {}}
        if tp == before:  # the run's own engine, as its rounds poll it
            sized.update_weights(weights.named_parameters())
            out |= _exchange(config, meshes, sized, model_dir)
        del sized
        per_token = entry["kv_bytes_per_token"]
        probe = TorchEngine(empty_model(args, device, dtype), EngineConfig(
            block_size=config.engine.block_size, kv_memory_mb=max(1.0, 2 * probe_tokens * per_token / 2**20),
            max_num_seqs=max(batches), max_prefill_tokens=max(batches) * max(contexts)), meshes.rollout_tp)
        probe.update_weights(weights.named_parameters())
        entry |= curves(probe)
        if config.engine.speculative != "off":  # verify-step costs, as TorchEngine.calibrate measures them
            entry["spec"] = dataclasses.asdict(measure_spec_cost(
                probe, min(32, config.engine.max_num_seqs), config.engine.spec_max_tokens, min(128, limit // 4)))
        del probe
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out["tp"][str(tp)] = entry
    meshes.set_rollout_tp(before)
    return out


def _own_engine(config, meshes, model_dir: Path, dtype, kind: str, curves) -> dict:
    """The profile of the run's own engine (``kind``, one that cannot switch TP) at the run's TP."""
    from rollpacker.model import empty_model, read_args
    from rollpacker.rollout import build_engine

    args, tp = read_args(model_dir), meshes.rollout_tp.size()
    engine = build_engine(config.engine, model_dir, meshes.device, dtype, meshes.rollout_tp)
    out = _exchange(config, meshes, engine, model_dir)
    shapes = empty_model(args, "meta", dtype)
    entry = {"kv_capacity_tokens": engine.kv_capacity_tokens,
             "kv_bytes_per_token": 2 * args.num_layers * max(1, args.num_kv_heads // tp) * args.head_dim
             * dtype.itemsize,
             "weight_bytes": sum(p.numel() for p in shapes.parameters()) * dtype.itemsize // tp,
             **curves(engine)}
    engine.shutdown()  # last: vLLM's destroys the default process group (the planner never gets here)
    return out | {"engine": kind, "tp": {str(tp): entry}}


def _slowest(meshes, ms: float) -> float:
    """The slowest rank's time (collective): a replica is as fast as its slowest rank."""
    import torch

    t = torch.tensor([ms], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=meshes.control)
    return t.item()


def _exchange(config, meshes, engine, model_dir: Path, repeats: int = 3) -> dict[str, float]:
    """A poll's control exchange as the job makes it: ``exchange_ms`` per poll and ``exchange_request_ms``
    per request added or finished.

    Synchronous rounds of the run's P0 x R0 requests (its data's prompts, scored by its reward
    scheduler, lengths forced evenly over 1..cap so they finish poll after poll, as a run's do) run
    through the real exchange on ``engine``, ``repeats`` times each of: capped at 32 polls' tokens (or
    ``rollout.max_new_tokens``), at a quarter of that, and at a quarter with a quarter of the prompts
    (so polls and requests vary apart), after one round warming up. Each round's
    seconds of polls less their slowest replica's engine steps (:class:`~rollpacker.metrics.Phases`:
    the command, the reports, rank 0's round and scoring) are fitted as ``polls x per poll + (adds +
    finishes) x per request``. Exchanged empty in a tight loop, without engine steps between, a poll
    took half as long as the job's."""
    import numpy as np
    from transformers import AutoTokenizer

    from rollpacker.controller import encode, reward_scheduler
    from rollpacker.data.dataset import PromptSampler, fit_rows, load_rows
    from rollpacker.exchange import RoundLeader, run_round
    from rollpacker.schedule.sync import SyncPolicy

    r, rank0 = config.rollout, meshes.rank == 0
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def prompt(row: dict) -> list[int]:
        return encode(tokenizer, config, row["prompt"])

    long = min(32 * r.poll_steps, r.max_new_tokens)  # what the run's rows fit in
    rows = fit_rows(load_rows(config.data)[:4 * r.num_prompts], prompt, engine.max_model_len,
                    engine.kv_capacity_tokens, long)
    scorer = reward_scheduler(config, tokenizer, meshes.device) if rank0 else None
    seen = []  # (polls, requests added and finished, seconds)
    short = max(1, long // 4)
    shapes = [(short, r.num_prompts), (long, r.num_prompts), (short, max(1, r.num_prompts // 4))]
    for i, (cap, prompts) in enumerate(shapes[:1] + shapes * repeats):  # polls and requests vary apart
        policy = SyncPolicy(PromptSampler(len(rows), i), prompts, r.group_size)
        sampling = r.sampling(max_new_tokens=cap, stop=(), stop_token_ids=())
        leader = RoundLeader(policy=policy, rows=rows, encode=prompt, rewards=scorer, sampling=sampling,
                             lengths=_Spread(cap))
        result = run_round(meshes, engine, r.poll_steps, leader.round(i, policy.start_round(i)) if rank0 else None)
        if result is not None and i:
            seen.append((len(result.running_trace) + 1, 2 * result.num_launched,  # the final command's poll too
                         result.phases.exchange + result.phases.idle))
    if scorer:
        scorer.close()
    fit = np.zeros(2)
    if seen:
        counts, seconds = np.array([s[:2] for s in seen], dtype=float), np.array([s[2] for s in seen])
        fit = np.linalg.lstsq(counts, seconds, rcond=None)[0]
        if fit.min() < 0:  # one term alone, the other 0 (the better of the two)
            alone = [np.eye(2)[j] * seconds.sum() / counts[:, j].sum() for j in (0, 1)]
            fit = min(alone, key=lambda f: float(((counts @ f - seconds) ** 2).sum()))
    return {"exchange_ms": _slowest(meshes, 1e3 * fit[0]), "exchange_request_ms": _slowest(meshes, 1e3 * fit[1])}


@dataclass(frozen=True)
class _Spread:
    """Forced response lengths (:attr:`~rollpacker.exchange.RoundLeader.lengths`) spread evenly over
    1..``cap`` by request id."""

    cap: int

    def turn(self, turn, row: int) -> int:
        return 1 + zlib.crc32(turn.id.encode()) % self.cap


def _prefill_ms(engine, num: int, context: int, vocab_size: int, avoid: set[int]) -> float:
    """ms of one prefill step of ``num`` prompts of ``context`` tokens (after an untimed one)."""
    from rollpacker.rollout.engine import Request, SamplingParams
    from rollpacker.rollout.probe import random_prompts

    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    times = []
    for rep in range(2):
        prompts = random_prompts(num, context, vocab_size, avoid, seed=rep)
        reqs = [Request(id=f"prefill-{rep}-{i}", prompt_ids=q, params=params) for i, q in enumerate(prompts)]
        for r in reqs:
            engine.add(r)
        start = time.perf_counter()
        engine.step()
        times.append(1e3 * (time.perf_counter() - start))
        for r in reqs:
            engine.abort(r.id)
    return times[-1]


def obtain(config, meshes, model_dir: Path, dtype) -> dict:
    """The profile for this run (collective): ``plan.profile`` if it matches and holds every TP the planner may
    pick, else the cached one, else a fresh one, measured now and cached. Every rank gets rank 0's."""
    from rollpacker.model import read_args
    from rollpacker.plan.planner import usable_tps

    key = profile_key(config, model_dir, device_name(meshes.device), meshes.world_size, dtype)
    usable = usable_tps(meshes.world_size, read_args(model_dir).num_kv_heads, config.plan)
    found: Any = None
    if meshes.rank == 0:
        path = Path(config.plan.profile) if config.plan.profile else cache_path(config, key)
        try:
            if config.plan.profile and not path.is_file():
                raise ValueError(f"{path}: no such file (plan.profile: write one with python -m rollpacker.profile "
                                 "and the run's flags, or leave plan.profile out to profile now)")
            found = load(path, key) if path.is_file() else None
            missing = [tp for tp in usable if found is not None and str(tp) not in found["tp"]]
            if missing:  # measured under another plan.max_tp or node size: the planner would pick one unmeasured
                raise ValueError(f"{path}: the profile holds TPs {sorted(map(int, found['tp']))}, not {missing}, "
                                 f"which this run may pick ({usable}: plan.max_tp, the node's size); profile again "
                                 "with python -m rollpacker.profile and the run's flags, or set plan.max_tp")
        except (ValueError, OSError) as e:
            found = e if config.plan.profile else None  # a stale cache entry is measured again
            if not config.plan.profile:
                logger.warning("plan: ignoring the cached profile %s (%s); profiling again", path, e)
    found = meshes.broadcast(found)
    if isinstance(found, Exception):
        raise UserError(str(found))
    if found is not None:
        return found
    if meshes.rank == 0:
        logger.info("plan: no profile for this setup; profiling every rollout TP first")
    profile = measure(config, meshes, model_dir, dtype, key)
    if meshes.rank == 0:
        save(profile, cache_path(config, key))
        say_noisy(profile)
    return meshes.broadcast(profile)


def save(profile: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # one of its own: another run may be saving this profile too
    tmp.write_text(json.dumps(profile, indent=1) + "\n")
    tmp.replace(path)  # never a half-written profile


FALLING = 0.8
"""A decode step this share of a smaller batch's, or less, at a larger batch: measured on a busy machine."""


def say_noisy(profile: dict) -> None:
    """Warn once when a TP's decode times fall as the batch grows (they rise, on a machine doing nothing else):
    the planner's estimates from such a profile are noise."""
    falls = [f"TP {tp} context {c}: batch {a} {row[a]:.1f} ms, batch {b} {row[b]:.1f} ms"
             for tp, e in profile["tp"].items() for c, row in e["decode_ms"].items()
             for a, b in zip(sorted(row, key=int), sorted(row, key=int)[1:]) if row[b] <= FALLING * row[a]]
    if falls:
        logger.warning("plan: the profile's decode step times fall as the batch grows (%s%s): it was measured on a "
                       "busy machine, and the planner's estimates from it are noise; profile again on an idle one",
                       "; ".join(falls[:3]), f"; {len(falls) - 3} more" if len(falls) > 3 else "")


def summary(profile: dict) -> str:
    lines = [f"profile of {profile['key']['device']}, world {profile['key']['world']}:"]
    for tp, e in profile["tp"].items():
        curve = "; ".join(f"ctx {c}: " + ", ".join(f"{b}->{ms:.1f}" for b, ms in row.items())
                          for c, row in e["decode_ms"].items())
        lines.append(f"  TP {tp}: KV capacity {e['kv_capacity_tokens']} tokens/replica "
                     f"({e['kv_bytes_per_token']} B/token/rank); decode ms by batch: {curve}")
    return "\n".join(lines)
