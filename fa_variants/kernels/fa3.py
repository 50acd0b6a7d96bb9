"""Launcher of cuda_src/fa3_fwd.cu (FlashAttention-3 forward, sm_90a only): tiles per template head dim, TMA
tensor maps (kernels/tma.py), grid (Q block, head, batch), a producer warpgroup and BM / 64 consumer warpgroups,
and the launch plan of one call signature.

A plan keeps the three tensor maps encoded for the call signature and patches this call's addresses into them,
so a warm call is still one cuLaunchKernel (with four parameters: the maps of q, k and v, and FwdParams).
``plan(..., pingpong=False)`` / ``overlap=False`` run the ablation's instances (bench/ablation.py).
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import struct

import numpy as np

from .. import jit
from . import KernelLauncher
from .common import (CTYPE, PAD_INSTANCES, PAD_SOURCE, SM90_SMEM, cdiv, forward_via_plan, fwd_params, sm_count,
                     template_dim)
from .launch import _cupy, _torch, function_of, launch_argv
from .params import FWD
from .tma import MapTemplate

SOURCE = "fa3_fwd.cu"
ARCHS = ("sm_90a",)
# template head_dim -> [(BM query rows = 64 per consumer warpgroup, BN keys per K/V block, K/V ring stages,
# ping-pong on, persistent grid on)], the first being used (devcheck.py --tiles swaps it for a sweep:
# 'fa3:64=192,128,2,1,0'). Wide key
# blocks amortize each block's fixed work (barrier waits, row max, O rescale) where O (D / 2 registers a thread)
# leaves room for S, P and the next S: n176 at d = 128 (FA3's tile), n80 at d = 256 (O takes 128; two stages of
# K and V at n80 are 224 KB of the 227). d = 64: three consumers (BM = 192) keep the tensor cores fed where a
# block's GEMMs are short next to its softmax. Chosen by the sweeps in bench/NOTES.md (wgmma_n.cuh: n80, n176).
TILES = {64: [(192, 128, 2, 1, 0)], 128: [(128, 176, 2, 1, 0)], 256: [(128, 80, 2, 1, 0)]}
DIMS = tuple(TILES)
# The persistent grid (one CTA per SM taking tiles from a counter) against one CTA per tile, by template dim, as
# (causal, non-causal): it wins up to this seqlen_k (short tiles: the next tile's loads hide under this one's end
# instead of a new CTA's start; d 64 N 1K +12 %, N 2K +7 %; bench/RESULTS.md, fourth session). Non-causal at every
# length since its tiles pipeline across tiles (PERSISTENT_TILES, tenth session) and its last wave is split: d 128
# N 8K +1.5 %, 16K +5 % over the persistent grid unsplit, which was level with one CTA per tile; d 64 N 16K +5 % over
# one CTA per tile (fourteenth session). Causal d 64 at every length too: at N 16K it lost 1-5 % in the fourth
# session, and won +1.1 % (bf16) / +0.7 % (fp16) in three alternating rounds of the twenty-second, with the
# cross-tile pipeline since. A tile table entry's own flag (a sweep's) overrides it.
PERSISTENT_UP_TO = {64: (1 << 30, 1 << 30), 128: (1 << 30, 1 << 30), 256: (0, 0)}
# Where the persistent grid runs at d 128 (non-causal), 160-key blocks: with them a second Q buffer fits beside
# the ring, so the grid pipelines across tiles (fa3_fwd.cu's CROSS; 176 does not fit): +2-4 % over one CTA per
# tile at N 2K-4K, level at 8K-16K (bench/NOTES.md, tenth session).
PERSISTENT_TILES = {128: (128, 160, 2, 1, 1)}
# Causal rows' own tiles where they differ (FA3's choice too): at d 128, 128-key blocks waste less of the diagonal
# block than 176 and measured +4 % at N 2K, +2 % at N 4K (bench/RESULTS.md, fourth session); on the persistent
# grid at every length (its heavy-first order and the cross-tile pipeline: +1-3 % at N 4K-16K, tenth session).
# A sweep of causal shapes overrides this table ('fa3.CAUSAL_TILES:128=...'), not TILES.
CAUSAL_TILES = {128: [(128, 128, 2, 1, 1)]}
# Causal calls up to a seqlen_k take these tiles instead: at d 256, 64-key blocks up to N 2K, where the consumers
# skip the diagonal blocks their own rows do not see and 64 keys leave less masked work than 80 (+1.7 % at
# N 2K, level at 4K, -1 % at 8K; bench/NOTES.md, eleventh session).
CAUSAL_SHORT_TILES = {256: (2048, (128, 64, 2, 1, 0))}
# Non-causal calls up to a seqlen_k take these: at N 1K, 160-key blocks leave 64 keys in a tile's 7th block, which
# runs at 128 (TAIL_BN); 128-key blocks leave none (d 128 on the persistent grid: +4.0 % bf16, +4.6 % fp16 at N 1K,
# -0.6 % at 2K). d 256 at N 1K: 64-key blocks, none left, against 80 with 64 keys in the 13th block (+1.2-1.5 %;
# level at 2K; bench/NOTES.md, fifteenth session).
SHORT_TILES = {128: (1024, (128, 128, 2, 1, 1)), 256: (1024, (128, 64, 2, 1, 0))}
# The persistent grid's last wave spread over every SM (fa3_fwd.cu's SPLIT, where O leaves by TMA; non-causal,
# whose tiles are equal): the last tiles % CTAs tiles, cut along their K/V blocks into one range per CTA, each tile
# into at most MAX_PIECES pieces, where the last wave leaves at least 1 / 8 of the SMs idle and a tile has at least
# SPLIT_MIN_BLOCKS blocks (a piece has a fixed cost: its first S alone, its partial's round trip; at d 128 N 2K, 13
# blocks, the split lost 1 %, at N 4K-16K it gained 1-5 %: bench/NOTES.md, fourteenth session).
# FA_VARIANTS_FA3_SPLIT=0 turns it off, 1 on wherever it can run (the GPU tests' small shapes).
MAX_PIECES = 4
SPLIT_MIN_BLOCKS = 20


def tail_split(tiles: int, ctas: int, kv_blocks: int, causal: bool, tma_out: bool) -> tuple:
    """(tail_tiles, tail_blocks, tail_ranges) of FwdParams: the last wave's tiles and the ranges of K/V blocks
    they are cut into, or (0, 0, 0) for no split."""
    flag = os.environ.get("FA_VARIANTS_FA3_SPLIT", "").strip()
    if flag not in ("", "0", "1"):
        raise ValueError(f"FA_VARIANTS_FA3_SPLIT must be 0 or 1, got {flag!r}")
    if causal or not tma_out or flag == "0" or (flag == "" and kv_blocks < SPLIT_MIN_BLOCKS):
        return (0, 0, 0)
    last = tiles % ctas
    if tiles <= ctas or last == 0 or (flag == "" and 8 * last > 7 * ctas):
        return (0, 0, 0)
    blocks = max(cdiv(last * kv_blocks, ctas), cdiv(kv_blocks, MAX_PIECES))
    if blocks >= kv_blocks:
        return (0, 0, 0)
    return (last, blocks, cdiv(last * kv_blocks, blocks))


def workspace_bytes(d: int, cfg, tail: tuple) -> int:
    """The split tail's partials: per consumer thread D / 8 float4 of O and one of m and l; per range at most two
    pieces."""
    return tail[2] * 2 * (cfg[0] // 64) * 128 * (d // 8 + 1) * 16


def out_map(ptr: int, b: int, nq: int, h: int, d: int) -> MapTemplate:
    """The tensor map of a 16-bit output as run_cupy / run_torch allocate it (contiguous (b, nq, h, d)), in boxes
    of one consumer's 64 rows; made at any 16-byte aligned address (the launch patches in out's)."""
    return MapTemplate(ptr, (b, nq, h, d), (nq * h * d * 2, h * d * 2, d * 2), 2, 64, "out")


def _stream_buffer(cache: dict, device: int, stream: int, nbytes: int, zero: bool = False) -> int:
    """The address of at least ``nbytes`` of device memory kept in ``cache`` for launches on ``stream``: one
    buffer per stream, since launches on one stream run one after another while two kernels sharing one at once
    would clash. Its own cudaMalloc, not the current allocator's: a pool that goes away (a test's, a user's) would
    free a buffer this cache still hands out. ``zero``: zeroed on that stream when allocated (so before its first
    launch, with no host wait)."""
    key = (device, stream)
    if key not in cache or cache[key].size < nbytes:
        import cupy
        with cupy.cuda.Device(device):
            buf = cupy.cuda.memory.Memory(nbytes)
            if zero:
                cupy.cuda.runtime.memsetAsync(buf.ptr, 0, nbytes, stream)
        cache[key] = buf
    return cache[key].ptr


_WORKSPACES: dict = {}  # (device, stream) -> Memory: the split tail's partials (fp32), the largest asked for


def split_workspace(device: int, stream: int, nbytes: int) -> int:
    """The address of at least ``nbytes`` for the split tail's partials of launches on ``stream``."""
    return _stream_buffer(_WORKSPACES, device, stream, nbytes)


