"""Launcher of fa3_fp8: cuda_src/fa3_fwd.cu's FP8 instances (FA3's pipeline on e4m3 QGMMA, sm_90a only) on the
operands fa2_fp8's quantizers make (fp8_quantize.cu), with this kernel's Q and K scale blocks.

What differs from fa3's launcher is what the three tensor maps describe: e4m3 Q (batch, heads, seqlen_q, D) and
K (batch, heads_kv, seqlen_k, D) in rows of D bytes, and V^T (batch, heads_kv, D, seqlen_k_pad) in rows of keys;
and the parameter struct, fa2_fp8's Fp8FwdParams (the scales, V^T's padding), or on the persistent grid
Fa3Fp8FwdParams (the same and the split tail's fields). Quantized tensors carry the tiles they were made for;
``plan`` refuses others (their scale blocks would not be this kernel's).
"""
from __future__ import annotations

import numpy as np

from .. import jit
from ..tiles import Fa3Tile, fa3_instances, fa3_tile
from . import KernelLauncher
from . import fa2_fp8, fa3
from .common import CTYPE, PAD_INSTANCES, PAD_SOURCE, cached_plan, given_tile, plan_cache, scale_log2, sm_count
from .launch import function_of
from .params import FA3_FP8_FWD, FP8_FWD
from .tma import MapTemplate, slab_bytes

SOURCE = fa3.SOURCE
ARCHS = fa3.ARCHS


def config(head_dim: int) -> Fa3Tile:
    """The tile at the template dim head_dim pads to (tiles.FA3_FP8_TILES): the quantizers take its BM and BN as
    Q's and K's scale blocks."""
    return fa3_tile(head_dim, fp8=True)


def tiles(head_dim: int, causal: bool = False, seqlen_k: int | None = None) -> tuple[int, int]:
    tile = config(head_dim)
    return tile.block_q, tile.block_k


def specializations():
    return tuple(fa3.instance(c, d, tile, fp8=True) for c in CTYPE.values() for d, tile in fa3_instances(fp8=True))


def quant_specializations():
    return tuple(dict.fromkeys(e for c in CTYPE.values() for d, tile in fa3_instances(fp8=True)
                               for e in fa2_fp8.quant_instances(c, d, tile)))


def extra_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, itemsize=2, heads_kv=None):
    """The e4m3 copies of Q, K and V^T (padded) and their scales, when quantizing on the fly."""
    return fa2_fp8.extra_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, itemsize, heads_kv, tiles_of=tiles)


def quantize_q(q) -> dict:
    return fa2_fp8.quantize_q(q, config(q.shape[3]))


def quantize_kv(k, v) -> dict:
    return fa2_fp8.quantize_kv(k, v, config(k.shape[3]))


def quantize(q, k, v) -> dict:
    return fa2_fp8.quantize(q, k, v, config(q.shape[3]))


def _maps(qz: dict, tile: Fa3Tile) -> tuple:
    """Tensor maps of e4m3 Q, K and V^T as the (batch, rows, heads, row bytes) tensors tma.py describes."""
    bm, bn = tile.block_q, tile.block_k
    q, k, vt = qz["q"], qz["k"], qz["vt"]
    (b, h, nq, D), (hkv, nk), npad = q.shape, k.shape[1:3], vt.shape[3]
    row = slab_bytes(D)  # Q, K: rows of D e4m3 bytes; V^T: rows of BN keys
    return (MapTemplate(q.data.ptr, (b, nq, h, D), (h * nq * D, D, nq * D), 1, bm, "q", row),
            MapTemplate(k.data.ptr, (b, nk, hkv, D), (hkv * nk * D, D, nk * D), 1, bn, "k", row),
            MapTemplate(vt.data.ptr, (b, D, hkv, npad), (hkv * D * npad, npad, D * npad), 1, D, "v^T", slab_bytes(bn)))


_PLANS = plan_cache()  # call signature -> Fa3Plan (quantizing on the fly makes a new qz per call)


def plan(qz: dict, *, causal: bool, softmax_scale: float, return_lse: bool, split: bool | None = None,
         tile: Fa3Tile | None = None) -> fa3.Fa3Plan:
    """The launch of fa3_fp8 on operands from ``quantize`` (made for this kernel's tiles: checked). ``split``: the
    split last wave forced on or off (fa3.tail_split); ``tile``: another tile than the table's (the operands
    quantized for it)."""
    return cached_plan(_PLANS, fa2_fp8.plan_key(qz, causal, softmax_scale, return_lse) + (split, tile),
                       lambda: _plan(qz, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                                     split=split, tile=tile))


