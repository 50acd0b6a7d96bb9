"""The single source of truth: one entry per attention variant.

Tests, benchmarks and the CLI iterate over ``VARIANTS``; adding a version of the algorithm means adding a
``.cu``, a launcher in ``kernels/``, a NumPy model in ``reference/`` and one entry here.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Callable

from . import iomodel
from .reference import fa1 as ref_fa1
from .reference import fa2 as ref_fa2
from .reference import fp8 as ref_fp8
from .reference import naive as ref_naive

HALF_DTYPES = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    summary: str
    dtypes: tuple[str, ...]
    head_dims: tuple[int, ...] | None  # None: any head dim
    min_cc: int                        # minimum compute capability, e.g. 80 for sm_80
    launcher: str                      # module in fa_variants.kernels with forward(), tiles(), specializations()
    reference: Callable                # NumPy model: reference(q, k, v, causal=, softmax_scale=, ...) -> ModelResult
    io_model: Callable                 # closed-form HBM element accesses per head: io_model(Nq, Nk, d, block_q, block_k)
    archs: tuple[str, ...] = ("sm_80", "sm_86", "sm_89", "sm_90a")  # what `fa-variants build` compiles
    operand_dtype: str | None = None   # the tensor cores' operand format when it is not the input's (e4m3)

    @property
    def kernels(self):
        """The launcher module (imported lazily: it needs CuPy only when it launches)."""
        return importlib.import_module(f"fa_variants.kernels.{self.launcher}")

    def available(self) -> tuple[bool, str]:
        """(usable on this machine's current GPU, why not)."""
        cc = _device_cc()
        if isinstance(cc, str):
            return False, cc
        if cc < self.min_cc:
            return False, f"needs compute capability >= {self.min_cc / 10:.1f}, this GPU is {cc / 10:.1f}"
        return True, ""

    def forward(self, q, k, v, *, causal=False, softmax_scale=None, return_lse=False):
        """Run this variant's GPU kernel (validated like ``fa_variants.attention``)."""
        from .api import attention
        return attention(q, k, v, variant=self.name, causal=causal, softmax_scale=softmax_scale,
                         return_lse=return_lse, backend="cuda")

    def supports(self, dtype: str, head_dim: int) -> bool:
        return dtype in self.dtypes and (self.head_dims is None or head_dim in self.head_dims)

    def __str__(self):
        return self.name


@functools.lru_cache(maxsize=1)
def _device_cc():
    """Compute capability of the current CUDA device as an int (90), or a string saying why there is none."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - any import failure means "no CuPy"
        return f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
        return int(cupy.cuda.Device().compute_capability)
    except Exception as e:  # noqa: BLE001 - no driver, no device
        return f"no usable CUDA device ({type(e).__name__})"


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant(
        name="naive",
        summary="standard attention: S = QK^T and P = softmax(S) materialized in device memory (cuBLAS + our softmax)",
        dtypes=HALF_DTYPES, head_dims=None, min_cc=80, launcher="naive",
        reference=ref_naive.forward, io_model=iomodel.naive_accesses,
    ),
    Variant(
        name="fa1",
        summary="FlashAttention-1 (Alg. 1): outer loop over K/V blocks, O/l/m round-trip HBM, split-K warps",
        dtypes=HALF_DTYPES, head_dims=(32, 64, 96, 128, 256), min_cc=80, launcher="fa1",
        reference=ref_fa1.forward, io_model=iomodel.fa1_accesses,
    ),
    Variant(
        name="fa2",
        summary="FlashAttention-2: one CTA per Q block, O in registers, split-Q warps, deferred normalization",
        dtypes=HALF_DTYPES, head_dims=(32, 64, 96, 128, 256), min_cc=80, launcher="fa2",
        reference=ref_fa2.forward, io_model=iomodel.fa2_accesses,
    ),
    Variant(
        name="fa2_fp8",
        summary="FA2 loop order on e4m3 tensor cores, FA3 block scaling (Q/K per block, V per channel), P x256 to e4m3",
        dtypes=HALF_DTYPES, head_dims=(64, 128, 256), min_cc=89, launcher="fa2_fp8",
        reference=ref_fp8.forward, io_model=iomodel.fa2_accesses, archs=("sm_89", "sm_90a"),
        operand_dtype="float8_e4m3fn",
    ),
)}


def variants() -> list[Variant]:
    return list(VARIANTS.values())


def get(name: str) -> Variant:
    if not isinstance(name, str) or name not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {name!r}")
    return VARIANTS[name]
