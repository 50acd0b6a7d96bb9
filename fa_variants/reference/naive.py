"""Standard attention (the papers' Algorithm 0): S and P are materialized in HBM.

    load Q, K;        S = Q K^T * scale;     write S            (causal: masked scores set to -inf)
    read S;           P = softmax(S);        write P
    load P, V;        O = P V;               write O

Per head that is 4 N^2 + 4 N d element accesses (seqlen_q = seqlen_k = N): the N^2 terms are what
FlashAttention removes. Causal masking does not shrink S here: the full matrix is written and read; nor does
any mask of reference/masks.py (softcap and ALiBi transform S, sinks join each row's sum).
"""
from __future__ import annotations

from .budget import NAIVE_BACKWARD_MATRICES, NAIVE_MATRICES, check_naive
from .common import (AccessCounter, BackwardResult, ModelResult, logsumexp_from, matmul_flops, normalize, prepare,
                     prepare_backward, row_exp, rowsum_product, softmax_backward, sum_over_groups, to_flash_layout)
from .masks import Mask

LOOPS = """\
S = Q K^T * scale          read Q, K; write S (N_q x N_k)
P = softmax(S)             read S; write P (N_q x N_k)
O = P V                    read P, V; write O"""

LOOPS_BACKWARD = """\
dV = P^T dO                read P (the forward's), dO; write dV
dP = dO V^T                read dO, V; write dP (N_q x N_k)
D = rowsum(dO o O)         read P, dP, dO, O; write dS (N_q x N_k); D stays on chip (one row-wise pass)
dS = P o (dP - D)
dQ = dS K * scale          read dS, K; write dQ
dK = dS^T Q * scale        read dS, Q; write dK"""


def _fits(matrices: int, direction: str):
    """prepare's size check: ``matrices`` float64 N_q x N_k matrices a (batch, query head), from the flash-layout
    shapes q (batch, seqlen_q, heads, d) and k (batch, seqlen_k, heads_kv, d)."""
    return lambda q_shape, k_shape: check_naive(q_shape[0], q_shape[2], q_shape[1], k_shape[1], matrices, direction)


def forward(q, k, v, *, causal=False, softmax_scale=None, block_q=None, block_k=None, sram=None, window=(-1, -1),
            softcap=0.0, sinks=None, alibi_slopes=None) -> ModelResult:
    """softmax(q k^T * scale) v, the direct way. Block sizes (checked like the tiled models') and ``sram``
    are accepted and unused: there is no tiling. ``window``, ``softcap``, ``sinks``, ``alibi_slopes``:
    reference/masks.py."""
    Q, K, V, scale = prepare(q, k, v, causal=causal, softmax_scale=softmax_scale, block_q=block_q,
                              block_k=block_k, check_size=_fits(NAIVE_MATRICES, "forward"))
    mask = Mask.of_arrays(Q, K, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                          sinks=sinks)
    batch, heads, n_q, d = Q.shape
    n_k = K.shape[2]
    programs = batch * heads  # one per (batch, query head); K, V counted per query head (see prepare)
    hbm = AccessCounter()

    hbm.read("Q", programs * n_q * d)
    hbm.read("K", programs * n_k * d)
    everything = slice(0, n_q), slice(0, n_k)
    S = mask.apply(Q @ K.swapaxes(-1, -2) * scale, *everything, mask.needs_mask(*everything))
    hbm.write("S", programs * n_q * n_k)

    hbm.read("S", programs * n_q * n_k)
    m = S.max(axis=-1)
    E = row_exp(S, m)
    m, l, alpha = mask.fold_sinks(m, E.sum(axis=-1))   # a sink: one more term of each row's sum, with no value
    P = normalize(alpha[..., None] * E, l)
    hbm.write("P", programs * n_q * n_k)

    hbm.read("P", programs * n_q * n_k)
    hbm.read("V", programs * n_k * d)
    O = P @ V
    hbm.write("O", programs * n_q * d)
    return ModelResult(out=to_flash_layout(O), lse=logsumexp_from(m, l), hbm=hbm, blocks=None)


def backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, block_q=None, block_k=None,
             sram=None, window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None) -> BackwardResult:
    """The standard backward (FlashAttention-1 paper, Algorithm 3) of the forward above, which stored P.

    Five passes over HBM, each N x N matrix written once and read where the next pass needs it (per head):
        1. dV = P^T dO              reads P, dO; writes dV
        2. dP = dO V^T              reads dO, V; writes dP
        3. dS = P o (dP - D)        reads P, dP, dO, O; writes dS; D = rowsum(dO o O) stays on chip (one
                                    row-wise pass computes D_i, then dS_i). Algorithm 3 takes D = rowsum(P o dP)
                                    instead: the same value, without the 2 N_q d of dO and O.
        4. dQ = dS K * scale        reads dS, K; writes dQ
        5. dK = dS^T Q * scale      reads dS, Q; writes dK
    Counted per head: P 2 N_q N_k (read twice; its write was the forward's), dP 2 N_q N_k, dS 3 N_q N_k,
    dO 3 N_q d, Q, K, V, O, dQ, dK, dV once each. S is not touched: the forward's stored P stands in for it.
    Causal masking does not shrink the matrices (as in the forward). P's values are recomputed here as
    exp(S - LSE), the forward's softmax up to rounding, but counted as the read they model. ``lse`` is used for
    nothing else; block sizes (checked) and ``sram`` are accepted and unused: there is no tiling.
    dk, dv are summed over each group of query heads (``sum_over_groups``). Softcap: dS through the cap's
    derivative (``Mask.chain``); sinks: their gradient -sum_i e^(sink - LSE_i) D_i from pass 3's D (``dsinks``).
    """
    dO, Q, K, V, O, LSE, scale, heads_kv = prepare_backward(
        dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, block_q=block_q, block_k=block_k,
        check_size=_fits(NAIVE_BACKWARD_MATRICES, "backward"))
    mask = Mask.of_arrays(Q, K, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                          sinks=sinks)
    batch, heads, n_q, d = Q.shape
    n_k = K.shape[2]
    programs = batch * heads  # one per (batch, query head); K, V counted per query head (see prepare)
    hbm = AccessCounter()
    everything = slice(0, n_q), slice(0, n_k)
    S = Q @ K.swapaxes(-1, -2) * scale
    P = row_exp(mask.apply(S, *everything, mask.needs_mask(*everything)), LSE)   # the forward's P

    hbm.read("P", programs * n_q * n_k)                       # 1. dV = P^T dO
    hbm.read("dO", programs * n_q * d)
    dV = P.swapaxes(-1, -2) @ dO
    hbm.write("dV", programs * n_k * d)

    hbm.read("dO", programs * n_q * d)                        # 2. dP = dO V^T
    hbm.read("V", programs * n_k * d)
    dP = dO @ V.swapaxes(-1, -2)
    hbm.write("dP", programs * n_q * n_k)

    for name, size in (("P", n_q * n_k), ("dP", n_q * n_k), ("dO", n_q * d), ("O", n_q * d)):
        hbm.read(name, programs * size)                       # 3. dS = P o (dP - rowsum(dO o O))
    D = rowsum_product(dO, O)
    dS = mask.chain(softmax_backward(P, dP, D), S)
    dsinks = None if mask.sinks is None else mask.sinks.grad(LSE, D)
    hbm.write("dS", programs * n_q * n_k)

    hbm.read("dS", programs * n_q * n_k)                      # 4. dQ = dS K * scale
    hbm.read("K", programs * n_k * d)
    dQ = dS @ K * scale
    hbm.write("dQ", programs * n_q * d)

    hbm.read("dS", programs * n_q * n_k)                      # 5. dK = dS^T Q * scale
    hbm.read("Q", programs * n_q * d)
    dK = dS.swapaxes(-1, -2) @ Q * scale
    hbm.write("dK", programs * n_k * d)
    return BackwardResult(dq=to_flash_layout(dQ), dk=sum_over_groups(dK, heads_kv), dv=sum_over_groups(dV, heads_kv),
                          hbm=hbm, blocks=None, flops=matmul_flops(programs, n_q, n_k, d, products=4), dsinks=dsinks)
