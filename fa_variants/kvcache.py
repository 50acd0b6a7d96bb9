"""The KV cache that ``attention_with_kvcache`` reads and appends to: its two layouts, every check of a call
against it, where each token lives, and the in-place append.

Layouts (flash-attn's ``flash_attn_with_kvcache``):

- contiguous: k_cache, v_cache (batch_cache, seqlen_cache, heads_kv, head_dim), batch_cache >= batch; token t of
  sequence b is row [b, t].
- paged: k_cache, v_cache (num_pages, page_size, heads_kv, head_dim) and page_table (batch, max_pages) int32;
  token t of sequence b is row [page_table[b, t // page_size], t % page_size]. Any page size >= 1. Only the
  entries that cover a sequence's tokens are read; the rest may hold anything (-1 padding, say).

``check_call`` raises every misuse (ValueError/TypeError naming the argument) before anything is read or
written, so a refused call leaves the cache as it was. It works on NumPy arrays: the GPU side is refused earlier,
by ``fa_variants.decode``.
"""
from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from .arrays import refuse_masked
from .reference.common import is_float_dtype

FP8_CACHE_DTYPE = "float8_e4m3fn"
CONTIGUOUS = "(batch_cache, seqlen_cache, heads_kv, head_dim)"
PAGED = "(num_pages, page_size, heads_kv, head_dim)"
INDEX_DTYPE = np.int32


