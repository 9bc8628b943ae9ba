"""The DSL surface: gen, select, roles, the @function decorator and the default backend.

Constructors only build frozen expressions (they never block or call the runtime); the
sampling fields come from runtime.protocol.sampling.SamplingParams, the one definition of them.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from radixflow.chat_template import ChatTemplate
from radixflow.choices import ChoicesSamplingMethod, token_length_normalized
from radixflow.ir import Expr, ExprList, Gen, RoleBegin, RoleEnd, Select, as_expr, flatten
from radixflow.run import resolve_backend, run_program, run_program_batch
from radixflow.runtime.protocol.sampling import SamplingParams
from radixflow.state import ProgramState

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - {"choices"}
LOGPROB_FIELDS = frozenset(
    {"return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"}
)
# Keyword arguments of run()/run_batch() that set program-wide defaults, not program arguments.
RUN_OPTIONS = SAMPLING_FIELDS | LOGPROB_FIELDS | {"stop_regex"}


@dataclass
class GlobalConfig:
    """The DSL's one ambient setting: the backend programs use when run() gets none."""

    default_backend: Any = None
    verbosity: int = 0


global_config = GlobalConfig()


def _normalize(name: str, value: Any) -> Any:
    if name in ("stop", "stop_token_ids", "stop_regex"):
        return (value,) if isinstance(value, (str, int)) else tuple(value)
    if name == "json_schema" and not isinstance(value, str):
        schema = value.model_json_schema() if hasattr(value, "model_json_schema") else value
        return json.dumps(schema)
    return value


def _params(values: dict[str, Any]) -> dict[str, Any]:
    return {k: _normalize(k, v) for k, v in values.items() if v is not None}


_NOT_SAMPLING = ("name", "choices", "choices_method", "sampling")


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | type | None = None,
    **sampling: Any,
) -> Expr:
    """A generation stored under `name`; unset fields take the run() defaults. Other
    SamplingParams fields (seed, repetition_penalty, ...) are accepted by keyword. With
    `choices` it is a select(). `n` > 1 draws n samples of the same prefix (prefilled once):
    `s[name]` is the list of n texts and the text goes on with the first. `stop_regex` ends
    the output where it first matches (the match stays). Raises TypeError for an unknown
    field, re.error for a bad regex, ValueError for a json_schema that is not JSON; ranges
    are checked when it runs."""
    values = {k: v for k, v in locals().items() if k not in _NOT_SAMPLING}
    if choices is not None:
        method = choices_method or token_length_normalized
        return select(name, choices, temperature or 0.0, method)
    unknown = sorted(set(sampling) - SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"gen() got unknown sampling parameter(s) {unknown}")
    if regex is not None:
        re.compile(regex)
    params = _params({**values, **sampling})
    for old, new in (("max_tokens", "max_new_tokens"), ("min_tokens", "min_new_tokens")):
        if old in params:
            params[new] = params.pop(old)
    if "json_schema" in params:
        json.loads(params["json_schema"])
    return Gen(name, tuple(sorted(params.items())))


