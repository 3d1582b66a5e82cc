"""Dataset loading (strict JSONL, errors naming file:line) and the stateful epoch sampler."""

from __future__ import annotations

import json
import logging
import re

import pytest

from rollpacker.data.dataset import (
    DataConfig,
    DatasetError,
    PromptSampler,
    check_held_out,
    load_eval_rows,
    load_rows,
    rows_digest,
    toy_held_out,
)
from rollpacker.reward.config import RewardConfig
from rollpacker.reward.scheduler import build_functions, check_row
from rollpacker.toy import task as toy


def write(tmp_path, lines: list[str], name: str = "train.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def load(path: str, funcs: tuple[str, ...] = ("math", "code"), **config) -> list[dict]:
    """The rows of ``path`` as a run scoring them with ``funcs`` loads them."""
    functions = build_functions(RewardConfig(funcs=funcs))
    return load_rows(DataConfig(path=path, **config), lambda row: check_row(functions, row))


# --- config --------------------------------------------------------------------------------------


def test_config_defaults_are_valid():
    config = DataConfig()
    assert config.path == () and (config.split, config.prompt_key, config.answer_key) == ("train", "prompt", "answer")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_toy_prompts": 0}, "data.num_toy_prompts must be positive, got 0"),
        ({"num_toy_prompts": -3}, "data.num_toy_prompts must be positive, got -3"),
        ({"shuffle_seed": -1}, "data.shuffle_seed must be >= 0, got -1"),
        ({"toy_tail_alpha": 0.0}, "data.toy_tail_alpha must be positive, got 0.0"),
        ({"prompt_key": ""}, "data.prompt_key must not be empty"),
    ],
)
def test_config_validation_names_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**kwargs)


# --- loading -------------------------------------------------------------------------------------


def test_toy_rows_when_no_path():
    rows = load_rows(DataConfig(num_toy_prompts=7, toy_seed=3))
    trained = [row for row in toy.make_dataset(20, 3, alpha=1.6) if not toy_held_out(row)]
    assert [row["prompt"] for row in rows] == [row["prompt"] for row in trained[:7]]
    assert [row["id"] for row in rows] == [f"toy-3-{i}" for i in range(7)]
    thick = load_rows(DataConfig(num_toy_prompts=7, toy_seed=3, toy_tail_alpha=1.3))
    assert thick == toy.make_dataset(7, 3, keep=lambda row: not toy_held_out(row))
    assert all({"id", "prompt", "answer"} <= row.keys() for row in rows)


def test_toy_held_out_problems_are_never_trained_on_and_keep_the_training_mix():
    config = DataConfig()
    trained, held_out = load_rows(config), load_eval_rows(config)
    assert len(held_out) == 256 and not {r["prompt"] for r in held_out} & {r["prompt"] for r in trained}
    # the short problems repeat (124 two-term sums in 2048 training prompts), yet the held-out mix is training's
    two_terms = [sum(r["num_terms"] == 2 for r in rows) / len(rows) for rows in (trained, held_out)]
    assert two_terms[1] > 0.15 and abs(two_terms[0] - two_terms[1]) < 0.1, two_terms


def test_valid_jsonl_loads(tmp_path):
    path = write(tmp_path, [
        json.dumps({"prompt": "1+1?", "answer": "2"}),
        "",
        "   ",
        json.dumps({"id": "q7", "prompt": "2+2?", "answer": "4", "source": "x"}),
        json.dumps({"id": 9, "prompt": "3+3?", "answer": "6"}),
    ])
    rows = load(path)
    assert [{k: v for k, v in r.items() if v is not None} for r in rows] == [  # a column some rows lack: None
        {"id": "train:1", "prompt": "1+1?", "answer": "2"},
        {"id": "q7", "prompt": "2+2?", "answer": "4", "source": "x"},
        {"id": "9", "prompt": "3+3?", "answer": "6"},
    ]


def test_jsonl_with_bom_and_unicode(tmp_path):
    path = tmp_path / "u.jsonl"
    line = json.dumps({"prompt": "π≈?", "answer": "3.14"}, ensure_ascii=False)
    path.write_bytes("\ufeff".encode() + line.encode() + b"\n")
    assert load(str(path)) == [{"id": "u:1", "prompt": "π≈?", "answer": "3.14"}]


def test_invalid_json_names_line(tmp_path):
    path = write(tmp_path, [json.dumps({"prompt": "a", "answer": "b"}), "", '{"prompt": "a" "answer": "b"}'])
    with pytest.raises(DatasetError, match=r"train\.jsonl:3: invalid JSON \(Expecting ',' delimiter"):
        load(path)


def test_not_an_object_names_line(tmp_path):
    path = write(tmp_path, ['["prompt", "answer"]'])
    with pytest.raises(DatasetError, match=r"train\.jsonl:1: expected a JSON object, got list"):
        load(path)


@pytest.mark.parametrize("field", ["prompt", "answer"])
def test_missing_field_names_field_and_line(tmp_path, field):
    row = {"prompt": "p", "answer": "a"}
    del row[field]
    path = write(tmp_path, [json.dumps({"prompt": "p", "answer": "a"}), json.dumps(row)])
    with pytest.raises(DatasetError, match=rf"train\.jsonl:2: missing field '{field}'"):
        load(path)


