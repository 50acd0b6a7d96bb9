"""How fa-variants measures speed: one implementation shared by ``fa-variants compare`` and ``bench/``.

Method (DESIGN.md, "Speed"):

- **CUDA events** on the current CuPy stream bracket each call; the time is GPU time, never wall clock around
  an asynchronous launch.
- **No host overhead in the number.** Before each timed call a one-thread *pad* kernel spins on the GPU's
  global timer for a little longer than the host needs to enqueue the call (measured during warm-up). The
  host records the start event and launches the call while the pad runs, so the GPU goes pad -> start ->
  kernel(s) -> end without an idle gap, and the event pair measures the call's device time alone.
- **Warm-up** calls first (JIT compilation, cuBLAS handles, memory-pool growth), then the **median** of many.
  ``FAV_TIMING_REST_S`` (default 0) idles the GPU that many seconds before each case's warm-up, so that a case does
  not start with the clock the case before it left (``rest_seconds``).
- **Inputs larger than L2**: the caller passes several input sets and calls rotate among them, sized so that
  the sets together are at least 3x the L2 (60 MB on the H200): no call finds its Q, K, V in L2 left warm by
  the previous call.
- **TFLOP/s** = 4 * B * H * Nq * Nk * d / time, **halved for causal** (the flash-attn / FlashAttention-2
  paper convention, also used by the peer numbers in anchors/h200-peers.md). With bottom-right causal and
  Nq != Nk the exact count of visible pairs differs; we keep the convention so numbers compare with others'.
  The **backward** counts 2.5x the forward's FLOPs and forward+backward 3.5x (``direction_flops``; flash-attn's
  benchmark and the anchors' convention), whatever a given backward really computes (fa2's deterministic
  backward does 3.5x, the standard one 2x: ``iomodel.backward_flops``).

``time_cuda`` times a sequence of calls without a host synchronization between them; ``EventTimer.once``
times one call and synchronizes (pytest-benchmark's pedantic mode calls it once per round, and
``event_clock`` is the timer handed to pytest-benchmark so that the statistics it prints are these CUDA-event
times).

A second timer, **as a user sees it**: ``user_view_ms`` is ``triton.testing.do_bench`` (median of events around
each call, a 256 MB memset flushing L2 before each, no pad kernel): the host's enqueue cost shows in it wherever
it exceeds that flush's GPU time. ``summary_tables`` and ``peer_ratios`` put both timers beside torch SDPA's.

The backward peers: ``torch_sdpa_grad_sets`` runs SDPA's forward once (backend forced, q, k, v requiring grad)
outside any timed region and ``torch_grad_fn`` times ``torch.autograd.grad(out, (q, k, v), dout,
retain_graph=True)`` alone; ``torch_sdpa_fwdbwd_fn`` times both. Results carry a direction ("fwd", "bwd",
"fwdbwd"); ratios are taken between cases of one shape and one direction.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import statistics
import time

DEFAULT_L2_BYTES = 60 * 1000 * 1000    # H200; the real value is read from the device when there is one
L2_FOOTPRINT = 3                        # input sets together span at least this many L2 sizes
MAX_SETS = 8
_DTYPE_SHORT = {"float16": "fp16", "bfloat16": "bf16"}
_SHORT_DTYPE = {v: k for k, v in _DTYPE_SHORT.items()}


# ------------------------------------------------------------------------------------------------ arithmetic
def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal) -> float:
    """Forward FLOPs by the convention 4 * B * H * Nq * Nk * d, halved for causal (whatever the alignment)."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


def backward_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal) -> float:
    """Backward FLOPs by the convention: 2.5 x ``attention_flops`` (so also halved for causal)."""
    return FLOPS_FACTOR["bwd"] * attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal)


# ------------------------------------------------------------------------------------------------ directions
#: What a benchmark case times: the forward, the backward alone (given q, k, v, out, lse, dout), or both.
DIRECTIONS = ("fwd", "bwd", "fwdbwd")
DIRECTION_NAMES = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward+backward"}
DIRECTION_TAGS = {"fwd": "", "bwd": "bwd", "fwdbwd": "fwd+bwd"}   # suffix of group names and table headers
FLOPS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}           # x the forward's 4BHNqNkd (/2 causal)
_DIRECTION_ALIASES = {"fwd+bwd": "fwdbwd", "fwd_bwd": "fwdbwd", "forward": "fwd", "backward": "bwd"}


