"""Input checking and conversion: NumPy, CuPy and DLPack / ``__cuda_array_interface__`` producers.

Every misuse is reported here, as a ``TypeError`` or ``ValueError`` naming the argument and what is accepted,
before anything is copied to the GPU or launched.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import numbers

import ml_dtypes
import numpy as np

NAMES = ("q", "k", "v")


def _cupy():
    try:
        import cupy
        return cupy
    except Exception:  # noqa: BLE001
        return None


def dtype_name(dtype) -> str:
    return np.dtype(dtype).name


@dataclasses.dataclass
class Inputs:
    """q, k, v as arrays of one library (NumPy or CuPy), plus how to hand results back to the caller."""
    q: object
    k: object
    v: object
    on_gpu: bool          # CuPy arrays (possibly zero-copy views of torch/JAX memory)
    wrap: object          # callable turning a result array into the caller's array type


def _framework_wrap(x):
    """Return a function mapping a CuPy result back to ``x``'s framework through DLPack (zero-copy)."""
    root = type(x).__module__.split(".")[0]
    if root in ("jax", "jaxlib"):
        import jax.numpy as jnp
        return jnp.from_dlpack
    mod = importlib.import_module(root)
    if hasattr(mod, "from_dlpack"):
        return mod.from_dlpack
    return lambda a: a  # a bare __cuda_array_interface__ producer: give back CuPy


def _host_import(name: str, x) -> np.ndarray:
    """A NumPy view of a host DLPack producer. NumPy's DLPack import knows no bfloat16, so a bfloat16 tensor
    comes in through its 16-bit patterns, viewed as ml_dtypes.bfloat16 (torch: an int16 view of the same memory;
    JAX: its own NumPy conversion, which speaks ml_dtypes), and torch's float8_e4m3fn through its bytes."""
    try:
        return np.from_dlpack(x)
    except (RuntimeError, TypeError, BufferError, ValueError) as e:
        root = type(x).__module__.split(".")[0]
        try:
            if root == "torch":
                import torch
                if x.dtype == torch.bfloat16:
                    return np.from_dlpack(x.detach().view(torch.int16)).view(ml_dtypes.bfloat16)
                if x.dtype == torch.float8_e4m3fn:
                    return np.from_dlpack(x.detach().view(torch.uint8)).view(ml_dtypes.float8_e4m3fn)
            else:
                return np.asarray(x)
        except Exception:  # noqa: BLE001 - reported below, with the DLPack error
            pass
        raise TypeError(f"{name} ({type(x).__name__} of dtype {getattr(x, 'dtype', '?')}) cannot be read on the "
                        f"host: {e}") from None


def _host_wrap(x):
    """A function handing a NumPy result back as ``x``'s framework (torch or JAX, CPU), bfloat16 included."""
    root = type(x).__module__.split(".")[0]
    if root in ("jax", "jaxlib"):
        import jax.numpy as jnp
        return jnp.asarray
    if root == "torch":
        import torch

        def to_torch(a):
            if a.dtype == ml_dtypes.bfloat16:
                return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
            return torch.from_numpy(np.ascontiguousarray(a))
        return to_torch
    mod = importlib.import_module(root)
    return getattr(mod, "from_dlpack", lambda a: a)


def _import_one(name: str, x):
    """(array as NumPy or CuPy, on_gpu, wrap) for one input, or a TypeError naming it."""
    cp = _cupy()
    if isinstance(x, np.ndarray):
        refuse_masked(name, x)
        return x, False, lambda a: a
    if cp is not None and isinstance(x, cp.ndarray):
        return x, True, lambda a: a
    if hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__"):
        dev = getattr(x, "__dlpack_device__", lambda: (2, 0))()
        if dev[0] == 1:  # kDLCPU: a CPU torch tensor or JAX array
            return _host_import(name, x), False, _host_wrap(x)
        if cp is None:
            raise TypeError(f"{name} is a GPU array ({type(x).__name__}) but CuPy is not installed; "
                            "install fa-variants[cuda12] or [cuda13]")
        arr = cp.from_dlpack(x) if hasattr(x, "__dlpack__") else cp.asarray(x)
        return arr, True, _framework_wrap(x)
    raise TypeError(f"{name} must be a NumPy or CuPy array, or a DLPack / __cuda_array_interface__ producer "
                    f"(torch.Tensor, jax.Array), got {type(x).__name__}")


