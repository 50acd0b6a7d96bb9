"""``attention_backward()``: the gradients of ``attention()`` (dq, dk, dv), validated like the forward.

Every misuse is a TypeError/ValueError naming the argument before anything runs. Then the backend, by the
forward's rule (api.resolve_backend): the GPU for backend="cuda", for GPU arrays, and for "auto" with host arrays
where the variant runs on this GPU. There the variant's launcher runs its backward kernels (host arrays go to the
device and come back); a variant whose registry entry has no "backward" direction raises BackendUnavailable
rather than quietly running the NumPy model on a copy. backend="numpy", or "auto" with host arrays and no usable
GPU, runs the variant's NumPy backward model (float64 inside) and casts the gradients to q's, k's and v's dtypes.
"""
from __future__ import annotations

import numpy as np

from . import arrays
from .api import BACKENDS, BackendUnavailable, resolve_backend
from .registry import get

NAMES = ("dout", "q", "k", "v", "out", "lse")


def attention_backward(dout, q, k, v, out, lse, *, variant: str = "fa2", causal: bool = False,
                       softmax_scale: float | None = None, backend: str = "auto"):
    """Gradients of ``attention(q, k, v, variant=, causal=, softmax_scale=)`` for the output gradient ``dout``.

    ``out`` and ``lse`` are that forward's results (``return_lse=True``): dout and out have q's shape and dtype,
    lse is float32 (batch, heads, seqlen_q). Returns (dq, dk, dv) of q's array type, with q's, k's and v's
    shapes and dtypes (dk and dv have heads_kv heads: a GQA group's gradients summed). Inputs are not modified.
    """
    entry = get(variant)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    arrays.check_scalars(causal, softmax_scale, False)  # as attention(): the scalars first, the arrays after
    inp, extra = _import(dout, q, k, v, out, lse)
    arrays.check_shapes(inp, entry)
    _check_saved(inp, extra)
    scale = arrays.check_scalars(causal, softmax_scale, False, head_dim=inp.q.shape[3])
    if _resolve(backend, entry, inp.on_gpu) == "cuda":
        return _on_gpu(entry, inp, extra, bool(causal), scale)

    model = entry.reference_backward
    if model is None:
        raise BackendUnavailable(f"variant {entry.name!r} has no NumPy backward model (and no GPU backward kernel)")
    dout_h, q_h, k_h, v_h, out_h, lse_h = (arrays.to_numpy(a) for a in (extra["dout"], inp.q, inp.k, inp.v,
                                                                          extra["out"], extra["lse"]))
    res = model(dout_h, q_h, k_h, v_h, out_h, lse_h, causal=bool(causal), softmax_scale=scale)
    with np.errstate(over="ignore"):  # a gradient past float16's range is inf there, as a kernel would store it
        grads = [res.dq.astype(q_h.dtype), res.dk.astype(k_h.dtype), res.dv.astype(v_h.dtype)]
    if inp.on_gpu:
        grads = [arrays.to_cupy(g) for g in grads]
    return tuple(inp.wrap(g) for g in grads)


def _import(dout, q, k, v, out, lse):
    """(Inputs of q, k, v; {dout, out, lse} as arrays of the same library). Where each array lives is compared
    before any is imported, as the forward does, so a host/GPU mix is reported as such and nothing is copied."""
    given = dict(zip(NAMES, (dout, q, k, v, out, lse)))
    claims = {n: arrays._claims_gpu(x) for n, x in given.items()}
    if None not in claims.values() and len(set(claims.values())) != 1:
        where = ", ".join(f"{n} on {'GPU' if g else 'host'}" for n, g in claims.items())
        raise ValueError(f"dout, q, k, v, out and lse must be on the same device, got {where}")
    inp = arrays.import_arrays(q, k, v)
    extra = {}
    for n in ("dout", "out", "lse"):
        a, on_gpu, _ = arrays._import_one(n, given[n])
        if on_gpu != inp.on_gpu:
            raise ValueError(f"{n} must be on q's device, got {n} on {'GPU' if on_gpu else 'host'} and q on "
                             f"{'GPU' if inp.on_gpu else 'host'}")
        if on_gpu and a.device.id != inp.q.device.id:
            raise ValueError(f"{n} must be on q's device, got device {a.device.id} and q on {inp.q.device.id}")
        extra[n] = a
    return inp, extra


def _check_saved(inp, extra) -> None:
    """dout and out: q's shape and dtype; lse: float32 (batch, heads, seqlen_q), as the forward returns it."""
    q = inp.q
    qdt = arrays.dtype_name(q.dtype)
    for n in ("dout", "out"):
        a = extra[n]
        if tuple(a.shape) != tuple(q.shape):
            raise ValueError(f"{n} must have q's shape {tuple(q.shape)}, got {tuple(a.shape)}")
        if arrays.dtype_name(a.dtype) != qdt:
            raise TypeError(f"{n} must have q's dtype {qdt}, got {arrays.dtype_name(a.dtype)}")
    lse = extra["lse"]
    want = (q.shape[0], q.shape[2], q.shape[1])
    if tuple(lse.shape) != want:
        raise ValueError(f"lse must have shape (batch, heads, seqlen_q) = {want}, got {tuple(lse.shape)}")
    if arrays.dtype_name(lse.dtype) != "float32":
        raise TypeError(f"lse must be float32 (as attention(return_lse=True) returns it), got "
                        f"{arrays.dtype_name(lse.dtype)}")


def _resolve(backend: str, entry, on_gpu: bool) -> str:
    """'cuda' or 'numpy', by the forward's rule; a GPU call of a variant without GPU backward kernels raises
    (a silent NumPy fallback there would hide that)."""
    if backend == "numpy":
        return "numpy"
    if backend == "cuda" or on_gpu or entry.available()[0]:
        if "backward" not in entry.directions:
            raise BackendUnavailable(f"variant {entry.name!r} has no GPU backward kernel yet; backend='numpy' "
                                     f"runs its NumPy model")
        where = resolve_backend(backend, entry, on_gpu)
        if where == "cuda":
            return where
    return "numpy"


def _on_gpu(entry, inp, extra, causal: bool, scale: float):
    """The launcher's backward on CuPy copies of host arrays (or the GPU arrays themselves), results wrapped as
    q's type. A head dim that is not a multiple of 8 runs zero-padded to the next one: zero columns of q and k
    leave S unchanged, zero columns of v, out and dout add nothing to dP or D, and their gradients are cut off."""
    import cupy
    names = ("dout", "q", "k", "v", "out", "lse")
    given = dict(dout=extra["dout"], q=inp.q, k=inp.k, v=inp.v, out=extra["out"], lse=extra["lse"])
    dev = {n: (a if inp.on_gpu else arrays.to_cupy(a)) for n, a in given.items()}
    d = inp.q.shape[3]
    with cupy.cuda.Device(dev["q"].device.id):
        if d % 8:
            width = (d + 7) // 8 * 8
            for n in names[:5]:
                dev[n] = cupy.pad(dev[n], ((0, 0), (0, 0), (0, 0), (0, width - d)))
        grads = entry.launcher.backward(*(dev[n] for n in names), causal=causal, softmax_scale=scale)
        if d % 8:
            grads = tuple(cupy.ascontiguousarray(g[..., :d]) for g in grads)
    if not inp.on_gpu:
        grads = tuple(arrays.to_numpy(g) for g in grads)
    return tuple(inp.wrap(g) for g in grads)
