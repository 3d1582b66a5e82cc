"""The toy reasoning task: multi-term arithmetic with a worked solution, one line per term.

A problem is a chain of single-digit terms joined by ``+`` and ``-``; the solution folds them in
left to right, one line per step, and ends with the answer on a ``#### N`` line::

    prompt:   "Q: 3+5-2+8\\nA:"
    response: " 3+5=8\\n8-2=6\\n6+8=14\\n#### 14"   (then EOS)

The running total stays within 0..99 (a ``-`` that would go below 0 becomes ``+``, a ``+`` that
would pass 99 becomes ``-``), so every line is a small, learnable step and a tiny model can do
it; the reward is checkable by rule (:func:`score`).

Why the length is heavy-tailed: the number of terms is drawn from a Pareto distribution
(truncated to ``MIN_TERMS..MAX_TERMS``) and the response grows linearly with it, about 7.5
tokens per term. Nearly three quarters of the problems have 2 to 6 terms (15 to 45 tokens, median
about 27), about 6% have 25 to 48 (190 to 385 tokens), so the longest responses are over 8x the
median: the shape of the RollPacker paper's Fig. 2a. Tokens are characters here (the toy model's
tokenizer, :mod:`rollpacker.toy.model`, has one per character), plus one EOS.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

MIN_TERMS = 2
MAX_TERMS = 48
PARETO_SCALE = 2.5
PARETO_ALPHA = 1.3
MAX_TOTAL = 99
PROMPT_PREFIX = "Q: "
PROMPT_SUFFIX = "\nA:"
ANSWER_MARK = "####"


def num_terms(rng: random.Random, alpha: float = PARETO_ALPHA) -> int:
    """A heavy-tailed term count in ``MIN_TERMS..MAX_TERMS`` (median 4 at the default ``alpha``; 3 at 1.6)."""
    return max(MIN_TERMS, min(MAX_TERMS, int(PARETO_SCALE * rng.paretovariate(alpha))))


def make_problem(rng: random.Random, terms: int | None = None, alpha: float = PARETO_ALPHA) -> dict:
    """One problem with ``terms`` terms (drawn by :func:`num_terms` with ``alpha`` when None); no id yet."""
    terms = num_terms(rng, alpha) if terms is None else terms
    total = rng.randint(1, 9)
    expr = str(total)
    for _ in range(terms - 1):
        t = rng.randint(1, 9)
        minus = total + t > MAX_TOTAL or (total >= t and rng.random() < 0.5)
        total += -t if minus else t
        expr += f"{'-' if minus else '+'}{t}"
    return {"prompt": f"{PROMPT_PREFIX}{expr}{PROMPT_SUFFIX}", "answer": str(total), "num_terms": terms}


def rows(config, num: int, seed: int, keep: Callable[[dict], bool] = lambda _: True) -> list[dict]:
    """``data.toy_task arithmetic``: the first ``num`` problems ``keep`` takes, drawn with ``seed`` and
    ``data.toy_tail_alpha``."""
    return make_dataset(num, seed, config.toy_tail_alpha, keep)


def make_dataset(n: int, seed: int, alpha: float = PARETO_ALPHA,
                 keep: Callable[[dict], bool] = lambda _: True) -> list[dict]:
    """The first ``n`` problems ``keep`` takes as rows of the dataset schema ``{"id", "prompt", "answer",
    "num_terms"}``, their term counts drawn with tail exponent ``alpha``."""
    rng = random.Random(seed)
    problems = filter(keep, (make_problem(rng, alpha=alpha) for _ in itertools.count()))
    return [{"id": f"toy-{seed}-{i}", **problem} for i, problem in enumerate(itertools.islice(problems, n))]


def solution(problem: dict) -> str:
    """The worked response to ``problem`` (without EOS): one ``a+b=c`` line per term, then ``#### N``."""
    expr = problem["prompt"].removeprefix(PROMPT_PREFIX).removesuffix(PROMPT_SUFFIX)
    terms = [int(t) for t in re.findall(r"[+-]?\d+", expr)]
    total, lines = terms[0], []
    for t in terms[1:]:
        lines.append(f"{total}{'+' if t > 0 else '-'}{abs(t)}={total + t}")
        total += t
    return " " + "\n".join([*lines, f"{ANSWER_MARK} {total}"])


def _as_int(text: str) -> int | None:
    text = text.strip()
    return int(text) if re.fullmatch(r"-?\d{1,18}", text) else None


def score(response: str, answer: str) -> float:
    """1.0 if the text after the last ``####`` is exactly the integer ``answer``, else 0.0."""
    _, mark, final = response.rpartition(ANSWER_MARK)
    got = _as_int(final) if mark else None
    return float(got is not None and got == _as_int(answer))


def response_num_tokens(problem: dict) -> int:
    """Tokens of the worked response: one per character plus EOS."""
    return len(solution(problem)) + 1


def length_stats(rows: list[dict]) -> dict[str, float]:
    """Median, p90, p99 and max of the worked responses' token counts, and max / median."""
    lengths = sorted(response_num_tokens(r) for r in rows)
    median = statistics.median(lengths)

    def pct(p: float) -> int:
        return lengths[min(len(lengths) - 1, int(p * len(lengths)))]

    return {"median": median, "p90": pct(0.9), "p99": pct(0.99), "max": lengths[-1],
            "max_over_median": lengths[-1] / median}


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(out: Path, num: int = 1000, seed: int = 0, alpha: float = PARETO_ALPHA) -> None:
    """Write ``num`` toy problems as JSONL to ``out`` and print their response-length statistics.

    Args:
        out: JSONL file to write.
        num: Number of problems.
        seed: Seed of the problem generator.
        alpha: Pareto exponent of the term count (the default job trains on 1.6).
    """
    if num < 1 or alpha <= 0:
        sys.exit(f"rollpacker.toy.task: --num ({num}) must be positive and --alpha ({alpha}) above 0")
    rows = make_dataset(num, seed, alpha)
    try:
        write_jsonl(rows, out)
    except OSError as e:
        sys.exit(f"rollpacker.toy.task: cannot write {out} ({e.strerror or e}): name a file this user can write")
    stats = length_stats(rows)
    print(f"wrote {num} problems to {out}")
    print("response tokens: " + ", ".join(f"{k}={v:g}" for k, v in stats.items()))


if __name__ == "__main__":
    import tyro

    tyro.cli(main)
