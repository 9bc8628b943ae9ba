"""radixflow: an SGLang-compatible frontend language over the radixflow runtime.

An SGLang program runs unchanged after `import radixflow as sgl`. This package never imports
torch: it talks to the runtime over its wire protocol (`RuntimeEndpoint`), or starts a
local server process (`Runtime`). Both are imported on first use.

Where radixflow differs from SGLang on purpose:
- select scores exactly each choice's own tokens (SGLang's means include a prompt token);
  a single trailing space of the prompt moves into the choices (token healing).
- unconditional_likelihood_normalized gets real unconditional logprobs from `score`.
- Roles use the served model's own chat template (SmolLM2: ChatML with its default system
  prompt and `<|im_end|>` as a stop), where SGLang falls back to USER:/ASSISTANT:.
- gen(n>1) and stop_regex raise ValueError instead of failing obscurely; join's
  "concate_and_append" appends the branches' text (no KV concatenation).
- An exception in a program body is recorded on the state (error(); reads raise
  ProgramError) instead of escaping run(), so one failed program never sinks a run_batch.
- run_batch does not pre-cache a traced prefix: the runtime prefills a prefix shared by
  requests arriving together only once.
"""

from __future__ import annotations

from typing import Any

from radixflow.api import (
    Function,
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    global_config,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from radixflow.chat_template import ChatTemplate, get_chat_template
from radixflow.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixflow.interpreter import ProgramError, ProgramState, ProgramStateGroup
from radixflow.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, REGEX_STRING

__version__ = "0.1.0"

_BACKEND_NAMES = ("Runtime", "RuntimeEndpoint", "RuntimeEndpointError")

__all__ = [
    "ChatTemplate",
    "Function",
    "ProgramError",
    "ProgramState",
    "ProgramStateGroup",
    "REGEX_BOOL",
    "REGEX_FLOAT",
    "REGEX_INT",
    "REGEX_STR",
    "REGEX_STRING",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_chat_template",
    "get_server_info",
    "global_config",
    "greedy_token_selection",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    *_BACKEND_NAMES,
]


def __getattr__(name: str) -> Any:
    """The backend classes come from radixflow.backend on first use."""
    if name in _BACKEND_NAMES:
        from radixflow import backend

        return getattr(backend, name)
    raise AttributeError(f"module 'radixflow' has no attribute {name!r}")
