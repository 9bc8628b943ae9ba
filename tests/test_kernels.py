"""Triton attention kernels vs the torch reference, under the Triton CPU interpreter.

Also checks the reference itself against naive per-request attention with explicit masks,
and a tiny random Llama run end to end with either ops object. Launches are batched (one
per dtype/config) because every interpreted program costs milliseconds.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton (and our kernels) are imported

import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402

from radixflow.kernels import REFERENCE_OPS, AttentionOps, reference, triton_ops  # noqa: E402
from radixflow.kernels import decode_attention as decode_module  # noqa: E402
from radixflow.kernels.decode_attention import decode_attention  # noqa: E402
from radixflow.kernels.extend_attention import extend_attention  # noqa: E402

NUM_KV_HEADS = 2
HEAD_DIM = 64
DECODE_LENS = (1, 31, 32, 33, 200)
EXTEND_CASES = [(prefix, new) for prefix in (0, 17, 40) for new in (1, 5, 33)]
TOLERANCE = {  # (atol, rtol): fp16 outputs are rounded, so allow one ulp relative
    torch.float32: (1e-5, 0.0),
    torch.float16: (1e-3, 1e-3),
}


def indptr(lens: list[int]) -> torch.Tensor:
    """Prefix sum (B+1,) int64 of per-request lengths."""
    out = torch.zeros(len(lens) + 1, dtype=torch.int64)
    out[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    return out


def make_pools(
    num_used: int, dtype: torch.dtype, gen: torch.Generator, num_kv_heads: int = NUM_KV_HEADS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V pools with `num_used` random slots at shuffled positions, and poison elsewhere.

    Spare slots hold NaN, so a kernel that gathers a slot it should not poisons its output.
    The dummy slot 0 holds a large finite value instead: the reference gathers it as padding
    (times a zero probability), and a kernel that let it into a softmax would be dominated.
    """
    num_slots = num_used + 1 + 23
    slots = 1 + torch.randperm(num_slots - 1, generator=gen)[:num_used]  # (num_used,)
    shape = (num_slots, num_kv_heads, HEAD_DIM)
    k_buffer = torch.full(shape, float("nan"), dtype=dtype)
    v_buffer = torch.full(shape, float("nan"), dtype=dtype)
    k_buffer[0] = v_buffer[0] = 1e4
    k_buffer[slots] = randn((num_used, num_kv_heads, HEAD_DIM), dtype, gen)
    v_buffer[slots] = randn((num_used, num_kv_heads, HEAD_DIM), dtype, gen)
    return k_buffer, v_buffer, slots


def randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def strided_heads(
    num_rows: int, heads: list[int], dtype: torch.dtype, gen: torch.Generator
) -> list[torch.Tensor]:
    """Random (num_rows, h, D) tensors for each h in `heads`, all views of one fused buffer.

    Like q/k/v split off a fused qkv projection: the row stride is not h * D.
    """
    fused = randn((num_rows, sum(heads), HEAD_DIM), dtype, gen)  # (rows, Σh, D)
    return list(fused.split(heads, dim=1))


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Compare with the dtype's tolerance; returns the max abs error (for reporting)."""
    atol, rtol = TOLERANCE[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    return (actual.float() - expected.float()).abs().max().item()


def decode_case(group: int, lens: list[int], dtype: torch.dtype, seed: int = 0) -> tuple:
    """Arguments of one decode launch: q (B, Hkv*group, D) strided, shuffled slots."""
    gen = torch.Generator().manual_seed(seed)
    k_buffer, v_buffer, slots = make_pools(sum(lens), dtype, gen)
    q, _ = strided_heads(len(lens), [NUM_KV_HEADS * group, 2], dtype, gen)
    return q, k_buffer, v_buffer, indptr(lens), slots, HEAD_DIM**-0.5


def extend_case(group: int, cases: list[tuple[int, int]], dtype: torch.dtype) -> tuple:
    """Arguments of one extend launch: requests (prefix_len, extend_len) in one batch."""
    gen = torch.Generator().manual_seed(1)
    prefix_lens = [prefix for prefix, _ in cases]
    extend_lens = [new for _, new in cases]
    k_buffer, v_buffer, slots = make_pools(sum(prefix_lens), dtype, gen)
    heads = [NUM_KV_HEADS * group, NUM_KV_HEADS, NUM_KV_HEADS]
    q, k, v = strided_heads(sum(extend_lens), heads, dtype, gen)
    qo_indptr, kv_indptr = indptr(extend_lens), indptr(prefix_lens)
    return q, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, slots, HEAD_DIM**-0.5


# ---------------------------------------------------------------- kernels vs reference


def test_kernels_run_in_the_interpreter() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    kernel = decode_module._decode_split_kernel
    assert isinstance(kernel, InterpretedFunction), (
        "radixflow.kernels.decode_attention was imported before TRITON_INTERPRET=1 was set"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_splits", [1, 8])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_decode_matches_reference(dtype: torch.dtype, num_kv_splits: int, group: int) -> None:
    args = decode_case(group, list(DECODE_LENS), dtype)
    out = decode_attention(*args, num_kv_splits=num_kv_splits)  # (B, H, D)
    assert_close(out, reference.decode_attention(*args, num_kv_splits=num_kv_splits))


def test_decode_split_counts_agree() -> None:
    """1 split (the merge is a copy), a non-power-of-two count, mostly empty splits."""
    args = decode_case(3, [5, 64, 100, 257], torch.float32, seed=2)
    single = decode_attention(*args, num_kv_splits=1)
    for num_kv_splits in (3, 16):
        assert_close(decode_attention(*args, num_kv_splits=num_kv_splits), single)


def test_decode_group_larger_than_head_tile() -> None:
    """20 query heads per KV head take two [BLOCK_H, D] tiles, the second one part masked."""
    assert 20 > decode_module.BLOCK_H
    args = decode_case(20, [3, 50], torch.float32, seed=5)
    assert_close(decode_attention(*args, num_kv_splits=2), reference.decode_attention(*args))


def test_decode_empty_request_gives_zeros() -> None:
    """A request with no KV gets zeros like the reference (no NaN from an all-empty merge)."""
    args = decode_case(3, [0, 40, 0], torch.float32, seed=3)
    out = decode_attention(*args, num_kv_splits=8)
    assert torch.all(out[0] == 0) and torch.all(out[2] == 0)
    assert_close(out, reference.decode_attention(*args))


def test_reference_decode_groups_mixed_lengths() -> None:
    """The torch decode pads within groups of similar KV length: a batch mixing long and short
    contexts forms several groups and gives each request what it gets alone."""
    lens = [300, 4, 290, 17, 1, 120, 0, 33]
    q, k_buffer, v_buffer, kv_indptr, slots, scale = decode_case(3, lens, torch.float32, seed=5)
    groups = reference.decode_layout(kv_indptr, slots).groups
    assert len(groups) >= 3 and sorted(torch.cat([g[0] for g in groups]).tolist()) == list(
        range(len(lens))
    )
    assert sum(g[1].numel() for g in groups) <= 2 * sum(lens) + max(lens)
    together = reference.decode_attention(q, k_buffer, v_buffer, kv_indptr, slots, scale)
    for b, n in enumerate(lens):
        own = slots[int(kv_indptr[b]) : int(kv_indptr[b + 1])]
        alone = reference.decode_attention(
            q[b : b + 1], k_buffer, v_buffer, indptr([n]), own, scale
        )
        assert_close(together[b : b + 1], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 3])
def test_extend_matches_reference(dtype: torch.dtype, group: int) -> None:
    args = extend_case(group, EXTEND_CASES, dtype)
    out = extend_attention(*args)  # (T, H, D)
    assert_close(out, reference.extend_attention(*args))


def test_extend_without_any_prefix() -> None:
    """All prefixes empty: kv_indices has no elements and loop 1 never runs."""
    args = extend_case(3, [(0, 20), (0, 1)], torch.float32)
    assert args[-2].numel() == 0
    assert_close(extend_attention(*args), reference.extend_attention(*args))


def test_launch_wrappers_reject_bad_inputs() -> None:
    q, k_buffer, v_buffer, kv_indptr, kv_indices, scale = decode_case(3, [4, 9], torch.float32)
    with pytest.raises(AssertionError, match="int32/int64"):
        decode_attention(q, k_buffer, v_buffer, kv_indptr.float(), kv_indices, scale)
    strided_q = torch.empty((*q.shape[:2], 2 * q.shape[2]))[..., ::2]  # stride(-1) == 2
    with pytest.raises(AssertionError, match="contiguous"):
        decode_attention(strided_q, k_buffer, v_buffer, kv_indptr, kv_indices, scale)
    with pytest.raises(AssertionError):
        decode_attention(q.half(), k_buffer, v_buffer, kv_indptr, kv_indices, scale)
    with pytest.raises(AssertionError, match="kv_indptr"):
        decode_attention(q, k_buffer, v_buffer, kv_indptr[:-1], kv_indices, scale)
    args = list(extend_case(3, [(3, 2)], torch.float32))
    args[5] = args[5].to(torch.int16)  # qo_indptr
    with pytest.raises(AssertionError, match="int32/int64"):
        extend_attention(*args)


COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from radixflow.kernels import decode_attention as decode, extend_attention as extend

def build(kernel, dtype, constexprs, num_warps, num_stages):
    capabilities = (80, 90) if dtype == "bf16" else (90,)
    def kind(name):
        if name in constexprs:
            return "constexpr"
        if name.endswith("_ptr"):
            return "*i64" if "ind" in name else "*fp32" if "part_" in name else "*" + dtype
        return "fp32" if name == "sm_scale" else "i32"
    signature = {name: kind(name) for name in kernel.arg_names}
    source = ASTSource(kernel, signature, constexprs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    for capability in capabilities:
        assert triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)

for dtype in ("bf16", "fp32"):
    split = dict(GROUP=3, BLOCK_H=decode.BLOCK_H, BLOCK_N=decode.BLOCK_N, BLOCK_D=64, UPCAST=False)
    build(decode._decode_split_kernel, dtype, split, 4, 2)
    for block_s in (1, 8):  # num_kv_splits=1 gives a one-element tl.arange
        merge = dict(BLOCK_S=block_s, BLOCK_N=decode.BLOCK_N, BLOCK_D=64)
        build(decode._decode_merge_kernel, dtype, merge, 4, 2)
    blocks = (128, 64) if dtype == "bf16" else (64, 32)
    extend_constexprs = dict(GROUP=3, BLOCK_M=blocks[0], BLOCK_N=blocks[1], BLOCK_D=64)
    build(extend._extend_kernel, dtype, dict(extend_constexprs, UPCAST=False), 4, 1)
print("compiled")
"""


def test_kernels_compile_for_cuda_targets() -> None:
    """The interpreter is lenient; compiling to sm80/sm90 cubins (no GPU needed) is not."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


# ---------------------------------------------------------------- reference vs naive loops


def naive_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """q (Lq, D), keys/values (Lk, D), visible (Lq, Lk) bool -> (Lq, D), in float64."""
    scores = (q.double() @ keys.double().T) * scale  # (Lq, Lk)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values.double()


def naive_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One request and one head at a time, with an explicit bottom-right causal mask."""
    out = torch.zeros(q.shape, dtype=torch.float64)  # (T, H, D)
    group = q.shape[1] // k.shape[1]
    for b in range(qo_indptr.numel() - 1):
        rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        slots = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])]
        prefix_len, extend_len = slots.numel(), rows.stop - rows.start
        # new token i sees keys 0 .. prefix_len + i
        visible = torch.ones(extend_len, prefix_len + extend_len).tril(prefix_len).bool()
        for h in range(q.shape[1]):
            keys = torch.cat([k_buffer[slots, h // group], k[rows, h // group]])  # (P+E, D)
            values = torch.cat([v_buffer[slots, h // group], v[rows, h // group]])
            out[rows, h] = naive_attention(q[rows, h], keys, values, visible, scale)
    return out


def naive_decode(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One request and one head at a time over all its pooled keys."""
    out = torch.zeros(q.shape, dtype=torch.float64)  # (B, H, D)
    group = q.shape[1] // k_buffer.shape[1]
    for b in range(q.shape[0]):
        slots = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])]
        if slots.numel() == 0:
            continue  # the reference's convention: no keys -> zeros
        visible = torch.ones(1, slots.numel(), dtype=torch.bool)
        for h in range(q.shape[1]):
            keys, values = k_buffer[slots, h // group], v_buffer[slots, h // group]
            out[b, h] = naive_attention(q[b, h][None], keys, values, visible, scale)[0]
    return out


@pytest.mark.parametrize("group", [1, 3])
def test_reference_extend_matches_naive(group: int) -> None:
    args = extend_case(group, EXTEND_CASES, torch.float32)
    expected = naive_extend(*args).float()
    torch.testing.assert_close(reference.extend_attention(*args), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("group", [1, 4])
def test_reference_decode_matches_naive(group: int) -> None:
    args = decode_case(group, [0, *DECODE_LENS], torch.float32)
    expected = naive_decode(*args).float()
    torch.testing.assert_close(reference.decode_attention(*args), expected, atol=1e-5, rtol=0)


def shared_slots(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Pools and kv_indices of six requests as a radix tree lays them out: three behind one
    100-slot prefix (two of them also share the next 70), two behind another 80-slot prefix
    (one of them ending right at it), one alone. -> (k_buffer, v_buffer, slots, lens)."""
    k_buffer, v_buffer, pool = make_pools(456, torch.float32, gen)
    take = iter(pool.split([100, 70, 5, 9, 30, 80, 12, 150]))
    root, branch, *tails = next(take), next(take), next(take), next(take), next(take)
    other, other_tail, alone = next(take), next(take), next(take)
    requests = [
        torch.cat([root, branch, tails[0]]),
        torch.cat([root, branch, tails[1]]),
        torch.cat([root, tails[2]]),
        torch.cat([other, other_tail]),
        other,
        alone,
    ]
    return k_buffer, v_buffer, torch.cat(requests), [len(r) for r in requests]


def test_reference_decode_with_shared_prefixes_matches_naive() -> None:
    gen = torch.Generator().manual_seed(5)
    k_buffer, v_buffer, slots, lens = shared_slots(gen)
    kv_indptr = indptr(lens)
    layout = reference.decode_layout(kv_indptr, slots)
    assert sorted(len(g.slots) for g in layout.shared) == [70, 80, 100]  # 70: nested
    q = randn((len(lens), NUM_KV_HEADS * 3, HEAD_DIM), torch.float32, gen)
    expected = naive_decode(q, k_buffer, v_buffer, kv_indptr, slots, 0.125).float()
    actual = reference.decode_attention(q, k_buffer, v_buffer, kv_indptr, slots, 0.125)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def test_reference_extend_with_shared_prefixes_matches_naive() -> None:
    """New tokens (1, 7, 33, 4, 2, 5) behind the shared prefixes; one prefix is shared in
    full, so that request's remaining keys are only its own new tokens."""
    gen = torch.Generator().manual_seed(6)
    k_buffer, v_buffer, slots, lens = shared_slots(gen)
    new = [1, 7, 33, 4, 2, 5]
    q, k, v = strided_heads(
        sum(new), [NUM_KV_HEADS * 3, NUM_KV_HEADS, NUM_KV_HEADS], torch.float32, gen
    )
    args = (q, k, v, k_buffer, v_buffer, indptr(new), indptr(lens), slots, 0.125)
    assert len(reference.make_layout(*args[5:8]).shared) == 3
    expected = naive_extend(*args).float()
    torch.testing.assert_close(reference.extend_attention(*args), expected, atol=1e-5, rtol=0)


def test_reference_decode_is_extend_of_one_token() -> None:
    """Decode of the last token == extend of that token over the rest as prefix."""
    gen = torch.Generator().manual_seed(4)
    lens = [7, 30]
    k_buffer, v_buffer, slots = make_pools(sum(lens), torch.float32, gen)
    q = randn((2, 6, HEAD_DIM), torch.float32, gen)
    decoded = reference.decode_attention(q, k_buffer, v_buffer, indptr(lens), slots, 0.125)
    last = indptr(lens)[1:] - 1  # the new token's position in kv_indices
    prefix = torch.cat([slots[0:6], slots[7:36]])
    extended = reference.extend_attention(
        q, k_buffer[slots[last]], v_buffer[slots[last]], k_buffer, v_buffer,
        indptr([1, 1]), indptr([6, 29]), prefix, 0.125,
    )  # fmt: skip
    torch.testing.assert_close(extended, decoded, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- tiny Llama, both ops


@dataclass
class Seq:
    """A request in the toy runner: all its tokens and the slots of the cached ones."""

    tokens: list[int]
    slots: list[int] = field(default_factory=list)


def longs(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def forward_step(
    model: torch.nn.Module,
    caches: tuple[torch.Tensor, torch.Tensor],
    free: list[int],
    extends: list[Seq],
    decodes: list[Seq],
) -> torch.Tensor:
    """Run uncached tokens of `extends` and the last token of `decodes`; logits (R, vocab)."""
    from radixflow.runtime.models.llama import ForwardBatch

    ids, positions, out_slots, logit_rows = [], [], [], []
    extend_lens, prefix_lens, prefix_slots, decode_lens, decode_slots = [], [], [], [], []
    for seq in extends + decodes:
        cached = len(seq.slots)
        new_slots = [free.pop() for _ in seq.tokens[cached:]]
        ids += seq.tokens[cached:]
        positions += range(cached, len(seq.tokens))
        out_slots += new_slots
        logit_rows.append(len(ids) - 1)
        if seq in decodes:  # decode reads its own new slot from the pool
            decode_lens.append(len(seq.tokens))
            decode_slots += seq.slots + new_slots
        else:
            extend_lens.append(len(new_slots))
            prefix_lens.append(cached)
            prefix_slots += seq.slots
        seq.slots += new_slots
    batch = ForwardBatch(
        input_ids=longs(ids), positions=longs(positions), out_slots=longs(out_slots),
        num_extend_tokens=sum(extend_lens), extend_qo_indptr=indptr(extend_lens),
        extend_kv_indptr=indptr(prefix_lens), extend_kv_indices=longs(prefix_slots),
        decode_kv_indptr=indptr(decode_lens), decode_kv_indices=longs(decode_slots),
        logit_rows=longs(logit_rows),
    )  # fmt: skip
    return model(batch, *caches)


def run_tiny_llama(ops: AttentionOps) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill two prompts, extend a third over a shared prefix beside decodes, decode on.

    Returns every step's logits and the greedy continuation of each request.
    """
    llama = pytest.importorskip("radixflow.runtime.models.llama")
    config = llama.LlamaConfig(
        vocab_size=97, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=6,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, max_position=128, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = llama.LlamaModel(config, ops).eval()
    shape = (config.num_layers, 160, config.num_kv_heads, config.head_dim)
    caches = (torch.full(shape, float("nan")), torch.full(shape, float("nan")))
    for cache in caches:  # (layers, slots, Hkv, D): NaN except the dummy slot, as in make_pools
        cache[:, 0] = 0.0
    free = (1 + torch.randperm(159, generator=torch.Generator().manual_seed(5))).tolist()
    prompt = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    a, b, c = Seq(prompt[:9]), Seq(prompt[9:30]), Seq(prompt[:9] + prompt[20:24])
    all_logits = []
    schedule = [([a, b], []), ([c], [a, b]), ([], [a, b, c]), ([], [a, b, c]), ([], [a, b, c])]
    for extends, decodes in schedule:
        if c in extends:
            c.slots = a.slots[:9]  # c reuses a's cached prompt as its prefix
        logits = forward_step(model, caches, free, extends, decodes)  # (R, vocab)
        all_logits.append(logits)
        for seq, token in zip(extends + decodes, logits.argmax(-1).tolist(), strict=True):
            seq.tokens.append(token)
    return all_logits, [a.tokens, b.tokens, c.tokens]


def test_tiny_llama_triton_ops_match_reference_ops() -> None:
    expected_logits, expected_tokens = run_tiny_llama(REFERENCE_OPS)
    logits, tokens = run_tiny_llama(triton_ops())
    assert tokens == expected_tokens
    assert len(tokens[2]) == 13 + 4  # c: prompt, 1 token from its extend, 3 decodes
    for step_logits, step_expected in zip(logits, expected_logits, strict=True):
        torch.testing.assert_close(step_logits, step_expected, atol=1e-4, rtol=1e-4)
