"""Chat templates of the tool-calling formats, written for the tiny random models (our own
Jinja, shaped like each family's): Qwen 2.5's `<tool_call>` blocks with the tools in the system
turn, Qwen 3's the same plus `<think>` and `enable_thinking`, and Llama 3.1's JSON calls with an
`ipython` turn for results. Each renders a tool result's `tool_call_id`, so a test can see it
reach the prompt. `chat_model` saves a tiny checkpoint with a tokenizer that knows the
format's tags as single tokens (as the real ones do) and the template beside it."""

from __future__ import annotations

from pathlib import Path

import transformers
from family_models import VOCAB, byte_vocab, save_family

QWEN_TOOLS = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions. Their signatures are in <tools></tools>:
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>

For each call, reply with a JSON object inside <tool_call></tool_call>:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}"""
QWEN_TURNS = """{%- for m in messages %}
{%- if m.role == 'system' %}
{%- elif m.role == 'tool' %}<|im_start|>user
<tool_response id="{{ m.tool_call_id }}">
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ ANSWER }}{% for c in m.tool_calls or [] %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}"""
QWEN25 = (
    QWEN_TOOLS
    + QWEN_TURNS.replace("ANSWER", "m.content or ''")
    + "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen 3: earlier turns lose their think block; enable_thinking false closes an empty one
QWEN3 = (
    QWEN_TOOLS
    + QWEN_TURNS.replace("ANSWER", "(m.content or '').split('</think>')[-1].lstrip('\\n')")
    + """{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""
)
LLAMA31 = """<|begin_of_text|>
{%- if tools or messages[0].role == 'system' %}<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
Given the following functions, reply with a JSON for a function call with its proper arguments
that best answers the prompt, in the format {"name": function name, "parameters": dictionary of
argument name and its value}; several calls are joined by "; ".

{% for t in tools %}{{ t | tojson }}

{% endfor %}{% endif %}
{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}<|eot_id|>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}
{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ {"tool_call_id": m.tool_call_id, "output": m.content} | tojson }}<|eot_id|>
{%- elif m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for c in m.tool_calls %}{% if not loop.first %}; {% endif %}
{{- {"name": c.function.name, "parameters": c.function.arguments} | tojson }}{% endfor %}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

TEMPLATES = {"qwen2": QWEN25, "qwen3": QWEN3, "llama": LLAMA31}
QWEN_SPECIAL = ["<|im_start|>", "<|im_end|>"]
QWEN_TAGS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>",
             "</tool_response>"]  # fmt: skip
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TOKENS = {"qwen2": (QWEN_SPECIAL, QWEN_TAGS), "qwen3": (QWEN_SPECIAL, QWEN_TAGS),
          "llama": (LLAMA_SPECIAL, [])}  # fmt: skip


def chat_tokenizer(family: str) -> transformers.PreTrainedTokenizerFast:
    """Byte-level BPE without merges (ids 0..255 bytes, 256 EOS, as tiny_tokenizer) plus the
    family's specials (dropped from decoded text) and tags (kept, as Qwen's <tool_call> is)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    special, tags = TOKENS[family]
    vocab = byte_vocab()
    vocab["<|endoftext|>"] = 256
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>"
    )
    fast.add_special_tokens({"additional_special_tokens": special})
    fast.add_tokens(tags)
    assert len(fast) <= VOCAB, len(fast)
    return fast


def chat_model(family: str, root: Path) -> tuple[Path, Path]:
    """(checkpoint dir, template file) of a tiny `family` model served with its template."""
    path, _ = save_family(family, root, max_position_embeddings=4096)
    tokenizer = chat_tokenizer(family)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(path)
    template = root / f"{family}.jinja"
    template.write_text(TEMPLATES[family])
    return path, template
