"""Launcher of cuda_src/fa1_bwd.cu: FlashAttention-1's backward (Algorithm 4), one CTA per K/V block (its outer
loop), an inner loop over the Q blocks that reads Q_i, O_i, dO_i and the LSE at every step, computes
D_i = rowsum(dO_i o O_i) there (the paper's line 19; fa2's separate delta pass is not used), and adds its share of
dQ_i to an fp32 dQ in device memory with atomic adds; a second kernel rounds that to q's dtype.

fa1's dQ is therefore NOT bitwise deterministic: the CTAs of different K/V blocks add into the same rows in an
order that varies run to run (dK and dV are: each is one CTA's registers). fa2's backward is deterministic.

Head dims: every template dim up to 256; above 128 the gradients' columns are split over CTAs (DC < D), as in
fa2_bwd. NOT YET RUN ON A GPU: compiled without spills for every arch.
"""
from __future__ import annotations

from .. import jit
from .common import CTYPE, TEMPLATE_DIMS, cdiv, pick_tiles, template_dim
from .fa2_bwd import bwd_params, prepare
from .launch import function_of, launch
from .params import BWD

SOURCE = "fa1_bwd.cu"
DIMS = TEMPLATE_DIMS
CONVERT_THREADS = 256

# template head_dim -> [(BM queries per inner step, BN keys per CTA, warps, DC gradient columns per CTA)], fastest
# first; a warp owns 16 keys (BN = 16 warps). The first whose shared memory fits the device is used (sm_90 first,
# then sm_80's 163 KB, then sm_86/89's 99 KB). Not tuned.
TILES = {
    32: [(64, 64, 4, 32)],
    64: [(64, 64, 4, 64)],
    96: [(64, 64, 4, 96), (32, 64, 4, 96)],
    128: [(64, 64, 4, 128), (32, 64, 4, 128)],
    160: [(64, 64, 4, 80), (32, 64, 4, 80), (16, 64, 4, 80)],
    192: [(64, 64, 4, 96), (32, 64, 4, 96), (16, 64, 4, 96)],
    224: [(32, 64, 4, 112), (16, 32, 2, 112)],
    256: [(32, 64, 4, 128), (16, 64, 4, 128), (16, 32, 2, 128)],
}
assert tuple(TILES) == DIMS


def smem_bytes(d: int, cfg) -> int:
    """Mirror of Fa1BwdSmem in fa1_bwd.cu: K, V; two stages of Q, dO, O; dS^T; LSE (two stages) and D."""
    bm, bn = cfg[:2]
    row = (d + 8) * 2
    return 2 * bn * row + 6 * bm * row + bn * (bm + 8) * 2 + 3 * bm * 4


def instance(ctype: str, d: int, cfg) -> str:
    bm, bn, w, dc = cfg
    return f"fa1_bwd<{ctype}, {d}, {dc}, {bm}, {bn}, {w}>"


def convert_instance(ctype: str) -> str:
    return f"fa1_bwd_dq_convert<{ctype}, {CONVERT_THREADS}>"


def instances(ctype: str, d: int):
    return tuple(instance(ctype, d, cfg) for cfg in TILES[d]) + (convert_instance(ctype),)


def specializations():
    return tuple(instance(c, d, cfg) for c in CTYPE.values() for d in DIMS for cfg in TILES[d]) + \
        tuple(convert_instance(c) for c in CTYPE.values())


def config(head_dim: int, limit=None):
    return pick_tiles(TILES, smem_bytes, template_dim(head_dim, DIMS), limit)


def backward(dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float):
    """(dq, dk, dv) of validated CuPy arrays on the current stream; head_dim a multiple of 8 up to 256."""
    import cupy
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    D, (dout, q, k, v, out, lse) = prepare("fa1's GPU backward", DIMS, dout, q, k, v, out, lse)
    ctype = CTYPE[q.dtype.name]
    dq_acc = cupy.zeros(q.shape, cupy.float32)   # Algorithm 4, line 5: dQ = 0 in HBM (fp32: the atomic adds' sum)
    dq = cupy.empty(q.shape, q.dtype)
    dk = cupy.empty(k.shape, k.dtype)
    dv = cupy.empty(v.shape, v.dtype)
    template = bwd_params(dout, q, k, v, out, causal=causal, softmax_scale=softmax_scale)
    stream = cupy.cuda.get_current_stream().ptr
    exprs = instances(ctype, D)
    cfg = config(d)
    smem = smem_bytes(D, cfg)
    func = function_of(jit.kernel(SOURCE, instance(ctype, D, cfg), exprs), smem)
    # BwdParams' dq carries the fp32 accumulator here; delta is unused (D_i is computed inside)
    ptrs = tuple(a.data.ptr for a in (q, k, v, out, dout, lse)) + (0, dq_acc.data.ptr, dk.data.ptr, dv.data.ptr)
    launch(func, (cdiv(nk, cfg[1]) * (D // cfg[3]), hkv, b), 32 * cfg[2], smem, stream, template,
           BWD.pointers_format, *ptrs)
    conv = jit.kernel(SOURCE, convert_instance(ctype), exprs)
    pairs = dq_acc.size // 2
    blocks = max(1, min(cdiv(pairs, CONVERT_THREADS), 65535))
    conv((blocks,), (CONVERT_THREADS,), (dq_acc, dq, cupy.int64(pairs)))
    return dq, dk, dv