# The FA3 paper's ablation (Table 2) at d = 128: instances with ping-pong and/or the intra-warpgroup overlap off.
ABLATION_DIM = 128
ABLATIONS = ((False, True), (True, False), (False, False), (True, True))  # (pingpong, overlap)


def as_persistent(d: int, cfg, causal: bool = False) -> tuple:
    """A tile table entry as the persistent grid runs it: itself if it is a persistent entry already, else
    PERSISTENT_TILES' entry where there is one."""
    if persistent(cfg):
        return tuple(cfg)
    if not causal and d in PERSISTENT_TILES:
        return tuple(PERSISTENT_TILES[d])
    return tuple(cfg[:4]) + (1,)


def config(d: int, seqlen_k: int | None = None, causal: bool = False):
    """The tile table's first entry at template dim d (CAUSAL_TILES' for causal calls; CAUSAL_SHORT_TILES' or
    SHORT_TILES' up to their seqlen_k), run on the persistent grid
    (as_persistent) up to PERSISTENT_UP_TO[d] (its causal or its non-causal limit) unless the entry sets its flag;
    FA_VARIANTS_FA3_PERSISTENT=0 or 1 forces either grid (call fav.clear_plans() after changing it)."""
    entry = (CAUSAL_TILES if causal and d in CAUSAL_TILES else TILES)[d][0]
    short = (CAUSAL_SHORT_TILES if causal else SHORT_TILES).get(d)
    if short and seqlen_k is not None and seqlen_k <= short[0]:
        entry = short[1]
    cfg = tuple(entry) + (0,) * (5 - len(entry))
    flag = os.environ.get("FA_VARIANTS_FA3_PERSISTENT", "").strip()
    if flag:
        if flag not in ("0", "1"):
            raise ValueError(f"FA_VARIANTS_FA3_PERSISTENT must be 0 or 1, got {flag!r}")
        return as_persistent(d, cfg, causal) if flag == "1" else cfg[:4] + (0,)
    if seqlen_k is not None and not cfg[4] and seqlen_k <= PERSISTENT_UP_TO[d][0 if causal else 1]:
        return as_persistent(d, cfg, causal)
    return cfg


