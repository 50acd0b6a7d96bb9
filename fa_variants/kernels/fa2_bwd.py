"""Launcher of cuda_src/fa2_bwd.cu: FlashAttention-2's backward with recomputation, deterministic (three passes:
D = rowsum(dO * O); dK, dV per K/V block; dQ per Q block).

Head dims 32..128 (the template dims up to 128) ran their GPU tests on an H200; the column-split kernels of head
dims 160..256 (DC < D below: each CTA accumulates a slice of the gradients' columns) are compiled without spills
but NOT YET RUN ON A GPU.

``delta(dout, out)`` is the first pass alone (any head dim a multiple of 8), for other backwards to share.
"""
from __future__ import annotations

from .. import jit
from .common import CTYPE, TEMPLATE_DIMS, cdiv, check_grid, elem_strides, ensure_vector_aligned, pick_tiles, template_dim
from .launch import function_of, launch
from .params import BWD

SOURCE = "fa2_bwd.cu"
DIMS = TEMPLATE_DIMS      # template head dims, as the forward's
DELTA_WARPS = 4

# template head_dim -> the dK/dV pass's [(BM queries per step, BN keys per CTA, warps, DC gradient columns per
# CTA)], fastest first (a warp owns 16 keys), and the dQ pass's [(BM queries per CTA, BN keys per step, warps, DC)]
# (a warp owns 16 query rows). The first whose shared memory fits the device is used (sm_90 the first; sm_80 and
# sm_86/89 have less). Above d = 128 a warp's 16 rows of dK and dV (2 x 4 DC / 8 fp32 registers a thread) no
# longer fit with DC = D, so the columns are split over D / DC CTAs, each recomputing S and dP. Not yet tuned.
DKDV_TILES = {
    32: [(64, 64, 4, 32)],
    64: [(64, 64, 4, 64), (32, 64, 4, 64)],
    96: [(64, 64, 4, 96), (32, 64, 4, 96)],
    128: [(64, 64, 4, 128), (32, 64, 4, 128)],
    160: [(64, 64, 4, 80), (32, 64, 4, 80), (16, 32, 2, 80)],
    192: [(64, 64, 4, 96), (32, 64, 4, 96), (16, 32, 2, 96)],
    224: [(64, 64, 4, 112), (32, 64, 4, 112), (16, 32, 2, 112)],
    256: [(64, 64, 4, 128), (32, 64, 4, 128), (16, 32, 2, 128)],
}
# dQ of 16 rows x 256 columns is 128 registers a thread: with 32-key steps (S and dS: 16 each) it fits unsplit
# (DC = D), which spares the split's second S and dP.
DQ_TILES = {
    32: [(128, 64, 8, 32), (64, 64, 4, 32)],
    64: [(128, 64, 8, 64), (64, 64, 4, 64)],
    96: [(128, 64, 8, 96), (64, 32, 4, 96)],   # (64, 64, 4) spills at d = 96 on sm_80
    128: [(128, 64, 8, 128), (64, 64, 4, 128), (64, 32, 4, 128)],
    **{d: [(64, 32, 4, d), (32, 16, 2, d)] for d in (160, 192, 224, 256)},
}
assert tuple(DKDV_TILES) == tuple(DQ_TILES) == DIMS

# The masked passes (fa2_bwd_dkdv_masked, fa2_bwd_dq_masked: the mask's interval, cap and slope take registers):
# the tiles above that compile without spills for sm_80 and sm_90a.
MASKED_DKDV_TILES = {**DKDV_TILES, 96: DKDV_TILES[96][1:], 128: DKDV_TILES[128][1:], 192: DKDV_TILES[192][1:],
                     224: DKDV_TILES[224][1:], 256: DKDV_TILES[256][2:]}
MASKED_DQ_TILES = {**DQ_TILES, 160: DQ_TILES[160][1:], 192: DQ_TILES[192][:1]}


def dkdv_smem(d: int, cfg) -> int:
    bm, bn = cfg[:2]
    row = (d + 8) * 2
    return 2 * bn * row + 4 * bm * row + 4 * bm * 4  # K, V; two stages of Q, dO; two of the rows' LSE and D


def dq_smem(d: int, cfg) -> int:
    bm, bn = cfg[:2]
    row = (d + 8) * 2
    return 2 * bm * row + 4 * bn * row  # Q, dO; two stages of K, V


def delta_instance(ctype: str) -> str:
    return f"fa2_bwd_delta<{ctype}, {DELTA_WARPS}>"


def dkdv_instance(ctype: str, d: int, cfg) -> str:
    bm, bn, w, dc = cfg
    return f"fa2_bwd_dkdv<{ctype}, {d}, {dc}, {bm}, {bn}, {w}>"


def dq_instance(ctype: str, d: int, cfg) -> str:
    bm, bn, w, dc = cfg
    return f"fa2_bwd_dq<{ctype}, {d}, {dc}, {bm}, {bn}, {w}>"


def masked(instance: str) -> str:
    """The masked kernel of a pass's instance name (fa2_bwd_dkdv<...> -> fa2_bwd_dkdv_masked<...>)."""
    return instance.replace("<", "_masked<", 1)


def masked_instances(ctype: str, d: int):
    return (tuple(masked(dkdv_instance(ctype, d, cfg)) for cfg in MASKED_DKDV_TILES[d])
            + tuple(masked(dq_instance(ctype, d, cfg)) for cfg in MASKED_DQ_TILES[d]))


def instances(ctype: str, d: int):
    """The dK/dV and dQ kernels of one dtype and template dim: one NVRTC module (the delta pass is its own)."""
    return (tuple(dkdv_instance(ctype, d, cfg) for cfg in DKDV_TILES[d])
            + tuple(dq_instance(ctype, d, cfg) for cfg in DQ_TILES[d]))


