"""Launcher of cuda_src/fa2_fp8_fwd.cu, fa2_fp8_fwd_sm90.cu and fp8_quantize.cu: quantize (or take quantized) Q,
K, V, then FA2 on e4m3 tensor cores. The quantized layout is what fa_variants.fp8.quantize returns.

Two kernels of one algorithm: on sm_90 the e4m3 tensor cores are reached only through wgmma (ptxas emulates
e4m3 mma.sync with f16 HMMA there), so Hopper runs fa2_fp8_fwd_sm90.cu and sm_89 runs fa2_fp8_fwd.cu. ``forward``
and ``plan`` take ``kernel="mma_sync"`` to run the mma.sync kernel on Hopper too (what wgmma buys, measured). The
tiles are fa_variants/tiles.py's."""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from .. import jit
from ..tiles import FA2_FP8_TILES, FA2_FP8_WGMMA_TILES, FP8_TEMPLATE_DIMS, Fp8WgmmaTile, Tile
from . import KernelLauncher
from .common import (CTYPE, PAD_INSTANCES, PAD_SOURCE, cached_plan, cdiv, check_grid, choose_kernel,
                     ensure_vector_aligned, given_tile, pad_last_dim, pick_tiles, plan_cache, scale_log2,
                     template_dim, wgmma_device)
from .launch import FwdPlan, _cupy, _torch, function_of, launch
from .params import FP8_FWD, QUANT

SOURCE = "fa2_fp8_fwd.cu"
SM90_SOURCE = "fa2_fp8_fwd_sm90.cu"
QUANT_SOURCE = "fp8_quantize.cu"
SOURCE_ARCHS = {SM90_SOURCE: ("sm_90a",)}  # wgmma exists only there
QUANT_THREADS = 256  # quantize_qk_amax's CTA: the fastest in bench/devcheck.py --quant-threads (docs/kernels/tiles.md)
AMAX_ROWS = 128      # rows of V per amax chunk (one atomicMax per channel each)
VT_THREADS = 256     # quantize_vt's CTA
VT_KEYS = 128        # positions of V^T per quantize_vt CTA (its shared-memory swizzle needs 128) ...
VT_CHANNELS = 128    # ... for at most this many channels (d = 256: two CTAs, registers as for d = 128)

TILES = FA2_FP8_TILES              # the mma.sync kernel's, by template head dim (fa_variants/tiles.py)
SM90_TILES = FA2_FP8_WGMMA_TILES   # the wgmma kernel's


