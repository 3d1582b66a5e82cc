"""The episode state machine with scripted turns and observations (no model, no tokenizer)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollpacker.env.contract import StepResult
from rollpacker.env.episode import Done, Episode, StepEnv, TurnRequest, reset_seed, turn_seed


class Letters:
    """A bridge over a scripted vocabulary: a token is a letter's code; an observation is its
    messages' contents as tokens after the end-of-turn token 1; the action is the letters."""

    def action_text(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids if t > 1)

    def observation_ids(self, observation: list[dict], turn_ids: list[int], tools=None) -> list[int]:
        return [1, *(ord(c) for m in observation for c in m["content"])]


def episode(**kw) -> Episode:
    limits = dict(seed=7, max_turns=3, max_tokens=100, max_new_tokens=10, max_context=200) | kw
    return Episode("3:1:2", [2, 3, 4], Letters(), **limits)


def turn(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_turns_and_observations_interleave_with_the_mask_and_logprobs():
    e = episode()
    first = e.next_turn()
    assert first == TurnRequest("3:1:2#0", [2, 3, 4], 10, turn_seed(7, "3:1:2#0"), session="3:1:2")
    assert e.on_turn(turn("ab"), [-0.1, -0.2], "stop") == StepEnv("ab")
    second = e.on_step(StepResult([{"role": "user", "content": "xy"}], reward=0.5))
    assert second == TurnRequest("3:1:2#1", [2, 3, 4, *turn("ab"), 1, *turn("xy")], 10, turn_seed(7, "3:1:2#1"),
                                 session="3:1:2")
    assert e.on_turn(turn("c"), [-0.3], "stop") == StepEnv("c")
    done = e.on_step(StepResult([{"role": "user", "content": "bye"}], reward=1.0, terminated=True))
    assert done == Done("terminated") and done.finish_reason == "stop"
    assert e.response_ids == [*turn("ab"), 1, *turn("xy"), *turn("c")]  # the final observation is not appended
    assert e.loss_mask == [True, True, False, False, False, True]
    assert e.logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3]
    assert e.step_rewards == {1: 0.5, 5: 1.0} and e.output().env_reward == 1.5  # each on its action's last token
    assert (e.num_turns, e.num_model_tokens, e.num_env_tokens) == (2, 3, 3)
    assert [m["role"] for m in e.messages] == ["assistant", "user", "assistant", "user"]


def test_the_samples_turns_name_each_observation_by_its_roles_one_that_said_nothing_environment():
    e = episode()
    e.on_turn(turn("a"), [-1.0], "stop")
    e.on_step(StepResult([]))  # said nothing: its tokens are the end of turn alone
    e.on_turn(turn("b"), [-1.0], "stop")
    e.on_step(StepResult([{"role": "tool", "content": "T"}]))
    e.on_turn(turn("c"), [-1.0], "stop")
    assert [(t["role"], t["trained"], t["text"]) for t in e.output().turns(str)] == [
        ("assistant", True, "[97]"), ("environment", False, "[1]"), ("assistant", True, "[98]"),
        ("tool", False, "[1, 84]"), ("assistant", True, "[99]")]


def test_an_observation_holding_an_assistant_message_is_one_observation_in_the_samples():
    e = episode()
    e.on_turn(turn("a"), [-1.0], "stop")
    e.on_step(StepResult([{"role": "assistant", "content": "H"}, {"role": "user", "content": "U"}]))
    e.on_turn(turn("b"), [-1.0], "stop")
    e.on_step(StepResult([{"role": "tool", "content": "T"}]))
    e.on_turn(turn("c"), [-1.0], "stop")
    assert [t["role"] for t in e.output().turns(str)] == [
        "assistant", "assistant+user", "assistant", "tool", "assistant"]


def test_ids_and_seeds_are_fixed_by_the_episode_and_the_turn():
    """A turn replayed (resumed, migrated, or the episode run again) asks for the same request."""
    a, b = episode(), episode()
    for e in (a, b):
        e.on_turn(turn("ab"), [-1.0, -1.0], "stop")
    assert a.on_step(StepResult([])) == b.on_step(StepResult([]))
    assert turn_seed(7, "3:1:2#1") != turn_seed(7, "3:1:2#0") != turn_seed(8, "3:1:2#0")
    assert reset_seed(7, "3:1") == reset_seed(7, "3:1") != reset_seed(7, "3:2")


