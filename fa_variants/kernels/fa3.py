"""Launcher of cuda_src/fa3_fwd.cu (FlashAttention-3 forward, sm_90a only): TMA tensor maps (kernels/tma.py), a
producer warpgroup and BM / 64 consumer warpgroups, one CTA per (Q block, head, batch) tile or the persistent grid,
and the launch plan of one call signature.

What a call launches (its tile from fa_variants/tiles.py, grid, shared memory, split last wave) is ``launch_of``, a
function of the shapes alone; ``plan`` adds what needs the GPU. A plan keeps the tensor maps encoded for the call
signature and patches this call's addresses into them, so a warm call is still one cuLaunchKernel (with the maps
of q, k, v and out, FwdParams and the persistent grid's tile counter). ``plan(..., pingpong=False)`` /
``overlap=False`` run the FA3 ablation's instances (bench/ablation.py).
"""
from __future__ import annotations

import ctypes
import dataclasses
import struct

import numpy as np

from .. import jit
from ..tiles import FA3_ABLATION_DIM, FA3_ABLATION_TILE, Fa3Tile, fa3_instances, fa3_template_dim, fa3_tile
from . import KernelLauncher
from .common import (CTYPE, PAD_INSTANCES, PAD_SOURCE, SM90_SMEM, cdiv, forward_via_plan, fwd_params, given_tile,
                     sm_count)
from .launch import _cupy, _torch, function_of, launch_argv
from .params import FWD
from .tma import MapTemplate

SOURCE = "fa3_fwd.cu"
ARCHS = ("sm_90a",)

# The persistent grid's last wave spread over every SM (fa3_fwd.cu's SPLIT, where O leaves by TMA; non-causal, whose
# tiles are equal): the last tiles % CTAs tiles, cut along their K/V blocks into one range per CTA, each tile into
# at most MAX_PIECES pieces, where the last wave leaves at least 1 / 8 of the SMs idle and a tile has at least
# SPLIT_MIN_BLOCKS blocks: a piece has a fixed cost (its first S alone, its partial's round trip) that a tile of
# fewer blocks does not win back (docs/kernels/tiles.md).
MAX_PIECES = 4
SPLIT_MIN_BLOCKS = 20


def tail_split(tiles: int, ctas: int, kv_blocks: int, causal: bool, tma_out: bool, split: bool | None = None) -> tuple:
    """(tail_tiles, tail_blocks, tail_ranges) of FwdParams: the last wave's tiles and the ranges of K/V blocks
    they are cut into, or (0, 0, 0) for no split. ``split`` None: where it pays (the thresholds above); True:
    wherever the kernel can run it (the GPU tests' small shapes); False: never."""
    if split is not None and not isinstance(split, bool):
        raise TypeError(f"split must be None, True or False, got {split!r}")
    if causal or not tma_out or split is False or (split is None and kv_blocks < SPLIT_MIN_BLOCKS):
        return (0, 0, 0)
    last = tiles % ctas
    if tiles <= ctas or last == 0 or (split is None and 8 * last > 7 * ctas):
        return (0, 0, 0)
    blocks = max(cdiv(last * kv_blocks, ctas), cdiv(kv_blocks, MAX_PIECES))
    if blocks >= kv_blocks:
        return (0, 0, 0)
    return (last, blocks, cdiv(last * kv_blocks, blocks))


