"""The flags the commands share, and their types: positive integers, BRxBC blocks, --variants, the shape flags of
compare and profile, the block flags of compare, explain and profile; and the parser that reports a bad flag in
one line."""
from __future__ import annotations

import argparse

from ..reference.common import DEFAULT_SRAM
from ..registry import VARIANTS, Variant, get, variants

# One default shape, with and without a GPU (what `fa-variants compare` means does not depend on the machine).
SHAPE_DEFAULTS = dict(batch=4, heads=16, seqlen=4096, head_dim=128)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: 'fa-variants explain: error: argument --sram: must be >= 1, got 0'."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_at_least(minimum: int):
    """An argparse type: an integer of at least ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    parse.__name__ = f"int>={minimum}"
    return parse


positive = int_at_least(1)
non_negative = int_at_least(0)


def blocks_arg(text: str) -> tuple[int, int]:
    """'128x64' (or 128,64) -> (128, 64)."""
    parts = text.lower().replace(",", "x").split("x")
    try:
        b_r, b_c = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BRxBC such as 128x64, got {text!r}") from None
    if b_r < 1 or b_c < 1:
        raise argparse.ArgumentTypeError(f"block sizes must be >= 1, got {text!r}")
    return b_r, b_c


def parse_variants(text: str | None, command: str = "compare") -> list[Variant]:
    """--variants: the registry entries named (comma-separated), every one when empty; an unknown name ends the
    command in one line."""
    if not text:
        return list(variants())
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise SystemExit(f"fa-variants {command}: unknown variant(s) {unknown or [text]}; choose from {sorted(VARIANTS)}")
    return [get(n) for n in names]


def add_block_args(p: argparse.ArgumentParser, sram_help: str) -> None:
    """--paper-blocks | --blocks BRxBC, and --sram: the IO model's blocks (``blocks.Blocks.from_args``)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--paper-blocks", action="store_true",
                   help="the IO model with the paper's blocks for --sram instead of each kernel's tiles")
    g.add_argument("--blocks", type=blocks_arg, metavar="BRxBC",
                   help="the IO model with these blocks (e.g. 128x64) instead of each kernel's tiles")
    p.add_argument("--sram", type=positive, default=DEFAULT_SRAM, help=sram_help + " (default %(default)s)")


def add_shape_args(c: argparse.ArgumentParser) -> None:
    """The problem's flags (``shapes.shape_from_args``), --variants, --no-torch, --seed and -v."""
    d = SHAPE_DEFAULTS
    c.add_argument("--batch", type=positive, help=f"default {d['batch']}")
    c.add_argument("--heads", type=positive,
                   help=f"query heads, default {d['heads']} (or the smallest multiple of --heads-kv >= {d['heads']})")
    c.add_argument("--heads-kv", type=positive, help="K/V heads for MQA/GQA (default: = heads)")
    c.add_argument("--seqlen", type=positive, help=f"query length, default {d['seqlen']}")
    c.add_argument("--seqlen-k", type=positive, help="key length (default: = seqlen); causal is bottom-right aligned")
    c.add_argument("--head-dim", type=positive, help=f"default {d['head_dim']}")
    c.add_argument("--dtype", choices=["float16", "bfloat16", "fp8"], default="bfloat16",
                   help="fp8: fa2_fp8 and fa3_fp8 (bf16 inputs quantized to e4m3 on the fly) beside fa2 and fa3 in bf16")
    c.add_argument("--causal", action="store_true")
    c.add_argument("--variants", help=f"comma-separated subset of {','.join(VARIANTS)}")
    c.add_argument("--no-torch", action="store_true", help="skip the torch SDPA rows")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failing variants")
