"""FlashAttention-1 forward (Dao et al. 2022, Algorithm 1), line by line, in the loop order of ``fa1_fwd.cu``.

The outer loop is over K/V blocks j, so each K_j, V_j is loaded once; the price is that the running state of
*every* Q block (O_i, l_i, m_i) lives in HBM and makes a round trip on every (i, j) step, and Q_i is re-read
T_c times. O_i is kept normalized at every step (per-block normalization, line 12).

HBM accounting follows the algorithm's text: line 2 initializes O, l, m "in HBM" and those writes are counted
(N_q d + 2 N_q). Per head, with T_c = ceil(N_k / B_c), non-causal:
    Q: T_c N_q d    K, V: N_k d each    O: N_q d + 2 T_c N_q d    l, m: N_q + 2 T_c N_q each
Causal: a block pair wholly above the diagonal is skipped (Q_i, O_i, l_i, m_i not loaded, nothing written).
The log-sum-exp returned is m + log l of the final HBM state; Algorithm 1 writes no separate LSE.
"""
from __future__ import annotations

import numpy as np

from .common import (AccessCounter, ModelResult, block_slices, block_visited, causal_visible,
                     logsumexp_from, normalize, prepare, rescale, resolve_blocks, row_exp, to_flash_layout)

LOOPS = """\
O = 0, l = 0, m = -inf in HBM                                       (line 2)
for j in 1..T_c:           load K_j, V_j                            (lines 5-6)
  for i in 1..T_r:         load Q_i, O_i, l_i, m_i; S_ij = Q_i K_j^T (lines 7-9)
                           m~ = rowmax S_ij, P~ = exp(S_ij - m~), l~ = rowsum P~; m_new, l_new (10-11)
                           write O_i = (l_i e^(m_i-m_new) O_i + e^(m~-m_new) P~ V_j) / l_new; l_i, m_i (12-13)"""


def forward(q, k, v, *, causal=False, softmax_scale=None, block_q=None, block_k=None, sram=None) -> ModelResult:
    """FA1's forward on float64 copies; ``block_q``/``block_k`` default to the paper's for ``sram`` elements."""
    Q, K, V, scale = prepare(q, k, v, causal=causal, softmax_scale=softmax_scale,
                              block_q=block_q, block_k=block_k)
    batch, heads, N_q, d = Q.shape
    N_k = K.shape[2]
    B_r, B_c = resolve_blocks(d, block_q, block_k, sram)            # line 1
    programs = batch * heads  # every (batch, query head) loads its own K/V blocks, GQA included
    hbm = AccessCounter()

    O = np.zeros_like(Q)                                            # line 2: the "HBM" arrays
    l = np.zeros((batch, heads, N_q))
    m = np.full((batch, heads, N_q), -np.inf)
    hbm.write("O", programs * N_q * d)
    hbm.write("l", programs * N_q)
    hbm.write("m", programs * N_q)

    for cols in block_slices(N_k, B_c):                             # line 5: outer loop over K/V blocks
        K_j, V_j = K[:, :, cols], V[:, :, cols]                     # line 6
        hbm.read("K", programs * K_j.shape[2] * d)
        hbm.read("V", programs * V_j.shape[2] * d)
        for rows in block_slices(N_q, B_r):                         # line 7: inner loop over Q blocks
            if causal and not block_visited(rows.stop - 1, cols.start, N_q, N_k):
                continue                                            # wholly above the diagonal: skipped
            n = programs * (rows.stop - rows.start)
            Q_i, O_i, l_i, m_i = Q[:, :, rows], O[:, :, rows], l[:, :, rows], m[:, :, rows]   # line 8
            for name, size in (("Q", n * d), ("O", n * d), ("l", n), ("m", n)):
                hbm.read(name, size)

            S_ij = Q_i @ K_j.swapaxes(-1, -2) * scale               # line 9
            if causal:
                S_ij = np.where(causal_visible(np.arange(N_q)[rows], np.arange(N_k)[cols], N_q, N_k),
                                S_ij, -np.inf)
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
    return ModelResult(out=to_flash_layout(O), lse=logsumexp_from(m, l), hbm=hbm, blocks=(B_r, B_c))