def smem_bytes(d: int, tile) -> int:
    bm, bn = tile.block_q, tile.block_k
    q = bm * (d // 2 + 8) * 2
    k = bn * (d // 2 + 8) * 2
    vt = d * (bn // 2 + 8) * 2
    return q + 2 * (k + vt)


def sm90_smem_bytes(d: int, tile) -> int:
    # unpadded swizzled tiles, three K/V stages, 1 KB for alignment
    return 1024 + tile.block_q * d + 3 * (tile.block_k * d + d * tile.block_k)


uses_wgmma = wgmma_device  # whether this device runs the wgmma kernel (a GPU test patches it to run mma.sync)


def kernel_of(kernel: str | None = None) -> str:
    """``kernel`` ("wgmma" or "mma_sync", checked), or the one this device runs where None."""
    return choose_kernel(kernel, uses_wgmma())


def fp8_template_dim(head_dim: int) -> int:
    """The head dim the fp8 kernels run ``head_dim`` at (tiles.FP8_TEMPLATE_DIMS): any multiple of 16 up to 256 is
    quantized into rows of the next one up, its extra columns zero."""
    return template_dim(head_dim, FP8_TEMPLATE_DIMS)


def config(head_dim: int, limit: int | None = None, kernel: str | None = None):
    """The tile of ``kernel`` (default: this device's) at the template dim head_dim pads to, the first of its table
    whose shared memory fits ``limit`` (default: this device's)."""
    d = fp8_template_dim(head_dim)
    if kernel_of(kernel) == "wgmma":
        return pick_tiles(SM90_TILES, sm90_smem_bytes, d, limit)
    return pick_tiles(TILES, smem_bytes, d, limit)


def tiles(head_dim: int, causal: bool = False, seqlen_k: int | None = None) -> tuple[int, int]:
    tile = config(head_dim)
    return tile.block_q, tile.block_k


def instance(ctype: str, d: int, tile) -> str:
    return f"fa2_fp8_fwd<{ctype}, {d}, {tile.block_q}, {tile.block_k}, {tile.warps}>"


def sm90_instance(ctype: str, d: int, tile) -> str:
    return f"fa2_fp8_fwd_sm90<{ctype}, {d}, {tile.block_k}, {tile.warps // 4}, {tile.ctas_per_sm}>"


def quant_instances(ctype: str, d: int, tile, threads: int = QUANT_THREADS):
    """The two quantizer kernels for a kernel of ``tile`` (its BM and BN are Q's and K's scale blocks)."""
    bm, bn = tile[:2]
    return (f"quantize_qk_amax<{ctype}, {d}, {bm}, {bn}, {AMAX_ROWS}, {threads}>",
            f"quantize_vt<{ctype}, {d}, {VT_KEYS}, {min(d, VT_CHANNELS)}, {VT_THREADS}>")


def specializations():
    return tuple(instance(c, d, tile) for c in CTYPE.values() for d, cands in TILES.items() for tile in cands)


SOURCES = {
    PAD_SOURCE: PAD_INSTANCES,
    SM90_SOURCE: tuple(sm90_instance(c, d, tile) for c in CTYPE.values() for d, cands in SM90_TILES.items()
                       for tile in cands),
    QUANT_SOURCE: tuple(dict.fromkeys(e for c in CTYPE.values() for table in (TILES, SM90_TILES)
                                      for d, cands in table.items() for tile in cands
                                      for e in quant_instances(c, d, tile))),
}


def extra_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, itemsize=2, heads_kv=None, tiles_of=None):
    """The e4m3 copies of Q, K and V^T (padded) and their scales, when quantizing on the fly for the kernel whose
    (BM, BN) ``tiles_of(head_dim)`` gives (default: this device's fa2_fp8 kernel's)."""
    heads_kv = heads if heads_kv is None else heads_kv
    bm, bn = (tiles_of or tiles)(head_dim)[:2]
    D = fp8_template_dim(head_dim)  # quantized rows are the template dim wide
    nk_pad = cdiv(seqlen_k, bn) * bn
    return (batch * D * (heads * seqlen_q + heads_kv * (seqlen_k + nk_pad))
            + 4 * batch * (heads * cdiv(seqlen_q, bm) + heads_kv * (cdiv(seqlen_k, bn) + 2 * D)))


def _padded(x):
    """x with its head dim widened to the template dim by zeros (a copy), or x itself when it is one; 16-byte
    aligned rows either way (the quantizers read 16-byte vectors)."""
    D = fp8_template_dim(x.shape[3])
    return ensure_vector_aligned(x) if x.shape[3] == D else pad_last_dim(x, D)


@dataclasses.dataclass(frozen=True)
class QuantPlan:
    """The quantization of one call signature: quantize_qk_amax over its items, then (with K and V) quantize_vt."""
    rows_func: int            # quantize_qk_amax
    items: int
    threads: int
    vt_func: int              # quantize_vt (0: Q only)
    vt_grid: tuple
    template: bytes           # QuantParams with zero pointers
    q_shapes: tuple           # e4m3 Q, sq (empty: no Q)
    kv_shapes: tuple          # e4m3 K, sk, V^T, sv (= amax's) (empty: no K, V)


def _quant_plan(q, k, v, cfg, threads: int) -> QuantPlan:
    x = q if q is not None else k
    b, _, _, D = x.shape
    ctype = CTYPE[np.dtype(x.dtype).name]
    bm, bn = cfg[:2]
    fields = {f: 0 for f, _ in QUANT.fields}  # a part not quantized keeps zeros (and no items)
    items, q_shapes, kv_shapes, vt_grid = 0, (), (), (0, 0, 0)
    if q is not None:
        nq, h = q.shape[1:3]
        fields.update(zip(("q_b", "q_n", "q_h"), _strides(q)), heads=h, seqlen_q=nq, q_items=cdiv(nq, bm) * h * b)
        items += fields["q_items"]
        q_shapes = ((b, h, nq, D), (b, h, cdiv(nq, bm)))
    if k is not None:
        nk, hkv = k.shape[1:3]
        check_grid(hkv, "heads_kv")
        check_grid(b, "batch")
        n_pad = cdiv(nk, bn) * bn
        fields.update(zip(("k_b", "k_n", "k_h"), _strides(k)), **dict(zip(("v_b", "v_n", "v_h"), _strides(v))),
                      heads_kv=hkv, seqlen_k=nk, seqlen_k_pad=n_pad, k_items=cdiv(nk, bn) * hkv * b)
        items += fields["k_items"] + cdiv(nk, AMAX_ROWS) * hkv * b
        kv_shapes = ((b, hkv, nk, D), (b, hkv, cdiv(nk, bn)), (b, hkv, D, n_pad), (b, hkv, D))
        vt_grid = (cdiv(n_pad, VT_KEYS) * (D // min(D, VT_CHANNELS)), hkv, b)
    if items >= 2**31:
        raise ValueError(f"{items} quantizer work items (row blocks and V chunks) exceed the grid's 2^31 - 1")
    rows, vt = quant_instances(ctype, D, cfg, threads)
    return QuantPlan(rows_func=function_of(jit.kernel(QUANT_SOURCE, rows), 0), items=items, threads=threads,
                     vt_func=function_of(jit.kernel(QUANT_SOURCE, vt), 0) if k is not None else 0, vt_grid=vt_grid,
                     template=QUANT.pack(**fields), q_shapes=q_shapes, kv_shapes=kv_shapes)


_QUANT_PLANS = plan_cache()


def _strides(a):
    return [s // a.dtype.itemsize for s in a.strides[:3]]


def quantize_parts(q, k, v, cfg=None, threads: int = QUANT_THREADS) -> dict:
    """Q's part (k = v = None), K's and V's (q = None) or all three of the quantized operands, for the tiles ``cfg``
    (BM, BN, ...) of the kernel that will read them: this device's fa2_fp8 kernel's by default (fa3_fp8 passes its
    own). One launch for Q alone; with K and V a memset of V's amax and two; ``threads``: quantize_qk_amax's CTA (a
    sweep's)."""
    import cupy
    x = q if q is not None else k
    d = x.shape[3]
    cfg = tuple(config(d) if cfg is None else cfg)
    q, k, v = (None if a is None else _padded(a) for a in (q, k, v))
    key = (*(None if a is None else (a.shape, a.strides) for a in (q, k, v)), x.dtype, cfg, threads,
           cupy.cuda.runtime.getDevice())
    plan = cached_plan(_QUANT_PLANS, key, lambda: _quant_plan(q, k, v, cfg, threads))
    ptrs = dict.fromkeys(QUANT.pointers, 0)
    parts = {"head_dim": d}
    if q is not None:
        qq, sq = cupy.empty(plan.q_shapes[0], cupy.uint8), cupy.empty(plan.q_shapes[1], cupy.float32)
        parts.update(q=qq, sq=sq, out_dtype=x.dtype)
        ptrs.update(q=q.data.ptr, qq=qq.data.ptr, sq=sq.data.ptr)
    if k is not None:
        kq_shape, sk_shape, vt_shape, sv_shape = plan.kv_shapes
        kq, sk, vt = cupy.empty(kq_shape, cupy.uint8), cupy.empty(sk_shape, cupy.float32), cupy.empty(vt_shape, cupy.uint8)
        sv, amax = cupy.empty(sv_shape, cupy.float32), cupy.zeros(sv_shape, cupy.float32)
        parts.update(k=kq, vt=vt, sk=sk, sv=sv, seqlen_k=k.shape[1], tiles=cfg, kv_dtype=x.dtype)
        ptrs.update(k=k.data.ptr, v=v.data.ptr, kq=kq.data.ptr, vt=vt.data.ptr, sk=sk.data.ptr, sv=sv.data.ptr,
                    amax=amax.data.ptr)
    _quantize_launches(plan, cupy.cuda.get_current_stream().ptr, tuple(ptrs.values()))
    return parts


def _quantize_launches(plan: QuantPlan, stream: int, ptrs: tuple):
    """The quantizer's two launches; ``ptrs``: QuantParams' pointers in order."""
    launch(plan.rows_func, (plan.items, 1, 1), plan.threads, 0, stream, plan.template, QUANT.pointers_format, *ptrs)
    if plan.vt_func:  # (it waits for the first: griddep_wait)
        launch(plan.vt_func, plan.vt_grid, VT_THREADS, 0, stream, plan.template, QUANT.pointers_format, *ptrs,
               after=True)


def quantize_q(q, cfg=None) -> dict:
    """Q's part of the quantized operands (``quantize_kv`` makes K's and V's)."""
    return quantize_parts(q, None, None, cfg)


def quantize_kv(k, v, cfg=None) -> dict:
    """K's and V's parts: quantize them once and reuse them with many queries (a KV cache)."""
    return quantize_parts(None, k, v, cfg)


def quantize(q, k, v, cfg=None) -> dict:
    """All of Q, K, V: the dict fa_variants.fp8.Quantized wraps."""
    return quantize_parts(q, k, v, cfg)


#: The quantized operands in one workspace (QuantizeAndAttend): name, QuantPlan shape (q_shapes, kv_shapes), dtype.
_WORKSPACE = (("q", 0, 0, np.uint8), ("k", 1, 0, np.uint8), ("vt", 1, 2, np.uint8), ("sq", 0, 1, np.float32),
              ("sk", 1, 1, np.float32), ("sv", 1, 3, np.float32), ("amax", 1, 3, np.float32))
_ALIGN = 256  # each operand's offset in the workspace (TMA takes 16-byte aligned addresses)


@dataclasses.dataclass(frozen=True)
class QuantizeAndAttend:
    """An fp8 forward that quantizes on the fly, for one call signature (api.py caches it like any plan): the
    quantizer's plan, the attention's, and where each e4m3 operand and scale lies in one workspace. A call makes
    one allocation (quantize() makes seven arrays), clears V's amax there and launches the quantizer's two kernels
    and the attention's with pointers into it: the kernels and layouts of quantize() then attention()."""
    quant: QuantPlan
    attend: object              # the fp8 launcher's attention plan
    launch_attention: Callable  # (attend, stream, {operand: address}, out, lse) -> None
    offsets: tuple              # ((operand, byte offset), ...) in _WORKSPACE's order
    nbytes: int
    amax_bytes: int
    out_shape: tuple
    dtype: np.dtype
    lse_shape: tuple | None
    device: int

    def _launch(self, stream: int, base: int, q: int, k: int, v: int, out: int, lse: int):
        import cupy
        at = {name: base + off for name, off in self.offsets}
        cupy.cuda.runtime.memsetAsync(at["amax"], 0, self.amax_bytes, stream)
        _quantize_launches(self.quant, stream, (q, k, v, at["q"], at["k"], at["vt"], at["sq"], at["sk"], at["sv"],
                                                at["amax"]))
        self.launch_attention(self.attend, stream, at, out, lse)

    def run_cupy(self, q, k, v):
        empty, stream = _cupy()
        ws, out = empty(self.nbytes, np.uint8), empty(self.out_shape, self.dtype)
        lse = None if self.lse_shape is None else empty(self.lse_shape, np.float32)
        self._launch(stream().ptr, ws.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr,
                     0 if lse is None else lse.data.ptr)
        return out, lse

    def run_torch(self, q, k, v):
        torch, stream_of = _torch()
        dev = q.device
        ws = torch.empty(self.nbytes, dtype=torch.uint8, device=dev)
        out = torch.empty(self.out_shape, dtype=q.dtype, device=dev)
        lse = None if self.lse_shape is None else torch.empty(self.lse_shape, dtype=torch.float32, device=dev)
        self._launch(stream_of(self.device), ws.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                     0 if lse is None else lse.data_ptr())
        return out, lse


def quantize_and_attend(q, k, v, cfg, make_attention_plan, launch_attention, *, causal, softmax_scale, return_lse):
    """The QuantizeAndAttend of validated, aligned CuPy q, k, v for an fp8 kernel of tiles ``cfg``, whose attention
    plan ``make_attention_plan(qz, causal=, softmax_scale=, return_lse=)`` makes from quantized operands; None where
    the head dim is not a template dim (the operands are then padded copies: the launcher's forward does that)."""
    import cupy
    d = q.shape[3]
    if d != fp8_template_dim(d):
        return None
    cfg = tuple(cfg)
    quant = _quant_plan(q, k, v, cfg, QUANT_THREADS)
    shapes = (quant.q_shapes, quant.kv_shapes)
    size = lambda part, i: int(np.prod(shapes[part][i]))  # noqa: E731
    offsets, nbytes = [], 0
    for name, part, i, dtype in _WORKSPACE:
        offsets.append((name, nbytes))
        nbytes += cdiv(size(part, i) * np.dtype(dtype).itemsize, _ALIGN) * _ALIGN
    # the attention plan, made from views of one such workspace (its tensor maps take their addresses per call)
    ws = cupy.empty(nbytes, cupy.uint8)
    qz = {name: ws[off:].view(dtype)[:size(part, i)].reshape(shapes[part][i])
          for (name, part, i, dtype), (_, off) in zip(_WORKSPACE, offsets)}
    qz.update(seqlen_k=k.shape[1], head_dim=d, tiles=cfg, out_dtype=q.dtype, kv_dtype=k.dtype)
    attend = make_attention_plan(qz, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)
    b, nq, h, _ = q.shape
    return QuantizeAndAttend(quant=quant, attend=attend, launch_attention=launch_attention, offsets=tuple(offsets),
                             nbytes=nbytes, amax_bytes=size(1, 3) * 4, out_shape=(b, nq, h, d),
                             dtype=np.dtype(q.dtype), lse_shape=(b, h, nq) if return_lse else None,
                             device=cupy.cuda.Device().id)


_PLANS = plan_cache()  # (shapes, flags, device, kernel) -> FwdPlan: quantizing on the fly makes a qz per call


def plan_key(qz: dict, causal: bool, softmax_scale: float, return_lse: bool) -> tuple:
    """What a plan on the operands of ``qz`` depends on: their shapes and tiles, the flags, the device."""
    import cupy
    return (qz["q"].shape, qz["k"].shape, qz["vt"].shape, qz["seqlen_k"], qz["head_dim"], np.dtype(qz["out_dtype"]),
            tuple(qz["tiles"]), causal, softmax_scale, return_lse, cupy.cuda.runtime.getDevice())


def plan(qz: dict, *, causal: bool, softmax_scale: float, return_lse: bool, kernel: str | None = None,
         tile=None) -> FwdPlan:
    """The launch of FA2 on e4m3 operands prepared by ``quantize`` (their tiles must be the kernel's: checked).
    Its pointers are q, k, vt, sq, sk, sv, out, lse (params.FP8_FWD). ``kernel``: "mma_sync" or "wgmma" instead
    of this device's choice (operands quantized with that kernel's ``config``); ``tile``: another tile than the
    table's (the operands quantized for it)."""
    kernel = kernel_of(kernel)
    return cached_plan(_PLANS, plan_key(qz, causal, softmax_scale, return_lse) + (kernel, tile),
                       lambda: _plan(qz, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                                     kernel=kernel, tile=tile))


def _plan(qz: dict, *, causal: bool, softmax_scale: float, return_lse: bool, kernel: str, tile=None) -> FwdPlan:
    import cupy
    b, h, nq, D = qz["q"].shape
    d = qz["head_dim"]
    hkv = qz["k"].shape[1]
    nk, nk_pad = qz["seqlen_k"], qz["vt"].shape[3]
    if given_tile(tile, Fp8WgmmaTile if kernel == "wgmma" else Tile) is None:
        tile = config(d, kernel=kernel)
    if tuple(qz["tiles"]) != tuple(tile):
        raise ValueError(f"quantized tensors were made for tiles {qz['tiles']}, the {kernel} kernel uses "
                         f"{tuple(tile)}; quantize again")
    ctype = CTYPE[np.dtype(qz["out_dtype"]).name]
    if kernel == "wgmma":
        kern, smem = jit.kernel(SM90_SOURCE, sm90_instance(ctype, D, tile)), sm90_smem_bytes(D, tile)
    else:
        kern, smem = jit.kernel(SOURCE, instance(ctype, D, tile)), smem_bytes(D, tile)
    check_grid(h, "heads")
    check_grid(b, "batch")
    template = FP8_FWD.pack(q=0, k=0, vt=0, sq=0, sk=0, sv=0, o=0, lse=0, o_b=nq * h * d, o_n=h * d, o_h=d,
                            batch=b, seqlen_q=nq, seqlen_k=nk, seqlen_k_pad=nk_pad, heads=h, group=h // hkv, head_dim=d,
                            scale_log2=scale_log2(softmax_scale), causal=int(bool(causal)), heads_kv=hkv)
    return FwdPlan(func=function_of(kern, smem), grid=(cdiv(nq, tile.block_q), h, b), block=32 * tile.warps,
                   smem=smem, template=template, fmt=FP8_FWD.pointers_format, out_shape=(b, nq, h, d),
                   dtype=np.dtype(qz["out_dtype"]), lse_shape=(b, h, nq) if return_lse else None, ws_rows=0,
                   ws_cols=0, device=cupy.cuda.Device().id)


def run_quantized(p: FwdPlan, qz: dict):
    """(out, lse or None) of plan ``p`` on the operands of ``qz``, on the current stream."""
    import cupy
    out = cupy.empty(p.out_shape, p.dtype)
    lse = None if p.lse_shape is None else cupy.empty(p.lse_shape, cupy.float32)
    launch(p.func, p.grid, p.block, p.smem, cupy.cuda.get_current_stream().ptr, p.template, p.fmt,
           *(qz[n].data.ptr for n in ("q", "k", "vt", "sq", "sk", "sv")), out.data.ptr,
           0 if lse is None else lse.data.ptr)
    return out, lse


def attention_quantized(qz: dict, *, causal: bool, softmax_scale: float, return_lse: bool,
                        kernel: str | None = None):
    """FA2 on e4m3 operands prepared by ``quantize`` (``kernel``: as ``plan``'s)."""
    return run_quantized(plan(qz, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse, kernel=kernel),
                         qz)


def forward(q, k, v, *, causal, softmax_scale, return_lse, kernel: str | None = None):
    """Quantize q, k, v and attend. ``kernel``: "mma_sync" or "wgmma" instead of this device's choice (the FP8
    study and devcheck compare the two on Hopper)."""
    qz = quantize(q, k, v, config(q.shape[3], kernel=kernel))
    return attention_quantized(qz, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse, kernel=kernel)


LAUNCHER = KernelLauncher(sources=lambda: {SOURCE: specializations(), **SOURCES}, forward_fn=forward,
                          tiles_fn=tiles, extra_bytes_fn=extra_bytes, source_archs=SOURCE_ARCHS)
