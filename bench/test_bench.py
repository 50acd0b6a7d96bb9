"""Forward and backward benchmarks: every registry variant and torch SDPA (FlashAttention-2 and cuDNN backends)
on the same inputs, over the FlashAttention-2 paper's sweep.

Matrix: dtype bf16 and fp16; head dim 64 and 128; N in 1K, 2K, 4K, 8K, 16K with B * N = 16K tokens and
H * d = 2048; causal and not. FA1's small-grid case (B = 1, H = 16, N = 16K, d = 128: only 16 CTAs for FA1's
one-CTA-per-head grid) is the matrix's N = 16K, d = 128 row. Plus d = 256 in bf16 for N = 4K, 8K, 16K. Besides
the registry's variants, ``fa2_fp8_prequant`` (``fa3_fp8_prequant``) times fa2_fp8 (fa3_fp8) on operands quantized
before the timed call.

Each round is one call bracketed by CUDA events (``timing.events.EventTimer.once``) after a pad kernel that hides
the host's launch overhead; calls rotate among input sets larger than L2 together. pytest-benchmark's timer is
``timing.events.event_clock``, which advances only by those event times, so its min/median/mean are GPU times.
A second timer, as a user sees it: ``triton.testing.do_bench`` (``timing.user_view.user_view_ms``; L2 flushed
before each call, no pad kernel), recorded beside it in extra_info (``tflops_do_bench``; empty without triton).
The torch peers of a shape run before the other variants, so each case also records its ratios to them by both
timers (``over_torch_flash``, ``over_torch_flash_do_bench``, ``over_torch_cudnn``, ...).

Backward (``test_backward``), on the forward's shapes, in two directions: "bwd", the backward alone (given q,
k, v, out, lse and dout, the backward call is timed; out and lse come from the variant's own forward, run
outside the timed region) and "fwdbwd" (forward then backward in the timed call). Variants: torch SDPA's flash
and cuDNN backwards (``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`` of an SDPA forward run
once beforehand with that backend forced and q, k, v requiring grad; "fwdbwd" runs both), then ours with a
backward (naive, fa1, fa2, fa3), through ``fav.attention_backward(..., backend="cuda")``: a case that raises
BackendUnavailable (no GPU backward for that variant here) or MemoryError is skipped with its message, and the
summary lists those skips. TFLOP/s of a backward = 2.5 x the forward's FLOPs / time (3.5x for "fwdbwd"), halved for
causal, as in anchors/h200-peers.md; ratios to torch are taken in the same direction, by both timers.

``fa2_bwd_kernel`` times fa2's mma.sync backward (``kernels.fa2_bwd.backward``, the kernels sm_80-89 run)
directly, bypassing the API, at head dims up to 128: on Hopper, where the API runs the wgmma backward, it shows
that instruction's share, as ``fa2_mma_sync`` does for the forward. It runs only with ``FAV_BENCH_UNVALIDATED=1``
(a kernel called outside the API's checks that faults would end the CUDA context, and every later case with it).

Directions: ``FAV_BENCH_DIRECTIONS=fwd,bwd,fwdbwd`` (default all) collects only the named ones; the others are
deselected. The backward cases come on top of the forward's (per shape and direction the torch peers and ours
with a backward), so a default run takes roughly twice as long as ``FAV_BENCH_DIRECTIONS=fwd``.

    pytest bench                                   # everything (forward, then backward)
    FAV_BENCH_DIRECTIONS=fwd pytest bench          # the forward only
    FAV_BENCH_DIRECTIONS=bwd pytest bench          # the backward alone, nothing else
    pytest bench -k "fa2 and d128 and N4096"       # a slice (of every direction collected)
    pytest bench --benchmark-autosave              # save, then later: pytest bench --benchmark-compare
    FAV_BENCH_ROUNDS=50 pytest bench               # more timed calls per case
    FAV_BENCH_DO_BENCH=0 pytest bench              # without the do_bench timer
    FAV_BENCH_UNVALIDATED=1 FAV_BENCH_DIRECTIONS=bwd pytest bench -k "fa2_bwd_kernel or torch"
"""
from __future__ import annotations

import itertools
import math
import os

import pytest

import fa_variants as fav
from fa_variants import registry
from fa_variants.timing.events import EventTimer, event_clock
from fa_variants.timing.inputs import l2_bytes
from fa_variants.timing.shapes import DIRECTION_TAGS, FLOPS_FACTOR, Shape, direction_flops, tflops
from fa_variants.timing.torch_peers import (as_torch_bhnd, peer_names, torch_grad_fn, torch_leaf_sets, torch_sdpa_fn,
                                           torch_sdpa_fwdbwd_fn, torch_sdpa_grad_sets, torch_sdpa_unsupported,
                                           torch_status)
