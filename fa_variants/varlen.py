"""``attention_varlen`` and the mask keywords of ``attention()`` and ``attention_backward()``.

The keywords (reference/masks.py has the conventions, docs/masks.md their sources):
    window=(left, right)   key j is seen by query i when i + diag - left <= j <= i + diag + right, diag =
                           seqlen_k - seqlen_q, -1 unbounded (flash-attn's)
    softcap                scores become softcap tanh(s / softcap) before the softmax (0: none)
    sinks                  (heads,) one logit per head in every row's denominator, without a value (gpt-oss)
    alibi_slopes           (heads,) or (batch, heads) float32: bias -slope |i + diag - j|
    cu_seqlens_q/_k        flash-attn's packed (varlen) layout, int32 cumulative lengths, max_seqlen_q/_k ints

Every argument is checked (a TypeError or ValueError naming it) before anything runs; inputs are never modified.
Then the NumPy models run these calls (NumPy arrays, or backend="numpy" on copies of GPU arrays), and on the GPU
the masked kernels: fa3's on sm_90a (kernels/fa3_masked.py; variant "auto" or "fa3"; its backward runs fa2's passes
for head dims above 128) and fa2's elsewhere or by name (kernels/fa2_masked.py, mma.sync on every sm_80+ GPU); a
backward needs only q, k, v, out and lse; the other variants' kernels take no masks and are refused by name. A
window that hides nothing a plain call would not (a side at least the sequence long, or (-1, 0), which is causal)
runs as that plain call, on the GPU too.
"""
from __future__ import annotations

import inspect

import numpy as np

from . import arrays, dispatch, lse_check
from .reference import dense, masks
from .reference import varlen as model_varlen
from .tolerances import LSE_ATOL, LSE_RTOL

SINK_DTYPES = ("float16", "bfloat16", "float32", "float64")
ALIBI_DTYPES = ("float32",)                       # flash-attn's: the slopes are fp32
CU_SEQLENS_DTYPES = ("int32",)
GPU_MASKED_VARIANTS = ("auto", "fa2", "fa3")      # whose GPU forward takes masks and packed batches


# ------------------------------------------------------------------------------------------------ shared checks
def is_plain(window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None, *, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=None, max_seqlen_k=None) -> bool:
    """Whether a call passes every mask keyword at its default (attention()'s own path). Cheap, checks nothing:
    anything else, the defaults spelled otherwise included, goes through this module, which checks it."""
    return (sinks is None and alibi_slopes is None and cu_seqlens_q is None and cu_seqlens_k is None
            and max_seqlen_q is None and max_seqlen_k is None
            and type(window) is tuple and len(window) == 2 and type(window[0]) is type(window[1]) is int
            and window == (-1, -1)
            and type(softcap) in (float, int) and softcap == 0)


def _check_scalars(variant, backend, causal, softmax_scale, return_lse, window, softcap):
    """The scalar arguments, before any array: (backend, scale or None, window, softcap)."""
    dispatch.check_variant(variant)
    dispatch.check_backend(backend)
    scale = arrays.check_scalars(causal, softmax_scale, return_lse)
    return backend, scale, masks.check_window(window), masks.check_softcap(softcap)


def _side_array(name: str, x, inp, dtypes, required=False):
    """An auxiliary array (sinks, alibi_slopes, cu_seqlens): None, or a host NumPy copy of it, which must live
    where q does and have one of ``dtypes``."""
    a = _side_import(name, x, inp, dtypes, required)
    return None if a is None else np.array(arrays.to_numpy(a))   # a copy: the models never see the caller's memory


def _side_import(name: str, x, inp, dtypes, required=False):
    """``x`` imported as an array of q's library (not copied), checked to live where q does and to have one of
    ``dtypes``; None for None unless ``required``."""
    if x is None:
        if required:
            raise TypeError(f"{name} is required")
        return None
    a, on_gpu, _ = arrays._import_one(name, x)
    if on_gpu != inp.on_gpu:
        raise ValueError(f"{name} must be on q's device, got {name} on {'GPU' if on_gpu else 'host'} and q on "
                         f"{'GPU' if inp.on_gpu else 'host'}")
    if on_gpu and a.device.id != inp.q.device.id:
        raise ValueError(f"{name} must be on q's device, got device {a.device.id} and q on {inp.q.device.id}")
    if arrays.dtype_name(a.dtype) not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(dtypes)}, got {arrays.dtype_name(a.dtype)}")
    return a


