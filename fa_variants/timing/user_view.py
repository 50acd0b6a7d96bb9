"""A second timer, **as a user sees it**: ``user_view_ms`` is ``triton.testing.do_bench`` (median of events around
each call, a 256 MB memset flushing L2 before each, no pad kernel): the host's enqueue cost shows in it wherever it
exceeds that flush's GPU time. The bench's summary puts it beside the CUDA-event timer's (``tables``)."""
from __future__ import annotations

from .torch_peers import on_cupy_stream

DO_BENCH_ARGS = dict(warmup=25, rep=100, return_mode="median")   # ms of warm-up and of timed calls
MAX_DO_BENCH_FAILURES = 3      # in a row: then stop trying (a missing C compiler for triton's driver would
_DO_BENCH_FAILURES: list = []  # otherwise fail, slowly, in every case of a run)


def do_bench_status() -> tuple[object, str]:
    """(triton.testing.do_bench, '') when triton is importable, else (None, why not)."""
    try:
        from triton.testing import do_bench
    except Exception as e:  # noqa: BLE001 - no triton (or a broken one): the column stays empty
        return None, f"triton is not importable ({type(e).__name__})"
    return do_bench, ""


def user_view_ms(fn, args=()) -> tuple[float | None, str]:
    """(median ms of ``fn(*args)`` by ``triton.testing.do_bench``, '') or (None, why not).

    do_bench records its events on torch's current stream, so the calls run with torch's stream set to CuPy's
    (``on_cupy_stream``): otherwise the events would not bracket our kernels."""
    do_bench, why = do_bench_status()
    if do_bench is None:
        return None, why
    if len(_DO_BENCH_FAILURES) >= MAX_DO_BENCH_FAILURES:
        return None, f"do_bench not tried after {len(_DO_BENCH_FAILURES)} failures in a row ({_DO_BENCH_FAILURES[-1]})"
    try:
        import torch
        with on_cupy_stream(torch):
            ms = float(do_bench(lambda: fn(*args), **DO_BENCH_ARGS))
    except Exception as e:  # noqa: BLE001 - a failing second timer must not fail the measured case
        _DO_BENCH_FAILURES.append(f"{type(e).__name__}: {str(e)[:200]}")
        return None, f"do_bench failed: {_DO_BENCH_FAILURES[-1]}"
    _DO_BENCH_FAILURES.clear()
    return ms, ""

