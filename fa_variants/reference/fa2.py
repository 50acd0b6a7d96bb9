"""FlashAttention-2 forward (Dao 2023, Algorithm 1), in the loop order of ``cuda_src/fa2_fwd.cu``.

One program per (Q block i, head, batch): Q_i is loaded once and O_i, l_i, m_i never leave the chip. The
inner loop streams K_j, V_j; O_i accumulates *unnormalized* (deferred normalization) and is divided by l_i
once at the end, when O_i and LSE_i = m_i + log l_i are written. Masks (reference/masks.py: causal, a window,
a shorter key length): the K/V blocks that none of a Q block's rows sees are skipped (never loaded), and the
elementwise mask is applied only to the blocks that need one; softcap and ALiBi transform every block's scores;
the sinks join each row's (m, l) before O_i is normalized.

Per head, with T_r = ceil(N_q / B_r): Q and O move once, K and V T_r times:
    N_q d + 2 T_r N_k d + N_q d + N_q (LSE)   ->   2 N^2 d / B_r = 8 N^2 d^2 / M with B_r = M / 4d.
"""
from __future__ import annotations

import numpy as np

from .budget import Progress
from .common import (AccessCounter, BackwardResult, ModelResult, block_slices, logsumexp_from, matmul_flops,
                     normalize, online_softmax_step, prepare, prepare_backward, resolve_blocks, row_exp,
                     rowsum_product, softmax_backward, sum_over_groups, to_flash_layout)
from .masks import Mask

LOOPS = """\
for i in 1..T_r:           (one CTA each) load Q_i; O_i = 0, l_i = 0, m_i = -inf on chip
  for j in the blocks Q_i's rows see (masks: the others skipped):
                           load K_j, V_j; S_ij = Q_i K_j^T * scale (softcap, bias; mask where a key is hidden)
                           m_new = max(m_i, rowmax S_ij); P_ij = exp(S_ij - m_new)
                           l_i = e^(m_i - m_new) l_i + rowsum P_ij; O_i = e^(m_i - m_new) O_i + P_ij V_j
  write O_i / l_i and LSE_i = m_i + log l_i (once)"""

LOOPS_BACKWARD = """\
D = rowsum(dO o O)         (preprocessing pass) read O, dO; write D
for j in 1..T_c:           (dK/dV kernel, one CTA each) load K_j, V_j; dK_j = 0, dV_j = 0 on chip
  for i in 1..T_r:         load Q_i, dO_i, LSE_i, D_i; S_ij = Q_i K_j^T * scale; P_ij = exp(S_ij - LSE_i)
                           dV_j += P_ij^T dO_i; dP_ij = dO_i V_j^T; dS_ij = P_ij o (dP_ij - D_i)
                           dK_j += scale dS_ij^T Q_i    [dq_mode="atomic": dQ_i += scale dS_ij K_j in HBM]
  write dK_j, dV_j (once)
for i in 1..T_r:           (dQ kernel, one CTA each; dq_mode="separate") load Q_i, dO_i, LSE_i, D_i; dQ_i = 0
  for j in 1..T_c:         load K_j, V_j; recompute S_ij, P_ij, dP_ij, dS_ij; dQ_i += scale dS_ij K_j
  write dQ_i (once)"""

DQ_MODES = ("separate", "atomic")


def forward(q, k, v, *, causal=False, softmax_scale=None, block_q=None, block_k=None, sram=None, window=(-1, -1),
            softcap=0.0, sinks=None, alibi_slopes=None) -> ModelResult:
    """FA2's forward on float64 copies; ``block_q``/``block_k`` default to the paper's for ``sram`` elements.
    ``window``, ``softcap``, ``sinks`` (heads,), ``alibi_slopes`` (heads,) or (batch, heads): reference/masks.py."""
    Q, K, V, scale = prepare(q, k, v, causal=causal, softmax_scale=softmax_scale,
                              block_q=block_q, block_k=block_k)
    mask = Mask.of_arrays(Q, K, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                          sinks=sinks)
    batch, heads, N_q, d = Q.shape
    N_k = K.shape[2]
    B_r, B_c = resolve_blocks(d, block_q, block_k, sram)
    programs = batch * heads  # every (batch, query head) loads its own K/V blocks, GQA included
    hbm = AccessCounter()
    O = np.zeros_like(Q)
    LSE = np.empty((batch, heads, N_q))
    progress = Progress(_what("forward", batch, heads, N_q, N_k, d), mask.pairs(B_r, B_c))

    for rows in block_slices(N_q, B_r):                       # outer loop: Q blocks, one CTA each
        Q_i = Q[:, :, rows]
        hbm.read("Q", programs * Q_i.shape[2] * d)
        m_i = np.full(Q_i.shape[:3], -np.inf)
        l_i = np.zeros(Q_i.shape[:3])
        O_i = np.zeros(Q_i.shape)
        for cols in mask.blocks(rows, B_c):                   # inner loop: the K/V blocks its rows see
            K_j, V_j = K[:, :, cols], V[:, :, cols]
            hbm.read("K", programs * K_j.shape[2] * d)
            hbm.read("V", programs * V_j.shape[2] * d)
            S_ij = mask.apply(Q_i @ K_j.swapaxes(-1, -2) * scale, rows, cols, mask.needs_mask(rows, cols))
            m_i, l_i, O_i = online_softmax_step(m_i, l_i, O_i, S_ij, V_j)
            progress.step()
        m_i, l_i, alpha = mask.fold_sinks(m_i, l_i)            # a sink: one more score, with no value
        O[:, :, rows] = normalize(alpha[..., None] * O_i, l_i)  # deferred normalization: once per row
        LSE[:, :, rows] = logsumexp_from(m_i, l_i)
        hbm.write("O", programs * O_i.shape[2] * d)
        hbm.write("LSE", programs * O_i.shape[2])
    progress.close()
    return ModelResult(out=to_flash_layout(O), lse=LSE, hbm=hbm, blocks=(B_r, B_c))


