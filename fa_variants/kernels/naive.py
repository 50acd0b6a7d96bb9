"""Standard attention on the GPU: S = QK^T (cuBLAS), P = softmax(S) (our row kernel), O = PV (cuBLAS).

S and P live in device memory (fp32, P written over S), which is what makes this O(N^2) in memory and traffic:
the baseline every FlashAttention variant is measured against.

The backward (``backward``) is the standard one with P materialized: P = exp(S scale - LSE) recomputed from the
forward's LSE over a fresh S = QK^T (cuBLAS, fp32, as the forward), dV = P^T dO, dP = dO V^T (cuBLAS), dS =
P o (dP - D) (cuda_src/naive_bwd.cu, D = rowsum(dO o O)), dQ = dS K scale, dK = dS^T Q scale (cuBLAS). Two fp32
N_q x N_k matrices per head are alive at its peak; a call whose matrices would not fit in free device memory is
refused (``AttentionTooLarge``) before anything is allocated. NOT YET RUN ON A GPU.
"""
from __future__ import annotations


from .. import jit
from . import KernelLauncher
from .common import scale_log2

SOURCE = "naive_softmax.cu"
BWD_SOURCE = "naive_bwd.cu"
THREADS = 256


class AttentionTooLarge(MemoryError, ValueError):
    """S and P of standard attention (or the backward's P and dP) do not fit in free device memory: a MemoryError
    (what the CLI and the benchmarks catch) and a ValueError (a size this call cannot take)."""


def specializations():
    return (f"row_softmax<{THREADS}>",)


def bwd_specializations():
    return (f"naive_bwd_p<{THREADS}>", f"naive_bwd_ds<{THREADS}>")


def tiles(head_dim, causal=False, seqlen_k=None):
    return None, None  # no tiling: every score is materialized


def extra_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, itemsize=2, heads_kv=None):
    """fp32 S (P is written over it) plus fp32 copies of Q, K, V and O."""
    heads_kv = heads if heads_kv is None else heads_kv
    s = 4 * batch * heads * seqlen_q * seqlen_k
    qkvo = 4 * batch * head_dim * (2 * heads * seqlen_q + 2 * heads_kv * seqlen_k)
    return s + qkvo


def check_fits(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim):
    import cupy
    need = extra_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, heads_kv=heads_kv)
    free_dev, _ = cupy.cuda.runtime.memGetInfo()
    free = free_dev + cupy.get_default_memory_pool().free_bytes()
    if need > 0.9 * free:
        raise AttentionTooLarge(
            f"naive attention needs {need / 2**30:.1f} GiB for S/P (batch {batch} x heads {heads} x "
            f"{seqlen_q} x {seqlen_k} fp32) but only {free / 2**30:.1f} GiB of device memory is free; "
            f"use variant='fa2', which needs O(N) memory")


def forward(q, k, v, *, causal, softmax_scale, return_lse):
    import cupy

    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    check_fits(b, h, hkv, nq, nk, d)
    # (b, hkv, g, n, d) views so that one batched GEMM serves MQA/GQA without repeating K and V.
    qf = q.astype(cupy.float32).transpose(0, 2, 1, 3).reshape(b, hkv, g, nq, d)
    kf = k.astype(cupy.float32).transpose(0, 2, 1, 3)[:, :, None]
    vf = v.astype(cupy.float32).transpose(0, 2, 1, 3)[:, :, None]
    s = cupy.ascontiguousarray(cupy.matmul(qf, kf.swapaxes(-1, -2)))   # (b, hkv, g, nq, nk) fp32
    lse = cupy.empty((b, h, nq), dtype=cupy.float32)
    rows = b * h * nq
    kern = jit.kernel(SOURCE, specializations()[0])
    kern((rows,), (THREADS,), (s, lse, cupy.int64(rows), cupy.int32(nq), cupy.int32(nk),
                              cupy.float32(scale_log2(softmax_scale)), cupy.int32(bool(causal))))
    o = cupy.matmul(s, vf)                                                # (b, hkv, g, nq, d)
    out = o.reshape(b, h, nq, d).transpose(0, 2, 1, 3).astype(q.dtype)
    return cupy.ascontiguousarray(out), (lse if return_lse else None)


def backward_bytes(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim) -> int:
    """Device memory the backward allocates at its peak (a bound): two fp32 (batch, heads, seqlen_q, seqlen_k)
    matrices (S then P, and dP then dS, each written over in place), and fp32 copies of q, dout, out, k, v, the
    transposed copies cuBLAS is handed, the fp32 gradients and the 16-bit ones (six rows of head_dim floats per
    query row and per key row of every head)."""
    pp = 2 * 4 * batch * heads * seqlen_q * seqlen_k
    rows = 4 * head_dim * 6 * (batch * heads * seqlen_q + batch * heads_kv * seqlen_k)
    return pp + rows


