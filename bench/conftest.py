"""pytest-benchmark suite: configuration, GPU gate, shared inputs and the end-of-session summary.

Run it with ``pytest bench`` (the root pyproject's ``testpaths`` keeps it out of a plain ``pytest``). Every
statistic pytest-benchmark prints is a CUDA-event time (see ``fa_variants.timing``). Benchmarks of one shape
are grouped together, so ``pytest bench --benchmark-compare`` puts naive, fa1, fa2 and torch side by side.

Environment: FAV_BENCH_ROUNDS (timed calls per case, default 20), FAV_BENCH_WARMUP (default 5).
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
    """record(shape, variant, median_ms) for the end-of-session summary table."""
    results = request.config.stash[_RESULTS]

    def record(shape: timing.Shape, variant: str, ms: float):
        results.append((shape, variant, ms))

    yield record
    try:  # give memory back between cases: naive's S at N = 16K is tens of GB
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()
    except Exception:  # noqa: BLE001
        pass


# ------------------------------------------------------------------------------------------------ summary
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    results = config.stash.get(_RESULTS, [])
    if not results:
        return
    from tabulate import tabulate

    ms = {(s.id, v): t for s, v, t in results}
    shapes = list(dict.fromkeys(s for s, _, _ in results))
    names = list(dict.fromkeys(v for _, v, _ in results))
    ours = [n for n in names if not n.startswith("torch-")]
    has_flash = "torch-flash" in names
    headers = ["shape"] + [f"{n} TFLOP/s" for n in names] + ([f"{n} / flash" for n in ours] if has_flash else [])
    rows = []
    for s in shapes:
        row = [s.id]
        for n in names:
            t = ms.get((s.id, n))
            row.append("" if t is None else f"{timing.tflops(s.flops, t):.1f}")
        if has_flash:
            f = ms.get((s.id, "torch-flash"))
            for n in ours:
                t = ms.get((s.id, n))
                row.append("" if t is None or f is None else f"{f / t:.2f}")
        rows.append(row)
    tr = terminalreporter
    tr.write_sep("=", "fa-variants: forward TFLOP/s (median CUDA-event time; 4BHN^2d, /2 causal)")
    tr.write_line(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
    if has_flash:
        tr.write_line("X / flash: TFLOP/s of X over torch SDPA's FLASH_ATTENTION backend on the same inputs")
