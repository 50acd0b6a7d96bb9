"""What a NumPy model costs on this host, said before it hurts.

Memory: the naive model materializes S and P (float64, batch x heads x seqlen_q x seqlen_k each); a call that
would not fit in the host's available memory is refused before anything is allocated (``ModelTooLarge``, naming
the memory it needs), as the GPU path refuses one that would not fit on the device.

Time: the blocked models (fa1, fa2, fp8) run a few NumPy operations per block pair, so at long sequences they take
hours. ``Progress`` counts the block pairs a model visits; once the pairs after the first have run for
``CALIBRATE_SECONDS`` it knows this host's rate, and as soon as the whole run is estimated at more than
``WARN_SECONDS`` it warns (``LongRunWarning``, with the estimate) and draws a progress bar on stderr.
"""
from __future__ import annotations

import os
import sys
import time
import warnings

import numpy as np

WARN_SECONDS = 5.0          # runs estimated longer than this get a warning and a progress bar
CALIBRATE_SECONDS = 1.0     # the run is timed this long (after its first step) before it is judged
REDRAW_SECONDS = 0.5        # the bar's refresh interval (on a terminal; elsewhere one line per tenth)
NAIVE_MATRICES = 3          # N_q x N_k float64 matrices the naive forward holds at once (S, exp(S - m), P)
NAIVE_BACKWARD_MATRICES = 4  # ... and its backward (P, dP, dS and a temporary)


class ModelTooLarge(MemoryError, ValueError):
    """A NumPy model's arrays would not fit in the host's available memory: a MemoryError (what a caller that
    catches running out of memory expects) and a ValueError (a size this call cannot take)."""


class LongRunWarning(UserWarning):
    """A NumPy model will run for a long time on this host."""


def available_memory() -> int | None:
    """Bytes of host memory available to a new allocation (Linux's MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(need: int, what: str, instead: str) -> None:
    """``ModelTooLarge`` when ``need`` bytes exceed the available host memory; ``what`` needs them, ``instead``
    says what to run."""
    have = available_memory()
    if have is not None and need > have:
        raise ModelTooLarge(f"{what} needs about {need / 2**30:.1f} GiB of host memory, and {have / 2**30:.1f} GiB "
                            f"is available; {instead}")


def check_naive(batch: int, heads: int, seqlen_q: int, seqlen_k: int, matrices: int, direction: str) -> None:
    """The naive model's refusal before it materializes its ``matrices`` float64 N_q x N_k matrices per head."""
    need = matrices * 8 * batch * heads * seqlen_q * seqlen_k
    check_memory(need, f"the naive {direction} NumPy model ({matrices} float64 matrices of batch {batch} x heads "
                 f"{heads} x {seqlen_q} x {seqlen_k})", "fa2's model (variant='fa2') needs O(N) memory")


def pairs_visited(seqlen_q: int, seqlen_k: int, block_q: int, block_k: int, causal: bool) -> int:
    """(Q block, K block) pairs a blocked model visits: all of them, or under causal masking those not wholly above
    the bottom-right diagonal (reference.common.block_visited's rule)."""
    t_r, t_c = -(-seqlen_q // block_q), -(-seqlen_k // block_k)
    if not causal:
        return t_r * t_c
    last_rows = np.minimum(np.arange(1, t_r + 1) * block_q, seqlen_q) - 1
    return int(np.clip((last_rows + seqlen_k - seqlen_q) // block_k + 1, 0, t_c).sum())


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Progress:
    """Counts the ``total`` block pairs of one model call (``step()`` after each); warns and shows a bar on
    stderr when the run is estimated at more than WARN_SECONDS; ``close()`` at the end of the run."""

    def __init__(self, what: str, total: int, stream=None):
        self.what, self.total, self.done = what, max(int(total), 1), 0
        self.stream = sys.stderr if stream is None else stream
        self.start = time.perf_counter()
        self.first = None          # (time, pairs) at the end of the first step: the rate is timed from there on,
        #                            leaving out the first step's one-off costs (allocations, caches)
        self.estimate = None       # seconds of the whole run, from the rate so far (once calibrated)
        self.shown = False         # the bar is on
        self.last_draw = self.start
        self.tenth = -1

    def step(self, pairs: int = 1) -> None:
        self.done += pairs
        now = time.perf_counter()
        if self.shown:
            self._draw(now)
            return
        if self.first is None:
            self.first = now, self.done
            return
        t1, n1 = self.first
        if now - t1 < CALIBRATE_SECONDS:
            return
        # the rate so far, re-estimated at each step until the run is judged long
        self.estimate = (now - self.start) + (now - t1) / (self.done - n1) * (self.total - self.done)
        if self.estimate > WARN_SECONDS:
            warnings.warn(f"{self.what} will take about {_duration(self.estimate)} on this host (the rate of its "
                          f"block pairs 2 to {self.done} of {self.total}); the GPU kernels (backend='cuda') run it "
                          f"in a small fraction of that", LongRunWarning, stacklevel=3)
            self.shown = True
            self._draw(now)

    def _draw(self, now: float, final: bool = False) -> None:
        frac = min(self.done / self.total, 1.0)
        tty = getattr(self.stream, "isatty", lambda: False)()
        if tty and not final and now - self.last_draw < REDRAW_SECONDS:
            return
        if not tty and int(frac * 10) == self.tenth and (not final or frac == 1.0):
            return  # elsewhere than a terminal: one line per tenth, the last one once
        self.last_draw, self.tenth = now, int(frac * 10)
        elapsed = now - self.start
        left = elapsed * (1 - frac) / frac if frac > 0 else float("inf")
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        line = f"{self.what}: [{bar}] {100 * frac:5.1f}%  {_duration(elapsed)} elapsed, {_duration(left)} left"
        self.stream.write(("\r" + line) if tty else line + "\n")
        if tty and final:
            self.stream.write("\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar (when there is one) with the run's final state."""
        if self.shown:
            self._draw(time.perf_counter(), final=True)
