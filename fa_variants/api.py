"""``attention()``: the public entry point. Validates everything, then dispatches to a GPU kernel or a NumPy model.

A call whose signature (array types, shapes, strides, dtypes, alignment, devices, and the scalar arguments)
was validated before and ended in a single-kernel launch reuses that launch's plan (kernels/launch.py): the
signature is the cache key, so every check the first call passed holds again, and a warm call costs a key,
an allocation and a cuLaunchKernel. Anything else (a new signature, NumPy or JAX arrays, a variant that
launches several kernels) takes the full path, which raises every misuse before any launch.
"""
from __future__ import annotations

import sys
import threading

import numpy as np

from . import arrays
from .registry import get

BACKENDS = ("auto", "cuda", "numpy")
_PLANS: dict = {}          # call signature -> (plan, takes torch tensors)
_PLANS_MAX = 4096          # signatures kept before the cache starts over
_KEYERS: dict = {}         # array type -> function giving its part of a signature (None: not cached)
_lock = threading.Lock()


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
        _KEYERS[t] = fn
        return fn


_get_device = None


def _current_device() -> int:
    global _get_device
    if _get_device is None:
        import cupy
        _get_device = cupy.cuda.runtime.getDevice
    return _get_device()


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


def _signature(q, k, v, variant, causal, softmax_scale, return_lse, backend):
    """The cache key of a call, or None when calls of this kind are not cached. Types are part of it: causal=1
    equals and hashes like True, but only True passed the checks."""
    tq = type(q)
    kq = _KEYERS.get(tq) or _keyer(tq)
    if kq is None or type(k) is not tq or type(v) is not tq:
        return None
    return (variant, backend, type(causal), causal, type(softmax_scale), softmax_scale, type(return_lse),
            return_lse, tq, kq(q), kq(k), kq(v), _current_device())


# ------------------------------------------------------------------------------------------------ attention
def attention(q, k, v, *, variant: str = "fa2", causal: bool = False, softmax_scale: float | None = None,
              return_lse: bool = False, backend: str = "auto"):
    """Scaled dot-product attention softmax(q k^T * scale) v in flash-attn's layout.

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim), heads % heads_kv == 0.
    Causal masking is bottom-right aligned; a row that sees no key gives zeros and lse = -inf.
    Returns an array of q's type, shape and dtype (and lse, float32 (batch, heads, seqlen_q), with return_lse).
    """
    try:
        key = _signature(q, k, v, variant, causal, softmax_scale, return_lse, backend)
        hit = None if key is None else _PLANS.get(key)
    except Exception:  # noqa: BLE001 - an unhashable argument, or arrays the keyer cannot read: the full path
        key = hit = None  # reports what is wrong with them
    if hit is not None:
        plan, torch_in = hit
        out, lse = plan.run_torch(q, k, v) if torch_in else plan.run_cupy(q, k, v)
        return (out, lse) if return_lse else out
    # --- torch autograd / torch.compile hook (fa_variants/integrations/torch.py) ------------------------------
    # Torch tensors that require grad, and torch tensors under torch.compile (Dynamo cannot trace DLPack), go
    # through torch custom ops whose body calls attention() on detached tensors. Checked only after a plan miss,
    # so it costs the warm path nothing: such a call never reaches _attention with its own key (requires_grad is
    # part of it), so no plan is ever stored under that key and every such call misses and comes here.
    if _torch_op_needed(q, k, v):
        from .integrations import torch as _torch_ops
        return _torch_ops.attention(q, k, v, variant=variant, causal=causal, softmax_scale=softmax_scale,
                                    return_lse=return_lse, backend=backend)
    # --- end of the hook -----------------------------------------------------------------------------------------
    return _attention(q, k, v, variant, causal, softmax_scale, return_lse, backend, key)


def _torch_op_needed(q, k, v) -> bool:
    """Whether torch tensors among q, k, v need the custom ops: one requires grad, or Dynamo is tracing them.
    (Torch is imported already when its tensors come in.)"""
    tensors = [x for x in (q, k, v) if _keyer(type(x)) is _torch_key]
    if not tensors:
        return False
    return any(x.requires_grad for x in tensors) or sys.modules["torch"].compiler.is_compiling()


def _attention(q, k, v, variant, causal, softmax_scale, return_lse, backend, key):
    """The full path: every check, then the GPU or the NumPy model; remembers the plan of a single launch."""
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
        with np.errstate(over="ignore"):  # an LSE past float32's 3.4e38 (inputs ~1e20) is +inf there
            lse = res.lse.astype(np.float32)
        if inp.on_gpu:
            out, lse = arrays.to_cupy(out), arrays.to_cupy(lse)
        out = inp.wrap(out)
        return (out, inp.wrap(lse)) if return_lse else out

    # Every kernel takes each row's max over the raw scores Q K^T and scales it: that needs scale > 0 (with
    # scale < 0 the running max's -inf start times the scale is +inf, and fa1/fa2/fa3 returned all NaN). A
    # negative scale runs softmax(|scale| (-Q) K^T), the same function, on a negated copy of q; not cached.
    if not inp.on_gpu or scale < 0:
        import cupy
        with cupy.cuda.Device(inp.q.device.id if inp.on_gpu else None):
            qd, kd, vd = (arrays.to_cupy(a) for a in (inp.q, inp.k, inp.v))
            if scale < 0:  # the sign bit of every element: exact in fp16 and bf16, a NaN stays NaN
                qd, scale = (qd.view(cupy.uint16) ^ cupy.uint16(0x8000)).view(qd.dtype), -scale
            out, lse = entry.launcher.forward(qd, kd, vd, causal=bool(causal), softmax_scale=scale,
                                              return_lse=bool(return_lse))
        host = (lambda a: a) if inp.on_gpu else arrays.to_numpy
        out = inp.wrap(host(out))
        return (out, inp.wrap(host(lse))) if return_lse else out

    import cupy
    with cupy.cuda.Device(inp.q.device.id):
        plan = None
        cacheable = key is not None and key[-1] == inp.q.device.id
        if cacheable and arrays.launchable_as_is(inp.q, inp.k, inp.v):
            plan = entry.launcher.plan(inp.q, inp.k, inp.v, causal=bool(causal), softmax_scale=scale,
                                       return_lse=bool(return_lse))
        if plan is None:
            if cacheable:  # a warm call skips the checks, though it still launches through the launcher
                _remember(key, _Validated(entry.launcher, bool(causal), scale, bool(return_lse)), q)
            out, lse = entry.launcher.forward(inp.q, inp.k, inp.v, causal=bool(causal), softmax_scale=scale,
                                              return_lse=bool(return_lse))
            out, lse = inp.wrap(out), (None if lse is None else inp.wrap(lse))
        else:
            torch_in = _remember(key, plan, q)
            out, lse = plan.run_torch(q, k, v) if torch_in else plan.run_cupy(inp.q, inp.k, inp.v)
    return (out, lse) if return_lse else out


def _remember(key, plan, q) -> bool:
    """Cache ``plan`` under ``key``; returns whether the call's arrays are torch tensors."""
    torch_in = _keyer(type(q)) is _torch_key
    with _lock:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = (plan, torch_in)
    return torch_in


def clear_plans() -> None:
    """Forget every cached launch plan (after changing FA_VARIANTS_SMEM_LIMIT, FA_VARIANTS_FP8_KERNEL or FA_VARIANTS_FA3_PERSISTENT, which
    change the tiles a plan was made with)."""
    from .kernels import common
    with _lock:
        _PLANS.clear()
        for cache in common.PLAN_CACHES:  # forward_via_plan's and the fp8 launchers'
            cache.clear()
