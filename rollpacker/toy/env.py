"""The built-in toy environment (``env.factory = toy``): the toy arithmetic task, with another try.

The episode starts from the row's own prompt (``Q: 3+5-2\\nA:``). A right answer ends it; a wrong
one gets the problem again as a user turn (the toy template renders ``Q: 3+5-2\\nA:`` after the
answer), up to ``TRIES`` answers. The reward comes with the answer that ends the episode: 1 for a
right answer at the first try, ``LATER`` at a later one, 0 if none was right. It is learnable by
the embedded default on CPU: the toy model already solves some problems, and a second try is a
second draw of the same skill that the reward asks to get right the first time.
"""

from __future__ import annotations

from rollpacker.toy.task import PROMPT_PREFIX, PROMPT_SUFFIX, score

TRIES = 2
"""Answers per episode at most."""
LATER = 0.5
"""The reward of a right answer after the first try."""


class RetryEnv:
    """One toy problem: answer it, with another try after a wrong answer (see the module docstring)."""

    def __init__(self, row: dict, tries: int = TRIES):
        self.problem = row["prompt"].removeprefix(PROMPT_PREFIX).removesuffix(PROMPT_SUFFIX)
        self.answer, self.tries, self.answers = row["answer"], tries, 0

    def reset(self, *, seed: int, options: dict):
        self.answers = 0
        return None, {}

    def step(self, action: str):
        self.answers += 1
        if score(action, self.answer):
            return None, 1.0 if self.answers == 1 else LATER, True, False, {"correct": 1.0}
        if self.answers >= self.tries:
            return None, 0.0, True, False, {"correct": 0.0}
        return self.problem, None, False, False, {}


def make_env(row: dict) -> RetryEnv:
    return RetryEnv(row)
