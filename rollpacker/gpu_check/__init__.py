"""``python -m rollpacker.gpu_check [--device cuda|cpu] [--out DIR] [--work DIR] [--stages NAME ...]``: what a
first GPU run must prove, in one command on one GPU (H100/H200 class) in at most 8 minutes, with only that
machine's torch and Triton, transformers, safetensors and our pure-Python dependencies (no vLLM or SGLang).

A preflight line comes first (what is missing, what still runs); then each stage runs in a process group of
its own under its own limit and prints one JSON line (``stage``, ``ok``, ``seconds``, ``limit_s`` and what it
measured); the last line sums them up (device, versions, commit, date). ``--out`` gets those lines, each
stage's log and the toy job's metrics, nothing large; models and checkpoints go to ``--work``. A stage prints
each measurement as it makes it, so a timeout keeps what it measured. On CPU every stage runs at toy size: the
default test tier runs it, so the check cannot rot. :data:`STAGES` says what each one proves.
"""

from __future__ import annotations

from dataclasses import dataclass

RESULT = "GPU_CHECK_RESULT "
"""The prefix of the line a stage process prints its result on."""


@dataclass(frozen=True)
class Stage:
    letter: str
    what: str
    cuda_s: int
    """Time limit on one GPU."""
    cpu_s: int
    """Time limit at toy size on a CPU: a hang's bound (a busy 2-core machine takes 30-240 s a stage)."""
    needs_triton: bool = False
    """It runs the Triton kernel itself: skipped where Triton cannot compile (the others use the torch head)."""
    writes_models: bool = False
    """It writes models or checkpoints to the work folder."""
    default: bool = True
    """It runs unless ``--stages`` says otherwise (off: only when named)."""


STAGES = {
    "toy": Stage("a", "the default job end to end (NCCL, FSDP2 bf16, TorchEngine bf16, release/train/push/resume), "
                 "a checkpoint, a resume from it and the Hugging Face export", 100, 600, writes_models=True),
    "train": Stage("b", "an FSDP2 step of a ~1.3B Qwen2-shaped random model in bf16, activation checkpointing off and "
                   "full: measured peak against the memory plan; the push into a bf16 TorchEngine against an fp32 "
                   "recompute of the same bf16 weights", 80, 600),
    "offload": Stage("c", "train.offload on one rank: a step and a full_tensor on cuda:nccl,cpu:gloo, and a CPU "
                     "collective over every group it relies on", 45, 600),
    "kernel": Stage("d", "the Triton log-prob kernel against the chunked torch path at a 7B head: values, ms, "
                    "peak, TFLOP/s, smaller size first, what would overrun skipped", 80, 600, needs_triton=True),
    "engine": Stage("e", "TorchEngine's greedy tokens and log-probs against transformers in fp32 and bf16, "
                    "preemption (a near-tie tolerated), the decode workspace's peak against the plan", 50, 600,
                    writes_models=True),
    "spec": Stage("f", "the speculative verify cost, k = 1..8 drafts at 1..32 running requests, on a 7B-shaped "
                  "model", 40, 600),
    "judge": Stage("g", "the judge's layer streaming: copies on the side stream overlap compute, logits bit-equal "
                   "to resident", 40, 600),
    "episodes": Stage("h", "issue 47's measurement where a decode step is flat: bench episodes' sync, tail and "
                      "tail+warm on one rank, one seed; every prompt trained once, the speedups reported", 240, 900,
                      default=False),
}
"""Every stage, in the order the check runs them: the issue's (a)-(g), whose CUDA limits sum to 435 s, by default;
(h) when named, a second command's (docs/gpu-check.md)."""
DEFAULT_STAGES = [name for name, stage in STAGES.items() if stage.default]
