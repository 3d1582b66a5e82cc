"""``bench parity``'s parts: the delayed tool keeps the schema the model sees; a run's metrics summarized."""

from __future__ import annotations

import pytest

from rollpacker.bench.parity import Args, delayed, summarize
from rollpacker.toy.tools import calculator


def test_a_delayed_tool_keeps_its_schema_and_result():
    from transformers.utils import get_json_schema

    slow = delayed(calculator, "lognormal:0.001:1.0")
    assert get_json_schema(slow) == get_json_schema(calculator) and slow("47*86") == "4042"


def test_summarize_reads_the_gain_the_tool_rate_and_what_keep_first_kept():
    records = [{"step": 0, "eval/accuracy": 0.5, "eval/info/tool_calls_frac": 0.0},
               {"step": 0, "reward/mean": 0.5, "env/info/tool_calls_frac": 0.1, "sched/cut_episodes": 2.0,
                **{f"sched/{side}/{k}": v for side, v in (("kept", 1.0), ("cut", 3.0))
                   for k in ("turns", "model_tokens", "tool_calls", "env_seconds")}},
               {"step": 1, "reward/mean": 0.9, "env/info/tool_calls_frac": 0.5, "sched/cut_episodes": 0.0},
               {"step": 2, "eval/accuracy": 0.75, "eval/info/tool_calls_frac": 0.5,
                "eval/hard/info/tool_calls_frac": 1.0}]
    s = summarize(records, 12.0)
    assert (s["eval_gain"], s["eval_mean"], s["tool_rate"], s["tool_rate_hard"]) == (0.25, 0.75, 0.5, 1.0)
    assert s["train_tool_rate"] == 0.5 and s["cut_episodes"] == 2.0  # the last quarter: step 1
    assert (s["kept_tool_calls"], s["cut_tool_calls"], s["cut_turns"], s["wall_s"]) == (1.0, 3.0, 3.0, 12.0)


def test_bad_arguments_say_what_to_write():
    with pytest.raises(ValueError, match="unknown"):
        Args(policies="sync,fast")
    with pytest.raises(ValueError, match="lognormal:MEAN_SECONDS:SIGMA"):
        Args(latency="gauss")


def test_the_bar_catches_a_policy_that_learns_late(capsys):
    """Gain and final tool-call rate saturate on toy-tools: learning the tool ten steps late passed them
    (seed 0's keep-first, docs/results.md); the mean of the evaluations does not."""
    from rollpacker.bench.parity import report

    def seed(evals: list[float]) -> dict:
        records = [{"step": 10 * i, "eval/accuracy": a, "eval/info/tool_calls_frac": 0.527}
                   for i, a in enumerate(evals)] + [{"step": 0, "reward/mean": 0.5}]
        return summarize(records, 1.0)

    results = {"sync": [seed([0.492, 0.5, 0.961, 0.965])], "tail": [seed([0.492, 0.5, 0.957, 0.969])],
               "tail_keep_first": [seed([0.492, 0.5, 0.734, 0.969])]}
    summary = report(Args(seeds="0"), results)
    assert summary["parity_tail"] and not summary["parity_tail_keep_first"]
    assert summary["eval_gain_gap_tail_keep_first"] < 0 < summary["eval_mean_gap_tail_keep_first"] - 0.07
    out = capsys.readouterr().out
    assert "mean of evals +0.074 below (at most 0.03), tool-call rate +0.000 below (at most 0.05): NO" in out


def test_a_seed_that_cut_nothing_is_left_out_of_the_kept_and_cut_means(capsys):
    """It counted as kept and cut episodes of 0 turns, halving the other seeds' means (a short run)."""
    from rollpacker.bench.parity import report

    def seed(cut: bool) -> dict:
        step = {"step": 0, "reward/mean": 0.5, "sched/cut_episodes": float(cut)}
        if cut:
            step |= {f"sched/{side}/{k}": v for side, v in (("kept", 2.0), ("cut", 4.0))
                     for k in ("turns", "model_tokens", "tool_calls", "env_seconds")}
        return summarize([{"step": 0, "eval/accuracy": 0.5}, step], 1.0)

    summary = report(Args(seeds="0,1"), {"sync": [seed(False), seed(False)], "tail": [seed(True), seed(False)],
                                         "tail_keep_first": [seed(False), seed(False)]})
    assert (summary["kept_turns_tail"], summary["cut_turns_tail"]) == (2.0, 4.0)
    assert summary["kept_turns_tail_keep_first"] is None  # no seed cut any: no mean, not 0


def test_gaps_are_below_sync_whatever_the_order_and_each_seed_is_judged_alone(capsys):
    """The first policy was the baseline: ``--policies tail_keep_first,sync`` measured sync below keep-first and
    printed ``parity_sync: true``. And a mean over seeds hid one seed that learned late; how many seeds meet the
    bar alone is said beside it."""
    from rollpacker.bench.parity import report

    def seed(evals: list[float], rate: float) -> dict:
        records = [{"step": 10 * i, "eval/accuracy": a, "eval/info/tool_calls_frac": rate}
                   for i, a in enumerate(evals)] + [{"step": 0, "reward/mean": 0.5}]
        return summarize(records, 1.0)

    late, early = seed([0.5, 0.5, 0.6, 0.9], 0.44), seed([0.5, 0.9, 0.95, 0.96], 0.55)
    summary = report(Args(policies="tail_keep_first,sync", seeds="0,1,2"),
                     {"tail_keep_first": [early, early, late], "sync": [seed([0.5, 0.75, 0.9, 0.94], 0.53)] * 3})
    assert "parity_sync" not in summary and summary["parity_tail_keep_first"]  # the means pass
    assert summary["parity_seeds_tail_keep_first"] == 2  # the late seed does not
    assert "tool-call rate +0.017 below (at most 0.05): yes (on 2 of 3 seeds alone)" in capsys.readouterr().out
    assert "parity_tail" not in report(Args(policies="tail", seeds="0"), {"tail": [early]})  # no sync: no gaps
