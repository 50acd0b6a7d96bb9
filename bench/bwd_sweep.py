"""Tile sweep of fa2's wgmma backward (cuda_src/fa2_bwd_sm90.cu) on Hopper, beside the mma.sync backward and torch.

    PYTHONPATH=$PWD python3 bench/bwd_sweep.py [--dims 64,128,256] [--quick] [--json out.json]
    PYTHONPATH=$PWD python3 bench/bwd_sweep.py --list      (no GPU: compile the candidates, print registers)

For each head dim d and mask, bf16, N = 4096, B = 4, H = 2048 // d (B * N = 16K tokens, H * d = 2048), this times
the backward call alone (given the fa2 forward's out and lse) of:
  - wgmma default   the three passes with the launcher's tables as they are (kernels/fa2_bwd_sm90.py DKDV_TILES /
                    DQ_TILES),
  - fused dQ writer  at d 64 and 128, the fused dQ (the library's choice there: ``scheme="writer"``),
  - each CANDIDATE  the same launcher with one head dim's table entries swapped (``tiles()`` below) so that
                    ``fa2_bwd_sm90.backward`` runs it; a candidate changes the dK/dV pass, the dQ pass or both,
  - best combo      the fastest dK/dV-only and the fastest dQ-only candidate of that shape together (when both
                    beat the default and no candidate is that pair already),
  - mma.sync        ``fa2_bwd.backward`` (cuda_src/fa2_bwd.cu),
  - torch-flash, torch-cudnn   SDPA's backward (forward run once outside the timed calls, as
                    ``fa-variants compare --backward`` does).
Timing is fa_variants.timing's (CUDA events, pad kernel, inputs rotating through more than L2; median of
--repeats after --warmup). TFLOP/s by the 2.5 x 4BHN^2d (/2 causal) convention. "rel vs default": ||dX - dX_default||
/ ||dX_default|| for dq / dk / dv on the first input set (a candidate above 1e-2 is WRONG: shown in the table).
Registers, local memory (spills) and CTAs per SM are read off the loaded kernels (dK/dV pass | dQ pass).

Candidate configs: dK/dV (BN keys per CTA, split (0 none, 1 CTAs, 2 warpgroups), BM queries per step[, MINB
CTAs/SM of the launch bounds[, BM of the split's dV CTAs[, PIPE: the next step's S^T issued behind this step's
dV/dK]]]); dQ (BM queries per CTA, BN keys per step[, MINB]). ``--list`` checks that each compiles for sm_90a
without spills or ptxas's C7512 "wgmma serialized" note.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fa_variants.kernels import fa2_bwd_sm90 as sm90  # noqa: E402  (no GPU needed to import)

SEQLEN, BATCH, HD = 4096, 4, 2048
DTYPE = "bfloat16"
REL_LIMIT = 1e-2
DEFAULT = "wgmma default"

# head dim -> [(label, dK/dV config or None = the table's, dQ config or None = the table's)], at most 6 each: the
# shipped kernels' code paths with other tiles (``--list`` prints their registers and spills).
CANDIDATES = {
    64: [
        ("kv BM64 no pipe", (128, False, 64), None),         # S^T, dP^T as n64 wgmmas (the table's BM 128: n128)
        ("kv BN64 BM128", (64, False, 128), None),           # one warpgroup a CTA, two CTAs an SM
        ("q 128x64 x2", None, (128, 64, 2)),                 # two CTAs of two warpgroups an SM
        ("q 64x128 x2", None, (64, 128, 2)),                 # 128 keys a step: half the barriers of 64x64
        ("kv BM128 no pipe", (128, False, 128), None),       # the table's without PIPE
        ("kv pipe BM64", (128, False, 64, 1, 64, True), None),  # PIPE with n64 products: a shorter P^T
    ],
    128: [
        ("kv BN64", (64, False), None),                      # one warpgroup a CTA, two CTAs an SM
        ("q 128x128", None, (128, 128)),                     # n128 S, dP (the table's 192x64)
        ("q 64x64", None, (64, 64)),                         # one warpgroup a CTA, two CTAs an SM
        ("q 128x64", None, (128, 64)),                       # two warpgroups instead of three
        ("kv no pipe", (128, False), None),                  # the table's without PIPE
    ],
    256: [
        ("kv CTA split", (128, True, 32, 1, 64), None),      # the table's second entry: 2 CTAs a block, S^T in both
        ("kv WG split BM32", (64, 2, 32), None),             # the warpgroup split with 32 queries a step
        ("kv BN128 BM32", (128, True, 32), None),            # the CTA split, its dV CTAs at BM 32 too
        ("kv BN64 split", (64, True), None),                 # the CTA split of one warpgroup a CTA
        ("q 64x64", None, (64, 64)),                         # one warpgroup a CTA (the table's 128x32: two)
        ("kv pipe BM32", (128, True, 32, 1, 32, True), None),  # the CTA split with PIPE (dV CTAs BM 32 too)
    ],
}
MAX_CANDIDATES = 6


# ------------------------------------------------------------------------------------------------ tables
@contextlib.contextmanager
def tiles(head_dim: int, dkdv=None, dq=None):
    """Within the block, the wgmma launcher's tables for template dim ``head_dim`` hold just ``dkdv`` / ``dq``
    (None: left as they are); the entries (the very list objects) come back on exit, exception or not. They are
    the three passes' tables: a candidate runs ``sm90.backward(..., scheme="separate")``."""
    saved = sm90.DKDV_TILES[head_dim], sm90.DQ_TILES[head_dim]
    try:
        if dkdv is not None:
            sm90.DKDV_TILES[head_dim] = [tuple(dkdv)]
        if dq is not None:
            sm90.DQ_TILES[head_dim] = [tuple(dq)]
        yield
    finally:
        sm90.DKDV_TILES[head_dim], sm90.DQ_TILES[head_dim] = saved


