"""Run by tests/dist/rollout/test_vllm_engine.py (issue 37): a bf16 vLLM engine receives the trainer's fp32 masters
(converted to its dtype as they are pushed) and then generates what a bf16 TorchEngine loaded with the
same weights generates. Its own process: vLLM's in-process state is per process. Argv: the two models."""

import os
import sys

import torch

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from support.engine_pair import prompts  # noqa: E402

from rollpacker.model import load_model  # noqa: E402
from rollpacker.rollout import build_engine  # noqa: E402
from rollpacker.rollout.config import EngineConfig  # noqa: E402
from rollpacker.rollout.engine import Request, SamplingParams, generate  # noqa: E402

a, b = sys.argv[1:3]
engine = build_engine(EngineConfig(kind="vllm", kv_memory_mb=2, memory_fraction=0.05, max_num_seqs=16), a, "cpu",
                      torch.bfloat16)
masters = load_model(b)  # fp32, as the trainer's
assert all(p.dtype == torch.float32 for p in masters.parameters())
engine.update_weights(masters.named_parameters())
params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
reqs = [Request(id=f"g{i}", prompt_ids=p, params=params) for i, p in enumerate(prompts(3, 20, seed=4))]
got = generate(engine, reqs)
ref = generate(build_engine(EngineConfig(), b, "cpu", torch.bfloat16), reqs)
assert all(got[r.id].token_ids == ref[r.id].token_ids for r in reqs), (got, ref)
print("OK bf16 push", flush=True)
