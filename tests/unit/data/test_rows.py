"""What a loaded row holds: its reference answer, its chat messages as written, its prompt, its default id,
and where a source that is no local file is read from."""

from __future__ import annotations

import json
import re

import pytest

from rollpacker.data.dataset import DataConfig, DatasetError, load_rows
from rollpacker.reward.config import RewardConfig
from rollpacker.reward.scheduler import build_functions, check_row


def write(tmp_path, records: list[dict], name: str = "train.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def load(path: str, funcs: tuple[str, ...] = ("math",), **config) -> list[dict]:
    """The rows of ``path`` as a run scoring them with ``funcs`` loads them."""
    functions = build_functions(RewardConfig(funcs=funcs))
    return load_rows(DataConfig(path=path, **config), lambda row: check_row(functions, row))


# --- data.answer_key -------------------------------------------------------------------------------


def test_an_answer_key_reads_its_column_alone_never_the_rows_answer_column(tmp_path):
    """GSM8K's answer column holds the worked solution; data.answer_key=final names the reference. A row
    without final is missing its reference, not scored against the solution text."""
    path = write(tmp_path, [{"prompt": "3+5", "answer": "3 and 5 make... #### 8", "final": "8"},
                            {"prompt": "2+2", "answer": "2 and 2 make... #### 4"}])
    with pytest.raises(DatasetError, match=r"train\.jsonl:2: missing field 'answer' \(math\): .* \(data\.answer_key "
                                           r"reads column 'final', which this row lacks; its columns: prompt, answer: "
                                           r"set data.answer_key to the one holding the answer\) \(fix the row"):
        load(path, answer_key="final")
    # TRL's math datasets' reference is solution: the default key's message named no column, only skip_bad_lines
    trl = write(tmp_path, [{"prompt": "3+5", "solution": "8"}], "trl.jsonl")
    with pytest.raises(DatasetError, match=r"reads column 'answer', which this row lacks; its columns: prompt, "
                                           r"solution: set data.answer_key"):
        load(trl)
    assert [(r["id"], r["answer"]) for r in load(path, answer_key="final", skip_bad_lines=True)] == [("train:1", "8")]
    # a row another reward function scores needs no reference: it loads, with none
    code = write(tmp_path, [{"prompt": "add", "answer": "solution text", "tests": [{"input": "", "output": "3"}]},
                            {"prompt": "3+5", "final": "8"}], "code.jsonl")
    assert load(code, ("math", "code"), answer_key="final")[0]["answer"] is None
    # verl's reward_model.ground_truth stands in for the default key only
    verl = write(tmp_path, [{"prompt": "p", "reward_model": {"ground_truth": "1"}}], "verl.jsonl")
    assert load(verl)[0]["answer"] == "1"
    with pytest.raises(DatasetError, match=r"verl\.jsonl:1: missing field 'answer'"):
        load(verl, answer_key="final")


# --- chat messages ---------------------------------------------------------------------------------

CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3+5"}}}
HISTORY = [{"role": "user", "content": "3+5"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "name": "calculator", "tool_call_id": "c1", "content": "8"}]


def test_messages_keep_their_tool_calls_and_names_and_render_as_the_template_renders_the_file(tmp_path):
    """Every key of a message reaches the template (TRL and verl pass messages unchanged) but the None
    Arrow writes for a key other messages have; an assistant turn with tool calls may have no content."""
    from rollpacker.data.chat import render
    from rollpacker.toy.tools_model import build_tools_tokenizer

    path = write(tmp_path, [{"prompt": HISTORY, "answer": "8"}, {"prompt": [{"role": "user", "content": "1+1"}],
                                                                  "answer": "2"}])
    rows = load(path)
    assert rows[0]["prompt"] == HISTORY
    assert rows[1]["prompt"] == [{"role": "user", "content": "1+1"}]  # no tool_calls: None, name: None
    tokenizer = build_tools_tokenizer()
    text = render(tokenizer, rows[0]["prompt"])
    assert text == tokenizer.apply_chat_template(HISTORY, add_generation_prompt=True, tokenize=False)
    assert text == ('Q: 3+5\nA: <tool_call>{"name": "calculator", "arguments": {"expression": "3+5"}}</tool_call>\n'
                    'R: 8\nA:')
    path = write(tmp_path, [{"prompt": [{"role": "user", "content": None}], "answer": "1"}], "bad.jsonl")
    with pytest.raises(DatasetError, match=r"bad\.jsonl:1: field 'prompt': message 0 is not a .* \(content may be "
                                           r"null with tool_calls\)"):
        load(path)


def test_a_parquet_tool_call_renders_without_the_arguments_of_other_rows_calls(tmp_path):
    """Arrow gives every call's arguments the union of the keys in the column: the calculator call got the
    ``code: null`` of another row's python call, and the template rendered it into the prompt."""
    import datasets

    python_call = {"type": "function", "function": {"name": "python", "arguments": {"code": "print(8)"}}}
    histories = [HISTORY, [{"role": "user", "content": "8?"}, {"role": "assistant", "content": None,
                                                             "tool_calls": [python_call]}]]
    path = tmp_path / "calls.parquet"
    datasets.Dataset.from_list([{"prompt": h, "answer": "8"} for h in histories]).to_parquet(path)
    assert [row["prompt"] for row in load(path)] == histories


# --- empty prompts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "what"), [("", "empty"), (" \n", "only whitespace")])
def test_an_empty_string_prompt_is_a_bad_row(tmp_path, prompt, what):
    path = write(tmp_path, [{"prompt": "1+1", "answer": "2"}, {"prompt": prompt, "answer": "3"}])
    with pytest.raises(DatasetError, match=rf"train\.jsonl:2: field 'prompt' is {what}: give the question"):
        load(path)
    assert [r["id"] for r in load(path, skip_bad_lines=True)] == ["train:1"]


def test_a_message_of_empty_content_loads_for_an_environment_that_writes_the_prompt(tmp_path):
    """docs/environments.md: [{"role": "user", "content": ""}] when reset writes it all."""
    path = write(tmp_path, [{"prompt": [{"role": "user", "content": ""}], "answer": "3"}])
    assert load(path)[0]["prompt"] == [{"role": "user", "content": ""}]


# --- joined splits ---------------------------------------------------------------------------------


def test_joined_splits_give_the_later_splits_rows_their_own_ids(tmp_path):
    """train+test numbers the test rows from 1 again: their default ids carry the split, so the load does
    not stop on duplicates it made itself; ids of a single split (train, test, slices) are as before."""
    import datasets

    path = tmp_path / "d"
    splits = {"train": [{"prompt": "1+1", "answer": "2"}, {"prompt": "2+2", "answer": "4"}],
              "test": [{"prompt": "3+3", "answer": "6"}, {"prompt": "4+4", "answer": None}]}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(str(path))
    assert [(r["id"], r["prompt"]) for r in load(str(path), split="train+test[:1]")] == [
        ("d:1", "1+1"), ("d:2", "2+2"), ("d:test:1", "3+3")]
    assert [r["id"] for r in load(str(path), split="test[:1]+train[1:]")] == ["d:1", "d:train:2"]
    assert [r["id"] for r in load(str(path), split="test[:1]")] == ["d:1"]
    assert [r["id"] for r in load(str(path), split="train[:1]+train[1:]")] == ["d:1", "d:2"]
    with pytest.raises(DatasetError, match=r"d: split test row 2: missing field 'answer'"):
        load(str(path), split="train+test")
    rows = load(str(path), split="train+test", skip_bad_lines=True)
    assert [r["id"] for r in rows] == ["d:1", "d:2", "d:test:1"]


# --- Hub ids and configs ---------------------------------------------------------------------------


@pytest.fixture
def hub(monkeypatch):
    """``datasets.load_dataset`` (the Hub: no network here) replaced by one that records its arguments."""
    import datasets

    calls = []

    def load_dataset(name, config=None):
        calls.append((name, config))
        return datasets.DatasetDict({"train": datasets.Dataset.from_list([{"question": "1+1", "answer": "2"}])})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


@pytest.mark.parametrize(("source", "call", "row_id"), [
    ("openai/gsm8k:main", ("openai/gsm8k", "main"), "gsm8k:1"),
    ("simplescaling/s1K-1.1", ("simplescaling/s1K-1.1", None), "s1K-1.1:1"),
    ("a-m-team/AM-DeepSeek-R1-Distilled-1.4M", ("a-m-team/AM-DeepSeek-R1-Distilled-1.4M", None),
     "AM-DeepSeek-R1-Distilled-1.4M:1"),
])
def test_a_name_nothing_local_has_goes_to_the_hub_with_its_config(hub, source, call, row_id):
    rows = load(source, prompt_key="question")
    assert hub == [call] and [(r["id"], r["prompt"]) for r in rows] == [(row_id, "1+1")]


def test_two_configs_of_one_hub_dataset_are_named_as_given(hub):
    rows = load_rows(DataConfig(path=("openai/gsm8k:main", "openai/gsm8k:socratic"), prompt_key="question"))
    assert [(r["id"], r["data_source"]) for r in rows] == [("openai/gsm8k:main:1", "openai/gsm8k:main"),
                                                           ("openai/gsm8k:socratic:1", "openai/gsm8k:socratic")]


def test_a_missing_dataset_file_or_directory_is_no_hub_id(hub, tmp_path, monkeypatch):
    """Before, a missing directory went to the Hub, and its error read as a download that failed."""
    monkeypatch.chdir(tmp_path)
    for missing in (tmp_path / "nope.parquet", tmp_path / "saved", "../saved", "data/math/saved"):
        with pytest.raises(DatasetError, match=f"data.path: no such file or directory: {re.escape(str(missing))} "):
            load(str(missing))
    assert hub == []


def test_a_hub_snapshot_directory_is_read_with_its_config(tmp_path, monkeypatch):
    """What huggingface-cli download writes: a dataset repository whose README names its configs."""
    import datasets
    import pandas as pd

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    repo = tmp_path / "gsm8k"
    for config in ("main", "socratic"):
        (repo / config).mkdir(parents=True)
        pd.DataFrame({"question": [f"{config} 1+1?"], "answer": ["#### 2"]}).to_parquet(repo / config / "train.parquet")
    (repo / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: "
                                    "main/train.parquet\n- config_name: socratic\n  data_files:\n  - split: train\n"
                                    "    path: socratic/train.parquet\n---\n")
    rows = load(f"{repo}:socratic", prompt_key="question")
    assert [(r["id"], r["prompt"], r["answer"]) for r in rows] == [("gsm8k:1", "socratic 1+1?", "#### 2")]
    with pytest.raises(DatasetError, match=r"gsm8k is a directory that neither load_from_disk .* Config name is "
                                           r"missing(.|\n)*named NAME:CONFIG"):
        load(str(repo), prompt_key="question")


def test_a_hub_dataset_out_of_reach_is_said_without_the_config_hint_when_a_config_was_given(monkeypatch):
    import datasets

    def unreachable(name, config=None):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(DatasetError) as named:
        load("openai/gsm8k:main")
    assert "(ConnectionError: no network)" in str(named.value) and "NAME:CONFIG" not in str(named.value)
    with pytest.raises(DatasetError, match=r"\(ConnectionError: no network\); a dataset of several configs is named "
                                           r"NAME:CONFIG"):
        load("openai/gsm8k")
