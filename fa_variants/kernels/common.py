"""What the launchers share: dtype dispatch, template head dims and padding, 16-byte alignment, the packed
parameter struct, tile choice."""
from __future__ import annotations

import functools

from .. import arrays, gpu, jit, plans
from ..tiles import TEMPLATE_DIMS, first_fitting, template_dim  # noqa: F401 - the launchers import them from here

LOG2E = 1.4426950408889634
CTYPE = {"float16": "fav::Half", "bfloat16": "fav::BFloat16"}


def ensure_vector_aligned(a):
    """The kernels copy 16 bytes at a time: pointer and outer strides must be multiples of 8 elements.
    Anything else (rare: odd slicing) is copied once into a fresh, aligned array; the caller's array is untouched.
    (A copy, not ascontiguousarray: that returns an already-contiguous array with a misaligned base as it is.)"""
    return a if arrays.aligned_for_vector_loads(a) else a.copy()


def negated(a):
    """-a for a 16-bit CuPy array by its sign bits: exact, and a NaN stays NaN (a negative softmax_scale runs as a
    positive one on a negated q: every kernel takes each row's max over the raw scores and scales it)."""
    import cupy
    return (a.view(cupy.uint16) ^ cupy.uint16(0x8000)).view(a.dtype)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# The kernels load 16-byte rows: a head dim that is not a multiple of 8 is copied once into rows padded to the next
# multiple of 8 (pad_last_dim), as flash-attn does. Any d <= 256 then runs on its next template head dim
# (fa_variants/tiles.py), the extra columns zero-filled on load and never stored.
PAD_SOURCE = "pad_head_dim.cu"
PAD_ROWS = 8
PAD_THREADS = (128, 256)  # one thread per column: the smallest CTA that covers the padded row
PAD_INSTANCES = tuple(f"pad_head_dim<{t}, {PAD_ROWS}>" for t in PAD_THREADS)


def pad_last_dim(a, width: int):
    """A zero-padded contiguous copy of the (B, N, H, d) 16-bit array ``a`` with rows of ``width`` elements (q, k,
    v of a head dim that is not a multiple of 8, or fa2_fp8's rows under a wider template), in one pass of
    cuda_src/pad_head_dim.cu. Zeros add nothing to Q K^T, and the padded columns of P V are never returned."""
    import cupy
    from .launch import launch
    from .params import PAD
    key = (a.shape, a.strides, a.dtype, width, cupy.cuda.runtime.getDevice())
    if key not in _PAD_PLANS:
        _PAD_PLANS[key] = _pad_plan(a, width)
    func, grid, threads, template = _PAD_PLANS[key]
    out = cupy.empty(a.shape[:3] + (width,), dtype=a.dtype)
    launch(func, grid, threads, 0, cupy.cuda.get_current_stream().ptr, template, PAD.pointers_format,
           a.data.ptr, out.data.ptr)
    return out


#: The launchers' plans live in the one plan cache (fa_variants/plans.py), each launcher's keys under its own
#: ``plans.Owner``; fav.clear_plans() empties it.
def plan_cache(name: str = "launcher") -> plans.Owner:
    return plans.Owner(name)


def cached_plan(cache: plans.Owner, key, make):
    """The plan of ``key`` among ``cache``'s (a ``plan_cache()``), made by ``make()`` on a miss."""
    return plans.cached((cache, key), make)


_PAD_PLANS: dict = {}   # (shape, strides, dtype, width, device) -> (CUfunction, grid, threads, PadParams bytes)
_FWD_PLANS = plan_cache()  # forward_via_plan's plans of padded or copied inputs, per signature


def _pad_plan(a, width: int):
    from .launch import function_of
    from .params import PAD
    b, n, h, d = a.shape
    rows = b * n * h
    if rows >= 2**31:
        raise ValueError(f"batch * seqlen * heads = {rows} rows is more than the padding copy indexes (2^31)")
    s = elem_strides(a)
    template = PAD.pack(src=0, dst=0, s_b=s[0], s_n=s[1], s_h=s[2], rows=rows, seqlen=n, heads=h, head_dim=d,
                        width=width)
    threads = next(t for t in PAD_THREADS if t >= width)
    func = function_of(jit.kernel(PAD_SOURCE, f"pad_head_dim<{threads}, {PAD_ROWS}>", PAD_INSTANCES), 0)
    return func, (cdiv(rows, PAD_ROWS), 1, 1), threads, template


