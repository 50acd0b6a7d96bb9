"""Forward-pass benchmarks: every registry variant and torch SDPA (FlashAttention-2 and cuDNN backends) on
the same inputs, over the FlashAttention-2 paper's sweep.

Matrix: dtype bf16 and fp16; head dim 64 and 128; N in 1K, 2K, 4K, 8K, 16K with B * N = 16K tokens and
H * d = 2048; causal and not. FA1's small-grid case (B = 1, H = 16, N = 16K, d = 128: only 16 CTAs for FA1's
one-CTA-per-head grid) is the matrix's N = 16K, d = 128 row. Plus d = 256 in bf16 for N = 4K, 8K, 16K. Besides
the registry's variants, ``fa2_fp8_prequant`` times fa2_fp8 on operands quantized before the timed call.

Each round is one call bracketed by CUDA events (``timing.EventTimer.once``) after a pad kernel that hides the
host's launch overhead; calls rotate among input sets larger than L2 together. pytest-benchmark's timer is
``timing.event_clock``, which advances only by those event times, so its min/median/mean are GPU times.
A second timer, as a user sees it: ``triton.testing.do_bench`` (``timing.user_view_ms``; L2 flushed before each
call, no pad kernel), recorded beside it in extra_info (``tflops_do_bench``; empty without triton). The torch
peers of a shape run before the other variants, so each case also records its ratios to them by both timers
(``over_torch_flash``, ``over_torch_flash_do_bench``, ``over_torch_cudnn``, ...).

    pytest bench                                   # everything (a few minutes on an H200)
    pytest bench -k "fa2 and d128 and N4096"       # a slice
    pytest bench --benchmark-autosave              # save, then later: pytest bench --benchmark-compare
    FAV_BENCH_ROUNDS=50 pytest bench               # more timed calls per case
    FAV_BENCH_DO_BENCH=0 pytest bench              # without the do_bench timer
"""
from __future__ import annotations

import itertools
import math
import os

import pytest

import fa_variants as fav
from fa_variants import registry, timing
from fa_variants.timing import Shape

TOKENS = 16 * 1024
HIDDEN = 2048
ROUNDS = int(os.environ.get("FAV_BENCH_ROUNDS", "20"))
WARMUP = int(os.environ.get("FAV_BENCH_WARMUP", "5"))
DO_BENCH = os.environ.get("FAV_BENCH_DO_BENCH", "1") != "0"