def threads(cfg) -> int:
    return 128 * (1 + cfg[0] // 64)


def _bars(stages: int) -> int:
    # mbarriers: Q full/empty (two slots each), K/V full/empty per stage, tile full/empty per slot; two tile slots
    return 8 * (8 + 4 * stages) + 8


def _layout_bytes(d: int, cfg, itemsize: int, q_bufs: int) -> int:
    # alignment, the Q buffers, the K/V ring (fp8: K and V^T, one byte an element), the mbarriers and tile slots
    bm, bn, stages = cfg[:3]
    return 1024 + q_bufs * bm * itemsize * d + stages * 2 * bn * itemsize * d + _bars(stages)


def q_buffers(d: int, cfg, itemsize: int = 2, overlap: bool = True) -> int:
    """Q buffers of an instance: two where the persistent grid pipelines across tiles (fa3_fwd.cu's CROSS: the
    intra-warpgroup overlap on and a second Q buffer fits in sm_90's opt-in shared memory, tma.cuh's
    MAX_DYNAMIC_SMEM), else one. The kernel decides the same way and traps if given less than its layout needs."""
    return 2 if persistent(cfg) and overlap and _layout_bytes(d, cfg, itemsize, 2) <= SM90_SMEM else 1


def o_buffer_bytes(d: int, cfg) -> int:
    """fa3_fp8's O buffer: BM rows of 16-bit O (twice Q's e4m3 rows, so O cannot go out through Q's buffer)."""
    return cfg[0] * 2 * d


def stores_o_by_tma(d: int, cfg, overlap: bool = True, itemsize: int = 2) -> bool:
    """Whether an instance stores O by TMA (fa3_fwd.cu's TMA_OUT: where the persistent grid pipelines across
    tiles; 16-bit O over its Q buffers, fa3_fp8's through a buffer of its own where that fits too); it then takes
    a tensor map of the output."""
    if q_buffers(d, cfg, itemsize, overlap) != 2:
        return False
    return itemsize == 2 or _layout_bytes(d, cfg, itemsize, 2) + o_buffer_bytes(d, cfg) <= SM90_SMEM


def smem_bytes(d: int, cfg, itemsize: int = 2, overlap: bool = True) -> int:
    """Alignment, the Q buffers, fa3_fp8's O buffer, the K/V ring (fp8: K and V^T, one byte an element), the
    mbarriers and the persistent grid's two tile slots."""
    o_buf = o_buffer_bytes(d, cfg) if itemsize == 1 and stores_o_by_tma(d, cfg, overlap, itemsize) else 0
    return _layout_bytes(d, cfg, itemsize, q_buffers(d, cfg, itemsize, overlap)) + o_buf


def tiles(head_dim, limit=None):
    return config(template_dim(head_dim, DIMS))[:2]


def causal_tiles(head_dim):
    return config(template_dim(head_dim, DIMS), causal=True)[:2]


def instance(ctype: str, d: int, pingpong: bool | None = None, overlap: bool = True, cfg=None,
             fp8: bool = False) -> str:
    cfg = config(d) if cfg is None else tuple(cfg) + (0,) * (5 - len(cfg))
    bm, bn, stages, pp, pers = cfg
    pingpong = bool(pp) if pingpong is None else pingpong
    fp8_arg = ", true" if fp8 else ""  # the 16-bit instances keep their names (and cache keys)
    return (f"fa3_fwd<{ctype}, {d}, {bn}, {stages}, {str(pingpong).lower()}, {str(overlap).lower()}, "
            f"{bm // 64}, {str(bool(pers)).lower()}{fp8_arg}>")


def persistent(cfg) -> bool:
    """Whether a tile configuration (BM, BN, stages, ping-pong[, persistent]) runs the persistent grid."""
    return len(cfg) > 4 and bool(cfg[4])


def grid(nq: int, heads: int, batch: int, cfg) -> tuple:
    """One CTA per (Q block, head, batch) tile, or with the persistent grid one per SM (at most one per tile)."""
    tiles = cdiv(nq, cfg[0]) * heads * batch
    if persistent(cfg):
        tiles = min(tiles, sm_count())
    return (tiles, 1, 1)


_COUNTERS: dict = {}  # (device, stream) -> Memory on that device: the persistent grid's counter pair, then the
COUNTER_INTS = 2 + 3 * 1024  # split tail's counts (one per tail tile and consumer: fewer tiles than SMs)


def tile_counter(device: int, stream: int) -> int:
    """The address of the persistent grid's tile counter pair for launches on ``stream``: zeroed once here, on
    that stream (so before its first launch, with no host wait), and again by the last CTA of every launch. One
    pair per stream, because launches on one stream run one after another, while two kernels sharing a pair at
    once would take each other's tiles."""
    return _stream_buffer(_COUNTERS, device, stream, 4 * COUNTER_INTS, zero=True)


def specializations():
    grids = lambda d, cfg, causal: (cfg[:4] + (0,), as_persistent(d, cfg, causal))  # noqa: E731
    cfgs = [(d, config(d, causal=causal), causal) for d in DIMS for causal in (False, True)]
    cfgs += [(d, config(d, 1, causal=c), c) for c, table in ((True, CAUSAL_SHORT_TILES), (False, SHORT_TILES))
             for d in table]
    main = tuple(dict.fromkeys(instance(c, d, cfg=g) for c in CTYPE.values() for d, cfg, causal in cfgs
                               for g in grids(d, cfg, causal)))
    ablation = tuple(instance(c, ABLATION_DIM, pp, ov) for c in CTYPE.values() for pp, ov in ABLATIONS)
    return main + tuple(e for e in dict.fromkeys(ablation) if e not in main)


def extra_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, itemsize=2, heads_kv=None):
    return 0