def elem_strides(a) -> tuple:
    """Element strides (batch, seqlen, head) of a (B, N, H, d) CuPy array."""
    return tuple(s // a.dtype.itemsize for s in a.strides[:3])


def fwd_params(q, k, v, *, head_dim: int, causal: bool, softmax_scale: float, out_strides: tuple,
               kv_blocks=(0, None), tail=None) -> bytes:
    """FwdParams (cuda_src/common/params.cuh) for aligned q, k, v, all pointers zero: a launch fills them; given
    the split tail's (tail_tiles, tail_blocks, tail_ranges), fa3's Fa3FwdParams."""
    from .params import FA3_FWD, FWD, KV_BLOCKS_ALL
    extra = {} if tail is None else dict(tail_tiles=tail[0], tail_blocks=tail[1], tail_ranges=tail[2])
    b, nq, h, _ = q.shape
    qs, ks, vs = elem_strides(q), elem_strides(k), elem_strides(v)
    return (FWD if tail is None else FA3_FWD).pack(q=0, k=0, v=0, o=0, lse=0, o_ws=0, l_ws=0, m_ws=0,
                    q_b=qs[0], q_n=qs[1], q_h=qs[2], k_b=ks[0], k_n=ks[1], k_h=ks[2], v_b=vs[0], v_n=vs[1],
                    v_h=vs[2], o_b=out_strides[0], o_n=out_strides[1], o_h=out_strides[2], batch=b, seqlen_q=nq,
                    seqlen_k=k.shape[1], heads=h, group=h // k.shape[2], head_dim=head_dim,
                    kv_block_begin=kv_blocks[0],
                    kv_block_end=KV_BLOCKS_ALL if kv_blocks[1] is None else kv_blocks[1],
                    scale_log2=scale_log2(softmax_scale), causal=int(bool(causal)), **extra)


def forward_via_plan(make_plan, q, k, v, *, causal, softmax_scale, return_lse):
    """The 16-bit forwards' ``forward``: copy what cannot be launched on as it is (misaligned, or a head dim
    not a multiple of 8, padded), then run the plan on CuPy arrays. Padded outputs come back as a view of
    their first head_dim columns."""
    d = q.shape[3]
    if d % 8:
        d8 = round_up(d, 8)
        q, k, v = (pad_last_dim(a, d8) for a in (q, k, v))
    else:
        q, k, v = (ensure_vector_aligned(a) for a in (q, k, v))
    import cupy
    key = (make_plan, *(x for a in (q, k, v) for x in (a.shape, a.strides)), q.dtype, causal, softmax_scale,
           return_lse, cupy.cuda.runtime.getDevice())
    plan = cached_plan(_FWD_PLANS, key, lambda: make_plan(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                                          return_lse=return_lse))
    out, lse = plan.run_cupy(q, k, v)
    return (out[..., :d] if d % 8 else out), lse


def scale_log2(softmax_scale: float) -> float:
    """softmax_scale * log2(e), the kernels' score scale in log2 units. A scale of 0 becomes float32's smallest
    normal number: the kernels multiply masked scores (-inf) by it, and -inf * 0 is NaN, while any finite score
    times 2^-126 leaves an exponent that rounds to 0 (every visible key weighs the same, as a scale of 0 means)."""
    return softmax_scale * LOG2E if softmax_scale != 0 else 2.0 ** -126  # float32 tiny


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_grid(n: int, what: str):
    if n > 65535:
        raise ValueError(f"{what} = {n} exceeds the CUDA grid limit of 65535")


SM90_SMEM = 227 * 1024  # opt-in shared memory per block: sm_90 227 KB, sm_80 163 KB, sm_86/89 99 KB
# The same by compute capability, for tiles picked for a device other than this one (`explain --device-cc`)
SMEM_BY_CC = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: SM90_SMEM}


# device -> its streaming multiprocessors, asked once per device (Device.attributes queries every attribute the
# device has, hundreds of microseconds); the tests cut a device's count here to run a grid on fewer SMs
SMS: dict = {}


def sm_count(device: int | None = None) -> int:
    """Streaming multiprocessors of ``device`` (default: the current one): what persistent grids are sized to."""
    import cupy
    device = cupy.cuda.runtime.getDevice() if device is None else int(device)
    if device not in SMS:
        SMS[device] = int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])
    return SMS[device]


KERNELS = ("wgmma", "mma_sync")  # fa2's and fa2_fp8's two kernels: Hopper's, and the one every sm_80+ GPU runs


def wgmma_device() -> bool:
    """Whether this device runs fa2's and fa2_fp8's wgmma kernels: sm_90 (and no device at all: the IO model
    describes the H200)."""
    cc = gpu.compute_capability()
    return cc is None or cc == 90


def choose_kernel(kernel: str | None, device_runs_wgmma: bool) -> str:
    """``kernel`` ("wgmma" or "mma_sync", checked), or where None the one this device runs."""
    if kernel is None:
        return "wgmma" if device_runs_wgmma else "mma_sync"
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS} or None, got {kernel!r}")
    return kernel


def given_tile(tile, kind: type):
    """A tile passed to a launcher (``plan(tile=...)``: a sweep's), checked to be the kernel's named tuple
    (fa_variants/tiles.py ``kind``); None (the table's) stays None."""
    if tile is not None and not isinstance(tile, kind):
        raise TypeError(f"tile must be a fa_variants.tiles.{kind.__name__} or None, got {tile!r}")
    return tile


def smem_limit() -> int:
    """Opt-in shared memory per block of the current device (the sm_90 figure when there is none)."""
    try:
        import cupy
        return _smem_limit_of(cupy.cuda.runtime.getDevice())
    except Exception:  # noqa: BLE001 - no device: describe the H200 configuration
        return SM90_SMEM


@functools.lru_cache(maxsize=None)
def _smem_limit_of(device: int) -> int:
    # Once per device: Device.attributes queries every attribute the device has, hundreds of microseconds.
    import cupy
    return int(cupy.cuda.Device(device).attributes["MaxSharedMemoryPerBlockOptin"])


def pick_tiles(candidates, smem_bytes, head_dim: int, limit: int | None = None):
    """The first tile of ``candidates[head_dim]`` (fastest first) whose shared memory fits ``limit`` (default: the
    current device's)."""
    return first_fitting(candidates[head_dim], smem_bytes, head_dim, smem_limit() if limit is None else limit)
