"""Launchers of fa2's masked kernels (mma.sync, every sm_80+ GPU) under a sliding window, a softcap, ALiBi and sinks
(common/mask.cuh's AttnMask), over a dense batch or a packed (varlen) one: cuda_src/fa2_fwd.cu's fa2_fwd_masked,
and the backward's passes in cuda_src/fa2_bwd.cu (fa2_bwd_delta over the packed rows as one sequence, then
fa2_bwd_dkdv_masked and fa2_bwd_dq_masked; the sinks' gradient from the LSE and D).

The tiles are tiles.FA2_MASKED_TILES and fa2_bwd's MASKED_* tables, the grids (block, head, sequence) sized by the
longest sequence; a CTA past its sequence's end leaves at once. The parameter structs (MaskedFwdParams,
MaskedBwdParams) are packed per call: their side arrays (cu_seqlens, slopes) are pointers of the call.
"""
from __future__ import annotations

from .. import jit
from ..tiles import FA2_MASKED_TILES
from . import masked
from .common import CTYPE, cdiv, pick_tiles, round_up, template_dim
from .launch import function_of, launch
from .masked import Masks

SOURCE = "fa2_fwd.cu"   # beside fa2_fwd, whose block loop it shares
TILES = FA2_MASKED_TILES


def smem_bytes(d: int, tile) -> int:
    from .fa2 import smem_bytes as fa2_smem
    return fa2_smem(d, tile)


def instance(ctype: str, d: int, tile) -> str:
    return (f"fa2_fwd_masked<{ctype}, {d}, {tile.block_q}, {tile.block_k}, {tile.warps}, "
            f"{'true' if tile.early_prefetch else 'false'}>")


def specializations() -> tuple:
    return tuple(instance(c, d, tile) for c in CTYPE.values() for d, cands in TILES.items() for tile in cands)


def tiles(head_dim: int, smem_limit: int | None = None) -> tuple[int, int]:
    """(BM, BN) of the forward a call of ``head_dim`` launches with ``smem_limit`` bytes of shared memory a block
    (None: this device's, sm_90's without one)."""
    tile = pick_tiles(TILES, smem_bytes, template_dim(round_up(head_dim, 8)), smem_limit)
    return tile.block_q, tile.block_k


def forward(q, k, v, *, causal: bool, softmax_scale: float, return_lse: bool, masks: Masks):
    """masked.forward on fa2's kernel: (out, lse or None), lse (batch, heads, seqlen_q) or (heads, total_q)."""
    return masked.forward(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse, masks=masks,
                          run=_run)


def _run(q, k, v, run: masked.Prepared) -> None:
    import cupy
    from .params import MASKED_FWD
    h, dp = q.shape[2], q.shape[3]
    dt = template_dim(dp)
    tile = pick_tiles(TILES, smem_bytes, dt)
    smem = smem_bytes(dt, tile)
    func = function_of(jit.kernel(SOURCE, instance(CTYPE[q.dtype.name], dt, tile)), smem)
    launch(func, (cdiv(run.rows, tile.block_q), h, run.batch), 32 * tile.warps, smem,
           cupy.cuda.get_current_stream().ptr, run.template, MASKED_FWD.pointers_format, *run.pointers(q, k, v))


def backward(dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float, masks: Masks, deterministic: bool = True):
    """masked.backward on fa2's passes: (dq, dk, dv, dsinks or None), deterministic whatever ``deterministic``
    says."""
    return masked.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, masks=masks,
                           gradients=gradients)


def gradients(dout, q, k, v, out, lse, causal, softmax_scale, masks):
    """(dq, dk, dv, D) of launchable arrays: fa2_bwd_delta over the rows (a packed batch's as one sequence), then
    fa2_bwd_dkdv_masked and fa2_bwd_dq_masked, grids (block, head, sequence) sized by the longest sequence."""
    import cupy
    from . import fa2_bwd
    from .params import MASKED_BWD
    dlt = fa2_bwd.delta(dout, out)   # (1, heads, total_q) when packed: D is per row, whatever its sequence
    run = masked.bwd_launch(dout, q, k, v, out, causal, softmax_scale, masks)
    if run.empty:
        return run.dq, run.dk, run.dv, dlt
    h, dp, hkv = q.shape[2], q.shape[3], k.shape[2]
    ptrs = run.pointers(q, k, v, out, dout, lse, dlt)
    stream = cupy.cuda.get_current_stream().ptr
    D = template_dim(dp)
    ctype = CTYPE[q.dtype.name]
    exprs = fa2_bwd.masked_instances(ctype, D)

    def launch_pass(expr, grid, block, smem):
        func = function_of(jit.kernel(fa2_bwd.SOURCE, expr, exprs), smem)
        launch(func, grid, block, smem, stream, run.template, MASKED_BWD.pointers_format, *ptrs)

    kv = pick_tiles(fa2_bwd.MASKED_DKDV_TILES, fa2_bwd.dkdv_smem, D)
    launch_pass(fa2_bwd.masked(fa2_bwd.dkdv_instance(ctype, D, kv)), (cdiv(run.rows_k, kv[1]) * (D // kv[3]), hkv,
                run.batch), 32 * kv[2], fa2_bwd.dkdv_smem(D, kv))
    qc = pick_tiles(fa2_bwd.MASKED_DQ_TILES, fa2_bwd.dq_smem, D)
    launch_pass(fa2_bwd.masked(fa2_bwd.dq_instance(ctype, D, qc)), (cdiv(run.rows_q, qc[0]) * (D // qc[3]), h,
                run.batch), 32 * qc[2], fa2_bwd.dq_smem(D, qc))
    return run.dq, run.dk, run.dv, dlt
