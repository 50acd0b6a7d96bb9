"""The GPU side of decoding over a KV cache: cuda_src/kv_append.cu (the new tokens into the cache), decode_fwd.cu
(the split-KV kernel) and merge_states.cu (the merge of the splits, and of any attention states).

Arrays arrive as ``DevArray``s: a pointer, shape, element strides, dtype and device, read off CuPy arrays or torch
tensors without converting either (torch's float8_e4m3fn cache has no CuPy dtype, and a DLPack round trip per
tensor costs microseconds of a step that lasts tens). Results are allocated by the caller's framework, on its
current stream: a step is then capturable in a CUDA graph (torch.cuda.CUDAGraph, cupy.cuda.Graph).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import ml_dtypes
import numpy as np

from .. import jit
from ..reference import decode as model
from .common import CTYPE, cdiv, scale_log2, smem_limit
from .launch import function_of, launch
from .params import APPEND, DECODE, MERGE

SOURCE, MERGE_SOURCE, APPEND_SOURCE = "decode_fwd.cu", "merge_states.cu", "kv_append.cu"
THREADS, BLOCK_N = 128, 64          # decode_fwd.cu's CTA and keys per block
SPLIT_N = model.DEFAULT_BLOCK_N     # the split granularity, the model's
MERGE_WARPS, APPEND_WARPS = 4, 4
FP8_ARCHS = ("sm_89", "sm_90", "sm_90a")   # e4m3 -> f16x2 conversion: sm_89+
TEMPLATE_DIMS = (64, 128, 256)
MAX_MT = {64: 2, 128: 2, 256: 1}    # m-tiles of 16 packed rows per CTA: O's registers allow MT * D <= 256
SMEM_BUDGET = {"sm_90a": 220 * 1024, "sm_80": 160 * 1024}   # what the ring may take (1 CTA per SM either way)
OTHER_BUDGET = 92 * 1024            # sm_86 / sm_89: 99 KB per block
MAX_STAGES = 8
KV_KIND = {2: "fav::Bits16", 1: "fav::E4M3"}


# ------------------------------------------------------------------------------------------------ the tile table
def template_dim(head_dim: int) -> int:
    return next(d for d in TEMPLATE_DIMS if head_dim <= d)


def _q_tile_bytes(d: int, mt: int) -> int:
    return 16 * mt * (d + 8) * 2


def _stage_bytes(d: int, kv_bytes: int) -> int:
    """One ring stage: a K and a V block as they land, rows padded by 16 bytes."""
    return 2 * BLOCK_N * (d * kv_bytes + 16)


def _v_tile_bytes(d: int, kv_bytes: int) -> int:
    """The fp16 V block an e4m3 cache's V is converted into (none for a 16-bit cache)."""
    return BLOCK_N * (d + 8) * 2 if kv_bytes == 1 else 0


