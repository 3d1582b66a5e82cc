"""``python -m rollpacker.bench memory [MODEL ...] [--device cuda]``: the memory plan's training peak against
real steps.

Each case builds a random native decoder (5M, 33M or 125M parameters), shards it with FSDP2 on 1
or 2 gloo ranks, and measures the peak of a real trainer step. It compares that with
:func:`rollpacker.plan.memory.train_phases` for the same shapes and the device's settings. The
last line is JSON (``plan_max_rel_error``, the checkpointing factor, the rows).

Invariants:

- Each case runs in fresh processes. A first step creates AdamW's state; the second is measured.
- On CPU the profiler's peak is corrected by the drift of frees it cannot see.
- A case of several ranks runs ``REPEATS`` times and keeps the lowest peak of any rank: skew between
  the ranks only adds (the leading rank holds reduce-scatter buffers until the other catches up).
- On a GPU only the one-rank cases run.

Why: no GPU was lent, so the plan's formulae are checked where the same code runs, in fp32 on CPU.
How memory is measured: ``docs/memory.md``; the keys: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

MODELS = {
    "5M": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=688, vocab_size=4096),
    "33M": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
                intermediate_size=1376, vocab_size=16384),
    "125M": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=32000),
}
"""Random Qwen2-shaped decoders (qkv biases, untied head), by parameter count."""


@dataclass(frozen=True)
class Case:
    model: str
    seq_lens: tuple[int, ...]
    """One micro-batch's sequences on each rank (half prompt, half response)."""
    checkpointing: str = "none"
    world: int = 1
    ac_part: str = "block"
    micro_batches: int = 1
    reduce_every: bool = False
    critic: bool = False
    """PPO's critic (train.advantage gae) trains beside the policy."""

    @property
    def name(self) -> str:
        ac = self.checkpointing + (f"/{self.ac_part}" if self.checkpointing == "selective" else "")
        every = " reduce-every" if self.reduce_every else ""
        micro = f" x{self.micro_batches}{every}" if self.micro_batches > 1 else ""
        critic = " critic" if self.critic else ""
        return f"{self.model} {len(self.seq_lens)}x{self.seq_lens[0]}{micro}{critic} ac={ac} ranks={self.world}"


CASES = (
    Case("5M", (512,) * 2),
    Case("5M", (512,) * 2, "full"),
    Case("5M", (2048,)),
    Case("5M", (2048,), "full"),
    Case("33M", (512,) * 2, "full", world=2),
    Case("33M", (256,) * 4, "selective", world=2, ac_part="mlp"),
    Case("33M", (512,), world=2, micro_batches=2),
    Case("33M", (512,), world=2, micro_batches=2, reduce_every=True),
    Case("125M", (256,)),
    Case("125M", (128,), world=2),
    Case("5M", (512,) * 2, critic=True),
    Case("33M", (512,), world=2, micro_batches=2, critic=True),
)
FACTOR_CASES = (CASES[2], CASES[3])
"""Checkpointing off and full at 2048 tokens: the factor by which full checkpointing shrinks activations."""
REPEATS = 3
"""Runs of a case of several ranks: on a loaded machine one run measured up to 16% over the plan."""


def model_config(case: Case) -> dict:
    return dict(model_type="qwen2", max_position_embeddings=4096, **MODELS[case.model])


def planned(case: Case, device: str = "cpu") -> dict:
    """The plan's peak, its phase and the state at the step's start for ``case`` (the device's settings)."""
    from rollpacker.plan.memory import Shape, TrainSetup, train_phases

    cuda = device == "cuda"
    setup = TrainSetup(shard_size=case.world, seq_lens=case.seq_lens, response_tokens=sum(case.seq_lens) // 2,
                       compute_bytes=2 if cuda else 4, checkpointing=case.checkpointing, ac_every=2,
                       ac_part=case.ac_part, head="fused" if cuda else "torch", foreach=cuda,
                       micro_batches=case.micro_batches, reduce_every=case.reduce_every, gloo=not cuda,
                       critic=case.critic)
    phases = train_phases(Shape.from_hf(model_config(case)), setup)
    before = sum(t.bytes for t in phases[0].terms if t.name.startswith(("parameters", "optimizer", "critic param")))
    peak = max(phases, key=lambda p: p.total)
    return {"peak": peak.total, "before": before, "phase": peak.name}