def test_a_misnamed_prompt_or_answer_column_names_the_columns_there_are(tmp_path):
    """A typo in data.answer_key would score every response 0 with a function of your own, silently."""
    path = write(tmp_path, [json.dumps({"question": "p", "solution": "a"}), json.dumps({"question": "q"})])
    with pytest.raises(DatasetError, match=r"train\.jsonl:1: missing field 'prompt' \(the prompt; data.prompt_key "
                                           r"names its column, one of this row's: question, solution\)"):
        load_rows(DataConfig(path=str(path)))
    with pytest.raises(DatasetError, match=r"data.path: data.answer_key 'answers' names a column no row of "
                                           r".*train.jsonl has \(its columns: question, solution\): name one"):
        load_rows(DataConfig(path=str(path), prompt_key="question", answer_key="answers"))
    rows = load_rows(DataConfig(path=str(path), prompt_key="question", answer_key="solution"))
    assert [r["answer"] for r in rows] == ["a", None]  # a row without it: the function's to judge
    code = write(tmp_path, [json.dumps({"question": "add", "tests": [{"input": "", "output": "3"}]})], "code.jsonl")
    held_out = DataConfig(path=str(path), eval_path=str(code), prompt_key="question", answer_key="answers")
    assert [r["answer"] for r in load_eval_rows(held_out)] == [None]  # an eval set of another task may have none


def test_code_rows_carry_tests_instead_of_an_answer(tmp_path):
    tests = [{"input": "1 2\n", "output": "3\n"}]
    path = write(tmp_path, [json.dumps({"prompt": "add", "tests": tests}), json.dumps({"prompt": "p", "tests": []})])
    with pytest.raises(DatasetError, match=r"train\.jsonl:2: field 'tests' must be a non-empty list"):
        load(path)
    path = write(tmp_path, [json.dumps({"prompt": "add", "tests": tests})])
    assert load(path)[0]["tests"] == tests


def test_non_string_prompt(tmp_path):
    path = write(tmp_path, [json.dumps({"prompt": 12, "answer": "a"})])
    with pytest.raises(DatasetError, match=r"train\.jsonl:1: field 'prompt' must be a string or a list of chat "
                                           r"messages \(\{\"role\", \"content\"\}\), got int 12"):
        load(path)
    messages = [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]
    path = write(tmp_path, [json.dumps({"prompt": messages})])
    with pytest.raises(DatasetError, match=r"train\.jsonl:1: field 'prompt': message 1 has role 'bot'; expected one of "
                                           "system, developer, user, assistant, tool"):
        load(path)
    developer = [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "a"}]  # gpt-oss's
    assert load(write(tmp_path, [json.dumps({"prompt": developer, "answer": "b"})]))[0]["prompt"] == developer


def test_answers_are_kept_as_the_file_has_them_and_the_built_ins_check_theirs(tmp_path):
    """TRL and verl pass a column to the user's functions as it is: an integer stays one, a verl ground_truth dict
    (Search-R1's {"target": [...]}) a dict; math and toy take a string or a number, and refuse the rest by row."""
    from rollpacker.reward.rules import math, toy

    rows = [{"prompt": "p", "answer": 42}, {"prompt": "q", "answer": 2.5}, {"prompt": "r", "answer": 3.0}]
    path = write(tmp_path, [json.dumps(r) for r in rows])
    assert [r["answer"] for r in load(path)] == [42, 2.5, 3.0]  # as Arrow reads the column (floats, 42.0)
    assert math(["\\boxed{42}", "\\boxed{2.5}", "so 3"], answer=[42, 2.5, 3.0]) == [1.0, 1.0, 1.0]
    assert toy(["#### 3", "#### 3"], answer=[3.0, "3"]) == [1.0, 1.0]
    search_r1 = {"prompt": "p", "reward_model": {"ground_truth": {"target": ["Paris"]}}}
    path = write(tmp_path, [json.dumps(search_r1)])
    (tmp_path / "mine.py").write_text("def f(completions, answer, **kw):\n    return [0.0] * len(completions)\n")
    assert load(path, (f"{tmp_path / 'mine.py'}:f",))[0]["answer"] == {"target": ["Paris"]}
    with pytest.raises(DatasetError, match=r"train\.jsonl:1: field 'answer' must be a string or a number for "
                                           r"reward.funcs math, got dict \{\"target\": \[\"Paris\"\]\}"):
        load(path)
    path = write(tmp_path, [json.dumps({"prompt": "p", "answer": " "})])
    with pytest.raises(DatasetError, match=r"train\.jsonl:1: field 'answer' is empty: reward.funcs math has nothing"):
        load(path)


def test_bad_id_type(tmp_path):
    path = write(tmp_path, [json.dumps({"id": [1], "prompt": "p", "answer": "a"})])
    with pytest.raises(DatasetError, match=r"train\.jsonl:1: field 'id' \(the row's id: data.id_key\) must be a "
                                           r"string or an integer, got list \[1\]; set data.id_key"):
        load(path)


