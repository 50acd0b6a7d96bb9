"""Dense float64 attention and its backward (``reference_backward``) from the definition, for checking kernels
(CLI, bench/devcheck.py).

Independent of the kernels and of the blocked models: the whole score row at once, bottom-right causal mask,
head h reads kv head h // (H / Hkv), a row that sees no key gives 0 and lse -inf, a NaN or Inf in q or k gives
NaN in the rows it reaches (the models' rule, reference/common.py). Works on NumPy or CuPy arrays (the result
lives where q does), one (batch, head) pair at a time so large shapes stay affordable.
The tests keep their own copy in tests/conftest.py on purpose: a test must not trust the library it checks.
"""
from __future__ import annotations

import numpy as np


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


def attention64(q, k, v, *, causal: bool, scale: float, pairs=None):
    """(out, lse) in float64 for the (batch, head) ``pairs`` (default: all): out (P, Nq, d), lse (P, Nq)."""
    xp = array_module(q)
    bsz, nq, h, _ = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    group = h // hkv
    visible = xp.arange(nk)[None, :] <= (xp.arange(nq) + (nk - nq))[:, None]
    outs, lses = [], []
    for b, hi in (all_pairs(bsz, h) if pairs is None else pairs):
        qq = to_float64(q[b, :, hi])
        kk = to_float64(k[b, :, hi // group])
        vv = to_float64(v[b, :, hi // group])
        p, m, l = _exp_scores(xp, qq, kk, scale, visible if causal else None)
        # l == 0 exactly: no visible key (0, -inf). A NaN or +Inf score makes l NaN, which this test (unlike
        # l > 0) lets through: that row is NaN, as the kernels and torch SDPA give.
        empty = l == 0
        outs.append((p @ vv) / xp.where(empty, 1.0, l)[:, None])
        lses.append(xp.where(empty, -xp.inf, xp.log(xp.where(empty, 1.0, l)) + m))
    return xp.stack(outs), xp.stack(lses)


def _exp_scores(xp, qq, kk, scale, visible):
    """(exp(S - m), m, l) of one (batch, head): S = q k^T scale, masked where ``visible`` (None: nothing is),
    m the row max (0 for a row with no visible key: exp(-inf - 0) = 0, where -inf - -inf is NaN), l the row sum."""
    s = (qq @ kk.T) * scale
    if visible is not None:
        s = xp.where(visible, s, -xp.inf)
    m = s.max(axis=1)
    m = xp.where(m == -xp.inf, 0.0, m)
    p = xp.exp(s - m[:, None])
    return p, m, p.sum(axis=1)


def reference_backward(dout, q, k, v, *, causal: bool, scale: float):
    """(dq, dk, dv) in float64, flash-attn's layout (dk, dv with k's heads_kv heads), from the definition.

    Independent of the backward models: each (batch, head)'s softmax P recomputed whole from q and k (as
    ``attention64``), then dV = P^T dO, dP = dO V^T, dS = P o (dP - rowsum(P o dP)) (the softmax's Jacobian,
    not the models' rowsum(dO o O)), dQ = dS K scale, dK = dS^T Q scale; a GQA group's dk, dv are added in head
    order. A row that sees no key has P = 0 and zero gradients; a NaN or Inf in q or k reaches what its P
    reaches. NumPy or CuPy (the result lives where q does); all pairs, one at a time.
    """
    xp = array_module(q)
    bsz, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    group = h // hkv
    visible = xp.arange(nk)[None, :] <= (xp.arange(nq) + (nk - nq))[:, None]
    dq = xp.zeros((bsz, nq, h, d))
    dk = xp.zeros((bsz, nk, hkv, d))
    dv = xp.zeros((bsz, nk, hkv, d))
    for b, hi in all_pairs(bsz, h):
        qq, kk, vv, do = (to_float64(x) for x in (q[b, :, hi], k[b, :, hi // group], v[b, :, hi // group],
                                                  dout[b, :, hi]))
        p, _, l = _exp_scores(xp, qq, kk, scale, visible if causal else None)
        p = p / xp.where(l == 0, 1.0, l)[:, None]   # l == 0: no visible key, P = 0 (NaN l passes: NaN row)
        dp = do @ vv.T
        ds = p * (dp - (p * dp).sum(axis=1)[:, None])
        dq[b, :, hi] = (ds @ kk) * scale
        dk[b, :, hi // group] += (ds.T @ qq) * scale
        dv[b, :, hi // group] += p.T @ do
    return dq, dk, dv


def rel_error(out, ref, pairs) -> float:
    """||out - ref|| / ||ref|| over the reference's (batch, head) pairs; ``out`` in (B, Nq, H, d) layout."""
    xp = array_module(ref)
    o = xp.stack([to_float64(out[b, :, h]) for b, h in pairs])
    den = float(xp.linalg.norm(ref))
    return float(xp.linalg.norm(o - ref)) / den if den > 0 else float("nan")
