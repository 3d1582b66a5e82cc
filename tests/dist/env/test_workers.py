"""Environments in killable worker processes: episodes of the toy environment with the toy model,
tools in the workers, and environments that hang, raise, return garbage or cannot be sent back."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import pytest
from support.chat import ADD_TOOL

from rollpacker.env.config import EnvConfig
from rollpacker.env.workers import EnvPool
from rollpacker.workers import PoolError

BAD_ENV = '''
import time


class Env:
    def __init__(self, row):
        self.mode, self.id = row["mode"], row["id"]

    def close(self):
        open(f"closed-{self.id}", "w").close()

    def reset(self, *, seed, options):
        return None, {}

    def step(self, action):
        if self.mode == "hang":
            time.sleep(600)
        if self.mode == "raise":
            raise ValueError("the board is on fire")
        if self.mode == "garbage":
            return "obs", 1.0
        if self.mode == "unpicklable":
            return "obs", 1.0, False, False, {"handle": lambda: 0}
        return "fine", 0.5, False, False, {}


def make_env(row):
    return Env(row)
'''

TOOLS = ADD_TOOL


def test_toy_episodes_with_the_toy_model_and_environments_in_workers():
    """The toy model answers toy problems; a wrong answer (or one cut at its 150 tokens) gets another
    try. Every turn the episode shows was stepped in a worker, the environment's tokens are masked
    and carry no log-prob."""
    import torch
    from transformers import AutoTokenizer

    from rollpacker.env.render import ChatBridge
    from rollpacker.model import load_model
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.torch_engine import TorchEngine
    from rollpacker.toy.model import toy_model_dir
    from rollpacker.toy.task import make_dataset
    from tests.support.episodes import run_episodes

    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir())
    engine = TorchEngine(load_model(toy_model_dir(), torch.device("cpu"), torch.float32), EngineConfig())
    rows = make_dataset(12, seed=5, alpha=1.6)
    with EnvPool(EnvConfig(factory="toy", num_workers=2, timeout=20)) as pool:
        run = run_episodes(engine, pool, ChatBridge(tokenizer), rows, seed=1, max_turns=2, max_tokens=300,
                           max_new_tokens=150, temperature=1.0)
        assert pool._episodes == {}  # every environment closed
    assert not run.errors and len(run.episodes) == len(rows)
    turns = sorted(e.num_turns for e in run.episodes.values())
    assert turns[-1] == 2, turns  # another try after a wrong answer
    cut = [e for e in run.episodes.values() if e.loss_mask[:150] == [True] * 150]  # a first turn at its limit
    assert cut and all(e.num_turns == 2 for e in cut)  # ... went to the environment like any other
    for key, e in run.episodes.items():
        row = rows[int(key.split(":")[1])]
        assert e.done.reason in ("terminated", "length", "max_tokens"), e.done
        assert run.steps.get(key, 0) == e.num_turns - (e.done.reason != "terminated")
        env_ids = [t for t, m in zip(e.response_ids, e.loss_mask) if not m]
        if e.num_turns == 2:
            assert tokenizer.decode(env_ids) == "\n" + row["prompt"]  # the problem again, as a user turn
        assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.loss_mask) if not m)
        assert all(lp < 0.0 for lp, m in zip(e.logprobs, e.loss_mask) if m)
        assert e.num_model_tokens + e.num_env_tokens == len(e.response_ids)
        if e.done.reason == "terminated":
            assert list(e.step_rewards) == [max(i for i, m in enumerate(e.loss_mask) if m)]


def test_tools_run_in_the_workers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tools.py").write_text(textwrap.dedent(TOOLS))
    with EnvPool(EnvConfig(tools=("tools.py:add", "python"), num_workers=1, timeout=30)) as pool:
        pool.open_episode("e", {"id": "r0", "prompt": "p"}, 0)
        (opened,) = pool.drain(60)
        assert [t["function"]["name"] for t in opened.value[1]["tools"]] == ["add", "python"]
        pool.step_episode("e", '<tool_call>{"name": "add", "arguments": {"a": 40, "b": 2}}</tool_call>'
                               '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
                               '<tool_call>{"name": "python", "arguments": {"code": "1 / 0"}}</tool_call>')
        (step,) = pool.drain(60)
        assert [m["content"] for m in step.value.observation][:2] == ["42", "42\n"]
        assert "ZeroDivisionError" in step.value.observation[2]["content"]
        assert step.value.info == {"tool_calls": 3, "tool_errors": 1}  # the program that raised failed
        pool.step_episode("e", "It is 42.")
        pool.close_episode("e")
        answered, closed = pool.drain(60)
        assert answered.value.terminated and closed.kind == "close" and not closed.error


SLOW_TOOL = '''
import asyncio

async def wait(seconds: int) -> str:
    """Wait.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "waited"