@pytest.mark.parametrize("limits, turns, reason", [
    (dict(max_turns=2), ["ab", "cd"], "max_turns"),
    (dict(max_new_tokens=2, max_tokens=2), ["ab"], "max_tokens"),  # a turn at its own limit and the episode's
    (dict(max_tokens=5, max_new_tokens=10), ["abc", "de"], "max_tokens"),  # the second turn had 2 left
    (dict(max_context=11), ["abc", "d"], "context"),
])
def test_limits_end_the_episode(limits, turns, reason):
    e = episode(**limits)
    budgets = []
    for i, text in enumerate(turns):
        budgets.append(e.next_turn().max_new_tokens)
        finish = "length" if len(text) == budgets[-1] else "stop"
        out = e.on_turn(turn(text), [-1.0] * len(text), finish)
        if isinstance(out, StepEnv):
            out = e.on_step(StepResult([{"role": "user", "content": "o"}]))
    assert out == Done(reason) and e.done == Done(reason)
    assert out.finish_reason == ("stop" if reason == "max_turns" else "length")
    if reason == "max_tokens":
        assert budgets == ([5, 2] if len(turns) == 2 else [2])
    if reason == "context":  # 3 prompt + 3 + 2 observation = 8 of 11: 3 left; 1 + 2 more would fill them
        assert budgets == [8, 3] and len(e.prompt_ids) + len(e.response_ids) == 9


def test_an_observation_that_does_not_fit_ends_the_episode_without_it():
    e = episode(max_context=8)
    e.on_turn(turn("ab"), [-1.0, -1.0], "stop")
    assert e.on_step(StepResult([{"role": "user", "content": "xyz"}])) == Done("context")
    assert e.response_ids == turn("ab")


def test_a_failed_environment_ends_the_episode_once_and_an_aborted_episode_keeps_its_tokens():
    e = episode()
    e.on_turn(turn("ab"), [-1.0, -1.0], "stop")
    done = e.fail("toy.py:make_env: episode 3:1:2 (row 'r7'): step raised ValueError: boom")
    assert done.reason == "error" and done.finish_reason == "error" and "boom" in done.detail
    assert e.fail("again") == done  # ended once
    out = e.output()  # its model's tokens still read as the model's, none trained (Controller.group_samples)
    assert out.loss_mask == [True, True] and out.num_model_tokens == 2
    assert [t["trained"] for t in out.turns(str)] == [False]
    a = episode()
    a.on_turn(turn("ab"), [-1.0, -1.0], "stop")
    assert a.abort() == Done("abort") and a.loss_mask == [True, True]


def test_driving_it_out_of_order_is_a_bug_said_plainly():
    e = episode()
    with pytest.raises(RuntimeError, match="expected a step, but it is waiting for a turn"):
        e.on_step(StepResult([]))
    with pytest.raises(ValueError, match="give on_turn a whole turn"):
        e.on_turn(turn("ab"), [-1.0, -1.0], "abort")
    e.abort()
    with pytest.raises(RuntimeError, match=r"expected a turn, but it is done \(abort\)"):
        e.next_turn()


def test_a_prompt_that_fills_the_context_is_refused():
    with pytest.raises(ValueError, match="a prompt of 3 tokens leaves no room for a turn in a context of 3"):
        episode(max_context=3)


@pytest.mark.parametrize("max_context", range(4, 16))
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 9])
def test_no_turn_is_asked_for_with_no_token_left(max_context, max_tokens):
    """Whatever the limits, every turn asked for has at least one token; a conversation that leaves
    none ends the episode by its limit ("length": truncated), never with a turn of budget <= 0."""
    for turn_len in (1, 2, 4):
        e, out = episode(max_context=max_context, max_tokens=max_tokens, max_new_tokens=4, max_turns=20), None
        while not isinstance(out, Done):
            budget = e.next_turn().max_new_tokens
            assert budget >= 1, (budget, e.num_model_tokens, len(e.response_ids))
            n = min(turn_len, budget)
            out = e.on_turn(turn("a" * n), [-1.0] * n, "length" if n == budget else "stop")
            if isinstance(out, StepEnv):
                out = e.on_step(StepResult([{"role": "user", "content": "o"}]))
        assert out.finish_reason == "length" and len(e.prompt_ids) + len(e.response_ids) <= max_context
        assert e.num_model_tokens <= max_tokens


