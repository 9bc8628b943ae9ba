"""Triton attention kernels vs the plain torch reference, under the Triton CPU interpreter.

Decode (split-KV, and with shared-prefix groups), extend, the launch checks, compilation
for CUDA targets, and a tiny random Llama run end to end on the reference, the CPU fast
path and the Triton ops. Launches are batched (one per dtype/config) because every
interpreted program costs milliseconds. The reference and the CPU fast path are tested
without Triton in tests/kernels/cpu/test_kernels_cpu.py.
"""

import os

from conftest import use_the_triton_interpreter

use_the_triton_interpreter()  # without CUDA; with it the module is skipped

import dataclasses  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402

from radixflow.kernels import (  # noqa: E402
    CPU_OPS,
    REFERENCE_OPS,
    AttentionOps,
    reference,
    triton_ops,
)
from radixflow.kernels.shared_prefix import MIN_SHARED_KEYS  # noqa: E402
from radixflow.kernels.triton import decode_attention as decode_module  # noqa: E402
from radixflow.kernels.triton import shared_prefix_attention as shared_attention  # noqa: E402
from radixflow.kernels.triton.decode_attention import decode_attention, decode_layout  # noqa: E402
from radixflow.kernels.triton.extend_attention import extend_attention  # noqa: E402

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
        "radixflow.kernels.triton.decode_attention was imported before TRITON_INTERPRET=1 was set"
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
import multiprocessing

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from radixflow.kernels.triton import decode_attention as decode, extend_attention as extend
from radixflow.kernels.triton import shared_prefix_attention as shared

def jobs():
    for dtype in ("bf16", "fp32"):
        split = dict(GROUP=3, BLOCK_H=decode.BLOCK_H, BLOCK_N=decode.BLOCK_N, BLOCK_D=64,
                     UPCAST=False)
        yield decode._decode_split_kernel, dtype, split, 4, 2, ()
        for block_s, has_shared in ((1, False), (8, False), (8, True)):  # 1: one-element arange
            merge = dict(BLOCK_S=block_s, BLOCK_N=decode.BLOCK_N, BLOCK_D=64, HAS_SHARED=has_shared)
            shared_ptrs = ("shared_out_ptr", "shared_lse_ptr")
            yield decode._decode_merge_kernel, dtype, merge, 4, 2, shared_ptrs
        blocks = (64, 64) if dtype == "bf16" else (32, 32)
        prefix = dict(GROUP=3, BLOCK_M=blocks[0], BLOCK_N=blocks[1], BLOCK_D=64, UPCAST=False)
        yield shared._shared_prefix_kernel, dtype, prefix, 4, 2, ("out_ptr", "lse_ptr")
        blocks = (128, 64) if dtype == "bf16" else (64, 32)
        extend_constexprs = dict(GROUP=3, BLOCK_M=blocks[0], BLOCK_N=blocks[1], BLOCK_D=64)
        yield extend._extend_kernel, dtype, dict(extend_constexprs, UPCAST=False), 4, 1, ()

def build(index):
    kernel, dtype, constexprs, num_warps, num_stages, fp32_ptrs = list(jobs())[index]
    capabilities = (80, 90) if dtype == "bf16" else (90,)
    def kind(name):
        if name in constexprs:
            return "constexpr"
        if name.endswith("_ptr"):
            if any(word in name for word in ("ind", "rows", "slots", "entries")):
                return "*i64"
            return "*fp32" if "part_" in name or name in fp32_ptrs else "*" + dtype
        return "fp32" if name == "sm_scale" else "i32"
    signature = {name: kind(name) for name in kernel.arg_names}
    source = ASTSource(kernel, signature, constexprs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    for capability in capabilities:
        assert triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)

if __name__ == "__main__":
    # two processes: each compile is single-threaded, and the suite's other core idles
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.map(build, range(len(list(jobs()))))  # a worker's failure raises here
    print("compiled")