def test_duplicate_id(tmp_path):
    path = write(tmp_path, [
        json.dumps({"id": "a", "prompt": "p", "answer": "x"}),
        json.dumps({"id": "b", "prompt": "p", "answer": "x"}),
        json.dumps({"id": "a", "prompt": "q", "answer": "y"}),
    ])
    with pytest.raises(DatasetError, match=r"train\.jsonl:3: duplicate id 'a' \(first at .*train\.jsonl:1\) in "
                                           r"column 'id' \(data.id_key\), .*or to '' to number the rows"):
        load(path)
    with pytest.raises(DatasetError, match=r"duplicate id 'a'"):  # the data's layout: no row skipped for it
        load_rows(DataConfig(path=str(path), skip_bad_lines=True))
    # TRL and verl read id as any column: numbered rows instead, or another column's ids
    assert [r["id"] for r in load_rows(DataConfig(path=str(path), id_key=""))] == ["train:1", "train:2", "train:3"]
    path = write(tmp_path, [json.dumps({"id": 0, "uid": f"u{i}", "prompt": "p", "answer": "x"}) for i in range(2)])
    assert [r["id"] for r in load_rows(DataConfig(path=str(path), id_key="uid"))] == ["u0", "u1"]


def test_a_file_named_twice_is_refused_not_read_twice(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, [json.dumps({"prompt": "p", "answer": "x"})], "a.jsonl")
    for twice in (("a.jsonl", "./a.jsonl"), ("a.jsonl", "a.jsonl")):
        with pytest.raises(DatasetError, match=rf"data.path names {re.escape(twice[1])} twice \(as a.jsonl and "
                                               rf"{re.escape(twice[1])}\): list each file once"):
            load_rows(DataConfig(path=twice))


def test_jsonl_that_datasets_cannot_read_is_named_by_line_or_as_given(tmp_path):
    # a first line of null: pyarrow's reader dies of it (SIGSEGV), so it is never given such a file
    path = write(tmp_path, ["", "null", json.dumps({"prompt": "p", "answer": "x"})])
    with pytest.raises(DatasetError, match=r"train\.jsonl:2: expected a JSON object, got NoneType"):
        load(path)
    assert [r["id"] for r in load_rows(DataConfig(path=path, skip_bad_lines=True))] == ["train:3"]
    path = write(tmp_path, ["null", json.dumps({"prompt": "p", "answer": "x"})], "train.json")
    with pytest.raises(DatasetError, match=r"train\.json begins with null: give a JSON array of objects"):
        load(path)
    # every line a JSON object, but a key twice: the user's file, not a cleaned copy of it
    path = write(tmp_path, ['{"prompt": "p", "answer": "1", "answer": "3"}'], "dup.jsonl")
    with pytest.raises(DatasetError, match=rf"data.path: {re.escape(path)} cannot be read as json: .*twice"):
        load(path)
    # only bad lines: the first one's fault is said
    path = write(tmp_path, ['{"prompt": "p"} x'], "bad.jsonl")
    with pytest.raises(DatasetError, match=r"bad\.jsonl: no rows \(.*bad rows: line 1: invalid JSON"):
        load_rows(DataConfig(path=path, skip_bad_lines=True))


def test_default_id_collides_with_explicit_id(tmp_path):
    path = write(tmp_path, [json.dumps({"id": "train:2", "prompt": "p", "answer": "x"}),
                            json.dumps({"prompt": "q", "answer": "y"})])
    with pytest.raises(DatasetError, match=r"train\.jsonl:2: duplicate id 'train:2'"):
        load(path)


def test_a_split_reading_a_row_twice_says_so_not_that_ids_repeat(tmp_path, caplog):
    """train+train named data.id_key, which the file does not have, and told to set it to '', which it was."""
    path = write(tmp_path, [json.dumps({"prompt": str(i), "answer": "x"}) for i in range(5)])
    for split in ("train+train", "train[:60%]+train[40%:]"):
        with pytest.raises(DatasetError, match=rf"train\.jsonl:\d: read twice \(data.split {re.escape(repr(split))} "
                                               r"names it in two parts that repeat or overlap\)"):
            load(path, split=split)
    assert [r["id"] for r in load(path, split="train[:40%]+train[40%:]")] == [f"train:{i}" for i in range(1, 6)]
    bad = write(tmp_path, ['{"prompt": "1", "answer": "x"}', "{", '{"prompt": "2", "answer": "x"}', "{"], "bad.jsonl")
    with caplog.at_level(logging.WARNING, logger="rollpacker.data.dataset"):
        assert len(load_rows(DataConfig(path=bad, skip_bad_lines=True, split="train[:50%]"))) == 1
    assert "skipped 2 bad row(s), kept 1 (data.skip_bad_lines)" in caplog.text  # the file's bad lines, the slice's rows