def _as_plain(q, k, causal, window, softcap, sinks, alibi_slopes):
    """The ``causal`` of a plain call that computes what this masked one does (a window that hides no more than a
    plain call, and no transform), or None."""
    if softcap != 0 or sinks is not None or alibi_slopes is not None:
        return None
    return masks.window_as_causal(q.shape[1], k.shape[1], causal, window)


def _runs_on_gpu(inp, backend: str) -> bool:
    """backend="cuda", or GPU arrays with "auto"; host arrays with "auto" run the model even where a GPU is usable."""
    return backend == "cuda" or (inp.on_gpu and backend == "auto")


def _model(direction: str, variant: str, dtype: str, head_dim: int):
    """The registry entry whose NumPy model runs a masked call; a variant whose model takes no masks (the fp8
    ones) is refused by name."""
    entry, _ = dispatch.resolve(direction, variant, dtype, head_dim, False, "numpy")
    fn = entry.reference if direction == "forward" else entry.reference_backward
    if "window" not in inspect.signature(fn).parameters:
        raise NotImplementedError(f"variant {entry.name!r}: its NumPy model takes no window, softcap, sinks, ALiBi "
                                  f"or varlen; naive, fa1, fa2 and fa3's do (variant='auto' runs fa2's)")
    return entry


def _back(inp, host_arrays, dtypes):
    """Model results (float64 NumPy) cast to ``dtypes`` and handed back as q's array type (on its device)."""
    with np.errstate(over="ignore"):   # past float16's range: inf, as a kernel would store it
        cast = [a.astype(dt) for a, dt in zip(host_arrays, dtypes)]
    if inp.on_gpu:
        cast = [arrays.to_cupy(a) for a in cast]
    return [inp.wrap(a) for a in cast]


