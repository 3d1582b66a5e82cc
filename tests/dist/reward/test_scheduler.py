"""The reward scheduler the controller drives: scores come back per sample, failures as None."""

from __future__ import annotations

import json

import pytest

from rollpacker.env.episode import Response
from rollpacker.reward.config import RewardConfig
from rollpacker.reward.scheduler import RewardScheduler

ROWS = [{"id": "a", "prompt": "p", "answer": "4"}, {"id": "b", "prompt": "p", "answer": "4"},
        {"id": "c", "prompt": "p", "answer": "\\frac{1}{2}"}]
RESPONSES = ["so \\boxed{4}", "so \\boxed{5}", "\\boxed{10^{10^{10^{10}}}}"]


def score_all(cfg: RewardConfig) -> dict:
    scheduler = RewardScheduler(cfg, lambda ids: RESPONSES[ids[0]])
    try:
        for i, row in enumerate(ROWS[:2]):
            scheduler.submit(i, row, Response(id="", prompt_ids=[], token_ids=[i]))
        got = dict(scheduler.poll()) | dict(scheduler.wait())
        assert scheduler.take_metrics()["reward/seconds_total"] > 0
        assert scheduler.take_metrics() == {"reward/errors": 0, "reward/seconds_total": 0.0}
        return got
    finally:
        scheduler.close()


def test_pool_and_inline_scoring_agree():
    assert score_all(RewardConfig(funcs=("math",), num_workers=2)) == score_all(
        RewardConfig(funcs=("math",), num_workers=0)) == {0: 1.0, 1: 0.0}


@pytest.mark.timeout(60)
def test_a_hanging_reward_is_scored_0_and_counted_and_the_pool_goes_on(caplog):
    scheduler = RewardScheduler(RewardConfig(funcs=("math",), num_workers=1, timeout=2.0),
                                lambda ids: RESPONSES[ids[0]])
    try:
        scheduler.submit("hang", ROWS[2], Response(id="", prompt_ids=[], token_ids=[2]))
        scheduler.submit("ok", ROWS[0], Response(id="", prompt_ids=[], token_ids=[0]))
        assert dict(scheduler.wait()) == {"hang": 0.0, "ok": 1.0}
        assert scheduler.take_metrics() | {"reward/seconds_total": 0} == {
            "reward/math": 1.0, "reward/errors": 1, "reward/seconds_total": 0}
        assert ("reward function 'math' failed on 1 of 2 responses at step 0, scored 0 (--reward.on-error skip); "
                "first on row 'c': timed out after 2 s (reward.timeout); its worker was replaced") in caplog.text
    finally:
        scheduler.close()


