"""``python -m rollpacker.bench spec``: the default job's rollout with speculative decoding off and on,
side by side in one run.

Each run is the 2-rank toy job rolling out alone (``--train.skip``) under ``--policies`` and each
variant: ``off``, ``spec``, ``on``, ``group`` and ``lf``, joined with ``+``. Per policy and variant
it prints rollout, tail-phase and long-round seconds (also as CPU seconds), acceptance by draft
source, and the tokens that differ from the first variant's run. The last line is JSON
(``rollout_speedup_spec``, ``tokens_changed``, ...).

Invariants:

- Rolling out alone, every step samples from the shipped model, so runs compare token by token.
- The first step calibrates the engines and is not counted.
- Flags after ``--`` go to every run.

Why: speculation must change no token, and the job, not the engine alone, says what it saves.
The variants and the keys: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import tyro

from rollpacker.bench import json_line, ratio, seed_list
from rollpacker.bench.spec_job import RECORD
from rollpacker.jobflags import JobArgs, job_argv, policy_args, policy_list, split_run_args

PROG = "python -m rollpacker.bench spec"
FLAGS = {"off": [], "spec": ["--engine.speculative", "auto"], "on": ["--engine.speculative", "on"],
         "group": ["--rollout.routing", "group"], "lf": ["--rollout.longest-first"]}
"""What each part of a variant adds to the job."""
ROLLOUT_ALONE = ["--train.skip", "--eval-every", "0", "--checkpoint-every", "0"]


@dataclass
class Args(JobArgs):
    policies: str = "tail,sync"
    """Comma-separated policies (the first gives the headline figures)."""
    variants: str = "off,lf,spec,spec+lf"
    """Comma-separated variants (parts joined with +); the first is the baseline."""
    headline: str = "spec"
    """The variant whose figures against the first are the headline ``*_spec`` ones."""
    seeds: str = "0"
    """Comma-separated seeds (sampling and data order)."""
    num_steps: int = 11
    """Steps per run; the first is not counted."""
    nproc: int = 2
    """Ranks (torchrun --nproc_per_node)."""

    def __post_init__(self) -> None:
        seed_list(self.seeds)
        policy_list(self.policies)
        for variant in self.variants.split(","):
            for part in variant.split("+"):
                if part not in FLAGS:
                    raise SystemExit(f"{PROG}: unknown variant part {part!r} in {variant!r}"
                                     f" (parts: {', '.join(FLAGS)})")
        if self.headline not in self.variants.split(","):
            raise SystemExit(f"{PROG}: --headline {self.headline!r} is not one of --variants {self.variants!r}")
        if self.num_steps < 2:
            raise SystemExit(f"{PROG}: --num-steps must be >= 2 (the first step is not counted)")


@dataclass
class Totals:
    """One policy and variant, summed over seeds and counted steps."""

    rollout_s: float = 0.0
    tail_s: float = 0.0
    long_s: float = 0.0
    cpu_s: float = 0.0
    tail_cpu_s: float = 0.0
    long_cpu_s: float = 0.0
    steps: int = 0
    long_steps: int = 0
    drafts: dict[str, list[int]] = field(default_factory=dict)
    """Source -> [rows verified, draft tokens, accepted tokens, trials (SpecStats.num_trials)]."""
    tokens_changed: int = 0
    responses_changed: int = 0
    responses_compared: int = 0


def variant_flags(variant: str) -> list[str]:
    return [flag for part in variant.split("+") for flag in FLAGS[part]]


def run(args: Args, policy: str, variant: str, seed: int, extra: list[str], run_dir: str) -> tuple[list, list]:
    """One job: its metrics records and its recorded rounds."""
    flags = [*ROLLOUT_ALONE, "--num-steps", str(args.num_steps), *variant_flags(variant), *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "rollpacker.bench.spec_job", *job_argv(args, flags, policy_args(policy), seed, run_dir)]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    read = lambda name: [json.loads(line) for line in (Path(run_dir) / name).read_text().splitlines()]  # noqa: E731
    return read("metrics.jsonl"), read(RECORD)


def add(t: Totals, records: list[dict], rounds: list[dict]) -> None:
    """Add the counted steps of one run (its first left out; a final evaluation's record is no step)."""
    for r in [r for r in records if "time/rollout" in r][1:]:
        long = r["sched/round_kind"] == "long"
        t.rollout_s += r["time/rollout"]
        t.tail_s += r["rollout/tail_seconds"]
        t.cpu_s += r["rollout/cpu_seconds"]
        t.tail_cpu_s += r["rollout/tail_cpu_seconds"]
        t.long_s += r["time/rollout"] if long else 0.0
        t.long_cpu_s += r["rollout/cpu_seconds"] if long else 0.0
        t.steps += 1
        t.long_steps += long
    for rnd in rounds[1:]:
        spec = rnd["spec"]
        for source, rows in spec["num_drafts"].items():
            counts = t.drafts.setdefault(source, [0, 0, 0, 0])
            counts[0] += rows
            counts[1] += spec["num_draft_tokens"].get(source, 0)
            counts[2] += spec["num_accepted_tokens"].get(source, 0)
            counts[3] += spec["num_trials"].get(source, 0)


def changed(base: list[dict], other: list[dict]) -> tuple[int, int, int]:
    """Tokens and responses that differ between two runs' rounds, and responses compared: those with the
    same request id and prompt; up to where both have tokens when either was aborted."""
    def outputs(rounds):
        return {(rnd["step"], rid): (prompt, tokens, reason) for rnd in rounds
                for rid, prompt, tokens, reason in rnd["outputs"]}

    theirs = outputs(other)
    tokens = responses = compared = 0
    for key, (prompt, a, reason) in outputs(base).items():
        if key not in theirs or theirs[key][0] != prompt:
            continue
        b, other_reason = theirs[key][1:]
        n = min(len(a), len(b))
        diff = sum(x != y for x, y in zip(a[:n], b[:n]))
        if "abort" not in (reason, other_reason):
            diff += abs(len(a) - len(b))
        tokens, responses, compared = tokens + diff, responses + (diff > 0), compared + 1
    return tokens, responses, compared


def without_lf(variant: str) -> str:
    return "+".join(p for p in variant.split("+") if p != "lf") or "off"


def report(policies: list[str], variants: list[str], headline: str,
           totals: dict[tuple[str, str], Totals]) -> dict:
    """The table and the figures."""
    print(f"\n{'policy':<7}{'variant':<16}{'rollout s':>10}{'tail s':>8}{'long s':>8}{'cpu s':>8}{'tail cpu':>9}"
          f"{'speedup':>8}{'tail x':>7}{'long x':>7}{'cpu x':>7}{'tail cpu x':>11}{'accept':>8}{'rate':>6}"
          f"{'tok/row':>8}{'changed':>8}{'of':>6}")
    figures: dict[str, float] = {}
    for policy in policies:
        base = totals[policy, variants[0]]
        for variant in variants:
            t = totals[policy, variant]
            rows, drafted, accepted, trials = (sum(c[i] for c in t.drafts.values()) for i in range(4))
            accept = accepted / drafted if drafted else 0.0
            rate = accepted / trials if trials else 0.0
            per_row = (accepted + rows) / rows if rows else 1.0
            x = {"rollout_speedup": ratio(base.rollout_s, t.rollout_s), "tail_speedup": ratio(base.tail_s, t.tail_s),
                 "long_speedup": ratio(base.long_s, t.long_s), "rollout_speedup_cpu": ratio(base.cpu_s, t.cpu_s),
                 "tail_speedup_cpu": ratio(base.tail_cpu_s, t.tail_cpu_s),
                 "long_speedup_cpu": ratio(base.long_cpu_s, t.long_cpu_s)}
            print(f"{policy:<7}{variant:<16}{t.rollout_s / t.steps:>10.3f}{t.tail_s / t.steps:>8.3f}"
                  f"{t.long_s / max(t.long_steps, 1):>8.3f}{t.cpu_s / t.steps:>8.3f}{t.tail_cpu_s / t.steps:>9.3f}"
                  f"{x['rollout_speedup']:>8.2f}{x['tail_speedup']:>7.2f}{x['long_speedup']:>7.2f}"
                  f"{x['rollout_speedup_cpu']:>7.2f}{x['tail_speedup_cpu']:>11.2f}{accept:>8.3f}{rate:>6.3f}{per_row:>8.2f}"
                  f"{t.tokens_changed:>8}{t.responses_compared:>6}")
            for source, (n, d, a, trials) in sorted(t.drafts.items()):
                print(f"{'':<23}{source:<9} rows {n:7d}  draft tokens {d:8d}  accepted {a:8d}"
                      f"  acceptance {a / d if d else 0:.3f}  rate {a / trials if trials else 0:.3f}"
                      f"  tokens/row {(a + n) / n:.2f}")
            name = f"{policy}_{variant.replace('+', '_')}"
            figures |= {f"{k}_{name}": v for k, v in x.items()}
            figures |= {f"spec_acceptance_{name}": round(accept, 3), f"spec_accept_rate_{name}": round(rate, 3),
                        f"spec_tokens_per_row_{name}": round(per_row, 3),
                        f"tokens_changed_{name}": t.tokens_changed, f"responses_compared_{name}": t.responses_compared,
                        f"rollout_s_{name}": round(t.rollout_s / t.steps, 3)}
            if "lf" in variant.split("+") and without_lf(variant) in variants:  # longest first against today's order
                plain = totals[policy, without_lf(variant)]
                figures[f"long_speedup_longest_first_{name}"] = ratio(plain.long_s, t.long_s)
                figures[f"long_speedup_longest_first_cpu_{name}"] = ratio(plain.long_cpu_s, t.long_cpu_s)
    head = f"{policies[0]}_{headline.replace('+', '_')}"
    lf = next((v for v in variants if "lf" in v.split("+") and without_lf(v) in variants), None)
    return {"rollout_speedup_spec": figures[f"rollout_speedup_{head}"],
            "tail_speedup_spec": figures[f"tail_speedup_{head}"],
            "spec_acceptance": figures[f"spec_acceptance_{head}"],
            "spec_accept_rate": figures[f"spec_accept_rate_{head}"],
            "tokens_changed": sum(t.tokens_changed for t in totals.values()),
            "rollout_speedup_spec_cpu": figures[f"rollout_speedup_cpu_{head}"],
            "tail_speedup_spec_cpu": figures[f"tail_speedup_cpu_{head}"],
            **({"long_speedup_longest_first":
                figures[f"long_speedup_longest_first_{policies[0]}_{lf.replace('+', '_')}"]} if lf else {}), **figures}


def main(argv: list[str] | None = None) -> dict:
    own, extra = split_run_args(sys.argv[1:] if argv is None else argv)
    args = tyro.cli(Args, args=own, prog=PROG)
    policies, variants = args.policies.split(","), args.variants.split(",")
    totals = {(p, v): Totals() for p in policies for v in variants}
    for seed in seed_list(args.seeds):
        for policy in policies:
            runs = {}
            for variant in variants:
                with tempfile.TemporaryDirectory() as run_dir:
                    runs[variant] = run(args, policy, variant, seed, extra, run_dir)
                add(totals[policy, variant], *runs[variant])
            for variant in variants[1:]:
                t = totals[policy, variant]
                tokens, responses, compared = changed(runs[variants[0]][1], runs[variant][1])
                t.tokens_changed, t.responses_changed = t.tokens_changed + tokens, t.responses_changed + responses
                t.responses_compared += compared
    summary = report(policies, variants, args.headline, totals)
    sys.stdout.flush()
    print(json_line(summary), flush=True)  # NaN (no long round): null
    return summary


if __name__ == "__main__":
    main()
