"""Token in, token out: canonical model tokens plus observation deltas are the whole conversation's render."""

from __future__ import annotations

import pytest

from rollpacker.env.config import EnvConfig
from rollpacker.env.contract import StepResult
from rollpacker.env.episode import Episode, StepEnv, TurnRequest
from rollpacker.env.render import ChatBridge, TemplateBreak
from rollpacker.env.setup import Environments
from tests.support.chat import (
    COUNTING_TEMPLATE,
    QWEN3_STYLE_TEMPLATE,
    QWEN_STYLE_TEMPLATE,
    chat_tokenizer,
    llama3_style_tokenizer,
    mistral_style_tokenizer,
    qwen_style_tokenizer,
)

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+3, then times 7?"},
    {"role": "assistant", "content": "Let me add first.", "tool_calls": [CALL]},
    {"role": "tool", "name": "add", "content": "5"},
    {"role": "assistant", "content": "So 5 times 7 is 35. #### 35"},
    {"role": "user", "content": "Wrong, try again: 5 * 7 ="},
    {"role": "assistant", "content": "Adding twice.", "tool_calls": [CALL, CALL]},
    {"role": "tool", "name": "add", "content": "5"},
    {"role": "tool", "name": "add", "content": "5"},
    {"role": "assistant", "content": "It is 35.\n#### 35"},
]


def play(bridge: ChatBridge, conversation: list[dict], sample, tools: list[dict] | None = None
         ) -> tuple[Episode, list[int]]:
    """Run ``conversation`` through an episode (prompted with ``tools``): its assistant turns as the model's tokens
    (``sample`` gives a turn's tokens), the rest as observations. Returns the episode and the last turn's ids."""
    first = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    episode = Episode("0:0:0", bridge.prompt_ids(conversation[:first], tools), bridge, seed=0, max_turns=99,
                      max_tokens=10_000, max_new_tokens=1000, max_context=100_000, tools=tools)
    request, turn = episode.next_turn(), []
    observation: list[dict] = []
    for i in range(first, len(conversation)):
        m = conversation[i]
        if m["role"] != "assistant":
            observation.append(m)
            continue
        if observation:
            request = episode.on_step(StepResult(observation))
            observation = []
        assert isinstance(request, TurnRequest) and request.prompt_ids == episode.prompt_ids + episode.response_ids
        turn = sample(conversation[:i], m)
        assert isinstance(episode.on_turn(turn, [-0.5] * len(turn), "stop"), StepEnv)
    return episode, turn


def canonical(bridge: ChatBridge, before: list[dict], message: dict, stop: int) -> list[int]:
    """The template's own tokens of an assistant turn, up to and including the model's stop token."""
    head, whole = bridge.prompt_ids(before), bridge.encode(bridge.render([*before, message]))
    assert whole[:len(head)] == head
    turn = whole[len(head):]
    if stop in turn:  # the template writes the stop token: the model's turn ends there
        return turn[:turn.index(stop) + 1]
    end = len(bridge.end_of_turn)  # else the model's stop token stands where the template ends the turn
    assert turn[-end:] == bridge.end_of_turn
    return [*turn[:-end], stop]


def test_qwen_style_canonical_tokens_and_deltas_are_the_whole_render():
    tokenizer = qwen_style_tokenizer()
    bridge = ChatBridge(tokenizer, tools=TOOLS)
    eos = tokenizer.eos_token_id  # <|im_end|>: the model samples it, the template's "\n" after it is the delta's
    episode, last = play(bridge, CONVERSATION, lambda before, m: canonical(bridge, before, m, eos))
    whole = bridge.encode(bridge.render(CONVERSATION))
    tail = bridge.observation_ids([], last)[:1]  # the template's "\n" after the last <|im_end|>
    assert episode.prompt_ids + episode.response_ids + tail == whole
    assert bridge.end_of_turn == bridge.encode("<|im_end|>\n")
    assert episode.num_turns == 4 and episode.num_model_tokens == sum(episode.loss_mask)
    model = [t for t, m in zip(episode.response_ids, episode.loss_mask) if m]
    assert tokenizer.decode(model).count("<|im_end|>") == 4  # each turn's stop token is the model's
    assert "<tool_response>" in tokenizer.decode([t for t, m in zip(episode.response_ids, episode.loss_mask) if not m])


