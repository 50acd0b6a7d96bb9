"""The papers' HBM-traffic formulas, per head, in elements, and ``explain``. Element sizes and modeled bytes of
a whole call belong to each registry entry (``Variant.hbm_bytes``).

Every ``*_accesses`` function returns the same keys as ``AccessCounter.by_tensor()`` of its NumPy model run on
one (batch, head), plus "total". They are exact for every size, not only when the blocks divide the seqlens:
T_r = ceil(N_q / B_r) and T_c = ceil(N_k / B_c) count the short last block correctly. With ``causal=True``
they give the exact count of the block pairs the kernels visit (pairs wholly above the bottom-right diagonal
are skipped), summed in closed form per Q block.

The papers' asymptotic terms (``standard_attention``, ``kv_reread``, ``flash_ratio``, ``fa1_extra``) take the
on-chip memory M in elements and the paper's block sizes (``paper_blocks``).
"""
from __future__ import annotations

import math

import numpy as np
from tabulate import tabulate

from .reference.common import DEFAULT_SRAM, paper_blocks, resolve_blocks

__all__ = ["standard_attention", "paper_blocks", "kv_reread", "flash_ratio", "fa1_extra", "naive_accesses",
           "fa1_accesses", "fa2_accesses", "explain", "DEFAULT_SRAM"]


# ----------------------------------------------------------------------------------------------- paper terms

def standard_attention(N: int, d: int) -> int:
    """Standard attention's HBM accesses per head: Q, K, V read and O written (4Nd), S and P each written
    and read once (4N^2)."""
    return 4 * N * N + 4 * N * d


def kv_reread(N: int, d: int, M: int) -> float:
    """FA2's dominant term: K and V re-read once per Q block, 2 N d T_r with T_r = N / B_r, B_r = M / 4d."""
    return 8 * N * N * d * d / M


def flash_ratio(d: int, M: int) -> float:
    """standard / flash at large N: 4 N^2 / (8 N^2 d^2 / M) = M / 2d^2 (11.7 for M = 96000, d = 64)."""
    return M / (2 * d * d)


def fa1_extra(N: int, d: int, M: int) -> int:
    """FA1 total - FA2 total for N x N attention, non-causal, both with square blocks B = ceil(M / 4d).

    With T = ceil(N / B) passes, FA1 re-reads Q and round-trips O, l, m on each pass while FA2 instead
    re-reads K and V: Q (T-1)Nd + O 2TNd + l, m 2N(1 + 2T) - LSE N - K, V 2(T-1)Nd = (T+1)Nd + (4T+1)N
    ~= 4 N^2 d (d + 4) / M. Exact when B divides N.
    """
    _, B = paper_blocks(M, d)
    T = math.ceil(N / B)
    return (T + 1) * N * d + (4 * T + 1) * N


# ----------------------------------------------------------------------------------------------- exact counts

