"""RadixAttention on the real model: outputs never depend on caching, chunking, paging or
preemption, and shared prefixes are computed once."""

from __future__ import annotations

import pytest

from conftest import chat

SHARED = (
    "You are a careful assistant. Answer each question about the following story in one "
    "short sentence. Story: Mara found an old brass key under the stairs of her grandmother's "
    "house. The key opened a small wooden box in the attic that held letters from a sailor "
    "named Tomas, written between 1921 and 1924, describing storms, ports and a parrot. "
)
QUESTIONS = [
    "Where was the key?",
    "Who wrote the letters?",
    "What did the box hold?",
    "When were the letters written?",
    "What animal is mentioned?",
    "Who is Mara?",
]
PARAMS = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}

CONFIGS = {
    "cache_off": {"disable_radix_cache": True},
    "chunk_16": {"chunked_prefill_size": 16},
    "chunk_64": {"chunked_prefill_size": 64},
    "chunk_off": {"chunked_prefill_size": -1},
    "page_16": {"page_size": 16},
    "preempt": {"max_total_tokens": 220, "schedule_conservativeness": 0.05},
}


@pytest.fixture(scope="module")
def reference_outputs(make_engine):
    eng = make_engine()
    prompts = [chat(SHARED + q) for q in QUESTIONS]
    outs = [o["output_ids"] for o in eng.generate(prompts, PARAMS)]
    eng.check_idle()
    assert eng.stats()["cached_tokens"] > 0
    return prompts, outs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_outputs_identical(make_engine, reference_outputs, name):
    prompts, expected = reference_outputs
    eng = make_engine(**CONFIGS[name])
    half = len(prompts) // 2
    first = eng.submit(prompts[:half], PARAMS)
    while not all(r.num_output_tokens >= 2 for r in first):  # the first half is decoding
        assert eng.step(), "the first half finished before it decoded twice"
    assert not any(r.finished for r in first)
    second = eng.submit(prompts[half:], PARAMS)  # the second half arrives mid-decode
    while eng.step():
        pass
    assert [r.result()["output_ids"] for r in first + second] == expected
    stats = eng.stats()
    if name == "preempt":
        assert stats["preemptions"] > 0
    if name == "cache_off":
        assert stats["cached_tokens"] == 0
    eng.check_idle()


@pytest.mark.parametrize("page_size", [1, 16])
def test_fork_prefix_computed_once(make_engine, page_size):
    eng = make_engine(page_size=page_size)
    tok = eng.tokenizer
    prefix = tok.encode(SHARED * 3, add_special_tokens=False)[:300]
    branches = [prefix + tok.encode(f" Branch {i}:", add_special_tokens=False) for i in range(8)]
    outs = eng.generate(input_ids=branches, sampling_params={**PARAMS, "max_new_tokens": 32})
    distinct = len({tuple(b[: i + 1]) for b in branches for i in range(len(b))})  # trie size
    assert eng.stats()["prefill_tokens_computed"] == distinct
    assert all(o["meta_info"]["completion_tokens"] == 32 for o in outs)
    eng.check_idle()


def test_parallel_sampling_shares_prompt(make_engine):
    eng = make_engine()
    prompt = chat("Name an animal.")
    outs = eng.generate(
        prompt, {"n": 4, "temperature": 1.0, "seed": 3, "max_new_tokens": 8, "ignore_eos": True}
    )
    assert len(outs) == 4 and len({tuple(o["output_ids"]) for o in outs}) > 1
    n_prompt = outs[0]["meta_info"]["prompt_tokens"]
    assert eng.stats()["prefill_tokens_computed"] == n_prompt + 3
    eng.check_idle()


def test_turns_reuse_previous_turn(make_engine):
    eng = make_engine()
    history = chat("Tell me a fact about the moon.")
    first = eng.generate(history, {"max_new_tokens": 12, "temperature": 0})
    history += first["text"] + "<|im_end|>\n<|im_start|>user\nAnd about the sun?<|im_end|>\n"
    second = eng.generate(
        history + "<|im_start|>assistant\n", {"max_new_tokens": 8, "temperature": 0}
    )
    assert second["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"]
    assert eng.flush_cache() and eng.stats()["tokens_in_tree"] == 0
    eng.check_idle()
