"""The interpreter: one StreamExecutor per stream (a program's state and every forked branch)
executes the nodes submitted with `s += ...` strictly in order on its own worker thread,
making the blocking backend calls; fork/join and the streamed pieces live here too.

The program body runs in the caller's thread (or its own thread with `stream=True`), so
`s += ...` returns at once and `s[name]` blocks until the variable is produced.

Errors: a failing node or an exception in the body marks the stream failed; remaining nodes
are skipped, every waiting reader wakes up, `exc` holds the exception, and reading a result
that was not produced raises ProgramError from it. A failed branch fails its parent at
join(). Every stream is closed when its program body returns, so no worker thread outlives
its queued work.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from radixflow.api_run import ApiRun
from radixflow.backends.api import ApiBackend
from radixflow.chat_template import ChatTemplate
from radixflow.ir import (
    Constant,
    Expr,
    Gen,
    Image,
    RoleBegin,
    RoleEnd,
    Select,
    VarScopeBegin,
    VarScopeEnd,
    as_expr,
    flatten,
    produced_name,
)
from radixflow.sampling import resolve_sampling

logger = logging.getLogger(__name__)

JOIN_MODES = ("gather_variable", "concate_and_append")
# per-token meta a stream chunk holds for its new tokens only (SGLang's incremental form)
INCREMENTAL_META = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
_END = object()


class ProgramError(RuntimeError):
    """A program stream failed; `__cause__` is the original exception."""


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
        num_api_spec_tokens: int | None = None,
    ) -> None:
        self.backend, self.template, self.defaults = backend, template, defaults
        self.stream, self.use_thread = stream, use_thread
        # a hosted API (OpenAI, Anthropic, LiteLLM) runs gens and selects its own way
        self.api = ApiRun(backend, num_api_spec_tokens) if isinstance(backend, ApiBackend) else None
        self.deferred: set[str] = set()  # gens of a speculated assistant turn, not yet run
        self.text = ""
        self.variables: dict[str | None, Any] = {}
        self.meta_info: dict[str | None, Any] = {}
        self.messages: list[dict[str, str]] = []
        self.role: tuple[str, int] | None = None  # open role and where its content starts
        self.images: list[bytes] = []  # the text's images, in placeholder order (media.py)
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
            with self.cond:  # readers of a deferred gen wait for the queue to run dry
                self.queue.task_done()
                self.cond.notify_all()
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
                    if produced_name(node) not in self.deferred:
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
            with self.cond:
                # a deferred gen with nothing left to run: its turn's end is not submitted yet
                self.cond.wait_for(lambda: event.is_set() or self._stalled(name))
                if not event.is_set():
                    raise RuntimeError(
                        f"s[{name!r}] is written when its assistant turn ends (API speculative "
                        "execution): read it after the turn"
                    )
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

    def _stalled(self, name: str) -> bool:
        return name in self.deferred and self.queue.unfinished_tasks == 0

    def defer(self, name: str | None) -> None:
        """A gen whose value comes when its assistant turn ends: its readers wait till then."""
        if name is not None:
            with self.cond:
                self.deferred.add(name)
                self.cond.notify_all()

    def release_deferred(self) -> None:
        with self.cond:
            for name in self.deferred:
                self.events[name].set()
            self.deferred.clear()
            self.cond.notify_all()

    # -- node execution (worker thread) --------------------------------------------------
    def _execute(self, node: Expr) -> None:
        if isinstance(node, Constant):
            self._fill(node.value)
        elif isinstance(node, Gen):
            self._gen(node)
        elif isinstance(node, Select):
            self._select(node)
        elif isinstance(node, Image):
            self._image(node)
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

    def _fill(self, text: str) -> None:
        """Constant text or a role's markup (an API backend may defer or match it)."""
        if self.api is not None:
            self.api.fill(self, text)
        else:
            self.append(text)

    def _image(self, node: Image) -> None:
        """The image's placeholder joins the text (the runtime model's); its bytes go with
        every later gen. Raises ValueError where the backend cannot take images."""
        if self.api is not None:
            raise ValueError("image() needs a radixflow runtime backend, not a hosted API")
        info = self.backend.model_info() if hasattr(self.backend, "model_info") else {}
        vision = info.get("vision")
        if not vision:
            raise ValueError("the runtime's model takes no images (a text-only model)")
        self.images.append(node.data)
        self._fill(vision["placeholder"])

    def append(self, text: str, var: str | None = None, meta: dict | None = None) -> None:
        with self.cond:
            self.text += text
            if self.stream:
                self.pieces.append(Piece(var, text, meta))
            self.cond.notify_all()

    def _gen(self, node: Gen) -> None:
        stop_str = self.template.stop_str
        sampling, options = resolve_sampling(self.defaults, node.overrides(), stop_str)
        if self.api is not None:
            self.api.gen(self, node.name, sampling)
            return
        num = sampling.get("n", 1)
        if self.stream:
            if num != 1:
                raise ValueError("gen(n>1) cannot stream: run the program with stream=False")
            text, meta = self._gen_stream(node.name, sampling, options)
            self.set_var(node.name, text, meta)
            return
        if self.images:
            options = {**options, "image_data": list(self.images)}
        out = self.backend.generate(self.text, sampling, **options)
        if num == 1:
            self.append(out["text"], node.name)
            self.set_var(node.name, out["text"], out["meta_info"])
            return
        # n samples of the same prefix (admitted together: the prefix is prefilled once); as
        # SGLang, the text goes on with the first and the variable holds all n
        outs = out if isinstance(out, list) else [out]
        self.append(outs[0]["text"], node.name)
        self.set_var(node.name, [o["text"] for o in outs], [o["meta_info"] for o in outs])

    def _gen_stream(
        self, name: str | None, sampling: dict[str, Any], options: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        """Stream one gen's chunks into the text; its final meta holds all the logprobs the
        chunks brought (each chunk's meta only its new tokens')."""
        base, shown, meta = self.text, "", {}
        if self.images:
            options = {**options, "image_data": list(self.images)}
        streamed: dict[str, list[Any]] = {}
        for chunk in self.backend.generate_stream(base, sampling, **options):
            meta, new = chunk["meta_info"], chunk["text"]
            for key in INCREMENTAL_META:
                if meta.get(key):
                    streamed.setdefault(key, []).extend(meta[key])
            if not new.startswith(shown):  # the runtime revised earlier text: restart it
                with self.cond:
                    self.text, shown = base, ""
            self.set_var(name, new)
            self.append(new[len(shown) :], name, meta)
            shown = new
        return shown, {**meta, **streamed}

    def _select(self, node: Select) -> None:
        if self.api is not None:
            self.api.select(self, node.name, list(node.choices), node.choices_method)
            return
        if self.images:
            raise ValueError("select() after an image is not supported: use gen(regex=...)")
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
        self.append(decision.decision, node.name)
        self.set_var(node.name, decision.decision, decision.meta_info)

    def _role_begin(self, role: str) -> None:
        if self.role is not None:
            raise ValueError(f"cannot begin role {role!r} inside role {self.role[0]!r}")
        prefix, _ = self.template.get_prefix_and_suffix(role)
        system = self.template.default_system_prompt
        if not self.messages and role != "system" and system is not None:
            self._role_begin("system")
            self._fill(system)
            self._role_end("system")
        self._fill(prefix)
        self.role = (role, len(self.text))

    def _role_end(self, role: str) -> None:
        if self.role is None or self.role[0] != role:
            raise ValueError(f"role {role!r} ended but the open role is {self.role!r}")
        if self.api is not None and role == "assistant":
            self.api.end_turn(self)
        content = self.text[self.role[1] :].lstrip()
        self.role = None
        self._fill(self.template.get_prefix_and_suffix(role)[1])
        self.messages.append({"role": role, "content": content})

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
        child.images = list(self.images)
        child.scopes, child.variables = dict(self.scopes), dict(self.variables)
        child.meta_info, child.exc = dict(self.meta_info), self.exc
        child.api = self.api.fork() if self.api is not None else None
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