def _what(direction: str, batch: int, heads: int, n_q: int, n_k: int, d: int) -> str:
    return f"fa2's NumPy model ({direction}, batch {batch} x heads {heads} x {n_q} x {n_k}, head_dim {d})"


def _recompute(Q_i, K_j, V_j, dO_i, LSE_i, D_i, scale, rows, cols, mask):
    """(P_ij, dS_ij) of one block pair, from the saved LSE and D: what both backward kernels recompute. dS_ij is
    the gradient of the scaled scores Q_i K_j^T scale, through the softcap where there is one (``Mask.chain``)."""
    S_ij = Q_i @ K_j.swapaxes(-1, -2) * scale
    P_ij = row_exp(mask.apply(S_ij, rows, cols, mask.needs_mask(rows, cols)), LSE_i)
    return P_ij, mask.chain(softmax_backward(P_ij, dO_i @ V_j.swapaxes(-1, -2), D_i), S_ij)


def backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, block_q=None, block_k=None,
             sram=None, dq_mode="separate", window=(-1, -1), softcap=0.0, sinks=None,
             alibi_slopes=None) -> BackwardResult:
    """FA2's backward (Dao 2023, Algorithm 2, sec. 3.1.2), in the loop order of its kernels, on float64 copies.

    A preprocessing pass computes D = rowsum(dO o O) once (reads O, dO; writes D: N_q). Then one program per
    K/V block j loads K_j, V_j once, loops over the Q blocks i (loading Q_i, dO_i, LSE_i, D_i), recomputes S_ij
    and P_ij = exp(S_ij - LSE_i), and keeps dK_j, dV_j on chip until its single write. dQ_i collects a term
    from every j, that is from every one of those programs:

    - ``dq_mode="separate"`` (default, deterministic): a second kernel, one program per Q block i, loads Q_i,
      dO_i, LSE_i, D_i once, loops over the K/V blocks j recomputing S, P, dP and dS, accumulates dQ_i on chip
      and writes it once. It re-reads K and V (T_r N_k d each) and costs 3 more matmuls per block pair
      (S, dP, dQ: 7 in all, against 5 for ``"atomic"``).
    - ``dq_mode="atomic"`` (the paper's and flash-attn's): the dK/dV kernel adds scale dS_ij K_j into an fp32
      dQ accumulator in HBM at every (i, j) step, a read-modify-write of B_r d elements; the accumulator is
      zeroed first (N_q d, Algorithm 2's line 3). Here the adds happen in j order; on the GPU their order
      varies from run to run. (flash-attn then converts the fp32 accumulator to the output's dtype, a pass
      of N_q d read + N_q d write outside Algorithm 2, not counted.)

    Per head, with T_r = ceil(N_q / B_r), T_c = ceil(N_k / B_c), non-causal:
        separate: Q N_q d + T_c N_q d; K, V N_k d + T_r N_k d each; O N_q d; dO 2 N_q d + T_c N_q d;
                  LSE N_q + T_c N_q; D 2 N_q + T_c N_q; dQ N_q d; dK, dV N_k d each
        atomic:   Q T_c N_q d; K, V N_k d each; O N_q d; dO N_q d + T_c N_q d; LSE T_c N_q; D N_q + T_c N_q;
                  dQ N_q d + 2 T_c N_q d; dK, dV N_k d each
    Causal: block pairs wholly above the bottom-right diagonal are skipped in both kernels (T_c N_q and T_r N_k
    become the rows and columns loaded over the visited pairs); so are the pairs outside a window (any mask of
    reference/masks.py: ``Mask.blocks``, ``Mask.q_blocks``), and a K/V block that no query sees loads nothing and
    writes zeros. dk, dv are summed over each group of query heads (``sum_over_groups``). Softcap: dS is taken
    through the cap's derivative (``Mask.chain``). Sinks: their gradient -sum_i e^(sink - LSE_i) D_i comes from
    the preprocessing pass, which then reads LSE too (``dsinks`` of the result).
    """
    if not isinstance(dq_mode, str) or dq_mode not in DQ_MODES:
        raise ValueError(f"dq_mode must be one of {DQ_MODES}, got {dq_mode!r}")
    dO, Q, K, V, O, LSE, scale, heads_kv = prepare_backward(dout, q, k, v, out, lse, causal=causal,
                                                            softmax_scale=softmax_scale, block_q=block_q,
                                                            block_k=block_k)
    mask = Mask.of_arrays(Q, K, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                          sinks=sinks)
    batch, heads, N_q, d = Q.shape
    N_k = K.shape[2]
    B_r, B_c = resolve_blocks(d, block_q, block_k, sram)
    programs = batch * heads  # every (batch, query head) loads its own K/V blocks, GQA included
    hbm = AccessCounter()
    flops = 0

    hbm.read("O", programs * N_q * d)                          # preprocessing: D once, for both kernels
    hbm.read("dO", programs * N_q * d)
    D = rowsum_product(dO, O)
    hbm.write("D", programs * N_q)
    dsinks = None
    if mask.sinks is not None:                                 # ... and the sinks' gradient from D and LSE
        hbm.read("LSE", programs * N_q)
        dsinks = mask.sinks.grad(LSE, D)

    dQ, dK, dV = np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V)
    passes = 2 if dq_mode == "separate" else 1
    progress = Progress(_what("backward", batch, heads, N_q, N_k, d), passes * mask.pairs(B_r, B_c))
    if dq_mode == "atomic":
        hbm.write("dQ", programs * N_q * d)                    # the accumulator's zeros (line 3)

    for cols in mask.key_blocks(B_c):                          # dK/dV kernel: one CTA per K/V block
        visitors = mask.q_blocks(cols, B_r)                    # the Q blocks that see a key of it
        K_j, V_j = K[:, :, cols], V[:, :, cols]
        if visitors:                                           # (seen by none: nothing loaded, zeros written)
            hbm.read("K", programs * K_j.shape[2] * d)
            hbm.read("V", programs * V_j.shape[2] * d)
        dK_j, dV_j = np.zeros_like(K_j), np.zeros_like(V_j)
        for rows in visitors:                                  # inner loop: Q blocks
            n = programs * (rows.stop - rows.start)
            Q_i, dO_i, LSE_i, D_i = Q[:, :, rows], dO[:, :, rows], LSE[:, :, rows], D[:, :, rows]
            for name, size in (("Q", n * d), ("dO", n * d), ("LSE", n), ("D", n)):
                hbm.read(name, size)
            P_ij, dS_ij = _recompute(Q_i, K_j, V_j, dO_i, LSE_i, D_i, scale, rows, cols, mask)
            dV_j = dV_j + P_ij.swapaxes(-1, -2) @ dO_i
            dK_j = dK_j + scale * (dS_ij.swapaxes(-1, -2) @ Q_i)
            products = 4                                        # S, P^T dO, dO V^T, dS^T Q
            if dq_mode == "atomic":                             # fp32 read-modify-write of dQ_i in HBM
                hbm.read("dQ", n * d)
                dQ[:, :, rows] += scale * (dS_ij @ K_j)
                hbm.write("dQ", n * d)
                products += 1
            flops += matmul_flops(programs, rows.stop - rows.start, cols.stop - cols.start, d, products)
            progress.step()
        dK[:, :, cols], dV[:, :, cols] = dK_j, dV_j             # once per K/V block
        hbm.write("dK", programs * K_j.shape[2] * d)
        hbm.write("dV", programs * V_j.shape[2] * d)

    if dq_mode == "separate":
        for rows in block_slices(N_q, B_r):                    # dQ kernel: one CTA per Q block
            Q_i, dO_i, LSE_i, D_i = Q[:, :, rows], dO[:, :, rows], LSE[:, :, rows], D[:, :, rows]
            n = programs * (rows.stop - rows.start)
            for name, size in (("Q", n * d), ("dO", n * d), ("LSE", n), ("D", n)):
                hbm.read(name, size)
            dQ_i = np.zeros_like(Q_i)
            for cols in mask.blocks(rows, B_c):                # inner loop: the K/V blocks its rows see
                K_j, V_j = K[:, :, cols], V[:, :, cols]
                hbm.read("K", programs * K_j.shape[2] * d)
                hbm.read("V", programs * V_j.shape[2] * d)
                _, dS_ij = _recompute(Q_i, K_j, V_j, dO_i, LSE_i, D_i, scale, rows, cols, mask)
                dQ_i = dQ_i + scale * (dS_ij @ K_j)
                flops += matmul_flops(programs, rows.stop - rows.start, cols.stop - cols.start, d, products=3)
                progress.step()
            dQ[:, :, rows] = dQ_i                               # once per Q block
            hbm.write("dQ", n * d)
    progress.close()
    return BackwardResult(dq=to_flash_layout(dQ), dk=sum_over_groups(dK, heads_kv), dv=sum_over_groups(dV, heads_kv),
                          hbm=hbm, blocks=(B_r, B_c), flops=flops, dsinks=dsinks)