def specializations():
    return (tuple(delta_instance(c) for c in CTYPE.values())
            + tuple(e for c in CTYPE.values() for d in DIMS for e in instances(c, d) + masked_instances(c, d)))


def prepare(what: str, dims, dout, q, k, v, out, lse):
    """What every GPU backward does first (``what`` names it in the error): head_dim a multiple of 8 up to
    dims[-1], the grid's limits, 16-byte aligned copies of what is not, LSE as contiguous float32. Returns
    (template head dim, (dout, q, k, v, out, lse))."""
    import cupy
    b, _, h, d = q.shape
    if d % 8 or d > dims[-1]:
        raise ValueError(f"{what} takes head_dim a multiple of 8 up to {dims[-1]}, got {d}")
    check_grid(h, "heads")
    check_grid(b, "batch")
    q, k, v, out, dout = (ensure_vector_aligned(a) for a in (q, k, v, out, dout))
    return template_dim(d, dims), (dout, q, k, v, out, cupy.ascontiguousarray(lse, dtype=cupy.float32))


def bwd_params(dout, q, k, v, out, *, causal: bool, softmax_scale: float) -> bytes:
    """BwdParams with every pointer zero (the launches fill them)."""
    from .common import scale_log2
    b, nq, h, d = q.shape
    qs, ks, vs, os, ds = (elem_strides(a) for a in (q, k, v, out, dout))
    return BWD.pack(q=0, k=0, v=0, o=0, dout=0, lse=0, delta=0, dq=0, dk=0, dv=0,
                    q_b=qs[0], q_n=qs[1], q_h=qs[2], k_b=ks[0], k_n=ks[1], k_h=ks[2], v_b=vs[0], v_n=vs[1],
                    v_h=vs[2], o_b=os[0], o_n=os[1], o_h=os[2], do_b=ds[0], do_n=ds[1], do_h=ds[2],
                    seqlen_q=nq, seqlen_k=k.shape[1], heads=h, group=h // k.shape[2], head_dim=d,
                    scale_log2=scale_log2(softmax_scale), scale=softmax_scale, causal=int(bool(causal)))


def delta(dout, out, delta_out=None):
    """Pass 1 alone: D = rowsum(dO * O) in fp32, a fresh (batch, heads, seqlen_q) float32 array (or written into
    ``delta_out``, contiguous float32 of that shape), on the current stream. ``dout`` and ``out``: CuPy
    (batch, seqlen_q, heads, head_dim) float16/bfloat16 of one dtype, head_dim a multiple of 8, any strides with a
    contiguous last dim (misaligned ones are copied)."""
    import cupy
    b, nq, h, d = out.shape
    if tuple(dout.shape) != tuple(out.shape) or dout.dtype != out.dtype:
        raise ValueError(f"dout and out must have one shape and dtype, got {dout.shape} {dout.dtype} and "
                         f"{out.shape} {out.dtype}")
    if d % 8:
        raise ValueError(f"the delta pass takes head_dim a multiple of 8, got {d}")
    check_grid(h, "heads")
    check_grid(b, "batch")
    dout, out = (ensure_vector_aligned(a) for a in (dout, out))
    if delta_out is None:
        delta_out = cupy.empty((b, h, nq), cupy.float32)
    elif delta_out.shape != (b, h, nq) or delta_out.dtype != cupy.float32 or not delta_out.flags.c_contiguous:
        raise ValueError(f"delta_out must be contiguous float32 {(b, h, nq)}, got {delta_out.dtype} {delta_out.shape}")
    template = bwd_params(dout, out, out, out, out, causal=False, softmax_scale=1.0)
    expr = delta_instance(CTYPE[out.dtype.name])
    func = function_of(jit.kernel(SOURCE, expr, (expr,)), 0)
    ptrs = (0, 0, 0, out.data.ptr, dout.data.ptr, 0, delta_out.data.ptr, 0, 0, 0)
    launch(func, (cdiv(nq, DELTA_WARPS), h, b), 32 * DELTA_WARPS, 0, cupy.cuda.get_current_stream().ptr,
           template, BWD.pointers_format, *ptrs)
    return delta_out


def backward(dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float):
    """(dq, dk, dv) of validated CuPy arrays on the current stream; head_dim a multiple of 8 up to 256."""
    import cupy
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    D, (dout, q, k, v, out, lse) = prepare("fa2's GPU backward", DIMS, dout, q, k, v, out, lse)
    ctype = CTYPE[q.dtype.name]
    dlt = delta(dout, out)
    dq = cupy.empty(q.shape, q.dtype)
    dk = cupy.empty(k.shape, k.dtype)
    dv = cupy.empty(v.shape, v.dtype)
    template = bwd_params(dout, q, k, v, out, causal=causal, softmax_scale=softmax_scale)
    ptrs = tuple(a.data.ptr for a in (q, k, v, out, dout, lse, dlt, dq, dk, dv))
    stream = cupy.cuda.get_current_stream().ptr
    exprs = instances(ctype, D)

    def run(expr, grid, block, smem):
        func = function_of(jit.kernel(SOURCE, expr, exprs), smem)
        launch(func, grid, block, smem, stream, template, BWD.pointers_format, *ptrs)

    kv = pick_tiles(DKDV_TILES, dkdv_smem, D)
    run(dkdv_instance(ctype, D, kv), (cdiv(nk, kv[1]) * (D // kv[3]), hkv, b), 32 * kv[2], dkdv_smem(D, kv))
    qc = pick_tiles(DQ_TILES, dq_smem, D)
    run(dq_instance(ctype, D, qc), (cdiv(nq, qc[0]) * (D // qc[3]), h, b), 32 * qc[2], dq_smem(D, qc))
    return dq, dk, dv
