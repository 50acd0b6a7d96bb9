"""The recompute exercise: the standard backward, which keeps the N x N softmax P, against FlashAttention-2's,
which recomputes P from Q, K and the LSE: more FLOPs, O(N) memory.

    PYTHONPATH=$PWD python3 bench/recompute.py [--json recompute.json] [--unvalidated-kernel] [--no-torch]
        [--seqlens 2048,4096,8192,16384] [--batch 1 --heads 16 --head-dim 128 --dtype bfloat16] [--causal]
        [--repeats 10 --warmup 3] [--no-memory-check]

Rows, for each N (default bf16, d = 128, B = 1, H = 16, N = 2K, 4K, 8K, 16K, not causal):

  naive            ours, fav.attention_backward(variant="naive", backend="cuda"): the standard backward (P stored)
  fa2              ours, fav.attention_backward(variant="fa2", backend="cuda"): recomputation, deterministic dQ
                   (on sm_90 at d 64 and 128 the fused dQ: 5 products; else the separate dQ pass: 7)
  fa2_bwd_kernel   fa2's mma.sync backward kernel, kernels.fa2_bwd.backward called directly (skipping the API's
                   checks), only with --unvalidated-kernel
  fa3              ours, fav.attention_backward(variant="fa3", backend="cuda") on sm_90a: FA3's backward (a TMA
                   producer warp, dQ summed across K/V blocks in a fixed order: 5 products); skipped elsewhere
  torch-math       torch SDPA's MATH backend: autograd keeps the forward's softmax P (torch's standard backward)
  torch-flash      torch SDPA's FLASH_ATTENTION backend: FA2's backward (CUTLASS), dQ accumulated atomically

torch-math is torch's stored-P backward and torch-flash its recomputing one, beside ours (naive and fa2 through
fav.attention_backward, both GPU kernels tested on the H200).

Columns: the FLOPs the backward computes (``iomodel.backward_flops`` x B x H: the standard backward 2x the forward's
4BHN^2d, fa2 with its separate dQ pass 3.5x, FA2 with atomic dQ 2.5x, and so fa2's fused dQ, which ``fa2_dq_mode``
picks as the kernels do; causal counted on 64 x 64 blocks), the
median CUDA-event time of the backward call alone (its forward ran beforehand, untimed), TFLOP/s by the 2.5x
convention (anchors/h200-peers.md) and by those FLOPs, and device memory beyond inputs and outputs:

  held       what the forward leaves for the backward beyond out: LSE for ours (the API's backward is handed out
             and lse, nothing else), autograd's saved tensors for torch (P for MATH)
  bwd peak   the peak during the backward call beyond dq, dk and dv (CuPy's pool for ours, torch's caching
             allocator for torch); for naive this is where P, dP and dS live

The memory check (skip with --no-memory-check): fa2's backward at B = 1, H = 16, N = 131072, d = 128 allocates
O(N) beyond dq, dk, dv (its D = rowsum(dO o O): B H N floats; the fused dQ also its fp32 dQ sum, B H N d floats, as
torch flash's dq_accum), printed with the figures; naive refuses the size
(its S/P alone would be B H N^2 fp32 = 1 TiB). torch-flash's backward at that size beside it.

Without a GPU every measured cell is empty and each row says why; the FLOPs columns and the memory model still
print. ``--json PATH`` writes the rows and the memory check.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from tabulate import tabulate

from fa_variants import gpu, iomodel
from fa_variants.timing.events import time_cuda
from fa_variants.timing.inputs import gpu_dout_sets, gpu_input_sets, random_dout, random_inputs
from fa_variants.timing.memory import PeakMemory, nbytes_rounded
from fa_variants.timing.shapes import Shape, direction_flops, median, tflops
from fa_variants.timing.torch_peers import torch_grad_fn, torch_leaf_sets, torch_sdpa_fn, torch_status

SEQLENS = (2048, 4096, 8192, 16384)
MEMORY_SHAPE = Shape(1, 16, 131072, 128, "bfloat16", False)
BLOCKS = (64, 64)          # the causal FLOP count's blocks (fa2's dK/dV kernel tiles at d = 128)
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    kind: str              # "ours" (through the API), "kernel" (kernels.fa2_bwd directly), "torch"
    what: str
    flops_variant: str     # iomodel.backward_flops' variant and dq_mode
    dq_mode: str = "separate"  # ("kernels": the one fa2_dq_mode picks for the shape)
    stores_p: bool = False
    forward: str = ""      # the variant whose forward gives out and lse (ours)
    torch_backend: str = ""  # a key of timing.torch_peers.TORCH_BACKENDS / OTHER_TORCH_BACKENDS


IMPLS = (
    Impl("naive", "ours", "fav.attention_backward(variant='naive'): the standard backward, P stored", "naive",
         stores_p=True, forward="naive"),
    Impl("fa2", "ours", "fav.attention_backward(variant='fa2'): recomputation, deterministic dQ", "fa2",
         dq_mode="kernels", forward="fa2"),
    Impl("fa2_bwd_kernel", "kernel", "kernels.fa2_bwd.backward called directly (UNVALIDATED)", "fa2",
         forward="fa2"),
    Impl("fa3", "ours", "fav.attention_backward(variant='fa3'): FA3's backward, a TMA producer warp, dQ summed "
         "across K/V blocks in a fixed order (fa2's kernels where it does not apply)", "fa3", dq_mode="kernels",
         forward="fa3"),
    Impl("torch-math", "torch", "torch SDPA MATH: autograd keeps P", "naive", stores_p=True,
         torch_backend="torch-math"),
    Impl("torch-flash", "torch", "torch SDPA FLASH_ATTENTION: FA2's backward, atomic dQ", "fa2", dq_mode="atomic",
         torch_backend="torch-flash"),
)


# ------------------------------------------------------------------------------------------------ arithmetic
def shapes(seqlens, batch=1, heads=16, head_dim=128, dtype="bfloat16", causal=False) -> list[Shape]:
    return [Shape(batch, heads, n, head_dim, dtype, causal) for n in seqlens]


H200_SMS = 132


def fa2_dq_mode(shape: Shape) -> str:
    """The iomodel dq_mode of what fav.attention_backward(variant="fa2") runs on ``shape``: "atomic" (5 products)
    where the Hopper kernels' scheme is a fused dQ whose grid fits (every K/V block's CTA of a head resident at once:
    n_kv <= SMs, so up to N = 16.9K at BN 128 on 132 SMs; fa2_bwd_sm90.fused_grid), else "separate" (7). For the GPU
    here if there is one (the mma.sync kernel off sm_90), else for the H200."""
    from fa_variants.kernels import fa2_bwd_sm90 as sm90
    from fa_variants.kernels.common import sm_count, template_dim
    if gpu.available() and gpu.compute_capability() != 90:
        return "separate"
    d = template_dim(shape.head_dim, sm90.DIMS)
    if sm90.dq_mode(d, shape.causal) == "separate":
        return "separate"
    sms = sm_count() if gpu.available() else H200_SMS
    return "atomic" if sm90.fused_contributors(d, shape.nk) <= sms else "separate"


def flops_of(impl: Impl, shape: Shape) -> int:
    """Matmul FLOPs of ``impl``'s backward on ``shape``: ``iomodel.backward_flops`` per head x B x H."""
    mode = fa2_dq_mode(shape) if impl.dq_mode == "kernels" else impl.dq_mode
    # fa3 runs fa2's three passes wherever fa2's fused dQ would not (the same grid: kernels/fa3_bwd.py)
    variant = "fa2" if impl.flops_variant == "fa3" and mode == "separate" else impl.flops_variant
    per_head = iomodel.backward_flops(variant, shape.seqlen_q, shape.nk, shape.head_dim, *BLOCKS,
                                      causal=shape.causal, dq_mode=mode)
    return per_head * shape.batch * shape.heads