'''


def test_a_turns_calls_answer_within_the_timeout_and_the_worker_goes_on(tmp_path, monkeypatch):
    """A hanging async tool and a looping program took the whole env.timeout: the worker was killed, and every
    episode on it failed. The async call is cancelled at the turn's deadline, the calls after it are not run, and
    the built-in python's program gets what is left of the turn: each is answered, and the episodes go on."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tools.py").write_text(textwrap.dedent(TOOLS) + textwrap.dedent(SLOW_TOOL))
    call = '<tool_call>{"name": "%s", "arguments": %s}</tool_call>'
    with EnvPool(EnvConfig(tools=("tools.py:add", "tools.py:wait", "python"), num_workers=1, timeout=4)) as pool:
        for key in ("a", "b"):
            pool.open_episode(key, {"id": key, "prompt": "p"}, 0)
        assert not any(r.error for r in pool.drain(60))
        pool.step_episode("a", call % ("wait", '{"seconds": 60}') + call % ("add", '{"a": 1, "b": 2}'))
        pool.step_episode("b", call % ("python", '{"code": "while True: pass"}') + call % ("add", '{"a": 1, "b": 2}'))
        replies = {r.key: r for r in pool.drain(60)}
        assert not any(r.error for r in replies.values()), replies
        waited, added = [m["content"] for m in replies["a"].value.observation]
        assert waited == "error: wait timed out: this turn's calls have 4 s (env.timeout)"
        assert added == "error: not run: this turn's calls took their 4 s (env.timeout)"
        looped, added = [m["content"] for m in replies["b"].value.observation]
        assert re.fullmatch(r"\n\[timed out after \d\.\d+ s\]", looped), looped  # its 3.2 s less the sandbox's kill
        assert added in ("3", "error: not run: this turn's calls took their 4 s (env.timeout)")
        assert replies["b"].value.info["tool_errors"] == 1 + (added != "3")  # the program's timeout counts
        pool.step_episode("a", call % ("add", '{"a": 40, "b": 2}'))
        (again,) = pool.drain(60)
        assert not again.error and again.value.observation[0]["content"] == "42"


def test_the_python_tool_runs_code_in_the_sandbox():
    from rollpacker.env.tools import python

    assert python("print(6 * 7)") == "42\n"
    assert "ZeroDivisionError" in python("1 / 0")
    assert python("import socket\ntry:\n socket.create_connection(('1.1.1.1', 53), 1)\nexcept OSError:\n print('no')"
                  ) == "no\n"


def test_the_python_tool_runs_under_reward_sandbox_and_a_missing_sandbox_stops_the_pool(tmp_path):
    """It ran under the default sandbox whatever reward.sandbox said, and without isolation every call was
    answered with the sandbox's error, trained on."""
    from rollpacker.env.workers import EnvSpec
    from rollpacker.reward.sandbox import SandboxConfig

    cfg = EnvConfig(tools=("python",), num_workers=1)
    seen = "import os\nprint(os.getpid() < 10)"
    for isolation, visible in (("auto", "True"), ("none", "False")):  # in a PID namespace of its own, or not
        with EnvPool(cfg, EnvSpec.from_config(cfg, sandbox=SandboxConfig(isolation=isolation))) as pool:
            pool.open_episode("a", {"id": "a"}, 0)
            pool.drain(60)
            pool.step_episode("a", '<tool_call>{"name": "python", "arguments": {"code": %s}}</tool_call>'
                              % json.dumps(seen))
            (step,) = pool.drain(60)
            assert step.value.observation[0]["content"] == f"{visible}\n", isolation
    missing = EnvSpec.from_config(cfg, sandbox=SandboxConfig(python=str(tmp_path / "no-python")))
    with pytest.raises(PoolError, match=r"could not start: env.tools python: code sandbox: reward.sandbox.python="
                                        r"'.*no-python' is no executable here"):
        with EnvPool(cfg, missing) as pool:
            pool.open_episode("a", {"id": "a"}, 0)
            pool.drain(60)


def test_hanging_raising_and_garbage_environments_are_killed_or_dropped_and_reported_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad_env.py").write_text(textwrap.dedent(BAD_ENV))
    modes = {"e0": "raise", "e1": "hang", "e2": "garbage", "e3": "ok", "e4": "unpicklable"}  # e1, e3 share worker 1
    errors: dict[str, list[str]] = {key: [] for key in modes}
    with EnvPool(EnvConfig(factory="bad_env.py:make_env", num_workers=2, timeout=3)) as pool:
        for key, mode in modes.items():
            pool.open_episode(key, {"id": f"row-{mode}", "mode": mode}, 0)
        assert not any(r.error for r in pool.drain(60))
        assert {k: e.worker for k, e in pool._episodes.items()} == {"e0": 0, "e1": 1, "e2": 0, "e3": 1, "e4": 0}
        for key in modes:
            pool.step_episode(key, "go")
        steps = {r.key: r for r in pool.drain(60)}
        for key in modes:
            pool.close_episode(key)
        later = pool.drain(60)  # closing a failed or lost environment is quiet
        for r in [*steps.values(), *later]:
            if r.error:
                errors[r.key].append(r.error)
        pool.open_episode("e5", {"id": "row-ok2", "mode": "ok"}, 0)  # the replaced worker serves
        pool.step_episode("e5", "go")
        fresh = pool.drain(60)
    # every environment closed: a failed one when it failed (the unpicklable too), the others with their workers
    assert sorted(p.name.removeprefix("closed-row-") for p in tmp_path.glob("closed-*")) == [
        "garbage", "hang", "ok", "ok2", "raise", "unpicklable"]
    where = "bad_env.py:make_env: episode 'e{}' (row 'row-{}'): "
    assert errors["e0"] == [where.format(0, "raise") + "step raised ValueError: the board is on fire"]
    assert errors["e1"] == [where.format(1, "hang") + "its step call: timed out after 3 s (env.timeout); its worker "
                            "was replaced"]
    assert errors["e2"] == [where.format(2, "garbage") + "step returned garbage: step returned a tuple of 2 "
                            "('obs', 1.0); gymnasium's step returns (observation, reward, terminated, truncated, info)"]
    assert len(errors["e3"]) == 1 and errors["e3"][0].startswith(
        "bad_env.py:make_env: the environment of episode 'e3' (row 'row-ok') was lost with its worker, killed because "
        + where.format(1, "hang") + "its step call: timed out")
    assert len(errors["e4"]) == 1 and errors["e4"][0].startswith(
        where.format(4, "unpicklable") + "step returned something that cannot be sent back")
    assert steps["e3"].error == errors["e3"][0] and {r.kind for r in later} == {"close"}
    assert [(r.kind, r.error, r.value.reward if r.kind == "step" else None) for r in fresh] == [
        ("open", None, None), ("step", None, 0.5)]


def test_a_reply_only_the_worker_can_unpickle_fails_its_call_not_the_pool(tmp_path, monkeypatch):
    """An environment file's own class in ``info``: the worker pickles it, the trainer cannot load it (it never
    imported that file, or another file of that name). The pool's manager thread died of it, and with it the run.
    An open's such reply was tried again (env.reset_retries), each try replacing a worker."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text(textwrap.dedent('''
        class Note:
            pass

        class Env:
            def reset(self, *, seed, options):
                return None, {"note": Note()} if options["row"]["id"] == "n" else {}

            def step(self, action):
                return "obs", 1.0, False, False, {"note": Note()} if action == "note" else {}

        def make_env(row):
            return Env()
        '''))
    with EnvPool(EnvConfig(factory="mine.py:make_env", num_workers=1, reset_retries=2, reset_retry_delay=0)) as pool:
        pool.open_episode("n", {"id": "n"}, 0)  # an open's too: not retried, as its reply would not read again
        (failed,) = pool.drain(60)
        assert failed.retries == 0 and "its reply cannot be read here" in failed.error, failed
        pool.open_episode("a", {"id": "a"}, 0)
        pool.drain(60)
        pool.step_episode("a", "note")
        (failed,) = pool.drain(60)
        assert re.match(r"mine.py:make_env: episode 'a' \(row 'a'\): its step call: its reply cannot be read here "
                        r"\((ModuleNotFoundError|AttributeError): .*rollpacker_user_mine.*\): return plain data",
                        failed.error), failed.error
        pool.open_episode("b", {"id": "b"}, 0)  # the fresh worker serves
        pool.step_episode("b", "plain")
        assert [(r.kind, r.error, r.value.reward if r.kind == "step" else None) for r in pool.drain(60)] == [
            ("open", None, None), ("step", None, 1.0)]


def test_a_sys_exit_in_an_environment_or_a_tool_is_its_error_not_its_workers_death(tmp_path, monkeypatch):
    """``sys.exit()`` in a step or a tool killed the worker: every episode on it lost, no cause said."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "quits.py").write_text(textwrap.dedent('''
        import sys

        class Env:
            def reset(self, *, seed, options):
                return None, {}

            def step(self, action):
                sys.exit(3)

        def make_env(row):
            return Env()

        def leave(x: int) -> int:
            """Quits.

            Args:
                x: Anything.
            """
            sys.exit(4)
        '''))
    call = '<tool_call>{"name": "leave", "arguments": {"x": 1}}</tool_call>'
    with EnvPool(EnvConfig(factory="quits.py:make_env", tools=("quits.py:leave",), num_workers=1)) as pool:
        for key in ("a", "b"):
            pool.open_episode(key, {"id": key}, 0)
        assert not any(r.error for r in pool.drain(60))
        pool.step_episode("a", call)
        (tool,) = pool.drain(60)
        assert not tool.error and tool.value.observation[0]["content"] == "error: SystemExit: 4"
        pool.step_episode("a", "done")
        (stepped,) = pool.drain(60)
        assert stepped.error == "quits.py:make_env: episode 'a' (row 'a'): step raised SystemExit: 3"
        pool.step_episode("b", call)  # its worker serves on: b's environment is there
        (other,) = pool.drain(60)
        assert not other.error and other.value.observation[0]["content"] == "error: SystemExit: 4"


def test_whatever_an_environment_raises_or_returns_is_its_error_and_every_other_closes(tmp_path, monkeypatch):
    """A step raising CancelledError or KeyboardInterrupt, a reply pickle refuses (ValueError: a ctypes pointer), a
    close() calling sys.exit(): each killed the worker (every episode on it lost, no cause said) or left the other
    environments it held unclosed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "modes.py").write_text(textwrap.dedent('''
        import asyncio, ctypes, sys

        class Env:
            def __init__(self, mode):
                self.mode = mode

            def reset(self, *, seed, options):
                return None, {}

            def step(self, action):
                if self.mode == "cancelled":
                    raise asyncio.CancelledError()
                if self.mode == "interrupt":
                    raise KeyboardInterrupt("in a library")
                return "obs", 1.0, False, False, {"pointer": ctypes.pointer(ctypes.c_int(3))}

            def close(self):
                if self.mode == "quits":
                    sys.exit(5)
                open(f"closed-{self.mode}", "w").close()

        def make_env(row):
            return Env(row["id"])
        '''))
    with EnvPool(EnvConfig(factory="modes.py:make_env", num_workers=1)) as pool:
        for key in ("cancelled", "interrupt", "unsent", "quits", "kept"):
            pool.open_episode(key, {"id": key}, 0)
        assert not any(r.error for r in pool.drain(60))
        for key in ("cancelled", "interrupt", "unsent"):
            pool.step_episode(key, "go")
        errors = {r.key: r.error.split(": ", 2)[2] for r in pool.drain(60)}
    assert errors == {"cancelled": "step raised CancelledError: ", "interrupt": "step raised KeyboardInterrupt: in a "
                      "library", "unsent": "step returned something that cannot be sent back (ValueError: ctypes "
                      "objects containing pointers cannot be pickled)"}
    assert sorted(p.name for p in tmp_path.glob("closed-*")) == ["closed-cancelled", "closed-interrupt", "closed-kept",
                                                                  "closed-unsent"]  # quits' sys.exit stopped none


@pytest.mark.parametrize("timeout", [3])
def test_a_reset_that_hangs_is_killed_too(tmp_path, monkeypatch, timeout):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "slow.py").write_text("import time\n\ndef make_env(row):\n    time.sleep(600)\n")
    with EnvPool(EnvConfig(factory="slow.py:make_env", num_workers=1, timeout=timeout)) as pool:
        pool.open_episode("e", {"id": "r"}, 0)
        (opened,) = pool.drain(60)
        pool.close_episode("e")
        (closed,) = pool.drain(60)
    assert opened.error == ("slow.py:make_env: episode 'e' (row 'r'): its open call: timed out after 3 s "
                            "(env.timeout); its worker was replaced")
    assert closed.error is None


SLOW_FACTORY = """
import time


class Env:
    def reset(self, *, seed, options):
        return None, {}

    def step(self, action):
        return "obs", 1.0, True, False, {}


class Factory:
    loaded = False

    def warm_up(self):
        time.sleep(2)
        self.loaded = True

    def __call__(self, row):
        assert self.loaded, "not warmed up"
        return Env()


make_env = Factory()
"""


def test_a_factory_is_warmed_up_as_its_worker_starts_not_in_its_first_resets_timeout(tmp_path, monkeypatch):
    """A factory whose warm_up() takes 2 s (a verifiers environment loading its dataset): the worker runs it before
    it says ready, so the first reset opens within a 1 s env.timeout."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "slow_factory.py").write_text(SLOW_FACTORY)
    with EnvPool(EnvConfig(factory="slow_factory.py:make_env", num_workers=1, timeout=1)) as pool:
        pool.open_episode("e", {"id": "r"}, 0)
        (opened,) = pool.drain(60)
    assert opened.error is None


def test_a_factory_whose_warm_up_raises_stops_the_pool_naming_it(tmp_path, monkeypatch):
    """No call would meet the error again (it would fail later for want of what warm_up loads, its cause lost)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text(SLOW_FACTORY.replace("time.sleep(2)", "raise FileNotFoundError('judge.bin')"))
    with EnvPool(EnvConfig(factory="broken.py:make_env", num_workers=1, timeout=5)) as pool:
        pool.open_episode("e", {"id": "r"}, 0)
        with pytest.raises(RuntimeError, match=r"the env workers could not start: env.factory: the warm_up\(\) of "
                                               r"make_env \(.*broken.py:make_env\) raised FileNotFoundError: "
                                               r"judge.bin \(fix it"):
            pool.drain(60)


def test_a_factory_or_tool_that_cannot_be_loaded_stops_the_pool_at_its_start(tmp_path, monkeypatch):
    """A misspelled function or a module that fails to import was each open's error, retried as if transient: a
    whole evaluation of failed episodes before the run stopped, or with env.max_error_frac 1 a run training nothing.
    And the run's close met the failed pool again: a traceback under the message."""
    from rollpacker.env.setup import Environments

    monkeypatch.chdir(tmp_path)
    (tmp_path / "envs.py").write_text("def make_env(row):\n    pass\n")
    (tmp_path / "broken.py").write_text("import not_a_package\n\ndef add(a: int) -> int:\n    return a\n")
    (tmp_path / "calc.py").write_text("def multiply(a, b):\n    return a * b\n")  # no type hints nor docstring
    for cfg, said in ((EnvConfig(factory="envs.py:make_envv"), r"env.factory: .*envs.py has no function or dict "
                                                                r"'make_envv' \(fix it, or what it imports\)"),
                      (EnvConfig(tools=("broken.py:add",)), r"env.tools: cannot import .*broken.py: "
                                                           r"ModuleNotFoundError: No module named 'not_a_package'"),
                      (EnvConfig(tools=("calc.py:multiply", "./calc.py:multiply")),  # each open failed alike
                       r"env.tools: two tools are named 'multiply'"),
                      (EnvConfig(tools=("calc.py:multiply",)), r"env.tools: multiply: no JSON schema")):
        pool = EnvPool(replace(cfg, num_workers=1, reset_retries=3))
        envs = Environments(cfg=pool.cfg, pool=pool, bridge=None, encode=None, seed=0, max_new_tokens=8,
                            max_context=100)
        pool.open_episode("e", {"id": "r"}, 0)
        with pytest.raises(PoolError, match=f"the env workers could not start: {said}"):
            pool.drain(60)
        envs.close()  # quiet: the failed pool was said


TRACKED_ENV = '''
import os
import uuid
from pathlib import Path


