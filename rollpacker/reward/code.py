"""Code reward: run a response's Python program against a row's test cases in the sandbox.

A row's ``tests`` is a list of ``{"input": stdin, "output": expected stdout}``. The reward is 1.0
when every test passes, else 0.0; a response without a code block scores 0.0. Tests run one by
one in a fresh sandbox each and stop at the first failure (only a fully correct response is ever
used as a timing anchor, so the rest would not be needed).

Adaptive timeout (RollPacker §4.3): a test case's timeout is
``T = min(max(T_min, lambda * T_anchor), T_max)``, where ``T_anchor`` is the longest run time seen
among *correct* responses on that test case, so far in the run (``T_min`` until there is one).
:class:`AdaptiveTimeout` keeps the anchors, keyed by a hash of the test case, and saves them in
the checkpoint. Unlike the paper, run time is the sandbox's wall time, its ~0.05 s setup included;
RollPacker's published code uses lambda = 2, the paper 1.5 (our default).

CLI, for debugging a reward by hand (prints one JSON line, exits 1 unless every test passed)::

    python -m rollpacker.reward.code --code PROG.py --tests TESTS.json [--timeout 5]
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollpacker.reward.rules import RewardError
from rollpacker.reward.sandbox import Isolation, Sandbox, SandboxConfig, SandboxUnavailable

_CODE_BLOCK = re.compile(r"```[ \t]*([\w+#.-]*)(?:[ \t][^`\n]*)?\r?\n(.*?)```", re.DOTALL)
"""Every fenced block, its label read too (and text after it: ```python solution.py): a block of another language
(```text of a sample input) skipped at its opening fence made its closing fence open the next block, and the prose
after it ran as the program."""
_PYTHON = {"python", "python3", "py"}


def extract_code(response: str) -> str | None:
    """The last fenced block labelled Python (```python, ```py), else the last bare one (```), or None: as verl's and
    open-r1's, a bare block after the solution (its sample output) is not the program."""
    blocks = _CODE_BLOCK.findall(response)
    for labels in (_PYTHON, {""}):
        if code := [code for label, code in blocks if label.lower() in labels]:
            return code[-1]
    return None


MAX_TIMEOUT = 3600.0
"""The most seconds ``python -m rollpacker.reward.code --timeout`` gives a test (beyond it the sandbox's clock
overflows)."""
TESTS_FORMAT = 'a non-empty list of {"input": str, "output": str} objects'


def valid_tests(tests: Any) -> bool:
    """Whether ``tests`` (a row's field ``tests``) is :data:`TESTS_FORMAT` (an input may be null: empty stdin)."""
    return isinstance(tests, list) and bool(tests) and all(
        isinstance(t, dict) and isinstance(t.get("output"), str) and isinstance(t.get("input") or "", str)
        for t in tests)


def case_key(test: dict) -> str:
    """A test case's identity across the run: a hash of its input and expected output."""
    text = json.dumps([test.get("input") or "", test["output"]])
    return hashlib.sha1(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def code_reward(response: str, tests: list[dict], timeouts: list[float],
                sandbox: SandboxConfig | None = None) -> tuple[float, dict]:
    """(1.0 if the response's program passes every test else 0.0, ``{"verdicts", "seconds"}`` per test run).

    ``timeouts[i]`` is test ``i``'s wall-clock limit. Stops at the first failing test. Raises
    :class:`RewardError` when the sample cannot be judged (no tests, the sandbox failed): that is
    a reward_error, not a wrong answer.
    """
    if not tests or len(timeouts) != len(tests):
        raise RewardError(f"code reward: {len(tests)} tests and {len(timeouts)} timeouts; "
                          "a row needs at least one test")
    program = extract_code(response)
    if program is None:
        return 0.0, {"verdicts": [], "seconds": []}
    box = Sandbox(sandbox)
    verdicts, seconds = [], []
    for test, timeout in zip(tests, timeouts):
        result = box.check(program, test, timeout)
        if result.verdict == "SANDBOX_ERROR":
            raise RewardError(f"code reward: the sandbox failed to start: {result.detail.strip()[-300:]}")
        verdicts.append(result.verdict)
        seconds.append(result.seconds)
        if result.verdict != "PASS":
            break
    passed = len(verdicts) == len(tests) and all(v == "PASS" for v in verdicts)
    return float(passed), {"verdicts": verdicts, "seconds": seconds}


def code(completions: list, tests: list | None = None, timeouts: list | None = None,
         sandbox: list | None = None, **_) -> list[dict | None]:
    """The built-in ``code``, a TRL-convention function: :func:`code_reward` of each completion, as
    ``{"score", "verdicts", "seconds"}`` (None for a row without ``tests``). ``timeouts`` (per test)
    and ``sandbox`` come from the reward scheduler's :class:`AdaptiveTimeout` and config."""
    from rollpacker.reward.functions import completion_text

    n = len(completions)
    return [None if t is None else _scored(*code_reward(completion_text(c), t, limits, box))
            for c, t, limits, box in zip(completions, tests or [None] * n, timeouts or [None] * n,
                                         sandbox or [None] * n)]


def _scored(score: float, details: dict) -> dict:
    return {"score": score, **details}


class AdaptiveTimeout:
    """Per test case timeouts ``min(max(T_min, factor * T_anchor), T_max)``, anchors learned from correct runs."""

    def __init__(self, factor: float = 1.5, minimum: float = 2.0, maximum: float = 30.0):
        self.factor, self.minimum, self.maximum = factor, minimum, maximum
        self.anchors: dict[str, float] = {}
        """case_key -> the longest run time of a correct response on that test case, in seconds."""

    @classmethod
    def from_config(cls, cfg) -> AdaptiveTimeout:
        """From a :class:`rollpacker.reward.config.RewardConfig`'s ``timeout_factor``, ``timeout_min`` and
        ``timeout_max``."""
        return cls(cfg.timeout_factor, cfg.timeout_min, cfg.timeout_max)

    def timeouts(self, tests: list[dict]) -> list[float]:
        """The timeout of each test case, in seconds."""
        return [min(max(self.minimum, self.factor * self.anchors.get(case_key(t), 0.0)), self.maximum) for t in tests]

    def observe(self, tests: list[dict], info: dict) -> None:
        """Learn from one scored response (``info`` from :func:`code_reward`): anchors move only if all tests passed."""
        verdicts = info.get("verdicts", [])
        if len(verdicts) != len(tests) or any(v != "PASS" for v in verdicts):
            return
        for test, seconds in zip(tests, info["seconds"]):
            key = case_key(test)
            self.anchors[key] = max(self.anchors.get(key, 0.0), seconds)

    def state_dict(self) -> dict:
        return {"anchors": dict(self.anchors)}

    def load_state_dict(self, state: dict) -> None:
        self.anchors = {str(k): float(v) for k, v in state["anchors"].items()}


@dataclass(kw_only=True)
class CheckArgs:
    code: Path
    """The Python program to run."""
    tests: Path
    """JSON list of {"input": stdin, "output": expected stdout}."""
    timeout: float = 2.0
    """Seconds per test."""
    isolation: Isolation = "auto"
    """OS isolation (none: no isolation, only for code you trust)."""
    python: str = ""
    """Interpreter for the program (empty: this one if the sandbox can run it)."""


def main(argv: list[str] | None = None) -> int:
    import tyro

    args = tyro.cli(CheckArgs, args=argv, prog="python -m rollpacker.reward.code", description=__doc__.split("\n\n")[0])
    try:
        program, tests = args.code.read_text(), json.loads(args.tests.read_text())
    except OSError as e:
        print(f"python -m rollpacker.reward.code: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"python -m rollpacker.reward.code: {args.tests} is not JSON: {e}", file=sys.stderr)
        return 2
    if not valid_tests(tests) or not 0 < args.timeout <= MAX_TIMEOUT:
        print(f"python -m rollpacker.reward.code: {args.tests} must hold {TESTS_FORMAT}, as a row's field 'tests', "
              f"and --timeout ({args.timeout}) be in (0, {MAX_TIMEOUT:g}] seconds", file=sys.stderr)
        return 2
    try:
        box = Sandbox(SandboxConfig(isolation=args.isolation, python=args.python))
    except SandboxUnavailable as e:
        print(e, file=sys.stderr)
        return 2
    results = [box.check(program, test, args.timeout) for test in tests]
    passed = all(r.verdict == "PASS" for r in results)
    print(json.dumps({"passed": passed, "verdict": [r.verdict for r in results],
                      "seconds": [round(r.seconds, 4) for r in results], "isolation": box.isolation,
                      "detail": [r.detail for r in results]}))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
