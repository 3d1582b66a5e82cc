"""The trainer and the RL loop on real gloo ranks."""

from __future__ import annotations

import pytest
import torch


def test_nonfinite_loss_skips_the_step(toy_random_dir):
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Sample, Trainer

    meshes = build_meshes(1, 0)
    trainer = Trainer(load_model(toy_random_dir), TrainConfig(lr=1e-2), meshes.train, num_steps=2)
    before = {k: v.full_tensor().clone() for k, v in trainer.model.state_dict().items()}
    stats = trainer.step([Sample([5, 6, 7], [8, 9], float("nan"), [-1.0, -1.0])])
    assert stats["train/skipped"] == 1.0
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k].full_tensor()) for k in before)
    stats = trainer.step([Sample([5, 6, 7], [8, 9], 1.0, [-1.0, -1.0])])
    assert stats["train/skipped"] == 0.0
    assert not torch.equal(before["norm.weight"], trainer.model.state_dict()["norm.weight"].full_tensor())


def test_lr_warms_up_then_decays_by_cosine_to_its_floor_at_the_last_step():
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import lr_factor

    cosine = TrainConfig(warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1)
    assert [lr_factor(s, cosine, num_steps=6) for s in range(7)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.775, 0.325, 0.1, 0.1])  # 0.1 + 0.9 * (1 + cos(pi * k / 3)) / 2 after the warm-up
    constant = TrainConfig(warmup_steps=2, lr_schedule="constant")
    assert [lr_factor(s, constant, num_steps=6) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(0, TrainConfig(warmup_steps=0), num_steps=1) == 1.0
