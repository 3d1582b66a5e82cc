"""Episodes through the round's protocol alone (``schedule/round.py`` with its ``EpisodeRunner``):
scripted engines and scripted environments, no model, no process. Under sync, tail, sorted and
stream training (a scale-down that migrates episodes at a turn boundary): tokens interleave as
the turns and observations came, the model's tokens alone are masked in, the policy hears of each
episode once, every episode aborted is closed, the ledger is exact, and ids and seeds are stable."""

from __future__ import annotations

import collections
from types import SimpleNamespace
from typing import Callable

import pytest

from rollpacker.data.dataset import PromptSampler
from rollpacker.env.contract import EnvReply, StepResult
from rollpacker.env.episode import Episode, Response, reset_seed, turn_seed
from rollpacker.schedule.eval import EvalPolicy
from rollpacker.schedule.round import Round, RoundHooks, RoundState, Seen
from rollpacker.schedule.runner import EpisodeRunner
from rollpacker.schedule.scale_down import ScaleDownDecider, StreamConfig, StreamRound
from rollpacker.schedule.sorted import SortedConfig
from rollpacker.schedule.sync import SyncConfig
from rollpacker.schedule.tail import TailConfig

SEED = 3
OBS = 900
"""Observation tokens are OBS + the step number: told apart from the model's (< 100)."""


class Bridge:
    """Text and tokens, scripted: an action is its token ids as text; observation k is [OBS + k, OBS + k]."""

    def action_text(self, token_ids):
        return " ".join(map(str, token_ids))

    def observation_ids(self, observation, turn_ids, tools=None):
        return [OBS + int(observation[0]["content"])] * 2

    def check_tool_parser(self, parser):
        """Its calls are scripted: any parser reads them."""


def turns_of(key: str) -> int:
    """Episode ``key``'s environment ends it after this many steps (1 to 3, by its id)."""
    return 1 + sum(map(ord, key)) % 3


def turn_tokens(seed: int) -> list[int]:
    """What the scripted engine samples for a turn seeded ``seed``: 1 to 4 tokens below 100."""
    return [seed % 97] * (1 + seed % 4)


def make(key: str, row: int, reset) -> Episode:
    return Episode(key, [row + 1, 5], Bridge(), seed=SEED, max_turns=3, max_tokens=64, max_new_tokens=8,
                   max_context=1000)


class Scores:
    """An episode's reward is its environment's (as the exchange's leader scores without reward functions)."""

    def __init__(self):
        self.ready = []

    def submit(self, key, row, output, held_out=False):
        assert isinstance(output, Response)
        self.ready.append((key, output.env_reward))

    def submit_group(self, keys, row, outputs):
        """No group function."""

    def poll(self):
        ready, self.ready = self.ready, []
        return ready

    def wait(self, keys=None, timeout=None):
        return self.poll()


