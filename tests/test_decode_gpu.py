"""attention_with_kvcache and merge_states on the GPU (decode_fwd.cu, kv_append.cu, merge_states.cu) against
float64: odd cache lengths (0, 1, 37, 1000, 4097), lengths that differ per sequence, seqlen_q 1 to 16, GQA 1:1 to
64:1, pages of odd sizes that straddle the blocks, appends, explicit split counts, an e4m3 cache, torch tensors
(appended in place, device-resident lengths, a CUDA graph), outputs poisoned before the call."""
from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np
import pytest

import fa_variants as fav
from conftest import TOL, Case
from kvcache_cases import (FP8, MASK_CASES, assert_lse, logical_from, make_cache, mask_case, quantize_e4m3, reference,
                           rel)

pytestmark = pytest.mark.gpu


class DecodeCase(NamedTuple):
    batch: int
    seqlen_q: int
    heads: int
    heads_kv: int
    d: int
    lens: tuple            # cache_seqlens before the call
    capacity: int
    page_size: int | None
    causal: bool
    seqlen_new: int = 0
    num_splits: int = 0
    dtype: str = "bfloat16"

    @property
    def id(self):
        return (f"B{self.batch}-Nq{self.seqlen_q}-H{self.heads}:{self.heads_kv}-d{self.d}-L{'.'.join(map(str, self.lens))}"
                f"-{'page' + str(self.page_size) if self.page_size else 'contig'}-{'causal' if self.causal else 'full'}"
                f"-new{self.seqlen_new}-s{self.num_splits}-{self.dtype}")


CASES = [
    DecodeCase(1, 1, 32, 8, 128, (4097,), 4200, None, True),
    DecodeCase(3, 4, 8, 2, 64, (1, 37, 1000), 1100, 16, True, seqlen_new=2),
    DecodeCase(2, 16, 16, 2, 128, (0, 300), 320, 7, True, seqlen_new=3),
    DecodeCase(4, 1, 64, 1, 256, (37, 4097, 2, 129), 4100, 256, False, seqlen_new=1),
    DecodeCase(2, 3, 4, 4, 96, (500, 64), 600, None, True, num_splits=5, dtype="float16"),
    DecodeCase(2, 2, 6, 3, 64, (1000, 999), 1024, 1, False, num_splits=256),
    DecodeCase(1, 5, 8, 1, 128, (37,), 64, 32, True, seqlen_new=5, num_splits=1, dtype="float16"),
    DecodeCase(5, 1, 16, 8, 128, (1, 2, 3, 4, 5), 8, None, True, seqlen_new=1),
]


def _host_call(rng, c: DecodeCase, fp8: bool = False):
    cache = make_cache(rng, c.batch, c.capacity, c.heads_kv, c.d, dtype=np.float32, page_size=c.page_size)
    k_cache, v_cache = cache.k_cache, cache.v_cache
    kd = vd = None
    if fp8:
        k_log, kd = quantize_e4m3(cache.k_log)
        v_log, vd = quantize_e4m3(cache.v_log)
        cache = make_cache(rng, c.batch, c.capacity, c.heads_kv, c.d, dtype=np.float32, page_size=c.page_size)
        k_cache = np.zeros(cache.k_cache.shape, FP8)
        v_cache = np.zeros(cache.v_cache.shape, FP8)
        _write_logical(k_cache, cache.page_table, k_log)
        _write_logical(v_cache, cache.page_table, v_log)
        cache = cache._replace(k_cache=k_cache, v_cache=v_cache, k_log=k_log, v_log=v_log)
    else:
        dt = np.dtype(c.dtype) if c.dtype == "float16" else ml_dtypes.bfloat16
        cache = cache._replace(k_cache=k_cache.astype(dt), v_cache=v_cache.astype(dt), k_log=cache.k_log.astype(dt),
                               v_log=cache.v_log.astype(dt))
    qdt = np.float16 if c.dtype == "float16" else ml_dtypes.bfloat16
    q = rng.standard_normal((c.batch, c.seqlen_q, c.heads, c.d)).astype(qdt)
    new = None
    if c.seqlen_new:
        src = cache.k_cache.dtype
        new = tuple(rng.standard_normal((c.batch, c.seqlen_new, c.heads_kv, c.d)).astype(np.float32).astype(src)
                    for _ in range(2))
    return q, cache, new, kd, vd


