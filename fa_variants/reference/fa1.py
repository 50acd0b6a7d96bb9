"""FlashAttention-1 forward (Dao et al. 2022, Algorithm 1), line by line, in the loop order of ``fa1_fwd.cu``.

The outer loop is over K/V blocks j, so each K_j, V_j is loaded once; the price is that the running state of
*every* Q block (O_i, l_i, m_i) lives in HBM and makes a round trip on every (i, j) step, and Q_i is re-read
T_c times. O_i is kept normalized at every step (per-block normalization, line 12).

HBM accounting follows the algorithm's text: line 2 initializes O, l, m "in HBM" and those writes are counted
(N_q d + 2 N_q). Per head, with T_c = ceil(N_k / B_c), non-causal:
    Q: T_c N_q d    K, V: N_k d each    O: N_q d + 2 T_c N_q d    l, m: N_q + 2 T_c N_q each
Causal: a block pair wholly above the diagonal is skipped (Q_i, O_i, l_i, m_i not loaded, nothing written);
likewise any pair of reference/masks.py's masks (a window, a shorter key length) whose rows see none of its keys,
and a K/V block that no row sees is not loaded. Sinks start every row's statistics in line 2 (m = sink, l = 1:
one more score, with no value), which costs nothing more.
The log-sum-exp returned is m + log l of the final HBM state; Algorithm 1 writes no separate LSE.
"""
from __future__ import annotations

import numpy as np

from .budget import Progress
from .common import (AccessCounter, BackwardResult, ModelResult, logsumexp_from, matmul_flops, normalize, prepare,
                     prepare_backward, rescale, resolve_blocks, row_exp, rowsum_product, softmax_backward,
                     sum_over_groups, to_flash_layout)
from .masks import Mask

LOOPS = """\
O = 0, l = 0, m = -inf in HBM                                       (line 2)
for j in 1..T_c:           load K_j, V_j                            (lines 5-6)
  for i in 1..T_r:         load Q_i, O_i, l_i, m_i; S_ij = Q_i K_j^T (lines 7-9)
                           m~ = rowmax S_ij, P~ = exp(S_ij - m~), l~ = rowsum P~; m_new, l_new (10-11)
                           write O_i = (l_i e^(m_i-m_new) O_i + e^(m~-m_new) P~ V_j) / l_new; l_i, m_i (12-13)"""

LOOPS_BACKWARD = """\
dQ = 0, dK = 0, dV = 0 in HBM                                       (line 5)
for j in 1..T_c:           load K_j, V_j; dK~_j = 0, dV~_j = 0 on chip (lines 6-8)
  for i in 1..T_r:         load Q_i, O_i, dO_i, dQ_i, l_i, m_i      (lines 9-10)
                           S_ij = scale Q_i K_j^T; P_ij = diag(l_i)^-1 exp(S_ij - m_i)     (11-13)
                           dV~_j += P_ij^T dO_i; dP_ij = dO_i V_j^T; D_i = rowsum(dO_i o O_i) (16-19)
                           dS_ij = P_ij o (dP_ij - D_i); write dQ_i = dQ_i + scale dS_ij K_j (20-21)
                           dK~_j += scale dS_ij^T Q_i                                       (22)
  write dK_j = dK~_j, dV_j = dV~_j                                  (line 24)"""


