"""The LLM judge as a reward kind: judge rows, the [reward.judge] config, a 1-rank run whose
responses the shipped toy model judges (it adds digits, so some of its verdicts do not parse), and
one a reward model scores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.jobs import launch_job

from rollpacker.config import load_preset, parse
from rollpacker.toy.model import toy_model_dir

SCORES_2 = "{prompt}{response}\nQ: 1+1\nA: 1+1=2\n#### "  # the toy model's verdict: "2"
UNPARSEABLE = "{prompt}{response}\nQ: 1+1\nA:"  # the toy model's verdict: " " (it answers " 1+1=2")


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_judge_config_from_flags_and_toml_without_torch(tmp_path):
    judge = str(toy_model_dir())
    preset = tmp_path / "judge.toml"
    preset.write_text(f'[reward]\nfuncs = ["judge"]\n[reward.judge]\nmodel_path = "{judge}"\nmax_score = 5\n')
    cfg = load_preset(str(preset))
    assert (cfg.reward.funcs, cfg.reward.judge.model_path, cfg.reward.judge.max_score) == (("judge",), judge, 5)
    preset.write_text("[reward.judge]\nmax_score = 0\n")
    with pytest.raises(ValueError, match="judge.toml: judge.max_score must be >= 1, got 0"):
        load_preset(str(preset))
    code = ("import sys\nfrom rollpacker.config import parse\n"
            f"cfg = parse(['--reward.funcs', 'judge', '--reward.judge.model-path', {judge!r},"
            " '--reward.judge.max-batch-tokens', '8192'])\n"
            f"assert (cfg.reward.judge.model_path, cfg.reward.judge.max_batch_tokens) == ({judge!r}, 8192)\n"
            "assert 'torch' not in sys.modules, 'torch imported while parsing'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert parse([]).reward.judge.model_path == ""
    preset.write_text('[reward]\nfuncs = ["judge"]\n[reward.judge]\nmodel_path = "/nowhere"\n')
    with pytest.raises(ValueError, match="model_path='/nowhere' is not a Hugging Face model directory"):
        load_preset(str(preset))


@pytest.mark.timeout(120)
def test_one_rank_run_with_the_judge(tmp_path):
    """Row 1's rubric makes every verdict "2" (reward 2/9), row 2's every verdict unparseable."""
    data = write_jsonl(tmp_path / "judge.jsonl", [{"prompt": "Q: 3+4\nA:", "rubric": SCORES_2},
                                                  {"prompt": "Q: 2+5-1\nA:", "rubric": UNPARSEABLE}])
    run_dir = tmp_path / "run"
    proc = launch_job("--data.path", data, "--reward.funcs", "judge",
                      "--reward.judge.model-path", str(toy_model_dir()), "--reward.on-error", "skip",
                      "--reward.num-workers", "0",
                      "--num-steps", "1", "--rollout.num-prompts", "2", "--rollout.group-size", "2",
                      "--rollout.max-new-tokens", "32", "--eval-every", "0", "--metrics.wandb-mode", "disabled",
                      "--metrics.no-live", "--run-dir", str(run_dir), nproc=1, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [record] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert record["reward/errors"] == 2  # row 2's group, scored 0 and counted
    assert record["reward/mean"] == pytest.approx(2 / 9 / 2)  # row 1's group at 2/9, row 2's at 0
    assert record["reward/judge"] == pytest.approx(2 / 9)  # the judge's own mean, where it scored
    assert record["reward/seconds_total"] > 0
    assert ("reward function 'judge' failed on 2 of 4 responses at step 0, scored 0 (--reward.on-error skip); first "
            "on row 'judge:2': judge verdict ' ' is not a score") in proc.stderr


@pytest.mark.timeout(120)
def test_one_rank_run_rewarded_by_a_reward_model_as_transformers_scores(tmp_path, reward_model_dir):
    """A string prompt and a chat one: each response's reward is the reward model's score of the conversation."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    data = write_jsonl(tmp_path / "rm.jsonl", [{"prompt": "Q: 3+4\nA:"},
                                               {"prompt": [{"role": "user", "content": "2+5-1"}]}])
    run_dir = tmp_path / "run"
    proc = launch_job("--data.path", data, "--reward.funcs", "judge", "--reward.judge.model-path",
                      str(reward_model_dir), "--num-steps", "1", "--rollout.num-prompts", "2", "--rollout.group-size",
                      "2", "--rollout.max-new-tokens", "16", "--eval-every", "0", "--metrics.samples-every", "1",
                      "--metrics.wandb-mode", "disabled", "--metrics.no-live", "--run-dir", str(run_dir), nproc=1,
                      timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [record] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (run_dir / "samples" / "step_0.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    reference = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    for s in samples:
        prompt = [{"role": "user", "content": s["prompt"]}] if isinstance(s["prompt"], str) else s["prompt"]
        text = tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": s["completion"]}],
                                             tokenize=False)
        with torch.no_grad():
            score = reference(**tokenizer(text, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item()
        assert s["rewards"]["judge"] == pytest.approx(score, abs=1e-4) and s["reward"] == s["rewards"]["judge"]
    assert len(samples) == 4 and record["reward/errors"] == 0
    assert record["reward/judge"] == pytest.approx(sum(s["reward"] for s in samples) / 4)
