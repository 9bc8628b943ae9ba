"""DiskStore: KV blocks in files, content-addressed, written by a background thread (torch-free).

A block is the KV of `block_tokens` consecutive positions. Its key is a chained hash of the
store's fingerprint and every token up to the block's end (tiered.py), so a file's name says
exactly which prefix it holds: the directory is the index, nothing is written at shutdown
beyond the pending writes, and a store another configuration wrote lives under another
fingerprint, never read.

    ROOT/<fingerprint hex>/FINGERPRINT.json       what the fingerprint covers (for people)
    ROOT/<fingerprint hex>/<key[:2]>/<key>.kv     one block: HEADER, int64 tokens, payload

A file is written to a temporary name and renamed into place (atomic on POSIX): a SIGKILL
mid-write leaves a stray temporary file (removed at the next start once its writer is dead),
never a torn block; two processes writing one key write the same bytes. The header carries
the fingerprint, the key, the token ids and a CRC-32 of tokens and payload; a block that fails
any check is deleted and reported missing, so its tokens are recomputed, never served.
Capacity: least recently used files (this process's view: the files it found at start, wrote,
or read) are deleted past `capacity_bytes`.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"RFKVBLK1"
VERSION = 1
# magic, version, fingerprint, key, num_tokens, payload bytes, CRC-32 of tokens + payload
HEADER = struct.Struct("<8sI16s16sIQI")
MAX_PENDING_BYTES = 1 << 30  # queued writes past this are dropped (recomputed if needed)
MAX_READY_BYTES = 1 << 29  # prefetched blocks kept in memory until their request is admitted


class DiskStore:
    """Blocks on disk under one fingerprint. `put` queues a write (a background thread does
    it) and returns at once; `get` serves a queued block from memory, else reads and checks
    the file. Thread-safe between the caller and its writer thread."""

    def __init__(
        self, root: Path, fingerprint: bytes, capacity_bytes: int, described: dict
    ) -> None:
        self.fingerprint = fingerprint
        self.dir = Path(root) / fingerprint.hex()
        self.capacity_bytes = capacity_bytes
        _make_private_dir(Path(root))
        _make_private_dir(self.dir)
        _atomic_write(self.dir / "FINGERPRINT.json", json.dumps(described, indent=1).encode())
        self._lock = threading.Lock()
        self._pending: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
        self._pending_bytes = 0
        self._lru: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key: size
        self.disk_bytes = 0
        self.counters = dict.fromkeys(
            ("blocks_written", "bytes_written", "blocks_read", "bytes_read", "blocks_bad",
             "writes_dropped", "blocks_deleted", "blocks_prefetched"),
            0,
        )  # fmt: skip
        self._scan()
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="hicache-writer", daemon=True)
        self._writer.start()
        self._ready: collections.OrderedDict[bytes, tuple[np.ndarray, np.ndarray]] = (
            collections.OrderedDict()
        )  # prefetched and checked, oldest first
        self._reads: queue.Queue[tuple[bytes, np.ndarray] | None] = queue.Queue()
        self._queued: set[bytes] = set()  # asked for, not yet being read
        self._reading: dict[bytes, threading.Event] = {}  # being read: set when done
        self._reader = threading.Thread(target=self._read_loop, name="hicache-reader", daemon=True)
        self._reader.start()

    # ---- the caller's side -----------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        with self._lock:
            if key in self._pending:
                return True
        return self._path(key).exists()

    def put(self, key: bytes, tokens: np.ndarray, payload: np.ndarray) -> bool:
        """Queue `payload` (uint8, (num_tokens, bytes_per_token)) for `tokens` under `key`;
        False when dropped (too much already pending: the block is simply not stored)."""
        with self._lock:
            if key in self._pending:
                return True
            if self._pending_bytes + payload.nbytes > MAX_PENDING_BYTES:
                self.counters["writes_dropped"] += 1
                return False
            self._pending[key] = (tokens.astype(np.int64), payload)
            self._pending_bytes += payload.nbytes
        self._queue.put(key)
        return True

    def get(self, key: bytes, tokens: np.ndarray) -> np.ndarray | None:
        """The payload stored for `key`, or None (missing, or bad and now deleted). A block
        whose stored tokens differ from `tokens` is never returned."""
        tokens = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            self._queued.discard(key)  # not read yet: read here, the reader skips it
            reading = self._reading.get(key)
        if reading is not None:
            reading.wait()  # being read: one read of a file, one verdict
        with self._lock:
            ready = self._ready.pop(key, None)
            pending = self._pending.get(key)
        for found in (ready, pending):
            if found is not None:
                return found[1] if np.array_equal(found[0], tokens) else None
        return self._load(key, tokens)

    def prefetch(self, key: bytes, tokens: np.ndarray) -> None:
        """Read and check `key`'s file in the background, so that a `get` soon after finds
        it in memory (a waiting request's blocks, read while it waits)."""
        with self._lock:
            if key in self._pending or key in self._ready or key in self._queued:
                return
            self._queued.add(key)
        self._reads.put((key, np.asarray(tokens, dtype=np.int64)))

    def _load(self, key: bytes, tokens: np.ndarray) -> np.ndarray | None:
        path = self._path(key)
        try:
            raw = bytearray(path.read_bytes())
        except OSError:
            return None
        payload = self._check(raw, key, tokens)
        if payload is None:
            self._count("blocks_bad")
            log.warning("hicache: dropping bad block %s (it is recomputed)", path.name)
            self._delete(key)
            return None
        self._count("blocks_read")
        self._count("bytes_read", len(raw))
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
        try:
            os.utime(path)  # the LRU order survives a restart (the scan sorts by mtime)
        except OSError:
            pass  # another process deleted it meanwhile: we hold its bytes already
        return payload

    def discard(self, key: bytes) -> None:
        """Delete `key`'s block (another tensor-parallel rank lacks its shard of it)."""
        self._delete(key)

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.counters[name] += amount

    def flush(self) -> None:
        """Block until every queued write is on disk (or failed)."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._reads.put(None)
        self._writer.join()
        self._reader.join()

    def stats(self) -> dict[str, int]:
        with self._lock:
            pending = len(self._pending)
        return {**self.counters, "disk_bytes": self.disk_bytes, "pending_writes": pending}

    # ---- the file format -------------------------------------------------------------------

    def _check(self, raw: bytearray, key: bytes, tokens: np.ndarray) -> np.ndarray | None:
        if len(raw) < HEADER.size:
            return None
        magic, version, fingerprint, stored_key, num_tokens, num_bytes, crc = HEADER.unpack_from(
            raw
        )
        body = memoryview(raw)[HEADER.size :]
        token_bytes = 8 * num_tokens
        ok = (
            (magic, version, fingerprint, stored_key) == (MAGIC, VERSION, self.fingerprint, key)
            and num_tokens == len(tokens)
            and len(body) == token_bytes + num_bytes
            and zlib.crc32(body) == crc
        )
        if not ok or not np.array_equal(np.frombuffer(body[:token_bytes], np.int64), tokens):
            return None
        payload = np.frombuffer(body[token_bytes:], dtype=np.uint8)
        return payload.reshape(num_tokens, -1) if num_tokens else None

    def _encode(self, key: bytes, tokens: np.ndarray, payload: np.ndarray) -> bytes:
        body = tokens.tobytes() + np.ascontiguousarray(payload).tobytes()
        header = HEADER.pack(
            MAGIC, VERSION, self.fingerprint, key, len(tokens), payload.nbytes, zlib.crc32(body)
        )
        return header + body

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.dir / name[:2] / f"{name}.kv"

    # ---- the background threads ------------------------------------------------------------

    def _read_loop(self) -> None:
        while (item := self._reads.get()) is not None:
            key, tokens = item
            with self._lock:
                if key not in self._queued:
                    continue  # `get` took it meanwhile
                self._queued.remove(key)
                done = self._reading[key] = threading.Event()
            payload = self._load(key, tokens)
            with self._lock:
                del self._reading[key]
                done.set()
                if payload is None:
                    continue
                self._ready[key] = (tokens, payload)
                self.counters["blocks_prefetched"] += 1
                while sum(p.nbytes for _, p in self._ready.values()) > MAX_READY_BYTES:
                    self._ready.popitem(last=False)  # never fetched: read again if asked

    def _write_loop(self) -> None:
        while True:
            key = self._queue.get()
            try:
                if key is None:
                    return
                self._write(key)
            finally:
                self._queue.task_done()

    def _write(self, key: bytes) -> None:
        with self._lock:
            tokens, payload = self._pending[key]
        path = self._path(key)
        try:
            if not path.exists():
                data = self._encode(key, tokens, payload)
                path.parent.mkdir(mode=0o700, exist_ok=True)
                _atomic_write(path, data)
                self._account(key, len(data))
                self._count("blocks_written")
                self._count("bytes_written", len(data))
        except OSError as e:  # a full or read-only disk: the block is recomputed if needed
            self._count("writes_dropped")
            log.warning("hicache: writing %s failed: %s", path.name, e)
        finally:
            with self._lock:
                del self._pending[key]
                self._pending_bytes -= payload.nbytes
        self._trim()

    def _account(self, key: bytes, size: int) -> None:
        with self._lock:
            self._lru[key] = size
            self.disk_bytes += size

    def _trim(self) -> None:
        """Delete least recently used blocks past the capacity."""
        while True:
            with self._lock:
                if self.disk_bytes <= self.capacity_bytes or not self._lru:
                    return
                key = next(iter(self._lru))
            self._delete(key)

    def _delete(self, key: bytes) -> None:
        with self._lock:
            size = self._lru.pop(key, None)
            if size is not None:
                self.disk_bytes -= size
                self.counters["blocks_deleted"] += 1
        try:
            self._path(key).unlink()
        except OSError:
            pass  # already gone (another process, or a missing block)

    def _scan(self) -> None:
        """The blocks already on disk, oldest use first; stray temporary files of dead
        writers removed."""
        found = []
        for sub in self.dir.iterdir():
            if sub.name.endswith(".tmp"):  # FINGERPRINT.json's
                _remove_stray(sub)
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(".tmp"):
                    _remove_stray(Path(entry.path))
                elif entry.name.endswith(".kv"):
                    with contextlib.suppress(FileNotFoundError, ValueError):  # gone, or not ours
                        st = entry.stat()
                        found.append((st.st_mtime_ns, bytes.fromhex(entry.name[:-3]), st.st_size))
        for _, key, size in sorted(found):
            self._lru[key] = size
            self.disk_bytes += size
        self._trim()


def _make_private_dir(path: Path) -> None:
    """Create `path` for the user only (0700); tighten one of ours that is wider."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o077:
        path.chmod(0o700)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write to `.<name>.<pid>.<thread>.tmp` beside `path`, then rename over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def _remove_stray(tmp: Path) -> None:
    """Delete a temporary file whose writer process is gone (a SIGKILL mid-write)."""
    parts = tmp.name.split(".")
    try:
        pid = int(parts[-3])
        os.kill(pid, 0)
        alive = time.time() - tmp.stat().st_mtime < 3600  # a live pid: maybe reused
    except (ValueError, IndexError, ProcessLookupError, FileNotFoundError):
        alive = False
    except PermissionError:
        alive = True  # another user's live process: not ours to judge
    if not alive:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
