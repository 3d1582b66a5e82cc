"""Run on 4 gloo ranks by tests/dist/test_exchange.py: a tail round over two TP-2 TorchEngine replicas,
through the real exchange. Each rank is sent its replica's requests and aborts only (its TP peer the same),
the reports come back without prompts and leave the round with them, and every response equals the one
TorchEngine generates for its request alone."""

import sys

from support.fakes import InstantRewards

from rollpacker.data.dataset import PromptSampler
from rollpacker.data.lengths import LengthReplay
from rollpacker.dist import build_meshes, exit_process
from rollpacker.exchange import RoundLeader, run_round
from rollpacker.model import load_model
from rollpacker.rollout.config import EngineConfig
from rollpacker.rollout.engine import Request, SamplingParams, generate
from rollpacker.rollout.torch_engine import TorchEngine
from rollpacker.schedule.tail import TailPolicy


class Recorded(TorchEngine):
    """TorchEngine, keeping what this rank was asked to add and abort."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.added, self.aborted = [], []

    def add(self, request):
        self.added.append(request.id)
        super().add(request)

    def abort(self, request_id):
        self.aborted.append(request_id)
        return super().abort(request_id)


def prompt(row: int) -> list[int]:
    return list(range(1, 4 + 3 * row))


def main(path: str) -> None:
    meshes = build_meshes(rollout_tp=2)
    assert meshes.num_replicas == 2 and meshes.replicas() == [0, 0, 1, 1]
    engine = Recorded(load_model(path), EngineConfig(block_size=4), tp_mesh=meshes.rollout_tp)
    sampling = SamplingParams(max_new_tokens=64, temperature=1.0)
    policy = TailPolicy(PromptSampler(8, seed=0), 2, 2)  # races 3 prompts x 3 responses, keeps 2 x 2
    # lengths forced (long-tailed, seeded by request): the round cuts what finishes late
    rewards = InstantRewards(lambda row, key: 1.0)
    leader = None if meshes.rank else RoundLeader(policy=policy, rows=list(range(8)), encode=prompt, sampling=sampling,
                                                  rewards=rewards, lengths=LengthReplay(0, 64))
    sent, prompts_back = [], []  # the pairs this rank was sent; the prompt tokens the reports carried back
    scatter, gather = meshes.scatter, meshes.gather

    def scattered(objs, group):
        cmd = scatter(objs, group)
        sent.extend(cmd.add + cmd.abort)
        return cmd

    def gathered(obj, group):
        reports = gather(obj, group)
        outputs = [o for r in reports or [] if r for o in (*r.finished, *r.aborted)]
        prompts_back.append(sum(len(o.prompt_ids) for o in outputs))
        return reports

    meshes.scatter, meshes.gather = scattered, gathered
    rnd = leader.round(0, policy.start_round(0)) if leader else None
    result = run_round(meshes, engine, 2, rnd)
    meshes.scatter, meshes.gather = scatter, gather
    assert {replica for replica, _ in sent} == {meshes.replica}, sent  # no other replica's request or abort
    assert len(sent) == len(engine.added) + len(engine.aborted), (sent, engine.added, engine.aborted)
    seen = meshes.gather((engine.added, engine.aborted))
    if meshes.rank:
        return
    assert sum(prompts_back) == 0, prompts_back
    (added0, aborted0), (peer0, peer_aborted0), (added1, aborted1), (peer1, peer_aborted1) = seen
    assert (added0, aborted0) == (peer0, peer_aborted0) and (added1, aborted1) == (peer1, peer_aborted1), seen
    assert added0 and added1 and not set(added0) & set(added1), seen
    assert set(aborted0) <= set(added0) and set(aborted1) <= set(added1), seen
    assert result.num_aborted and len(added0) + len(added1) == result.num_launched, (result.num_launched, seen)
    # alone, on a TP-1 engine: the same tokens from each request (seeded), so each rank got whole requests
    alone = TorchEngine(load_model(path), EngineConfig(block_size=4))
    outputs = {o.id: o for g in result.groups for o in g.outputs}
    assert len(outputs) == 4, outputs
    for group in result.groups:
        assert all(o.prompt_ids == prompt(group.prompt) for o in group.outputs), group
    want = generate(alone, [Request(id=k, prompt_ids=prompt(rnd.round.state.row(k)), params=rnd.requests[k][0].params)
                            for k in outputs])
    assert {k: o.token_ids for k, o in want.items()} == {k: o.token_ids for k, o in outputs.items()}
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)
