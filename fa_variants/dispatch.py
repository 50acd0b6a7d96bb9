"""Which variant runs a call, and where: ``variant="auto"`` (the rule is choice.py's), the backends, and the
errors for what cannot run here. ``forward`` and ``backward`` ask this module; it looks at no array data, only
at the dtype, head dim and device the caller has already read.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import arrays, gpu
from .choice import BACKENDS, Choice, choose
from .registry import VARIANTS, Variant, get

AUTO = "auto"


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here (no GPU, or the GPU is too old for the variant)."""


def check_variant(variant) -> None:
    """"auto" or a registry name; a ValueError naming the choices otherwise."""
    if not isinstance(variant, str) or (variant != AUTO and variant not in VARIANTS):
        raise ValueError(f"variant must be 'auto' or one of {sorted(VARIANTS)}, got {variant!r}")


def check_backend(backend) -> None:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")


def resolve_backend(backend: str, variant: Variant, on_gpu: bool) -> str:
    """'cuda' or 'numpy' for a call of ``variant``; never silent about a GPU the variant cannot use."""
    if backend == "numpy":
        return "numpy"
    ok, why = variant.available()
    if backend == "cuda" or on_gpu:
        if not ok:
            raise BackendUnavailable(f"variant {variant.name!r} cannot run on the GPU here: {why}")
        return "cuda"
    return "cuda" if ok else "numpy"  # auto with host arrays: the GPU when usable, else the NumPy model


def auto_choice(direction: str, dtype: str, head_dim: int, on_gpu: bool, backend: str,
                device_cc: int | None = None) -> Choice:
    """choice.choose for this machine's current GPU (or a device of compute capability ``device_cc``), for arrays
    on the GPU or on the host."""
    if device_cc is None:
        probe = gpu.probe()
        device_cc, no_gpu = probe.cc, probe.reason
    else:
        no_gpu = ""
    # GPU arrays are never handed to the NumPy model auto falls back to: for them auto means "a kernel, or say why"
    return choose(direction, device_cc, dtype, head_dim, "cuda" if on_gpu and backend == AUTO else backend,
                  no_gpu=no_gpu)


_REFUSAL = {"dtype": TypeError, "head_dim": ValueError, "device": BackendUnavailable}


def resolve(direction: str, variant: str, dtype: str, head_dim: int, on_gpu: bool, backend: str) -> tuple:
    """(registry entry, "cuda" or "numpy") for a call whose arrays have ``dtype`` and ``head_dim`` and live on
    the GPU or not. An explicitly named variant is checked against the dtype and head dim, then by the backend
    rule above; ``direction="backward"`` asks for its backward kernels or its NumPy backward model."""
    if variant == AUTO:
        c = auto_choice(direction, dtype, head_dim, on_gpu, backend)
        if c.variant is None:
            raise _REFUSAL[c.refused](c.reason)
        return VARIANTS[c.variant], c.backend
    entry = get(variant)
    arrays.check_supported(entry, dtype, head_dim)
    if direction == "forward":
        return entry, resolve_backend(backend, entry, on_gpu)
    where = "numpy"
    if backend == "cuda" or (backend == AUTO and (on_gpu or entry.available()[0])):
        if "backward" not in entry.directions:
            raise BackendUnavailable(f"variant {entry.name!r} has no backward kernel; variant='auto' runs the "
                                     f"fastest backward here on any forward's out and lse")
        where = resolve_backend(backend, entry, on_gpu)
    if where == "numpy" and entry.reference_backward is None:
        raise BackendUnavailable(f"variant {entry.name!r} has no NumPy backward model (and no GPU backward kernel "
                                 f"here); variant='auto' runs the fastest backward here on any forward's out and "
                                 f"lse")
    return entry, where


def backward_variant(forward_variant: str) -> str:
    """The variant whose backward differentiates a forward of ``forward_variant`` under autograd: the same one
    where it has a backward, else "auto" (a backward needs only q, k, v, out and lse)."""
    if forward_variant == AUTO or "backward" not in get(forward_variant).directions:
        return AUTO
    return forward_variant


# ------------------------------------------------------------------------------------------------ explain
@dataclasses.dataclass(frozen=True)
class ChoiceReport:
    """What ``variant="auto"`` runs forward and backward for one kind of call; prints as two lines."""
    forward: Choice
    backward: Choice

    def __repr__(self):
        return f"{self.forward}\n{self.backward}"

    __str__ = __repr__


def explain_choice(q=None, k=None, v=None, *, dtype=None, head_dim: int | None = None, backend: str = "auto",
                   device_cc: int | None = None) -> ChoiceReport:
    """What ``variant="auto"`` picks, and why, forward and backward: for the arrays ``q`` (, ``k``, ``v``) of a
    call, or for ``dtype`` and ``head_dim``; on this machine's current GPU, or on a device of compute capability
    ``device_cc`` (e.g. 80 for an A100, 90 for an H100)::

        >>> fav.explain_choice(dtype="bfloat16", head_dim=128, device_cc=90)
        forward : fa3 (GPU): the fastest forward on compute capability 9.0
        backward: fa3 (GPU): the fastest backward on compute capability 9.0
    """
    check_backend(backend)
    on_gpu = False
    if q is not None:
        inp = arrays.import_arrays(q, q if k is None else k, q if v is None else v)
        arrays.check_dims(inp.q, inp.k, inp.v)
        dtype, head_dim, on_gpu = arrays.common_dtype(inp), int(inp.q.shape[3]), inp.on_gpu
    elif dtype is None or head_dim is None:
        raise TypeError("explain_choice needs q (and k, v) or both dtype and head_dim")
    else:
        dtype = np.dtype(dtype).name
        if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)) or head_dim < 1:
            raise ValueError(f"head_dim must be an int >= 1, got {head_dim!r}")
    if device_cc is not None and (isinstance(device_cc, bool) or not isinstance(device_cc, int) or device_cc < 10):
        raise ValueError(f"device_cc must be a compute capability as an int such as 80 or 90, got {device_cc!r}")
    return ChoiceReport(*(auto_choice(d, dtype, int(head_dim), on_gpu, backend, device_cc)
                          for d in ("forward", "backward")))
