"""Launcher of cuda_src/fa3_bwd.cu: FlashAttention-3's backward on sm_90a (docs/kernels/fa3_bwd.md).

Three launches on the current stream: ``fa3_bwd_stats`` (each Q block's LSE in log2 units and D = rowsum(dO o O),
in the layout the producer copies in one piece), ``fa3_bwd`` (the persistent dK/dV grid: a TMA producer warp, two
compute warpgroups, the fused dQ's writer), and fa2_bwd_sm90.cu's ``fa2_bwd_dq_convert`` (the writer's fp32 dQ sum
into dq). dQ's shares are added in a fixed order: the result is the same bit for bit on every run.

Head dims above 128 run fa2's Hopper backward (kernels/fa2_bwd_sm90.py; the fused dQ's tiles hold d 64 and 128,
d 256 runs fa2's three passes). Sequences whose K/V blocks a head's CTAs cannot all hold at once (seqlen_k > 128 x
SMs: fa2_bwd_sm90.fused_grid gives no grid) run the masked kernel with no mask, whose walk takes a sequence a chunk
of blocks at a time.

``masked_gradients`` is the same backward under a window, softcap or ALiBi, over a dense or packed batch
(``fa3_bwd_masked``, ``fa3_bwd_stats_masked``, ``fa3_bwd_dq_convert_masked``; kernels/fa3_masked.py's backward
calls it at head dims up to 128, fa2's masked passes above).
"""
from __future__ import annotations

import ctypes
import functools
import struct

from .. import jit
from ..tiles import FA3_BWD_TILES, template_dim
from . import fa2_bwd, fa2_bwd_sm90
from .common import CTYPE, cdiv, sm_count
from .launch import function_of, launch, launch_argv
from .params import BWD
from . import tma

SOURCE = "fa3_bwd.cu"
ARCHS = ("sm_90a",)
DIMS = tuple(FA3_BWD_TILES)  # template head dims; other d <= 128 run on the next one (the tensor maps zero-fill)
STATS_WARPS = 8           # rows per CTA of fa3_bwd_stats
# The share buffers, their layout and the conversion are the fused dQ's of fa2_bwd_sm90 (its tiles: (BN, BM)).
assert {d: (t.block_k, t.block_q) for d, t in FA3_BWD_TILES.items()} == fa2_bwd_sm90.FUSED_TILES
RING_BYTES = 48           # hopper/bwd_producer.cuh's BwdRing: after the fused dQ's buffers, bars and slots


def instance(ctype: str, d: int, deterministic: bool = True) -> str:
    t = FA3_BWD_TILES[d]
    return f"fa3_bwd<{ctype}, {d}, {t.block_k}, {t.block_q}{'' if deterministic else ', false'}>"


def stats_instance(ctype: str, d: int) -> str:
    return f"fa3_bwd_stats<{ctype}, {FA3_BWD_TILES[d].block_q}, {STATS_WARPS}>"


def instances(ctype: str, d: int) -> tuple:
    return instance(ctype, d), instance(ctype, d, False), stats_instance(ctype, d)


def masked_instances(ctype: str, d: int) -> tuple:
    """The masked backward's kernels (one NVRTC module with the plain ones): the main one, its stats, its dQ
    conversion, and the main one with dQ's shares added as they come."""
    t = FA3_BWD_TILES[d]
    main = f"fa3_bwd_masked<{ctype}, {d}, {t.block_k}, {t.block_q}>"
    return (main, f"fa3_bwd_stats_masked<{ctype}, {t.block_q}, {STATS_WARPS}>",
            f"fa3_bwd_dq_convert_masked<{ctype}, {d}, {t.block_k}, {t.block_q}>", main.replace(">", ", false>"))


def module(ctype: str, d: int) -> tuple:
    return instances(ctype, d) + masked_instances(ctype, d)


def specializations() -> tuple:
    return tuple(dict.fromkeys(e for c in CTYPE.values() for d in DIMS for e in module(c, d)))


def smem_bytes(d: int) -> int:
    """The dK/dV CTA's shared memory: fa2's fused dQ kernel's (the same tiles and share buffers) and the ring's
    mbarriers."""
    return fa2_bwd_sm90.fused_smem(d) + RING_BYTES


def threads(d: int) -> int:
    return fa2_bwd_sm90.fused_threads(d)