class Driver:
    """Engines and environment workers, scripted: a turn finishes ``1 + seed % 3`` polls after it
    is added; an environment call is answered at the next poll; an aborted turn comes back at the
    next poll with what it had (``whole``: finished, as an engine that finished it before the abort
    reached it answers). It records every call and turn it saw."""

    def __init__(self, whole: bool = False):
        self.whole, self.moved = whole, []  # the turn ids aborted
        self.opened: dict[str, int] = {}  # episode -> its environment's reset seed
        self.running: dict[str, list] = {}  # turn id -> [replica, request, polls left, resumed]
        self.replies, self.aborted = [], []
        self.env_log: dict[str, list[str]] = collections.defaultdict(list)
        self.steps: dict[str, int] = collections.Counter()
        self.turns: dict[str, tuple[int, list[int]]] = {}  # turn id -> (seed, its prompt)
        self.requests: dict[str, object] = {}
        self.resumed: list[str] = []
        self.added: list[tuple[float, int]] = []  # (poll time, replica) of every turn added
        self.ended: dict[str, int] = {}  # episode -> the replica told to end its session
        self.now = 0.0

    def apply(self, a) -> None:
        for replica, _, turn in a.add:
            assert turn.id not in self.turns and turn.seed == turn_seed(SEED, turn.id)
            self.turns[turn.id] = (turn.seed, turn.prompt_ids)
            self.running[turn.id] = [replica, turn, 1 + turn.seed % 3]
            self.requests[turn.id] = turn
            self.added.append((self.now, replica))
        for replica, out in a.resume:  # a migrated turn resumes on a kept replica (same id, same seed)
            assert replica == 0 and out.finish_reason == "abort"
            self.resumed.append(out.id)
            self.running[out.id] = [replica, self.requests[out.id], 1]
        for _, rid in a.abort:
            replica, turn, _ = self.running.pop(rid)
            self.moved.append(rid)
            tokens = turn_tokens(turn.seed) if self.whole else []
            self.aborted.append(SimpleNamespace(id=rid, prompt_ids=turn.prompt_ids, token_ids=tokens,
                                                logprobs=[-0.5] * len(tokens),
                                                finish_reason="stop" if self.whole else "abort"))
        for call in a.env:
            self.env_log[call.key].append(call.kind)
            if call.kind == "open":
                self.opened[call.key] = call.seed
                self.replies.append(EnvReply(call.key, "open", (None, {}), seconds=0.1))
            elif call.kind == "step":
                self.steps[call.key] += 1
                n = self.steps[call.key]
                result = StepResult([{"role": "user", "content": str(n)}], reward=float(n),
                                    terminated=n >= turns_of(call.key))
                self.replies.append(EnvReply(call.key, "step", result, seconds=0.1))
        cut_last = {rid.rpartition("#")[0] for _, rid in a.abort} if getattr(a, "done", False) else set()
        for replica, key in getattr(a, "end_sessions", []):  # once, as its environment closes, or with its last turn
            assert key not in self.ended and (self.env_log[key][-1] == "close" or key in cut_last)
            self.ended[key] = replica

    def seen(self) -> Seen:
        self.now += 1.0
        finished = []
        for tid, entry in list(self.running.items()):
            entry[2] -= 1
            if entry[2] <= 0:
                del self.running[tid]
                tokens = turn_tokens(entry[1].seed)
                finished.append(SimpleNamespace(id=tid, prompt_ids=entry[1].prompt_ids, token_ids=tokens,
                                                logprobs=[-0.5] * len(tokens), finish_reason="stop"))
        seen = Seen(now=self.now, finished=finished, aborted=self.aborted, env=self.replies)
        self.aborted, self.replies = [], []
        return seen

    def generated(self):
        return [(2, 1)] * len(self.running)


class Counting:
    """Wraps a policy: counts its ``on_finished`` calls per response."""

    def __init__(self, policy):
        self.policy, self.calls = policy, collections.Counter()

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def on_finished(self, slot, response, output, reward):
        self.calls[(slot, response)] += 1
        return self.policy.on_finished(slot, response, output, reward)


def run_round(policy, step: int, driver: Driver, *, replicas: int = 2, hooks=None):
    counting = Counting(policy)
    state = RoundState(step, policy.start_round(step), counting, num_replicas=replicas)
    runner = EpisodeRunner(make, seed=SEED, environment=True)
    rnd = Round(state, Scores(), runner, hooks)
    a = rnd.start(now=driver.now)
    assert not a.add and [c.kind for c in a.env] == ["open"] * state.num_launched
    scaled = False
    for _ in range(500):
        driver.apply(a)
        if a.done:
            break
        a = rnd.poll(driver.seen(), driver.generated)
        scaled |= a.scale_down
    else:
        pytest.fail("the round did not end")
    rnd.end(driver.seen().aborted)
    assert rnd.settle()
    outcome = rnd.finish()
    driver.apply(SimpleNamespace(add=[], resume=[], abort=[], env=outcome.env))
    assert max(counting.calls.values()) == 1  # one on_finished per episode
    assert not (runner.rows or runner.live or runner.running)
    assert all(seed == reset_seed(SEED, state.plan.group(step, int(key.split(":")[1])))  # a group's start alike
               for key, seed in driver.opened.items() if key.startswith(f"{step}:"))
    return outcome, state, scaled


