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
from . import KernelLauncher
from . import fa2_fp8, fa3
from .common import CTYPE, PAD_INSTANCES, PAD_SOURCE, cached_plan, cdiv, plan_cache, scale_log2
from .launch import function_of
from .params import FA3_FP8_FWD, FP8_FWD
from .tma import MapTemplate, slab_bytes

SOURCE = fa3.SOURCE
ARCHS = fa3.ARCHS
DIMS = fa2_fp8.FP8_TEMPLATE_DIMS
# template head_dim -> [(BM = 64 per consumer warpgroup, BN keys per block, stages, ping-pong, persistent)], the
# first used. BM is Q's scale block and BN K's (fa2_fp8's quantizers take them). e4m3 halves the shared memory and
# the P fragments of fa3's tiles; S (BN / 2 fp32 registers a thread) and O (D / 2) stay. d 64 on the persistent
# grid: +6-8 % at N 4K and 16K (bench/RESULTS.md, fourth session). d 128 too since O leaves it by TMA from a buffer
# of its own and its last wave is split (fa3_fwd.cu's TMA_OUT, SPLIT): +4-5 % at N 4K-16K, +1.4 % causal (d 64 +1-4 %;
# bench/NOTES.md, eighteenth session); d 256 has no room for that buffer and runs one CTA per tile.
# d 128 with 192-key blocks (V^T in 64-byte slabs): +3-5 % at N >= 8K, even at 4K (eighth session); 256 keys spill,
# and FA3's 224 (V^T in 32-byte slabs) measured level (0.98-1.01, seventeenth session). d 64 with FA3's 160-key
# blocks (V^T in 32-byte slabs): +2-3 % at N 4K and 16K over 128 (seventeenth session).
TILES = {64: [(192, 160, 2, 1, 1)], 128: [(128, 192, 2, 1, 1)], 256: [(128, 128, 2, 1, 0)]}


def config(head_dim: int, limit=None) -> tuple:
    """(BM, BN, stages, ping-pong, persistent) at the template dim head_dim pads to."""
    return tuple(TILES[fa2_fp8.fp8_template_dim(head_dim)][0])


def tiles(head_dim: int, limit=None):
    return config(head_dim)[:2]


def instance(ctype: str, d: int, cfg) -> str:
    return fa3.instance(ctype, d, cfg=cfg, fp8=True)


def specializations():
    return tuple(instance(c, d, cfg) for c in CTYPE.values() for d in DIMS for cfg in TILES[d])


def quant_specializations():
    return tuple(dict.fromkeys(e for c in CTYPE.values() for d in DIMS for cfg in TILES[d]
                               for e in fa2_fp8.quant_instances(c, d, cfg)))


def extra_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, itemsize=2, heads_kv=None):
    """The e4m3 copies of Q, K and V^T (padded) and their scales, when quantizing on the fly."""
    return fa2_fp8.extra_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, itemsize, heads_kv, tiles_of=tiles)


def quantize_q(q) -> dict:
    return fa2_fp8.quantize_q(q, config(q.shape[3]))


def quantize_kv(k, v) -> dict:
    return fa2_fp8.quantize_kv(k, v, config(k.shape[3]))


def quantize(q, k, v) -> dict:
    return fa2_fp8.quantize(q, k, v, config(q.shape[3]))


def _maps(qz: dict, cfg) -> tuple:
    """Tensor maps of e4m3 Q, K and V^T as the (batch, rows, heads, row bytes) tensors tma.py describes."""
    bm, bn = cfg[:2]
    q, k, vt = qz["q"], qz["k"], qz["vt"]
    (b, h, nq, D), (hkv, nk), npad = q.shape, k.shape[1:3], vt.shape[3]
    row = slab_bytes(D)  # Q, K: rows of D e4m3 bytes; V^T: rows of BN keys
    return (MapTemplate(q.data.ptr, (b, nq, h, D), (h * nq * D, D, nq * D), 1, bm, "q", row),
            MapTemplate(k.data.ptr, (b, nk, hkv, D), (hkv * nk * D, D, nk * D), 1, bn, "k", row),
            MapTemplate(vt.data.ptr, (b, D, hkv, npad), (hkv * D * npad, npad, D * npad), 1, D, "v^T", slab_bytes(bn)))


