"""``fa-variants``: compare the variants on this machine, explain their HBM traffic, build every kernel, profile
their DRAM traffic.

    fa-variants compare [--batch 4 --heads 16 --seqlen 4096 --head-dim 128 --dtype bfloat16 --causal ...] [--backward]
    fa-variants explain fa2 [--seqlen 4096 --head-dim 128] [--paper-blocks [--sram 32768] | --blocks 128x64] [--backward]
    fa-variants build [--arch 80,86,89,90a] [--variants fa1,fa2]
    fa-variants profile [shape flags of compare] [--variants fa2]     (needs a GPU and Nsight Compute's ncu)

The report goes to stdout; progress lines go to stderr. ``python -m fa_variants.cli`` works without installing.
One shape means the same problem with and without a GPU: without one, ``compare`` runs the NumPy models, scaled
down to a CPU-sized version of that shape unless ``--full-size`` (the first line says which shape ran).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import math
import os
import sys
import time
import traceback
from typing import Sequence

import ml_dtypes
import numpy as np
from tabulate import tabulate

from . import __version__, arrays, gpu, iomodel, jit
from .timing import events, inputs, memory, shapes, torch_peers
from .api import BackendUnavailable, attention
from .backward import attention_backward
from .reference.common import DEFAULT_SRAM, paper_blocks
from .reference.dense import array_module, attention64, pick_pairs, reference_backward, rel_error, to_float64
from .registry import VARIANTS, Variant, get, variants

# One default shape, with and without a GPU (what `fa-variants compare` means does not depend on the machine).
SHAPE_DEFAULTS = dict(batch=4, heads=16, seqlen=4096, head_dim=128)
GPU_SHAPE = SHAPE_DEFAULTS  # (the name older code used)
# Without a GPU the NumPy models run a scaled-down version of the shape (unless --full-size) when it exceeds
# either budget: B*H*Nq*Nk*d (the models' arithmetic: about a second for all four variants at the limit) and
# B*H*Nq*Nk (naive's model holds a few float64 arrays of the scores).
CPU_WORK_BUDGET = 2**29
CPU_SCORES_BUDGET = 2**23
REF_FLOP_BUDGET_GPU = 2e12      # float64 FLOPs spent on the reference before falling back to a subset of heads
REF_FLOP_BUDGET_CPU = 2e10
# explain runs the NumPy model once; more (B_r x B_c) block pairs than this would take minutes in Python loops
EXPLAIN_MAX_BLOCK_PAIRS = 1 << 18
# failures that are a statement about the problem size, not a bug: reported in the table, exit code stays 0
EXPECTED_FAILURES = (MemoryError,)
_HALF = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
_CUDA_MODULES = ("cupy", "cupy_backends", "cuda", "fastrlock")
_INSTALL_HINT = 'install CuPy with the cuda extra: pip install "fa-variants[cuda12]" (or [cuda13] for a CUDA 13 driver)'


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _err_text(e: BaseException, limit: int = 160) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _parse_variants(text: str | None, command: str = "compare") -> list[Variant]:
    if not text:
        return list(variants())
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise SystemExit(f"fa-variants {command}: unknown variant(s) {unknown or [text]}; choose from {sorted(VARIANTS)}")
    return [get(n) for n in names]


def _fmt(x, spec: str, missing: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return missing
    return format(x, spec)


# ------------------------------------------------------------------------------------------------ argument types
def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    parse.__name__ = f"int>={minimum}"
    return parse


_positive = _int_at_least(1)
_non_negative = _int_at_least(0)


def _blocks_arg(text: str) -> tuple[int, int]:
    """'128x64' (or 128,64) -> (128, 64)."""
    parts = text.lower().replace(",", "x").split("x")
    try:
        b_r, b_c = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BRxBC such as 128x64, got {text!r}") from None
    if b_r < 1 or b_c < 1:
        raise argparse.ArgumentTypeError(f"block sizes must be >= 1, got {text!r}")
    return b_r, b_c


# ------------------------------------------------------------------------------------------------ blocks
@dataclasses.dataclass(frozen=True)
class Blocks:
    """The one block-size choice of ``compare``, ``explain`` and ``profile`` for the IO model (and the NumPy
    models): each kernel's tiles (default), the paper's blocks for ``sram`` elements, or ``given`` for all."""
    mode: str = "kernel"                      # "kernel" | "paper" | "given"
    sram: int = DEFAULT_SRAM
    given: tuple[int, int] | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Blocks":
        if getattr(args, "blocks", None):
            return cls("given", args.sram, tuple(args.blocks))
        return cls("paper" if getattr(args, "paper_blocks", False) else "kernel", args.sram)

    def pick(self, entry: Variant, head_dim: int, causal: bool = False) -> tuple[tuple[int | None, int | None], str]:
        """((B_r, B_c), source) for ``entry`` at ``head_dim`` (and mask): source is "kernel", "paper", "given", "fallback"
        (the paper's, because the launcher has no tiles at this head dim) or "untiled" (blocks (None, None))."""
        if _untiled(entry, head_dim):
            return (None, None), "untiled"
        if self.mode == "given":
            return self.given, "given"
        if self.mode == "paper":
            return paper_blocks(self.sram, head_dim), "paper"
        try:
            b_r, b_c = entry.launcher.tiles(head_dim, causal)
        except Exception:  # noqa: BLE001 - a head dim the launcher has no tiles for (yet): the paper's, said so
            return paper_blocks(self.sram, head_dim), "fallback"
        return (int(b_r), int(b_c)), "kernel"

    def source_text(self, source: str, entry: Variant, head_dim: int) -> str:
        """Where ``pick``'s blocks come from, in words."""
        where = "this GPU" if gpu.available() else "an H200 (no GPU here)"
        return {
            "kernel": f"{entry.name}'s kernel tiles at d={head_dim}, as its launcher picks them on {where}",
            "paper": f"the paper's blocks for M={self.sram} elements (B_c = ceil(M/4d), B_r = min(B_c, d))",
            "given": "given by --blocks",
            "fallback": f"the paper's blocks for M={self.sram} elements: {entry.name}'s launcher has no tiles "
                        f"at d={head_dim}",
            "untiled": f"none: {entry.name} does not tile",
        }[source]

    def describe(self) -> str:
        """The choice for every variant, in words (the notes under compare's and profile's tables)."""
        if self.mode == "given":
            return f"B_r x B_c = {self.given[0]}x{self.given[1]} for every tiled variant (--blocks)"
        if self.mode == "paper":
            return (f"the paper's blocks for M = {self.sram} elements: B_c = ceil(M/4d), B_r = min(B_c, d) "
                    f"(--paper-blocks)")
        where = "this GPU" if gpu.available() else "an H200 (no GPU here)"
        return (f"each kernel's tiles, as its launcher picks them on {where} (the paper's blocks where a "
                f"launcher has none); --paper-blocks (with --sram) or --blocks BRxBC for others")


_SOURCE_TAG = {"kernel": "", "untiled": "", "paper": " (paper)", "given": " (--blocks)",
               "fallback": " (paper: no kernel tiles)"}


def _untiled(entry: Variant, head_dim: int) -> bool:
    try:
        return tuple(entry.launcher.tiles(head_dim)) == (None, None)
    except Exception:  # noqa: BLE001
        return False


def _blocks_text(blocks) -> str:
    return "—" if blocks is None or blocks[0] is None else f"{blocks[0]}x{blocks[1]}"


def _add_block_args(p: argparse.ArgumentParser, sram_help: str) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--paper-blocks", action="store_true",
                   help="the IO model with the paper's blocks for --sram instead of each kernel's tiles")
    g.add_argument("--blocks", type=_blocks_arg, metavar="BRxBC",
                   help="the IO model with these blocks (e.g. 128x64) instead of each kernel's tiles")
    p.add_argument("--sram", type=_positive, default=getattr(iomodel, "DEFAULT_SRAM", DEFAULT_SRAM),
                   help=sram_help + " (default %(default)s)")


