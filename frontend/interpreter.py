"""How a program runs: ProgramState (`s`), its stream executor, fork/join, run and run_batch.

Each stream (the program's state and every forked branch) owns a worker thread that executes
the nodes submitted with `s += ...` strictly in order, making the blocking backend calls.
The program body runs in the caller's thread (or its own thread with `stream=True`), so
`s += ...` returns at once and `s[name]` blocks until the variable is produced.

Errors: a failing node or an exception in the body marks the stream failed; remaining nodes
are skipped, every waiting reader wakes up, `error()` returns the exception, and reading a
result that was not produced (`s[name]`, `text()`) raises ProgramError from it. A failed
branch fails its parent at `join()`. Every stream is closed when its program body returns,
so no worker thread outlives its queued work.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from tqdm import tqdm

from radixflow.chat_template import ChatTemplate, get_chat_template, template_for_model
from radixflow.ir import (
    REGEX_BOOL,
    REGEX_FLOAT,
    REGEX_INT,
    REGEX_STR,
    Constant,
    Expr,
    ExprList,
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    VarScopeBegin,
    VarScopeEnd,
    as_expr,
    flatten,
    produced_name,
)

logger = logging.getLogger(__name__)

LOGPROB_OPTIONS = ("return_logprob", "logprob_start_len", "top_logprobs_num")
DTYPE_REGEX = {
    "int": (REGEX_INT, (" ", "\n")),
    "float": (REGEX_FLOAT, (" ", "\n")),
    "str": (REGEX_STR, ()),
    "bool": (REGEX_BOOL, ()),
}
JOIN_MODES = ("gather_variable", "concate_and_append")
_END = object()


class ProgramError(RuntimeError):
    """A program stream failed; `__cause__` is the original exception."""


def resolve_sampling(
    defaults: dict[str, Any], overrides: dict[str, Any], stop_str: tuple[str, ...]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Merge run() defaults with a gen's overrides -> (wire sampling params, logprob options).
    dtype becomes a regex; the template's stop strings are added. Raises ValueError for
    what a program cannot express (n > 1, stop_regex, an unknown dtype)."""
    params = {**defaults, **overrides}
    options = {k: params.pop(k) for k in LOGPROB_OPTIONS if k in params}
    params.pop("return_text_in_logprobs", None)  # entries carry token text None
    if params.pop("stop_regex", None):
        raise ValueError("stop_regex is not supported; use stop strings or a regex constraint")
    stop = list(params.get("stop") or ())
    dtype = params.pop("dtype", None)
    if dtype is not None:
        key = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", repr(dtype))
        if key not in DTYPE_REGEX:
            raise ValueError(f"unsupported dtype {dtype!r}; use int, float, str or bool")
        if params.get("regex"):
            logger.warning("gen got both dtype and regex; dtype=%s wins", key)
        params["regex"], extra_stop = DTYPE_REGEX[key]
        stop += extra_stop
    params["stop"] = list(dict.fromkeys(stop + list(stop_str)))
    if params.get("n", 1) != 1:
        raise ValueError("gen(n>1) is not supported in a program; fork the state instead")
    # Names were checked by gen(); values are validated once, where the request enters the
    # runtime (server or Engine), and come back as a clear error.
    return params, options


@dataclass
class Piece:
    """One append to a streaming state's text (for text_iter): which variable, what, meta."""

    var: str | None
    text: str
    meta: dict[str, Any] | None = None


