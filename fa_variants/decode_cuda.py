"""``attention_with_kvcache`` and ``merge_states`` on GPU arrays: CuPy arrays, torch tensors (read in place, the
results allocated by torch on its current stream) and other DLPack producers (through CuPy).

Every check runs before the first launch, on the arrays' shapes, dtypes and strides (``kvcache.check_call`` on
stand-ins). Index arrays given on the host (an int, NumPy) are checked in full and copied to the device; those on
the device are not read (a step would synchronize and could not be captured in a CUDA graph): the kernels guard
them (kv_append.cu writes no row outside the cache; decode_fwd.cu gives NaN rows for a sequence that does not fit
its cache or names a page outside it).
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from . import arrays, gpu, kvcache
from .reference import masks
from .dispatch import BackendUnavailable
from .kernels import decode as kern
from .kernels.common import negated
from .kernels.decode import DevArray, Framework

BIG = ("q", "k_cache", "v_cache", "k", "v")
CACHE_INDEX = ("cache_seqlens", "page_table", "k_descale", "v_descale")
MASK_ARRAYS = ("alibi_slopes", "sinks")
INDEX = CACHE_INDEX + MASK_ARRAYS   # small arrays: device ones are not read on the host, host ones copied up
MASK_DTYPES = ("float32", "float16", "bfloat16", "float64")   # what a device mask array may hold (read as float32)


def require_gpu(func: str) -> None:
    """BackendUnavailable, before any array is touched, where no CUDA device can run the kernels."""
    if not gpu.available():
        raise BackendUnavailable(f"{func} was given GPU arrays (or backend='cuda'), and no CUDA GPU is usable here: "
                                 f"{gpu.reason()}; nothing was read, appended or launched")


def _framework_root(x) -> str:
    return type(x).__module__.split(".")[0]


def _device_array(name: str, x):
    """(the array the launch reads: a torch tensor or a CuPy array, its DevArray)."""
    if _framework_root(x) == "torch":
        if not x.is_cuda:
            raise ValueError(f"{name} is a CPU tensor while q is on the GPU: pass every array on one device")
        return x, DevArray.of(x)
    cp = arrays._cupy()
    if cp is not None and isinstance(x, cp.ndarray):
        return x, DevArray.of(x)
    a, on_gpu, _ = arrays._import_one(name, x)
    if not on_gpu:
        raise ValueError(f"{name} is on the host while q is on the GPU: pass every array on one device")
    return a, DevArray.of(a)


def _as_float32(name: str, x, d: DevArray):
    """A device sinks or alibi_slopes array as the kernel reads it: float32 (a model's bfloat16 parameters are
    converted on the device: no host read), contiguous."""
    if d.dtype not in MASK_DTYPES:
        raise TypeError(f"{name} must have a floating-point dtype ({', '.join(MASK_DTYPES)}), got {d.dtype}")
    if d.dtype == "float32" and d.strides == kern.contiguous_strides(d.shape):
        return x, d
    y = x.float().contiguous() if _framework_root(x) == "torch" else arrays._cupy().ascontiguousarray(x, "float32")
    return y, DevArray.of(y)


def _np_dtype(dtype: str):
    return ml_dtypes.float8_e4m3fn if dtype == "float8_e4m3fn" else np.dtype(dtype)


def _check_streamed(name: str, a: DevArray, vector: bool) -> None:
    """Contiguous last dimension; the 16-byte row loads (``vector``) need strides of whole 16 bytes."""
    if a.shape[-1] > 1 and a.strides[-1] != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got element strides {a.strides}")
    if any(s < 0 for s in a.strides):
        raise ValueError(f"{name} has negative strides {a.strides}; pass a copy")
    if vector and any(s * a.itemsize % 16 for s in a.strides[:-1]):
        raise ValueError(f"{name} must start on a 16-byte boundary with strides of whole 16 bytes (the kernel "
                         f"reads 16-byte rows), got element strides {a.strides}")


def _check_aligned(name: str, a: DevArray, vector: bool) -> None:
    """The 16-byte row loads (``vector``) need a 16-byte aligned base (a pointer: checked on every call)."""
    if vector and a.ptr % 16:
        raise ValueError(f"{name} must start on a 16-byte boundary with strides of whole 16 bytes (the kernel "
                         f"reads 16-byte rows), got pointer {a.ptr:#x} and element strides {a.strides}")


_WARM: dict = {}     # a call's signature -> its StepPlan, for calls whose arrays all live on the device
WARM_MAX = 256


def _facts(x):
    """What a step's checks and plan depend on of an array, read off a torch tensor or a CuPy array without
    building anything (a decoding loop repeats one signature, and these reads are a warm call's whole cost before
    its launches); None for None, False for an array of any other kind (such a call takes the checked path)."""
    if x is None:
        return None
    module = type(x).__module__
    if module.startswith("torch"):
        return type(x), x.shape, x.stride(), x.dtype, x.device
    if module.startswith("cupy"):
        return type(x), x.shape, x.strides, x.dtype, x.device.id
    return False


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, page_table, k, v, causal, softmax_scale,
                           num_splits, return_lse, k_descale, v_descale, window, softcap, alibi_slopes, sinks):
    """decode.attention_with_kvcache's GPU path (its scalar arguments, the window and the softcap already
    checked). A call whose signature (every array's facts, on the device, and the scalars) passed before runs its
    plan straight away: the checks depend on the signature alone there."""
    if softmax_scale < 0:   # the kernel's row max is of the raw scores: -q with |scale| gives the same scores
        q, softmax_scale = _negated(q), -softmax_scale
    given = (q, k_cache, v_cache, k, v, cache_seqlens, page_table, k_descale, v_descale, alibi_slopes, sinks)
    key = (*map(_facts, given), causal, softmax_scale, num_splits, return_lse, window, softcap)
    plan = _WARM.get(key)
    if plan is not None:
        held = {n: _launchable(n, x) for n, x in zip(BIG + INDEX, given) if x is not None}   # alive until launched
        out, lse = plan.run(Framework(q), **{n: _ptr(x) for n, x in held.items()})
        return (out, lse) if return_lse else out
    out, lse, plan = _checked_call(q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table, k=k, v=v,
                                   causal=causal, softmax_scale=softmax_scale, num_splits=num_splits,
                                   return_lse=return_lse, k_descale=k_descale, v_descale=v_descale, window=window,
                                   softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    if plan is not None and False not in key[:len(given)]:
        if len(_WARM) >= WARM_MAX:
            _WARM.clear()
        _WARM[key] = plan
    wrap = _wrap_like(q)
    return (wrap(out), wrap(lse)) if return_lse else wrap(out)


def _negated(q):
    """-q, exact (a sign flip), in q's framework: a CuPy bfloat16 array by its sign bits (CuPy has no arithmetic
    on it)."""
    return negated(q) if _framework_root(q) == "cupy" else -q


def _launchable(name: str, x):
    """A warm call's array as the kernels read it: a mask array as float32 (_as_float32), the 16-byte alignment
    of the streamed ones checked."""
    if name in MASK_ARRAYS:
        return _as_float32(name, x, DevArray.of(x))[0]
    if name in ("q", "k_cache", "v_cache") and _ptr(x) % 16:
        _check_aligned(name, DevArray.of(x), vector=True)
    return x


def _ptr(x) -> int:
    return x.data_ptr() if type(x).__module__.startswith("torch") else x.data.ptr


def _checked_call(q, k_cache, v_cache, *, cache_seqlens, page_table, k, v, causal, softmax_scale, num_splits,
                  return_lse, k_descale, v_descale, window, softcap, alibi_slopes, sinks):
    """The call checked in full and run: (out, lse, the plan where the call's index arrays all live on the device,
    else None: host values are checked on every call)."""
    require_gpu("attention_with_kvcache")
    if softmax_scale == 0 and (softcap > 0 or alibi_slopes is not None):
        raise ValueError("softmax_scale = 0 with softcap or alibi_slopes: not supported on the GPU (the kernel "
                         "transforms raw scores, in units of 1 / softmax_scale); pass a nonzero softmax_scale")
    big = {n: _device_array(n, x) for n, x in zip(BIG, (q, k_cache, v_cache, k, v)) if x is not None}
    dev = {n: d for n, (_, d) in big.items()}
    if len({d.device for d in dev.values()}) != 1:
        raise ValueError(f"q, k_cache, v_cache (and k, v) must be on one GPU, got devices "
                         f"{ {n: d.device for n, d in dev.items()} }")
    device = dev["q"].device
    if k is not None and _framework_root(k_cache) in ("jax", "jaxlib"):
        raise TypeError("k_cache is a JAX array, which cannot be written in place: append k, v with JAX's own "
                        ".at[].set(), or pass the cache as CuPy arrays or torch tensors")
    index = dict(zip(INDEX, (cache_seqlens, page_table, k_descale, v_descale, alibi_slopes, sinks)))
    on_device = {n: _device_array(n, x) for n, x in index.items() if x is not None and arrays._claims_gpu(x)}
    on_device.update({n: _as_float32(n, *on_device[n]) for n in MASK_ARRAYS if n in on_device})
    index = {n: x if n in on_device or x is None or isinstance(x, np.ndarray) or np.isscalar(x) else
             arrays._host_import(n, x) for n, x in index.items()}   # CPU torch tensors: NumPy views
    specs = tuple((n, d.spec) for n, d in (*dev.items(), *((n, d) for n, (_, d) in on_device.items())))
    host = {n: x for n, x in index.items() if n not in on_device and x is not None}
    # Device index arrays are not read: then everything checked depends on the signature alone, worked out once.
    call = _check(specs, host) if host else _checked_specs(specs)
    max_k = call.capacity if "cache_seqlens" in on_device else int(call.seqlens_k.max())
    paged = call.page_table is not None
    sizes = (paged, call.page_table.shape[1] if paged else 0, call.seqlen_new, call.capacity, max_k)
    plan = _step_plan(specs, sizes, causal, softmax_scale, num_splits, return_lse, window, softcap)
    for n, d in dev.items():
        _check_aligned(n, d, vector=n not in ("k", "v"))

    # Everything is checked: host index arrays up to the device, the append, the attention.
    fw = Framework(big["q"][0])
    held = []   # the device copies of host index arrays, alive until their launches are queued
    ptrs = {n: d.ptr for n, d in dev.items()}
    for n, x in index.items():
        if n in on_device:
            ptrs[n] = on_device[n][1].ptr
        elif x is not None:
            host_x = np.full(call.batch, x, np.int32) if n == "cache_seqlens" and np.isscalar(x) else x
            if n in MASK_ARRAYS:
                host_x = np.asarray(host_x, np.float32)   # the kernel's type, converted where ml_dtypes reads it
            held.append(fw.from_host(np.ascontiguousarray(host_x), device))
            ptrs[n] = fw.ptr(held[-1])
    out, lse = plan.run(fw, **ptrs)
    return out, lse, None if held or on_device.keys() != {n for n in INDEX if index[n] is not None} else plan


def _check(specs: tuple, host: dict) -> kvcache.CacheCall:
    """kvcache.check_call with stand-ins for the GPU arrays (``specs``: (name, DevArray)) and the host index
    arrays' values (``host``)."""
    given = {**{n: kvcache.stand_in(d.shape, _np_dtype(d.dtype)) for n, d in specs}, **host}
    on_device = tuple(n for n, _ in specs if n in CACHE_INDEX)
    call = kvcache.check_call(given["q"], given["k_cache"], given["v_cache"], k=given.get("k"), v=given.get("v"),
                              **{n: given.get(n) for n in CACHE_INDEX}, device_values=on_device)
    masks.check_alibi(given.get("alibi_slopes"), call.heads, call.batch)
    masks.check_sinks(given.get("sinks"), call.heads)
    return call


