"""``fa-variants compare --backward``: the backward of every variant that has one, and torch's peers' backwards, on
the same inputs: time of the backward call alone, TFLOP/s by the 2.5x convention, dq/dk/dv errors against a float64
backward. Without a GPU the NumPy backward models run instead, with their counted HBM accesses and FLOPs beside
the formulas."""
from __future__ import annotations

import argparse
import math
import time
import traceback

import numpy as np
from tabulate import tabulate

from .. import iomodel
from ..api import BackendUnavailable, attention
from ..backward import attention_backward
from ..reference.dense import attention64
from ..registry import Variant, variants
from ..timing.events import time_cuda
from ..timing.inputs import gpu_dout_sets, gpu_input_sets, l2_bytes, random_dout, random_inputs
from ..timing.memory import PeakMemory, nbytes_rounded
from ..timing.shapes import direction_flops, median, tflops
from ..timing.torch_peers import torch_grad_fn, torch_grads_to_cupy, torch_sdpa_grad_sets
from .args import parse_variants
from .blocks import SOURCE_TAG, Blocks, backward_tiles_note
from .reference import (REF_FLOP_BUDGET_CPU, REF_FLOP_BUDGET_GPU, errs_text, grad_errors, kv_pairs, kv_subset_note,
                        reference_grads)
from .rows import EXPECTED_FAILURES, gpu_line, run_rows
from .shapes import cpu_sized, describe, numpy_run_line, shape_from_args, validate
from .text import blocks_text, err_text, fmt, print_notes, progress


def chosen_variants(args: argparse.Namespace) -> tuple[list[Variant], list[str]]:
    """The variants for ``compare --backward``: those with a backward (a NumPy model, and the API's entry point).
    One named with --variants that has none ends the command in one line; from the default list it is left out
    with a note."""
    if args.dtype == "fp8":
        raise SystemExit("fa-variants compare --backward: --dtype fp8 has no backward (fa2_fp8 is forward-only); "
                         "use --dtype bfloat16 or float16")
    chosen = parse_variants(args.variants)
    having = [v.name for v in variants() if v.reference_backward is not None]
    lacking = [v for v in chosen if v.reference_backward is None]
    if lacking and args.variants:
        raise SystemExit(f"fa-variants compare --backward: {', '.join(v.name for v in lacking)} has no backward "
                         f"(--backward: {', '.join(having)})")
    notes = [f"{v.name} not run: it has no backward (forward only)" for v in lacking]
    return [v for v in chosen if v.reference_backward is not None], notes


