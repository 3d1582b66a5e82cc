"""Run on 2 gloo ranks by tests/dist/train/test_lora.py: LoRA sharded with FSDP2 over both ranks, for the
native decoder and a Hugging Face one (argv: the model directory).

At initialization the merged weights equal the base; after two steps only adapters changed; the
adapters export (gathered from both ranks) as a PEFT directory that ``peft`` loads on the base with
the trained model's logits, and the merged weights export as a Hugging Face model with them too. The export
(``Job.export``) replaces what an earlier one left in its directories, and copies no weights of the model
directory (a ``pytorch_model.bin`` of the base would load in place of the trained weights).
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from rollpacker.config import Config
from rollpacker.dist import build_meshes, exit_process
from rollpacker.job import Job
from rollpacker.model import CausalAttention, load_model, lora
from rollpacker.model.config import LoraConfig
from rollpacker.model.hf_decoder import load_hf
from rollpacker.train.config import TrainConfig
from rollpacker.train.trainer import Sample, Trainer

PROMPT = [3, 9, 4, 17, 22, 5]


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def logits(model, tokens: list[int]) -> torch.Tensor:
    t = torch.tensor(tokens)
    with torch.no_grad():
        return model(t, torch.arange(len(t)), CausalAttention([len(t)]), head=lambda h, w: (h @ w.T).float())


def check(meshes, path: Path, impl: str, out: Path) -> None:
    import peft
    import transformers

    cfg = TrainConfig(lr=5e-2, warmup_steps=0, micro_batch_tokens=16,
                      lora=LoraConfig(rank=4, alpha=8, export_merged=True))
    torch.manual_seed(0)
    trainer = Trainer(load_model(path) if impl == "native" else load_hf(path), cfg, meshes.train, num_steps=4)
    base = dict(load_model(path).named_parameters()) if impl == "native" else None
    merged = {n: full(p) for n, p in lora.merged_weights(trainer.model)}
    assert base is None or all(torch.equal(merged[n], base[n]) for n in base), "merged != base at init"
    before = {n: full(p) for n, p in trainer.model.named_parameters()}
    samples = [Sample(PROMPT, [8, 30, 2, 11], 1.0, [-1.0] * 4, group=0), Sample(PROMPT, [40, 6, 6], 0.0, [-1.0] * 3),
               Sample(PROMPT, [12, 7], 0.5, [-1.0] * 2), Sample(PROMPT, [1, 2, 3, 4, 5], 0.0, [-1.0] * 5)]
    for _ in range(2):
        trainer.step(samples, 14)
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], full(p))}
    assert changed and all(lora.is_adapter(n) for n in changed), sorted(changed)[:5]
    assert not trainer.model.training  # the trainer's forwards run without dropout, as the model is served
    mine = logits(trainer.model, PROMPT)
    rank0 = dist.get_rank() == 0
    base_dir, adapter = out / f"{impl}-base", out / f"{impl}-adapter"
    if rank0:  # the base's directory with a stale .bin, and the export's with an earlier full model's weights
        shutil.copytree(path, base_dir)
        (base_dir / "pytorch_model.bin").write_bytes(b"the base, in an older format")
        adapter.mkdir()
        (adapter / "model.safetensors").write_bytes(b"an earlier run's full model")
    dist.barrier()
    Job(config=Config(train=cfg), meshes=meshes, model_dir=base_dir, engine=None, trainer=trainer).export(adapter)
    if rank0:
        for exported in (adapter, out / f"{impl}-adapter_merged"):
            names = set(os.listdir(exported))
            assert "pytorch_model.bin" not in names and "generation_config.json" in names, sorted(names)
        assert "model.safetensors" not in os.listdir(adapter), sorted(os.listdir(adapter))
        hf = transformers.AutoModelForCausalLM.from_pretrained(path)
        adapted = peft.PeftModel.from_pretrained(hf, out / f"{impl}-adapter").eval()
        merged_hf = transformers.AutoModelForCausalLM.from_pretrained(out / f"{impl}-adapter_merged").eval()
        with torch.no_grad():
            for what, model in (("peft", adapted), ("merged", merged_hf)):
                theirs = model(torch.tensor([PROMPT])).logits[0]
                diff = float((theirs - mine).abs().max())
                assert diff < 1e-5, f"{impl}: {what} logits differ from the trained model's by {diff}"
            plain = transformers.AutoModelForCausalLM.from_pretrained(path)(torch.tensor([PROMPT])).logits[0]
        assert float((plain - mine).abs().max()) > 1e-3, "the adapters changed nothing"
    dist.barrier()
    print(f"OK {impl}", flush=True)  # one write: the two ranks share a pipe


if __name__ == "__main__":
    meshes = build_meshes(1, 0)
    with tempfile.TemporaryDirectory() as tmp:
        box = [tmp]
        dist.broadcast_object_list(box, src=0)  # rank 0's directory: it writes, then reads back
        for impl in ("native", "hf"):
            check(meshes, Path(sys.argv[1]), impl, Path(box[0]))
    exit_process(0)