def gen_int(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Expr:
    """gen(..., dtype=int): the value is the text of an integer (REGEX_INT)."""
    return gen(name, max_tokens, dtype=int, **kwargs)


def gen_string(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Expr:
    """gen(..., dtype=str): the value is a double-quoted string (REGEX_STR)."""
    return gen(name, max_tokens, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> Expr:
    """Pick one of `choices` by the runtime's logprobs of each choice's own tokens (one score
    request, prefix cached once); the choice is appended and stored under `name`. Raises
    ValueError for no/empty choices or a temperature above 0 (scoring is exact)."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select needs a list of non-empty string choices")
    if temperature > 1e-5:
        raise ValueError("select scores the choices exactly; temperature must be 0")
    return Select(name, tuple(choices), choices_method)


def _role(role: str, expr: object) -> ExprList:
    inner = () if expr is None else tuple(flatten(as_expr(expr)))
    return ExprList((RoleBegin(role), *inner, RoleEnd(role)))


def system(expr: object = None) -> ExprList:
    """`expr` as a system message (formatted by the backend's chat template)."""
    return _role("system", expr)


def user(expr: object = None) -> ExprList:
    """`expr` as a user message (formatted by the backend's chat template)."""
    return _role("user", expr)


def assistant(expr: object = None) -> ExprList:
    """`expr` as an assistant message (formatted by the backend's chat template)."""
    return _role("assistant", expr)


# Bare role markers: `s += sgl.user_begin() + ... + sgl.user_end()`.
system_begin, system_end = partial(RoleBegin, "system"), partial(RoleEnd, "system")
user_begin, user_end = partial(RoleBegin, "user"), partial(RoleEnd, "user")
assistant_begin, assistant_end = partial(RoleBegin, "assistant"), partial(RoleEnd, "assistant")


class Function:
    """A program made by @function. `run` (or calling it) starts it, `run_batch` runs many,
    `bind` fixes arguments. Keyword arguments of run() that name sampling parameters (and are
    not program parameters) become the program-wide defaults for every gen."""

    def __init__(
        self,
        func: Callable[..., Any],
        num_api_spec_tokens: int | None = None,
        bind_arguments: dict[str, Any] | None = None,
    ) -> None:
        # API speculative execution on a hosted-API backend (radixflow.speculative)
        self.func, self.num_api_spec_tokens = func, num_api_spec_tokens
        self.signature = inspect.signature(func)
        names = list(self.signature.parameters)
        if not names or names[0] != "s":
            raise TypeError(f"the first parameter of @function {func.__name__} must be named s")
        self.arg_names = names[1:]
        self.arg_defaults = [
            p.default for p in self.signature.parameters.values() if p.default is not p.empty
        ]
        self.bind_arguments = dict(bind_arguments or {})
        self.__name__, self.__doc__ = func.__name__, func.__doc__

    def bind(self, **kwargs: Any) -> Function:
        """A new Function with these arguments fixed. Raises ValueError for unknown names."""
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise ValueError(f"{self.__name__} has no parameter(s) {unknown}")
        return Function(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if len(args) > len(self.arg_names):
            raise TypeError(f"{self.__name__} takes {len(self.arg_names)} arguments")
        arguments = {**self.bind_arguments, **dict(zip(self.arg_names, args)), **kwargs}
        self.signature.bind(None, **arguments)  # raises TypeError for missing/unknown ones
        return arguments

    def _split(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        program, defaults = {}, {}
        for key, value in kwargs.items():
            if key in RUN_OPTIONS and key not in self.arg_names:
                if value is not None:
                    defaults[key] = _normalize(key, value)
            else:
                program[key] = value
        return program, defaults

    def run(
        self,
        *args: Any,
        backend: Any = None,
        stream: bool = False,
        use_thread: bool = True,
        chat_template: ChatTemplate | str | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program. Returns its state once the body has returned (stream=True: at
        once); reads on the state block. Raises RuntimeError without a backend, TypeError for
        bad arguments; errors inside the program surface through the state."""
        program, defaults = self._split(kwargs)
        return run_program(
            self.func,
            self._arguments(args, program),
            backend or global_config.default_backend,
            defaults,
            stream=stream,
            use_thread=use_thread,
            chat_template=chat_template,
            num_api_spec_tokens=self.num_api_spec_tokens,
        )

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]] | list[tuple[Any, ...]],
        *,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        chat_template: ChatTemplate | str | None = None,
        **sampling: Any,
    ) -> list[ProgramState] | Iterator[ProgramState]:
        """Run once per argument set (dicts, or tuples of positional arguments) on
        `num_threads` threads; returns finished states in input order (a generator with
        generator_style). Blocks; `progress_bar` shows a tqdm bar on stderr."""
        unknown = sorted(set(sampling) - RUN_OPTIONS)
        if unknown:
            raise TypeError(f"run_batch got unknown option(s) {unknown}")
        batch = [
            self._arguments(tuple(item), {})
            if isinstance(item, (list, tuple))
            else self._arguments((), dict(item))
            for item in batch_kwargs
        ]
        return run_program_batch(
            self.func,
            batch,
            backend or global_config.default_backend,
            self._split(sampling)[1],
            num_threads=num_threads,
            progress_bar=progress_bar,
            generator_style=generator_style,
            chat_template=chat_template,
            num_api_spec_tokens=self.num_api_spec_tokens,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """Decorator, bare (`@function`) or called (`@function(num_api_spec_tokens=...)`)."""
    if func is None:
        return lambda f: Function(f, num_api_spec_tokens)
    return Function(func, num_api_spec_tokens)


def set_default_backend(backend: Any) -> None:
    """Programs run without backend= use this one: a Runtime, a RuntimeEndpoint, an offline
    Engine, or a hosted-API backend (OpenAI, Anthropic, LiteLLM)."""
    global_config.default_backend = backend


def flush_cache(backend: Any = None) -> bool:
    """Empty the runtime's prefix cache; False when there is no backend."""
    backend = backend or global_config.default_backend
    return False if backend is None else bool(resolve_backend(backend).flush_cache())


def get_server_info(backend: Any = None) -> dict[str, Any] | None:
    """The runtime's model info and stats in one dict; None when there is no backend."""
    backend = backend or global_config.default_backend
    if backend is None:
        return None
    endpoint = resolve_backend(backend)
    return {**endpoint.model_info(), **endpoint.stats()}
