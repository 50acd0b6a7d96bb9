"""pytest-benchmark suite: configuration, GPU gate, shared inputs and the summary printed at the end.

Run it with ``pytest bench`` (the root pyproject's ``testpaths`` keeps it out of a plain ``pytest``). Every
statistic pytest-benchmark prints is a CUDA-event time (see ``fa_variants.timing``). Benchmarks of one shape
are grouped together, so ``pytest bench --benchmark-compare`` puts naive, fa1, fa2 and torch side by side.

Each case is also timed "as a user sees it" by ``triton.testing.do_bench`` (``timing.user_view.user_view_ms``); the
summary shows fa2 over torch's flash and cuDNN backends by both timers, for the forward and, in tables of their
own, the backward ("bwd": the backward alone) and forward+backward ("fwdbwd"). Backward groups are named like the
forward's with a direction suffix ('shape=<id> bwd', 'shape=<id> fwd+bwd').

Environment: FAV_BENCH_ROUNDS (timed calls per case, default 20), FAV_BENCH_WARMUP (default 5),
FAV_BENCH_DO_BENCH=0 (leave out the do_bench timer), FAV_BENCH_DIRECTIONS=fwd,bwd,fwdbwd (which directions to
collect, default all; the others are deselected), FAV_BENCH_UNVALIDATED=1 (run the fa2_bwd_kernel cases: fa2's
mma.sync backward kernel timed directly, bypassing the API), FAV_BENCH_FLEX=0 (leave out FlexAttention, the third
torch peer, compiled by torch.compile once per shape and direction), FAV_TIMING_REST_S (seconds the GPU idles
before each case's warm-up, ``timing.events.rest_seconds``): 0.2 here unless set (the library's timers default to
0). A card at its power cap starts a case timed right after a heavy one at the clock that one left; with the rest
every case starts from the same idle card. FAV_TIMING_REST_S=0 runs the cases back to back.
"""
from __future__ import annotations

import collections
import functools
import os
from pathlib import Path

import pytest

from fa_variants.timing.inputs import gpu_dout_sets, gpu_input_sets
from fa_variants.timing.shapes import DIRECTIONS, Shape, bench_group, parse_directions
from fa_variants.timing.tables import Skipped, Timed, peer_ratios, skip_lines, summary_tables

BENCH_DIR = Path(__file__).resolve().parent
_RESULTS = pytest.StashKey[list]()
_SKIPPED = pytest.StashKey[list]()
_DIRECTIONS = pytest.StashKey[tuple]()


@functools.lru_cache(maxsize=1)
def gpu_missing() -> str:
    """'' when CuPy sees a CUDA device, else why not (the library's one probe)."""
    from fa_variants import gpu
    return gpu.reason()


BENCH_REST_S = "0.2"  # FAV_TIMING_REST_S where the environment does not set it (see above)


def pytest_configure(config):
    os.environ.setdefault("FAV_TIMING_REST_S", BENCH_REST_S)
    config.stash[_RESULTS] = []
    config.stash[_SKIPPED] = []
    try:
        config.stash[_DIRECTIONS] = parse_directions(os.environ.get("FAV_BENCH_DIRECTIONS"))
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def _in_bench(item) -> bool:
    return BENCH_DIR in Path(str(item.path)).resolve().parents