# ------------------------------------------------------------------------------------------------ forward
def attention_masked(q, k, v, *, variant, causal, softmax_scale, return_lse, backend, window, softcap, sinks,
                     alibi_slopes, plain):
    """``attention()`` with mask keywords (api.attention calls it; ``plain`` is api.attention itself, which runs a
    window that reduces to a plain call)."""
    backend, scale, window, softcap = _check_scalars(variant, backend, causal, softmax_scale, return_lse, window,
                                                     softcap)
    if arrays.torch_op_needed(q, k, v, sinks):
        # Torch tensors that require grad (sinks too), or under Dynamo: the dense batch as a packed one through the
        # varlen torch ops (integrations/torch.py), whose body checks the rest
        arrays.check_dims(q, k, v)
        reduced = _as_plain(q, k, causal, window, softcap, sinks, alibi_slopes)
        if reduced is not None:
            return plain(q, k, v, variant=variant, causal=reduced, softmax_scale=softmax_scale,
                         return_lse=return_lse, backend=backend)
        from .integrations import torch as torch_ops
        return torch_ops.attention_masked(q, k, v, causal=causal, window=window, softcap=softcap, sinks=sinks,
                                          alibi_slopes=alibi_slopes, softmax_scale=scale, return_lse=return_lse,
                                          variant=variant, backend=backend)
    inp = arrays.import_arrays(q, k, v)
    arrays.check_dims(inp.q, inp.k, inp.v)
    dtype = arrays.common_dtype(inp)
    arrays.check_layout(dict(q=inp.q, k=inp.k, v=inp.v))
    batch, _, heads, d = inp.q.shape
    sinks_h = _side_array("sinks", sinks, inp, SINK_DTYPES)
    slopes_h = _side_array("alibi_slopes", alibi_slopes, inp, ALIBI_DTYPES)
    masks.check_sinks(sinks_h, heads)
    masks.check_alibi(slopes_h, heads, batch)
    reduced = _as_plain(inp.q, inp.k, causal, window, softcap, sinks, alibi_slopes)
    if reduced is not None:
        return plain(q, k, v, variant=variant, causal=reduced, softmax_scale=softmax_scale, return_lse=return_lse,
                     backend=backend)
    if _runs_on_gpu(inp, backend):
        return _on_gpu(inp, causal, arrays.default_scale(scale, d), return_lse,
                       _gpu_masks(variant, dtype, d, inp, window, softcap, sinks_h, alibi_slopes), variant=variant)
    entry = _model("forward", variant, dtype, d)
    qh, kh, vh = (arrays.to_numpy(a) for a in (inp.q, inp.k, inp.v))
    res = entry.reference(qh, kh, vh, causal=bool(causal), softmax_scale=arrays.default_scale(scale, d),
                          window=window, softcap=softcap, sinks=sinks_h, alibi_slopes=slopes_h)
    out, lse = _back(inp, (res.out, res.lse), (qh.dtype, np.float32))
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None, softmax_scale=None,
                     return_lse=False, variant="auto", backend=None):
    """Attention over a packed batch of sequences of different lengths (flash-attn's varlen layout).

    q: (total_q, heads, head_dim); k, v: (total_k, heads_kv, head_dim), heads % heads_kv == 0. Sequence b's
    queries are q[cu_seqlens_q[b]:cu_seqlens_q[b+1]], its keys and values k, v[cu_seqlens_k[b]:cu_seqlens_k[b+1]]:
    int32 arrays of batch + 1 cumulative lengths from 0, non-decreasing (sequences of length 0 allowed), on q's
    device; max_seqlen_q, max_seqlen_k at least the longest lengths. Each sequence is attended on its own, causal
    bottom-right per sequence, with ``window``, ``softcap``, ``sinks`` (heads,) and ``alibi_slopes`` (heads,) or
    (batch, heads) float32 as ``attention()`` takes them. Returns out of q's type, shape and dtype (and lse, float32
    (heads, total_q), with return_lse); rows that see no key, or lie past cu_seqlens_q[-1], give 0 and lse -inf
    (with sinks, a row of a sequence without keys has lse = its sink).

    The NumPy models run it on host arrays (``variant``: "auto" is fa2's; naive, fa1, fa2, fa3 by name); GPU arrays
    run a masked kernel (variant "auto": fa3's forward on sm_90a, fa2's elsewhere; "fa2" or "fa3" by name; the
    backward fa2's); backend="numpy" runs the model on host copies. ``backend``
    None means "auto". The lengths are checked on the host: a GPU call copies cu_seqlens there first (a sync).
    Torch tensors that require grad (q, k, v, sinks) are recorded for autograd, and under torch.compile the call
    is one opaque op (integrations/torch.py).
    """
    backend, scale, window, softcap = _check_scalars(variant, "auto" if backend is None else backend, causal,
                                                     softmax_scale, return_lse, window, softcap)
    if arrays.torch_op_needed(q, k, v, sinks):
        # Torch tensors that require grad (sinks too), or under Dynamo: the torch ops, whose body is this call on
        # detached tensors (every array check runs there, before anything is computed).
        from .integrations import torch as torch_ops
        return torch_ops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          causal=causal, window=window, softcap=softcap, sinks=sinks,
                                          alibi_slopes=alibi_slopes, softmax_scale=scale, return_lse=return_lse,
                                          variant=variant, backend=backend)
    inp = arrays.import_arrays(q, k, v)
    model_varlen.check_packed_dims(inp.q, inp.k, inp.v)
    dtype = arrays.common_dtype(inp)
    arrays.check_layout({n: a for n, a in dict(q=inp.q, k=inp.k, v=inp.v).items() if a.size})  # (empty: no strides)
    bounds, sinks_h, slopes_h = _varlen_sides(inp, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks,
                                              alibi_slopes)
    d = inp.q.shape[2]
    if _runs_on_gpu(inp, backend):
        on_gpu = _gpu_masks(variant, dtype, d, inp, window, softcap, sinks_h, alibi_slopes,
                            cu=(cu_seqlens_q, cu_seqlens_k), bounds=bounds)
        return _on_gpu(inp, causal, arrays.default_scale(scale, d), return_lse, on_gpu, variant=variant)
    entry = _model("forward", variant, dtype, d)
    qh, kh, vh = (arrays.to_numpy(a) for a in (inp.q, inp.k, inp.v))
    res = model_varlen.forward(entry.reference, qh, kh, vh, bounds.cu_q.astype(np.int32),
                               bounds.cu_k.astype(np.int32), causal=bool(causal),
                               softmax_scale=arrays.default_scale(scale, d), window=window, softcap=softcap,
                               sinks=sinks_h, alibi_slopes=slopes_h)
    out, lse = _back(inp, (res.out, res.lse), (qh.dtype, np.float32))
    return (out, lse) if return_lse else out