def t(x):
    """A bfloat16 CUDA tensor of the NumPy bfloat16 array x (through its bit patterns)."""
    import torch
    return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).cuda().view(torch.bfloat16)


def _write_logical(dst, table, logical):
    if table is None:
        dst[:logical.shape[0], :logical.shape[1]] = logical
        return
    ps = dst.shape[1]
    for b in range(logical.shape[0]):
        for t in range(logical.shape[1]):
            dst[table[b, t // ps], t % ps] = logical[b, t]


def _expected(c: DecodeCase, q, cache, new, kd, vd, **mask):
    k_log, v_log = cache.k_log.copy(), cache.v_log.copy()
    lens = np.array(c.lens)
    if new is not None:
        for b in range(c.batch):
            k_log[b, lens[b]:lens[b] + c.seqlen_new] = new[0][b]
            v_log[b, lens[b]:lens[b] + c.seqlen_new] = new[1][b]
    return (reference(q, k_log, v_log, lens + c.seqlen_new, c.causal, k_descale=kd, v_descale=vd, **mask),
            (k_log, v_log))


def _graph_replay(step, reset):
    """step()'s results as a torch.cuda.CUDAGraph replays it: warmed up on a side stream (torch's rule), captured,
    replayed, with reset() (the cache back as it was) before each of the three."""
    import torch
    reset()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    reset()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        results = step()
    reset()
    g.replay()
    torch.cuda.synchronize()
    return results


def _check(c, out, lse, ref, what, tol_dtype):
    (ref_out, ref_lse) = ref
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all(), f"{what}: non-finite output"
    seen = np.isfinite(ref_lse).transpose(0, 2, 1)
    assert (out[~seen] == 0).all(), f"{what}: rows that see no key are not zero"
    if seen.any():
        err = rel(out[seen], ref_out[seen])
        assert err <= TOL[tol_dtype], f"{what}: relative error {err:.2e} > {TOL[tol_dtype]:.0e}"
    assert_lse(lse, ref_lse, what)


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_cupy_matches_float64_and_appends_in_place(rng, poisoned, c):
    import cupy
    q, cache, new, kd, vd = _host_call(rng, c)
    ref, logical = _expected(c, q, cache, new, kd, vd)
    dev = dict(q=cupy.asarray(q), k_cache=cupy.asarray(cache.k_cache), v_cache=cupy.asarray(cache.v_cache))
    kw = dict(cache_seqlens=np.array(c.lens, np.int32), page_table=cache.page_table, causal=c.causal,
              num_splits=c.num_splits, return_lse=True)
    if new is not None:
        kw.update(k=cupy.asarray(new[0]), v=cupy.asarray(new[1]))
    with poisoned(Case(c.batch, c.seqlen_q, c.capacity, c.heads, c.heads_kv, c.d, c.causal)):
        out, lse = fav.attention_with_kvcache(**dev, **kw)
    assert out.dtype == dev["q"].dtype and out.shape == q.shape
    _check(c, cupy.asnumpy(out), cupy.asnumpy(lse), ref, c.id, c.dtype)
    if new is not None:  # the cache now holds the new tokens, and nothing else moved
        after = cache._replace(k_cache=cupy.asnumpy(dev["k_cache"]), v_cache=cupy.asnumpy(dev["v_cache"]))
        k_after, v_after = logical_from(after, c.batch, c.capacity)
        assert np.array_equal(k_after, logical[0]) and np.array_equal(v_after, logical[1])


MASK_GPU_CASES = [   # d 64 two m-tiles (Nq 4 x 8 rows), d 128 one, d 256; paged and contiguous; forced and chosen splits
    DecodeCase(4, 1, 8, 2, 128, (0, 3, 700, 4097), 4200, None, True, seqlen_new=1),
    DecodeCase(3, 4, 16, 2, 64, (1, 37, 1000), 1100, 16, True, seqlen_new=2, num_splits=3),
    DecodeCase(2, 2, 8, 4, 256, (300, 129), 320, 7, True, num_splits=2, dtype="float16"),
]


@pytest.mark.parametrize("case", MASK_CASES)
@pytest.mark.parametrize("c", MASK_GPU_CASES, ids=lambda c: c.id)
def test_mask_keywords_match_float64(rng, poisoned, c, case):
    """The window (its keys alone split and read), softcap, ALiBi and sinks on packed rows, against float64 attention
    over the sequences' keys (appended ones included), outputs poisoned."""
    import cupy
    mask = mask_case(rng, case, c.batch, c.heads)
    causal = mask.pop("causal", c.causal)
    c = c._replace(causal=causal)
    q, cache, new, kd, vd = _host_call(rng, c)
    ref, _ = _expected(c, q, cache, new, kd, vd, **mask)
    dev = dict(q=cupy.asarray(q), k_cache=cupy.asarray(cache.k_cache), v_cache=cupy.asarray(cache.v_cache))
    side = {n: cupy.asarray(x) if n in ("alibi_slopes", "sinks") else x for n, x in mask.items()}
    kw = dict(cache_seqlens=np.array(c.lens, np.int32), page_table=cache.page_table, causal=causal,
              num_splits=c.num_splits, return_lse=True, **side)
    if new is not None:
        kw.update(k=cupy.asarray(new[0]), v=cupy.asarray(new[1]))
    with poisoned(Case(c.batch, c.seqlen_q, c.capacity, c.heads, c.heads_kv, c.d, causal)):
        out, lse = fav.attention_with_kvcache(**dev, **kw)
    _check(c, cupy.asnumpy(out), cupy.asnumpy(lse), ref, f"{c.id} {case}", c.dtype)


def test_bfloat16_sinks_on_the_device_and_a_graph(rng):
    """gpt-oss's layers: a window and bfloat16 sinks (the model's parameters) as torch tensors, converted on the
    device; the step under a CUDA graph replays the eager result."""
    import torch
    c = DecodeCase(2, 1, 16, 2, 64, (5000, 100), 5200, 16, True, seqlen_new=1)
    q, cache, new, _, _ = _host_call(rng, c)
    sinks = (rng.standard_normal(c.heads) + 1.0).astype(ml_dtypes.bfloat16)
    ref, _ = _expected(c, q, cache, new, None, None, window=(127, 0), sinks=sinks.astype(np.float32))
    kc, vc, qt, kn, vn = t(cache.k_cache), t(cache.v_cache), t(q), t(new[0]), t(new[1])
    kw = dict(cache_seqlens=torch.tensor(c.lens, dtype=torch.int32, device="cuda"), window=(127, 0), sinks=t(sinks),
              page_table=torch.from_numpy(cache.page_table).cuda(), return_lse=True)
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = fav.attention_with_kvcache(qt, kc, vc, k=kn, v=vn, **kw)
    _check(c, out.float().cpu().numpy(), lse.cpu().numpy(), ref, "bf16 sinks", "bfloat16")
    g_out, g_lse = _graph_replay(lambda: fav.attention_with_kvcache(qt, kc, vc, k=kn, v=vn, **kw),
                                 lambda: (kc.copy_(kc0), vc.copy_(vc0)))
    assert torch.equal(g_out, out) and torch.equal(g_lse, lse)


@pytest.mark.parametrize("softcap", [0.0, 4.0])
def test_a_negative_scale_matches_float64(rng, softcap):
    """softmax_scale -0.5 on scores spread over hundreds (q scaled by 8): the row max of the raw scores would
    overflow the exponentials; the kernel runs -q with |scale| (with a softcap too, odd in the score)."""
    import cupy
    c = DecodeCase(2, 2, 8, 2, 128, (300, 1000), 1024, None, True, num_splits=3)
    q, cache, _, _, _ = _host_call(rng, c)
    q = (q.astype(np.float32) * 8).astype(q.dtype)
    ref = reference(q, cache.k_log, cache.v_log, np.array(c.lens), True, scale=-0.5,
                    **({"softcap": softcap} if softcap else {}))
    out, lse = fav.attention_with_kvcache(cupy.asarray(q), cupy.asarray(cache.k_cache), cupy.asarray(cache.v_cache),
                                          cache_seqlens=np.array(c.lens, np.int32), softmax_scale=-0.5,
                                          softcap=softcap, num_splits=3, return_lse=True)
    _check(c, cupy.asnumpy(out), cupy.asnumpy(lse), ref, f"scale -0.5 softcap {softcap}", c.dtype)


def test_strided_q_and_cache_views(rng):
    """q a slice of a wider tensor (heads), the cache a slice of a longer one: strides, not copies."""
    import cupy
    c = DecodeCase(2, 2, 8, 2, 128, (100, 4000), 4096, None, True)
    q, cache, _, _, _ = _host_call(rng, c)
    wide = cupy.asarray(np.concatenate([q, q], axis=2))[:, :, 8:]
    long_k = cupy.zeros((2, 5000, 2, 128), cupy.asarray(cache.k_cache).dtype)
    long_v = cupy.zeros_like(long_k)
    long_k[:, :4096] = cupy.asarray(cache.k_cache[:2])
    long_v[:, :4096] = cupy.asarray(cache.v_cache[:2])
    out, lse = fav.attention_with_kvcache(wide, long_k[:, :4096], long_v[:, :4096], cache_seqlens=np.array(c.lens, np.int32),
                                          causal=True, return_lse=True)
    ref, _ = _expected(c, q, cache, None, None, None)
    _check(c, cupy.asnumpy(out), cupy.asnumpy(lse), ref, "strided", "bfloat16")


FP8_CASES = [   # d 128 with one m-tile and Q's fragments kept; d 64 with two m-tiles; d 80 on the d 128 template (the
               # permuted head dims' last group partly zero); d 256, Q's fragments read each block; fp16 and bf16 q
    DecodeCase(2, 2, 16, 4, 128, (37, 4097), 4200, None, True, seqlen_new=1),
    DecodeCase(2, 2, 16, 4, 128, (37, 4097), 4200, 16, True, seqlen_new=1),
    DecodeCase(2, 3, 16, 2, 64, (1000, 1), 1100, None, True, seqlen_new=1, dtype="float16"),
    DecodeCase(1, 5, 8, 2, 80, (4097,), 4200, 7, True, seqlen_new=2),
    DecodeCase(3, 1, 8, 2, 256, (129, 37, 2000), 2100, None, False, seqlen_new=1, dtype="float16"),
]


def _torch_fp8_call(c: DecodeCase, q, cache, new, kd, vd):
    import torch
    t = {n: torch.from_numpy(np.ascontiguousarray(x).view(np.uint8)).cuda().view(torch.float8_e4m3fn)
         for n, x in dict(k_cache=cache.k_cache, v_cache=cache.v_cache, k=new[0], v=new[1]).items()}
    qt = torch.from_numpy(q.view(np.int16)).cuda().view(torch.float16 if c.dtype == "float16" else torch.bfloat16)
    table = None if c.page_size is None else torch.from_numpy(cache.page_table).cuda()
    out, lse = fav.attention_with_kvcache(qt, t["k_cache"], t["v_cache"], k=t["k"], v=t["v"],
                                          cache_seqlens=torch.tensor(c.lens, dtype=torch.int32, device="cuda"),
                                          page_table=table, k_descale=torch.from_numpy(kd).cuda(),
                                          v_descale=torch.from_numpy(vd).cuda(), causal=c.causal, return_lse=True)
    return out, lse, t


@pytest.mark.parametrize("c", FP8_CASES, ids=lambda c: c.id)
def test_fp8_cache_matches_float64_of_its_values(rng, c):
    """An e4m3 cache with per-(batch, KV head) descale factors: the kernel's error is q's format's, measured
    against float64 attention over the dequantized cache values."""
    import torch
    q, cache, new, kd, vd = _host_call(rng, c, fp8=True)
    ref, logical = _expected(c, q, cache, new, kd, vd)
    out, lse, t = _torch_fp8_call(c, q, cache, new, kd, vd)
    _check(c, out.float().cpu().numpy(), lse.cpu().numpy(), ref, "fp8", c.dtype)
    after = cache._replace(k_cache=t["k_cache"].view(torch.uint8).cpu().numpy().view(FP8),
                           v_cache=t["v_cache"].view(torch.uint8).cpu().numpy().view(FP8))
    k_after, _ = logical_from(after, c.batch, c.capacity)
    assert np.array_equal(k_after.view(np.uint8), logical[0].view(np.uint8))


@pytest.mark.parametrize("which", ["k", "v"])
def test_nan_in_an_fp8_cache_reaches_its_sequence_only(rng, which):
    """e4m3's NaN (0x7f) at one element of sequence 0's cache, KV head 1: in K, every row of that KV head's query
    heads comes out NaN; in V, their column of it. Sequence 1 and the other heads stay finite."""
    import torch
    c = DecodeCase(2, 1, 8, 2, 128, (300, 300), 320, None, False, seqlen_new=1)
    q, cache, new, kd, vd = _host_call(rng, c, fp8=True)
    poisoned = getattr(cache, f"{which}_cache").copy()
    poisoned.view(np.uint8)[0, 123, 1, 5] = 0x7F
    cache = cache._replace(**{f"{which}_cache": poisoned})
    out, lse, _ = _torch_fp8_call(c, q, cache, new, kd, vd)
    o = out.float().cpu().numpy()
    hit = o[0, :, 4:] if which == "k" else o[0, :, 4:, 5]
    assert np.isnan(hit).all() and np.isfinite(o[0, :, :4]).all() and np.isfinite(o[1]).all()
    if which == "v":
        assert np.isfinite(np.delete(o[0, :, 4:], 5, axis=-1)).all()


def test_torch_in_place_append_device_lengths_and_cuda_graph(rng):
    """torch tensors: the append lands in the caller's cache tensors; cache_seqlens on the device; the step
    captured in a torch.cuda.CUDAGraph and replayed gives the eager result."""
    import torch
    c = DecodeCase(4, 1, 32, 8, 128, (10, 4000, 777, 1), 4096, 16, True, seqlen_new=1)
    q, cache, new, _, _ = _host_call(rng, c)

    kc, vc, qt, kn, vn = t(cache.k_cache), t(cache.v_cache), t(q), t(new[0]), t(new[1])
    seqlens = torch.tensor(c.lens, dtype=torch.int32, device="cuda")
    table = torch.from_numpy(cache.page_table).cuda()
    kw = dict(cache_seqlens=seqlens, page_table=table, causal=True, return_lse=True)
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = fav.attention_with_kvcache(qt, kc, vc, k=kn, v=vn, **kw)
    ref, _ = _expected(c, q, cache, new, None, None)
    _check(c, out.float().cpu().numpy(), lse.cpu().numpy(), ref, "torch", "bfloat16")
    assert not torch.equal(kc, kc0)
    g_out, g_lse = _graph_replay(lambda: fav.attention_with_kvcache(qt, kc, vc, k=kn, v=vn, **kw),
                                 lambda: (kc.copy_(kc0), vc.copy_(vc0)))
    assert torch.equal(g_out, out) and torch.equal(g_lse, lse)


def test_cupy_graph_capture_replays_the_step(rng):
    """cupy.cuda.Graph: a step with an append and a split (kv_append, decode_split, merge_states) captured on a
    stream and replayed gives the eager result and the eager cache."""
    import cupy
    c = DecodeCase(2, 1, 16, 4, 128, (300, 2000), 2048, None, True, seqlen_new=1, num_splits=8)
    q, cache, new, _, _ = _host_call(rng, c)
    dq, kc, vc, kn, vn = (cupy.asarray(x) for x in (q, cache.k_cache, cache.v_cache, *new))
    lens = cupy.asarray(np.array(c.lens, np.int32))
    kc0, vc0 = kc.copy(), vc.copy()

    def step():
        return fav.attention_with_kvcache(dq, kc, vc, k=kn, v=vn, cache_seqlens=lens, num_splits=c.num_splits)

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        want = step()                      # eager, and the warm-up: kernels loaded
        k_want = kc.copy()
        for _ in range(2):                 # steps dropped: the pool then holds free blocks of every size the
            spare = step()                 # capture allocates, so it asks nothing of the device
            del spare
        kc[...], vc[...] = kc0, vc0
        stream.begin_capture()
        got = step()
        graph = stream.end_capture()
        graph.launch(stream)
    stream.synchronize()
    assert cupy.array_equal(got, want) and cupy.array_equal(kc, k_want)


def test_torch_compile_reduce_overhead_runs_the_step(rng):
    """torch.compile(mode="reduce-overhead") over a step with an append: the custom op under CUDA graphs (or
    torch's fallback where it declines them for the mutated cache) gives the eager result, step after step."""
    import torch
    c = DecodeCase(2, 1, 16, 4, 128, (100, 900), 1024, 16, True, seqlen_new=1)
    q, cache, new, _, _ = _host_call(rng, c)

    qt, kn, vn = t(q), t(new[0]), t(new[1])
    table = torch.from_numpy(cache.page_table).cuda()
    eager = [t(cache.k_cache), t(cache.v_cache)]
    compiled = [x.clone() for x in eager]

    def step(q, k_cache, v_cache, lens, k, v):
        return fav.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, page_table=table, k=k, v=v)

    fast = torch.compile(step, mode="reduce-overhead")
    for i in range(3):
        lens = torch.tensor(c.lens, dtype=torch.int32, device="cuda") + i
        want = step(qt, *eager, lens, kn, vn)
        got = fast(qt, *compiled, lens, kn, vn)
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"step {i}"
        assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1]), f"step {i}: the cache"


