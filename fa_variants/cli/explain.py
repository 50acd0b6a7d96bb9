"""``fa-variants explain <variant>``: a variant's loop order and HBM traffic, the paper's formula beside its NumPy
model's count (``iomodel.explain``), forward or backward; for fa3, the pipeline and the measured ablation."""
from __future__ import annotations

import argparse
import math
from typing import Callable

from .. import iomodel
from ..registry import VARIANTS, Variant, get, variants
from . import explain_mask
from . import explain_decode
from . import explain_ring
from .args import add_block_args, positive
from .blocks import Blocks, backward_tiles_note

# explain runs the NumPy model once; more (B_r x B_c) block pairs than this would take minutes in Python loops
EXPLAIN_MAX_BLOCK_PAIRS = 1 << 18



def explain_auto(args: argparse.Namespace) -> int:
    """What variant="auto" runs here, forward and backward, for --dtype and --head-dim, and why."""
    from ..dispatch import explain_choice
    print(explain_choice(dtype=args.dtype, head_dim=args.head_dim, device_cc=args.device_cc))
    return 0


# What explain takes besides a variant's name: a target name -> its command (parsed flags -> exit status).
OTHER_TARGETS: dict[str, Callable[[argparse.Namespace], int]] = {"auto": explain_auto, "decode": explain_decode.run}
OTHER_TARGETS["mask"] = explain_mask.run   # the tiles a mask computes (--causal, --window, --seqlens)
OTHER_TARGETS["ring"] = explain_ring.run   # context parallelism: a step's compute against its transfer


def add_parser(sub) -> None:
    e = sub.add_parser("explain", help="a variant's loop order and HBM traffic: paper formula vs the NumPy "
                       "model's count")
    e.add_argument("variant", choices=[*VARIANTS, *OTHER_TARGETS])
    e.add_argument("--seqlen", type=positive, default=1024, help="N, default 1024 (the model runs once at this size)")
    e.add_argument("--head-dim", type=positive, default=64, help="d, default 64")
    e.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16",
                   help="explain auto: the inputs' dtype, default bfloat16")
    e.add_argument("--device-cc", type=positive, default=None, metavar="CC",
                   help="explain auto: a device's compute capability (80 for an A100, 90 for an H100) instead of this one's")
    add_block_args(e, "on-chip memory M in elements: the paper's terms, and the blocks of --paper-blocks")
    e.add_argument("--backward", action="store_true",
                   help="the backward with recomputation instead (naive, fa1, fa2, fa3): its loops, its HBM traffic "
                   "formula vs the NumPy model's count, and the FLOPs it pays for the HBM it saves (the "
                   "paper's blocks unless --blocks: the launchers report their forward kernels' tiles only)")
    e.add_argument("--measured", metavar="FILE", help="the FA3 ablation measured by `bench/ablation.py --json FILE`: "
                   "its rows and what each lever buys (fa3 prints the run shipped with the package without it)")
    explain_mask.add_args(e)
    explain_decode.add_arguments(e)
    explain_ring.add_arguments(e)
    e.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.variant in OTHER_TARGETS:
        return OTHER_TARGETS[args.variant](args)
    return explain_variant(args, get(args.variant))


def explain_variant(args: argparse.Namespace, entry: Variant) -> int:
    n, d = args.seqlen, args.head_dim
    if d not in entry.head_dims:
        raise SystemExit(f"fa-variants explain: {entry.name} takes head_dim {entry.head_dims_text}, got {d}")
    if args.backward and entry.reference_backward is None:
        having = [v.name for v in variants() if v.reference_backward is not None]
        raise SystemExit(f"fa-variants explain: {entry.name} has no backward model (--backward: {', '.join(having)})")
    blocks = Blocks.from_args(args)
    if args.backward:
        blocks = blocks.for_backward()
    (b_r, b_c), source = blocks.pick(entry, d)
    if b_r is not None and math.ceil(n / b_r) * math.ceil(n / b_c) > EXPLAIN_MAX_BLOCK_PAIRS:
        raise SystemExit(f"fa-variants explain: blocks {b_r}x{b_c} at N={n} make {math.ceil(n / b_r) * math.ceil(n / b_c):,} "
                         f"block pairs, too many for the NumPy model (at most {EXPLAIN_MAX_BLOCK_PAIRS:,}); "
                         f"use larger blocks or a smaller --seqlen")
    text = iomodel.explain(entry, n, d, args.sram, blocks=(b_r, b_c), backward=args.backward)
    head, _, rest = text.partition("\n")
    print(f"{head}\n{_blocks_line(args, entry, blocks, (b_r, b_c), source)}\n{rest}")
    if args.measured or (entry.name == "fa3" and not args.backward):
        print("\n" + _measured_ablation(args.measured))
    return 0


def _blocks_line(args: argparse.Namespace, entry: Variant, blocks: Blocks, used, source: str) -> str:
    """The second line: which blocks the model ran with, where they come from, and how to ask for others."""
    if used[0] is None:
        what = "P, dP and dS" if args.backward else "S and P"
        return f"(no tiling: {entry.name} materializes {what}; blocks play no part)"
    others = "; --paper-blocks [--sram M] or --blocks BRxBC for others" if source == "kernel" else ""
    if args.backward and not args.paper_blocks and source == "paper":   # the default of a backward: say why
        others = f"; {backward_tiles_note([entry])}, so no kernel tiles; --sram M or --blocks BRxBC for others"
    return f"(blocks {used[0]}x{used[1]}: {blocks.source_text(source, entry, args.head_dim)}{others})"


def _measured_ablation(path: str | None) -> str:
    """The FA3 ablation's measured rows and levers: a run's `bench/ablation.py --json` file, or the shipped one."""
    from .. import ablation
    try:
        data = ablation.load(path)
    except ValueError as e:
        raise SystemExit(f"fa-variants explain: --measured: {e}") from None
    if path:
        return ablation.text(data, path)
    return ablation.text(data, "the run shipped in fa_variants/measured/; on your card: python3 bench/ablation.py "
                               "--json f && fa-variants explain fa3 --measured f")
