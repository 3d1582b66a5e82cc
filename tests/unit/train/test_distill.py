"""On-policy distillation (train.teacher) on a real one-rank FSDP2 trainer: the teacher's per-token
reverse KL as token rewards, written out by hand, and no signal when the student is its teacher."""

from __future__ import annotations

import json

import pytest
import torch

from rollpacker.model import CausalAttention

PROMPT = [3, 9, 4, 17, 22, 5]


def samples() -> list:
    from rollpacker.train.trainer import Sample

    return [Sample(PROMPT, [8, 30, 2, 11], 1.0, [-1.0] * 4), Sample(PROMPT, [40, 6, 6], 0.0, [-1.0] * 3)]


def trainer(student, teacher, offload: bool = False, **teacher_cfg):
    from rollpacker.dist import build_meshes
    from rollpacker.train.config import TeacherConfig, TrainConfig
    from rollpacker.train.trainer import Trainer

    cfg = TrainConfig(lr=1e-2, warmup_steps=0, offload=offload, teacher=TeacherConfig(path="teacher", **teacher_cfg))
    return Trainer(student, cfg, build_meshes(1, 0).train, temperature=0.8, teacher=teacher, num_steps=3)


def by_hand(model, sample, temperature: float) -> torch.Tensor:
    """Log-probs of the response tokens, from the whole sequence's logits."""
    tokens = torch.tensor(sample.prompt_ids + sample.response_ids)
    with torch.no_grad():
        logits = model.logits(model(tokens, torch.arange(len(tokens)), CausalAttention([len(tokens)])))
    logp = torch.log_softmax(logits / temperature, dim=-1)
    n = len(sample.prompt_ids)
    return logp[n - 1:-1].gather(1, tokens[n:, None])[:, 0]


def weights(t) -> dict:
    return {k: v.full_tensor().clone() for k, v in t.model.state_dict().items()}


@pytest.mark.parametrize("offload", [False, True])
def test_token_rewards_are_the_teachers_reverse_kl(qwen2_dir, offload):
    """Sharded like the policy, or (train.offload) streamed from host memory layer by layer."""
    from rollpacker.model import load_model
    from rollpacker.model.offload import StreamedModel

    student, teacher = load_model(qwen2_dir), load_model(qwen2_dir)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
    want = []
    for s in samples():  # -coef (log p_student - log p_teacher) per token
        want.append(-0.5 * (by_hand(student, s, 0.8) - by_hand(teacher, s, 0.8)))
    t = trainer(student, teacher, offload=offload, coef=0.5)
    assert isinstance(t.teacher, StreamedModel) == offload
    batch = samples()
    frozen = t._frozen(batch, [[0, 1]], [[[[0, 1]]]])
    rewards = t._token_rewards(batch, frozen, torch.ones(2, 4, dtype=torch.bool))
    assert torch.allclose(rewards[0], want[0], atol=1e-5)
    assert torch.allclose(rewards[1, :3], want[1], atol=1e-5) and rewards[1, 3] == 0
    stats = t.step(batch, 7)
    expected_kl = -torch.cat(want).sum() / 0.5 / 7  # the mean reverse KL per token
    assert stats["train/teacher_kl"] == pytest.approx(float(expected_kl), abs=1e-5)


@pytest.mark.parametrize("in_loss", [False, True])
def test_a_student_equal_to_its_teacher_gets_no_signal(qwen2_dir, in_loss):
    from rollpacker.model import load_model

    t = trainer(load_model(qwen2_dir), load_model(qwen2_dir), task_weight=0.0, in_loss=in_loss)
    batch = samples()
    if not in_loss:
        frozen = t._frozen(batch, [[0, 1]], [[[[0, 1]]]])
        assert torch.equal(t._token_rewards(batch, frozen, torch.ones(2, 4, dtype=torch.bool)), torch.zeros(2, 4))
    before = weights(t)
    stats = t.step(batch, 7)
    assert stats["train/teacher_kl"] == 0.0 and stats["train/grad_norm"] == 0.0
    after = weights(t)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_overlong_punishment_is_not_weighed_by_the_task_weight(qwen2_dir):
    """Distillation alone (task weight 0) keeps DAPO's overlong punishment: it is no part of the task reward."""
    from rollpacker.model import load_model

    t = trainer(load_model(qwen2_dir), load_model(qwen2_dir), task_weight=0.0, in_loss=True)
    long, short = samples()
    long.reward, short.reward, long.shaping = 1.0, 1.0, -0.5  # equal task rewards; the long one punished
    adv = [p.advantages for p in t._prepare([long, short])]
    assert adv[0].lt(0).all() and adv[1].gt(0).all()