def _pair_sums(N_q, N_k, B_r, B_c, causal):
    """(sum over visited pairs of Q-block rows, sum over visited pairs of K-block columns).

    Non-causal that is (T_c N_q, T_r N_k). Causal: Q block i (last row r_i) visits the K blocks
    j <= floor((r_i + N_k - N_q) / B_c), n_i of them, covering min(N_k, n_i B_c) keys.
    """
    T_r, T_c = math.ceil(N_q / B_r), math.ceil(N_k / B_c)
    if not causal:
        return T_c * N_q, T_r * N_k
    starts = np.arange(T_r) * B_r
    rows = np.minimum(starts + B_r, N_q) - starts
    r_last = starts + rows - 1
    n = np.clip((r_last + N_k - N_q) // B_c + 1, 0, T_c)
    return int((rows * n).sum()), int(np.minimum(N_k, n * B_c).sum())


def _with_total(counts: dict) -> dict:
    counts = {t: int(c) for t, c in counts.items()}
    counts["total"] = sum(counts.values())
    return counts


def naive_accesses(seqlen_q, seqlen_k, head_dim, block_q=None, block_k=None, causal=False) -> dict:
    """Standard attention per head: S and P (N_q x N_k) each written once and read once; causal masking
    does not shrink them. Blocks are ignored. N_q = N_k = N gives ``standard_attention(N, d)``."""
    N_q, N_k, d = seqlen_q, seqlen_k, head_dim
    return _with_total({"Q": N_q * d, "K": N_k * d, "V": N_k * d, "O": N_q * d,
                        "S": 2 * N_q * N_k, "P": 2 * N_q * N_k})


def fa1_accesses(seqlen_q, seqlen_k, head_dim, block_q=None, block_k=None, causal=False) -> dict:
    """FA1 (Algorithm 1) per head, counting line 2's initial writes of O, l, m. Exact, causal included.

    Non-causal: Q T_c N_q d; K, V N_k d; O N_q d + 2 T_c N_q d; l, m N_q + 2 T_c N_q each.
    """
    N_q, N_k, d = seqlen_q, seqlen_k, head_dim
    B_r, B_c = resolve_blocks(d, block_q, block_k)
    q_rows, _ = _pair_sums(N_q, N_k, B_r, B_c, causal)   # Q_i rows loaded over all visited (i, j) steps
    return _with_total({"Q": q_rows * d, "K": N_k * d, "V": N_k * d, "O": N_q * d + 2 * q_rows * d,
                        "l": N_q + 2 * q_rows, "m": N_q + 2 * q_rows})


def fa2_accesses(seqlen_q, seqlen_k, head_dim, block_q=None, block_k=None, causal=False) -> dict:
    """FA2 per head: Q read and O, LSE written once; K, V read once per Q block. Exact, causal included.

    Non-causal: Q N_q d; K, V T_r N_k d each; O N_q d; LSE N_q.
    """
    N_q, N_k, d = seqlen_q, seqlen_k, head_dim
    B_r, B_c = resolve_blocks(d, block_q, block_k)
    _, k_cols = _pair_sums(N_q, N_k, B_r, B_c, causal)   # K_j columns loaded over all visited (i, j) steps
    return _with_total({"Q": N_q * d, "K": k_cols * d, "V": k_cols * d, "O": N_q * d, "LSE": N_q})


# ----------------------------------------------------------------------------------------------- bytes, explain

_NAIVE_MAX_N = 8192


def explain(entry, N, d, M=DEFAULT_SRAM, blocks=None) -> str:
    """A registry entry's loop structure, then its per-head HBM traffic: formula vs counted by its NumPy model
    (run once on random N(0,1) data of size N x d, non-causal) with ``blocks`` = (B_r, B_c), by default the
    paper's blocks for M."""
    variant_name, accesses = entry.name, entry.io_model
    B_r, B_c = blocks if blocks is not None else paper_blocks(M, d)
    formula = accesses(N, N, d, B_r, B_c)
    if variant_name == "naive" and N > _NAIVE_MAX_N:   # the model would hold N^2 float64 scores
        counted = {t: "not run" for t in formula}
    else:
        rng = np.random.default_rng()
        q, k, v = (rng.standard_normal((1, N, 1, d)) for _ in range(3))
        by = entry.reference(q, k, v, block_q=B_r, block_k=B_c).hbm.by_tensor()
        counted = {t: f"{n:,}" for t, n in {**by, "total": sum(by.values())}.items()}
    rows = [(t, f"{formula[t]:,}", counted.get(t, "0")) for t in formula]

    tiling = "" if variant_name == "naive" else \
        f", B_r={B_r}, B_c={B_c}, T_r={math.ceil(N / B_r)}, T_c={math.ceil(N / B_c)}"
    std = standard_attention(N, d)
    lines = [f"{variant_name}: N={N}, d={d}, M={M} elements{tiling}", entry.loops, "",
             "HBM accesses per head (elements):",
             tabulate(rows, headers=("tensor", "formula", "counted"), colalign=("left", "right", "right")), "",
             f"standard attention 4N^2+4Nd = {std:,}; this variant moves {formula['total'] / std:.3g}x that"]
    B = M / (4 * d)
    if variant_name.startswith("fa2"):
        lines.append(f"paper: K/V re-reads 8N^2d^2/M = {kv_reread(N, d, M):,.0f} (with B_r = M/4d = {B:g}; "
                     f"here B_r = {B_r}); standard/flash -> M/2d^2 = {flash_ratio(d, M):.3g}")
    elif variant_name == "fa1":
        lines.append(f"paper: FA1 - FA2 with square blocks B = {B_c}: fa1_extra = (T+1)Nd + (4T+1)N = "
                     f"{fa1_extra(N, d, M):,} (~ 4N^2d(d+4)/M = {4 * N * N * d * (d + 4) / M:,.0f})")
    return "\n".join(lines)
