"""CUDA-event timing: how fa-variants measures the time of a call (``fa-variants compare`` and ``bench/``).

- **CUDA events** on the current CuPy stream bracket each call; the time is GPU time, never wall clock around
  an asynchronous launch.
- **No host overhead in the number.** Before each timed call a one-thread *pad* kernel spins on the GPU's
  global timer for a little longer than the host needs to enqueue the call (measured during warm-up). The
  host records the start event and launches the call while the pad runs, so the GPU goes pad -> start ->
  kernel(s) -> end without an idle gap, and the event pair measures the call's device time alone.
- **Warm-up** calls first (JIT compilation, cuBLAS handles, memory-pool growth), then the **median** of many.
  ``FAV_TIMING_REST_S`` (default 0) idles the GPU that many seconds before each case's warm-up, so that a case does
  not start with the clock the case before it left (``rest_seconds``).

``time_cuda`` times a sequence of calls without a host synchronization between them; ``EventTimer.once`` times one
call and synchronizes (pytest-benchmark's pedantic mode calls it once per round, and ``event_clock`` is the timer
handed to pytest-benchmark so that the statistics it prints are these CUDA-event times).
"""
from __future__ import annotations

import os
import time

_PAD_SOURCE = r"""
extern "C" __global__ void fav_timing_pad(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""
_pad_kernel = None


def _pad(stream, ns: int):
    """Keep the GPU busy for ``ns`` nanoseconds on ``stream`` (one thread spinning on %globaltimer)."""
    global _pad_kernel
    import cupy
    if _pad_kernel is None:
        _pad_kernel = cupy.RawKernel(_PAD_SOURCE, "fav_timing_pad")
    with stream:
        _pad_kernel((1,), (1,), (cupy.uint64(ns),))


class _VirtualClock:
    seconds = 0.0


_CLOCK = _VirtualClock()


def event_clock() -> float:
    """A clock (in seconds) that advances only by CUDA-event-measured GPU time: ``EventTimer.once`` adds each
    call's event time. Handed to pytest-benchmark (``@pytest.mark.benchmark(timer=event_clock)`` with
    ``benchmark.pedantic``), its statistics are exactly the CUDA-event times."""
    return _CLOCK.seconds


def rest_seconds(text: str | None = None) -> float:
    """``FAV_TIMING_REST_S``: seconds the GPU idles before each timed case's warm-up (default 0). A card held at its
    power cap lowers its clock under load, so a case timed right after a heavy one starts slower than the same case
    after a pause: a rest starts every case from the same idle state."""
    text = os.environ.get("FAV_TIMING_REST_S", "") if text is None else text
    try:
        rest = float(text) if text.strip() else 0.0
    except ValueError:
        rest = -1.0
    if not 0.0 <= rest <= 60.0:
        raise ValueError(f"FAV_TIMING_REST_S must be a number of seconds from 0 to 60, got {text!r}")
    return rest


class EventTimer:
    """CUDA-event timing of ``fn(*args)`` on the current CuPy stream, with a pad kernel hiding host overhead."""

    MIN_PAD_NS = 20_000
    MAX_PAD_NS = 20_000_000

    def __init__(self, pad: bool = True):
        import cupy
        self.cupy = cupy
        self.stream = cupy.cuda.get_current_stream()
        self.pad = pad
        self.pad_ns = self.MIN_PAD_NS
        self.rest_s = rest_seconds()

    def warmup(self, fn, arg_sets, calls: int):
        """``calls`` untimed calls (at least one per set), then size the pad from the host's enqueue time; first, a
        rest of ``FAV_TIMING_REST_S`` seconds with the GPU idle (``rest_seconds``)."""
        if self.rest_s > 0:
            self.stream.synchronize()
            time.sleep(self.rest_s)
        host = []
        for i in range(max(calls, len(arg_sets), 1)):
            args = arg_sets[i % len(arg_sets)]
            t0 = time.perf_counter()
            fn(*args)
            host.append(time.perf_counter() - t0)
        self.stream.synchronize()
        # the host time of the fastest enqueues (after the first, which may compile), doubled, as the pad
        enqueue = min(host[1:] or host)
        self.pad_ns = int(min(self.MAX_PAD_NS, max(self.MIN_PAD_NS, 2 * enqueue * 1e9 + 10_000)))
        for _ in range(3):  # the pad kernel itself compiles on first use: keep that out of the timed calls
            if self.pad:
                _pad(self.stream, 1000)
        self.stream.synchronize()

    def _timed(self, fn, args):
        ev0, ev1 = self.cupy.cuda.Event(), self.cupy.cuda.Event()
        if self.pad:
            _pad(self.stream, self.pad_ns)
        ev0.record(self.stream)
        fn(*args)
        ev1.record(self.stream)
        return ev0, ev1

    def once(self, fn, args=(), advance_clock: bool = True) -> float:
        """Time one call in ms; synchronizes. Advances ``event_clock`` by the measured time."""
        ev0, ev1 = self._timed(fn, args)
        ev1.synchronize()
        ms = self.cupy.cuda.get_elapsed_time(ev0, ev1)
        if advance_clock:
            _CLOCK.seconds += ms * 1e-3
        return ms

    def many(self, fn, arg_sets, repeats: int, start: int = 0) -> list[float]:
        """``repeats`` calls rotating over ``arg_sets``, one synchronization at the end; ms per call."""
        events = [self._timed(fn, arg_sets[(start + i) % len(arg_sets)]) for i in range(repeats)]
        events[-1][1].synchronize()
        return [self.cupy.cuda.get_elapsed_time(a, b) for a, b in events]


def time_cuda(fn, *, warmup: int = 5, repeats: int = 30, rotate_inputs=None, pad: bool = True) -> list[float]:
    """CUDA-event times in ms of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones.

    ``rotate_inputs``: a list of argument tuples; call i runs ``fn(*rotate_inputs[i % len])`` (pass several
    input sets larger than L2 together, see ``gpu_input_sets``). None: ``fn()`` with no arguments.
    Take ``median()`` of the result."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sets = list(rotate_inputs) if rotate_inputs else [()]
    timer = EventTimer(pad=pad)
    timer.warmup(fn, sets, warmup)
    return timer.many(fn, sets, repeats, start=max(warmup, len(sets)))