def refuse_masked(name: str, x) -> None:
    """A NumPy masked array's mask would be ignored (only its data is read): a TypeError naming the argument."""
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{name} is a NumPy masked array, and attention would ignore its mask: pass "
                        f"{name}.filled(0) or np.asarray({name}) if the mask means nothing here (causal=True is the "
                        f"one mask attention takes)")


def torch_op_needed(*xs, autograd: bool = True) -> bool:
    """Whether the torch tensors among ``xs`` must go through the torch custom ops (integrations/torch.py): Dynamo
    is tracing them (it cannot follow the DLPack hand-over), or, with ``autograd``, one of them requires grad."""
    # (None first: Dynamo (torch 2.11) cannot read NoneType's __module__)
    tensors = [x for x in xs if x is not None and type(x).__module__.split(".")[0] == "torch"]
    if not tensors:
        return False
    import torch   # imported already: its tensors came in (an import Dynamo traces, unlike a sys.modules lookup)
    return torch.compiler.is_compiling() or (autograd and any(x.requires_grad for x in tensors))


def _claims_gpu(x) -> bool | None:
    """Where ``x`` says it lives (True: GPU, False: host) without touching it; None if it is no array we take."""
    cp = _cupy()
    if isinstance(x, np.ndarray):
        return False
    if cp is not None and isinstance(x, cp.ndarray):
        return True
    if hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__"):
        try:
            return getattr(x, "__dlpack_device__", lambda: (2, 0))()[0] != 1
        except Exception:  # noqa: BLE001 - let _import_one report it
            return None
    return None


def import_arrays(q, k, v) -> Inputs:
    # Device agreement is checked before any conversion, so that mixing host and GPU arrays is reported as
    # such (and nothing is imported through CuPy) even where CuPy cannot reach a device.
    claims = [_claims_gpu(x) for x in (q, k, v)]
    if None not in claims and len(set(claims)) != 1:
        where = ", ".join(f"{n} on {'GPU' if g else 'host'}" for n, g in zip(NAMES, claims))
        raise ValueError(f"q, k and v must be on the same device, got {where}")
    imported = [_import_one(n, x) for n, x in zip(NAMES, (q, k, v))]
    arrays = [a for a, _, _ in imported]
    on_gpu = [g for _, g, _ in imported]
    if len(set(on_gpu)) != 1:
        where = ", ".join(f"{n} on {'GPU' if g else 'host'}" for n, g in zip(NAMES, on_gpu))
        raise ValueError(f"q, k and v must be on the same device, got {where}")
    if on_gpu[0]:
        devs = [a.device.id for a in arrays]
        if len(set(devs)) != 1:
            raise ValueError(f"q, k and v must be on the same device, got devices {dict(zip(NAMES, devs))}")
    return Inputs(*arrays, on_gpu=on_gpu[0], wrap=imported[0][2])


def check_dims(q, k, v) -> None:
    """Rank, sizes and GQA divisibility of q, k, v (any array type): the rules attention() and the NumPy models
    share (the models take any layout, so strides and alignment are check_shapes' alone)."""
    for n, a in zip(NAMES, (q, k, v)):
        if a.ndim != 4:
            raise ValueError(f"{n} must have 4 dimensions (batch, seqlen, heads, head_dim), got shape {tuple(a.shape)}")
        if 0 in a.shape:
            raise ValueError(f"{n} has a zero-size dimension, shape {tuple(a.shape)}; every dimension must be >= 1")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if not (q.shape[3] == k.shape[3] == v.shape[3]):
        raise ValueError(f"head_dim differs: q {q.shape[3]}, k {k.shape[3]}, v {v.shape[3]}; all three must match")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"k and v must have the same (seqlen_k, heads_kv), got {tuple(k.shape[1:3])} and {tuple(v.shape[1:3])}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"heads of q ({q.shape[2]}) must be a multiple of heads of k/v ({k.shape[2]}) for MQA/GQA")


