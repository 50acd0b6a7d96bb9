"""Launcher of cuda_src/fa1_fwd.cu: one CTA per (batch, head), a float32 O/l/m workspace in device memory."""
from __future__ import annotations

from .. import jit
from ..tiles import FA1_TILES, Tile
from . import KernelLauncher
from .common import (CTYPE, PAD_INSTANCES, PAD_SOURCE, cdiv, check_grid, forward_via_plan, fwd_params, given_tile,
                     pick_tiles, template_dim)
from .launch import FwdPlan, function_of

SOURCE = "fa1_fwd.cu"

TILES = FA1_TILES  # by template head dim (fa_variants/tiles.py)


def smem_bytes(d: int, tile) -> int:
    """Mirror of Fa1Smem in fa1_fwd.cu."""
    bm, bn, w = tile
    row16, row32 = (d + 8) * 2, (d + 8) * 4
    return 2 * bn * row16 + 2 * bm * row16 + w * bm * row32 + bm * row32 + 2 * bm * 4 + 2 * w * bm * 4 + (w + 1) * bm * 4


def config(head_dim: int, limit: int | None = None):
    """The tile of the template head_dim pads to: the first of its table whose shared memory fits ``limit``
    (default: this device's)."""
    return pick_tiles(TILES, smem_bytes, template_dim(head_dim), limit)


def tiles(head_dim: int, causal: bool = False, seqlen_k: int | None = None) -> tuple[int, int]:
    tile = config(head_dim)
    return tile.block_q, tile.block_k


def instance(ctype: str, d: int, tile) -> str:
    return f"fa1_fwd<{ctype}, {d}, {tile.block_q}, {tile.block_k}, {tile.warps}>"


def specializations():
    return tuple(instance(c, d, tile) for c in CTYPE.values() for d, cands in TILES.items() for tile in cands)


def workspace_rows(batch: int, heads: int, seqlen_q: int, block_q: int) -> int:
    """Rows of the fp32 O / l / m workspace: every (batch, head)'s rows padded to whole Q blocks."""
    return batch * heads * cdiv(seqlen_q, block_q) * block_q


def extra_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, itemsize=2, heads_kv=None):
    """The fp32 workspace: O (rows padded to the Q block, template head dim columns) plus l and m."""
    return workspace_rows(batch, heads, seqlen_q, config(head_dim).block_q) * (template_dim(head_dim) + 2) * 4


def plan(q, k, v, *, causal, softmax_scale, return_lse, tile=None) -> FwdPlan:
    """The launch of one call signature, for aligned CuPy q, k, v whose head dim is a multiple of 8 (``tile``:
    another tile than the table's). The kernel initializes its workspace itself (Algorithm 1, line 2), so a fresh,
    uninitialized one serves each call."""
    import cupy
    b, nq, h, d = q.shape
    D = template_dim(d)
    tile = config(d) if given_tile(tile, Tile) is None else tile
    kern = jit.kernel(SOURCE, instance(CTYPE[q.dtype.name], D, tile))  # compiled on first use
    smem = smem_bytes(D, tile)
    check_grid(b, "batch")
    return FwdPlan(func=function_of(kern, smem), grid=(h, b, 1), block=32 * tile.warps, smem=smem,
                   template=fwd_params(q, k, v, head_dim=d, causal=causal, softmax_scale=softmax_scale,
                                       out_strides=(nq * h * d, h * d, d)),
                   fmt="<8Q", out_shape=(b, nq, h, d), dtype=q.dtype,
                   lse_shape=(b, h, nq) if return_lse else None, ws_rows=workspace_rows(b, h, nq, tile.block_q),
                   ws_cols=D,
                   device=cupy.cuda.Device().id)


def forward(q, k, v, *, causal, softmax_scale, return_lse):
    return forward_via_plan(plan, q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)


def _sources():
    from . import fa1_bwd
    return {SOURCE: specializations(), PAD_SOURCE: PAD_INSTANCES, fa1_bwd.SOURCE: fa1_bwd.specializations()}


def backward(dout, q, k, v, out, lse, *, causal, softmax_scale):
    """Algorithm 4 on the GPU (kernels/fa1_bwd.py): dQ through fp32 atomic adds, so not bitwise deterministic."""
    from . import fa1_bwd
    return fa1_bwd.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale)


LAUNCHER = KernelLauncher(sources=_sources, forward_fn=forward, tiles_fn=tiles, extra_bytes_fn=extra_bytes,
                          plan_fn=plan, backward_fn=backward,
                          backward_order="varies")
