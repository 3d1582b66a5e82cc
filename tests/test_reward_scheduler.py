"""The reward scheduler the controller drives: scores come back per sample, failures as None."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rollpacker.reward.config import RewardConfig
from rollpacker.reward.scheduler import RewardScheduler

ROWS = [{"answer": "4"}, {"answer": "4"}, {"answer": "\\frac{1}{2}"}]
RESPONSES = ["so \\boxed{4}", "so \\boxed{5}", "\\boxed{10^{10^{10^{10}}}}"]


def score_all(cfg: RewardConfig) -> dict:
    scheduler = RewardScheduler(cfg, "math", lambda ids: RESPONSES[ids[0]])
    try:
        for i, row in enumerate(ROWS[:2]):
            scheduler.submit(i, row, SimpleNamespace(token_ids=[i]))
        got = dict(scheduler.poll()) | dict(scheduler.wait())
        assert scheduler.take_seconds() > 0 and scheduler.take_seconds() == 0
        return got
    finally:
        scheduler.close()


def test_pool_and_inline_scoring_agree():
    assert score_all(RewardConfig(num_workers=2)) == score_all(RewardConfig(num_workers=0)) == {0: 1.0, 1: 0.0}


@pytest.mark.timeout(60)
def test_a_hanging_reward_comes_back_flagged_and_the_pool_goes_on():
    scheduler = RewardScheduler(RewardConfig(num_workers=1, timeout=2.0), "math", lambda ids: RESPONSES[ids[0]])
    try:
        scheduler.submit("hang", ROWS[2], SimpleNamespace(token_ids=[2]))
        scheduler.submit("ok", ROWS[0], SimpleNamespace(token_ids=[0]))
        assert dict(scheduler.wait()) == {"hang": None, "ok": 1.0}
    finally:
        scheduler.close()


def test_rewards_bench_smoke(capsys):
    from rollpacker.bench.rewards import main

    main(["--responses", "4", "--rollout-seconds", "0.5", "--fixed-timeout", "3", "--loop-fraction", "0",
          "--slow-fraction", "0", "--wrong-fraction", "0.3"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for name in ("sync_fixed", "async_fixed", "sync_adaptive", "async_adaptive"):
        assert summary[f"step_{name}"] >= 0.5 and summary[f"exposed_{name}"] >= 0


@pytest.mark.parametrize("workers", [0, 1])
def test_code_rows_are_sandboxed_and_teach_the_adaptive_timeout(workers):
    row = {"prompt": "add", "tests": [{"input": "1 2\n", "output": "3\n"}]}
    programs = ["```python\nprint(sum(map(int, input().split())))\n```", "```python\nprint(4)\n```"]
    scheduler = RewardScheduler(RewardConfig(num_workers=workers), "code", lambda ids: programs[ids[0]])
    try:
        for i in range(2):
            scheduler.submit(i, row, SimpleNamespace(token_ids=[i]))
        assert dict(scheduler.wait()) == {0: 1.0, 1: 0.0}
        [anchor] = scheduler.state_dict()["timeouts"]["anchors"].values()
        assert 0 < anchor < 2.0
    finally:
        scheduler.close()
