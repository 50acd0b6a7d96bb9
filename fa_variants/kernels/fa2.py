"""Launcher of cuda_src/fa2_fwd.cu and fa2_fwd_sm90.cu: tile sizes per template head dim, grid (Q block, head,
batch), dynamic shared memory, and the launch plan of one call signature.

One algorithm, two kernels: FlashAttention-2 on mma.sync (sm_80, sm_86, sm_89: the paper's kernel) and the same
loop on Hopper's wgmma (sm_90: its tensor cores reach their rate only through wgmma). FA_VARIANTS_FA2_KERNEL=mma_sync
runs the mma.sync kernel on Hopper too (the instruction change alone, measured; and FA1 against FA2 on one
instruction)."""
from __future__ import annotations

import os

from .. import gpu, jit
from . import KernelLauncher
from .common import (CTYPE, PAD_INSTANCES, PAD_SOURCE, TEMPLATE_DIMS, cdiv, check_grid, forward_via_plan,
                     fwd_params, pick_tiles, template_dim, tile_lookup)
from .launch import FwdPlan, function_of

SOURCE = "fa2_fwd.cu"
SM90_SOURCE = "fa2_fwd_sm90.cu"
SM90_BWD_SOURCE = "fa2_bwd_sm90.cu"  # kernels/fa2_bwd_sm90.py's source (named here for SOURCE_ARCHS)
SOURCE_ARCHS = {SM90_SOURCE: ("sm_90a",), SM90_BWD_SOURCE: ("sm_90a",)}  # wgmma exists only there

# template head_dim -> (BM rows of Q per CTA, BN keys per K/V block, warps, early prefetch), fastest first; each
# warp owns BM / warps rows. The first that fits the device's shared memory is used (sm_90: the first; sm_80 and
# sm_86/89 have less). Chosen by the sweeps recorded in bench/NOTES.md; "early prefetch" issues the next K/V
# block's loads before the QK^T MMAs rather than after the softmax, which spills registers at d >= 96. Above
# d = 128 one warp's 16 rows of O take 4 D / 8 registers a thread, so 8 warps share the 128 rows.
TILES = {
    32: [(128, 64, 4, False)],  # early prefetch spills 4 bytes on sm_80 here
    64: [(128, 64, 4, True)],
    96: [(128, 64, 4, False)],
    128: [(128, 64, 4, False), (128, 32, 4, False)],
    160: [(128, 64, 8, True), (64, 32, 4, True)],
    192: [(128, 64, 8, True), (64, 32, 4, True)],
    224: [(128, 64, 8, True), (64, 32, 4, True), (32, 32, 2, True)],
    256: [(128, 64, 8, True), (64, 32, 4, True), (32, 32, 2, True)],
}
assert tuple(TILES) == TEMPLATE_DIMS


def smem_bytes(d: int, cfg) -> int:
    bm, bn = cfg[:2]
    row = (d + 8) * 2  # padded rows, see Tile<> in common/tile.cuh
    return bm * row + 4 * bn * row  # Q + two stages of K and V


_config = tile_lookup(TILES, smem_bytes)[0]  # the mma.sync kernel's choice at a template dim


# wgmma kernel: template head_dim -> (BM = two warpgroups of 64 rows, BN keys, 8 warps). Its tiles are K-major
# 128-byte swizzled rows of 64, 128 or 256 elements, so other head dims pad to those; n128 key blocks where the O
# accumulator leaves room for the S and P registers (d = 256: 128 of O, so n64).
SM90_TILES = {64: [(128, 128, 8)], 128: [(128, 128, 8)], 256: [(128, 64, 8)]}
SM90_DIMS = tuple(SM90_TILES)


def uses_wgmma() -> bool:
    """Whether this device runs the wgmma kernel: sm_90 (and no device at all: the IO model describes the H200)."""
    if os.environ.get("FA_VARIANTS_FA2_KERNEL", "").replace(".", "_") == "mma_sync":
        return False
    cc = gpu.compute_capability()
    return cc is None or cc == 90


def sm90_smem_bytes(d: int, cfg) -> int:
    bm, bn = cfg[:2]
    return 1024 + bm * 2 * d + 2 * 2 * bn * 2 * d  # unpadded swizzled Q, two stages of K and V, 1 KB alignment


