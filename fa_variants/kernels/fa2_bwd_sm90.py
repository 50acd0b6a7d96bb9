"""Launcher of cuda_src/fa2_bwd_sm90.cu: fa2_bwd.py's deterministic backward on Hopper's wgmma (sm_90a only).
Pass 1 (D = rowsum(dO * O)) is fa2_bwd.delta (fa2_bwd.cu's kernel). Then one of two schemes (SCHEMES; ``dq_mode``
picks, ``backward(scheme=...)`` may name one):
  "separate"   the three passes: dK, dV per K/V block, then dQ per Q block (recomputing S and dP: 7 products);
  "writer"     the fused dQ, at d 64 and 128 where its grid fits (FUSED_TILES, ``fused_grid``): one pass computes
               dK, dV per K/V block and hands each block's share of dQ to a warpgroup of its own, which adds it into
               an fp32 sum in a fixed order (5 products); a second kernel converts that sum. Deterministic.
Same contract as ``fa2_bwd.backward``; head dims up to 256. The choices' measurements: docs/kernels/fa2_bwd.md.
kernels/fa2.py dispatches fa2's backward here on sm_90.
"""
from __future__ import annotations

import ctypes

from .. import jit
from . import fa2_bwd
from .common import CTYPE, cdiv, pick_tiles, sm_count
from .launch import function_of, launch
from .params import BWD

SOURCE = "fa2_bwd_sm90.cu"
DIMS = (64, 128, 256)   # the swizzled tiles' rows of 128, 256 or 512 bytes; other d pad to the next one
DKDV_BM = 64            # queries per step of the dK/dV pass by default (a config's third entry)

# template head_dim -> [(BN keys per CTA: 64 per warpgroup, split)], fastest first (pick_tiles takes the first that
# fits the device's shared memory). split (d = 256, where dK and dV of 64 keys would take 256 registers a thread):
# SPLIT_CTAS, each K/V block gets two CTAs, one per gradient (each computing S^T); SPLIT_WARPGROUPS, a CTA of two
# warpgroups per 64 keys, one per gradient, P^T computed once. A config may go on: (BN, split, BM queries per step,
# MINB CTAs per SM in the launch bounds, BM_DV the split's dV CTAs' BM, PIPE: step s+1's S^T issued behind step s's
# dV/dK wgmmas, three Q/dO stages); left out, they are (64, 1, BM, False). bench/bwd_sweep.py times alternatives.
# d 64: 128 queries a step (S^T and dP^T as n128 wgmmas), PIPE; d 128: PIPE; d 256: the warpgroup split, 64 queries
# a step, then (where 215 KB of shared memory is not there) the CTA split of 128-key CTAs of 32 queries a step, its
# dV CTAs 64 (PIPE does not pay at d 256: its dV CTAs would have to drop to 32 queries to fit three stages).
SPLIT_NONE, SPLIT_CTAS, SPLIT_WARPGROUPS = 0, 1, 2
DKDV_TILES = {64: [(128, False, 128, 1, 128, True)], 128: [(128, False, 64, 1, 64, True)],
              256: [(64, SPLIT_WARPGROUPS, 64), (128, SPLIT_CTAS, 32, 1, 64)]}
# template head_dim -> [(BM queries per CTA: 64 per warpgroup, BN keys per step)], may go on with MINB (default
# 1). d 64: four 64 x 64 CTAs per SM; d 128: three warpgroups of 64 x 64 (outputs as 128 x 64's); d 256: 128 x 32.
DQ_TILES = {64: [(64, 64, 4)], 128: [(192, 64)], 256: [(128, 32)]}
# The fused dQ: template head_dim -> (BN keys per CTA, BM queries per step); the two warpgroups split each dQ share
# (BM x d) into 64 x 64 halves, by rows at d 64, by columns at d 128.
FUSED_TILES = {64: (128, 128), 128: (128, 64)}
DKDV_DEFAULTS = (DKDV_BM, 1, None, False)  # BM, MINB, BM_DV (None: = BM), PIPE
DQ_DEFAULTS = (1,)                  # MINB