def test_several_files_train_together_and_each_eval_set_is_its_own_source(tmp_path, caplog):
    """As verl's train_files and val_files: the rows of every file, ids unique across them; a row without a
    data_source takes its file's name, one with it keeps it; each eval set gives its first num_eval_prompts."""

    gsm = write(tmp_path, [json.dumps({"prompt": f"g{i}", "answer": "1"}) for i in range(3)], "gsm.jsonl")
    mixed = write(tmp_path, [json.dumps({"prompt": "m", "answer": "2", "data_source": "lighteval/MATH"}),
                             json.dumps({"prompt": "n", "answer": "3"})], "math.jsonl")
    rows = load_rows(DataConfig(path=(gsm, mixed)))
    assert [(r["id"], r["data_source"]) for r in rows] == [
        ("gsm:1", "gsm"), ("gsm:2", "gsm"), ("gsm:3", "gsm"), ("math:1", "lighteval/MATH"), ("math:2", "math")]
    assert "data_source" not in load_rows(DataConfig(path=gsm))[0]  # one file: the rows as they are
    code = write(tmp_path, [json.dumps({"prompt": "c", "tests": [{"input": "", "output": "1"}]})], "code.jsonl")
    both = load_rows(DataConfig(path=(gsm, code)))  # TRL's multi-task recipe: code_reward(completions, tests)
    assert (both[0]["tests"], both[-1]["answer"]) == (None, None)  # each file's columns on every row, None if not its
    with caplog.at_level(logging.INFO, logger="rollpacker.data.dataset"):
        held_out = load_eval_rows(DataConfig(path=gsm, eval_path=(gsm, mixed), num_eval_prompts=2))
    assert [r["id"] for r in held_out] == ["gsm:1", "gsm:2", "math:1", "math:2"]
    assert f"data.eval_path: {gsm}: evaluating its first 2 of 3 rows (data.num_eval_prompts)" in caplog.text

    again = write(tmp_path, [json.dumps({"id": "gsm:2", "prompt": "p", "answer": "x"})], "again.jsonl")
    with pytest.raises(DatasetError, match=r"again\.jsonl and .*gsm\.jsonl both have a row with id 'gsm:2'"):
        load_rows(DataConfig(path=(gsm, again)))


def test_files_of_one_name_in_two_folders_are_named_by_their_folders(tmp_path, monkeypatch):
    """verl writes gsm8k/train.parquet and math/train.parquet: their rows' ids and sources do not collide."""
    paths = []
    for folder in ("gsm8k", "math"):
        (tmp_path / folder).mkdir()
        paths.append(write(tmp_path / folder, [json.dumps({"prompt": folder, "answer": "1"})] * 2))
    rows = load_rows(DataConfig(path=tuple(paths)))
    assert [(r["id"], r["data_source"]) for r in rows] == [
        ("gsm8k/train:1", "gsm8k/train"), ("gsm8k/train:2", "gsm8k/train"),
        ("math/train:1", "math/train"), ("math/train:2", "math/train")]
    # one in the working directory (its folder's name, not "") and, in one folder, two formats of one name
    monkeypatch.chdir(tmp_path / "math")
    (tmp_path / "math" / "sub").mkdir()
    write(tmp_path / "math" / "sub", [json.dumps({"prompt": "s", "answer": "1"})])
    rows = load_rows(DataConfig(path=("train.jsonl", "sub/train.jsonl")))
    assert sorted({r["data_source"] for r in rows}) == ["math/train", "sub/train"]
    write(tmp_path / "math", [json.dumps({"prompt": "j", "answer": "1"})], "train.json")
    rows = load_rows(DataConfig(path=("train.jsonl", "train.json")))
    assert sorted({r["id"] for r in rows}) == ["math/train.json:1", "math/train.jsonl:1", "math/train.jsonl:2"]
    # in two folders of one name: as given (both were math/train.jsonl, and their rows' ids collided)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "other" / "math").mkdir(parents=True)
    write(tmp_path / "other" / "math", [json.dumps({"prompt": "o", "answer": "1"})])
    rows = load_rows(DataConfig(path=("math/train.jsonl", "other/math/train.jsonl")))
    assert sorted({r["data_source"] for r in rows}) == ["math/train.jsonl", "other/math/train.jsonl"]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "saved", "saved_dict"])