# ------------------------------------------------------------------------------------------------ shapes
def _default_heads(heads_kv: int | None) -> int:
    """16, or the smallest multiple of --heads-kv that is at least 16."""
    base = SHAPE_DEFAULTS["heads"]
    return base if heads_kv is None else heads_kv * math.ceil(base / heads_kv)


def _shape_from_args(args: argparse.Namespace) -> shapes.Shape:
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else SHAPE_DEFAULTS[name]  # noqa: E731
    heads = args.heads if args.heads is not None else _default_heads(args.heads_kv)
    return shapes.Shape(batch=pick("batch"), heads=heads, seqlen_q=pick("seqlen"), head_dim=pick("head_dim"),
                        dtype=args.dtype, causal=bool(args.causal), heads_kv=args.heads_kv, seqlen_k=args.seqlen_k)


def _explicit_shape(args: argparse.Namespace) -> bool:
    return any(getattr(args, n, None) is not None for n in ("batch", "heads", "heads_kv", "seqlen", "seqlen_k", "head_dim"))


def _describe(shape: shapes.Shape) -> str:
    s = f"B={shape.batch}, H={shape.heads}, N={shape.seqlen_q}, d={shape.head_dim}"
    if shape.hkv != shape.heads:
        s += f", H_kv={shape.hkv}"
    if shape.nk != shape.seqlen_q:
        s += f", N_k={shape.nk}"
    return s


def refusal(entry: Variant, shape: shapes.Shape) -> str:
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


def _validate(command: str, chosen: list[Variant], shape: shapes.Shape, explicit: bool) -> tuple[list[Variant], list[str]]:
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


def _cost(shape: shapes.Shape) -> tuple[int, int]:
    scores = shape.batch * shape.heads * shape.seqlen_q * shape.nk
    return scores * shape.head_dim, scores


def _fits_cpu(shape: shapes.Shape) -> bool:
    work, scores = _cost(shape)
    return work <= CPU_WORK_BUDGET and scores <= CPU_SCORES_BUDGET


