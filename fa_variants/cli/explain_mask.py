"""``fa-variants explain mask``: how many tiles a forward computes under a mask, against the dense grid.

    fa-variants explain mask --seqlen 32768 --causal --window 4096 0
    fa-variants explain mask --seqlens 128,4096,16384,0,512 --causal        (a packed batch)

The count is reference/masks.py's (``tile_count``): the (Q block, K/V block) pairs whose rows see a key of the
block, as the NumPy models visit them, and how many of those need the elementwise mask. The tiles are those of the
masked forward a call would run at --head-dim (fa3's on sm_90, fa2's elsewhere: on this GPU, or --device-cc's; as on
an H200 without either), or --blocks, or the paper's with --paper-blocks.
"""
from __future__ import annotations

import argparse

from .. import gpu
from ..reference.common import paper_blocks
from ..reference.masks import check_window, tile_count


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
                   help="explain mask and explain decode: a sliding window, flash-attn's (-1: unbounded), "
                        "default -1 -1")
    e.add_argument("--seqlens", type=lengths_arg, metavar="N1,N2,...",
                   help="explain mask: a packed batch's sequence lengths instead of one sequence of --seqlen")


def run(args: argparse.Namespace) -> int:
    try:
        window = check_window(tuple(args.window))
    except ValueError as e:
        raise SystemExit(f"fa-variants explain mask: --window: {e}") from None
    lengths = args.seqlens or [args.seqlen]
    (b_r, b_c), source = _tiles(args)
    t = tile_count(lengths, lengths, b_r, b_c, causal=args.causal, window=window)
    what = ", ".join(([] if not args.causal else ["causal"]) + ([] if window == (-1, -1) else [f"window {window}"]))
    batch = f"{len(lengths)} sequences of {','.join(map(str, lengths))}" if args.seqlens else f"seqlen {lengths[0]}"
    tiles = f"{b_r}x{b_c}" + (f" ({source})" if source else "")
    print(f"mask: {what or 'none'} over {batch}; tiles {tiles}")
    print(f"tiles computed: {t.visited:,} of {t.dense:,} dense ({100 * t.fraction:.1f}%; the dense grid is batch x "
          f"ceil(max_seqlen / B_r) x ceil(max_seqlen / B_c)); {t.masked:,} of them with the elementwise mask")
    return 0


def _tiles(args: argparse.Namespace) -> tuple[tuple[int, int], str]:
    """((B_r, B_c), where they come from): --blocks, the paper's (--paper-blocks), or the masked forward's tiles."""
    if getattr(args, "blocks", None):
        return tuple(args.blocks), ""
    if getattr(args, "paper_blocks", False):
        return paper_blocks(args.sram, args.head_dim), "the paper's"
    from ..choice import masked_forward
    from ..kernels import fa2_masked, fa3_masked
    from ..kernels.common import SMEM_BY_CC
    cc = args.device_cc if args.device_cc is not None else gpu.compute_capability()
    where = f"sm_{cc}" if cc else "as on an H200, no GPU here"
    if masked_forward(cc or 90) == "fa3":
        return fa3_masked.tiles(args.head_dim), f"fa3's masked kernel tiles at d={args.head_dim}, {where}"
    limit = SMEM_BY_CC.get(cc) if args.device_cc is not None else None
    return fa2_masked.tiles(args.head_dim, limit), f"fa2's masked kernel tiles at d={args.head_dim}, {where}"