@functools.lru_cache(maxsize=1024)
def _checked_specs(specs: tuple) -> kvcache.CacheCall:
    """_check of a call whose index arrays are all on the device (or absent): a function of the signature, worked
    out once per signature (a decoding loop repeats one). A refused call raises each time."""
    return _check(specs, {})


@functools.lru_cache(maxsize=1024)
def _step_plan(specs: tuple, sizes: tuple, causal: bool, softmax_scale: float, num_splits: int,
               return_lse: bool, window: tuple, softcap: float) -> kern.StepPlan:
    """What the kernels take beyond the model, checked, and the step's launches, for arrays of these specs
    (name, DevArray without its pointer) and ``sizes``: (paged, max_pages, seqlen_new, capacity, max_seqlen_k)."""
    dev = dict(specs)
    paged, max_pages, seqlen_new, capacity, max_k = sizes
    _check_kernel_limits(dev["q"].shape[3], dev)
    for n, d in dev.items():
        if n in INDEX:
            if d.device != dev["q"].device:
                raise ValueError(f"{n} is on GPU {d.device}, q on GPU {dev['q'].device}")
            want = kern.contiguous_strides(d.shape)
            if d.strides != want:
                raise ValueError(f"{n} must be contiguous (strides {want}), got {d.strides}")
    append = None
    if "k" in dev:
        append = kern.append_launch(dev["k"], dev["v"], dev["k_cache"], dev["v_cache"], paged=paged,
                                    capacity=capacity, page_size=dev["k_cache"].shape[1] if paged else 0,
                                    max_pages=max_pages)
    return kern.step_plan(dev["q"], dev["k_cache"], dev["v_cache"], paged=paged, max_pages=max_pages,
                          seqlen_new=seqlen_new, capacity=capacity, max_seqlen_k=max_k, causal=causal,
                          softmax_scale=softmax_scale, num_splits=num_splits, return_lse=return_lse, append=append,
                          window=window, softcap=softcap, alibi_rows=_alibi_rows(dev.get("alibi_slopes")))