def cpu_sized(shape: shapes.Shape) -> shapes.Shape:
    """``shape`` when the NumPy models can run it in about a second, else a smaller problem of the same kind:
    batch 1, a few heads (GQA kept as GQA), Nq and Nk halved together; head_dim, dtype and causality kept."""
    if _fits_cpu(shape):
        return shape
    group = shape.heads // shape.hkv
    hkv = 1 if group > 1 else min(shape.hkv, 2)
    heads = hkv * min(group, 4)
    nq, nk = shape.seqlen_q, shape.nk

    def make(nq, nk):
        return dataclasses.replace(shape, batch=1, heads=heads, heads_kv=None if hkv == heads else hkv,
                                   seqlen_q=nq, seqlen_k=None if nk == nq else nk)

    while not _fits_cpu(make(nq, nk)) and max(nq, nk) > 1:
        nq, nk = max(1, (nq + 1) // 2), max(1, (nk + 1) // 2)
    return make(nq, nk)


# ------------------------------------------------------------------------------------------------ compare
def _modeled_hbm(entry: Variant, shape: shapes.Shape, blocks) -> float | None:
    try:
        bq, bk = blocks
        return entry.hbm_bytes(shape.batch, shape.heads, shape.seqlen_q, shape.nk, shape.head_dim,
                               bq, bk, shape.causal, shape.itemsize)
    except Exception:  # noqa: BLE001 - no model for this variant (yet): leave the cell empty
        return None


def cmd_compare(args: argparse.Namespace) -> int:
    if getattr(args, "backward", False):
        return _compare_backward(args)
    if args.dtype == "fp8":  # the FP8 comparison: the fp8 variants on bf16 inputs (quantized on the fly) beside
        args.dtype = "bfloat16"  # the bf16 ones (fa3 and fa3_fp8 listed as unavailable off Hopper)
        args.variants = args.variants or "fa2,fa3,fa2_fp8,fa3_fp8"
    chosen = _parse_variants(args.variants)
    why_no_gpu = "forced by --numpy" if args.numpy else gpu.reason()
    if why_no_gpu:
        return _compare_numpy(args, chosen, why_no_gpu)
    return _compare_gpu(args, chosen)


def _compare_numpy(args: argparse.Namespace, chosen: list[Variant], why: str) -> int:
    asked = _shape_from_args(args)
    chosen, notes = _validate("compare", chosen, asked, explicit=bool(args.variants))
    shape = asked if args.full_size else cpu_sized(asked)
    blocks = Blocks.from_args(args)
    lead = "--numpy" if why == "forced by --numpy" else "no CUDA GPU"
    reason = "" if lead == "--numpy" else f" [{why}]"
    if shape == asked:
        which = "the requested" if _explicit_shape(args) else "the default"
        print(f"{lead}: running the NumPy models at {which} size ({_describe(shape)}){reason}")
    else:
        print(f"{lead}: running the NumPy models at a CPU-sized shape ({_describe(shape)}) instead of "
              f"{_describe(asked)} (--full-size runs that, slowly){reason}")
    print(f"dtype {shape.dtype}, {'causal (bottom-right)' if shape.causal else 'not causal'}; "
          f"the models compute in float64 on the CPU")
    q, k, v = inputs.random_inputs(shape, np, seed=args.seed)
    scale = 1.0 / math.sqrt(shape.head_dim)
    pairs = pick_pairs(shape.batch, shape.heads, shape.seqlen_q, shape.nk, shape.head_dim, REF_FLOP_BUDGET_CPU)
    ref, _ = attention64(q, k, v, causal=shape.causal, scale=scale, pairs=pairs)
    rows, failed = [], False
    for i, entry in enumerate(chosen, 1):
        _progress(f"[{i}/{len(chosen)}] {entry.name} (NumPy model)")
        (b_r, b_c), source = blocks.pick(entry, shape.head_dim, shape.causal)
        try:
            kw = {} if b_r is None else dict(block_q=b_r, block_k=b_c)
            t0 = time.perf_counter()
            res = entry.reference(q, k, v, causal=shape.causal, softmax_scale=scale, **kw)
            wall = (time.perf_counter() - t0) * 1e3
            err = rel_error(res.out, ref, pairs)
            counted = res.hbm.total
            used = getattr(res, "blocks", None) or (None, None)
            try:
                per_head = entry.io_model(shape.seqlen_q, shape.nk, shape.head_dim, *used, causal=shape.causal)
                formula = per_head["total"] * shape.batch * shape.heads
            except Exception:  # noqa: BLE001
                formula = None
            blk = _blocks_text(used) + ("" if used[0] is None else _SOURCE_TAG[source])
            rows.append([entry.name, blk, f"{wall:.1f}", f"{err:.1e}", f"{counted / 1e6:.3f}",
                         _fmt(None if formula is None else formula / 1e6, ".3f", "n/a")])
        except Exception as e:  # noqa: BLE001
            failed |= not isinstance(e, EXPECTED_FAILURES)
            if args.verbose:
                traceback.print_exc()
            rows.append([entry.name, "", "", f"error: {_err_text(e)}", "", ""])
    print(tabulate(rows, headers=["variant", "blocks B_r x B_c", "time (CPU, ms)", "rel. error",
                                  "HBM accesses counted (M elem.)", "formula (M elem.)"],
                   tablefmt="github", disable_numparse=True))
    notes = [
        "time: wall clock of the NumPy model on the CPU (not a GPU number)",
        "rel. error: ||out - ref|| / ||ref|| against a direct float64 computation on the same inputs"
        + _subset_note(pairs, shape),
        "HBM accesses: element reads + writes the model counts (every batch and head), beside the closed-form "
        "count of fa_variants.iomodel; `fa-variants explain <variant>` shows the breakdown",
        f"blocks: {blocks.describe()}",
    ] + notes
    _print_notes(notes)
    return 1 if failed else 0


def _subset_note(pairs, shape: shapes.Shape) -> str:
    total = shape.batch * shape.heads
    if len(pairs) == total:
        return ""
    return (f"; computed on {len(pairs)} of the {total} (batch, head) pairs, evenly spaced "
            f"(the full float64 reference would cost too much)")


def _print_notes(notes: Sequence[str]) -> None:
    for i, n in enumerate(notes, 1):
        print(f"  [{i}] {n}")


def _compare_gpu(args: argparse.Namespace, chosen: list[Variant]) -> int:
    import cupy

    shape = _shape_from_args(args)
    chosen, skipped = _validate("compare", chosen, shape, explicit=bool(args.variants))
    blocks = Blocks.from_args(args)
    dev = cupy.cuda.Device()
    print(f"GPU: {gpu.probe().name} (compute capability {dev.compute_capability}), CuPy {cupy.__version__}, "
          f"NVRTC {'.'.join(map(str, jit.nvrtc_version()))}")
    print(f"shape {_describe(shape)}, {shape.dtype}, {'causal (bottom-right)' if shape.causal else 'not causal'}; "
          f"{shape.flops / 1e12:.3f} TFLOP per call by the 4BHNqNkd{'/2' if shape.causal else ''} convention")

    scale = 1.0 / math.sqrt(shape.head_dim)
    sets = inputs.gpu_input_sets(shape, seed=args.seed)
    q, k, v = sets[0]
    l2 = inputs.l2_bytes()
    pairs = pick_pairs(shape.batch, shape.heads, shape.seqlen_q, shape.nk, shape.head_dim, REF_FLOP_BUDGET_GPU)
    _progress(f"float64 reference on {len(pairs)} (batch, head) pairs ...")
    ref, _ = attention64(q, k, v, causal=shape.causal, scale=scale, pairs=pairs)
    cupy.cuda.get_current_stream().synchronize()

    run = _run_rows(chosen, shape, args, "",
                    lambda torch, peer: _run_torch(torch, peer, shape, scale, sets, ref, pairs, args),
                    lambda entry: _run_variant(entry, shape, scale, sets, ref, pairs, args, blocks))
    results, unavailable, failed, peers, torch_why = run

    ref_ms = {r["variant"]: r["ms"] for r in results if "ms" in r}
    model_col = blocks.mode != "kernel"
    headers = ["variant", "tiles", "time (ms)", "TFLOP/s", "rel. error", "HBM model (GB)"]
    headers += ["model blocks"] if model_col else []
    headers += ["extra mem (MB)"]
    ratio_cols = [p for p in peers if p in ref_ms]
    headers += [f"x {p}" for p in ratio_cols]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["variant"], "", "", "", f"error: {r['error']}", ""] + [""] * model_col + [""]
                        + [""] * len(ratio_cols))
            continue
        row = [r["variant"], r.get("tiles", "—"), f"{r['ms']:.3f}", f"{shapes.tflops(shape.flops, r['ms']):.1f}",
               f"{r['err']:.1e}", _fmt(None if r.get("hbm") is None else r["hbm"] / 1e9, ".3f", "—")]
        row += [r.get("model_blocks", "—")] if model_col else []
        row += [_fmt(None if r.get("extra") is None else r["extra"] / 2**20, ".1f", "—") + r.get("extra_how", "")]
        row += [f"{ref_ms[p] / r['ms']:.2f}" for p in ratio_cols]
        rows.append(row)
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))

    nset = len(sets)
    notes = [
        f"time: median of {args.repeats} CUDA-event timings after {args.warmup} warm-up calls; calls rotate among "
        f"{nset} input sets ({nset * shape.input_bytes / 1e6:.0f} MB together, L2 {l2 / 1e6:.0f} MB) so no call "
        f"finds its inputs in L2; a pad kernel before each call keeps host launch overhead out of the events",
        f"TFLOP/s = 4*B*H*Nq*Nk*d / time{', halved for causal' if shape.causal else ''} (the flash-attn convention)",
        "rel. error: ||out - ref|| / ||ref|| against a direct float64 computation on the GPU" + _subset_note(pairs, shape),
        f"HBM model: the papers' closed-form traffic (fa_variants.iomodel) with {blocks.describe()}; a model, "
        "not a measurement (`fa-variants profile` measures with ncu; L2 absorbs part of the K/V re-reads)",
        "extra mem: peak of the memory pool during one call beyond the output and LSE (CuPy pool for our "
        "kernels, torch's caching allocator for SDPA, where the LSE counts as extra); '*' = the launcher's "
        "extra_bytes() where no measurement was possible",
    ]
    if ratio_cols:
        notes.append("x torch-...: speed relative to that torch peer on the same inputs (> 1 is faster; torch-flex: FlexAttention)")
    if not peers:
        notes.append(f"torch SDPA rows not run: {torch_why}")
    notes += skipped
    for label, why in unavailable:
        notes.append(f"{label} not run here: {why}")
    _print_notes(notes)
    return 1 if failed or not results else 0


def _run_rows(chosen, shape, args, what: str, run_torch, run_ours, skippable=()):
    """compare's loop over the chosen variants, then torch SDPA's backends: one result row each (or an error row,
    or a ``skippable`` exception's skipped row), memory pools emptied between rows. Returns (results, unavailable
    variants with why, whether one of ours failed, the torch peers that ran, why torch did not)."""
    import cupy
    results, unavailable, failed = [], [], False
    torch, torch_why = (None, "--no-torch") if args.no_torch else torch_peers.torch_status()
    if torch is not None and torch_peers.torch_sdpa_unsupported(shape):
        torch_why = torch_peers.torch_sdpa_unsupported(shape)
        torch = None
    peers = torch_peers.peer_names(getattr(args, "flex", False)) if torch is not None else []
    todo = list(chosen) + peers
    for i, item in enumerate(todo, 1):
        label = item if isinstance(item, str) else item.name
        if not isinstance(item, str):
            ok, why = item.available()
            if not ok:
                unavailable.append((label, why))
                continue
        _progress(f"[{i}/{len(todo)}] {label}{what} ...")
        try:
            results.append(run_torch(torch, item) if isinstance(item, str) else run_ours(item))
        except skippable as e:
            results.append(dict(variant=label, skipped=_err_text(e, 300)))
        except Exception as e:  # noqa: BLE001 - our variants' failures set the exit code; a peer's do not
            failed |= not isinstance(item, str) and not isinstance(e, EXPECTED_FAILURES)
            if args.verbose:
                traceback.print_exc()
            results.append(dict(variant=label, error=_err_text(e)))
        finally:
            cupy.get_default_memory_pool().free_all_blocks()
            if torch is not None:
                torch.cuda.empty_cache()
    return results, unavailable, failed, peers, torch_why


