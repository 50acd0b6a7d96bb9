"""The papers' HBM-traffic formulas, per head, in elements, and ``explain``. Element sizes and modeled bytes of
a whole call belong to each registry entry (``Variant.hbm_bytes``).

Every ``*_accesses`` function returns the same keys as ``AccessCounter.by_tensor()`` of its NumPy model run on
one (batch, head), plus "total". They are exact for every size, not only when the blocks divide the seqlens:
T_r = ceil(N_q / B_r) and T_c = ceil(N_k / B_c) count the short last block correctly. With ``causal=True``
they give the exact count of the block pairs the kernels visit (pairs wholly above the bottom-right diagonal
are skipped), summed in closed form per Q block.

The papers' asymptotic terms (``standard_attention``, ``kv_reread``, ``flash_ratio``, ``fa1_extra``) take the
on-chip memory M in elements and the paper's block sizes (``paper_blocks``).

The backward's ``*_backward_accesses`` are exact in the same sense against the models' ``backward``;
``backward_flops`` counts their matrix products (the recomputation's price) and ``explain(..., backward=True)``
prints both.
"""
from __future__ import annotations

import inspect
import math

import numpy as np
from tabulate import tabulate

from .reference.common import DEFAULT_SRAM, paper_blocks, resolve_blocks
from .tiles import FA3_BWD_TILES

__all__ = ["standard_attention", "paper_blocks", "kv_reread", "flash_ratio", "fa1_extra", "naive_accesses",
           "fa1_accesses", "fa2_accesses", "standard_backward", "naive_backward_accesses", "fa1_backward_accesses",
           "fa2_backward_accesses", "forward_flops", "backward_flops", "explain", "DEFAULT_SRAM"]


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