def test_a_slice_takes_its_rows_keeping_their_numbers_in_every_format(tmp_path, kind):
    """``train[3:]`` and ``train[:3]`` split one file into training and held-out rows whose default ids
    (and the lines errors name) are those the rows have in the whole file, so the two never share one."""
    import datasets

    records = [{"prompt": f"q{i}", "answer": str(i)} for i in range(1, 6)]
    path = tmp_path / "data"
    if kind == "jsonl":
        path = write(tmp_path, [json.dumps(r) for r in records], "data.jsonl")
    elif kind == "parquet":
        path = tmp_path / "data.parquet"
        datasets.Dataset.from_list(records).to_parquet(str(path))
    elif kind == "saved":
        datasets.Dataset.from_list(records).save_to_disk(str(path))
    else:
        datasets.DatasetDict(train=datasets.Dataset.from_list(records)).save_to_disk(str(path))
    config = DataConfig(path=str(path), split="train[3:]", eval_path=str(path), eval_split="train[:60%]")

    assert [(r["id"], r["prompt"]) for r in load_rows(config)] == [("data:4", "q4"), ("data:5", "q5")]
    assert [r["id"] for r in load_eval_rows(config)] == ["data:1", "data:2", "data:3"]
    # docs/your-task.md's slices: an eval_split alone is a slice of path's file
    sliced = DataConfig(path=str(path), split="train[:60%]", eval_split="train[60%:]")
    assert [r["id"] for r in load_eval_rows(sliced)] == ["data:4", "data:5"]
    check_held_out(sliced, load_rows(sliced), load_eval_rows(sliced))
    leaky = DataConfig(path=str(path), eval_split="train[60%:]")  # training reads the whole split
    with pytest.raises(DatasetError, match=r"data.eval_split 'train\[60%:\]' of data.path holds 2 of the rows "
                                           r"training reads too \(data.split 'train'\), 'data:4' first, .* set "
                                           r"data.split to the rest"):
        check_held_out(leaky, load_rows(leaky), load_eval_rows(leaky))
    with pytest.raises(DatasetError, match=r"data.eval_path: .*data(\.\w+)? has no split 'test' .*it has train "
                                           r"\(set data.eval_split"):
        load_eval_rows(DataConfig(path=str(path), eval_path=str(path), eval_split="test"))
    with pytest.raises(DatasetError, match=r"^data.path \(read with data.eval_split\): .*has no split 'test' .*\(set "
                                           r"data.eval_split"):  # no data.eval_path to name
        load_eval_rows(DataConfig(path=str(path), eval_split="test"))
    # an eval_path without eval_split is its one split, whole: data.split is a slice of the training file
    whole = DataConfig(path=str(path), split="train[:40%]", eval_path=str(path))
    assert [r["id"] for r in load_rows(whole)] == ["data:1", "data:2"]
    assert [r["id"] for r in load_eval_rows(whole)] == ["data:1", "data:2", "data:3", "data:4", "data:5"]
    # the training file named as eval_path too: checked as a slice is (it evaluated trained rows, unsaid)
    check_held_out(config, load_rows(config), load_eval_rows(config))
    with pytest.raises(DatasetError, match=r"data.eval_path .*data(\.\w+)? holds 2 of the rows training reads too "
                                           r"\(data.split 'train\[:40%\]'\), 'data:1' first"):
        check_held_out(whole, load_rows(whole), load_eval_rows(whole))
    on_purpose = DataConfig(path=str(path), split="train[:40%]", eval_path=str(path), eval_trained_rows=True)
    check_held_out(on_purpose, load_rows(on_purpose), load_eval_rows(on_purpose))  # the training set's accuracy


def test_trained_rows_in_the_eval_set_are_found_whatever_their_ids(tmp_path):
    """A row is known by its prompt and answer: a training file named again as eval_path beside another of its name
    (ids x/train:1 there, train:1 here), or the test split trained as train+test's second part (dd:test:1) and
    evaluated alone (dd:1), passed the check as rows of their own."""
    import datasets

    for folder, n in (("x", 2), ("y", 3)):
        (tmp_path / folder).mkdir()
        write(tmp_path / folder, [json.dumps({"prompt": f"{folder}{i}", "answer": str(i)}) for i in range(n)])
    x, y = str(tmp_path / "x" / "train.jsonl"), str(tmp_path / "y" / "train.jsonl")
    named_again = DataConfig(path=(x, y), eval_path=x)
    assert [r["id"] for r in load_eval_rows(named_again)] == ["train:1", "train:2"]
    with pytest.raises(DatasetError, match=r"data.eval_path .*x/train.jsonl holds 2 of the rows training reads too "
                                           r"\(data.split 'train'\), 'train:1' first"):
        check_held_out(named_again, load_rows(named_again), load_eval_rows(named_again))
    saved = str(tmp_path / "dd")
    datasets.DatasetDict(train=datasets.Dataset.from_list([{"prompt": f"tr{i}", "answer": "1"} for i in range(4)]),
                         test=datasets.Dataset.from_list([{"prompt": f"te{i}", "answer": "1"} for i in range(3)])
                         ).save_to_disk(saved)
    joined = DataConfig(path=saved, split="train+test", eval_path=saved, eval_split="test")
    with pytest.raises(DatasetError, match=r"holds 3 of the rows training reads too \(data.split 'train\+test'\)"):
        check_held_out(joined, load_rows(joined), load_eval_rows(joined))
    apart = DataConfig(path=saved, split="train", eval_path=saved, eval_split="test")
    check_held_out(apart, load_rows(apart), load_eval_rows(apart))
    # a whole-number answer read as a float (Arrow, as the eval file's other answer is 2.5) is still the row's
    write(tmp_path / "x", [json.dumps({"prompt": "x0", "answer": 0}), json.dumps({"prompt": "q", "answer": 2.5})],
          "eval.jsonl")
    numbers = DataConfig(path=str(tmp_path / "x" / "num.jsonl"), eval_path=str(tmp_path / "x" / "eval.jsonl"))
    write(tmp_path / "x", [json.dumps({"prompt": "x0", "answer": 0}), json.dumps({"prompt": "x1", "answer": 1})],
          "num.jsonl")
    assert [r["answer"] for r in load_eval_rows(numbers)] == [0.0, 2.5]
    with pytest.raises(DatasetError, match=r"holds 1 of the rows training reads too"):
        check_held_out(numbers, load_rows(numbers), load_eval_rows(numbers))
    # rows without an answer (a code task's tests, a judge's prompt): known by their prompt (a KeyError stopped the
    # run as it started)
    (tmp_path / "z").mkdir()
    write(tmp_path / "z", [json.dumps({"prompt": f"z{i}", "tests": [{"input": "", "output": str(i)}]})
                           for i in range(3)])
    z = str(tmp_path / "z" / "train.jsonl")
    check_held_out(DataConfig(path=y, eval_path=z), load_rows(DataConfig(path=y)), load_eval_rows(DataConfig(
        path=y, eval_path=z)))
    with pytest.raises(DatasetError, match=r"holds 3 of the rows training reads too"):
        check_held_out(DataConfig(path=z, eval_path=z), load_rows(DataConfig(path=z)),
                       load_eval_rows(DataConfig(path=z, eval_path=z)))


