"""Run on 2 gloo ranks by tests/dist/rollout/test_vllm_engine.py: VLLMEngine replicas (TP 1) or one TP-2
replica reusing the trainer's gloo group; greedy against transformers before and after a weight
push; the default group still usable; engine shut down last. Args: tp, model a, model b."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from support.engine_pair import hf_greedy, hf_model, prompts  # noqa: E402

from rollpacker.dist import exit_process  # noqa: E402
from rollpacker.model import load_model  # noqa: E402
from rollpacker.rollout import build_engine  # noqa: E402
from rollpacker.rollout.config import EngineConfig  # noqa: E402
from rollpacker.rollout.engine import Request, SamplingParams, generate  # noqa: E402

tp, path_a, path_b = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()


def _engine():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]
    return build_engine(EngineConfig(kind="vllm", kv_memory_mb=4, memory_fraction=0.05, max_num_seqs=8),
                        path_a, "cpu", torch.float32, tp_mesh=mesh)


engine = _engine()
replica = rank // tp
reqs = [Request(id=f"r{i}", prompt_ids=p, params=SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts(3, 140, seed=10 + replica))]
for path in (path_a, path_b):
    if path is path_b:
        engine.update_weights(load_model(path).named_parameters())
    got = generate(engine, reqs)
    hf = hf_model(path)
    for r in reqs:
        assert got[r.id].token_ids == hf_greedy(hf, r.prompt_ids, 10), (rank, path.name, r.id)
sampled = Request(id="s", prompt_ids=reqs[0].prompt_ids, params=SamplingParams(
    max_new_tokens=8, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True))
tokens = generate(engine, [sampled])["s"].token_ids
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, tokens)  # the trainer's default group still works
if tp == 2:
    assert gathered[0] == gathered[1], gathered  # the TP ranks stayed in lockstep
torch.set_num_threads(1)
assert torch.get_num_threads() == 1
print(f"rank {rank} OK", flush=True)
engine.shutdown()  # last: vLLM destroys the default process group here
exit_process(0)