def forward(q, k, v, *, causal=False, softmax_scale=None, block_q=None, block_k=None, sram=None, window=(-1, -1),
            softcap=0.0, sinks=None, alibi_slopes=None) -> ModelResult:
    """FA1's forward on float64 copies; ``block_q``/``block_k`` default to the paper's for ``sram`` elements.
    ``window``, ``softcap``, ``sinks`` (heads,), ``alibi_slopes`` (heads,) or (batch, heads): reference/masks.py."""
    Q, K, V, scale = prepare(q, k, v, causal=causal, softmax_scale=softmax_scale,
                              block_q=block_q, block_k=block_k)
    mask = Mask.of_arrays(Q, K, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                          sinks=sinks)
    batch, heads, N_q, d = Q.shape
    N_k = K.shape[2]
    B_r, B_c = resolve_blocks(d, block_q, block_k, sram)            # line 1
    programs = batch * heads  # every (batch, query head) loads its own K/V blocks, GQA included
    hbm = AccessCounter()

    O = np.zeros_like(Q)                                            # line 2: the "HBM" arrays
    m, l, _ = mask.fold_sinks(np.full((batch, heads, N_q), -np.inf), np.zeros((batch, heads, N_q)))
    hbm.write("O", programs * N_q * d)
    hbm.write("l", programs * N_q)
    hbm.write("m", programs * N_q)
    progress = Progress(_what("forward", batch, heads, N_q, N_k, d), mask.pairs(B_r, B_c))

    for cols in mask.key_blocks(B_c):                               # line 5: outer loop over K/V blocks
        visitors = mask.q_blocks(cols, B_r)                         # the Q blocks that see a key of it
        if not visitors:
            continue                                                # seen by no row: not loaded
        K_j, V_j = K[:, :, cols], V[:, :, cols]                     # line 6
        hbm.read("K", programs * K_j.shape[2] * d)
        hbm.read("V", programs * V_j.shape[2] * d)
        for rows in visitors:                                       # line 7: inner loop over Q blocks
            n = programs * (rows.stop - rows.start)
            Q_i, O_i, l_i, m_i = Q[:, :, rows], O[:, :, rows], l[:, :, rows], m[:, :, rows]   # line 8
            for name, size in (("Q", n * d), ("O", n * d), ("l", n), ("m", n)):
                hbm.read(name, size)

            S_ij = mask.apply(Q_i @ K_j.swapaxes(-1, -2) * scale,   # line 9 (softcap, bias; the mask where
                              rows, cols, mask.needs_mask(rows, cols))  # a key of the block is hidden)
            m_tilde = S_ij.max(axis=-1)                             # line 10 (-inf for a fully masked row)
            P_tilde = row_exp(S_ij, m_tilde)
            l_tilde = P_tilde.sum(axis=-1)
            m_new = np.maximum(m_i, m_tilde)                        # line 11
            l_new = rescale(m_i, m_new) * l_i + rescale(m_tilde, m_new) * l_tilde
            O[:, :, rows] = normalize(                              # line 12: O_i stays normalized
                (l_i * rescale(m_i, m_new))[..., None] * O_i + rescale(m_tilde, m_new)[..., None] * (P_tilde @ V_j),
                l_new)
            l[:, :, rows], m[:, :, rows] = l_new, m_new             # line 13
            for name, size in (("O", n * d), ("l", n), ("m", n)):
                hbm.write(name, size)
            progress.step()
    progress.close()
    return ModelResult(out=to_flash_layout(O), lse=logsumexp_from(m, l), hbm=hbm, blocks=(B_r, B_c))


def _what(direction: str, batch: int, heads: int, n_q: int, n_k: int, d: int) -> str:
    return f"fa1's NumPy model ({direction}, batch {batch} x heads {heads} x {n_q} x {n_k}, head_dim {d})"


def backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, block_q=None, block_k=None,
             sram=None, window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None) -> BackwardResult:
    """FA1's backward (Dao et al. 2022, Algorithm 4, without dropout), line by line, in the forward's loop order.

    The outer loop is over K/V blocks j: dK_j, dV_j accumulate on chip and are written once. The price is the
    inner loop's: every (i, j) step loads Q_i, O_i, dO_i, dQ_i, l_i, m_i and writes dQ_i back (a
    read-modify-write of dQ in HBM), and recomputes S_ij, P_ij and D_i = rowsum(dO_i o O_i) (line 19 computes
    D_i inside the inner loop, so it is recomputed T_c times; nothing stores it).

    The statistics: Algorithm 4 reads the forward's l and m; the API hands over LSE = m + log l instead. With
    m = LSE and l = 1, line 13's P_ij = diag(l_i)^-1 exp(S_ij - m_i) is the same P, and the l_i, m_i loads are
    counted as Algorithm 4 makes them (B_r each per step, as "l" and "m").

    HBM accounting follows the algorithm's text, as the forward's does: line 5 initializes dQ, dK, dV "in HBM"
    and those writes are counted (N_q d + 2 N_k d; dK's and dV's zeros are overwritten at line 24 unread, so a
    kernel would skip those 2 N_k d). Per head, with T_c = ceil(N_k / B_c), non-causal:
        Q, O, dO: T_c N_q d each    l, m: T_c N_q each    K, V: N_k d each
        dQ: N_q d + 2 T_c N_q d     dK, dV: 2 N_k d each
    Causal: a block pair wholly above the bottom-right diagonal is skipped (nothing loaded, nothing written);
    T_c N_q becomes the number of Q rows loaded over the visited pairs; the same for any mask of
    reference/masks.py, and a K/V block that no row sees is not loaded (its dK_j, dV_j zeros are written). dk,
    dv are summed over each group of query heads (``sum_over_groups``). Softcap: dS through the cap's derivative
    (``Mask.chain``). Sinks: row i's share of their gradient, -e^(sink - LSE_i) D_i, is added at its Q block's
    first visited pair, where line 19 has D_i (``dsinks`` of the result).
    """
    dO, Q, K, V, O, LSE, scale, heads_kv = prepare_backward(dout, q, k, v, out, lse, causal=causal,
                                                            softmax_scale=softmax_scale, block_q=block_q,
                                                            block_k=block_k)
    mask = Mask.of_arrays(Q, K, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                          sinks=sinks)
    batch, heads, N_q, d = Q.shape
    N_k = K.shape[2]
    B_r, B_c = resolve_blocks(d, block_q, block_k, sram)            # line 2
    programs = batch * heads  # every (batch, query head) loads its own K/V blocks, GQA included
    hbm = AccessCounter()
    flops = 0
    m, l = LSE, np.ones_like(LSE)   # the forward's statistics, as far as line 13 can tell (see above)

    dQ, dK, dV = np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V)   # line 5: the "HBM" arrays
    hbm.write("dQ", programs * N_q * d)
    hbm.write("dK", programs * N_k * d)
    hbm.write("dV", programs * N_k * d)
    progress = Progress(_what("backward", batch, heads, N_q, N_k, d), mask.pairs(B_r, B_c))
    dsinks = None if mask.sinks is None else np.zeros(heads)

    for cols in mask.key_blocks(B_c):                               # line 6: outer loop over K/V blocks
        visitors = mask.q_blocks(cols, B_r)                         # the Q blocks that see a key of it
        K_j, V_j = K[:, :, cols], V[:, :, cols]                     # line 7 (seen by no row: not loaded)
        if visitors:
            hbm.read("K", programs * K_j.shape[2] * d)
            hbm.read("V", programs * V_j.shape[2] * d)
        dK_j, dV_j = np.zeros_like(K_j), np.zeros_like(V_j)         # line 8: on chip
        for rows in visitors:                                       # line 9: inner loop over Q blocks
            n = programs * (rows.stop - rows.start)
            Q_i, O_i, dO_i, dQ_i = Q[:, :, rows], O[:, :, rows], dO[:, :, rows], dQ[:, :, rows]   # line 10
            l_i, m_i = l[:, :, rows], m[:, :, rows]
            for name, size in (("Q", n * d), ("O", n * d), ("dO", n * d), ("dQ", n * d), ("l", n), ("m", n)):
                hbm.read(name, size)

            S_ij = Q_i @ K_j.swapaxes(-1, -2) * scale               # lines 11-12 (then softcap, bias, mask)
            P_ij = row_exp(mask.apply(S_ij, rows, cols, mask.needs_mask(rows, cols)), m_i) / l_i[..., None]
            #                                                         line 13 (no dropout: 14-15, 18 are identities)
            dV_j = dV_j + P_ij.swapaxes(-1, -2) @ dO_i              # line 16
            dP_ij = dO_i @ V_j.swapaxes(-1, -2)                     # line 17
            D_i = rowsum_product(dO_i, O_i)                         # line 19: recomputed at every step
            if dsinks is not None and cols.start == mask.blocks(rows, B_c)[0].start:
                dsinks += mask.sinks.grad(LSE[:, :, rows], D_i)     # once per row: at its first visited pair
            dS_ij = mask.chain(softmax_backward(P_ij, dP_ij, D_i), S_ij)   # line 20
            dQ[:, :, rows] = dQ_i + scale * (dS_ij @ K_j)           # line 21: written back at every step
            hbm.write("dQ", n * d)
            dK_j = dK_j + scale * (dS_ij.swapaxes(-1, -2) @ Q_i)    # line 22
            flops += matmul_flops(programs, rows.stop - rows.start, cols.stop - cols.start, d, products=5)
            progress.step()
        dK[:, :, cols], dV[:, :, cols] = dK_j, dV_j                 # line 24
        hbm.write("dK", programs * K_j.shape[2] * d)
        hbm.write("dV", programs * V_j.shape[2] * d)
    progress.close()
    return BackwardResult(dq=to_flash_layout(dQ), dk=sum_over_groups(dK, heads_kv), dv=sum_over_groups(dV, heads_kv),
                          hbm=hbm, blocks=(B_r, B_c), flops=flops, dsinks=dsinks)
