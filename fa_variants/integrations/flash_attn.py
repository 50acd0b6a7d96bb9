"""flash-attn's calls on fa-variants: ``flash_attn_func``, ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache`` with the signatures of flash-attn 2's ``flash_attn_interface``, so that code (and tests)
written against flash-attn run here by changing one import::

    from fa_variants.integrations.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

Any array ``fav.attention`` takes goes in (torch tensors on the GPU are what flash-attn takes; torch autograd
records the call, with fa3's or fa2's backward through ``variant="auto"``). The keywords mean what flash-attn says:
causal bottom-right, ``window_size`` (left, right) with -1 unbounded, ``softcap`` (0: none), ``alibi_slopes``
(heads,) or (batch, heads) float32. What differs:

- ``dropout_p`` must be 0: no kernel here has dropout (a ValueError names it, as for any argument refused).
- ``deterministic`` is accepted and has nothing to choose: the backward ``auto`` runs gives the same bits on every
  run either way.
- ``return_attn_probs=True`` returns (out, softmax_lse, None): the log-sum-exp as flash-attn returns it, and no
  probabilities (flash-attn returns them only for testing, with dropout).
- ``flash_attn_with_kvcache`` runs ``fav.attention_with_kvcache`` (``block_table`` is its ``page_table``); the
  rotary embedding (``rotary_cos``/``rotary_sin``), ``cache_batch_idx`` and ``cache_leftpad`` are refused with a
  ValueError: apply the rotary embedding to q and k before the call, and index the cache's batch yourself.
"""
from __future__ import annotations

from .. import api, arrays, decode, varlen

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


def _check(dropout_p, window_size, return_attn_probs, deterministic) -> tuple:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise ValueError(f"dropout_p must be 0 (fa-variants' kernels have no dropout), got {dropout_p!r}")
    arrays.check_flags(return_attn_probs=return_attn_probs, deterministic=deterministic)
    return _window(window_size)


def _window(window_size) -> tuple:
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    return left, right


def _result(res, return_attn_probs: bool):
    return (res[0], res[1], None) if return_attn_probs else res


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_func``: q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k, heads_kv,
    head_dim); returns out of q's shape (with return_attn_probs: (out, softmax_lse (batch, heads, seqlen_q),
    None))."""
    window = _check(dropout_p, window_size, return_attn_probs, deterministic)
    res = api.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
                        alibi_slopes=alibi_slopes, return_lse=return_attn_probs)
    return _result(res, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_varlen_func``: q (total_q, heads, head_dim), k and v (total_k, heads_kv,
    head_dim), int32 cumulative lengths (batch + 1,); returns out of q's shape (with return_attn_probs: (out,
    softmax_lse (heads, total_q), None))."""
    window = _check(dropout_p, window_size, return_attn_probs, deterministic)
    res = varlen.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                  window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                                  softmax_scale=softmax_scale, return_lse=return_attn_probs)
    return _result(res, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn's ``flash_attn_with_kvcache``: q (batch, seqlen_q, heads, head_dim) over k_cache, v_cache
    (batch_cache, seqlen_cache, heads_kv, head_dim), or paged (num_pages, page_size, heads_kv, head_dim) with
    ``block_table`` (batch, max_pages) int32; k, v appended in place at ``cache_seqlens`` (an int or int32 (batch,);
    None: every sequence fills its cache). Returns out (with return_softmax_lse: (out, softmax_lse (batch, heads,
    seqlen_q)))."""
    refused = {n: x for n, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                                 ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad))
               if x is not None}
    if refused:
        raise ValueError(f"{', '.join(refused)} not supported by fa-variants' attention_with_kvcache: apply the "
                         f"rotary embedding to q and k before the call, and pass the cache's own rows (no "
                         f"cache_batch_idx or cache_leftpad)")
    arrays.check_flags(return_softmax_lse=return_softmax_lse)
    window = _window(window_size)
    if cache_seqlens is None:
        if block_table is not None:
            raise ValueError("cache_seqlens is required with block_table (a paged cache has no length of its own)")
        cache_seqlens = k_cache.shape[1] - (0 if k is None else k.shape[1])
    return decode.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=block_table,
                                         k=k, v=v, causal=causal, softmax_scale=softmax_scale, num_splits=num_splits,
                                         return_lse=return_softmax_lse, window=window, softcap=softcap,
                                         alibi_slopes=alibi_slopes)
