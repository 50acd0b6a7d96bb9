"""``fa-variants explain ring``: ring attention (context parallelism, fa_variants/distributed.py) over --world ranks:
each step's attention on the busiest rank against the transfer of the next K/V block, and when the transfer hides;
the bytes each rank sends; and a check of the NumPy ring model against one rank's attention at a small size.

    fa-variants explain ring --seqlen 131072 --world 8 --causal --heads 32 --heads-kv 8 --head-dim 128"""
from __future__ import annotations

import argparse

import numpy as np
from tabulate import tabulate

from ..reference import ring
from ..reference.dense import attention64
from .args import positive

LOOP = """\
ring: rank r keeps its queries; at step s it holds the K/V block of rank r - s, attends its queries to it, merges
the partial (out, LSE) into its running state (the merge of split-KV decoding: e^(LSE_s - LSE) weights), and passes
the block to rank r + 1 while the next step computes. Causal masking in sequence order would give rank 0 almost
nothing to do and the last rank almost everything; zigzag gives rank r chunks r and 2 world - 1 - r of 2 world, so
that every rank computes the same at every step."""


def add_arguments(e: argparse.ArgumentParser) -> None:
    g = e.add_argument_group("explain ring", "context parallelism: --seqlen is the whole sequence")
    g.add_argument("--world", type=positive, default=8, help="explain ring: ranks, default 8")
    g.add_argument("--tflops", type=float, default=500.0, help="explain ring: attention TFLOP/s a rank sustains, "
                   "default 500")
    g.add_argument("--link-gbs", type=float, default=200.0, help="explain ring: GB/s a rank sends to the next, "
                   "default 200")
    g.add_argument("--in-order", action="store_true", help="explain ring: chunks in sequence order, not zigzag")


def run(args: argparse.Namespace) -> int:
    world, n, d = args.world, args.seqlen, args.head_dim
    zigzag = args.causal and not args.in_order
    pieces = 2 * world if zigzag else world
    if n % pieces:
        raise SystemExit(f"fa-variants explain ring: --seqlen {n} must be a multiple of {pieces} for {world} ranks")
    rows, block = ring.step_times(n, world, batch=args.batch, heads=args.heads, heads_kv=args.heads_kv,
                                  head_dim=d, causal=args.causal, zigzag=zigzag, tflops=args.tflops,
                                  link_gbs=args.link_gbs)
    print(f"ring: {world} ranks, seqlen {n} ({n // world} a rank{', zigzag' if zigzag else ''}), batch {args.batch}, "
          f"{args.heads} query heads on {args.heads_kv} KV heads, d {d}, {'causal' if args.causal else 'full'}; "
          f"{args.tflops:g} TFLOP/s a rank, a link of {args.link_gbs:g} GB/s")
    print(LOOP + "\n")
    table = [[s, f"{c:.1f}", f"{t:.1f}", "yes" if t <= c else "no"] for s, c, t in rows]
    print(tabulate(table, headers=["step", "attention µs (busiest rank)", "next block's transfer µs", "hidden"]))
    total_c, total_t = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"\nK/V block {block / 2**20:.1f} MiB; a rank sends {(world - 1) * block / 2**20:.1f} MiB forward and "
          f"{((world - 1) * block + world * 2 * block) / 2**20:.1f} MiB backward (the blocks again, and their "
          f"dK, dV in fp32 on the way home); forward {total_c:.0f} µs of attention, {total_t:.0f} µs of transfer.")
    _check_model()
    return 0


def _check_model() -> None:
    """The NumPy ring at a small size against one rank's attention of the whole sequence."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 48, h, 16)) for h in (4, 2, 2))
    for world, causal in ((4, True), (3, False)):
        res = ring.forward(q, k, v, world, causal=causal, zigzag=causal)
        want, lse = attention64(q, k, v, causal=causal, scale=16 ** -0.5)
        err = np.abs(res.out - want.reshape(1, 4, 48, 16).transpose(0, 2, 1, 3)).max()
        print(f"model check: {world} ranks, {'causal zigzag' if causal else 'full'}: max |ring - one rank| = {err:.1e}")
