"""TRL's ``environment_factory`` classes, unchanged, in the real environment workers: classes written
here in TRL's shape (a tool method, ``reset(**row)`` returning text, ``get_reward``), a dict of them,
and reward functions taking ``environments``, scored in a real reward worker. The episodes run
through the product's own glue (``Environments``, ``EpisodeRunner``, ``RewardScheduler``) with
scripted model turns."""

from __future__ import annotations

import json
import textwrap
import time
from types import SimpleNamespace

import pytest

from rollpacker.env.config import EnvConfig
from rollpacker.env.contract import EnvError
from rollpacker.env.setup import Environments
from rollpacker.env.trl import factories
from rollpacker.env.workers import EnvPool, EnvSpec
from rollpacker.reward.config import RewardConfig
from rollpacker.reward.functions import BadValue, call, resolve
from rollpacker.reward.scheduler import RewardScheduler, build_functions
from rollpacker.schedule.runner import EpisodeRunner

TRL_ENV = '''
import threading


class Counter:
    """Reach the row's target with the add tool (TRL's shape: no constructor argument)."""

    made = 0

    def __init__(self):
        Counter.made += 1
        self.number = Counter.made  # which instance of this worker: a closed episode's is reused
        self.lock = threading.Lock()  # does not pickle: not in the copy reward functions get

    def reset(self, target, **kwargs):
        self.counter, self.target, self.columns = 0, target, sorted(kwargs)
        return f" Reach {target}."

    def add(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.counter += step
        return self.counter

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def _helper(self):
        return "not a tool"


class Unscored(Counter):
    def get_reward(self) -> float:
        raise RuntimeError("no score today")


class Rewarded(Counter):
    def get_reward(self) -> float:  # what it works out, reward functions taking environments read
        self.rewarded = getattr(self, "rewarded", 0) + 1
        return super().get_reward()


class Echo:
    def reset(self, **kwargs):
        self.columns = sorted(kwargs)

    def shout(self, text: str) -> str:
        """Say it louder.

        Args:
            text: What to say.
        """
        return text.upper()


ENVS = {"count": Counter, "echo": Echo}


def exact(environments, prompts, completions, **kwargs):  # the prompt the model saw, its turns, its environment
    return [float(env.counter == env.target and p[-1]["content"] == f"Count. Reach {env.target}."
                  and c[-1]["role"] == "assistant") for env, p, c in zip(environments, prompts, completions)]


def locked(environments, **kwargs):
    return [float(environments[0].lock.locked())]


def only_environments(environments):
    return [float(environments[0].counter)]
'''