def backward_refusal(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, free_bytes: int) -> str:
    """'' when the backward's buffers (``backward_bytes``) fit in 90% of ``free_bytes``, else why not, with the
    sizes: the pure half of ``check_backward_fits`` (no GPU)."""
    need = backward_bytes(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim)
    if need <= 0.9 * free_bytes:
        return ""
    return (f"naive attention's backward needs {need / 2**30:.1f} GiB (P and dP: 2 x batch {batch} x heads {heads} "
            f"x {seqlen_q} x {seqlen_k} fp32, plus fp32 copies of q, k, v, out, dout at head_dim {head_dim}) but "
            f"only {free_bytes / 2**30:.1f} GiB of device memory is free; use variant='fa2', whose backward needs "
            f"O(N) memory")


def free_device_bytes() -> int:
    """Free device memory, counting what CuPy's pool holds unused (it is handed out before new memory)."""
    import cupy
    free_dev, _ = cupy.cuda.runtime.memGetInfo()
    return free_dev + cupy.get_default_memory_pool().free_bytes()


def check_backward_fits(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim):
    why = backward_refusal(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, free_device_bytes())
    if why:
        raise AttentionTooLarge(why)


def backward(dout, q, k, v, out, lse, *, causal, softmax_scale):
    """(dq, dk, dv) for validated CuPy arrays, on the current stream: the standard backward, P materialized.
    GQA/MQA: the group's query heads are rows of one batched GEMM per kv head, so dK and dV come out summed over
    the group without repeating K and V. Deterministic (cuBLAS's fp32 GEMMs and our row kernels, one launch order)."""
    import cupy

    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    check_backward_fits(b, h, hkv, nq, nk, d)
    f32 = cupy.float32

    def rows_q(a):  # (b, nq, h, d) -> fp32 (b, hkv, g * nq, d), rows ordered (group head, query) as the LSE's
        return cupy.ascontiguousarray(a.astype(f32).transpose(0, 2, 1, 3)).reshape(b, hkv, g * nq, d)

    def rows_k(a):  # (b, nk, hkv, d) -> fp32 (b, hkv, nk, d)
        return cupy.ascontiguousarray(a.astype(f32).transpose(0, 2, 1, 3))

    qf, dof = rows_q(q), rows_q(dout)
    kf, vf = rows_k(k), rows_k(v)
    delta = cupy.sum(rows_q(out) * dof, axis=-1)               # D = rowsum(dO o O): (b, hkv, g * nq)
    rows = b * h * nq
    p_kernel = jit.kernel(BWD_SOURCE, bwd_specializations()[0], bwd_specializations())
    ds_kernel = jit.kernel(BWD_SOURCE, bwd_specializations()[1], bwd_specializations())

    s = cupy.matmul(qf, kf.swapaxes(-1, -2))                   # S = Q K^T: (b, hkv, g * nq, nk) fp32
    p_kernel((rows,), (THREADS,), (s, cupy.ascontiguousarray(lse, dtype=f32), cupy.int64(rows), cupy.int32(nq),
                                   cupy.int32(nk), cupy.float32(scale_log2(softmax_scale)), cupy.int32(bool(causal))))
    # dV = P^T dO, as (dO^T P)^T: cuBLAS through cupy.matmul copies a non-contiguous operand, and P^T would be a
    # third N_q x N_k matrix; dO^T is the small one.
    dv = cupy.matmul(dof.swapaxes(-1, -2), s).swapaxes(-1, -2)  # (b, hkv, nk, d)
    dp = cupy.matmul(dof, vf.swapaxes(-1, -2))                 # dP = dO V^T: (b, hkv, g * nq, nk)
    ds_kernel((rows,), (THREADS,), (dp, s, delta, cupy.int64(rows), cupy.int32(nk)))   # dS = P o (dP - D) over dP
    del s
    dq = cupy.matmul(dp, kf) * f32(softmax_scale)               # (b, hkv, g * nq, d)
    dk = cupy.matmul(qf.swapaxes(-1, -2), dp).swapaxes(-1, -2) * f32(softmax_scale)   # dS^T Q, as (Q^T dS)^T
    del dp
    dq = dq.reshape(b, h, nq, d).transpose(0, 2, 1, 3).astype(q.dtype)
    dk = dk.transpose(0, 2, 1, 3).astype(k.dtype)
    dv = dv.transpose(0, 2, 1, 3).astype(v.dtype)
    return tuple(cupy.ascontiguousarray(x) for x in (dq, dk, dv))


LAUNCHER = KernelLauncher(sources=lambda: {SOURCE: specializations(), BWD_SOURCE: bwd_specializations()},
                          forward_fn=forward, tiles_fn=tiles, extra_bytes_fn=extra_bytes, backward_fn=backward)