class Env:
    def __init__(self, row):
        self.name = f"{row['id']}-{uuid.uuid4().hex[:8]}"
        (Path(os.environ["ENV_LOG"]) / f"made-{self.name}").write_text(str(os.getpid()))

    def reset(self, *, seed, options):
        return None, {}

    def step(self, action):
        return "obs", None, False, False, {}

    def close(self):
        (Path(os.environ["ENV_LOG"]) / f"closed-{self.name}").touch()


def make_env(row):
    return Env(row)
'''

ORPHAN = '''
import signal, time
from rollpacker.env.config import EnvConfig
from rollpacker.env.workers import EnvPool

if __name__ == "__main__":
    pool = EnvPool(EnvConfig(factory="tracked.py:make_env", num_workers=2))
    for key in ("a", "b", "c"):
        pool.open_episode(key, {"id": key}, 0)
    pool.drain(60)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a rank: it stops after its step, torchrun kills it sooner
    print("open", flush=True)
    time.sleep(600)
'''


def _made_and_closed(log) -> tuple[set[str], set[str], set[int]]:
    made = {p.name.removeprefix("made-") for p in log.glob("made-*")}
    return made, {p.name.removeprefix("closed-") for p in log.glob("closed-*")}, \
        {int(p.read_text()) for p in log.glob("made-*")}


def _gone(pid: int) -> bool:
    try:
        return b"multiprocessing" not in open(f"/proc/{pid}/cmdline", "rb").read()  # noqa: SIM115
    except OSError:
        return True


SLOW_CLOSE = '''
import time
from pathlib import Path


