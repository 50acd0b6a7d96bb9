"""``fa-variants compare``: every variant (and torch's peers) on the same inputs, forward: time, TFLOP/s, error
against float64, modeled HBM traffic, extra memory. Without a GPU the NumPy models run instead (a CPU-sized
version of the shape unless --full-size) and report their counted HBM accesses beside the formulas."""
from __future__ import annotations

import argparse
import math
import time
import traceback

import numpy as np
from tabulate import tabulate

from ..api import attention
from ..reference.dense import attention64, pick_pairs, rel_error
from ..registry import Variant
from ..timing.events import time_cuda
from ..timing.inputs import gpu_input_sets, l2_bytes, random_inputs
from ..timing.memory import PeakMemory, nbytes_rounded
from ..timing.shapes import Shape, median, tflops
from ..timing.torch_peers import as_torch_bhnd, torch_sdpa_fn
from .blocks import SOURCE_TAG, Blocks
from .reference import REF_FLOP_BUDGET_CPU, REF_FLOP_BUDGET_GPU, subset_note
from .rows import EXPECTED_FAILURES, gpu_line, run_rows
from .shapes import cpu_sized, describe, numpy_run_line, shape_from_args, validate
from .text import blocks_text, err_text, fmt, print_notes, progress


def on_numpy(args: argparse.Namespace, chosen: list[Variant], why: str, notes: list[str]) -> int:
    """The NumPy models on the CPU: wall time, error against float64, counted HBM accesses beside the formula."""
    asked = shape_from_args(args)
    chosen, skipped = validate("compare", chosen, asked, explicit=bool(args.variants))
    shape = asked if args.full_size else cpu_sized(asked)
    blocks = Blocks.from_args(args)
    print(numpy_run_line(args, asked, shape, why, "NumPy models"))
    print(f"dtype {shape.dtype}, {'causal (bottom-right)' if shape.causal else 'not causal'}; "
          f"the models compute in float64 on the CPU")
    q, k, v = random_inputs(shape, np, seed=args.seed)
    scale = 1.0 / math.sqrt(shape.head_dim)
    pairs = pick_pairs(shape.batch, shape.heads, shape.seqlen_q, shape.nk, shape.head_dim, REF_FLOP_BUDGET_CPU)
    ref, _ = attention64(q, k, v, causal=shape.causal, scale=scale, pairs=pairs)
    rows, failed = [], False
    for i, entry in enumerate(chosen, 1):
        progress(f"[{i}/{len(chosen)}] {entry.name} (NumPy model)")
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
            blk = blocks_text(used) + ("" if used[0] is None else SOURCE_TAG[source])
            rows.append([entry.name, blk, f"{wall:.1f}", f"{err:.1e}", f"{counted / 1e6:.3f}",
                         fmt(None if formula is None else formula / 1e6, ".3f", "n/a")])
        except Exception as e:  # noqa: BLE001
            failed |= not isinstance(e, EXPECTED_FAILURES)
            if args.verbose:
                traceback.print_exc()
            rows.append([entry.name, "", "", f"error: {err_text(e)}", "", ""])
    print(tabulate(rows, headers=["variant", "blocks B_r x B_c", "time (CPU, ms)", "rel. error",
                                  "HBM accesses counted (M elem.)", "formula (M elem.)"],
                   tablefmt="github", disable_numparse=True))
    print_notes([
        "time: wall clock of the NumPy model on the CPU (not a GPU number)",
        "rel. error: ||out - ref|| / ||ref|| against a direct float64 computation on the same inputs"
        + subset_note(pairs, shape),
        "HBM accesses: element reads + writes the model counts (every batch and head), beside the closed-form "
        "count of fa_variants.iomodel; `fa-variants explain <variant>` shows the breakdown",
        f"blocks: {blocks.describe()}",
    ] + skipped + notes)
    return 1 if failed else 0