def _alibi_rows(slopes: DevArray | None) -> int:
    """alibi_slopes' rows: 0 (none), 1 for (heads,), batch for (batch, heads)."""
    return 0 if slopes is None else slopes.shape[0] if len(slopes.shape) == 2 else 1


def _check_kernel_limits(head_dim: int, dev: dict) -> None:
    """What the GPU kernel takes beyond the model: head dims in whole 16-byte rows, at most 256; rows of whole
    16 bytes (``dev``: name -> DevArray of q, the caches, k, v)."""
    fp8 = dev["k_cache"].itemsize == 1
    step = 16 if fp8 else 8
    if head_dim % step or head_dim > 256:
        raise ValueError(f"head_dim must be a multiple of {step} up to 256 for the GPU kernel with a "
                         f"{'float8_e4m3fn' if fp8 else '16-bit'} cache (whole 16-byte rows), got {head_dim}; "
                         f"the NumPy model takes any")
    for n in BIG:
        if n in dev:
            _check_streamed(n, dev[n], vector=n not in ("k", "v"))
    if fp8 and kern.arch_of(dev["q"].device) not in kern.FP8_ARCHS:
        raise ValueError(f"a float8_e4m3fn cache needs an sm_89+ GPU with the e4m3 conversion; this one is "
                         f"{kern.arch_of(dev['q'].device)}")


