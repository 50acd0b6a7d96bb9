"""fav.attention_with_kvcache on torch tensors on the CPU (the NumPy model on their memory): results as torch
tensors, the cache appended in place, and the whole call one opaque op under torch.compile (fullgraph)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fa_variants as fav
from kvcache_cases import make_cache

torch = pytest.importorskip("torch")

TORCH_DTYPE = {np.dtype(np.float16): torch.float16, np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
               np.dtype(ml_dtypes.float8_e4m3fn): torch.float8_e4m3fn}


def to_torch(a: np.ndarray) -> torch.Tensor:
    """A torch copy of a NumPy array, bfloat16 and float8 included (through their bit patterns)."""
    a = np.ascontiguousarray(a)
    bits = {1: np.uint8, 2: np.int16}.get(a.dtype.itemsize) if a.dtype in TORCH_DTYPE else None
    if bits is None:
        return torch.from_numpy(a.copy())
    return torch.from_numpy(a.view(bits).copy()).view(TORCH_DTYPE[a.dtype])


def step(rng, dtype, page_size, cache_dtype=None):
    """A decoding step with an append: NumPy arrays and torch copies of the same values."""
    batch, cap, hkv, heads, d, new = 2, 40, 2, 4, 16, 2
    cache = make_cache(rng, batch, cap, hkv, d, cache_dtype or dtype, page_size=page_size)
    host = dict(q=rng.standard_normal((batch, new, heads, d)).astype(dtype), k_cache=cache.k_cache,
                v_cache=cache.v_cache, cache_seqlens=np.array([3, 30], np.int32), page_table=cache.page_table,
                k=rng.standard_normal((batch, new, hkv, d)).astype(cache.k_cache.dtype),
                v=rng.standard_normal((batch, new, hkv, d)).astype(cache.k_cache.dtype))
    if cache_dtype is not None:
        host.update(k_descale=np.full((batch, hkv), 0.5, np.float32), v_descale=np.full((batch, hkv), 2.0, np.float32))
    tensors = {n: None if x is None else to_torch(x) for n, x in host.items()}
    return host, tensors


def call(arrays: dict, **kw):
    a = dict(arrays)
    return fav.attention_with_kvcache(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), **a, **kw)


def bits(x) -> np.ndarray:
    x = x.contiguous()
    return (x.view(torch.uint8) if x.element_size() == 1 else x.view(torch.int16)).numpy()


@pytest.mark.parametrize("dtype,page_size,cache_dtype", [
    (np.float16, None, None), (ml_dtypes.bfloat16, 8, None), (ml_dtypes.bfloat16, None, ml_dtypes.float8_e4m3fn)])
def test_cpu_tensors_run_the_model_and_append_in_place(rng, dtype, page_size, cache_dtype):
    host, tensors = step(rng, dtype, page_size, cache_dtype)
    want_out, want_lse = call(host, return_lse=True)
    out, lse = call(tensors, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == tensors["q"].dtype and out.shape == tensors["q"].shape
    assert lse.dtype == torch.float32 and np.array_equal(lse.numpy(), want_lse)
    assert np.array_equal(bits(out), np.ascontiguousarray(want_out).view(bits(out).dtype))
    for n in ("k_cache", "v_cache"):   # the torch caches took the same append as the NumPy ones
        assert np.array_equal(bits(tensors[n]), np.ascontiguousarray(host[n]).view(bits(tensors[n]).dtype))


def test_a_refused_torch_call_leaves_the_cache_unchanged(rng):
    _, tensors = step(rng, np.float16, None)
    before = tensors["k_cache"].clone()
    tensors["cache_seqlens"] = torch.tensor([3, 39], dtype=torch.int32)   # 39 + 2 new tokens > 40 slots
    with pytest.raises(ValueError, match="cache_seqlens"):
        call(tensors)
    assert torch.equal(tensors["k_cache"], before)


def test_a_decoding_step_compiles_whole(rng):
    """fullgraph=True: Dynamo cannot trace the DLPack hand-over, so the call must be the one custom op; the
    compiled step appends into the cache it is given and returns what the eager call returns."""
    host, tensors = step(rng, ml_dtypes.bfloat16, 8)
    eager = {n: None if x is None else x.clone() for n, x in tensors.items()}
    want = call(eager)

    @torch.compile(fullgraph=True)
    def decode_step(q, k_cache, v_cache, cache_seqlens, page_table, k, v):
        return fav.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                          page_table=page_table, k=k, v=v)

    got = decode_step(**tensors)
    assert torch.equal(got, want)
    assert torch.equal(tensors["k_cache"], eager["k_cache"]) and torch.equal(tensors["v_cache"], eager["v_cache"])


def test_an_int_length_under_compile(rng):
    host, tensors = step(rng, np.float16, None)
    want = fav.attention_with_kvcache(host["q"], host["k_cache"], host["v_cache"], cache_seqlens=17)
    got = torch.compile(lambda q, kc, vc: fav.attention_with_kvcache(q, kc, vc, cache_seqlens=17),
                        fullgraph=True)(tensors["q"], tensors["k_cache"], tensors["v_cache"])
    assert np.array_equal(got.numpy(), want)


def test_mask_keywords_compile_whole(rng):
    """A window and bfloat16 sinks that require grad (gpt-oss's parameters) and ALiBi slopes through the one op
    under torch.compile (fullgraph), as the eager call gives them."""
    host, tensors = step(rng, ml_dtypes.bfloat16, 8)
    sinks = torch.randn(4, dtype=torch.bfloat16, requires_grad=True)
    slopes = torch.rand(2, 4, dtype=torch.float32)
    kw = dict(window=(5, 0), softcap=3.0, alibi_slopes=slopes)
    eager = {n: None if x is None else x.clone() for n, x in tensors.items()}
    with torch.no_grad():
        want = call(eager, sinks=sinks, **kw)

    @torch.compile(fullgraph=True)
    def decode_step(q, k_cache, v_cache, cache_seqlens, page_table, k, v, sinks):
        return fav.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                          page_table=page_table, k=k, v=v, sinks=sinks, **kw)

    with torch.no_grad():
        got = decode_step(**tensors, sinks=sinks)
    assert torch.equal(got, want)
    unmasked = call({n: None if x is None else x.clone() for n, x in eager.items() if n not in ("k", "v")})
    assert not torch.equal(unmasked, want)
