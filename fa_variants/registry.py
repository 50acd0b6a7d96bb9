"""The single source of truth: one entry per attention variant.

Tests, benchmarks and the CLI iterate over ``VARIANTS``; adding a version of the algorithm means adding a
``.cu``, a launcher in ``kernels/`` (an object with the ``kernels.Launcher`` interface), a NumPy model in
``reference/`` and one entry here. Each entry owns everything that describes it: dtypes, head dims, the
directions it offers, the tensors it stores at a size other than the input's (what the IO model's bytes use),
its exact HBM access model, its NumPy model and its launcher. This module imports no array library and never
``api``: ``api`` imports it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from . import gpu, iomodel
from .kernels import Launcher
from .kernels import fa1 as k_fa1
from .kernels import fa2 as k_fa2
from .kernels import fa2_fp8 as k_fa2_fp8
from .kernels import fa3_fp8 as k_fa3_fp8
from .kernels import fa3 as k_fa3
from .kernels import decode as k_decode
from .kernels import naive as k_naive
from .reference import fa1 as ref_fa1
from .reference import fa2 as ref_fa2
from .reference import fa3 as ref_fa3
from .reference import fp8 as ref_fp8
from .reference import naive as ref_naive

HALF_DTYPES = ("float16", "bfloat16")
ALL_HEAD_DIMS = range(1, 257)
DIRECTIONS = ("forward", "backward")


def _dims_text(dims: range) -> str:
    step = f" in steps of {dims.step}" if dims.step != 1 else ""
    return f"{dims.start}..{dims[-1]}{step}"


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    summary: str
    dtypes: tuple[str, ...]
    head_dims: range                   # every head dim accepted (the kernels pad to a few template dims inside)
    min_cc: int                        # minimum compute capability, e.g. 80 for sm_80
    launcher: Launcher                 # the GPU side: forward(), tiles(), compile_units(), extra_bytes()
    reference: Callable                # NumPy model: reference(q, k, v, causal=, softmax_scale=, ...) -> ModelResult
    io_model: Callable                 # exact HBM element accesses per head: io_model(Nq, Nk, d, block_q, block_k)
    tensor_bytes: Mapping[str, int]    # bytes per element of the tensors not stored at the input's itemsize
    loops: str                         # the algorithm's loop structure, as its NumPy model's LOOPS prints it
    directions: tuple[str, ...] = ("forward",)  # what the GPU kernels offer
    reference_backward: Callable | None = None  # NumPy backward model: (dout, q, k, v, out, lse, causal=, ...) -> result
    io_model_backward: Callable | None = None   # exact HBM element accesses per head of the backward
    archs: tuple[str, ...] = ("sm_80", "sm_86", "sm_89", "sm_90a")  # what `fa-variants build` compiles
    operand_dtype: str | None = None   # the tensor cores' operand format when it is not the input's (e4m3)
    max_cc: int | None = None          # the newest compute capability it runs on (sm_90a code runs on sm_90 only)
    pipeline: str | None = None        # the kernel's pipeline (warp roles, barriers, overlap): explain prints it

    def __post_init__(self):
        unknown = set(self.directions) - set(DIRECTIONS)
        if unknown:
            raise ValueError(f"{self.name}: directions must be among {DIRECTIONS}, got {sorted(unknown)}")
        if "backward" in self.directions and getattr(self.launcher, "backward_fn", True) is None:
            raise ValueError(f"{self.name}: directions include 'backward' but its launcher has no backward_fn")

    def available(self) -> tuple[bool, str]:
        """(usable on this machine's current GPU, why not)."""
        p = gpu.probe()
        if not p.ok:
            return False, p.reason
        if p.cc < self.min_cc:
            return False, f"needs compute capability >= {self.min_cc / 10:.1f}, this GPU is {p.cc / 10:.1f}"
        if self.max_cc is not None and p.cc > self.max_cc:
            return False, (f"runs on compute capability {self.min_cc / 10:.1f}"
                           f"{'' if self.max_cc == self.min_cc else f'..{self.max_cc / 10:.1f}'} only (Hopper "
                           f"instructions: sm_90a code does not run on newer GPUs), this GPU is {p.cc / 10:.1f}")
        return True, ""

    def supports(self, dtype: str, head_dim: int) -> bool:
        return dtype in self.dtypes and head_dim in self.head_dims

    @property
    def gpus_text(self) -> str:
        """The GPUs it runs on: "sm_80+", or its archs alone where it has a newest one ("sm_90a only")."""
        return f"sm_{self.min_cc}+" if self.max_cc is None else f"{', '.join(self.archs)} only"

    @property
    def head_dims_text(self) -> str:
        return _dims_text(self.head_dims)

    def element_bytes(self, tensor: str, itemsize: int) -> int:
        """Bytes per element of ``tensor`` in this variant's kernels, for inputs of ``itemsize`` bytes."""
        return self.tensor_bytes.get(tensor, itemsize)

    def hbm_bytes(self, batch, heads, seqlen_q, seqlen_k, head_dim, block_q=None, block_k=None, causal=False,
                  itemsize=2) -> int:
        """Modeled HBM bytes of one call: the exact per-head counts x batch x heads (GQA shares no K/V reads
        between the query heads' programs), each tensor at ``element_bytes``."""
        counts = self.io_model(seqlen_q, seqlen_k, head_dim, block_q, block_k, causal=causal)
        per_head = sum(n * self.element_bytes(t, itemsize) for t, n in counts.items() if t != "total")
        return batch * heads * per_head

    def describe(self) -> str:
        ok, why = self.available()
        here = "runs here" if ok else f"not here: {why}"
        return (f"{self.name:8s} {self.summary}\n{'':8s} dtypes {', '.join(self.dtypes)}; head_dim "
                f"{self.head_dims_text}; {'/'.join(self.directions)}; {self.gpus_text}; {here}")

    def __repr__(self):
        ok, why = self.available()
        return (f"Variant({self.name!r}, dtypes={list(self.dtypes)}, head_dims={self.head_dims_text}, "
                f"directions={list(self.directions)}, min_cc={self.min_cc}, "
                f"available={'yes' if ok else 'no: ' + why})")

    def __str__(self):
        return self.name


class VariantList(list):
    """``fav.variants()``: a list of entries that prints as a readable table."""

    def __repr__(self):
        return "\n".join(v.describe() for v in self)


# The softmax statistics are fp32 everywhere; naive stores S and P in fp32; FA1's O makes its T_c round trips
# through an fp32 workspace (the final half-precision copy of O is outside Algorithm 1 and not modeled);
# fa2_fp8's kernel reads Q, K, V as one-byte e4m3 (the on-the-fly quantization is a separate pass, not modeled).
VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant(
        name="naive",
        summary="standard attention: S = QK^T and P = softmax(S) materialized in device memory (cuBLAS + our softmax)",
        dtypes=HALF_DTYPES, head_dims=ALL_HEAD_DIMS, min_cc=80, launcher=k_naive.LAUNCHER,
        reference=ref_naive.forward, loops=ref_naive.LOOPS, io_model=iomodel.naive_accesses, tensor_bytes={"S": 4, "P": 4},
        reference_backward=ref_naive.backward, io_model_backward=iomodel.naive_backward_accesses,
        directions=("forward", "backward"),
    ),
    Variant(
        name="fa1",
        summary="FlashAttention-1 (Alg. 1): outer loop over K/V blocks, O/l/m round-trip HBM, split-K warps",
        dtypes=HALF_DTYPES, head_dims=ALL_HEAD_DIMS, min_cc=80, launcher=k_fa1.LAUNCHER,
        reference=ref_fa1.forward, loops=ref_fa1.LOOPS, io_model=iomodel.fa1_accesses, tensor_bytes={"O": 4, "l": 4, "m": 4},
        reference_backward=ref_fa1.backward, io_model_backward=iomodel.fa1_backward_accesses,
        directions=("forward", "backward"),
    ),
    Variant(
        name="fa2",
        summary="FlashAttention-2: one CTA per Q block, O in registers, split-Q warps, deferred normalization",
        dtypes=HALF_DTYPES, head_dims=ALL_HEAD_DIMS, min_cc=80, launcher=k_fa2.LAUNCHER,
        reference=ref_fa2.forward, loops=ref_fa2.LOOPS, io_model=iomodel.fa2_accesses, tensor_bytes={"LSE": 4},
        reference_backward=ref_fa2.backward, io_model_backward=iomodel.fa2_backward_accesses,
        directions=("forward", "backward"),
    ),
    Variant(
        name="fa2_fp8",
        summary="FA2 loop order on e4m3 tensor cores, FA3 block scaling (Q/K per block, V per channel), P x256 to e4m3",
        dtypes=HALF_DTYPES, head_dims=range(16, 257, 16), min_cc=89, launcher=k_fa2_fp8.LAUNCHER,
        reference=ref_fp8.forward, loops=ref_fp8.LOOPS, io_model=iomodel.fa2_accesses, archs=("sm_89", "sm_90a"),
        tensor_bytes={"LSE": 4, "Q": 1, "K": 1, "V": 1}, operand_dtype="float8_e4m3fn",
    ),
    Variant(
        name="fa3",
        summary="FlashAttention-3 (Hopper): TMA producer warpgroup, K/V ring on mbarriers, 2 consumer warpgroups "
                "in ping-pong, softmax overlapped with P V",
        dtypes=HALF_DTYPES, head_dims=ALL_HEAD_DIMS, min_cc=90, max_cc=90, launcher=k_fa3.LAUNCHER,
        reference=ref_fa3.forward, loops=ref_fa3.LOOPS, io_model=ref_fa3.accesses, tensor_bytes={"LSE": 4},
        archs=("sm_90a",), pipeline=ref_fa3.PIPELINE,
        reference_backward=ref_fa3.backward, io_model_backward=ref_fa3.backward_accesses,
        directions=("forward", "backward"),
    ),
    Variant(
        name="fa3_fp8",
        summary="fa3's pipeline on e4m3 QGMMA: fa2_fp8's block scales and V^T, P x256 to e4m3 in registers",
        dtypes=HALF_DTYPES, head_dims=range(16, 257, 16), min_cc=90, max_cc=90, launcher=k_fa3_fp8.LAUNCHER,
        reference=ref_fa3.forward_fp8, loops=ref_fa3.LOOPS, io_model=ref_fa3.accesses_fp8, archs=("sm_90a",),
        tensor_bytes={"LSE": 4, "Q": 1, "K": 1, "V": 1}, operand_dtype="float8_e4m3fn", pipeline=ref_fa3.PIPELINE,
    ),
)}


def variants() -> VariantList:
    """Every registry entry; prints as one readable line pair per variant, saying whether it runs here."""
    return VariantList(VARIANTS.values())


def get(name: str) -> Variant:
    """One registry entry by name (a ValueError naming the choices otherwise)."""
    if not isinstance(name, str) or name not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {name!r}")
    return VARIANTS[name]


# The kernels behind calls other than attention(q, k, v): attention_with_kvcache and merge_states (decode.py). They
# are no registry entry (an entry is a forward over q, k, v), but `fa-variants build` and CI compile them as they
# compile the entries' kernels: {name: (compile_units(arch), the archs built)}.
STEP_KERNELS = {"decode": (k_decode.compile_units, ("sm_80", "sm_90a"))}

