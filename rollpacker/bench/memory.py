"""``python -m rollpacker.bench memory``: the memory plan's training peak against real training steps.

Each case builds a random native decoder (three sizes, the largest 124M parameters), shards it with
FSDP2 on 1 or 2 gloo ranks, and runs two real trainer steps (a small one that creates AdamW's
state, then the measured one: one micro-batch of the case's sequences), with activation
checkpointing off, full or selective. Each case runs in processes of its own.

**How CPU memory is measured.** torch 2.13 has no CPU counterpart of
``torch.cuda.max_memory_allocated``. ``torch.profiler.profile(profile_memory=True)`` records every
allocation and free of the CPU allocator (c10's profiled memory reporter), each carrying the total
allocated since profiling began; everything here is allocated inside the profile (the model is
built on the meta device first), so the largest total during the measured step is its peak
(``peak``), and the total when it starts is the state it starts from (``before``: parameters and
optimizer state). The plan's number is :func:`rollpacker.plan.memory.train_phase` for the same shapes
with CPU's settings (fp32, the torch log-prob head, the optimizer one tensor at a time), without
the GPU-only allowances. ``activations`` is ``peak - before``, measured and planned.

The last line is JSON: ``plan_max_rel_error`` (the largest ``|plan - measured| / measured`` of the
peaks), the checkpointing factor measured and planned, and the rows.
"""

from __future__ import annotations

import json
import os
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
    checkpointing: str = "none"
    world: int = 1
    ac_part: str = "block"

    @property
    def name(self) -> str:
        ac = self.checkpointing + (f"/{self.ac_part}" if self.checkpointing == "selective" else "")
        return f"{self.model} {len(self.seq_lens)}x{self.seq_lens[0]} ac={ac} ranks={self.world}"


CASES = (
    Case("5M", (512,) * 2),
    Case("5M", (512,) * 2, "full"),
    Case("5M", (2048,)),
    Case("5M", (2048,), "full"),
    Case("33M", (512,) * 2, world=2),
    Case("33M", (512,) * 2, "full", world=2),
    Case("33M", (256,) * 4, "selective", world=2, ac_part="mlp"),
    Case("125M", (256,)),
    Case("125M", (256,), "full"),
    Case("125M", (128,), world=2),
)


def model_config(case: Case) -> dict:
    return dict(model_type="qwen2", max_position_embeddings=4096, **MODELS[case.model])


def planned(case: Case) -> dict[str, float]:
    """The plan's peak and state-at-start for ``case`` (CPU settings)."""
    from rollpacker.plan.memory import Shape, TrainSetup, train_phases

    setup = TrainSetup(shard_size=case.world, seq_lens=case.seq_lens, response_tokens=sum(case.seq_lens) // 2,
                       compute_bytes=4, checkpointing=case.checkpointing, ac_every=2, ac_part=case.ac_part,
                       head="torch", foreach=False, micro_batches=1, gloo=True)
    phases = train_phases(Shape.from_hf(model_config(case)), setup)
    before = sum(t.bytes for t in phases[0].terms if t.name.startswith(("parameters", "optimizer")))
    peak = max(phases, key=lambda p: p.total)
    return {"peak": peak.total, "before": before, "phase": peak.name}