def _plan(qz: dict, *, causal: bool, softmax_scale: float, return_lse: bool, split: bool | None = None,
          tile: Fa3Tile | None = None) -> fa3.Fa3Plan:
    import cupy
    b, h, nq, D = qz["q"].shape
    d, hkv = qz["head_dim"], qz["k"].shape[1]
    nk, nk_pad = qz["seqlen_k"], qz["vt"].shape[3]
    tile = config(d) if given_tile(tile, Fa3Tile) is None else tile
    if tuple(qz["tiles"]) != tuple(tile):
        raise ValueError(f"quantized tensors were made for tiles {qz['tiles']}, fa3_fp8 uses {tuple(tile)}; quantize "
                         "with fa_variants.fp8.quantize(..., variant='fa3_fp8')")
    out_dtype = np.dtype(qz["out_dtype"])
    at = fa3.launch_of(out_dtype.name, batch=b, heads=h, seqlen_q=nq, seqlen_k=nk, head_dim=d, causal=causal,
                       sms=sm_count(), fp8=True, split=split, tile=tile)
    maps = _maps(qz, at.tile)
    if at.tma_out:  # O (16-bit) through a shared buffer of its own, stored by TMA
        maps += (fa3.out_map(qz["k"].data.ptr, b, nq, h, d),)
    fields = dict(q=0, k=0, vt=0, sq=0, sk=0, sv=0, o=0, lse=0, o_b=nq * h * d, o_n=h * d, o_h=d, batch=b, seqlen_q=nq,
                  seqlen_k=nk, seqlen_k_pad=nk_pad, heads=h, group=h // hkv, head_dim=d,
                  scale_log2=scale_log2(abs(softmax_scale)), causal=int(bool(causal)), heads_kv=hkv)
    # the persistent grid's instances take the split tail's fields too (Fa3Fp8FwdParams), the others fa2_fp8's
    params = FA3_FP8_FWD if at.tile.persistent else FP8_FWD
    if params is FA3_FP8_FWD:
        fields.update(tail_tiles=at.tail[0], tail_blocks=at.tail[1], tail_ranges=at.tail[2], o_ws=0)
    return fa3.Fa3Plan(func=function_of(jit.kernel(SOURCE, at.instance), at.smem), grid=(at.ctas, 1, 1),
                       block=at.tile.threads, smem=at.smem, template=params.pack(**fields), workspace=at.workspace,
                       ws_offset=FA3_FP8_FWD.offset("o_ws"), fmt=params.pointers_format, maps=maps,
                       out_shape=(b, nq, h, d), dtype=out_dtype, lse_shape=(b, h, nq) if return_lse else None,
                       device=cupy.cuda.Device().id, persistent=at.tile.persistent, negate_q=softmax_scale < 0)


def launch_on(p: fa3.Fa3Plan, stream: int, at: dict, out: int, lse: int, after: bool = False):
    """Plan ``p`` on the operands at addresses ``at`` (q, k, vt, sq, sk, sv), into out (and lse, 0: none).
    ``after``: started behind the quantizer still running (the kernel's griddep_wait holds it until that ends)."""
    maps = (at["q"], at["k"], at["vt"])
    p.launch(stream, maps + (out,), maps + (at["sq"], at["sk"], at["sv"], out, lse),  # (out: where O leaves by TMA)
             after=after)


def launch_behind_quantizer(p: fa3.Fa3Plan, stream: int, at: dict, out: int, lse: int):
    launch_on(p, stream, at, out, lse, after=True)


def run_quantized(p: fa3.Fa3Plan, qz: dict):
    """(out, lse or None) of plan ``p`` on the operands of ``qz``, on the current stream."""
    import cupy
    out = cupy.empty(p.out_shape, p.dtype)
    lse = None if p.lse_shape is None else cupy.empty(p.lse_shape, cupy.float32)
    # The kernel folds a positive score scale into its exponent (its row max is of the raw scores): a negative
    # one runs as softmax(|scale| (-Q) K^T), on a copy of Q with every sign bit flipped (exact; NaN stays NaN).
    q = qz["q"] ^ 0x80 if p.negate_q else qz["q"]
    at = {n: qz[n].data.ptr for n in ("k", "vt", "sq", "sk", "sv")}
    launch_on(p, cupy.cuda.get_current_stream().ptr, {**at, "q": q.data.ptr}, out.data.ptr,
              0 if lse is None else lse.data.ptr)
    return out, lse


def attention_quantized(qz: dict, *, causal: bool, softmax_scale: float, return_lse: bool,
                        split: bool | None = None):
    """fa3_fp8 on operands from ``quantize``; ``split``: the split last wave forced on or off (the GPU tests')."""
    return run_quantized(plan(qz, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse, split=split), qz)


def forward(q, k, v, *, causal, softmax_scale, return_lse):
    return attention_quantized(quantize(q, k, v), causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)


def plan_on_the_fly(q, k, v, *, causal, softmax_scale, return_lse):
    """The quantize-then-attend plan of aligned q, k, v (api.py caches it per call signature); None at a head dim
    that is padded first. (api.py hands a negative scale over as a positive one on a negated q.)"""
    return fa2_fp8.quantize_and_attend(q, k, v, config(q.shape[3]), plan, launch_behind_quantizer, causal=causal,
                                       softmax_scale=softmax_scale, return_lse=return_lse)


LAUNCHER = KernelLauncher(sources=lambda: {SOURCE: specializations(), fa2_fp8.QUANT_SOURCE: quant_specializations(),
                                           PAD_SOURCE: PAD_INSTANCES},
                          forward_fn=forward, tiles_fn=tiles, extra_bytes_fn=extra_bytes,
                          source_archs={SOURCE: ARCHS}, plan_fn=plan_on_the_fly)