def test_toy_canonical_tokens_and_deltas_are_the_whole_render_but_for_the_eos_the_model_samples():
    """The toy template renders no EOS after an answer; the model samples one (kept: token out), and
    the template's "\\n" follows it."""
    from transformers import AutoTokenizer

    from rollpacker.toy.model import toy_model_dir

    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir())
    bridge = ChatBridge(tokenizer)
    eos = tokenizer.eos_token_id
    conversation = [{"role": "user", "content": "3+5-2"}, {"role": "assistant", "content": " 3+5=8\n8-2=7\n#### 7"},
                    {"role": "user", "content": "3+5-2"}, {"role": "assistant", "content": " 3+5=8\n8-2=6\n#### 6"}]
    episode, _ = play(bridge, conversation, lambda before, m: canonical(bridge, before, m, eos))
    assert episode.prompt_ids == tokenizer("Q: 3+5-2\nA:")["input_ids"]  # the toy task's own prompt
    stitched = episode.prompt_ids + episode.response_ids
    assert stitched.count(eos) == 2
    assert [t for t in stitched if t != eos] + bridge.end_of_turn == bridge.encode(bridge.render(conversation))


def test_a_template_that_rewrites_earlier_turns_is_caught_naming_it():
    tokenizer = qwen_style_tokenizer(COUNTING_TEMPLATE)
    tokenizer.name_or_path = "counting-template"
    bridge = ChatBridge(tokenizer)
    with pytest.raises(TemplateBreak, match="counting-template is not prefix-preserving for observations of roles "
                                            r"\('user',\).*env.template_breaks=count"):
        bridge.observation_ids([{"role": "user", "content": "again"}], [5, 6])
    counting = ChatBridge(tokenizer, template_breaks="count")
    ids = counting.observation_ids([{"role": "user", "content": "again"}], [5, 6])
    assert counting.breaks == 1 and tokenizer.decode(ids) == "\nuser: again\nassistant:"  # the end of turn, the delta


def test_counted_template_breaks_are_logged_and_said_once(caplog):
    """With env.template_breaks count, the breaks are the step's env/template_breaks (they were counted and never
    logged), and the first is said once: the model trains on turns its template would not render."""
    counting = ChatBridge(qwen_style_tokenizer(COUNTING_TEMPLATE), template_breaks="count")
    envs = Environments(cfg=EnvConfig(tools=("rollpacker.toy.tools:calculator",), template_breaks="count"),
                        pool=None, bridge=counting, encode=None, seed=0, max_new_tokens=8, max_context=64)
    for _ in range(3):
        counting.observation_ids([{"role": "user", "content": "again"}], [5, 6])
    assert envs.take_metrics()["env/template_breaks"] == 3 and envs.take_metrics()["env/template_breaks"] == 0
    assert [r.getMessage().count("env/template_breaks counts them; said once") for r in caplog.records] == [1]


def test_a_template_that_puts_a_turn_before_an_assistant_turn_once_one_follows_is_caught():
    """Not Qwen3's think block, dropped from the assistant turn: a turn inserted before it, which the episode's
    tokens never hold."""
    template = QWEN_STYLE_TEMPLATE.replace(
        "{%- elif m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + m.content }}",
        "{%- elif m.role == 'assistant' %}{% if not loop.last %}{{ '<|im_start|>system\\nNOTE<|im_end|>\\n' }}"
        "{% endif %}{{ '<|im_start|>assistant\\n' + m.content }}")
    assert template != QWEN_STYLE_TEMPLATE
    with pytest.raises(TemplateBreak, match=r"not prefix-preserving .* from character \d+ \(before: .*after: .*NOTE"):
        ChatBridge(qwen_style_tokenizer(template)).delta([{"role": "user", "content": "again"}])