def parse_directions(text: str | None) -> tuple[str, ...]:
    """``FAV_BENCH_DIRECTIONS``: 'fwd,bwd,fwdbwd' (any subset, any order; empty or None: all) -> the
    directions in DIRECTIONS order. ValueError naming the bad entry and the choices."""
    if text is None or not text.strip():
        return DIRECTIONS
    asked = set()
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        part = _DIRECTION_ALIASES.get(part, part)
        if part not in DIRECTIONS:
            raise ValueError(f"FAV_BENCH_DIRECTIONS: unknown direction {part!r} in {text!r}; choose from "
                             f"{','.join(DIRECTIONS)} (comma-separated)")
        asked.add(part)
    if not asked:
        raise ValueError(f"FAV_BENCH_DIRECTIONS names no direction: {text!r}; choose from {','.join(DIRECTIONS)}")
    return tuple(d for d in DIRECTIONS if d in asked)


def direction_flops(shape: "Shape", direction: str = "fwd") -> float:
    """FLOPs of one call of ``direction`` on ``shape`` by the convention (forward x FLOPS_FACTOR)."""
    if direction not in FLOPS_FACTOR:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    return FLOPS_FACTOR[direction] * shape.flops


def bench_group(shape_id: str, direction: str = "fwd") -> str:
    """pytest-benchmark group of a case: 'shape=<id>' for the forward (as before), 'shape=<id> bwd' and
    'shape=<id> fwd+bwd' for the others, so sorted groups keep one shape's directions next to each other."""
    tag = DIRECTION_TAGS[direction]
    return f"shape={shape_id}" + (f" {tag}" if tag else "")


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms > 0 else float("nan")


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


# ------------------------------------------------------------------------------------------------ shapes
@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention problem. ``id`` is a compact, parseable name used in benchmark ids and tables."""
    batch: int
    heads: int
    seqlen_q: int
    head_dim: int
    dtype: str = "bfloat16"
    causal: bool = False
    heads_kv: int | None = None      # None: = heads
    seqlen_k: int | None = None      # None: = seqlen_q

    @property
    def hkv(self) -> int:
        return self.heads if self.heads_kv is None else self.heads_kv

    @property
    def nk(self) -> int:
        return self.seqlen_q if self.seqlen_k is None else self.seqlen_k

    @property
    def itemsize(self) -> int:
        return 2

    @property
    def flops(self) -> float:
        return attention_flops(self.batch, self.heads, self.seqlen_q, self.nk, self.head_dim, self.causal)

    @property
    def input_bytes(self) -> int:
        """Bytes of one (q, k, v) set."""
        return self.itemsize * self.batch * self.head_dim * (self.heads * self.seqlen_q + 2 * self.hkv * self.nk)

    @property
    def id(self) -> str:
        parts = [_DTYPE_SHORT.get(self.dtype, self.dtype), f"d{self.head_dim}", f"N{self.seqlen_q}"]
        if self.nk != self.seqlen_q:
            parts.append(f"Nk{self.nk}")
        parts += [f"B{self.batch}", f"H{self.heads}"]
        if self.hkv != self.heads:
            parts.append(f"Hkv{self.hkv}")
        parts.append("causal" if self.causal else "full")
        return "-".join(parts)

    def __str__(self):
        return self.id

    @classmethod
    def parse(cls, text: str) -> "Shape":
        """Inverse of ``id``: 'bf16-d128-N4096-B4-H16-causal' -> Shape(...)."""
        fields = text.split("-")
        if len(fields) < 5 or fields[-1] not in ("causal", "full"):
            raise ValueError(f"not a shape id: {text!r} (expected like 'bf16-d128-N4096-B4-H16-causal')")
        dtype = _SHORT_DTYPE.get(fields[0], fields[0])
        vals = {}
        for f in fields[1:-1]:
            m = re.fullmatch(r"(d|Nk|N|B|Hkv|H)(\d+)", f)
            if not m:
                raise ValueError(f"not a shape id: {text!r} (bad field {f!r})")
            vals[m.group(1)] = int(m.group(2))
        return cls(batch=vals["B"], heads=vals["H"], seqlen_q=vals["N"], head_dim=vals["d"], dtype=dtype,
                   causal=fields[-1] == "causal", heads_kv=vals.get("Hkv"), seqlen_k=vals.get("Nk"))


# ------------------------------------------------------------------------------------------------ inputs
def cast_half(x32, dtype: str):
    """float32 array (NumPy or CuPy) -> float16 / bfloat16, round to nearest even."""
    import ml_dtypes
    import numpy as np
    if dtype == "float16":
        return x32.astype(np.float16)
    if dtype != "bfloat16":
        raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {dtype!r}")
    try:
        return x32.astype(ml_dtypes.bfloat16)
    except Exception:  # noqa: BLE001 - an array library without a bf16 cast: round the bits ourselves
        bits = x32.view(np.uint32)
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        return rounded.astype(np.uint16).view(ml_dtypes.bfloat16)


def random_inputs(shape: Shape, xp, seed: int = 0):
    """(q, k, v) in flash-attn layout, N(0, 1) entries, of ``shape.dtype``, as arrays of ``xp`` (numpy/cupy)."""
    import numpy as np
    if xp is np:
        rng = np.random.default_rng(seed)
        normal = lambda s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    else:
        rng = xp.random.default_rng(seed)
        normal = lambda s: rng.standard_normal(s, dtype=xp.float32)  # noqa: E731
    q = cast_half(normal((shape.batch, shape.seqlen_q, shape.heads, shape.head_dim)), shape.dtype)
    k = cast_half(normal((shape.batch, shape.nk, shape.hkv, shape.head_dim)), shape.dtype)
    v = cast_half(normal((shape.batch, shape.nk, shape.hkv, shape.head_dim)), shape.dtype)
    return q, k, v


def random_dout(shape: Shape, xp, seed: int = 10_000):
    """An output gradient of q's shape (batch, seqlen_q, heads, head_dim), N(0, 1), of ``shape.dtype``."""
    import numpy as np
    rng = np.random.default_rng(seed) if xp is np else xp.random.default_rng(seed)
    dt = np.float32 if xp is np else xp.float32
    return cast_half(rng.standard_normal((shape.batch, shape.seqlen_q, shape.heads, shape.head_dim), dtype=dt),
                     shape.dtype)


