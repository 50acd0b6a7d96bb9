"""Where a packed batch's backward loses against a dense one, without a GPU: fa3's masked backward's walk
(kernels/fa3_bwd.py's masked_shares, the mirror of bwd_dq_writer.cuh's SequenceWalk) on bench/varlen.py's
batches, counted in steps (one (K/V block, Q block) pair of a query head: 128 keys x BM queries).

    python bench/varlen_walk.py [--quick]

Per batch and grid: the steps the busiest CTA runs against the steps of all CTAs spread evenly over the SMs (the
grid's efficiency: the kernel takes as long as the busiest CTA), and the steps the causal products need at exactly
half of each square (the blocks' waste: a diagonal block is computed whole). The kernel's TFLOP/s count the exact
half, so the dense batch's over the packed one's is about their waste times their efficiency times their time per
step. Two grids: the launcher's (kernels/fa3_bwd.py's masked_grid, grouped by walk_columns), and groups of exactly
the longest sequence's K/V blocks (the plain fa3_bwd's grid, which leaves SMs % n_kv SMs idle).
"""
from __future__ import annotations

import argparse

import numpy as np
from tabulate import tabulate

from fa_variants.kernels import fa3_bwd
from fa_variants.tiles import FA3_BWD_TILES

HEADS, D, SMS = 16, 128, 132


def packed_lengths(total: int, seed: int = 0) -> list[int]:
    """bench/varlen.py's documents: lengths drawn from 128 to 16K until they make ``total`` tokens."""
    rng = np.random.default_rng(seed)
    lens: list[int] = []
    while sum(lens) < total:
        lens.append(int(min(total - sum(lens), rng.integers(128, 16385))))
    return lens


def walk(lens: list[int], grid: str) -> dict:
    bm, bn = FA3_BWD_TILES[D].block_q, FA3_BWD_TILES[D].block_k
    n_kv = -(-max(lens) // bn)
    if grid == "launcher's":
        ctas = min(sum(-(-n // bn) for n in lens) * HEADS, SMS)
    else:
        ctas = min(SMS // n_kv, len(lens) * HEADS) * n_kv
    steps = np.array([len(s) for s in fa3_bwd.masked_shares(lens, lens, HEADS, 1, ctas, bm, bn, causal=True)])
    exact = sum(n * n / 2 for n in lens) * HEADS / (bm * bn)
    return dict(ctas=ctas, columns=fa3_bwd.walk_columns(n_kv, ctas), busiest=int(steps.max()),
                efficiency=steps.sum() / SMS / steps.max(), waste=steps.sum() / exact)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    total = 16384 if args.quick else 65536
    lens = packed_lengths(total)
    batches = [(f"packed {len(lens)} docs, {total} tokens", lens), (f"dense {total // 8192} x 8192", [8192] * 8),
               ("dense 2 x 8960", [8960] * 2), ("dense 4 x 12288", [12288] * 4)]
    rows = []
    for name, batch in batches:
        for grid in ("launcher's", "groups of n_kv"):
            r = walk(batch, grid)
            rows.append([name, grid, r["ctas"], r["columns"], r["busiest"], f"{r['efficiency']:.3f}",
                         f"{r['waste']:.3f}"])
    print(f"fa3's masked backward's walk, causal, {HEADS} heads, d {D}, {SMS} SMs; documents {lens}")
    print(tabulate(rows, headers=["batch", "grid", "CTAs", "columns", "busiest CTA's steps", "efficiency",
                                  "blocks' waste"]))


if __name__ == "__main__":
    main()
