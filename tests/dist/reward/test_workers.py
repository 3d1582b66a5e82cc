"""The reward worker pool: asynchronous scoring in killable processes, flagged failures, recovery.

Real worker processes, real math-verify and the real code sandbox; timeouts are short so the
hangs cost seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from support.jobs import sandboxed_pids

from rollpacker.imports import target
from rollpacker.reward.code import AdaptiveTimeout
from rollpacker.reward.config import RewardConfig
from rollpacker.reward.functions import BUILTINS, Ref
from rollpacker.reward.sandbox import SandboxConfig
from rollpacker.reward.workers import STOP_GRACE, RewardPool
from rollpacker.workers import ORPHAN_GRACE

TOWER = "\\boxed{10^{10^{10^{10^{10}}}}}"  # math-verify tries to evaluate it: past MATH_TIME_LIMIT


def task(kind: str, payload: dict) -> tuple[Ref, dict, float | None]:
    """A built-in's call on one response, from ``{"response", ...its columns}``; code's timeout covers its tests."""
    columns = {k: v for k, v in payload.items() if k != "response"}
    if kind == "code":
        columns["sandbox"] = SandboxConfig()
    timeout = 3.0 + sum(columns["timeouts"]) if "timeouts" in columns else None
    return Ref(kind, target(kind, BUILTINS)), {"prompt": "", "completion": payload["response"], "completion_ids": [],
                                     "columns": columns}, timeout


def by_key(results):
    return {r.key: r for r in results}


def worker_pids(pool: RewardPool) -> list[int]:
    return [w.process.pid for w in pool._workers]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def pool():
    with RewardPool(RewardConfig(num_workers=2, timeout=3.0), (target("math", BUILTINS),)) as pool:  # as a job's:
        yield pool  # math-verify imported before the first call's 3 s (a loaded machine took longer)


def test_scores_every_kind(pool):
    code = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    pool.submit("math-right", *task("math", {"response": "so \\boxed{\\frac{1}{2}}", "answer": "0.5"}))
    pool.submit("math-wrong", *task("math", {"response": "\\boxed{3}", "answer": "2"}))
    pool.submit("toy", *task("toy", {"response": " 1+1=2\n#### 2", "answer": "2"}))
    pool.submit("code", *task("code", {"response": code, "tests": [{"input": "2 3", "output": "5"}],
                                       "timeouts": [5.0]}))
    results = by_key(pool.drain(timeout=60))
    assert {k: r.score for k, r in results.items()} == {"math-right": 1.0, "math-wrong": 0.0, "toy": 1.0, "code": 1.0}
    assert all(r.error is None and r.seconds > 0 and r.cpu_seconds >= 0 for r in results.values())
    assert results["code"].info["verdicts"] == ["PASS"]
    assert pool._num_unfinished == 0 and pool.poll() == []


def test_a_reward_that_raises_is_flagged(pool):
    pool.submit("bad-gold", *task("math", {"response": "\\boxed{1}", "answer": ""}))
    [result] = pool.drain(timeout=60)
    assert result.score is None and "gold answer '' holds no parsable expression" in result.error


@pytest.mark.parametrize(
    "response",
    [
        "\\boxed{" + "7" * (1 << 20) + "}",  # a 1 MB answer
        "\\boxed{" + "\\frac{1}{" * 10_000 + "2" + "}" * 10_001,  # 10k nested \frac
        TOWER,
        "\\boxed{9^{9^{9^{9^{9}}}}} = \\boxed{2^{2^{2^{2^{2^{2^{2}}}}}}}",
    ],
    ids=["1mb", "nested_frac", "tower_10", "tower_9_and_2"],
)
def test_hostile_math_is_zero_or_flagged_in_time(pool, response):
    start = time.monotonic()
    pool.submit("hostile", *task("math", {"response": response, "answer": "42"}))
    [result] = pool.drain(timeout=60)
    assert result.score == 0.0 or (result.score is None and result.error)
    assert time.monotonic() - start < pool.cfg.timeout + 10  # 10 s: a replacement worker may still be starting


RAISES_BASE_EXCEPTION = """
from math_verify.errors import TimeoutException


def score(completions, **kwargs):
    raise TimeoutException("Timeout during comparison")  # a BaseException, as math-verify's own timeouts raise it
