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
from .common import CTYPE, cdiv, check_grid, elem_strides, negated, pick_tiles, round_up, scale_log2, template_dim
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


def backward(dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float, masks: Masks):
    """(dq, dk, dv, dsinks or None) for CuPy arrays of forward's layouts (lse (batch, heads, seqlen_q), or (heads,
    total_q) when packed); dsinks float32 (heads,). Rows of a packed q, k, v past the last sequence get zero
    gradients. A negative scale runs on a negated copy of q (dq negated back)."""
    import cupy
    from . import fa2_bwd
    masked.check_scale(softmax_scale, masks)
    flip = softmax_scale < 0
    if flip:
        q, softmax_scale = negated(q), -softmax_scale
    packed = masks.packed
    d = q.shape[-1]
    dout4, q4, k4, v4, out4 = masked.launchable((dout, q, k, v, out), packed)
    lse = cupy.ascontiguousarray(lse, dtype=cupy.float32)
    dlt = fa2_bwd.delta(dout4, out4)   # (1, heads, total_q) when packed: D is per row, whatever its sequence
    dq, dk, dv = (masked.as_given(g, d, packed) for g in _dqdkdv(dout4, q4, k4, v4, out4, lse, dlt, causal, softmax_scale,
                                                         masks))
    if flip:
        dq = negated(dq)
    dsinks = None
    if masks.sinks is not None:
        # dsink_h = -sum over rows of P_sink * D, P_sink = exp(sink_h - LSE): rows that saw nothing (LSE -inf,
        # past the last sequence) add nothing
        l64 = lse.reshape(lse.shape[-2], -1) if packed else lse.transpose(1, 0, 2).reshape(lse.shape[1], -1)
        d64 = dlt.reshape(lse.shape[-2], -1) if packed else dlt.transpose(1, 0, 2).reshape(lse.shape[1], -1)
        sink = masks.sinks.astype(cupy.float64)[:, None]
        p_sink = cupy.where(cupy.isneginf(l64), 0.0, cupy.exp(sink - l64.astype(cupy.float64)))
        dsinks = -(p_sink * d64).sum(axis=1)
    return dq, dk, dv, dsinks


def _dqdkdv(dout, q, k, v, out, lse, dlt, causal, softmax_scale, masks):
    import cupy
    from . import fa2_bwd
    from .params import MASKED_BWD
    _, nq, h, dp = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    packed = masks.packed
    batch = masks.cu_seqlens_q.shape[0] - 1 if packed else q.shape[0]
    fill = cupy.zeros if packed and (masks.total_q < nq or masks.total_k < nk) else cupy.empty
    dq, dk, dv = fill(q.shape, q.dtype), fill(k.shape, k.dtype), fill(v.shape, v.dtype)
    rows_q, rows_k = (masks.max_seqlen_q, masks.max_seqlen_k) if packed else (nq, nk)
    if batch == 0 or rows_q == 0 or rows_k == 0:
        return dq, dk, dv
    check_grid(h, "heads")
    check_grid(batch, "batch")
    strides = {n: elem_strides(a) for n, a in (("q", q), ("k", k), ("v", v), ("o", out), ("do", dout))}
    if packed:
        strides = {n: (0,) + st[1:] for n, st in strides.items()}
    fields, _held = masked.mask_fields(masks, softmax_scale, h)   # (_held: alive until the launches)
    template = MASKED_BWD.pack(
        q=0, k=0, v=0, o=0, dout=0, lse=0, delta=0, dq=0, dk=0, dv=0,
        **{f"{n}_{axis}": st[i] for n, st in strides.items() for i, axis in enumerate("bnh")},
        seqlen_q=rows_q, seqlen_k=rows_k, heads=h, group=h // hkv, head_dim=dp,
        scale_log2=scale_log2(softmax_scale), scale=softmax_scale, causal=int(bool(causal)),
        lse_h=nq, **fields)
    ptrs = tuple(a.data.ptr for a in (q, k, v, out, dout, lse, dlt, dq, dk, dv))
    stream = cupy.cuda.get_current_stream().ptr
    D = template_dim(dp)
    ctype = CTYPE[q.dtype.name]
    exprs = fa2_bwd.masked_instances(ctype, D)

    def run(expr, grid, block, smem):
        func = function_of(jit.kernel(fa2_bwd.SOURCE, expr, exprs), smem)
        launch(func, grid, block, smem, stream, template, MASKED_BWD.pointers_format, *ptrs)

    kv = pick_tiles(fa2_bwd.MASKED_DKDV_TILES, fa2_bwd.dkdv_smem, D)
    run(fa2_bwd.masked(fa2_bwd.dkdv_instance(ctype, D, kv)), (cdiv(rows_k, kv[1]) * (D // kv[3]), hkv, batch),
        32 * kv[2], fa2_bwd.dkdv_smem(D, kv))
    qc = pick_tiles(fa2_bwd.MASKED_DQ_TILES, fa2_bwd.dq_smem, D)
    run(fa2_bwd.masked(fa2_bwd.dq_instance(ctype, D, qc)), (cdiv(rows_q, qc[0]) * (D // qc[3]), h, batch),
        32 * qc[2], fa2_bwd.dq_smem(D, qc))
    return dq, dk, dv
