"""``variant="auto"``: the fastest correct shipped kernel for a device, dtype, head dim and direction.

The rule, in one place: walk ``FASTEST_FIRST`` and take the first variant whose registry entry offers the
direction, runs on the device's compute capability (``min_cc`` .. ``max_cc``) and takes the dtype and head dim.
Today that is fa3 on sm_90a (compute capability 9.0), forward and backward (its backward launcher runs fa2's
Hopper kernels where its own does not apply: head dims above 128, keys beyond 128 per SM), and fa2 elsewhere
(sm_80+). A backward needs only q, k, v, out and lse, so it may come from another variant than the forward. The
fp8 variants are never chosen: e4m3 operands are a precision a caller asks for by name. Without a usable GPU (or with ``backend="numpy"``) the choice is ``NUMPY_MODEL``'s NumPy
model, which follows the kernel's blocks in O(N) memory.

A call with a window, softcap, sinks, ALiBi or a packed batch (varlen.py) runs a masked kernel: the forward the
first of ``MASKED_FORWARD`` that runs on the device (``masked_forward``), and the backward of the same variant
(fa3's masked backward runs fa2's masked passes where its own does not apply, as its plain one does).

This module looks at no array: ``dispatch`` hands it the device, dtype and head dim of a call.
"""
from __future__ import annotations

import dataclasses

from .registry import DIRECTIONS, VARIANTS, Variant

BACKENDS = ("auto", "cuda", "numpy")
#: The exact (16-bit operand) variants, fastest first on every GPU where several run (docs/results.md has the
#: measurements). A new exact variant takes its place here; one missing from this list is never chosen.
FASTEST_FIRST = ("fa3", "fa2", "fa1", "naive")
#: The NumPy model auto runs without a GPU.
NUMPY_MODEL = "fa2"
#: The variants with a masked GPU forward and backward (kernels/fa3_masked.py, kernels/fa2_masked.py), fastest first.
MASKED_FORWARD = ("fa3", "fa2")


@dataclasses.dataclass(frozen=True)
class Choice:
    """What ``auto`` runs for one direction: ``variant`` on ``backend``, and why; or, when nothing can run,
    ``variant`` None and ``refused`` naming what stood in the way ("dtype", "head_dim" or "device")."""
    direction: str
    variant: str | None
    backend: str | None     # "cuda" or "numpy"
    reason: str
    refused: str | None = None

    def __str__(self):
        if self.variant is None:
            return f"{self.direction:8s}: nothing: {self.reason}"
        where = "GPU" if self.backend == "cuda" else "NumPy model"
        return f"{self.direction:8s}: {self.variant} ({where}): {self.reason}"


def _cc_text(cc: int) -> str:
    return f"{cc // 10}.{cc % 10}"


def why_not(entry: Variant, direction: str, device_cc: int, dtype: str, head_dim: int) -> str | None:
    """Why ``entry`` cannot run ``direction`` on this device, dtype and head dim (None: it can)."""
    if direction not in entry.directions:
        return f"no {direction}"
    if device_cc < entry.min_cc or (entry.max_cc is not None and device_cc > entry.max_cc):
        if entry.max_cc is None:
            return f"needs compute capability {_cc_text(entry.min_cc)}+"
        span = _cc_text(entry.min_cc) if entry.max_cc == entry.min_cc else \
            f"{_cc_text(entry.min_cc)}..{_cc_text(entry.max_cc)}"
        return f"runs on compute capability {span} only"
    if dtype not in entry.dtypes:
        return f"takes {', '.join(entry.dtypes)}"
    if head_dim not in entry.head_dims:
        return f"takes head_dim {entry.head_dims_text}"
    return None


def masked_forward(device_cc: int | None) -> str:
    """The variant whose masked forward ``variant="auto"`` runs on a device of compute capability ``device_cc``
    (fa3's on sm_90a; fa2's, the last, on every other sm_80+ device and without one)."""
    for name in MASKED_FORWARD[:-1]:
        entry = VARIANTS[name]
        if device_cc is not None and entry.min_cc <= device_cc and (entry.max_cc is None or device_cc <= entry.max_cc):
            return name
    return MASKED_FORWARD[-1]


