"""Standard attention on the GPU: S = QK^T (cuBLAS), P = softmax(S) (our row kernel), O = PV (cuBLAS).

S and P live in device memory (fp32, P written over S), which is what makes this O(N^2) in memory and traffic:
the baseline every FlashAttention variant is measured against.
"""
from __future__ import annotations


from .. import jit
from . import KernelLauncher
from .common import scale_log2

SOURCE = "naive_softmax.cu"
THREADS = 256


class AttentionTooLarge(MemoryError):
    """S and P of standard attention do not fit in free device memory."""


def specializations():
    return (f"row_softmax<{THREADS}>",)


def tiles(head_dim):
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


LAUNCHER = KernelLauncher(sources=lambda: {SOURCE: specializations()}, forward_fn=forward, tiles_fn=tiles,
                          extra_bytes_fn=extra_bytes)