def test_an_eval_set_of_several_splits_needs_its_held_out_one_named(tmp_path):
    """A Hub id or a saved DatasetDict of train and test: without data.eval_split, its train split (data.split's)
    was evaluated, silently, the prompts training draws."""
    import datasets

    path = tmp_path / "both"
    datasets.DatasetDict(train=datasets.Dataset.from_list([{"prompt": "q1", "answer": "1"}]),
                         test=datasets.Dataset.from_list([{"prompt": "q2", "answer": "2"}])).save_to_disk(str(path))
    with pytest.raises(DatasetError, match=r"data.eval_path: .*both has the splits train, test: name the held-out "
                                           r"one with data.eval_split \(e.g. test\)"):
        load_eval_rows(DataConfig(path=str(path), eval_path=str(path)))
    assert [r["prompt"] for r in load_eval_rows(DataConfig(path=str(path), eval_path=str(path), eval_split="test"))
            ] == ["q2"]
    # its test split alone (no eval_path): numbered as train's, other rows, held out all the same
    alone = DataConfig(path=str(path), eval_split="test")
    assert [r["id"] for r in load_eval_rows(alone)] == [r["id"] for r in load_rows(alone)] == ["both:1"]
    check_held_out(alone, load_rows(alone), load_eval_rows(alone))


def test_a_path_from_home_is_read_as_verls_configs_write_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write(tmp_path, [json.dumps({"prompt": "p", "answer": "1"})], "mine.jsonl")
    assert [r["id"] for r in load("~/mine.jsonl")] == ["mine:1"]


def test_a_bad_row_in_a_slice_is_named_by_its_line_in_the_file(tmp_path):
    path = write(tmp_path, [json.dumps({"prompt": "p", "answer": "1"})] * 3 + [json.dumps({"prompt": 5})])
    with pytest.raises(DatasetError, match=r"train\.jsonl:4: field 'prompt' must be a string"):
        load(path, split="train[2:]")


def test_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(json.dumps({"prompt": "p", "answer": "a"}).encode() + b'\n{"prompt": "\xff", "answer": "a"}\n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl:2: not valid UTF-8"):
        load(str(path))


def test_missing_file_names_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError, match=re.escape(f"data.path: no such file or directory: {missing}")):
        load(str(missing))


@pytest.mark.parametrize("lines", [[], ["", "  ", "\t"]])
def test_empty_dataset_is_an_error(tmp_path, lines):
    path = write(tmp_path, lines)
    with pytest.raises(DatasetError, match=r"train\.jsonl: no rows"):
        load(path)


# --- sampler -------------------------------------------------------------------------------------


def next_batch(sampler: PromptSampler, n: int) -> list[int]:
    """The next ``n`` rows (the sampler draws (epoch, row) keys)."""
    return [row for _, row in sampler.draw(n)]


def draw(sampler: PromptSampler, sizes: list[int]) -> list[int]:
    return [i for n in sizes for i in next_batch(sampler, n)]


def test_sampler_deterministic_for_a_seed():
    assert draw(PromptSampler(50, seed=3), [7] * 20) == draw(PromptSampler(50, seed=3), [7] * 20)
    # batch boundaries do not change the sequence
    assert draw(PromptSampler(50, seed=3), [7] * 20) == draw(PromptSampler(50, seed=3), [1, 139])


def test_sampler_seeds_and_epochs_differ():
    a, b = PromptSampler(50, seed=0), PromptSampler(50, seed=1)
    assert next_batch(a, 50) != next_batch(b, 50)
    assert next_batch(a, 50) != next_batch(PromptSampler(50, seed=0), 50)  # epoch 1 != epoch 0


def test_every_index_once_per_epoch():
    sampler = PromptSampler(37, seed=5)
    for epoch in range(4):
        got = draw(sampler, [10, 10, 10, 7])
        assert sorted(got) == list(range(37))
        assert (sampler.epoch, sampler.position) == (epoch, 37)


def test_epoch_rollover_mid_batch():
    n = 10
    whole = draw(PromptSampler(n, seed=2), [n, n])  # epoch 0 then epoch 1
    sampler = PromptSampler(n, seed=2)
    assert (sampler.epoch, sampler.position) == (0, 0)
    first = next_batch(sampler, 7)
    assert (sampler.epoch, sampler.position) == (0, 7)
    straddle = next_batch(sampler, 6)  # 3 from epoch 0, 3 from epoch 1
    assert (sampler.epoch, sampler.position) == (1, 3)
    assert first + straddle == whole[:13]
    assert sorted(first + straddle[:3]) == list(range(n))