class Env:
    def __init__(self, row):
        self.id = row["id"]

    def reset(self, *, seed, options):
        return None, {}

    def step(self, action):
        time.sleep(60 if action == "hang" else 0)
        return "obs", None, False, False, {}

    def close(self):
        time.sleep(0.5)
        Path(f"closed-{self.id}").touch()


def make_env(row):
    return Env(row)
'''


def test_a_stopping_worker_closes_each_environment_it_holds_within_env_timeout(tmp_path, monkeypatch):
    """A worker replaced (a step that hung) or stopped at the pool's close had STOP_GRACE, 2 s, for all its
    environments' closes: six closes of 0.5 s each, and the worker was SIGKILLed after three, the rest never closed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "slow.py").write_text(textwrap.dedent(SLOW_CLOSE))
    keys = [f"e{i}" for i in range(6)]
    with EnvPool(EnvConfig(factory="slow.py:make_env", num_workers=1, timeout=1)) as pool:
        for key in keys:
            pool.open_episode(key, {"id": key}, 0)
        pool.drain(60)
        pool.step_episode("e0", "hang")
        (hung,) = pool.drain(60)
        assert "timed out after 1 s" in hung.error, hung.error
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("closed-*"))) < len(keys) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(p.name for p in tmp_path.glob("closed-*")) == [f"closed-{key}" for key in keys]
        fresh = [f"f{i}" for i in range(6)]
        for key in fresh:  # the fresh worker's: closed as the pool stops
            pool.open_episode(key, {"id": key}, 0)
        pool.drain(60)
    assert sorted(p.name for p in tmp_path.glob("closed-f*")) == [f"closed-{key}" for key in fresh]


def test_every_environment_made_is_closed_when_the_pool_stops_or_its_process_dies(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tracked.py").write_text(textwrap.dedent(TRACKED_ENV))
    for name in ("pool", "orphan"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv("ENV_LOG", str(tmp_path / "pool"))
    with EnvPool(EnvConfig(factory="tracked.py:make_env", num_workers=2)) as pool:
        for key in ("a", "b", "c"):
            pool.open_episode(key, {"id": key}, 0)
        pool.drain(60)
        pool.close_episode("a")  # one closed by its episode, two open when the pool stops
        pool.drain(60)
    made, closed, _ = _made_and_closed(tmp_path / "pool")
    assert len(made) == 3 and closed == made

    (tmp_path / "orphan.py").write_text(textwrap.dedent(ORPHAN))  # a rank with environments open, killed as
    proc = subprocess.Popen([sys.executable, "orphan.py"], env={**os.environ, "ENV_LOG": str(tmp_path / "orphan")},
                            stdout=subprocess.PIPE, text=True, start_new_session=True)  # torchrun starts and stops one
    assert proc.stdout.readline() == "open\n"
    os.killpg(proc.pid, signal.SIGTERM)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        made, closed, pids = _made_and_closed(tmp_path / "orphan")
        if closed == made and all(map(_gone, pids)):
            break
        time.sleep(0.1)
    assert len(made) == 3 and closed == made and pids and all(map(_gone, pids))


def test_environments_opened_ahead_answer_their_rounds_opens_and_the_others_are_closed(tmp_path, monkeypatch):
    """env.warm: a round's open of an environment opened ahead sends nothing and gets the reply of the reset
    that ran ahead (held through a held-out round's polls); the next warming closes those no round opened;
    one opened ahead for another row is a loud error."""
    from rollpacker.env.contract import EnvCall
    from rollpacker.env.setup import Environments

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tracked.py").write_text(textwrap.dedent(TRACKED_ENV))
    (tmp_path / "log").mkdir()
    monkeypatch.setenv("ENV_LOG", str(tmp_path / "log"))
    cfg = EnvConfig(factory="tracked.py:make_env", num_workers=2, warm=True)
    rows = [{"id": "a"}, {"id": "b"}]
    envs = Environments(cfg=cfg, pool=EnvPool(cfg), bridge=None, encode=None, seed=0, max_new_tokens=8,
                        max_context=64)
    try:
        envs.warm(lambda: [EnvCall("open", "3:0:0", row=0, seed=7), EnvCall("open", "3:1:0", row=1, seed=8)], rows)
        deadline = time.monotonic() + 60
        while len(envs.held) < 2 and time.monotonic() < deadline:  # a held-out round's polls hold their replies
            assert envs.poll("eval/", idle=True) == []
        assert len(envs.held) == 2 and len(_made_and_closed(tmp_path / "log")[0]) == 2
        envs.send([EnvCall("open", "3:0:0", row=0, seed=7)], rows)
        assert [(r.key, r.kind, r.error) for r in envs.poll()] == [("3:0:0", "open", None)]
        assert envs.take_metrics()["env/warm_opens"] == 1 and envs.take_metrics()["env/warm_opens"] == 0
        assert len(_made_and_closed(tmp_path / "log")[0]) == 2  # the round's open made nothing

        envs.warm(lambda: [EnvCall("open", "4:0:0", row=1, seed=9)], rows)  # 3:1:0 was never opened: it is closed
        envs.pool.drain(60)
        made, closed, _ = _made_and_closed(tmp_path / "log")
        assert len(made) == 3 and len(closed) == 1 and next(iter(closed)).startswith("b-")
        with pytest.raises(RuntimeError, match="opened ahead for another"):
            envs.send([EnvCall("open", "4:0:0", row=0, seed=9)], rows)
    finally:
        envs.close()
    made, closed, _ = _made_and_closed(tmp_path / "log")
    assert closed == made


FLAKY_ENV = '''
import os
import time
from pathlib import Path


