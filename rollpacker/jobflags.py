"""The ``rollpacker.run`` command lines of the benchmarks' jobs, shared with the simulator.

``python -m rollpacker.bench`` launches these jobs and measures them; ``python -m rollpacker.sim
validate`` and ``growth`` simulate the very same jobs. Both build the flags here, so the two cannot
drift apart, and the simulator does not import the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rollpacker.schedule.config import POLICY_CONFIGS, names, settings
from rollpacker.schedule.sync import SyncConfig


def check_job(argv: list[str], what: str, run_args: list[str], evaluated: bool = False):
    """The config of the ``rollpacker.run`` flags ``argv`` of one run of a benchmark (``what``), checked before its
    first run: a flag after ``--`` (``run_args``) that it refuses fails now, not after the runs before it; so does
    ``--eval-every 0`` where the benchmark reads evaluations (``evaluated``)."""
    import contextlib
    import io

    from rollpacker.config import as_flags, parse

    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            config = parse(argv)
    except SystemExit as e:  # tyro's box, drawn into err
        raise SystemExit(f"{as_flags(err.getvalue().strip()) or e.code}\n{what} refuses `-- {' '.join(run_args)}`: "
                         "leave it out or choose the runs it applies to") from None
    if evaluated and not config.eval_every:
        raise SystemExit(f"{what}: this benchmark compares held-out evaluations: `-- {' '.join(run_args)}` turns "
                         "them off (--eval-every 0); leave it out")
    return config


def split_run_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """A tool's own flags, and the ``rollpacker.run`` flags that follow ``--``."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


STREAM = ["--stream.enabled"]
PIPE = ["--schedule.pipe"]
OFF_POLICY = ["--train.rollout-correction", "token_tis"]
VARIANTS = {"": [], "stream": STREAM, "pipe": PIPE, **{f"stream_{c}": [*STREAM, "--stream.criterion", c]
                                                         for c in ("kv", "throughput")}}
"""What ``POLICY+VARIANT`` adds to a policy: stream training (and its scale-down criterion) or RolloutPipe."""


def policy_args(policy: str) -> list[str]:
    """The flags of ``POLICY`` or ``POLICY+VARIANT`` (``pipe`` alone: sync with RolloutPipe); a policy
    whose samples are stale trains with truncated importance sampling."""
    name, _, extra = (f"{SyncConfig.name}+pipe" if policy == "pipe" else policy).partition("+")
    if extra not in VARIANTS or name not in POLICY_CONFIGS:
        raise SystemExit(f"unknown policy {policy!r}: write POLICY or POLICY+V, POLICY one of "
                         f"{', '.join(POLICY_CONFIGS)}, V one of {', '.join(v for v in VARIANTS if v)}")
    cls = POLICY_CONFIGS[name]
    for variant, takes, what in (("pipe", lambda c: "pipe" in settings(c), "RolloutPipe"),
                                 ("stream", lambda c: not c.own_pools, "stream training")):
        if extra.startswith(variant) and not takes(cls):  # refused by the job, after the runs before it
            raise SystemExit(f"policy {policy!r}: schedule:{name} does not run with {what}; it runs on top of "
                             f"{', '.join(names(takes))}")
    return [f"schedule:{name}", *VARIANTS[extra], *(OFF_POLICY if cls.stale_samples else [])]


def policy_list(text: str) -> list[str]:
    """``--policies``: the comma-separated ``POLICY[+VARIANT]`` each checked now (a bad one was met after the runs
    of the ones before it)."""
    names = text.split(",")
    for name in names:
        policy_args(name)
    return names


@dataclass
class JobArgs:
    preset: str = "toy-cpu"
    """Preset of the job (its num_steps and eval settings; rollpacker.run flags after ``--`` override them)."""
    train_shard_size: int = 1
    """--train.train-shard-size of every run (stream training frees whole training replicas)."""


def job_argv(args: JobArgs, run_args: list[str], policy_flags: list[str], seed: int, run_dir: str) -> list[str]:
    """The ``rollpacker.run`` flags of one benchmark run."""
    return ["--preset", args.preset, "--run-dir", run_dir, *policy_flags,
            "--train.train-shard-size", str(args.train_shard_size),
            "--seed", str(seed), "--data.shuffle-seed", str(seed), "--metrics.wandb-mode", "disabled",
            "--metrics.no-live", "--checkpoint.no-export-hf", *run_args]


@dataclass
class MemoryRegime:
    """``bench regime``'s job: a Qwen2-shaped random model on vLLM, rolling out the paper's length tail."""

    model_dir: Path = Path("runs/regime-model")
    """The random model (written there if missing; see the hidden/layers flags)."""
    num_layers: int = 8
    hidden_size: int = 768
    num_heads: int = 12
    num_kv_heads: int = 4
    intermediate_size: int = 2048
    num_steps: int = 8
    """Steps per policy (a tail run's long rounds included)."""
    num_prompts: int = 4
    """P0 (per step, over both ranks)."""
    group_size: int = 2
    """R0: with P0, 4 requests per rank in a sync round (8 in tail's speculative short rounds)."""
    max_new_tokens: int = 1024
    """The response cap the replayed lengths are scaled to (median ~30 tokens, longest = cap)."""
    seed: int = 0


def memory_regime_flags(args: MemoryRegime) -> list[str]:
    """The ``rollpacker.run`` flags of the memory-bound regime (the random model written first if missing; one
    there of another shape than the flags ask is a SystemExit saying so)."""
    config = args.model_dir / "config.json"
    if config.exists():
        import json

        have, want = json.loads(config.read_text()), {
            "num_hidden_layers": args.num_layers, "hidden_size": args.hidden_size, "num_attention_heads":
            args.num_heads, "num_key_value_heads": args.num_kv_heads, "intermediate_size": args.intermediate_size}
        differ = [f"{key}={have.get(key)} (asked {value})" for key, value in want.items() if have.get(key) != value]
        if differ:
            raise SystemExit(f"{args.model_dir} holds a model of another shape: {', '.join(differ)}; give another "
                             "--model-dir, or remove it to have the shape asked written there")
    else:
        from rollpacker.toy.random_model import RandomModelConfig, write

        write(RandomModelConfig(out=args.model_dir, num_layers=args.num_layers, hidden_size=args.hidden_size,
                                num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                                intermediate_size=args.intermediate_size))
    return ["--engine.kind", "vllm", "--model.path", str(args.model_dir), "--rollout.replay-lengths",
            "--train.skip", "--rollout.max-new-tokens", str(args.max_new_tokens), "--rollout.num-prompts",
            str(args.num_prompts), "--rollout.group-size", str(args.group_size), "--num-steps",
            str(args.num_steps), "--eval-every", "0", "--checkpoint-every", "0"]