@dataclasses.dataclass(frozen=True)
class Fa3Plan:
    """One fa3 (or fa3_fp8) forward for one call signature: fa2's FwdPlan plus the tensor maps."""
    func: int
    grid: tuple
    block: int
    smem: int
    template: bytes         # FwdParams (fa3_fp8: Fp8FwdParams) with zero pointers
    fmt: str                # struct format of the parameter struct's leading pointers
    maps: tuple             # MapTemplate of q, k, v[, out] (out where stores_o_by_tma; fa3_fp8: e4m3 q, k, v^T)
    out_shape: tuple
    dtype: np.dtype
    lse_shape: tuple | None
    device: int
    persistent: bool = False  # the kernel's fifth parameter is then this stream's tile counter pair
    workspace: int = 0        # bytes of the split tail's partials (per stream), 0: no split
    ws_offset: int = FWD.offset("o_ws")  # where the struct holds their address (fa3_fp8: Fa3Fp8FwdParams')
    negate_q: bool = False    # fa3_fp8 with softmax_scale < 0: run on -Q with |scale| (fa3_fp8.run_quantized)

    def launch(self, stream, map_ptrs, ptrs, after: bool = False):
        """One launch: ``map_ptrs`` the addresses of the mapped tensors, ``ptrs`` the struct's pointers. ``after``:
        a programmatic launch behind the kernel ahead on the stream (launch.launch_argv; fp8 instances only)."""
        params = ctypes.create_string_buffer(self.template, len(self.template))
        struct.pack_into(self.fmt, params, 0, *ptrs)
        if self.workspace:
            struct.pack_into("<Q", params, self.ws_offset, split_workspace(self.device, stream, self.workspace))
        counter = ctypes.c_uint64(tile_counter(self.device, stream) if self.persistent else 0)
        maps = [ctypes.create_string_buffer(m.at(ptr), 128) for m, ptr in zip(self.maps, map_ptrs)]
        maps += maps[:1] * (4 - len(maps))  # the kernel's O map where it stores O itself: never read
        argv = (ctypes.c_void_p * 6)(*(ctypes.addressof(b) for b in maps + [params]), ctypes.addressof(counter))
        launch_argv(self.func, self.grid, self.block, self.smem, stream, argv, after)

    def run_cupy(self, q, k, v):
        empty, stream = _cupy()
        out = empty(self.out_shape, self.dtype)
        lse = None if self.lse_shape is None else empty(self.lse_shape, np.float32)
        ptrs = (q.data.ptr, k.data.ptr, v.data.ptr)
        self.launch(stream().ptr, ptrs + (out.data.ptr,),
                    ptrs + (out.data.ptr, 0 if lse is None else lse.data.ptr, 0, 0, 0))
        return out, lse

    def run_torch(self, q, k, v):
        torch, stream_of = _torch()
        out = torch.empty(self.out_shape, dtype=q.dtype, device=q.device)
        lse = None if self.lse_shape is None else torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        self.launch(stream_of(self.device), ptrs + (out.data_ptr(),),
                    ptrs + (out.data_ptr(), 0 if lse is None else lse.data_ptr(), 0, 0, 0))
        return out, lse