def test_batch_longer_than_an_epoch():
    sampler = PromptSampler(4, seed=0)
    batch = next_batch(sampler, 10)
    assert len(batch) == 10 and (sampler.epoch, sampler.position) == (2, 2)
    assert sorted(batch[:4]) == sorted(batch[4:8]) == [0, 1, 2, 3]
    assert next_batch(sampler, 0) == []


@pytest.mark.parametrize("consumed", [0, 5, 13, 20, 21, 40])
def test_state_dict_round_trip(consumed):
    """Resuming from a saved state continues exactly, also right at and across epoch boundaries."""
    sampler = PromptSampler(20, seed=9)
    next_batch(sampler, consumed)
    state = sampler.state_dict()
    assert state == json.loads(json.dumps(state))  # plain data
    expected = draw(sampler, [6] * 8)  # crosses at least two epoch boundaries

    resumed = PromptSampler(20, seed=9)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert (resumed.epoch, resumed.position) == (state["epoch"], state["position"])
    assert draw(resumed, [6] * 8) == expected


def test_load_state_dict_rejects_other_dataset_or_seed():
    state = PromptSampler(20, seed=9).state_dict()
    with pytest.raises(ValueError, match="num_rows=20 but this run has num_rows=21"):
        PromptSampler(21, seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=9 but this run has seed=0"):
        PromptSampler(20, seed=0).load_state_dict(state)
    del state["shuffle"]  # a checkpoint from before data.shuffle: it shuffled
    with pytest.raises(ValueError, match="shuffle=True but this run has shuffle=False"):
        PromptSampler(20, seed=9, shuffle=False).load_state_dict(state)


def test_a_resume_on_other_rows_of_the_same_count_is_said_once(caplog):
    rows = [{"id": f"r{i}", "prompt": f"Q{i}"} for i in range(20)]
    data = DataConfig(shuffle_seed=9)
    sampler = PromptSampler.for_data(rows, data)
    sampler.draw(7)
    state = json.loads(json.dumps(sampler.state_dict()))
    PromptSampler.for_data([dict(row) for row in rows], data).load_state_dict(state)  # the same rows: silent
    assert not caplog.records
    edited = [*rows[:3], {"id": "r3", "prompt": "Q3, fixed"}, *rows[4:]]
    resumed = PromptSampler.for_data(edited, data)
    resumed.load_state_dict(state)
    assert [r.getMessage() for r in caplog.records] == [
        "resume: the data's rows differ from the checkpoint's (20 rows, as there, but other ids or prompts): its "
        "position (epoch 0, 7 rows drawn) and retired rows go on by row index over these rows; resume on the "
        "checkpoint's data for the same order"]
    assert resumed.draw(5) == sampler.draw(5)  # it goes on all the same
    del state["digest"]  # a checkpoint from before digests: nothing to compare
    caplog.clear()
    PromptSampler.for_data(edited, data).load_state_dict(state)
    assert not caplog.records
    # a prompt object JSON does not hold is digested without its address (a new one in every process); one JSON
    # cannot order (dict keys of mixed types) is unknown, not a crash
    assert rows_digest([{"id": 0, "prompt": object()}]) == rows_digest([{"id": 0, "prompt": object()}])
    assert rows_digest([{"id": 0, "prompt": {1: "a", "b": 2}}]) == ""


def test_sampler_argument_errors():
    with pytest.raises(ValueError, match="num_rows=0"):
        PromptSampler(0)
    with pytest.raises(ValueError, match="batch size must be >= 0"):
        PromptSampler(3).draw(-1)


# --- formats and chat prompts ----------------------------------------------------------------------


def test_verl_parquet_and_chat_prompts_reach_the_token_ids(tmp_path):
    """verl's RL layout read as it is; a system prompt and chat_template_kwargs reach the ids exactly as
    apply_chat_template on the toy tokenizer writes them; string prompts keep their tokens."""
    import pandas as pd
    from transformers import AutoTokenizer

    from rollpacker.config import Config
    from rollpacker.controller import encode
    from rollpacker.toy.model import toy_model_dir

    path = tmp_path / "rl.parquet"
    pd.DataFrame({"prompt": [[{"role": "user", "content": "3+5"}],
                             [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "2+2"}]],
                  "data_source": ["toy", "toy"], "reward_model": [{"ground_truth": "8"}, {"ground_truth": "4"}],
                  "extra_info": [{"index": 0}, {"index": 1}]}).to_parquet(path)
    rows = load(str(path), ("toy",))
    assert [(r["id"], r["answer"], r["data_source"], r["extra_info"]) for r in rows] == [
        ("rl:1", "8", "toy", {"index": 0}), ("rl:2", "4", "toy", {"index": 1})]
    tok = AutoTokenizer.from_pretrained(toy_model_dir())
    tok.chat_template = "{% if greet %}Hi\n{% endif %}" + tok.chat_template  # a template that reads a kwarg
    config = Config()
    config.data.system_prompt = "Think."
    config.model.chat_template_kwargs = {"greet": True}
    for row, system in zip(rows, ["Think.", "Be exact."]):  # a row's own system turn wins
        user = row["prompt"][-1]["content"]
        expected = tok(f"Hi\n{system}\nQ: {user}\nA:", add_special_tokens=False)["input_ids"]
        assert encode(tok, config, row["prompt"]) == expected == tok.apply_chat_template(
            [{"role": "system", "content": system}, row["prompt"][-1]], add_generation_prompt=True, greet=True,
            tokenize=True)["input_ids"]
    plain = toy.make_dataset(1, 0)[0]["prompt"]
    assert encode(AutoTokenizer.from_pretrained(toy_model_dir()), Config(), plain) == tok(plain)["input_ids"]
    with pytest.raises(DatasetError, match=r"rl\.parquet: row 2: missing field 'answer' \(toy\)"):
        pd.DataFrame({"prompt": ["a", "b"], "reward_model": [{"ground_truth": "1"}, None]}).to_parquet(path)
        load(str(path), ("toy",))


