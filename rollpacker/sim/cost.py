"""The cost model: seconds per engine iteration, prefill, training step and weight sync, from a roofline.

One module for the simulator and the parallelism planner. :class:`Hardware` holds data-sheet
figures, :class:`ModelShape` a decoder's shape, and :class:`Calibration` the efficiencies and
overheads no data sheet gives. :class:`CostModel` prices an iteration as the larger of its memory
and compute time, plus prefill, fixed overheads and TP all-reduces.

Invariants:

- Every constant is a named field, and none is fitted to the paper's Table 2.
- :func:`fit_calibration` refits the overheads and the decode efficiency from a measured decode curve.
- :class:`ProfiledCost` uses a measured profile in place of the roofline.

Why a roofline: it scales to clusters we cannot run, with few enough constants to check one by
one. The formula and where each default comes from: ``docs/simulator.md`` (The cost model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from rollpacker.model.args import head_dim, tied_embeddings
from rollpacker.rollout.spec_cost import SpecCost

GB = 1e9
BF16 = 2
TRAIN_PASSES = 6
"""Forward passes' worth of FLOPs per trained token: old and reference log-probs (1 + 1), then the
update's forward, recomputed forward (activation checkpointing) and backward (1 + 1 + 2)."""
CRITIC_PASSES = 5
"""What PPO's critic adds (``train.advantage gae``): its values before the step (1), then its forward,
recomputed forward and backward (1 + 1 + 2); its one-row head costs nothing beside the blocks."""


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    hbm_bytes: float
    """HBM capacity per GPU."""
    hbm_bw: float
    """HBM bandwidth per GPU, bytes/s."""
    flops: float
    """Dense bf16 FLOP/s per GPU."""
    nvlink_bw: float
    """NVLink bandwidth per GPU and direction, bytes/s."""
    net_bw: float
    """Network bandwidth per GPU between nodes, bytes/s."""
    gpus_per_node: int = 8


