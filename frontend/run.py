"""run and run_batch: start a program body on a fresh stream (in this thread, or its own with
stream=True), or many on a thread pool, states returned in input order."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from tqdm import tqdm

from radixflow.backends.api import ApiBackend
from radixflow.backends.engine import OfflineEngine, engine_backend
from radixflow.chat_template import ChatTemplate, get_chat_template, template_for_model
from radixflow.interpreter import StreamExecutor
from radixflow.state import ProgramState


def resolve_backend(backend: Any) -> Any:
    """Unwrap a Runtime to its endpoint, an offline Engine to its in-process backend; raise
    RuntimeError when there is no backend."""
    if backend is None:
        raise RuntimeError(
            "no backend: pass backend=... or call radixflow.set_default_backend(...) first"
        )
    if isinstance(backend, OfflineEngine):
        return engine_backend(backend)
    return getattr(backend, "endpoint", backend)


def resolve_template(template: ChatTemplate | str | None, backend: Any) -> ChatTemplate:
    if isinstance(template, ChatTemplate):
        return template
    if isinstance(template, str):
        return get_chat_template(template)
    if isinstance(backend, ApiBackend):
        return backend.get_chat_template()
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
    num_api_spec_tokens: int | None = None,
) -> ProgramState:
    """Start `func(s, **kwargs)`. Non-stream: the body runs here and this returns when it
    has (trailing gens may still run; reads block). stream=True: the body gets a thread.
    `num_api_spec_tokens`: API speculative execution on a hosted-API backend."""
    endpoint = resolve_backend(backend)
    template = resolve_template(chat_template, endpoint)
    executor = StreamExecutor(
        endpoint,
        template,
        defaults,
        stream=stream,
        use_thread=use_thread,
        num_api_spec_tokens=num_api_spec_tokens,
    )
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
    num_api_spec_tokens: int | None = None,
) -> list[ProgramState] | Iterator[ProgramState]:
    """Run every argument set on a thread pool; states in input order, each finished."""
    endpoint = resolve_backend(backend)
    template = resolve_template(chat_template, endpoint)
    if num_threads == "auto":
        num_threads = max(96, (os.cpu_count() or 1) * 16)
    workers = max(1, min(int(num_threads), len(batch)))

    def run_one(kwargs: dict[str, Any]) -> ProgramState:
        state = run_program(
            func,
            kwargs,
            endpoint,
            defaults,
            chat_template=template,
            num_api_spec_tokens=num_api_spec_tokens,
        )
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
