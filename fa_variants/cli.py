"""``fa-variants``: compare the variants on this machine, explain their HBM traffic, build every kernel.

    fa-variants compare [--batch 4 --heads 16 --seqlen 4096 --head-dim 128 --dtype bfloat16 --causal ...]
    fa-variants explain fa2 [--seqlen 4096 --head-dim 128 --sram 32768]
    fa-variants build [--arch 80,86,89,90a] [--variants fa1,fa2]

The report goes to stdout; progress lines go to stderr. ``python -m fa_variants.cli`` works without installing.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import sys
import time
import traceback

import numpy as np
from tabulate import tabulate

from . import iomodel, jit, timing
from .api import attention
from .reference.dense import attention64, pick_pairs, rel_error
from .registry import VARIANTS, get, variants

CPU_SHAPE = dict(batch=1, heads=2, seqlen=256, head_dim=64)
GPU_SHAPE = dict(batch=4, heads=16, seqlen=4096, head_dim=128)
REF_FLOP_BUDGET_GPU = 2e12      # float64 FLOPs spent on the reference before falling back to a subset of heads
REF_FLOP_BUDGET_CPU = 2e10
# failures that are a statement about the problem size, not a bug: reported in the table, exit code stays 0
EXPECTED_FAILURES = (MemoryError,)


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _err_text(e: BaseException, limit: int = 160) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _gpu_reason() -> str:
    """'' when a CUDA device is usable through CuPy, else why not."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001
        return f"CuPy is not importable ({type(e).__name__})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001
        return f"no usable CUDA driver/device ({type(e).__name__})"
    return "" if n > 0 else "no CUDA device"


def _parse_variants(text: str | None) -> list:
    if not text:
        return variants()
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"fa-variants: unknown variant(s) {unknown}; choose from {sorted(VARIANTS)}")
    return [get(n) for n in names]


