"""Rule-based rewards, as TRL-convention reward functions (:mod:`rollpacker.reward.functions`).

``math`` checks the response's final answer against the row's ``answer`` with math-verify
(symbolic equivalence, so ``\\boxed{\\frac{1}{2}}`` matches ``0.5``); ``toy`` is the toy task's exact
check. Both return None for a row without an answer: they do not apply to it.

math-verify times each of its calls alone with ``signal.alarm`` (a response's parse, then every pair of
gold and response expressions: 25 s at its defaults, past ``reward.timeout``), so its timeouts are off
here and one deadline of :data:`MATH_TIME_LIMIT` bounds a sample's whole check instead, where a signal
can (a process's main thread: a reward worker's, the controller's when scoring inline; off it, the
worker's kill is the limit). A response whose answer cannot be checked by then
(``\\boxed{10^{10^{10^{10}}}}``) scores 0, as verl and TRL score it, and its worker lives on.
A response that holds no answer scores 0; anything else that goes wrong while scoring raises
:class:`RewardError` rather than passing for a wrong answer.
"""

from __future__ import annotations

import contextlib
import decimal
import functools
import logging
import re
import signal
import threading

from rollpacker.reward.functions import completion_text
from rollpacker.toy import task as toy_task

MATH_TIME_LIMIT = 5.0
"""Seconds math-verify may take to check one response (parse and compare), below ``reward.timeout``'s 10."""


class RewardError(RuntimeError):
    """A reward function failed on a sample; the message names the cause."""


def _as_latex(answer: str) -> str:
    """The gold answer in math mode: a bare expression (``0.5``, ``\\frac{1}{2}``, MATH's ``\\$18.90``: an escaped
    dollar is a currency sign, not math mode) gets ``$...$``."""
    answer = answer.strip()
    if re.search(r"(?<!\\)\$", answer) or "\\boxed" in answer or "\\(" in answer or "\\[" in answer:
        return answer
    return f"${answer}$"


@functools.cache
def _math_verify():
    """math-verify's ``parse`` and ``verify``, imported on first use (sympy behind it: half a second), not at config
    time; its "timeout is disabled" warnings silenced: ours is the worker's kill."""
    import math_verify
    from math_verify.errors import TimeoutException

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify.parse, math_verify.verify, TimeoutException


@contextlib.contextmanager
def _deadline(seconds: float, expired: type[BaseException]):
    """Raise ``expired`` in this block after ``seconds``, on a process's main thread (a signal reaches no other).
    A stop that unwinds through it (a worker's retire: ``SystemExit``) leaves the timer as it is: the retire has
    armed its own kill on it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise expired(f"over {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
        signal.setitimer(signal.ITIMER_REAL, 0)
    except (Exception, expired):
        signal.setitimer(signal.ITIMER_REAL, 0)
        raise
    finally:
        signal.signal(signal.SIGALRM, previous)


def math_reward(response: str, answer: str) -> float:
    """1.0 if the response's final answer (``\\boxed{}``, else the last expression) equals ``answer``; 0 if it
    cannot be checked within :data:`MATH_TIME_LIMIT` (the module docstring)."""
    parse, verify, TimeoutException = _math_verify()
    with _deadline(MATH_TIME_LIMIT, TimeoutException):
        try:
            gold = parse(_as_latex(answer), parsing_timeout=None, raise_on_error=True)
        except (Exception, TimeoutException) as e:
            raise RewardError(f"math reward: cannot parse the gold answer {answer[:80]!r}: "
                              f"{type(e).__name__}: {e}") from e
        if not gold:
            raise RewardError(f"math reward: the gold answer {answer[:80]!r} holds no parsable expression; "
                              "fix the dataset's 'answer'")
        try:
            pred = parse(response, parsing_timeout=None, raise_on_error=True)
            return float(verify(gold, pred, timeout_seconds=None, raise_on_error=True))
        except TimeoutException:
            return 0.0
        except Exception as e:
            raise RewardError(f"math reward: math-verify failed on response ...{response[-80:]!r}: "
                              f"{type(e).__name__}: {e}") from e


def toy_reward(response: str, answer: str) -> float:
    """The toy task's check: 1.0 if the number after the last ``####`` equals ``answer``."""
    return toy_task.score(response, answer)


def toy(completions: list, answer: list | None = None, **_) -> list[float | None]:
    """The built-in ``toy``: :func:`toy_reward` of each completion (None without an answer)."""
    return [None if a is None else toy_reward(completion_text(c), answer_text(a))
            for c, a in zip(completions, _or_none(answer, completions))]


def math(completions: list, answer: list | None = None, **_) -> list[float | None]:
    """The built-in ``math``: :func:`math_reward` of each completion (None without an answer)."""
    return [None if a is None else math_reward(completion_text(c), answer_text(a))
            for c, a in zip(completions, _or_none(answer, completions))]


def answer_text(answer: str | int | float) -> str:
    """A reference answer as the built-ins read it: a number as its text, a whole float without its ``.0``
    (Arrow reads a column of 1 and 2.5 as floats), a small one without an exponent (``1e-05`` reads as e - 5)."""
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    if isinstance(answer, float) and (digits := decimal.Decimal(repr(answer))).is_finite():
        return format(digits, "f")
    return str(answer)


math.warm_up = _math_verify  # a reward worker imports math-verify before it says ready, not in its first call


def _or_none(column: list | None, completions: list) -> list:
    return [None] * len(completions) if column is None else column