def test_a_template_that_moves_the_episodes_tools_is_caught_with_them():
    """Mistral v3 writes the tools before the last user turn: appending one moves them. Without the
    episode's tools the render preserves the prefix; its observations are checked with them."""
    bridge = ChatBridge(mistral_style_tokenizer())
    again = [{"role": "user", "content": "Wrong, try again."}]
    assert bridge.delta(again) == "[INST] Wrong, try again.[/INST]"
    conversation = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "6"}, *again,
                    {"role": "assistant", "content": "5"}]
    with pytest.raises(TemplateBreak, match="not prefix-preserving for observations of roles"):
        play(bridge, conversation, lambda before, m: bridge.encode(m["content"]) + [bridge.tokenizer.eos_token_id],
             tools=TOOLS)


ALTERNATING = ("{% for m in messages %}{% if (m.role == 'user') != loop.index0 is even %}"
               "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
               "{{ '<turn>' + m.role + '\n' + m.content + '<end>\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<turn>assistant\n' }}{% endif %}")


def test_a_template_that_refuses_an_observation_says_so_naming_its_roles():
    bridge = ChatBridge(chat_tokenizer(ALTERNATING, ["<pad>", "<turn>", "<end>"], eos="<end>"))
    assert bridge.delta([{"role": "user", "content": "again"}]) == "<turn>user\nagain<end>\n<turn>assistant\n"
    with pytest.raises(TemplateBreak, match=r"refuses observations of roles \('tool',\) after an assistant turn "
                                            r"\(TemplateError: roles must alternate user/assistant\): set "
                                            "env.observation_role"):
        bridge.delta([{"role": "tool", "name": "add", "content": "5"}])


def test_a_template_that_refuses_tool_results_is_refused_before_the_first_call_naming_what_fixes_it():
    """Gemma 2's template takes only alternating user and assistant turns: the run stopped at the first tool result,
    mid-run, saying to set env.observation_role (a string observation's role; tool results are always role tool)."""
    bridge = ChatBridge(chat_tokenizer(ALTERNATING, ["<pad>", "<turn>", "<end>"], eos="<end>"))
    with pytest.raises(TemplateBreak, match=r"refuses observations of roles \('tool',\) after an assistant turn .*"
                                            r"\(a string observation's role: tool results are role tool\), or use a "
                                            r"template that takes them \(model.path's chat_template\)"):
        bridge.check_tool_parser("hermes")


def test_a_tool_observation_without_an_id_gets_one_mistrals_template_takes():
    """A string observation of env.observation_role tool names no call: it gets an id of Mistral's form (its template
    refuses a result without one), which the base turn's call has too."""
    bridge = ChatBridge(mistral_style_tokenizer())
    assert bridge.delta([{"role": "tool", "content": "Higher."}]) == (
        '[TOOL_RESULTS] {"content": "Higher.", "call_id": "call00000"}[/TOOL_RESULTS]')


def test_a_tool_result_renders_under_a_template_that_joins_the_calls_arguments_as_text():
    """DeepSeek's templates concatenate a call's arguments (a string): the base turn's call with a dict raised
    TypeError out of the episode at its first tool result, and the run stopped."""
    joins = QWEN_STYLE_TEMPLATE.replace(
        "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}",
        "{{ '{\"name\": \"' + call.function.name + '\", \"arguments\": ' + call.function.arguments + '}' }}")
    assert joins != QWEN_STYLE_TEMPLATE
    result = [{"role": "tool", "name": "add", "content": "5"}]
    expected = ChatBridge(qwen_style_tokenizer()).delta(result, TOOLS)
    assert ChatBridge(qwen_style_tokenizer(joins)).delta(result, TOOLS) == expected
    refusing = joins.replace("call.function.arguments + '}'", "call.function.arguments + 1")  # neither form
    with pytest.raises(TemplateBreak, match=r"refuses observations of roles \('tool',\) after an assistant turn "
                                            r"\(TypeError: "):
        ChatBridge(qwen_style_tokenizer(refusing)).delta(result, TOOLS)


