"""The LLM judge as a reward kind: judge rows, the [reward.judge] config, and a 1-rank run whose
responses the shipped toy model judges (it adds digits, so some of its verdicts do not parse)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollpacker.data.dataset import DataConfig, DatasetError, load_rows
from rollpacker.reward.config import JudgeConfig, RewardConfig
from rollpacker.reward.scheduler import build_functions, check_row

SCORES_2 = "{prompt}{response}\nQ: 1+1\nA: 1+1=2\n#### "  # the toy model's verdict: "2"


def load(path: str, funcs: tuple[str, ...] = ("judge",)) -> list[dict]:
    from rollpacker.toy.model import toy_model_dir

    functions = build_functions(RewardConfig(funcs=funcs, judge=JudgeConfig(model_path=str(toy_model_dir()))))
    return load_rows(DataConfig(path=path), lambda row: check_row(functions, row))


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_judge_rows_need_only_a_prompt_and_may_carry_a_rubric(tmp_path):
    path = write_jsonl(tmp_path / "j.jsonl", [{"prompt": "a"}, {"prompt": "b", "rubric": SCORES_2, "answer": "2"}])
    rows = load(path)
    assert [(r["id"], r.get("rubric")) for r in rows] == [("j:1", None), ("j:2", SCORES_2)]
    with pytest.raises(DatasetError, match=r"j.jsonl:1: missing field 'answer'"):
        load(path, ("math",))


@pytest.mark.parametrize("row, match", [
    ({"answer": "1"}, r"bad.jsonl:2: missing field 'prompt'"),
    ({"prompt": "p", "rubric": 3}, r"bad.jsonl:2: field 'rubric' must be a string, got int 3"),
    ({"prompt": "p", "rubric": "{prompt} only"}, r"bad.jsonl:2: field 'rubric' must contain \{response\} "
                                                 r"\(or drop it to use reward.judge.rubric\)"),
    ({"prompt": "p", "rubric": "{prompt}{response}{x}"}, r"bad.jsonl:2: field 'rubric' is not a valid template"),
])
def test_bad_judge_rows_name_the_line(tmp_path, row, match):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, row])
    with pytest.raises(DatasetError, match=match):
        load(path)
