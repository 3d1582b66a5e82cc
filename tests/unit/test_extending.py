"""The example policy of docs/extending.md (``fifo``): its settings compose by capability, the page's
command names it out of tree, and it runs through the round the controller and the simulator
share, on the paper's length tail."""

from __future__ import annotations

from collections import Counter

import pytest
from support.docs import example_code, example_command, example_policy

from rollpacker.config import Config
from rollpacker.rollout.config import RolloutConfig
from rollpacker.sim.simulate import SimConfig, build_replicas, simulate_round
from rollpacker.train.config import TrainConfig

P0, R0 = 8, 4


def test_the_example_composes_by_its_capabilities():
    fifo = example_policy()
    config = Config(schedule=fifo.FifoConfig(keep_share=0.5), train=TrainConfig(skip=True))  # on-policy, no pools
    assert config.policy == "fifo" and config.rollout_ranks(4) == 4 and not config.pipe
    with pytest.raises(ValueError, match=r"schedule.keep_share must be in \(0, 1\], got 0"):
        fifo.FifoConfig(keep_share=0)
    with pytest.raises(ValueError, match=r"schedule.max_gen_batches=-1"):  # the settings every policy has, checked
        fifo.FifoConfig(max_gen_batches=-1)


@pytest.fixture
def registry():
    """The policy registry as it was, restored after the test (an out-of-tree policy registers itself)."""
    from rollpacker.schedule import config as policies

    before = dict(policies.POLICY_CONFIGS), policies.ScheduleConfig
    yield policies
    policies.POLICY_CONFIGS.clear()
    policies.POLICY_CONFIGS.update(before[0])
    policies.ScheduleConfig = before[1]


def test_the_pages_command_runs_the_example_out_of_tree(tmp_path, monkeypatch, registry):
    """``--schedule.policy fifo.py:FifoConfig`` (the page's command, run where fifo.py is) registers
    the file's class as schedule:fifo, with its own settings and the usual checks."""
    from rollpacker.config import parse

    (tmp_path / "fifo.py").write_text(example_code())
    monkeypatch.chdir(tmp_path)
    config = parse(example_command())
    assert config.policy == "fifo" and config.schedule.keep_share == 0.5 and "fifo" in registry.POLICY_CONFIGS
    assert type(config.schedule).__module__.startswith("rollpacker_policy_fifo_")  # its path's hash after
    assert parse(["schedule:fifo"]).policy == "fifo"  # registered: a subcommand like the shipped ones
    with pytest.raises(SystemExit, match=r"schedule.eta_prompts does not apply to policy fifo"):
        parse([*example_command(), "--schedule.eta-prompts", "2"])
    with pytest.raises(SystemExit, match=r"schedule.policy: cannot import nowhere: ModuleNotFoundError"):
        parse(["--schedule.policy", "nowhere:FifoConfig"])
    with pytest.raises(SystemExit, match=r"schedule.policy: rollpacker.config:Config is not a PolicyConfig"):
        parse(["--schedule.policy", "rollpacker.config:Config"])
    with pytest.raises(SystemExit, match=r"named 'sync', as rollpacker.schedule.sync.SyncConfig"):
        (tmp_path / "clash.py").write_text(example_code().replace('name: ClassVar[str] = "fifo"',
                                                                   'name: ClassVar[str] = "sync"'))
        parse(["--schedule.policy", "clash.py:FifoConfig"])


def test_the_example_cuts_rounds_defers_the_rest_and_keeps_the_ledger():
    """Rounds through the simulator's replicas: each trains keep_share x P0 fresh groups, the cut
    prompts go first next round and are generated afresh, and every prompt is accounted for."""
    fifo = example_policy()
    cfg = SimConfig(model="qwen2.5-7b", gpus=1, num_rows=40, num_steps=6, schedule=fifo.FifoConfig(keep_share=0.5),
                    rollout=RolloutConfig(num_prompts=P0, group_size=R0, max_new_tokens=2048, tp=1))
    policy, lengths = cfg.build_policy(), cfg.workload()
    trained, deferred = Counter(), []
    for step in range(cfg.num_steps):
        record = simulate_round(step, policy, build_replicas(cfg.cost(), 1), lengths, max_new_tokens=2048)
        assert record.kind == "fifo" and len(record.groups) == P0 // 2
        assert record.num_launched == P0 * R0 and record.aborted  # the cut prompts' requests were aborted
        for group in record.groups:
            assert len(group.outputs) == R0
            assert all(out.id.startswith(f"{step}:") for out in group.outputs)  # generated this round
            trained[group.epoch, group.prompt] += 1
        queue = list(policy.ledger.queue)
        assert len(queue) == P0 - len(record.groups)
        if deferred:  # last round's cut prompts went first
            assert policy.keys[:len(deferred)] == deferred
        deferred = queue
        policy.ledger.check(policy.sampler)
    assert max(trained.values()) == 1 and len(trained) == cfg.num_steps * P0 // 2
    assert policy.stats() == {"sched/deferred": P0 // 2, "sched/queue_len": P0 // 2}


@pytest.mark.parametrize("bug, said", [
    ("end_round_twice", "end_round returned 4 group\\(s\\) twice, which would train twice"),
    ("end_round_dict", "end_round returned dict, not a list of Group"),
    ("on_finished_none", "on_finished returned NoneType, not a PolicyDecision"),
])
def test_a_policy_that_returns_what_the_contract_does_not_is_told_where(bug, said):
    """A policy returning its groups twice trained them twice, unsaid; one returning another type died in the
    round's code, naming neither the policy nor the contract."""
    from rollpacker.errors import UserError

    fifo = example_policy()

    class Buggy(fifo.FifoPolicy):
        def on_finished(self, *args):
            decision = super().on_finished(*args)
            return None if bug == "on_finished_none" else decision

        def end_round(self, aborted):
            groups = super().end_round(aborted)
            if bug == "end_round_twice":
                return groups + groups
            return dict(enumerate(groups)) if bug == "end_round_dict" else groups

    cfg = SimConfig(model="qwen2.5-7b", gpus=1, num_rows=40, num_steps=1, schedule=fifo.FifoConfig(keep_share=0.5),
                    rollout=RolloutConfig(num_prompts=P0, group_size=R0, max_new_tokens=2048, tp=1))
    policy = cfg.build_policy()
    policy.__class__ = Buggy
    with pytest.raises(UserError, match=f"policy fifo: {said}"):
        simulate_round(0, policy, build_replicas(cfg.cost(), 1), cfg.workload(), max_new_tokens=2048)


def test_the_example_filters_groups_of_one_reward():
    """With schedule.filter_zero_variance the example's zero_variance call took the rewards alone (a TypeError)."""
    from types import SimpleNamespace

    from rollpacker.data.dataset import PromptSampler

    fifo = example_policy()
    policy = fifo.FifoConfig(keep_share=0.5, filter_zero_variance=True).build(PromptSampler(8, 0), 2, 2)
    policy.start_round(0)
    outputs = [SimpleNamespace(id=f"0:0:{k}", finish_reason="stop") for k in range(2)]
    assert policy.on_finished(0, 0, outputs[0], 1.0).filtered == []
    decision = policy.on_finished(0, 1, outputs[1], 1.0)
    assert decision.filtered == [policy.groups[0]] and decision.complete == []