def cuda_worker(case: Case) -> dict[str, float]:
    """On a GPU: two real steps, the second measured by the CUDA allocator."""
    import torch

    from rollpacker.train.losses import normalizer
    from rollpacker.train.trainer import Trainer

    meshes, model, critic, cfg, batches = setup(case)
    for m in (model, critic) if critic else (model,):
        m.to_empty(device=meshes.device)
        m.init_weights()
    trainer = Trainer(model, cfg, meshes.train, critic=critic, num_steps=2)
    for batch in batches:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        trainer.step(batch, normalizer(cfg.aggregation, [len(s.response_ids) for s in batch], max(case.seq_lens)))
    torch.cuda.synchronize()
    return {"peak": torch.cuda.max_memory_allocated(), "before": before, "missed_frees": 0}


def setup(case: Case):
    """This rank's meshes, ``case``'s model (and critic, or None) on the meta device, its training config, and
    its two batches (identical on every rank): a small one that creates AdamW's state, then the measured one."""
    import torch

    from rollpacker.dist import build_meshes
    from rollpacker.model import ModelArgs, Transformer
    from rollpacker.model.parallelize import with_value_head
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Sample

    meshes = build_meshes(rollout_tp=1, train_shard_size=0)
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_hf(model_config(case)))
        critic = with_value_head(Transformer(ModelArgs.from_hf(model_config(case)))) if case.critic else None
    cfg = TrainConfig(lr=1e-4, warmup_steps=0, micro_batch_tokens=sum(case.seq_lens),
                      activation_checkpointing=case.checkpointing, ac_every=2, ac_part=case.ac_part,
                      reduce_every_micro_batch=case.reduce_every, advantage="gae" if case.critic else "grpo")
    g = torch.Generator().manual_seed(0)

    def samples(lengths: list[int]) -> list[Sample]:
        token = lambda n: torch.randint(0, model.args.vocab_size, (n,), generator=g).tolist()  # noqa: E731
        return [Sample(token(n // 2), token(n - n // 2), 1.0, [-1.0] * (n - n // 2)) for n in lengths]

    batches = samples([16] * case.world), samples(list(case.seq_lens) * case.world * case.micro_batches)
    torch.manual_seed(0)
    return meshes, model, critic, cfg, batches


def worker(case: Case) -> dict[str, float]:
    """On every rank: two real steps under the profiler; this rank's peak, corrected (see the docstring)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    from rollpacker.train.losses import normalizer
    from rollpacker.train.trainer import Trainer

    meshes, model, critic, cfg, (warmup, measured) = setup(case)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for m in (model, critic) if critic else (model,):
            m.to_empty(device="cpu")
            m.init_weights()
        trainer = Trainer(model, cfg, meshes.train, critic=critic, num_steps=2)
        for name, batch in (("warmup_step", warmup), ("measured_step", measured)):
            with record_function(name):
                lengths = [len(s.response_ids) for s in batch]
                trainer.step(batch, normalizer(cfg.aggregation, lengths, max(case.seq_lens)))
    window, totals = None, []

    def walk(node) -> None:
        nonlocal window
        if node.tag == _EventType.Allocation:
            totals.append((node.start_time_ns, node.extra_fields.total_allocated))
        elif node.name == "measured_step":
            window = (node.start_time_ns, node.end_time_ns)
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    totals.sort()
    before = next(total for t, total in reversed(totals) if t < window[0])
    peak = max(total for t, total in totals if window[0] <= t <= window[1])
    trained = [(trainer.model, trainer.optimizer), (trainer.critic, trainer.critic_optimizer)]
    state = [t for m, opt in trained if m is not None
             for t in (*m.parameters(), *(v for s in opt.state.values() for v in s.values()))]
    state_bytes = sum((t.to_local() if hasattr(t, "to_local") else t).untyped_storage().nbytes() for t in state)
    return {"peak": peak - (before - state_bytes), "before": state_bytes, "missed_frees": before - state_bytes}


def run_case(case: Case, device: str = "cpu") -> dict[str, float]:
    """``case`` in fresh processes (torchrun for 2 ranks) on ``device``: of its runs' ranks, the measurement
    with the lowest peak (every rank plans the same; see the docstring)."""
    cmd = [sys.executable, "-m", "rollpacker.bench.memory", "--worker", json.dumps(asdict(case)), device]
    if case.world > 1:
        cmd[1:2] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={case.world}", "-m"]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
    env |= {"OMP_NUM_THREADS": "1", "ROLLPACKER_DEVICE": "cpu" if device == "cpu" else "auto"}
    ranks = []
    for _ in range(REPEATS if case.world > 1 else 1):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            raise RuntimeError(f"bench memory: {case.name} failed:\n{proc.stderr[-4000:]}")
        decoder = json.JSONDecoder()  # each rank's object after its marker, whatever another rank wrote after it
        ranks += [decoder.raw_decode(part)[0] for part in proc.stdout.split("MEASURED ")[1:]]
    return min(ranks, key=lambda m: m["peak"])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        from rollpacker.dist import exit_process

        raw = json.loads(argv[1])
        case = Case(**{**raw, "seq_lens": tuple(raw["seq_lens"])})
        measured = json.dumps((cuda_worker if argv[2] == "cuda" else worker)(case))
        sys.stdout.write(f"MEASURED {measured}\n")  # one write: the ranks share the pipe
        exit_process(0)
    usage = f"usage: python -m rollpacker.bench memory [{' '.join(MODELS)}] [--device cpu|cuda]"
    if {"-h", "--help"} & set(argv):
        print(f"{usage}\n\n{__doc__.strip()}")
        return
    device = "cpu"
    if "--device" in argv:
        i = argv.index("--device")
        device, argv = (argv[i + 1:i + 2] or ["?"])[0], argv[:i] + argv[i + 2:]
    unknown = [a for a in argv if a not in MODELS]
    if unknown or device not in ("cpu", "cuda"):
        sys.exit(f"{usage}: unknown {unknown or device}")
    import torch

    gpus = torch.cuda.device_count() if device == "cuda" else 0
    start = time.time()
    print(f"{'case':<44} {'measured GB':>11} {'plan GB':>8} {'error':>7} {'activations':>11} {'planned':>8}  "
          "plan's peak phase")
    rows = {}
    for case in (c for c in CASES if (not argv or c.model in argv) and (device == "cpu" or c.world <= gpus)):
        measured, plan = run_case(case, device), planned(case, device)
        rows[case] = row = {
            "case": case.name, "measured_gb": measured["peak"] / 1e9, "plan_gb": plan["peak"] / 1e9,
            "rel_error": (plan["peak"] - measured["peak"]) / measured["peak"],
            "activations_measured_gb": (measured["peak"] - measured["before"]) / 1e9,
            "activations_plan_gb": (plan["peak"] - plan["before"]) / 1e9, "plan_phase": plan["phase"],
            "missed_frees_gb": measured["missed_frees"] / 1e9}
        print(f"{case.name:<44} {row['measured_gb']:>11.3f} {row['plan_gb']:>8.3f} {100 * row['rel_error']:>6.1f}% "
              f"{row['activations_measured_gb']:>11.3f} {row['activations_plan_gb']:>8.3f}  {plan['phase']}",
              flush=True)
    if not rows:
        sys.exit(f"bench memory: no case of {' '.join(argv) or 'any model'} runs on {device} with {gpus} GPU(s) "
                 "(on CUDA a case needs a GPU per rank)")
    summary = {"device": device, "plan_max_rel_error": round(max(abs(r["rel_error"]) for r in rows.values()), 4)}
    if all(c in rows for c in FACTOR_CASES):
        off, full = (rows[c] for c in FACTOR_CASES)
        for key in ("measured", "plan"):
            ratio = full[f"activations_{key}_gb"] / off[f"activations_{key}_gb"]
            summary[f"checkpointing_factor_{key}"] = round(ratio, 4)
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    summary |= {"seconds": round(time.time() - start, 1), "cpu_seconds": round(cpu.ru_utime + cpu.ru_stime, 1),
                "rows": list(rows.values())}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
