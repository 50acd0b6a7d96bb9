"""What the fa1 and fa2 launchers share: dtype dispatch, 16-byte alignment, strides, output allocation."""
from __future__ import annotations

import dataclasses

from .. import arrays

LOG2E = 1.4426950408889634
CTYPE = {"float16": "fav::Half", "bfloat16": "fav::BFloat16"}


def ensure_vector_aligned(a):
    """The kernels copy 16 bytes at a time: pointer and outer strides must be multiples of 8 elements.
    Anything else (rare: odd slicing) is copied once into a fresh, aligned array; the caller's array is untouched.
    (A copy, not ascontiguousarray: that returns an already-contiguous array with a misaligned base as it is.)"""
    return a if arrays.aligned_for_vector_loads(a) else a.copy()


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


def prepare(q, k, v) -> Launch:
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


SM90_SMEM = 227 * 1024  # opt-in shared memory per block: sm_90 227 KB, sm_80 163 KB, sm_86/89 99 KB


def smem_limit() -> int:
    """Opt-in shared memory per block of the current device (the sm_90 figure when there is none).
    FA_VARIANTS_SMEM_LIMIT overrides it: run the tile choices of a smaller GPU (sm_80, sm_86) on a bigger one."""
    import os
    if os.environ.get("FA_VARIANTS_SMEM_LIMIT"):
        return int(os.environ["FA_VARIANTS_SMEM_LIMIT"])
    try:
        import cupy
        return int(cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
    except Exception:  # noqa: BLE001 - no device: describe the H200 configuration
        return SM90_SMEM


def pick_tiles(candidates, smem_bytes, head_dim: int, limit: int | None = None):
    """The first (BM, BN, warps) of ``candidates[head_dim]`` (fastest first) whose shared memory fits ``limit``."""
    limit = smem_limit() if limit is None else limit
    for cfg in candidates[head_dim]:
        if smem_bytes(head_dim, cfg) <= limit:
            return cfg
    raise ValueError(f"no tile configuration for head_dim {head_dim} fits {limit} bytes of shared memory")


def tile_lookup(candidates: dict, smem_bytes):
    """(config, tiles) for a launcher: config(d) is the full tile tuple the device takes (pick_tiles), tiles(d)
    its (block_q, block_k) for the IO model. ``candidates`` is read at each call, so edits to it take effect."""
    def config(head_dim, limit=None):
        return pick_tiles(candidates, smem_bytes, head_dim, limit)

    def tiles(head_dim, limit=None):
        return config(head_dim, limit)[:2]

    return config, tiles
