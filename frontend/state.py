"""ProgramState, the `s` of a program, and ProgramStateGroup, the branches of `s.fork(n)`:
the user's view of a stream. Writes queue work on the stream's executor
(`radixflow.interpreter`) and return at once; reads block until what they read was produced.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from radixflow.interpreter import INCREMENTAL_META, StreamExecutor
from radixflow.ir import ExprList, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd, as_expr, flatten


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
        """Block until `name` is produced; its runtime meta info (tokens, finish reason); a
        list of n of them for gen(n>1)."""
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
        """Async text_iter. With return_meta_data, yields (chunk, meta_info) in SGLang's
        incremental form: a chunk's output_token_logprobs (output_top_logprobs,
        output_token_ids_logprobs) are those of its own new tokens, and the ones of chunks
        that added no text are merged into the next chunk's."""
        loop = asyncio.get_running_loop()
        executor = self.stream_executor
        if not executor.stream:
            read = self.text if var_name is None else partial(self.get_var, var_name)
            value = await loop.run_in_executor(None, read)
            meta = executor.meta_info.get(var_name, {})
            yield (value, meta) if return_meta_data else value
            return
        pieces, carried = executor.iter_pieces(var_name), {}
        while (piece := await loop.run_in_executor(None, next, pieces, None)) is not None:
            meta = piece.meta or {}
            for key in INCREMENTAL_META:
                if key in meta or key in carried:
                    carried[key] = carried.get(key, []) + list(meta.get(key) or [])
            if piece.text:
                yield (piece.text, {**meta, **carried}) if return_meta_data else piece.text
                carried = {}

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