def on_numpy(args: argparse.Namespace, chosen: list[Variant], why: str, notes: list[str]) -> int:
    """The NumPy backward models on the CPU: wall time, dq/dk/dv errors, counted HBM accesses and FLOPs beside the
    formulas."""
    asked = shape_from_args(args)
    chosen, more = validate("compare", chosen, asked, explicit=bool(args.variants))
    notes = notes + more
    shape = asked if args.full_size else cpu_sized(asked)
    blocks = Blocks.from_args(args)
    paper_default = blocks.mode == "kernel"
    blocks = blocks.for_backward()
    print(numpy_run_line(args, asked, shape, why, "NumPy backward models"))
    print(f"dtype {shape.dtype}, {'causal (bottom-right)' if shape.causal else 'not causal'}; the models compute "
          f"in float64 on the CPU; out and lse handed to them are the float64 forward's")
    b, nq, h, d = shape.batch, shape.seqlen_q, shape.heads, shape.head_dim
    q, k, v = random_inputs(shape, np, seed=args.seed)
    dout = random_dout(shape, np, seed=args.seed + 10_000)
    scale = 1.0 / math.sqrt(d)
    out64, lse64 = attention64(q, k, v, causal=shape.causal, scale=scale)
    out = out64.reshape(b, h, nq, d).transpose(0, 2, 1, 3)
    lse = lse64.reshape(b, h, nq)
    group = shape.heads // shape.hkv
    pairs = kv_pairs(shape, REF_FLOP_BUDGET_CPU)
    refs = reference_grads(dout, q, k, v, causal=shape.causal, scale=scale, kv_pairs=pairs, group=group)
    rows, failed = [], False
    for i, entry in enumerate(chosen, 1):
        progress(f"[{i}/{len(chosen)}] {entry.name} (NumPy backward model)")
        (b_r, b_c), source = blocks.pick(entry, d, shape.causal)
        try:
            kw = {} if b_r is None else dict(block_q=b_r, block_k=b_c)
            t0 = time.perf_counter()
            res = entry.reference_backward(dout, q, k, v, out, lse, causal=shape.causal, softmax_scale=scale, **kw)
            wall = (time.perf_counter() - t0) * 1e3
            errs = grad_errors((res.dq, res.dk, res.dv), refs, pairs, group)
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
            blk = blocks_text(used) + ("" if used[0] is None or paper_default else SOURCE_TAG[source])
            rows.append([entry.name, blk, f"{wall:.1f}", *errs_text(errs), f"{res.hbm.total / 1e6:.3f}",
                         fmt(None if formula is None else formula / 1e6, ".3f", "n/a"), f"{res.flops / 1e9:.3f}",
                         fmt(None if flops_formula is None else flops_formula / 1e9, ".3f", "n/a"),
                         f"{res.flops / shape.flops:.2f}"])
        except Exception as e:  # noqa: BLE001
            failed |= not isinstance(e, EXPECTED_FAILURES)
            if args.verbose:
                traceback.print_exc()
            rows.append([entry.name, "", "", f"error: {err_text(e)}", "", "", "", "", "", "", ""])
    print(tabulate(rows, headers=["variant", "blocks B_r x B_c", "time (CPU, ms)", "err dq", "err dk", "err dv",
                                  "HBM accesses counted (M elem.)", "formula (M elem.)", "FLOPs counted (G)",
                                  "formula (G)", "FLOPs / fwd"],
                   tablefmt="github", disable_numparse=True))
    why_paper = backward_tiles_note(e for e in chosen if blocks.pick(e, d)[1] != "untiled")
    block_note = (f"blocks: the paper's blocks for M = {blocks.sram} elements (B_c = ceil(M/4d), B_r = min(B_c, d)), "
                  f"as explain --backward{': ' + why_paper if why_paper else ''}; --blocks BRxBC for others"
                  if paper_default else f"blocks: {blocks.describe()}")
    print_notes([
        "time: wall clock of the NumPy backward model on the CPU (not a GPU number)",
        "err dq/dk/dv: ||dX - ref|| / ||ref|| against a float64 backward from the definition "
        "(reference.dense.reference_backward) on the same inputs" + kv_subset_note(pairs, shape),
        "HBM accesses: element reads + writes the backward model counts (every batch and head), beside "
        "fa_variants.iomodel's closed form; `fa-variants explain <variant> --backward` shows the breakdown",
        "FLOPs: the model's matmul FLOPs (recomputation included) beside iomodel.backward_flops; FLOPs / fwd: over "
        "the forward's 4BHNqNkd (/2 causal). On the GPU, TFLOP/s count 2.5x the forward for every backward",
        block_note,
    ] + notes)
    return 1 if failed else 0