def workspace_bytes(d: int, tile: Fa3Tile, tail: tuple) -> int:
    """The split tail's partials: per consumer thread D / 8 float4 of O and one of m and l; per range at most two
    pieces."""
    return tail[2] * 2 * tile.consumers * 128 * (d // 8 + 1) * 16


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


# The FA3 paper's ablation (Table 2): instances with ping-pong and/or the intra-warpgroup overlap off, at
# FA3_ABLATION_DIM on FA3_ABLATION_TILE.
ABLATIONS = ((False, True), (True, False), (False, False), (True, True))  # (pingpong, overlap)


def _bars(stages: int) -> int:
    # mbarriers: Q full/empty (two slots each), K/V full/empty per stage, tile full/empty per slot; two tile slots
    return 8 * (8 + 4 * stages) + 8


def _layout_bytes(d: int, tile: Fa3Tile, itemsize: int, q_bufs: int) -> int:
    # alignment, the Q buffers, the K/V ring (fp8: K and V^T, one byte an element), the mbarriers and tile slots
    return 1024 + q_bufs * tile.block_q * itemsize * d + tile.stages * 2 * tile.block_k * itemsize * d + \
        _bars(tile.stages)


def q_buffers(d: int, tile: Fa3Tile, itemsize: int = 2, overlap: bool = True) -> int:
    """Q buffers of an instance: two where the persistent grid pipelines across tiles (fa3_fwd.cu's CROSS: the
    intra-warpgroup overlap on and a second Q buffer fits in sm_90's opt-in shared memory, tma.cuh's
    MAX_DYNAMIC_SMEM), else one. The kernel decides the same way and traps if given less than its layout needs."""
    return 2 if tile.persistent and overlap and _layout_bytes(d, tile, itemsize, 2) <= SM90_SMEM else 1


def o_buffer_bytes(d: int, tile: Fa3Tile) -> int:
    """fa3_fp8's O buffer: BM rows of 16-bit O (twice Q's e4m3 rows, so O cannot go out through Q's buffer)."""
    return tile.block_q * 2 * d


def stores_o_by_tma(d: int, tile: Fa3Tile, overlap: bool = True, itemsize: int = 2) -> bool:
    """Whether an instance stores O by TMA (fa3_fwd.cu's TMA_OUT: where the persistent grid pipelines across
    tiles; 16-bit O over its Q buffers, fa3_fp8's through a buffer of its own where that fits too); it then takes
    a tensor map of the output."""
    if q_buffers(d, tile, itemsize, overlap) != 2:
        return False
    return itemsize == 2 or _layout_bytes(d, tile, itemsize, 2) + o_buffer_bytes(d, tile) <= SM90_SMEM


def smem_bytes(d: int, tile: Fa3Tile, itemsize: int = 2, overlap: bool = True) -> int:
    """Alignment, the Q buffers, fa3_fp8's O buffer, the K/V ring (fp8: K and V^T, one byte an element), the
    mbarriers and the persistent grid's two tile slots."""
    o_buf = o_buffer_bytes(d, tile) if itemsize == 1 and stores_o_by_tma(d, tile, overlap, itemsize) else 0
    return _layout_bytes(d, tile, itemsize, q_buffers(d, tile, itemsize, overlap)) + o_buf


def tiles(head_dim: int, causal: bool = False, seqlen_k: int | None = None) -> tuple[int, int]:
    """(BM, BN) that a call launches (tiles.fa3_tile): what the IO model is run with."""
    tile = fa3_tile(head_dim, seqlen_k, causal)
    return tile.block_q, tile.block_k


def instance(ctype: str, d: int, tile: Fa3Tile, *, pingpong: bool | None = None, overlap: bool = True,
             fp8: bool = False) -> str:
    """The fa3_fwd template instance of ``tile`` at template dim ``d`` (``pingpong`` None: the tile's)."""
    pingpong = tile.pingpong if pingpong is None else pingpong
    fp8_arg = ", true" if fp8 else ""  # the 16-bit instances keep their names (and cache keys)
    return (f"fa3_fwd<{ctype}, {d}, {tile.block_k}, {tile.stages}, {str(bool(pingpong)).lower()}, "
            f"{str(overlap).lower()}, {tile.consumers}, {str(bool(tile.persistent)).lower()}{fp8_arg}>")


@dataclasses.dataclass(frozen=True)
class Fa3Launch:
    """What a call launches, decided from its shapes alone (``launch_of``, no GPU): ``plan`` adds the tensor maps,
    the parameter struct and the CUfunction."""
    dim: int          # the template head dim
    tile: Fa3Tile
    instance: str     # the fa3_fwd template instance
    ctas: int         # one per (Q block, head, batch) tile, or on the persistent grid at most one per SM
    smem: int         # dynamic shared memory, bytes
    tma_out: bool     # O stored by TMA: the kernel takes a tensor map of the output
    tail: tuple       # the split last wave (tail_split), (0, 0, 0) for none
    workspace: int    # bytes of the split tail's partials, per stream


def launch_of(dtype: str, *, batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool,
              sms: int, fp8: bool = False, pingpong: bool | None = None, overlap: bool = True,
              split: bool | None = None, tile: Fa3Tile | None = None) -> Fa3Launch:
    """The launch of fa3 (``fp8``: fa3_fp8) for one call signature: q of (batch, seqlen_q, heads, head_dim) in
    ``dtype`` (fa3_fp8: its output's), ``seqlen_k`` keys, on ``sms`` SMs. The tile is the table's
    (tiles.fa3_tile), or ``tile`` (a tile sweep's); ``pingpong`` False/True and ``overlap=False`` run the FA3
    ablation's instances, on tiles.FA3_ABLATION_TILE, one CTA per tile at every length; ``split``: tail_split's."""
    d = fa3_template_dim(head_dim)
    ablation = pingpong is not None or not overlap
    if ablation and (fp8 or d != FA3_ABLATION_DIM):
        raise ValueError(f"the ablation instances exist for 16-bit head_dim {FA3_ABLATION_DIM} only, got "
                         f"{'fp8 ' if fp8 else ''}head_dim {head_dim}")
    if given_tile(tile, Fa3Tile) is None:
        tile = FA3_ABLATION_TILE if ablation else fa3_tile(head_dim, seqlen_k, causal, fp8)
    itemsize = 1 if fp8 else 2
    tiles = cdiv(seqlen_q, tile.block_q) * heads * batch
    if tiles >= 2**31:
        raise ValueError(f"batch * heads * Q blocks = {tiles} tiles exceed the grid's 2^31 - 1")
    ctas = min(tiles, sms) if tile.persistent else tiles
    tma_out = stores_o_by_tma(d, tile, overlap, itemsize)
    tail = tail_split(tiles, ctas, cdiv(seqlen_k, tile.block_k), causal, tma_out, split)
    return Fa3Launch(dim=d, tile=tile, ctas=ctas, smem=smem_bytes(d, tile, itemsize, overlap), tma_out=tma_out,
                     instance=instance(CTYPE[dtype], d, tile, pingpong=pingpong, overlap=overlap, fp8=fp8),
                     tail=tail, workspace=workspace_bytes(d, tile, tail))


_COUNTERS: dict = {}  # (device, stream) -> Memory on that device: the persistent grid's counter pair, then the
COUNTER_INTS = 2 + 3 * 1024  # split tail's counts (one per tail tile and consumer: fewer tiles than SMs)


def tile_counter(device: int, stream: int) -> int:
    """The address of the persistent grid's tile counter pair for launches on ``stream``: zeroed once here, on
    that stream (so before its first launch, with no host wait), and again by the last CTA of every launch. One
    pair per stream, because launches on one stream run one after another, while two kernels sharing a pair at
    once would take each other's tiles."""
    return _stream_buffer(_COUNTERS, device, stream, 4 * COUNTER_INTS, zero=True)


def specializations():
    """Every instance a call can launch (tiles.fa3_instances), then the ablation's."""
    main = tuple(instance(c, d, tile) for c in CTYPE.values() for d, tile in fa3_instances())
    ablation = tuple(instance(c, FA3_ABLATION_DIM, FA3_ABLATION_TILE, pingpong=pp, overlap=ov)
                     for c in CTYPE.values() for pp, ov in ABLATIONS)
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


def plan(q, k, v, *, causal, softmax_scale, return_lse, pingpong: bool | None = None, overlap: bool = True,
         split: bool | None = None, tile: Fa3Tile | None = None) -> Fa3Plan:
    """The launch of one call signature (``launch_of``), for aligned CuPy q, k, v whose head dim is a multiple
    of 8. ``pingpong``/``overlap``: the ablation's instances; ``split``: the split last wave forced on or off;
    ``tile``: another tile than the table's."""
    import cupy
    b, nq, h, d = q.shape
    at = launch_of(q.dtype.name, batch=b, heads=h, seqlen_q=nq, seqlen_k=k.shape[1], head_dim=d, causal=causal,
                   sms=sm_count(), pingpong=pingpong, overlap=overlap, split=split, tile=tile)
    maps = tuple(MapTemplate(a.data.ptr, a.shape, a.strides, a.dtype.itemsize, rows, name)
                 for a, rows, name in ((q, at.tile.block_q, "q"), (k, at.tile.block_k, "k"), (v, at.tile.block_k, "v")))
    if at.tma_out:
        maps += (out_map(q.data.ptr, b, nq, h, d),)
    return Fa3Plan(func=function_of(jit.kernel(SOURCE, at.instance), at.smem), grid=(at.ctas, 1, 1),
                   block=at.tile.threads, smem=at.smem,
                   template=fwd_params(q, k, v, head_dim=d, causal=causal, softmax_scale=softmax_scale,
                                       out_strides=(nq * h * d, h * d, d), tail=at.tail),
                   workspace=at.workspace, fmt=FWD.pointers_format, maps=maps, out_shape=(b, nq, h, d),
                   dtype=q.dtype, lse_shape=(b, h, nq) if return_lse else None, device=cupy.cuda.Device().id,
                   persistent=at.tile.persistent)


def forward(q, k, v, *, causal, softmax_scale, return_lse):
    return forward_via_plan(plan, q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)


def backward(dout, q, k, v, out, lse, *, causal, softmax_scale, deterministic=True):
    """fa3_bwd (kernels/fa3_bwd.py), or fa2's Hopper backward where it does not apply."""
    from . import fa3_bwd
    return fa3_bwd.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                            deterministic=deterministic)


def _sources():
    from . import fa3_bwd, fa3_masked
    return {SOURCE: specializations() + fa3_masked.specializations(), PAD_SOURCE: PAD_INSTANCES,
            fa3_bwd.SOURCE: fa3_bwd.specializations()}


LAUNCHER = KernelLauncher(sources=_sources, forward_fn=forward, tiles_fn=tiles, extra_bytes_fn=extra_bytes,
                          source_archs={SOURCE: ARCHS, "fa3_bwd.cu": ARCHS}, plan_fn=plan, backward_fn=backward,
                          backward_order="either")