@dataclasses.dataclass(frozen=True)
class CacheCall:
    """A validated call: the sizes, the lengths and where each token lives."""
    batch: int
    seqlen_q: int
    heads: int
    heads_kv: int
    head_dim: int
    cache_seqlens: np.ndarray      # int64 (batch,): tokens in the cache before the call
    seqlen_new: int                # tokens the call appends to every sequence (0 without k, v)
    capacity: int                  # tokens one sequence can hold
    page_table: np.ndarray | None  # int64 (batch, max_pages); None: the contiguous layout
    page_size: int | None
    k_descale: np.ndarray | None   # float64 (batch, heads_kv): an fp8 cache's dequantization factors
    v_descale: np.ndarray | None

    @property
    def seqlens_k(self) -> np.ndarray:
        """Keys each sequence attends to: the cache's tokens and the appended ones."""
        return self.cache_seqlens + self.seqlen_new

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA): query head h reads KV head h // group."""
        return self.heads // self.heads_kv

    def rows(self, b: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(index along axis 0, index along axis 1) of tokens start..stop-1 of sequence b, for ``cache[idx]``."""
        t = np.arange(start, stop)
        if self.page_table is None:
            return np.full(t.shape, b), t
        return self.page_table[b, t // self.page_size], t % self.page_size


def _ndarray(name: str, x, what: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array ({what}), got {type(x).__name__}")
    refuse_masked(name, x)
    return x


def _float_array(name: str, x, ndim: int, layout: str) -> np.ndarray:
    x = _ndarray(name, x, layout)
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {x.shape}")
    if 0 in x.shape:
        raise ValueError(f"{name} has a zero-size dimension, shape {x.shape}; every dimension must be >= 1")
    if not is_float_dtype(x.dtype):
        raise TypeError(f"{name} must have a floating-point dtype, got {x.dtype}")
    return x


def _index_array(name: str, x, shape: tuple, layout: str) -> np.ndarray:
    x = _ndarray(name, x, f"{layout} int32")
    if x.dtype != INDEX_DTYPE:
        raise TypeError(f"{name} must be int32 {layout}, got {x.dtype}")
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {layout} = {shape}, got {x.shape}")
    return x.astype(np.int64)


def _check_caches(q, k_cache, v_cache, paged: bool):
    """(batch, seqlen_q, heads, heads_kv, head_dim) after the rank, size, dtype and head checks."""
    layout = PAGED if paged else CONTIGUOUS
    q = _float_array("q", q, 4, "(batch, seqlen_q, heads, head_dim)")
    k_cache = _float_array("k_cache", k_cache, 4, layout)
    v_cache = _float_array("v_cache", v_cache, 4, layout)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape {layout}, got {k_cache.shape} and {v_cache.shape}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache and v_cache must share one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.dtype not in (q.dtype, np.dtype(FP8_CACHE_DTYPE)):
        raise TypeError(f"k_cache and v_cache must have q's dtype ({q.dtype}) or {FP8_CACHE_DTYPE}, got "
                        f"{k_cache.dtype}")
    batch, seqlen_q, heads, d = q.shape
    heads_kv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"head_dim differs: q {d}, k_cache/v_cache {k_cache.shape[3]}")
    if heads % heads_kv:
        raise ValueError(f"heads of q ({heads}) must be a multiple of heads of k_cache/v_cache ({heads_kv}) for "
                         f"MQA/GQA")
    if not paged and k_cache.shape[0] < batch:
        raise ValueError(f"k_cache and v_cache hold {k_cache.shape[0]} sequences (batch_cache), fewer than q's "
                         f"batch {batch}: sequence b lives in row b of a contiguous cache")
    return batch, seqlen_q, heads, heads_kv, d


def _check_new(k, v, k_cache, v_cache, batch: int, heads_kv: int, d: int) -> int:
    """seqlen_new of the tokens to append (0 without k and v)."""
    if (k is None) != (v is None):
        raise ValueError(f"k and v must be given together (the new tokens' keys and values), got "
                         f"{'k' if v is None else 'v'} alone")
    if k is None:
        return 0
    layout = "(batch, seqlen_new, heads_kv, head_dim)"
    k = _float_array("k", k, 4, layout)
    v = _float_array("v", v, 4, layout)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape {layout}, got {k.shape} and {v.shape}")
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, heads_kv, d):
        raise ValueError(f"k and v must have shape {layout} = ({batch}, seqlen_new, {heads_kv}, {d}), got {k.shape}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise TypeError(f"k and v must have the cache's dtype ({k_cache.dtype}; an fp8 cache takes tokens quantized "
                        f"with its k_descale/v_descale), got {k.dtype} and {v.dtype}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.flags.writeable:
            raise ValueError(f"{name} is read-only, and k, v are appended to it in place: pass a writeable cache")
    return k.shape[1]


def _check_lengths(cache_seqlens, batch: int, values_known: bool = True) -> np.ndarray:
    if isinstance(cache_seqlens, (numbers.Integral, np.integer)) and not isinstance(cache_seqlens, (bool, np.bool_)):
        lengths = np.full(batch, int(cache_seqlens), np.int64)
    elif not isinstance(cache_seqlens, np.ndarray):
        raise TypeError(f"cache_seqlens must be an int or an int32 array (batch,), got {type(cache_seqlens).__name__}")
    else:
        lengths = _index_array("cache_seqlens", cache_seqlens, (batch,), "(batch,)")
    if values_known and (lengths < 0).any():
        b = int(np.argmax(lengths < 0))
        raise ValueError(f"cache_seqlens must be >= 0, got {int(lengths[b])} for sequence {b}")
    return lengths


def _check_room(lengths: np.ndarray, seqlen_new: int, capacity: int, where: str) -> None:
    total = lengths + seqlen_new
    b = int(np.argmax(total))
    if total[b] <= capacity:
        return
    if seqlen_new == 0:
        raise ValueError(f"cache_seqlens[{b}] = {int(lengths[b])} is beyond the cache: {where} holds {capacity} "
                         f"tokens per sequence")
    raise ValueError(f"k, v ({seqlen_new} new tokens) have no room at cache_seqlens[{b}] = {int(lengths[b])}: "
                     f"{int(total[b])} tokens, and {where} holds {capacity} per sequence")


def _check_pages(page_table: np.ndarray, lengths: np.ndarray, seqlen_new: int, page_size: int,
                 num_pages: int) -> None:
    """Every entry that covers a token the call reads or writes names a page; no page the call writes is used by
    another sequence (or twice), as the written values would then depend on the order of the writes."""
    used = [page_table[b, :-(-int(n) // page_size)] for b, n in enumerate(lengths + seqlen_new)]
    for b, pages in enumerate(used):
        bad = (pages < 0) | (pages >= num_pages)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"page_table[{b}, {i}] = {int(pages[i])} is not a page index: k_cache holds "
                             f"{num_pages} pages (0..{num_pages - 1}), and sequence {b} uses entries "
                             f"0..{len(pages) - 1}")
    if seqlen_new == 0:
        return
    counts = np.bincount(np.concatenate(used), minlength=num_pages)
    for b, n in enumerate(lengths):
        written = page_table[b, int(n) // page_size:-(-int(n + seqlen_new) // page_size)]
        shared = written[counts[written] > 1]
        if shared.size:
            raise ValueError(f"page {int(shared[0])} receives sequence {b}'s new tokens and appears more than once "
                             f"among the pages the call uses (page_table): an appended page must belong to one "
                             f"sequence")


def _check_descale(name: str, x, fp8: bool, batch: int, heads_kv: int, values_known: bool = True) -> np.ndarray | None:
    if x is None:
        return None
    if not fp8:
        raise ValueError(f"{name} dequantizes a {FP8_CACHE_DTYPE} cache; this cache is not fp8: pass None")
    x = _ndarray(name, x, "(batch, heads_kv) float32")
    if x.dtype != np.float32:
        raise TypeError(f"{name} must be float32 (batch, heads_kv), got {x.dtype}")
    if x.shape != (batch, heads_kv):
        raise ValueError(f"{name} must have shape (batch, heads_kv) = {(batch, heads_kv)}, got {x.shape}")
    bad = ~(np.isfinite(x) & (x > 0))
    if values_known and bad.any():
        raise ValueError(f"{name} must be finite and > 0 (a dequantization factor), got {x[bad][0]} at "
                         f"{tuple(int(i) for i in np.argwhere(bad)[0])}")
    return x.astype(np.float64)


def check_call(q, k_cache, v_cache, *, cache_seqlens, page_table=None, k=None, v=None, k_descale=None,
               v_descale=None, device_values: tuple = ()) -> CacheCall:
    """Every check of the arrays of an ``attention_with_kvcache`` call, before anything is read or written.

    ``device_values``: the names among cache_seqlens, page_table, k_descale, v_descale whose values live on the
    GPU. The arrays passed for them are stand-ins (``stand_in``) whose shape and dtype are checked and whose
    values are not: reading them would cost a device synchronization each step and break CUDA-graph capture,
    so the kernels guard those values instead (kv_append.cu writes no row outside the cache, decode_fwd.cu turns
    a sequence that does not fit its cache, or names a page outside it, into NaN rows)."""
    paged = page_table is not None
    batch, seqlen_q, heads, heads_kv, d = _check_caches(q, k_cache, v_cache, paged)
    seqlen_new = _check_new(k, v, k_cache, v_cache, batch, heads_kv, d)
    page_size = None
    if paged:
        table = _ndarray("page_table", page_table, "(batch, max_pages) int32")
        if table.ndim != 2 or table.shape[0] != batch or table.shape[1] < 1:
            raise ValueError(f"page_table must have shape (batch, max_pages) = ({batch}, max_pages >= 1), got "
                             f"{table.shape}")
        page_table = _index_array("page_table", table, table.shape, "(batch, max_pages)")
        page_size = k_cache.shape[1]
        capacity, where = page_table.shape[1] * page_size, (f"page_table ({page_table.shape[1]} pages of "
                                                             f"{page_size} tokens)")
    else:
        capacity, where = k_cache.shape[1], "k_cache (seqlen_cache)"
    lengths = _check_lengths(cache_seqlens, batch, "cache_seqlens" not in device_values)
    if "cache_seqlens" not in device_values:
        _check_room(lengths, seqlen_new, capacity, where)
        if paged and "page_table" not in device_values:
            _check_pages(page_table, lengths, seqlen_new, page_size, k_cache.shape[0])
    fp8 = k_cache.dtype == np.dtype(FP8_CACHE_DTYPE)
    descale = {name: _check_descale(name, x, fp8, batch, heads_kv, name not in device_values)
               for name, x in (("k_descale", k_descale), ("v_descale", v_descale))}
    return CacheCall(batch=batch, seqlen_q=seqlen_q, heads=heads, heads_kv=heads_kv, head_dim=d,
                     cache_seqlens=lengths, seqlen_new=seqlen_new, capacity=capacity, page_table=page_table,
                     page_size=page_size, **descale)


def stand_in(shape: tuple, dtype) -> np.ndarray:
    """A writeable NumPy array of ``shape`` and ``dtype`` that owns one element (every stride 0): what
    ``check_call`` is given for a GPU array, whose shape and dtype it checks without reading it."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape=tuple(shape), strides=(0,) * len(shape),
                                           writeable=True)


def append(call: CacheCall, k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """Write k, v (batch, seqlen_new, heads_kv, d) into the caches in place at each sequence's cache_seqlens."""
    for b, n in enumerate(call.cache_seqlens):
        idx = call.rows(b, int(n), int(n) + call.seqlen_new)
        k_cache[idx] = k[b]
        v_cache[idx] = v[b]
