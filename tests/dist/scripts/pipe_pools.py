"""Run on 2 gloo ranks by tests/dist/schedule/test_pipe.py: under ``schedule.pipe`` the train pool never rolls out.

Two RL steps of the real job (``rollpacker.job.build`` and ``rl_step``, the shipped toy model);
then rank 1 (the train pool) has generated no token and holds no KV cache, rank 0 (the rollout
pool) generated the round and its stream trainer fed rank 1 something.
"""

import sys


def main(run_dir: str) -> None:
    # imported here, not above: the job's reward workers are spawned, and spawn imports this file in each of them
    from rollpacker.config import parse
    from rollpacker.dist import exit_process
    from rollpacker.job import build
    from rollpacker.loops.colocated import rl_step

    config = parse(["--schedule.pipe", "--train.train-shard-size", "1", "--data.num-toy-prompts", "16",
                    "--rollout.num-prompts", "4", "--rollout.group-size", "4", "--rollout.max-new-tokens", "64",
                    "--num-steps", "2", "--eval-every", "0", "--run-dir", run_dir, "--metrics.wandb-mode",
                    "disabled", "--metrics.no-live"])
    job = build(config)
    seconds = 0.0
    for step in range(2):
        rl_step(job, step, {})
        seconds += job.stream.seconds
    rank = job.meshes.rank
    if rank == 0:
        assert job.engine.num_generated_tokens > 0
        job.close()
    else:
        assert job.engine.num_generated_tokens == 0, job.engine.num_generated_tokens
        assert job.engine.cache is None, "the train pool's KV cache should stay released"
        assert seconds > 0, "the train pool never trained a streamed group"
    print("OK", rank, flush=True)
    exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1])
