"""Rule-based rewards: math-verify for math answers, the toy task's exact check, as TRL-convention functions."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from rollpacker.imports import target
from rollpacker.reward import RewardError, math_reward, rules, toy_reward
from rollpacker.reward.functions import BUILTINS
from rollpacker.toy import task as toy


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("So the answer is \\boxed{42}.", "42"),
        ("Halving gives \\boxed{\\frac{1}{2}}", "0.5"),
        ("The result is 0.5", "\\frac{1}{2}"),
        ("\\boxed{3\\pi}", "$3\\pi$"),
        ("\\boxed{x^2+1}", "x^2 + 1"),
        ("The total cost is \\boxed{\\$18.90}.", "\\$18.90"),  # MATH's currency: an escaped dollar, not math mode
        ("\\boxed{32000}", "\\$32,\\!000"),
    ],
)
def test_math_reward_correct(response, answer):
    assert math_reward(response, answer) == 1.0


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("So the answer is \\boxed{41}.", "42"),
        ("\\boxed{\\frac{1}{3}}", "0.5"),
    ],
)
def test_math_reward_wrong(response, answer):
    assert math_reward(response, answer) == 0.0


@pytest.mark.parametrize("response", ["garbage !!! @@", "", "\\boxed{\\frac{1}{", "\\boxed{}"])
def test_math_reward_garbage_response_scores_zero(response):
    assert math_reward(response, "42") == 0.0


def test_math_reward_unparsable_gold_is_an_error():
    with pytest.raises(RewardError, match="gold answer '' holds no parsable expression"):
        math_reward("\\boxed{1}", "")


def test_math_reward_off_the_main_thread():
    """math-verify's signal-based timeout is off, so scoring works from a worker thread."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(math_reward, "\\boxed{42}", "42").result() == 1.0


def test_a_worker_warms_up_math_verify_for_math_alone():
    """math-verify and sympy behind it (half a second) are imported as a worker warms ``math`` up, before it says
    ready, with their timeout warnings off; a worker of ``toy`` does without them."""
    code = ("import logging, sys\nfrom rollpacker.imports import warm_up\nwarm_up(sys.argv[1], 'reward.funcs')\n"
            "print('math_verify' in sys.modules, logging.getLogger('math_verify').level)")
    warmed = {name: subprocess.run([sys.executable, "-c", code, target(name, BUILTINS)], capture_output=True,
                                   text=True, timeout=120, check=True).stdout.split() for name in ("math", "toy")}
    assert warmed == {"math": ["True", str(logging.ERROR)], "toy": ["False", str(logging.NOTSET)]}


def test_toy_reward_is_toy_score():
    row = toy.make_dataset(3, seed=0)[2]
    right = toy.solution(row)
    assert toy_reward(right, row["answer"]) == toy.score(right, row["answer"]) == 1.0
    assert toy_reward(" 1+1=2\n#### 999", row["answer"]) == toy.score(" 1+1=2\n#### 999", row["answer"]) == 0.0


def test_the_builtins_are_trl_convention_functions():
    """Completions as strings or as assistant messages; None where the row has no answer."""
    messages = [[{"role": "assistant", "content": "so \\boxed{4}"}], [{"role": "assistant", "content": "#### 4"}]]
    assert rules.math(messages, answer=["4", None]) == [1.0, None]
    assert rules.toy(["#### 4", " 1+3=4\n#### 5"], answer=["4", "4"], data_source=["x", "y"]) == [1.0, 0.0]
    assert rules.toy(["#### 4"]) == [None]


def test_a_numeric_answer_is_read_as_its_digits():
    """A float gold below 1e-4 was str()'d to 1e-05, which math-verify reads as e - 5: \\boxed{0.00001} scored 0."""
    responses = ["\\boxed{0.00001}", "\\boxed{e-5}", "\\boxed{0.25}", "\\boxed{3}", "\\boxed{0.00000025}"]
    assert rules.math(responses, answer=[1e-05, 1e-05, 0.25, 3.0, 2.5e-07]) == [1.0, 0.0, 1.0, 1.0, 1.0]


def test_a_response_rescored_while_it_is_being_scored_is_scored_once():
    """sorted_partial submits a carried finished response again each round its prompt runs; a round
    does not wait for the rewards of groups it does not keep, so the earlier score may be in flight."""
    from rollpacker.env.episode import Response
    from rollpacker.reward.config import RewardConfig
    from rollpacker.reward.scheduler import RewardScheduler

    scheduler = RewardScheduler(RewardConfig(funcs=("toy",), num_workers=0), lambda ids: " 1+2=3\n#### 3")
    row, out = {"id": 7, "prompt": "Q: 1+2\nA:", "answer": "3"}, Response(id="", prompt_ids=[], token_ids=[1, 2])
    scheduler.submit("4:1:0", row, out)
    scheduler.submit("4:1:0", row, out)  # the next round rescores it before the first score was polled
    assert scheduler.poll() == [("4:1:0", 1.0)] and scheduler.poll() == []
    scheduler.submit("4:1:0", row, out)  # scored and taken: a later round scores it again
    assert scheduler.wait() == [("4:1:0", 1.0)]
