"""A packed (varlen) batch through a NumPy model, forward and backward.

flash-attn's varlen layout: q (total_q, heads, d), k and v (total_k, heads_kv, d), sequence b's queries the rows
cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1 of q and its keys the rows cu_seqlens_k[b] .. cu_seqlens_k[b+1] - 1 of k
and v (``masks.VarlenBounds``). A varlen kernel's CTA reads its sequence's bounds and works on that sequence
alone, with the sequence's own bottom-right mask; so each sequence here is one call of the model (batch 1), its
blocks cut at its own lengths, and the IO counters add up what the sequences cost: a packed batch costs the sum of
its sequences, not batch x max_seqlen^2. A sequence without queries costs nothing; one without keys has rows that
see no key (out 0, LSE -inf, or the sink's logit). Rows of q past cu_seqlens_q[-1] belong to no sequence: out 0,
LSE -inf, and zero gradients, as are k's and v's rows past cu_seqlens_k[-1].
"""
from __future__ import annotations

import numpy as np

from .common import AccessCounter, BackwardResult, ModelResult, is_float_dtype
from .masks import Mask, VarlenBounds, check_alibi, check_sinks


def check_packed(q, k, v) -> None:
    """q, k, v floating NumPy arrays of the varlen layout (``check_packed_dims``)."""
    for name, a in zip("qkv", (q, k, v)):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array, got {type(a).__name__}")
        if not is_float_dtype(a.dtype):
            raise TypeError(f"{name} must have a floating-point dtype, got {a.dtype}")
    check_packed_dims(q, k, v)


def check_packed_dims(q, k, v) -> None:
    """q (total_q, heads, d), k and v (total_k, heads_kv, d) (any array type), heads % heads_kv == 0; the totals
    may be 0 (every sequence empty)."""
    for name, a in zip("qkv", (q, k, v)):
        if a.ndim != 3:
            raise ValueError(f"{name} must have 3 dimensions (total_{'q' if name == 'q' else 'k'}, heads, head_dim) "
                             f"in the varlen layout, got shape {tuple(a.shape)}")
    q, k, v = (tuple(a.shape) for a in (q, k, v))
    if k != v:
        raise ValueError(f"k and v must have the same shape (total_k, heads_kv, head_dim), got {k} and {v}")
    if q[1] < 1 or q[2] < 1 or k[1] < 1:
        raise ValueError(f"heads and head_dim must be >= 1, got q {q}, k {k}")
    if q[2] != k[2]:
        raise ValueError(f"head_dim differs: q {q[2]}, k and v {k[2]}")
    if q[1] % k[1]:
        raise ValueError(f"heads of q ({q[1]}) must be a multiple of heads of k/v ({k[1]}) for MQA/GQA")


def _merge(into: AccessCounter, part: AccessCounter) -> None:
    for name, n in part.reads.items():
        into.read(name, n)
    for name, n in part.writes.items():
        into.write(name, n)


def _sequence_kw(slopes, b: int, kw: dict) -> dict:
    """The model's keywords for sequence b: its row of (batch, heads) ALiBi slopes."""
    return dict(kw, alibi_slopes=None if slopes is None else slopes[b if slopes.shape[0] > 1 else 0])


def forward(model, q, k, v, cu_seqlens_q, cu_seqlens_k, *, sinks=None, alibi_slopes=None, **kw) -> ModelResult:
    """``model`` (a forward of reference/: naive, fa1, fa2 or fa3) over the packed batch, one sequence at a time.
    ``kw``: the model's other keywords (causal, window, softcap, softmax_scale, blocks...). Returns ``ModelResult``
    with out float64 (total_q, heads, d), lse (heads, total_q) (flash-attn's varlen layout), the counters summed."""
    check_packed(q, k, v)
    bounds = VarlenBounds.of(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    heads = q.shape[1]
    slopes, sink_values = check_alibi(alibi_slopes, heads, bounds.batch), check_sinks(sinks, heads)
    out, lse = np.zeros(q.shape), np.full((heads, q.shape[0]), -np.inf)
    hbm, blocks = AccessCounter(), None
    for b, rows, keys in bounds.sequences():
        n_q, n_k = rows.stop - rows.start, keys.stop - keys.start
        if n_q == 0:
            continue
        if n_k == 0:                                   # no key to see: out stays 0
            lse[:, rows] = Mask.of(n_q, 0, sinks=sink_values, heads=heads).empty_lse((1, heads, n_q))[0]
            continue
        res = model(q[None, rows], k[None, keys], v[None, keys], sinks=sink_values, **_sequence_kw(slopes, b, kw))
        out[rows], lse[:, rows] = res.out[0], res.lse[0]
        _merge(hbm, res.hbm)
        blocks = res.blocks
    return ModelResult(out=out, lse=lse, hbm=hbm, blocks=blocks)


def backward(model, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, sinks=None, alibi_slopes=None,
             **kw) -> BackwardResult:
    """``model`` (a backward of reference/: naive, fa1 or fa2) over the packed batch, one sequence at a time: dout
    and out (total_q, heads, d), lse (heads, total_q). A sequence without queries or without keys has zero
    gradients (no key: P = 0, and O = 0 gives the sinks none either). Returns ``BackwardResult`` with dq (total_q,
    heads, d), dk and dv (total_k, heads_kv, d), dsinks summed over the sequences."""
    check_packed(q, k, v)
    bounds = VarlenBounds.of(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    heads = q.shape[1]
    for name, a in (("dout", dout), ("out", out)):
        if a.shape != q.shape:
            raise ValueError(f"{name} must have q's shape (total_q, heads, head_dim) = {q.shape}, got {a.shape}")
    if lse.shape != (heads, q.shape[0]):
        raise ValueError(f"lse must have shape (heads, total_q) = {(heads, q.shape[0])}, got {lse.shape}")
    slopes, sink_values = check_alibi(alibi_slopes, heads, bounds.batch), check_sinks(sinks, heads)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    dsinks = None if sink_values is None else np.zeros(heads)
    hbm, blocks, flops = AccessCounter(), None, 0
    for b, rows, keys in bounds.sequences():
        if rows.stop == rows.start or keys.stop == keys.start:
            continue
        res = model(dout[None, rows], q[None, rows], k[None, keys], v[None, keys], out[None, rows],
                    lse[None, :, rows], sinks=sink_values, **_sequence_kw(slopes, b, kw))
        dq[rows], dk[keys], dv[keys] = res.dq[0], res.dk[0], res.dv[0]
        if dsinks is not None:
            dsinks += res.dsinks
        _merge(hbm, res.hbm)
        blocks, flops = res.blocks, flops + res.flops
    return BackwardResult(dq=dq, dk=dk, dv=dv, hbm=hbm, blocks=blocks, flops=flops, dsinks=dsinks)
