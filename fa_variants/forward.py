"""The forward below ``attention()``: every check, then a GPU kernel or a NumPy model, and the plan cache.

A call whose signature (array types, shapes, strides, dtypes, alignment, devices, and the scalar arguments) was
validated before and ended in a single-kernel launch reuses that launch's plan (kernels/launch.py), kept in the
one plan cache (plans.py): the signature is the key, so every check the first call passed holds again, and a
warm call costs a key, a dict lookup, an allocation and a cuLaunchKernel. Anything else (a new signature, NumPy
or JAX arrays, a variant that launches several kernels) takes the full path, ``run``, which raises every misuse
before any launch. ``attention`` here is that warm path plus ``run``; ``api.attention`` adds the torch autograd
detour between the two, and the torch custom op's body calls this one.
"""
from __future__ import annotations

import numpy as np

from . import arrays, dispatch, plans

OWNER = plans.Owner("attention")   # the first element of every key this module keeps
PLANS = plans.PLANS
_KEYERS: dict = {}                 # array type -> function giving its part of a signature (None: not cached)
_torch_compiling = None            # torch.compiler.is_compiling, bound once a torch tensor type is seen


# ------------------------------------------------------------------------------------------------ signatures
def _cupy_key(x):
    mem = x.data
    return x.shape, x.strides, x.dtype, mem.ptr & 15, mem.device_id


def _torch_key(x):
    return x.shape, x.stride(), x.dtype, x.get_device(), x.requires_grad, x.data_ptr() & 15


def _keyer(t):
    """The signature function of array type ``t`` (cached per type): CuPy arrays and torch tensors have one."""
    try:
        return _KEYERS[t]
    except KeyError:
        root = t.__module__.split(".")[0]
        fn = _cupy_key if root == "cupy" and t.__name__ == "ndarray" else _torch_key if root == "torch" else None
        if fn is _torch_key:
            global _torch_compiling
            import torch   # imported already: its tensors came in
            _torch_compiling = torch.compiler.is_compiling
        _KEYERS[t] = fn
        return fn


def is_torch(x) -> bool:
    return _keyer(type(x)) is _torch_key


_get_device = None


def _current_device() -> int:
    global _get_device
    if _get_device is None:
        import cupy
        _get_device = cupy.cuda.runtime.getDevice
    return _get_device()


def signature(q, k, v, variant, causal, softmax_scale, return_lse, backend):
    """The cache key of a call, or None when calls of this kind are not cached. Types are part of it: causal=1
    equals and hashes like True, but only True passed the checks."""
    tq = type(q)
    kq = _KEYERS.get(tq) or _keyer(tq)
    if kq is None or type(k) is not tq or type(v) is not tq:
        return None
    if kq is _torch_key and _torch_compiling():   # traced by Dynamo, which cannot read data_ptr(): no plan; the
        return None                               # call goes through the torch ops (api.attention)
    return (OWNER, variant, backend, type(causal), causal, type(softmax_scale), softmax_scale, type(return_lse),
            return_lse, tq, kq(q), kq(k), kq(v), _current_device())


class _Validated:
    """The cache entry of a signature whose variant launches several kernels (naive, fa2_fp8 quantizing on the
    fly): no plan to replay, but the checks it passed need not run again."""

    def __init__(self, launcher, causal: bool, scale: float, return_lse: bool):
        self.launcher, self.kw = launcher, dict(causal=causal, softmax_scale=scale, return_lse=return_lse)

    def run_cupy(self, q, k, v):
        return self.launcher.forward(q, k, v, **self.kw)

    def run_torch(self, q, k, v):
        import cupy
        import torch
        out, lse = self.launcher.forward(cupy.from_dlpack(q), cupy.from_dlpack(k), cupy.from_dlpack(v), **self.kw)
        return torch.from_dlpack(out), None if lse is None else torch.from_dlpack(lse)


def _remember(key, plan, q):
    """Keep ``plan``'s launch for the arrays of ``q``'s type (torch or CuPy) under ``key``; returns it."""
    return plans.put(key, plan.run_torch if is_torch(q) else plan.run_cupy)


# ------------------------------------------------------------------------------------------------ the calls
def attention(q, k, v, variant, causal, softmax_scale, return_lse, backend):
    """``attention()`` without the torch autograd detour: the warm path, else ``run``."""
    try:
        key = signature(q, k, v, variant, causal, softmax_scale, return_lse, backend)
        launch = None if key is None else PLANS.get(key)
    except Exception:  # noqa: BLE001 - an unhashable argument, or arrays the keyer cannot read: the full path
        key = launch = None  # reports what is wrong with them
    if launch is not None:
        out, lse = launch(q, k, v)
        return (out, lse) if return_lse else out
    return run(q, k, v, variant, causal, softmax_scale, return_lse, backend, key)