def _wrap_like(q):
    root = _framework_root(q)
    if root == "torch":
        return lambda a: a
    cp = arrays._cupy()
    if cp is not None and isinstance(q, cp.ndarray):
        return lambda a: a
    return arrays._framework_wrap(q)


# ------------------------------------------------------------------------------------------------ merge_states
OUT_DTYPES = tuple(kern.MERGE_TYPES)
LSE_DTYPES = tuple(kern.LSE_TYPES)


def merge_states(outs: list, lses: list | None, stacked: bool):
    """decode.merge_states on GPU arrays: states as lists (stacked here: one copy) or stacked arrays, in
    flash-attn's layout (out (batch, seqlen, heads, d), lse (batch, heads, seqlen)) or FlashInfer's (out (tokens,
    heads, d), lse (tokens, heads)). Returns (out, lse) in the states' dtypes, as the caller's framework."""
    require_gpu("merge_states")
    if not stacked:
        held = [_device_array(f"outs[{i}]", x)[0] for i, x in enumerate(outs)]
        lheld = [_device_array(f"lses[{i}]", x)[0] for i, x in enumerate(lses)]
        fw = Framework(held[0])
        for n, group in (("outs", held), ("lses", lheld)):
            shapes = {tuple(x.shape) for x in group}
            if len(shapes) != 1:
                raise ValueError(f"the states' {n} must share one shape, got {sorted(shapes)}")
        rank = len(held[0].shape)
        axis = 0 if rank == 4 else 1
        outs_s, lses_s = fw.lib.stack(held, axis), fw.lib.stack(lheld, axis)
    else:
        outs_s, lses_s = _device_array("outs", outs)[0], _device_array("lses", lses)[0]
        fw = Framework(outs_s)
    o, ls = DevArray.of(outs_s), DevArray.of(lses_s)
    if o.dtype not in OUT_DTYPES:
        raise TypeError(f"the states' out must be one of {OUT_DTYPES} on the GPU, got {o.dtype}")
    if ls.dtype not in LSE_DTYPES:
        raise TypeError(f"the states' lse must be float32 or float64, got {ls.dtype}")
    if o.shape[-1] > 1 and o.strides[-1] != 1:
        raise ValueError(f"the states' out must be contiguous in head_dim, got element strides {o.strides}")
    if len(o.shape) == 5:                                   # (S, batch, seqlen, heads, d), lse (S, batch, heads, seqlen)
        s, b, n, h, d = o.shape
        if ls.shape != (s, b, h, n):
            raise ValueError(f"lses must have shape (states, batch, heads, seqlen) = {(s, b, h, n)}, got {ls.shape}")
        parts, lse_strides = o, ls.strides
        out = fw.empty((b, n, h, d), o.dtype)
        res_shape = (b, h, n)
    elif len(o.shape) == 4:                                 # (tokens, S, heads, d), lse (tokens, S, heads)
        t, s, h, d = o.shape
        if ls.shape != (t, s, h):
            raise ValueError(f"lses must have shape (tokens, states, heads) = {(t, s, h)}, got {ls.shape}")
        parts = DevArray(o.ptr, (s, t, 1, h, d), (o.strides[1], o.strides[0], 0, o.strides[2], 1), o.dtype, o.device)
        lse_strides = (ls.strides[1], ls.strides[0], ls.strides[2], 0)
        out = fw.empty((t, h, d), o.dtype)
        res_shape = (t, h)
    else:
        raise ValueError(f"outs must be stacked states (states, batch, seqlen, heads, head_dim) or (tokens, states, "
                         f"heads, head_dim), got shape {o.shape}")
    lse = fw.empty(res_shape, ls.dtype)
    od = DevArray.of(out)
    out_view = od if len(od.shape) == 4 else DevArray(od.ptr, (od.shape[0], 1, od.shape[1], od.shape[2]),
                                                      (od.strides[0], 0, od.strides[1], 1), od.dtype, od.device)
    kern.merge_launch(parts, ls, out_view, lse_strides)(fw.stream, o_parts=parts.ptr, lse_parts=ls.ptr,
                                                        out=out_view.ptr, lse=fw.ptr(lse))
    wrap = _wrap_like(outs_s)
    return wrap(out), wrap(lse)