def test_a_template_that_refuses_the_turn_before_an_observation_says_so_naming_its_roles():
    """Mistral's template refuses the base turn's call of an id not of its form (Hermes' call_0), before the
    observation is rendered: the same error as a refused observation, naming the setting."""
    bridge = ChatBridge(mistral_style_tokenizer())
    with pytest.raises(TemplateBreak, match=r"refuses observations of roles \('tool',\) after an assistant turn "
                                            r"\(TemplateError: Tool call IDs should be alphanumeric strings with "
                                            r"length 9!\): set env.observation_role"):
        bridge.delta([{"role": "tool", "name": "add", "tool_call_id": "call_0", "content": "5"}])


@pytest.mark.parametrize("observation, delta", [
    ({"role": "tool", "name": "add", "content": "5"},
     "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"),
    ({"role": "user", "content": "again"}, "<|im_start|>user\nagain<|im_end|>\n")])
@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3s_template_rewriting_the_assistant_turn_alone_is_no_break(observation, delta, thinking):
    """Qwen3's template shows the last assistant turn's empty think block only while no turn follows it: the
    assistant turn is rewritten, but not the turns before it nor its end, and in an episode the model's own tokens
    stand in for that turn. The delta is what follows the turn's end; nothing is counted as a break."""
    tokenizer = qwen_style_tokenizer(QWEN3_STYLE_TEMPLATE)
    bridge = ChatBridge(tokenizer, tools=TOOLS, template_kwargs={"enable_thinking": thinking})
    turn = tokenizer('<think>\nAdd them.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
                     '</tool_call><|im_end|>', add_special_tokens=False)["input_ids"]
    ids = bridge.observation_ids([observation], turn, TOOLS)
    header = "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")
    assert tokenizer.decode(ids) == "\n" + delta + header and bridge.breaks == 0


def test_a_turn_stopped_by_a_stop_string_gets_the_whole_end_of_turn():
    """The model stopped on "</tool_call>" (a stop string), not on <|im_end|>: the template's end of
    turn follows whole, and the action's text is cut before the stop string."""
    tokenizer = qwen_style_tokenizer()
    bridge = ChatBridge(tokenizer, stop=("</tool_call>",))
    turn = tokenizer('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
                     add_special_tokens=False)["input_ids"]
    ids = bridge.observation_ids([{"role": "tool", "name": "add", "content": "5"}], turn)
    assert tokenizer.decode(ids).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>")
    assert bridge.action_text(turn) == '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'


def test_a_turn_that_stops_on_another_eos_id_ends_there_without_the_templates_end_of_turn_token():
    """Llama 3.1 ends a tool call with <|eom_id|> (an EOS id the engines stop at): the template's <|eot_id|> was
    added after it, two ends of turn in a row that no template renders."""
    tokenizer = llama3_style_tokenizer()
    vocab = tokenizer.get_vocab()
    bridge = ChatBridge(tokenizer, eos=(vocab["<|end_of_text|>"], vocab["<|eom_id|>"], vocab["<|eot_id|>"]))
    turn = [*bridge.encode('<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}'), vocab["<|eom_id|>"]]
    ids = bridge.observation_ids([{"role": "tool", "name": "add", "content": "5"}], turn)
    assert tokenizer.decode(ids).startswith("<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>")
    assert bridge.observation_ids([], [*turn[:-1], vocab["<|eot_id|>"]]) == bridge.observation_ids([], turn)
    assert bridge.observation_ids([], turn[:-1])[:1] == [vocab["<|eot_id|>"]]  # no EOS: the template's end follows


