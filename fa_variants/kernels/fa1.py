"""Launcher of cuda_src/fa1_fwd.cu: one CTA per (batch, head), a float32 O/l/m workspace in device memory."""
from __future__ import annotations

from .. import jit
from . import KernelLauncher
from .common import (CTYPE, PAD_INSTANCES, PAD_SOURCE, TEMPLATE_DIMS, cdiv, check_grid, forward_via_plan,
                     fwd_params, template_dim, tile_lookup)
from .launch import FwdPlan, function_of

SOURCE = "fa1_fwd.cu"

# template head_dim -> (BM rows per Q block, BN keys per K/V block, warps), fastest first. The warps split BN
# (split-K), so each holds a BM x (BN / warps) score block and a BM x d partial P~V: BM shrinks as d grows to keep
# that in registers. The first that fits the device's shared memory is used (sm_90 first; then sm_80, sm_86/89).
TILES = {
    32: [(64, 128, 4)],
    64: [(32, 128, 4), (32, 64, 4)],
    96: [(32, 128, 4), (16, 64, 4)],
    128: [(32, 128, 4), (32, 64, 4), (16, 64, 4)],
    160: [(16, 64, 4), (16, 32, 2), (16, 16, 1)],
    192: [(16, 64, 4), (16, 32, 2), (16, 16, 1)],
    224: [(16, 64, 4), (16, 32, 2), (16, 16, 1)],
    256: [(16, 64, 4), (16, 32, 2), (16, 16, 1)],
}
assert tuple(TILES) == TEMPLATE_DIMS


def smem_bytes(d: int, cfg) -> int:
    """Mirror of Fa1Smem in fa1_fwd.cu."""
    bm, bn, w = cfg
    row16, row32 = (d + 8) * 2, (d + 8) * 4
    return 2 * bn * row16 + 2 * bm * row16 + w * bm * row32 + bm * row32 + 2 * bm * 4 + 2 * w * bm * 4 + (w + 1) * bm * 4


_config, _tiles = tile_lookup(TILES, smem_bytes)


def config(head_dim, limit=None):
    """(BM, BN, warps) of the template head_dim pads to."""
    return _config(template_dim(head_dim), limit)


def tiles(head_dim, limit=None):
    return _tiles(template_dim(head_dim), limit)


def instance(ctype: str, d: int, cfg) -> str:
    bm, bn, w = cfg
    return f"fa1_fwd<{ctype}, {d}, {bm}, {bn}, {w}>"


def specializations():
    return tuple(instance(c, d, cfg) for c in CTYPE.values() for d, cfgs in TILES.items() for cfg in cfgs)


def workspace_rows(batch, heads, seqlen_q, head_dim) -> int:
    """Rows of the fp32 O / l / m workspace: every (batch, head)'s rows padded to whole Q blocks."""
    return batch * heads * cdiv(seqlen_q, config(head_dim)[0]) * config(head_dim)[0]


def extra_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, itemsize=2, heads_kv=None):
    """The fp32 workspace: O (rows padded to the Q block, template head dim columns) plus l and m."""
    return workspace_rows(batch, heads, seqlen_q, head_dim) * (template_dim(head_dim) + 2) * 4


def plan(q, k, v, *, causal, softmax_scale, return_lse) -> FwdPlan:
    """The launch of one call signature, for aligned CuPy q, k, v whose head dim is a multiple of 8. The kernel
    initializes its workspace itself (Algorithm 1, line 2), so a fresh, uninitialized one serves each call."""
    import cupy
    b, nq, h, d = q.shape
    D = template_dim(d)
    cfg = config(d)
    kern = jit.kernel(SOURCE, instance(CTYPE[q.dtype.name], D, cfg))  # compiled on first use
    smem = smem_bytes(D, cfg)
    check_grid(b, "batch")
    return FwdPlan(func=function_of(kern, smem), grid=(h, b, 1), block=32 * cfg[2], smem=smem,
                   template=fwd_params(q, k, v, head_dim=d, causal=causal, softmax_scale=softmax_scale,
                                       out_strides=(nq * h * d, h * d, d)),
                   fmt="<8Q", out_shape=(b, nq, h, d), dtype=q.dtype,
                   lse_shape=(b, h, nq) if return_lse else None, ws_rows=workspace_rows(b, h, nq, d), ws_cols=D,
                   device=cupy.cuda.Device().id)


def forward(q, k, v, *, causal, softmax_scale, return_lse):
    return forward_via_plan(plan, q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)


def _sources():
    from . import fa1_bwd
    return {SOURCE: specializations(), PAD_SOURCE: PAD_INSTANCES, fa1_bwd.SOURCE: fa1_bwd.specializations()}


def backward(dout, q, k, v, out, lse, *, causal, softmax_scale):
    """Algorithm 4 on the GPU (kernels/fa1_bwd.py): dQ through fp32 atomic adds, so not bitwise deterministic."""
    from . import fa1_bwd
    return fa1_bwd.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale)


LAUNCHER = KernelLauncher(sources=_sources, forward_fn=forward, tiles_fn=tiles, extra_bytes_fn=extra_bytes,
                          plan_fn=plan, backward_fn=backward)