class StreamExecutor:
    """One stream: text, variables, messages, and a worker executing nodes in order."""

    def __init__(
        self,
        backend: Any,
        template: ChatTemplate,
        defaults: dict[str, Any],
        *,
        stream: bool = False,
        use_thread: bool = True,
    ) -> None:
        self.backend, self.template, self.defaults = backend, template, defaults
        self.stream, self.use_thread = stream, use_thread
        self.text = ""
        self.variables: dict[str | None, Any] = {}
        self.meta_info: dict[str | None, Any] = {}
        self.messages: list[dict[str, str]] = []
        self.role: tuple[str, int] | None = None  # open role and where its content starts
        self.scopes: dict[str, int] = {}
        self.events: dict[str, threading.Event] = {}
        self.pieces: list[Piece] = []
        self.exc: Exception | None = None
        self.children: list[StreamExecutor] = []
        self.fork_vars: frozenset[str | None] = frozenset()
        self.fork_pos = 0
        self.body_thread: int | None = None
        self.closed = False
        self.done = threading.Event()
        self.cond = threading.Condition()
        self.queue: queue.Queue[Any] = queue.Queue()
        if use_thread:
            threading.Thread(target=self._loop, daemon=True, name="radixflow-stream").start()

    # -- submission and the worker -------------------------------------------------------
    def submit(self, expr: object) -> None:
        """Queue `expr`'s nodes; named ones get an event readers wait on. Raises on a closed
        stream, or ValueError/TypeError for a value that is not text or an expression."""
        items = []
        with self.cond:
            if self.closed:
                raise RuntimeError("this state is closed (its branch was joined or it ended)")
            for node in flatten(as_expr(expr)):
                name, event = produced_name(node), None
                if name is not None:
                    event = self.events[name] = threading.Event()
                    if self.exc is not None:
                        event.set()
                items.append((node, event))
        for item in items:
            if self.use_thread:
                self.queue.put(item)
            else:
                self._step(*item)

    def _loop(self) -> None:
        while (item := self.queue.get()) is not _END:
            self._step(*item)
            self.queue.task_done()
        self.queue.task_done()
        self._finish()

    def _step(self, node: Expr, event: threading.Event | None) -> None:
        try:
            if self.exc is None:
                self._execute(node)
        except Exception as e:
            self.fail(e)
        finally:
            if event is not None:
                with self.cond:
                    event.set()
                    self.cond.notify_all()

    def fail(self, exc: Exception) -> None:
        """Mark the stream failed (first error wins) and wake every reader."""
        with self.cond:
            if self.exc is None:
                self.exc = exc
                logger.warning("program stream failed: %r", exc)
            for event in self.events.values():
                event.set()
            self.cond.notify_all()

    def close(self) -> None:
        """No more submissions; the worker ends after the queued nodes. Closes branches too."""
        with self.cond:
            if self.closed:
                return
            self.closed = True
            children = list(self.children)
        if self.use_thread:
            self.queue.put(_END)
        else:
            self._finish()
        for child in children:
            child.close()

    def _finish(self) -> None:
        with self.cond:
            self.done.set()
            self.cond.notify_all()

    def settle(self) -> None:
        """Block until the submitted work ran: from the submitting (body) thread, what was
        queued so far; from any other thread, the whole stream."""
        if self.closed or threading.get_ident() != self.body_thread:
            self.done.wait()
        elif self.use_thread:
            self.queue.join()

    def raise_if_failed(self) -> None:
        if self.exc is not None:
            raise ProgramError(f"program failed: {self.exc!r}") from self.exc

    def get_var(self, name: str) -> Any:
        event = self.events.get(name)
        if event is not None:
            event.wait()
        elif name not in self.variables:
            self.settle()  # maybe not submitted yet (stream=True body still running)
            if name in self.events:
                self.events[name].wait()
        if name in self.variables:
            return self.variables[name]
        self.raise_if_failed()
        raise KeyError(name)

    def set_var(self, name: str | None, value: Any, meta: Any = None) -> None:
        with self.cond:
            self.variables[name] = value
            if meta is not None:
                self.meta_info[name] = meta

    # -- node execution (worker thread) --------------------------------------------------
    def _execute(self, node: Expr) -> None:
        if isinstance(node, Constant):
            self._append(node.value)
        elif isinstance(node, Gen):
            self._gen(node)
        elif isinstance(node, Select):
            self._select(node)
        elif isinstance(node, RoleBegin):
            self._role_begin(node.role)
        elif isinstance(node, RoleEnd):
            self._role_end(node.role)
        elif isinstance(node, VarScopeBegin):
            self.scopes[node.name] = len(self.text)
        elif isinstance(node, VarScopeEnd):
            if node.name not in self.scopes:
                raise ValueError(f"var_scope {node.name!r} ended without a begin")
            self.set_var(node.name, self.text[self.scopes.pop(node.name) :])
        else:
            raise TypeError(f"cannot execute {node!r}")

    def _append(self, text: str, var: str | None = None, meta: dict | None = None) -> None:
        with self.cond:
            self.text += text
            if self.stream:
                self.pieces.append(Piece(var, text, meta))
            self.cond.notify_all()

    def _gen(self, node: Gen) -> None:
        stop_str = self.template.stop_str
        sampling, options = resolve_sampling(self.defaults, node.overrides(), stop_str)
        if self.stream:
            text, meta = self._gen_stream(node.name, sampling, options)
        else:
            out = self.backend.generate(self.text, sampling, **options)
            text, meta = out["text"], out["meta_info"]
            self._append(text, node.name)
        self.set_var(node.name, text, meta)

    def _gen_stream(
        self, name: str | None, sampling: dict[str, Any], options: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        base, shown, logprobs, meta = self.text, "", [], {}
        for chunk in self.backend.generate_stream(base, sampling, **options):
            meta, new = chunk["meta_info"], chunk["text"]
            logprobs += meta.get("output_token_logprobs") or []
            if not new.startswith(shown):  # the runtime revised earlier text: restart it
                with self.cond:
                    self.text, shown = base, ""
            self.set_var(name, new)
            self._append(new[len(shown) :], name, meta)
            shown = new
        return shown, ({**meta, "output_token_logprobs": logprobs} if logprobs else meta)

    def _select(self, node: Select) -> None:
        method = node.choices_method
        unconditional = method.requires_unconditional_logprobs
        # Token healing: "Action: " + choice would score the choice without its natural
        # leading-space token; move one trailing space into every continuation instead.
        prefix, space = self.text, ""
        if len(prefix) > 1 and prefix.endswith(" ") and not prefix.endswith("  "):
            prefix, space = prefix[:-1], " "
        continuations = [space + choice for choice in node.choices]
        results = self.backend.score(prefix, continuations, unconditional=unconditional)
        entries = [_entries(r["logprobs"], r["token_ids"]) for r in results]
        decision = method(
            choices=list(node.choices),
            normalized_prompt_logprobs=[_mean(r["logprobs"]) for r in results],
            input_token_logprobs=entries,
            output_token_logprobs=[[] for _ in results],
            unconditional_token_logprobs=[
                _entries(r["unconditional_logprobs"], r["token_ids"]) for r in results
            ]
            if unconditional
            else None,
        )
        self._append(decision.decision, node.name)
        self.set_var(node.name, decision.decision, decision.meta_info)

    def _role_begin(self, role: str) -> None:
        if self.role is not None:
            raise ValueError(f"cannot begin role {role!r} inside role {self.role[0]!r}")
        prefix, _ = self.template.get_prefix_and_suffix(role)
        system = self.template.default_system_prompt
        if not self.messages and role != "system" and system is not None:
            self._role_begin("system")
            self._append(system)
            self._role_end("system")
        self._append(prefix)
        self.role = (role, len(self.text))

    def _role_end(self, role: str) -> None:
        if self.role is None or self.role[0] != role:
            raise ValueError(f"role {role!r} ended but the open role is {self.role!r}")
        content = self.text[self.role[1] :].lstrip()
        self._append(self.template.get_prefix_and_suffix(role)[1])
        self.messages.append({"role": role, "content": content})
        self.role = None

    # -- fork / join ---------------------------------------------------------------------
    def spawn(self) -> StreamExecutor:
        """A branch starting from this stream's current state (call after settle())."""
        child = StreamExecutor(
            self.backend,
            self.template,
            self.defaults,
            stream=self.stream,
            use_thread=self.use_thread,
        )
        child.text, child.messages, child.role = self.text, list(self.messages), self.role
        child.scopes, child.variables = dict(self.scopes), dict(self.variables)
        child.meta_info, child.exc = dict(self.meta_info), self.exc
        child.body_thread = self.body_thread
        child.fork_vars, child.fork_pos = frozenset(self.variables), len(self.text)
        with self.cond:
            self.children.append(child)
        return child

    def join(self, children: list[StreamExecutor], mode: str) -> None:
        """Wait for the branches; gather their new variables (and their meta info) into lists,
        or append their new text. A failed branch fails this stream. Raises ValueError for an
        unknown mode."""
        if mode not in JOIN_MODES:
            raise ValueError(f"unknown join mode {mode!r}; use one of {JOIN_MODES}")
        for child in children:
            child.close()
        for child in children:
            child.done.wait()
        with self.cond:
            self.children = [c for c in self.children if c not in children]
        failed = next((c.exc for c in children if c.exc is not None), None)
        if failed is not None:
            self.fail(failed)
        elif mode == "concate_and_append":
            self.submit("".join(c.text[c.fork_pos :] for c in children))
        else:
            gathered: dict[str, list[Any]] = {}
            metas: dict[str, list[Any]] = {}
            for child in children:
                for key, value in child.variables.items():
                    if key is not None and key not in child.fork_vars:
                        gathered.setdefault(key, []).append(value)
                        metas.setdefault(key, []).append(child.meta_info.get(key, {}))
            for key, values in gathered.items():
                self.set_var(key, values, metas[key])

    # -- streaming reads -----------------------------------------------------------------
    def iter_pieces(self, var: str | None) -> Iterator[Piece]:
        """Pieces as they are appended (of one variable, or all) until that one is produced
        or the stream ends. Blocks between pieces."""
        i = 0
        while True:
            with self.cond:
                while len(self.pieces) <= i and not self._stream_over(var):
                    self.cond.wait()
                if len(self.pieces) <= i:
                    return
                piece = self.pieces[i]
            i += 1
            if var is None or piece.var == var:
                yield piece

    def _stream_over(self, var: str | None) -> bool:
        if self.done.is_set() or self.exc is not None:
            return True
        event = self.events.get(var) if var is not None else None
        return event is not None and event.is_set()


def _entries(logprobs: list[float | None], token_ids: list[int]) -> list[list[Any]]:
    return [[lp, tid, None] for lp, tid in zip(logprobs, token_ids)]


def _mean(logprobs: list[float | None]) -> float:
    values = [lp for lp in logprobs if lp is not None]
    return sum(values) / len(values) if values else 0.0


class ProgramState:
    """The `s` of a program. `s += expr` queues (non-blocking); reads block as documented."""

    def __init__(self, executor: StreamExecutor) -> None:
        self.stream_executor = executor
        self.ret_value: Any = None

    def __iadd__(self, other: object) -> ProgramState:
        """Queue text or an expression. Raises ValueError for None, TypeError for non-text."""
        self.stream_executor.submit(other)
        return self

    def __getitem__(self, name: str) -> Any:
        """Block until `name` is produced; return it. KeyError if it never is; ProgramError
        if the stream failed before producing it."""
        return self.stream_executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables

    get_var = __getitem__
    set_var = __setitem__

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """Block until `name` is produced; its runtime meta info (tokens, finish reason)."""
        self.stream_executor.get_var(name)
        return self.stream_executor.meta_info.get(name, {})

    def sync(self) -> None:
        """Block until the submitted work has run."""
        self.stream_executor.settle()

    def text(self) -> str:
        """Block until the work ran; the full text. Raises ProgramError if the stream failed."""
        self.sync()
        self.stream_executor.raise_if_failed()
        return self.stream_executor.text

    def messages(self) -> list[dict[str, str]]:
        """Block like text(); the chat messages as [{"role", "content"}]."""
        self.text()
        return list(self.stream_executor.messages)

    def error(self) -> Exception | None:
        """Block until the work ran; the exception that stopped this stream, or None."""
        self.sync()
        return self.stream_executor.exc

    def fork(self, size: int = 1, position_ids_offset: object = None) -> ProgramStateGroup:
        """Wait for queued work, cache the shared text in the runtime once (size > 1), then
        start `size` branches, each with its own worker. `position_ids_offset` is ignored."""
        executor = self.stream_executor
        executor.settle()
        if size > 1 and executor.text and executor.exc is None:
            try:
                executor.backend.cache_prefix(executor.text)
            except Exception as e:
                executor.fail(e)
        return ProgramStateGroup([ProgramState(executor.spawn()) for _ in range(size)], self)

    @contextmanager
    def copy(self, position_ids_offset: object = None) -> Iterator[ProgramState]:
        """`with s.copy() as c:` a one-branch fork, joined when the block ends."""
        group = self.fork(1)
        yield group[0]
        group.join()

    def _role(self, role: str, expr: object) -> Any:
        if expr is None:
            return self._role_block(role)
        wrapped = ExprList((RoleBegin(role), *flatten(as_expr(expr)), RoleEnd(role)))
        self += wrapped
        return wrapped

    @contextmanager
    def _role_block(self, role: str) -> Iterator[None]:
        self += RoleBegin(role)
        yield
        self += RoleEnd(role)

    def system(self, expr: object = None) -> Any:
        """With expr: queue it as a system message. Without: `with s.system(): ...`."""
        return self._role("system", expr)

    def user(self, expr: object = None) -> Any:
        """With expr: queue it as a user message. Without: `with s.user(): ...`."""
        return self._role("user", expr)

    def assistant(self, expr: object = None) -> Any:
        """With expr: queue it as an assistant message. Without: `with s.assistant(): ...`."""
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """`with s.var_scope(name):` sets s[name] to the text appended inside the block."""
        self += VarScopeBegin(name)
        yield
        self += VarScopeEnd(name)

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """stream=True: yield text chunks (all text, or one variable's) as they arrive.
        Otherwise: yield the final text or value once. Raises ProgramError on failure."""
        executor = self.stream_executor
        if not executor.stream:
            yield self.text() if var_name is None else self[var_name]
            return
        for piece in executor.iter_pieces(var_name):
            if piece.text:
                yield piece.text
        if var_name is None or var_name not in executor.variables:
            executor.raise_if_failed()

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """Async text_iter. With return_meta_data, yields (chunk, meta_info); the incremental
        output_token_logprobs of chunks that added no text are merged into the next one."""
        loop = asyncio.get_running_loop()
        executor = self.stream_executor
        if not executor.stream:
            read = self.text if var_name is None else partial(self.get_var, var_name)
            value = await loop.run_in_executor(None, read)
            meta = executor.meta_info.get(var_name, {})
            yield (value, meta) if return_meta_data else value
            return
        pieces, carried = executor.iter_pieces(var_name), []
        while (piece := await loop.run_in_executor(None, next, pieces, None)) is not None:
            meta = piece.meta or {}
            carried = carried + (meta.get("output_token_logprobs") or [])
            if piece.text:
                yield (
                    (piece.text, {**meta, "output_token_logprobs": carried})
                    if (return_meta_data)
                    else piece.text
                )
                carried = []

    def __repr__(self) -> str:
        self.sync()  # but never raise from repr
        return f"ProgramState({self.stream_executor.text!r})"


class ProgramStateGroup:
    """The branches of `s.fork(n)`: index them, `+=` to all, join them back."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states, self.parent = states, parent

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if value is not self.states[i]:  # only `forks[i] += x` assigns, with the same state
            raise ValueError("cannot replace a branch of a fork")

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: object) -> ProgramStateGroup:
        """`forks += expr` (to every branch), `+= [e0, e1, ...]` (one each), `+= lambda i:`."""
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} branches")
            for state, expr in zip(self.states, other):
                state += expr
        else:
            for i, state in enumerate(self.states):
                state += other(i) if callable(other) else other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Block until every branch finished. "gather_variable": each variable the branches
        created becomes a list in the parent (nested forks: nested lists); the parent's text is
        unchanged. "concate_and_append": the branches' new text is appended to the parent."""
        executors = [state.stream_executor for state in self.states]
        self.parent.stream_executor.join(executors, mode)


def resolve_backend(backend: Any) -> Any:
    """Unwrap a Runtime to its endpoint; raise RuntimeError when there is no backend."""
    if backend is None:
        raise RuntimeError(
            "no backend: pass backend=... or call radixflow.set_default_backend(...) first"
        )
    return getattr(backend, "endpoint", backend)


def resolve_template(template: ChatTemplate | str | None, backend: Any) -> ChatTemplate:
    if isinstance(template, ChatTemplate):
        return template
    if isinstance(template, str):
        return get_chat_template(template)
    return template_for_model(backend.model_info())


def run_program(
    func: Callable[..., Any],
    kwargs: dict[str, Any],
    backend: Any,
    defaults: dict[str, Any],
    *,
    stream: bool = False,
    use_thread: bool = True,
    chat_template: ChatTemplate | str | None = None,
) -> ProgramState:
    """Start `func(s, **kwargs)`. Non-stream: the body runs here and this returns when it
    has (trailing gens may still run; reads block). stream=True: the body gets a thread."""
    endpoint = resolve_backend(backend)
    template = resolve_template(chat_template, endpoint)
    executor = StreamExecutor(endpoint, template, defaults, stream=stream, use_thread=use_thread)
    state = ProgramState(executor)
    if stream:
        threading.Thread(target=_run_body, args=(func, state, kwargs), daemon=True).start()
    else:
        _run_body(func, state, kwargs)
    return state


def _run_body(func: Callable[..., Any], state: ProgramState, kwargs: dict[str, Any]) -> None:
    executor = state.stream_executor
    executor.body_thread = threading.get_ident()
    try:
        state.ret_value = func(state, **kwargs)
    except Exception as e:
        executor.fail(e)
    finally:
        executor.close()


def run_program_batch(
    func: Callable[..., Any],
    batch: list[dict[str, Any]],
    backend: Any,
    defaults: dict[str, Any],
    *,
    num_threads: int | str = "auto",
    progress_bar: bool = False,
    generator_style: bool = False,
    chat_template: ChatTemplate | str | None = None,
) -> list[ProgramState] | Iterator[ProgramState]:
    """Run every argument set on a thread pool; states in input order, each finished."""
    endpoint = resolve_backend(backend)
    template = resolve_template(chat_template, endpoint)
    if num_threads == "auto":
        num_threads = max(96, (os.cpu_count() or 1) * 16)
    workers = max(1, min(int(num_threads), len(batch)))

    def run_one(kwargs: dict[str, Any]) -> ProgramState:
        state = run_program(func, kwargs, endpoint, defaults, chat_template=template)
        state.stream_executor.done.wait()
        return state

    iterator = _batch_iter(run_one, batch, workers, progress_bar, ordered=generator_style)
    return iterator if generator_style else list(iterator)


def _batch_iter(
    run_one: Callable[[dict[str, Any]], ProgramState],
    batch: list[dict[str, Any]],
    workers: int,
    progress_bar: bool,
    ordered: bool,
) -> Iterator[ProgramState]:
    if not batch:
        return
    bar = tqdm(total=len(batch), disable=not progress_bar)
    with ThreadPoolExecutor(workers) as pool, bar:
        futures = [pool.submit(run_one, kwargs) for kwargs in batch]
        if ordered:
            for future in futures:
                state = future.result()
                bar.update(1)
                yield state
            return
        for _ in as_completed(futures):
            bar.update(1)
        yield from (future.result() for future in futures)
