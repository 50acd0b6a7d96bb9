"""fav.attention_with_kvcache: flash_attn_with_kvcache's semantics on NumPy arrays (the model), the fp8 cache
against the 16-bit one, and every misuse refused before anything is written (the cache byte-identical after)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fa_variants as fav
from conftest import TOL, has_gpu
from kvcache_cases import FP8, assert_lse, logical_from, make_cache, quantize_e4m3, reference, rel


def test_out_and_lse_like_flash_attn(rng):
    batch, cap, hkv, heads, d, nq = 3, 64, 2, 8, 32, 4
    cache = make_cache(rng, batch, cap, hkv, d, ml_dtypes.bfloat16, page_size=16)
    q = rng.standard_normal((batch, nq, heads, d)).astype(ml_dtypes.bfloat16)
    lengths = np.array([0, 2, 63], np.int32)
    out, lse = fav.attention_with_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=lengths,
                                          page_table=cache.page_table, return_lse=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (batch, heads, nq)
    ref_out, ref_lse = reference(q, cache.k_log, cache.v_log, lengths, causal=True)
    assert rel(out, ref_out) <= TOL["bfloat16"]
    assert_lse(lse, ref_lse)
    assert (out[0] == 0).all() and np.isneginf(lse[0]).all()          # an empty sequence: zeros and -inf
    only = fav.attention_with_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=lengths,
                                      page_table=cache.page_table)
    assert np.array_equal(only, out)


def test_int_cache_seqlens_softmax_scale_and_non_causal(rng):
    cache = make_cache(rng, 2, 50, 1, 16)
    q = rng.standard_normal((2, 3, 2, 16)).astype(np.float16)
    out = fav.attention_with_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=41, causal=False,
                                     softmax_scale=0.3, num_splits=4)
    ref_out, _ = reference(q, cache.k_log, cache.v_log, [41, 41], causal=False, scale=0.3)
    assert rel(out, ref_out) <= TOL["float16"]


@pytest.mark.parametrize("page_size", [None, 1, 7])
def test_append_in_place_then_attend(rng, page_size):
    batch, cap, hkv, d, new = 2, 30, 2, 16, 3
    cache = make_cache(rng, batch, cap, hkv, d, page_size=page_size)
    lengths = np.array([5, 26], np.int32)
    k_new, v_new = (rng.standard_normal((batch, new, hkv, d)).astype(np.float16) for _ in range(2))
    q = rng.standard_normal((batch, 2, 4, d)).astype(np.float16)
    out = fav.attention_with_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=lengths,
                                     page_table=cache.page_table, k=k_new, v=v_new)
    expect_k, expect_v = cache.k_log.copy(), cache.v_log.copy()
    for b, n in enumerate(lengths):
        expect_k[b, n:n + new], expect_v[b, n:n + new] = k_new[b], v_new[b]
    got_k, got_v = logical_from(cache, batch, cap)
    assert np.array_equal(got_k, expect_k) and np.array_equal(got_v, expect_v)
    assert np.array_equal(lengths, [5, 26]), "cache_seqlens is the caller's to advance"
    ref_out, _ = reference(q, expect_k, expect_v, lengths + new, causal=True)
    assert rel(out, ref_out) <= TOL["float16"]


@pytest.mark.parametrize("page_size", [None, 16])
def test_fp8_cache_against_the_16bit_cache(rng, page_size):
    """The same cache stored in e4m3 with per-(batch, KV head) descales: its output is within fp8's tolerance of
    the bf16 cache's (TOL['float8_e4m3fn'], the project's fp8 bound against float64)."""
    batch, cap, hkv, heads, d = 2, 300, 2, 8, 64
    cache = make_cache(rng, batch, cap, hkv, d, ml_dtypes.bfloat16, page_size=page_size)
    k8, kd = quantize_e4m3(logical_from(cache, batch, cap)[0])
    v8, vd = quantize_e4m3(logical_from(cache, batch, cap)[1])
    cache8 = make_cache(rng, batch, cap, hkv, d, FP8, page_size=page_size)
    if page_size is None:
        cache8.k_cache[:batch], cache8.v_cache[:batch] = k8, v8
        table = None
    else:
        table = cache.page_table
        t = np.arange(cap)
        cache8.k_cache[table[:, t // page_size], t % page_size] = k8
        cache8.v_cache[table[:, t // page_size], t % page_size] = v8
    q = rng.standard_normal((batch, 2, heads, d)).astype(ml_dtypes.bfloat16)
    lengths = np.array([299, 120], np.int32)
    out16 = fav.attention_with_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=lengths, page_table=table)
    out8 = fav.attention_with_kvcache(q, cache8.k_cache, cache8.v_cache, cache_seqlens=lengths, page_table=table,
                                      k_descale=kd, v_descale=vd)
    ref16, _ = reference(q, cache.k_log, cache.v_log, lengths, causal=True)
    assert rel(out16, ref16) <= TOL["bfloat16"]
    err = rel(out8, ref16)
    assert err <= TOL["float8_e4m3fn"], f"fp8 cache vs 16-bit: {err:.3e}"
    assert err > TOL["bfloat16"] / 10, "the e4m3 rounding should show: was the fp8 cache read at all?"


# ------------------------------------------------------------------------------------------------ misuse
def base_call(rng, paged=True, fp8=False):
    """A valid call's arguments (with new tokens, so that a call that got through would write the cache)."""
    batch, hkv, d = 2, 2, 8
    dtype = FP8 if fp8 else np.float16
    cache = make_cache(rng, batch, 16, hkv, d, dtype, page_size=4 if paged else None)
    kw = dict(q=rng.standard_normal((batch, 1, 4, d)).astype(np.float16), k_cache=cache.k_cache,
              v_cache=cache.v_cache, cache_seqlens=np.array([3, 10], np.int32), page_table=cache.page_table,
              k=rng.standard_normal((batch, 2, hkv, d)).astype(dtype),
              v=rng.standard_normal((batch, 2, hkv, d)).astype(dtype))
    if fp8:
        kw.update(k_descale=np.ones((batch, hkv), np.float32), v_descale=np.ones((batch, hkv), np.float32))
    return kw


