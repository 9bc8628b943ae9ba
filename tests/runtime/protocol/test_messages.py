"""The wire protocol: every message round-trips, bad frames raise ProtocolError, no torch."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from radixflow.runtime.protocol import codec
from radixflow.runtime.protocol import messages as m
from radixflow.runtime.protocol.sampling import SamplingParams

SAMPLES = [
    m.Generate("g1", text="Hello", sampling_params={"max_new_tokens": 4, "stop": ["\n"]}),
    m.Generate(
        "g2",
        input_ids=[1, 2, 3],
        stream=True,
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
    ),
    m.Score("s", prefix="Q: ", continuations=[" yes", " no"], unconditional=True),
    m.CachePrefix("c", text="shared prefix"),
    m.Embed("e1", text=["a", "b"]),
    m.Embed("e2", input_ids=[[1, 2], [3]], pooling="mean"),
    m.Abort("a", target_rid="g1"),
    m.FlushCache("f"),
    m.ModelInfo("mi"),
    m.Stats("st"),
    m.Health("h"),
    m.Status("q", target_rids=["g1", "g2"]),
    m.Ping(),
    m.Generate("g3", text="Hi", lora_path="sql"),
    m.LoadLoraAdapter("l1", lora_name="sql", lora_path="/adapters/sql"),
    m.UnloadLoraAdapter("l2", lora_name="sql"),
    m.Chunk("g2", text="Hi", new_ids=[5], meta_info={"completion_tokens": 1}),
    m.Result("g1", data={"text": "x", "output_ids": [1], "meta_info": {"id": "g1"}}),
    m.Error("g1", code=m.ERROR_INVALID_REQUEST, message="bad"),
    m.AddRequests(
        [
            m.ReqSpec("s1", [1, 2], SamplingParams(max_new_tokens=0), True, True, 1),
            m.ReqSpec("s2", [3], SamplingParams(stop=("a", "b"), stop_token_ids=(7,), seed=3)),
            m.ReqSpec("s4", [4, 5], SamplingParams(max_new_tokens=0), pooling="mean"),
            m.ReqSpec("s5", [6], SamplingParams(), lora="sql"),
        ]
    ),
    m.AbortRequests(["s1", "s2"], message="client disconnected"),
    m.Flush("s3"),
    m.Shutdown(),
    m.SchedulerReady({"model": "smollm2", "context_length": 8192}, pid=42, load_seconds=1.5),
    m.SchedulerFailed("--max-total-tokens 100,000 does not fit"),
    m.RequestUpdates(
        [
            m.ReqUpdate("s1", [7, 8], new_logprobs=[-0.5, -1.0], new_top_logprobs=[[[-0.5, 7]]]),
            m.ReqUpdate(
                "s2",
                [],
                finished=True,
                finish_reason={"type": "stop", "matched": 2},
                meta_info={"id": "s2"},
                input_logprobs=[None, -2.5],
            ),
            m.ReqUpdate("s4", [], finished=True, embedding=[0.6, -0.8]),
        ]
    ),
    m.SchedulerStats({"free_slots": 10}, idle_check="ok"),
    m.FlushDone("s3", flushed=True),
    m.LoraUpdated("l1", error="", adapters={"sql": "/adapters/sql"}),
]


def test_every_message_type_has_a_sample() -> None:
    assert {type(s) for s in SAMPLES} == set(m.ALL_MESSAGES)
    assert len({c.TAG for c in m.ALL_MESSAGES}) == len(m.ALL_MESSAGES)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda s: s.TAG)
def test_round_trip(message: object) -> None:
    family = m.ALL_MESSAGES
    assert codec.decode(codec.encode(message), family) == message
    decoded, key = codec.decode_with_key(codec.encode(message, api_key="k3y"), family)
    assert decoded == message and key == "k3y"


def test_envelope_and_plain_ints() -> None:
    frame = codec.encode(m.Generate("g", input_ids=np.array([1, 2], dtype=np.int64).tolist()))
    body = msgpack.unpackb(frame)
    assert body["v"] == m.PROTOCOL_VERSION and body["t"] == "generate" and "key" not in body
    numpy_ids = m.ReqUpdate("r", new_ids=list(np.array([3, 4], dtype=np.int32)))
    decoded = codec.decode(codec.encode(m.RequestUpdates([numpy_ids])), m.FROM_SCHEDULER)
    assert decoded.updates[0].new_ids == [3, 4]
    assert all(type(t) is int for t in decoded.updates[0].new_ids)


def test_int_accepted_for_float_and_bool_is_not_int() -> None:
    frame = _frame(t="scheduler_ready", model_info={}, pid=1, load_seconds=2)
    assert codec.decode(frame, m.FROM_SCHEDULER).load_seconds == 2.0
    with pytest.raises(m.ProtocolError, match="logprob_start_len"):
        codec.decode(_frame(rid="x", logprob_start_len=True), m.CLIENT_REQUESTS)


def _frame(**body: object) -> bytes:
    return msgpack.packb({"v": m.PROTOCOL_VERSION, "t": "generate", **body})


BAD_FRAMES = [
    ("not msgpack", b"\xc1", m.ERROR_BAD_MESSAGE, ""),
    ("truncated", _frame(rid="r1", text="hi")[:-2], m.ERROR_BAD_MESSAGE, ""),
    ("trailing bytes", _frame(rid="r1") + b"x", m.ERROR_BAD_MESSAGE, ""),
    ("a list", msgpack.packb([1, 2]), m.ERROR_BAD_MESSAGE, ""),
    ("int keys", msgpack.packb({1: 2}), m.ERROR_BAD_MESSAGE, ""),
    ("nested too deep", b"\x91" * 100_000 + b"\xc0", m.ERROR_BAD_MESSAGE, ""),
    ("huge array header", b"\xdd\xff\xff\xff\xff", m.ERROR_BAD_MESSAGE, ""),
    ("no version", msgpack.packb({"t": "health", "rid": "r2"}), m.ERROR_BAD_VERSION, "r2"),
    (
        "wrong version",
        msgpack.packb({"v": 99, "t": "health", "rid": "r3"}),
        m.ERROR_BAD_VERSION,
        "r3",
    ),
    (
        "unknown tag",
        msgpack.packb({"v": 1, "t": "explode", "rid": "r4"}),
        m.ERROR_UNKNOWN_TYPE,
        "r4",
    ),
    ("ipc tag from a client", msgpack.packb({"v": 1, "t": "shutdown"}), m.ERROR_UNKNOWN_TYPE, ""),
    ("missing rid", _frame(text="hi"), m.ERROR_BAD_MESSAGE, ""),
    ("rid not a string", _frame(rid=5), m.ERROR_BAD_MESSAGE, ""),
    ("text not a string", _frame(rid="r5", text=3), m.ERROR_BAD_MESSAGE, "r5"),
    ("input_ids of floats", _frame(rid="r6", input_ids=[1.5]), m.ERROR_BAD_MESSAGE, "r6"),
    ("unknown field", _frame(rid="r7", temperature=0), m.ERROR_BAD_MESSAGE, "r7"),
    ("key not a string", _frame(rid="r8", key=1), m.ERROR_BAD_MESSAGE, "r8"),
]


@pytest.mark.parametrize("name,frame,code,rid", BAD_FRAMES, ids=[b[0] for b in BAD_FRAMES])
def test_bad_frames_raise_protocol_error(name: str, frame: bytes, code: str, rid: str) -> None:
    with pytest.raises(m.ProtocolError) as info:
        codec.decode(frame, m.CLIENT_REQUESTS)
    assert info.value.code == code, info.value
    assert info.value.rid == rid


def test_oversized_frame_is_refused_before_unpacking() -> None:
    frame = codec.encode(m.Generate("big", text="x" * 5000))
    with pytest.raises(m.ProtocolError) as info:
        codec.decode(frame, m.CLIENT_REQUESTS, max_bytes=1000)
    assert info.value.code == m.ERROR_TOO_LARGE


def test_nested_dataclass_fields_are_checked() -> None:
    body = {"v": 1, "t": "add_requests", "reqs": [{"rid": "a", "input_ids": "oops"}]}
    with pytest.raises(m.ProtocolError, match=r"add_requests.reqs\[0\].input_ids"):
        codec.decode(msgpack.packb(body), m.TO_SCHEDULER)


def test_messages_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.Health("h").rid = "x"  # type: ignore[misc]
