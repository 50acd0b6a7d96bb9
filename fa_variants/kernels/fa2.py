"""Launcher of cuda_src/fa2_fwd.cu and fa2_fwd_sm90.cu: the tile per template head dim (fa_variants/tiles.py), grid
(Q block, head, batch), dynamic shared memory, and the launch plan of one call signature.

One algorithm, two kernels: FlashAttention-2 on mma.sync (sm_80, sm_86, sm_89: the paper's kernel) and the same
loop on Hopper's wgmma (sm_90: its tensor cores reach their rate only through wgmma). ``plan(..., kernel=
"mma_sync")`` runs the mma.sync kernel on Hopper too (the instruction change alone, measured; and FA1 against FA2
on one instruction)."""
from __future__ import annotations

from .. import jit
from ..tiles import FA2_TILES, FA2_WGMMA_TILES, Fa2Tile, Tile
from . import KernelLauncher
from .common import (CTYPE, PAD_INSTANCES, PAD_SOURCE, cdiv, check_grid, choose_kernel, forward_via_plan, fwd_params,
                     given_tile, pick_tiles, template_dim, wgmma_device)
from .launch import FwdPlan, function_of

SOURCE = "fa2_fwd.cu"
SM90_SOURCE = "fa2_fwd_sm90.cu"
SM90_BWD_SOURCE = "fa2_bwd_sm90.cu"  # kernels/fa2_bwd_sm90.py's source (named here for SOURCE_ARCHS)
SOURCE_ARCHS = {SM90_SOURCE: ("sm_90a",), SM90_BWD_SOURCE: ("sm_90a",)}  # wgmma exists only there

TILES = FA2_TILES              # the mma.sync kernel's, by template head dim (fa_variants/tiles.py)
SM90_TILES = FA2_WGMMA_TILES   # the wgmma kernel's
SM90_DIMS = tuple(SM90_TILES)


def smem_bytes(d: int, tile) -> int:
    row = (d + 8) * 2  # padded rows, see Tile<> in common/tile.cuh
    return tile.block_q * row + 4 * tile.block_k * row  # Q + two stages of K and V


def sm90_smem_bytes(d: int, tile) -> int:
    # unpadded swizzled Q, two stages of K and V, 1 KB alignment
    return 1024 + tile.block_q * 2 * d + 2 * 2 * tile.block_k * 2 * d


uses_wgmma = wgmma_device  # whether this device runs the wgmma kernel (a GPU test patches it to run mma.sync)


def kernel_of(kernel: str | None = None) -> str:
    """``kernel`` ("wgmma" or "mma_sync", checked), or the one this device runs where None."""
    return choose_kernel(kernel, uses_wgmma())


def kernel_dim(head_dim: int, kernel: str | None = None) -> int:
    """The template head dim of ``kernel`` (default: this device's)."""
    return template_dim(head_dim, SM90_DIMS) if kernel_of(kernel) == "wgmma" else template_dim(head_dim)


def config(head_dim: int, limit: int | None = None, kernel: str | None = None):
    """The tile of ``kernel`` (default: this device's) at the template dim head_dim pads to: the first of its table
    whose shared memory fits ``limit`` (default: this device's)."""
    d = kernel_dim(head_dim, kernel)
    if kernel_of(kernel) == "wgmma":
        return pick_tiles(SM90_TILES, sm90_smem_bytes, d, limit)
    return pick_tiles(TILES, smem_bytes, d, limit)


def tiles(head_dim: int, causal: bool = False, seqlen_k: int | None = None) -> tuple[int, int]:
    tile = config(head_dim)
    return tile.block_q, tile.block_k


def instance(ctype: str, d: int, tile, epilogue: str = "") -> str:
    epi = f", {epilogue}" if epilogue else ""
    return (f"fa2_fwd<{ctype}, {d}, {tile.block_q}, {tile.block_k}, {tile.warps}, "
            f"{'true' if tile.early_prefetch else 'false'}{epi}>")


def sm90_instance(ctype: str, d: int, tile) -> str:
    return f"fa2_fwd_sm90<{ctype}, {d}, {tile.block_k}>"


def launch_of(dtype: str, head_dim: int, kernel: str | None = None, epilogue: str = "", tile=None) -> tuple:
    """(source, instance, tile, dynamic shared memory) that a call of ``head_dim`` launches on ``kernel`` (default:
    this device's; every split-KV partial on mma.sync, where PartialOut is instantiated); ``tile``: another tile
    than the table's (a tile sweep's)."""
    kernel = "mma_sync" if epilogue else kernel_of(kernel)
    d = kernel_dim(head_dim, kernel)
    if given_tile(tile, Tile if kernel == "wgmma" else Fa2Tile) is None:
        tile = config(head_dim, kernel=kernel)
    if kernel == "wgmma":
        return SM90_SOURCE, sm90_instance(CTYPE[dtype], d, tile), tile, sm90_smem_bytes(d, tile)
    return SOURCE, instance(CTYPE[dtype], d, tile, epilogue), tile, smem_bytes(d, tile)


def specializations():
    return tuple(instance(c, d, tile) for c in CTYPE.values() for d, cands in TILES.items() for tile in cands) + \
        tuple(instance(c, 64, TILES[64][0], "fav::PartialOut<64>") for c in CTYPE.values())


SOURCES = {SM90_SOURCE: tuple(sm90_instance(c, d, tile) for c in CTYPE.values()
                              for d, cands in SM90_TILES.items() for tile in cands),
           PAD_SOURCE: PAD_INSTANCES}


