"""The attention spec (`radixflow.kernels.reference`) and the CPU fast path measured against it.

The reference is checked against float64 loops with explicit masks and shown to run on any
device; the fast path (`radixflow.kernels.cpu.attention`: length groups, shared-prefix runs
merged by log-sum-exp, torch's fused CPU kernel) is compared with the reference over a grid
of batches laid out as a paged radix cache lays them out. No Triton here.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from radixflow.kernels import CPU_OPS, REFERENCE_OPS, get_ops, reference
from radixflow.kernels.cpu import attention as cpu_attention
from radixflow.kernels.cpu import decode_layout as cpu_decode_layout
from radixflow.kernels.cpu import native, short_extend, torch_attention
from radixflow.kernels.shared_prefix import MIN_SHARED_KEYS, find_shared_prefixes

NUM_KV_HEADS = 2
HEAD_DIM = 32
NATIVE = native.library()


@pytest.fixture(autouse=True)
def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """These are the torch fast path's tests: the native kernels (tests/kernels/cpu/test_native.py)
    are off unless a test turns them back on."""
    monkeypatch.setitem(native._state, "lib", None)


TOLERANCE = {torch.float32: (2e-6, 0.0), torch.float16: (1e-3, 1e-3)}  # (atol, rtol)


def indptr(lens: list[int]) -> torch.Tensor:
    """Prefix sum (B+1,) int64 of per-request lengths."""
    return torch.nn.functional.pad(torch.tensor(lens, dtype=torch.int64).cumsum(0), (1, 0))


class PagedPool:
    """K/V pools handed out in pages of `page_size` slots from shuffled pages, as the KV pool
    does; unused slots hold NaN, so reading a slot nobody wrote poisons the output. The
    dummy page 0 holds a large finite value: padding gathers slot 0 (times probability 0),
    and a softmax that let it in would be dominated by it."""

    def __init__(self, num_pages: int, page_size: int, dtype: torch.dtype, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.page_size, self.dtype = page_size, dtype
        shape = (num_pages * page_size, NUM_KV_HEADS, HEAD_DIM)
        self.k = torch.full(shape, float("nan"), dtype=dtype)
        self.v = torch.full(shape, float("nan"), dtype=dtype)
        self.k[:page_size] = self.v[:page_size] = 1e4
        self.pages = (
            1 + torch.randperm(num_pages - 1, generator=self.gen)
        ).tolist()  # page 0: dummy

    def alloc(self, n: int) -> torch.Tensor:
        """n slots (n,) on fresh pages, filled with random K/V."""
        num_pages = -(-n // self.page_size)
        pages = torch.tensor([self.pages.pop() for _ in range(num_pages)], dtype=torch.int64)
        slots = (pages[:, None] * self.page_size + torch.arange(self.page_size)).flatten()[:n]
        self.k[slots] = torch.randn((n, NUM_KV_HEADS, HEAD_DIM), generator=self.gen).to(self.dtype)
        self.v[slots] = torch.randn((n, NUM_KV_HEADS, HEAD_DIM), generator=self.gen).to(self.dtype)
        return slots

    def queries(self, num_rows: int, group: int) -> torch.Tensor:
        """q (num_rows, Hkv * group, D) as a strided view of a fused qkv buffer."""
        fused = torch.randn((num_rows, NUM_KV_HEADS * (group + 2), HEAD_DIM), generator=self.gen)
        return fused.to(self.dtype)[:, : NUM_KV_HEADS * group]


def layout_requests(pool: PagedPool, kind: str) -> list[torch.Tensor]:
    """Each request's pooled KV slots for one kind of batch (run lengths are whole pages of
    16 or 64, as the radix tree shares whole pages)."""
    if kind == "ragged":  # no sharing; lengths across the 64-key and group boundaries
        return [pool.alloc(n) for n in (0, 1, 31, 64, 65, 200, 7, 300)]
    if kind == "nested":  # three behind a 128-run, two of them also share the next 64
        root, branch, other = pool.alloc(128), pool.alloc(64), pool.alloc(64)
        return [
            torch.cat([root, branch, pool.alloc(5)]),
            torch.cat([root, branch, pool.alloc(17)]),
            torch.cat([root, pool.alloc(40)]),
            torch.cat([other, pool.alloc(3)]),
            other,  # ends exactly at the shared run: no keys of its own
            pool.alloc(90),
        ]
    if kind == "fully_shared":  # every request holds the same 192 slots and nothing else
        run = pool.alloc(192)
        return [run] * 5
    if kind == "tree":  # tree of thought: 2 problems x 2 branches x 2 leaves
        requests = []
        for _ in range(2):
            problem = pool.alloc(64)
            for _ in range(2):
                branch = torch.cat([problem, pool.alloc(64)])
                requests += [torch.cat([branch, pool.alloc(n)]) for n in (1, 33)]
        return requests
    raise ValueError(kind)


KINDS = ("ragged", "nested", "fully_shared", "tree")
NUM_GROUPS = {"ragged": 0, "nested": 3, "fully_shared": 1, "tree": 6}


def decode_batch(kind: str, group: int, page_size: int, dtype: torch.dtype) -> tuple:
    """Arguments (q, k_buffer, v_buffer, kv_indptr, kv_indices, scale) of a decode batch."""
    pool = PagedPool(2000 // page_size + 20, page_size, dtype, seed=10 * KINDS.index(kind) + group)
    requests = layout_requests(pool, kind)
    q = pool.queries(len(requests), group)
    kv_indptr = indptr([len(r) for r in requests])
    return q, pool.k, pool.v, kv_indptr, torch.cat(requests), HEAD_DIM**-0.5


def extend_batch(kind: str, group: int, page_size: int) -> tuple:
    """Arguments of an extend batch: the same cached prefixes plus 1..33 new tokens each."""
    pool = PagedPool(2000 // page_size + 20, page_size, torch.float32, seed=7)
    prefixes = layout_requests(pool, kind)
    new = [(1, 7, 33, 4, 2, 5, 16, 9)[i % 8] for i in range(len(prefixes))]
    q = pool.queries(sum(new), group)
    k, v = (torch.randn((sum(new), NUM_KV_HEADS, HEAD_DIM), generator=pool.gen) for _ in "kv")
    qo_indptr, kv_indptr = indptr(new), indptr([len(p) for p in prefixes])
    return q, k, v, pool.k, pool.v, qo_indptr, kv_indptr, torch.cat(prefixes), HEAD_DIM**-0.5


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Compare with the dtype's tolerance; returns the max abs error."""
    atol, rtol = TOLERANCE[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    return (actual.float() - expected.float()).abs().max().item()


# ---------------------------------------------------------------- the CPU fast path vs the spec


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", ["torch", "native"])
def test_cpu_decode_matches_reference(
    kind: str, group: int, page_size: int, dtype: torch.dtype, path: str, monkeypatch
) -> None:
    if path == "native":
        monkeypatch.setitem(native._state, "lib", NATIVE)
    args = decode_batch(kind, group, page_size, dtype)
    layout = cpu_attention.decode_layout(*args[3:5])
    assert (layout.runs is not None) == (path == "native" and NATIVE is not None)
    assert len(layout.shared) == NUM_GROUPS[kind]  # the case exercises what it names
    out = cpu_attention.decode_attention(*args, layout=layout)  # (B, H, D)
    assert_close(out, reference.decode_attention(*args))


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_cpu_extend_matches_reference(kind: str, group: int, page_size: int) -> None:
    args = extend_batch(kind, group, page_size)
    layout = cpu_attention.make_layout(*args[5:8])
    assert len(layout.shared) == NUM_GROUPS[kind]
    out = cpu_attention.extend_attention(*args, layout=layout)  # (T, H, D)
    assert_close(out, reference.extend_attention(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_cpu_short_extend_matches_reference(
    kind: str, group: int, page_size: int, dtype: torch.dtype
) -> None:
    """Verify-sized extends (1..16 new tokens each) read their cached keys as views of the
    pool (kernels/cpu/short_extend.py) when those lie in at most MAX_RUNS runs (always with
    pages of 64 here); more scattered ones take the general path."""
    pool = PagedPool(2000 // page_size + 20, page_size, dtype, seed=3)
    prefixes = layout_requests(pool, kind)[: short_extend.MAX_REQUESTS]
    new = [(1, 6, 16, 9)[i] for i in range(len(prefixes))]
    q = pool.queries(sum(new), group)
    k, v = (
        torch.randn((sum(new), NUM_KV_HEADS, HEAD_DIM), generator=pool.gen).to(dtype) for _ in "kv"
    )
    args = (q, k, v, pool.k, pool.v, indptr(new), indptr([len(p) for p in prefixes]))
    args += (torch.cat(prefixes), HEAD_DIM**-0.5)
    layout = cpu_attention.make_layout(*args[5:8])
    runs = cpu_decode_layout.slot_runs(*args[6:8])
    assert (layout.short is not None) == all(len(r) <= short_extend.MAX_RUNS for r in runs)
    if page_size == 64:
        assert layout.short is not None
    assert_close(
        cpu_attention.extend_attention(*args, layout=layout), reference.extend_attention(*args)
    )


def test_cpu_decode_groups_mixed_lengths() -> None:
    """Decodes pad within groups of similar KV length: a batch mixing long and short contexts
    forms several groups, gathers at most about twice its keys, and matches the spec."""
    pool = PagedPool(1000, 1, torch.float32, seed=5)  # scattered slots: nothing is a view
    lens = [300, 4, 290, 17, 1, 120, 0, 33]
    requests = [pool.alloc(n) for n in lens]
    args = (pool.queries(len(lens), 3), pool.k, pool.v, indptr(lens), torch.cat(requests), 0.125)
    layout = cpu_attention.decode_layout(*args[3:5])
    groups, views = layout.groups, [row for row, _ in layout.views]
    assert len(groups) >= 3 and views == []
    assert sorted(torch.cat([g[0] for g in groups]).tolist() + views) == list(range(len(lens)))
    assert sum(g[1].numel() for g in groups) <= 2 * sum(lens) + max(lens)
    assert_close(cpu_attention.decode_attention(*args), reference.decode_attention(*args))


class ContiguousPool(PagedPool):
    """Slots handed out one after another, as the KV pool does for a request's own run."""

    def __init__(self, num_slots: int, dtype: torch.dtype, seed: int) -> None:
        super().__init__(num_slots, 1, dtype, seed)
        self.next = 1

    def alloc(self, n: int) -> torch.Tensor:
        slots = torch.arange(self.next, self.next + n)
        self.next += n + 3  # a gap: the next request's run does not continue this one
        self.k[slots] = torch.randn((n, NUM_KV_HEADS, HEAD_DIM), generator=self.gen).to(self.dtype)
        self.v[slots] = torch.randn((n, NUM_KV_HEADS, HEAD_DIM), generator=self.gen).to(self.dtype)
        return slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("extra", [{}, {"logit_cap": 5.0}, {"sliding_window": 40}])
def test_cpu_decode_reads_contiguous_runs_as_views(
    group: int, dtype: torch.dtype, extra: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests whose keys lie in a few runs of consecutive slots (one run; a shared prefix
    run then their own; two own runs; more runs than MAX_VIEW_RUNS: gathered) are attended
    over views of the pool, and the result is the spec's. fp32 views copy nothing."""
    monkeypatch.setattr(cpu_decode_layout, "VIEW_MIN_KEYS", 32)  # small shapes, same paths
    pool = ContiguousPool(4000, dtype, seed=group)
    prefix = pool.alloc(100)
    pieces = [pool.alloc(n) for n in (40, 30, 20, *[10] * 10)]
    requests = [
        pool.alloc(300),  # one run
        pool.alloc(57),
        torch.cat([prefix, pool.alloc(45)]),  # behind a shared prefix run
        torch.cat([prefix, pool.alloc(70)]),
        torch.cat(pieces[:2]),  # two runs
        torch.cat(pieces[2:]),  # eleven runs: gathered
        pool.alloc(5),  # too short for a view: gathered
    ]
    args = (pool.queries(len(requests), group), pool.k, pool.v)
    args += (indptr([len(r) for r in requests]), torch.cat(requests), HEAD_DIM**-0.5)
    window = {k: v for k, v in extra.items() if k == "sliding_window"}
    layout = cpu_attention.decode_layout(*args[3:5], **window)
    views = {row: len(runs) for row, runs in layout.views}
    gathered = sorted(torch.cat([g[0] for g in layout.groups]).tolist())
    if "sliding_window" in extra:  # the last 40 keys: one run each, and 4 for request 5
        assert views == {0: 1, 1: 1, 2: 1, 3: 1, 4: 2, 5: 4} and gathered == [6]
    else:
        assert views == {0: 1, 1: 1, 2: 1, 3: 1, 4: 2} and gathered == [5, 6]
        assert layout.shared_starts == (1,)
    out = cpu_attention.decode_attention(*args, layout=layout, **extra)
    assert_close(out, reference.decode_attention(*args, **extra))
    if dtype == torch.float32:  # a view shares the pool's storage
        view = torch_attention.pool_view(pool.k, 1, 10)
        assert view.untyped_storage().data_ptr() == pool.k.untyped_storage().data_ptr()


class StridedPool(PagedPool):
    """Runs placed on one stride, as the KV pool places requests admitted together; the
    slots nobody wrote are zero (the runner's pool is zero-filled), slot 0 included."""

    def __init__(self, num_slots: int, dtype: torch.dtype, seed: int, stride: int) -> None:
        super().__init__(num_slots, 1, dtype, seed)
        self.k.zero_()
        self.v.zero_()
        self.stride = stride

    def write(self, first: int, n: int) -> torch.Tensor:
        slots = torch.arange(first, first + n)
        self.k[slots] = torch.randn((n, NUM_KV_HEADS, HEAD_DIM), generator=self.gen).to(self.dtype)
        self.v[slots] = torch.randn((n, NUM_KV_HEADS, HEAD_DIM), generator=self.gen).to(self.dtype)
        return slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("extra", [{}, {"logit_cap": 5.0}, {"sliding_window": 40}])
def test_cpu_decode_reads_a_strided_batch_as_one_grid(
    group: int, dtype: torch.dtype, extra: dict
) -> None:
    """Requests on one stride (a hole where one finished; one whose run starts 2 slots into
    its row behind a 1-key head cached elsewhere; unequal lengths; a sliding window cutting
    their first keys) form one grid: a single strided view of an fp32 pool. Requests off
    the stride are gathered. Equal to the spec."""
    pool = StridedPool(2000, dtype, seed=group, stride=128)
    head = pool.write(1900, 1)
    lens = {1: 40, 2: 33, 3: 47, 5: 29, 6: 45}  # grid row -> length; row 4 is a hole
    requests = [pool.write(128 * k, n) for k, n in lens.items()]
    requests.append(torch.cat([head, pool.write(128 * 7 + 2, 30)]))  # offset 2, head
    requests.append(pool.write(128 * 3 + 60, 20))  # off the stride
    args = (pool.queries(len(requests), group), pool.k, pool.v)
    args += (indptr([len(r) for r in requests]), torch.cat(requests), HEAD_DIM**-0.5)
    window = {k: v for k, v in extra.items() if k == "sliding_window"}
    layout = cpu_attention.decode_layout(*args[3:5], **window)
    grid = layout.grid
    assert grid is not None and grid.stride == 128 and grid.count == 7
    assert sorted(grid.rows.tolist()) == [0, 1, 2, 3, 4, 5]
    assert torch.cat([g[0] for g in layout.groups]).tolist() == [6]
    assert [h[0].tolist() for h in layout.heads] == [[5]]  # merged by log-sum-exp
    out = cpu_attention.decode_attention(*args, layout=layout, **extra)
    assert_close(out, reference.decode_attention(*args, **extra))
    keys = torch_attention.grid_keys(pool.k, grid)
    shares = keys.untyped_storage().data_ptr() == pool.k.untyped_storage().data_ptr()
    assert shares == (dtype == torch.float32)  # fp32: a view, no copy


def test_cpu_decode_grid_takes_the_densest_rows_of_a_wrapped_wave() -> None:
    """A wave whose last runs wrapped around the pool's end (two at its start, six near its
    end, on one stride): the grid takes the six, the two are gathered. One grid over all
    eight would be mostly padding, and was refused whole before. Equal to the spec."""
    pool = StridedPool(64 * 40, torch.float32, seed=5, stride=64)
    places = [(64 * k, 30 + k) for k in range(30, 36)] + [(64, 28), (128, 33)]
    requests = [pool.write(first, n) for first, n in places]
    args = (pool.queries(len(requests), 3), pool.k, pool.v)
    args += (indptr([len(r) for r in requests]), torch.cat(requests), HEAD_DIM**-0.5)
    layout = cpu_attention.decode_layout(*args[3:5])
    assert layout.grid is not None and layout.grid.count == 6
    assert sorted(layout.grid.rows.tolist()) == [0, 1, 2, 3, 4, 5]
    assert sorted(torch.cat([g[0] for g in layout.groups]).tolist()) == [6, 7]
    out = cpu_attention.decode_attention(*args, layout=layout)
    assert_close(out, reference.decode_attention(*args))


def test_cpu_decode_grid_past_the_pool_end_is_gathered() -> None:
    """A grid whose last row would leave the pool reads its keys by gathering instead."""
    pool = StridedPool(64 * 4 + 20, torch.float32, seed=9, stride=64)
    requests = [pool.write(64 * k, n) for k, n in ((1, 30), (2, 25), (3, 31), (4, 18))]
    args = (pool.queries(4, 3), pool.k, pool.v, indptr([30, 25, 31, 18]), torch.cat(requests))
    args += (HEAD_DIM**-0.5,)
    layout = cpu_attention.decode_layout(*args[3:5])
    assert layout.grid is not None and layout.grid.count == 4
    keys = torch_attention.grid_keys(pool.k, layout.grid)
    assert keys.untyped_storage().data_ptr() != pool.k.untyped_storage().data_ptr()
    assert_close(
        cpu_attention.decode_attention(*args, layout=layout), reference.decode_attention(*args)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_runner_kv_cache_is_zero_filled(dtype: torch.dtype) -> None:
    """The grid's masked columns read slots nobody wrote: the runner's pool must hold zeros
    there, even in memory a freed NaN tensor just gave back to the allocator."""
    from radixflow.runtime.model_executor.model_runner import zeroed_cache

    shape = (2, 300, NUM_KV_HEADS, HEAD_DIM)
    for _ in range(3):
        junk = torch.full(shape, float("nan"), dtype=dtype)
        del junk
        cache = zeroed_cache(shape, dtype, torch.device("cpu"))
        assert cache.dtype == dtype and cache.shape == shape and cache.is_contiguous()
        assert not cache.float().isnan().any() and cache.float().abs().sum() == 0


def test_slot_runs() -> None:
    slots = torch.tensor([5, 6, 7, 8, 9, 20, 21, 2])
    runs = cpu_decode_layout.slot_runs(indptr([3, 0, 4, 1]), slots)
    assert runs == [[(5, 3)], [], [(8, 2), (20, 2)], [(2, 1)]]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("host", ["native", "numpy"])
def test_host_run_table_is_the_torch_one(
    seed: int, host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host's run table (what a CPU step uses: the native pass, numpy without it) gives
    the torch ops' integers, dtypes and shapes: empty requests, runs across request
    borders, scattered and repeated slots, int32 and int64 slots."""
    if host == "numpy":
        monkeypatch.setattr(native, "run_table", lambda *a: None)
    elif NATIVE is None:
        pytest.skip("native kernels not built")
    else:  # this module's tests run with the native kernels off (the fixture above)
        monkeypatch.setitem(native._state, "lib", NATIVE)
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 40, (7,), generator=gen)
    lens[seed % 7] = 0
    total = int(lens.sum())
    dtype = torch.int32 if seed % 2 else torch.int64
    slots = torch.randint(0, 50, (total,), generator=gen, dtype=dtype)
    slots[: total // 2] = torch.arange(total // 2, dtype=dtype) + 100  # long runs
    kv_indptr = indptr(lens.tolist())
    host = cpu_decode_layout.run_table(kv_indptr, slots)
    device = cpu_decode_layout._device_run_table(kv_indptr, slots)
    for got, want in zip(host, device, strict=True):
        assert got.dtype == want.dtype == torch.long and torch.equal(got, want)
    empty = cpu_decode_layout.run_table(indptr([0, 0]), slots[:0])
    assert [t.tolist() for t in empty] == [[0, 0, 0], [], []]


def test_find_shared_prefixes_nested_runs() -> None:
    """The finder reports each run once with the query rows behind it, nested runs after
    their parent, and how many leading keys of each request the runs cover."""
    q, _, _, kv_indptr, kv_indices, _ = decode_batch("nested", 1, 16, torch.float32)
    batch = torch.arange(len(kv_indptr))
    groups, skip = find_shared_prefixes(batch, kv_indptr, kv_indices)
    runs = sorted((len(g.slots), g.q_rows.tolist()) for g in groups)
    assert runs == [(64, [0, 1]), (64, [3, 4]), (128, [0, 1, 2])]
    assert skip.tolist() == [192, 192, 128, 64, 64, 0]
    short = kv_indices[: MIN_SHARED_KEYS - 1]  # two requests sharing one key too few
    assert (
        find_shared_prefixes(torch.arange(3), indptr([63, 63]), torch.cat([short, short]))[0] == ()
    )


# ---------------------------------------------------------------- the spec itself


def naive_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """q (Lq, D), keys/values (Lk, D), visible (Lq, Lk) bool -> (Lq, D), in float64."""
    scores = (q.double() @ keys.double().T) * scale  # (Lq, Lk)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ values.double()


@pytest.mark.parametrize("group", [1, 3])
def test_reference_extend_matches_naive(group: int) -> None:
    """One head at a time in float64, with the mask written out: token i of a request with
    P cached keys sees keys 0 .. P + i."""
    q, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, scale = extend_batch(
        "nested", group, 16
    )
    expected = torch.zeros(q.shape, dtype=torch.float64)  # (T, H, D)
    for b in range(len(qo_indptr) - 1):
        rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        slots = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])]
        prefix, new = len(slots), rows.stop - rows.start
        visible = torch.tensor([[j <= prefix + i for j in range(prefix + new)] for i in range(new)])
        for h in range(q.shape[1]):
            keys = torch.cat([k_buffer[slots, h // group], k[rows, h // group]])  # (P+E, D)
            values = torch.cat([v_buffer[slots, h // group], v[rows, h // group]])
            expected[rows, h] = naive_attention(q[rows, h], keys, values, visible, scale)
    actual = reference.extend_attention(
        q, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, scale
    )
    torch.testing.assert_close(actual, expected.float(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("group", [1, 4])
def test_reference_decode_matches_naive(group: int) -> None:
    """One head at a time in float64 over all the request's keys; no keys -> zeros."""
    q, k_buffer, v_buffer, kv_indptr, kv_indices, scale = decode_batch(
        "ragged", group, 1, torch.float32
    )
    expected = torch.zeros(q.shape, dtype=torch.float64)  # (B, H, D)
    for b in range(q.shape[0]):
        slots = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])]
        visible = torch.ones(1, len(slots), dtype=torch.bool)
        for h in range(q.shape[1]):
            keys, values = k_buffer[slots, h // group], v_buffer[slots, h // group]
            expected[b, h] = naive_attention(q[b, h][None], keys, values, visible, scale)[0]
    assert torch.all(expected[0] == 0)  # the batch starts with an empty request
    actual = reference.decode_attention(q, k_buffer, v_buffer, kv_indptr, kv_indices, scale)
    torch.testing.assert_close(actual, expected.float(), atol=1e-5, rtol=0)


def test_reference_decode_is_extend_of_one_token() -> None:
    """Decode of the last token == extend of that token over the rest as its prefix."""
    q, k_buffer, v_buffer, kv_indptr, kv_indices, scale = decode_batch(
        "nested", 3, 1, torch.float32
    )
    last = kv_indptr[1:] - 1  # each request's newest key, by position in kv_indices
    keep = torch.ones(len(kv_indices), dtype=torch.bool)
    keep[last] = False
    lens = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
    assert min(lens) > 0, lens
    extended = reference.extend_attention(
        q, k_buffer[kv_indices[last]], v_buffer[kv_indices[last]], k_buffer, v_buffer,
        indptr([1] * len(lens)), indptr([n - 1 for n in lens]), kv_indices[keep], scale,
    )  # fmt: skip
    decoded = reference.decode_attention(q, k_buffer, v_buffer, kv_indptr, kv_indices, scale)
    torch.testing.assert_close(extended, decoded, atol=1e-6, rtol=0)


class OpNames(TorchDispatchMode):
    """Records the name of every aten op that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_reference_runs_on_any_device() -> None:
    """The spec runs on the meta device (pools, activations and slots there; only the
    lengths are read on the host) and calls no device-specific op such as torch's fused
    `_scaled_dot_product_flash_attention_for_cpu`, so it can check kernels on CUDA."""
    meta = torch.device("meta")
    q, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, scale = extend_batch(
        "nested", 3, 16
    )
    on_meta = [t.to(meta) for t in (q, k, v, k_buffer, v_buffer)]
    with OpNames() as ops:
        out = reference.extend_attention(*on_meta, qo_indptr, kv_indptr, kv_indices.to(meta), scale)
        decoded = reference.decode_attention(
            on_meta[0][:6], *on_meta[3:5], kv_indptr, kv_indices.to(meta), scale
        )
    assert out.device == meta and out.shape == q.shape and decoded.shape == (6, *q.shape[1:])
    assert ops.names and not [name for name in ops.names if "_for_cpu" in name]
    with OpNames() as fast:  # the check sees what the CPU fast path calls
        cpu_attention.decode_attention(*decode_batch("nested", 3, 16, torch.float32))
    assert any("_for_cpu" in name for name in fast.names)


def test_get_ops_on_cpu_runs_the_fast_path_and_can_run_the_spec() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert get_ops("auto", cpu) is CPU_OPS and get_ops("torch", cpu) is CPU_OPS
    assert CPU_OPS.decode_attention is cpu_attention.decode_attention
    assert get_ops("reference", cpu) is REFERENCE_OPS and get_ops("torch", cuda) is REFERENCE_OPS
    assert REFERENCE_OPS.prepare_decode is None  # the spec derives nothing per forward
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_ops("flash", cpu)
