"""``attention()``: the public entry point. Validates everything, then dispatches to a GPU kernel or a NumPy model."""
from __future__ import annotations

import numpy as np

from . import arrays
from .registry import get

BACKENDS = ("auto", "cuda", "numpy")


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here (no GPU, or the GPU is too old for the variant)."""


def resolve_backend(backend: str, variant, on_gpu: bool) -> str:
    """'cuda' or 'numpy' for this call; never silent about a GPU the variant cannot use."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "numpy":
        return "numpy"
    ok, why = variant.available()
    if backend == "cuda" or on_gpu:
        if not ok:
            raise BackendUnavailable(f"variant {variant.name!r} cannot run on the GPU here: {why}")
        return "cuda"
    return "cuda" if ok else "numpy"  # auto with host arrays: the GPU when usable, else the NumPy model


def attention(q, k, v, *, variant="fa2", causal=False, softmax_scale=None, return_lse=False, backend="auto"):
    """Scaled dot-product attention softmax(q k^T * scale) v in flash-attn's layout.

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim), heads % heads_kv == 0.
    Causal masking is bottom-right aligned; a row that sees no key gives zeros and lse = -inf.
    Returns an array of q's type, shape and dtype (and lse, float32 (batch, heads, seqlen_q), with return_lse).
    """
    entry = get(variant)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    arrays.check_scalars(causal, softmax_scale, return_lse)
    inp = arrays.import_arrays(q, k, v)
    arrays.check_shapes(inp, entry)
    scale = arrays.check_scalars(causal, softmax_scale, return_lse, head_dim=inp.q.shape[3])
    where = resolve_backend(backend, entry, inp.on_gpu)

    if where == "numpy":
        qh, kh, vh = (arrays.to_numpy(a) for a in (inp.q, inp.k, inp.v))
        res = entry.reference(qh, kh, vh, causal=bool(causal), softmax_scale=scale)
        out = res.out.astype(qh.dtype)
        lse = res.lse.astype(np.float32)
        if inp.on_gpu:
            out, lse = arrays.to_cupy(out), arrays.to_cupy(lse)
    else:
        qd, kd, vd = (inp.q, inp.k, inp.v) if inp.on_gpu else (arrays.to_cupy(a) for a in (inp.q, inp.k, inp.v))
        out, lse = entry.launcher.forward(qd, kd, vd, causal=bool(causal), softmax_scale=scale,
                                         return_lse=bool(return_lse))
        if not inp.on_gpu:
            out = arrays.to_numpy(out)
            lse = None if lse is None else arrays.to_numpy(lse)
    out = inp.wrap(out)
    return (out, inp.wrap(lse)) if return_lse else out