def _fmt(x, spec: str, missing: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return missing
    return format(x, spec)


# ------------------------------------------------------------------------------------------------ compare
def _shape_from_args(args, defaults) -> timing.Shape:
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else defaults[name]  # noqa: E731
    return timing.Shape(batch=pick("batch"), heads=pick("heads"), seqlen_q=pick("seqlen"), head_dim=pick("head_dim"),
                        dtype=args.dtype, causal=bool(args.causal), heads_kv=args.heads_kv, seqlen_k=args.seqlen_k)


def _check_shape(shape: timing.Shape) -> None:
    for name, val in (("batch", shape.batch), ("heads", shape.heads), ("seqlen", shape.seqlen_q),
                      ("seqlen-k", shape.nk), ("head-dim", shape.head_dim), ("heads-kv", shape.hkv)):
        if val < 1:
            raise SystemExit(f"fa-variants compare: --{name} must be >= 1, got {val}")
    if shape.heads % shape.hkv:
        raise SystemExit(f"fa-variants compare: --heads ({shape.heads}) must be a multiple of --heads-kv ({shape.hkv})")


def _describe(shape: timing.Shape) -> str:
    s = (f"B={shape.batch}, H={shape.heads}, N={shape.seqlen_q}, d={shape.head_dim}")
    if shape.hkv != shape.heads:
        s += f", H_kv={shape.hkv}"
    if shape.nk != shape.seqlen_q:
        s += f", N_k={shape.nk}"
    return s


def _unsupported(entry, shape) -> str:
    if not entry.supports(shape.dtype, shape.head_dim):
        return (f"does not take {shape.dtype} with head_dim {shape.head_dim} (dtypes {list(entry.dtypes)}, "
                f"head dims {entry.head_dims_text})")
    return ""


def _modeled_hbm(entry, shape, tiles) -> float | None:
    try:
        bq, bk = tiles
        return entry.hbm_bytes(shape.batch, shape.heads, shape.seqlen_q, shape.nk, shape.head_dim,
                               bq, bk, shape.causal, shape.itemsize)
    except Exception:  # noqa: BLE001 - no model for this variant (yet): leave the cell empty
        return None


def cmd_compare(args) -> int:
    if args.dtype == "fp8":  # the FP8 comparison: fa2_fp8 on bf16 inputs (quantized on the fly) beside bf16 fa2
        args.dtype = "bfloat16"
        args.variants = args.variants or "fa2,fa2_fp8"
    chosen = _parse_variants(args.variants)
    why_no_gpu = "forced by --numpy" if args.numpy else _gpu_reason()
    if why_no_gpu:
        return _compare_numpy(args, chosen, why_no_gpu)
    return _compare_gpu(args, chosen)


def _compare_numpy(args, chosen, why) -> int:
    explicit = any(getattr(args, n) is not None for n in CPU_SHAPE)
    shape = _shape_from_args(args, CPU_SHAPE)
    _check_shape(shape)
    size = _describe(shape)
    lead = "no CUDA GPU" if why != "forced by --numpy" else "--numpy"
    print(f"{lead}: running the NumPy models at {'the requested' if explicit else 'a small'} size ({size})"
          + ("" if lead == "--numpy" else f" [{why}]"))
    print(f"dtype {shape.dtype}, {'causal (bottom-right)' if shape.causal else 'not causal'}; "
          f"the models compute in float64 on the CPU")
    q, k, v = timing.random_inputs(shape, np, seed=args.seed)
    scale = 1.0 / math.sqrt(shape.head_dim)
    pairs = pick_pairs(shape.batch, shape.heads, shape.seqlen_q, shape.nk, shape.head_dim, REF_FLOP_BUDGET_CPU)
    ref, _ = attention64(q, k, v, causal=shape.causal, scale=scale, pairs=pairs)
    rows, notes, failed = [], [], False
    for i, entry in enumerate(chosen, 1):
        _progress(f"[{i}/{len(chosen)}] {entry.name} (NumPy model)")
        blocks, source = _model_blocks(entry, shape.head_dim)
        try:
            kw = {} if blocks == (None, None) or blocks is None else dict(block_q=blocks[0], block_k=blocks[1])
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
            blk = "—" if used == (None, None) else f"{used[0]}x{used[1]}" + ("" if source == "kernel" else f" ({source})")
            rows.append([entry.name, blk, f"{wall:.1f}", f"{err:.1e}", f"{counted / 1e6:.3f}",
                         _fmt(None if formula is None else formula / 1e6, ".3f", "n/a")])
        except Exception as e:  # noqa: BLE001
            failed |= not isinstance(e, EXPECTED_FAILURES)
            rows.append([entry.name, "", "", f"error: {_err_text(e)}", "", ""])
    print(tabulate(rows, headers=["variant", "blocks B_r x B_c", "time (CPU, ms)", "rel. error",
                                  "HBM accesses counted (M elem.)", "formula (M elem.)"],
                   tablefmt="github", disable_numparse=True))
    notes.append("time: wall clock of the NumPy model on the CPU (not a GPU number)")
    notes.append("rel. error: ||out - ref|| / ||ref|| against a direct float64 computation on the same inputs"
                 + _subset_note(pairs, shape))
    notes.append("HBM accesses: element reads + writes the model counts (every batch and head), beside the "
                 "closed-form count of fa_variants.iomodel; `fa-variants explain <variant>` shows the breakdown")
    _print_notes(notes)
    return 1 if failed else 0


def _model_blocks(entry, head_dim):
    """(blocks, where they come from): the launcher's tiles when importable, else the model's defaults."""
    try:
        t = entry.launcher.tiles(head_dim)
        return t, "kernel"
    except Exception:  # noqa: BLE001 - launcher missing or head dim it does not tile
        return None, "model default"


def _subset_note(pairs, shape) -> str:
    total = shape.batch * shape.heads
    if len(pairs) == total:
        return ""
    return (f"; computed on {len(pairs)} of the {total} (batch, head) pairs, evenly spaced "
            f"(the full float64 reference would cost too much)")


def _print_notes(notes):
    for i, n in enumerate(notes, 1):
        print(f"  [{i}] {n}")


def _compare_gpu(args, chosen) -> int:
    import cupy

    shape = _shape_from_args(args, GPU_SHAPE)
    _check_shape(shape)
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"GPU: {name} (compute capability {dev.compute_capability}), CuPy {cupy.__version__}, "
          f"NVRTC {'.'.join(map(str, jit.nvrtc_version()))}")
    print(f"shape {_describe(shape)}, {shape.dtype}, {'causal (bottom-right)' if shape.causal else 'not causal'}; "
          f"{shape.flops / 1e12:.3f} TFLOP per call by the 4BHNqNkd{'/2' if shape.causal else ''} convention")

    scale = 1.0 / math.sqrt(shape.head_dim)
    sets = timing.gpu_input_sets(shape, seed=args.seed)
    q, k, v = sets[0]
    l2 = timing.l2_bytes()
    pairs = pick_pairs(shape.batch, shape.heads, shape.seqlen_q, shape.nk, shape.head_dim, REF_FLOP_BUDGET_GPU)
    _progress(f"float64 reference on {len(pairs)} (batch, head) pairs ...")
    ref, _ = attention64(q, k, v, causal=shape.causal, scale=scale, pairs=pairs)
    cupy.cuda.get_current_stream().synchronize()

    results, unavailable, failed = [], [], False
    torch, torch_why = (None, "--no-torch") if args.no_torch else timing.torch_status()
    if torch is not None and timing.torch_sdpa_unsupported(shape):
        torch_why = timing.torch_sdpa_unsupported(shape)
        torch = None
    peers = list(timing.TORCH_BACKENDS) if torch is not None else []
    todo = [e for e in chosen] + peers
    for i, item in enumerate(todo, 1):
        label = item if isinstance(item, str) else item.name
        if not isinstance(item, str):
            ok, why = item.available()
            why = why or _unsupported(item, shape)
            if not ok or why:
                unavailable.append((label, why))
                continue
        _progress(f"[{i}/{len(todo)}] {label} ...")
        try:
            if isinstance(item, str):
                r = _run_torch(torch, item, shape, scale, sets, ref, pairs, args)
            else:
                r = _run_variant(item, shape, scale, sets, ref, pairs, args)
            results.append(r)
        except Exception as e:  # noqa: BLE001 - our variants' failures set the exit code; a peer's do not
            failed |= not isinstance(item, str) and not isinstance(e, EXPECTED_FAILURES)
            if args.verbose:
                traceback.print_exc()
            results.append(dict(variant=label, error=_err_text(e)))
        finally:
            cupy.get_default_memory_pool().free_all_blocks()
            if torch is not None:
                torch.cuda.empty_cache()

    ref_ms = {r["variant"]: r["ms"] for r in results if "ms" in r}
    headers = ["variant", "tiles", "time (ms)", "TFLOP/s", "rel. error", "HBM model (GB)", "extra mem (MB)"]
    ratio_cols = [p for p in peers if p in ref_ms]
    headers += [f"x {p}" for p in ratio_cols]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["variant"], "", "", "", f"error: {r['error']}", "", ""] + [""] * len(ratio_cols))
            continue
        row = [r["variant"], r.get("tiles", "—"), f"{r['ms']:.3f}", f"{timing.tflops(shape.flops, r['ms']):.1f}", f"{r['err']:.1e}",
               _fmt(None if r.get("hbm") is None else r["hbm"] / 1e9, ".3f", "—"),
               _fmt(None if r.get("extra") is None else r["extra"] / 2**20, ".1f", "—") + r.get("extra_how", "")]
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
        "HBM model: the papers' closed-form traffic (fa_variants.iomodel) with the kernel's tiles; a model, "
        "not a measurement (ncu's dram__bytes measures; L2 absorbs part of the K/V re-reads)",
        "extra mem: peak of the memory pool during one call beyond the output and LSE (CuPy pool for our "
        "kernels, torch's caching allocator for SDPA, where the LSE counts as extra); '*' = the launcher's "
        "extra_bytes() where no measurement was possible",
    ]
    if ratio_cols:
        notes.append("x torch-...: speed relative to that torch SDPA backend on the same inputs (> 1 is faster)")
    if not peers:
        notes.append(f"torch SDPA rows not run: {torch_why}")
    for label, why in unavailable:
        notes.append(f"{label} not run here: {why}")
    _print_notes(notes)
    return 1 if failed or not results else 0


