"""The toy task (data, solutions, reward) and the shipped toy model's files."""

import functools
import json
import random
import re

import pytest
from transformers import AutoTokenizer

from rollpacker.model import load_model
from rollpacker.toy import model as toy_model
from rollpacker.toy import task as toy
from rollpacker.toy.model import TOY_MODEL_DIR, toy_model_dir


def test_dataset_is_deterministic_by_seed():
    assert toy.make_dataset(50, seed=3) == toy.make_dataset(50, seed=3)
    assert toy.make_dataset(50, seed=3) != toy.make_dataset(50, seed=4)


def test_dataset_schema(tmp_path):
    rows = toy.make_dataset(20, seed=0)
    toy.write_jsonl(rows, tmp_path / "toy.jsonl")
    lines = (tmp_path / "toy.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == rows
    assert len({r["id"] for r in rows}) == 20
    for r in rows:
        assert isinstance(r["id"], str) and isinstance(r["prompt"], str) and isinstance(r["answer"], str)
        assert r["prompt"].startswith("Q: ") and r["prompt"].endswith("\nA:")
        assert toy.MIN_TERMS <= r["num_terms"] <= toy.MAX_TERMS


def test_response_length_is_heavy_tailed():
    stats = toy.length_stats(toy.make_dataset(1000, seed=0))
    assert stats["max"] >= 8 * stats["median"]
    assert 20 <= stats["median"] <= 40 and stats["max"] <= 400


def test_the_default_jobs_thinner_tail_keeps_the_long_responses():
    """data.toy_tail_alpha=1.6 (the default job's mix): fewer long problems, the same longest ones."""
    default, thinner = toy.make_dataset(2048, seed=0), toy.make_dataset(2048, seed=0, alpha=1.6)
    def long(rows):
        return sum(r["num_terms"] >= 7 for r in rows)
    assert long(thinner) < 0.8 * long(default)
    stats = toy.length_stats(thinner)
    assert stats["max"] >= 10 * stats["median"] and stats["max"] <= 400


def test_solution_lines_are_correct_arithmetic():
    for r in toy.make_dataset(200, seed=1):
        *steps, final = toy.solution(r).lstrip(" ").split("\n")
        assert len(steps) == r["num_terms"] - 1
        expr = r["prompt"][len("Q: ") : -len("\nA:")]
        assert steps[0].startswith(re.match(r"\d+", expr).group())
        for prev, line in zip([None, *steps], steps):
            a, op, b, c = re.fullmatch(r"(\d+)([+-])(\d+)=(\d+)", line).groups()
            assert int(c) == (int(a) + int(b) if op == "+" else int(a) - int(b))
            assert 0 <= int(c) <= toy.MAX_TOTAL and 1 <= int(b) <= 9
            if prev is not None:
                assert a == prev.split("=")[1]
        assert final == f"#### {r['answer']}"
        assert toy.score(toy.solution(r), r["answer"]) == 1.0


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        (" 3+5=8\n#### 8", 1.0),
        ("#### 8\n", 1.0),
        ("#### 7\n#### 8", 1.0),
        (" 3+5=8\n#### 9", 0.0),
        ("#### 8\n#### 9", 0.0),
        (" 3+5=8", 0.0),
        ("#### 8x", 0.0),
        ("#### ", 0.0),
        ("", 0.0),
        ("####" + "9" * 10_000, 0.0),
        ("\x00garbage é ####", 0.0),
    ],
)
def test_score(response, reward):
    assert toy.score(response, "8") == reward


def test_score_never_raises_on_a_bad_answer():
    assert toy.score("#### 8", "eight") == 0.0


def test_make_problem_with_fixed_terms():
    rng = random.Random(0)
    assert all(toy.make_problem(rng, terms=n)["num_terms"] == n for n in (2, 25, toy.MAX_TERMS))


def test_shipped_tokenizer_round_trips():
    assert toy_model_dir() == TOY_MODEL_DIR
    tok = AutoTokenizer.from_pretrained(TOY_MODEL_DIR)
    r = toy.make_dataset(1, seed=5)[0]
    prompt_ids, response_ids = tok.encode(r["prompt"]), tok.encode(toy.solution(r))
    assert prompt_ids + response_ids == tok.encode(r["prompt"] + toy.solution(r))
    assert len(response_ids) == len(toy.solution(r))
    assert tok.decode(prompt_ids + response_ids) == r["prompt"] + toy.solution(r)
    assert tok.eos_token_id is not None and tok.bos_token_id is None


