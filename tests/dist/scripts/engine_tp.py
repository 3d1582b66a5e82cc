"""Run on 2 gloo ranks by tests/dist/rollout/test_engine.py: TP=2 engines against TP=1 (speculation off, on
and auto; auto's back-off decided by TP rank 0), and FSDP2 weight push."""

import sys

import torch
import torch.distributed as dist
from support.fakes import StepClock
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from rollpacker.dist import exit_process
from rollpacker.model import load_model
from rollpacker.rollout.config import EngineConfig
from rollpacker.rollout.engine import DraftContext, Request, SamplingParams, generate
from rollpacker.rollout.spec_cost import SpecCost
from rollpacker.rollout.torch_engine import TorchEngine


def requests(context=None):
    """Six requests; with ``context`` (id -> tokens) each is offered those tokens as an earlier epoch's."""
    return [
        Request(id=str(i), prompt_ids=list(range(1, 3 + 7 * i)), params=SamplingParams(
            max_new_tokens=20 + 5 * i, temperature=0 if i % 2 else 0.8, top_p=0.9, seed=i, ignore_eos=True),
            draft_context=(DraftContext(source="epoch", token_ids=context[str(i)]),) if context else ())
        for i in range(6)
    ]


def tokens(outs):
    return {k: o.token_ids for k, o in outs.items()}


def main(path: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    config = EngineConfig(block_size=4)
    single = generate(TorchEngine(load_model(path), config), requests())
    tp = TorchEngine(load_model(path), config, tp_mesh=mesh)
    sharded = generate(tp, requests())
    assert tokens(single) == tokens(sharded), "TP=2 differs from TP=1"
    for k in single:
        assert max(abs(a - b) for a, b in zip(single[k].logprobs, sharded[k].logprobs)) < 1e-4

    # Speculation under TP: every rank drafts from the same (broadcast) tokens and decides by TP rank
    # 0's cost table, so the verify forwards line up; tokens are TP=1's, drafts from the context accepted.
    context = {k: tuple(o.token_ids) for k, o in single.items()}
    for speculative, extra in (("on", {}), ("auto", {"max_num_seqs": 4, "spec_max_tokens": 2})):
        spec = TorchEngine(load_model(path), EngineConfig(block_size=4, speculative=speculative, **extra), tp_mesh=mesh)
        out = generate(spec, requests(context))
        assert tokens(out) == tokens(single), f"TP=2 speculative={speculative} differs from TP=1"
        for k in single:
            assert max(abs(a - b) for a, b in zip(single[k].logprobs, out[k].logprobs)) < 1e-4
        stats = spec.stats().spec
        if speculative == "on":
            assert stats.num_accepted_tokens["epoch"] > 0, stats
        else:
            costs = [None, None]
            dist.all_gather_object(costs, spec.spec_cost)
            assert costs[0] == costs[1], "the TP ranks decide by different cost tables"

    # auto's realized payoff is TP rank 0's: rank 0's clock finds a verify step 20x a plain one, rank 1's
    # as cheap; both ranks back off together (else their forwards would not line up), tokens unchanged.
    clock = StepClock(20.0 if dist.get_rank() == 0 else 1.0)
    cheap = SpecCost((1, 4, 8), (0, 1, 2, 4), ((1, 1.1, 1.2, 1.4), (1.2, 1.3, 1.4, 1.6), (2, 5, 8, 14)))
    auto = TorchEngine(load_model(path), EngineConfig(block_size=4, speculative="auto", max_num_seqs=4),
                       tp_mesh=mesh, spec_cost=cheap, clock=clock)
    clock.engine = auto
    assert tokens(generate(auto, requests(context))) == tokens(single), "TP=2 auto with back-off differs from TP=1"
    assert auto.realized.num_backoffs >= 1, auto.realized.num_backoffs

    # Push weights from a live FSDP2-sharded copy (perturbed) into the TP engine and a TP=1 engine.
    trainer = load_model(path)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(1.5)
    for block in trainer.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(trainer, mesh=mesh)
    tp.update_weights(trainer.named_parameters())
    plain = TorchEngine(load_model(path), config)
    plain.update_weights(trainer.named_parameters())
    pushed_tp, pushed_plain = generate(tp, requests()), generate(plain, requests())
    assert tokens(pushed_tp) == tokens(pushed_plain), "FSDP2 -> TP push differs from FSDP2 -> TP=1 push"
    assert tokens(pushed_plain) != tokens(single), "the pushed weights had no effect"
    print("OK", dist.get_rank(), flush=True)
    exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1])
