"""The inputs a measurement runs on: random q, k, v (and dout) of a ``Shape``, and several independent sets of
them on the GPU to rotate among.

**Inputs larger than L2**: the caller passes several input sets and calls rotate among them, sized so that the
sets together are at least ``L2_FOOTPRINT`` x the L2 (60 MB on the H200): no call finds its Q, K, V in L2 left
warm by the previous call.
"""
from __future__ import annotations

import math

from .shapes import Shape


DEFAULT_L2_BYTES = 60 * 1000 * 1000    # H200; the real value is read from the device when there is one
L2_FOOTPRINT = 3                        # input sets together span at least this many L2 sizes
MAX_SETS = 8


def cast_half(x32, dtype: str):
    """float32 array (NumPy or CuPy) -> float16 / bfloat16, round to nearest even."""
    import ml_dtypes
    import numpy as np
    if dtype == "float16":
        return x32.astype(np.float16)
    if dtype != "bfloat16":
        raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {dtype!r}")
    try:
        return x32.astype(ml_dtypes.bfloat16)
    except Exception:  # noqa: BLE001 - an array library without a bf16 cast: round the bits ourselves
        bits = x32.view(np.uint32)
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        return rounded.astype(np.uint16).view(ml_dtypes.bfloat16)


def random_inputs(shape: Shape, xp, seed: int = 0):
    """(q, k, v) in flash-attn layout, N(0, 1) entries, of ``shape.dtype``, as arrays of ``xp`` (numpy/cupy)."""
    import numpy as np
    if xp is np:
        rng = np.random.default_rng(seed)
        normal = lambda s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    else:
        rng = xp.random.default_rng(seed)
        normal = lambda s: rng.standard_normal(s, dtype=xp.float32)  # noqa: E731
    q = cast_half(normal((shape.batch, shape.seqlen_q, shape.heads, shape.head_dim)), shape.dtype)
    k = cast_half(normal((shape.batch, shape.nk, shape.hkv, shape.head_dim)), shape.dtype)
    v = cast_half(normal((shape.batch, shape.nk, shape.hkv, shape.head_dim)), shape.dtype)
    return q, k, v


def random_dout(shape: Shape, xp, seed: int = 10_000):
    """An output gradient of q's shape (batch, seqlen_q, heads, head_dim), N(0, 1), of ``shape.dtype``."""
    import numpy as np
    rng = np.random.default_rng(seed) if xp is np else xp.random.default_rng(seed)
    dt = np.float32 if xp is np else xp.float32
    return cast_half(rng.standard_normal((shape.batch, shape.seqlen_q, shape.heads, shape.head_dim), dtype=dt),
                     shape.dtype)


def gpu_dout_sets(shape: Shape, n_sets: int, seed: int = 10_000):
    """``n_sets`` CuPy output gradients for ``shape``, one per input set of ``gpu_input_sets``."""
    import cupy
    return [random_dout(shape, cupy, seed + i) for i in range(n_sets)]


def l2_bytes() -> int:
    """L2 size of the current CUDA device (DEFAULT_L2_BYTES if it cannot be read)."""
    try:
        import cupy
        dev = cupy.cuda.Device()
        return int(cupy.cuda.runtime.getDeviceProperties(dev.id)["l2CacheSize"]) or DEFAULT_L2_BYTES
    except Exception:  # noqa: BLE001
        return DEFAULT_L2_BYTES


def rotation_count(set_bytes: int, l2: int | None = None, free_bytes: int | None = None) -> int:
    """How many input sets to rotate among: together >= L2_FOOTPRINT x L2 and at least 2, within a quarter
    of free device memory, at most MAX_SETS."""
    l2 = DEFAULT_L2_BYTES if l2 is None else l2
    n = max(2, math.ceil(L2_FOOTPRINT * l2 / max(set_bytes, 1)))
    if free_bytes is not None:
        n = min(n, max(1, int(0.25 * free_bytes // max(set_bytes, 1))))
    return max(1, min(n, MAX_SETS))


def gpu_input_sets(shape: Shape, seed: int = 0, n_sets: int | None = None):
    """Several independent (q, k, v) CuPy sets of ``shape`` for L2-busting rotation (see ``rotation_count``)."""
    import cupy
    if n_sets is None:
        free, _ = cupy.cuda.runtime.memGetInfo()
        free += cupy.get_default_memory_pool().free_bytes()
        n_sets = rotation_count(shape.input_bytes, l2_bytes(), free)
    return [random_inputs(shape, cupy, seed + i) for i in range(n_sets)]

