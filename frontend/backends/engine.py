"""An offline `radixflow.Engine` as a program's backend: RuntimeEndpoint's methods, served in
this process, so programs share prefixes through the engine's own radix tree with no server.

    engine = radixflow.Engine(model="smollm2")
    program.run(backend=engine)            # or radixflow.set_default_backend(engine)

The Engine is single-threaded, and a program runs on several threads (its stream, each fork
branch, run_batch's pool). So one driver thread per engine makes every call into it: callers
queue requests and block on their replies, and the driver submits what arrived, steps the
scheduler once, hands out chunks and results, and repeats; requests that arrive together are
batched in the same step. It stops when idle and starts again with the next call. While a
program runs on an engine, call the engine itself only through the DSL. No torch is imported
here: the engine comes in as an object (`OfflineEngine`).
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from radixflow.transport import RuntimeEndpointError


@runtime_checkable
class OfflineEngine(Protocol):
    """What the driver uses of `radixflow.Engine` (radixflow.runtime.engine)."""

    tokenizer: Any
    model_info: dict[str, Any]

    def submit(self, prompt: Any = None, sampling_params: Any = None, **options: Any) -> list:
        """Queue requests -> EngineRequest handles (`finished`, `result()`, `next_chunk()`)."""
        ...

    def step(self) -> bool:
        """One scheduler step; whether work remains."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def flush_cache(self) -> bool: ...


@dataclass
class Call:
    """One caller's request to the driver: `start` runs on the driver thread and returns the
    handles to watch (or a value, for control calls); replies go to `replies`."""

    start: Callable[[], Any]
    stream: bool = False
    replies: queue.Queue[Any] = field(default_factory=queue.Queue)
    handles: list[Any] = field(default_factory=list)


_FAILED = object()  # a reply tag: (_FAILED, exception)
_BACKENDS: weakref.WeakKeyDictionary[Any, EngineBackend] = weakref.WeakKeyDictionary()
_BACKENDS_LOCK = threading.Lock()


def engine_backend(engine: OfflineEngine) -> EngineBackend:
    """The one backend (and driver) of `engine`, made on first use."""
    with _BACKENDS_LOCK:
        backend = _BACKENDS.get(engine)
        if backend is None:
            backend = _BACKENDS[engine] = EngineBackend(engine)
        return backend