def plan(q, k, v, *, causal, softmax_scale, return_lse, pingpong: bool | None = None,
         overlap: bool = True) -> Fa3Plan:
    """The launch of one call signature, for aligned CuPy q, k, v whose head dim is a multiple of 8.
    ``pingpong`` None: the tile table's choice; False/True and ``overlap=False``: the ablation's instances."""
    import cupy
    b, nq, h, d = q.shape
    D = template_dim(d, DIMS)
    ablation = pingpong is not None or not overlap
    if ablation and D != ABLATION_DIM:
        raise ValueError(f"the ablation instances exist at head_dim {ABLATION_DIM} only, got {d}")
    # the ablation's instances run one CTA per tile, at every length: the paper's levers on the plain grid
    cfg = config(D) if ablation else config(D, k.shape[1], causal)
    smem = smem_bytes(D, cfg, overlap=overlap)
    kern = jit.kernel(SOURCE, instance(CTYPE[q.dtype.name], D, pingpong, overlap, cfg))
    maps = tuple(MapTemplate(a.data.ptr, a.shape, a.strides, a.dtype.itemsize, rows, name)
                 for a, rows, name in ((q, cfg[0], "q"), (k, cfg[1], "k"), (v, cfg[1], "v")))
    tma_out = stores_o_by_tma(D, cfg, overlap)
    if tma_out:
        maps += (out_map(q.data.ptr, b, nq, h, d),)
    tiles = cdiv(nq, cfg[0]) * h * b
    if tiles >= 2**31:
        raise ValueError(f"batch * heads * Q blocks = {tiles} tiles exceed the grid's 2^31 - 1")
    ctas = grid(nq, h, b, cfg)
    tail = tail_split(tiles, ctas[0], cdiv(k.shape[1], cfg[1]), causal, tma_out)
    return Fa3Plan(func=function_of(kern, smem), grid=ctas, block=threads(cfg), smem=smem,
                   template=fwd_params(q, k, v, head_dim=d, causal=causal, softmax_scale=softmax_scale,
                                       out_strides=(nq * h * d, h * d, d), tail=tail),
                   workspace=workspace_bytes(D, cfg, tail),
                   fmt=FWD.pointers_format, maps=maps, out_shape=(b, nq, h, d), dtype=q.dtype,
                   lse_shape=(b, h, nq) if return_lse else None, device=cupy.cuda.Device().id,
                   persistent=persistent(cfg))


def forward(q, k, v, *, causal, softmax_scale, return_lse):
    return forward_via_plan(plan, q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)


LAUNCHER = KernelLauncher(sources=lambda: {SOURCE: specializations(), PAD_SOURCE: PAD_INSTANCES},
                          forward_fn=forward, tiles_fn=tiles, causal_tiles_fn=causal_tiles, extra_bytes_fn=extra_bytes,
                          source_archs={SOURCE: ARCHS}, plan_fn=plan)