def on_gpu(args: argparse.Namespace, chosen: list[Variant], notes: list[str] = ()) -> int:
    """Our kernels and torch's peers on the GPU: CUDA-event medians over inputs rotating past the L2."""
    import cupy

    shape = shape_from_args(args)
    chosen, skipped = validate("compare", chosen, shape, explicit=bool(args.variants))
    blocks = Blocks.from_args(args)
    print(gpu_line())
    print(f"shape {describe(shape)}, {shape.dtype}, {'causal (bottom-right)' if shape.causal else 'not causal'}; "
          f"{shape.flops / 1e12:.3f} TFLOP per call by the 4BHNqNkd{'/2' if shape.causal else ''} convention")

    scale = 1.0 / math.sqrt(shape.head_dim)
    sets = gpu_input_sets(shape, seed=args.seed)
    q, k, v = sets[0]
    l2 = l2_bytes()
    pairs = pick_pairs(shape.batch, shape.heads, shape.seqlen_q, shape.nk, shape.head_dim, REF_FLOP_BUDGET_GPU)
    progress(f"float64 reference on {len(pairs)} (batch, head) pairs ...")
    ref, _ = attention64(q, k, v, causal=shape.causal, scale=scale, pairs=pairs)
    cupy.cuda.get_current_stream().synchronize()

    run = run_rows(chosen, shape, args, "",
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
        row = [r["variant"], r.get("tiles", "—"), f"{r['ms']:.3f}", f"{tflops(shape.flops, r['ms']):.1f}",
               f"{r['err']:.1e}", fmt(None if r.get("hbm") is None else r["hbm"] / 1e9, ".3f", "—")]
        row += [r.get("model_blocks", "—")] if model_col else []
        row += [fmt(None if r.get("extra") is None else r["extra"] / 2**20, ".1f", "—") + r.get("extra_how", "")]
        row += [f"{ref_ms[p] / r['ms']:.2f}" for p in ratio_cols]
        rows.append(row)
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))

    nset = len(sets)
    lines = [
        f"time: median of {args.repeats} CUDA-event timings after {args.warmup} warm-up calls; calls rotate among "
        f"{nset} input sets ({nset * shape.input_bytes / 1e6:.0f} MB together, L2 {l2 / 1e6:.0f} MB) so no call "
        f"finds its inputs in L2; a pad kernel before each call keeps host launch overhead out of the events",
        f"TFLOP/s = 4*B*H*Nq*Nk*d / time{', halved for causal' if shape.causal else ''} (the flash-attn convention)",
        "rel. error: ||out - ref|| / ||ref|| against a direct float64 computation on the GPU" + subset_note(pairs, shape),
        f"HBM model: the papers' closed-form traffic (fa_variants.iomodel) with {blocks.describe()}; a model, "
        "not a measurement (`fa-variants profile` measures with ncu; L2 absorbs part of the K/V re-reads)",
        "extra mem: peak of the memory pool during one call beyond the output and LSE (CuPy pool for our "
        "kernels, torch's caching allocator for SDPA, where the LSE counts as extra); '*' = the launcher's "
        "extra_bytes() where no measurement was possible",
    ]
    if ratio_cols:
        lines.append("x torch-...: speed relative to that torch peer on the same inputs (> 1 is faster; torch-flex: FlexAttention)")
    if not peers:
        lines.append(f"torch SDPA rows not run: {torch_why}")
    print_notes(lines + skipped + list(notes) + [f"{label} not run here: {why}" for label, why in unavailable])
    return 1 if failed or not results else 0


def _modeled_hbm(entry: Variant, shape: Shape, blocks) -> float | None:
    try:
        bq, bk = blocks
        return entry.hbm_bytes(shape.batch, shape.heads, shape.seqlen_q, shape.nk, shape.head_dim,
                               bq, bk, shape.causal, shape.itemsize)
    except Exception:  # noqa: BLE001 - no model for this variant: leave the cell empty
        return None


def _run_variant(entry: Variant, shape, scale, sets, ref, pairs, args, blocks: Blocks) -> dict:
    import cupy
    q, k, v = sets[0]
    extra, how = None, ""
    try:
        with PeakMemory() as pm:
            out, lse = attention(q, k, v, variant=entry.name, causal=shape.causal, softmax_scale=scale, return_lse=True, backend="cuda")
            cupy.cuda.get_current_stream().synchronize()
        extra = max(0, pm.peak - nbytes_rounded(out, lse))
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

    times = time_cuda(call, warmup=args.warmup, repeats=args.repeats, rotate_inputs=sets)
    try:
        tiles = tuple(entry.launcher.tiles(shape.head_dim, shape.causal))
    except Exception:  # noqa: BLE001
        tiles = (None, None)
    used, source = blocks.pick(entry, shape.head_dim, shape.causal)
    return dict(variant=entry.name, ms=median(times), err=err, hbm=_modeled_hbm(entry, shape, used),
                extra=extra, extra_how=how, tiles=blocks_text(tiles),
                model_blocks=blocks_text(used) + SOURCE_TAG[source])


def _run_torch(torch, peer, shape, scale, sets, ref, pairs, args) -> dict:
    import cupy
    fn = torch_sdpa_fn(torch, peer, shape, scale)
    tsets = [tuple(as_torch_bhnd(torch, a) for a in s) for s in sets]
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
    times = time_cuda(fn, warmup=args.warmup, repeats=args.repeats, rotate_inputs=tsets)
    return dict(variant=peer, ms=median(times), err=err, hbm=None, extra=extra)