def run(q, k, v, variant, causal, softmax_scale, return_lse, backend, key=None):
    """The full path: every check (the scalars once, then the arrays), the variant and backend (dispatch), then
    the NumPy model or the GPU; remembers the plan of a single launch under ``key``."""
    dispatch.check_variant(variant)
    dispatch.check_backend(backend)
    scale = arrays.check_scalars(causal, softmax_scale, return_lse)
    inp = arrays.import_arrays(q, k, v)
    arrays.check_dims(inp.q, inp.k, inp.v)
    dtype, d = arrays.common_dtype(inp), inp.q.shape[3]
    arrays.check_layout(dict(q=inp.q, k=inp.k, v=inp.v))
    entry, where = dispatch.resolve("forward", variant, dtype, d, inp.on_gpu, backend)
    scale, causal, return_lse = arrays.default_scale(scale, d), bool(causal), bool(return_lse)
    if where == "numpy":
        out, lse = _model(entry, inp, causal, scale)
    elif not inp.on_gpu or scale < 0:
        out, lse = _on_copies(entry, inp, causal, scale, return_lse)
    else:
        return _on_device(entry, inp, q, k, v, causal, scale, return_lse, key)
    return (out, lse) if return_lse else out


def _model(entry, inp, causal: bool, scale: float):
    """The variant's NumPy model on host copies; (out, lse) as the caller's array type."""
    qh, kh, vh = (arrays.to_numpy(a) for a in (inp.q, inp.k, inp.v))
    res = entry.reference(qh, kh, vh, causal=causal, softmax_scale=scale)
    out = res.out.astype(qh.dtype)
    with np.errstate(over="ignore"):  # an LSE past float32's 3.4e38 (inputs ~1e20) is +inf there
        lse = res.lse.astype(np.float32)
    if inp.on_gpu:
        out, lse = arrays.to_cupy(out), arrays.to_cupy(lse)
    return inp.wrap(out), inp.wrap(lse)


def _on_copies(entry, inp, causal: bool, scale: float, return_lse: bool):
    """The launcher on device copies of host arrays, or on a negated q; not cached.

    Every kernel takes each row's max over the raw scores Q K^T and scales it: that needs scale > 0 (with
    scale < 0 the running max's -inf start times the scale is +inf, and fa1/fa2/fa3 returned all NaN). A negative
    scale runs softmax(|scale| (-Q) K^T), the same function, on a negated copy of q."""
    import cupy
    from .kernels.common import negated
    with cupy.cuda.Device(inp.q.device.id if inp.on_gpu else None):
        qd, kd, vd = (arrays.to_cupy(a) for a in (inp.q, inp.k, inp.v))
        if scale < 0:
            qd, scale = negated(qd), -scale
        out, lse = entry.launcher.forward(qd, kd, vd, causal=causal, softmax_scale=scale, return_lse=return_lse)
    host = (lambda a: a) if inp.on_gpu else arrays.to_numpy
    return inp.wrap(host(out)), (None if lse is None else inp.wrap(host(lse)))


def _on_device(entry, inp, q, k, v, causal: bool, scale: float, return_lse: bool, key):
    """GPU arrays: the launcher's plan when it has one for them (kept under ``key``), else its forward (the
    signature kept as validated)."""
    import cupy
    with cupy.cuda.Device(inp.q.device.id):
        plan = None
        cacheable = key is not None and key[-1] == inp.q.device.id
        if cacheable and arrays.launchable_as_is(inp.q, inp.k, inp.v):
            plan = entry.launcher.plan(inp.q, inp.k, inp.v, causal=causal, softmax_scale=scale,
                                       return_lse=return_lse)
        if plan is None:
            if cacheable:  # a warm call skips the checks, though it still launches through the launcher
                _remember(key, _Validated(entry.launcher, causal, scale, return_lse), q)
            out, lse = entry.launcher.forward(inp.q, inp.k, inp.v, causal=causal, softmax_scale=scale,
                                              return_lse=return_lse)
            out, lse = inp.wrap(out), (None if lse is None else inp.wrap(lse))
        else:
            out, lse = _remember(key, plan, q)(q, k, v)
    return (out, lse) if return_lse else out