def _shapes() -> list[Shape]:
    out = []
    for dtype in ("bfloat16", "float16"):
        for d in (64, 128):
            for n in (1024, 2048, 4096, 8192, 16384):
                for causal in (False, True):
                    out.append(Shape(batch=TOKENS // n, heads=HIDDEN // d, seqlen_q=n, head_dim=d, dtype=dtype,
                                     causal=causal))
    small_grid = [Shape(batch=1, heads=16, seqlen_q=16384, head_dim=128, dtype=dt, causal=c)
                  for dt in ("bfloat16", "float16") for c in (False, True)]
    # d = 256, the FP8 issue's other head dim (bf16, N = 4K-16K at the same token and hidden counts)
    d256 = [Shape(batch=TOKENS // n, heads=HIDDEN // 256, seqlen_q=n, head_dim=256, dtype="bfloat16", causal=c)
            for n in (4096, 8192, 16384) for c in (False, True)]
    return out + [s for s in small_grid if s not in out] + d256   # small grid: already in the matrix, kept once


SHAPES = _shapes()
# fa2_fp8 on bf16/fp16 inputs quantizes on the fly; PREQUANT is the same kernel on tensors quantized beforehand
# (fav.fp8.quantize, outside the timed call), as a KV cache would hold them.
PREQUANT = "fa2_fp8_prequant"
# On Hopper fa2 runs its wgmma kernel; MMA_SYNC is fa2's mma.sync kernel (the one sm_80-89 run) on the same
# inputs: the instruction's share of fa2's speed, and FA1 against FA2 on one instruction.
MMA_SYNC = "fa2_mma_sync"
# The torch peers first: each later case of the shape then finds them measured, for its ratios (extra_info).
VARIANTS = list(timing.TORCH_BACKENDS) + [v.name for v in registry.variants()] + [MMA_SYNC, PREQUANT]
CASES = [(s.id, v) for s in SHAPES for v in VARIANTS]   # shape-major: one set of inputs serves every variant


def _device_name() -> str:
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _ours(variant: str, shape: Shape, scale: float):
    """(fn(q, k, v), modeled HBM bytes) for a registry variant, or pytest.skip with the reason."""
    entry = registry.get(variant)
    ok, why = entry.available()
    if not ok:
        pytest.skip(f"{variant} not available here: {why}")
    if not entry.supports(shape.dtype, shape.head_dim):
        pytest.skip(f"{variant} does not take {shape.dtype} with head_dim {shape.head_dim}")
    try:
        bq, bk = entry.launcher.tiles(shape.head_dim)
        hbm = entry.hbm_bytes(shape.batch, shape.heads, shape.seqlen_q, shape.nk, shape.head_dim,
                              bq, bk, shape.causal, shape.itemsize)
    except Exception:  # noqa: BLE001 - no model: no number, the timing still stands
        hbm = None

    def fn(q, k, v):
        return fav.attention(q, k, v, variant=variant, causal=shape.causal, softmax_scale=scale, backend="cuda")

    return fn, hbm


def _torch(peer: str, shape: Shape, scale: float):
    torch, why = timing.torch_status()
    if torch is None:
        pytest.skip(why)
    why = timing.torch_sdpa_unsupported(shape)
    if why:
        pytest.skip(why)
    return torch, timing.torch_sdpa_fn(torch, peer, shape, scale)


@pytest.mark.gpu
@pytest.mark.benchmark(timer=timing.event_clock)
@pytest.mark.parametrize("shape,variant", CASES, ids=[f"{s}-{v}" for s, v in CASES])
def test_forward(benchmark, gpu_inputs, bench_record, shape, variant):
    shp = Shape.parse(shape)
    scale = 1.0 / math.sqrt(shp.head_dim)
    hbm = None
    if variant in timing.TORCH_BACKENDS:
        torch, fn = _torch(variant, shp, scale)
        sets = [tuple(timing.as_torch_bhnd(torch, a) for a in s) for s in gpu_inputs(shp)]
    elif variant == MMA_SYNC:
        from fa_variants.kernels import fa2 as fa2_kernels
        _ours("fa2", shp, scale)  # skips where fa2 cannot run
        sets = gpu_inputs(shp)
        fn = fa2_kernels.plan(*sets[0], causal=shp.causal, softmax_scale=scale, return_lse=False,
                              kernel="mma_sync").run_cupy   # one plan: every input set has the same signature
    elif variant == PREQUANT:
        import fa_variants as fav
        _ours("fa2_fp8", shp, scale)  # skips where fa2_fp8 cannot run
        sets = [(fav.fp8.quantize(*s),) for s in gpu_inputs(shp)]

        def fn(qz):
            return fav.fp8.attention(qz, causal=shp.causal, softmax_scale=scale)
    else:
        fn, hbm = _ours(variant, shp, scale)
        sets = gpu_inputs(shp)

    timer = timing.EventTimer()
    try:
        timer.warmup(fn, sets, WARMUP)
    except MemoryError as e:          # naive refusing an S that does not fit: a fact about the size, not a bug
        pytest.skip(f"{variant}: {e}")

    counter = itertools.count()

    def setup():
        return sets[next(counter) % len(sets)], {}

    benchmark.pedantic(lambda *args: timer.once(fn, args), setup=setup, rounds=ROUNDS, warmup_rounds=0,
                       iterations=1)
    if benchmark.stats is None:       # --benchmark-disable: ran once, nothing measured
        return
    med_ms = benchmark.stats.stats.median * 1e3
    db_ms, db_why = timing.user_view_ms(fn, sets[0]) if DO_BENCH else (None, "FAV_BENCH_DO_BENCH=0")
    benchmark.extra_info.update(
        variant=variant, shape=shp.id, dtype=shp.dtype, batch=shp.batch, heads=shp.heads, heads_kv=shp.hkv,
        seqlen_q=shp.seqlen_q, seqlen_k=shp.nk, head_dim=shp.head_dim, causal=shp.causal,
        median_ms=med_ms, tflops=timing.tflops(shp.flops, med_ms), flops=shp.flops,
        median_ms_do_bench=db_ms, tflops_do_bench=timing.tflops(shp.flops, db_ms) if db_ms else None,
        do_bench_note=db_why or None,
        hbm_bytes_model=hbm, input_sets=len(sets), l2_bytes=timing.l2_bytes(),
        timer="CUDA events (fa_variants.timing.event_clock)", timer_do_bench="triton.testing.do_bench median",
        device=_device_name(),
    )
    ratios = bench_record(shp, variant, med_ms, db_ms)
    if variant not in timing.TORCH_BACKENDS:
        benchmark.extra_info.update(ratios)