def p_bytes(shape: Shape, itemsize: int = 4) -> int:
    """Bytes of one N_q x N_k matrix per (batch, head): S, P, dP or dS (fp32 by default)."""
    return itemsize * shape.batch * shape.heads * shape.seqlen_q * shape.nk


def fused_dq_bytes(shape: Shape) -> int:
    """The fused dQ's own buffers where fa2_dq_mode picks it (else 0): its fp32 dQ sum (batch, heads, Q blocks x BM,
    d template) and the per-half counters (batch, heads, Q blocks, 2) of int32, as kernels/fa2_bwd_sm90.py
    allocates them."""
    from fa_variants.kernels import fa2_bwd_sm90 as sm90
    from fa_variants.kernels.common import template_dim
    if fa2_dq_mode(shape) != "atomic":
        return 0
    shapes = sm90.fused_buffers(shape.batch, shape.heads, shape.seqlen_q, template_dim(shape.head_dim, sm90.DIMS))
    return 4 * sum(math.prod(s) for s in shapes)


def delta_bytes(shape: Shape) -> int:
    """fa2's backward's own buffer: D = rowsum(dO o O), fp32 (batch, heads, seqlen_q)."""
    return 4 * shape.batch * shape.heads * shape.seqlen_q


def row_values(impl: Impl, shape: Shape, ms=None, held=None, bwd_peak=None, status: str = "") -> dict:
    """One row of the table (and of the JSON): FLOPs, time, both TFLOP/s, memory, status ('' = measured)."""
    fl = flops_of(impl, shape)
    conv = direction_flops(shape, "bwd")
    return dict(impl=impl.name, what=impl.what, shape=shape.id, seqlen=shape.seqlen_q, stores_p=impl.stores_p,
                flops=fl, flops_over_forward=fl / shape.flops, flops_convention=conv, ms=ms,
                tflops_convention=tflops(conv, ms) if ms else None,
                tflops_actual=tflops(fl, ms) if ms else None,
                held_bytes=held, bwd_peak_bytes=bwd_peak, p_fp32_bytes=p_bytes(shape), status=status)