def check_episode(out: Response, driver: Driver) -> None:
    """Its tokens are its turns as sampled and its observations, interleaved; only the turns' are masked in."""
    expected, mask, rewards = [], [], {}
    for k in range(out.num_turns):
        seed, prompt = driver.turns[f"{out.id}#{k}"]
        assert prompt == out.prompt_ids + expected  # each turn saw the whole episode so far
        expected += turn_tokens(seed)
        mask += [True] * len(turn_tokens(seed))
        rewards[len(expected) - 1] = float(k + 1)
        if k + 1 < out.num_turns:
            expected += [OBS + k + 1] * 2
            mask += [False, False]
    assert (out.token_ids, out.loss_mask, out.step_rewards) == (expected, mask, rewards)
    assert out.num_turns == turns_of(out.id) and out.reason == "terminated"
    assert driver.steps[out.id] == out.num_turns  # the environment was stepped for every turn


@pytest.mark.parametrize("name", ["sync", "tail", "sorted"])
def test_policies_run_scripted_episodes_each_heard_once_and_every_environment_closed(name):
    configs = {"sync": SyncConfig, "tail": TailConfig, "sorted": SortedConfig}
    policy = configs[name]().build(PromptSampler(12), 4, 2, num_epochs=1)
    driver, trained = Driver(), []
    for step in range(20):
        if policy.done():
            break
        outcome, state, _ = run_round(policy, step, driver)
        for g in outcome.groups:
            assert len(g.outputs) == 2 and g.rewards == [o.env_reward for o in g.outputs]
            assert all(o.id in driver.ended for o in g.outputs)  # the engine session of every episode trained
            for o in g.outputs:
                check_episode(o, driver)
            trained.append(g.prompt)
        for o in outcome.aborted:
            assert isinstance(o, Response) and o.finish_reason == "abort"
    assert sorted(trained) == list(range(12))  # every prompt trained exactly once
    if hasattr(policy, "ledger"):
        assert policy.ledger.counts() == collections.Counter(trained=12) and not policy.ledger.queue
    # every environment opened was closed once, last; those of cut episodes too
    assert driver.env_log and all(calls[0] == "open" and calls[-1] == "close" and calls.count("close") == 1
                                  for calls in driver.env_log.values())
    if name == "tail":
        assert len(driver.env_log) > 12 * 2  # over-provisioned: some episodes were cut


def test_the_same_rounds_give_the_same_turns_ids_and_seeds():
    runs = []
    for _ in range(2):
        policy, driver = TailConfig().build(PromptSampler(8), 4, 2, num_epochs=1), Driver()
        groups = [run_round(policy, step, driver)[0].groups for step in range(2)]
        runs.append((driver.turns, [[o.token_ids for o in g.outputs] for gs in groups for g in gs]))
    assert runs[0] == runs[1] and runs[0][0]


def test_every_evaluation_opens_the_same_episodes_and_none_a_training_round_opens():
    """The held-out round's environments reset alike at every evaluation (its curve compares the same
    episodes), and unlike those of a training round's prompt group of the same step and slot."""
    opened = []
    for step in (3, 7):
        driver = Driver()
        run_round(EvalPolicy(4, 2), step, driver)
        opened.append({key.partition(":")[2]: seed for key, seed in driver.opened.items()})
    assert opened[0] == opened[1] and len(opened[0]) == 8 and len(set(opened[0].values())) == 4
    driver = Driver()
    run_round(SyncConfig().build(PromptSampler(4), 4, 2, num_epochs=1), 3, driver)
    assert len(set(driver.opened.values())) == 4 and not set(driver.opened.values()) & set(opened[0].values())


def test_a_stream_round_migrates_episodes_at_a_turn_boundary():
    """A scale-down mid-round: episodes between turns move to the kept replica at once; running turns
    are aborted and resumed there. Every episode still finishes whole, heard once; every group is fed."""
    policy = SyncConfig().build(PromptSampler(8), 4, 2, num_epochs=1)
    hooks = StreamRound(ScaleDownDecider(StreamConfig(trigger=0.25), num_replicas=2, kv_capacity_tokens=100,
                                  max_new_tokens=8))
    driver = Driver()
    outcome, state, scaled = run_round(policy, 0, driver, hooks=hooks)
    assert scaled and outcome.scaled is not None and state.active == 1
    assert outcome.num_fed == 4 and all(g.streamed for g in outcome.groups)
    for g in outcome.groups:
        for o in g.outputs:
            check_episode(o, driver)
    assert driver.resumed and not outcome.aborted  # some turns were running when it scaled down: resumed
    after = [replica for now, replica in driver.added if now >= outcome.scaled.at]
    assert after and set(after) == {0}  # every turn after the scale-down on the kept replica


