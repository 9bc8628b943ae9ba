"""radixflow: an SGLang-compatible frontend language over the radixflow runtime.

An SGLang program runs unchanged after `import radixflow as sgl`. This package never imports
torch: it talks to the runtime over its wire protocol (`RuntimeEndpoint`), starts a local
server process (`Runtime`), or runs on a hosted API (`OpenAI`, `Anthropic`, `LiteLLM`, each
importing its SDK only when constructed). `Engine`, the offline engine, is the one name here
from the runtime (and the one that loads torch): a program runs on it in this process. Every
name is imported on first use.

Where radixflow differs from SGLang on purpose:
- select scores exactly each choice's own tokens (SGLang's means include a prompt token);
  a single trailing space of the prompt moves into the choices (token healing).
- unconditional_likelihood_normalized gets real unconditional logprobs from `score`.
- Roles use the served model's own chat template (SmolLM2: ChatML with its default system
  prompt and `<|im_end|>` as a stop), where SGLang falls back to USER:/ASSISTANT:.
- gen(n>1) works on every backend (SGLang's runtime backend fails on it): the variable is the
  list of n samples, the text goes on with the first. join's "concate_and_append" appends
  the branches' text (no KV concatenation).
- An exception in a program body is recorded on the state (error(); reads raise
  ProgramError) instead of escaping run(), so one failed program never sinks a run_batch.
- run_batch does not pre-cache a traced prefix: the runtime prefills a prefix shared by
  requests arriving together only once.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> the module that defines it. Resolved on first use (PEP 562), so that
# `import radixflow.runtime` (the scheduler process among others) runs no DSL code.
_EXPORTS = {
    "radixflow.api": (
        "Function",
        "assistant",
        "assistant_begin",
        "assistant_end",
        "flush_cache",
        "function",
        "gen",
        "gen_int",
        "gen_string",
        "get_server_info",
        "global_config",
        "select",
        "set_default_backend",
        "system",
        "system_begin",
        "system_end",
        "user",
        "user_begin",
        "user_end",
    ),
    "radixflow.media": ("image", "video"),
    "radixflow.chat_template": ("ChatTemplate", "get_chat_template"),
    "radixflow.choices": (
        "greedy_token_selection",
        "token_length_normalized",
        "unconditional_likelihood_normalized",
    ),
    "radixflow.interpreter": ("ProgramError",),
    "radixflow.state": ("ProgramState", "ProgramStateGroup"),
    "radixflow.ir": ("REGEX_BOOL", "REGEX_FLOAT", "REGEX_INT", "REGEX_STR", "REGEX_STRING"),
    "radixflow.backend": ("Runtime", "RuntimeEndpoint"),
    "radixflow.transport": ("Liveness", "RuntimeEndpointError"),
    "radixflow.backends.openai": ("OpenAI",),
    "radixflow.backends.anthropic": ("Anthropic",),
    "radixflow.backends.litellm": ("LiteLLM",),
    "radixflow.backends.vertexai": ("VertexAI",),
    # the offline engine (torch): SGLang exports it here too. The runtime's package resolves
    # it lazily as well; the DSL itself never imports the engine (backends.engine takes it
    # as an object), tests/test_layering.py holds this table to that one exception
    "radixflow.runtime": ("Engine",),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'radixflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