def _mib(x) -> str:
    return "" if x is None else f"{x / MIB:,.1f}"


def _num(x, spec) -> str:
    return "" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def table(rows) -> tuple[list[str], list[list[str]]]:
    headers = ["impl", "N", "stores P", "FLOPs (T)", "/ fwd", "time (ms)", "TFLOP/s (2.5x)", "TFLOP/s (actual)",
               "held (MiB)", "bwd peak (MiB)", "P fp32 (MiB)", "status"]
    body = [[r["impl"], str(r["seqlen"]), "yes" if r["stores_p"] else "no", f"{r['flops'] / 1e12:.2f}",
             f"{r['flops_over_forward']:.2f}", _num(r["ms"], ".3f"), _num(r["tflops_convention"], ".1f"),
             _num(r["tflops_actual"], ".1f"), _mib(r["held_bytes"]), _mib(r["bwd_peak_bytes"]),
             _mib(r["p_fp32_bytes"]), r["status"] or "measured"] for r in rows]
    return headers, body


# ------------------------------------------------------------------------------------------------ GPU
def _sync():
    import cupy
    cupy.cuda.get_current_stream().synchronize()


def _free(torch=None):
    import cupy
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()


def _our_fns(impl: Impl, shape: Shape, scale: float):
    import fa_variants as fav

    def fwd(q, k, v):
        return fav.attention(q, k, v, variant=impl.forward, causal=shape.causal, softmax_scale=scale,
                             return_lse=True, backend="cuda")

    if impl.kind == "kernel":
        from fa_variants.kernels import fa2_bwd

        def bwd(dout, q, k, v, out, lse):
            return fa2_bwd.backward(dout, q, k, v, out, lse, causal=shape.causal, softmax_scale=scale)
    else:
        def bwd(dout, q, k, v, out, lse):
            return fav.attention_backward(dout, q, k, v, out, lse, variant=impl.forward, causal=shape.causal,
                                          softmax_scale=scale, backend="cuda", check_lse=False)
    return fwd, bwd


def measure_ours(impl: Impl, shape: Shape, sets, douts, args) -> dict:
    import fa_variants as fav
    scale = 1.0 / math.sqrt(shape.head_dim)
    fwd, bwd = _our_fns(impl, shape, scale)
    q, k, v = sets[0]
    try:
        out, lse = fwd(q, k, v)
        _sync()
        held = nbytes_rounded(lse)       # all the API's backward is handed beyond out
        with PeakMemory() as pm:
            grads = bwd(douts[0], q, k, v, out, lse)
            _sync()
    except fav.BackendUnavailable as e:
        return row_values(impl, shape, status=f"skipped: {e}")
    except MemoryError as e:
        return row_values(impl, shape, status=f"refused: {type(e).__name__}: {e}")
    peak = max(0, pm.peak - nbytes_rounded(*grads))
    del grads
    use = sets[:1] if impl.stores_p else sets      # P dominates the traffic: one set, and memory for one P
    saved = [(out, lse)] + [fwd(*s) for s in use[1:]]
    rotate = [(d, q, k, v, o, l) for (q, k, v), d, (o, l) in zip(use, douts, saved)]
    ms = median(time_cuda(bwd, warmup=args.warmup, repeats=args.repeats, rotate_inputs=rotate))
    return row_values(impl, shape, ms, held, peak)


