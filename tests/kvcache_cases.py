"""Random KV caches for the decoding tests, built without the library.

Each sequence's keys and values are drawn as plain arrays (the "logical" cache, (batch, capacity, heads_kv, d)),
then written into a contiguous or a paged cache by the test's own addressing: pages in a random order, spare pages
and unused slots filled with other random values. The float64 reference reads the logical arrays, so it never
shares the library's page walk.
"""
from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

from conftest import reference64
from fa_variants.tolerances import LSE_RTOL

# The model against float64: its partials are stored in fp32 as the kernel stores them (relative 2^-24 each),
# so with several splits it agrees to about 1e-7; with one split it is float64 throughout.
SPLIT_MODEL_TOL = 1e-6
SINGLE_SPLIT_TOL = 1e-12
LSE_TOL = 1e-5
FP8 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0


class Cache(NamedTuple):
    k_cache: np.ndarray
    v_cache: np.ndarray
    page_table: np.ndarray | None
    k_log: np.ndarray          # (batch, capacity, heads_kv, d): what sequence b holds at token t
    v_log: np.ndarray


def make_cache(rng, batch: int, capacity: int, heads_kv: int, d: int, dtype=np.float16, page_size=None,
               extra_rows: int = 1) -> Cache:
    """A cache of ``capacity`` tokens per sequence, contiguous (with ``extra_rows`` unused sequences) or in
    pages of ``page_size`` (``extra_rows`` spare pages, the table's order random)."""
    def draw(*shape):
        return rng.standard_normal(shape).astype(dtype)

    k_log, v_log = draw(batch, capacity, heads_kv, d), draw(batch, capacity, heads_kv, d)
    if page_size is None:
        k_cache = np.concatenate([k_log, draw(extra_rows, capacity, heads_kv, d)])
        v_cache = np.concatenate([v_log, draw(extra_rows, capacity, heads_kv, d)])
        return Cache(k_cache, v_cache, None, k_log, v_log)
    per_seq = -(-capacity // page_size)
    num_pages = batch * per_seq + extra_rows
    table = rng.permutation(num_pages)[:batch * per_seq].reshape(batch, per_seq).astype(np.int32)
    k_cache, v_cache = draw(num_pages, page_size, heads_kv, d), draw(num_pages, page_size, heads_kv, d)
    for b in range(batch):
        for i, page in enumerate(table[b]):
            t = slice(i * page_size, min((i + 1) * page_size, capacity))
            k_cache[page, :t.stop - t.start] = k_log[b, t]
            v_cache[page, :t.stop - t.start] = v_log[b, t]
    return Cache(k_cache, v_cache, table, k_log, v_log)


def logical_from(cache: Cache, batch: int, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Read a (possibly paged) cache back into logical arrays, by the test's own addressing."""
    if cache.page_table is None:
        return cache.k_cache[:batch, :capacity], cache.v_cache[:batch, :capacity]
    t = np.arange(capacity)
    pages, slots = cache.page_table[:, t // cache.k_cache.shape[1]], t % cache.k_cache.shape[1]
    return cache.k_cache[pages, slots[None, :]], cache.v_cache[pages, slots[None, :]]


def quantize_e4m3(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x / descale rounded to e4m3, descale (batch, heads_kv) float32), descale = amax / 448 per (batch, head)
    over the whole cache, as a serving stack would keep per-head scales."""
    x = x.astype(np.float32)
    descale = (np.abs(x).max(axis=(1, 3)) / E4M3_MAX).astype(np.float32)
    return (x / descale[:, None, :, None]).astype(FP8), descale


def reference(q, k_log, v_log, seqlens_k, causal: bool, scale=None, k_descale=None, v_descale=None, **mask):
    """float64 attention of each sequence over its first seqlens_k[b] logical tokens (dequantized by the descale
    factors when given): (out (batch, seqlen_q, heads, d), lse (batch, heads, seqlen_q)). ``mask``: the mask
    keywords (window, softcap, alibi_slopes, sinks), through test_masks_model's reference."""
    from test_masks_model import reference as masked_reference
    batch, nq, heads, d = q.shape
    out, lse = np.zeros((batch, nq, heads, d)), np.full((batch, heads, nq), -np.inf)
    slopes = mask.get("alibi_slopes")
    for b in range(batch):
        n = int(seqlens_k[b])
        if n == 0 and mask.get("sinks") is None:
            continue
        k, v = k_log[b:b + 1, :n].astype(np.float64), v_log[b:b + 1, :n].astype(np.float64)
        if k_descale is not None:
            k = k * k_descale[b][None, None, :, None].astype(np.float64)
        if v_descale is not None:
            v = v * v_descale[b][None, None, :, None].astype(np.float64)
        if not mask:
            out[b:b + 1], lse[b:b + 1] = reference64(q[b:b + 1], k, v, causal=causal, scale=scale)
            continue
        kw = dict(window=mask.get("window", (-1, -1)), softcap=mask.get("softcap", 0.0), sinks=mask.get("sinks"),
                  alibi=None if slopes is None else np.asarray(slopes if slopes.ndim == 1 else slopes[b], np.float64))
        r = masked_reference(q[b:b + 1].astype(np.float64), k, v, causal=causal, scale=scale, **kw)
        out[b:b + 1], lse[b:b + 1] = r["out"], r["lse"]
    return out, lse


def mask_case(rng, name: str, batch: int, heads: int) -> dict:
    """attention_with_kvcache's mask keywords of a named case (fresh slopes and sinks, float32)."""
    slopes = rng.uniform(0.05, 0.5, heads).astype(np.float32)
    sinks = (rng.standard_normal(heads) + 1.0).astype(np.float32)
    return {
        "window": dict(window=(5, 0)),
        "window both sides": dict(causal=False, window=(4, 2)),
        "softcap": dict(softcap=1.5),
        "alibi": dict(alibi_slopes=slopes),
        "alibi per sequence": dict(alibi_slopes=rng.uniform(0.05, 0.5, (batch, heads)).astype(np.float32)),
        "sinks": dict(sinks=sinks),
        "window and sinks": dict(window=(7, 0), sinks=sinks),       # gpt-oss's sliding layers
        "everything": dict(window=(9, 0), softcap=2.0, alibi_slopes=slopes, sinks=sinks),
    }[name]


MASK_CASES = ("window", "window both sides", "softcap", "alibi", "alibi per sequence", "sinks", "window and sinks",
              "everything")


def rel(a, ref) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - ref) / np.linalg.norm(ref))


def assert_lse(lse, ref_lse, what: str = "") -> None:
    lse = np.asarray(lse, np.float64)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty), f"{what}: -inf rows differ from the reference's"
    assert not np.isnan(lse).any(), f"{what}: NaN in lse"
    # (fp32 loses absolute precision as |lse| grows: the bound widens by LSE_RTOL of it, as tolerances.py's)
    err = np.abs(lse[~empty] - ref_lse[~empty])
    over = err - (LSE_TOL + LSE_RTOL * np.abs(ref_lse[~empty]))
    assert over.size == 0 or over.max() <= 0, f"{what}: lse off by {err[over.argmax()]:.2e}, past its bound"