def _run_variant(entry: Variant, shape, scale, sets, ref, pairs, args, blocks: Blocks) -> dict:
    import cupy
    q, k, v = sets[0]
    extra, how = None, ""
    try:
        with memory.PeakMemory() as pm:
            out, lse = attention(q, k, v, variant=entry.name, causal=shape.causal, softmax_scale=scale, return_lse=True, backend="cuda")
            cupy.cuda.get_current_stream().synchronize()
        extra = max(0, pm.peak - memory.nbytes_rounded(out, lse))
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - a memory hook that will not install: fall back to the launcher's number
        out, lse = attention(q, k, v, variant=entry.name, causal=shape.causal, softmax_scale=scale, return_lse=True, backend="cuda")
        try:
            extra, how = entry.launcher.extra_bytes(shape.batch, shape.heads, shape.seqlen_q, shape.nk,
                                                   shape.head_dim, shape.itemsize, heads_kv=shape.hkv), "*"
        except Exception:  # noqa: BLE001
            extra = None
    err = rel_error(out, ref, pairs)
    del out, lse

    def call(q, k, v):
        return attention(q, k, v, variant=entry.name, causal=shape.causal, softmax_scale=scale, backend="cuda")

    times = events.time_cuda(call, warmup=args.warmup, repeats=args.repeats, rotate_inputs=sets)
    try:
        tiles = tuple(entry.launcher.tiles(shape.head_dim, shape.causal))
    except Exception:  # noqa: BLE001
        tiles = (None, None)
    used, source = blocks.pick(entry, shape.head_dim, shape.causal)
    return dict(variant=entry.name, ms=shapes.median(times), err=err, hbm=_modeled_hbm(entry, shape, used),
                extra=extra, extra_how=how, tiles=_blocks_text(tiles),
                model_blocks=_blocks_text(used) + _SOURCE_TAG[source])


def _run_torch(torch, peer, shape, scale, sets, ref, pairs, args) -> dict:
    import cupy
    fn = torch_peers.torch_sdpa_fn(torch, peer, shape, scale)
    tsets = [tuple(torch_peers.as_torch_bhnd(torch, a) for a in s) for s in sets]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(*tsets[0])
    torch.cuda.synchronize()
    extra = max(0, torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size())
    out_c = cupy.from_dlpack(out.transpose(1, 2).detach()) if out.dtype != torch.bfloat16 else \
        cupy.from_dlpack(out.transpose(1, 2).contiguous().view(torch.int16)).view(sets[0][0].dtype)
    err = rel_error(out_c, ref, pairs)
    del out, out_c
    times = events.time_cuda(fn, warmup=args.warmup, repeats=args.repeats, rotate_inputs=tsets)
    return dict(variant=peer, ms=shapes.median(times), err=err, hbm=None, extra=extra)


# ------------------------------------------------------------------------------------------------ compare --backward
def _backward_chosen(args: argparse.Namespace) -> tuple[list[Variant], list[str]]:
    """The variants for ``compare --backward``: those with a backward (a NumPy model, and the API's entry point).
    One named with --variants that has none ends the command in one line; from the default list it is left out
    with a note."""
    if args.dtype == "fp8":
        raise SystemExit("fa-variants compare --backward: --dtype fp8 has no backward (fa2_fp8 is forward-only); "
                         "use --dtype bfloat16 or float16")
    chosen = _parse_variants(args.variants)
    having = [v.name for v in variants() if v.reference_backward is not None]
    lacking = [v for v in chosen if v.reference_backward is None]
    if lacking and args.variants:
        raise SystemExit(f"fa-variants compare --backward: {', '.join(v.name for v in lacking)} has no backward "
                         f"(--backward: {', '.join(having)})")
    notes = [f"{v.name} not run: it has no backward (forward only)" for v in lacking]
    return [v for v in chosen if v.reference_backward is not None], notes


def _compare_backward(args: argparse.Namespace) -> int:
    chosen, notes = _backward_chosen(args)
    why_no_gpu = "forced by --numpy" if args.numpy else gpu.reason()
    if why_no_gpu:
        return _compare_backward_numpy(args, chosen, notes, why_no_gpu)
    return _compare_backward_gpu(args, chosen, notes)


def _kv_pairs(shape: shapes.Shape, budget: float):
    """(batch, kv head) pairs for the float64 reference backward, all of them if they fit ``budget`` FLOPs, else an
    evenly spaced subset. A pair covers its group's query heads (a kv head's dk, dv sum over all of them), each
    costing about 2.5x the forward's 4 Nq Nk d."""
    group = shape.heads // shape.hkv
    per_pair_dim = math.ceil(shapes.FLOPS_FACTOR["bwd"] * group * shape.head_dim)  # pick_pairs: 4 Nq Nk x this
    return pick_pairs(shape.batch, shape.hkv, shape.seqlen_q, shape.nk, per_pair_dim, budget)


def _reference_grads(dout, q, k, v, *, causal: bool, scale: float, kv_pairs, group: int) -> dict:
    """{"dq": [...], "dk": [...], "dv": [...]}: float64 ``reference_backward`` per (batch, kv head) pair, dq of the
    group's query heads (N_q, G, d), dk and dv of the kv head (N_k, 1, d); NumPy or CuPy, where q lives."""
    refs = {"dq": [], "dk": [], "dv": []}
    for b, g in kv_pairs:
        hs = slice(g * group, (g + 1) * group)
        dq, dk, dv = reference_backward(dout[b:b + 1, :, hs], q[b:b + 1, :, hs], k[b:b + 1, :, g:g + 1],
                                        v[b:b + 1, :, g:g + 1], causal=causal, scale=scale)
        refs["dq"].append(dq[0])
        refs["dk"].append(dk[0])
        refs["dv"].append(dv[0])
    return refs


def grad_errors(grads, refs: dict, kv_pairs, group: int) -> tuple[float, float, float]:
    """(dq, dk, dv) relative errors ||g - ref|| / ||ref|| over the reference's (batch, kv head) pairs; ``grads`` in
    flash-attn's layout, any dtype, NumPy or CuPy like ``refs``."""
    errs = []
    for name, g in zip(("dq", "dk", "dv"), grads):
        num = den = 0.0
        for (b, h), ref in zip(kv_pairs, refs[name]):
            part = g[b, :, h * group:(h + 1) * group] if name == "dq" else g[b, :, h:h + 1]
            xp = array_module(ref)
            num += float(xp.sum((to_float64(part) - ref) ** 2))
            den += float(xp.sum(ref * ref))
        errs.append(math.sqrt(num / den) if den > 0 else float("nan"))
    return tuple(errs)