def measure_torch(impl: Impl, torch, shape: Shape, sets, douts, args) -> dict:
    scale = 1.0 / math.sqrt(shape.head_dim)
    fwd = torch_sdpa_fn(torch, impl.torch_backend, shape, scale)
    grad = torch_grad_fn(torch)
    use = sets[:1] if impl.stores_p else sets
    leaves = torch_leaf_sets(torch, use, douts)
    try:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        q, k, v, dout = leaves[0]
        out = fwd(q, k, v)
        torch.cuda.synchronize()
        held = max(0, torch.cuda.memory_allocated() - base - out.numel() * out.element_size())
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = grad(out, q, k, v, dout)
        torch.cuda.synchronize()
        peak = max(0, torch.cuda.max_memory_allocated() - base - sum(g.numel() * g.element_size() for g in grads))
        del grads
        tsets = [(out, q, k, v, dout)] + [(fwd(*s[:3]),) + s for s in leaves[1:]]
        ms = median(time_cuda(grad, warmup=args.warmup, repeats=args.repeats, rotate_inputs=tsets))
    except torch.cuda.OutOfMemoryError as e:
        return row_values(impl, shape, status=f"out of memory: {' '.join(str(e).split())[:200]}")
    return row_values(impl, shape, ms, held, peak)


def measure_all(args, torch) -> tuple[list[dict], bool]:
    import cupy
    rows, failed = [], False
    for shape in shapes(args.seqlens, args.batch, args.heads, args.head_dim, args.dtype, args.causal):
        print(f"{shape.id} ...", file=sys.stderr, flush=True)
        sets = gpu_input_sets(shape)
        douts = gpu_dout_sets(shape, len(sets))
        for impl in IMPLS:
            if impl.kind == "kernel" and not args.unvalidated_kernel:
                rows.append(row_values(impl, shape, status="not run: pass --unvalidated-kernel (fa2's mma.sync "
                                       "kernel called directly)"))
                continue
            if impl.kind == "kernel" and (shape.head_dim > 128 or shape.head_dim % 8):
                rows.append(row_values(impl, shape, status="not run: the kernel takes head_dim a multiple of 8 "
                                       "up to 128"))
                continue
            if impl.kind == "torch" and torch is None:
                rows.append(row_values(impl, shape, status=f"not run: {args.torch_why}"))
                continue
            try:
                if impl.kind == "torch":
                    rows.append(measure_torch(impl, torch, shape, sets, douts, args))
                else:
                    rows.append(measure_ours(impl, shape, sets, douts, args))
            except Exception as e:  # noqa: BLE001 - one row's failure is reported, the others still run
                failed |= impl.kind != "torch"
                rows.append(row_values(impl, shape, status=f"error: {type(e).__name__}: {str(e)[:200]}"))
            finally:
                _free(torch)
        del sets, douts
        _free(torch)
    cupy.cuda.Device().synchronize()
    return rows, failed