def call_text(tool: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': arguments})}</tool_call>"


ACTIONS = [call_text("add", step=2), call_text("add", step=3), "It is 5.", call_text("add", step=1), "It is 3."]
"""The scripted model's turns: a turn's one token is its index here."""


class Bridge:
    """Text and tokens, scripted: an action is ``ACTIONS[token]``; any observation is one token, 900."""

    def action_text(self, token_ids):
        return ACTIONS[token_ids[0]]

    def observation_ids(self, observation, turn_ids, tools=None):
        return [900]

    def check_tool_parser(self, parser):
        """Its calls are scripted in hermes' layout, env.tool_parser's default."""
        assert parser == "hermes"


@pytest.fixture
def env_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trl_env.py").write_text(textwrap.dedent(TRL_ENV))
    return tmp_path


def run(pool: EnvPool, rows: list[dict], scripts: list[list[int]], max_turns: int, max_tokens: int = 0) -> list:
    """Each row's episode to its end, as a round runs it: the real ``Environments`` and ``EpisodeRunner``,
    the model's turns taken from ``scripts`` (ACTIONS indices per turn, one token each)."""
    envs = Environments(cfg=EnvConfig(factory="trl_env.py:Counter", max_turns=max_turns, max_tokens=max_tokens),
                        pool=pool, bridge=Bridge(), encode=lambda prompt, tools: [1, 2], seed=0, max_new_tokens=8,
                        max_context=1000)
    runner = EpisodeRunner(envs.maker(rows, lambda row: [1, 2]), seed=0, environment=True)
    for k in range(len(rows)):
        runner.open(f"0:{k}:0", k, f"0:{k}")
    done, deadline = [], time.monotonic() + 60
    while len(done) < len(rows):
        assert time.monotonic() < deadline, "episodes still running"
        envs.send(runner.take_calls(), rows)
        done += runner.on_env(envs.poll(idle=True), time.monotonic())
        outs = []
        for key, turn in runner.take_turns():
            action = scripts[int(key.split(":")[1])][int(turn.id.rpartition("#")[2])]
            outs.append(SimpleNamespace(id=turn.id, token_ids=[action], logprobs=[0.0], finish_reason="stop"))
        done += runner.on_turns(outs)
    envs.send(runner.take_calls(), rows)  # the closes
    pool.drain(60)
    return sorted(done, key=lambda r: r.id)


def test_a_trl_environment_runs_unchanged_and_its_rewards_are_composed_once(env_file):
    """reset(**row)'s text ends the prompt; the public method is the one tool; the answer ends the
    episode and get_reward() is its step's reward (or the last turn's at env.max_turns); a reward
    function taking environments reads a copy of the instance in a reward worker, and the reward
    scheduler adds the two: 0.5 x the function + 1 x the environment's."""
    cfg = EnvConfig(factory="trl_env.py:Counter", num_workers=1, timeout=60, max_turns=3)
    rows = [{"id": f"r{k}", "prompt": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Count."}], "target": 5, "answer": "5"}
            for k in range(3)]
    scripts = [[0, 1, 2], [0, 4], [0, 0, 3]]  # right; a wrong answer; still calling at max_turns (3): not run, 4
    with EnvPool(cfg, EnvSpec.from_config(cfg, states=True)) as pool:
        pool.open_episode("look", rows[0], 0)
        (opened,) = pool.drain(60)
        prompt, info = opened.value
        assert prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count. Reach 5."}]
        assert [t["function"]["name"] for t in info["tools"]] == ["add"]  # not reset, get_reward, _helper
        assert info["tools"][0]["function"]["parameters"]["properties"]["step"] == {"type": "integer",
                                                                                   "description": "How much to add."}
        pool.close_episode("look")
        pool.drain(60)
        right, wrong, cut = run(pool, rows, scripts, max_turns=3)

    assert [r.reason for r in (right, wrong, cut)] == ["terminated", "terminated", "max_turns"]
    assert [r.env_reward for r in (right, wrong, cut)] == [1.0, 0.0, 0.0]
    assert list(right.step_rewards) == [len(right.token_ids) - 1]  # on the answer's last token
    assert right.messages[:2] == [{"role": "assistant", "content": ACTIONS[0]},
                                  {"role": "tool", "name": "add", "tool_call_id": "call_0", "content": "2"}]
    assert right.info == {"tool_calls": 2.0, "tool_errors": 0.0}
    assert right.prompt[-1]["content"] == "Count. Reach 5."
    copy = right.env_state.restore()
    assert type(copy).__name__ == "Counter" and (copy.counter, copy.target) == (5, 5)
    assert copy.columns == ["answer", "id", "prompt"]  # the row's columns but those reset names (target)
    assert cut.env_state.restore().counter == 4 and cut.info["tool_calls"] == 2  # as TRL: the last turn's call not run
    # three instances for four episodes: the first episode's, closed, was reused
    assert sorted(r.env_state.restore().number for r in (right, wrong, cut)) == [1, 2, 3]

    rewards = RewardConfig(funcs=("trl_env.py:exact",), weights=(0.5,), num_workers=1)
    functions = build_functions(rewards, environment=True)
    assert functions[0].ref.environments
    scheduler = RewardScheduler(rewards, lambda ids: "", functions=functions)
    try:
        for r, row in zip((right, wrong, cut), rows):
            scheduler.submit(r.id, row, r)
        # exact: 1 for right (0.5 weighted; its prompt ends with reset's text); 0 for the others
        assert dict(scheduler.wait()) == {right.id: 1.5, wrong.id: 0.0, cut.id: 0.0}
        assert scheduler.take_metrics()["reward/environment"] == pytest.approx(1 / 3)  # get_reward's mean
    finally:
        scheduler.close()


def test_get_reward_comes_with_the_last_turn_env_max_turns_allows_whose_calls_are_not_run(env_file):
    """As TRL's loop: the calls of the last turn it allows are left, get_reward sees the state before them."""
    cfg = EnvConfig(factory="trl_env.py:Counter", num_workers=1, timeout=60, max_turns=2)
    row = {"id": "r", "prompt": "Count.", "target": 3}
    with EnvPool(cfg) as pool:
        (done,) = run(pool, [row], [[1, 0]], max_turns=2)  # add 3, then add 2 at the last turn: 3, not 5
    assert done.reason == "max_turns" and done.env_reward == 1.0 and done.prompt == "Count. Reach 3."
    assert done.env_state is None  # no reward function asked for a copy


def test_get_reward_scores_an_episode_a_token_limit_ended_once(env_file):
    """TRL calls get_reward once per rollout, however it ended: an episode whose model tokens ran out
    (env.max_tokens 2, one token a turn) after its second tool call is scored by it all the same, on its
    last token; a get_reward that raises then is the episode's environment error; an environment
    without get_reward is not asked."""
    rows = [{"id": "r", "prompt": "Count.", "target": 5}, {"id": "s", "prompt": "Count.", "target": 5}]
    scripts = [[0, 1], [4]]  # add 2, add 3: out of tokens at 5; answer "It is 3." at once

    def episodes(factory: str, num: int) -> list:
        cfg = EnvConfig(factory=f"trl_env.py:{factory}", num_workers=1, timeout=60, max_turns=3)
        with EnvPool(cfg, EnvSpec.from_config(cfg, states=True)) as pool:
            return run(pool, rows[:num], scripts, max_turns=3, max_tokens=2)

    cut, answered = episodes("Counter", 2)
    assert (cut.reason, cut.env_reward, cut.step_rewards) == ("max_tokens", 1.0, {2: 1.0})
    assert cut.token_ids == [0, 900, 1] and cut.loss_mask == [True, False, True]
    assert (answered.reason, answered.env_reward) == ("terminated", 0.0)
    cut, answered = episodes("Unscored", 2)
    assert (cut.reason, answered.reason) == ("error", "error") and cut.finish_reason == "error"  # trains nothing
    assert cut.detail.endswith("finish raised RuntimeError: get_reward() raised RuntimeError: no score today")
    assert answered.detail.endswith("step raised RuntimeError: get_reward() raised RuntimeError: no score today")
    (echo,) = episodes("Echo", 1)
    assert (echo.reason, echo.env_reward) == ("max_tokens", 0.0)
    # the copy reward functions get is of the environment after get_reward, however the episode ended
    cut, answered = episodes("Rewarded", 2)
    assert cut.env_state.restore().rewarded == 1 and answered.env_state.restore().rewarded == 1


def test_a_dict_of_environments_is_picked_by_the_rows_environment_column(env_file):
    cfg = EnvConfig(factory="trl_env.py:ENVS", num_workers=1, timeout=60)
    with EnvPool(cfg, EnvSpec.from_config(cfg, states=True)) as pool:
        pool.open_episode("echo", {"id": "e", "prompt": "Say hi.", "environment": "echo"}, 0)
        pool.open_episode("none", {"id": "n", "prompt": "Say hi."}, 0)
        pool.open_episode("typo", {"id": "t", "prompt": "Say hi.", "environment": "cont"}, 0)
        echo, none, typo = sorted(pool.drain(60), key=lambda r: ["echo", "none", "typo"].index(r.key))
        prompt, info = echo.value
        assert prompt is None and [t["function"]["name"] for t in info["tools"]] == ["shout"]
        assert echo.state.restore().columns == ["id", "prompt"]  # the selector is not reset's
        pool.step_episode("echo", call_text("shout", text="hi"))
        (shouted,) = pool.drain(60)
        assert shouted.value.observation[0]["content"] == "HI"
    for reply, value in ((none, "None"), (typo, "'cont'")):
        assert f"(row {reply.key[0]!r}): open raised EnvError: row {reply.key[0]!r} has environment={value}" in \
            reply.error
        assert "dict of the environments 'count', 'echo': give each row an 'environment' column" in reply.error


def test_trl_factories_are_told_from_ours_by_their_arguments(env_file):
    class Ours:
        def __init__(self, row):
            self.row = row

    class Theirs:
        def reset(self, **kwargs):
            return None

    assert factories(Ours, "x") is None and factories(lambda row: Ours(row), "x") is None
    assert factories(lambda row=None: Ours(row), "x") is None  # a row with a default is still ours
    assert factories(lambda max_turns=5: Theirs(), "x") is not None  # a TRL environment's own options
    assert factories(Theirs, "x") == {None: Theirs} and factories(lambda: Theirs(), "x") is not None
    assert factories({"a": Theirs}, "x") == {"a": Theirs}
    (env_file / "mine.py").write_text("class Mine:\n    def reset(self, *, seed, options):\n        return None, {}\n")
    with pytest.raises(EnvError, match="Mine is made with no argument, as TRL's environments are, but its reset takes "
                                       "seed and options, as gymnasium's needs: .* the row: make_env\\(row\\)"):
        EnvSpec.from_config(EnvConfig(factory="mine.py:Mine")).build({"id": "r", "prompt": "p"})
    with pytest.raises(EnvError, match="env.factory: x: the dict's 'b' is type .*a class \\(or function\\) called "
                                       "with no argument"):
        factories({"a": Theirs, "b": Ours}, "x")


def test_what_a_copy_lacks_and_a_function_without_a_copy_say_why(env_file):
    """An attribute that does not pickle stays in the worker, and using it says so; a function that
    names environments with no copy to give (not a TRL environment) is told how to get one."""
    spec = EnvSpec.from_config(EnvConfig(factory="trl_env.py:Counter"), states=True)
    env = spec.build({"id": "r", "prompt": "Count.", "target": 2})

    env.reset(seed=0, options={"row": {"id": "r", "prompt": "Count.", "target": 2}})
    sample = {"prompt": "Count.", "completion": "", "completion_ids": [], "columns": {},
              "messages": [{"role": "assistant", "content": "2"}], "environment": env.reward_state()}
    assert call(resolve("trl_env.py:only_environments", "only_environments"), sample)[0] == 0.0
    with pytest.raises(AttributeError, match=r"Counter.lock \(a lock\) is not in the copy of the environment that "
                                             "reward functions get: it does not pickle"):
        call(resolve("trl_env.py:locked", "locked"), sample)
    lock = env.reward_state().restore().lock  # what the language does with it raises, naming it too
    for use in (bool, len, iter, str, lambda u: u == 1, lambda u: f"{u}", lambda u: u.__enter__(), lambda u: 1 in u):
        with pytest.raises(TypeError, match=r"Counter.lock \(a lock\) is not in the copy"):
            use(lock)
    assert lock is not None and "Counter.lock" in repr(lock)
    with pytest.raises(BadValue, match="takes environments, and this response has no copy of its environment"):
        call(resolve("trl_env.py:exact", "exact"), {**sample, "environment": None})


def test_tools_are_listed_from_the_class_as_trl_lists_them():
    """As TRL's GRPOTrainer: a property is not read (one valid only after reset failed every open), a static
    method is a tool, a class method is not (one without a docstring failed every open)."""
    from rollpacker.env.trl import tool_methods

    class Listed:
        def __init__(self):
            self.history = None

        def reset(self, **kwargs):
            self.history = []

        @property
        def last(self):
            return self.history[-1]

        @staticmethod
        def add(a: int, b: int) -> str:
            """Add two integers.

            Args:
                a: The first.
                b: The second.
            """
            return str(a + b)

        @classmethod
        def build(cls):
            return cls()

        def move(self, to: str) -> str:
            """Move.

            Args:
                to: Where.
            """
            return to

    tools = tool_methods(Listed())
    assert sorted(tools) == ["add", "move"] and tools["add"](2, 3) == "5" and tools["move"]("x") == "x"


def test_a_public_helper_without_a_docstring_is_refused_saying_public_methods_are_tools():
    from rollpacker.env.contract import EnvError
    from rollpacker.env.trl import TRLEnv, tool_methods

    class Helped:
        def reset(self, **kwargs):
            return None

        def add(self, a: int, b: int) -> str:
            """Add two integers.

            Args:
                a: The first.
                b: The second.
            """
            return str(a + b)

        def check(self, x):
            return x

    with pytest.raises(EnvError, match=r"Helped: check: no JSON schema .* \(every public method of a TRL environment "
                                       r"but reset and get_reward is a tool, as in TRL: start a helper's name with _"):
        TRLEnv(Helped(), tool_methods(Helped()), parser="hermes", max_turns=2, select=False, factory="f.py:Helped",
               release=lambda instance: None, max_result_chars=100, timeout=5.0)
