"""FlashAttention-2 forward (Dao 2023, Algorithm 1), in the loop order of ``cuda_src/fa2_fwd.cu``.

One program per (Q block i, head, batch): Q_i is loaded once and O_i, l_i, m_i never leave the chip. The
inner loop streams K_j, V_j; O_i accumulates *unnormalized* (deferred normalization) and is divided by l_i
once at the end, when O_i and LSE_i = m_i + log l_i are written. Causal: blocks wholly above the diagonal
are skipped (never loaded).

Per head, with T_r = ceil(N_q / B_r): Q and O move once, K and V T_r times:
    N_q d + 2 T_r N_k d + N_q d + N_q (LSE)   ->   2 N^2 d / B_r = 8 N^2 d^2 / M with B_r = M / 4d.
"""
from __future__ import annotations

import numpy as np

from .common import (AccessCounter, ModelResult, block_slices, block_visited, causal_visible,
                     logsumexp_from, normalize, online_softmax_step, prepare, resolve_blocks, to_flash_layout)

LOOPS = """\
for i in 1..T_r:           (one CTA each) load Q_i; O_i = 0, l_i = 0, m_i = -inf on chip
  for j in 1..T_c:         load K_j, V_j; S_ij = Q_i K_j^T * scale
                           m_new = max(m_i, rowmax S_ij); P_ij = exp(S_ij - m_new)
                           l_i = e^(m_i - m_new) l_i + rowsum P_ij; O_i = e^(m_i - m_new) O_i + P_ij V_j
  write O_i / l_i and LSE_i = m_i + log l_i (once)"""


def forward(q, k, v, *, causal=False, softmax_scale=None, block_q=None, block_k=None, sram=None) -> ModelResult:
    """FA2's forward on float64 copies; ``block_q``/``block_k`` default to the paper's for ``sram`` elements."""
    Q, K, V, scale = prepare(q, k, v, causal=causal, softmax_scale=softmax_scale,
                              block_q=block_q, block_k=block_k)
    batch, heads, N_q, d = Q.shape
    N_k = K.shape[2]
    B_r, B_c = resolve_blocks(d, block_q, block_k, sram)
    programs = batch * heads  # every (batch, query head) loads its own K/V blocks, GQA included
    hbm = AccessCounter()
    O = np.zeros_like(Q)
    LSE = np.empty((batch, heads, N_q))

    for rows in block_slices(N_q, B_r):                       # outer loop: Q blocks, one CTA each
        Q_i = Q[:, :, rows]
        hbm.read("Q", programs * Q_i.shape[2] * d)
        m_i = np.full(Q_i.shape[:3], -np.inf)
        l_i = np.zeros(Q_i.shape[:3])
        O_i = np.zeros(Q_i.shape)
        for cols in block_slices(N_k, B_c):                   # inner loop: K/V blocks
            if causal and not block_visited(rows.stop - 1, cols.start, N_q, N_k):
                break                                          # this and every later K block is masked
            K_j, V_j = K[:, :, cols], V[:, :, cols]
            hbm.read("K", programs * K_j.shape[2] * d)
            hbm.read("V", programs * V_j.shape[2] * d)
            S_ij = Q_i @ K_j.swapaxes(-1, -2) * scale
            if causal:
                S_ij = np.where(causal_visible(np.arange(N_q)[rows], np.arange(N_k)[cols], N_q, N_k),
                                S_ij, -np.inf)
            m_i, l_i, O_i = online_softmax_step(m_i, l_i, O_i, S_ij, V_j)
        O[:, :, rows] = normalize(O_i, l_i)                    # deferred normalization: once per row
        LSE[:, :, rows] = logsumexp_from(m_i, l_i)
        hbm.write("O", programs * O_i.shape[2] * d)
        hbm.write("LSE", programs * O_i.shape[2])
    return ModelResult(out=to_flash_layout(O), lse=LSE, hbm=hbm, blocks=(B_r, B_c))