def test_rewards_bench_smoke(capsys):
    from rollpacker.bench.rewards import main

    main(["--responses", "4", "--rollout-seconds", "0.5", "--fixed-timeout", "3", "--loop-fraction", "0",
          "--slow-fraction", "0", "--wrong-fraction", "0.3", "--remote-median-s", "0.05"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for name in ("sync_fixed", "async_fixed", "sync_adaptive", "async_adaptive"):  # step = rollout + exposed scoring
        assert summary[f"exposed_{name}"] >= 0
        rollout = summary[f"step_{name}"] - summary[f"exposed_{name}"]  # its 0.5 s slept: a loaded machine wakes late
        assert 0.5 - 0.002 <= rollout < 0.5 + 2.0, summary  # (0.002: the summary's rounding; late by 0.3 s once)
    assert summary["step_speedup"] == pytest.approx(summary["step_sync_fixed"] / summary["step_async_adaptive"],
                                                    abs=0.02)
    assert summary["exposed_ratio"] == pytest.approx(
        summary["exposed_sync_fixed"] / summary["exposed_async_adaptive"], rel=0.02, abs=0.006)  # 2 decimals
    assert summary["remote_step_speedup"] == pytest.approx(
        summary["step_remote"] / summary["step_remote_awaited"], abs=0.02)


@pytest.mark.parametrize("workers", [0, 1])
def test_code_rows_are_sandboxed_and_teach_the_adaptive_timeout(workers):
    row = {"id": "r", "prompt": "add", "tests": [{"input": "1 2\n", "output": "3\n"}]}
    programs = ["```python\nprint(sum(map(int, input().split())))\n```", "```python\nprint(4)\n```"]
    scheduler = RewardScheduler(RewardConfig(funcs=("code",), num_workers=workers), lambda ids: programs[ids[0]])
    try:
        for i in range(2):
            scheduler.submit(i, row, Response(id="", prompt_ids=[], token_ids=[i]))
        assert dict(scheduler.wait()) == {0: 1.0, 1: 0.0}
        [anchor] = scheduler.state_dict()["functions"]["code"]["anchors"].values()
        assert 0 < anchor < 2.0
    finally:
        scheduler.close()


# --- the LLM judge: the toy model adds the digits of ADDER, so its verdict on ("3", "4") is "7" ---

ADDER = "Q: {prompt}+{response}\nA: {prompt}+{response}="  # 14 tokens for one-digit pairs (one per character)
UNPARSEABLE = "Q: {prompt}+{response}\nA:"  # 9 tokens; the toy model answers " 3+4=7": a space comes first
JUDGED = [  # (row, response, reward with max_score 7; None: a reward_error)
    ({"id": "0", "prompt": "3"}, "4", 1.0),
    ({"id": "1", "prompt": "2"}, "5", 1.0),
    ({"id": "2", "prompt": "4"}, "4", None),  # verdict 8 > max_score
    ({"id": "3", "prompt": "3", "rubric": UNPARSEABLE}, "4", None),  # verdict " "
    ({"id": "4", "prompt": "1"}, "1", 2 / 7),
    ({"id": "5", "prompt": "4"}, "2", 6 / 7),
    ({"id": "6", "prompt": "3"}, "4" * 20, None),  # over judge.max_tokens: flagged without a forward
]


def judge_config(**overrides):
    from rollpacker.reward.config import JudgeConfig
    from rollpacker.toy.model import toy_model_dir

    return JudgeConfig(model_path=str(toy_model_dir()), rubric=ADDER, max_score=7, max_tokens=14, **overrides)


@pytest.mark.parametrize("workers", [0, 1])
def test_judge_scores_one_bounded_batch_per_poll_and_the_rest_in_wait(workers, caplog):
    from rollpacker.reward.judge import Judge

    cfg = RewardConfig(funcs=("judge",), num_workers=workers, judge=judge_config(max_batch_tokens=28))  # 2 a forward
    scheduler = RewardScheduler(cfg, lambda ids: JUDGED[ids[0]][1])
    try:
        for i, (row, _, _) in enumerate(JUDGED):
            scheduler.submit(i, row, Response(id="", prompt_ids=[], token_ids=[i]))
        assert scheduler.judge is None  # loaded on the first poll, not at submit
        polls = [scheduler.poll(), scheduler.poll()]
        assert scheduler.take_metrics()["reward/seconds_total"] > 0
        polls.append(scheduler.wait())
        metrics = scheduler.take_metrics()
        assert metrics["reward/seconds_total"] > 0 and scheduler.wait() == scheduler.poll() == []
        assert metrics["reward/errors"] == 1 and metrics["reward/judge"] == pytest.approx((2 / 7 + 6 / 7) / 2)
        # packed in order: 14 + 14 tokens; 14 + 9 (the next 14 would pass 28); the rest (the long one costs 0)
        assert [[key for key, _ in done] for done in polls] == [[0, 1], [2, 3], [4, 5, 6]]
        got = dict(polls[0] + polls[1] + polls[2])
        assert got == {i: reward or 0.0 for i, (_, _, reward) in enumerate(JUDGED)}  # a failed one: 0 (skip)
        direct = Judge(cfg.judge).score([(row["prompt"], response) for row, response, _ in JUDGED],
                                        [row.get("rubric") for row, _, _ in JUDGED])
        assert got == {i: 0.0 if isinstance(r, Exception) else r for i, r in enumerate(direct)}
        errors = [r.getMessage() for r in caplog.records if "reward function 'judge' failed" in r.getMessage()]
        assert len(errors) == 2  # one line per take_metrics: the first failure of each, with a count
        assert "failed on 2 of 4 responses" in errors[0] and "row '2': judge verdict 8 is out of range" in errors[0]
        assert "failed on 1 of 3 responses" in errors[1] and "over judge.max_tokens=14" in errors[1]
    finally:
        scheduler.close()


def test_a_reward_model_whose_template_refuses_a_conversation_fails_that_response_alone(
        reward_model_dir, tmp_path, caplog):
    """An episode's tool turn that the reward model's chat template refuses: a reward_error for that
    response, the others scored."""
    import shutil

    from transformers import AutoTokenizer

    from rollpacker.reward.config import JudgeConfig

    rm = tmp_path / "rm"
    shutil.copytree(reward_model_dir, rm)
    tokenizer = AutoTokenizer.from_pretrained(rm)
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool "
                               "turns') }}{% endif %}{{ m.content }}\n{% endfor %}")
    tokenizer.save_pretrained(rm)
    cfg = RewardConfig(funcs=("judge",), num_workers=0, judge=JudgeConfig(model_path=str(rm)))
    tool_turns = [{"role": "assistant", "content": "calc(1+2)"}, {"role": "tool", "content": "3"},
                  {"role": "assistant", "content": "3"}]
    scheduler = RewardScheduler(cfg, lambda ids: "3")
    try:
        scheduler.submit(0, {"id": "a", "prompt": "1+2"}, Response(id="", prompt_ids=[], token_ids=[0]))
        scheduler.submit(1, {"id": "b", "prompt": "1+2"}, Response(id="", prompt_ids=[], token_ids=[0],
                                                                 messages=tool_turns))
        got = dict(scheduler.wait())
        metrics = scheduler.take_metrics()
    finally:
        scheduler.close()
    assert got[1] == 0.0 and got[0] != 0.0 and metrics["reward/errors"] == 1
    [error] = [r.getMessage() for r in caplog.records if "reward function 'judge' failed" in r.getMessage()]
    assert ("row 'b': the reward model's chat template refused the conversation: TemplateError: no tool turns"
            in error)


ASYNC_REWARDS = """
import asyncio, time

state = {"in_flight": 0, "peak": 0}


async def remote(completions, **kwargs):  # a remote reward model: its time is the network's
    text = completions[0]
    state["in_flight"] += 1
    state["peak"] = max(state["peak"], state["in_flight"])
    try:
        await asyncio.sleep(3600 if text == "hang" else 0.3)
        return [float(len(text))]
    finally:
        state["in_flight"] -= 1


async def cancels(completions, **kwargs):  # a gather whose sibling was cancelled: CancelledError is no Exception
    sibling = asyncio.ensure_future(asyncio.sleep(1))
    sibling.cancel()
    return await asyncio.gather(sibling)


async def blocking(completions, **kwargs):  # a sync request inside async def: it holds the loop
    time.sleep(3)
    return [1.0]
"""


@pytest.mark.parametrize("workers", [2, 0])  # 0: plain functions inline; async ones were awaited one at a time
def test_async_functions_are_awaited_together_up_to_max_concurrent_and_cancelled_at_their_timeout(tmp_path, workers):
    from rollpacker.imports import load

    (tmp_path / "remote_rm.py").write_text(ASYNC_REWARDS)
    spec = f"{tmp_path / 'remote_rm.py'}:remote"
    texts = ["a", "bb", "hang", "ccc", "dddd", "eeeee", "ffffff", "ggggggg", "hhhhhhhh"]
    cfg = RewardConfig(funcs=(spec,), num_workers=workers, max_concurrent=4, timeout=2.0)
    scheduler = RewardScheduler(cfg, lambda ids: texts[ids[0]])
    assert scheduler.pool is None and scheduler.async_calls is not None  # no worker process for an async function
    try:
        for i in range(len(texts)):
            scheduler.submit(i, {"id": str(i), "prompt": "p"}, Response(id="", prompt_ids=[], token_ids=[i]))
        got = dict(scheduler.poll()) | dict(scheduler.wait())
        metrics = scheduler.take_metrics()
    finally:
        scheduler.close()
    assert got == {i: 0.0 if t == "hang" else float(len(t)) for i, t in enumerate(texts)}
    assert load(spec, "reward.funcs").__globals__["state"]["peak"] == 4  # awaited together, never more than 4
    assert metrics["reward/errors"] == 1


def test_an_async_function_that_blocks_its_loop_stops_the_run_naming_it(tmp_path, monkeypatch):
    from rollpacker.reward import workers
    from rollpacker.reward.functions import RewardFunctionError

    monkeypatch.setattr(workers, "STALL_GRACE_S", 0.5)
    (tmp_path / "remote_rm.py").write_text(ASYNC_REWARDS)
    cfg = RewardConfig(funcs=(f"{tmp_path / 'remote_rm.py'}:blocking",), num_workers=1, timeout=0.5)
    scheduler = RewardScheduler(cfg, lambda ids: "x")
    try:
        scheduler.submit(0, {"id": "0", "prompt": "p"}, Response(id="", prompt_ids=[], token_ids=[0]))
        with pytest.raises(RewardFunctionError, match="async reward function blocking: no call returned within 1 s"):
            scheduler.wait()
    finally:
        scheduler.close()


def test_an_async_function_raising_cancelled_error_is_its_failure_not_a_stall(tmp_path, monkeypatch):
    """CancelledError is no Exception: it escaped, no result came back, and the stall check stopped the run naming
    the function a blocking one."""
    from rollpacker.reward import workers
    from rollpacker.reward.functions import RewardFunctionError

    monkeypatch.setattr(workers, "STALL_GRACE_S", 0.5)
    (tmp_path / "remote_rm.py").write_text(ASYNC_REWARDS)
    cfg = RewardConfig(funcs=(f"{tmp_path / 'remote_rm.py'}:cancels",), num_workers=1, timeout=0.5)
    scheduler = RewardScheduler(cfg, lambda ids: "x")
    try:
        scheduler.submit(0, {"id": "0", "prompt": "p"}, Response(id="", prompt_ids=[], token_ids=[0]))
        assert dict(scheduler.wait()) == {0: 0.0}
        with pytest.raises(RewardFunctionError, match="'cancels' failed on 1 of 1 .*raised CancelledError"):
            scheduler.take_metrics()  # every response failed: the run stops, naming the function's error
    finally:
        scheduler.close()


def test_a_value_a_worker_cannot_send_back_is_the_functions_failure(tmp_path, caplog):
    """A verl dict holding a lock could not be pickled back: the worker died, and the error said only that."""
    (tmp_path / "locked.py").write_text("import threading\n\ndef locked(data_source, solution_str, ground_truth, "
                                        "extra_info=None):\n    return {'score': 1.0, 'lock': threading.Lock()}\n")
    cfg = RewardConfig(funcs=(f"{tmp_path / 'locked.py'}:locked",), num_workers=1, max_error_frac=1.0)
    scheduler = RewardScheduler(cfg, lambda ids: "x")
    try:
        scheduler.submit(0, {"id": "0", "prompt": "p", "answer": "1"}, Response(id="", prompt_ids=[], token_ids=[0]))
        assert dict(scheduler.wait()) == {0: 0.0}
        assert scheduler.take_metrics()["reward/errors"] == 1
    finally:
        scheduler.close()
    assert "returned what cannot be sent from its reward worker (a lock, a generator?): TypeError" in caplog.text


def test_values_that_fail_to_pickle_or_to_unpickle_are_the_functions_failure_not_the_pools(tmp_path, caplog):
    """A value nested past the recursion limit killed its worker (said only "died"); one the trainer could not
    unpickle (an exception whose __init__ takes arguments) killed the pool's manager thread, and so the run."""
    (tmp_path / "odd.py").write_text(
        "class Verdict(Exception):\n    def __init__(self, test, why):\n        super().__init__(f'{test}: {why}')\n\n"
        "def odd(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'deep':\n        value = []\n        for _ in range(100_000):\n"
        "            value = [value]\n        return {'score': 1.0, 'deep': value}\n"
        "    if solution_str == 'verdict':\n        return {'score': 1.0, 'why': Verdict(1, 'wrong')}\n"
        "    return 1.0\n")
    cfg = RewardConfig(funcs=(f"{tmp_path / 'odd.py'}:odd",), num_workers=1, max_error_frac=1.0)
    texts = ["deep", "verdict", "fine"]
    scheduler = RewardScheduler(cfg, lambda ids: texts[ids[0]])
    try:
        for i in range(3):
            scheduler.submit(i, {"id": str(i), "prompt": "p", "answer": "1"},
                             Response(id="", prompt_ids=[], token_ids=[i]))
            assert dict(scheduler.wait()) == {i: float(i == 2)}  # one at a time: the third on a fresh worker
            assert scheduler.take_metrics()["reward/errors"] == (i < 2)
    finally:
        scheduler.close()
    assert "cannot be sent from its reward worker (a lock, a generator?): RecursionError" in caplog.text
    assert ("its reply cannot be read here (TypeError: Verdict.__init__() missing 1 required positional argument: "
            "'why'): return plain data") in caplog.text


def test_judge_needs_a_model_directory(tmp_path):
    from rollpacker.reward.config import JudgeConfig

    with pytest.raises(ValueError, match="reward.judge.model_path is empty.*--reward.judge.model-path"):
        RewardConfig(funcs=("judge",), num_workers=0)
    with pytest.raises(ValueError, match="is not a Hugging Face model directory"):
        RewardConfig(funcs=("judge",), num_workers=0, judge=JudgeConfig(model_path=str(tmp_path)))
    RewardScheduler(RewardConfig(funcs=("math",), num_workers=0), str).close()  # other functions need no judge


SLOW_REWARD = """
import time


def slow(completions, **kwargs):  # a sandbox's tests, say: slower than the rollout
    time.sleep(0.6)
    return [float(len(completions[0]) % 2)]
"""


def test_a_wait_for_some_responses_ends_at_its_timeout_and_refuses_one_never_submitted(tmp_path):
    (tmp_path / "slow_rm.py").write_text(SLOW_REWARD)
    cfg = RewardConfig(funcs=(f"{tmp_path / 'slow_rm.py'}:slow",), num_workers=1)
    scheduler = RewardScheduler(cfg, lambda ids: "x" * ids[0])
    try:
        for i in range(3):
            scheduler.submit(i, {"id": str(i), "prompt": "p"}, Response(id="", prompt_ids=[], token_ids=[i]))
        first = dict(scheduler.wait([0, 1, 2], timeout=0.1))  # three calls of 0.6 s: not all in
        assert len(first) < 3
        rest = dict(scheduler.wait([k for k in range(3) if k not in first]))
        assert first | rest == {0: 0.0, 1: 1.0, 2: 0.0}
        with pytest.raises(RuntimeError, match=r"responses \['7'\] have no reward and none is being computed"):
            scheduler.wait([7], timeout=5)
    finally:
        scheduler.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("args", [
    # end_of_round in the slow tier: mid_round waits at the round's end too (22 s of the default tier)
    pytest.param([], marks=pytest.mark.slow), ["--schedule.filter-zero-variance"],
    # 16 calls of 0.6 s after a rollout of 32-token responses: they outlasted its old bound of 8 s (0.25 s a token);
    # one_step_off's first wait past the first step is the training pool's for batch 2
    # the slow tier for these two: 35 s and 27 s of the default tier's 15 minutes
    pytest.param(["schedule:one_step_off", "--train.rollout-correction", "token_tis", "--rollout.num-prompts", "8",
                  "--num-steps", "3"], marks=pytest.mark.slow),
    # shuffle seed 1: both steps' rounds free a rank (seed 0's second round ends without)
    pytest.param(["--stream.enabled", "--stream.criterion", "kv", "--train.train-shard-size", "1",
                  "--rollout.num-prompts", "8", "--data.shuffle-seed", "1"], marks=pytest.mark.slow)],
    ids=["end_of_round", "mid_round", "one_step_off", "stream"])
def test_scoring_longer_than_the_collective_timeout_is_waited_for(tmp_path, args):
    """Rank 0 waits for the last scores while the other ranks wait on it: past dist.timeout_s the job went on
    only if rank 0 polls them between exchanges (dynamic sampling waits mid-round too), and if the training
    pool (one_step_off) and the ranks stream training freed wait as long as rank 0 moves."""
    from support.jobs import QUIET, launch_job

    (tmp_path / "slow_rm.py").write_text(SLOW_REWARD)
    run_dir = tmp_path / "run"
    proc = launch_job("--reward.funcs", f"{tmp_path / 'slow_rm.py'}:slow", "--reward.num-workers", "1",
                      "--dist.timeout-s", "2", "--num-steps", "2", "--rollout.num-prompts", "4",
                      "--rollout.group-size", "2", "--rollout.max-new-tokens", "32", "--eval-every", "0",
                      *QUIET, "--run-dir", str(run_dir), *args, timeout=200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(3 if "--num-steps" in args else 2))
    if "--stream.enabled" in args:  # its freed rank waited through the scoring
        assert all(r["stream/scaled_down"] == 1 for r in records)
    assert records[1]["time/reward_exposed"] > 2  # the wait outlasted the timeout of step 1's collectives


@pytest.mark.timeout(300)
def test_reward_correct_names_the_function_accuracy_pass_at_k_and_retire_solved_count(tmp_path):
    """TRL's accuracy + format pair: a format reward of 1 made every response's reward >= 1, so reward/accuracy,
    eval/accuracy, eval/pass@k and data.retire_solved counted every response correct. With reward.correct toy they
    count the toy function's, as the samples hold it."""
    from support.jobs import QUIET, launch_job

    (tmp_path / "fmt.py").write_text("def fmt(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    run_dir = tmp_path / "run"
    proc = launch_job("--reward.funcs", "toy", f"{tmp_path / 'fmt.py'}:fmt", "--reward.correct", "toy",
                      "--data.retire-solved", "0.5", "--num-steps", "1", "--rollout.num-prompts", "8",
                      "--rollout.group-size", "2", "--rollout.max-new-tokens", "32", "--eval-every", "1",
                      "--eval.n", "2", "--eval.temperature", "1", "--metrics.samples-every", "1", *QUIET,
                      "--run-dir", str(run_dir), nproc=1, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][0]

    def read(name: str) -> list[dict]:
        return [json.loads(line) for line in (run_dir / "samples" / f"{name}.jsonl").read_text().splitlines()]

    trained, evaluated = read("step_0"), read("eval_step_0")
    assert all(s["reward"] >= 1 for s in trained + evaluated)
    assert any(s["rewards"]["toy"] < 1 for s in trained) and any(s["rewards"]["toy"] < 1 for s in evaluated)
    solved = [s["rewards"]["toy"] >= 1 for s in trained if s["trained"]]
    assert first["reward/accuracy"] == pytest.approx(sum(solved) / len(solved))
    assert first["eval/accuracy"] == pytest.approx(sum(s["rewards"]["toy"] >= 1 for s in evaluated) / len(evaluated))
    # each function's held-out mean and errors, under eval/ (they were dropped); no held-out response is trained
    assert first["eval/reward/toy"] == pytest.approx(sum(s["rewards"]["toy"] for s in evaluated) / len(evaluated))
    assert (first["eval/reward/fmt"], first["eval/reward/errors"]) == (1.0, 0)
    assert "eval/reward/seconds_total" not in first
    assert not any(s["trained"] for s in evaluated)
    by_row = {}
    for s in evaluated:
        by_row.setdefault(s["row"], []).append(s["rewards"]["toy"] >= 1)
    assert first["eval/pass@2"] == pytest.approx(sum(any(c) for c in by_row.values()) / len(by_row))
    groups = {}
    for s in trained:
        groups.setdefault(s["row"], []).append(s["rewards"]["toy"] >= 1)
    assert first["sched/retired"] == sum(sum(g) >= 1 for g in groups.values()) < len(groups)  # half of each group