def test_a_migrating_turn_that_comes_back_whole_goes_on_on_the_kept_replica():
    """An engine may finish a turn before the scale-down's abort reaches it (SGLang answers it whole):
    its episode goes on, its next turns on the kept replica."""

    class ScaleDownAtPoll4(RoundHooks):
        polls = 0

        def scale_down_now(self, generated) -> bool:
            self.polls += 1
            return self.polls == 4

    driver = Driver(whole=True)
    outcome, state, scaled = run_round(SyncConfig().build(PromptSampler(8), 4, 2, num_epochs=1), 0, driver,
                                       hooks=ScaleDownAtPoll4())
    assert scaled and driver.moved == ["0:2:1#1"] and not driver.resumed  # turn 1 of 3 came back whole
    for g in outcome.groups:
        for o in g.outputs:
            check_episode(o, driver)
    assert "0:2:1#2" in driver.turns
    assert {replica for now, replica in driver.added if now >= outcome.scaled.at} == {0}


class Frontier(Driver):
    """Records each turn's priority beside the episodes of its group whose environment had ended them."""

    def __init__(self):
        super().__init__()
        self.done_in: dict[str, int] = collections.Counter()  # slot (``STEP:SLOT``) -> episodes terminated
        self.priorities: list[tuple[int, int, int]] = []  # (priority, slot, episodes of its group done then)

    def apply(self, a) -> None:
        for _, priority, turn in a.add:
            group = turn.id.rsplit(":", 1)[0]
            self.priorities.append((priority, int(group.split(":")[1]), self.done_in[group]))
        super().apply(a)

    def seen(self) -> Seen:
        seen = super().seen()
        for reply in seen.env:
            if reply.kind == "step" and reply.value.terminated:
                self.done_in[reply.key.rsplit(":", 1)[0]] += 1
        return seen


@pytest.mark.parametrize("hooks", [None, "pipe"])
def test_turns_of_groups_closer_to_complete_are_admitted_first(hooks):
    from rollpacker.schedule.scale_down import PipeRound

    group_size = 3
    driver, policy = Frontier(), SyncConfig().build(PromptSampler(12), 4, group_size, num_epochs=1)
    decider = ScaleDownDecider(StreamConfig(), num_replicas=2, kv_capacity_tokens=1, max_new_tokens=1)
    run_round(policy, 0, driver, hooks=PipeRound(decider) if hooks else None)
    assert any(done for _, _, done in driver.priorities)  # some turns came after a sibling finished
    for priority, slot, done in driver.priorities:
        base = slot if hooks else 0  # RolloutPipe's frontier-group dispatch (the slot) comes first
        assert priority == base * (group_size + 1) + group_size - done


def long_reset_runner(on_error: str, encode: Callable | None = None) -> EpisodeRunner:
    """The run's :class:`~rollpacker.env.setup.Episodes` over two rows with a context of 50 tokens
    (a prompt's token is its character, or ``encode``'s); its workers are not needed to make an episode."""
    from rollpacker.env.config import EnvConfig
    from rollpacker.env.setup import Environments

    encode = encode or (lambda prompt, tools: [ord(c) % 97 for c in prompt])

    envs = Environments(cfg=EnvConfig(factory="toy", on_error=on_error), pool=None, bridge=Bridge(), encode=encode,
                        seed=SEED, max_new_tokens=8, max_context=50)
    rows = [{"id": "short", "prompt": "2+2"}, {"id": "r1", "prompt": "3+3"}]
    return EpisodeRunner(envs.maker(rows, lambda row: encode(row["prompt"], None)), seed=SEED, environment=True,
                         on_error=on_error)


def open_replies(runner: EpisodeRunner, prompts: dict[str, str]) -> list:
    for key in prompts:
        runner.open(key, int(key[-1]), key.rpartition(":")[0])
    assert [c.kind for c in runner.take_calls()] == ["open"] * len(prompts)
    return [EnvReply(k, "open", (p, {})) for k, p in prompts.items()]


