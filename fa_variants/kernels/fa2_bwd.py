"""Launcher of cuda_src/fa2_bwd.cu: FlashAttention-2's backward with recomputation, deterministic (three passes:
D = rowsum(dO * O); dK, dV per K/V block; dQ per Q block).

NOT YET RUN ON A GPU: written and compiled (every arch, no spills) in a session with no device time left. The
API does not call it: ``fav.attention_backward`` on the GPU raises BackendUnavailable until the GPU tests of
tests/test_gpu_backward.py pass on the H200; those tests call ``backward`` here directly.
"""
from __future__ import annotations

from .. import jit
from .common import CTYPE, cdiv, check_grid, elem_strides, ensure_vector_aligned, pick_tiles, template_dim
from .launch import function_of, launch
from .params import BWD

SOURCE = "fa2_bwd.cu"
DIMS = (32, 64, 96, 128)   # template head dims: above 128, dK and dV of 16 keys no longer fit a warp's registers
DELTA_WARPS = 4

# template head_dim -> [(BM queries per step, BN keys per CTA, warps)], fastest first (a warp owns 16 keys), and
# the dQ pass's [(BM queries per CTA, BN keys per step, warps)] (a warp owns 16 query rows). Not yet tuned.
DKDV_TILES = {d: [(64, 64, 4)] for d in DIMS}
DQ_TILES = {d: [(128, 64, 8), (64, 32 if d == 96 else 64, 4)] for d in DIMS}  # (64, 64, 4) spills at d = 96 on sm_80


def dkdv_smem(d: int, cfg) -> int:
    bm, bn = cfg[:2]
    row = (d + 8) * 2
    return 2 * bn * row + 4 * bm * row + 4 * bm * 4  # K, V; two stages of Q, dO; two of the rows' LSE and D


def dq_smem(d: int, cfg) -> int:
    bm, bn = cfg[:2]
    row = (d + 8) * 2
    return 2 * bm * row + 4 * bn * row  # Q, dO; two stages of K, V


def instances(ctype: str, d: int):
    a, b = DKDV_TILES[d], DQ_TILES[d]
    return ((f"fa2_bwd_delta<{ctype}, {d}, {DELTA_WARPS}>",)
            + tuple(f"fa2_bwd_dkdv<{ctype}, {d}, {bm}, {bn}, {w}>" for bm, bn, w in a)
            + tuple(f"fa2_bwd_dq<{ctype}, {d}, {bm}, {bn}, {w}>" for bm, bn, w in b))


def specializations():
    return tuple(e for c in CTYPE.values() for d in DIMS for e in instances(c, d))


def backward(dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float):
    """(dq, dk, dv) of validated CuPy arrays on the current stream; head_dim a multiple of 8 up to 128."""
    import cupy
    from .common import scale_log2
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    if d % 8 or d > DIMS[-1]:
        raise ValueError(f"fa2's GPU backward takes head_dim a multiple of 8 up to {DIMS[-1]}, got {d}")
    check_grid(h, "heads")
    check_grid(b, "batch")
    D = template_dim(d, DIMS)
    ctype = CTYPE[q.dtype.name]
    q, k, v, out, dout = (ensure_vector_aligned(a) for a in (q, k, v, out, dout))
    lse = cupy.ascontiguousarray(lse, dtype=cupy.float32)
    delta = cupy.empty((b, h, nq), cupy.float32)
    dq = cupy.empty(q.shape, q.dtype)
    dk = cupy.empty(k.shape, k.dtype)
    dv = cupy.empty(v.shape, v.dtype)
    qs, ks, vs, os, ds = (elem_strides(a) for a in (q, k, v, out, dout))
    template = BWD.pack(q=0, k=0, v=0, o=0, dout=0, lse=0, delta=0, dq=0, dk=0, dv=0,
                        q_b=qs[0], q_n=qs[1], q_h=qs[2], k_b=ks[0], k_n=ks[1], k_h=ks[2], v_b=vs[0], v_n=vs[1],
                        v_h=vs[2], o_b=os[0], o_n=os[1], o_h=os[2], do_b=ds[0], do_n=ds[1], do_h=ds[2],
                        seqlen_q=nq, seqlen_k=nk, heads=h, group=h // hkv, head_dim=d,
                        scale_log2=scale_log2(softmax_scale), scale=softmax_scale, causal=int(bool(causal)))
    ptrs = tuple(a.data.ptr for a in (q, k, v, out, dout, lse, delta, dq, dk, dv))
    stream = cupy.cuda.get_current_stream().ptr
    exprs = instances(ctype, D)

    def run(expr, grid, block, smem):
        func = function_of(jit.kernel(SOURCE, expr, exprs), smem)
        launch(func, grid, block, smem, stream, template, BWD.pointers_format, *ptrs)

    run(exprs[0], (cdiv(nq, DELTA_WARPS), h, b), 32 * DELTA_WARPS, 0)
    kv = pick_tiles(DKDV_TILES, dkdv_smem, D)
    run(f"fa2_bwd_dkdv<{ctype}, {D}, {kv[0]}, {kv[1]}, {kv[2]}>", (cdiv(nk, kv[1]), hkv, b), 32 * kv[2],
        dkdv_smem(D, kv))
    qc = pick_tiles(DQ_TILES, dq_smem, D)
    run(f"fa2_bwd_dq<{ctype}, {D}, {qc[0]}, {qc[1]}, {qc[2]}>", (cdiv(nq, qc[0]), h, b), 32 * qc[2], dq_smem(D, qc))
    return dq, dk, dv