"""


def test_math_past_its_time_limit_scores_zero_and_its_worker_lives(tmp_path):
    """An answer math-verify cannot check within MATH_TIME_LIMIT scores 0 at reward.timeout's default, not killed
    (a worker restart, a reward error); a user's function that raises a BaseException (math-verify's timeout with
    raise_on_error) is flagged, its worker lives."""
    (tmp_path / "base.py").write_text(RAISES_BASE_EXCEPTION)
    ref = Ref("score", f"{tmp_path / 'base.py'}:score")
    with RewardPool(RewardConfig(num_workers=1), (target("math", BUILTINS), ref.target)) as pool:
        pids = worker_pids(pool)
        pool.submit("tower", *task("math", {"response": TOWER, "answer": "42"}))
        pool.submit("user", ref, {"prompt": "", "completion": "x", "completion_ids": [], "columns": {}})
        pool.submit("after", *task("math", {"response": "\\boxed{2}", "answer": "2"}))
        results = by_key(pool.drain(timeout=60))
        assert (results["tower"].score, results["tower"].error) == (0.0, None)
        assert results["user"].score is None and results["user"].error == ("raised TimeoutException: Timeout "
                                                                           "during comparison")
        assert (results["after"].score, results["after"].error) == (1.0, None)
        assert worker_pids(pool) == pids


def test_hung_tasks_are_killed_and_capacity_recovers():
    # the functions warmed up as each worker starts, as the job's are: a replacement's first math call importing
    # math-verify inside its 1.5 s timed out on a loaded machine
    warmed = (target("toy", BUILTINS), target("math", BUILTINS))
    with RewardPool(RewardConfig(num_workers=2, timeout=1.5), warmed) as pool:
        pool.submit("warm", *task("toy", {"response": "#### 1", "answer": "1"}))
        pool.drain(timeout=60)
        old_pids = worker_pids(pool)
        pool.submit("hang-1", *task("math", {"response": TOWER, "answer": "1"}))
        pool.submit("hang-2", *task("math", {"response": TOWER, "answer": "1"}))
        for i in range(6):
            pool.submit(i, *task("math", {"response": f"\\boxed{{{i}}}", "answer": str(i)}))
        with pytest.raises(TimeoutError, match="still unscored"):
            pool.drain(timeout=0.2)
        results = by_key(pool.drain(timeout=60))
        assert set(results) == {"hang-1", "hang-2", *range(6)}
        for key in ("hang-1", "hang-2"):
            assert results[key].score is None and "timed out after 1.5 s" in results[key].error
            assert 1.5 <= results[key].seconds < 3
        assert all(results[i].score == 1.0 and results[i].error is None for i in range(6))
        assert not set(worker_pids(pool)) & set(old_pids)
        time.sleep(STOP_GRACE + 0.5)
        assert not any(alive(pid) for pid in old_pids)
        assert len(worker_pids(pool)) == 2 and all(alive(pid) for pid in worker_pids(pool))


def test_crashed_worker_is_flagged_and_replaced():
    with RewardPool(RewardConfig(num_workers=1, timeout=60)) as pool:
        pool.submit("warm", *task("toy", {"response": "#### 1", "answer": "1"}))
        pool.drain(timeout=60)
        [pid] = worker_pids(pool)
        pool.submit("victim", *task("math", {"response": TOWER, "answer": "1"}))
        time.sleep(0.5)
        os.kill(pid, 9)
        [result] = pool.drain(timeout=30)
        assert result.key == "victim" and result.score is None and "worker died (exit code -9)" in result.error
        pool.submit("after", *task("math", {"response": "\\boxed{2}", "answer": "2"}))
        [result] = pool.drain(timeout=60)
        assert result.score == 1.0 and worker_pids(pool) != [pid]


SLOW_TO_LOAD = """
import time

time.sleep(1.5)  # its import loads something, as a model or a dataset


class Scorer:
    warmed = False

    def warm_up(self):
        time.sleep(1.5)
        self.warmed = True

    def score(self, completions, **kwargs):
        return [1.0 if self.warmed else 0.5 for _ in completions]