def stats_shape(batch: int, heads: int, seqlen_q: int, d: int) -> tuple:
    """(batch, heads, Q blocks, 2, BM) float32: per Q block its LSE (log2 units), then its D."""
    bm = FA3_BWD_TILES[d].block_q
    return batch, heads, cdiv(seqlen_q, bm), 2, bm


def tensor_map(a, rows: int, name: str) -> bytes:
    """The TMA map of a (batch, seqlen, heads, head_dim) CuPy array in boxes of 64 columns x ``rows`` rows."""
    tma.check(a.data.ptr, a.shape, a.strides, a.dtype.itemsize, rows, name)
    return tma.encode(a.data.ptr, a.shape, a.strides, a.dtype.itemsize, rows)


def backward(dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float, deterministic: bool = True):
    """(dq, dk, dv) of validated CuPy arrays on the current stream (fa2_bwd.backward's contract). ``deterministic``:
    dQ's shares added in a fixed order (the same bits on every run), else as they come (fa2's fallbacks are
    deterministic either way)."""
    import cupy
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    if d > DIMS[-1]:
        return fa2_bwd_sm90.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale)
    grid = fa2_bwd_sm90.fused_grid(q.device.id, cdiv(nk, FA3_BWD_TILES[template_dim(d, DIMS)].block_k), b * hkv)
    if not grid:  # a head's K/V blocks are more than the SMs
        from .masked import Masks
        from . import masked
        return masked.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, masks=Masks(),
                               gradients=functools.partial(masked_gradients, deterministic=deterministic))[:3]
    D, (dout, q, k, v, out, lse) = fa2_bwd.prepare("fa3's backward", DIMS, dout, q, k, v, out, lse)
    ctype = CTYPE[q.dtype.name]
    bm, bn = FA3_BWD_TILES[D]
    dq = cupy.empty(q.shape, q.dtype)
    dk = cupy.empty(k.shape, k.dtype)
    dv = cupy.empty(v.shape, v.dtype)
    stats = cupy.empty(stats_shape(b, h, nq, D), cupy.float32)
    acc_shape, counts_shape = fa2_bwd_sm90.fused_buffers(b, h, nq, D)
    acc = (cupy.empty if deterministic else cupy.zeros)(acc_shape, cupy.float32)
    counts = cupy.zeros(counts_shape if deterministic else (1,), cupy.int32)
    template = fa2_bwd.bwd_params(dout, q, k, v, out, causal=causal, softmax_scale=softmax_scale)
    # (BwdParams' delta stays null: D travels in stats)
    ptrs = tuple(a.data.ptr for a in (q, k, v, out, dout, lse)) + (0,) + tuple(a.data.ptr for a in (dq, dk, dv))
    stream = cupy.cuda.get_current_stream().ptr
    exprs = module(ctype, D)

    launch(function_of(jit.kernel(SOURCE, stats_instance(ctype, D), exprs), 0),
           (cdiv(stats.shape[2] * bm, STATS_WARPS), h, b), 32 * STATS_WARPS, 0, stream, template,
           BWD.pointers_format, *ptrs, extra=(ctypes.c_uint64(stats.data.ptr),))

    buffers = [ctypes.create_string_buffer(tensor_map(a, rows, name), 128)
               for a, rows, name in ((q, bm, "q"), (dout, bm, "dout"), (k, bn, "k"), (v, bn, "v"))]
    params = ctypes.create_string_buffer(template, len(template))
    struct.pack_into(BWD.pointers_format, params, 0, *ptrs)
    scalars = (ctypes.c_uint64(stats.data.ptr), ctypes.c_uint64(acc.data.ptr), ctypes.c_uint64(counts.data.ptr),
               ctypes.c_int(b))
    argv = (ctypes.c_void_p * 9)(*(ctypes.addressof(x) for x in buffers + [params]),
                                 *(ctypes.addressof(x) for x in scalars))
    smem = smem_bytes(D)
    launch_argv(function_of(jit.kernel(SOURCE, instance(ctype, D, deterministic), exprs), smem), (grid, 1, 1),
                threads(D), smem, stream, argv)

    convert = fa2_bwd_sm90.convert_instance(ctype, D)
    launch(function_of(jit.kernel(fa2_bwd_sm90.SOURCE, convert, fa2_bwd_sm90.instances(ctype, D)), 0),
           (cdiv(nq * (d // 8), 256), h, b), 256, 0, stream, template, BWD.pointers_format, *ptrs,
           extra=(ctypes.c_uint64(acc.data.ptr),))
    return dq, dk, dv


def masked_grid(q, k, masks) -> int:
    """CTAs of the masked backward for q, k as given (dense, or packed (total, heads, d)); 0 where it does not
    apply (head dims above 128) or nothing runs. One a K/V block of the call's (an upper bound when packed: a
    sequence's blocks from the packed rows' blocks plus one), up to the SMs, all resident at once; the kernel's walk
    groups them by walk_columns."""
    d = q.shape[-1]
    if d > DIMS[-1]:
        return 0
    bn = FA3_BWD_TILES[template_dim(d, DIMS)].block_k
    if masks.packed:
        batch = masks.cu_seqlens_q.shape[0] - 1
        blocks = min(cdiv(masks.total_k, bn) + batch, batch * cdiv(masks.max_seqlen_k, bn)) if masks.max_seqlen_k else 0
    else:
        blocks = q.shape[0] * cdiv(k.shape[1], bn)
    return min(blocks * k.shape[-2], sm_count(q.device.id))


def masked_blocks(q, masks, bm: int) -> int:
    """Q blocks of the stats and the dQ sum (bwd_dq_writer.cuh's dq_block): (batch, heads, n_q) dense; packed, the
    packed rows' blocks plus one a sequence, for every head."""
    b, nq, h = q.shape[:3]
    if masks.packed:
        return (cdiv(nq, bm) + masks.cu_seqlens_q.shape[0] - 1) * h
    return b * h * cdiv(nq, bm)


def masked_gradients(dout, q, k, v, out, lse, causal, softmax_scale, masks, deterministic: bool = True):
    """(dq, dk, dv, None) of launchable arrays (kernels/masked.py's backward): fa3_bwd_stats_masked, the
    persistent fa3_bwd_masked (dQ's shares in the fixed order, or, not ``deterministic``, as they come),
    fa3_bwd_dq_convert_masked. The caller checked masked_grid."""
    import cupy
    from . import fa3_masked, masked
    from .params import MASKED_BWD
    run = masked.bwd_launch(dout, q, k, v, out, causal, softmax_scale, masks)
    if run.empty:
        return run.dq, run.dk, run.dv, None
    h, dp = q.shape[2], q.shape[3]
    D = template_dim(dp, DIMS)
    ctype = CTYPE[q.dtype.name]
    bm, bn = FA3_BWD_TILES[D]
    blocks = masked_blocks(q, masks, bm)
    if blocks >= 2**31:
        raise ValueError(f"{blocks} Q blocks x heads exceed the backward's 2^31 - 1")
    stats = cupy.empty((blocks, 2, bm), cupy.float32)
    acc = (cupy.empty if deterministic else cupy.zeros)((blocks, 2, 64 * 64), cupy.float32)
    counts = cupy.zeros((blocks, 2) if deterministic else (1,), cupy.int32)
    ptrs = run.pointers(q, k, v, out, dout, lse, None)
    stream = cupy.cuda.get_current_stream().ptr
    exprs = module(ctype, D)
    main_k, stats_k, convert_k, unordered = masked_instances(ctype, D)
    main_k = main_k if deterministic else unordered

    launch(function_of(jit.kernel(SOURCE, stats_k, exprs), 0), (cdiv(cdiv(run.rows_q, bm) * bm, STATS_WARPS), h,
           run.batch), 32 * STATS_WARPS, 0, stream, run.template, MASKED_BWD.pointers_format, *ptrs,
           extra=(ctypes.c_uint64(stats.data.ptr),))

    maps = [ctypes.create_string_buffer(fa3_masked.tensor_map(a, rows, name), 128)
            for a, rows, name in ((q, bm, "q"), (dout, bm, "dout"), (k, bn, "k"), (v, bn, "v"))]
    params = ctypes.create_string_buffer(run.template, len(run.template))
    struct.pack_into(MASKED_BWD.pointers_format, params, 0, *ptrs)
    scalars = (ctypes.c_uint64(stats.data.ptr), ctypes.c_uint64(acc.data.ptr), ctypes.c_uint64(counts.data.ptr),
               ctypes.c_int(run.batch))
    argv = (ctypes.c_void_p * 9)(*(ctypes.addressof(x) for x in maps + [params]),
                                 *(ctypes.addressof(x) for x in scalars))
    smem = smem_bytes(D)
    launch_argv(function_of(jit.kernel(SOURCE, main_k, exprs), smem), (masked_grid(q, k, masks), 1, 1), threads(D),
                smem, stream, argv)

    launch(function_of(jit.kernel(SOURCE, convert_k, exprs), 0), (cdiv(run.rows_q * (dp // 8), 256), h, run.batch),
           256, 0, stream, run.template, MASKED_BWD.pointers_format, *ptrs, extra=(ctypes.c_uint64(acc.data.ptr),))
    return run.dq, run.dk, run.dv, None


def walk_columns(n_kv: int, ctas: int) -> int:
    """bwd_dq_writer.cuh's walk_columns: the smallest divisor of ``ctas`` that holds ``n_kv`` K/V blocks (``ctas``
    where none does)."""
    columns = min(n_kv, ctas)
    while ctas % columns:
        columns += 1
    return columns


def masked_shares(seqlens_q, seqlens_k, heads_kv: int, group: int, ctas: int, bm: int, bn: int, *, causal: bool,
                  window=(-1, -1)) -> list:
    """The masked backward's walk (bwd_dq_writer.cuh's SequenceWalk and DqOrder's rank_in, on reference/masks.py's
    blocks): for each of ``ctas`` CTAs, the dQ shares it hands its writer, in order, as ((sequence, query head, Q
    block), rank). The grid's columns are the longest sequence's K/V blocks, or the CTAs where those are more (a
    longer sequence walked a chunk of that many blocks at a time); every K/V block of every (sequence, kv head) is
    one CTA's; CTA c takes column c of a chunk moved on by the columns of the chunks its group walked before. The
    groups are of walk_columns CTAs."""
    from ..reference.masks import Mask
    cols = walk_columns(cdiv(max(seqlens_k), bn), ctas)
    groups, items = ctas // cols, len(seqlens_q) * heads_kv
    band = causal or tuple(window) != (-1, -1)
    blocks_of = {}   # (sq, sk) -> (the Q blocks each K/V block j sees, the K/V blocks [lo, hi) each Q block i sees)
    for sq, sk in set(zip(seqlens_q, seqlens_k)):
        mask = Mask.of(sq, sk, causal=causal, window=window)
        q_seen = [[r.start // bm for r in mask.q_blocks(slice(j * bn, min(j * bn + bn, sk)), bm)]
                  for j in range(cdiv(sk, bn))]
        kv = [[c.start // bn for c in mask.blocks(slice(i * bm, min(i * bm + bm, sq)), bn)]
              for i in range(cdiv(sq, bm))]
        blocks_of[sq, sk] = q_seen, [(x[0], x[-1] + 1) if x else (0, 0) for x in kv]
    walks = []
    for cta in range(ctas):
        c, shares, shift, sub = cta % cols, [], 0, -1
        for item in range(cta // cols, items, groups):
            b, h_kv = divmod(item, heads_kv)
            sq, sk = seqlens_q[b], seqlens_k[b]
            n_b, n_q = cdiv(sk, bn), cdiv(sq, bm)
            q_seen, kv_seen = blocks_of[sq, sk]
            for c0 in range(0, n_b, cols):
                n_c = min(cols, n_b - c0)
                col, shift, sub = (c - shift) % cols, (shift + n_c) % cols, sub + 1
                if col >= n_c:
                    continue
                down = band and sub % 2 == 1
                j = c0 + (n_c - 1 - col if down else col)
                seen = q_seen[j]
                blocks = (seen[::-1] if down else seen) if band else \
                    [((j - c0) * n_q // n_c + k) % n_q for k in range(n_q)]
                for hq in range(group):
                    for i in blocks:
                        lo, hi = kv_seen[i]
                        if band:
                            rank = max(0, min(hi, c0) - lo) + (min(hi, c0 + n_c) - 1 - j if not down else
                                                               j - max(lo, c0))
                        else:
                            rank = c0 + (((i + 1) * n_c - 1) // n_q - (j - c0)) % n_c
                        shares.append(((b, h_kv * group + hq, i), rank))
        walks.append(shares)
    return walks