def extra_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, itemsize=2, heads_kv=None):
    return 0  # only the output and the LSE


def plan(q, k, v, *, causal, softmax_scale, return_lse, kv_blocks=(0, None), epilogue="", kernel=None,
         tile=None) -> FwdPlan:
    """The launch of one call signature, for aligned CuPy q, k, v whose head dim is a multiple of 8.
    ``kv_blocks``/``epilogue``: a [begin, end) range of K/V blocks into a split-KV partial (PartialOut).
    ``kernel``: "mma_sync" or "wgmma" instead of this device's choice (the benchmark times both on Hopper);
    ``tile``: another tile than the table's."""
    import cupy
    b, nq, h, d = q.shape
    source, name, tile, smem = launch_of(q.dtype.name, d, kernel, epilogue, tile)
    check_grid(h, "heads")
    check_grid(b, "batch")
    out_strides = (nq * h * d, h * d, d)
    return FwdPlan(func=function_of(jit.kernel(source, name), smem), grid=(cdiv(nq, tile.block_q), h, b),
                   block=32 * tile.warps, smem=smem,
                   template=fwd_params(q, k, v, head_dim=d, causal=causal, softmax_scale=softmax_scale,
                                       out_strides=out_strides, kv_blocks=kv_blocks),
                   fmt="<8Q", out_shape=(b, nq, h, d), dtype=q.dtype,
                   lse_shape=(b, h, nq) if return_lse else None, ws_rows=0, ws_cols=0,
                   device=cupy.cuda.Device().id)


def forward(q, k, v, *, causal, softmax_scale, return_lse):
    return forward_via_plan(plan, q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)


def forward_partial(q, k, v, *, causal, softmax_scale, kv_blocks):
    """One split of a split-KV forward on the mma.sync kernel (aligned q, k, v with head_dim 64): K/V blocks
    [begin, end) of ``partial_block_k()`` keys into (unnormalized O (B, H, Nq, 64) float32, m (B, H, Nq) in log2 units, l (B, H, Nq)),
    the PartialOut epilogue's layout. ``merge_partials`` combines splits."""
    import cupy
    b, nq, h, d = q.shape
    if d != 64:
        raise ValueError(f"forward_partial is instantiated for head_dim 64, got {d}")
    p = plan(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=False, kv_blocks=kv_blocks,
             epilogue="fav::PartialOut<64>")
    o = cupy.empty((b, h, nq, 64), cupy.float32)
    m = cupy.empty((b, h, nq), cupy.float32)
    lsum = cupy.empty((b, h, nq), cupy.float32)
    from .launch import launch
    launch(p.func, p.grid, p.block, p.smem, cupy.cuda.get_current_stream().ptr, p.template, p.fmt,
           q.data.ptr, k.data.ptr, v.data.ptr, 0, 0, o.data.ptr, lsum.data.ptr, m.data.ptr)
    return o, m, lsum


def partial_block_k() -> int:
    """Keys per K/V block of forward_partial's kernel: the unit of its [begin, end) ranges."""
    return config(64, kernel="mma_sync").block_k


def merge_partials(parts, dtype):
    """Split-KV's combine: (out (B, Nq, H, d) in ``dtype``, lse (B, H, Nq)) from [(o, m, l), ...] of
    ``forward_partial``. Each split is rescaled by 2^(m_split - m_max); rows no split saw give 0 and -inf."""
    import cupy
    m_max = cupy.max(cupy.stack([m for _, m, _ in parts]), axis=0)
    ref = cupy.where(cupy.isneginf(m_max), 0.0, m_max)
    num, den = 0.0, 0.0
    for o, m, lsum in parts:
        w = cupy.exp2(m - ref)
        num = num + o * w[..., None]
        den = den + lsum * w
    seen = ~(den <= 0)  # a NaN sum stays NaN (epilogue.cuh's rule); only a row no key reached is zero
    out = cupy.where(seen[..., None], num / cupy.where(seen, den, 1.0)[..., None], 0.0)
    lse = cupy.where(seen, (ref + cupy.log2(cupy.where(seen, den, 1.0))) * 0.6931471805599453, -cupy.inf)
    return out.transpose(0, 2, 1, 3).astype(dtype), lse.astype(cupy.float32)


def _sources():
    from . import fa2_bwd, fa2_bwd_sm90, fa2_masked
    return {SOURCE: specializations() + fa2_masked.specializations(), **SOURCES, fa2_bwd.SOURCE: fa2_bwd.specializations(),
            fa2_bwd_sm90.SOURCE: fa2_bwd_sm90.specializations()}


def backward(dout, q, k, v, out, lse, *, causal, softmax_scale, kernel=None):
    """fa2_bwd_sm90 (wgmma) where the forward runs on wgmma and it takes the head dim, else fa2_bwd (mma.sync).
    ``kernel``: "mma_sync" or "wgmma" instead of this device's choice, as ``plan``'s."""
    from . import fa2_bwd, fa2_bwd_sm90
    mod = fa2_bwd_sm90 if kernel_of(kernel) == "wgmma" and fa2_bwd_sm90.supports(q.shape[3]) else fa2_bwd
    return mod.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale)


LAUNCHER = KernelLauncher(sources=_sources, forward_fn=forward,
                          tiles_fn=tiles, extra_bytes_fn=extra_bytes, source_archs=SOURCE_ARCHS, plan_fn=plan,
                          backward_fn=backward)
