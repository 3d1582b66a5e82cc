"""SortedRL (``sorted``, ``sorted_partial``) on scripted completion orders, with the ledger checked after
every event, and through the real controller; importance weights by hand; a resume across a weight
change on the real toy model; and two epochs on 2 gloo ranks."""

from __future__ import annotations

import pytest

# --- load groups and early termination ----------------------------------------------------------


# --- staleness and the ledger -------------------------------------------------------------------


# --- config -------------------------------------------------------------------------------------


# --- importance sampling ------------------------------------------------------------------------


# --- resume across a weight change, on the real toy model ----------------------------------------


# --- for real: 2 gloo ranks ---------------------------------------------------------------------


@pytest.mark.parametrize("policy", [pytest.param("sorted", marks=pytest.mark.slow), "sorted_partial"])  # partial: more
def test_two_rank_runs_train_every_prompt_once_per_epoch(policy, tmp_path):
    from support.jobs import finish, steps, trained
    from support.jobs import start_job as launch  # the tail job's flags; later flags win

    num_rows = 16  # two load groups of 2 x 4 prompts per epoch
    extra = [f"schedule:{policy}", "--schedule.sorted-batches", "2", "--data.num-toy-prompts", str(num_rows)]
    if policy == "sorted_partial":
        extra += ["--train.rollout-correction", "token_tis"]
    finish(launch(tmp_path, *extra))
    assert trained(tmp_path) == {0: list(range(num_rows)), 1: list(range(num_rows))}
    records = list(steps(tmp_path).values())
    assert {r["sched/round_kind"] for r in records} == {"sorted"}
    assert sum(r["sched/trained_prompts"] for r in records) == 2 * num_rows
    assert all(r["sched/trained_prompts"] == 4 for r in records) and any(r["sched/deferred"] for r in records)
    assert all(len(r["rollout/response_lengths"]) == 2 * r["sched/trained_prompts"] for r in records)
    stale = [r["sched/staleness_max"] for r in records]
    if policy == "sorted":
        assert max(stale) == 0 and not any(r["sched/resumed"] for r in records)
    else:  # (the toy's responses to one prompt have near-equal lengths: kept finished ones are tested above)
        assert max(stale) >= 1 and any(r["sched/resumed"] for r in records)
        assert all(0.5 < r["train/rollout_is_ratio_mean"] < 2 for r in records)