def cfg_text(dkdv, dq) -> str:
    def short(cfg):
        return "(" + ",".join("T" if x is True else "F" if x is False else str(x) for x in cfg) + ")"
    parts = []
    if dkdv is not None:
        parts.append("kv" + short(dkdv))
    if dq is not None:
        parts.append("q" + short(dq))
    return " ".join(parts) or "tables"


def default_text(d: int) -> str:
    return f"kv{cfg_text(sm90.DKDV_TILES[d][0], None)[2:]} q{cfg_text(None, sm90.DQ_TILES[d][0])[1:]}"


def modules(ctype: str, d: int, dkdv=None, dq=None) -> tuple:
    """The name expressions of the module the launcher loads under ``tiles(d, dkdv, dq)``."""
    with tiles(d, dkdv, dq):
        return sm90.instances(ctype, d)


def configs(d: int) -> list:
    """Every (dkdv, dq) pair a sweep of head dim d may run: the default, the candidates, and each pair of a
    dK/dV-only with a dQ-only candidate (a possible "best combo")."""
    kvs = [kv for _, kv, q in CANDIDATES[d] if kv is not None and q is None]
    qs = [q for _, kv, q in CANDIDATES[d] if q is not None and kv is None]
    pairs = [(None, None)] + [(kv, q) for _, kv, q in CANDIDATES[d]] + [(kv, q) for kv in kvs for q in qs]
    return list(dict.fromkeys(pairs))