def gpu_dout_sets(shape: Shape, n_sets: int, seed: int = 10_000):
    """``n_sets`` CuPy output gradients for ``shape``, one per input set of ``gpu_input_sets``."""
    import cupy
    return [random_dout(shape, cupy, seed + i) for i in range(n_sets)]


def l2_bytes() -> int:
    """L2 size of the current CUDA device (DEFAULT_L2_BYTES if it cannot be read)."""
    try:
        import cupy
        dev = cupy.cuda.Device()
        return int(cupy.cuda.runtime.getDeviceProperties(dev.id)["l2CacheSize"]) or DEFAULT_L2_BYTES
    except Exception:  # noqa: BLE001
        return DEFAULT_L2_BYTES


def rotation_count(set_bytes: int, l2: int | None = None, free_bytes: int | None = None) -> int:
    """How many input sets to rotate among: together >= L2_FOOTPRINT x L2 and at least 2, within a quarter
    of free device memory, at most MAX_SETS."""
    l2 = DEFAULT_L2_BYTES if l2 is None else l2
    n = max(2, math.ceil(L2_FOOTPRINT * l2 / max(set_bytes, 1)))
    if free_bytes is not None:
        n = min(n, max(1, int(0.25 * free_bytes // max(set_bytes, 1))))
    return max(1, min(n, MAX_SETS))


def gpu_input_sets(shape: Shape, seed: int = 0, n_sets: int | None = None):
    """Several independent (q, k, v) CuPy sets of ``shape`` for L2-busting rotation (see ``rotation_count``)."""
    import cupy
    if n_sets is None:
        free, _ = cupy.cuda.runtime.memGetInfo()
        free += cupy.get_default_memory_pool().free_bytes()
        n_sets = rotation_count(shape.input_bytes, l2_bytes(), free)
    return [random_inputs(shape, cupy, seed + i) for i in range(n_sets)]


# ------------------------------------------------------------------------------------------------ timing
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
    """``FAV_TIMING_REST_S``: seconds the GPU idles before each timed case's warm-up (default 0). The H200 lowers its
    clock under load within ~100 ms (power cap), so a case timed right after a heavy one starts slower than the same
    case after a pause: a rest starts every case from the same idle state (bench/NOTES.md, nineteenth session)."""
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


# ------------------------------------------------------------------------------------------------ device memory
class PeakMemory:
    """Peak bytes held in CuPy's memory pool during a ``with`` block, above what was held when it started.

    ``with PeakMemory() as pm: out = f(...)``; then ``pm.peak`` (bytes). Counts pool allocations only
    (not cuBLAS workspaces or other libraries' own cudaMalloc)."""

    def __enter__(self):
        from cupy.cuda import memory_hook

        outer = self

        class _Hook(memory_hook.MemoryHook):
            name = "fa_variants_peak"

            def malloc_postprocess(self, **kw):
                outer.live += kw["mem_size"]
                outer.peak = max(outer.peak, outer.live)

            def free_postprocess(self, **kw):
                outer.live -= kw["mem_size"]

        self.live = self.peak = 0
        self._hook = _Hook()
        self._hook.__enter__()
        return self

    def __exit__(self, *exc):
        self._hook.__exit__(*exc)
        return False


def nbytes_rounded(*arrays) -> int:
    """Bytes of arrays as CuPy's pool allocates them (rounded up to 512)."""
    return sum(-(-a.nbytes // 512) * 512 for a in arrays if a is not None)


# ------------------------------------------------------------------------------------------------ torch peers
TORCH_BACKENDS = {"torch-flash": "FLASH_ATTENTION", "torch-cudnn": "CUDNN_ATTENTION"}
# The other torch peers: its unfused SDPA (autograd keeps the softmax P), for bench/recompute.py; and FlexAttention
# (torch.nn.attention.flex_attention under torch.compile: a Triton kernel on the GPU; about 2 s of compile a shape
# and direction on the H200, 13 s the first), on by default in `pytest bench`, with --flex in `compare` and
# `bench/devcheck.py`.
FLEX = "torch-flex"
OTHER_TORCH_BACKENDS = {"torch-math": "MATH", FLEX: None}
TORCH_PEERS = (*TORCH_BACKENDS, FLEX)  # what the tables show as torch's, not ours (ratios: TORCH_BACKENDS only)


def peer_names(flex: bool) -> list[str]:
    """The torch peers a table times: SDPA's flash and cuDNN backends, and FlexAttention with ``flex``."""
    return [*TORCH_BACKENDS, *([FLEX] if flex else [])]


@functools.lru_cache(maxsize=1)
def _compiled_flex(torch):
    """flex_attention under torch.compile, one specialization per shape. Dynamo's recompile limit (8 by default)
    would otherwise send the ninth shape of a sweep to eager flex_attention, silently 50x slower (seen on the
    H200: 4-30 TF/s): raise it, and make hitting it an error rather than a fallback."""
    from torch.nn.attention.flex_attention import flex_attention
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 4096))
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True
    return torch.compile(flex_attention, dynamic=False)


def torch_flex_fn(torch, shape: Shape, softmax_scale: float, device: str = "cuda"):
    """A callable (q, k, v) -> out on torch (B, H, N, d) tensors: FlexAttention with this library's conventions,
    causal aligned bottom-right (key j visible to query i iff j <= i + N_k - N_q: a block mask, so fully masked
    blocks are skipped) and GQA by ``enable_gqa``. Compiled by torch.compile on first call (per shape)."""
    from torch.nn.attention.flex_attention import create_block_mask
    block_mask = None
    if shape.causal:
        diag = shape.nk - shape.seqlen_q
        block_mask = create_block_mask(lambda b, h, i, j: j <= i + diag, B=None, H=None, Q_LEN=shape.seqlen_q,
                                       KV_LEN=shape.nk, device=device)
    kwargs = dict(block_mask=block_mask, scale=float(softmax_scale), enable_gqa=shape.hkv != shape.heads)
    flex = _compiled_flex(torch)
    return lambda q, k, v: flex(q, k, v, **kwargs)


def torch_status() -> tuple[object, str]:
    """(torch module, '') when torch with CUDA is importable, else (None, why not)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return None, f"torch is not importable ({type(e).__name__})"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
    except Exception:  # noqa: BLE001
        return None, f"torch {torch.__version__} has no torch.nn.attention.sdpa_kernel (needs torch >= 2.3)"
    if not torch.cuda.is_available():
        return None, "torch has no CUDA device"
    return torch, ""


def torch_sdpa_unsupported(shape: Shape) -> str:
    """Why torch SDPA cannot compute the same thing as our kernels for ``shape`` ('' when it can)."""
    if shape.causal and shape.seqlen_q != shape.nk:
        return ("torch SDPA aligns the causal mask top-left when seqlen_q != seqlen_k; our kernels align it "
                "bottom-right (flash-attn >= 2.1), so the results differ")
    return ""


def as_torch_bhnd(torch, x):
    """CuPy (B, N, H, d) -> torch (B, H, N, d) view, zero-copy through DLPack."""
    try:
        t = torch.from_dlpack(x)
    except Exception:  # noqa: BLE001 - a DLPack without bf16: move the bits and reinterpret
        import numpy as np
        t = torch.from_dlpack(x.view(np.int16)).view(torch.bfloat16 if x.dtype.name == "bfloat16" else torch.float16)
    return t.transpose(1, 2)


def torch_sdpa_fn(torch, peer: str, shape: Shape, softmax_scale: float):
    """A callable (q, k, v) -> out (torch, (B, H, N, d)) running SDPA with one backend forced (``FLEX``:
    FlexAttention), on the current CuPy stream. ``peer`` is a key of TORCH_BACKENDS (or OTHER_TORCH_BACKENDS)."""
    import cupy
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ptr = cupy.cuda.get_current_stream().ptr
    if peer == FLEX:
        flex = torch_flex_fn(torch, shape, softmax_scale, device=f"cuda:{cupy.cuda.Device().id}")

        def flex_on_stream(q, k, v):
            with on_cupy_stream(torch, ptr):
                return flex(q, k, v)

        return flex_on_stream
    backend = getattr(SDPBackend, {**TORCH_BACKENDS, **OTHER_TORCH_BACKENDS}[peer])
    F = torch.nn.functional
    kwargs = dict(is_causal=bool(shape.causal), scale=float(softmax_scale))
    if shape.hkv != shape.heads:
        kwargs["enable_gqa"] = True

    def fn(q, k, v):
        with on_cupy_stream(torch, ptr), sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    return fn


def on_cupy_stream(torch, ptr: int | None = None):
    """A context in which torch's current stream is CuPy's (``ptr``, default: CuPy's current stream), so that
    torch work, and torch events, are ordered with our kernels; no-op when they are the same stream already."""
    if ptr is None:
        import cupy
        ptr = cupy.cuda.get_current_stream().ptr
    if torch.cuda.current_stream().cuda_stream == ptr:
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(ptr))


def torch_leaf_sets(torch, sets, douts=None):
    """[(q, k, v[, dout])] torch (B, H, N, d) views of CuPy input sets, q, k, v detached leaves that require
    grad (zero-copy: they share the CuPy arrays' memory), dout a plain view."""
    out = []
    for i, s in enumerate(sets):
        leaves = tuple(as_torch_bhnd(torch, a).detach().requires_grad_(True) for a in s)
        out.append(leaves + ((as_torch_bhnd(torch, douts[i]),) if douts is not None else ()))
    return out


def torch_sdpa_grad_sets(torch, peer: str, shape: Shape, softmax_scale: float, sets, douts):
    """For timing SDPA's backward alone: [(out, q, k, v, dout)] per input set, where the forward
    ``out = SDPA(q, k, v)`` (backend ``peer`` forced, q, k, v requiring grad) has run once, here, outside any
    timed region; ``out`` holds its autograd graph, which ``torch_grad_fn`` keeps (retain_graph) call after call.
    The backward runs the kernel of the forward's backend (the graph records which)."""
    fwd = torch_sdpa_fn(torch, peer, shape, softmax_scale)
    res = []
    for q, k, v, dout in torch_leaf_sets(torch, sets, douts):
        res.append((fwd(q, k, v), q, k, v, dout))
    return res


def torch_grad_fn(torch, ptr: int | None = None):
    """fn(out, q, k, v, dout) -> (dq, dk, dv): ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)``
    with torch's stream set to CuPy's (``ptr``, default CuPy's current stream), so it is ordered with, and timed
    by, events on that stream. (The backward kernels run on the stream their forward ran on: CuPy's, when the
    forward came from ``torch_sdpa_fn``.)"""
    if ptr is None:
        import cupy
        ptr = cupy.cuda.get_current_stream().ptr

    def fn(out, q, k, v, dout):
        with on_cupy_stream(torch, ptr):
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    return fn


def torch_sdpa_fwdbwd_fn(torch, peer: str, shape: Shape, softmax_scale: float):
    """fn(q, k, v, dout) -> (dq, dk, dv): SDPA's forward (backend ``peer`` forced) then its backward, on CuPy's
    current stream; q, k, v must require grad (``torch_leaf_sets``)."""
    import cupy
    ptr = cupy.cuda.get_current_stream().ptr
    fwd = torch_sdpa_fn(torch, peer, shape, softmax_scale)

    def fn(q, k, v, dout):
        out = fwd(q, k, v)
        with on_cupy_stream(torch, ptr):
            return torch.autograd.grad(out, (q, k, v), dout)

    return fn


# ------------------------------------------------------------------------------------------------ user view
DO_BENCH_ARGS = dict(warmup=25, rep=100, return_mode="median")   # ms of warm-up and of timed calls
MAX_DO_BENCH_FAILURES = 3      # in a row: then stop trying (a missing C compiler for triton's driver would
_DO_BENCH_FAILURES: list = []  # otherwise fail, slowly, in every case of a session)


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


# ------------------------------------------------------------------------------------------------ summaries
@dataclasses.dataclass(frozen=True)
class Timed:
    """One benchmark case's result: the shape, the variant, and its median time by each timer (ms)."""
    shape: Shape
    variant: str
    ms: float                          # EventTimer: pad kernel, inputs rotating through more than L2
    ms_do_bench: float | None = None   # user_view_ms (triton do_bench); None where triton is absent
    direction: str = "fwd"             # "fwd", "bwd" (the backward alone) or "fwdbwd"

    @property
    def flops(self) -> float:
        return direction_flops(self.shape, self.direction)


def speedup(peer_ms, ms) -> float | None:
    """TFLOP/s of a case over its peer's on the same shape (= peer time / case time); None if either is missing."""
    if peer_ms is None or ms is None or not (peer_ms > 0 and ms > 0):
        return None
    return peer_ms / ms


def _peer_key(peer: str) -> str:
    return "over_" + peer.replace("-", "_")          # 'torch-flash' -> 'over_torch_flash'


def peer_ratios(results, case: Timed) -> dict:
    """{'over_torch_flash': x, 'over_torch_flash_do_bench': y, 'over_torch_cudnn': ..., ...}: ``case`` against
    the torch peers among ``results`` on the same shape and in the same direction (a backward against torch's
    backward), by each timer (None where a peer or a time is missing). The bench runs the peers of a shape first,
    so every other case finds them measured on the same inputs."""
    found = {(r.shape.id, r.variant, r.direction): r for r in results}
    out = {}
    for peer in TORCH_BACKENDS:
        p = found.get((case.shape.id, peer, case.direction))
        out[_peer_key(peer)] = speedup(p.ms if p else None, case.ms)
        out[_peer_key(peer) + "_do_bench"] = speedup(p.ms_do_bench if p else None, case.ms_do_bench)
    return out


def _fmt(x, spec: str = ".2f") -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


#: The backward summary's focus: fa2 through the API, and fa2's GPU backward kernel timed directly (the bench's
#: unvalidated ``fa2_bwd_kernel`` case, opt-in) until the API calls it.
BACKWARD_FOCUS = ("fa2", "fa2_bwd_kernel")
_TITLES = {
    "fwd": "forward TFLOP/s (median CUDA-event time; 4BHN^2d, /2 causal)",
    "bwd": "backward TFLOP/s (median CUDA-event time; 2.5 x 4BHN^2d, /2 causal; torch: autograd.grad of SDPA's "
           "output, forward excluded)",
    "fwdbwd": "forward+backward TFLOP/s (median CUDA-event time; 3.5 x 4BHN^2d, /2 causal)",
}


def summary_tables(results, focus=("fa2",),
                   backward_focus=BACKWARD_FOCUS) -> list[tuple[str, list[str], list[list[str]]]]:
    """[(title, headers, rows)] of the end-of-session summary, for each direction that has results (forward,
    backward, forward+backward, in that order):

    1. TFLOP/s of every variant per shape (CUDA-event timer) and each of ours over torch-flash.
    2. For each ``focus`` variant that ran (``backward_focus`` for the backward directions): its TFLOP/s and its
       ratios over torch-flash and torch-cudnn by both timers (event timer and do_bench), one row per shape.
    Ratios compare cases of one shape and one direction; a backward's TFLOP/s counts 2.5x the forward FLOPs."""
    results = list(results)
    tables = []
    for direction in DIRECTIONS:
        these = [r for r in results if r.direction == direction]
        if these:
            tables += _direction_tables(these, direction, focus if direction == "fwd" else backward_focus)
    return tables


def _direction_tables(results, direction: str, focus) -> list:
    tag = DIRECTION_TAGS[direction]
    t = f" {tag}" if tag else ""
    by = {(r.shape.id, r.variant): r for r in results}
    shapes = list(dict.fromkeys(r.shape for r in results))
    seen = list(dict.fromkeys(r.variant for r in results))
    ours = [n for n in seen if n not in TORCH_PEERS]
    names = ours + [n for n in TORCH_PEERS if n in seen]        # ours first, whatever order the cases ran in
    has_flash = "torch-flash" in names
    headers = (["shape"] + [f"{n}{t} TFLOP/s" for n in names]
               + ([f"{n}{t} / flash{t}" for n in ours] if has_flash else []))
    rows = []
    for s in shapes:
        row = [s.id] + [_fmt(tflops(by[s.id, n].flops, by[s.id, n].ms) if (s.id, n) in by else None, ".1f")
                        for n in names]
        if has_flash:
            row += [_fmt(peer_ratios(results, by[s.id, n])["over_torch_flash"] if (s.id, n) in by else None)
                    for n in ours]
        rows.append(row)
    tables = [(_TITLES[direction], headers, rows)]
    what = {"fwd": "", "bwd": " backward", "fwdbwd": " forward+backward"}[direction]
    for v in (f for f in focus if f in names):
        head = ["shape", f"{v}{t} TFLOP/s", f"{v}{t} TFLOP/s do_bench"]
        for peer in TORCH_BACKENDS:
            short = peer.split("-")[1]
            head += [f"{v}{t} / {short}{t}", f"{v}{t} / {short}{t} do_bench"]
        body = []
        for s in shapes:
            r = by.get((s.id, v))
            if r is None:
                continue
            ratios = peer_ratios(results, r)
            db = tflops(r.flops, r.ms_do_bench) if r.ms_do_bench else None
            line = [s.id, _fmt(tflops(r.flops, r.ms), ".1f"), _fmt(db, ".1f")]
            for peer in TORCH_BACKENDS:
                line += [_fmt(ratios[_peer_key(peer)]), _fmt(ratios[_peer_key(peer) + "_do_bench"])]
            body.append(line)
        peers = f"torch SDPA's{what}" if what else "torch SDPA"
        tables.append((f"{v}{what} against {peers} on the same inputs, both timers (X / peer = peer time / X time)",
                       head, body))
    return tables


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A benchmark case that did not run, and why (the bench's backward cases record theirs)."""
    shape: Shape
    variant: str
    direction: str
    reason: str


def skip_lines(skipped) -> list[str]:
    """One line per (direction, variant, reason) among ``skipped``, with how many shapes it covers, in the order
    first seen: 'bwd fa2: skipped on 52 shapes: variant 'fa2' has no GPU backward kernel yet; ...'."""
    counts = {}
    for s in skipped:
        key = (s.direction, s.variant, s.reason)
        counts[key] = counts.get(key, 0) + 1
    out = []
    for (direction, variant, reason), n in counts.items():
        tag = DIRECTION_TAGS[direction] or "fwd"
        out.append(f"{tag} {variant}: skipped on {n} shape{'s' if n != 1 else ''}: {reason}")
    return out