def test_a_reset_prompt_with_no_room_for_a_turn_is_an_environment_error_of_its_episode():
    """An environment whose reset prompt fills the context (60 tokens of 50) fails that episode
    (skip: counted, trained on nothing, closed) naming the environment, the row, the tokens and the
    fix; no turn goes to an engine. Its sibling with a short prompt runs."""
    runner = long_reset_runner("skip")
    done = runner.on_env(open_replies(runner, {"0:0:1": "x" * 60, "0:0:0": "1+1"}), now=0.0)
    (failed,) = done
    assert failed.id == "0:0:1" and failed.reason == "error" and failed.finish_reason == "error"
    for said in ("toy", "'r1'", "60 tokens", "context length is 50", "--engine.max-model-len", "shorten"):
        assert said in failed.detail, failed.detail
    assert not any(failed.loss_mask) and runner.stats.errors == 1 and runner.stats.causes == [failed.detail]
    assert [(c.kind, c.key) for c in runner.take_calls()] == [("close", "0:0:1")]
    ((key, turn),) = runner.take_turns()
    assert key == "0:0:0" and turn.max_new_tokens == 8


def test_a_reset_prompt_of_no_token_is_an_environment_error_of_its_episode():
    runner = long_reset_runner("skip")
    (failed,) = runner.on_env(open_replies(runner, {"0:0:1": "", "0:0:0": "1+1"}), now=0.0)
    assert (failed.id, failed.reason) == ("0:0:1", "error")
    assert "its reset prompt '' encodes to no token" in failed.detail
    assert [key for key, _ in runner.take_turns()] == ["0:0:0"]


def test_an_episode_keeps_the_tools_its_reset_gave_for_its_observations():
    runner, tools = long_reset_runner("skip"), [{"type": "function", "function": {"name": "add"}}]
    runner.open("0:0:0", 0, "0:0")
    runner.take_calls()
    runner.on_env([EnvReply("0:0:0", "open", ("1+1", {"tools": tools}))], now=0.0)
    assert runner.live["0:0:0"].tools == tools


def test_the_retries_an_open_took_are_counted_in_env_reset_retries():
    """The pool retries a failed open (``env.reset_retries``) and says how often on its reply; the round counts
    them, whatever came of the open."""
    runner = long_reset_runner("skip")
    for key in ("0:0:0", "0:0:1"):
        runner.open(key, int(key[-1]), "0:0")
    runner.take_calls()
    runner.on_env([EnvReply("0:0:0", "open", ("1+1", {}), retries=2),
                   EnvReply("0:0:1", "open", error="toy: episode '0:0:1' (row 'r1'): open raised OSError (tried 4 "
                            "times, env.reset_retries 3)", retries=3)], now=0.0)
    assert runner.stats.reset_retries == 5 and runner.stats.metrics()["env/reset_retries"] == 5.0
    # an episode cut (tail batching) while its open was retried: the retries ran, and are counted
    runner.open("0:1:0", 0, "0:1")
    runner.take_calls()
    runner.abort(["0:1:0"])
    runner.on_env([EnvReply("0:1:0", "open", error="toy: ... (tried 3 times, env.reset_retries 3)", retries=2)], 0.0)
    assert runner.stats.reset_retries == 7


def test_a_reset_prompt_with_no_room_stops_the_run_with_on_error_fail():
    from rollpacker.errors import UserError

    runner = long_reset_runner("fail")
    with pytest.raises(UserError, match=r"toy: episode '0:0:1' \(row 'r1'\).*60 tokens.*--env.on-error fail"):
        runner.on_env(open_replies(runner, {"0:0:1": "x" * 60}), now=0.0)


