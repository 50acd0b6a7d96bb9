"""Launcher of cuda_src/fa2_fp8_fwd.cu and cuda_src/fp8_quantize.cu: quantize (or take quantized) Q, K, V, then
FA2 on e4m3 tensor cores. The quantized layout is what fa_variants.fp8.quantize returns."""
from __future__ import annotations

import numpy as np

from .. import jit
from .common import CTYPE, cdiv, check_grid, tile_lookup, scale_log2

SOURCE = "fa2_fp8_fwd.cu"
QUANT_SOURCE = "fp8_quantize.cu"
QUANT_THREADS = 256
AMAX_ROWS = 64

# head_dim -> (BM rows of Q per CTA = Q scale block, BN keys per block = K scale block, warps). On sm_90 the
# e4m3 mma.sync is emulated (ptxas unpacks e4m3 to f16 for HMMA), which costs registers: these are the
# largest tiles that compile without spills for both sm_89 and sm_90a (bench/NOTES.md).
TILES = {64: [(128, 32, 4)], 128: [(64, 64, 4)], 256: [(128, 32, 8)]}


def smem_bytes(d: int, cfg) -> int:
    bm, bn = cfg[:2]
    q = bm * (d // 2 + 8) * 2
    k = bn * (d // 2 + 8) * 2
    vt = d * (bn // 2 + 8) * 2
    return q + 2 * (k + vt)


config, tiles = tile_lookup(TILES, smem_bytes)


def instance(ctype: str, d: int, cfg) -> str:
    bm, bn, w = cfg
    return f"fa2_fp8_fwd<{ctype}, {d}, {bm}, {bn}, {w}>"


def quant_instances(ctype: str, d: int, cfg):
    bm, bn, _ = cfg
    return (f"quantize_rows<{ctype}, {d}, {bm}, {QUANT_THREADS}>", f"quantize_rows<{ctype}, {d}, {bn}, {QUANT_THREADS}>",
            f"channel_amax<{ctype}, {d}, {AMAX_ROWS}, {min(d, 128)}>", f"quantize_vt<{ctype}, {d}, {QUANT_THREADS}>")


def specializations():
    return tuple(instance(c, d, cfg) for c in CTYPE.values() for d, cfgs in TILES.items() for cfg in cfgs)


SOURCES = {QUANT_SOURCE: tuple(dict.fromkeys(
    e for c in CTYPE.values() for d, cfgs in TILES.items() for cfg in cfgs for e in quant_instances(c, d, cfg)))}


def extra_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, itemsize=2, heads_kv=None):
    """The e4m3 copies of Q, K and V^T (padded) and their scales, when quantizing on the fly."""
    heads_kv = heads if heads_kv is None else heads_kv
    bm, bn = tiles(head_dim)
    nk_pad = cdiv(seqlen_k, bn) * bn
    return (batch * head_dim * (heads * seqlen_q + heads_kv * (seqlen_k + nk_pad))
            + 4 * batch * (heads * cdiv(seqlen_q, bm) + heads_kv * (cdiv(seqlen_k, bn) + 2 * head_dim)))


def _strides(a):
    return [np.int64(s // a.dtype.itemsize) for s in a.strides[:3]]


def quantize_rows(x, block: int, ctype: str, d: int, cfg):
    """(B, N, H, d) fp16/bf16 -> ((B, H, N, d) e4m3 bytes, (B, H, ceil(N/block)) float32 scales)."""
    import cupy
    b, n, h, _ = x.shape
    xq = cupy.empty((b, h, n, d), dtype=cupy.uint8)
    sc = cupy.empty((b, h, cdiv(n, block)), dtype=cupy.float32)
    kern = jit.kernel(QUANT_SOURCE, f"quantize_rows<{ctype}, {d}, {block}, {QUANT_THREADS}>")
    kern((cdiv(n, block), h, b), (QUANT_THREADS,), (x, *_strides(x), np.int32(n), xq, sc))
    return xq, sc


def quantize_v(v, block_k: int, ctype: str, d: int):
    """(B, N, H, d) -> (V^T (B, H, d, N_pad) e4m3 bytes in vt_key order, (B, H, d) float32 per-channel scales)."""
    import cupy
    b, n, h, _ = v.shape
    n_pad = cdiv(n, block_k) * block_k
    amax = cupy.zeros((b, h, d), dtype=cupy.float32)
    threads = min(d, 128)
    jit.kernel(QUANT_SOURCE, f"channel_amax<{ctype}, {d}, {AMAX_ROWS}, {threads}>")(
        (cdiv(n, AMAX_ROWS), h, b), (threads,), (v, *_strides(v), np.int32(n), amax))
    vt = cupy.empty((b, h, d, n_pad), dtype=cupy.uint8)
    sv = cupy.empty((b, h, d), dtype=cupy.float32)
    jit.kernel(QUANT_SOURCE, f"quantize_vt<{ctype}, {d}, {QUANT_THREADS}>")(
        (n_pad // 32, h, b), (QUANT_THREADS,), (v, *_strides(v), np.int32(n), np.int32(n_pad), amax, vt, sv))
    return vt, sv


def quantize_q(q) -> dict:
    """Q's part of the quantized operands (``quantize_kv`` makes K's and V's), with this device's tiles."""
    from .. import arrays
    d = q.shape[3]
    cfg = config(d)
    qq, sq = quantize_rows(q, cfg[0], CTYPE[arrays.dtype_name(q.dtype)], d, cfg)
    return dict(q=qq, sq=sq, out_dtype=q.dtype)


def quantize_kv(k, v) -> dict:
    """K's and V's parts: quantize them once and reuse them with many queries (a KV cache)."""
    from .. import arrays
    d = k.shape[3]
    cfg = config(d)
    ctype = CTYPE[arrays.dtype_name(k.dtype)]
    kq, sk = quantize_rows(k, cfg[1], ctype, d, cfg)
    vt, sv = quantize_v(v, cfg[1], ctype, d)
    return dict(k=kq, vt=vt, sk=sk, sv=sv, seqlen_k=k.shape[1], tiles=cfg, kv_dtype=k.dtype)


def quantize(q, k, v) -> dict:
    """All of Q, K, V: the dict fa_variants.fp8.Quantized wraps."""
    return {**quantize_q(q), **quantize_kv(k, v)}


def attention_quantized(qz: dict, *, causal: bool, softmax_scale: float, return_lse: bool):
    """FA2 on e4m3 operands prepared by ``quantize`` (their tiles must be this device's: checked)."""
    import cupy
    b, h, nq, d = qz["q"].shape
    hkv = qz["k"].shape[1]
    nk, nk_pad = qz["seqlen_k"], qz["vt"].shape[3]
    cfg = config(d)
    if tuple(qz["tiles"]) != tuple(cfg):
        raise ValueError(f"quantized tensors were made for tiles {qz['tiles']}, this GPU uses {cfg}; quantize again")
    ctype = CTYPE[qz["out_dtype"].name]
    out = cupy.empty((b, nq, h, d), dtype=qz["out_dtype"])
    lse = cupy.empty((b, h, nq), dtype=cupy.float32)
    kern = jit.kernel(SOURCE, instance(ctype, d, cfg))
    smem = smem_bytes(d, cfg)
    kern.max_dynamic_shared_size_bytes = smem
    check_grid(h, "heads")
    check_grid(b, "batch")
    kern((cdiv(nq, cfg[0]), h, b), (32 * cfg[2],),
         (qz["q"], qz["k"], qz["vt"], qz["sq"], qz["sk"], qz["sv"], out, lse, np.int32(nq), np.int32(nk),
          np.int32(nk_pad), np.int32(h), np.int32(h // hkv), np.float32(scale_log2(softmax_scale)),
          np.int32(bool(causal))), shared_mem=smem)
    return out, (lse if return_lse else None)


def forward(q, k, v, *, causal, softmax_scale, return_lse):
    qz = quantize(q, k, v)
    return attention_quantized(qz, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)
