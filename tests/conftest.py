"""Shared test machinery: the ONE place tolerances live, the GPU gate, random inputs and a float64 reference.

The reference here (``reference64``) is written directly from the definition of attention and imports nothing
from ``fa_variants``: the kernels and the library's NumPy models are both checked against it.

Seeds: every random input comes from a generator whose seed is recorded on the test (and printed in a failed
test's report); set ``FA_VARIANTS_SEED=<n>`` to replay a run.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import sys
import traceback
from typing import NamedTuple

import ml_dtypes
import numpy as np
import pytest

# --------------------------------------------------------------------------------------------------------------
# Tolerances: fa_variants/tolerances.py (shared with bench/devcheck.py), with why each is what it is.
from fa_variants.tolerances import (FP8_MODEL_LSE_ATOL, FP8_MODEL_TO_FLOAT64, FP8_MODEL_TOL, GRAD_TOL,  # noqa: E402,F401
                                    LSE_ATOL, LSE_ATOL_FP8, LSE_RTOL, TOL)

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}


# --------------------------------------------------------------------------------------------------------------
# The GPU gate.
@functools.lru_cache(maxsize=1)
def has_gpu() -> bool:
    """CuPy importable and at least one CUDA device usable (the library's one probe)."""
    from fa_variants import gpu
    return gpu.available()


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The test command runs on every logical CPU, with pytest-xdist (the ``test`` extra): compiling every kernel
    instance (test_jit.py) is most of the suite's time. ``-n N`` or ``-n 0`` (one process) on the command line win.
    Every GPU test is in the xdist group "gpu" (pytest_collection_modifyitems), which --dist loadgroup runs in one
    worker. Set here, not in pyproject's addopts, which `pytest bench` reads too: benchmarks need one process
    (pytest-benchmark switches itself off under xdist)."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    if hasattr(config, "workerinput"):
        # A worker parses the command line again, without the --dist set below, and would not group: where the
        # command line names no --dist, the controller chose loadgroup.
        if not any(a in ("--dist", "-d") or a.startswith("--dist=") for a in config.invocation_params.args):
            config.option.loadgroup = True
        return
    if config.option.numprocesses is None:
        config.option.numprocesses = "logical"
    if config.option.dist == "no":
        config.option.dist = "loadgroup"
    if config.option.numprocesses not in (0, "0"):
        # A worker per CPU, each with a BLAS and OpenMP pool as wide as the machine (NumPy's models, torch), would
        # put CPUs x CPUs threads on the CPUs: the workers inherit one thread each unless the caller chose.
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "model: needs the variant's NumPy model in fa_variants/reference")


def pytest_itemcollected(item):
    """Under pytest-xdist (--dist loadgroup, set above) every GPU test runs in one worker, one after another: tests
    in parallel processes would share one device's memory and SMs, and the NaN-poisoned pools and memory checks
    assume no other test allocates meanwhile. Marked as each test is collected: xdist's worker reads the groups in
    its own pytest_collection_modifyitems, which runs before this initial conftest's. (pytest-xdist 3.8 groups by
    rewriting Item._nodeid, which pytest 9 no longer reads: the test extra keeps pytest below 9.)"""
    if item.get_closest_marker("gpu") is not None:
        item.add_marker(pytest.mark.xdist_group("gpu"))


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)


# JAX on a GPU takes 75 % of the device's memory at its first call and keeps what it frees in its own pool; these
# make it allocate what it needs and give it back, as CuPy's and torch's pools do when emptied (release_device_memory)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")


# --------------------------------------------------------------------------------------------------------------
# Device memory: every GPU test gives back what it allocated, so that a whole suite fits where each file does.
# A full garbage collection, with torch and JAX loaded, costs more than most GPU tests' own work, and arrays kept
# alive by reference cycles are rare: after a test it runs only where the device's free memory has fallen more than
# _SLACK below what it was after the last one (docs/tools.md).
_SLACK = 1 << 30
_after_last_collection: list = []  # the device's free bytes after the last full collection