def memory_check(args, torch) -> dict:
    """fa2's backward at MEMORY_SHAPE: O(N) beyond dq, dk, dv; naive refuses the size; torch-flash beside it."""
    import cupy
    import fa_variants as fav
    shape = MEMORY_SHAPE
    scale = 1.0 / math.sqrt(shape.head_dim)
    res = dict(shape=shape.id, p_fp32_bytes=p_bytes(shape), delta_bytes=delta_bytes(shape))
    q, k, v = random_inputs(shape, cupy, 0)
    dout = random_dout(shape, cupy)
    res["input_bytes"] = nbytes_rounded(q, k, v, dout)
    with PeakMemory() as pm:
        out, lse = fav.attention(q, k, v, variant="fa2", causal=shape.causal, softmax_scale=scale, return_lse=True,
                                 backend="cuda")
        _sync()
    res["fa2_forward_peak_bytes"] = pm.peak
    res["out_lse_bytes"] = nbytes_rounded(out, lse)
    res["fused_dq_bytes"] = fused_dq_bytes(shape)
    try:
        with PeakMemory() as pm:
            grads = fav.attention_backward(dout, q, k, v, out, lse, variant="fa2", causal=shape.causal,
                                           softmax_scale=scale, backend="cuda", check_lse=False)
            _sync()
        gb = nbytes_rounded(*grads)
        res.update(fa2_api="ran", fa2_api_peak_bytes=pm.peak, fa2_api_extra_bytes=max(0, pm.peak - gb))
        del grads
    except fav.BackendUnavailable as e:
        res["fa2_api"] = f"skipped: {e}"
    _free()
    if args.unvalidated_kernel:
        from fa_variants.kernels import fa2_bwd
        from fa_variants.reference.dense import to_float64
        with PeakMemory() as pm:
            grads = fa2_bwd.backward(dout, q, k, v, out, lse, causal=shape.causal, softmax_scale=scale)
            _sync()
        gb = nbytes_rounded(*grads)
        res.update(fa2_kernel_peak_bytes=pm.peak, grads_bytes=gb, fa2_kernel_extra_bytes=max(0, pm.peak - gb),
                   fa2_kernel_finite=all(bool(cupy.isfinite(to_float64(g)).all()) for g in grads))
        del grads
        _free()
    try:
        fav.attention_backward(dout, q, k, v, out, lse, variant="naive", causal=shape.causal, softmax_scale=scale,
                               backend="cuda", check_lse=False)
        res["naive_backward"] = "ran (unexpected)"
    except fav.BackendUnavailable as e:
        res["naive_backward"] = f"skipped: {e}"
    except MemoryError as e:
        res["naive_backward"] = f"refused: {type(e).__name__}: {e}"
    try:
        fav.attention(q, k, v, variant="naive", causal=shape.causal, softmax_scale=scale, backend="cuda")
        res["naive_forward"] = "ran (unexpected)"
    except MemoryError as e:
        res["naive_forward"] = f"refused: {type(e).__name__}: {e}"
    _free()
    if torch is not None:
        try:
            fwd = torch_sdpa_fn(torch, "torch-flash", shape, scale)
            (tq, tk, tv, tdo), = torch_leaf_sets(torch, [(q, k, v)], [dout])
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            tout = fwd(tq, tk, tv)
            torch.cuda.synchronize()
            res["torch_flash_held_bytes"] = max(0, torch.cuda.memory_allocated() - base
                                                 - tout.numel() * tout.element_size())
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            grads = torch_grad_fn(torch)(tout, tq, tk, tv, tdo)
            torch.cuda.synchronize()
            res["torch_flash_bwd_peak_bytes"] = max(0, torch.cuda.max_memory_allocated() - base
                                                     - sum(g.numel() * g.element_size() for g in grads))
            del grads, tout
        except Exception as e:  # noqa: BLE001
            res["torch_flash"] = f"error: {type(e).__name__}: {str(e)[:200]}"
        _free(torch)
    return res