# ------------------------------------------------------------------------------------------------ --list
def list_candidates(dims) -> int:
    """Compile every candidate here (NVRTC, sm_90a, no GPU) and print registers, spills and ptxas notes."""
    from tabulate import tabulate
    from fa_variants import jit
    from fa_variants.kernels.common import CTYPE
    ctype = CTYPE[DTYPE]
    rows, bad = [], 0
    for d in dims:
        for label, dkdv, dq in [(DEFAULT, None, None)] + CANDIDATES[d]:
            exprs = modules(ctype, d, dkdv, dq)
            comp = jit.compile_source(sm90.SOURCE, exprs, "sm_90a")
            reps = {r.kernel: r for r in comp.reports()}
            notes = sorted({ln.split(")")[0].split("(")[-1] for ln in comp.log.splitlines() if "(C75" in ln})
            with tiles(d, dkdv, dq):
                kv, qc = sm90.DKDV_TILES[d][0], sm90.DQ_TILES[d][0]
                smem = (sm90.dkdv_smem(d, kv), sm90.dq_smem(d, qc))
            r_kv, r_q = reps[sm90.dkdv_instance(ctype, d, kv)], reps[sm90.dq_instance(ctype, d, qc)]
            spills = r_kv.spill_stores + r_kv.spill_loads + r_q.spill_stores + r_q.spill_loads
            bad += bool(spills or notes)
            rows.append([d, label, cfg_text(kv, None), cfg_text(None, qc), f"{r_kv.registers} / {r_q.registers}",
                         f"{smem[0] / 1024:.1f} / {smem[1] / 1024:.1f}", spills, " ".join(notes)])
    print(tabulate(rows, headers=["d", "candidate", "dK/dV", "dQ", "regs kv / q", "smem KB kv / q", "spill B",
                                  "ptxas"], tablefmt="github", disable_numparse=True))
    return 1 if bad else 0


# ------------------------------------------------------------------------------------------------ GPU
def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def precompile(jobs) -> float:
    """Fill the disk cache (FA_VARIANTS_CACHE) with ``jobs`` [(source, name expressions)] in parallel processes,
    so that the launchers' first calls only load cubins. Forked workers (NVRTC only: no CUDA context is used in
    them); any failure leaves the compile to the launch, which reports it."""
    import concurrent.futures as cf
    import multiprocessing as mp
    from fa_variants import jit
    t0 = time.perf_counter()
    jobs = list(dict.fromkeys(jobs))
    workers = min(len(jobs), os.cpu_count() or 1, 16)
    if workers < 2 or "fork" not in mp.get_all_start_methods():
        return 0.0
    try:
        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as ex:
            futs = [ex.submit(jit.cached_cubin, src, exprs, "sm_90a") for src, exprs in jobs]
            errors = [f.exception() for f in futs]
    except Exception as e:  # noqa: BLE001 - no process pool here: the launches compile one by one
        errors = [e]
    for e in dict.fromkeys(f"{type(e).__name__}: {str(e)[:300]}" for e in errors if e is not None):
        _progress(f"precompile: {e}")
    return time.perf_counter() - t0


def rel_errs(grads, ref) -> tuple:
    import cupy
    out = []
    for g, r in zip(grads, ref):
        g32, r32 = g.astype(cupy.float32), r.astype(cupy.float32)
        out.append(float(cupy.linalg.norm(g32 - r32) / max(float(cupy.linalg.norm(r32)), 1e-30)))
    return tuple(out)


def kernel_info(ctype: str, d: int, dkdv=None, dq=None) -> str:
    """'regs kv|q, local B kv|q, CTAs/SM kv|q' of the loaded wgmma kernels of a config (after a call)."""
    from cupy.cuda import driver
    from fa_variants import jit
    exprs = modules(ctype, d, dkdv, dq)
    with tiles(d, dkdv, dq):
        kv, qc = sm90.DKDV_TILES[d][0], sm90.DQ_TILES[d][0]
    launches = ((sm90.dkdv_instance(ctype, d, kv), sm90.dkdv_threads(kv), sm90.dkdv_smem(d, kv)),
                (sm90.dq_instance(ctype, d, qc), 2 * sm90.dq_config(qc)[0], sm90.dq_smem(d, qc)))
    regs, local, ctas = [], [], []
    for expr, block, smem in launches:
        k = jit.kernel(sm90.SOURCE, expr, exprs)
        regs.append(str(k.num_regs))
        local.append(str(k.local_size_bytes))
        try:
            ctas.append(str(driver.occupancyMaxActiveBlocksPerMultiprocessor(k.kernel.ptr, block, smem)))
        except Exception:  # noqa: BLE001
            ctas.append("?")
    return f"{'|'.join(regs)}", f"{'|'.join(local)}", f"{'|'.join(ctas)}"