def case_direction(item) -> str | None:
    """The direction a bench item times: its 'direction' parameter, "fwd" for test_forward, else None."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "direction" in params:
        return params["direction"]
    return "fwd" if getattr(item, "originalname", item.name).startswith("test_forward") else None


def pytest_collection_modifyitems(config, items):
    wanted = config.stash.get(_DIRECTIONS, DIRECTIONS)
    if wanted != DIRECTIONS:      # FAV_BENCH_DIRECTIONS: the other directions' cases are deselected
        keep, drop = [], []
        for item in items:
            d = case_direction(item) if _in_bench(item) else None
            (drop if d is not None and d not in wanted else keep).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    why = gpu_missing()
    if not why:
        return
    skip = pytest.mark.skip(reason=f"benchmarks need a CUDA GPU: {why}")
    for item in items:
        if _in_bench(item):
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_benchmark_group_stats(config, benchmarks, group_by):
    """The default grouping ('group') becomes 'by shape and direction': every variant of one shape in one table,
    the forward's as 'shape=<id>', the backward's as 'shape=<id> bwd' and 'shape=<id> fwd+bwd'."""
    if group_by != "group" or not benchmarks:
        return None
    if not all(isinstance(b.get("params"), dict) and "shape" in b["params"] for b in benchmarks):
        return None
    groups = collections.defaultdict(list)
    for b in benchmarks:
        groups[bench_group(b["params"]["shape"], b["params"].get("direction", "fwd"))].append(b)
    for g in groups.values():
        g.sort(key=lambda b: b["name"])
    return sorted(groups.items())


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="session")
def gpu_inputs():
    """get(shape) -> list of (q, k, v) CuPy input sets for L2-busting rotation; only the last shape is kept."""
    cache = {}

    def get(shape: Shape):
        if shape.id not in cache:
            cache.clear()
            import cupy
            cupy.get_default_memory_pool().free_all_blocks()
            cache[shape.id] = gpu_input_sets(shape)
        return cache[shape.id]

    yield get
    cache.clear()


@pytest.fixture(scope="session")
def gpu_douts():
    """get(shape, n) -> n CuPy output gradients for ``shape`` (one per input set); only the last shape is kept."""
    cache = {}

    def get(shape: Shape, n: int):
        key = (shape.id, n)
        if key not in cache:
            cache.clear()
            cache[key] = gpu_dout_sets(shape, n)
        return cache[key]

    yield get
    cache.clear()


@pytest.fixture
def bench_record(request):
    """record(shape, variant, median_ms, median_ms_do_bench=None, direction="fwd") -> ratios to the torch peers
    measured so far on the same shape and direction (``timing.tables.peer_ratios``); every record also feeds the
    summary printed at the end."""
    results = request.config.stash[_RESULTS]

    def record(shape: Shape, variant: str, ms: float, ms_do_bench: float | None = None,
               direction: str = "fwd") -> dict:
        case = Timed(shape, variant, ms, ms_do_bench, direction)
        results.append(case)
        return peer_ratios(results, case)

    yield record
    try:  # give memory back between cases: naive's S at N = 16K is tens of GB
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()
    except Exception:  # noqa: BLE001
        pass


@pytest.fixture
def bench_skip(request):
    """skip(shape, variant, direction, reason): record why a case did not run (listed under the summary), then
    ``pytest.skip(reason)``."""
    skipped = request.config.stash[_SKIPPED]

    def skip(shape: Shape, variant: str, direction: str, reason: str):
        skipped.append(Skipped(shape, variant, direction, reason))
        pytest.skip(reason)

    return skip


# ------------------------------------------------------------------------------------------------ summary
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    results = config.stash.get(_RESULTS, [])
    tables = summary_tables(results)
    skipped = skip_lines(config.stash.get(_SKIPPED, []))
    if not tables and not skipped:
        return
    from tabulate import tabulate

    tr = terminalreporter
    for title, headers, rows in tables:
        tr.write_sep("=", f"fa-variants: {title}")
        tr.write_line(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
    if tables:
        tr.write_line("X / flash: TFLOP/s of X over torch SDPA's FLASH_ATTENTION backend on the same inputs "
                      "(cudnn: CUDNN_ATTENTION), in the same direction; do_bench: triton.testing.do_bench's median "
                      "(L2 flushed, host launch cost included where it exceeds the flush), beside the CUDA-event "
                      "timer's")
    if any(r.direction != "fwd" for r in results):
        tr.write_line("bwd: the backward alone (ours: given q, k, v, out, lse, dout; torch: autograd.grad of "
                      "SDPA's output, its forward run once outside the timed region); fwd+bwd: both; TFLOP/s "
                      "count 2.5x (bwd) and 3.5x (fwd+bwd) the forward's FLOPs")
    if skipped:
        tr.write_sep("-", "fa-variants: backward cases not run")
        for line in skipped:
            tr.write_line(line)