def stages(d: int, mt: int, kv_bytes: int, arch: str) -> int:
    """The deepest K/V ring that fits the arch's budget beside the Q tile (and an e4m3 cache's fp16 V block)."""
    budget = SMEM_BUDGET.get(arch, OTHER_BUDGET) - _q_tile_bytes(d, mt) - _v_tile_bytes(d, kv_bytes)
    return max(2, min(MAX_STAGES, budget // _stage_bytes(d, kv_bytes)))


def smem_bytes(d: int, mt: int, n_stages: int, kv_bytes: int) -> int:
    """decode_fwd.cu's Smem<...>::BYTES."""
    q_tile = _q_tile_bytes(d, mt)
    loop = q_tile + n_stages * _stage_bytes(d, kv_bytes) + _v_tile_bytes(d, kv_bytes)
    merge = q_tile + 4 * 16 * mt * (2 + d + 4) * 4
    return max(loop, merge)


def m_tiles(rows: int, d: int) -> int:
    """m-tiles per CTA for ``rows`` packed rows (seqlen_q * group): the fewest that hold them, at most MAX_MT[d]
    (more rows: more Q tiles per (batch, KV head), each reading the split again, mostly from L2)."""
    return min(MAX_MT[d], 1 if rows <= 16 else 2)


def instance(dtype: str, d: int, mt: int, paged: bool, kv_bytes: int, arch: str) -> str:
    return (f"decode_split<{CTYPE[dtype]}, {d}, {mt}, {stages(d, mt, kv_bytes, arch)}, {str(paged).lower()}, "
            f"{KV_KIND[kv_bytes]}>")


MERGE_TYPES = {"float16": "fav::merge::Bits16Of<fav::Half>", "bfloat16": "fav::merge::Bits16Of<fav::BFloat16>",
               "float32": "fav::merge::F32", "float64": "fav::merge::F64"}
LSE_TYPES = {"float32": "fav::merge::F32", "float64": "fav::merge::F64"}


def merge_instance(parts_dtype: str, lse_dtype: str, out_dtype: str | None = None) -> str:
    """merge_states.cu's instance for states of ``parts_dtype`` into ``out_dtype`` (default: the same)."""
    acc = "double" if "float64" in (parts_dtype, lse_dtype) else "float"
    out = MERGE_TYPES[out_dtype or parts_dtype]
    return f"merge_states<{MERGE_TYPES[parts_dtype]}, {LSE_TYPES[lse_dtype]}, {out}, {acc}>"


def append_instance(kv_bytes: int, paged: bool) -> str:
    return f"kv_append<{'unsigned short' if kv_bytes == 2 else 'unsigned char'}, {str(paged).lower()}>"


def compile_units(arch: str | None = None) -> dict:
    """{source: instances} shipped for ``arch`` (both when None): every dtype, template head dim, m-tile count,
    layout and cache format of the split kernel, every merge and append."""
    archs = (arch,) if arch else tuple(SMEM_BUDGET)
    split = sorted({instance(t, d, mt, paged, kv, a) for a in archs for t in CTYPE for d in TEMPLATE_DIMS
                    for mt in range(1, MAX_MT[d] + 1) for paged in (False, True)
                    for kv in ((2, 1) if a in FP8_ARCHS else (2,))})
    merges = sorted({merge_instance(o, lse) for o in MERGE_TYPES for lse in LSE_TYPES} |
                    {merge_instance("float32", "float32", t) for t in CTYPE})   # decoding's partials into q's format
    appends = sorted({append_instance(kv, paged) for kv in (2, 1) for paged in (False, True)})
    return {SOURCE: tuple(split), MERGE_SOURCE: tuple(merges), APPEND_SOURCE: tuple(appends)}


# ------------------------------------------------------------------------------------------------ arrays
class DevArray(NamedTuple):
    """A GPU array as the launch needs it: pointer, shape, strides in elements, dtype name, device. (A NamedTuple:
    a decoding step makes and hashes several per call, and a tuple's construction and hash are the cheapest.)"""
    ptr: int
    shape: tuple
    strides: tuple
    dtype: str
    device: int

    @property
    def spec(self) -> "DevArray":
        """The array without its pointer: what a launch plan depends on."""
        return self._replace(ptr=0)

    @property
    def itemsize(self) -> int:
        return 1 if self.dtype == "float8_e4m3fn" else np.dtype(self.dtype).itemsize

    @staticmethod
    def of(x) -> "DevArray":
        if type(x).__module__.split(".")[0] == "torch":
            dtype = str(x.dtype).removeprefix("torch.")
            return DevArray(x.data_ptr(), tuple(x.shape), tuple(x.stride()), dtype, x.device.index)
        item = x.dtype.itemsize
        return DevArray(x.data.ptr, tuple(x.shape), tuple(s // item for s in x.strides), x.dtype.name, x.device.id)


class Framework:
    """Allocation and the current stream of the caller's framework (torch or CuPy), on one device."""

    def __init__(self, like):
        self.torch = type(like).__module__.split(".")[0] == "torch"
        if self.torch:
            import torch
            self.lib, self.device = torch, like.device
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            self.stream = raw(like.device.index) if raw else torch.cuda.current_stream(like.device).cuda_stream
        else:
            import cupy
            self.lib, self.device = cupy, None
            self.stream = cupy.cuda.get_current_stream().ptr

    def empty(self, shape, dtype: str):
        if self.torch:
            return self.lib.empty(shape, dtype=getattr(self.lib, dtype), device=self.device)
        return self.lib.empty(shape, dtype=ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)

    def full(self, shape, value, dtype: str):
        if self.torch:
            return self.lib.full(shape, value, dtype=getattr(self.lib, dtype), device=self.device)
        return self.lib.full(shape, value, dtype=dtype)

    def from_host(self, host: np.ndarray, device: int):
        """A device copy of a small host array (index arrays given as NumPy)."""
        if self.torch:
            return self.lib.from_numpy(host).to(self.device)
        with self.lib.cuda.Device(device):
            return self.lib.asarray(host)

    def ptr(self, x) -> int:
        return x.data_ptr() if self.torch else x.data.ptr


# ------------------------------------------------------------------------------------------------ launches
@functools.lru_cache(maxsize=None)
def _function_on(source: str, expr: str, smem: int, device: int) -> int:
    return function_of(jit.kernel(source, expr), smem)


def _function(source: str, expr: str, smem: int = 0) -> int:
    """The CUfunction of ``expr`` on the current device, its shared-memory limit raised once."""
    import cupy
    return _function_on(source, expr, smem, cupy.cuda.runtime.getDevice())


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch worked out but for its pointers: the CUfunction, grid, block, dynamic shared memory and the
    parameter struct packed with null pointers; a call writes the pointers it is given into a copy and launches.
    ``after``: behind the kernel ahead on the stream, with programmatic dependent launch (the kernel waits for
    that one's writes with griddep_wait)."""
    func: int
    grid: tuple
    block: int
    smem: int
    template: bytes
    fmt: str
    pointers: tuple   # the struct's pointer fields, in order
    after: bool = False

    @staticmethod
    def of(struct, func: int, grid: tuple, block: int, smem: int, after: bool = False, **fields) -> "Launch":
        pointers = struct.pointers
        return Launch(func, grid, block, smem, struct.pack(**{f: 0 for f in pointers}, **fields),
                      struct.pointers_format, pointers, after)

    def __call__(self, stream: int, **ptrs: int) -> None:
        launch(self.func, self.grid, self.block, self.smem, stream, self.template, self.fmt,
               *[ptrs.get(f, 0) for f in self.pointers], after=self.after)


def append_launch(k: DevArray, v: DevArray, k_cache: DevArray, v_cache: DevArray, *, paged: bool, capacity: int,
                  page_size: int, max_pages: int) -> Launch:
    """kv_append.cu: k, v into the caches at cache_seqlens, in place (pointers: k, v, k_cache, v_cache,
    cache_seqlens, page_table)."""
    batch, seqlen_new, heads_kv, d = k.shape
    rows = batch * seqlen_new * heads_kv
    func = _function(APPEND_SOURCE, append_instance(k_cache.itemsize, paged))
    return Launch.of(APPEND, func, (cdiv(rows, APPEND_WARPS), 1, 1), APPEND_WARPS * 32, 0,
                     kn_b=k.strides[0], kn_n=k.strides[1], kn_h=k.strides[2], vn_b=v.strides[0], vn_n=v.strides[1],
                     vn_h=v.strides[2], k_b=k_cache.strides[0], k_n=k_cache.strides[1], k_h=k_cache.strides[2],
                     v_b=v_cache.strides[0], v_n=v_cache.strides[1], v_h=v_cache.strides[2], batch=batch,
                     seqlen_new=seqlen_new, heads_kv=heads_kv, head_dim=d, capacity=capacity, page_size=page_size,
                     max_pages=max_pages, num_pages=k_cache.shape[0])


def merge_launch(parts: DevArray, lses: DevArray, out: DevArray, axes: tuple, after: bool = False) -> Launch:
    """merge_states.cu over states stacked on parts' axis 0, parts (S, batch, seqlen, heads, d) and lses (S, batch,
    heads, seqlen) in any strides (``axes``: lses' strides in that order), into out (batch, seqlen, heads, d) and a
    contiguous lse (batch, heads, seqlen) (pointers: o_parts, lse_parts, out, lse; a null lse is not written)."""
    states, batch, seqlen, heads, d = parts.shape
    rows = batch * seqlen * heads
    func = _function(MERGE_SOURCE, merge_instance(parts.dtype, lses.dtype, out.dtype))
    return Launch.of(MERGE, func, (cdiv(rows, MERGE_WARPS), 1, 1), MERGE_WARPS * 32, 0, after,
                     p_s=parts.strides[0], p_b=parts.strides[1], p_n=parts.strides[2], p_h=parts.strides[3],
                     l_s=axes[0], l_b=axes[1], l_h=axes[2], l_n=axes[3], o_b=out.strides[0], o_n=out.strides[1],
                     o_h=out.strides[2], states=states, batch=batch, seqlen=seqlen, heads=heads, head_dim=d)


def num_sms(device: int) -> int:
    from .common import sm_count
    return sm_count(device)


@functools.lru_cache(maxsize=None)
def arch_of(device: int) -> str:
    import cupy
    return jit.device_arch(cupy.cuda.Device(device))


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """A decoding step for one signature: the append (when k, v are given), the split kernel and the merge (when
    split), and the shapes of what a call allocates. ``run`` is all a warm call does: allocate, fill in pointers,
    launch."""
    append: Launch | None
    split: Launch
    merge: Launch | None
    num_splits: int
    out_shape: tuple
    dtype: str
    lse_shape: tuple | None      # None: no LSE asked for
    o_parts_size: int            # elements of the splits' fp32 partial O (when split), then their LSEs' up to
    parts_size: int              # parts_size: one allocation

    def run(self, fw: Framework, *, q: int, k_cache: int, v_cache: int, cache_seqlens: int, page_table: int = 0,
            k_descale: int = 0, v_descale: int = 0, k: int = 0, v: int = 0, alibi_slopes: int = 0, sinks: int = 0):
        """(out, lse or None) in fw's arrays, given the device pointers of the call's arrays (0: absent); k, v:
        the new tokens, appended when the plan has an append."""
        out = fw.empty(self.out_shape, self.dtype)
        lse = None if self.lse_shape is None else fw.empty(self.lse_shape, "float32")
        o, lse_ptr = fw.ptr(out), 0 if lse is None else fw.ptr(lse)
        index = dict(cache_seqlens=cache_seqlens, page_table=page_table)
        if self.append is not None:
            self.append(fw.stream, k=k, v=v, k_cache=k_cache, v_cache=v_cache, **index)
        step = dict(q=q, k=k_cache, v=v_cache, k_descale=k_descale, v_descale=v_descale, alibi_slopes=alibi_slopes,
                    sinks=sinks, **index)
        if self.merge is None:
            self.split(fw.stream, **step, o=o, lse=lse_ptr)
        else:   # the partials, O's then the LSEs', in one allocation (one allocator call fewer a step)
            parts = fw.empty((self.parts_size,), "float32")
            o_parts = fw.ptr(parts)
            lse_parts = o_parts + 4 * self.o_parts_size
            self.split(fw.stream, **step, o_part=o_parts, lse_part=lse_parts)
            self.merge(fw.stream, o_parts=o_parts, lse_parts=lse_parts, out=o, lse=lse_ptr)
        return out, lse


def contiguous_strides(shape: tuple) -> tuple:
    """Element strides of a C-contiguous array of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _contiguous(shape: tuple, dtype: str, device: int) -> DevArray:
    """A stand-in for a contiguous array the plan's call will allocate (its pointer is the call's)."""
    return DevArray(0, tuple(shape), contiguous_strides(shape), dtype, device)


def step_plan(q: DevArray, k_cache: DevArray, v_cache: DevArray, *, paged: bool, max_pages: int, seqlen_new: int,
              capacity: int, max_seqlen_k: int, causal: bool, softmax_scale: float, num_splits: int,
              return_lse: bool, append: Launch | None = None, window: tuple = (-1, -1), softcap: float = 0.0,
              alibi_rows: int = 0) -> StepPlan:
    """decode_fwd.cu's launch (and merge_states.cu's, when split) for arrays of these shapes, strides and dtypes
    (their pointers are not read); ``append``: kv_append.cu's launch, ahead of them on the stream; the mask
    keywords checked (``alibi_rows``: alibi_slopes' rows, 1 or batch; 0: none)."""
    batch, seqlen_q, heads, head_dim = q.shape
    heads_kv = k_cache.shape[2]
    group = heads // heads_kv
    d = template_dim(head_dim)
    mt = m_tiles(seqlen_q * group, d)
    row_tiles = cdiv(seqlen_q * group, 16 * mt)
    arch = arch_of(q.device)
    kv_bytes = k_cache.itemsize
    if num_splits == 0:
        seen = max_seqlen_k if window[0] < 0 else min(max_seqlen_k, window[0] + seqlen_q)   # the keys a row sees
        num_splits = model.choose_num_splits(batch, heads_kv * row_tiles, seen, num_sms(q.device), SPLIT_N)
    n_stages = stages(d, mt, kv_bytes, arch)
    smem = smem_bytes(d, mt, n_stages, kv_bytes)
    if smem > smem_limit():
        raise ValueError(f"head_dim {head_dim} needs {smem} bytes of shared memory per block; this GPU allows "
                         f"{smem_limit()}")
    func = _function(SOURCE, instance(q.dtype, d, mt, paged, kv_bytes, arch), smem)
    out_shape = (batch, seqlen_q, heads, head_dim)
    inv_scale = 1.0 / softmax_scale if softmax_scale else 0.0   # the transforms' raw units (a scale of 0 has none)
    split = Launch.of(DECODE, func, (num_splits, heads_kv * row_tiles, batch), THREADS, smem, append is not None,
                      q_b=q.strides[0], q_n=q.strides[1], q_h=q.strides[2],
                      k_b=k_cache.strides[0], k_n=k_cache.strides[1], k_h=k_cache.strides[2],
                      v_b=v_cache.strides[0], v_n=v_cache.strides[1], v_h=v_cache.strides[2],
                      o_b=seqlen_q * heads * head_dim, o_n=heads * head_dim, o_h=head_dim,
                      batch=batch, seqlen_q=seqlen_q, heads=heads, heads_kv=heads_kv, group=group,
                      head_dim=head_dim, seqlen_new=seqlen_new, capacity=capacity,
                      page_size=k_cache.shape[1] if paged else 0, max_pages=max_pages,
                      num_pages=k_cache.shape[0] if paged else 0, num_splits=num_splits, row_tiles=row_tiles,
                      scale_log2=scale_log2(softmax_scale), causal=int(bool(causal)), window_left=window[0],
                      window_right=window[1], softcap=softcap, inv_scale=inv_scale,
                      alibi_b=heads if alibi_rows > 1 else 0)
    parts_shape = (num_splits, batch, seqlen_q, heads, head_dim)
    lse_parts_shape = (num_splits, batch, heads, seqlen_q)
    merge = None
    if num_splits > 1:
        lse_parts = _contiguous(lse_parts_shape, "float32", q.device)
        merge = merge_launch(_contiguous(parts_shape, "float32", q.device), lse_parts,
                             _contiguous(out_shape, q.dtype, q.device), lse_parts.strides, after=True)
    return StepPlan(append, split, merge, num_splits, out_shape, q.dtype,
                    (batch, heads, seqlen_q) if return_lse else None, math.prod(parts_shape),
                    math.prod(parts_shape) + math.prod(lse_parts_shape))