HARDWARE = {
    "H800": Hardware(name="H800", hbm_bytes=80 * GB, hbm_bw=3.35e12, flops=989e12, nvlink_bw=200 * GB,
                     net_bw=50 * GB),
    "H100": Hardware(name="H100", hbm_bytes=80 * GB, hbm_bw=3.35e12, flops=989e12, nvlink_bw=450 * GB,
                     net_bw=50 * GB),
    "H200": Hardware(name="H200", hbm_bytes=141 * GB, hbm_bw=4.8e12, flops=989e12, nvlink_bw=450 * GB,
                     net_bw=50 * GB),
}


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool = False

    @property
    def matmul_params(self) -> int:
        """Weights of every matmul one token goes through: q/k/v/o, MLP, LM head."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = 2 * h * q + 2 * h * kv + 3 * h * self.intermediate_size
        return self.num_layers * per_layer + self.vocab_size * h

    @property
    def num_params(self) -> int:
        embedding = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.matmul_params + embedding

    @property
    def weight_bytes(self) -> float:
        return BF16 * self.num_params

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * BF16

    def attention_flops(self, context: float) -> float:
        """q.k and p.v FLOPs of one token attending to ``context`` keys, all layers."""
        return 4 * self.num_layers * self.num_heads * self.head_dim * context

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelShape:
        """The shape in a Hugging Face ``config.json`` (or the directory holding it)."""
        path = Path(path)
        path = path / "config.json" if path.is_dir() else path
        c = json.loads(path.read_text())
        heads = c["num_attention_heads"]
        return cls(name=c.get("_name_or_path") or path.parent.name, num_layers=c["num_hidden_layers"],
                   hidden_size=c["hidden_size"], num_heads=heads, num_kv_heads=c.get("num_key_value_heads", heads),
                   head_dim=head_dim(c), intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"],
                   tied_embeddings=tied_embeddings(c))


MODELS = {
    "qwen2.5-7b": ModelShape(name="qwen2.5-7b", num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4,
                             head_dim=128, intermediate_size=18944, vocab_size=152064),
    "qwen2.5-14b": ModelShape(name="qwen2.5-14b", num_layers=48, hidden_size=5120, num_heads=40, num_kv_heads=8,
                              head_dim=128, intermediate_size=13824, vocab_size=152064),
    "qwen2.5-32b": ModelShape(name="qwen2.5-32b", num_layers=64, hidden_size=5120, num_heads=40, num_kv_heads=8,
                              head_dim=128, intermediate_size=27648, vocab_size=152064),
}


@dataclass(frozen=True, kw_only=True)
class Calibration:
    hbm_efficiency: float = 0.75
    """Fraction of HBM bandwidth decode achieves streaming weights and KV."""
    decode_flops_efficiency: float = 0.5
    """Fraction of peak FLOP/s of decode matmuls when compute-bound (large batches)."""
    prefill_flops_efficiency: float = 0.55
    """Fraction of peak FLOP/s of prefill (and recompute after preemption)."""
    step_overhead_s: float = 3e-3
    """Fixed cost of every engine iteration: scheduling, sampling launch, Python."""
    seq_overhead_s: float = 2e-5
    """Extra cost per running request per iteration (sampling, bookkeeping)."""
    allreduce_latency_s: float = 1e-5
    """Latency of one TP all-reduce (two per layer per iteration)."""
    memory_utilization: float = 0.8
    """Share of HBM the engine may use for weights and KV cache."""
    activation_reserve_gb: float = 3.0
    """HBM per GPU kept for activations and CUDA graphs, not KV."""
    train_efficiency: float = 0.165
    """Achieved fraction of peak FLOP/s in training (fitted to the paper's Table 1)."""
    train_overhead_s: float = 5.0
    """Fixed cost of every training step: optimizer step, offload and onload."""
    sync_efficiency: float = 0.5
    """Fraction of link bandwidth the weight push achieves."""
    sync_overhead_s: float = 2.0
    """Fixed cost of every weight sync: engine sleep/wake, cache reallocation."""

    def __post_init__(self) -> None:
        for name in ("hbm_efficiency", "decode_flops_efficiency", "prefill_flops_efficiency", "memory_utilization",
                     "train_efficiency", "sync_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"calibration.{name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("step_overhead_s", "seq_overhead_s", "allreduce_latency_s", "activation_reserve_gb",
                     "train_overhead_s", "sync_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"calibration.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class CostModel:
    """Costs of one model on one kind of GPU; ``tp`` is the engine replica's TP size."""

    hardware: Hardware
    model: ModelShape
    tp: int = 1
    calib: Calibration = Calibration()
    train_passes: int = TRAIN_PASSES
    """Forward passes' worth of FLOPs per trained token (with a critic, ``TRAIN_PASSES + CRITIC_PASSES``)."""

    def __post_init__(self) -> None:
        if self.tp <= 0:
            raise ValueError(f"tp must be positive, got {self.tp}")

    # -- rollout -------------------------------------------------------------------------------

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache one replica holds (0 when the weights alone do not fit)."""
        c, hw, m = self.calib, self.hardware, self.model
        free = c.memory_utilization * hw.hbm_bytes - m.weight_bytes / self.tp - c.activation_reserve_gb * GB
        return max(0, int(free / self._kv_bytes_per_gpu(1.0)))

    def _kv_bytes_per_gpu(self, tokens):
        """KV heads split over TP; when TP exceeds the KV heads, they are replicated."""
        m = self.model
        return tokens * m.kv_bytes_per_token * max(m.num_kv_heads, self.tp) / m.num_kv_heads / self.tp

    def _allreduce_s(self, tokens):
        if self.tp == 1:
            return 0.0
        hw, m = self.hardware, self.model
        bw = hw.nvlink_bw if self.tp <= hw.gpus_per_node else hw.net_bw
        size = tokens * m.hidden_size * BF16
        return 2 * m.num_layers * (self.calib.allreduce_latency_s + 2 * (self.tp - 1) / self.tp * size / bw)

    def prefill_s(self, tokens: float, tokens_sq: float) -> float:
        """Compute time of prefilling ``tokens`` prompt tokens; ``tokens_sq`` is the sum of each
        sequence's squared length (its causal attention costs half of that, per key)."""
        m, c = self.model, self.calib
        flops = 2 * m.matmul_params * tokens + m.attention_flops(tokens_sq / 2)
        return flops / self.tp / (self.hardware.flops * c.prefill_flops_efficiency)

    def iteration_times(self, num_running: int, context: int, num_iters: int, prefill_tokens: int = 0,
                        prefill_sq: int = 0, queries: int = 1) -> np.ndarray:
        """Seconds of each of ``num_iters`` iterations of ``num_running`` requests whose contexts sum
        to ``context`` tokens at the first one (each iteration adds ``num_running``); the first
        iteration also prefills ``prefill_tokens`` (``prefill_sq``: sum of squared lengths).
        ``queries``: tokens each request runs through the model per iteration (a speculative verify
        step: its newest token and its draft); they read the weights and the KV once."""
        m, c, hw = self.model, self.calib, self.hardware
        ctx = context + num_running * np.arange(num_iters, dtype=np.float64)
        memory = (m.weight_bytes / self.tp + self._kv_bytes_per_gpu(ctx)) / (hw.hbm_bw * c.hbm_efficiency)
        compute = queries * (2 * m.matmul_params * num_running + m.attention_flops(ctx)) / self.tp / (
            hw.flops * c.decode_flops_efficiency)
        times = np.maximum(memory, compute) + c.step_overhead_s + c.seq_overhead_s * num_running
        times += self._allreduce_s(num_running * queries)
        if prefill_tokens:
            times[0] += self.prefill_s(prefill_tokens, prefill_sq) + self._allreduce_s(prefill_tokens)
        return times

    # -- training and weight sync --------------------------------------------------------------

    def train_gpu_s(self, tokens: float, tokens_sq: float) -> float:
        """GPU-seconds of training work on sequences of ``tokens`` total (``tokens_sq``: sum of
        squared lengths): old and reference log-probs, then forward + backward; no fixed costs."""
        m, c = self.model, self.calib
        forward = 2 * m.matmul_params * tokens + m.attention_flops(tokens_sq / 2)
        return self.train_passes * forward / (self.hardware.flops * c.train_efficiency)

    def train_s(self, tokens: float, tokens_sq: float, num_gpus: int) -> float:
        """One training step over those sequences on ``num_gpus``: their work spread evenly, plus
        the step's fixed cost."""
        return self.train_gpu_s(tokens, tokens_sq) / num_gpus + self.calib.train_overhead_s

    def sync_s(self) -> float:
        """Pushing the trainer's weights into the engines: every GPU receives its TP shard."""
        c = self.calib
        return self.model.weight_bytes / self.tp / (self.hardware.nvlink_bw * c.sync_efficiency) + c.sync_overhead_s


# ---- fitting the calibration to a measured profile ------------------------------------------------


def fit_calibration(profile: str | Path | dict, model: ModelShape, base: Calibration = Calibration()) -> tuple[
        Calibration, Hardware]:
    """Refit ``step_overhead_s`` and ``decode_flops_efficiency`` to a decode curve measured by
    ``python -m rollpacker.bench engine --out profile.json`` (TorchEngine, one replica), or to the
    TP=1 curve of a planner profile (``python -m rollpacker.profile``).

    The curve gives ms per decode iteration against running requests N at a short context. A line
    ``ms = a + s * N`` is fitted by least squares; ``a`` is the iteration overhead and the slope is
    the per-token matmul and attention work at the measured peak FLOP/s (the profile's
    ``summary.peak_gflops``), so ``decode_flops_efficiency = flops_per_token / (peak * s)`` (the
    per-request overhead cannot be told apart from it on one curve and is set to 0). Returns the
    calibration and the profiled machine as a :class:`Hardware` (a CPU: compute-bound).
    """
    record = profile if isinstance(profile, dict) else json.loads(Path(profile).read_text())
    if "tp" in record:  # a planner profile (python -m rollpacker.profile): its TP=1 curve, shortest context
        if record.get("peak_gflops") is None or "1" not in record["tp"]:
            raise ValueError(f"fit_calibration: this profile has no CPU peak FLOP/s or no TP=1 curve (TPs "
                             f"{sorted(record['tp'], key=int)}); fit from a CPU profile made at rollout.tp 1, or from "
                             "python -m rollpacker.bench engine --out")
        entry = record["tp"]["1"]
        context = min(entry["decode_ms"], key=int)
        record = {"decode_ms_per_iter": entry["decode_ms"][context], "context_len": [int(context)],
                  "summary": {"peak_gflops": record["peak_gflops"]}}
    curve = {int(n): float(ms) for n, ms in record["decode_ms_per_iter"].items()}
    if len(curve) < 2:
        raise ValueError(f"fit_calibration: the profile needs at least 2 points of decode_ms_per_iter, got {curve}")
    n = np.array(sorted(curve), dtype=np.float64)
    ms = np.array([curve[int(k)] for k in n])
    slope, intercept = np.polyfit(n, ms, 1)
    peak = float(record["summary"]["peak_gflops"]) * 1e9
    context = float(np.mean(record.get("context_len", [record.get("prompt_len", 0)])))
    per_token = 2 * model.matmul_params + model.attention_flops(context)
    efficiency = min(1.0, per_token / (peak * max(slope, 1e-9) * 1e-3))
    calib = replace(base, step_overhead_s=max(intercept, 0.0) * 1e-3, seq_overhead_s=0.0,
                    decode_flops_efficiency=efficiency)
    machine = Hardware(name="profiled", hbm_bytes=64 * GB, hbm_bw=1e15, flops=peak, nvlink_bw=10 * GB, net_bw=10 * GB)
    return calib, machine


# ---- the profiled machine itself ---------------------------------------------------------------------


def _interp(x: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Piecewise-linear through (xs, ys), extended along the end segments (one point: flat); past the last, never
    below it, and never below 0 (a noisy profile's falling last segment made a larger batch's time negative), as
    the planner's."""
    if len(xs) == 1:
        return np.full_like(x, ys[0], dtype=np.float64)
    inner = np.interp(x, xs, ys)
    low = np.maximum(ys[0] + (x - xs[0]) * (ys[1] - ys[0]) / (xs[1] - xs[0]), 0.0)
    high = np.maximum(ys[-1] + (x - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), ys[-1])
    return np.where(x < xs[0], low, np.where(x > xs[-1], high, inner))


@dataclass(frozen=True)
class ProfiledCost:
    """One replica's rollout costs read off a measured profile (``python -m rollpacker.profile``)
    instead of a roofline: the cost model of the machine that was profiled, for checking the
    simulator against runs there (``python -m rollpacker.sim validate``). Nothing is fitted: a
    decode iteration costs the profile's time for that many running requests at that mean context
    per request (linear between the measured points; linear beyond the largest batch, whose
    slope is the curve's last if it rises, else flat; flat beyond the contexts), and an iteration that prefills adds its
    tokens at the measured prefill throughput of the nearest context. A speculative verify
    iteration costs the decode iteration times the engine's measured verify-step ratio (``spec``:
    TorchEngine's :class:`~rollpacker.rollout.spec_cost.SpecCost`, profiled with
    ``--engine.speculative`` on or auto)."""

    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    decode_ms: tuple[tuple[float, ...], ...]
    """[context][batch]: ms of one decode iteration."""
    prefill_tok_s: tuple[float, ...]
    """Per context: prompt tokens prefilled per second."""
    kv_capacity: int
    tp: int = 1
    spec: SpecCost | None = None
    """The engine's verify-step times by running requests and draft tokens, where profiled."""

    @classmethod
    def from_profile(cls, profile: dict, tp: int = 1) -> ProfiledCost:
        entry = profile["tp"][str(tp)]
        contexts = sorted(entry["decode_ms"], key=int)
        batches = sorted(entry["decode_ms"][contexts[0]], key=int)
        spec = entry.get("spec")
        return cls(batches=tuple(map(int, batches)), contexts=tuple(map(int, contexts)),
                   decode_ms=tuple(tuple(float(entry["decode_ms"][c][b]) for b in batches) for c in contexts),
                   prefill_tok_s=tuple(float(entry["prefill_tok_s"][c]) for c in contexts),
                   kv_capacity=int(entry["kv_capacity_tokens"]), tp=tp,
                   spec=spec and SpecCost(tuple(spec["rows"]), tuple(spec["draft_lens"]),
                                          tuple(map(tuple, spec["ms"])), spec["draft_ms"]))

    def kv_capacity_tokens(self) -> int:
        return self.kv_capacity

    def decode_s(self, num_running: int, mean_context: np.ndarray) -> np.ndarray:
        """Seconds of decode iterations of ``num_running`` requests at each mean context per request."""
        batches, contexts = np.array(self.batches, dtype=np.float64), np.array(self.contexts, dtype=np.float64)
        at_batch = np.array([_interp(np.array([float(num_running)]), batches, np.array(row))[0]
                             for row in self.decode_ms])  # per measured context
        return np.interp(mean_context, contexts, at_batch) / 1e3

    def iteration_times(self, num_running: int, context: int, num_iters: int, prefill_tokens: int = 0,
                        prefill_sq: int = 0, queries: int = 1) -> np.ndarray:
        """As :meth:`CostModel.iteration_times` (``context``: the requests' contexts summed at the first)."""
        ctx = (context + num_running * np.arange(num_iters, dtype=np.float64)) / max(num_running, 1)
        times = self.decode_s(num_running, ctx)
        if queries > 1:
            if self.spec is None:
                raise ValueError("the profile has no verify-step costs: profile with --engine.speculative auto")
            times *= self.spec.step_ms(num_running, queries - 1) / self.spec.step_ms(num_running, 0)
        if prefill_tokens:
            nearest = int(np.argmin([abs(c - prefill_sq / prefill_tokens) for c in self.contexts]))
            times[0] += prefill_tokens / self.prefill_tok_s[nearest]
        return times