def _empty_pools() -> None:
    import cupy
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def release_device_memory(full: bool = True) -> None:
    """Free what finished work left on the current device: the library's cached launch plans (a plan can hold
    buffers, taken from whichever pool was current when it was made, a test's poisoned pool included, which that
    buffer then keeps alive whole), arrays kept by the last failed test's traceback, then CuPy's default and pinned
    pools and torch's caching allocator; and arrays kept by reference cycles (a full collection) where ``full``, or
    where the free memory has not come back within _SLACK. What stays is small and bounded: loaded modules, and the
    per-stream buffers of kernels/fa3.py (the largest split tail asked for, and a tile counter)."""
    import cupy
    import fa_variants

    cupy.cuda.Device().synchronize()
    fa_variants.clear_plans()
    tb = getattr(sys, "last_traceback", None)
    if tb is not None:  # pytest keeps the last failure here (for post-mortem debugging): its frames hold arrays
        traceback.clear_frames(tb)
    _empty_pools()
    if full or not _after_last_collection or device_free_bytes() < _after_last_collection[-1] - _SLACK:
        gc.collect()
        _empty_pools()
        _after_last_collection[:] = [device_free_bytes()]


def device_free_bytes() -> int:
    """Free memory on the current device, as the driver counts it (every process's allocations included)."""
    import cupy
    return int(cupy.cuda.runtime.memGetInfo()[0])


@pytest.fixture(autouse=True)
def _release_device_memory_after_gpu_tests(request):
    yield
    if request.node.get_closest_marker("gpu") is not None and has_gpu():
        release_device_memory(full=False)


# --------------------------------------------------------------------------------------------------------------
# Seeds.
def new_seed() -> int:
    env = os.environ.get("FA_VARIANTS_SEED")
    return int(env) if env else int(np.random.SeedSequence().entropy % (2**63))


@pytest.fixture
def rng(request):
    """A fresh generator per test; its seed is recorded and printed if the test fails."""
    seed = new_seed()
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        seeds = [str(v) for k, v in item.user_properties if k == "seed"]
        if seeds:
            report.sections.append(("fa-variants random seed",
                                    f"seed(s) {', '.join(seeds)}; replay with FA_VARIANTS_SEED={seeds[0]}"))


# --------------------------------------------------------------------------------------------------------------
# Arrays.
def _xp_module(xp):
    if xp is None or xp == "cupy":
        import cupy
        return cupy
    if xp == "numpy":
        return np
    return xp


def to_host(a) -> np.ndarray:
    """NumPy view/copy of a NumPy, CuPy or torch array (values unchanged, dtype kept where NumPy has it)."""
    if isinstance(a, np.ndarray):
        return a
    mod = type(a).__module__.split(".")[0]
    if mod == "cupy":
        import cupy
        return cupy.asnumpy(a)
    if mod == "torch":
        import torch
        t = a.detach().cpu()
        if t.dtype == torch.bfloat16:  # NumPy has no bf16: go through the raw bits
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(a)


def place(a: np.ndarray, xp=None, strided=False, role: str = "q"):
    """Put host array ``a`` (B, N, H, d) on ``xp`` with a given memory layout and the same values.

    strided=False: C-contiguous. strided=True (or "aligned"): a non-contiguous view whose last dimension is
    contiguous and whose strides stay multiples of 16 bytes: q is a (B, H, N, d) buffer transposed to
    (B, N, H, d); k and v are slices of a packed (B, N, 2, H, d + 8) buffer (flash-attn's kvpacked layout with
    padded rows). strided="unaligned": views of a (B, N, H, d + 1) buffer: every row starts at an odd element.
    strided="offset": C-contiguous, but starting one element into its buffer (a base that is not 16-byte aligned).
    """
    xp = _xp_module(xp)
    if not strided:
        return xp.asarray(np.ascontiguousarray(a))
    if strided == "offset":
        buf = xp.asarray(np.concatenate([np.zeros(1, a.dtype), a.ravel()]))
        view = buf[1:].reshape(a.shape)
        ptr = view.ctypes.data if xp is np else view.data.ptr
        assert view.flags.c_contiguous and ptr % 16
        return view
    b, n, h, d = a.shape
    if strided == "unaligned":
        buf = np.zeros((b, n, h, d + 1), a.dtype)
        buf[..., 1:] = a
        dev = xp.asarray(buf)
        view = dev[..., 1:]
    elif role == "q":
        dev = xp.asarray(np.ascontiguousarray(a.transpose(0, 2, 1, 3)))
        view = dev.transpose(0, 2, 1, 3)
    else:
        buf = np.zeros((b, n, 2, h, d + 8), a.dtype)
        slot = 0 if role == "k" else 1
        buf[:, :, slot, :, :d] = a
        buf[:, :, 1 - slot, :, :d] = -a  # the neighbour slot holds other values: reading it gives wrong answers
        dev = xp.asarray(buf)
        view = dev[:, :, slot, :, :d]
    assert not view.flags.c_contiguous and view.strides[3] == a.dtype.itemsize
    return view