def kernel_dim(head_dim: int) -> int:
    """The template head dim of the kernel this device runs."""
    return template_dim(head_dim, SM90_DIMS) if uses_wgmma() else template_dim(head_dim)


def config(head_dim, limit=None):
    """(BM, BN, warps[, early prefetch]) of the kernel this device runs, at the template dim head_dim pads to."""
    if uses_wgmma():
        return pick_tiles(SM90_TILES, sm90_smem_bytes, kernel_dim(head_dim), limit)
    return _config(template_dim(head_dim), limit)


def tiles(head_dim, limit=None):
    return config(head_dim, limit)[:2]


def instance(ctype: str, d: int, cfg, epilogue: str = "") -> str:
    bm, bn, w, early = cfg
    epi = f", {epilogue}" if epilogue else ""
    return f"fa2_fwd<{ctype}, {d}, {bm}, {bn}, {w}, {'true' if early else 'false'}{epi}>"


def sm90_instance(ctype: str, d: int, cfg) -> str:
    return f"fa2_fwd_sm90<{ctype}, {d}, {cfg[1]}>"


def specializations():
    return tuple(instance(c, d, cfg) for c in CTYPE.values() for d, cfgs in TILES.items() for cfg in cfgs) + \
        tuple(instance(c, 64, TILES[64][0], "fav::PartialOut<64>") for c in CTYPE.values())


SOURCES = {SM90_SOURCE: tuple(sm90_instance(c, d, cfg) for c in CTYPE.values()
                              for d, cfgs in SM90_TILES.items() for cfg in cfgs),
           PAD_SOURCE: PAD_INSTANCES}


def extra_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, itemsize=2, heads_kv=None):
    return 0  # only the output and the LSE


def plan(q, k, v, *, causal, softmax_scale, return_lse, kv_blocks=(0, None), epilogue="", kernel=None) -> FwdPlan:
    """The launch of one call signature, for aligned CuPy q, k, v whose head dim is a multiple of 8.
    ``kv_blocks``/``epilogue``: a [begin, end) range of K/V blocks into a split-KV partial (PartialOut).
    ``kernel``: "mma_sync" or "wgmma" instead of this device's choice (the benchmark times both on Hopper)."""
    import cupy
    b, nq, h, d = q.shape
    wgmma = uses_wgmma() if kernel is None else kernel == "wgmma"
    if wgmma and not epilogue:
        D = template_dim(d, SM90_DIMS)
        cfg = pick_tiles(SM90_TILES, sm90_smem_bytes, D)
        kern = jit.kernel(SM90_SOURCE, sm90_instance(CTYPE[q.dtype.name], D, cfg))
        smem = sm90_smem_bytes(D, cfg)
    else:  # the mma.sync kernel (and every split-KV partial: PartialOut is instantiated there)
        D = template_dim(d)
        cfg = _config(D)
        kern = jit.kernel(SOURCE, instance(CTYPE[q.dtype.name], D, cfg, epilogue))  # compiled on first use
        smem = smem_bytes(D, cfg)
    check_grid(h, "heads")
    check_grid(b, "batch")
    out_strides = (nq * h * d, h * d, d)
    return FwdPlan(func=function_of(kern, smem), grid=(cdiv(nq, cfg[0]), h, b), block=32 * cfg[2], smem=smem,
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
    return _config(64)[1]


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
    from . import fa2_bwd, fa2_bwd_sm90
    return {SOURCE: specializations(), **SOURCES, fa2_bwd.SOURCE: fa2_bwd.specializations(),
            fa2_bwd_sm90.SOURCE: fa2_bwd_sm90.specializations()}


def backward(dout, q, k, v, out, lse, *, causal, softmax_scale):
    """fa2_bwd_sm90 (wgmma) where the forward runs on wgmma and it takes the head dim, else fa2_bwd (mma.sync;
    FA_VARIANTS_FA2_KERNEL=mma_sync forces it, as it does the forward)."""
    from . import fa2_bwd, fa2_bwd_sm90
    mod = fa2_bwd_sm90 if uses_wgmma() and fa2_bwd_sm90.supports(q.shape[3]) else fa2_bwd
    return mod.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale)


LAUNCHER = KernelLauncher(sources=_sources, forward_fn=forward,
                          tiles_fn=tiles, extra_bytes_fn=extra_bytes, source_archs=SOURCE_ARCHS, plan_fn=plan,
                          backward_fn=backward)
