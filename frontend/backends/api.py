"""What the hosted-API backends (OpenAI, Anthropic, LiteLLM) share: the prompt a program hands
them, their parameter checks, their call counter, and select without logprobs.

A program on such a backend makes one API call per gen (`radixflow.api_run` drives them): a
chat model gets the conversation as messages (the roles' contents), a completion model the
program's text so far. Each backend maps the gen's sampling parameters to its API and raises
ValueError for one its API cannot honour (instead of dropping it silently). select scores the
choices by logprobs where the API returns them for given text (OpenAI completions with
echo+logprobs); otherwise it generates greedily and takes the choice closest to the answer.
Each backend imports its SDK only when constructed, and names the pip package when missing.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from radixflow.chat_template import ChatTemplate, get_chat_template
from radixflow.choices import ChoicesDecision, ChoicesSamplingMethod
from radixflow.runtime.protocol.sampling import SamplingParams

DEFAULT_MAX_TOKENS = SamplingParams.max_new_tokens  # SGLang's default for a gen
NEUTRAL = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
NEUTRAL.update(stop=[], stop_token_ids=[], stop_regex=[])  # as resolve_sampling sends them


def import_sdk(module: str, package: str, backend: str) -> Any:
    """The SDK module; ImportError naming the pip package when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"radixflow.{backend} needs the {package!r} package: pip install {package}"
        ) from e


@dataclass(frozen=True)
class Prompt:
    """A program's state as a backend sees it at a gen or select: the whole text, the
    finished messages, and the open role with what it holds so far."""

    text: str
    messages: list[dict[str, str]]
    role: str | None = None
    partial: str = ""


class ChatPromptError(ValueError):
    """A gen or select a chat API cannot express at this point of the program."""


def chat_messages(prompt: Prompt, continues_assistant: bool) -> list[dict[str, str]]:
    """The messages of a chat call: the finished ones, then the open assistant turn's text
    where the API continues a trailing assistant message (Anthropic's prefill). Without roles
    the whole text is one user message (SGLang's rule). Raises ChatPromptError otherwise."""
    if prompt.role is None:
        if prompt.messages:
            raise ChatPromptError(
                "a chat model writes the assistant's turn: put gen/select inside sgl.assistant()"
            )
        return [{"role": "user", "content": prompt.text}]
    if prompt.role != "assistant":
        raise ChatPromptError(
            f"a chat model writes the assistant's turn, not the {prompt.role}'s: put gen/select"
            " inside sgl.assistant()"
        )
    content = prompt.partial.lstrip()
    if not content:
        return list(prompt.messages)
    if continues_assistant:
        return [*prompt.messages, {"role": "assistant", "content": content}]
    raise ChatPromptError(
        "this chat API cannot continue a started assistant message: put gen/select right "
        "after sgl.assistant(), or set num_api_spec_tokens (API speculative execution) so "
        "the turn's text and gens are matched from one answer"
    )