def _run_variant(entry, shape, scale, sets, ref, pairs, args) -> dict:
    import cupy
    q, k, v = sets[0]
    extra, how = None, ""
    try:
        with timing.PeakMemory() as pm:
            out, lse = attention(q, k, v, variant=entry.name, causal=shape.causal, softmax_scale=scale, return_lse=True, backend="cuda")
            cupy.cuda.get_current_stream().synchronize()
        extra = max(0, pm.peak - timing.nbytes_rounded(out, lse))
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

    times = timing.time_cuda(call, warmup=args.warmup, repeats=args.repeats, rotate_inputs=sets)
    try:
        tiles = entry.launcher.tiles(shape.head_dim)
    except Exception:  # noqa: BLE001
        tiles = (None, None)
    return dict(variant=entry.name, ms=timing.median(times), err=err, hbm=_modeled_hbm(entry, shape, tiles),
                extra=extra, extra_how=how, tiles="—" if tiles[0] is None else f"{tiles[0]}x{tiles[1]}")


def _run_torch(torch, peer, shape, scale, sets, ref, pairs, args) -> dict:
    import cupy
    fn = timing.torch_sdpa_fn(torch, peer, shape, scale)
    tsets = [tuple(timing.as_torch_bhnd(torch, a) for a in s) for s in sets]
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
    times = timing.time_cuda(fn, warmup=args.warmup, repeats=args.repeats, rotate_inputs=tsets)
    return dict(variant=peer, ms=timing.median(times), err=err, hbm=None, extra=extra)


