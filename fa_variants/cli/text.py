"""What the commands print besides their tables: progress on stderr, one-line error texts, number cells, the
numbered notes under a table, and a progress bar for long runs."""
from __future__ import annotations

import math
import shutil
import sys
import time
from typing import Sequence

INSTALL_HINT = 'install CuPy with the cuda extra: pip install "fa-variants[cuda12]" (or [cuda13] for a CUDA 13 driver)'


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def err_text(e: BaseException, limit: int = 160) -> str:
    """An exception as one line of at most ``limit`` characters: 'TypeName: message'."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fmt(x, spec: str, missing: str = "") -> str:
    """A table cell: ``x`` formatted by ``spec``, ``missing`` for None and non-finite numbers."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return missing
    return format(x, spec)


def blocks_text(blocks) -> str:
    """(B_r, B_c) -> 'B_rxB_c'; '—' where a variant does not tile."""
    return "—" if blocks is None or blocks[0] is None else f"{blocks[0]}x{blocks[1]}"


def print_notes(notes: Sequence[str]) -> None:
    """The numbered notes under a table: '  [1] ...'."""
    for i, n in enumerate(notes, 1):
        print(f"  [{i}] {n}")


class ProgressBar:
    """Progress over ``total`` steps on stderr: one bar redrawn in place on a terminal, one line per step elsewhere
    (a log keeps every step). ``step(text, keep=True)`` also leaves ``text`` above the bar (a failure)."""

    WIDTH = 24

    def __init__(self, total: int, stream=None):
        self.stream = sys.stderr if stream is None else stream
        self.total, self.done, self.t0 = max(total, 1), 0, time.perf_counter()
        isatty = getattr(self.stream, "isatty", None)
        self.live = bool(isatty and isatty())

    def step(self, text: str, keep: bool = False) -> None:
        self.done += 1
        if not self.live:
            print(f"[{self.done}/{self.total}] {text}", file=self.stream, flush=True)
            return
        if keep:
            self.stream.write("\r" + self._fit(text) + "\n")
        elapsed = time.perf_counter() - self.t0
        left = elapsed / self.done * (self.total - self.done)
        filled = self.WIDTH * self.done // self.total
        self.stream.write("\r" + self._fit(f"[{'#' * filled}{'-' * (self.WIDTH - filled)}] {self.done}/{self.total}"
                                            f"  {elapsed:.0f} s, ~{left:.0f} s left  {text}"))
        self.stream.flush()

    def close(self) -> None:
        if self.live and self.done:
            self.stream.write("\n")
            self.stream.flush()

    @staticmethod
    def _fit(text: str) -> str:
        cols = max(20, shutil.get_terminal_size().columns - 1)
        return text[:cols].ljust(cols)