def test_retired_rows_leave_every_later_epoch_and_a_resume_keeps_them():
    """A row solved by the share retire_solved asks is out of the epochs after the current one."""
    sampler = PromptSampler(10, seed=4, retire_solved=0.5)
    first = next_batch(sampler, 6)
    assert sampler.observe(first[0], [True, False]) and sampler.observe(first[2], [True, True])
    assert not sampler.observe(first[1], [False, False, False, True])  # 1 of 4 solved it
    assert sampler.remaining(2) == 4 + 8 and sampler.remaining(0) is None
    state = json.loads(json.dumps(sampler.state_dict()))
    rest = draw(sampler, [4, 8])  # epoch 0's last 4, then epoch 1 without the two
    assert sorted(first + rest[:4]) == list(range(10))
    assert sorted(rest[4:]) == sorted(set(range(10)) - {first[0], first[2]})
    assert sampler.sizes == [10, 8] and sampler.remaining(2) == 0 and sampler.epochs_drawn == 2
    resumed = PromptSampler(10, seed=4, retire_solved=0.5)
    resumed.load_state_dict(state)
    assert draw(resumed, [12]) == rest
    old = {k: state[k] for k in ("num_rows", "seed", "epoch", "position")}  # a checkpoint from before retirement
    resumed.load_state_dict(old)
    assert resumed.sizes == [10] and not resumed.retired and not resumed.retiring
    off = PromptSampler(3)
    assert not off.observe(0, [True]) and off.remaining(0) is None
    share = PromptSampler(3, retire_solved=0.28)  # 0.28 of 25 is 7 (the float product is 7.000000000000001)
    assert share.observe(0, [True] * 7 + [False] * 18) and not share.observe(1, [True] * 6 + [False] * 19)


def test_when_every_row_is_retired_nothing_is_left_to_draw():
    sampler = PromptSampler(3, retire_solved=1.0)
    for row in next_batch(sampler, 3):
        sampler.observe(row, [True, True])
    assert sampler.remaining(0) == 0 and sampler.remaining(5) == 0
    with pytest.raises(ValueError, match="every row is retired"):
        sampler.draw(1)


def test_unshuffled_epochs_go_in_the_datasets_order_and_a_resume_keeps_to_it():
    sampler = PromptSampler(5, seed=3, shuffle=False, retire_solved=1.0)
    assert next_batch(sampler, 5) == [0, 1, 2, 3, 4]
    sampler.observe(2, [True])
    assert next_batch(sampler, 4) == [0, 1, 3, 4]
    shuffled = PromptSampler(5, seed=3)
    with pytest.raises(ValueError, match="shuffle=False but this run has shuffle=True"):
        shuffled.load_state_dict(sampler.state_dict())


def test_empty_sources_and_joined_splits_of_other_columns(tmp_path):
    """An empty saved Dataset was load_from_disk's IndexError traceback, an empty .json or .parquet file datasets'
    words naming no emptiness; the rows of splits joined (train+test) lacked a column the other split has (a
    reward function naming it raised TypeError on them: scored 0); a bad line's column counted its newline."""
    import datasets

    datasets.Dataset.from_dict({"prompt": [], "answer": []}).save_to_disk(str(tmp_path / "empty_ds"))
    (tmp_path / "empty.json").write_text("[]")
    datasets.Dataset.from_dict({"prompt": [], "answer": []}).to_parquet(str(tmp_path / "empty.parquet"))
    for name, said in (("empty_ds", "load_from_disk cannot read it"), ("empty.json", "no rows (the data is empty)"),
                       ("empty.parquet", "no rows (the data is empty)")):
        with pytest.raises(DatasetError, match=re.escape(said)):
            load_rows(DataConfig(path=str(tmp_path / name)))
    datasets.DatasetDict(train=datasets.Dataset.from_list([{"prompt": "1+2", "answer": "3", "k": 1}]),
                         test=datasets.Dataset.from_list([{"prompt": "9+1", "answer": "10"}])).save_to_disk(
        str(tmp_path / "both"))
    rows = load_rows(DataConfig(path=str(tmp_path / "both"), split="train+test"))
    assert [row.get("k", "missing") for row in rows] == [1, None]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+2", "answer": "3"}\n{"prompt": "1+2", "answer": \n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: invalid JSON \(Expecting value at column 29\)"):
        load_rows(DataConfig(path=str(tmp_path / "bad.jsonl")))