from fa_variants.timing.user_view import user_view_ms

TOKENS = 16 * 1024
HIDDEN = 2048
ROUNDS = int(os.environ.get("FAV_BENCH_ROUNDS", "20"))
WARMUP = int(os.environ.get("FAV_BENCH_WARMUP", "5"))
DO_BENCH = os.environ.get("FAV_BENCH_DO_BENCH", "1") != "0"
UNVALIDATED = os.environ.get("FAV_BENCH_UNVALIDATED", "0") not in ("", "0")


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
# The fp8 variants on bf16/fp16 inputs quantize on the fly; "<variant>_prequant" is the same kernel on tensors
# quantized beforehand (fav.fp8.quantize, outside the timed call), as a KV cache would hold them.
PREQUANTS = {f"{v.name}_prequant": v.name for v in registry.variants() if v.operand_dtype is not None}
# On Hopper fa2 runs its wgmma kernel; MMA_SYNC is fa2's mma.sync kernel (the one sm_80-89 run) on the same
# inputs: the instruction's share of fa2's speed, and FA1 against FA2 on one instruction.
MMA_SYNC = "fa2_mma_sync"
# The torch peers first: each later case of the shape then finds them measured, for its ratios (extra_info).
# FlexAttention is the third torch peer (torch.compile once per shape and direction); FAV_BENCH_FLEX=0 leaves it
# out.
PEERS = peer_names(os.environ.get("FAV_BENCH_FLEX", "1") not in ("", "0"))
VARIANTS = PEERS + [v.name for v in registry.variants()] + [MMA_SYNC, *PREQUANTS]
CASES = [(s.id, v) for s in SHAPES for v in VARIANTS]   # shape-major: one set of inputs serves every variant

# The backward: torch peers first (ratios), then ours with a backward, then fa2's mma.sync kernel timed directly.
BWD_KERNEL = "fa2_bwd_kernel"        # kernels.fa2_bwd.backward (mma.sync), bypassing the API (opt-in)
BWD_KERNEL_MAX_DIM = 128
BWD_DIRECTIONS = ("bwd", "fwdbwd")
BWD_VARIANTS = (PEERS + [v.name for v in registry.variants() if v.reference_backward]
                + [BWD_KERNEL])
BWD_CASES = [(s.id, d, v) for s in SHAPES for d in BWD_DIRECTIONS for v in BWD_VARIANTS]


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
        bq, bk = entry.launcher.tiles(shape.head_dim, shape.causal)
        hbm = entry.hbm_bytes(shape.batch, shape.heads, shape.seqlen_q, shape.nk, shape.head_dim,
                              bq, bk, shape.causal, shape.itemsize)
    except Exception:  # noqa: BLE001 - no model: no number, the timing still stands
        hbm = None

    def fn(q, k, v):
        return fav.attention(q, k, v, variant=variant, causal=shape.causal, softmax_scale=scale, backend="cuda")

    return fn, hbm


def _torch(peer: str, shape: Shape, scale: float):
    torch, why = torch_status()
    if torch is None:
        pytest.skip(why)
    why = torch_sdpa_unsupported(shape)
    if why:
        pytest.skip(why)
    return torch, torch_sdpa_fn(torch, peer, shape, scale)


@pytest.mark.gpu
@pytest.mark.benchmark(timer=event_clock)
@pytest.mark.parametrize("shape,variant", CASES, ids=[f"{s}-{v}" for s, v in CASES])
def test_forward(benchmark, gpu_inputs, bench_record, shape, variant):
    shp = Shape.parse(shape)
    scale = 1.0 / math.sqrt(shp.head_dim)
    hbm = None
    if variant in PEERS:
        torch, fn = _torch(variant, shp, scale)
        sets = [tuple(as_torch_bhnd(torch, a) for a in s) for s in gpu_inputs(shp)]
    elif variant == MMA_SYNC:
        from fa_variants.kernels import fa2 as fa2_kernels
        _ours("fa2", shp, scale)  # skips where fa2 cannot run
        sets = gpu_inputs(shp)
        fn = fa2_kernels.plan(*sets[0], causal=shp.causal, softmax_scale=scale, return_lse=False,
                              kernel="mma_sync").run_cupy   # one plan: every input set has the same signature
    elif variant in PREQUANTS:
        import fa_variants as fav
        _ours(PREQUANTS[variant], shp, scale)  # skips where the variant cannot run
        sets = [(fav.fp8.quantize(*s, variant=PREQUANTS[variant]),) for s in gpu_inputs(shp)]

        def fn(qz):
            return fav.fp8.attention(qz, causal=shp.causal, softmax_scale=scale)
    else:
        fn, hbm = _ours(variant, shp, scale)
        sets = gpu_inputs(shp)

    _measure(benchmark, bench_record, shp, variant, fn, sets, hbm=hbm)


