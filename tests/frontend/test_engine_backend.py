"""radixflow.Engine as a program's backend (the session's engine, in this process): programs
give what the engine gives directly and share prefixes through its radix tree; gen(n) prefills
its prefix once; stop_regex stops at its match; a stream's logprobs come in SGLang's
incremental form; and the Engine's SGLang methods (async streaming, server info)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import radixflow as sgl
import radixflow.runtime

GREEDY = {"temperature": 0}


@sgl.function
def chat_and_choose(s: Any) -> None:
    s += "The capital of France is" + sgl.gen("capital", max_tokens=6)
    s += "\nIs that right? Answer:" + sgl.select("verdict", choices=[" yes", " no"])
    forks = s.fork(2)
    forks += lambda i: f"\nAnother city in France, number {i + 1}:" + sgl.gen("city", max_tokens=4)
    forks.join()


def test_a_program_runs_on_the_engine_and_shares_its_prefixes(engine: Any) -> None:
    assert sgl.Engine is radixflow.runtime.Engine
    assert sgl.flush_cache(engine)
    state = chat_and_choose.run(backend=engine, **GREEDY)
    assert state.error() is None, state.error()
    direct = engine.generate("The capital of France is", {"max_new_tokens": 6, **GREEDY})
    assert state["capital"] == direct["text"] and "Paris" in direct["text"]
    assert state["verdict"] in (" yes", " no")
    assert len(state.get_meta_info("verdict")["input_token_logprobs"]) == 2
    assert len(state["city"]) == 2
    # each branch found the shared text in the engine's radix tree (fork cached it once)
    text = state.text()
    prompt = len(engine.tokenizer.encode(text, add_special_tokens=False))
    for meta in state.get_meta_info("city"):
        assert meta["cached_tokens"] >= prompt - 2, (meta, prompt)


SHARED = "Here are facts about the sea.\n" + "".join(
    f"Fact {i}: the sea covers much of the planet and holds {i + 3} kinds of fish.\n"
    for i in range(10)
)


@sgl.function
def samples(s: Any) -> None:
    # 1.5: at 1.0 the greedy 4 tokens have probability 0.86, so 4 samples often all agree
    s += SHARED + "Fact 10:" + sgl.gen("fact", max_tokens=4, n=4, temperature=1.5, seed=7)


def test_gen_n_prefills_the_shared_prefix_once(engine: Any) -> None:
    prompt = len(engine.tokenizer.encode(SHARED + "Fact 10:", add_special_tokens=False))
    assert sgl.flush_cache(engine)
    before = engine.stats()["prefill_tokens_computed"]
    state = samples.run(backend=engine)
    facts = state["fact"]
    assert isinstance(facts, list) and len(facts) == 4 and len(set(facts)) > 1, facts
    assert state.text() == SHARED + "Fact 10:" + facts[0]
    computed = engine.stats()["prefill_tokens_computed"] - before
    # one prefill; each other sample found it cached and computes only the last prompt token
    # again (for its own first logits)
    assert computed == prompt + 3, (computed, prompt)
    assert [m["cached_tokens"] for m in state.get_meta_info("fact")].count(0) == 1


@sgl.function
def sentence(s: Any, stop_regex: str | None) -> None:
    s += "The capital of France is" + sgl.gen("rest", max_tokens=16, stop_regex=stop_regex)


def test_stop_regex_stops_at_its_match(engine: Any) -> None:
    full = sentence.run(stop_regex=None, backend=engine, **GREEDY)["rest"]
    rest = sentence.run(stop_regex=r"[.!?]", backend=engine, **GREEDY)["rest"]
    assert re.search(r"[.!?]", rest).end() == len(rest), rest  # the first match ends it
    assert full.startswith(rest) and len(rest) < len(full), (rest, full)


@sgl.function
def story(s: Any) -> None:
    # the stop string holds back a " the" (it may begin the stop): that chunk adds no text,
    # and its token's logprobs go with the next chunk
    s += "Once upon a time" + sgl.gen(
        "story", max_tokens=12, stop=" the@@", return_logprob=True, top_logprobs_num=2
    )


def test_streamed_logprobs_come_per_chunk(engine: Any) -> None:
    """text_async_iter(return_meta_data=True): each chunk carries the logprobs of its own
    new tokens (merged forward from chunks that added no text), which add up to the whole."""

    async def collect() -> tuple[Any, list[Any]]:
        state = story.run(backend=engine, stream=True, **GREEDY)
        return state, [c async for c in state.text_async_iter("story", return_meta_data=True)]

    state, chunks = asyncio.run(collect())
    final = state.get_meta_info("story")
    entries = [e for _, meta in chunks for e in meta["output_token_logprobs"]]
    tops = [t for _, meta in chunks for t in meta["output_top_logprobs"]]
    assert "".join(text for text, _ in chunks) == state["story"]
    assert len(chunks) > 2 and len(entries) == final["completion_tokens"] == 12
    assert entries == final["output_token_logprobs"] and len(tops) == 12
    direct = engine.generate(
        "Once upon a time", {"max_new_tokens": 12, **GREEDY}, return_logprob=True
    )
    assert [e[1] for e in entries] == direct["output_ids"]


def state_pieces(state: Any) -> list[tuple[str, dict[str, Any]]]:
    """The stream's pieces that added no text, as (text, meta)."""
    pieces = state.stream_executor.pieces
    return [(p.text, p.meta or {}) for p in pieces if p.var == "story" and not p.text]


def test_the_engine_streams_async_and_reports_as_sglangs(engine: Any) -> None:
    async def stream() -> list[dict[str, Any]]:
        chunks = await engine.async_generate("Once upon a time", {"max_new_tokens": 6, **GREEDY},
                                             stream=True, return_logprob=True)  # fmt: skip
        return [chunk async for chunk in chunks]

    chunks = asyncio.run(stream())
    assert chunks[-1]["finished"] and not any(c["finished"] for c in chunks[:-1])
    assert sum(len(c["meta_info"]["output_token_logprobs"]) for c in chunks) == 6
    whole = engine.generate("Once upon a time", {"max_new_tokens": 6, **GREEDY})
    assert chunks[-1]["text"] == whole["text"]
    info = engine.get_server_info()
    assert info["internal_states"][0]["prefill_tokens_computed"] > 0 and "api_key" not in info
    assert engine.get_model_info()["context_length"] == info["context_length"]