def test_shipped_model_loads_and_is_small():
    size = sum(f.stat().st_size for f in TOY_MODEL_DIR.iterdir())
    assert size <= 10 << 20
    model = load_model(TOY_MODEL_DIR)
    tok = AutoTokenizer.from_pretrained(TOY_MODEL_DIR)
    assert model.args.model_type == "qwen2"
    assert model.args.eos_token_ids == (tok.eos_token_id,)
    assert model.args.vocab_size == len(tok)


def test_missing_toy_model_is_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(toy_model, "TOY_MODEL_DIR", tmp_path / "not_shipped")
    monkeypatch.setattr(toy_model, "SFTConfig", functools.partial(toy_model.SFTConfig, num_steps=2, warmup_steps=1))
    monkeypatch.setenv("ROLLPACKER_CACHE", str(tmp_path / "cache"))
    path = toy_model.toy_model_dir()
    assert path == tmp_path / "cache" / "toy_model"
    built = (path / "model.safetensors").stat().st_mtime_ns
    assert toy_model.toy_model_dir() == path and (path / "model.safetensors").stat().st_mtime_ns == built
    report = toy_model.evaluate(path, num=4)
    assert [name for name, *_ in report] == ["2-3", "4-6", "7-12", "13-24", "25-48", "overall"]
    assert report[-1][1] == 4


def test_shipped_model_logits_agree_across_engine_trainer_and_transformers():
    """The shipped model is served identically by TorchEngine, the trainer's decoder and transformers'
    Qwen2ForCausalLM: greedy tokens, engine log-probs and logits (fp32, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollpacker.model import CausalAttention
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.engine import Request, SamplingParams, generate
    from rollpacker.rollout.torch_engine import TorchEngine

    config = json.loads((TOY_MODEL_DIR / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] in (32, 64)  # vLLM's CPU attention sizes
    tok = AutoTokenizer.from_pretrained(TOY_MODEL_DIR)
    hf = AutoModelForCausalLM.from_pretrained(TOY_MODEL_DIR, dtype=torch.float32).eval()
    ours = load_model(TOY_MODEL_DIR)
    rows = toy.make_dataset(6, seed=11)
    params = SamplingParams(max_new_tokens=80, temperature=0.0)
    outs = generate(TorchEngine(load_model(TOY_MODEL_DIR), EngineConfig()),
                    [Request(id=r["id"], prompt_ids=tok.encode(r["prompt"]), params=params) for r in rows])
    for r in rows:
        out = outs[r["id"]]
        ids = torch.tensor(out.prompt_ids + out.token_ids)
        with torch.no_grad():
            hf_logits = hf(ids[None]).logits[0]
            our_logits = ours.logits(ours(ids, torch.arange(len(ids)), CausalAttention([len(ids)])))
        torch.testing.assert_close(our_logits, hf_logits, rtol=1e-5, atol=1e-4)
        response = slice(len(out.prompt_ids) - 1, len(ids) - 1)  # positions that predict the response
        assert hf_logits[response].argmax(-1).tolist() == out.token_ids
        hf_logprobs = hf_logits[response].log_softmax(-1).gather(1, ids[1:, None][response]).squeeze(1)
        torch.testing.assert_close(torch.tensor(out.logprobs), hf_logprobs, rtol=0, atol=1e-4)


def test_the_task_command_refuses_bad_values_in_one_line(tmp_path):
    """--num 0 wrote an empty file and raised StatisticsError, --alpha 0 a ZeroDivisionError, --alpha -1 gave 2 terms
    to every problem; an --out it cannot write was a traceback."""
    from rollpacker.toy.task import main

    for num, alpha in ((0, 1.3), (10, 0.0), (10, -1.0)):
        with pytest.raises(SystemExit, match=r"--num \(-?\d+\) must be positive and --alpha \(-?[\d.]+\) above 0"):
            main(tmp_path / "x.jsonl", num=num, alpha=alpha)
    with pytest.raises(SystemExit, match=f"cannot write {tmp_path} \\(Is a directory\\)"):
        main(tmp_path, num=10)
    assert not (tmp_path / "x.jsonl").exists()


def test_building_a_model_refuses_to_overwrite_what_is_not_a_model(tmp_path):
    """toy.model build (and tools_model's, random_model's) replaced a user's config.json in a directory of theirs."""
    from rollpacker.toy.model import refuse_out

    refuse_out(tmp_path / "new", "build")  # a new directory, or an empty one
    refuse_out(tmp_path, "build")
    (tmp_path / "config.json").write_text("{}")
    refuse_out(tmp_path, "build")  # a model's: written again
    (tmp_path / "config.json").unlink()
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match=f"build: --out {tmp_path} holds files that are not a model's"):
        refuse_out(tmp_path, "build")
    with pytest.raises(SystemExit, match="is a file: name a directory"):
        refuse_out(tmp_path / "notes.txt", "build")
