"""The problem a command runs: the Shape its flags ask for, checked exactly as ``fav.attention`` checks it, and
the CPU-sized version of it that the NumPy models run without a GPU (unless --full-size)."""
from __future__ import annotations

import argparse
import dataclasses
import math

import ml_dtypes
import numpy as np

from .. import arrays
from ..registry import Variant
from ..timing.shapes import Shape
from .args import SHAPE_DEFAULTS

# Without a GPU the NumPy models run a scaled-down version of the shape (unless --full-size) when it exceeds
# either budget: B*H*Nq*Nk*d (the models' arithmetic: about a second for all four variants at the limit) and
# B*H*Nq*Nk (naive's model holds a few float64 arrays of the scores).
CPU_WORK_BUDGET = 2**29
CPU_SCORES_BUDGET = 2**23
_HALF = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def default_heads(heads_kv: int | None) -> int:
    """16, or the smallest multiple of --heads-kv that is at least 16."""
    base = SHAPE_DEFAULTS["heads"]
    return base if heads_kv is None else heads_kv * math.ceil(base / heads_kv)


def shape_from_args(args: argparse.Namespace) -> Shape:
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else SHAPE_DEFAULTS[name]  # noqa: E731
    heads = args.heads if args.heads is not None else default_heads(args.heads_kv)
    return Shape(batch=pick("batch"), heads=heads, seqlen_q=pick("seqlen"), head_dim=pick("head_dim"),
                 dtype=args.dtype, causal=bool(args.causal), heads_kv=args.heads_kv, seqlen_k=args.seqlen_k)


def explicit_shape(args: argparse.Namespace) -> bool:
    """Whether a shape flag was given (else the default shape runs)."""
    return any(getattr(args, n, None) is not None for n in ("batch", "heads", "heads_kv", "seqlen", "seqlen_k", "head_dim"))


def describe(shape: Shape) -> str:
    s = f"B={shape.batch}, H={shape.heads}, N={shape.seqlen_q}, d={shape.head_dim}"
    if shape.hkv != shape.heads:
        s += f", H_kv={shape.hkv}"
    if shape.nk != shape.seqlen_q:
        s += f", N_k={shape.nk}"
    return s


def refusal(entry: Variant, shape: Shape) -> str:
    """'' when ``fav.attention`` takes ``shape`` for ``entry``, else its own error message.

    The check is attention()'s: ``arrays.check_shapes`` on zero-stride NumPy stand-ins of q, k, v (no memory)."""
    for name, val in (("batch", shape.batch), ("heads", shape.heads), ("heads_kv", shape.hkv),
                      ("seqlen", shape.seqlen_q), ("seqlen_k", shape.nk), ("head_dim", shape.head_dim)):
        if val < 1:
            return f"{name} must be >= 1, got {val}"
    if shape.dtype not in _HALF:
        return f"variant {entry.name!r} accepts dtypes {list(entry.dtypes)}, got {shape.dtype}"
    dt = np.dtype(_HALF[shape.dtype])

    def stand_in(n, h):
        return np.lib.stride_tricks.as_strided(np.zeros(shape.head_dim, dt), (shape.batch, n, h, shape.head_dim),
                                               (0, 0, 0, dt.itemsize), writeable=False)

    try:
        inp = arrays.Inputs(stand_in(shape.seqlen_q, shape.heads), stand_in(shape.nk, shape.hkv),
                            stand_in(shape.nk, shape.hkv), on_gpu=False, wrap=None)
        arrays.check_shapes(inp, entry)
    except (TypeError, ValueError) as e:
        return str(e)
    return ""


def validate(command: str, chosen: list[Variant], shape: Shape, explicit: bool) -> tuple[list[Variant], list[str]]:
    """The variants that take ``shape``, and notes on those left out. A variant named with --variants that
    ``fav.attention`` would refuse ends the command (one line, non-zero exit); from the default list it is
    left out with a note, unless none is left."""
    if shape.heads % shape.hkv:
        raise SystemExit(f"fa-variants {command}: --heads ({shape.heads}) must be a multiple of --heads-kv ({shape.hkv})")
    kept, notes, refused = [], [], []
    for entry in chosen:
        why = refusal(entry, shape)
        if not why:
            kept.append(entry)
        elif explicit:
            raise SystemExit(f"fa-variants {command}: fav.attention refuses this shape: {why}")
        else:
            refused.append(why)
            notes.append(f"{entry.name} not run: {why}")
    if not kept:
        text = f"fa-variants {command}: no variant takes this shape: {'; '.join(refused)}"
        raise SystemExit(text if len(text) <= 300 else text[:297] + "...")
    return kept, notes


def fits_cpu(shape: Shape) -> bool:
    scores = shape.batch * shape.heads * shape.seqlen_q * shape.nk
    return scores * shape.head_dim <= CPU_WORK_BUDGET and scores <= CPU_SCORES_BUDGET


def cpu_sized(shape: Shape) -> Shape:
    """``shape`` when the NumPy models can run it in about a second, else a smaller problem of the same kind:
    batch 1, a few heads (GQA kept as GQA), Nq and Nk halved together; head_dim, dtype and causality kept."""
    if fits_cpu(shape):
        return shape
    group = shape.heads // shape.hkv
    hkv = 1 if group > 1 else min(shape.hkv, 2)
    heads = hkv * min(group, 4)
    nq, nk = shape.seqlen_q, shape.nk

    def make(nq, nk):
        return dataclasses.replace(shape, batch=1, heads=heads, heads_kv=None if hkv == heads else hkv,
                                   seqlen_q=nq, seqlen_k=None if nk == nq else nk)

    while not fits_cpu(make(nq, nk)) and max(nq, nk) > 1:
        nq, nk = max(1, (nq + 1) // 2), max(1, (nk + 1) // 2)
    return make(nq, nk)


def numpy_run_line(args: argparse.Namespace, asked: Shape, shape: Shape, why: str, models: str) -> str:
    """The first line of a comparison without a GPU: which NumPy ``models`` run at which shape, and why no GPU."""
    lead = "--numpy" if why == "forced by --numpy" else "no CUDA GPU"
    reason = "" if lead == "--numpy" else f" [{why}]"
    if shape == asked:
        which = "the requested" if explicit_shape(args) else "the default"
        return f"{lead}: running the {models} at {which} size ({describe(shape)}){reason}"
    return (f"{lead}: running the {models} at a CPU-sized shape ({describe(shape)}) instead of {describe(asked)} "
            f"(--full-size runs that, slowly){reason}")
