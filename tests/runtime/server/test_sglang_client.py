"""SGLang's own frontend (`import sglang as sgl`, `sgl.RuntimeEndpoint("http://...")`, SGLang's
package, not radixflow's DSL) runs SGLang's own test programs against a radixflow server,
unchanged. The programs whose assertions check the answers of a large model (few-shot QA,
ReAct's country, exact integers) are left out: SmolLM2-135M gets those wrong on any server;
the ones here assert what the server must do (selects, regexes, JSON, streams, forks)."""

from __future__ import annotations

import asyncio
import time

import pytest

sgl = pytest.importorskip("sglang", reason="scripts/setup.sh installs SGLang's package")
programs = pytest.importorskip("sglang.test.test_programs")

DEFAULT = [
    ("select", (False,)),
    ("decode_json", ()),
    ("tool_use", ()),
    ("stream", ()),
    ("regex", ()),
    ("dtype_gen", ()),
    ("stream_logprobs", ()),  # each chunk's logprob entries are its own tokens only
]
LONGER = [
    ("mt_bench", ()),
    ("expert_answer", (False,)),
    ("parallel_encoding", (False,)),
    ("decode_json_regex", ()),
    ("parallel_decoding", ()),
]


# its own server, not the session's shared one: greedy text under the default int8 matmuls
# moves with what the tree already holds, and decode_json's output then ran to its limit.
# stream_logprobs holds the server to SGLang's incremental form at `auto`'s pace (~300
# tokens/s here): its client keeps only the newest event's meta, so the server must not send
# two events at once (a final right after a chunk, or faster than the reader wakes)
SERVER = dict(max_total_tokens=16384)


@pytest.fixture(scope="module")
def backend(runtime):
    endpoint = sgl.RuntimeEndpoint(runtime.url)
    sgl.set_default_backend(endpoint)
    yield endpoint
    sgl.set_default_backend(None)


@pytest.mark.parametrize(("name", "args"), DEFAULT, ids=[n for n, _ in DEFAULT])
def test_sglang_program(backend, name: str, args: tuple) -> None:
    getattr(programs, f"test_{name}")(*args)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "args"), LONGER, ids=[n for n, _ in LONGER])
def test_sglang_program_longer(backend, name: str, args: tuple) -> None:
    getattr(programs, f"test_{name}")(*args)


def test_it_is_sglangs_own_client(backend) -> None:
    assert type(backend).__module__.startswith("sglang.")
    assert backend.get_model_name()


def test_stream_logprobs_reach_a_reader_that_works_between_chunks(backend) -> None:
    """SGLang's stream_logprobs program with a reader that spends 12 ms on each chunk (a client
    rendering it): every chunk it sees holds exactly the entries of its own tokens. The
    client keeps only the newest event's meta_info, so this holds only while the server
    sends a logprob stream's events further apart than the reader's work (a decode step here
    is 3-8 ms): it fails with the events unpaced."""

    @sgl.function
    def answer(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", return_logprob=True))

    async def chunks() -> list[tuple[str, dict]]:
        state = answer(
            question="Write a long travel blog post about Hawaii.",
            stream=True,
            temperature=0,
            max_new_tokens=48,
        )
        out = []
        async for text, meta in state.text_async_iter("answer", return_meta_data=True):
            out.append((text, meta))
            time.sleep(0.012)  # blocks the loop, as a busy reader does
        return out

    seen, tokens = asyncio.run(chunks()), 0
    assert len(seen) > 1
    for text, meta in seen:
        assert text
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - tokens
        tokens = meta["completion_tokens"]
    assert tokens == 48