def on_gpu(args: argparse.Namespace, chosen: list[Variant], notes: list[str]) -> int:
    """Our backwards (fav.attention_backward) and torch's on the GPU: CUDA-event medians of the backward call."""
    import cupy

    shape = shape_from_args(args)
    chosen, more = validate("compare", chosen, shape, explicit=bool(args.variants))
    notes = notes + more
    bwd_flops = direction_flops(shape, "bwd")
    print(gpu_line())
    print(f"backward, shape {describe(shape)}, {shape.dtype}, "
          f"{'causal (bottom-right)' if shape.causal else 'not causal'}; {bwd_flops / 1e12:.3f} TFLOP per call by "
          f"the 2.5 x 4BHNqNkd{'/2' if shape.causal else ''} convention")

    scale = 1.0 / math.sqrt(shape.head_dim)
    sets = gpu_input_sets(shape, seed=args.seed)
    douts = gpu_dout_sets(shape, len(sets), seed=args.seed + 10_000)
    l2 = l2_bytes()
    group = shape.heads // shape.hkv
    pairs = kv_pairs(shape, REF_FLOP_BUDGET_GPU)
    progress(f"float64 reference backward on {len(pairs)} (batch, kv head) pairs ...")
    refs = reference_grads(douts[0], *sets[0], causal=shape.causal, scale=scale, kv_pairs=pairs, group=group)
    cupy.cuda.get_current_stream().synchronize()

    ctx = dict(shape=shape, scale=scale, sets=sets, douts=douts, refs=refs, kv_pairs=pairs, group=group)
    # BackendUnavailable: the API runs no GPU backward for this variant on this device: a row saying so, not a failure
    run = run_rows(chosen, shape, args, " backward", lambda torch, peer: _run_torch(torch, peer, args, **ctx),
                   lambda entry: _run_variant(entry, args, **ctx), skippable=(BackendUnavailable,))
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
        "(reference.dense.reference_backward)" + kv_subset_note(pairs, shape),
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
        row = [r["variant"], f"{r['ms']:.3f}", f"{tflops(bwd_flops, r['ms']):.1f}", *errs_text(r["errs"]),
               fmt(None if r.get("extra") is None else r["extra"] / 2**20, ".1f", "—")]
        row += [f"{ref_ms[p] / r['ms']:.2f}" for p in ratio_cols]
        rows.append(row)
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))

    print_notes(head + notes + skipped_notes + [f"{label} not run here: {why}" for label, why in unavailable])
    ran = any("ms" in r for r in results)
    return 1 if failed or not (ran or any("skipped" in r for r in results)) else 0


def _run_variant(entry: Variant, args, *, shape, scale, sets, douts, refs, kv_pairs, group) -> dict:
    import cupy

    def fwd(q, k, v):
        return attention(q, k, v, variant=entry.name, causal=shape.causal, softmax_scale=scale, return_lse=True,
                         backend="cuda")

    def call(dout, q, k, v, out, lse):
        return attention_backward(dout, q, k, v, out, lse, variant=entry.name, causal=shape.causal,
                                  softmax_scale=scale, backend="cuda", check_lse=False)

    q, k, v = sets[0]
    out, lse = fwd(q, k, v)
    with PeakMemory() as pm:     # BackendUnavailable (no GPU backward for it here) leaves from here: skipped row
        grads = call(douts[0], q, k, v, out, lse)
        cupy.cuda.get_current_stream().synchronize()
    extra = max(0, pm.peak - nbytes_rounded(*grads))
    errs = grad_errors(grads, refs, kv_pairs, group)
    del grads
    saved = [(out, lse)] + [fwd(*s) for s in sets[1:]]
    rotate = [(d, q, k, v, o, lse) for (q, k, v), d, (o, lse) in zip(sets, douts, saved)]
    times = time_cuda(call, warmup=args.warmup, repeats=args.repeats, rotate_inputs=rotate)
    return dict(variant=entry.name, ms=median(times), errs=errs, extra=extra)


def _run_torch(torch, peer, args, *, shape, scale, sets, douts, refs, kv_pairs, group) -> dict:
    fn = torch_grad_fn(torch)
    tsets = torch_sdpa_grad_sets(torch, peer, shape, scale, sets, douts)   # forward once, not timed
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = fn(*tsets[0])
    torch.cuda.synchronize()
    extra = max(0, torch.cuda.max_memory_allocated() - base - sum(g.numel() * g.element_size() for g in grads))
    errs = grad_errors(torch_grads_to_cupy(torch, grads, sets[0][0].dtype), refs, kv_pairs, group)
    del grads
    times = time_cuda(fn, warmup=args.warmup, repeats=args.repeats, rotate_inputs=tsets)
    return dict(variant=peer, ms=median(times), errs=errs, extra=extra)