def _measure(benchmark, bench_record, shp: Shape, variant: str, fn, sets, *, direction: str = "fwd", hbm=None,
             skip=None, extra=None):
    """Warm up, time ``fn(*set)`` over the rotating ``sets`` under pytest-benchmark (CUDA-event clock), time it
    once more by do_bench, record extra_info and the ratios to the torch peers of the same shape and direction.
    ``skip(reason)`` (default pytest.skip) is called where warm-up meets a MemoryError."""
    timer = EventTimer()
    try:
        timer.warmup(fn, sets, WARMUP)
    except MemoryError as e:          # naive refusing an S that does not fit: a fact about the size, not a bug
        (skip or pytest.skip)(f"{variant}: {e}")

    counter = itertools.count()

    def setup():
        return sets[next(counter) % len(sets)], {}

    benchmark.pedantic(lambda *args: timer.once(fn, args), setup=setup, rounds=ROUNDS, warmup_rounds=0,
                       iterations=1)
    if benchmark.stats is None:       # --benchmark-disable: ran once, nothing measured
        return
    med_ms = benchmark.stats.stats.median * 1e3
    db_ms, db_why = user_view_ms(fn, sets[0]) if DO_BENCH else (None, "FAV_BENCH_DO_BENCH=0")
    flops = direction_flops(shp, direction)
    info = dict(
        variant=variant, shape=shp.id, dtype=shp.dtype, batch=shp.batch, heads=shp.heads, heads_kv=shp.hkv,
        seqlen_q=shp.seqlen_q, seqlen_k=shp.nk, head_dim=shp.head_dim, causal=shp.causal,
        median_ms=med_ms, tflops=tflops(flops, med_ms), flops=flops,
        median_ms_do_bench=db_ms, tflops_do_bench=tflops(flops, db_ms) if db_ms else None,
        do_bench_note=db_why or None,
        hbm_bytes_model=hbm, input_sets=len(sets), l2_bytes=l2_bytes(),
        timer="CUDA events (fa_variants.timing.event_clock)", timer_do_bench="triton.testing.do_bench median",
        device=_device_name(),
    )
    if direction != "fwd":
        # 'variant' carries the direction so that readers keyed by variant and shape (bench/plot.py) keep the
        # backward's points apart from the forward's; 'base_variant' is the plain name.
        info.update(variant=f"{variant} {DIRECTION_TAGS[direction]}", base_variant=variant,
                    direction=direction, flops_convention=f"{FLOPS_FACTOR[direction]} x 4BHNqNkd"
                    f"{' / 2 (causal)' if shp.causal else ''}")
    info.update(extra or {})
    benchmark.extra_info.update(info)
    ratios = bench_record(shp, variant, med_ms, db_ms, direction=direction)
    if variant not in PEERS:
        benchmark.extra_info.update(ratios)


# ------------------------------------------------------------------------------------------------ backward
def _our_backward(variant: str, fwd_variant: str, bwd, shp: Shape, scale: float, qkv, douts, direction: str, skip):
    """(fn, argument sets) timing ``bwd(dout, q, k, v, out, lse)`` ("bwd") or ``fwd_variant``'s forward then
    ``bwd`` ("fwdbwd"). One forward and one backward on the first set come first: a backward that is unavailable
    (BackendUnavailable) or a size that does not fit (MemoryError) skips the case before the other sets' forwards
    run. "bwd": out and lse are ``fwd_variant``'s own, computed here, outside the timed region."""
    def fwd(q, k, v):
        return fav.attention(q, k, v, variant=fwd_variant, causal=shp.causal, softmax_scale=scale,
                             return_lse=True, backend="cuda")

    q, k, v = qkv[0]
    try:
        saved = [fwd(q, k, v)]
        bwd(douts[0], q, k, v, *saved[0])
    except fav.BackendUnavailable as e:
        skip(f"{variant}: {e}")
    except MemoryError as e:
        skip(f"{variant}: {e}")
    if direction == "bwd":
        saved += [fwd(*s) for s in qkv[1:]]
        return bwd, [(d, q, k, v, o, lse) for (q, k, v), d, (o, lse) in zip(qkv, douts, saved)]

    def fwd_bwd(q, k, v, dout):
        out, lse = fwd(q, k, v)
        return bwd(dout, q, k, v, out, lse)

    return fwd_bwd, [(q, k, v, d) for (q, k, v), d in zip(qkv, douts)]


