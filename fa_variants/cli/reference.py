"""The float64 reference that ``compare`` measures errors against: how much of it to compute (a subset of
(batch, head) pairs when the whole would cost too much), the reference gradients, and the errors over that
subset."""
from __future__ import annotations

import math

from ..reference.dense import array_module, pick_pairs, reference_backward, to_float64
from ..timing.shapes import FLOPS_FACTOR, Shape
from .text import fmt

REF_FLOP_BUDGET_GPU = 2e12      # float64 FLOPs spent on the reference before falling back to a subset of heads
REF_FLOP_BUDGET_CPU = 2e10


def subset_note(pairs, shape: Shape) -> str:
    """'' when the reference covers every (batch, head) pair, else the words that say it does not."""
    total = shape.batch * shape.heads
    if len(pairs) == total:
        return ""
    return (f"; computed on {len(pairs)} of the {total} (batch, head) pairs, evenly spaced "
            f"(the full float64 reference would cost too much)")


def kv_pairs(shape: Shape, budget: float):
    """(batch, kv head) pairs for the float64 reference backward, all of them if they fit ``budget`` FLOPs, else an
    evenly spaced subset. A pair covers its group's query heads (a kv head's dk, dv sum over all of them), each
    costing about 2.5x the forward's 4 Nq Nk d."""
    group = shape.heads // shape.hkv
    per_pair_dim = math.ceil(FLOPS_FACTOR["bwd"] * group * shape.head_dim)  # pick_pairs: 4 Nq Nk x this
    return pick_pairs(shape.batch, shape.hkv, shape.seqlen_q, shape.nk, per_pair_dim, budget)


def kv_subset_note(pairs, shape: Shape) -> str:
    total = shape.batch * shape.hkv
    if len(pairs) == total:
        return ""
    return (f"; computed on {len(pairs)} of the {total} (batch, kv head) pairs, evenly spaced, each with all "
            f"its query heads (the full float64 reference would cost too much)")


def reference_grads(dout, q, k, v, *, causal: bool, scale: float, kv_pairs, group: int) -> dict:
    """{"dq": [...], "dk": [...], "dv": [...]}: float64 ``reference_backward`` per (batch, kv head) pair, dq of the
    group's query heads (N_q, G, d), dk and dv of the kv head (N_k, 1, d); NumPy or CuPy, where q lives."""
    refs = {"dq": [], "dk": [], "dv": []}
    for b, g in kv_pairs:
        hs = slice(g * group, (g + 1) * group)
        dq, dk, dv = reference_backward(dout[b:b + 1, :, hs], q[b:b + 1, :, hs], k[b:b + 1, :, g:g + 1],
                                        v[b:b + 1, :, g:g + 1], causal=causal, scale=scale)
        refs["dq"].append(dq[0])
        refs["dk"].append(dk[0])
        refs["dv"].append(dv[0])
    return refs


def grad_errors(grads, refs: dict, kv_pairs, group: int) -> tuple[float, float, float]:
    """(dq, dk, dv) relative errors ||g - ref|| / ||ref|| over the reference's (batch, kv head) pairs; ``grads`` in
    flash-attn's layout, any dtype, NumPy or CuPy like ``refs``."""
    errs = []
    for name, g in zip(("dq", "dk", "dv"), grads):
        num = den = 0.0
        for (b, h), ref in zip(kv_pairs, refs[name]):
            part = g[b, :, h * group:(h + 1) * group] if name == "dq" else g[b, :, h:h + 1]
            xp = array_module(ref)
            num += float(xp.sum((to_float64(part) - ref) ** 2))
            den += float(xp.sum(ref * ref))
        errs.append(math.sqrt(num / den) if den > 0 else float("nan"))
    return tuple(errs)


def errs_text(errs) -> list[str]:
    return [fmt(e, ".1e", "nan") for e in errs]
