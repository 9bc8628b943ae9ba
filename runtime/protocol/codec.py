"""The wire codec: messages (runtime/protocol/messages.py, whose docstring is the protocol) to
msgpack frames and back, every field checked against its dataclass's type hints."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar, Union

import msgpack

from radixflow.runtime.protocol.messages import (
    ERROR_BAD_MESSAGE,
    ERROR_BAD_VERSION,
    ERROR_TOO_LARGE,
    ERROR_UNKNOWN_TYPE,
    PROTOCOL_VERSION,
    ProtocolError,
)

M = TypeVar("M")
ENVELOPE_KEYS = ("v", "t", "key")


# ---- encoding ---------------------------------------------------------------------------


def encode(message: Any, api_key: str = "") -> bytes:
    """One frame for `message`. numpy / torch scalars and arrays become plain ints and lists."""
    body = {"v": PROTOCOL_VERSION, "t": message.TAG, **_to_map(message)}
    if api_key:
        body["key"] = api_key
    return msgpack.packb(body, use_bin_type=True, default=_to_builtin)


def _to_map(obj: Any) -> dict[str, Any]:
    """The fields by name; one marked `omit_none` is left out when None (its default)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None and f.metadata.get("omit_none"):
            continue
        out[f.name] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return _to_map(value)
    if isinstance(value, (list, tuple)) and value and dataclasses.is_dataclass(value[0]):
        return [_to_map(v) for v in value]
    if isinstance(value, tuple):
        return list(value)
    return value


def _to_builtin(obj: Any) -> Any:
    """msgpack's fallback: numpy/torch scalars and arrays have `tolist()`."""
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"cannot encode {type(obj).__name__} in a message")


# ---- decoding ---------------------------------------------------------------------------


def decode(frame: bytes, family: tuple[type[M], ...], max_bytes: int = 64 << 20) -> M:
    """Parse one frame into one of `family`'s messages. Raises ProtocolError."""
    return decode_with_key(frame, family, max_bytes)[0]


def decode_with_key(
    frame: bytes, family: tuple[type[M], ...], max_bytes: int = 64 << 20
) -> tuple[M, str]:
    """Like `decode`, also returning the envelope's API key ("" when absent)."""
    body = _unpack(frame, max_bytes)
    rid = body.get("rid") if isinstance(body.get("rid"), str) else ""
    if "v" not in body:
        raise ProtocolError(ERROR_BAD_VERSION, "missing protocol version 'v'", rid)
    if body["v"] != PROTOCOL_VERSION or isinstance(body["v"], bool):
        raise ProtocolError(
            ERROR_BAD_VERSION,
            f"protocol version {body['v']!r} is not supported (this side speaks "
            f"{PROTOCOL_VERSION})",
            rid,
        )
    tag = body.get("t")
    cls = next((c for c in family if c.TAG == tag), None)
    if cls is None:
        raise ProtocolError(ERROR_UNKNOWN_TYPE, f"unknown message type {tag!r}", rid)
    key = body.get("key", "")
    if not isinstance(key, str):
        raise ProtocolError(ERROR_BAD_MESSAGE, "'key' must be a string", rid)
    fields = {k: v for k, v in body.items() if k not in ENVELOPE_KEYS}
    return _from_map(cls, fields, tag, rid), key


def _unpack(frame: bytes, max_bytes: int) -> dict[str, Any]:
    if len(frame) > max_bytes:
        message = f"frame of {len(frame)} bytes exceeds {max_bytes}"
        raise ProtocolError(ERROR_TOO_LARGE, message, peek_rid(frame))
    try:
        body = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=max_bytes,
            max_map_len=max_bytes // 2,
            max_ext_len=0,
        )
    except (ValueError, TypeError) as e:  # msgpack's errors are ValueError subclasses
        raise ProtocolError(
            ERROR_BAD_MESSAGE, f"not a msgpack frame: {e or type(e).__name__}"
        ) from e
    if not isinstance(body, dict):
        raise ProtocolError(ERROR_BAD_MESSAGE, f"frame is a {type(body).__name__}, not a map")
    return body


def peek_rid(frame: bytes) -> str:
    """The top-level "rid" of a msgpack map frame, found by skipping every other value without
    building it (keys and the rid are read under a 1 KiB limit), or "" if there is none.
    Lets a `too_large` refusal reach the call that sent the oversized frame."""
    unpacker = msgpack.Unpacker(
        raw=False,
        max_buffer_size=max(len(frame), 1),
        max_str_len=1024,
        max_bin_len=1024,
        max_array_len=0,
        max_map_len=0,
        max_ext_len=0,
    )
    try:
        unpacker.feed(frame)
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "rid":
                rid = unpacker.unpack()
                return rid if isinstance(rid, str) else ""
            unpacker.skip()
    except (ValueError, TypeError, msgpack.OutOfData, msgpack.StackError):
        pass
    return ""


def _from_map(cls: type[M], body: dict[str, Any], where: str, rid: str = "") -> M:
    spec = _field_spec(cls)
    unknown = sorted(map(repr, set(body) - set(spec)))  # keys may be bytes, ints, ...
    if unknown:
        raise ProtocolError(ERROR_BAD_MESSAGE, f"{where}: unknown field(s) {unknown}", rid)
    values = {}
    for name, (hint, required) in spec.items():
        if name not in body:
            if required:
                raise ProtocolError(ERROR_BAD_MESSAGE, f"{where}: missing field {name!r}", rid)
            continue
        values[name] = _check(body[name], hint, f"{where}.{name}", rid)
    return cls(**values)


@functools.cache
def _field_spec(cls: type) -> dict[str, tuple[Any, bool]]:
    hints = typing.get_type_hints(cls)
    return {
        f.name: (
            hints[f.name],
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
    }


def _check(value: Any, hint: Any, where: str, rid: str) -> Any:
    """`value` if it matches the type `hint` (converted where harmless), else ProtocolError."""
    if hint is Any:
        return value
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        for arg in typing.get_args(hint):
            if arg is not type(None) and _matches_shallow(value, arg):
                return _check(value, arg, where, rid)
    elif origin is list:
        return _check_list(value, typing.get_args(hint)[0], where, rid)
    elif origin is tuple:  # only tuple[X, ...]
        return tuple(_check_list(value, typing.get_args(hint)[0], where, rid))
    elif origin is dict:
        if isinstance(value, dict):
            return value  # string keys are guaranteed by strict_map_key
    elif dataclasses.is_dataclass(hint):
        if isinstance(value, dict):
            return _from_map(hint, value, where, rid)
    elif _matches_shallow(value, hint):
        return float(value) if hint is float else value
    raise ProtocolError(
        ERROR_BAD_MESSAGE, f"{where}: expected {_type_name(hint)}, got {type(value).__name__}", rid
    )


def _check_list(value: Any, item: Any, where: str, rid: str) -> list[Any]:
    if isinstance(value, list):
        if item is int and all(type(v) is int for v in value):
            return value
        if item in (str, Any) and all(item is Any or type(v) is str for v in value):
            return value
        if item not in (int, str):
            return [_check(v, item, f"{where}[{i}]", rid) for i, v in enumerate(value)]
    raise ProtocolError(ERROR_BAD_MESSAGE, f"{where}: expected a list of {_type_name(item)}", rid)


def _matches_shallow(value: Any, hint: Any) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is bytes:
        return isinstance(value, bytes)
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        return isinstance(value, list)
    if origin is dict or dataclasses.is_dataclass(hint):
        return isinstance(value, dict)
    return hint is Any


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