def _gpu_masks(variant, dtype, d, inp, window, softcap, sinks_h, alibi_slopes, cu=(None, None), bounds=None):
    """The masked kernel's arguments (kernels/masked.Masks) for a checked call on the GPU: a variant whose
    kernel takes them (GPU_MASKED_VARIANTS), fa2's dtypes and head dims, the side arrays on q's device. The sinks
    come as their checked host copy (``sinks_h``) and go up as float32, the kernels' type: a bfloat16 GPU array
    (gpt-oss's sinks are the model's dtype) is then converted where ml_dtypes reads it, not by the GPU library's
    cast."""
    if variant not in GPU_MASKED_VARIANTS:
        raise NotImplementedError(f"variant {variant!r}: its GPU kernel takes no window, softcap, sinks, ALiBi or "
                                  f"varlen yet; variant='auto', 'fa2' or 'fa3' runs a masked kernel")
    from . import registry
    from .kernels.masked import Masks
    entry = registry.get("fa3" if variant == "fa3" else "fa2")
    arrays.check_supported(entry, dtype, d)
    dispatch.resolve_backend("cuda", entry, True)
    side = {n: None if x is None else _side_import(n, x, inp, dt)
            for n, x, dt in (("alibi_slopes", alibi_slopes, ALIBI_DTYPES),
                             ("cu_seqlens_q", cu[0], CU_SEQLENS_DTYPES), ("cu_seqlens_k", cu[1], CU_SEQLENS_DTYPES))}
    if sinks_h is not None:
        import cupy
        with cupy.cuda.Device(inp.q.device.id):
            side["sinks"] = cupy.asarray(np.asarray(sinks_h, dtype=np.float32))
    else:
        side["sinks"] = None
    lengths = {} if bounds is None else dict(
        max_seqlen_q=int(bounds.seqlens_q.max(initial=0)), max_seqlen_k=int(bounds.seqlens_k.max(initial=0)),
        total_q=int(bounds.cu_q[-1]), total_k=int(bounds.cu_k[-1]))
    return Masks(window=window, softcap=softcap, **lengths, **side)


def masked_forward_kernel(variant: str):
    """The module of the masked forward (and backward) a GPU call of ``variant`` runs (its checks passed): fa3's
    where it runs (sm_90a; variant "auto" or "fa3"), else fa2's. (fa3's backward runs fa2's passes where its own
    does not apply: kernels/fa3_masked.py.)"""
    from . import choice, gpu
    from .kernels import fa2_masked, fa3_masked
    name = choice.masked_forward(gpu.compute_capability()) if variant == "auto" else variant
    return fa3_masked if name == "fa3" else fa2_masked


def _on_gpu(inp, causal, scale: float, return_lse: bool, kernel_masks, saved=None, sinks_dtype=None,
            variant="auto", deterministic=None):
    """The masked kernels on the checked arrays (host arrays with backend="cuda": on device copies, the results
    copied back), as q's array type: the forward's (out, lse) by ``variant``'s kernel (masked_forward_kernel), or
    with ``saved`` (the backward's dout, out, lse) its gradients (dq, dk, dv, and dsinks in ``sinks_dtype`` where
    sinks are given), dQ's shares in a fixed order unless ``deterministic`` is False."""
    import dataclasses

    import cupy
    from .kernels import masked
    with cupy.cuda.Device(inp.q.device.id if inp.on_gpu else None):
        q, k, v = (arrays.to_cupy(a) for a in (inp.q, inp.k, inp.v))
        if not inp.on_gpu:
            kernel_masks = dataclasses.replace(kernel_masks, **{
                f: arrays.to_cupy(getattr(kernel_masks, f)) for f in masked.SIDE_ARRAYS
                if getattr(kernel_masks, f) is not None})
        if saved is None:
            results = masked_forward_kernel(variant).forward(q, k, v, causal=bool(causal), softmax_scale=scale,
                                                             return_lse=return_lse, masks=kernel_masks)
            results = results if return_lse else results[:1]
        else:
            dout, out, lse = (arrays.to_cupy(saved[n]) for n in ("dout", "out", "lse"))
            *results, dsinks = masked_forward_kernel(variant).backward(
                dout, q, k, v, out, lse, causal=bool(causal), softmax_scale=scale, masks=kernel_masks,
                deterministic=deterministic is not False)
            if dsinks is not None:
                results.append(dsinks.astype(sinks_dtype))
    back = (lambda a: a) if inp.on_gpu else arrays.to_numpy
    results = [inp.wrap(back(a)) for a in results]
    return tuple(results) if len(results) > 1 else results[0]


