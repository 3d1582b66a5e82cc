"""Run on 2 and 4 gloo ranks by tests/dist/schedule/test_stream.py: stream-trained steps equal synchronous ones,
for each aggregation mode given (comma-separated).

Two trainers start from the same weights. The synchronous one takes ``Trainer.step`` on each
step's whole batch. For the stream one, rank 0 feeds some groups' samples, in several messages,
through ``StreamTrainer`` to the freed ranks (the second half), which accumulate their gradients
while rank 0 goes on; then every rank joins one ``Trainer.step`` on the rest with the global
normalizer. After each step the weights must agree (max relative error <= 1e-5, fp32).

AdamW's first steps divide each gradient by its own magnitude, which turns rounding noise in
gradients that are zero in exact arithmetic (the k_proj biases: softmax ignores a shift of every
score) into full-size updates of either sign. ``adam_eps=1`` keeps the update linear in the
gradient, so the comparison measures the gradients, which is what streaming changes.
"""

import sys

import torch

from rollpacker.dist import build_meshes, exit_process
from rollpacker.model import load_model
from rollpacker.schedule.scale_down import StreamConfig
from rollpacker.train.config import TrainConfig
from rollpacker.train.losses import normalizer
from rollpacker.train.stream import StreamTrainer
from rollpacker.train.trainer import Sample, Trainer


def groups(seed: int, num: int = 8, size: int = 3) -> list[list[Sample]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(num):
        prompt = torch.randint(0, 90, (int(torch.randint(3, 12, (), generator=g)),), generator=g).tolist()
        group = []
        for _ in range(size):
            n = int(torch.randint(1, 40, (), generator=g))
            group.append(Sample(prompt, torch.randint(0, 90, (n,), generator=g).tolist(),
                                float(torch.rand((), generator=g)), [-1.0] * n, group=k))
        out.append(group)
    return out


def main(path: str, shard: int, aggregations: str) -> None:
    meshes = build_meshes(rollout_tp=1, train_shard_size=shard, stream=True)
    for aggregation in aggregations.split(","):
        check(path, meshes, aggregation)
    print("OK")
    exit_process(0)


def check(path: str, meshes, aggregation: str) -> None:
    # several micro-batches per rank
    cfg = TrainConfig(lr=1.0, warmup_steps=0, adam_eps=1.0, micro_batch_tokens=64, aggregation=aggregation)
    sync = Trainer(load_model(path), cfg, meshes.train, num_steps=4)
    streamed = Trainer(load_model(path), cfg, meshes.train, num_steps=4)
    stream = StreamTrainer(StreamConfig(enabled=True), streamed, meshes, kv_capacity_tokens=1, max_new_tokens=1)
    assert not stream.refused, stream.refused
    # (groups streamed, in how many messages) per step: uneven, nothing, almost everything, everything.
    plans = [(3, 2), (0, 0), (7, 3), (8, 1)]
    initial = {k: v.full_tensor().clone() for k, v in sync.model.state_dict().items()}
    for step, (num_streamed, num_messages) in enumerate(plans):
        batch = groups(step)
        every = [s for g in batch for s in g]
        count = normalizer(aggregation, [len(s.response_ids) for s in every], 40)
        sync_stats = sync.step(every, count)
        stream.await_sends()
        if stream.freed:
            stream.serve()
        elif meshes.rank == 0:
            for i in range(num_messages):  # the first num_streamed groups, dealt over the messages
                stream.feed([s for g in batch[:num_streamed][i::num_messages] for s in g])
            stream.close()
        rest = [s for g in batch[num_streamed:] for s in g]
        stream_stats = streamed.step(rest, count)
        worst = 0.0
        for (name, a), (_, b) in zip(sync.model.state_dict().items(), streamed.model.state_dict().items()):
            a, b = a.full_tensor(), b.full_tensor()
            worst = max(worst, ((a - b).abs().max() / a.abs().max().clamp(min=1e-12)).item())
        assert worst <= 1e-5, (aggregation, step, worst)
        loss = sync_stats["train/loss"]
        assert abs(loss - stream_stats["train/loss"]) <= 1e-5 * max(1.0, abs(loss))
        moved = max((v.full_tensor() - initial[k]).abs().max().item() for k, v in sync.model.state_dict().items())
        assert moved > 1e-3, moved  # the steps change the weights by far more than the tolerance
        print(f"rank {meshes.rank} {aggregation} step {step}: streamed {num_streamed} groups, max rel err {worst:.2e}",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
