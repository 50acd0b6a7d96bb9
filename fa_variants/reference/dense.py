"""Dense float64 attention and its backward (``reference_backward``) from the definition, for checking kernels
(CLI, bench/devcheck.py).

Independent of the kernels and of the blocked models: the whole score row at once, bottom-right causal mask,
head h reads kv head h // (H / Hkv), a row that sees no key gives 0 and lse -inf, a NaN or Inf in q or k gives
NaN in the rows it reaches (the models' rule, reference/common.py). Works on NumPy or CuPy arrays (the result
lives where q does), one (batch, head) pair at a time so large shapes stay affordable. A window, softcap, sinks or
ALiBi (reference/masks.py, applied elementwise to the whole score matrix) take NumPy arrays.
The tests keep their own copy in tests/conftest.py on purpose: a test must not trust the library it checks.
"""
from __future__ import annotations

import numpy as np

from .masks import Mask, check_softcap, check_window


def array_module(a):
    if isinstance(a, np.ndarray):
        return np
    import cupy
    return cupy


def to_float64(x):
    """float16 / bfloat16 / float32 array (NumPy or CuPy) -> float64 of the same library."""
    if x.dtype.name == "bfloat16":
        try:
            return x.astype(np.float64)
        except Exception:  # noqa: BLE001 - an array library without a bf16 cast: widen the bits ourselves
            return (x.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def all_pairs(batch: int, heads: int):
    return [(b, h) for b in range(batch) for h in range(heads)]


def pick_pairs(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, budget: float):
    """All (batch, head) pairs if the float64 reference of all fits ``budget`` FLOPs, else an evenly spaced subset."""
    per_pair = 4.0 * seqlen_q * seqlen_k * head_dim
    total = batch * heads
    n = max(1, min(total, int(budget // per_pair)))
    idx = sorted({int(round(i * (total - 1) / max(n - 1, 1))) for i in range(n)}) if n < total else range(total)
    return [(i // heads, i % heads) for i in idx]


def call_mask(q, k, *, causal: bool, window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None) -> Mask | None:
    """The ``Mask`` of a call with a window, a softcap, sinks or ALiBi (NumPy arrays only); None for a plain call
    (causal or not), which runs on NumPy or CuPy arrays."""
    if check_window(window) == (-1, -1) and check_softcap(softcap) == 0 and sinks is None and alibi_slopes is None:
        return None
    if array_module(q) is not np:
        raise TypeError("window, softcap, sinks and alibi_slopes: the dense reference takes NumPy arrays")
    return Mask.of(q.shape[1], k.shape[1], causal=causal, window=window, softcap=softcap, sinks=sinks,
                   alibi_slopes=alibi_slopes, heads=q.shape[2], batch=q.shape[0])


def attention64(q, k, v, *, causal: bool, scale: float, pairs=None, window=(-1, -1), softcap=0.0, sinks=None,
                alibi_slopes=None):
    """(out, lse) in float64 for the (batch, head) ``pairs`` (default: all): out (P, Nq, d), lse (P, Nq).
    ``window``, ``softcap``, ``sinks`` (heads,), ``alibi_slopes`` (heads,) or (batch, heads): reference/masks.py."""
    xp = array_module(q)
    mask = call_mask(q, k, causal=causal, window=window, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes)
    bsz, nq, h, _ = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    group = h // hkv
    visible = xp.arange(nk)[None, :] <= (xp.arange(nq) + (nk - nq))[:, None]
    outs, lses = [], []
    for b, hi in (all_pairs(bsz, h) if pairs is None else pairs):
        qq = to_float64(q[b, :, hi])
        kk = to_float64(k[b, :, hi // group])
        vv = to_float64(v[b, :, hi // group])
        p, m, l, _ = _exp_scores(xp, qq, kk, scale, visible if causal else None, _pick(mask, b, hi))
        # l == 0 exactly: no visible key (0, -inf). A NaN or +Inf score makes l NaN, which this test (unlike
        # l > 0) lets through: that row is NaN, as the kernels and torch SDPA give.
        empty = l == 0
        outs.append((p @ vv) / xp.where(empty, 1.0, l)[:, None])
        lses.append(xp.where(empty, -xp.inf, xp.log(xp.where(empty, 1.0, l)) + m))
    return xp.stack(outs), xp.stack(lses)


def _pick(mask: Mask | None, b: int, h: int) -> Mask | None:
    return None if mask is None else mask.pick(b, h)


def _exp_scores(xp, qq, kk, scale, visible, mask=None):
    """(exp(S' - m), m, l, S) of one (batch, head): S = q k^T scale, S' its masked scores: -inf where ``visible``
    is False (None: nothing is), or with ``mask`` (a ``Mask.pick``'d one) S transformed and masked whole; m the row
    max (0 for a row with no visible key: exp(-inf - 0) = 0, where -inf - -inf is NaN), l the row sum, the sinks'
    terms included (``Mask.fold_sinks``, which moves m and scales the exponentials with it)."""
    s = (qq @ kk.T) * scale
    t = s
    if mask is not None:
        t = mask.apply(s, slice(0, s.shape[0]), slice(0, s.shape[1]), masked=True)
    elif visible is not None:
        t = xp.where(visible, s, -xp.inf)
    m = t.max(axis=1)
    m = xp.where(m == -xp.inf, 0.0, m)
    p = xp.exp(t - m[:, None])
    l = p.sum(axis=1)
    if mask is not None and mask.sinks is not None:
        m, l, alpha = mask.fold_sinks(m, l)
        p = p * alpha[:, None]
    return p, m, l, s


def reference_backward(dout, q, k, v, *, causal: bool, scale: float, window=(-1, -1), softcap=0.0, sinks=None,
                       alibi_slopes=None):
    """(dq, dk, dv) in float64, flash-attn's layout (dk, dv with k's heads_kv heads), from the definition; with
    ``sinks``, (dq, dk, dv, dsinks), dsinks (heads,) = -sum over rows of P_sink rowsum(P o dP).

    Independent of the backward models: each (batch, head)'s softmax P recomputed whole from q and k (as
    ``attention64``), then dV = P^T dO, dP = dO V^T, dS = P o (dP - rowsum(P o dP)) (the softmax's Jacobian,
    not the models' rowsum(dO o O)), dQ = dS K scale, dK = dS^T Q scale; a GQA group's dk, dv are added in head
    order. A row that sees no key has P = 0 and zero gradients; a NaN or Inf in q or k reaches what its P
    reaches. NumPy or CuPy (the result lives where q does); all pairs, one at a time. A softcap's derivative
    scales dS (``Mask.chain``); masks as ``attention64``.
    """
    xp = array_module(q)
    mask = call_mask(q, k, causal=causal, window=window, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes)
    bsz, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    group = h // hkv
    visible = xp.arange(nk)[None, :] <= (xp.arange(nq) + (nk - nq))[:, None]
    dq = xp.zeros((bsz, nq, h, d))
    dk = xp.zeros((bsz, nk, hkv, d))
    dv = xp.zeros((bsz, nk, hkv, d))
    dsinks = None if sinks is None else np.zeros(h)
    for b, hi in all_pairs(bsz, h):
        qq, kk, vv, do = (to_float64(x) for x in (q[b, :, hi], k[b, :, hi // group], v[b, :, hi // group],
                                                  dout[b, :, hi]))
        pair_mask = _pick(mask, b, hi)
        p, m, l, s = _exp_scores(xp, qq, kk, scale, visible if causal else None, pair_mask)
        p = p / xp.where(l == 0, 1.0, l)[:, None]   # l == 0: no visible key, P = 0 (NaN l passes: NaN row)
        dp = do @ vv.T
        rowsum = (p * dp).sum(axis=1)
        ds = p * (dp - rowsum[:, None])
        if pair_mask is not None:
            ds = pair_mask.chain(ds, s)
        if dsinks is not None:                      # P_sink = e^(sink - m) / l, the sink's share of the row
            with np.errstate(invalid="ignore"):
                dsinks[hi] -= (np.exp(pair_mask.sinks.values - m) / l * rowsum).sum()
        dq[b, :, hi] = (ds @ kk) * scale
        dk[b, :, hi // group] += (ds.T @ qq) * scale
        dv[b, :, hi // group] += p.T @ do
    return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)


def rel_error(out, ref, pairs) -> float:
    """||out - ref|| / ||ref|| over the reference's (batch, head) pairs; ``out`` in (B, Nq, H, d) layout."""
    xp = array_module(ref)
    o = xp.stack([to_float64(out[b, :, h]) for b, h in pairs])
    den = float(xp.linalg.norm(ref))
    return float(xp.linalg.norm(o - ref)) / den if den > 0 else float("nan")