class Env:
    def __init__(self, row):
        self.log = Path(os.environ["ENV_LOG"])
        self.tries = len(list(self.log.glob(f"{row['id']}-*.made")))
        self.name = f"{row['id']}-{self.tries}"
        (self.log / f"{self.name}.made").write_text(str(time.monotonic()))
        self.fails = {"twice": 2, "always": 99, "hang_once": 0, "ok": 0, "garbage": 0}[row["mode"]]
        self.mode = row["mode"]
        if row["mode"] == "hang_once" and self.tries == 0:
            time.sleep(600)

    def reset(self, *, seed, options):
        if self.tries < self.fails:
            raise ConnectionError(f"sandbox 503 (try {self.tries + 1})")
        return "no info" if self.mode == "garbage" else (None, {})

    def step(self, action):
        return "obs", 1.0, True, False, {}

    def close(self):
        (self.log / f"{self.name}.closed").touch()


def make_env(row):
    return Env(row)
'''


def test_a_failed_reset_is_tried_again_later_and_each_failed_environment_closed(tmp_path, monkeypatch):
    """env.reset_retries 2 (delays 0.3 s, then 0.6 s): a reset that fails twice succeeds on its third try; one that
    always fails says so after three; a make_env that hangs (its worker replaced) succeeds on the fresh worker, and
    the open queued behind it there, never run, waits for that worker rather than fail; a reset that returns garbage
    fails at once (it would again). Every environment whose reset raised was closed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "flaky.py").write_text(textwrap.dedent(FLAKY_ENV))
    monkeypatch.setenv("ENV_LOG", str(tmp_path))
    modes = {"e0": "twice", "e1": "hang_once", "e2": "always", "e3": "ok", "e4": "garbage"}  # e1, e3 on worker 1
    cfg = EnvConfig(factory="flaky.py:make_env", num_workers=2, timeout=3, reset_retries=2, reset_retry_delay=0.3)
    with EnvPool(cfg) as pool:
        for key, mode in modes.items():
            pool.open_episode(key, {"id": mode, "mode": mode}, 0)
        opened = {r.key: r for r in pool.drain(60)}
        for key in modes:
            pool.close_episode(key)
        pool.drain(60)
    assert {k: (r.error, r.retries) for k, r in opened.items() if k not in ("e2", "e4")} == {
        "e0": (None, 2), "e1": (None, 1), "e3": (None, 0)}
    assert opened["e4"].error.startswith("flaky.py:make_env: episode 'e4' (row 'garbage'): open returned garbage: ")
    assert opened["e4"].retries == 0 and "tried" not in opened["e4"].error
    assert opened["e2"].error == ("flaky.py:make_env: episode 'e2' (row 'always'): open raised ConnectionError: "
                                  "sandbox 503 (try 3) (tried 3 times, env.reset_retries 2)")
    assert opened["e2"].retries == 2
    made = {p.stem: float(p.read_text()) for p in tmp_path.glob("*.made")}
    closed = {p.stem for p in tmp_path.glob("*.closed")}
    assert sorted(made) == ["always-0", "always-1", "always-2", "garbage-0", "hang_once-0", "hang_once-1", "ok-0",
                            "twice-0", "twice-1", "twice-2"]
    assert closed == set(made) - {"hang_once-0"}  # its worker was killed in make_env: no environment to close
    assert made["twice-1"] - made["twice-0"] >= 0.3 and made["twice-2"] - made["twice-1"] >= 0.6  # the delays


def test_a_setup_an_adapter_refuses_at_open_is_not_tried_again(tmp_path, monkeypatch):
    """A TRL environment's public method without a docstring (its tool schema) fails every open the same way: it
    waited out every retry's delay first, as a sandbox's 503 would."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "counter.py").write_text(textwrap.dedent('''
        class Counter:
            def reset(self, **kwargs):
                return None

            def helper(self, x):
                return x
        '''))
    cfg = EnvConfig(factory="counter.py:Counter", num_workers=1, reset_retries=3, reset_retry_delay=60)
    with EnvPool(cfg) as pool:
        pool.open_episode("e", {"id": "r", "prompt": [{"role": "user", "content": "hi"}]}, 0)
        (opened,) = pool.drain(30)  # not 60 s and more
    assert opened.retries == 0 and "open raised EnvError: " in opened.error and "tried" not in opened.error


def test_a_close_while_a_reset_waits_to_be_tried_again_fails_it_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "flaky.py").write_text(textwrap.dedent(FLAKY_ENV))
    monkeypatch.setenv("ENV_LOG", str(tmp_path))
    cfg = EnvConfig(factory="flaky.py:make_env", num_workers=1, timeout=30, reset_retries=3, reset_retry_delay=60)
    with EnvPool(cfg) as pool:
        pool.open_episode("e", {"id": "always", "mode": "always"}, 0)
        deadline = time.monotonic() + 60
        while not (tmp_path / "always-0.closed").exists():  # its first reset failed (its environment closed)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        start = time.monotonic()
        pool.close_episode("e")  # the episode was aborted: its open is not tried again
        opened, closed = pool.drain(60)
        waited = time.monotonic() - start
        assert pool._episodes == {}
    assert opened.error.endswith("open raised ConnectionError: sandbox 503 (try 1)") and opened.retries == 0
    assert closed.kind == "close" and closed.error is None and waited < 30
    assert sorted(p.name for p in tmp_path.glob("always-*")) == ["always-0.closed", "always-0.made"]


LEAKY = '''
class Env:
    def reset(self, *, seed, options):
        return "p", {}

    def step(self, action):
        return "obs", 1.0, True, False, {}

    def close(self):
        raise OSError("container c1 still running")


def make_env(row):
    return Env()
'''


def test_a_close_that_raises_is_answered_with_its_error_naming_the_environment_and_row(tmp_path, monkeypatch):
    """Its episode is over (scored already); the round counts it in env/close_errors (a sandbox may be left)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "leaky.py").write_text(LEAKY)
    with EnvPool(EnvConfig(factory="leaky.py:make_env", num_workers=1, timeout=10)) as pool:
        pool.open_episode("e", {"id": "r7"}, 0)
        pool.drain(60)
        pool.close_episode("e")
        (closed,) = pool.drain(60)
    assert closed.kind == "close" and "leaky.py:make_env" in closed.error and "'r7'" in closed.error
    assert "close raised OSError: container c1 still running" in closed.error