def random_qkv_host(rng, batch, seqlen_q, seqlen_k, heads, heads_kv, d, dtype, scale=1.0):
    """N(0, 1) * scale inputs on the host, rounded to ``dtype``."""
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype

    def one(n, h):
        x = rng.standard_normal((batch, n, h, d), dtype=np.float32) * np.float32(scale)
        return x.astype(dt)

    return one(seqlen_q, heads), one(seqlen_k, heads_kv), one(seqlen_k, heads_kv)


def make_qkv(batch, seqlen_q, seqlen_k, heads, heads_kv, d, dtype, scale=1.0, strided=False, xp="cupy", *, rng):
    """Random N(0, 1) * scale q (B, Nq, H, d), k, v (B, Nk, Hkv, d) of ``dtype`` on ``xp`` (see ``place``)."""
    host = random_qkv_host(rng, batch, seqlen_q, seqlen_k, heads, heads_kv, d, dtype, scale)
    return tuple(place(a, xp, strided, role) for a, role in zip(host, ("q", "k", "v")))


@pytest.fixture(name="make_qkv")
def make_qkv_fixture(rng):
    """``make_qkv(batch, seqlen_q, seqlen_k, heads, heads_kv, d, dtype, scale=1.0, strided=False, xp=cupy)``."""
    return functools.partial(make_qkv, rng=rng)