def dkdv_config(cfg) -> tuple:
    """(BN, split, BM, MINB, BM_DV, PIPE) of a DKDV_TILES entry, the left-out trailing entries filled in; split
    one of SPLIT_NONE, SPLIT_CTAS, SPLIT_WARPGROUPS (False and True stand for the first two)."""
    bn, split, bm, minb, bm_dv, pipe = tuple(cfg) + DKDV_DEFAULTS[len(cfg) - 2:]
    return bn, int(split), bm, minb, bm if bm_dv is None else bm_dv, bool(pipe)


def dkdv_threads(cfg) -> int:
    """Threads of a dK/dV CTA: 64 keys per warpgroup, or (SPLIT_WARPGROUPS) two warpgroups on 64 keys."""
    bn, split = dkdv_config(cfg)[:2]
    return (4 if split == SPLIT_WARPGROUPS else 2) * bn


def dkdv_ctas(cfg, seqlen_k: int) -> int:
    """dK/dV CTAs per (kv head, batch): one per K/V block, two with SPLIT_CTAS."""
    bn, split = dkdv_config(cfg)[:2]
    return cdiv(seqlen_k, bn) * (2 if split == SPLIT_CTAS else 1)


def dq_config(cfg) -> tuple:
    """(BM, BN, MINB) of a DQ_TILES entry."""
    return tuple(cfg) + DQ_DEFAULTS[len(cfg) - 2:]