def _unsupported(direction: str, dtype: str, head_dim: int) -> Choice | None:
    """The refusal when no candidate takes ``dtype`` or ``head_dim`` at all (on any device), else None."""
    offer = [VARIANTS[n] for n in FASTEST_FIRST if direction in VARIANTS[n].directions]
    names = ", ".join(e.name for e in offer)
    dtypes = sorted({t for e in offer for t in e.dtypes})
    if dtype not in dtypes:
        return Choice(direction, None, None, f"variant 'auto' runs {names}, which accept dtypes {dtypes}, got "
                      f"{dtype}", "dtype")
    if not any(e.supports(dtype, head_dim) for e in offer):
        dims = sorted({e.head_dims_text for e in offer if dtype in e.dtypes})
        return Choice(direction, None, None, f"variant 'auto' runs {names}, which accept head_dim in "
                      f"{' or '.join(dims)} for {dtype}, got {head_dim}", "head_dim")
    return None


def _model(direction: str, dtype: str, head_dim: int, why: str) -> Choice:
    """NUMPY_MODEL's NumPy model, or why it cannot take these inputs."""
    entry = VARIANTS[NUMPY_MODEL]
    if (entry.reference if direction == "forward" else entry.reference_backward) is None:
        return Choice(direction, None, None, f"{why}, and {NUMPY_MODEL}, which variant 'auto' runs then, has no "
                      f"NumPy {direction} model", "device")
    if not entry.supports(dtype, head_dim):
        return Choice(direction, None, None, f"{why}, and {NUMPY_MODEL}'s NumPy model, which variant 'auto' runs "
                      f"then, takes {', '.join(entry.dtypes)} at head_dim {entry.head_dims_text}, not {dtype} at "
                      f"{head_dim}", "dtype" if dtype not in entry.dtypes else "head_dim")
    return Choice(direction, NUMPY_MODEL, "numpy", f"{why}: {NUMPY_MODEL}'s NumPy model (float64, the kernel's "
                  "blocks, O(N) memory)")


def choose(direction: str, device_cc: int | None, dtype: str, head_dim: int, backend: str = "auto",
           no_gpu: str = "no usable GPU") -> Choice:
    """What ``variant="auto"`` runs for ``direction`` ("forward" or "backward") on a device of compute capability
    ``device_cc`` (an int such as 90; None: no usable GPU, ``no_gpu`` says why), for inputs of ``dtype`` (a NumPy
    dtype name) and ``head_dim``, under ``backend`` ("auto", "cuda" or "numpy").

    With backend "auto" and a GPU that runs no candidate, the choice is the NumPy model (right for host arrays;
    ``dispatch`` refuses GPU arrays then)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {list(DIRECTIONS)}, got {direction!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    unsupported = _unsupported(direction, dtype, head_dim)
    if unsupported is not None:
        return unsupported
    if backend == "numpy":
        return _model(direction, dtype, head_dim, "backend='numpy'")
    if device_cc is None:
        if backend == "cuda":
            return Choice(direction, None, None, f"backend='cuda', but {no_gpu}", "device")
        return _model(direction, dtype, head_dim, no_gpu)
    passed = []
    for name in FASTEST_FIRST:
        no = why_not(VARIANTS[name], direction, device_cc, dtype, head_dim)
        if no is None:
            reason = f"the fastest {direction} on compute capability {_cc_text(device_cc)}"
            return Choice(direction, name, "cuda", reason + (f"; passed over {', '.join(passed)}" if passed else ""))
        passed.append(f"{name} ({no})")
    why = f"no kernel runs the {direction} on compute capability {_cc_text(device_cc)}: {', '.join(passed)}"
    if backend == "auto":
        return _model(direction, dtype, head_dim, why)
    return Choice(direction, None, None, why, "device")