def _varlen_sides(inp, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, alibi_slopes):
    """(VarlenBounds, sinks, slopes) of a packed call, every one checked, host NumPy copies."""
    cu_q = _side_array("cu_seqlens_q", cu_seqlens_q, inp, CU_SEQLENS_DTYPES, required=True)
    cu_k = _side_array("cu_seqlens_k", cu_seqlens_k, inp, CU_SEQLENS_DTYPES, required=True)
    bounds = masks.VarlenBounds.of(cu_q, cu_k, inp.q.shape[0], inp.k.shape[0])
    bounds.check_max(max_seqlen_q, max_seqlen_k)
    sinks_h = _side_array("sinks", sinks, inp, SINK_DTYPES)
    slopes_h = _side_array("alibi_slopes", alibi_slopes, inp, ALIBI_DTYPES)
    masks.check_sinks(sinks_h, inp.q.shape[1])
    masks.check_alibi(slopes_h, inp.q.shape[1], bounds.batch)
    return bounds, sinks_h, slopes_h


# ------------------------------------------------------------------------------------------------ backward
def attention_backward_masked(dout, q, k, v, out, lse, *, variant, causal, softmax_scale, backend, check_lse,
                              deterministic, window, softcap, sinks, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q, max_seqlen_k, plain):
    """``attention_backward()`` with mask keywords or the varlen layout (``plain``: attention_backward itself, for
    a window that reduces to a plain call). Returns (dq, dk, dv), and dsinks (heads,) in sinks' dtype where sinks
    are given. The masked kernels and the models sum in a fixed order, unless ``deterministic`` is False, which lets
    fa3's masked backward add dQ's shares as they come (fa2's and the models stay deterministic)."""
    backend, scale, window, softcap = _check_scalars(variant, backend, causal, softmax_scale, False, window, softcap)
    arrays.check_flags(check_lse=check_lse)
    arrays.check_flags(deterministic=deterministic, none=True)
    packed = not (cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q is None and max_seqlen_k is None)
    inp = arrays.import_arrays(q, k, v)
    saved = {n: _side_import(n, x, inp, (arrays.dtype_name(inp.q.dtype),) if n != "lse" else ("float32",),
                             required=True) for n, x in (("dout", dout), ("out", out), ("lse", lse))}
    if packed:
        model_varlen.check_packed_dims(inp.q, inp.k, inp.v)
    else:
        arrays.check_dims(inp.q, inp.k, inp.v)
    dtype = arrays.common_dtype(inp)
    arrays.check_layout({n: a for n, a in dict(q=inp.q, k=inp.k, v=inp.v).items() if a.size})
    heads, d = inp.q.shape[-2], inp.q.shape[-1]
    lse_shape = (heads, inp.q.shape[0]) if packed else (inp.q.shape[0], heads, inp.q.shape[1])
    _check_saved(saved, tuple(inp.q.shape), lse_shape, "(heads, total_q)" if packed else "(batch, heads, seqlen_q)")
    if packed:
        bounds, sinks_h, slopes_h = _varlen_sides(inp, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  sinks, alibi_slopes)
    else:
        bounds = None
        sinks_h = _side_array("sinks", sinks, inp, SINK_DTYPES)
        slopes_h = _side_array("alibi_slopes", alibi_slopes, inp, ALIBI_DTYPES)
        masks.check_sinks(sinks_h, heads)
        masks.check_alibi(slopes_h, heads, inp.q.shape[0])
        reduced = _as_plain(inp.q, inp.k, causal, window, softcap, sinks, alibi_slopes)
        if reduced is not None:
            return plain(dout, q, k, v, out, lse, variant=variant, causal=reduced, softmax_scale=softmax_scale,
                         backend=backend, check_lse=check_lse, deterministic=deterministic)
    if _runs_on_gpu(inp, backend):
        kernel_masks = _gpu_masks(variant, dtype, d, inp, window, softcap, sinks_h, alibi_slopes,
                                  cu=(cu_seqlens_q, cu_seqlens_k) if packed else (None, None), bounds=bounds)
        return _on_gpu(inp, causal, arrays.default_scale(scale, d), False, kernel_masks, saved=saved,
                       sinks_dtype=None if sinks_h is None else sinks_h.dtype, variant=variant,
                       deterministic=deterministic)
    entry = _model("backward", variant, dtype, d)
    qh, kh, vh = (arrays.to_numpy(a) for a in (inp.q, inp.k, inp.v))
    saved = {n: arrays.to_numpy(a) for n, a in saved.items()}
    kw = dict(causal=bool(causal), softmax_scale=arrays.default_scale(scale, d), window=window, softcap=softcap,
              sinks=sinks_h, alibi_slopes=slopes_h)
    if check_lse:
        _check_lse(qh, kh, saved["lse"], bounds, kw)
    if packed:
        res = model_varlen.backward(entry.reference_backward, saved["dout"], qh, kh, vh, saved["out"], saved["lse"],
                                    bounds.cu_q.astype(np.int32), bounds.cu_k.astype(np.int32), **kw)
    else:
        res = entry.reference_backward(saved["dout"], qh, kh, vh, saved["out"], saved["lse"], **kw)
    grads = [res.dq, res.dk, res.dv] + ([] if sinks_h is None else [res.dsinks])
    dtypes = [qh.dtype, kh.dtype, vh.dtype] + ([] if sinks_h is None else [sinks_h.dtype])
    return tuple(_back(inp, grads, dtypes))


