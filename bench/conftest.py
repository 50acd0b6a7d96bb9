"""pytest-benchmark suite: configuration, GPU gate, shared inputs and the end-of-session summary.

Run it with ``pytest bench`` (the root pyproject's ``testpaths`` keeps it out of a plain ``pytest``). Every
statistic pytest-benchmark prints is a CUDA-event time (see ``fa_variants.timing``). Benchmarks of one shape
are grouped together, so ``pytest bench --benchmark-compare`` puts naive, fa1, fa2 and torch side by side.

Each case is also timed "as a user sees it" by ``triton.testing.do_bench`` (``timing.user_view_ms``); the
summary shows fa2 over torch's flash and cuDNN backends by both timers.

Environment: FAV_BENCH_ROUNDS (timed calls per case, default 20), FAV_BENCH_WARMUP (default 5),
FAV_BENCH_DO_BENCH=0 (leave out the do_bench timer).
"""
from __future__ import annotations

import collections
import functools
from pathlib import Path

import pytest

from fa_variants import timing

BENCH_DIR = Path(__file__).resolve().parent
_RESULTS = pytest.StashKey[list]()


@functools.lru_cache(maxsize=1)
def gpu_missing() -> str:
    """'' when CuPy sees a CUDA device, else why not (the library's one probe)."""
    from fa_variants import gpu
    return gpu.reason()


def pytest_configure(config):
    config.stash[_RESULTS] = []
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    why = gpu_missing()
    if not why:
        return
    skip = pytest.mark.skip(reason=f"benchmarks need a CUDA GPU: {why}")
    for item in items:
        if BENCH_DIR in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_benchmark_group_stats(config, benchmarks, group_by):
    """The default grouping ('group') becomes 'by shape': every variant of one shape in one table."""
    if group_by != "group" or not benchmarks:
        return None
    if not all(isinstance(b.get("params"), dict) and "shape" in b["params"] for b in benchmarks):
        return None
    groups = collections.defaultdict(list)
    for b in benchmarks:
        groups[f"shape={b['params']['shape']}"].append(b)
    for g in groups.values():
        g.sort(key=lambda b: b["name"])
    return sorted(groups.items())


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="session")
def gpu_inputs():
    """get(shape) -> list of (q, k, v) CuPy input sets for L2-busting rotation; only the last shape is kept."""
    cache = {}

    def get(shape: timing.Shape):
        if shape.id not in cache:
            cache.clear()
            import cupy
            cupy.get_default_memory_pool().free_all_blocks()
            cache[shape.id] = timing.gpu_input_sets(shape)
        return cache[shape.id]

    yield get
    cache.clear()


@pytest.fixture
def bench_record(request):
    """record(shape, variant, median_ms, median_ms_do_bench=None) -> ratios to the torch peers measured so far
    on the same shape (``timing.peer_ratios``); every record also feeds the end-of-session summary."""
    results = request.config.stash[_RESULTS]

    def record(shape: timing.Shape, variant: str, ms: float, ms_do_bench: float | None = None) -> dict:
        case = timing.Timed(shape, variant, ms, ms_do_bench)
        results.append(case)
        return timing.peer_ratios(results, case)

    yield record
    try:  # give memory back between cases: naive's S at N = 16K is tens of GB
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()
    except Exception:  # noqa: BLE001
        pass


# ------------------------------------------------------------------------------------------------ summary
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tables = timing.summary_tables(config.stash.get(_RESULTS, []))
    if not tables:
        return
    from tabulate import tabulate

    tr = terminalreporter
    for title, headers, rows in tables:
        tr.write_sep("=", f"fa-variants: {title}")
        tr.write_line(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
    tr.write_line("X / flash: TFLOP/s of X over torch SDPA's FLASH_ATTENTION backend on the same inputs (cudnn: "
                  "CUDNN_ATTENTION); do_bench: triton.testing.do_bench's median (L2 flushed, host launch cost "
                  "included where it exceeds the flush), beside the CUDA-event timer's")
