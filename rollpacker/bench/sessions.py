"""``python -m rollpacker.bench sessions``: TorchEngine's resident sessions on the toy model: episodes whose
turns prefill their whole conversation against turns that prefill only what is new, side by side in one run.

Workload: ``episodes`` episodes of ``turns`` turns on one engine, every episode's turn of one index at
once (a synchronous agentic step). Each turn samples ``new_tokens`` tokens (seeded, EOS ignored, the
default job's temperature); the environment answers ``obs_tokens`` tokens, which with the turn's prompt and
response make the next turn's prompt (so the context grows by ``new_tokens + obs_tokens`` a turn).
Modes, on the same episodes and seeds:

- ``scratch``: no session: every turn prefills its whole context (today's behaviour of every request);
- ``resident``: each turn names its episode (``Request.session``): the next turn prefills only its last
  response token and the observation.

Each mode runs ``repeats`` times, alternating; the fastest counts (a shared machine). Per mode: wall and
CPU seconds (this process: the engine runs one thread), prefill tokens computed and reused, sessions
evicted. The last line is JSON: ``rollout_speedup_resident`` (wall), ``rollout_speedup_resident_cpu``,
``prefill_tokens_ratio`` (computed by ``resident`` over ``scratch``), ``tokens_changed`` (must be 0),
``logprob_max_diff``, ``session_evictions``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

PROG = "python -m rollpacker.bench sessions"


@dataclass(kw_only=True)
class SessionsBenchConfig:
    episodes: int = 16
    """Episodes on the engine at once."""
    turns: int = 6
    """Turns per episode."""
    prompt_tokens: int = 64
    """Tokens of an episode's first prompt."""
    new_tokens: int = 32
    """Tokens each turn samples."""
    obs_tokens: int = 48
    """Tokens of each observation."""
    kv_memory_mb: float = 256.0
    """engine.kv_memory_mb: small values make the engine evict sessions."""
    repeats: int = 2
    """Timed runs per mode, alternating; the fastest counts."""
    num_threads: int = 1
    """torch threads (the default job: one per rank)."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("episodes", "turns", "prompt_tokens", "new_tokens", "obs_tokens", "repeats", "num_threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"bench.{name} must be positive, got {getattr(self, name)}")


def episodes(engine, cfg: SessionsBenchConfig, keep: bool) -> tuple[dict, float, float]:
    """Run every episode to its last turn: outputs by request id, wall and CPU seconds."""
    from rollpacker.rollout.config import RolloutConfig
    from rollpacker.rollout.engine import Request, SamplingParams, generate
    from rollpacker.rollout.probe import random_prompts

    vocab, eos = engine.model.args.vocab_size, set(engine.eos_ids)
    prompts = random_prompts(cfg.episodes, cfg.prompt_tokens, vocab, eos, cfg.seed)
    observations = random_prompts(cfg.episodes * cfg.turns, cfg.obs_tokens, vocab, eos, cfg.seed + 1)
    temperature, outputs = RolloutConfig().temperature, {}
    start, start_cpu = time.perf_counter(), time.process_time()
    for turn in range(cfg.turns):
        reqs = [Request(id=f"e{e}t{turn}", prompt_ids=p, session=f"e{e}" if keep else None, params=SamplingParams(
            max_new_tokens=cfg.new_tokens, temperature=temperature, seed=cfg.seed * 100_003 + e * 101 + turn,
            ignore_eos=True)) for e, p in enumerate(prompts)]
        done = generate(engine, reqs)
        outputs |= done
        prompts = [p + done[f"e{e}t{turn}"].token_ids + observations[e * cfg.turns + turn]
                   for e, p in enumerate(prompts)]
    for e in range(cfg.episodes):
        engine.end_session(f"e{e}")
    return outputs, time.perf_counter() - start, time.process_time() - start_cpu


def run(cfg: SessionsBenchConfig) -> dict:
    import torch

    from rollpacker.model import load_model
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.torch_engine import TorchEngine
    from rollpacker.toy.model import toy_model_dir

    torch.set_num_threads(cfg.num_threads)
    path = toy_model_dir()
    print(f"{PROG}: {cfg.episodes} episodes x {cfg.turns} turns, {cfg.prompt_tokens} prompt + {cfg.turns} x "
          f"({cfg.new_tokens} sampled + {cfg.obs_tokens} observed) tokens, toy model on cpu", flush=True)
    best: dict[str, tuple] = {}
    for _ in range(cfg.repeats):
        for mode in ("scratch", "resident"):
            engine = TorchEngine(load_model(path), EngineConfig(kv_memory_mb=cfg.kv_memory_mb))
            outputs, wall, cpu = episodes(engine, cfg, keep=mode == "resident")
            if mode not in best or wall < best[mode][1]:
                best[mode] = (outputs, wall, cpu, engine.stats())
    for mode, (_, wall, cpu, stats) in best.items():
        print(f"  {mode:9s} total {wall:7.2f}s (cpu {cpu:6.2f}s)  prefill tokens computed {stats.num_prefill_tokens:7d}"
              f"  reused {stats.num_reused_prefill_tokens:7d}  sessions evicted {stats.num_session_evictions}")
    (base, wall0, cpu0, stats0), (res, wall1, cpu1, stats1) = best["scratch"], best["resident"]
    changed = sum(sum(x != y for x, y in zip(o.token_ids, res[k].token_ids)) + abs(len(o.token_ids) -
                  len(res[k].token_ids)) for k, o in base.items())
    diff = max(abs(a - b) for k, o in base.items() for a, b in zip(o.logprobs, res[k].logprobs))
    return {"rollout_speedup_resident": round(wall0 / wall1, 3), "rollout_speedup_resident_cpu": round(cpu0 / cpu1, 3),
            "prefill_tokens_ratio": round(stats1.num_prefill_tokens / stats0.num_prefill_tokens, 3),
            "tokens_changed": changed, "logprob_max_diff": float(f"{diff:.2e}"),
            "session_evictions": stats1.num_session_evictions}


def main(argv: list[str] | None = None) -> None:
    import tyro

    cfg = tyro.cli(SessionsBenchConfig, args=sys.argv[1:] if argv is None else argv, prog=PROG,
                   description=__doc__.splitlines()[0])
    print(json.dumps(run(cfg)), flush=True)
