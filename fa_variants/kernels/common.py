"""What the fa1 and fa2 launchers share: dtype dispatch, 16-byte alignment, strides, output allocation."""
from __future__ import annotations

import dataclasses
import math

from .. import arrays

LOG2E = 1.4426950408889634
CTYPE = {"float16": "fav::Half", "bfloat16": "fav::BFloat16"}


def ensure_vector_aligned(a):
    """The kernels copy 16 bytes at a time: pointer and outer strides must be multiples of 8 elements.
    Anything else (rare: odd slicing) is copied once into a contiguous array; the caller's array is untouched."""
    import cupy
    return a if arrays.aligned_for_vector_loads(a) else cupy.ascontiguousarray(a)


@dataclasses.dataclass
class Launch:
    q: object
    k: object
    v: object
    out: object
    lse: object
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_kv: int
    head_dim: int

    @property
    def ctype(self) -> str:
        return CTYPE[arrays.dtype_name(self.q.dtype)]

    def stride_args(self):
        """Element strides (batch, seqlen, head) of q, k, v as int64 kernel arguments."""
        import numpy as np
        out = []
        for a in (self.q, self.k, self.v):
            out += [np.int64(s // a.dtype.itemsize) for s in a.strides[:3]]
        return out


def prepare(q, k, v, return_lse: bool) -> Launch:
    """Align inputs, allocate O (q's shape, contiguous) and the float32 LSE (always written: the kernels need
    somewhere to put it; only returned when asked)."""
    import cupy
    q, k, v = (ensure_vector_aligned(a) for a in (q, k, v))
    b, nq, h, d = q.shape
    out = cupy.empty((b, nq, h, d), dtype=q.dtype)
    lse = cupy.empty((b, h, nq), dtype=cupy.float32)
    return Launch(q, k, v, out, lse, b, nq, k.shape[1], h, k.shape[2], d)


def scale_log2(softmax_scale: float) -> float:
    return softmax_scale * LOG2E


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_grid(n: int, what: str):
    if n > 65535:
        raise ValueError(f"{what} = {n} exceeds the CUDA grid limit of 65535")