def test_closes_that_failed_are_counted_whatever_round_they_served_and_the_first_said(caplog):
    """A close's failure leaves its (finished) episode as it is; env/close_errors counts it (an evaluation's, or one
    that arrives while another round runs, too), and the run's first is said."""
    from rollpacker.env.config import EnvConfig
    from rollpacker.env.setup import Environments

    error = "toy: episode '0:0:0' (row 'short'): close raised OSError: container c1 still running"

    class Pool:  # the replies the workers have ready
        replies = [EnvReply("0:0:0", "close", error=error), EnvReply("eval/0:0:1", "close", error=error),
                   EnvReply("0:0:2", "close")]

        def poll(self):
            out, self.replies = self.replies, []
            return out

    envs = Environments(cfg=EnvConfig(factory="toy"), pool=Pool(), bridge=Bridge(), encode=None, seed=0,
                        max_new_tokens=8, max_context=100)
    with caplog.at_level("WARNING"):
        assert [r.key for r in envs.poll()] == ["0:0:0", "0:0:2"]  # the training round's (it skips closes)
        assert envs.take_metrics() == {"env/close_errors": 2.0} and envs.take_metrics() == {"env/close_errors": 0.0}
        envs.pool.replies = [EnvReply("0:1:0", "close", error=error)]
        envs.poll()
    said = [r.getMessage() for r in caplog.records if "close() failed" in r.getMessage()]
    assert len(said) == 1 and "container c1 still running" in said[0]
    assert Environments.none(8).take_metrics() == {}


def test_a_step_whose_tool_calls_all_failed_is_said_once_a_run_with_what_most_answered(caplog):
    """A tool that always raises (or a parser that misreads every call) would train the model not to call it."""
    from rollpacker.env.episode import Response
    from rollpacker.env.setup import SAID_CALLS, Environments

    def episode(calls: int, failed: int) -> Response:
        said = [{"role": "assistant", "content": "<tool_call>...</tool_call>"},
                {"role": "tool", "content": "error: RuntimeError: tool broke"}]
        return Response(id="e", prompt_ids=[1], token_ids=[2], logprobs=[0.0], finish_reason="stop", loss_mask=[True],
                        messages=said, info={"tool_calls": calls, "tool_errors": failed})

    envs = Environments.none(8)
    with caplog.at_level("WARNING"):
        envs.check_tool_calls([episode(SAID_CALLS - 1, SAID_CALLS - 1), Response(id="x", prompt_ids=[1])], 0)  # few
        envs.check_tool_calls([episode(SAID_CALLS, SAID_CALLS - 1), episode(1, 0)], 1)  # one worked
        envs.check_tool_calls([episode(SAID_CALLS, SAID_CALLS), episode(2, 2)], 2)
        envs.check_tool_calls([episode(SAID_CALLS, SAID_CALLS)], 3)  # said already
    said = [r.getMessage() for r in caplog.records if "tool calls failed" in r.getMessage()]
    assert said == [f"step 2: every one of its {SAID_CALLS + 2} tool calls failed (env/info/tool_errors), most "
                    "answered 'error: RuntimeError: tool broke': check the tools (a tool that always raises) and "
                    "--env.tool-parser; said once a run"]


def refusing(prompt, tools):
    """A chat template whose roles must alternate, over long_reset_runner's encoding."""
    from rollpacker.data.chat import TemplateRefused

    if isinstance(prompt, list) and [m["role"] for m in prompt] != ["user"]:
        raise TemplateRefused("the chat template of toy refused the prompt: TemplateError: Conversation roles must "
                              "alternate (fix the prompt, or use a model whose template takes it)")
    return [ord(c) % 97 for c in str(prompt)]


def test_a_reset_prompt_the_chat_template_refuses_is_an_environment_error_of_its_episode():
    """A reset whose messages the template refuses (two user turns where roles must alternate) stopped the run
    from inside the round with the data's "fix the prompt", naming neither the environment nor the row; now that
    episode fails (skip: counted, closed) and its sibling runs."""
    runner = long_reset_runner("skip", refusing)
    two = [{"role": "user", "content": "2+2"}, {"role": "user", "content": "and 3+3?"}]
    (failed,) = runner.on_env(open_replies(runner, {"0:0:1": two, "0:0:0": [two[0]]}), now=0.0)
    assert (failed.id, failed.reason) == ("0:0:1", "error") and runner.stats.errors == 1
    assert failed.detail.startswith("toy: episode '0:0:1' (row 'r1'): its reset prompt: the chat template of toy "
                                    "refused the prompt"), failed.detail
    assert [(c.kind, c.key) for c in runner.take_calls()] == [("close", "0:0:1")]
    assert [key for key, _ in runner.take_turns()] == ["0:0:0"]
