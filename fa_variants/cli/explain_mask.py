"""``fa-variants explain mask``: how many tiles a forward computes under a mask, against the dense grid.

    fa-variants explain mask --seqlen 32768 --causal --window 4096 0
    fa-variants explain mask --seqlens 128,4096,16384,0,512 --causal        (a packed batch)

The count is reference/masks.py's (``tile_count``): the (Q block, K/V block) pairs whose rows see a key of the
block, as the NumPy models visit them, and how many of those need the elementwise mask. The tiles are fa2's
kernel tiles at --head-dim (or --blocks, or the paper's with --paper-blocks).
"""
from __future__ import annotations

import argparse

from ..reference.masks import check_window, tile_count
from ..registry import get
from .blocks import Blocks

TILED_BY = "fa2"   # whose kernel tiles the count uses by default


def lengths_arg(text: str) -> list[int]:
    """'128,4096,0' -> [128, 4096, 0]: a packed batch's sequence lengths (0 allowed, at least one > 0)."""
    try:
        lengths = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated lengths such as 128,4096,0, got {text!r}") from None
    if not lengths or min(lengths) < 0 or max(lengths) == 0:
        raise argparse.ArgumentTypeError(f"lengths must be >= 0, one of them > 0, got {text!r}")
    return lengths


def add_args(e: argparse.ArgumentParser) -> None:
    """explain's flags for ``explain mask``."""
    e.add_argument("--causal", action="store_true", help="explain mask: bottom-right causal")
    e.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"), default=(-1, -1),
                   help="explain mask: a sliding window, flash-attn's (-1: unbounded), default -1 -1")
    e.add_argument("--seqlens", type=lengths_arg, metavar="N1,N2,...",
                   help="explain mask: a packed batch's sequence lengths instead of one sequence of --seqlen")


def run(args: argparse.Namespace) -> int:
    try:
        window = check_window(tuple(args.window))
    except ValueError as e:
        raise SystemExit(f"fa-variants explain mask: --window: {e}") from None
    lengths = args.seqlens or [args.seqlen]
    (b_r, b_c), source = Blocks.from_args(args).pick(get(TILED_BY), args.head_dim, args.causal)
    t = tile_count(lengths, lengths, b_r, b_c, causal=args.causal, window=window)
    what = ", ".join(([] if not args.causal else ["causal"]) + ([] if window == (-1, -1) else [f"window {window}"]))
    batch = f"{len(lengths)} sequences of {','.join(map(str, lengths))}" if args.seqlens else f"seqlen {lengths[0]}"
    tiles = f"{b_r}x{b_c}" + ("" if source != "kernel" else f" ({TILED_BY}'s kernel tiles at d={args.head_dim})")
    print(f"mask: {what or 'none'} over {batch}; tiles {tiles}")
    print(f"tiles computed: {t.visited:,} of {t.dense:,} dense ({100 * t.fraction:.1f}%; the dense grid is batch x "
          f"ceil(max_seqlen / B_r) x ceil(max_seqlen / B_c)); {t.masked:,} of them with the elementwise mask")
    return 0