def _table(kw, *cells):
    t = kw["page_table"].copy()
    for (b, i), value in cells:
        t[b, i] = value
    return t


MISUSE = {
    # name: (change to the valid call, exception, words of the message)
    "lengths beyond the cache": (lambda kw, rng: dict(cache_seqlens=np.array([3, 17], np.int32), k=None, v=None),
                                 ValueError, "cache_seqlens[1] = 17 is beyond the cache"),
    "no room to append": (lambda kw, rng: dict(cache_seqlens=np.array([3, 15], np.int32)), ValueError,
                          "have no room at cache_seqlens[1] = 15"),
    "negative length": (lambda kw, rng: dict(cache_seqlens=np.array([-1, 2], np.int32)), ValueError,
                        "cache_seqlens must be >= 0"),
    "int64 lengths": (lambda kw, rng: dict(cache_seqlens=np.array([3, 10])), TypeError,
                      "cache_seqlens must be int32"),
    "lengths of the wrong batch": (lambda kw, rng: dict(cache_seqlens=np.array([3], np.int32)), ValueError,
                                   "cache_seqlens must have shape (batch,)"),
    "float length": (lambda kw, rng: dict(cache_seqlens=3.0), TypeError, "cache_seqlens must be an int"),
    "page index out of range": (lambda kw, rng: dict(page_table=_table(kw, ((1, 2), 99))), ValueError,
                                "page_table[1, 2] = 99 is not a page index"),
    "negative page index": (lambda kw, rng: dict(page_table=_table(kw, ((0, 0), -1))), ValueError,
                            "page_table[0, 0] = -1"),
    "appended page shared": (lambda kw, rng: dict(page_table=_table(kw, ((0, 1), kw["page_table"][1, 0]))),
                             ValueError, "appears more than once"),
    "page table int64": (lambda kw, rng: dict(page_table=kw["page_table"].astype(np.int64)), TypeError,
                         "page_table must be int32"),
    "page table of the wrong batch": (lambda kw, rng: dict(page_table=kw["page_table"][:1]), ValueError,
                                      "page_table must have shape (batch, max_pages)"),
    "k without v": (lambda kw, rng: dict(v=None), ValueError, "k and v must be given together"),
    "v without k": (lambda kw, rng: dict(k=None), ValueError, "got v alone"),
    "k of the wrong heads": (lambda kw, rng: dict(k=kw["k"][:, :, :1], v=kw["v"][:, :, :1]), ValueError,
                             "k and v must have shape (batch, seqlen_new, heads_kv, head_dim)"),
    "k and v shapes differ": (lambda kw, rng: dict(v=kw["v"][:, :1]), ValueError, "k and v must have one shape"),
    "k of another dtype": (lambda kw, rng: dict(k=kw["k"].astype(np.float32), v=kw["v"].astype(np.float32)),
                           TypeError, "k and v must have the cache's dtype"),
    "cache of another dtype": (lambda kw, rng: dict(q=kw["q"].astype(ml_dtypes.bfloat16)), TypeError,
                               "k_cache and v_cache must have q's dtype"),
    "q float32": (lambda kw, rng: dict(q=kw["q"].astype(np.float32)), TypeError,
                  "q must be float16 or bfloat16"),
    "q integer": (lambda kw, rng: dict(q=kw["q"].astype(np.int16)), TypeError, "q must be float16 or bfloat16"),
    "heads not a multiple": (lambda kw, rng: dict(q=np.ones((2, 1, 3, 8), np.float16)), ValueError,
                             "must be a multiple of heads of k_cache"),
    "head_dim differs": (lambda kw, rng: dict(q=np.ones((2, 1, 4, 16), np.float16)), ValueError,
                         "head_dim differs"),
    "q of rank 3": (lambda kw, rng: dict(q=kw["q"][:, 0]), ValueError, "q must have 4 dimensions"),
    "empty q": (lambda kw, rng: dict(q=kw["q"][:, :0]), ValueError, "zero-size dimension"),
    "v_cache of another shape": (lambda kw, rng: dict(v_cache=kw["v_cache"][:-1]), ValueError,
                                 "k_cache and v_cache must have one shape"),
    "contiguous cache too small": (lambda kw, rng: dict(page_table=None, k_cache=kw["k_cache"][:1],
                                                        v_cache=kw["v_cache"][:1]), ValueError,
                                   "fewer than q's batch"),
    "read-only cache": (lambda kw, rng: dict(k_cache=_read_only(kw["k_cache"])), ValueError, "k_cache is read-only"),
    "descale on a 16-bit cache": (lambda kw, rng: dict(k_descale=np.ones((2, 2), np.float32)), ValueError,
                                  "k_descale dequantizes a float8_e4m3fn cache"),
    "num_splits negative": (lambda kw, rng: dict(num_splits=-1), ValueError, "num_splits must be 0"),
    "num_splits too many": (lambda kw, rng: dict(num_splits=257), ValueError, "1..256"),
    "num_splits bool": (lambda kw, rng: dict(num_splits=True), TypeError, "num_splits must be an int"),
    "causal not a bool": (lambda kw, rng: dict(causal=1), TypeError, "causal must be a bool"),
    "softmax_scale nan": (lambda kw, rng: dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
    "return_lse not a bool": (lambda kw, rng: dict(return_lse="yes"), TypeError, "return_lse must be a bool"),
    "variant unknown": (lambda kw, rng: dict(variant="fa2"), ValueError, "variant must be one of ['auto', 'decode']"),
    "backend unknown": (lambda kw, rng: dict(backend="gpu"), ValueError, "backend must be one of"),
    "strided head_dim": (lambda kw, rng: dict(k_cache=np.repeat(kw["k_cache"], 2, axis=3)[..., ::2]), ValueError,
                         "k_cache must be contiguous in its last dimension"),
    "a list for q": (lambda kw, rng: dict(q=kw["q"].tolist()), TypeError, "q must be a NumPy array"),
    "a masked cache": (lambda kw, rng: dict(k_cache=np.ma.masked_array(kw["k_cache"])), TypeError,
                       "masked array"),
    "window of one side": (lambda kw, rng: dict(window=(3,)), TypeError, "window must be a (left, right) pair"),
    "window below -1": (lambda kw, rng: dict(window=(-2, 0)), ValueError, "window sides must be >= -1"),
    "softcap negative": (lambda kw, rng: dict(softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
    "sinks per KV head": (lambda kw, rng: dict(sinks=np.zeros(2, np.float32)), ValueError,
                          "sinks must have shape (heads,) = (4,)"),
    "sinks of ints": (lambda kw, rng: dict(sinks=np.zeros(4, np.int32)), TypeError,
                      "sinks must have a floating-point dtype"),
    "alibi of the wrong batch": (lambda kw, rng: dict(alibi_slopes=np.zeros((3, 4), np.float32)), ValueError,
                                 "alibi_slopes must have shape (heads,) = (4,) or (batch, heads) = (2, 4)"),
}

FP8_MISUSE = {
    "descale of the wrong shape": (lambda kw, rng: dict(k_descale=np.ones((2,), np.float32)), ValueError,
                                   "k_descale must have shape (batch, heads_kv) = (2, 2)"),
    "descale float64": (lambda kw, rng: dict(v_descale=np.ones((2, 2))), TypeError, "v_descale must be float32"),
    "descale zero": (lambda kw, rng: dict(k_descale=np.zeros((2, 2), np.float32)), ValueError,
                     "k_descale must be finite and > 0"),
    "descale nan": (lambda kw, rng: dict(v_descale=np.full((2, 2), np.nan, np.float32)), ValueError,
                    "v_descale must be finite and > 0"),
    "new tokens in 16 bits for an fp8 cache": (lambda kw, rng: dict(k=kw["k"].astype(np.float16),
                                                                     v=kw["v"].astype(np.float16)), TypeError,
                                               "an fp8 cache takes tokens quantized"),
}


def _read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def _assert_refused(rng, change, err, words, fp8=False):
    kw = base_call(rng, fp8=fp8)
    caches = (kw["k_cache"], kw["v_cache"])
    before = {n: a.tobytes() for n, a in zip(("k_cache", "v_cache"), caches)}
    kw.update(change(kw, rng))
    with pytest.raises(err) as info:
        fav.attention_with_kvcache(**kw)
    assert words in str(info.value), f"message: {info.value}"
    after = {n: a.tobytes() for n, a in zip(("k_cache", "v_cache"), caches)}
    assert after == before, "a refused call changed the cache"


@pytest.mark.parametrize("name", MISUSE)
def test_misuse_is_refused_and_the_cache_unchanged(rng, name):
    _assert_refused(rng, *MISUSE[name])


@pytest.mark.parametrize("name", FP8_MISUSE)
def test_fp8_misuse_is_refused_and_the_cache_unchanged(rng, name):
    _assert_refused(rng, *FP8_MISUSE[name], fp8=True)


def test_the_valid_base_call_runs_and_appends(rng):
    """The calls above differ from this one by one argument each: it must pass, so each refusal is that
    argument's."""
    for fp8 in (False, True):
        kw = base_call(rng, fp8=fp8)
        before = kw["k_cache"].copy()
        out = fav.attention_with_kvcache(**kw)
        assert out.shape == kw["q"].shape and np.isfinite(out.astype(np.float32)).all()
        assert not np.array_equal(before.view(np.uint8), kw["k_cache"].view(np.uint8))


class _FakeGpuArray:
    """Claims GPU memory (``__cuda_array_interface__``) like a CuPy or torch CUDA array, without a GPU."""
    __cuda_array_interface__ = {"shape": (2,), "typestr": "<i4", "data": (0, False), "version": 3}


@pytest.mark.parametrize("where", ["cache_seqlens", "page_table", "k"])
def test_a_gpu_array_among_numpy_ones_is_refused_before_anything_is_written(rng, where):
    _assert_refused(rng, lambda kw, rng: {where: _FakeGpuArray()}, ValueError, f"{where} on the GPU")


@pytest.mark.skipif(has_gpu(), reason="the refusal where no GPU is usable")
@pytest.mark.parametrize("where", ["q", "k_cache"])
def test_gpu_arrays_without_a_gpu_are_refused_before_anything_is_written(rng, where):
    _assert_refused(rng, lambda kw, rng: {where: _FakeGpuArray()}, fav.BackendUnavailable, "no CUDA GPU is usable")


@pytest.mark.skipif(has_gpu(), reason="the refusal where no GPU is usable")
def test_backend_cuda_without_a_gpu_is_refused(rng):
    _assert_refused(rng, lambda kw, rng: dict(backend="cuda"), fav.BackendUnavailable, "backend='cuda'")


def test_backend_numpy_and_variant_decode_run_the_model(rng):
    kw = base_call(rng, paged=False)
    out_a = fav.attention_with_kvcache(**{**kw, "k": None, "v": None}, backend="numpy", variant="decode")
    out_b = fav.attention_with_kvcache(**{**kw, "k": None, "v": None})
    assert np.array_equal(out_a, out_b)


@pytest.mark.gpu
def test_cupy_misuse_is_refused_and_the_cache_unchanged(rng):
    import cupy
    kw = base_call(rng)
    dev = {n: (cupy.asarray(x) if isinstance(x, np.ndarray) and n != "cache_seqlens" else x) for n, x in kw.items()}
    before = {n: cupy.asnumpy(dev[n]).tobytes() for n in ("k_cache", "v_cache")}
    with pytest.raises(ValueError, match="no room"):
        fav.attention_with_kvcache(**{**dev, "cache_seqlens": np.full_like(kw["cache_seqlens"], 10**6)})
    assert {n: cupy.asnumpy(dev[n]).tobytes() for n in ("k_cache", "v_cache")} == before