def _check_saved(saved: dict, q_shape: tuple, lse_shape: tuple, lse_text: str) -> None:
    for n in ("dout", "out"):
        if tuple(saved[n].shape) != q_shape:
            raise ValueError(f"{n} must have q's shape {q_shape}, got {tuple(saved[n].shape)}")
    if tuple(saved["lse"].shape) != lse_shape:
        raise ValueError(f"lse must have shape {lse_text} = {lse_shape}, got {tuple(saved['lse'].shape)}")


def _check_lse(q, k, lse, bounds, kw) -> None:
    """A ValueError when the forward's ``lse`` cannot come from these masks: a few rows of a few (sequence, head)
    pairs recomputed with the dense reference (lse_check's rows and pairs). Host arrays only (the NumPy models
    made it, in float64, then rounded to float32): a genuine match is within LSE_ATOL + LSE_RTOL |lse|."""
    scale = kw["softmax_scale"]
    mask_kw = {n: kw[n] for n in ("causal", "window", "softcap", "sinks")}
    if bounds is None:
        problems = [(q, k, lse, kw["alibi_slopes"], lse_check.pairs_to_check(q.shape[0], q.shape[2]))]
    else:
        seqs = [s for s in bounds.sequences() if s[1].stop > s[1].start and s[2].stop > s[2].start]
        picks = lse_check.pairs_to_check(len(seqs), 1) if seqs else []
        slopes = kw["alibi_slopes"]
        problems = [(q[None, seqs[i][1]], k[None, seqs[i][2]], lse[None, :, seqs[i][1]],
                     None if slopes is None else slopes[seqs[i][0] if slopes.shape[0] > 1 else 0],
                     lse_check.pairs_to_check(1, q.shape[1])) for i, _ in picks]
    for qq, kk, given, slopes, pairs in problems:
        rows = lse_check.rows_to_check(qq.shape[1], kk.shape[1])
        _, mine = dense.attention64(qq, kk, kk, scale=scale, pairs=pairs, alibi_slopes=slopes, **mask_kw)
        got = np.stack([given[b, h, rows] for b, h in pairs]).astype(np.float64)
        mine = mine[:, rows]
        why = None
        if (np.isneginf(got) != np.isneginf(mine)).any():
            why = "a row that sees no key under one sees keys under the other"
        else:
            both = np.isfinite(got) & np.isfinite(mine)
            diff = np.abs(got[both] - mine[both])
            if (diff > LSE_ATOL + LSE_RTOL * np.abs(mine[both])).any():
                why = f"a row's lse differs by {diff.max():.3g}"
        if why:
            raise ValueError(f"lse does not match these causal, window, softcap, sinks, alibi_slopes and "
                             f"softmax_scale: {why}. Pass the arguments of the forward that returned out and lse")
