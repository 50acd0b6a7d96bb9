"""``attention_backward()``: the gradients of ``attention()`` (dq, dk, dv), validated like the forward.

Every misuse is a TypeError/ValueError naming the argument before anything runs. Then the variant and backend
(dispatch.py): ``variant="auto"`` runs the fastest backward for this GPU, dtype and head dim, whichever variant
made ``out`` and ``lse`` (a backward needs only q, k, v, out and lse); a named variant runs its own backward
kernels, and one without them raises BackendUnavailable rather than quietly running a NumPy model. On the GPU the
launcher's backward kernels run (host arrays go to the device and come back); backend="numpy", or "auto" with host
arrays and no usable GPU, runs the NumPy backward model (float64 inside) and casts the gradients to q's, k's and
v's dtypes.

``out`` and ``lse`` must come from a forward with the same ``causal`` and ``softmax_scale``: a handful of rows of
``lse`` are recomputed to check it (lse_check.py), since a mismatch would otherwise give a wrong gradient silently.
"""
from __future__ import annotations

import numpy as np

from . import arrays, dispatch, lse_check, varlen

NAMES = ("dout", "q", "k", "v", "out", "lse")


def attention_backward(dout, q, k, v, out, lse, *, variant: str = "auto", causal: bool = False,
                       softmax_scale: float | None = None, backend: str = "auto", check_lse: bool = True,
                       deterministic: bool | None = None, window=(-1, -1), softcap: float = 0.0, sinks=None,
                       alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                       max_seqlen_k=None):
    """Gradients of ``attention(q, k, v, causal=, softmax_scale=)`` for the output gradient ``dout``.

    ``out`` and ``lse`` are that forward's results (``return_lse=True``), from any variant: dout and out have q's
    shape and dtype (any strides), lse is float32 (batch, heads, seqlen_q). Returns (dq, dk, dv) of q's array
    type, with q's, k's and v's shapes and dtypes (dk and dv have heads_kv heads: a GQA group's gradients summed).
    Inputs are not modified.

    ``check_lse``: recompute a few rows of lse with ``causal`` and ``softmax_scale`` and raise a ValueError when
    they disagree with the given lse beyond what any forward's rounding explains (fp8 forwards included), which
    is what a forward run with other flags gives. It reads those rows' keys once and waits for the device;
    callers that carry the forward's flags themselves (the torch and JAX integrations) pass False.

    ``deterministic``: True asks for the same bits on every run, False allows a sum whose order varies, None (the
    default) takes the variant's default. fa3's backward adds each K/V block's share of dQ in a fixed order by
    default (as fast as adding them as they come on a dense batch; on a packed batch, or a sequence of more K/V
    blocks than the card has SMs, the order costs some speed: docs/kernels/fa3_bwd.md), or as they come with
    False; naive's, fa2's and the NumPy models' are deterministic either way; fa1's adds dQ atomically and refuses
    True on the GPU.

    ``window``, ``softcap``, ``sinks``, ``alibi_slopes``: the forward's masks (then (dq, dk, dv, dsinks) with
    sinks); ``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k``: attention_varlen's packed
    layout (lse (heads, total_q)). As of 2026-12-05 the NumPy models run these (varlen.py).
    """
    if not varlen.is_plain(window, softcap, sinks, alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                           max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k):
        return varlen.attention_backward_masked(
            dout, q, k, v, out, lse, variant=variant, causal=causal, softmax_scale=softmax_scale, backend=backend,
            check_lse=check_lse, deterministic=deterministic, window=window, softcap=softcap, sinks=sinks,
            alibi_slopes=alibi_slopes,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, plain=attention_backward)
    dispatch.check_variant(variant)
    dispatch.check_backend(backend)
    scale = arrays.check_scalars(causal, softmax_scale, False)  # as attention(): the scalars first, the arrays after
    arrays.check_flags(check_lse=check_lse)
    arrays.check_flags(deterministic=deterministic, none=True)
    inp, extra = _import(dout, q, k, v, out, lse)
    arrays.check_dims(inp.q, inp.k, inp.v)
    dtype, d = arrays.common_dtype(inp), inp.q.shape[3]
    arrays.check_layout(dict(q=inp.q, k=inp.k, v=inp.v))
    _check_saved(inp, extra)
    entry, where = dispatch.resolve("backward", variant, dtype, d, inp.on_gpu, backend)
    scale, causal = arrays.default_scale(scale, d), bool(causal)
    if where == "cuda" and deterministic and entry.launcher.backward_order == "varies":
        raise ValueError(f"deterministic=True: {entry.name}'s GPU backward adds dQ atomically, in an order that "
                         f"varies from run to run; variant 'auto', 'fa2' or 'fa3' give the same bits on every run")
    if check_lse:
        lse_check.check(inp.q, inp.k, extra["lse"], causal=causal, softmax_scale=scale)
    if where == "cuda":
        return _on_gpu(entry, inp, extra, causal, scale, deterministic is not False)
    dout_h, q_h, k_h, v_h, out_h, lse_h = (arrays.to_numpy(a) for a in (extra["dout"], inp.q, inp.k, inp.v,
                                                                          extra["out"], extra["lse"]))
    res = entry.reference_backward(dout_h, q_h, k_h, v_h, out_h, lse_h, causal=causal, softmax_scale=scale)
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


def _readable(a):
    """``a`` as the kernels read dout and out: its own memory when its last dimension is contiguous and no stride
    is negative (other strides are honoured, stride 0 included), else a contiguous copy."""
    import cupy
    item = a.dtype.itemsize
    if (a.strides[3] == item or a.shape[3] == 1) and min(a.strides) >= 0:
        return a
    return cupy.ascontiguousarray(a)


def _on_gpu(entry, inp, extra, causal: bool, scale: float, deterministic: bool):
    """The launcher's backward on CuPy copies of host arrays (or the GPU arrays themselves), results wrapped as
    q's type; ``deterministic``: the fixed order where the kernels offer both. A head dim that is not a multiple of 8 runs zero-padded to the next one: zero columns of q and k
    leave S unchanged, zero columns of v, out and dout add nothing to dP or D, and their gradients are cut off."""
    import cupy
    given = dict(dout=extra["dout"], q=inp.q, k=inp.k, v=inp.v, out=extra["out"], lse=extra["lse"])
    dev = {n: (a if inp.on_gpu else arrays.to_cupy(a)) for n, a in given.items()}
    d = inp.q.shape[3]
    with cupy.cuda.Device(dev["q"].device.id):
        dev["dout"], dev["out"] = _readable(dev["dout"]), _readable(dev["out"])
        if d % 8:
            width = (d + 7) // 8 * 8
            for n in NAMES[:5]:
                dev[n] = cupy.pad(dev[n], ((0, 0), (0, 0), (0, 0), (0, width - d)))
        grads = entry.launcher.backward(*(dev[n] for n in NAMES), causal=causal, softmax_scale=scale,
                                        deterministic=deterministic)
        if d % 8:
            grads = tuple(cupy.ascontiguousarray(g[..., :d]) for g in grads)
    if not inp.on_gpu:
        grads = tuple(arrays.to_numpy(g) for g in grads)
    return tuple(inp.wrap(g) for g in grads)
