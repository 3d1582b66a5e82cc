"""The user's reward functions: TRL's and verl's conventions, weights, None, and errors naming the
function, the row and the cause; real worker processes (a hang costs 2 s)."""

from __future__ import annotations

import textwrap
import threading

import pytest

from rollpacker.env.episode import Response
from rollpacker.errors import UserError
from rollpacker.reward.config import RewardConfig
from rollpacker.reward.functions import BadValue, RewardFunctionError, TrainerState, names
from rollpacker.reward.scheduler import RewardScheduler

FUNCTIONS = '''
import asyncio, time

def length(prompts, completions, completion_ids, data_source, **kwargs):  # TRL: one value per completion
    assert isinstance(prompts[0], list) and completions[0][0]["role"] == "assistant"
    return [len(ids) / 10 for ids in completion_ids]

async def exact(completions, answer, **kwargs):  # TRL, async
    await asyncio.sleep(0)
    return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]

def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # verl
    if data_source != "arith":
        return None  # not this source's rows
    return {"score": 0.5 if ground_truth in solution_str else 0.0, "hit": float(ground_truth in solution_str)}

def raises(completions, **kwargs):
    return [1 / 0]

def two(completions, **kwargs):
    return [1.0, 2.0]

def text(completions, **kwargs):
    return ["good"]

def hangs(completions, **kwargs):
    time.sleep(60)

def step(completions, trainer_state, **kwargs):  # TRL's trainer_state, required
    return [trainer_state.global_step + trainer_state.epoch]

def logs(completions, answer, log_extra=None, log_metric=None, **kwargs):  # TRL's docs' example 6
    extracted = [c[0]["content"].strip() for c in completions]
    rewards = [float(e == a) for e, a in zip(extracted, answer)]
    log_extra("golden_answer", list(answer))
    log_extra("extracted_answer", extracted)
    log_metric("accuracy", sum(rewards) / len(rewards))
    return rewards

def verl_pred(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0, "pred": solution_str.strip(), "ok": True}

def distinct(completions, answer, log_extra=None, **kwargs):  # a group function: a completion its siblings share
    texts = [c[0]["content"] for c in completions]            # scores less
    assert len(set(answer)) == 1  # one prompt's group
    log_extra("copies", [texts.count(t) for t in texts])
    return [1.0 / texts.count(t) for t in texts]

async def shortest(completion_ids, log_metric=None, **kwargs):  # an async group function: 1 for the shortest
    log_metric("size", len(completion_ids))
    return [float(len(ids) == min(map(len, completion_ids))) for ids in completion_ids]

def first_only(completions, answer, **kwargs):  # a group function: a metric from the first response alone
    return [{"score": 1.0, "m": 6.0 if answer[0] == "2" else 0.0}] + [None] * (len(completions) - 1)

def one_in_three(completions, id, **kwargs):
    if id[0].endswith("3"):
        raise ValueError("row three")
    return [1.0]


class Loaded:  # loads in warm_up(), as docs/rewards.md advises
    ready = False

    def warm_up(self):
        self.ready = True

    def score(self, completions, **kwargs):
        return [float(self.ready)]

    async def ascore(self, completions, **kwargs):
        return [float(self.ready)]


class Broken(Loaded):
    def warm_up(self):
        raise OSError("no such model")


loaded, aloaded, broken = Loaded().score, Loaded().ascore, Broken().ascore
'''

ROWS = [
    {"id": "a:1", "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "1+1"}], "answer": "2",
     "data_source": "arith", "extra_info": {"i": 0}},
    {"id": "a:2", "prompt": [{"role": "user", "content": "hi"}], "answer": "hello", "data_source": "chat",
     "extra_info": {"i": 1}},
]
RESPONSES = [" 2", "hello there"]


