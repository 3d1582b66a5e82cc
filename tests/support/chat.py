"""Chat tokenizers built here (nothing downloads): a Qwen-style ChatML tokenizer with tools, the
tool-call layouts of the families ``env.tool_parser`` reads (Qwen3-Coder, Llama 3.1, Mistral), and
templates that are not prefix-preserving, for the episode tests; and the source of a tool, for the tool
files they write."""

from __future__ import annotations

ADD_TOOL = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b
'''
"""The source of ``add(a, b)``, a tool with a docstring its JSON schema is read from."""

QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nCall any of these functions:\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ '</tools>\\nA call is <tool_call>{\\\"name\\\": NAME, \\\"arguments\\\": ARGS}</tool_call>.<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role in ('user', 'system') %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + m.content }}"
    "{%- for call in m.tool_calls or [] %}{{ '\\n<tool_call>\\n' }}"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}{{ '\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML as Qwen2.5 lays it out (written for these tests): tools in the system turn, calls as
``<tool_call>`` JSON in the assistant turn, consecutive tool results in one user turn."""

QWEN3_STYLE_TEMPLATE = (
    "{%- set ns = namespace(query=-1) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.query = loop.index0 %}{% endif %}{% endfor %}"
    + QWEN_STYLE_TEMPLATE.replace(
        "{{ '<|im_start|>assistant\\n' + m.content }}",
        "{{ '<|im_start|>assistant\\n' }}{%- if loop.index0 > ns.query and (loop.last or m.reasoning_content) %}"
        "{{ '<think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n\\n' }}{% endif %}{{ m.content }}")
    .replace("{{ '<|im_start|>assistant\\n' }}{% endif %}",
             "{{ '<|im_start|>assistant\\n' }}{%- if enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
             "{% endif %}{% endif %}")
)
"""Qwen3's layout (written for these tests): :data:`QWEN_STYLE_TEMPLATE` with think blocks, shown in an assistant
turn after the last user turn that is the conversation's last turn or has reasoning: a turn that follows one
drops its empty think block. Not prefix-preserving in that turn alone."""

QWEN3_CODER_STYLE_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nCall a function as:\\n<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>"
    "\\n</function>\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{ '<|im_start|>assistant' }}"
    "{%- if m.content and m.content | trim %}{{ '\\n' + m.content | trim + '\\n' }}{% endif %}"
    "{%- for call in m.tool_calls %}{{ '\\n<tool_call>\\n<function=' + call.function.name + '>\\n' }}"
    "{%- for name, value in call.function.arguments | items %}{{ '<parameter=' + name + '>\\n' }}"
    "{{ value if value is string else value | string }}{{ '\\n</parameter>\\n' }}"
    "{%- endfor %}{{ '</function>\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user\\n' }}{% endif %}"
    "{{ '<tool_response>\\n' + m.content + '\\n</tool_response>\\n' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Qwen3-Coder's layout (written for these tests): a call is ``<tool_call>``, ``<function=NAME>``, each
argument a ``<parameter=ARG>`` block of its value as text (``| string``: ``True``, a dict's Python repr)."""

LLAMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}{{ '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{ 'Environment: ipython\\n\\nTo call a function, answer with JSON in the format "
    "{\"name\": function name, \"parameters\": dictionary of argument name and its value}.\\n\\n' }}"
    "{%- for tool in tools %}{{ tool | tojson }}{{ '\\n\\n' }}{% endfor %}{%- endif %}"
    "{{ '<|eot_id|>' }}"
    "{%- for m in messages %}"
    "{%- if m.tool_calls %}"
    "{%- if m.tool_calls | length != 1 %}{{ raise_exception('This model only supports single tool-calls at once!') }}"
    "{%- endif %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{{ '{\"name\": \"' + m.tool_calls[0].function.name + '\", \"parameters\": ' }}"
    "{{ m.tool_calls[0].function.arguments | tojson }}{{ '}<|eot_id|>' }}"
    "{%- elif m.role == 'tool' %}{{ '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
"""Llama 3.1's layout (written for these tests): a call is the turn's whole text, ``{"name": ...,
"parameters": {...}}``, one per turn (the template refuses more); results in ``ipython`` turns."""

MISTRAL_V3_STYLE_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set last = namespace(user=-1) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set last.user = loop.index0 %}{% endif %}{% endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{%- if tools and loop.index0 == last.user %}{{ '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}"
    "{%- endif %}{{ '[INST] ' + m.content + '[/INST]' }}"
    "{%- elif m.tool_calls %}{{ '[TOOL_CALLS] [' }}"
    "{%- for call in m.tool_calls %}"
    "{%- if call.id is not defined or call.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "{{ (call.function | tojson)[:-1] + ', \"id\": \"' + call.id + '\"}' }}"
    "{{ ', ' if not loop.last else ']' + eos_token }}"
    "{%- endfor %}"
    "{%- elif m.role == 'assistant' %}{{ ' ' + m.content | trim + eos_token }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if m.tool_call_id is not defined or m.tool_call_id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "{{ '[TOOL_RESULTS] ' + {'content': m.content, 'call_id': m.tool_call_id} | tojson + '[/TOOL_RESULTS]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)
"""Mistral 7B v0.3's layout (tokenizer v3, written for these tests): ``[TOOL_CALLS] [`` and a JSON list of
calls with their 9-character ids, which results must name (the template refuses other ids)."""

MISTRAL_V11_STYLE_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}{{ '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{ '[INST]' + m.content + '[/INST]' }}"
    "{%- elif m.role == 'assistant' %}{{ m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}{% set args = call.function.arguments %}"
    "{{ '[TOOL_CALLS]' + call.function.name + '[ARGS]' + (args if args is string else args | tojson) }}"
    "{%- endfor %}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}{{ '[TOOL_RESULTS]' + m.content + '[/TOOL_RESULTS]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)
"""Mistral Small 3.2's layout (tokenizer v11+, written for these tests): ``[TOOL_CALLS]NAME[ARGS]{...}`` per call."""

COUNTING_TEMPLATE = """\
{{ messages | length }} messages
{% for m in messages %}{{ m.role }}: {{ m.content }}
{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"""
"""Not prefix-preserving: its first line counts the messages, so an appended turn rewrites it."""

CORPUS = [
    "The answer is 42. Let me compute 3+5=8 and 8-2=6, so #### 6.",
    "def add(a, b):\n    return a + b\nprint(add(2, 3))",
    "You are a helpful assistant. Use the tools when you need them.",
    '{"name": "add", "arguments": {"a": 1, "b": 2}}',
    "Wrong answer, try again: what is 7 times 6?",
] * 20


def qwen_style_tokenizer(template: str = QWEN_STYLE_TEMPLATE):
    """A byte-level BPE tokenizer trained here on a small corpus (real merges, so a boundary can
    change tokens), with ChatML's special tokens and ``template`` as its chat template."""
    return chat_tokenizer(template, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos="<|im_end|>",
                          added=["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])


def llama3_style_tokenizer():
    """Llama 3's special tokens (``<|python_tag|>`` among them) and :data:`LLAMA3_STYLE_TEMPLATE`."""
    return chat_tokenizer(LLAMA3_STYLE_TEMPLATE, ["<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>",
                                                  "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
                          eos="<|eot_id|>", bos="<|begin_of_text|>")


def mistral_style_tokenizer(template: str = MISTRAL_V3_STYLE_TEMPLATE):
    """Mistral's control tokens (``[TOOL_CALLS]``, ``[ARGS]``, ``[CALL_ID]`` among them: special, so decoding
    drops them) and ``template``."""
    return chat_tokenizer(template, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                     "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[ARGS]", "[CALL_ID]"],
                          eos="</s>", bos="<s>")


def chat_tokenizer(template: str, specials: list[str], *, eos: str, bos: str | None = None, added: list[str] = ()):
    """A byte-level BPE tokenizer trained on :data:`CORPUS` with ``specials`` (the first pads), ``added``
    (plain added tokens, as Qwen's ``<tool_call>``) and ``template`` as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, pad_token=specials[0],
                                        chat_template=template)
    tokenizer.add_tokens(list(added))
    return tokenizer
