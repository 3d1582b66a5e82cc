"""``python -m rollpacker.gpu_check [--device cuda|cpu] [--out DIR] [--stages NAME ...]``: what a first GPU run
must prove, in one command on one GPU (H100/H200 class) in at most 8 minutes, with only that machine's torch
and Triton, transformers, safetensors and our pure-Python dependencies (no vLLM or SGLang).

Each stage runs in a process of its own under its own time limit and prints one JSON line (``stage``,
``ok``, ``seconds``, ``limit_s`` and what it measured); the last line sums them up (device, versions,
commit, date). Lines and per-stage logs go to ``--out`` too. On CPU every stage runs at toy size: the
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


STAGES = {
    "toy": Stage("a", "the default job end to end (NCCL, FSDP2 bf16, TorchEngine bf16, release/train/push/resume), "
                 "a checkpoint, a resume from it and the Hugging Face export", 100, 600),
    "train": Stage("b", "an FSDP2 step of a ~1.3B Qwen2-shaped random model in bf16, activation checkpointing off and "
                   "full: measured peak against the memory plan; the push into a bf16 TorchEngine", 80, 600),
    "offload": Stage("c", "train.offload on one rank: a step and a full_tensor on cuda:nccl,cpu:gloo", 30, 600),
    "kernel": Stage("d", "the Triton log-prob kernel against the chunked torch path at a 7B head: values, ms, "
                    "peak, TFLOP/s", 80, 600),
    "engine": Stage("e", "TorchEngine's greedy tokens and log-probs against transformers in fp32 and bf16, "
                    "preemption, the decode workspace's peak against the plan", 50, 600),
    "spec": Stage("f", "the speculative verify cost, k = 1..8 drafts at 1..32 running requests, on a 7B-shaped "
                  "model", 40, 600),
    "judge": Stage("g", "the judge's layer streaming: copies on the side stream overlap compute, logits bit-equal "
                   "to resident", 40, 600),
}
"""Every stage, in the order the check runs them (the issue's (a)-(g)); the CUDA limits sum to 420 s."""
