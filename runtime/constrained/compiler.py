"""Grammar compilation in worker processes, each compilation under a time limit (torch-free).

Turning a regex into an outlines-core `Index` over a 49k-token vocabulary takes milliseconds
for most grammars and minutes for a few (`a{0,100000}`, a JSON schema with a huge
`maxLength`). In a thread of the scheduler process such a grammar cannot be stopped and holds
up every later constrained request; so compilation runs in `workers` child processes
(`python -m radixflow.runtime.constrained.compiler FD`), started on first use and fed over a
socket pair: first the vocabulary, then one grammar key at a time. A compilation past
`timeout_s` kills its worker (a fresh one starts for the next key) and resolves to a
GrammarError. Frames are msgpack (no pickle): the compiled Index travels as outlines-core's
own binary form (`Index.from_binary`). Workers die with their parent
(PR_SET_PDEATHSIG) and exit when the socket closes.

Also here, because the workers need them: the regex of each grammar kind and the build of the
index (`compile_index`), which report every problem as a GrammarError naming it.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from typing import Any

import msgpack
from outlines_core import Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema

from radixflow.runtime.constrained.schema_regex import bounded_schema_regex, canonical_layout

GrammarKey = tuple[str, str]
log = logging.getLogger(__name__)


class GrammarError(ValueError):
    """A grammar that does not compile (bad regex, bad JSON schema, bad choices list, or one
    too slow to compile), or a token the grammar forbids. The message names the problem."""


# ---- grammar keys -> regexes -> indexes ---------------------------------------------------------


def grammar_regex(key: GrammarKey, whitespace_pattern: str | None) -> str:
    kind, text = key
    if kind == "regex":
        return strip_anchors(text)
    if kind == "json":
        return json_schema_regex(text, whitespace_pattern)
    if kind == "choices":
        return choices_regex(text)
    if kind == "ebnf":
        raise GrammarError("ebnf grammars need --grammar-backend llguidance")
    raise GrammarError(f"unknown grammar kind {kind!r} (expected regex, json or choices)")


def compile_index(
    key: GrammarKey,
    vocabulary: Vocabulary,
    bytes_vocabulary: Vocabulary,
    whitespace_pattern: str | None,
) -> Index:
    """The index of `(?:regex)\\x00` (see constraints._Compiled for the end mark)."""
    regex = grammar_regex(key, whitespace_pattern)
    try:
        if key[0] == "regex":  # alone first: "a)(b" would pass once wrapped in "(?:...)"
            Index(regex, bytes_vocabulary)
        return Index(f"(?:{regex})\\x00", vocabulary)
    except (ValueError, TypeError, RuntimeError) as e:  # outlines-core's build errors
        raise GrammarError(_index_error(key, e)) from e


def bytes_vocabulary() -> Vocabulary:
    """Every byte but NUL: to check a user regex on its own before it is wrapped."""
    return Vocabulary(256, {bytes([b]): [b] for b in range(1, 256)})


def json_schema_regex(schema: str, whitespace_pattern: str | None = None) -> str:
    """The regex of the JSON documents valid under `schema` (JSON text); GrammarError if bad.
    `whitespace_pattern` may appear around every `{ } [ ] , :`; None: the canonical layout
    (`schema_regex.canonical_layout`: `{"a": 1, "b": [2, 3]}`)."""
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as e:
        raise GrammarError(f"invalid JSON schema: not valid JSON ({e})") from e
    try:
        if isinstance(parsed, dict):  # numeric bounds too (schema_regex)
            return bounded_schema_regex(parsed, build_regex_from_schema, whitespace_pattern)
        return canonical_layout(build_regex_from_schema, schema, whitespace_pattern)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid or unsupported JSON schema: {e}") from e


def choices_regex(choices: str) -> str:
    """An alternation of the literal strings in `choices` (a JSON list); GrammarError if bad."""
    try:
        options = json.loads(choices)
    except json.JSONDecodeError as e:
        raise GrammarError(f"invalid choices: not valid JSON ({e})") from e
    if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
        raise GrammarError(f"invalid choices: expected a non-empty list of strings, got {choices}")
    return "(" + "|".join(re.escape(option) for option in options) + ")"


def strip_anchors(pattern: str) -> str:
    """Drop a leading `^`/`\\A` and a trailing `$`/`\\z`: the whole output is matched anyway,
    and outlines-core rejects start anchors (end anchors would defeat the end mark)."""
    for anchor in ("^", "\\A"):
        pattern = pattern.removeprefix(anchor)
    for anchor in ("$", "\\z"):
        body = pattern.removesuffix(anchor)
        escapes = len(body) - len(body.rstrip("\\"))  # an odd count escapes the anchor
        if body != pattern and escapes % 2 == 0:
            pattern = body
    return pattern


def _index_error(key: GrammarKey, error: Exception) -> str:
    kind, text = key
    if kind != "regex":
        return f"{kind} grammar does not compile to an index: {error}"
    try:
        re.compile(text)
    except re.error as e:
        return f"invalid regex {text!r}: {error} ({e})"
    return f"invalid regex {text!r}: {error}"


# ---- the worker processes -----------------------------------------------------------------------


class _Worker:
    """One child process and the job it is compiling (None when idle)."""

    def __init__(self, setup: tuple[Any, ...]) -> None:
        ours, theirs = socket.socketpair()
        module = "radixflow.runtime.constrained.compiler"
        cmd = [sys.executable, "-m", module, str(theirs.fileno()), str(os.getpid())]
        self.process = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        _send(self.conn, setup)
        self.job: tuple[GrammarKey, Future[Any]] | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()


class CompilerPool:
    """Compiles grammar keys in up to `workers` processes; `submit` returns a Future that
    resolves to an outlines-core Index or a GrammarError (never raises). Thread-safe."""

    def __init__(
        self,
        token_ids: dict[bytes, list[int]],
        eos_token_id: int,
        whitespace_pattern: str | None,
        workers: int = 2,
        timeout_s: float = 60.0,
    ) -> None:
        assert workers >= 1 and timeout_s > 0, f"{workers=} {timeout_s=}"
        self._setup = (token_ids, eos_token_id, whitespace_pattern)
        self._size, self.timeout_s = workers, timeout_s
        self._queue: deque[tuple[GrammarKey, Future[Any]]] = deque()
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="grammar-dispatch", daemon=True)
        self._thread.start()

    def submit(self, key: GrammarKey) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed or not self._thread.is_alive():
                future.set_result(GrammarError("the grammar compiler is shut down"))
                return future
            self._queue.append((key, future))
        self._wake_w.send(b"x")
        return future

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
        self._wake_w.send(b"x")
        self._thread.join()
        self._wake_r.close()
        self._wake_w.close()

    def _run(self) -> None:
        try:
            while not self._closed:
                self._dispatch()
                busy = [w for w in self._workers if w.job is not None]
                left = min((w.deadline for w in busy), default=time.monotonic() + 3600)
                ready = wait(
                    [self._wake_r, *(w.conn for w in busy)], max(0.0, left - time.monotonic())
                )
                if self._wake_r in ready:
                    self._wake_r.recv(4096)
                for worker in busy:
                    if worker.conn in ready:
                        self._collect(worker)
                    elif time.monotonic() >= worker.deadline:
                        self._retire(worker, f"took longer than {self.timeout_s:g} s to compile")
        finally:
            for worker in self._workers:
                if worker.job is not None:
                    worker.job[1].set_result(GrammarError("the grammar compiler is shut down"))
                worker.kill()
            for _, future in self._queue:
                future.set_result(GrammarError("the grammar compiler is shut down"))

    def _dispatch(self) -> None:
        """Hand queued keys to idle workers, starting workers up to the pool size."""
        while True:
            idle = next((w for w in self._workers if w.job is None), None)
            with self._lock:
                if not self._queue:
                    return
            if idle is None and len(self._workers) < self._size:
                try:
                    idle = _Worker(self._setup)
                except OSError as e:  # cannot start a process: fail the key, keep serving
                    key, future = self._queue.popleft()
                    future.set_result(GrammarError(f"cannot start a grammar compiler: {e}"))
                    continue
                self._workers.append(idle)
            with self._lock:
                if idle is None or not self._queue:
                    return
                key, future = self._queue.popleft()
            try:
                _send(idle.conn, list(key))
            except OSError:  # died while idle: replace it, the key goes back to the front
                self._workers.remove(idle)
                idle.kill()
                with self._lock:
                    self._queue.appendleft((key, future))
                continue
            idle.job, idle.deadline = (key, future), time.monotonic() + self.timeout_s

    def _collect(self, worker: _Worker) -> None:
        assert worker.job is not None
        try:
            status, value = _recv(worker.conn)
            result = Index.from_binary(value) if status == "ok" else GrammarError(value)
        except (EOFError, OSError, ValueError, msgpack.UnpackException) as e:
            self._retire(worker, f"crashed the grammar compiler ({e!r})")
            return
        worker.job[1].set_result(result)
        worker.job = None

    def _retire(self, worker: _Worker, problem: str) -> None:
        assert worker.job is not None
        key, future = worker.job
        log.warning("%s grammar %.80r %s; its worker is replaced", key[0], key[1], problem)
        worker.job = None
        self._workers.remove(worker)
        worker.kill()
        future.set_result(GrammarError(f"{key[0]} grammar {problem}"))


def _worker_main(fd: int, parent: int) -> None:
    _die_with_parent(parent)
    conn = Connection(fd)
    token_ids, eos_token_id, whitespace_pattern = _recv(conn)
    vocabulary, byte_vocab = Vocabulary(eos_token_id, token_ids), bytes_vocabulary()
    while True:
        try:
            kind, text = _recv(conn)
        except EOFError:
            return
        try:
            index = compile_index((kind, text), vocabulary, byte_vocab, whitespace_pattern)
            reply = ["ok", index_to_bytes(index)]
        except GrammarError as e:
            reply = ["error", str(e)]
        _send(conn, reply)


def index_to_bytes(index: Index) -> bytes:
    """outlines-core's binary form of `index`, the input of `Index.from_binary`. The Index
    exposes it only through its pickle hook, so we call that hook and take its argument."""
    rebuild, (binary,) = index.__reduce__()
    assert rebuild == Index.from_binary and isinstance(binary, bytes), f"{rebuild=}"
    return binary


def _send(conn: Connection, value: Any) -> None:
    conn.send_bytes(msgpack.packb(value, use_bin_type=True))


def _recv(conn: Connection) -> Any:
    """One msgpack frame (the token vocabulary's keys are bytes, hence no strict map keys)."""
    return msgpack.unpackb(conn.recv_bytes(), raw=False, strict_map_key=False)


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when its parent dies, even mid-compilation."""
    try:
        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before the call above
        os._exit(1)


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]), int(sys.argv[2]))