def test_a_turn_cut_on_the_templates_end_of_turn_token_gets_the_whole_end_of_turn():
    """A turn cut at its token limit (it goes to the environment) whose last token happens to be the
    template's first end-of-turn token (the toy's "\\n") stopped on nothing: the whole end of turn
    follows, so the tokens are the render of the conversation with that turn as its content."""
    from transformers import AutoTokenizer

    from rollpacker.toy.model import toy_model_dir

    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir())
    bridge = ChatBridge(tokenizer)
    conversation = [{"role": "user", "content": "3+5-2"}, {"role": "assistant", "content": " 3+5=8\n"},
                    {"role": "user", "content": "Go on."}]
    turn = bridge.encode(" 3+5=8\n")
    assert turn[-1] == bridge.end_of_turn[0]
    episode = Episode("0:0:0", bridge.prompt_ids(conversation[:1]), bridge, seed=0, max_turns=3, max_tokens=100,
                      max_new_tokens=len(turn), max_context=1000)
    assert episode.on_turn(turn, [-0.5] * len(turn), "length") == StepEnv(" 3+5=8\n")
    assert isinstance(episode.on_step(StepResult(conversation[2:])), TurnRequest)
    assert episode.prompt_ids + episode.response_ids == bridge.prompt_ids(conversation)


def test_a_plain_string_prompt_beside_templated_observations_is_refused_unless_it_ends_as_a_rendered_one():
    """A ChatML model's first turn would follow a bare question (no user turn, no assistant header) while every
    observation comes in the template's turns; a string rendered already (the toy task's rows), chat messages, a
    string with tools (rendered through the template with them) or with model.chat_template are fine."""
    from rollpacker.env.config import EnvConfig
    from rollpacker.env.render import ChatBridge
    from rollpacker.env.setup import Environments
    from rollpacker.errors import UserError

    bridge = ChatBridge(qwen_style_tokenizer())

    def envs(templated: bool = False) -> Environments:
        return Environments(cfg=EnvConfig(factory="toy"), pool=None, bridge=bridge, encode=lambda p, t: [1, 2],
                            seed=0, max_new_tokens=8, max_context=100, templated=templated)

    rendered = bridge.render([{"role": "user", "content": "2+2"}], generation=True)
    rows = [{"id": "a", "prompt": rendered}, {"id": "b", "prompt": [{"role": "user", "content": "2+2"}]},
            {"id": "c", "prompt": "2+2"}]
    make = envs().maker(rows, lambda row: [1, 2])
    make("0:0:0", 0, None), make("0:1:0", 1, None), make("0:2:0", 2, ("2+2", {"tools": TOOLS}))
    make("0:1:1", 1, ([{"role": "user", "content": "3+3"}], {}))
    envs(templated=True).maker(rows, lambda row: [1, 2])("0:2:0", 2, None)
    make("0:2:2", 2, None)  # an episode whose environment never opened, failed at once: nothing rendered
    for reset in ((None, {}), ("a question of its reset's", {})):
        with pytest.raises(UserError, match=r"data row 'c': its episode's prompt is a plain string, tokenized as it "
                                            r"is, but the environment's observations go through the chat template, "
                                            r"which ends a user turn with .*assistant.*: set --model.chat-template"):
            make("0:2:1", 2, reset)


def test_a_prompt_of_empty_messages_is_refused_without_an_environment_to_write_it():
    from rollpacker.data.dataset import DatasetError
    from rollpacker.env.setup import Environments

    rows = [{"id": "a", "prompt": [{"role": "user", "content": "2+2"}]},
            {"id": "b", "prompt": [{"role": "system", "content": " "}, {"role": "user", "content": ""}]}]
    Environments.none(8).check_prompts(rows[:1])
    with pytest.raises(DatasetError, match=r"data row 'b': every message of its prompt is empty, and no environment"):
        Environments.none(8).check_prompts(rows)
