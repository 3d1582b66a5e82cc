"""Run on one rank by tests/dist/test_extending.py: the example policy of docs/extending.md, built
from Python without registering it, trains in a real job (the shipped toy model)."""

import dataclasses
import sys

from support.docs import example_policy

from rollpacker.config import parse
from rollpacker.dist import exit_process
from rollpacker.job import build
from rollpacker.loops import train


def main(run_dir: str) -> None:
    config = parse(["--data.num-toy-prompts", "32", "--rollout.num-prompts", "4", "--rollout.group-size", "2",
                    "--rollout.max-new-tokens", "96", "--num-steps", "2", "--eval-every", "0", "--run-dir", run_dir,
                    "--metrics.wandb-mode", "disabled", "--metrics.no-live", "--checkpoint.no-export-hf"])
    config = dataclasses.replace(config, schedule=example_policy().FifoConfig(keep_share=0.5))
    config.check_world(1)
    job = build(config)
    train(job)
    job.close()
    print("OK", flush=True)
    exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1])