def _padded_stats(stages: int, bm: int) -> int:
    """Bytes of `stages` stages of BM queries' LSE and D, padded to the swizzle's 1 KB (DkdvSmem's STATS to DS)."""
    return -(-stages * bm * 2 * 4 // 1024) * 1024


def dkdv_smem(d: int, cfg) -> int:
    bn, split, bm, _, bm_dv, pipe = dkdv_config(cfg)
    stages = 3 if pipe else 2

    def part(bm, kv):  # align; K (and V); stages x (Q, dO, LSE, D)
        return 1024 + kv * bn * 2 * d + stages * bm * (2 * 2 * d + 2 * 4)
    if split == SPLIT_WARPGROUPS:  # align; K, V; stages x (Q, dO); the padded LSE/D; the step's P^T (64 x BM fp32)
        return 1024 + 2 * bn * 2 * d + stages * bm * 2 * 2 * d + _padded_stats(stages, bm) + 64 * bm * 4
    # the split's dV CTAs with their own BM hold no V (the kernel's NO_V)
    return max(part(bm, 2), part(bm_dv, 1 if bm_dv != bm else 2))


def dq_smem(d: int, cfg) -> int:
    bm, bn, _ = dq_config(cfg)
    return 1024 + 2 * bm * 2 * d + 4 * bn * 2 * d  # align; Q, dO; two stages of K, V


# The fused dQ's kernel: the dK/dV CTAs hand each share to a warpgroup of their own that does nothing but the adds
FUSED_KERNEL = "fa2_bwd_fused_writer_sm90"
# The backward's schemes: the three passes ("separate") and the fused dQ ("writer", at FUSED_TILES' head dims).
SCHEMES = ("separate", "writer")
# The scheme by (template head dim, causal): the fused dQ wherever it exists (faster than the three passes, causal
# or not: docs/kernels/fa2_bwd.md).
DEFAULT_DQ = {(d, causal): "writer" for d in FUSED_TILES for causal in (False, True)}


def dq_mode(d: int, causal: bool) -> str:
    """The backward's scheme for template head dim d (one of SCHEMES), by DEFAULT_DQ."""
    return DEFAULT_DQ.get((d, causal), "separate")


def fused_threads(d: int) -> int:
    """Threads of a fused dQ CTA: two compute warpgroups on 64 keys each and the writer warpgroup."""
    return 2 * FUSED_TILES[d][0] + 128


def fused_smem(d: int) -> int:
    bn, bm = FUSED_TILES[d]
    stats = _padded_stats(2, bm)
    # align; K, V; Q, dO stages; dS^T; two shares of both 64 x 64 fp32 halves, their four mbarriers and two slots
    # (DkdvSmem's END)
    buffers = 2 * 2 * 64 * 64 * 4 + 4 * 8 + 2 * 8
    return 1024 + 2 * bn * 2 * d + 2 * 2 * bm * 2 * d + stats + bn * 2 * bm + buffers


def fused_contributors(d: int, seqlen_k: int) -> int:
    """The fused pass's contributors to one head's dQ: its K/V blocks of FUSED_TILES[d]'s BN keys. fused_grid
    needs them all resident at once."""
    return cdiv(seqlen_k, FUSED_TILES[d][0])


def fused_buffers(batch: int, heads: int, seqlen_q: int, d: int) -> tuple[tuple, tuple]:
    """Shapes of the fused pass's fp32 dQ sum (batch, heads, Q blocks x BM, d) and of its int32 counts (batch,
    heads, Q blocks, 2: one per half of a Q block's share)."""
    bm = FUSED_TILES[d][1]
    n_q = cdiv(seqlen_q, bm)
    return (batch, heads, n_q * bm, d), (batch, heads, n_q, 2)


def fused_instance(ctype: str, d: int) -> str:
    return f"{FUSED_KERNEL}<{ctype}, {d}, {', '.join(map(str, FUSED_TILES[d]))}>"


def convert_instance(ctype: str, d: int) -> str:
    """The conversion of the fused pass's fp32 sum (shares in the writer's fragment order: FRAG, true)."""
    return f"fa2_bwd_dq_convert<{ctype}, {d}, {', '.join(map(str, FUSED_TILES[d]))}, true>"


def dq_order(causal: bool, odd: bool, j: int, n_kv: int, n_q: int, first_q_block, kv_blocks_seen):
    """The fused dQ's order, as cuda_src/fa2_bwd_sm90.cu's DqOrder: (the Q blocks CTA role j visits, in order,
    for one query head; {Q block: this share's rank}). ``first_q_block(j)``: the first Q block K/V block j is
    visible to; ``kv_blocks_seen(i)``: how many K/V blocks Q block i sees (both 0 / n_kv when not causal)."""
    if not causal:
        lo = j * n_q // n_kv
        blocks = [(lo + k) % n_q for k in range(n_q)]
        return blocks, {i: (((i + 1) * n_kv - 1) // n_q - j) % n_kv for i in blocks}
    first = first_q_block(j)
    if odd:
        blocks = list(range(n_q - 1, first - 1, -1))
        return blocks, {i: j for i in blocks}
    blocks = list(range(first, n_q))
    return blocks, {i: kv_blocks_seen(i) - 1 - j for i in blocks}


def fused_grid(device: int, n_kv: int, items: int) -> int:
    """CTAs of the fused pass: groups x n_kv contributors, every one resident at once (one CTA an SM); 0 where it
    does not apply (a head's contributors could not all run side by side)."""
    groups = min(sm_count(device) // n_kv, items) if n_kv else 0
    return groups * n_kv


def _template_args(full: tuple, defaults: tuple) -> tuple:
    """``full`` less its trailing entries equal to ``defaults``' (so that adding a template argument leaves the
    existing instances' names, and cache keys, as they were)."""
    n = len(full)
    while n > len(full) - len(defaults) and full[n - 1] == defaults[n - 1 - (len(full) - len(defaults))]:
        n -= 1
    return full[:n]


def dkdv_instance(ctype: str, d: int, cfg) -> str:
    bn, split, bm, minb, bm_dv, pipe = dkdv_config(cfg)
    extra = _template_args((bm, minb, bm_dv, pipe), (DKDV_BM, 1, bm, False))
    args = [ctype, d, bn, ("false", "true", "2")[split], *("true" if x is True else "false" if x is False else x
                                                          for x in extra)]
    return f"fa2_bwd_dkdv_sm90<{', '.join(map(str, args))}>"


def dq_instance(ctype: str, d: int, cfg) -> str:
    bm, bn, minb = dq_config(cfg)
    args = [ctype, d, bm, bn, *_template_args((minb,), DQ_DEFAULTS)]
    return f"fa2_bwd_dq_sm90<{', '.join(map(str, args))}>"


def instances(ctype: str, d: int):
    fused = (fused_instance(ctype, d), convert_instance(ctype, d)) if d in FUSED_TILES else ()
    return (tuple(dkdv_instance(ctype, d, cfg) for cfg in DKDV_TILES[d])
            + tuple(dq_instance(ctype, d, cfg) for cfg in DQ_TILES[d]) + fused)


def specializations():
    return tuple(e for c in CTYPE.values() for d in DIMS for e in instances(c, d))


def supports(head_dim: int) -> bool:
    """Whether these kernels take this head dim (a multiple of 8 up to 256; the API pads other d to one)."""
    return 0 < head_dim <= DIMS[-1] and head_dim % 8 == 0


def backward(dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float, scheme: str | None = None):
    """(dq, dk, dv) of validated CuPy arrays on the current stream; head_dim a multiple of 8 up to 256. ``scheme``:
    one of SCHEMES, or None for ``dq_mode``'s; the fused dQ falls back to the three passes where its grid cannot
    hold a head's K/V blocks at once."""
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES} or None, got {scheme!r}")
    import cupy
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    D, (dout, q, k, v, out, lse) = fa2_bwd.prepare("fa2's wgmma backward", DIMS, dout, q, k, v, out, lse)
    mode = dq_mode(D, causal) if scheme is None else scheme
    if mode == "writer" and D not in FUSED_TILES:
        raise ValueError(f"scheme 'writer' (the fused dQ) serves head dims up to {max(FUSED_TILES)}, got {d}")
    ctype = CTYPE[q.dtype.name]
    delta = fa2_bwd.delta(dout, out)  # pass 1: fa2_bwd.cu's kernel, independent of the MMA
    dq = cupy.empty(q.shape, q.dtype)
    dk = cupy.empty(k.shape, k.dtype)
    dv = cupy.empty(v.shape, v.dtype)
    template = fa2_bwd.bwd_params(dout, q, k, v, out, causal=causal, softmax_scale=softmax_scale)
    ptrs = tuple(a.data.ptr for a in (q, k, v, out, dout, lse, delta, dq, dk, dv))
    stream = cupy.cuda.get_current_stream().ptr
    exprs = instances(ctype, D)

    def run(kern, grid, block, smem):
        launch(function_of(kern, smem), grid, block, smem, stream, template, BWD.pointers_format, *ptrs)

    grid = fused_grid(q.device.id, fused_contributors(D, nk), b * hkv) if mode == "writer" else 0
    if grid:  # the fused dQ: two launches instead of two passes
        smem = fused_smem(D)
        acc_shape, counts_shape = fused_buffers(b, h, nq, D)
        acc = cupy.empty(acc_shape, cupy.float32)
        counts = cupy.zeros(counts_shape, cupy.int32)
        launch(function_of(jit.kernel(SOURCE, fused_instance(ctype, D), exprs), smem), (grid, 1, 1),
               fused_threads(D), smem, stream, template, BWD.pointers_format, *ptrs,
               extra=(ctypes.c_uint64(acc.data.ptr), ctypes.c_uint64(counts.data.ptr), ctypes.c_int(b)))
        launch(function_of(jit.kernel(SOURCE, convert_instance(ctype, D), exprs), 0),
               (cdiv(nq * (d // 8), 256), h, b), 256, 0, stream, template, BWD.pointers_format, *ptrs,
               extra=(ctypes.c_uint64(acc.data.ptr),))
        return dq, dk, dv
    kv = pick_tiles(DKDV_TILES, dkdv_smem, D)
    run(jit.kernel(SOURCE, dkdv_instance(ctype, D, kv), exprs), (dkdv_ctas(kv, nk), hkv, b), dkdv_threads(kv),
        dkdv_smem(D, kv))
    qc = pick_tiles(DQ_TILES, dq_smem, D)
    bm = dq_config(qc)[0]
    run(jit.kernel(SOURCE, dq_instance(ctype, D, qc), exprs), (cdiv(nq, bm), h, b), 2 * bm, dq_smem(D, qc))
    return dq, dk, dv