def _kv_subset_note(kv_pairs, shape: shapes.Shape) -> str:
    total = shape.batch * shape.hkv
    if len(kv_pairs) == total:
        return ""
    return (f"; computed on {len(kv_pairs)} of the {total} (batch, kv head) pairs, evenly spaced, each with all "
            f"its query heads (the full float64 reference would cost too much)")


def _errs_text(errs) -> list[str]:
    return [_fmt(e, ".1e", "nan") for e in errs]


def _compare_backward_numpy(args: argparse.Namespace, chosen: list[Variant], notes: list[str], why: str) -> int:
    asked = _shape_from_args(args)
    chosen, more = _validate("compare", chosen, asked, explicit=bool(args.variants))
    notes = notes + more
    shape = asked if args.full_size else cpu_sized(asked)
    blocks = Blocks.from_args(args)
    paper_default = blocks.mode == "kernel"
    if paper_default:   # as explain --backward: no backward kernel's tiles to take, so the paper's blocks
        blocks = dataclasses.replace(blocks, mode="paper")
    lead = "--numpy" if why == "forced by --numpy" else "no CUDA GPU"
    reason = "" if lead == "--numpy" else f" [{why}]"
    if shape == asked:
        which = "the requested" if _explicit_shape(args) else "the default"
        print(f"{lead}: running the NumPy backward models at {which} size ({_describe(shape)}){reason}")
    else:
        print(f"{lead}: running the NumPy backward models at a CPU-sized shape ({_describe(shape)}) instead of "
              f"{_describe(asked)} (--full-size runs that, slowly){reason}")
    print(f"dtype {shape.dtype}, {'causal (bottom-right)' if shape.causal else 'not causal'}; the models compute "
          f"in float64 on the CPU; out and lse handed to them are the float64 forward's")
    b, nq, h, d = shape.batch, shape.seqlen_q, shape.heads, shape.head_dim
    q, k, v = inputs.random_inputs(shape, np, seed=args.seed)
    dout = inputs.random_dout(shape, np, seed=args.seed + 10_000)
    scale = 1.0 / math.sqrt(d)
    out64, lse64 = attention64(q, k, v, causal=shape.causal, scale=scale)
    out = out64.reshape(b, h, nq, d).transpose(0, 2, 1, 3)
    lse = lse64.reshape(b, h, nq)
    group = shape.heads // shape.hkv
    kv_pairs = _kv_pairs(shape, REF_FLOP_BUDGET_CPU)
    refs = _reference_grads(dout, q, k, v, causal=shape.causal, scale=scale, kv_pairs=kv_pairs, group=group)
    rows, failed = [], False
    for i, entry in enumerate(chosen, 1):
        _progress(f"[{i}/{len(chosen)}] {entry.name} (NumPy backward model)")
        (b_r, b_c), source = blocks.pick(entry, d, shape.causal)
        try:
            kw = {} if b_r is None else dict(block_q=b_r, block_k=b_c)
            t0 = time.perf_counter()
            res = entry.reference_backward(dout, q, k, v, out, lse, causal=shape.causal, softmax_scale=scale, **kw)
            wall = (time.perf_counter() - t0) * 1e3
            errs = grad_errors((res.dq, res.dk, res.dv), refs, kv_pairs, group)
            used = res.blocks or (None, None)
            try:
                per_head = entry.io_model_backward(nq, shape.nk, d, *used, causal=shape.causal)
                formula = per_head["total"] * b * h
            except Exception:  # noqa: BLE001
                formula = None
            try:
                flops_formula = iomodel.backward_flops(entry.name, nq, shape.nk, d, *used, causal=shape.causal) * b * h
            except Exception:  # noqa: BLE001
                flops_formula = None
            blk = _blocks_text(used) + ("" if used[0] is None or paper_default else _SOURCE_TAG[source])
            rows.append([entry.name, blk, f"{wall:.1f}", *_errs_text(errs), f"{res.hbm.total / 1e6:.3f}",
                         _fmt(None if formula is None else formula / 1e6, ".3f", "n/a"), f"{res.flops / 1e9:.3f}",
                         _fmt(None if flops_formula is None else flops_formula / 1e9, ".3f", "n/a"),
                         f"{res.flops / shape.flops:.2f}"])
        except Exception as e:  # noqa: BLE001
            failed |= not isinstance(e, EXPECTED_FAILURES)
            if args.verbose:
                traceback.print_exc()
            rows.append([entry.name, "", "", f"error: {_err_text(e)}", "", "", "", "", "", "", ""])
    print(tabulate(rows, headers=["variant", "blocks B_r x B_c", "time (CPU, ms)", "err dq", "err dk", "err dv",
                                  "HBM accesses counted (M elem.)", "formula (M elem.)", "FLOPs counted (G)",
                                  "formula (G)", "FLOPs / fwd"],
                   tablefmt="github", disable_numparse=True))
    block_note = (f"blocks: the paper's blocks for M = {blocks.sram} elements (B_c = ceil(M/4d), B_r = min(B_c, d)), "
                  f"as explain --backward: the API runs no backward kernel yet, so no kernel tiles; --blocks BRxBC "
                  f"for others" if paper_default else f"blocks: {blocks.describe()}")
    notes = [
        "time: wall clock of the NumPy backward model on the CPU (not a GPU number)",
        "err dq/dk/dv: ||dX - ref|| / ||ref|| against a float64 backward from the definition "
        "(reference.dense.reference_backward) on the same inputs" + _kv_subset_note(kv_pairs, shape),
        "HBM accesses: element reads + writes the backward model counts (every batch and head), beside "
        "fa_variants.iomodel's closed form; `fa-variants explain <variant> --backward` shows the breakdown",
        "FLOPs: the model's matmul FLOPs (recomputation included) beside iomodel.backward_flops; FLOPs / fwd: over "
        "the forward's 4BHNqNkd (/2 causal). On the GPU, TFLOP/s count 2.5x the forward for every backward",
        block_note,
    ] + notes
    _print_notes(notes)
    return 1 if failed else 0


