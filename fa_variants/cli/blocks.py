"""The one block-size choice of ``compare``, ``explain`` and ``profile`` for the IO model (and the NumPy models):
each kernel's tiles (default), the paper's blocks for an on-chip memory of ``sram`` elements, or given blocks."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Iterable

from .. import gpu
from ..reference.common import DEFAULT_SRAM, paper_blocks
from ..registry import Variant

# What a table cell adds to the blocks to say where they come from.
SOURCE_TAG = {"kernel": "", "untiled": "", "paper": " (paper)", "given": " (--blocks)",
              "fallback": " (paper: no kernel tiles)"}


def untiled(entry: Variant, head_dim: int) -> bool:
    """Whether ``entry`` does not tile at ``head_dim`` (naive: its launcher's tiles are (None, None))."""
    try:
        return tuple(entry.launcher.tiles(head_dim)) == (None, None)
    except Exception:  # noqa: BLE001
        return False


def _where() -> str:
    return "this GPU" if gpu.available() else "an H200 (no GPU here)"


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Each kernel's tiles (``mode`` "kernel", the default), the paper's blocks for ``sram`` elements ("paper"), or
    ``given`` blocks for every tiled variant ("given")."""
    mode: str = "kernel"                      # "kernel" | "paper" | "given"
    sram: int = DEFAULT_SRAM
    given: tuple[int, int] | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Blocks":
        if getattr(args, "blocks", None):
            return cls("given", args.sram, tuple(args.blocks))
        return cls("paper" if getattr(args, "paper_blocks", False) else "kernel", args.sram)

    def for_backward(self) -> "Blocks":
        """The choice for a backward: the launchers report their forward kernels' tiles only, so "kernel" becomes
        the paper's blocks (``backward_tiles_note`` says why, variant by variant)."""
        return dataclasses.replace(self, mode="paper") if self.mode == "kernel" else self

    def pick(self, entry: Variant, head_dim: int, causal: bool = False) -> tuple[tuple[int | None, int | None], str]:
        """((B_r, B_c), source) for ``entry`` at ``head_dim`` (and mask): source is "kernel", "paper", "given", "fallback"
        (the paper's, because the launcher has no tiles at this head dim) or "untiled" (blocks (None, None))."""
        if untiled(entry, head_dim):
            return (None, None), "untiled"
        if self.mode == "given":
            return self.given, "given"
        if self.mode == "paper":
            return paper_blocks(self.sram, head_dim), "paper"
        try:
            b_r, b_c = entry.launcher.tiles(head_dim, causal)
        except Exception:  # noqa: BLE001 - a head dim the launcher has no tiles for: the paper's, said so
            return paper_blocks(self.sram, head_dim), "fallback"
        return (int(b_r), int(b_c)), "kernel"

    def source_text(self, source: str, entry: Variant, head_dim: int) -> str:
        """Where ``pick``'s blocks come from, in words."""
        return {
            "kernel": f"{entry.name}'s kernel tiles at d={head_dim}, as its launcher picks them on {_where()}",
            "paper": f"the paper's blocks for M={self.sram} elements (B_c = ceil(M/4d), B_r = min(B_c, d))",
            "given": "given by --blocks",
            "fallback": f"the paper's blocks for M={self.sram} elements: {entry.name}'s launcher has no tiles "
                        f"at d={head_dim}",
            "untiled": f"none: {entry.name} does not tile",
        }[source]

    def describe(self) -> str:
        """The choice for every variant, in words (the notes under compare's and profile's tables)."""
        if self.mode == "given":
            return f"B_r x B_c = {self.given[0]}x{self.given[1]} for every tiled variant (--blocks)"
        if self.mode == "paper":
            return (f"the paper's blocks for M = {self.sram} elements: B_c = ceil(M/4d), B_r = min(B_c, d) "
                    f"(--paper-blocks)")
        return (f"each kernel's tiles, as its launcher picks them on {_where()} (the paper's blocks where a "
                f"launcher has none); --paper-blocks (with --sram) or --blocks BRxBC for others")


def backward_tiles_note(entries: Iterable[Variant]) -> str:
    """Why a backward's IO model takes the paper's blocks rather than kernel tiles, from the registry's directions:
    a variant with a GPU backward runs kernels whose tiles its launcher does not report (``tiles()`` gives the
    forward kernel's); one without has no kernel to take tiles from."""
    entries = list(entries)
    having = [e.name for e in entries if "backward" in e.directions]
    lacking = [e.name for e in entries if "backward" not in e.directions]
    parts = []
    if having:
        parts.append(f"{having[0]}'s GPU backward kernels pick their own tiles, which its launcher does not report"
                     if len(having) == 1 else f"the GPU backward kernels of {_and(having)} pick their own tiles, "
                     f"which the launchers do not report")
    if lacking:
        parts.append(f"{_and(lacking)} {'has' if len(lacking) == 1 else 'have'} no GPU backward kernel")
    return "; ".join(parts)


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
