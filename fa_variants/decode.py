"""Decoding over a KV cache: ``attention_with_kvcache`` (flash-attn's ``flash_attn_with_kvcache``) and
``merge_states`` (the combine step of split-KV, cascade attention and context parallelism).

NumPy arrays run the NumPy model (reference/decode.py); GPU arrays (CuPy, torch and JAX on a GPU) run the kernels
(decode_cuda.py: kv_append.cu, decode_fwd.cu, merge_states.cu).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import arrays
from .reference import decode as model
from .reference import masks
from .reference.common import is_float_dtype

DTYPES = ("float16", "bfloat16")     # q's dtypes
VARIANTS = ("auto", "decode")
BACKENDS = (None, "auto", "numpy", "cuda")
OPTIONAL = ("page_table", "k", "v", "k_descale", "v_descale", "alibi_slopes", "sinks")
STREAMED = ("q", "k_cache", "v_cache", "k", "v")   # contiguous in their last dimension, as the kernels read them


def _on_gpu(*xs) -> bool:
    return any(x is not None and arrays._claims_gpu(x) for x in xs)


def _check_placement(func: str, named: dict, optional: tuple = ()) -> None:
    """The host path: host arrays only (a GPU array among them: ValueError, every array on one side), TypeError
    for anything else. The names in ``optional`` may be None."""
    gpu = [n for n, x in named.items() if x is not None and arrays._claims_gpu(x)]
    if gpu:
        raise ValueError(f"{func}: {', '.join(gpu)} on the GPU while the rest are host arrays: pass every array on "
                         f"one side (host arrays run the NumPy model, GPU arrays the kernels); nothing was read or "
                         f"appended")
    for n, x in named.items():
        if not (x is None and n in optional) and arrays._claims_gpu(x) is None:
            raise TypeError(f"{n} must be a NumPy array, a CPU torch tensor or JAX array, or a GPU array, got "
                            f"{type(x).__name__}")


def _host_views(named: dict) -> dict:
    """NumPy views of the host arrays in ``named`` (CPU torch tensors and JAX arrays share their memory, so an
    append writes a torch cache in place); None and NumPy arrays pass as they are."""
    out = {}
    for n, x in named.items():
        if x is None or isinstance(x, np.ndarray):
            if isinstance(x, np.ndarray):
                arrays.refuse_masked(n, x)
            out[n] = x
        else:
            out[n] = arrays._host_import(n, x)
    return out


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, page_table=None, k=None, v=None, causal=True,
                           softmax_scale=None, num_splits=0, return_lse=False, k_descale=None, v_descale=None,
                           window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, variant="auto",
                           backend=None):
    """Attention of a few new query tokens over a KV cache, with flash-attn's flash_attn_with_kvcache semantics.

    q: (batch, seqlen_q, heads, head_dim) float16 or bfloat16, heads % heads_kv == 0.
    k_cache, v_cache: (batch_cache, seqlen_cache, heads_kv, head_dim), batch_cache >= batch (sequence b in row
        b), or paged: (num_pages, page_size, heads_kv, head_dim) with page_table (batch, max_pages) int32 (token t
        of sequence b in page page_table[b, t // page_size] at t % page_size; any page size >= 1). q's dtype, or
        float8_e4m3fn with k_descale, v_descale (batch, heads_kv) float32 (None: 1): the cache holds x / descale.
    cache_seqlens: int32 (batch,) or an int: the tokens already in each sequence's cache.
    k, v: (batch, seqlen_new, heads_kv, head_dim) in the cache's dtype, or None: appended to the cache in place at
        cache_seqlens, then attended to in the same call (the caller advances cache_seqlens by seqlen_new).
    causal: bottom-right within each sequence: query i sees keys j <= cache_seqlens + seqlen_new - seqlen_q + i;
        a row that sees no key gives zeros and lse -inf.
    window, softcap, alibi_slopes, sinks: attention()'s mask keywords, each sequence's queries its last seqlen_q
        tokens: window (left, right) keeps keys i + diag - left .. i + diag + right (-1: unbounded; only those keys
        are read, so a window of w costs w keys a step however long the cache), softcap caps the scores
        (cap tanh(s / cap)), alibi_slopes (heads,) or (batch, heads) float32 biases them by -slope |i + diag - j|,
        sinks (heads,) float32 adds one logit per head to every row's denominator (gpt-oss).
    num_splits: 0 chooses the split count from batch, heads_kv, length and the SM count
        (reference/decode.py: choose_num_splits); any value 1..256 runs that many splits.
    Returns out (q's shape and dtype), and with return_lse the merged lse (batch, heads, seqlen_q) float32.

    Every misuse raises ValueError/TypeError naming the argument before anything is read or written: a refused
    call leaves the cache as it was. NumPy arrays run the NumPy model, GPU arrays the kernels (CuPy, torch; the
    result in q's framework). On the GPU, cache_seqlens, page_table and the descale factors may be NumPy (checked
    in full, then copied up) or GPU arrays (not read on the host: a step stays free of synchronization and
    capturable in a CUDA graph; the kernels then turn a sequence whose length or pages fall outside the cache into
    NaN rows, and write no new row past the cache's capacity or onto a page outside it).
    """
    if not isinstance(variant, str) or variant not in VARIANTS:
        raise ValueError(f"variant must be one of {list(VARIANTS)}, got {variant!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    scale = arrays.check_scalars(causal, softmax_scale, return_lse)
    window, softcap = masks.check_window(window), masks.check_softcap(softcap)
    if arrays.torch_op_needed(q, autograd=False):   # torch.compile: one opaque op (there is no backward)
        from .integrations import torch as torch_ops
        return torch_ops.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table, k=k, v=v, causal=causal,
            softmax_scale=softmax_scale, num_splits=num_splits, return_lse=return_lse, k_descale=k_descale,
            v_descale=v_descale, window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    if _on_gpu(q, k_cache, v_cache) or backend == "cuda":
        if backend == "numpy":
            raise ValueError("backend='numpy' runs the NumPy model on NumPy arrays; q, k_cache, v_cache are on the "
                             "GPU")
        if getattr(q, "dtype", None) is not None and str(q.dtype).removeprefix("torch.") not in DTYPES:
            raise TypeError(f"q must be float16 or bfloat16 (the cache: q's dtype or float8_e4m3fn), got {q.dtype}")
        from . import decode_cuda
        head_dim = q.shape[-1] if getattr(q, "ndim", 0) == 4 else 1
        return decode_cuda.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table, k=k, v=v, causal=bool(causal),
            softmax_scale=arrays.default_scale(scale, head_dim), num_splits=model.check_num_splits(num_splits),
            return_lse=bool(return_lse), k_descale=k_descale, v_descale=v_descale, window=window, softcap=softcap,
            alibi_slopes=alibi_slopes, sinks=sinks)
    named = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=None if np.isscalar(cache_seqlens) else
                 cache_seqlens, page_table=page_table, k=k, v=v, k_descale=k_descale, v_descale=v_descale,
                 alibi_slopes=alibi_slopes, sinks=sinks)
    _check_placement("attention_with_kvcache", named, optional=("cache_seqlens", *OPTIONAL))
    if k is not None and type(k_cache).__module__.split(".")[0] in ("jax", "jaxlib"):
        raise TypeError("k_cache is a JAX array, which cannot be written in place: append k, v with JAX's own "
                        ".at[].set(), or pass the cache as NumPy arrays or torch tensors")
    host = _host_views(named)
    hq = host["q"]
    if hq.dtype.name not in DTYPES:
        raise TypeError(f"q must be float16 or bfloat16 (the cache: q's dtype or float8_e4m3fn), got {hq.dtype}")
    arrays.check_layout({n: x for n, x in host.items() if n in STREAMED and x is not None})
    lengths = cache_seqlens if np.isscalar(cache_seqlens) else host["cache_seqlens"]
    res = model.forward(hq, host["k_cache"], host["v_cache"], cache_seqlens=lengths, page_table=host["page_table"],
                        k=host["k"], v=host["v"], causal=causal, softmax_scale=softmax_scale, num_splits=num_splits,
                        k_descale=host["k_descale"], v_descale=host["v_descale"], window=window, softcap=softcap,
                        alibi_slopes=host["alibi_slopes"], sinks=host["sinks"])
    wrap = (lambda a: a) if isinstance(q, np.ndarray) else arrays._host_wrap(q)
    out = wrap(res.out.astype(hq.dtype))
    if not return_lse:
        return out
    with np.errstate(over="ignore"):  # an LSE past float32's range is +inf there, as attention() gives
        return out, wrap(res.lse.astype(np.float32))


# ------------------------------------------------------------------------------------------------ merge_states
class _Layout(NamedTuple):
    out: str               # out's axes
    lse: str               # lse's axes
    lse_axes: tuple        # lse's axes as positions in out's (the last, head_dim, left out)


# Each library's own layout, told apart by the rank of out: one state, and states stacked (on the axis the
# library stacks them on).
ONE_STATE = {
    4: _Layout("(batch, seqlen, heads, head_dim)", "(batch, heads, seqlen)", (0, 2, 1)),   # flash-attn, attention()
    3: _Layout("(tokens, heads, head_dim)", "(tokens, heads)", (0, 1)),                    # FlashInfer's merge_state
}
STACKED = {
    5: _Layout("(states, batch, seqlen, heads, head_dim)", "(states, batch, heads, seqlen)", (0, 1, 3, 2)),
    4: _Layout("(tokens, states, heads, head_dim)", "(tokens, states, heads)", (0, 1, 2)),  # FlashInfer's merge_states
}
STATE_AXIS = {5: 0, 4: 1}


def merge_states(out_a, lse_a, out_b=None, lse_b=None):
    """Merge attention states: attention over key sets A and B (disjoint) from the results over each.

    ``merge_states(out_a, lse_a, out_b, lse_b)`` -> (out, lse), each state in one of two layouts:
        out (batch, seqlen, heads, head_dim), lse (batch, heads, seqlen): flash-attn's, what attention() and
            attention_with_kvcache(return_lse=True) return;
        out (tokens, heads, head_dim), lse (tokens, heads): FlashInfer's merge_state.
    ``merge_states(outs, lses)`` merges n >= 1 states: two lists of states in one of the layouts above, or
    stacked arrays:
        outs (states, batch, seqlen, heads, head_dim), lses (states, batch, heads, seqlen): np.stack of
            attention()'s results (flash-attn's split partials also put the splits first);
        outs (tokens, states, heads, head_dim), lses (tokens, states, heads): FlashInfer's merge_states.
    out has any floating dtype (the result has it), lse float32 or float64 (the result has it). With M the
    largest LSE of a row: LSE = M + log sum_s e^(LSE_s - M) and out = sum_s e^(LSE_s - LSE) out_s. A state with
    LSE = -inf (it saw no key) contributes nothing, whatever its out holds; when every state is empty the result
    is zeros and -inf, never NaN; a NaN LSE gives a NaN row. NumPy arrays run the model (in float64), GPU
    arrays merge_states.cu (float16, bfloat16, float32 or float64 states).
    """
    members = [y for x in (out_a, lse_a) for y in (x if isinstance(x, (list, tuple)) else [x])]
    if _on_gpu(*members, out_b, lse_b):
        host = [x for x in (*members, out_b, lse_b) if isinstance(x, np.ndarray)]
        if host:
            raise ValueError("merge_states: some states on the GPU while the rest are NumPy arrays: pass every "
                             "state on one side (NumPy runs the model, GPU arrays merge_states.cu)")
        from . import decode_cuda
        if out_b is not None:
            return decode_cuda.merge_states([out_a, out_b], [lse_a, lse_b], stacked=False)
        listed = isinstance(out_a, (list, tuple))
        return decode_cuda.merge_states(list(out_a) if listed else out_a, list(lse_a) if listed else lse_a,
                                        stacked=not listed)
    if (out_b is None) != (lse_b is None):
        given, missing = ("out_b", "lse_b") if lse_b is None else ("lse_b", "out_b")
        raise TypeError(f"merge_states takes (out_a, lse_a, out_b, lse_b) or (outs, lses): got {given} without "
                        f"{missing}")
    if out_b is not None:
        return _merge_list([out_a, out_b], [lse_a, lse_b], ["out_a", "out_b"], ["lse_a", "lse_b"])
    outs, lses = out_a, lse_a
    if isinstance(outs, (list, tuple)) or isinstance(lses, (list, tuple)):
        if not (isinstance(outs, (list, tuple)) and isinstance(lses, (list, tuple)) and len(outs) == len(lses)):
            raise ValueError("outs and lses must be two lists of one length (an out and an lse per state), or two "
                             "stacked arrays")
        if not outs:
            raise ValueError("outs and lses are empty: merge_states needs at least one state")
        return _merge_list(list(outs), list(lses), [f"outs[{i}]" for i in range(len(outs))],
                           [f"lses[{i}]" for i in range(len(lses))])
    _check_states(dict(outs=outs), dict(lses=lses))
    if outs.ndim not in STACKED:
        raise ValueError(f"outs must be stacked states {STACKED[5].out} or {STACKED[4].out}, got shape "
                         f"{outs.shape}; for two states: merge_states(out_a, lse_a, out_b, lse_b)")
    return _merge(outs, lses, "lses", STACKED[outs.ndim], STATE_AXIS[outs.ndim],
                  hint="; for two states: merge_states(out_a, lse_a, out_b, lse_b)")


def _check_states(outs: dict, lses: dict) -> None:
    """NumPy arrays, floating outs, float32/float64 lses, one dtype each."""
    _check_placement("merge_states", {**outs, **lses})
    for n, x in outs.items():
        if not is_float_dtype(x.dtype):
            raise TypeError(f"{n} must have a floating-point dtype, got {x.dtype}")
    for n, x in lses.items():
        if x.dtype not in (np.float32, np.float64):
            raise TypeError(f"{n} must be float32 or float64 (a log-sum-exp), got {x.dtype}")
    for named in (outs, lses):
        dtypes = {n: x.dtype.name for n, x in named.items()}
        if len(set(dtypes.values())) != 1:
            raise TypeError(f"the states must share one dtype, got {dtypes}")


def _merge_list(outs: list, lses: list, out_names: list, lse_names: list):
    """States one by one, each in a ONE_STATE layout: checked, then stacked on a new first axis."""
    _check_states(dict(zip(out_names, outs)), dict(zip(lse_names, lses)))
    first = outs[0]
    if first.ndim not in ONE_STATE:
        raise ValueError(f"{out_names[0]} must be {ONE_STATE[4].out} (flash-attn's layout) or {ONE_STATE[3].out} "
                         f"(FlashInfer's), got shape {first.shape}")
    for n, x in zip(out_names[1:], outs[1:]):
        if x.shape != first.shape:
            raise ValueError(f"{n} must have {out_names[0]}'s shape {first.shape}, got {x.shape}")
    layout = ONE_STATE[first.ndim]
    want = tuple(first.shape[i] for i in layout.lse_axes)
    for n, x in zip(lse_names, lses):
        if x.shape != want:
            raise ValueError(f"{n} must have shape {layout.lse} = {want} for out {layout.out}, got {x.shape}")
    stacked = layout._replace(lse_axes=(0, *(i + 1 for i in layout.lse_axes)))
    return _merge(np.stack(outs), np.stack(lses), lse_names[0], stacked, 0)


def _merge(outs, lses, lse_name: str, layout: _Layout, state_axis: int, hint: str = ""):
    """The model's merge on states stacked along ``state_axis`` of outs; lses' axes are ``layout.lse_axes``."""
    want = tuple(outs.shape[i] for i in layout.lse_axes)
    if lses.shape != want:
        raise ValueError(f"{lse_name} must have shape {layout.lse} = {want} for outs {layout.out}, got "
                         f"{lses.shape}{hint}")
    in_out_order = lses.transpose(np.argsort(layout.lse_axes))            # lse's axes in out's order
    out, lse = model.merge(np.moveaxis(outs, state_axis, 0), np.moveaxis(in_out_order, state_axis, 0))
    rest = [a - (a > state_axis) for a in layout.lse_axes if a != state_axis]   # back to lse's layout
    return out.astype(outs.dtype), lse.transpose(rest).astype(lses.dtype)