def _compare_backward_gpu(args: argparse.Namespace, chosen: list[Variant], notes: list[str]) -> int:
    import cupy

    shape = _shape_from_args(args)
    chosen, more = _validate("compare", chosen, shape, explicit=bool(args.variants))
    notes = notes + more
    dev = cupy.cuda.Device()
    bwd_flops = shapes.direction_flops(shape, "bwd")
    print(f"GPU: {gpu.probe().name} (compute capability {dev.compute_capability}), CuPy {cupy.__version__}, "
          f"NVRTC {'.'.join(map(str, jit.nvrtc_version()))}")
    print(f"backward, shape {_describe(shape)}, {shape.dtype}, "
          f"{'causal (bottom-right)' if shape.causal else 'not causal'}; {bwd_flops / 1e12:.3f} TFLOP per call by "
          f"the 2.5 x 4BHNqNkd{'/2' if shape.causal else ''} convention")

    scale = 1.0 / math.sqrt(shape.head_dim)
    sets = inputs.gpu_input_sets(shape, seed=args.seed)
    douts = inputs.gpu_dout_sets(shape, len(sets), seed=args.seed + 10_000)
    l2 = inputs.l2_bytes()
    group = shape.heads // shape.hkv
    kv_pairs = _kv_pairs(shape, REF_FLOP_BUDGET_GPU)
    _progress(f"float64 reference backward on {len(kv_pairs)} (batch, kv head) pairs ...")
    refs = _reference_grads(douts[0], *sets[0], causal=shape.causal, scale=scale, kv_pairs=kv_pairs, group=group)
    cupy.cuda.get_current_stream().synchronize()

    ctx = dict(shape=shape, scale=scale, sets=sets, douts=douts, refs=refs, kv_pairs=kv_pairs, group=group)
    # BackendUnavailable: the API has no GPU backward for a variant (yet): a row saying so, not a failure
    run = _run_rows(chosen, shape, args, " backward", lambda torch, peer: _run_torch_backward(torch, peer, args, **ctx),
                    lambda entry: _run_variant_backward(entry, args, **ctx), skippable=(BackendUnavailable,))
    results, unavailable, failed, peers, torch_why = run

    ref_ms = {r["variant"]: r["ms"] for r in results if "ms" in r}
    ratio_cols = [p for p in peers if p in ref_ms]
    nset = len(sets)
    set_mb = nset * (shape.input_bytes + 2 * shape.itemsize * shape.batch * shape.seqlen_q * shape.heads
                     * shape.head_dim) / 1e6
    head = [
        f"time: median of {args.repeats} CUDA-event timings of the backward call alone after {args.warmup} warm-up "
        f"calls; calls rotate among {nset} sets of q, k, v, out, dout ({set_mb:.0f} MB together, L2 "
        f"{l2 / 1e6:.0f} MB); a pad kernel before each call keeps host launch overhead out of the events. Ours: "
        f"fav.attention_backward given the variant's own forward's out and lse; torch: autograd.grad(out, (q, k, v), "
        f"dout, retain_graph=True) of an SDPA forward run once beforehand with that backend forced",
        f"TFLOP/s = 2.5 x 4*B*H*Nq*Nk*d / time{', halved for causal' if shape.causal else ''} (the flash-attn "
        f"convention for the backward, whatever a backward really computes)",
        "err dq/dk/dv: ||dX - ref|| / ||ref|| against a float64 backward from the definition on the GPU "
        "(reference.dense.reference_backward)" + _kv_subset_note(kv_pairs, shape),
        "extra mem: peak of the memory pool during one backward call beyond dq, dk and dv (CuPy pool for ours, "
        "torch's caching allocator for SDPA)",
        "x torch-...: speed relative to that torch peer's backward on the same inputs (> 1 is faster; torch-flex: FlexAttention)"
        if ratio_cols else None,
        f"torch SDPA rows not run: {torch_why}" if not peers else "torch SDPA: flash = FLASH_ATTENTION, "
        "cudnn = CUDNN_ATTENTION (sdpa_kernel forcing one backend for the forward; the backward follows it)",
    ]
    head = [n for n in head if n]
    headers = ["variant", "time (ms)", "TFLOP/s", "err dq", "err dk", "err dv", "extra mem (MB)"]
    headers += [f"x {p}" for p in ratio_cols]
    rows, skipped_notes = [], []
    for r in results:
        if "skipped" in r:
            skipped_notes.append(f"{r['variant']} skipped: {r['skipped']}")
            where = len(head) + len(notes) + len(skipped_notes)     # the note that gives the reason
            rows.append([r["variant"], f"skipped [{where}]", "", "", "", "", ""] + [""] * len(ratio_cols))
            continue
        if "error" in r:
            rows.append([r["variant"], "", "", f"error: {r['error']}", "", "", ""] + [""] * len(ratio_cols))
            continue
        row = [r["variant"], f"{r['ms']:.3f}", f"{shapes.tflops(bwd_flops, r['ms']):.1f}", *_errs_text(r["errs"]),
               _fmt(None if r.get("extra") is None else r["extra"] / 2**20, ".1f", "—")]
        row += [f"{ref_ms[p] / r['ms']:.2f}" for p in ratio_cols]
        rows.append(row)
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))

    all_notes = head + notes + skipped_notes + [f"{label} not run here: {why}" for label, why in unavailable]
    _print_notes(all_notes)
    ran = any("ms" in r for r in results)
    return 1 if failed or not (ran or any("skipped" in r for r in results)) else 0


def _run_variant_backward(entry: Variant, args, *, shape, scale, sets, douts, refs, kv_pairs, group) -> dict:
    import cupy

    def fwd(q, k, v):
        return attention(q, k, v, variant=entry.name, causal=shape.causal, softmax_scale=scale, return_lse=True,
                         backend="cuda")

    def call(dout, q, k, v, out, lse):
        return attention_backward(dout, q, k, v, out, lse, variant=entry.name, causal=shape.causal,
                                  softmax_scale=scale, backend="cuda")

    q, k, v = sets[0]
    out, lse = fwd(q, k, v)
    with memory.PeakMemory() as pm:     # BackendUnavailable (no GPU backward yet) leaves from here: skipped row
        grads = call(douts[0], q, k, v, out, lse)
        cupy.cuda.get_current_stream().synchronize()
    extra = max(0, pm.peak - memory.nbytes_rounded(*grads))
    errs = grad_errors(grads, refs, kv_pairs, group)
    del grads
    saved = [(out, lse)] + [fwd(*s) for s in sets[1:]]
    rotate = [(d, q, k, v, o, lse) for (q, k, v), d, (o, lse) in zip(sets, douts, saved)]
    times = events.time_cuda(call, warmup=args.warmup, repeats=args.repeats, rotate_inputs=rotate)
    return dict(variant=entry.name, ms=shapes.median(times), errs=errs, extra=extra)


def torch_grads_to_cupy(torch, grads, dtype):
    """torch (B, H, N, d) gradients -> CuPy arrays in flash-attn's (B, N, H, d) layout of ``dtype`` (bf16 through
    its 16-bit pattern: DLPack may not carry bfloat16)."""
    import cupy
    out = []
    for g in grads:
        t = g.detach().transpose(1, 2)
        if t.dtype == torch.bfloat16:
            out.append(cupy.from_dlpack(t.contiguous().view(torch.int16)).view(dtype))
        else:
            out.append(cupy.from_dlpack(t))
    return out


def _run_torch_backward(torch, peer, args, *, shape, scale, sets, douts, refs, kv_pairs, group) -> dict:
    fn = torch_peers.torch_grad_fn(torch)
    tsets = torch_peers.torch_sdpa_grad_sets(torch, peer, shape, scale, sets, douts)   # forward once, not timed
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = fn(*tsets[0])
    torch.cuda.synchronize()
    extra = max(0, torch.cuda.max_memory_allocated() - base - sum(g.numel() * g.element_size() for g in grads))
    errs = grad_errors(torch_grads_to_cupy(torch, grads, sets[0][0].dtype), refs, kv_pairs, group)
    del grads
    times = events.time_cuda(fn, warmup=args.warmup, repeats=args.repeats, rotate_inputs=tsets)
    return dict(variant=peer, ms=shapes.median(times), errs=errs, extra=extra)


