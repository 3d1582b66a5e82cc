"""Chat tokenizers built here (nothing downloads): a Qwen-style ChatML tokenizer with tools, and
templates that are not prefix-preserving, for the episode tests."""

from __future__ import annotations

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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        chat_template=template)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    return tokenizer