# ------------------------------------------------------------------------------------------------ explain
def cmd_explain(args) -> int:
    print(iomodel.explain(get(args.variant), args.seqlen, args.head_dim, args.sram))
    return 0


# ------------------------------------------------------------------------------------------------ build
def _build_one(entry, source, expr, arch, options):
    t0 = time.perf_counter()
    compiled = jit.compile_source(source, (expr,), arch, options)
    return compiled, time.perf_counter() - t0


def cmd_build(args) -> int:
    chosen = _parse_variants(args.variants)
    try:
        wanted = None if not args.arch else {jit.normalize_arch(a) for a in args.arch.split(",") if a.strip()}
    except ValueError as e:
        raise SystemExit(f"fa-variants build: {e}") from None
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
        archs = [a for a in entry.archs if wanted is None or jit.normalize_arch(a) in wanted]
        if not archs:
            _progress(f"{entry.name}: none of its archs {list(entry.archs)} was asked for; skipped")
        tasks += [(entry.name, source, e, a, options) for a in archs for source, exprs in launcher.compile_units(a).items()
                  for e in exprs]
    print(f"NVRTC {'.'.join(map(str, jit.nvrtc_version()))}: compiling {len(tasks)} kernel instances "
          f"with {args.jobs} threads", file=sys.stderr, flush=True)
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:  # NVRTC releases the GIL
        futs = {pool.submit(_build_one, get(n), s, e, a, o): (n, s, e, a) for n, s, e, a, o in tasks}
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


# ------------------------------------------------------------------------------------------------ main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fa-variants", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compare", help="run every variant (and torch SDPA) on the same inputs: time, "
                       "TFLOP/s, error, modeled HBM traffic, extra memory")
    c.add_argument("--batch", type=int, help=f"default {GPU_SHAPE['batch']} (GPU) / {CPU_SHAPE['batch']} (NumPy)")
    c.add_argument("--heads", type=int, help=f"default {GPU_SHAPE['heads']} / {CPU_SHAPE['heads']}")
    c.add_argument("--heads-kv", type=int, help="K/V heads for MQA/GQA (default: = heads)")
    c.add_argument("--seqlen", type=int, help=f"query length, default {GPU_SHAPE['seqlen']} / {CPU_SHAPE['seqlen']}")
    c.add_argument("--seqlen-k", type=int, help="key length (default: = seqlen); causal is bottom-right aligned")
    c.add_argument("--head-dim", type=int, help=f"default {GPU_SHAPE['head_dim']} / {CPU_SHAPE['head_dim']}")
    c.add_argument("--dtype", choices=["float16", "bfloat16", "fp8"], default="bfloat16",
                   help="fp8: fa2_fp8 (bf16 inputs quantized to e4m3 on the fly) beside fa2 in bf16")
    c.add_argument("--causal", action="store_true")
    c.add_argument("--variants", help=f"comma-separated subset of {','.join(VARIANTS)}")
    c.add_argument("--repeats", type=int, default=30, help="timed calls (median reported), default 30")
    c.add_argument("--warmup", type=int, default=5, help="untimed calls first, default 5")
    c.add_argument("--no-torch", action="store_true", help="skip the torch SDPA rows")
    c.add_argument("--numpy", action="store_true", help="run the NumPy models even when there is a GPU")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failing variants")
    c.set_defaults(func=cmd_compare)

    e = sub.add_parser("explain", help="a variant's loop order and HBM traffic: paper formula vs the NumPy "
                       "model's count")
    e.add_argument("variant", choices=list(VARIANTS))
    e.add_argument("--seqlen", type=int, default=1024, help="N, default 1024 (the model runs once at this size)")
    e.add_argument("--head-dim", type=int, default=64, help="d, default 64")
    e.add_argument("--sram", type=int, default=getattr(iomodel, "DEFAULT_SRAM", 32768),
                   help="on-chip memory M in elements (default %(default)s)")
    e.set_defaults(func=cmd_explain)

    b = sub.add_parser("build", help="compile every kernel specialization with NVRTC (no GPU needed); "
                       "table of registers, shared memory, spills; non-zero exit on an error or a spill")
    b.add_argument("--arch", help="comma-separated, e.g. 80,86,89,90a (default: each variant's own archs)")
    b.add_argument("--variants", help=f"comma-separated subset of {','.join(VARIANTS)}")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile threads (default: CPU count)")
    b.add_argument("-v", "--verbose", action="store_true", help="full NVRTC logs of failures")
    b.set_defaults(func=cmd_build)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "repeats", 1) < 1 or getattr(args, "warmup", 0) < 0:
        raise SystemExit("fa-variants: --repeats must be >= 1 and --warmup >= 0")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