# ------------------------------------------------------------------------------------------------ explain
def cmd_explain(args: argparse.Namespace) -> int:
    entry = get(args.variant)
    n, d = args.seqlen, args.head_dim
    if d not in entry.head_dims:
        raise SystemExit(f"fa-variants explain: {entry.name} takes head_dim {entry.head_dims_text}, got {d}")
    if args.backward and entry.reference_backward is None:
        having = [v.name for v in variants() if v.reference_backward is not None]
        raise SystemExit(f"fa-variants explain: {entry.name} has no backward model (--backward: {', '.join(having)})")
    blocks = Blocks.from_args(args)
    no_kernel_tiles = args.backward and blocks.mode == "kernel"
    if no_kernel_tiles:  # no backward kernel to take tiles from: the paper's blocks
        blocks = dataclasses.replace(blocks, mode="paper")
    (b_r, b_c), source = blocks.pick(entry, d)
    if b_r is not None and math.ceil(n / b_r) * math.ceil(n / b_c) > EXPLAIN_MAX_BLOCK_PAIRS:
        raise SystemExit(f"fa-variants explain: blocks {b_r}x{b_c} at N={n} make {math.ceil(n / b_r) * math.ceil(n / b_c):,} "
                         f"block pairs, too many for the NumPy model (at most {EXPLAIN_MAX_BLOCK_PAIRS:,}); "
                         f"use larger blocks or a smaller --seqlen")
    text = iomodel.explain(entry, n, d, args.sram, blocks=(b_r, b_c), backward=args.backward)
    head, _, rest = text.partition("\n")
    if b_r is None:
        what = "P, dP and dS" if args.backward else "S and P"
        line = f"(no tiling: {entry.name} materializes {what}; blocks play no part)"
    else:
        others = "; --paper-blocks [--sram M] or --blocks BRxBC for others" if source == "kernel" else ""
        if no_kernel_tiles and source == "paper":
            others = "; no backward kernel yet, so no kernel tiles; --sram M or --blocks BRxBC for others"
        line = f"(blocks {b_r}x{b_c}: {blocks.source_text(source, entry, d)}{others})"
    print(f"{head}\n{line}\n{rest}")
    if args.measured or (entry.name == "fa3" and not args.backward):
        print("\n" + _measured_ablation(args.measured))
    return 0


def _measured_ablation(path: str | None) -> str:
    """The FA3 ablation's measured rows and levers: a run's `bench/ablation.py --json` file, or the shipped one."""
    from . import ablation
    try:
        data = ablation.load(path)
    except ValueError as e:
        raise SystemExit(f"fa-variants explain: --measured: {e}") from None
    if path:
        return ablation.text(data, path)
    return ablation.text(data, "the run shipped in fa_variants/measured/; on your card: python3 bench/ablation.py "
                               "--json f && fa-variants explain fa3 --measured f")


# ------------------------------------------------------------------------------------------------ build
def _build_one(source, expr, arch, options):
    t0 = time.perf_counter()
    compiled = jit.compile_into_cache(source, (expr,), arch, options)  # a first call then finds it compiled
    return compiled, time.perf_counter() - t0


def _build_archs(text: str | None, chosen: list[Variant]) -> list[str] | None:
    """The archs --arch asks for, normalized; sm_X means sm_Xa where the variants are built only for sm_Xa
    (Hopper: sm_90 -> sm_90a, said on stderr). An arch that selects no chosen variant ends the command."""
    if not text:
        return None
    try:
        asked = [jit.normalize_arch(a) for a in text.split(",") if a.strip()]
    except ValueError as e:
        raise SystemExit(f"fa-variants build: {e}") from None
    if not asked:
        raise SystemExit(f"fa-variants build: --arch names no arch: {text!r}")
    known = {a for e in chosen for a in e.archs}
    wanted = []
    for a in asked:
        if a not in known and a + "a" in known:
            _progress(f"fa-variants build: {a} means {a}a here: the {a[3:]} kernels are compiled for the "
                      f"arch-specific target {a}a (Hopper's wgmma and register reallocation exist only there)")
            a += "a"
        if a not in wanted:
            wanted.append(a)
    none = [a for a in wanted if a not in known]
    if none:
        have = sorted(known, key=lambda s: (len(s), s))
        raise SystemExit(f"fa-variants build: {', '.join(none)} selects no kernel of "
                         f"{', '.join(e.name for e in chosen)}: they are built for {', '.join(have)}")
    return wanted


def _check_nvrtc() -> tuple[int, int]:
    try:
        return jit.nvrtc_version()
    except ImportError as e:
        raise SystemExit(f"fa-variants build: NVRTC is not available ({_err_text(e)}); {_INSTALL_HINT}") from None
    except Exception as e:  # noqa: BLE001 - CuPy present but its NVRTC library missing
        raise SystemExit(f"fa-variants build: NVRTC is not usable ({_err_text(e)}); {_INSTALL_HINT}") from None


def cmd_build(args: argparse.Namespace) -> int:
    chosen = _parse_variants(args.variants, "build")
    wanted = _build_archs(args.arch, chosen)
    rows, tasks, bad = [], [], False
    for entry in chosen:
        try:
            launcher = entry.launcher
            launcher.compile_units()  # a launcher whose unit list fails to build is reported here
            options = ()
        except Exception as e:  # noqa: BLE001 - a launcher that does not import is a build failure, reported
            bad = True
            rows.append([entry.name, f"(launcher {entry.launcher!r})", "", "", "", "",
                         f"error: {_err_text(e)}"])
            continue
        archs = [a for a in entry.archs if wanted is None or a in wanted]
        if not archs:
            _progress(f"{entry.name}: none of its archs {list(entry.archs)} was asked for; skipped")
        tasks += [(entry.name, source, e, a, options) for a in archs for source, exprs in launcher.compile_units(a).items()
                  for e in exprs]
    if not tasks and not bad:
        raise SystemExit("fa-variants build: nothing to compile for these variants and archs")
    version = _check_nvrtc() if tasks else None
    if tasks:
        _progress(f"NVRTC {'.'.join(map(str, version))}: compiling {len(tasks)} kernel instances with {args.jobs} threads")
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:  # NVRTC releases the GIL
        futs = {pool.submit(_build_one, s, e, a, o): (n, s, e, a) for n, s, e, a, o in tasks}
        for i, fut in enumerate(concurrent.futures.as_completed(futs), 1):
            n, s, e, a = futs[fut]
            try:
                results[(n, e, a)] = fut.result()
                _progress(f"[{i}/{len(tasks)}] {n} {e} {a} ({results[(n, e, a)][1]:.1f} s)")
            except Exception as exc:  # noqa: BLE001
                results[(n, e, a)] = exc
                _progress(f"[{i}/{len(tasks)}] {n} {e} {a} FAILED")
    for n, s, e, a, _ in tasks:
        res = results[(n, e, a)]
        if isinstance(res, BaseException):
            bad = True
            rows.append([n, e, a, "", "", "", f"error: {_err_text(res, 200)}"])
            if args.verbose or not isinstance(res, jit.CompileError):
                print(str(res), file=sys.stderr)
            else:
                print(str(res)[:4000], file=sys.stderr)
            continue
        reports = [r for r in res[0].reports() if r.kernel == e] or res[0].reports()
        if not reports:
            bad = True
            rows.append([n, e, a, "", "", "", "error: no ptxas report in the NVRTC log"])
            continue
        for r in reports:
            spill = r.spill_stores + r.spill_loads
            bad |= spill > 0
            rows.append([n, r.kernel, a, str(r.registers), str(r.shared_bytes),
                         f"{r.spill_stores}/{r.spill_loads}", "SPILLS" if spill else "ok"])
    print(tabulate(rows, headers=["variant", "kernel instance", "arch", "registers", "static smem (B)",
                                  "spill st/ld (B)", "status"], tablefmt="github", disable_numparse=True))
    if bad:
        print("build FAILED: a launcher did not import, a kernel did not compile, or a kernel spills registers",
              file=sys.stderr)
    return 1 if bad else 0