def test_a_turn_cut_at_its_own_limit_goes_to_the_environment():
    """``max_new_tokens`` bounds each turn, ``max_tokens`` the episode (as verifiers' MultiTurnEnv
    steps a turn cut at its max_tokens, and verl's agent loop ends at the episode's response
    length): a turn cut by the former is an action like any other; the episode ends at the latter."""
    e = episode(max_new_tokens=3, max_tokens=7)
    assert e.next_turn().max_new_tokens == 3
    assert e.on_turn(turn("abc"), [-1.0] * 3, "length") == StepEnv("abc")
    second = e.on_step(StepResult([{"role": "user", "content": "o"}], reward=0.5))
    assert isinstance(second, TurnRequest) and second.max_new_tokens == 3
    assert e.on_turn(turn("def"), [-1.0] * 3, "length") == StepEnv("def")
    third = e.on_step(StepResult([{"role": "user", "content": "o"}]))
    assert third.max_new_tokens == 1  # the episode's budget: 7 - 6
    done = e.on_turn(turn("g"), [-1.0], "length")
    assert done == Done("max_tokens") and done.finish_reason == "length" and e.num_turns == 3
    assert e.step_rewards == {2: 0.5}


@pytest.mark.parametrize("result, reason", [(StepResult([], reward=1.0, terminated=True), "terminated"),
                                            (StepResult([{"role": "user", "content": "o"}]), "max_turns")])
def test_an_episode_whose_last_turn_its_limit_cut_ends_truncated_whatever_ended_it(result, reason):
    """The environment took a turn cut mid-sentence as the answer (a tools episode's turn without a call ends it):
    it read "stop", so rollout/truncated did not count it and train.mask_truncated trained it. A stopped last turn
    is not cut."""
    for finish, cut in (("length", True), ("stop", False)):
        e = episode(max_new_tokens=3, max_turns=1)
        assert e.on_turn(turn("abc"), [-1.0] * 3, finish) == StepEnv("abc")
        done = e.on_step(result)
        assert done == Done(reason, cut=cut) and done.finish_reason == ("length" if cut else "stop")
        assert e.output().finish_reason == done.finish_reason and e.output().reason == reason


def test_a_response_without_environment_is_the_one_turn_episode_named_and_seeded_as_itself():
    """No bridge: the one turn is the episode's own request id and seed (a single-turn request's), keeps no
    session, and ends the episode: "answer" when it stopped, "length" (truncated) when cut. Every token is
    the model's; an abort keeps the tokens the engine had (a later round may resume them)."""
    e = Episode("3:1:2", [2, 3, 4], None, seed=7, max_turns=1, max_tokens=10, max_new_tokens=10, max_context=100)
    assert e.next_turn() == TurnRequest("3:1:2", [2, 3, 4], 10, turn_seed(7, "3:1:2"))
    assert e.on_turn(turn("ab"), [-0.1, -0.2], "stop") == Done("answer")
    out = e.output()
    assert (out.token_ids, out.logprobs, out.loss_mask, out.finish_reason) == (turn("ab"), [-0.1, -0.2], [True] * 2,
                                                                            "stop")
    assert (out.num_turns, out.step_rewards, out.messages, out.describe(str)) == (1, {}, None, {})
    cut = Episode("3:1:3", [2, 3, 4], None, seed=7, max_turns=1, max_tokens=3, max_new_tokens=3, max_context=100)
    assert cut.on_turn(turn("abc"), [-1.0] * 3, "length").finish_reason == "length"
    aborted = Episode("3:1:4", [2, 3, 4], None, seed=7, max_turns=1, max_tokens=10, max_new_tokens=10,
                      max_context=100)
    aborted.abort(SimpleNamespace(token_ids=turn("a"), logprobs=[-0.5], finish_reason="abort"))
    partial = aborted.output()
    assert (partial.token_ids, partial.loss_mask, partial.finish_reason) == (turn("a"), [True], "abort")


@pytest.mark.parametrize(("tokens", "reason", "done"), [
    ("abc", "abort", Done("length")), ("ab", "stop", Done("answer")), ("abc", "length", Done("length"))])
def test_an_abort_that_reaches_a_whole_turn_without_environment_ends_the_episode_leaving_nothing_to_resume(
        tokens, reason, done):
    """An engine's abort that came back with the turn's whole budget (SGLang's, at the budget's last token)
    or a finished turn: the one-turn episode is done, not a partial a later round would resume with no token
    left to generate."""
    e = Episode("3:1:2", [2, 3, 4], None, seed=7, max_turns=1, max_tokens=3, max_new_tokens=3, max_context=100)
    assert e.abort(SimpleNamespace(token_ids=turn(tokens), logprobs=[-1.0] * len(tokens), finish_reason=reason)) == done
    assert e.output().finish_reason == done.finish_reason and e.output().token_ids == turn(tokens)