_PLANS = plan_cache()  # call signature -> Fa3Plan (quantizing on the fly makes a new qz per call)


def plan(qz: dict, *, causal: bool, softmax_scale: float, return_lse: bool) -> fa3.Fa3Plan:
    """The launch of fa3_fp8 on operands from ``quantize`` (made for this kernel's tiles: checked)."""
    return cached_plan(_PLANS, fa2_fp8.plan_key(qz, causal, softmax_scale, return_lse),
                       lambda: _plan(qz, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse))


def _plan(qz: dict, *, causal: bool, softmax_scale: float, return_lse: bool) -> fa3.Fa3Plan:
    import cupy
    b, h, nq, D = qz["q"].shape
    d, hkv = qz["head_dim"], qz["k"].shape[1]
    nk, nk_pad = qz["seqlen_k"], qz["vt"].shape[3]
    cfg = config(d)
    if tuple(qz["tiles"]) != cfg:
        raise ValueError(f"quantized tensors were made for tiles {qz['tiles']}, fa3_fp8 uses {cfg}; quantize with "
                         "fa_variants.fp8.quantize(..., variant='fa3_fp8')")
    tiles = cdiv(nq, cfg[0]) * h * b
    if tiles >= 2**31:
        raise ValueError(f"batch * heads * Q blocks = {tiles} tiles exceed the grid's 2^31 - 1")
    smem = fa3.smem_bytes(D, cfg, itemsize=1)
    kern = jit.kernel(SOURCE, instance(CTYPE[np.dtype(qz["out_dtype"]).name], D, cfg))
    maps = _maps(qz, cfg)
    tma_out = fa3.stores_o_by_tma(D, cfg, itemsize=1)
    if tma_out:  # O (16-bit) through a shared buffer of its own, stored by TMA
        maps += (fa3.out_map(qz["k"].data.ptr, b, nq, h, d),)
    ctas = fa3.grid(nq, h, b, cfg)
    tail = fa3.tail_split(tiles, ctas[0], cdiv(nk, cfg[1]), causal, tma_out)
    fields = dict(q=0, k=0, vt=0, sq=0, sk=0, sv=0, o=0, lse=0, o_b=nq * h * d, o_n=h * d, o_h=d, batch=b, seqlen_q=nq,
                  seqlen_k=nk, seqlen_k_pad=nk_pad, heads=h, group=h // hkv, head_dim=d,
                  scale_log2=scale_log2(abs(softmax_scale)), causal=int(bool(causal)), heads_kv=hkv)
    # the persistent grid's instances take the split tail's fields too (Fa3Fp8FwdParams), the others fa2_fp8's
    params = FA3_FP8_FWD if fa3.persistent(cfg) else FP8_FWD
    if params is FA3_FP8_FWD:
        fields.update(tail_tiles=tail[0], tail_blocks=tail[1], tail_ranges=tail[2], o_ws=0)
    template = params.pack(**fields)
    return fa3.Fa3Plan(func=function_of(kern, smem), grid=ctas, block=fa3.threads(cfg), smem=smem, template=template,
                       workspace=fa3.workspace_bytes(D, cfg, tail), ws_offset=FA3_FP8_FWD.offset("o_ws"),
                       fmt=params.pointers_format, maps=maps,
                       out_shape=(b, nq, h, d), dtype=np.dtype(qz["out_dtype"]),
                       lse_shape=(b, h, nq) if return_lse else None, device=cupy.cuda.Device().id,
                       persistent=fa3.persistent(cfg), negate_q=softmax_scale < 0)


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


def attention_quantized(qz: dict, *, causal: bool, softmax_scale: float, return_lse: bool):
    return run_quantized(plan(qz, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse), qz)


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
