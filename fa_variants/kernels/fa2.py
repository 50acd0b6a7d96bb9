"""Launcher of cuda_src/fa2_fwd.cu: tile sizes per head dim, grid (Q block, head, batch), dynamic shared memory."""
from __future__ import annotations

import numpy as np

from .. import jit
from . import KernelLauncher
from .common import CTYPE, cdiv, check_grid, prepare, scale_log2, tile_lookup

SOURCE = "fa2_fwd.cu"

# head_dim -> (BM rows of Q per CTA, BN keys per K/V block, warps, early prefetch), fastest first; each warp
# owns BM / warps rows. The first that fits the device's shared memory is used (sm_90: the first; sm_80 and
# sm_86/89 have less). Chosen by the sweeps recorded in bench/NOTES.md; "early prefetch" issues the next K/V
# block's loads before the QK^T MMAs rather than after the softmax, which spills registers at d >= 96.
TILES = {
    32: [(128, 64, 4, True)],
    64: [(128, 64, 4, True)],
    96: [(128, 64, 4, False)],
    128: [(128, 64, 4, False), (128, 32, 4, False)],
    256: [(128, 64, 8, True), (64, 32, 4, True), (32, 32, 2, True)],
}


def smem_bytes(d: int, cfg) -> int:
    bm, bn = cfg[:2]
    row = (d + 8) * 2  # padded rows, see Tile<> in common/tile.cuh
    return bm * row + 4 * bn * row  # Q + two stages of K and V


config, tiles = tile_lookup(TILES, smem_bytes)


def instance(ctype: str, d: int, cfg) -> str:
    bm, bn, w, early = cfg
    return f"fa2_fwd<{ctype}, {d}, {bm}, {bn}, {w}, {'true' if early else 'false'}>"


def specializations():
    return tuple(instance(c, d, cfg) for c in CTYPE.values() for d, cfgs in TILES.items() for cfg in cfgs)


def extra_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, itemsize=2, heads_kv=None):
    return 0  # only the output and the LSE


def forward(q, k, v, *, causal, softmax_scale, return_lse):
    L = prepare(q, k, v)
    d = L.head_dim
    cfg = config(d)
    kern = jit.kernel(SOURCE, instance(L.ctype, d, cfg))  # compiled on first use, one instance per module
    smem = smem_bytes(d, cfg)
    kern.max_dynamic_shared_size_bytes = smem
    check_grid(L.heads, "heads")
    check_grid(L.batch, "batch")
    grid = (cdiv(L.seqlen_q, cfg[0]), L.heads, L.batch)
    kern(grid, (32 * cfg[2],), (L.q, L.k, L.v, L.out, L.lse, *L.stride_args(),
                                np.int32(L.seqlen_q), np.int32(L.seqlen_k), np.int32(L.heads),
                                np.int32(L.heads // L.heads_kv), np.float32(scale_log2(softmax_scale)),
                                np.int32(bool(causal))), shared_mem=smem)
    return L.out, (L.lse if return_lse else None)


LAUNCHER = KernelLauncher(sources=lambda: {SOURCE: specializations()}, forward_fn=forward, tiles_fn=tiles,
                          extra_bytes_fn=extra_bytes)
