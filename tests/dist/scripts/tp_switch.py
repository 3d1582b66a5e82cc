"""Run on 2 gloo ranks by tests/dist/plan/test_planner.py: a job whose rollout TP switches 1 -> 2 -> 1 between
steps rolls out and trains exactly as a job at fixed TP 1.

Each job takes 3 RL steps (seeded sampling, so the weights really change) and after every step
generates greedily from fixed prompts on its current engines. The switching job rebuilds its
engines from the trainer's live weights at each switch.
"""

import sys

import torch
import torch.distributed as dist

from rollpacker.config import parse
from rollpacker.dist import exit_process
from rollpacker.job import build
from rollpacker.loops.colocated import rl_step
from rollpacker.rollout.engine import Request, SamplingParams, generate


def job_run(run_dir: str, tps: list[int]) -> tuple[list[dict], list[float], float, list[tuple]]:
    config = parse(["--run-dir", run_dir, "--num-steps", "3", "--eval-every", "0", "--rollout.num-prompts", "4",
                    "--rollout.group-size", "4", "--rollout.max-new-tokens", "48", "--data.num-toy-prompts", "16",
                    "--train.lr", "1e-3", "--metrics.wandb-mode", "disabled", "--metrics.no-live"])
    job = build(config)
    first = [p.full_tensor().clone() for p in job.trainer.model.parameters()]
    greedy, losses, engines = [], [], []
    for step, tp in enumerate(tps):
        job.switch_tp(tp)
        engines.append((job.meshes.rollout_tp.size(), job.meshes.num_replicas, job.engine.tp_group is not None))
        stats = {}
        rl_step(job, step, stats)
        losses.append(stats.get("train/loss"))
        params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
        reqs = [Request(id=str(i), prompt_ids=list(range(3, 9 + 3 * i)), params=params) for i in range(4)]
        greedy.append({k: o.token_ids for k, o in generate(job.engine, reqs).items()})
    moved = max((p.full_tensor() - q).abs().max().item() for p, q in zip(job.trainer.model.parameters(), first))
    job.close()  # its reward workers too
    return greedy, losses, moved, engines


def main(run_dir: str) -> None:
    switched, switched_losses, moved, engines = job_run(f"{run_dir}/switched", [1, 2, 1])
    fixed, fixed_losses, _, _ = job_run(f"{run_dir}/fixed", [1, 1, 1])
    assert engines == [(1, 2, False), (2, 1, True), (1, 2, False)], engines
    assert moved > 1e-4, f"the weights did not change ({moved}): the test would not see a stale engine"
    assert switched == fixed, "greedy rollouts differ between the switching job and the fixed-TP job"
    if dist.get_rank() == 0:
        for a, b in zip(switched_losses, fixed_losses):
            assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (switched_losses, fixed_losses)
    print("OK", dist.get_rank(), flush=True)
    exit_process(0)


if __name__ == "__main__":
    torch.manual_seed(0)
    main(sys.argv[1])
