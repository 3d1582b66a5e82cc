"""The toy tool task (calculator, data, reward), the toy tools model's template, its SFT episodes, and
the shipped model: it loads, renders tools and tool messages, and calls the tool on some prompts."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer
from transformers.utils import get_json_schema

from rollpacker.config import ModelConfig
from rollpacker.data.dataset import DataConfig, load_eval_rows, load_rows, toy_held_out
from rollpacker.env.render import ChatBridge
from rollpacker.env.tools import hermes
from rollpacker.toy import tools as toy_tools
from rollpacker.toy import tools_model as ttm

CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "47*86"}}}


def test_calculator_evaluates_arithmetic_and_refuses_the_rest():
    assert toy_tools.calculator("47*86") == "4042"
    assert toy_tools.calculator(" (2+3)*4 - -1 ") == "21"
    assert toy_tools.calculator("7/2") == "3.5" and toy_tools.calculator("8/2") == "4"
    for bad in ("2**99", "x", "'a'", "__import__('os')", "1.5*2", "9" * 101):
        with pytest.raises(ValueError):
            toy_tools.calculator(bad)
    with pytest.raises(ZeroDivisionError):
        toy_tools.calculator("1/0")
    schema = get_json_schema(toy_tools.calculator)["function"]
    assert schema["name"] == "calculator" and schema["parameters"]["required"] == ["expression"]


def test_dataset_is_deterministic_half_hard_and_right():
    rows = toy_tools.make_dataset(400, seed=3)
    assert rows == toy_tools.make_dataset(400, seed=3) != toy_tools.make_dataset(400, seed=4)
    assert len({r["id"] for r in rows}) == 400
    assert 0.4 < sum(r["data_source"] == "hard" for r in rows) / 400 < 0.6
    for r in rows:
        a, op, b = r["prompt"].partition("*") if "*" in r["prompt"] else (r["prompt"], "", "")
        if r["data_source"] == "hard":
            assert op and 10 <= int(a) <= 99 and 10 <= int(b) <= 99 and r["answer"] == str(int(a) * int(b))
        else:
            assert len(r["prompt"]) == 3 and int(r["answer"]) >= 0
            assert r["answer"] == str(eval(r["prompt"]))  # noqa: S307  (our own digits and operator)


def test_data_config_generates_the_tool_task_with_held_out_rows():
    config = DataConfig(toy_task="tools", num_toy_prompts=5, num_eval_prompts=4, toy_seed=2)
    assert load_rows(config) == toy_tools.make_dataset(5, 2, keep=lambda row: not toy_held_out(row))
    assert load_eval_rows(config) == toy_tools.make_dataset(4, toy_tools.EVAL_SEED + 2, keep=toy_held_out)
    # the preset's: none is a training prompt (the easy problems are few), half of them easy as in training
    config = DataConfig(toy_task="tools")
    held_out = load_eval_rows(config)
    assert len(held_out) == 256 and not {r["prompt"] for r in held_out} & {r["prompt"] for r in load_rows(config)}
    assert 0.4 < sum(r["data_source"] == "easy" for r in held_out) / 256 < 0.6
    with pytest.raises(ValueError, match="data.toy_task must be one of arithmetic, tools"):
        DataConfig(toy_task="calculator")


def test_correct_scores_the_last_assistant_turn():
    call = ttm.call_text("47*86")
    episode = [{"role": "assistant", "content": call}, {"role": "tool", "content": "4042"},
               {"role": "assistant", "content": " #### 4042"}]
    assert toy_tools.correct([episode], ["4042"]) == [1.0]
    assert toy_tools.correct([episode[:2]], ["4042"]) == [0.0]  # cut after the call: the tool's result is no answer
    assert toy_tools.correct([" #### 12", "12"], ["12", "12"]) == [1.0, 0.0]
    assert toy_tools.correct([episode]) == [None]


def test_template_renders_the_tools_it_is_given_and_tool_messages():
    tokenizer = ttm.build_tools_tokenizer()
    calc = get_json_schema(toy_tools.calculator)
    other = {"type": "function", "function": {"name": "lookup", "description": "Look up a word.", "parameters": {
        "type": "object", "properties": {"word": {"type": "string"}, "limit": {"type": "integer"}}}}}
    conversation = [{"role": "user", "content": "47*86"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                    {"role": "tool", "name": "calculator", "content": "4042"},
                    {"role": "assistant", "content": " #### 4042"}]
    assert tokenizer.apply_chat_template(conversation, tools=[calc, other], tokenize=False) == (
        "Tools: calculator(expression: string) lookup(word: string, limit: integer)\n"
        f"Q: 47*86\nA:{ttm.call_text('47*86')}\nR: 4042\nA: #### 4042\n")
    assert tokenizer.apply_chat_template(conversation[:1], tokenize=False, add_generation_prompt=True) == (
        "Q: 47*86\nA:")
    assert hermes(ttm.call_text("47*86"))[0].arguments == {"expression": "47*86"}  # what the model writes parses


def test_sft_episodes_are_the_template_render_with_the_models_eos():
    """The SFT tokens are what a run's episode holds: the template's render of the conversation, each
    model turn ending in the EOS the model samples (the template's "\\n" follows it), tool results from
    the real ToolEnv."""
    tokenizer = ttm.build_tools_tokenizer()
    episodes = ttm.EpisodeTokens(tokenizer)
    bad = ttm.call_text("47*86", argument="expr")
    actions = [bad, ttm.call_text("47*86"), " #### 4042"]
    ids, mask = episodes.episode("47*86", True, actions)
    eos = tokenizer.decode([tokenizer.eos_token_id])
    error = "error: TypeError: calculator() got an unexpected keyword argument 'expr'"
    assert tokenizer.decode(ids) == (f"Tools: calculator(expression: string)\nQ: 47*86\nA:{bad}{eos}\nR: {error}\n"
                                     f"A:{ttm.call_text('47*86')}{eos}\nR: 4042\nA: #### 4042{eos}")
    model = [t for t, m in zip(ids, mask) if m]
    assert tokenizer.decode(model) == "".join(a + eos for a in actions)
    bridge = ChatBridge(tokenizer)
    assert bridge.delta([{"role": "tool", "name": "calculator", "content": "4042"}]) == "R: 4042\nA:"


@pytest.mark.parametrize("seed", [0, 1])
def test_sft_mix_calls_on_hard_problems_more_answers_directly_mostly_and_sometimes_fails(seed):
    """The behaviour the SFT data teaches (the episodes whose choice to call is trained): direct answers
    mostly, calls more often on hard problems than on easy ones, some failed calls; practice episodes call
    without training that choice."""
    rng, cfg = random.Random(seed), ttm.SFTConfig()
    counts = {(kind, what): 0 for kind in toy_tools.KINDS for what in ("direct", "call", "failed")}
    no_tools = practice = 0
    for _ in range(4000):
        problem = toy_tools.make_problem(rng)
        with_tools, actions, choice = ttm.sft_actions(rng, problem, cfg)
        assert actions[-1] == f" #### {problem['answer']}" or not with_tools or len(actions) > 1
        if not with_tools:
            no_tools += 1
            assert actions == [f" #### {problem['answer']}"] and choice
            continue
        if not choice:
            practice += 1
            assert len(actions) > 1
            continue
        calls = hermes(actions[0])
        what = "direct" if not calls else "call" if calls[0].arguments.keys() == {"expression"} else "failed"
        counts[problem["data_source"], what] += 1
    assert no_tools > 300 and practice > 800
    for kind in toy_tools.KINDS:
        assert counts[kind, "direct"] > counts[kind, "call"] > counts[kind, "failed"] > 0, counts
    hard, easy = (counts[k, "call"] + counts[k, "failed"] for k in ("hard", "easy"))
    assert hard > 2 * easy, counts


def test_a_practice_episode_trains_everything_but_the_choice_to_call():
    tokenizer = ttm.build_tools_tokenizer()
    cfg = ttm.SFTConfig(practice_frac=1.0, malformed_frac=0.0, tools_frac=1.0, batch_tokens=100)
    tokens, _, targets, _ = ttm.sft_batch(random.Random(0), ttm.EpisodeTokens(tokenizer), cfg)
    text = tokenizer.decode(tokens.tolist())
    trained = tokenizer.decode([t for t in targets.tolist() if t >= 0])
    assert "A: <tool_call>" in text and trained.startswith('tool_call>{"name": "calculator"')


def test_the_shipped_model_is_the_package_default_for_its_name():
    assert ttm.model_dir() == ttm.MODEL_DIR
    assert ModelConfig(path="toy-tools").directory() == ttm.MODEL_DIR and ModelConfig(path="toy-tools").shipped
    tokenizer = AutoTokenizer.from_pretrained(ttm.MODEL_DIR)
    assert tokenizer.chat_template == ttm.CHAT_TEMPLATE
    assert sum(f.stat().st_size for f in ttm.MODEL_DIR.iterdir()) < 5_000_000


@pytest.fixture(scope="module")
def shipped():
    from rollpacker.model import load_model
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.torch_engine import TorchEngine

    return TorchEngine(load_model(ttm.MODEL_DIR), EngineConfig()), AutoTokenizer.from_pretrained(ttm.MODEL_DIR)


def test_shipped_model_sometimes_calls_the_tool_and_answers_from_its_result(shipped):
    """Sampled (seeded) on held-out problems: some episodes call the calculator, some answer directly,
    and calls that run are mostly answered with their result; without the tools line it never calls."""
    engine, tokenizer = shipped
    rows = toy_tools.make_dataset(64, toy_tools.EVAL_SEED)
    results = ttm.run_episodes(engine, tokenizer, rows, temperature=1.0, seed=0)
    called = [r for r in results if r["tool_calls"]]
    assert 0.1 * len(rows) <= len(called) <= 0.6 * len(rows)
    assert any(r["tool_errors"] == 0 and r["success"] for r in called if r["kind"] == "hard")
    assert all(r["tool_calls"] == 0 for r in ttm.run_episodes(engine, tokenizer, rows[:16], temperature=1.0,
                                                                seed=0, with_tools=False))


def test_eval_runs_no_call_of_the_last_turn_as_a_run_does(shipped):
    """env.max_turns: a run does not run the last turn's calls; eval's environment, never reset, ran them (an
    episode of 3 turns counted 3 calls)."""
    engine, tokenizer = shipped
    rows = [r for r in toy_tools.make_dataset(256, toy_tools.EVAL_SEED) if r["data_source"] == "hard"][:64]
    results = ttm.run_episodes(engine, tokenizer, rows, temperature=2.0, seed=0)  # a call a turn, at most
    assert all(r["tool_calls"] < r["turns"] for r in results)
    assert any(r["turns"] == ttm.MAX_TURNS and r["tool_calls"] == ttm.MAX_TURNS - 1 for r in results)


def test_shipped_model_greedy_answers_easy_problems_in_its_head(shipped):
    """The room RL has: greedy, the model answers directly, right on most easy problems, wrong on hard ones."""
    engine, tokenizer = shipped
    summary = {kind: rest for kind, *rest in ttm.summarize(ttm.run_episodes(
        engine, tokenizer, toy_tools.make_dataset(64, toy_tools.EVAL_SEED)))}
    _, easy, easy_called, _ = summary["easy"]
    _, hard, hard_called, _ = summary["hard"]
    assert easy >= 0.7 and hard <= 0.2 and easy_called <= 0.2 and hard_called <= 0.5
