"""Standard attention (the papers' Algorithm 0): S and P are materialized in HBM.

    load Q, K;        S = Q K^T * scale;     write S            (causal: masked scores set to -inf)
    read S;           P = softmax(S);        write P
    load P, V;        O = P V;               write O

Per head that is 4 N^2 + 4 N d element accesses (seqlen_q = seqlen_k = N): the N^2 terms are what
FlashAttention removes. Causal masking does not shrink S here: the full matrix is written and read.
"""
from __future__ import annotations

import numpy as np

from .common import (AccessCounter, ModelResult, causal_visible, logsumexp_from, normalize, prepare, row_exp,
                     to_flash_layout)

LOOPS = """\
S = Q K^T * scale          read Q, K; write S (N_q x N_k)
P = softmax(S)             read S; write P (N_q x N_k)
O = P V                    read P, V; write O"""


def forward(q, k, v, *, causal=False, softmax_scale=None, block_q=None, block_k=None, sram=None) -> ModelResult:
    """softmax(q k^T * scale) v, the direct way. Block sizes (checked like the tiled models') and ``sram``
    are accepted and unused: there is no tiling."""
    Q, K, V, scale = prepare(q, k, v, causal=causal, softmax_scale=softmax_scale,
                              block_q=block_q, block_k=block_k)
    batch, heads, n_q, d = Q.shape
    n_k = K.shape[2]
    programs = batch * heads  # one per (batch, query head); K, V counted per query head (see prepare)
    hbm = AccessCounter()

    hbm.read("Q", programs * n_q * d)
    hbm.read("K", programs * n_k * d)
    S = Q @ K.swapaxes(-1, -2) * scale
    if causal:
        S = np.where(causal_visible(np.arange(n_q), np.arange(n_k), n_q, n_k), S, -np.inf)
    hbm.write("S", programs * n_q * n_k)

    hbm.read("S", programs * n_q * n_k)
    m = S.max(axis=-1)
    E = row_exp(S, m)
    l = E.sum(axis=-1)
    P = normalize(E, l)
    hbm.write("P", programs * n_q * n_k)

    hbm.read("P", programs * n_q * n_k)
    hbm.read("V", programs * n_k * d)
    O = P @ V
    hbm.write("O", programs * n_q * d)
    return ModelResult(out=to_flash_layout(O), lse=logsumexp_from(m, l), hbm=hbm, blocks=None)