def common_dtype(inp: Inputs) -> str:
    """The one dtype name of q, k and v (a TypeError naming each when they differ)."""
    dts = [dtype_name(a.dtype) for a in (inp.q, inp.k, inp.v)]
    if len(set(dts)) != 1:
        raise TypeError(f"q, k and v must share one dtype, got q {dts[0]}, k {dts[1]}, v {dts[2]}")
    return dts[0]


def check_supported(variant, dtype: str, head_dim: int) -> None:
    """``variant`` (a registry entry) takes ``dtype`` and ``head_dim``."""
    if dtype not in variant.dtypes:
        raise TypeError(f"variant {variant.name!r} accepts dtypes {list(variant.dtypes)}, got {dtype}")
    if head_dim not in variant.head_dims:
        raise ValueError(f"variant {variant.name!r} accepts head_dim in {variant.head_dims_text}, got {head_dim}")


def check_layout(named: dict) -> None:
    """{name: array}: each contiguous in its last dimension, no negative stride (what the kernels read)."""
    for n, a in named.items():
        item = a.dtype.itemsize
        if a.strides[-1] != item and a.shape[-1] > 1:
            raise ValueError(f"{n} must be contiguous in its last dimension (stride {item} bytes), "
                             f"got strides {tuple(a.strides)}")
        if any(s < 0 for s in a.strides):
            raise ValueError(f"{n} has negative strides {tuple(a.strides)}; pass a copy")


def check_shapes(inp: Inputs, variant) -> None:
    """Rank, sizes, GQA divisibility, dtypes and layout, against what ``variant`` accepts."""
    check_dims(inp.q, inp.k, inp.v)
    check_supported(variant, common_dtype(inp), inp.q.shape[3])
    check_layout(dict(q=inp.q, k=inp.k, v=inp.v))


def check_flags(none: bool = False, **flags) -> None:
    """Each of ``flags`` a bool (NumPy's included; with ``none``, or None), else a TypeError naming it."""
    for name, value in flags.items():
        if not (isinstance(value, (bool, np.bool_)) or (none and value is None)):
            raise TypeError(f"{name} must be a bool{' or None' if none else ''}, got {type(value).__name__}")


def check_scalars(causal, softmax_scale, return_lse, head_dim: int | None = None) -> float | None:
    """Validate the scalar arguments; returns the softmax scale as a float, or for None: None, or 1/sqrt(head_dim)
    when ``head_dim`` is given."""
    check_flags(causal=causal, return_lse=return_lse)
    if softmax_scale is None:
        return None if head_dim is None else default_scale(None, head_dim)
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(float(softmax_scale)):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    return float(softmax_scale)


def default_scale(softmax_scale: float | None, head_dim: int) -> float:
    """The softmax scale of a call whose ``softmax_scale`` passed check_scalars: 1/sqrt(head_dim) for None."""
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale


def to_numpy(a):
    cp = _cupy()
    if cp is not None and isinstance(a, cp.ndarray):
        return cp.asnumpy(a)
    return np.asarray(a)


def to_cupy(a):
    import cupy
    return cupy.asarray(a)


def aligned_for_vector_loads(a, elements: int = 8) -> bool:
    """True when base pointer and the three outer strides allow 16-byte (8 x fp16) vector loads."""
    item = a.dtype.itemsize
    return a.data.ptr % (elements * item) == 0 and all(s % (elements * item) == 0 for s in a.strides[:3])


def launchable_as_is(q, k, v) -> bool:
    """Whether the 16-bit kernels take q, k, v without a copy: 16-byte aligned rows of a multiple of 8."""
    return q.shape[3] % 8 == 0 and all(aligned_for_vector_loads(a) for a in (q, k, v))
