"""The toy tool task: arithmetic where a calculator tool decides the outcome.

A problem is one operation on two numbers. Half are *easy*, one digit each (``7*8``): the toy tools
model answers them in its head. Half are *hard*, two digits times two digits (``47*86``): no tiny
character-level model does that in one pass, but :func:`calculator` does. The episode (``env.tools``
with this calculator) runs the model's calls and ends at its first turn without one, its answer.

:func:`correct` scores the answer (the last assistant turn's ``#### N``); :func:`unaided` a right
answer given without a call (the preset weighs it 0.3, so a call costs where it does not help). A
row's ``data_source`` is its kind, so evaluation reports ``eval/easy/...`` and ``eval/hard/...``.
The easy problems are few (207): one in 8 is held out like any toy problem's, but the toy tools model's
fine-tuning drew them all, so it knows every one; what RL learns here is when to call the tool, not the products.
"""

from __future__ import annotations

import ast
import itertools
import operator
import random
from collections.abc import Callable

from rollpacker.toy import task as toy

KINDS = ("easy", "hard")
HARD_FRAC = 0.5
"""Share of hard problems in a dataset."""
EVAL_SEED = 1_000_003
"""Seed offset of the held-out problems (as the toy task's)."""
MAX_EXPRESSION_CHARS = 100
"""The calculator refuses longer expressions."""
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Integers with + - * / and parentheses, e.g. "47*86".
    """
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"give the expression as a string of at most {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None
    value = _evaluate(tree.body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError("only integers, + - * / and parentheses are allowed")


def make_problem(rng: random.Random, kind: str | None = None) -> dict:
    """One problem of ``kind`` (drawn with :data:`HARD_FRAC` when None); no id yet."""
    kind = kind or ("hard" if rng.random() < HARD_FRAC else "easy")
    if kind == "hard":
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), "*"
    elif kind == "easy":
        a, b, op = rng.randint(1, 9), rng.randint(1, 9), rng.choice("+-*")
        if op == "-" and a < b:
            a, b = b, a
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    expression = f"{a}{op}{b}"
    return {"prompt": expression, "answer": calculator(expression), "data_source": kind}


def rows(config, num: int, seed: int, keep: Callable[[dict], bool] = lambda _: True) -> list[dict]:
    """``data.toy_task tools``: the first ``num`` problems ``keep`` takes, drawn with ``seed``."""
    return make_dataset(num, seed, keep)


def make_dataset(n: int, seed: int, keep: Callable[[dict], bool] = lambda _: True) -> list[dict]:
    """The first ``n`` problems ``keep`` takes as rows ``{"id", "prompt", "answer", "data_source"}``
    (data_source: easy or hard)."""
    rng = random.Random(seed)
    problems = filter(keep, (make_problem(rng) for _ in itertools.count()))
    return [{"id": f"tools-{seed}-{i}", **problem} for i, problem in enumerate(itertools.islice(problems, n))]


def final_answer(completion) -> str:
    """The text of a completion's answer: the last assistant turn of an episode's messages, or the
    completion itself (a string)."""
    if isinstance(completion, str):
        return completion
    turns = [m["content"] for m in completion if m.get("role") == "assistant"]
    return turns[-1] if turns else ""


def num_calls(completion) -> int:
    """Tool results in an episode's messages: the calls it made (0 for a string completion)."""
    return 0 if isinstance(completion, str) else sum(m.get("role") == "tool" for m in completion)


def correct(completions: list, answer: list[str] | None = None, **_) -> list[float | None]:
    """TRL-convention reward: 1.0 if the answer's ``#### N`` is the row's answer, else 0.0 (None
    without an answer)."""
    answers = [None] * len(completions) if answer is None else answer
    return [None if a is None else toy.score(final_answer(c), a) for c, a in zip(completions, answers)]


def unaided(completions: list, answer: list[str] | None = None, **_) -> list[float | None]:
    """TRL-convention reward: 1.0 for a right answer given without a tool call, else 0.0 (None without an
    answer). Weighted beside :func:`correct`, it is what a call costs where the model could do without."""
    return [None if r is None else r * (num_calls(c) == 0) for c, r in zip(completions, correct(completions, answer))]
