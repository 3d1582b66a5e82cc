"""RolloutPipe (``schedule.pipe``): complete-group pipelining on scripted completion orders, the
engine's frontier-first admission, the composition rules, and real 2-rank runs (1 rollout rank,
1 train rank): the train pool never rolls out, every step streams groups, the losses are the plain
sync run's, and tail+pipe trains every prompt exactly once per epoch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from support.fakes import single_turn_runner

from rollpacker.config import Config, parse
from rollpacker.data.dataset import PromptSampler
from rollpacker.jobflags import policy_args
from rollpacker.plan.config import PlanConfig
from rollpacker.schedule.base import Group, RoundPlan
from rollpacker.schedule.round import Round, RoundState
from rollpacker.schedule.scale_down import PipeRound, ScaleDownDecider, StreamConfig
from rollpacker.schedule.sync import SyncConfig, SyncPolicy
from rollpacker.schedule.tail import TailConfig
from rollpacker.train.config import TrainConfig


class FakeSink:
    """Where the pipe round sends groups (their slots): ``ready`` when the train pool has trained the last batch."""

    def __init__(self):
        self.busy, self.batches = False, []

    def ready(self) -> bool:
        return not self.busy

    def send(self, groups) -> None:
        if groups:  # the exchange sends only what the round feeds
            self.batches.append([g.prompt for g in groups])  # one "sample" per group, its slot
            self.busy = True


def group(slot: int) -> Group:
    return Group(prompt=slot, outputs=[SimpleNamespace(id=f"{slot}:{k}") for k in range(2)], rewards=[])


def test_complete_groups_go_fifo_as_soon_as_the_train_pool_is_free():
    """Scripted: groups complete in the order 2, 0, 1, 3; group 0's second response is scored late."""
    stream = FakeSink()
    state = RoundState(0, RoundPlan("sync", [], 2, keep=4), SyncPolicy(PromptSampler(4), 4, 2), num_replicas=1)
    pipe = PipeRound(ScaleDownDecider(StreamConfig(), num_replicas=1, kv_capacity_tokens=1, max_new_tokens=1))
    pipe.begin(state)
    rnd = Round(state, None, single_turn_runner(), pipe)
    complete, scores = state.complete, state.scores
    groups = {s: group(s) for s in range(4)}

    def completes(slot: int, scored: bool = True) -> None:
        complete.append(groups[slot])
        scores.update({o.id: 1.0 for o in groups[slot].outputs[:2 if scored else 1]})
        stream.send(rnd.feed(stream.ready()))
        assert pipe.fetching  # fetching goes on all round

    completes(2)  # the train pool is idle: group 2 goes at once, alone
    assert stream.batches == [[2]] and groups[2].streamed and groups[2].rewards == [1.0, 1.0]
    completes(0, scored=False)
    completes(1)  # the train pool is busy: both wait, in completion order
    assert stream.batches == [[2]] and complete == [groups[0], groups[1]]
    stream.busy = False  # it has trained group 2: everything complete and scored goes, FIFO
    completes(3)
    assert stream.batches == [[2], [1, 3]] and complete == [groups[0]]  # group 0 is not scored yet
    scores["0:1"] = 0.0
    stream.busy = False
    stream.send(rnd.feed(stream.ready()))
    assert stream.batches == [[2], [1, 3], [0]] and not complete and groups[0].rewards == [1.0, 0.0]


def test_engine_admits_the_best_priority_first():
    import torch

    from rollpacker.model import load_model
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.engine import Request, SamplingParams
    from rollpacker.rollout.torch_engine import TorchEngine
    from rollpacker.toy.model import toy_model_dir

    engine = TorchEngine(load_model(toy_model_dir(), torch.device("cpu"), torch.float32),
                         EngineConfig(kv_memory_mb=1, block_size=4, max_num_seqs=1), None)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    for rid, priority in (("late-group", 5), ("frontier", 1), ("late-group-2", 5), ("frontier-2", 1)):
        engine.add(Request(id=rid, prompt_ids=[5, 6, 7], params=params, priority=priority))
    order = []
    while engine.has_unfinished():
        order += [o.id for o in engine.step()]
    assert order == ["frontier", "frontier-2", "late-group", "late-group-2"]  # FIFO among equals


@pytest.mark.parametrize("kwargs,match", [
    ({"stream": StreamConfig(enabled=True)}, "stream.enabled"),
    ({"plan": PlanConfig(enabled=True)}, "plan.enabled"),
    ({"train": TrainConfig(advantage="reinforce_pp")}, "schedule.pipe with train.advantage='reinforce_pp'"),
])
def test_pipe_composition_is_explicit(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Config(schedule=SyncConfig(pipe=True), **kwargs)
    assert Config(schedule=SyncConfig(pipe=True)).pipe and Config(schedule=TailConfig(pipe=True)).pipe


@pytest.mark.parametrize("policy", ["sorted", "sorted_partial", "one_step_off"])
def test_pipe_is_a_setting_of_sync_and_tail_alone(policy, capsys):
    with pytest.raises(SystemExit, match=rf"schedule.pipe does not apply to policy {policy} \(it is a setting "
                                         r"of sync, tail\)"):
        parse([f"schedule:{policy}", "--schedule.pipe", "--train.rollout-correction", "token_tis"])


def test_bench_names():
    assert policy_args("pipe") == ["schedule:sync", "--schedule.pipe"]
    assert policy_args("tail+pipe") == ["schedule:tail", "--schedule.pipe"]