def run_shape(shape, args, torch, rows, record) -> None:
    import cupy
    import fa_variants as fav
    from fa_variants import timing
    from fa_variants.kernels import fa2_bwd
    from fa_variants.kernels.common import CTYPE
    d = shape.head_dim
    ctype = CTYPE[shape.dtype]
    scale = 1.0 / math.sqrt(d)
    flops = timing.direction_flops(shape, "bwd")
    sets = timing.gpu_input_sets(shape, seed=args.seed)
    douts = timing.gpu_dout_sets(shape, len(sets), seed=args.seed + 10_000)
    saved = [fav.attention(q, k, v, variant="fa2", causal=shape.causal, softmax_scale=scale, return_lse=True,
                           backend="cuda") for q, k, v in sets]
    rotate = [(dout, q, k, v, o, lse) for (q, k, v), dout, (o, lse) in zip(sets, douts, saved)]
    results = []   # dicts: impl, config, ms, errs, info, kv, q

    def time_fn(fn, rot):
        return timing.median(timing.time_cuda(fn, warmup=args.warmup, repeats=args.repeats, rotate_inputs=rot))

    def ours(fn, **kw):
        return lambda dout, q, k, v, o, lse: fn(dout, q, k, v, o, lse, causal=shape.causal, softmax_scale=scale,
                                                **kw)

    ref = None

    def wgmma(label, dkdv, dq, scheme="separate"):
        nonlocal ref
        config = ("fused dQ " + ",".join(map(str, sm90.FUSED_TILES[d])) if scheme != "separate"
                  else default_text(d) if dkdv is None and dq is None else cfg_text(dkdv, dq))
        res = dict(impl=label, config=config, kv=dkdv, q=dq, mode=scheme)
        try:
            with tiles(d, dkdv, dq):
                grads = sm90.backward(*rotate[0], causal=shape.causal, softmax_scale=scale, scheme=scheme)
                cupy.cuda.get_current_stream().synchronize()
                if ref is None:
                    ref = grads
                res["errs"] = rel_errs(grads, ref)
                del grads
                res["ms"] = time_fn(ours(sm90.backward, scheme=scheme), rotate)
            if scheme == "separate":  # (the three passes' kernels; the writer row reports none)
                res["info"] = kernel_info(ctype, d, dkdv, dq)
        except Exception as e:  # noqa: BLE001 - a failing candidate is a row, not the end of the sweep
            res["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        results.append(res)
        _progress(f"  {label}: {res.get('ms', res.get('error'))}")
        return res

    _progress(f"{shape.id}")
    wgmma(DEFAULT, None, None)
    if ref is None:
        rows.append([shape.id, DEFAULT, "", "error", "", "", "", "", results[-1].get("error", "")])
        return
    if d in sm90.FUSED_TILES:  # the fused dQ beside the three passes
        wgmma("fused dQ writer", None, None, "writer")
    for label, dkdv, dq in ([] if args.no_candidates else CANDIDATES[d]):
        wgmma(label, dkdv, dq)

    # the fastest change of each pass alone, together
    base = results[0].get("ms", math.inf)
    ok = [r for r in results if "ms" in r and max(r["errs"]) < REL_LIMIT]
    best_kv = min((r for r in ok if r["q"] is None and r["kv"] is not None), key=lambda r: r["ms"], default=None)
    best_q = min((r for r in ok if r["kv"] is None and r["q"] is not None), key=lambda r: r["ms"], default=None)
    if not args.no_candidates and best_kv and best_q and best_kv["ms"] < base and best_q["ms"] < base and not any(
            r["kv"] == best_kv["kv"] and r["q"] == best_q["q"] for r in results):
        wgmma("best combo", best_kv["kv"], best_q["q"])

    if not args.no_mma_sync:
        res = dict(impl="mma.sync", config="fa2_bwd.cu tables")
        try:
            grads = fa2_bwd.backward(*rotate[0], causal=shape.causal, softmax_scale=scale)
            res["errs"] = rel_errs(grads, ref)
            del grads
            res["ms"] = time_fn(ours(fa2_bwd.backward), rotate)
        except Exception as e:  # noqa: BLE001
            res["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        results.append(res)
        _progress(f"  mma.sync: {res.get('ms', res.get('error'))}")

    if torch is not None:
        from fa_variants.cli import torch_grads_to_cupy
        for peer in (("torch-flash",) if args.quick else tuple(timing.TORCH_BACKENDS)):
            res = dict(impl=peer, config="SDPA backward")
            try:
                fn = timing.torch_grad_fn(torch)
                tsets = timing.torch_sdpa_grad_sets(torch, peer, shape, scale, sets, douts)
                torch.cuda.synchronize()
                grads = torch_grads_to_cupy(torch, fn(*tsets[0]), sets[0][0].dtype)
                res["errs"] = rel_errs(grads, ref)
                del grads
                res["ms"] = time_fn(fn, tsets)
                del tsets
            except Exception as e:  # noqa: BLE001
                res["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            results.append(res)
            _progress(f"  {peer}: {res.get('ms', res.get('error'))}")

    flash = next((r["ms"] for r in results if r["impl"] == "torch-flash" and "ms" in r), None)
    library = sm90.dq_mode(d, shape.causal)  # the row fa2's backward runs
    for r in results:
        if "error" in r:
            rows.append([shape.id, r["impl"], r["config"], "", "", "", "", "", r["error"]])
            continue
        errs = "/".join(f"{e:.1e}" for e in r["errs"])
        verdict = "" if max(r["errs"]) < REL_LIMIT else " WRONG"
        regs, local, ctas = r.get("info", ("", "", ""))
        rows.append([shape.id, r["impl"], r["config"], f"{r['ms']:.3f}", f"{timing.tflops(flops, r['ms']):.1f}",
                     f"{flash / r['ms']:.2f}" if flash else "", f"{regs} / {ctas}" if regs else "", errs + verdict,
                     "; ".join(n for n in ("library default" if r.get("mode") == library and r.get("kv") is None
                                           and r.get("q") is None else "",
                                           f"local memory {local} B (spills)" if local and local != "0|0" else "")
                               if n)])
        record.append(dict(shape=shape.id, head_dim=d, causal=shape.causal, impl=r["impl"], config=r["config"],
                           dkdv=r.get("kv"), dq=r.get("q"), ms=r["ms"], tflops=timing.tflops(flops, r["ms"]),
                           x_flash=flash / r["ms"] if flash else None, rel_vs_default=r["errs"],
                           regs=regs, local=local, ctas_per_sm=ctas))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Candidates (dK/dV cfg, dQ cfg):\n" + "\n".join(
                                     f"  d {d}: " + "; ".join(f"{lab} = {cfg_text(kv, q)}" for lab, kv, q in c)
                                     for d, c in CANDIDATES.items()))
    ap.add_argument("--dims", default="64,128,256", help="head dims, comma-separated (of 64, 128, 256)")
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--quick", action="store_true",
                    help="not-causal shapes only, 3 repeats after 1 warm-up, torch flash as the only peer")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-torch", action="store_true", help="leave out torch SDPA's rows")
    ap.add_argument("--no-mma-sync", action="store_true", help="leave out the mma.sync backward's row")
    ap.add_argument("--seqlens", default=str(SEQLEN),
                    help=f"comma-separated N (default {SEQLEN}); B = {BATCH * SEQLEN} / N (B * N = 16K tokens)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default=DTYPE,
                    help="the inputs' dtype (the candidates are precompiled for bf16 only; others compile when first run)")
    ap.add_argument("--no-candidates", action="store_true",
                    help="only the default (and, at d 64 and 128, the fused dQ) beside the peers")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    ap.add_argument("--list", action="store_true",
                    help="no GPU: compile the candidates for sm_90a here and print registers/spills, then exit")
    args = ap.parse_args(argv)
    try:
        dims = [int(x) for x in args.dims.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--dims takes comma-separated integers, got {args.dims!r}")
    if not dims or any(d not in CANDIDATES for d in dims):
        ap.error(f"--dims must be of {sorted(CANDIDATES)}, got {args.dims!r}")
    if args.list:
        return list_candidates(dims)
    if args.quick:
        args.causal, args.warmup, args.repeats = "no", 1, 3

    t_start = time.perf_counter()
    import cupy
    from tabulate import tabulate
    from fa_variants import gpu, jit, timing
    from fa_variants.kernels import fa2, fa2_bwd
    from fa_variants.kernels.common import CTYPE, pick_tiles
    try:
        arch = jit.device_arch()
    except Exception as e:  # noqa: BLE001 - no CUDA device (or driver) here
        arch = f"none ({type(e).__name__})"
    if arch != "sm_90a":
        print(f"bwd_sweep: needs an sm_90 GPU (the wgmma backward is sm_90a only), this device: {arch}; "
              f"--list compiles the candidates without one", file=sys.stderr)
        return 2
    torch = None
    if not args.no_torch:
        torch, why = timing.torch_status()
        if torch is None:
            _progress(f"torch rows left out: {why}")

    ctype = CTYPE[DTYPE]
    jobs = []
    for d in dims:
        jobs.append((fa2.SM90_SOURCE, (fa2.sm90_instance(ctype, d, pick_tiles(fa2.SM90_TILES, fa2.sm90_smem_bytes,
                                                                                 d)),)))
        jobs += [(sm90.SOURCE, modules(ctype, d, kv, q)) for kv, q in configs(d)]
        if not args.no_mma_sync:
            jobs.append((fa2_bwd.SOURCE, fa2_bwd.instances(ctype, d)))
    if not args.no_mma_sync:
        jobs.append((fa2_bwd.SOURCE, (fa2_bwd.delta_instance(ctype),)))
    _progress(f"precompiling {len(jobs)} modules ...")
    t_compile = precompile(jobs)

    try:
        seqlens = [int(x) for x in args.seqlens.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--seqlens takes comma-separated integers, got {args.seqlens!r}")
    shapes = [timing.Shape(batch=max(1, BATCH * SEQLEN // n), heads=HD // d, seqlen_q=n, head_dim=d, dtype=args.dtype,
                           causal=c)
              for d in dims for n in seqlens for c in ((False, True) if args.causal == "both" else (args.causal == "yes",))]
    rows, record = [], []
    for shape in shapes:
        run_shape(shape, args, torch, rows, record)
        cupy.get_default_memory_pool().free_all_blocks()   # this shape's inputs are gone with run_shape

    print(f"GPU: {gpu.probe().name}; {args.dtype}, N {args.seqlens}, B = {BATCH * SEQLEN} / N, H = {HD} / d; backward call alone, median of "
          f"{args.repeats} after {args.warmup} warm-up; TFLOP/s = 2.5 x 4BHN^2d (/2 causal)")
    print(tabulate(rows, headers=["shape", "impl", "config", "ms", "TFLOP/s", "x flash",
                                  "regs kv|q / CTAs/SM kv|q", "rel vs default dq/dk/dv", "note"],
                   tablefmt="github", disable_numparse=True))
    # the fastest correct wgmma config per shape
    for sid in dict.fromkeys(r["shape"] for r in record):
        mine = [r for r in record if r["shape"] == sid and r["impl"] not in ("mma.sync", *timing.TORCH_BACKENDS)
                and max(r["rel_vs_default"]) < REL_LIMIT]
        if mine:
            best = min(mine, key=lambda r: r["ms"])
            base = next(r for r in mine if r["impl"] == DEFAULT)
            print(f"best {sid}: {best['impl']} {best['config']} {best['ms']:.3f} ms "
                  f"({base['ms'] / best['ms']:.2f}x the default"
                  + (f", {best['x_flash']:.2f}x torch flash)" if best["x_flash"] else ")"))
    print(f"wall {time.perf_counter() - t_start:.0f} s (precompile {t_compile:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