score = Scorer().score
{hang}
"""


def test_a_function_is_loaded_and_warmed_up_as_its_worker_starts_not_in_its_first_calls_timeout(tmp_path):
    """A module that takes 1.5 s to import and whose function's object warms up 1.5 s more (as a verifiers
    factory's score_group loads its environment): the worker does both before it says ready, so the first sample
    is scored within a 1 s reward.timeout, warmed up. A warm-up that hangs stops the pool after
    reward.start_timeout, naming it; the worker is stopped with the pool."""
    (tmp_path / "slow.py").write_text(SLOW_TO_LOAD.format(hang=""))
    ref, sample = Ref("score", f"{tmp_path / 'slow.py'}:score"), {"prompt": "", "completion": "x",
                                                                 "completion_ids": [], "columns": {}}
    with RewardPool(RewardConfig(num_workers=1, timeout=1.0), (ref.target,)) as pool:
        pool.submit("first", ref, sample)
        [result] = pool.drain(timeout=60)
    assert (result.score, result.error) == (1.0, None)

    (tmp_path / "hangs.py").write_text(SLOW_TO_LOAD.format(hang="Scorer.warm_up = lambda self: time.sleep(600)"))
    ref = Ref("score", f"{tmp_path / 'hangs.py'}:score")
    with RewardPool(RewardConfig(num_workers=1, timeout=1.0, start_timeout=4), (ref.target,)) as pool:
        [pid] = worker_pids(pool)
        pool.submit("never", ref, sample)
        with pytest.raises(RuntimeError, match=r"a reward worker did not start within 4 s \(reward.start_timeout\) "
                                               r"loading .*hangs.py:score: it hangs, or needs longer"):
            pool.drain(timeout=60)
    time.sleep(STOP_GRACE + 0.5)
    assert not alive(pid)

    (tmp_path / "raises.py").write_text(SLOW_TO_LOAD.format(hang="Scorer.warm_up = lambda self: 1 / 0"))
    ref = Ref("score", f"{tmp_path / 'raises.py'}:score")
    with RewardPool(RewardConfig(num_workers=1, timeout=1.0), (ref.target,)) as pool:  # no call would meet it
        pool.submit("never", ref, sample)
        with pytest.raises(RuntimeError, match=r"the reward workers could not start: reward.funcs: the warm_up\(\) of "
                                               r"score \(.*raises.py:score\) raised ZeroDivisionError"):
            pool.drain(60)


STUCK_IN_C = """
import hashlib, os, sys


def score(completions, **kwargs):
    with open(os.environ["STUCK_PID_FILE"], "w") as f:
        f.write(str(os.getpid()))
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", 2**31 - 1)  # minutes in C, where no Python signal handler runs
    return [1.0 for _ in completions]
"""

RANK = textwrap.dedent("""
    import os, sys, time
    from rollpacker.reward.config import RewardConfig
    from rollpacker.reward.functions import Ref
    from rollpacker.reward.workers import RewardPool

    if __name__ == "__main__":
        ref = Ref("score", sys.argv[1] + ":score")
        pool = RewardPool(RewardConfig(num_workers=1, timeout=1.0), (ref.target,))
        pool.submit("stuck", ref, {"prompt": "", "completion": "x", "completion_ids": [], "columns": {}})
        while not os.path.exists(os.environ["STUCK_PID_FILE"]):
            time.sleep(0.05)
        os.kill(os.getpid(), 9)  # the rank dies with its worker in the call, before the pool's timeout
""")


@pytest.mark.slow  # 15 s of waiting for the watchdog
def test_a_worker_stuck_in_c_code_does_not_outlive_its_dead_rank(tmp_path):
    """A reward call stuck in C code (a hash here; a regex, a solver) when its rank is killed: its parent-death
    signal's handler cannot run until the call returns, in minutes or never; the task's watchdog (a C thread)
    ends the worker ORPHAN_GRACE seconds after its pool would have killed it."""
    (tmp_path / "stuck.py").write_text(STUCK_IN_C)
    pid_file, log = tmp_path / "pid", tmp_path / "rank.log"
    with open(log, "w") as out:  # not a pipe: the worker inherits it, and would hold a pipe's reader
        rank = subprocess.run([sys.executable, "-c", RANK, str(tmp_path / "stuck.py")], stdout=out, stderr=out,
                              timeout=120, env=os.environ | {"STUCK_PID_FILE": str(pid_file)})
    assert rank.returncode == -9, log.read_text()[-2000:]
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 1.0 + STOP_GRACE + ORPHAN_GRACE + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive(pid):
        os.kill(pid, 9)
        pytest.fail("the worker outlived its rank")
    assert "stuck.py" in log.read_text()  # where it was stuck, in the stack its watchdog dumped


def test_hostile_code_through_the_pool(pool):
    before = sandboxed_pids()
    programs = {
        "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "busy": "while True:\n    pass",
        "flood": "while True:\n    print('x' * 4096)",
        "kill_parent": "import os\nfor pid in (-1, 1, os.getppid()):\n    try:\n        os.kill(pid, 9)\n"
                       "    except OSError:\n        pass",
    }
    start = time.monotonic()
    for name, program in programs.items():
        pool.submit(name, *task("code", {"response": f"```python\n{program}\n```",
                                         "tests": [{"input": "", "output": "1"}], "timeouts": [1.0]}))
    results = by_key(pool.drain(timeout=60))
    assert {k: r.score for k, r in results.items()} == dict.fromkeys(programs, 0.0)
    assert results["busy"].info["verdicts"] == ["TIMEOUT"] and results["flood"].info["verdicts"] == ["OUTPUT_LIMIT"]
    assert time.monotonic() - start < 15
    assert sandboxed_pids() <= before


def test_fifty_correct_solutions_concurrently():
    tests = [{"input": "3\n", "output": "9"}, {"input": "12\n", "output": "144"}]
    timeout = AdaptiveTimeout(minimum=20.0, maximum=30.0)  # generous: 2 CPUs shared by 50 programs in CI
    with RewardPool(RewardConfig(num_workers=4)) as pool:
        for i in range(50):
            program = f"```python\n# solution {i}\nn = int(input())\nprint(n * n + {i} - {i})\n```"
            pool.submit(i, *task("code", {"response": program, "tests": tests, "timeouts": timeout.timeouts(tests)}))
        results = pool.drain(timeout=300)
    assert sorted(r.key for r in results) == list(range(50))
    assert all(r.score == 1.0 and r.error is None and r.info["verdicts"] == ["PASS", "PASS"] for r in results)
    for r in results:
        timeout.observe(tests, r.info)
    slowest = [max(r.info["seconds"][j] for r in results) for j in range(2)]
    assert list(timeout.anchors.values()) == slowest  # the anchors: the slowest correct run per test case


def test_close_stops_every_process():
    before = sandboxed_pids()
    pool = RewardPool(RewardConfig(num_workers=2, timeout=60))
    pool.submit("warm", *task("toy", {"response": "#### 1", "answer": "1"}))
    pool.drain(timeout=60)
    pool.submit("hung-math", *task("math", {"response": TOWER, "answer": "1"}))
    pool.submit("hung-code", *task("code", {"response": "```python\nimport time\ntime.sleep(1e6)\n```",
                                      "tests": [{"input": "", "output": "1"}], "timeouts": [60.0]}))
    time.sleep(1.0)
    pids = worker_pids(pool)
    pool.close()
    assert not any(alive(pid) for pid in pids)
    assert sandboxed_pids() <= before
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(0, *task("toy", {"response": "", "answer": "1"}))


EXITS = "import sys\nsys.exit(4)\n"

SPAWNS = """
import os, subprocess, time


