"""Launcher of fa3_fwd.cu's fa3_fwd_masked (sm_90a): FlashAttention-3's forward under a sliding window, a softcap,
ALiBi and sinks (common/mask.cuh's AttnMask), over a dense batch or a packed (varlen) one. The call's checks, outputs
and parameter struct are those of every masked forward (kernels/masked.py: MaskedFwdParams); what differs is the
kernel: TMA tensor maps of q, k, v (a packed batch's as one sequence of total rows, each CTA at its sequence's
rows), the producer warpgroup and the ping-ponged consumers, one CTA per (Q block, head, sequence) tile.

The backward of a masked call is fa3's masked backward (kernels/fa3_bwd.py's masked_gradients: fa3_bwd.cu's
fa3_bwd_masked) at head dims up to 128, else fa2's masked passes (kernels/fa2_masked.py): either needs only q, k, v,
out and lse.
"""
from __future__ import annotations

from .. import jit
from ..tiles import FA3_MASKED_TILES, fa3_template_dim
from .common import CTYPE, cdiv, round_up
from . import masked
from .masked import Masks
from .launch import function_of
from . import tma

SOURCE = "fa3_fwd.cu"
TILES = FA3_MASKED_TILES


def instance(ctype: str, d: int, tile) -> str:
    return (f"fa3_fwd_masked<{ctype}, {d}, {tile.block_k}, {tile.stages}, {str(bool(tile.pingpong)).lower()}, "
            f"{tile.consumers}>")


def specializations() -> tuple:
    return tuple(instance(c, d, tile) for c in CTYPE.values() for d, tile in TILES.items())


def tiles(head_dim: int) -> tuple[int, int]:
    """(BM, BN) of the forward a call of ``head_dim`` launches."""
    tile = TILES[fa3_template_dim(round_up(head_dim, 8))]
    return tile.block_q, tile.block_k


def smem_bytes(d: int, tile) -> int:
    from .fa3 import smem_bytes as fa3_smem
    return fa3_smem(d, tile)


def forward(q, k, v, *, causal: bool, softmax_scale: float, return_lse: bool, masks: Masks):
    """masked.forward on fa3's kernel: (out, lse or None), lse (batch, heads, seqlen_q) or (heads, total_q)."""
    return masked.forward(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse, masks=masks,
                          run=_run)


def backward(dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float, masks: Masks, deterministic: bool = True):
    """masked.backward on fa3's masked backward, or fa2's passes where it does not apply: (dq, dk, dv, dsinks or
    None). ``deterministic``: dQ's shares in the fixed order (fa2's passes are deterministic either way)."""
    import functools
    from . import fa2_masked, fa3_bwd
    fits = fa3_bwd.masked_grid(q, k, masks) > 0
    gradients = functools.partial(fa3_bwd.masked_gradients, deterministic=deterministic) if fits else \
        fa2_masked.gradients
    return masked.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, masks=masks,
                           gradients=gradients)


def _run(q, k, v, run: masked.Prepared) -> None:
    import cupy
    from .params import MASKED_FWD
    h, dp = q.shape[2], q.shape[3]
    dt = fa3_template_dim(dp)
    tile = TILES[dt]
    smem = smem_bytes(dt, tile)
    maps = [tensor_map(a, rows, name) for a, rows, name in ((q, tile.block_q, "q"), (k, tile.block_k, "k"),
                                                               (v, tile.block_k, "v"))]
    tiles = cdiv(run.rows, tile.block_q) * h * run.batch
    if tiles >= 2**31:
        raise ValueError(f"batch * heads * Q blocks = {tiles} tiles exceed the grid's 2^31 - 1")
    func = function_of(jit.kernel(SOURCE, instance(CTYPE[q.dtype.name], dt, tile)), smem)
    launch_masked(func, tiles, tile.threads, smem, cupy.cuda.get_current_stream().ptr, maps, run.template,
                  MASKED_FWD.pointers_format, run.pointers(q, k, v))


def tensor_map(a, rows: int, name: str) -> bytes:
    """The TMA map of a (batch, seqlen, heads, d) CuPy array (a packed one as batch 1) in boxes of ``rows`` rows,
    encoded for this call (a masked call's checks and outputs cost more than the driver's encoding)."""
    strides = a.strides
    if a.shape[0] == 1:   # a packed batch (a view with a new axis: stride 0) as one sequence of its rows
        strides = (a.shape[1] * strides[1],) + strides[1:]
    tma.check(a.data.ptr, a.shape, strides, a.dtype.itemsize, rows, name)
    return tma.encode(a.data.ptr, a.shape, strides, a.dtype.itemsize, rows)


def launch_masked(func, ctas: int, block: int, smem: int, stream: int, maps: list, template: bytes, fmt: str,
                  ptrs: tuple) -> None:
    """One launch of fa3_fwd_masked: the maps of q, k, v (the kernel's O map is never read: q's stands in), the
    parameter struct with its pointers, no tile counter (one CTA per tile)."""
    import ctypes
    import struct
    from .launch import launch_argv
    params = ctypes.create_string_buffer(template, len(template))
    struct.pack_into(fmt, params, 0, *ptrs)
    bufs = [ctypes.create_string_buffer(m, 128) for m in maps + maps[:1]]
    counter = ctypes.c_uint64(0)
    argv = (ctypes.c_void_p * 6)(*(ctypes.addressof(b) for b in bufs), ctypes.addressof(params),
                                 ctypes.addressof(counter))
    launch_argv(func, (ctas, 1, 1), block, smem, stream, argv)