def worker(case: Case) -> dict[str, float]:
    """On every rank: two real steps under the profiler; this rank's measured bytes."""
    import torch
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    from rollpacker.dist import build_meshes
    from rollpacker.model import ModelArgs, Transformer
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Sample, Trainer

    meshes = build_meshes(rollout_tp=1, train_shard_size=0)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_hf(model_config(case)))
    cfg = TrainConfig(lr=1e-4, warmup_steps=0, micro_batch_tokens=sum(case.seq_lens),
                      activation_checkpointing=case.checkpointing, ac_every=2, ac_part=case.ac_part)
    g = torch.Generator().manual_seed(meshes.rank)
    vocab = model.args.vocab_size

    def samples(lengths):  # half prompt, half response: every rank gets the same batch
        return [Sample(torch.randint(0, vocab, (n // 2,), generator=g).tolist(),
                       torch.randint(0, vocab, (n - n // 2,), generator=g).tolist(), 1.0, [-1.0] * (n - n // 2))
                for lengths_ in [lengths] for n in lengths_]

    warmup, measured = samples([16] * case.world), samples(list(case.seq_lens) * case.world)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model.to_empty(device="cpu")
        model.init_weights()
        trainer = Trainer(model, cfg, meshes.train, num_steps=2)
        trainer.step(warmup)
        with record_function("measured_step"):
            trainer.step(measured)
    window, allocations = None, []

    def walk(node):
        nonlocal window
        if node.tag == _EventType.Allocation:
            allocations.append((node.start_time_ns, node.extra_fields.total_allocated))
        elif node.name == "measured_step":
            window = (node.start_time_ns, node.end_time_ns)
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    allocations.sort()
    before = next((total for t, total in reversed(allocations) if t < window[0]), 0)
    peak = max(total for t, total in allocations if window[0] <= t <= window[1])
    tensors = [*trainer.model.parameters(), *(v for st in trainer.optimizer.state.values() for v in st.values())]
    state = sum(t.to_local().untyped_storage().nbytes() if hasattr(t, "to_local") else t.untyped_storage().nbytes()
                for t in tensors)
    return {"peak": peak, "before": before, "after": allocations[-1][1], "state": state}


def run_case(case: Case) -> list[dict[str, float]]:
    """``case`` in fresh processes (torchrun for 2 ranks): each rank's measurement."""
    cmd = [sys.executable, "-m", "rollpacker.bench.memory", "--worker", json.dumps(asdict(case))]
    if case.world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={case.world}",
               "-m", "rollpacker.bench.memory", "--worker", json.dumps(asdict(case))]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env | {"OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise RuntimeError(f"bench memory: {case.name} failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line.removeprefix("MEASURED ")) for line in proc.stdout.splitlines()
            if line.startswith("MEASURED ")]


def corrected(m: dict[str, float]) -> dict[str, float]:
    """A rank's measurement less the frees the profiler missed before the step (see the docstring)."""
    missed = m["before"] - m["state"]
    return {"peak": m["peak"] - missed, "before": m["state"]}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        raw = json.loads(argv[1])
        case = Case(**{**raw, "seq_lens": tuple(raw["seq_lens"])})
        print("MEASURED " + json.dumps(worker(case)), flush=True)
        return
    names = [a for a in argv if not a.startswith("-")]
    cases = [c for c in CASES if not names or c.model in names]
    start = time.time()
    rows = []
    print(f"{'case':<40} {'measured GB':>12} {'plan GB':>9} {'error':>7} {'acts measured':>14} {'acts plan':>10}")
    for case in cases:
        t0 = time.time()
        measured = max((corrected(m) for m in run_case(case)), key=lambda m: m["peak"])
        plan = planned(case)
        err = (plan["peak"] - measured["peak"]) / measured["peak"]
        row = {"case": case.name, "measured_gb": measured["peak"] / 1e9, "plan_gb": plan["peak"] / 1e9,
               "rel_error": err, "activations_measured_gb": (measured["peak"] - measured["before"]) / 1e9,
               "activations_plan_gb": (plan["peak"] - plan["before"]) / 1e9, "phase": plan["phase"],
               "seconds": round(time.time() - t0, 1)}
        rows.append(row)
        print(f"{case.name:<40} {row['measured_gb']:>12.3f} {row['plan_gb']:>9.3f} {100 * err:>6.1f}% "
              f"{row['activations_measured_gb']:>14.3f} {row['activations_plan_gb']:>10.3f}  {plan['phase']} "
              f"({row['seconds']:.0f} s)", flush=True)
    print(json.dumps({"plan_max_rel_error": round(max(abs(r["rel_error"]) for r in rows), 4),
                      "seconds": round(time.time() - start, 1), "rows": rows}))


if __name__ == "__main__":
    main()