@dataclass(frozen=True)
class Completion:
    """One API call's answer: a text per choice (n of them), each one's finish reason
    ("stop" when the model ended or hit a stop string, "length" at max_tokens)."""

    texts: list[str]
    finish_reasons: list[str | None]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Usage:
    """API calls made and tokens billed (from the API's own usage counts)."""

    num_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ApiBackend:
    """A hosted model behind an API. Subclasses set `name` and `is_chat_model`, and implement
    `complete` (and `complete_stream`); `score` where the API gives logprobs of given text.
    `usage` counts calls and tokens (thread-safe)."""

    name = "api"
    is_chat_model = True
    continues_assistant = False  # the API continues a trailing assistant message

    def __init__(
        self,
        model_name: str,
        chat_template: ChatTemplate | str | None = None,
        num_api_spec_tokens: int | None = None,
    ) -> None:
        self.model_name = model_name
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        self.chat_template = chat_template or get_chat_template("default")
        self.num_api_spec_tokens = num_api_spec_tokens
        self.usage = Usage()
        self._usage_lock = threading.Lock()

    # ---- what subclasses implement ------------------------------------------------------------

    def complete(self, prompt: Prompt, params: dict[str, Any]) -> Completion:
        """One API call for a gen (`params`: the gen's sampling parameters)."""
        raise NotImplementedError

    def complete_stream(self, prompt: Prompt, params: dict[str, Any]) -> Iterator[str]:
        """One streamed API call: the text pieces as they come."""
        raise NotImplementedError

    def score(
        self, prefix: str, continuations: list[str], unconditional: bool
    ) -> list[tuple[list[Any], list[Any] | None]] | None:
        """Per continuation (its [logprob, None, token] entries, the unconditional ones or
        None), from one API call; None when the API cannot score given text."""
        return None

    # ---- shared -----------------------------------------------------------------------------

    def select(
        self, prompt: Prompt, choices: list[str], method: ChoicesSamplingMethod
    ) -> ChoicesDecision:
        """Pick a choice: by its tokens' logprobs where `score` gives them (a completion
        model), else by generating greedily and matching the closest choice."""
        scored = None if self.is_chat_model else self.score(
            prompt.text, list(choices), method.requires_unconditional_logprobs
        )  # fmt: skip
        if scored is not None:
            entries = [conditional for conditional, _ in scored]
            return method(
                choices=list(choices),
                normalized_prompt_logprobs=[_mean(e) for e in entries],
                input_token_logprobs=entries,
                output_token_logprobs=[[] for _ in choices],
                unconditional_token_logprobs=[u for _, u in scored]
                if method.requires_unconditional_logprobs
                else None,
            )
        longest = max(len(c) for c in choices)
        params = {"max_new_tokens": min(longest + 16, 256), "temperature": 0.0, "stop": []}
        answer = self.complete(prompt, params).texts[0]
        best = closest_choice(answer, choices)
        meta = {"method": "generate_and_match", "generated": answer}
        return ChoicesDecision(choices[best], meta)

    def count(self, prompt_tokens: int, completion_tokens: int) -> None:
        with self._usage_lock:
            self.usage.num_calls += 1
            self.usage.prompt_tokens += prompt_tokens
            self.usage.completion_tokens += completion_tokens

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def get_model_name(self) -> str:
        return self.model_name

    def model_info(self) -> dict[str, Any]:
        return {"model": self.model_name, "model_path": self.model_name}

    def stats(self) -> dict[str, Any]:
        return {"api_calls": self.usage.num_calls, **dataclasses.asdict(self.usage)}

    def cache_prefix(self, text: str) -> dict[str, Any]:
        """Nothing to do: a hosted API caches (or not) on its own."""
        return {}

    def flush_cache(self) -> bool:
        return False

    def close(self) -> None:
        """Nothing to release."""

    def checked(self, params: dict[str, Any], supported: set[str]) -> dict[str, Any]:
        """The parameters the API takes, as the program set them; ValueError for one it cannot
        honour set to anything but its neutral value (a regex must not become free text)."""
        unsupported = sorted(
            k for k, v in params.items() if k not in supported and v != NEUTRAL.get(k)
        )
        if unsupported:
            shown = ", ".join(f"{k}={params[k]!r}" for k in unsupported)
            raise ValueError(f"the {self.name} API cannot honour {shown}")
        return {k: v for k, v in params.items() if k in supported and v is not None}


def closest_choice(answer: str, choices: list[str]) -> int:
    """The choice the answer starts with (the longest such), else the one it mentions first,
    else the most similar one (difflib's ratio); ties go to the first choice."""
    text = answer.strip()
    starts = [i for i, c in enumerate(choices) if c.strip() and text.startswith(c.strip())]
    if starts:
        return max(starts, key=lambda i: (len(choices[i].strip()), -i))
    found = [(text.find(c.strip()), i) for i, c in enumerate(choices) if c.strip() in text]
    if found:
        return min(found, key=lambda f: (f[0], -len(choices[f[1]]), f[1]))[1]
    ratios = [difflib.SequenceMatcher(None, text, c.strip()).ratio() for c in choices]
    return max(range(len(choices)), key=lambda i: (ratios[i], -i))


def _mean(entries: list[Any]) -> float:
    values = [float(e[0]) for e in entries if e[0] is not None]
    return sum(values) / len(values) if values else 0.0
