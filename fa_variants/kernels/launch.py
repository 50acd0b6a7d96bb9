"""Launch plans: everything about a call that depends only on (variant, shapes, strides, dtype, causal, scale,
device), worked out once and reused, so that a warm call is a dictionary lookup, the output's allocation and
one cuLaunchKernel.

A plan holds the CUfunction, grid, block and dynamic shared memory, and the kernel's parameter struct packed
with everything but the pointers (kernels/params.py). A call copies those bytes, writes the pointers of this
call's q, k, v, output, LSE and workspace into the copy and launches on the caller's current stream: nothing
mutable is shared, so one plan serves any number of threads and streams at once. Plans are per device (the
CUfunction belongs to the device's context).

Two front doors: ``run_cupy`` for CuPy arrays and ``run_torch`` for torch tensors, which never become CuPy
arrays (no DLPack round trip: the pointers are read off the tensors, the output comes from torch's caching
allocator on torch's current stream).
"""
from __future__ import annotations

import ctypes
import dataclasses
import struct

import numpy as np

_LAUNCH = None
_MAX_DYNAMIC_SMEM = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def _driver_launch():
    global _LAUNCH
    if _LAUNCH is None:
        from cupy.cuda import driver
        _LAUNCH = driver.launchKernel
    return _LAUNCH


def function_of(raw_kernel, smem: int) -> int:
    """The CUfunction of a cupy.RawKernel, with its dynamic shared-memory limit raised to ``smem``."""
    from cupy.cuda import driver
    ptr = raw_kernel.kernel.ptr
    if smem > 48 * 1024:
        driver.funcSetAttribute(ptr, _MAX_DYNAMIC_SMEM, smem)
    return ptr


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


def max_active_clusters(func: int, cluster: int, block: int, smem: int) -> int:
    """How many clusters of ``cluster`` CTAs of ``func`` (its cluster size compiled in) the device holds at once
    (cuOccupancyMaxActiveClusters, through ctypes on the driver CuPy loaded; 0 where it cannot say)."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveClusters
    except (OSError, AttributeError):
        return 0
    cfg = _LaunchConfig((cluster, 1, 1), (block, 1, 1), smem, None, None, 0)
    n = ctypes.c_int(0)
    rc = fn(ctypes.byref(n), ctypes.c_void_p(func), ctypes.byref(cfg))
    return n.value if rc == 0 else 0


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte value union at offset 8
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int * 16)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_LAUNCH_EX = []  # [cuLaunchKernelEx, or None where the driver has none]


def launch_argv(func: int, grid: tuple, block: int, smem: int, stream: int, argv, after: bool = False) -> None:
    """cuLaunchKernel of ``func`` with the argument pointer array ``argv``. ``after``: with programmatic stream
    serialization (cuLaunchKernelEx), so the kernel may start before the one ahead of it on the stream ends and must
    call griddep_wait (ptx.cuh) before touching memory; a plain launch where the driver lacks cuLaunchKernelEx (the
    kernel's wait is then a no-op)."""
    if after and not _LAUNCH_EX:
        try:
            _LAUNCH_EX.append(ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx)
        except (OSError, AttributeError):
            _LAUNCH_EX.append(None)
    if not after or _LAUNCH_EX[0] is None:
        _driver_launch()(func, grid[0], grid[1], grid[2], block, 1, 1, smem, stream, ctypes.addressof(argv), 0)
        return
    attr = _LaunchAttribute(_PROGRAMMATIC_STREAM_SERIALIZATION, 0)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    cfg = _LaunchConfig(tuple(grid), (block, 1, 1), smem, stream, ctypes.addressof(attr), 1)
    rc = _LAUNCH_EX[0](ctypes.byref(cfg), ctypes.c_void_p(func), ctypes.c_void_p(ctypes.addressof(argv)), None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")


def launch(func: int, grid: tuple, block: int, smem: int, stream: int, template: bytes, fmt: str, *ptrs: int,
           extra: tuple = (), after: bool = False):
    """One cuLaunchKernel with a by-value struct argument: ``template`` with its leading pointers set to ``ptrs``,
    then the kernel's further arguments ``extra`` (ctypes values). The driver copies the arguments during the
    call, so the buffers may die right after. ``after``: launch_argv's programmatic launch."""
    buf = ctypes.create_string_buffer(template, len(template))
    struct.pack_into(fmt, buf, 0, *ptrs)
    argv = (ctypes.c_void_p * (1 + len(extra)))(ctypes.addressof(buf), *(ctypes.addressof(x) for x in extra))
    launch_argv(func, grid, block, smem, stream, argv, after)


@dataclasses.dataclass(frozen=True)
class FwdPlan:
    """One 16-bit forward (fa1 or fa2) for one call signature. Pointer order: params.FWD.pointers."""
    func: int
    grid: tuple
    block: int
    smem: int
    template: bytes           # FwdParams with zero pointers
    fmt: str                  # struct format of the leading pointers
    out_shape: tuple
    dtype: np.dtype
    lse_shape: tuple | None   # None: the LSE is not written (the kernel checks for null)
    ws_rows: int              # fa1: rows of the O / l / m workspace (0: none); ws_cols: D
    ws_cols: int
    device: int

    def _ws_ptrs(self, base: int) -> tuple:
        if not self.ws_rows:
            return 0, 0, 0
        o_bytes = self.ws_rows * self.ws_cols * 4
        return base, base + o_bytes, base + o_bytes + self.ws_rows * 4

    @property
    def ws_floats(self) -> int:
        return self.ws_rows * (self.ws_cols + 2)

    def run_cupy(self, q, k, v):
        empty, stream = _cupy()
        out = empty(self.out_shape, self.dtype)
        lse = None if self.lse_shape is None else empty(self.lse_shape, np.float32)
        ws = empty(self.ws_floats, np.float32) if self.ws_rows else None
        launch(self.func, self.grid, self.block, self.smem, stream().ptr, self.template,
               self.fmt, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, 0 if lse is None else lse.data.ptr,
               *self._ws_ptrs(0 if ws is None else ws.data.ptr))
        return out, lse

    def run_torch(self, q, k, v):
        torch, stream_of = _torch()
        dev = q.device
        out = torch.empty(self.out_shape, dtype=q.dtype, device=dev)
        lse = None if self.lse_shape is None else torch.empty(self.lse_shape, dtype=torch.float32, device=dev)
        ws = torch.empty(self.ws_floats, dtype=torch.float32, device=dev) if self.ws_rows else None
        launch(self.func, self.grid, self.block, self.smem, stream_of(self.device), self.template, self.fmt,
               q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr(),
               *self._ws_ptrs(0 if ws is None else ws.data_ptr()))
        return out, lse


_CUPY = None
_TORCH = None


def _cupy():
    """(cupy.empty, cupy.cuda.get_current_stream), bound once: a warm call should not pay for imports."""
    global _CUPY
    if _CUPY is None:
        import cupy
        _CUPY = (cupy.empty, cupy.cuda.get_current_stream)
    return _CUPY


def _torch():
    """(torch, the raw handle of torch's current stream on a device index): torch's own C getter when it has
    one (a public-API stream object costs microseconds a call)."""
    global _TORCH
    if _TORCH is None:
        import torch
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _TORCH = (torch, raw if raw is not None else (lambda i: torch.cuda.current_stream(i).cuda_stream))
    return _TORCH