# ------------------------------------------------------------------------------------------------ profile
def cmd_profile(args: argparse.Namespace) -> int:
    from . import profile

    chosen = _parse_variants(args.variants, "profile")
    shape = _shape_from_args(args)
    chosen, notes = _validate("profile", chosen, shape, explicit=bool(args.variants))
    return profile.run(shape, chosen, Blocks.from_args(args), ncu=args.ncu, torch_peers=not args.no_torch,
                       seed=args.seed, timeout=args.timeout, verbose=args.verbose, notes=notes)


# ------------------------------------------------------------------------------------------------ main
class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: 'fa-variants explain: error: argument --sram: must be >= 1, got 0'."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_shape_args(c: argparse.ArgumentParser) -> None:
    d = SHAPE_DEFAULTS
    c.add_argument("--batch", type=_positive, help=f"default {d['batch']}")
    c.add_argument("--heads", type=_positive,
                   help=f"query heads, default {d['heads']} (or the smallest multiple of --heads-kv >= {d['heads']})")
    c.add_argument("--heads-kv", type=_positive, help="K/V heads for MQA/GQA (default: = heads)")
    c.add_argument("--seqlen", type=_positive, help=f"query length, default {d['seqlen']}")
    c.add_argument("--seqlen-k", type=_positive, help="key length (default: = seqlen); causal is bottom-right aligned")
    c.add_argument("--head-dim", type=_positive, help=f"default {d['head_dim']}")
    c.add_argument("--dtype", choices=["float16", "bfloat16", "fp8"], default="bfloat16",
                   help="fp8: fa2_fp8 and fa3_fp8 (bf16 inputs quantized to e4m3 on the fly) beside fa2 and fa3 in bf16")
    c.add_argument("--causal", action="store_true")
    c.add_argument("--variants", help=f"comma-separated subset of {','.join(VARIANTS)}")
    c.add_argument("--no-torch", action="store_true", help="skip the torch SDPA rows")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failing variants")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fa-variants", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compare", help="run every variant (and torch SDPA) on the same inputs: time, "
                       "TFLOP/s, error, modeled HBM traffic, extra memory (the NumPy models without a GPU)")
    _add_shape_args(c)
    c.add_argument("--repeats", type=_positive, default=30, help="timed calls (median reported), default 30")
    c.add_argument("--warmup", type=_non_negative, default=5, help="untimed calls first, default 5")
    c.add_argument("--numpy", action="store_true", help="run the NumPy models even when there is a GPU")
    c.add_argument("--flex", action="store_true",
                   help="FlexAttention (torch.compile of flex_attention, about 15 s the first time) beside torch "
                   "SDPA's backends")
    c.add_argument("--full-size", action="store_true",
                   help="NumPy models: run the requested shape even when it is large (slow), instead of a "
                   "CPU-sized version of it")
    _add_block_args(c, "on-chip memory M in elements for --paper-blocks")
    c.add_argument("--backward", action="store_true",
                   help="compare the backward instead: our variants through fav.attention_backward (rows say "
                   "why where the GPU backward is unavailable), torch SDPA's flash and cuDNN backwards; TFLOP/s "
                   "count 2.5x the forward's FLOPs; dq/dk/dv errors against a float64 backward (the NumPy "
                   "backward models without a GPU)")
    c.set_defaults(func=cmd_compare)

    e = sub.add_parser("explain", help="a variant's loop order and HBM traffic: paper formula vs the NumPy "
                       "model's count")
    e.add_argument("variant", choices=list(VARIANTS))
    e.add_argument("--seqlen", type=_positive, default=1024, help="N, default 1024 (the model runs once at this size)")
    e.add_argument("--head-dim", type=_positive, default=64, help="d, default 64")
    _add_block_args(e, "on-chip memory M in elements: the paper's terms, and the blocks of --paper-blocks")
    e.add_argument("--backward", action="store_true",
                   help="the backward with recomputation instead (naive, fa1, fa2): its loops, its HBM traffic "
                   "formula vs the NumPy model's count, and the FLOPs it pays for the HBM it saves (the "
                   "paper's blocks unless --blocks: there is no backward kernel yet)")
    e.add_argument("--measured", metavar="FILE", help="the FA3 ablation measured by `bench/ablation.py --json FILE`: "
                   "its rows and what each lever buys (fa3 prints the run shipped with the package without it)")
    e.set_defaults(func=cmd_explain)

    b = sub.add_parser("build", help="compile every kernel specialization with NVRTC (no GPU needed) into the "
                       "disk cache the kernels load from (FA_VARIANTS_CACHE), so that no first call compiles; "
                       "table of registers, shared memory, spills; non-zero exit on an error or a spill")
    b.add_argument("--arch", help="comma-separated, e.g. 80,86,89,90a (default: each variant's own archs; "
                   "90 means 90a)")
    b.add_argument("--variants", help=f"comma-separated subset of {','.join(VARIANTS)}")
    b.add_argument("--jobs", type=_positive, default=os.cpu_count() or 1, help="compile threads (default: CPU count)")
    b.add_argument("-v", "--verbose", action="store_true", help="full NVRTC logs of failures")
    b.set_defaults(func=cmd_build)

    f = sub.add_parser("profile", help="measure DRAM and L2 bytes of one call per variant with Nsight Compute "
                       "(ncu), beside the IO model's HBM bytes (needs a GPU and ncu)")
    _add_shape_args(f)
    _add_block_args(f, "on-chip memory M in elements for --paper-blocks")
    f.add_argument("--ncu", default=os.environ.get("NCU", "ncu"), help="the ncu executable (default: $NCU or ncu on PATH)")
    f.add_argument("--timeout", type=_positive, default=900, help="seconds per ncu run, default 900")
    f.set_defaults(func=cmd_profile)
    return p


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is no file (captured): nothing to silence
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """The ``fa-variants`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        rc = args.func(args)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:  # `fa-variants explain fa2 | head -3`: the reader left; stop quietly, as cat would
        _quiet_stdout()
        return 128 + 13  # what a shell reports for a process ended by SIGPIPE
    except KeyboardInterrupt:
        print("fa-variants: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as e:  # CuPy (the cuda extra) missing where a command needs it
        if (e.name or "").split(".")[0] not in _CUDA_MODULES:
            raise
        print(f"fa-variants {args.command}: {_err_text(e)}; {_INSTALL_HINT}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