"""


def test_kernels_compile_for_cuda_targets(tmp_path: Path) -> None:
    """The interpreter is lenient; compiling to sm80/sm90 cubins (no GPU needed) is not."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    script = tmp_path / "compile_for_cuda.py"  # a file: the pool's spawned workers import it
    script.write_text(COMPILE_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


# ---------------------------------------------------------------- shared-prefix decode


def shared_case(kind: str, group: int, dtype: torch.dtype) -> tuple:
    """A decode batch laid out as a radix tree lays it out. "nested": three requests behind
    one 100-slot run (two of them also share the next 70), two behind an 80-slot run (one
    ending right at it), one alone. "fully_shared": six requests holding the same 96 slots
    and nothing else. -> decode arguments (q strided, shuffled slots)."""
    gen = torch.Generator().manual_seed(7)
    k_buffer, v_buffer, pool = make_pools(456, dtype, gen)
    if kind == "nested":
        root, branch, tail0, tail1, tail2, other, other_tail, alone = pool.split(
            [100, 70, 5, 9, 30, 80, 12, 150]
        )
        requests = [
            torch.cat([root, branch, tail0]),
            torch.cat([root, branch, tail1]),
            torch.cat([root, tail2]),
            torch.cat([other, other_tail]),
            other,
            alone,
        ]
    else:
        requests = [pool[:96]] * 6
    q, _ = strided_heads(len(requests), [NUM_KV_HEADS * group, 2], dtype, gen)
    lens = [len(r) for r in requests]
    return q, k_buffer, v_buffer, indptr(lens), torch.cat(requests), HEAD_DIM**-0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_shared_prefix_decode_matches_reference(dtype: torch.dtype, group: int) -> None:
    """Nested runs (tree of thought) and a request whose keys are all shared."""
    args = shared_case("nested", group, dtype)
    layout = decode_layout(*args[3:5])
    runs = torch.diff(layout.prefix_indptr).tolist()
    assert sorted(runs) == [70, 80, 100] and layout.max_group_size == 3
    assert layout.kv_indices.numel() == args[4].numel() - 100 * 3 - 70 * 2 - 80 * 2
    out = decode_attention(*args, num_kv_splits=3, layout=layout)  # (B, H, D)
    assert_close(out, reference.decode_attention(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fully_shared_decode_matches_reference(dtype: torch.dtype) -> None:
    """Six requests with only shared keys: their own parts are empty (log-sum-exp -inf in
    the merge), and 6 requests x 4 heads take two row tiles of the shared-prefix kernel."""
    args = shared_case("fully_shared", 4, dtype)
    layout = decode_layout(*args[3:5])
    assert layout.num_groups == 1 and layout.kv_indices.numel() == 0
    assert layout.max_group_size * 4 > shared_attention._block_sizes(64, dtype, args[0].device)[0]
    assert_close(decode_attention(*args, layout=layout), reference.decode_attention(*args))


# ---------------------------------------------------------------- tiny Llama, every ops object


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
    from radixflow.runtime.models.layers import ForwardBatch

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


SHARED_PROMPT = MIN_SHARED_KEYS + 2  # tokens a and c share: long enough to be a shared run


def run_tiny_llama(ops: AttentionOps) -> tuple[list[torch.Tensor], list[list[int]], list]:
    """Prefill two prompts, extend a third over the first one's cached prompt beside
    decodes, then decode all three (the first and third behind the same cached slots).

    Returns every step's logits, the greedy continuation of each request and the decode
    layout of every step that decodes (when the ops derive one).
    """
    from radixflow.runtime.models.layers import CausalLM, ModelConfig

    config = ModelConfig(
        vocab_size=97, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=6,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, max_position=128, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    layouts: list = []
    derive = ops.prepare_decode
    if derive is not None:  # record the layouts the model derives

        def prepare_decode(*args: torch.Tensor, **kwargs: int) -> object:
            layouts.append(derive(*args, **kwargs))
            return layouts[-1]

        ops = dataclasses.replace(ops, prepare_decode=prepare_decode)
    model = CausalLM(config, ops).eval()
    shape = (config.num_layers, 160, config.num_kv_heads, config.head_dim)
    caches = (torch.full(shape, float("nan")), torch.full(shape, float("nan")))
    for cache in caches:  # (layers, slots, Hkv, D): NaN except the dummy slot, as in make_pools
        cache[:, 0] = 0.0
    free = (1 + torch.randperm(159, generator=torch.Generator().manual_seed(5))).tolist()
    prompt = torch.randint(0, 97, (80,), generator=torch.Generator().manual_seed(6)).tolist()
    n = SHARED_PROMPT
    a, b, c = Seq(prompt[:n]), Seq(prompt[n:80]), Seq(prompt[:n] + prompt[70:74])
    all_logits = []
    schedule = [([a, b], []), ([c], [a, b]), ([], [a, b, c]), ([], [a, b, c]), ([], [a, b, c])]
    for extends, decodes in schedule:
        if c in extends:
            c.slots = a.slots[:n]  # c reuses a's cached prompt as its prefix
        logits = forward_step(model, caches, free, extends, decodes)  # (R, vocab)
        all_logits.append(logits)
        for seq, token in zip(extends + decodes, logits.argmax(-1).tolist(), strict=True):
            seq.tokens.append(token)
    return all_logits, [a.tokens, b.tokens, c.tokens], layouts


def shared_runs(layout: object) -> list[int]:
    """Lengths of the shared runs in a CPU or Triton decode layout."""
    if isinstance(layout, shared_attention.DecodeLayout):
        return torch.diff(layout.prefix_indptr).tolist()
    return [len(group.slots) for group in layout.shared]


def test_tiny_llama_fast_paths_match_reference_ops() -> None:
    """The CPU fast path and the Triton ops give the plain reference's logits and tokens,
    and the last three decode steps read a's and c's shared prompt as one run."""
    expected_logits, expected_tokens, _ = run_tiny_llama(REFERENCE_OPS)
    assert len(expected_tokens[2]) == SHARED_PROMPT + 4 + 4  # prompt, extend token, 3 decodes
    for ops in (CPU_OPS, triton_ops()):
        logits, tokens, layouts = run_tiny_llama(ops)
        runs = [shared_runs(layout) for layout in layouts]  # steps 2-5 decode
        assert runs == [[], [SHARED_PROMPT], [SHARED_PROMPT], [SHARED_PROMPT]], ops.name
        assert tokens == expected_tokens, ops.name
        for step_logits, step_expected in zip(logits, expected_logits, strict=True):
            torch.testing.assert_close(step_logits, step_expected, atol=1e-4, rtol=1e-4)