@pytest.fixture(scope="module")
def funcs(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_rewards.py"
    path.write_text(textwrap.dedent(FUNCTIONS))
    return lambda *names: tuple(f"{path}:{n}" for n in names)


def scores(cfg: RewardConfig, rows: list[dict] = ROWS, state: TrainerState | None = None) -> tuple[dict, dict]:
    scheduler = RewardScheduler(cfg, lambda ids: RESPONSES[ids[0] % 2])
    scheduler.state = state or scheduler.state
    try:
        for i, row in enumerate(rows):
            scheduler.submit(row["id"], row, Response(id="", prompt_ids=[], token_ids=[i] * (3 + i)))
        return dict(scheduler.wait()), scheduler.take_metrics()
    finally:
        scheduler.close()


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_functions_warm_up_runs_before_its_first_call_wherever_it_is_called(funcs, num_workers):
    """warm_up() ran in reward workers alone: never with reward.num_workers 0 (inline) nor for an async function
    (awaited on the controller), whose calls then met what it had not loaded."""
    got, _ = scores(RewardConfig(funcs=funcs("loaded", "aloaded"), num_workers=num_workers, on_error="fail"))
    assert got == {"a:1": 2.0, "a:2": 2.0}
    with pytest.raises(UserError, match=r"reward.funcs: the warm_up\(\) of broken \(.*\) raised OSError: no such "):
        RewardScheduler(RewardConfig(funcs=funcs("broken"), num_workers=num_workers), str)
    assert "rollpacker-async-rewards" not in [t.name for t in threading.enumerate()]  # refused before it starts one


def test_a_training_response_scored_during_an_evaluation_counts_in_trainings_metrics(funcs):
    """A training round does not wait for the rewards of responses it keeps no group of (tail's surplus): scored
    while the evaluation ran, they were counted in eval/reward/NAME (and their errors in the evaluation's)."""
    scheduler = RewardScheduler(RewardConfig(funcs=funcs("length", "raises"), num_workers=0, max_error_frac=1.0),
                                lambda ids: RESPONSES[ids[0] % 2])
    try:
        scheduler.submit("3:0:0", ROWS[0], Response(id="", prompt_ids=[], token_ids=[0] * 5))  # training's
        scheduler.submit("4:0:0", ROWS[1], Response(id="", prompt_ids=[], token_ids=[1] * 9), held_out=True)
        assert len(scheduler.wait()) == 2
        held_out = scheduler.take_metrics("the evaluation before step 4", held_out=True)
        trained = scheduler.take_metrics()
    finally:
        scheduler.close()
    assert (held_out["reward/length"], held_out["reward/errors"]) == (0.9, 1)
    assert (trained["reward/length"], trained["reward/errors"]) == (0.5, 1)


def test_a_rounds_reward_metrics_count_the_responses_it_trains_and_none_it_left(funcs):
    """reward/NAME and reward/errors counted every response scored since the last step: tail's surplus and the
    responses of deferred or filtered prompts, scored but not trained, and those scored after their step (a round
    waits for none of them) went into the next step's. With one function reward/NAME was not reward/mean."""
    scheduler = RewardScheduler(RewardConfig(funcs=funcs("length", "raises"), num_workers=0, max_error_frac=1.0),
                                lambda ids: RESPONSES[ids[0] % 2])
    try:
        for key, n in (("0:0:0", 5), ("0:0:1", 9), ("0:1:0", 7)):  # 0:1:0 is surplus: no round trains it
            scheduler.submit(key, ROWS[0], Response(id="", prompt_ids=[], token_ids=[0] * n))
        assert len(scheduler.wait()) == 3
        step0 = scheduler.take_metrics(keys=["0:0:0", "0:0:1"])
        scheduler.submit("1:0:0", ROWS[0], Response(id="", prompt_ids=[], token_ids=[0] * 3))
        scheduler.wait()
        step1 = scheduler.take_metrics(keys=["1:0:0"])
    finally:
        scheduler.close()
    assert (step0["reward/length"], step0["reward/errors"]) == (pytest.approx(0.7), 2)
    assert (step1["reward/length"], step1["reward/errors"]) == (pytest.approx(0.3), 1)
    assert list(scheduler.counted[False]) == ["0:1:0"]  # kept for a round that may train it, up to MAX_COUNTED


def test_the_counts_of_responses_no_round_takes_are_bounded(funcs, monkeypatch):
    """A filtered group's or a deferred prompt's responses are counted by no round: 64 a step grew rank 0 by 700 MB."""
    from rollpacker.reward import scheduler as module

    monkeypatch.setattr(module, "MAX_COUNTED", 4)
    scheduler = RewardScheduler(RewardConfig(funcs=funcs("length"), num_workers=0), lambda ids: "x")
    try:
        for i in range(10):
            scheduler.submit(f"0:{i}:0", ROWS[0], Response(id="", prompt_ids=[], token_ids=[0] * 3))
        scheduler.wait()
    finally:
        scheduler.close()
    assert list(scheduler.counted[False]) == [f"0:{i}:0" for i in range(6, 10)]  # the newest


def test_trl_and_verl_functions_weighted_and_none_left_out(funcs):
    cfg = RewardConfig(funcs=(*funcs("length", "exact", "compute_score"), "toy"), weights=(1.0, 2.0, 4.0, 8.0),
                       num_workers=2, on_error="fail")
    got, metrics = scores(cfg)
    # a:1: length 3/10, exact 1 (" 2" stripped), verl 0.5 ("2" in " 2"), toy 0 (no ####)
    # a:2: length 4/10, exact 0, verl None (source chat: left out of the sum), toy 0
    assert got == {"a:1": pytest.approx(0.3 + 2 * 1.0 + 4 * 0.5), "a:2": pytest.approx(0.4)}
    assert metrics | {"reward/seconds_total": 0} == pytest.approx({
        "reward/length": 0.35, "reward/exact": 0.5, "reward/compute_score": 0.5, "reward/compute_score/hit": 1.0,
        "reward/toy": 0.0, "reward/errors": 0, "reward/seconds_total": 0})
    inline, _ = scores(RewardConfig(funcs=cfg.funcs, weights=cfg.weights, num_workers=0, on_error="fail"))
    assert inline == got


def test_an_episode_whose_environment_failed_is_scored_by_no_function_and_counted_in_no_metric(funcs):
    """It trains nothing: its functions' calls were wasted, their errors counted toward reward.max_error_frac, and
    its values went into reward/NAME beside the trained responses'."""
    cfg = RewardConfig(funcs=funcs("length", "raises"), num_workers=0, on_error="skip", max_error_frac=1.0)
    scheduler = RewardScheduler(cfg, lambda ids: RESPONSES[ids[0] % 2])
    try:
        scheduler.submit("a:1", ROWS[0], Response(id="", prompt_ids=[], token_ids=[0] * 3))
        scheduler.submit("a:2", ROWS[1], Response(id="", prompt_ids=[], token_ids=[1] * 5, finish_reason="error",
                                                  step_rewards={4: 1.0}))
        got, metrics = dict(scheduler.wait()), scheduler.take_metrics()
        values = scheduler.take_values(["a:1", "a:2"])
    finally:
        scheduler.close()
    assert got == {"a:1": 0.0, "a:2": 0.0}  # a:1: raises failed it (skip: 0)
    assert metrics["reward/length"] == pytest.approx(0.3) and metrics["reward/errors"] == 1
    assert "reward/environment" not in metrics
    assert values["a:2"] == {"rewards": {"length": None, "raises": None}, "extra": {}, "reward_error": None}
    # the sample of a:1 says which function failed it, and how (the docs' reward_error)
    assert values["a:1"]["rewards"] == {"length": pytest.approx(0.3), "raises": None}
    assert list(values["a:1"]["reward_error"]) == ["raises"]
    assert "reward function 'raises' failed on row" in values["a:1"]["reward_error"]["raises"]
    assert "ZeroDivisionError" in values["a:1"]["reward_error"]["raises"]
    # a group function's call holds its group's working episodes alone (one that failed at its reset has no copy of
    # its environment: a function taking environments raised, failing its siblings)
    group = {"a:1:0": Response(id="", prompt_ids=[], token_ids=[0] * 3),
             "a:1:1": Response(id="", prompt_ids=[], token_ids=[1] * 4, finish_reason="error"),
             "a:1:2": Response(id="", prompt_ids=[], token_ids=[2] * 5)}
    cfg = RewardConfig(funcs=funcs("distinct", "shortest"), group_funcs=("distinct", "shortest"), num_workers=0,
                       on_error="fail")
    scheduler = RewardScheduler(cfg, lambda ids: RESPONSES[ids[0] % 2])
    try:
        for key, response in group.items():
            scheduler.submit(key, ROWS[0], response)
        scheduler.submit_group(list(group), ROWS[0], list(group.values()))
        got, metrics = dict(scheduler.wait()), scheduler.take_metrics()
    finally:
        scheduler.close()
    assert got == {"a:1:0": 0.5 + 1.0, "a:1:1": 0.0, "a:1:2": 0.5 + 0.0}  # " 2" twice; the shortest of two
    assert metrics["reward/shortest/size"] == 2 and metrics["reward/distinct"] == 0.5


def test_verls_compute_score_gets_reward_models_ground_truth_beside_an_answer_column(funcs):
    """A ds.map into verl's layout keeps the source's answer column (GSM8K's worked solution): verl passes
    reward_model.ground_truth, and so do we; a TRL function gets the answer column, as TRL passes it."""
    rows = [{**ROWS[0], "reward_model": {"style": "rule", "ground_truth": "7"}},  # answer "2", the response " 2"
            {**ROWS[1], "data_source": "arith", "reward_model": {"style": "rule"}}]  # no ground_truth: the answer
    got, _ = scores(RewardConfig(funcs=funcs("compute_score", "exact"), weights=(1.0, 2.0), num_workers=0,
                                 on_error="fail"), rows)
    assert got == {"a:1": 2.0, "a:2": 0.5}  # a:1: verl 0 ("7" not in " 2"), exact 1; a:2: verl 0.5 ("hello")


@pytest.mark.timeout(120)
def test_a_function_that_raises_miscounts_mistypes_or_hangs_is_one_error_naming_function_row_and_cause(funcs, caplog):
    cfg = RewardConfig(funcs=funcs("raises", "two", "text", "hangs", "length"), num_workers=4, timeout=5.0,
                       max_error_frac=1.0)  # every call of four functions fails: scored 0, counted, not stopped
    # (5 s: on two busy cores a worker's call of length took over 2 s)
    got, metrics = scores(cfg, state=TrainerState(global_step=7))
    assert got == {"a:1": 0.0, "a:2": 0.0} and metrics["reward/errors"] == 2
    assert metrics["reward/length"] == 0.35  # the functions that worked are still logged
    said = sorted(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    skip = "at step 7, scored 0 (--reward.on-error skip); first on row 'a:1'"
    assert said == [  # one line per function per step, with a count
        f"reward function 'hangs' failed on 2 of 2 responses {skip}: timed out after 5 s (reward.timeout); its "
        "worker was replaced",
        f"reward function 'raises' failed on 2 of 2 responses {skip}: raised ZeroDivisionError: division by zero",
        f"reward function 'text' failed on 2 of 2 responses {skip}: returned str 'good' for a completion; expected "
        "a float, an int or None",
        f"reward function 'two' failed on 2 of 2 responses {skip}: returned 2 values for 1 completion; a "
        "TRL-convention function returns one float or None per completion"]
    with pytest.raises(RewardFunctionError) as e:
        scores(RewardConfig(funcs=funcs("raises"), num_workers=1, on_error="fail"))
    assert str(e.value) == ("reward function 'raises' failed on row 'a:1': raised ZeroDivisionError: division by "
                            "zero (--reward.on-error fail stops the run; skip scores such a response 0 and counts it "
                            "in reward/errors)")


def test_a_step_of_noise_stops_the_run_naming_the_function_row_and_cause(funcs, caplog):
    """reward.max_error_frac: a function that failed on every call, or too many responses that erred,
    stop the run before the step trains; a function failing on 1 row in 10 does not."""
    rows = [{**ROWS[i % 2], "id": f"a:{i}"} for i in range(10)]
    with pytest.raises(RewardFunctionError) as e:
        scores(RewardConfig(funcs=(*funcs("text"), "toy"), num_workers=0), rows, TrainerState(global_step=3))
    assert str(e.value) == (
        "reward function 'text' failed on 10 of 10 responses at step 3: all of them, first on row 'a:0': returned "
        "str 'good' for a completion; expected a float, an int or None. Stopped before training on them: fix it, "
        "then run again with --resume auto (--reward.max-error-frac 1 trains on such responses, scored 0, instead)")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # the stop is the one message
    got, metrics = scores(RewardConfig(funcs=funcs("one_in_three"), num_workers=0), rows)
    assert metrics["reward/errors"] == 1 and sorted(got.values()) == [0.0] + [1.0] * 9
    many = [{**r, "id": f"a:{i}{'3' * (i % 2)}"} for i, r in enumerate(rows)]  # a:0, a:13, a:2, a:33...: 5 in 10 fail
    assert scores(RewardConfig(funcs=funcs("one_in_three"), num_workers=0, max_error_frac=0.5), many)[1][
        "reward/errors"] == 5  # not more than half
    with pytest.raises(RewardFunctionError, match=r"^5 of 10 responses at step 0 had a reward error, more than "
                       r"--reward\.max-error-frac 0\.4: reward function 'one_in_three' failed on 5 of 10 responses "
                       r"at step 0, first on row 'a:13': raised ValueError: row three\. Stopped before training"):
        scores(RewardConfig(funcs=funcs("one_in_three"), num_workers=0, max_error_frac=0.4), many)
    with pytest.raises(RewardFunctionError, match=r"^2 of 2 responses at step 0 had a reward error, more than "
                       r"--reward\.max-error-frac 0\.5: no reward function scored 2 of 2 responses at step 0 \(all "
                       r"returned None\), first on row 'a:1': compute_score returned None"):
        scores(RewardConfig(funcs=funcs("compute_score"), num_workers=0), [{**r, "data_source": "x"} for r in ROWS])


def test_trl_functions_get_trainer_state(funcs):
    """TRL passes ``trainer_state``; a function that names it gets the step and the epoch (in a worker too)."""
    state = TrainerState(global_step=5, epoch=1.25, max_steps=9)
    for workers in (0, 1):
        assert scores(RewardConfig(funcs=funcs("step"), num_workers=workers), state=state)[0] == {
            "a:1": 6.25, "a:2": 6.25}


def test_trl_log_metric_and_log_extra_and_a_verl_dicts_other_values_reach_the_metrics_and_samples(funcs):
    """TRL's ``log_metric`` is logged as ``reward/NAME/METRIC`` (a mean over the responses); ``log_extra``'s
    columns and a verl dict's values that are not numbers go to each response's samples as ``extra``."""
    for workers in (0, 1):
        scheduler = RewardScheduler(RewardConfig(funcs=funcs("logs", "verl_pred"), num_workers=workers),
                                    lambda ids: RESPONSES[ids[0] % 2])
        try:
            for i, row in enumerate(ROWS):
                scheduler.submit(row["id"], row, Response(id="", prompt_ids=[], token_ids=[i]))
            assert dict(scheduler.wait()) == {"a:1": 2.0, "a:2": 1.0}
            metrics = scheduler.take_metrics()
            values = scheduler.take_values(["a:1", "a:2"])
        finally:
            scheduler.close()
        assert metrics["reward/logs/accuracy"] == 0.5 and metrics["reward/verl_pred/ok"] == 1.0
        assert values["a:1"] == {"rewards": {"logs": 1.0, "verl_pred": 1.0}, "extra": {
            "logs/golden_answer": "2", "logs/extracted_answer": "2", "verl_pred/pred": "2"}, "reward_error": None}
        assert values["a:2"]["extra"]["logs/extracted_answer"] == "hello there"


def test_group_functions_score_a_completed_group_and_its_rewards_wait_for_them(funcs, caplog):
    """reward.group_funcs: a function is called once on a group's responses, TRL's lists holding the group, when
    the round says the group is complete; each response's reward is its per-response functions' and its value in
    the group's call, and comes only then. A group function that fails fails each response of its group."""
    row = ROWS[0]
    group = {f"a:1:{k}": Response(id="", prompt_ids=[], token_ids=[k] * (3 + k)) for k in range(3)}  # " 2", "hello
    for workers in (0, 1):                                                                         # there", " 2"
        cfg = RewardConfig(funcs=funcs("length", "distinct", "shortest"), weights=(1.0, 1.0, 10.0),
                           group_funcs=("distinct", "shortest"), num_workers=workers, on_error="fail")
        scheduler = RewardScheduler(cfg, lambda ids: RESPONSES[ids[0] % 2])
        try:
            for key, response in group.items():
                scheduler.submit(key, row, response)
            assert scheduler.poll() == []  # length is in: the rewards wait for the group's call
            scheduler.submit_group(list(group), row, list(group.values()))
            got, metrics = dict(scheduler.wait()), scheduler.take_metrics()
            values = scheduler.take_values(list(group))
        finally:
            scheduler.close()
        assert got == {"a:1:0": pytest.approx(0.3 + 0.5 + 10), "a:1:1": pytest.approx(0.4 + 1.0),
                       "a:1:2": pytest.approx(0.5 + 0.5)}
        assert metrics | {"reward/seconds_total": 0} == pytest.approx({
            "reward/length": 0.4, "reward/distinct": 2 / 3, "reward/shortest": 1 / 3, "reward/shortest/size": 3.0,
            "reward/errors": 0, "reward/seconds_total": 0})
        assert values["a:1:1"] == {"rewards": {"length": 0.4, "distinct": 1.0, "shortest": 0.0},
                                   "extra": {"distinct/copies": 1}, "reward_error": None}
    scheduler = RewardScheduler(RewardConfig(funcs=funcs("two"), group_funcs=("two",), num_workers=0,
                                             max_error_frac=1.0), lambda ids: RESPONSES[0])
    for key, response in group.items():
        scheduler.submit(key, row, response)
    scheduler.submit_group(list(group), row, list(group.values()))
    assert dict(scheduler.wait()) == dict.fromkeys(group, 0.0) and scheduler.take_metrics()["reward/errors"] == 3
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "reward function 'two' failed on 3 of 3 responses at step 0, scored 0 (--reward.on-error skip); first on row "
        "'a:1': returned 2 values for 3 completions; a TRL-convention function returns one float or None per "
        "completion"]


def test_a_group_functions_metric_is_a_mean_over_the_responses_that_gave_it(funcs):
    """reward/NAME/KEY: the mean of the numbers the function returned. A group's mean was recorded once for each of
    its responses, those that returned None too: (6 x 3 + 0) / 4 = 4.5, not (6 + 0) / 2."""
    scheduler = RewardScheduler(RewardConfig(funcs=funcs("first_only"), group_funcs=("first_only",), num_workers=0),
                                lambda ids: RESPONSES[0])
    groups = {"a:1": [f"a:1:{k}" for k in range(3)], "a:2": ["a:2:0"]}
    for row in ROWS[:2]:
        responses = [Response(id="", prompt_ids=[], token_ids=[k]) for k in range(len(groups[row["id"]]))]
        for key, response in zip(groups[row["id"]], responses):
            scheduler.submit(key, row, response)
        scheduler.submit_group(groups[row["id"]], row, responses)
    scheduler.wait()
    metrics = scheduler.take_metrics()
    scheduler.close()
    assert (metrics["reward/first_only"], metrics["reward/first_only/m"]) == (1.0, 3.0)


def test_reward_correct_names_one_of_the_functions(funcs):
    assert RewardConfig(funcs=("toy", *funcs("length")), correct="toy").correct == "toy"
    assert RewardConfig(correct="toy").correct == "toy"  # the default functions: toy
    with pytest.raises(ValueError, match=r"reward.correct names 'accuracy', not the metric name of one of "
                                         r"reward.funcs \(toy, length\): name the function"):
        RewardConfig(funcs=("toy", *funcs("length")), correct="accuracy")


def test_group_functions_are_users_functions_of_trls_convention(funcs):
    from rollpacker.config import Config
    from rollpacker.reward.scheduler import build_functions
    from rollpacker.schedule.sync import SyncConfig

    with pytest.raises(ValueError, match=r"reward.group_funcs names 'toy': a built-in, which scores each response "
                                         r"alone\. Name a function of your own"):
        RewardConfig(funcs=("toy",), group_funcs=("toy",))
    with pytest.raises(ValueError, match=r"names 'length': not the metric name of one of reward.funcs \(toy\)"):
        RewardConfig(funcs=("toy",), group_funcs=("length",))
    with pytest.raises(RewardFunctionError, match=r"group_funcs: compute_score \(.*\) follows verl's convention"):
        build_functions(RewardConfig(funcs=funcs("compute_score"), group_funcs=("compute_score",)))
    with pytest.raises(ValueError, match=r"schedule.filter_zero_variance with reward.group_funcs \['distinct'\]: the "
                                         r"filter decides on each response's reward as it is scored"):
        Config(reward=RewardConfig(funcs=funcs("distinct"), group_funcs=("distinct",)),
               schedule=SyncConfig(filter_zero_variance=True))


def test_a_row_no_function_scores_is_an_error_naming_it(funcs):
    with pytest.raises(RewardFunctionError, match="no reward function scores row 'a:2': compute_score returned None"):
        scores(RewardConfig(funcs=funcs("compute_score"), num_workers=0, on_error="fail"))
    scheduler = RewardScheduler(RewardConfig(funcs=funcs("compute_score"), num_workers=0, max_error_frac=1.0),
                                lambda ids: RESPONSES[ids[0] % 2])
    try:  # skip: scored 0, counted in reward/errors, and its sample says why (its reward_error was null)
        scheduler.submit("k", ROWS[1], Response(id="", prompt_ids=[], token_ids=[1] * 4))
        ((key, reward),) = scheduler.wait()
        assert (key, reward, type(reward)) == ("k", 0.0, float)  # the environment's rewards: none, an int 0 was
        (error,) = scheduler.take_values(["k"])["k"]["reward_error"].values()
        assert error.startswith("no reward function scores row 'a:2': compute_score returned None"), error
    finally:
        scheduler.close()


def test_loading_errors_name_the_function(funcs, tmp_path):
    from rollpacker.reward.scheduler import build_functions

    with pytest.raises(ValueError, match="no such file nope.py"):
        RewardConfig(funcs=("nope.py:f",))
    with pytest.raises(RewardFunctionError, match="my_rewards.py has no function 'missing'"):
        build_functions(RewardConfig(funcs=funcs("missing")))
    with pytest.raises(RewardFunctionError, match="cannot import no_such_package_x: ModuleNotFoundError"):
        build_functions(RewardConfig(funcs=("no_such_package_x:f",)))
    odd = tmp_path / "odd.py"
    odd.write_text("def f(x, y):\n    return 1\n")
    with pytest.raises(RewardFunctionError, match=r"odd.py:f: its parameters \(x, y\) follow neither TRL's"):
        build_functions(RewardConfig(funcs=(f"{odd}:f",)))
    assert names(("toy", "a.py:compute_score", "pkg.b:compute_score", "c.py:mean", "d.py:environment")) == [
        "toy", "a.compute_score", "b.compute_score", "c.mean", "d.environment"]  # not the scheduler's own
    assert names(("e.py:zero_variance_frac", "f.py:overlong_penalty_mean")) == [  # they overwrote the controller's
        "e.zero_variance_frac", "f.overlong_penalty_mean"]
    twin = tmp_path / "twin" / "my_rewards.py"  # two files of one stem: one metric name would hide one function
    twin.parent.mkdir()
    twin.write_text(odd.read_text())
    with pytest.raises(ValueError, match=r"my_rewards.py:f and .*twin/my_rewards.py:f would both log as "
                                         r"reward/my_rewards.f; rename one"):
        RewardConfig(funcs=(*funcs("f"), f"{twin}:f"))
    with pytest.raises(ValueError, match=r"reward.weights must be finite, got \[1.0, nan\]"):
        RewardConfig(funcs=("toy", "math"), weights=(1.0, float("nan")))


def test_an_episodes_answer_is_its_last_assistant_message_not_a_tool_result_after_it():
    """An episode cut at env.max_turns right after a call ends on the tool's message: the built-in rewards
    score the model's last answer, never the tool's output (a calculator's '#### 4042' earns nothing)."""
    from rollpacker.reward.functions import completion_text
    from rollpacker.reward.rules import math, toy

    turns = [{"role": "assistant", "content": "<tool_call>{}</tool_call>"}, {"role": "tool", "content": "#### 4042"}]
    assert completion_text(turns) == "<tool_call>{}</tool_call>" and completion_text("#### 1") == "#### 1"
    assert toy(prompts=["q"], completions=[turns], answer=["4042"]) == [0.0]
    assert math(prompts=["q"], completions=[turns], answer=["4042"]) == [0.0]


def test_a_trl_function_may_return_a_numpy_array_or_a_tensor_as_trl_takes_them(tmp_path):
    from rollpacker.reward.functions import call, prompt_text, resolve

    path = tmp_path / "arrays.py"
    path.write_text("import numpy, torch\n\ndef array(completions, **kw):\n    return numpy.array([1.0])\n\n"
                    "def tensor(completions, **kw):\n    return torch.tensor([0.5])\n\n"
                    "def scalars(completions, **kw):\n    return [torch.tensor(0.25)]\n\n"
                    "def scored(completions, **kw):\n    return [{'score': numpy.array(0.75)}]\n\n"
                    "def same(completions, **kw):\n    return [numpy.float64(1) == numpy.float64(1)]\n\n"
                    "def nan(completions, **kw):\n    return numpy.array([numpy.nan])\n\n"
                    "def nans(completions, **kw):\n    return [torch.tensor(float('nan'))]\n\n"
                    "def inf(completions, **kw):\n    return [float('inf')]\n\n"
                    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float('nan')\n")
    sample = {"columns": {}, "prompt": "p", "completion": "c", "completion_ids": [1]}
    assert call(resolve(f"{path}:array", "array"), sample) == (1.0, {}, {})
    assert call(resolve(f"{path}:tensor", "tensor"), sample) == (0.5, {}, {})
    assert call(resolve(f"{path}:scalars", "scalars"), sample) == (0.25, {}, {})  # a list of 0-d tensors
    assert call(resolve(f"{path}:scored", "scored"), sample) == (0.75, {}, {})
    assert call(resolve(f"{path}:same", "same"), sample) == (1.0, {}, {})  # numpy's bool
    assert call(resolve(f"{path}:nan", "nan"), sample) == (None, {}, {})  # TRL's None becomes NaN: it reads it back
    assert call(resolve(f"{path}:nans", "nans"), sample) == (None, {}, {})  # a 0-d tensor's NaN too
    for name in ("inf", "compute_score"):  # not TRL's None: a bug's
        with pytest.raises(BadValue, match=r"returned (inf|nan) for a completion; a reward must be finite \(None: "):
            call(resolve(f"{path}:{name}", name), {**sample, "columns": {"answer": "1"}})
    # the judge's text of a prompt whose assistant message holds only tool calls (content null, as the data allows)
    calls = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": None, "tool_calls": []}]
    assert prompt_text(calls) == "2+3?\n\n"


def test_a_prefill_leaves_the_prompt_and_leads_the_completion_as_trl_passes_them(tmp_path):
    """A chat prompt ending in an assistant turn is a prefill the model continued: a TRL function gets the prompt
    without it and the completion with its text first (TRL's ``bootstrap``), so a format reward sees the tag the
    prefill opened. An episode's first assistant turn gets it; a string prompt has none."""
    from rollpacker.reward.functions import call, resolve

    path = tmp_path / "prefill.py"
    path.write_text("def tagged(prompts, completions, **kw):\n"
                    "    assert all(p[-1]['role'] == 'user' for p in prompts), prompts\n"
                    "    return [float(c[0]['content'].startswith('<think>')) for c in completions]\n\n"
                    "def plain(prompts, completions, **kw):\n    return [float(completions[0] == ' 4')]\n")
    prompt = [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "<think>"}]
    sample = {"columns": {}, "prompt": prompt, "completion": "two and two</think> 4", "completion_ids": [1]}
    assert call(resolve(f"{path}:tagged", "tagged"), sample) == (1.0, {}, {})
    turns = [{"role": "assistant", "content": "x</think>"}, {"role": "tool", "content": "4"}]
    assert call(resolve(f"{path}:tagged", "tagged"), {**sample, "messages": turns}) == (1.0, {}, {})
    assert turns[0]["content"] == "x</think>" and prompt[-1]["content"] == "<think>"  # the sample's own untouched
    assert call(resolve(f"{path}:plain", "plain"), {**sample, "prompt": "2+2 =", "completion": " 4"}) == (1.0, {}, {})


def test_a_function_taking_a_column_no_row_has_is_refused_before_the_run(tmp_path):
    """Every call would raise TypeError (missing argument) after a whole rollout; a column some rows have (a file of
    several) or a parameter with a default is the function's to handle."""
    from rollpacker.reward.scheduler import build_functions, check_columns

    path = tmp_path / "cols.py"
    path.write_text("def needs(completions, difficulty, level=1, **kw):\n    return [1.0]\n\n"
                    "def singular(completions, prompt, **kw):\n    return [1.0]\n\n"
                    "def verl(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    functions = build_functions(RewardConfig(funcs=("math", f"{path}:needs", f"{path}:verl")))
    rows = [{"id": "a", "prompt": "p", "answer": "1"}, {"id": "b", "prompt": "q", "answer": "2", "topic": "x"}]
    with pytest.raises(RewardFunctionError, match=r"reward function needs \(.*cols.py:needs\) takes 'difficulty', a "
                                                  r"column no row of data.path has \(its columns: answer, topic\): "
                                                  r"add the column, or give the parameter a default"):
        check_columns(functions, rows, "data.path")
    check_columns(functions, [rows[0], {**rows[1], "difficulty": None}], "data.path")
    check_columns(functions, [], "data.eval_path")
    with pytest.raises(RewardFunctionError, match=r"takes 'prompt', a column no row"):  # TRL gives it as prompts
        check_columns(build_functions(RewardConfig(funcs=(f"{path}:singular",))), rows, "data.path")


def test_a_function_that_needs_environments_in_a_run_without_an_environment_is_refused_before_it(tmp_path):
    from rollpacker.reward.scheduler import build_functions

    path = tmp_path / "envs.py"
    path.write_text("def used(environments, **kw):\n    return [1.0]\n\n"
                    "def maybe(completions, environments=None, **kw):\n    return [1.0]\n")
    with pytest.raises(RewardFunctionError, match=r"reward function used \(.*envs.py:used\) takes environments, "
                                                  r"which an env.factory of TRL's shape gives, and this run has none: "
                                                  r"set --env.factory to one, or drop"):
        build_functions(RewardConfig(funcs=(f"{path}:used",)))
    # a default: TRL gives no environments where there are none, and the function runs with its default (it was refused)
    from rollpacker.reward.functions import call

    maybe = build_functions(RewardConfig(funcs=(f"{path}:maybe",)))[0]
    assert call(maybe.ref, {"prompt": "p", "completion": "c", "completion_ids": [1], "columns": {}})[0] == 1.0
    assert len(build_functions(RewardConfig(funcs=(f"{path}:used", f"{path}:maybe")), environment=True)) == 2