def _torch_backward(peer: str, shp: Shape, scale: float, qkv, douts, direction: str, skip):
    torch, why = torch_status()
    if torch is None:
        skip(why)
    why = torch_sdpa_unsupported(shp)
    if why:
        skip(why)
    try:
        if direction == "bwd":
            sets = torch_sdpa_grad_sets(torch, peer, shp, scale, qkv, douts)   # the forward runs here
            return torch_grad_fn(torch), sets
        fn = torch_sdpa_fwdbwd_fn(torch, peer, shp, scale)
        sets = torch_leaf_sets(torch, qkv, douts)
        fn(*sets[0])                  # a backend that refuses the shape says so here, as a skip
        return fn, sets
    except torch.cuda.OutOfMemoryError as e:
        skip(f"{peer}: {type(e).__name__}: {str(e)[:300]}")
    except RuntimeError as e:         # SDPA with one backend forced and none that takes the inputs
        if not any(m in str(e) for m in ("No available kernel", "No viable backend")):
            raise
        skip(f"{peer}: {' '.join(str(e).split())[:300]}")


@pytest.mark.gpu
@pytest.mark.benchmark(timer=event_clock)
@pytest.mark.parametrize("shape,direction,variant", BWD_CASES, ids=[f"{s}-{d}-{v}" for s, d, v in BWD_CASES])
def test_backward(benchmark, gpu_inputs, gpu_douts, bench_record, bench_skip, shape, direction, variant):
    shp = Shape.parse(shape)
    scale = 1.0 / math.sqrt(shp.head_dim)

    def skip(reason):
        bench_skip(shp, variant, direction, reason)

    extra = {}
    if variant == BWD_KERNEL:
        if not UNVALIDATED:
            skip("fa2_bwd_kernel times fa2's mma.sync backward kernel directly, bypassing the API: opt-in, "
                 "FAV_BENCH_UNVALIDATED=1")
        if shp.head_dim > BWD_KERNEL_MAX_DIM or shp.head_dim % 8:
            skip(f"fa2's GPU backward kernel takes head_dim a multiple of 8 up to {BWD_KERNEL_MAX_DIM}, "
                 f"got {shp.head_dim}")
        entry = registry.get("fa2")
        ok, why = entry.available()
        if not ok:
            skip(f"fa2 not available here: {why}")
    elif variant not in PEERS:
        entry = registry.get(variant)
        ok, why = entry.available()
        if not ok:
            skip(f"{variant} not available here: {why}")
        if not entry.supports(shp.dtype, shp.head_dim):
            skip(f"{variant} does not take {shp.dtype} with head_dim {shp.head_dim}")

    qkv = gpu_inputs(shp)
    douts = gpu_douts(shp, len(qkv))
    torch_mod = None
    try:
        if variant in PEERS:
            torch_mod = torch_status()[0]
            fn, sets = _torch_backward(variant, shp, scale, qkv, douts, direction, skip)
            extra = dict(torch_backward="torch.autograd.grad(out, (q, k, v), dout"
                         + (", retain_graph=True), forward excluded" if direction == "bwd" else "), after SDPA"))
        elif variant == BWD_KERNEL:
            from fa_variants.kernels import fa2_bwd

            def bwd(dout, q, k, v, out, lse):
                return fa2_bwd.backward(dout, q, k, v, out, lse, causal=shp.causal, softmax_scale=scale)

            fn, sets = _our_backward(variant, "fa2", bwd, shp, scale, qkv, douts, direction, skip)
            extra = dict(unvalidated=True, note="kernels.fa2_bwd.backward (mma.sync) called directly, not through "
                         "the API")
        else:
            def bwd(dout, q, k, v, out, lse):
                return fav.attention_backward(dout, q, k, v, out, lse, variant=variant, causal=shp.causal,
                                              softmax_scale=scale, backend="cuda", check_lse=False)

            fn, sets = _our_backward(variant, variant, bwd, shp, scale, qkv, douts, direction, skip)
        _measure(benchmark, bench_record, shp, variant, fn, sets, direction=direction, skip=skip, extra=extra)
    finally:
        sets = fn = None
        if torch_mod is not None:     # the retained graphs and cached gradients go back between cases
            torch_mod.cuda.empty_cache()
