"""The forward pass against transformers, and greedy generation token for token."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import CHAT_PROMPTS, chat
from radixflow.runtime.models.layers import ForwardBatch


def _t(values):
    return torch.tensor(values, dtype=torch.int64)


def test_ragged_logits_match_transformers(engine):
    """One ragged batch: a fresh prompt, a prompt continuing from a cached prefix, a decode.
    The reference is transformers in float64, the exact logits: two fp32 implementations that
    sum in different orders (our packed MKL matmuls, transformers' F.linear) each sit about
    6e-5 from them here, so against each other they may differ by twice that."""
    from transformers import AutoModelForCausalLM

    from radixflow.runtime.models.loader import weight_files

    weight_files(Path(engine.model_info["model_path"]))  # the GGUF dequantised, once
    hf_model = AutoModelForCausalLM.from_pretrained(
        engine.model_info["model_path"], dtype=torch.float64
    ).eval()
    tok = engine.tokenizer
    model = engine._loaded.model
    seqs = [
        tok.encode(t)
        for t in (
            "The quick brown fox jumps",
            "Paris is the capital of",
            "One two three four five six",
        )
    ]
    cfg = model.config
    k = torch.zeros(cfg.num_layers, 256, cfg.num_kv_heads, cfg.head_dim)
    v = torch.zeros_like(k)
    # Step 1: cache the first 3 tokens of seq 1 and the first len-1 tokens of seq 2.
    warm = [seqs[1][:3], seqs[2][:-1]]
    slots = [list(range(100, 103)), list(range(150, 150 + len(warm[1])))]
    rows = [0, len(warm[0])]
    model(
        ForwardBatch(
            input_ids=_t(warm[0] + warm[1]),
            positions=_t(list(range(3)) + list(range(len(warm[1])))),
            out_slots=_t(slots[0] + slots[1]),
            num_extend_tokens=len(warm[0]) + len(warm[1]),
            extend_qo_indptr=_t([0, 3, 3 + len(warm[1])]),
            extend_kv_indptr=_t([0, 0, 0]),
            extend_kv_indices=_t([]),
            decode_kv_indptr=_t([0]),
            decode_kv_indices=_t([]),
            logit_rows=_t(rows),
        ),
        k,
        v,
    )
    # Step 2: seq 0 fresh (extend), seq 1 continues after its 3 cached tokens, seq 2 decodes.
    s0, s1, s2 = seqs
    new0 = list(range(10, 10 + len(s0)))
    new1 = list(range(103, 103 + len(s1) - 3))
    dec_slot = 150 + len(s2) - 1
    input_ids = s0 + s1[3:] + [s2[-1]]
    positions = list(range(len(s0))) + list(range(3, len(s1))) + [len(s2) - 1]
    n_ext = len(s0) + len(s1) - 3
    logits = model(
        ForwardBatch(
            input_ids=_t(input_ids),
            positions=_t(positions),
            out_slots=_t(new0 + new1 + [dec_slot]),
            num_extend_tokens=n_ext,
            extend_qo_indptr=_t([0, len(s0), n_ext]),
            extend_kv_indptr=_t([0, 0, 3]),
            extend_kv_indices=_t(slots[0]),
            decode_kv_indptr=_t([0, len(s2)]),
            decode_kv_indices=_t(slots[1] + [dec_slot]),
            logit_rows=_t(list(range(n_ext + 1))),
        ),
        k,
        v,
    )
    with torch.no_grad():
        expected = [hf_model(torch.tensor([s])).logits[0] for s in seqs]
    want = torch.cat([expected[0], expected[1][3:], expected[2][-1:]])
    err = (logits.double() - want).abs().max().item()
    assert err < 1e-4, f"max abs logit error {err}"


def test_greedy_matches_transformers_generate(engine, hf_model):
    tok = engine.tokenizer
    prompts = [chat(p) for p in CHAT_PROMPTS]
    ours = engine.generate(prompts, {"max_new_tokens": 32, "temperature": 0})
    for prompt, out in zip(prompts, ours):
        ids = tok.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=32,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
        ref_ids = ref[0, len(ids) :].tolist()
        if tok.eos_token_id in ref_ids:  # transformers stops at EOS too (and keeps it)
            ref_ids = ref_ids[: ref_ids.index(tok.eos_token_id) + 1]
        assert out["output_ids"] == ref_ids, prompt
        assert len(ref_ids) >= 8
    engine.check_idle()


def test_batch_equals_alone(make_engine):
    eng = make_engine()
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta river stone cloud music paper light".split()
    prompts = [" ".join(rng.choice(words, size=int(n))) for n in rng.integers(2, 40, size=16)]
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    together = eng.generate(prompts, params)
    alone_engine = make_engine(disable_radix_cache=True)
    for prompt, out in zip(prompts, together):
        assert alone_engine.generate(prompt, params)["output_ids"] == out["output_ids"]
    eng.check_idle()
    alone_engine.check_idle()


def test_stop_strings_and_tokens(engine):
    prompt = chat("Count from 1 to 20, separated by commas.")
    full = engine.generate(prompt, {"max_new_tokens": 40, "temperature": 0})
    assert "5" in full["text"]
    cut = engine.generate(prompt, {"max_new_tokens": 40, "temperature": 0, "stop": ["5"]})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": "5"}
    assert cut["text"] == full["text"][: full["text"].index("5")]
    first = full["output_ids"][2]
    by_id = engine.generate(
        prompt, {"max_new_tokens": 40, "temperature": 0, "stop_token_ids": [first]}
    )
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    assert by_id["output_ids"] == full["output_ids"][:3]
    short = engine.generate(prompt, {"max_new_tokens": 5, "temperature": 0})
    assert short["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert short["output_ids"] == full["output_ids"][:5]


def test_min_new_tokens_and_ignore_eos(engine):
    prompt = chat("What is the capital of France?")
    base = engine.generate(prompt, {"max_new_tokens": 30, "temperature": 0})
    n = base["meta_info"]["completion_tokens"]
    assert base["meta_info"]["finish_reason"]["type"] == "stop" and n < 25
    longer = engine.generate(
        prompt, {"max_new_tokens": 30, "temperature": 0, "min_new_tokens": n + 3}
    )
    assert longer["meta_info"]["completion_tokens"] >= n + 3
    ignored = engine.generate(prompt, {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True})
    assert ignored["meta_info"]["completion_tokens"] == 30


def test_sampling_seeded_and_varied(engine):
    prompt = chat("Name a colour.")
    params = {
        "max_new_tokens": 12,
        "temperature": 1.0,
        "top_p": 0.95,
        "seed": 7,
        "ignore_eos": True,
    }
    a = engine.generate(prompt, params)
    b = engine.generate([prompt, "unrelated other prompt"], params)[0]
    assert a["output_ids"] == b["output_ids"]  # a seed does not depend on the batch
    outs = {tuple(engine.generate(prompt, {**params, "seed": s})["output_ids"]) for s in range(6)}
    assert len(outs) > 1
    top1 = engine.generate(
        prompt, {"max_new_tokens": 12, "temperature": 0.7, "top_k": 1, "ignore_eos": True}
    )
    greedy = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert top1["output_ids"] == greedy["output_ids"]


def test_penalties_change_output(engine):
    prompt = "Repeat after me: cat cat cat cat cat cat cat"
    base = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    pen = engine.generate(
        prompt,
        {
            "max_new_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "frequency_penalty": 2.0,
            "presence_penalty": 2.0,
        },
    )
    assert pen["output_ids"] != base["output_ids"]
    counts = lambda ids: max(ids.count(t) for t in set(ids))
    assert counts(pen["output_ids"]) <= counts(base["output_ids"])


def test_logprobs(engine):
    prompt = chat("Pick a number.")
    out = engine.generate(
        prompt,
        {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
    )
    meta = out["meta_info"]
    lps = meta["output_token_logprobs"]
    assert len(lps) == 6 and all(lp <= 0 for lp, _, _ in lps)
    # greedy: the chosen token is the top-1 entry
    assert all(top[0][1] == tok for top, (_, tok, _) in zip(meta["output_top_logprobs"], lps))
    n_prompt = meta["prompt_tokens"]
    inp = meta["input_token_logprobs"]
    assert len(inp) == n_prompt and inp[0][0] is None
    assert all(lp <= 0 for lp, _, _ in inp[1:])


@pytest.mark.parametrize(
    "bad",
    [
        {"max_new_tokens": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"temperature": -1},
        {"top_k": 0},
        {"min_p": 2},
        {"no_such_param": 1},
        {"max_new_tokens": "ten"},
        {"stop": 5},
        {"n": 0},
    ],
)
def test_bad_parameters_raise(engine, bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        engine.generate("hello", bad)


def test_prompt_past_context_raises(engine):
    ids = [42] * (engine.scheduler.context_len + 1)
    with pytest.raises(ValueError, match="context"):
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})


def test_stream_is_cumulative_and_utf8_safe(engine):
    prompt = chat("Write the word café three times.")
    chunks = list(engine.generate(prompt, {"max_new_tokens": 20, "temperature": 0}, stream=True))
    final = chunks[-1]
    assert final["finished"] and not any(c["finished"] for c in chunks[:-1])
    texts = [c["text"] for c in chunks[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert all("\ufffd" not in t for t in texts)
    assert final["text"].startswith(texts[-1].rstrip()) or final["text"] == texts[-1]
    whole = engine.generate(prompt, {"max_new_tokens": 20, "temperature": 0})
    assert whole["text"] == final["text"]


_PREFAULT_PROBE = """
import resource, sys, torch
from radixflow.runtime.model_executor.model_runner import ModelRunner, pick_ops
from radixflow.runtime.models.layers import CausalLM, ModelConfig

config = ModelConfig(
    vocab_size=97, hidden_size=64, intermediate_size=64, num_layers=4, num_heads=4,
    num_kv_heads=4, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling=None, max_position=256, tie_word_embeddings=False,
)
model = CausalLM(config, pick_ops("auto", torch.device("cpu"), config)).eval()
prefault = sys.argv[1] == "1"
runner = ModelRunner(model, 1 << 17, prefault=prefault)  # 2 pools of 32 MiB each
if runner.kv_prefault is not None:  # populated on a thread: done
    runner.kv_prefault.join()
pages = runner.k_caches.view(-1)[:: 4096 // 4]  # one float on every 4 KB page
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
pages.fill_(1.0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_cpu_kv_pool_is_prefaulted_unless_disabled():
    """The runner commits its CPU pool at start (on a thread where the kernel populates
    pages, runtime/model_executor/prefault.py), so a step's first KV writes into fresh pages
    do not page-fault; `prefault=False` (the Engine's --disable-kv-prefault) leaves them.
    Each case runs in a fresh process: in this one, earlier tests leave freed memory the
    allocator may hand back already faulted, which would hide the difference."""
    import subprocess
    import sys

    faults = {}
    for prefault in (False, True):
        out = subprocess.run(
            [sys.executable, "-c", _PREFAULT_PROBE, str(int(prefault))],
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout  # fmt: skip
        faults[prefault] = int(out.split()[-1])
    # 8192 pages of 4 KB (or 16 transparent huge pages of 2 MB) fault unless prefaulted
    assert faults[True] < 10 < faults[False], faults


def test_kv_prefault_keeps_what_the_engine_wrote_meanwhile():
    """The background prefault commits pages without writing them: rows stored in the pool
    before (or while) it runs are kept; where the kernel cannot populate, the pool is
    zeroed at once, before anything is stored."""
    from radixflow.runtime.model_executor import prefault

    pool = torch.from_numpy(np.zeros(1 << 22, dtype=np.float32))  # 16 MiB, pages not yet touched
    pool[:: 4096 // 4] = 3.0  # the engine's first stores, one a page
    thread = prefault.prefault([pool])
    if thread is None:
        pytest.skip("no MADV_POPULATE_WRITE on this kernel: the pool is zeroed at start")
    thread.join()
    assert (pool[:: 4096 // 4] == 3.0).all() and pool.sum().item() == 3.0 * (1 << 22) // 1024