def memory_lines(res: dict) -> list[str]:
    """The memory check in words (works on the model-only dict without a GPU, too)."""
    s = Shape.parse(res["shape"])
    lines = [f"memory check at {s.id} (B={s.batch}, H={s.heads}, N={s.seqlen_q}, d={s.head_dim}):",
             f"  an N x N fp32 matrix (S, P, dP or dS) would take {res['p_fp32_bytes'] / 2**30:,.0f} GiB; fa2's "
             f"backward's own buffer D = rowsum(dO o O) takes {res['delta_bytes'] / MIB:.1f} MiB"
             + (f", the fused dQ's fp32 sum and counters {res['fused_dq_bytes'] / MIB:,.1f} MiB (B H N d floats: "
                f"linear in N, as torch flash's dq_accum)" if res.get("fused_dq_bytes") else "")]
    if "input_bytes" in res:
        lines.append(f"  inputs q, k, v, dout {res['input_bytes'] / MIB:,.0f} MiB; fa2 forward pool peak "
                     f"{res['fa2_forward_peak_bytes'] / MIB:,.1f} MiB (out + lse: "
                     f"{res['out_lse_bytes'] / MIB:,.1f} MiB)")
        lines.append(f"  fa2 backward through the API: {res['fa2_api']}")
        if "fa2_api_peak_bytes" in res:
            extra, own = res["fa2_api_extra_bytes"], res["delta_bytes"] + res.get("fused_dq_bytes", 0)
            lines.append(f"    pool peak {res['fa2_api_peak_bytes'] / MIB:,.1f} MiB, {extra / MIB:,.1f} MiB beyond dq, "
                         f"dk, dv (its own buffers: {own / MIB:,.1f} MiB): "
                         f"{'O(N)' if extra <= 4 * own + MIB else 'MORE THAN O(N): look'}")
        if "fa2_kernel_peak_bytes" in res:
            extra = res["fa2_kernel_extra_bytes"]
            lines.append(f"  fa2's mma.sync backward kernel (called directly): pool peak "
                         f"{res['fa2_kernel_peak_bytes'] / MIB:,.1f} MiB = dq + dk + dv {res['grads_bytes'] / MIB:,.1f}"
                         f" MiB + {extra / MIB:,.1f} MiB beyond them (D: {res['delta_bytes'] / MIB:.1f} MiB): "
                         f"{'O(N)' if extra <= 4 * res['delta_bytes'] + MIB else 'MORE THAN O(N): look'}; "
                         f"gradients finite: {res['fa2_kernel_finite']}")
        else:
            lines.append("  fa2's mma.sync backward kernel: not run (--unvalidated-kernel runs it)")
        lines.append(f"  naive backward: {res['naive_backward']}")
        lines.append(f"  naive forward (a stored-P backward needs at least its S/P): {res['naive_forward']}")
        if "torch_flash_held_bytes" in res:
            lines.append(f"  torch-flash: forward leaves {res['torch_flash_held_bytes'] / MIB:,.1f} MiB for the "
                         f"backward beyond out; backward peak {res['torch_flash_bwd_peak_bytes'] / MIB:,.1f} MiB "
                         f"beyond dq, dk, dv")
        elif "torch_flash" in res:
            lines.append(f"  torch-flash: {res['torch_flash']}")
    else:
        lines.append(f"  not measured: {res.get('why', 'no GPU')}")
    return lines


# ------------------------------------------------------------------------------------------------ main
def _seqlens(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive sequence lengths, got {text!r}")
    return vals


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", type=_seqlens, default=SEQLENS, help="default 2048,4096,8192,16384")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true", help="leave out the torch rows")
    ap.add_argument("--unvalidated-kernel", action="store_true",
                    help="also time fa2's mma.sync backward kernel (kernels.fa2_bwd.backward) called directly, "
                    "outside the API's checks")
    ap.add_argument("--no-memory-check", action="store_true", help="leave out the N = 131072 memory check")
    ap.add_argument("--json", help="write the rows and the memory check here")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    why = gpu.reason()
    torch = None
    args.torch_why = "--no-torch"
    if not why and not args.no_torch:
        torch, args.torch_why = torch_status()
    if why:
        rows = [row_values(impl, s, status=f"not run: no CUDA GPU ({why})")
                for s in shapes(args.seqlens, args.batch, args.heads, args.head_dim, args.dtype, args.causal)
                for impl in IMPLS]
        failed = False
        mem = None if args.no_memory_check else dict(shape=MEMORY_SHAPE.id, p_fp32_bytes=p_bytes(MEMORY_SHAPE),
                                                     delta_bytes=delta_bytes(MEMORY_SHAPE),
                                                     fused_dq_bytes=fused_dq_bytes(MEMORY_SHAPE), why=f"no CUDA GPU ({why})")
    else:
        rows, failed = measure_all(args, torch)
        mem = None if args.no_memory_check else memory_check(args, torch)
    headers, body = table(rows)
    print(tabulate(body, headers=headers, tablefmt="github", disable_numparse=True))
    print("FLOPs: iomodel.backward_flops x B x H (the matmuls each backward computes, recomputation included); / fwd:"
          " over the forward's 4BHN^2d (/2 causal). TFLOP/s (2.5x): the convention of anchors/h200-peers.md; "
          "(actual): those FLOPs / time. held: memory the forward leaves for the backward beyond out; bwd peak: "
          "peak during the backward call beyond dq, dk, dv. Stored-P rows time one input set (P's traffic dwarfs L2).")
    if mem is not None:
        print("\n".join(memory_lines(mem)))
    if args.json:
        doc = dict(rows=rows, memory_check=mem, config={k: v for k, v in vars(args).items() if k != "json"})
        doc["config"]["seqlens"] = list(args.seqlens)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