class EngineBackend:
    """RuntimeEndpoint's methods over an in-process Engine (see the module docstring). Calls
    are thread-safe and block until their reply; a request the engine refuses raises
    RuntimeEndpointError (code invalid_request) with the engine's message. Holds the engine
    weakly: the program's backend= (or the default backend) keeps it alive."""

    def __init__(self, engine: OfflineEngine) -> None:
        self._engine = weakref.ref(engine)
        self._inbox: queue.Queue[Call] = queue.Queue()
        self._lock = threading.Lock()
        self._driving = False

    @property
    def engine(self) -> OfflineEngine:
        engine = self._engine()
        if engine is None:
            raise RuntimeEndpointError("the engine behind this backend is gone")
        return engine

    # ---- RuntimeEndpoint's methods ----------------------------------------------------------

    def generate(
        self,
        text: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        *,
        input_ids: list[int] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        image_data: list[bytes] | None = None,
        **_: Any,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """-> {"text", "output_ids", "meta_info"}; a list of n of those when n > 1 (the n
        samples are admitted together and prefill the prompt once)."""
        options = dict(return_logprob=return_logprob, logprob_start_len=logprob_start_len)
        options.update(top_logprobs_num=top_logprobs_num, image_data=image_data)
        prompt = {"input_ids": input_ids} if input_ids is not None else {"prompt": text}
        call = Call(
            lambda: self.engine.submit(**prompt, sampling_params=sampling_params, **options)
        )
        results = self._wait(call)
        return results if len(results) > 1 else results[0]

    def generate_stream(
        self,
        text: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        *,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        image_data: list[bytes] | None = None,
        **_: Any,
    ) -> Iterator[dict[str, Any]]:
        """Chunks as RuntimeEndpoint streams them (cumulative text, the new tokens' logprobs),
        the last one finished=True with the final text."""
        if (sampling_params or {}).get("n", 1) != 1:
            raise ValueError("gen(n>1) cannot stream")
        options = dict(return_logprob=return_logprob, logprob_start_len=logprob_start_len)
        options.update(top_logprobs_num=top_logprobs_num, stream=True, image_data=image_data)
        call = Call(lambda: self.engine.submit(text, sampling_params, **options), stream=True)
        self._send(call)
        while True:
            chunk = _reply(call.replies.get())
            yield chunk
            if chunk["finished"]:
                return

    def score(
        self, prefix: str, continuations: list[str], unconditional: bool = False
    ) -> list[dict[str, Any]]:
        """As the server's score: each continuation tokenized on its own after the prefix's
        tokens, prefill only, logprobs of exactly its tokens (0.0 for a token without
        context). Raises ValueError for an empty continuation."""
        encode = self.engine.tokenizer.encode
        prefix_ids = encode(prefix, add_special_tokens=False)
        ids = [encode(c, add_special_tokens=False) for c in continuations]
        if not ids or not all(ids):
            raise ValueError("score needs non-empty continuations")
        prefill = {"max_new_tokens": 0}

        def start() -> list[Any]:
            engine, num = self.engine, len(prefix_ids)
            joined = [prefix_ids + c for c in ids]
            handles = engine.submit(input_ids=joined, sampling_params=prefill,
                                    return_logprob=True, logprob_start_len=num)  # fmt: skip
            if unconditional:
                handles += engine.submit(input_ids=ids, sampling_params=prefill,
                                         return_logprob=True, logprob_start_len=0)  # fmt: skip
            return handles

        results = self._wait(Call(start))
        values = [[e[0] or 0.0 for e in r["meta_info"]["input_token_logprobs"]] for r in results]
        num = len(ids)
        return [
            {
                "text": continuation,
                "token_ids": ids[i],
                "logprobs": values[i],
                "unconditional_logprobs": values[num + i] if unconditional else None,
            }
            for i, continuation in enumerate(continuations)
        ]

    def cache_prefix(self, text: str) -> dict[str, Any]:
        """Prefill `text` into the radix tree; its meta_info."""
        call = Call(lambda: self.engine.submit(text, {"max_new_tokens": 0}))
        return self._wait(call)[0]["meta_info"]

    def flush_cache(self) -> bool:
        return self._control(lambda: self.engine.flush_cache())

    def stats(self) -> dict[str, Any]:
        return self._control(lambda: self.engine.stats())

    def model_info(self) -> dict[str, Any]:
        return dict(self.engine.model_info)

    def get_model_name(self) -> str:
        return self.engine.model_info["model_path"]

    def abort(self, rid: str) -> bool:
        return False  # calls here block their thread until done: nothing to abort by rid

    def close(self) -> None:
        """Nothing to release: the driver stops when idle."""

    # ---- the driver ---------------------------------------------------------------------------

    def _wait(self, call: Call) -> list[dict[str, Any]]:
        self._send(call)
        return _reply(call.replies.get())

    def _control(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the driver thread (the engine is single-threaded) and return its value."""
        call = Call(lambda: _Value(fn()))
        self._send(call)
        return _reply(call.replies.get())

    def _send(self, call: Call) -> None:
        self._inbox.put(call)
        with self._lock:
            if not self._driving:
                self._driving = True
                threading.Thread(target=self._drive, name="radixflow-engine", daemon=True).start()

    def _drive(self) -> None:
        """Submit what arrived, step once, reply; until nothing is queued or running."""
        running: list[Call] = []
        while True:
            running += self._start_arrivals()
            if not running:
                with self._lock:
                    if self._inbox.empty():
                        self._driving = False
                        return
                continue
            try:
                self.engine.step()
            except Exception as e:  # the engine failed: every call in flight fails with it
                for call in running:
                    call.replies.put((_FAILED, e))
                running = []
                continue
            running = [call for call in running if not _deliver(call)]

    def _start_arrivals(self) -> list[Call]:
        started = []
        while True:
            try:
                call = self._inbox.get_nowait()
            except queue.Empty:
                return started
            try:
                value = call.start()
            except Exception as e:  # the engine refused it: its caller gets the error
                call.replies.put((_FAILED, e))
                continue
            if isinstance(value, _Value):
                call.replies.put(value.value)
            else:
                call.handles = value
                started.append(call)


@dataclass(frozen=True)
class _Value:
    value: Any


def _deliver(call: Call) -> bool:
    """Hand the call its new chunks, or its results once every handle finished; True when
    the call is done."""
    if call.stream:
        chunk = call.handles[0].next_chunk()
        if chunk is not None:
            call.replies.put(_failure(chunk) or chunk)
        return chunk is not None and chunk["finished"]
    if not all(h.finished for h in call.handles):
        return False
    results = [h.result() for h in call.handles]
    failed = next((f for f in map(_failure, results) if f is not None), None)
    call.replies.put(failed or results)
    return True


def _failure(result: dict[str, Any]) -> tuple[object, Exception] | None:
    """A request the scheduler could not serve (a grammar that failed, out of KV...)."""
    if not result.get("error"):
        return None
    return (_FAILED, RuntimeEndpointError(f"[failed] {result['error']}", "failed"))


def _reply(reply: Any) -> Any:
    if isinstance(reply, tuple) and len(reply) == 2 and reply[0] is _FAILED:
        error = reply[1]
        if isinstance(error, RuntimeEndpointError):
            raise error
        if isinstance(error, ValueError):
            raise RuntimeEndpointError(str(error), "invalid_request") from error
        raise RuntimeEndpointError(f"the engine failed: {error!r}", "failed") from error
    return reply