# --------------------------------------------------------------------------------------------------------------
# The float64 reference and the comparisons.
def reference64(q, k, v, causal=False, scale=None):
    """Dense float64 attention, straight from the definition: (out (B, Nq, H, d), lse (B, H, Nq)).

    Causal masking is bottom-right aligned: query i sees keys j <= i + Nk - Nq. A query that sees no key gets
    out = 0 and lse = -inf. Head h of q reads head h // (H / Hkv) of k and v.
    """
    q, k, v = (to_host(a).astype(np.float64) for a in (q, k, v))
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    group = h // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = np.zeros((b, nq, h, d))
    lse = np.full((b, h, nq), -np.inf)
    last = np.arange(nq) + (nk - nq)              # last visible key of each query row (causal)
    visible = np.arange(nk)[None, :] <= last[:, None]
    for bi in range(b):
        for hi in range(h):
            kh, vh = k[bi, :, hi // group], v[bi, :, hi // group]
            s = (q[bi, :, hi] @ kh.T) * scale
            if causal:
                s = np.where(visible, s, -np.inf)
            m = s.max(axis=1)
            m = np.where(np.isfinite(m), m, 0.0)
            p = np.exp(s - m[:, None])
            l = p.sum(axis=1)
            seen = l > 0
            o = (p @ vh) / np.where(seen, l, 1.0)[:, None]
            out[bi, :, hi] = np.where(seen[:, None], o, 0.0)
            with np.errstate(divide="ignore"):
                lse[bi, hi] = np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)
    return out, lse


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN anywhere in ``out`` gives NaN, which fails every bound)."""
    o = to_host(out).astype(np.float64)
    r = to_host(ref).astype(np.float64)
    assert o.shape == r.shape, f"shape {o.shape} != reference shape {r.shape}"
    nr = np.linalg.norm(r)
    assert nr > 0, "reference is all zeros: such a comparison cannot fail"
    return float(np.linalg.norm(o - r) / nr)


def assert_matches(out, ref_out, dtype, lse=None, ref_lse=None, what=""):
    """``out`` within TOL[dtype] of ``ref_out`` with no NaN/inf; ``lse`` close where finite, -inf exactly where not.
    ``dtype`` names the precision of the tensor-core operands: the input dtype, or float8_e4m3fn for fa2_fp8."""
    o = to_host(out).astype(np.float64)
    assert np.isfinite(o).all(), f"{what}: output has {int((~np.isfinite(o)).sum())} non-finite elements"
    err = rel_err(o, ref_out)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3e} > {TOL[dtype]:.1e} ({dtype})"
    lse_atol = LSE_ATOL_FP8 if dtype == "float8_e4m3fn" else LSE_ATOL
    empty = ~np.isfinite(ref_lse) if ref_lse is not None else None
    if empty is not None and empty.any():  # rows that see no key: exact zeros (b, h, nq) -> (b, nq, h)
        rows = o.transpose(0, 2, 1, 3)[empty]
        assert (rows == 0).all(), f"{what}: rows with no visible key are not zero"
    if lse is None:
        return
    lh = to_host(lse)
    assert lh.dtype == np.float32, f"{what}: lse dtype {lh.dtype}, expected float32"
    assert lh.shape == ref_lse.shape, f"{what}: lse shape {lh.shape}, expected {ref_lse.shape}"
    lh = lh.astype(np.float64)
    assert not np.isnan(lh).any(), f"{what}: lse has NaN"
    assert np.array_equal(np.isneginf(lh), empty), (
        f"{what}: lse is -inf at {int(np.isneginf(lh).sum())} rows, the reference at {int(empty.sum())}")
    fin = ~empty
    diff = np.abs(lh[fin] - ref_lse[fin])
    bound = lse_atol + LSE_RTOL * np.abs(ref_lse[fin])
    assert (diff <= bound).all(), f"{what}: lse off by up to {diff.max():.3e} (bound {lse_atol:.0e} + {LSE_RTOL:.0e}|lse|)"


# ------------------------------------------------------------------------------------------------ GPU cases
class Case(NamedTuple):
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_kv: int
    head_dim: int
    causal: bool
    strided: bool | str = False

    @property
    def id(self):
        s = f"B{self.batch}-Nq{self.seqlen_q}-Nk{self.seqlen_k}-H{self.heads}-Hkv{self.heads_kv}-d{self.head_dim}"
        s += "-causal" if self.causal else "-full"
        return s + ("" if not self.strided else "-strided" if self.strided is True else f"-{self.strided}")



def to_device(host, strided=False):
    return tuple(place(a, "cupy", strided, role) for a, role in zip(host, ("q", "k", "v")))


def _poison_bytes(case: Case, free: int) -> int:
    """The poisoned block for a call on ``case``: twice what it may allocate, where half the free memory allows
    that, and never less than what it may allocate (more than that comes from fresh, unpoisoned memory)."""
    b, nq, nk, h, d = case.batch, case.seqlen_q, case.seqlen_k, case.heads, case.head_dim
    need = 64 * 2**20 + 4 * b * h * nq * nk + 16 * b * h * (nq + nk) * d  # naive's fp32 S and fp32 copies
    return max(need, min(2 * need, free // 2))


@pytest.fixture
def poisoned():
    """``with poisoned(case): out = attention(...)`` runs the call on a fresh CuPy memory pool whose only free
    memory is one block of all-ones bytes (NaN as fp16, bf16, fp32 and e4m3), so every array the call allocates
    starts as NaN. (Emptying the default pool is not enough: it keeps split blocks it cannot release, and its
    best fit hands those out first.) The pools stay alive until the test ends, with the arrays they hold."""
    import cupy
    pools = []

    @contextlib.contextmanager
    def poison(case: Case):
        pool = cupy.cuda.MemoryPool()
        pools.append(pool)
        free = device_free_bytes()
        nbytes = _poison_bytes(case, free)
        if nbytes > free:
            pytest.fail(f"{case.id}: the poisoned pool needs {nbytes / 2**30:.2f} GiB, {free / 2**30:.2f} GiB is "
                        f"free; CuPy's default pool holds {cupy.get_default_memory_pool().total_bytes() / 2**30:.2f} "
                        "GiB (the rest is held elsewhere: torch, another process, or arrays kept alive)")
        block = pool.malloc(nbytes)
        cupy.ndarray((nbytes,), cupy.uint8, memptr=block).fill(0xFF)
        cupy.cuda.Device().synchronize()
        del block
        with cupy.cuda.using_allocator(pool.malloc):
            yield

    yield poison
    cupy.cuda.Device().synchronize()
    for pool in pools:  # blocks still in use (a cached plan's buffers) go when release_device_memory drops them
        pool.free_all_blocks()