def score(completions, **kwargs):
    child = subprocess.Popen(["sleep", "600"])
    with open(os.environ["CHILD_PID_FILE"], "w") as f:
        f.write(str(child.pid))
    time.sleep(600)
"""


def test_a_worker_exiting_as_it_starts_stops_the_pool_once_and_what_a_worker_started_goes_with_it(tmp_path,
                                                                                                  monkeypatch):
    """A file that exits on import: its worker's pipe and sentinel are ready together, and the pipe's end read
    first replaced it, again and again (a hundred workers in 10 s, the sample never answered). A process the
    user's function started (in the worker's process group) outlived the pool's close."""
    (tmp_path / "exits.py").write_text(EXITS)
    ref = Ref("score", f"{tmp_path / 'exits.py'}:score")
    with RewardPool(RewardConfig(num_workers=1, timeout=1.0), (ref.target,)) as pool:
        pool.submit("never", ref, {"prompt": "", "completion": "x", "completion_ids": [], "columns": {}})
        with pytest.raises(RuntimeError, match=r"a reward worker exited while starting \(exit code 4\)"):
            pool.drain(timeout=30)
    (tmp_path / "spawns.py").write_text(SPAWNS)
    monkeypatch.setenv("CHILD_PID_FILE", str(tmp_path / "child.pid"))
    ref = Ref("score", f"{tmp_path / 'spawns.py'}:score")
    pool = RewardPool(RewardConfig(num_workers=1, timeout=60.0), (ref.target,))
    pool.submit("spawns", ref, {"prompt": "", "completion": "x", "completion_ids": [], "columns": {}})
    written = tmp_path / "child.pid"
    while not (written.exists() and written.read_text()):
        time.sleep(0.05)
    child = int(written.read_text())
    pool.close()
    time.sleep(0.5)  # its parent gone, init reaps it
    assert not alive(child)


def test_reward_config_validates():
    with pytest.raises(ValueError, match=r"reward.weights has 1 weights for 2 reward.funcs \(toy, math\): give one "
                                         r"each, or none for 1 each \(a preset's weights stay when a flag replaces"):
        RewardConfig(funcs=("toy", "math"), weights=(1.0,))
    with pytest.raises(ValueError, match="reward.funcs: 'nope' is neither a built-in"):
        RewardConfig(funcs=("nope",))
    with pytest.raises(ValueError, match=r"reward.timeout_max \(1.0\) must be >= reward.timeout_min \(2.0\)"):
        RewardConfig(timeout_max=1.0)
    with pytest.raises(ValueError, match=r"reward.timeout_factor must be >= 1 \(a test's timeout is this multiple "
                                         r"of its slowest correct run\), got 0.5"):
        RewardConfig(timeout_factor=0.5)  # the anchoring run itself would time out
    with pytest.raises(ValueError, match="reward.num_workers must be >= 0, got -1"):
        RewardConfig(num_workers=-1)