def _causal_visits(N_q, N_k, B_r, B_c):
    """Per Q block i, causal: (rows_i, n_i, keys_i). Q block i (last row r_i) visits the K blocks
    j <= floor((r_i + N_k - N_q) / B_c), n_i of them, covering keys_i = min(N_k, n_i B_c) keys."""
    T_r, T_c = math.ceil(N_q / B_r), math.ceil(N_k / B_c)
    starts = np.arange(T_r) * B_r
    rows = np.minimum(starts + B_r, N_q) - starts
    r_last = starts + rows - 1
    n = np.clip((r_last + N_k - N_q) // B_c + 1, 0, T_c)
    return rows, n, np.minimum(N_k, n * B_c)


def _pair_sums(N_q, N_k, B_r, B_c, causal):
    """(sum over visited pairs of Q-block rows, sum over visited pairs of K-block columns).

    Non-causal that is (T_c N_q, T_r N_k); causal, (sum_i rows_i n_i, sum_i keys_i) (``_causal_visits``).
    """
    T_r, T_c = math.ceil(N_q / B_r), math.ceil(N_k / B_c)
    if not causal:
        return T_c * N_q, T_r * N_k
    rows, n, keys = _causal_visits(N_q, N_k, B_r, B_c)
    return int((rows * n).sum()), int(keys.sum())


def _pair_area(N_q, N_k, B_r, B_c, causal):
    """Sum over visited pairs of rows x columns: the score elements a tiled kernel computes per pass.
    N_q N_k non-causal; causal, sum_i rows_i keys_i (the visible triangle plus the diagonal blocks' rest)."""
    if not causal:
        return N_q * N_k
    rows, _, keys = _causal_visits(N_q, N_k, B_r, B_c)
    return int((rows * keys).sum())


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


# ----------------------------------------------------------------------------------------------- backward

def standard_backward(N: int, d: int) -> int:
    """The standard backward's HBM accesses per head (naive's model, N_q = N_k = N): P read twice, dP written
    and read, dS written and read twice (7N^2); Q, K, V, O, dQ, dK, dV once and dO three times (10Nd)."""
    return 7 * N * N + 10 * N * d


def naive_backward_accesses(seqlen_q, seqlen_k, head_dim, block_q=None, block_k=None, causal=False) -> dict:
    """The standard backward per head (reference/naive.py ``backward``): the forward's P read in passes 1 and 3,
    dP written in 2 and read in 3, dS written in 3 and read in 4 and 5; dO read in passes 1, 2, 3. Causal
    masking does not shrink the matrices; blocks are ignored. N_q = N_k = N gives ``standard_backward(N, d)``.

    P 2 N_q N_k; dP 2 N_q N_k; dS 3 N_q N_k; dO 3 N_q d; Q, O, dQ N_q d; K, V, dK, dV N_k d.
    """
    N_q, N_k, d = seqlen_q, seqlen_k, head_dim
    NN = N_q * N_k
    return _with_total({"Q": N_q * d, "K": N_k * d, "V": N_k * d, "O": N_q * d, "P": 2 * NN,
                        "dO": 3 * N_q * d, "dQ": N_q * d, "dK": N_k * d, "dV": N_k * d, "dP": 2 * NN, "dS": 3 * NN})


def fa1_backward_accesses(seqlen_q, seqlen_k, head_dim, block_q=None, block_k=None, causal=False) -> dict:
    """FA1's backward (Algorithm 4) per head, counting line 5's initial writes of dQ, dK, dV. Exact, causal
    included. With R = the Q rows loaded over the visited (i, j) steps (T_c N_q non-causal):

    Q, O, dO R d each; l, m R each (read as Algorithm 4 does; the model takes m = LSE, l = 1); K, V N_k d each;
    dQ N_q d + 2 R d (zeroed, then read and written at every step); dK, dV 2 N_k d each (zeroed, written once).
    """
    N_q, N_k, d = seqlen_q, seqlen_k, head_dim
    B_r, B_c = resolve_blocks(d, block_q, block_k)
    R, _ = _pair_sums(N_q, N_k, B_r, B_c, causal)
    return _with_total({"Q": R * d, "K": N_k * d, "V": N_k * d, "O": R * d, "l": R, "m": R, "dO": R * d,
                        "dQ": N_q * d + 2 * R * d, "dK": 2 * N_k * d, "dV": 2 * N_k * d})


def fa2_backward_accesses(seqlen_q, seqlen_k, head_dim, block_q=None, block_k=None, causal=False,
                          dq_mode="separate") -> dict:
    """FA2's backward (Algorithm 2) per head. Exact, causal included. With R = the Q rows and C = the K columns
    loaded over the visited (i, j) pairs (T_c N_q and T_r N_k non-causal):

    both modes: O N_q d (preprocessing); dK, dV N_k d each (written once); the dK/dV kernel reads K, V N_k d each
      and Q, dO R d, LSE, D R each.
    "separate" adds the dQ kernel: Q, dO, LSE, D N_q (d) once more, K, V C d each; D and dQ written once:
      Q N_q d + R d; K, V N_k d + C d; dO 2 N_q d + R d; LSE N_q + R; D 2 N_q + R; dQ N_q d.
    "atomic": dQ zeroed, then read and written at every step: Q R d; K, V N_k d; dO N_q d + R d; LSE R;
      D N_q + R; dQ N_q d + 2 R d.
    """
    if dq_mode not in ("separate", "atomic"):
        raise ValueError(f"dq_mode must be one of ('separate', 'atomic'), got {dq_mode!r}")
    N_q, N_k, d = seqlen_q, seqlen_k, head_dim
    B_r, B_c = resolve_blocks(d, block_q, block_k)
    R, C = _pair_sums(N_q, N_k, B_r, B_c, causal)
    if dq_mode == "separate":
        counts = {"Q": N_q * d + R * d, "K": N_k * d + C * d, "V": N_k * d + C * d, "O": N_q * d,
                  "LSE": N_q + R, "dO": 2 * N_q * d + R * d, "dQ": N_q * d, "D": 2 * N_q + R}
    else:
        counts = {"Q": R * d, "K": N_k * d, "V": N_k * d, "O": N_q * d, "LSE": R, "dO": N_q * d + R * d,
                  "dQ": N_q * d + 2 * R * d, "D": N_q + R}
    return _with_total({**counts, "dK": N_k * d, "dV": N_k * d})


#: Matrix products per visited (Q block, K block) pair, 2 B_r B_c d FLOPs each. The forward has 2 (S = Q K^T,
#: P V); the standard backward 4 (P^T dO, dO V^T, dS K, dS^T Q); recomputing S instead of reading P adds 1;
#: FA2's separate dQ pass recomputes S and dP once more and moves dS K there: 4 + 3.
#: FA3's backward accumulates dQ across the K/V-block programs, as fa2's "atomic" mode (above d 128 it is fa2's).
BACKWARD_PRODUCTS = {"naive": 4, "fa1": 5, ("fa2", "separate"): 7, ("fa2", "atomic"): 5, "fa3": 5}


def forward_flops(seqlen_q, seqlen_k, head_dim) -> int:
    """The forward's matmul FLOPs per head, non-causal: S = Q K^T and P V, 2 N_q N_k d each."""
    return 4 * seqlen_q * seqlen_k * head_dim


def backward_flops(variant, seqlen_q, seqlen_k, head_dim, block_q=None, block_k=None, causal=False,
                   dq_mode="separate") -> int:
    """Matmul FLOPs per head of ``variant``'s backward model ("naive", "fa1", "fa2" or "fa3"), as its ``flops`` counts:
    ``BACKWARD_PRODUCTS`` x 2 d x the score elements of the visited block pairs (``_pair_area``; naive works on
    the whole N_q x N_k matrices, causal or not). Non-causal: naive 8 N_q N_k d (2x the forward), fa1 and fa2
    "atomic" 10 N_q N_k d (2.5x), fa2 "separate" 14 N_q N_k d (3.5x)."""
    N_q, N_k, d = seqlen_q, seqlen_k, head_dim
    if variant == "naive":
        return 2 * BACKWARD_PRODUCTS["naive"] * N_q * N_k * d
    key = (variant, dq_mode) if variant == "fa2" else variant
    if variant == "fa3" and d > max(FA3_BWD_TILES):
        key = ("fa2", "separate")
    if key not in BACKWARD_PRODUCTS:
        raise ValueError(f"variant must be 'naive', 'fa1', 'fa2' (dq_mode 'separate' or 'atomic') or 'fa3', "
                         f"got {variant!r}, dq_mode={dq_mode!r}")
    B_r, B_c = resolve_blocks(d, block_q, block_k)
    return 2 * BACKWARD_PRODUCTS[key] * _pair_area(N_q, N_k, B_r, B_c, causal) * d


# ----------------------------------------------------------------------------------------------- bytes, explain

_NAIVE_MAX_N = 8192


def explain(entry, N, d, M=DEFAULT_SRAM, blocks=None, backward=False) -> str:
    """A registry entry's loop structure, then its per-head HBM traffic: formula vs counted by its NumPy model
    (run once on random N(0,1) data of size N x d, non-causal) with ``blocks`` = (B_r, B_c), by default the
    paper's blocks for M. ``backward=True``: the same for its backward model, plus the recomputation's trade
    (matmul FLOPs against the forward's and the standard backward's, HBM against naive's N^2 terms)."""
    if backward:
        return _explain_backward(entry, N, d, M, blocks)
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
    pipeline = [entry.pipeline, ""] if getattr(entry, "pipeline", None) else []
    lines = [f"{variant_name}: N={N}, d={d}, M={M} elements{tiling}", entry.loops, "", *pipeline,
             "HBM accesses per head (elements):",
             tabulate(rows, headers=("tensor", "formula", "counted"), colalign=("left", "right", "right")), "",
             f"standard attention 4N^2+4Nd = {std:,}; this variant moves {formula['total'] / std:.3g}x that"]
    B = M / (4 * d)
    if variant_name.startswith(("fa2", "fa3")):   # FA3 moves FA2's bytes: the same K/V re-read line
        lines.append(f"paper: K/V re-reads 8N^2d^2/M = {kv_reread(N, d, M):,.0f} (with B_r = M/4d = {B:g}; "
                     f"here B_r = {B_r}); standard/flash -> M/2d^2 = {flash_ratio(d, M):.3g}")
    elif variant_name == "fa1":
        lines.append(f"paper: FA1 - FA2 with square blocks B = {B_c}: fa1_extra = (T+1)Nd + (4T+1)N = "
                     f"{fa1_extra(N, d, M):,} (~ 4N^2d(d+4)/M = {4 * N * N * d * (d + 4) / M:,.0f})")
    return "\n".join(lines)


def _table(formula: dict, counted: dict) -> str:
    rows = [(t, f"{formula[t]:,}", counted.get(t, "0")) for t in formula]
    return tabulate(rows, headers=("tensor", "formula", "counted"), colalign=("left", "right", "right"))


def _explain_backward(entry, N, d, M, blocks) -> str:
    name, accesses, model = entry.name, entry.io_model_backward, entry.reference_backward
    if model is None or accesses is None:
        raise ValueError(f"{name} has no backward model (reference_backward / io_model_backward are None)")
    B_r, B_c = blocks if blocks is not None else paper_blocks(M, d)
    formula = accesses(N, N, d, B_r, B_c)
    flops = backward_flops(name, N, N, d, B_r, B_c)
    if name == "naive" and N > _NAIVE_MAX_N:   # the model would hold several N^2 float64 matrices
        counted, flops_counted = {t: "not run" for t in formula}, "not run"
    else:
        rng = np.random.default_rng()
        q, k, v, dout = (rng.standard_normal((1, N, 1, d)) for _ in range(4))
        fwd = entry.reference(q, k, v, block_q=B_r, block_k=B_c)
        res = model(dout, q, k, v, fwd.out, fwd.lse, block_q=B_r, block_k=B_c)
        by = res.hbm.by_tensor()
        counted = {t: f"{n:,}" for t, n in {**by, "total": sum(by.values())}.items()}
        flops_counted = f"{res.flops:,}"

    tiling = "" if name == "naive" else \
        f", B_r={B_r}, B_c={B_c}, T_r={math.ceil(N / B_r)}, T_c={math.ceil(N / B_c)}"
    std = standard_backward(N, d)
    once = 8 * N * d   # Q, K, V, O, dO read once and dQ, dK, dV written once: what no backward avoids
    fwd_flops = forward_flops(N, N, d)
    lines = [f"{name} backward: N={N}, d={d}, M={M} elements{tiling}", inspect.getmodule(model).LOOPS_BACKWARD,
             "", "HBM accesses per head (elements):", _table(formula, counted), "",
             f"standard backward 7N^2+10Nd = {std:,}; this backward moves {formula['total'] / std:.3g}x that",
             f"HBM beyond reading Q, K, V, O, dO and writing dQ, dK, dV once (8Nd = {once:,}): naive's N^2 "
             f"matrices P, dP, dS (7N^2) and dO re-reads (2Nd) = {std - once:,}; this backward "
             f"{formula['total'] - once:,}" + (f" ({(formula['total'] - once) / (std - once):.3g}x naive's)"
                                              if name != "naive" else ""),
             f"matmul FLOPs per head: forward 4N^2d = {fwd_flops:,}; standard backward 8N^2d = {2 * fwd_flops:,} "
             f"(2x); this backward {flops:,} formula, {flops_counted} counted = {flops / fwd_flops:.3g}x the forward"]
    # The flash backwards' N^2 coefficients (large N, non-causal): the re-reads that replace naive's 7N^2.
    # Below 7 only with blocks of about d or more: at d = 128 and the paper's 64 x 64 blocks all exceed it.
    if name == "fa1":
        c = (5 * d + 2) / B_c
        lines.append(f"recompute trade: S = QK^T recomputed per (i, j) instead of reading P (+2N^2d FLOPs, 2.5x the "
                     f"forward) removes naive's 7N^2; the K/V-outer loop instead loads Q, O, dO, l, m and "
                     f"read-modify-writes dQ at every (i, j): (5d + 2) T_c N = "
                     f"{(5 * d + 2) * math.ceil(N / B_c) * N:,}, ~ (5d+2)/B_c N^2 = {c:.3g} N^2 against naive's 7N^2")
    elif name == "fa2":
        atomic = fa2_backward_accesses(N, N, d, B_r, B_c, dq_mode="atomic")
        a_flops = backward_flops(name, N, N, d, B_r, B_c, dq_mode="atomic")
        c, c_atomic = (2 * d + 2) / B_c + 2 * d / B_r, (4 * d + 2) / B_c
        lines += [f"recompute trade: S = QK^T recomputed instead of reading P removes naive's 7N^2; the re-reads "
                  f"(Q, dO, LSE, D per K/V block, K, V per Q block in the dQ pass) cost ~ ((2d+2)/B_c + 2d/B_r) N^2 = "
                  f"{c:.3g} N^2 against naive's 7N^2. The separate dQ pass recomputes S and dP once more (+4N^2d: "
                  f"{flops / fwd_flops:.3g}x the forward, against 2.5x with atomic adds) and re-reads K, V per Q "
                  f"block (2d T_r N = {2 * d * math.ceil(N / B_r) * N:,}), so that dQ is written once, "
                  f"deterministically",
                  f"dq_mode=\"atomic\" (flash-attn's: dQ_i read-modify-written in fp32 per (i, j); fa2's Hopper "
                  f"kernel at d 64 and 128 makes the same dQ accesses, its adds in a fixed order by a writer warpgroup, "
                  f"so still deterministic): total "
                  f"{atomic['total']:,} (dQ {atomic['dQ']:,} vs {formula['dQ']:,}, K+V {atomic['K'] + atomic['V']:,} "
                  f"vs {formula['K'] + formula['V']:,}; ~ (4d+2)/B_c N^2 = {c_atomic:.3g} N^2), matmul FLOPs "
                  f"{a_flops:,} = {a_flops / fwd_flops:.3g}x the forward"]
    elif name == "fa3" and d <= max(FA3_BWD_TILES):
        c = (4 * d + 2) / B_c
        lines.append(f"recompute trade: FA2's backward with dQ accumulated across the K/V-block CTAs (fa2's "
                     f"dq_mode=\"atomic\"): S and dP computed once per (i, j), 5 products ({flops / fwd_flops:.3g}x "
                     f"the forward, against 3.5x for fa2's separate dQ pass), at the price of dQ_i's fp32 "
                     f"read-modify-write per (i, j), ~ (4d+2)/B_c N^2 = {c:.3g} N^2 of re-reads against naive's 7N^2; "
                     f"on the GPU those adds are bulk reduce-adds in L2, in a fixed order (deterministic)")
    return "\n".join(lines)
