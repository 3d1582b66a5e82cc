"""Episodes' step infos summed per episode and turned into metrics (env/info/..., eval/[SOURCE/]info/...), and
their plot."""

from __future__ import annotations

import json

from rollpacker import report
from rollpacker.env.contract import StepResult
from rollpacker.env.episode import Episode, Response
from rollpacker.env.info import TOOL_INFO, info_metrics, selection_metrics
from rollpacker.schedule.base import Group
from tests.unit.env.test_episode import Letters, turn


def test_an_episode_sums_the_numbers_of_its_step_infos():
    e = Episode("0:0:0", [2, 3], Letters(), seed=0, max_turns=4, max_tokens=100, max_new_tokens=10, max_context=200,
                info_keys=TOOL_INFO)
    assert e.output().info == {"tool_calls": 0.0, "tool_errors": 0.0}
    e.on_turn(turn("a"), [-1.0], "stop")
    e.on_step(StepResult([{"role": "tool", "content": "error: x"}], info={"tool_calls": 2, "tool_errors": 1,
                                                                          "name": "calc", "ok": True}))
    e.on_turn(turn("b"), [-1.0], "stop")
    e.on_step(StepResult([{"role": "tool", "content": "4"}], info={"tool_calls": 1, "tool_errors": 0,
                                                                   "nan": float("nan")}))
    assert e.output().info == {"tool_calls": 3.0, "tool_errors": 1.0, "ok": 1.0}  # strings and NaN are not counted


def test_info_metrics_per_episode_share_and_per_source():
    outputs = [Response(id=str(i), prompt_ids=[1], info=info) for i, info in enumerate(
        [{"tool_calls": 2.0, "tool_errors": 1.0}, {"tool_calls": 0.0, "tool_errors": 0.0}, {"tool_calls": 1.0},
         {"tool_calls": 0.0, "tool_errors": 0.0}])]
    assert info_metrics(outputs, "env/") == {"env/info/tool_calls": 0.75, "env/info/tool_calls_frac": 0.5,
                                             "env/info/tool_errors": 0.25, "env/info/tool_errors_frac": 0.25}
    by_source = info_metrics(outputs, "eval/", ["hard", "easy", "hard", None])
    assert by_source["eval/hard/info/tool_calls"] == 1.5 and by_source["eval/hard/info/tool_errors_frac"] == 0.5
    assert by_source["eval/easy/info/tool_calls_frac"] == 0.0 and by_source["eval/info/tool_calls_frac"] == 0.5
    single = [Response(id=str(i), prompt_ids=[1]) for i in range(2)]
    assert info_metrics(single, "env/") == {}  # single-turn responses: no environment, no info


def test_report_plots_what_the_environments_counted(tmp_path, capsys):
    rows = [{"step": s, "env/info/tool_calls_frac": 0.2 + 0.01 * s, "env/info/tool_errors": 0.05,
             **({"eval/hard/info/tool_calls_frac": s / 60} if s % 10 == 0 else {})} for s in range(60)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report.main([str(tmp_path)]) == 0
    assert (tmp_path / "plots" / "env_info.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(tmp_path / "plots" / "env_info.png") in capsys.readouterr().out.split()


def test_selection_metrics_set_the_kept_episodes_beside_the_cut_ones_of_the_same_groups():
    """Group 4:0 kept two quick episodes and cut a slow one; group 4:1 cut none (left out of the kept side);
    a cut episode of a group not trained (deferred whole) is left out of both."""
    def ep(rid, turns, tools, seconds, tokens):
        return Response(id=rid, prompt_ids=[1], token_ids=[5] * tokens, loss_mask=[True] * tokens, num_turns=turns,
                        info={"tool_calls": tools}, env_seconds=seconds)

    groups = [Group(0, [ep("4:0:0", 1, 0.0, 0.5, 10), ep("4:0:2", 1, 0.0, 1.5, 20)], [1.0, 0.0]),
              Group(1, [ep("4:1:0", 3, 2.0, 9.0, 90)], [1.0])]
    cut = [ep("4:0:1", 2, 1.0, 6.0, 40), ep("4:2:0", 5, 4.0, 20.0, 99)]
    assert selection_metrics(groups, cut) == {
        "sched/cut_episodes": 1.0,
        "sched/kept/turns": 1.0, "sched/kept/model_tokens": 15.0, "sched/kept/tool_calls": 0.0,
        "sched/kept/env_seconds": 1.0,
        "sched/cut/turns": 2.0, "sched/cut/model_tokens": 40.0, "sched/cut/tool_calls": 1.0,
        "sched/cut/env_seconds": 6.0}
    assert selection_metrics(groups, cut[1:]) == {"sched/cut_episodes": 0.0}