def test_device_lengths_past_the_cache_give_nan_rows_and_write_nothing_outside(rng):
    """What the host cannot see without a synchronization: a device-resident length past the cache, or a page
    index outside it. That sequence's rows come out NaN; a sequence without room writes nothing, one with a bad
    page only the new rows whose own pages are in the cache; the others are right."""
    import torch
    c = DecodeCase(3, 1, 8, 2, 64, (100, 200, 50), 256, 16, True, seqlen_new=1)
    q, cache, new, _, _ = _host_call(rng, c)

    kc, vc = t(cache.k_cache), t(cache.v_cache)
    table = cache.page_table.copy()
    table[2, 1] = 10_000                              # sequence 2 names a page outside the cache
    lens = torch.tensor([100, 256, 50], dtype=torch.int32, device="cuda")   # sequence 1 has no room
    kc0 = kc.clone()
    out = fav.attention_with_kvcache(t(q), kc, vc, k=t(new[0]), v=t(new[1]), cache_seqlens=lens,
                                     page_table=torch.from_numpy(table).cuda(), causal=True)
    o = out.float().cpu().numpy()
    assert np.isnan(o[1]).all() and np.isnan(o[2]).all() and np.isfinite(o[0]).all()
    changed = (kc != kc0).any(dim=(1, 2, 3)).cpu().numpy()
    may_change = set(table[0].tolist()) | {int(table[2, 50 // 16])}   # sequence 2's new row: a page of its own
    assert all(p in may_change for p in np.flatnonzero(changed)), "a row was written where no append belongs"
    assert changed[table[0, 100 // 16]], "sequence 0's append is missing"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_merge_states_on_the_gpu_matches_the_model(rng, dtype):
    import cupy
    np_dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    lse_dt = np.float64 if dtype == "float64" else np.float32
    outs = rng.standard_normal((5, 2, 3, 4, 72)).astype(np_dt)
    lses = (rng.standard_normal((5, 2, 4, 3)) * 3).astype(lse_dt)
    lses[1, 0, 0, 0] = -np.inf                          # an empty state
    lses[:, 1, 1, 1] = -np.inf                          # a row no state saw
    outs[1, 0, 0, 0] = np.nan                           # ... whose O is ignored
    want_out, want_lse = fav.merge_states(outs, lses)
    got_out, got_lse = fav.merge_states(cupy.asarray(outs), cupy.asarray(lses))
    tol = 1e-2 if dtype == "bfloat16" else 1e-6
    assert rel(cupy.asnumpy(got_out).astype(np.float64), want_out.astype(np.float64)) <= tol
    assert np.array_equal(np.isneginf(cupy.asnumpy(got_lse)), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    assert np.abs(cupy.asnumpy(got_lse)[fin] - want_lse[fin]).max() <= 1e-5
    two_out, two_lse = fav.merge_states(cupy.asarray(outs[0]), cupy.asarray(lses[0]), cupy.asarray(outs[2]),
                                        cupy.asarray(lses[2]))
    ref_out, ref_lse = fav.merge_states(outs[0], lses[0], outs[2], lses[2])
    assert rel(cupy.asnumpy(two_out).astype(np.float64), ref_out.astype(np.float64)) <= tol
