"""Launcher of cuda_src/fa1_fwd.cu: one CTA per (batch, head), a float32 O/l/m workspace in device memory."""
from __future__ import annotations

import numpy as np

from .. import jit
from . import KernelLauncher
from .common import CTYPE, cdiv, check_grid, prepare, scale_log2, tile_lookup

SOURCE = "fa1_fwd.cu"

# head_dim -> (BM rows per Q block, BN keys per K/V block, warps), fastest first. The warps split BN (split-K),
# so each holds a BM x (BN / warps) score block and a BM x d partial P~V: BM shrinks as d grows to keep that in
# registers. The first that fits the device's shared memory is used (sm_90 first; then sm_80, sm_86/89).
TILES = {
    32: [(64, 128, 4)],
    64: [(32, 128, 4), (32, 64, 4)],
    96: [(32, 128, 4), (16, 64, 4)],
    128: [(32, 128, 4), (32, 64, 4), (16, 64, 4)],
    256: [(16, 64, 4), (16, 32, 2), (16, 16, 1)],
}


def smem_bytes(d: int, cfg) -> int:
    """Mirror of Fa1Smem in fa1_fwd.cu."""
    bm, bn, w = cfg
    row16, row32 = (d + 8) * 2, (d + 8) * 4
    return 2 * bn * row16 + 2 * bm * row16 + w * bm * row32 + bm * row32 + 2 * bm * 4 + 2 * w * bm * 4 + (w + 1) * bm * 4


config, tiles = tile_lookup(TILES, smem_bytes)


def instance(ctype: str, d: int, cfg) -> str:
    bm, bn, w = cfg
    return f"fa1_fwd<{ctype}, {d}, {bm}, {bn}, {w}>"


def specializations():
    return tuple(instance(c, d, cfg) for c in CTYPE.values() for d, cfgs in TILES.items() for cfg in cfgs)


def extra_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, itemsize=2, heads_kv=None):
    """The fp32 workspace: O (rows padded to the Q block) plus l and m."""
    bm = config(head_dim)[0]
    rows = cdiv(seqlen_q, bm) * bm
    return batch * heads * rows * (head_dim + 2) * 4


def forward(q, k, v, *, causal, softmax_scale, return_lse):
    import cupy

    L = prepare(q, k, v)
    d = L.head_dim
    cfg = config(d)
    bm, _, warps = cfg
    rows = cdiv(L.seqlen_q, bm) * bm
    o_ws = cupy.empty((L.batch * L.heads, rows, d), dtype=cupy.float32)  # the kernel initializes it (Alg. 1 line 2)
    l_ws = cupy.empty((L.batch * L.heads, rows), dtype=cupy.float32)
    m_ws = cupy.empty((L.batch * L.heads, rows), dtype=cupy.float32)
    kern = jit.kernel(SOURCE, instance(L.ctype, d, cfg))  # compiled on first use, one instance per module
    smem = smem_bytes(d, cfg)
    kern.max_dynamic_shared_size_bytes = smem
    check_grid(L.batch, "batch")
    kern((L.heads, L.batch), (32 * warps,), (L.q, L.k, L.v, L.out, L.lse, o_ws, l_ws, m_ws, *L.stride_args(),
                                              np.int32(L.seqlen_q), np.int32(L.seqlen_k), np.int32(L.heads),
                                              np.int32(L.heads // L.heads_kv), np.float32(scale_log2(softmax_scale)),
                                              np.int32(bool(causal))), shared_mem=smem)
    return L.out, (L.lse if return_lse else None)


LAUNCHER = KernelLauncher(sources=lambda: {SOURCE: specializations()}, forward_fn=forward, tiles_fn=tiles,
                          extra_bytes_fn=extra_bytes)