def test_teacher_config_and_stream_refusal():
    from rollpacker.config import Config
    from rollpacker.schedule.scale_down import StreamConfig
    from rollpacker.train.config import TeacherConfig, TrainConfig

    with pytest.raises(ValueError, match="train.teacher.coef"):
        TeacherConfig(coef=-1)
    with pytest.raises(ValueError, match="train.teacher.in_loss"):
        Config(train=TrainConfig(teacher=TeacherConfig(path="t")), stream=StreamConfig(enabled=True))
    Config(train=TrainConfig(teacher=TeacherConfig(path="t", in_loss=True)), stream=StreamConfig(enabled=True))


def test_a_teacher_with_another_tokenizer_is_refused_at_start(tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from rollpacker.errors import UserError
    from rollpacker.job import check_tokenizer
    from rollpacker.toy.model import toy_model_dir

    check_tokenizer(toy_model_dir(), str(toy_model_dir()), "train.teacher.path")
    other = tmp_path / "other"
    shutil.copytree(toy_model_dir(), other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<teacher-only>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(UserError, match=r"train.teacher.path: .*1 token\(s\) differ \(e.g. \['<teacher-only>'\]"):
        check_tokenizer(toy_model_dir(), str(other), "train.teacher.path")
    # the same tokens, fewer embedding rows (Qwen2.5-0.5B's 151936 against 7B's 152064): an id it has none for
    shutil.rmtree(other)
    shutil.copytree(toy_model_dir(), other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] - 5}))
    with pytest.raises(UserError, match=rf"train.teacher.path: {other} has 253 token embeddings \(config.json "
                                        r"vocab_size\), model.path 258: .*pick a model with at least 258"):
        check_tokenizer(toy_model_dir(), str(other), "train.teacher.path")
    check_tokenizer(other, str(toy_model_dir()), "train.teacher.path")  # a teacher with more rows reads every id
    # another EOS (a base model's beside an instruct one's): the same ids scored, accepted (it was refused)
    shutil.rmtree(other)
    shutil.copytree(toy_model_dir(), other)
    settings = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**settings, "eos_token": "<"}))
    assert AutoTokenizer.from_pretrained(other).eos_token != AutoTokenizer.from_pretrained(toy_model_dir()).eos_token
    check_tokenizer(toy_model_dir(), str(other), "train.teacher.path")
    # no tokenizer files: transformers made an empty one, and "257 token(s) differ" was the refusal
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (other / name).unlink(missing_ok=True)
    with pytest.raises(UserError, match=rf"train.teacher.path: {other} has no tokenizer \(tokenizer.json or "):
        check_tokenizer(toy_model_dir(), str(other), "train.teacher.path")


def test_the_teachers_loss_term_has_the_reverse_kls_gradient():
    """in_loss: coef * k2 per token, whose gradient is coef (log p - log p_teacher); off the mask, nothing."""
    from rollpacker.train.config import TeacherConfig, TrainConfig
    from rollpacker.train.losses import policy_objective

    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    teacher = torch.tensor([[-1.5, -1.0, float("nan")]])
    mask = torch.tensor([[True, True, False]])
    cfg = TrainConfig(teacher=TeacherConfig(path="t", coef=0.5, in_loss=True))
    zero = torch.zeros(1, 3)
    loss, stats = policy_objective(logp, logp.detach(), logp.detach(), zero, mask, cfg, teacher=teacher)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.5 * 0.5 * (0.5 ** 2 + 1.0 ** 2))
    assert logp.grad[0].tolist() == pytest.approx([0.5 * 0.5, 0.5 * -1.0, 0.0])
    assert float(stats["teacher_kl"]) == pytest.approx(0.5 + -1.0)  # k1 summed over the mask
