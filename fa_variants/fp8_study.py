"""The FA3 paper's FP8 accuracy experiment, on the CPU with the NumPy models.

Error of each method against a float64 dense reference (``reference.dense.attention64``):
  * ``fa2 bf16``          : inputs rounded to bf16, then reference/fa2.py in float64 (P and O are NOT rounded
                            to bf16 as the kernel would round P: a lower bound on the bf16 kernel's error);
  * ``fp8 per-tensor``    : reference/fp8.py, one scale per Q, K, V tensor (p_scale 256 as the others);
  * ``fp8 block``         : Q/K scales per block of 128 rows, V per channel;
  * ``fp8 block+rotation``: the same after the seeded Hadamard rotation of Q and K (incoherent processing).
on three input distributions (Q, K, V of shape (1, n, heads, d)):
  * ``normal``  : N(0, 1);
  * ``outliers``: N(0, 1) with 0.1% of the entries of each tensor replaced by N(0, 10^2) (the paper's setup);
  * ``sink``    : N(0, 1), every query shifted by +4 along channel 0 and 4 keys (positions 0-3) given a large
                  channel-0 component, so that their scores stand ~11 above the rest: the other probabilities are
                  ~e^-11 of the row max, where e4m3's P loses them without the p_scale factor.

With ``--gpu``, the same inputs (rounded to bf16, as a user would pass them) also go through the GPU kernels:
  * ``GPU fa2 bf16``, ``GPU fa2_fp8 block``, ``GPU fa2_fp8 block+rotation`` (``fav.fp8.quantize(rotate=True)``).
Per-tensor scaling is not something the kernel offers (its scales are per block), so that row stays the model's.

``--accumulation`` asks a different question: how far does the FP8 model move when its tensor-core accumulator
keeps fewer mantissa bits (``reference.fp8.tc_matmul``), and, with ``--gpu``, which of those models each GPU
kernel is closest to (docs/ records it for Hopper's e4m3 wgmma against the mma.sync kernel).

Run: ``python -m fa_variants.fp8_study [--n 4096 --d 128 --heads 1 --seed 0] [--gpu] [--accumulation]``.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import ml_dtypes
import numpy as np

from . import gpu as _gpu
from .kernels import fa2_fp8 as k_fa2_fp8
from .reference import fa2, fp8
from .reference.dense import attention64

DISTRIBUTIONS = ("normal", "outliers", "sink")
METHODS = ("fa2 bf16", "fp8 per-tensor", "fp8 block", "fp8 block+rotation")
GPU_METHODS = ("GPU fa2 bf16", "GPU fa2_fp8 block", "GPU fa2_fp8 block+rotation")
BLOCK = 128  # Q and K block (and scale block) sizes: keeps the Python loop short at n = 4096
SINKS = 4
SINK_GAP = 11.0  # score of a sink key above the typical score, in softmax-scaled units

PAPER_LINE = ("FA3 paper (Shah et al. 2024), NOT measured here: outlier inputs, RMSE of FP8 per-tensor 2.4e-2 vs "
              "9.1e-3 for block quantization + incoherent processing (2.6x lower)")


def make_inputs(dist: str, n: int, d: int, heads: int, rng: np.random.Generator):
    """(q, k, v) float64 (1, n, heads, d) drawn from ``dist``."""
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"dist must be one of {DISTRIBUTIONS}, got {dist!r}")
    q, k, v = (rng.standard_normal((1, n, heads, d)) for _ in range(3))
    if dist == "outliers":
        for a in (q, k, v):
            flat = a.reshape(-1)
            idx = rng.choice(flat.size, size=max(1, round(flat.size * 1e-3)), replace=False)
            flat[idx] = rng.standard_normal(idx.size) * 10.0
    elif dist == "sink":
        shift = 4.0
        q[..., 0] += shift
        # score of a sink ~ shift * c / sqrt(d) = SINK_GAP for c = SINK_GAP sqrt(d) / shift
        k[:, :SINKS, :, 0] += SINK_GAP * math.sqrt(d) / shift
    return q, k, v


def _run_gpu(method: str, q, k, v, seed: int) -> np.ndarray:
    import cupy

    import fa_variants as fav
    from .timing import cast_half
    q, k, v = (cast_half(cupy.asarray(a, dtype=cupy.float32), "bfloat16") for a in (q, k, v))
    if method == "GPU fa2 bf16":
        out = fav.attention(q, k, v, variant="fa2")
    else:
        out = fav.fp8.attention(fav.fp8.quantize(q, k, v, rotate=method.endswith("rotation"), seed=seed))
    return cupy.asnumpy(out).astype(np.float64)


def _run(method: str, q, k, v, seed: int) -> np.ndarray:
    if method in GPU_METHODS:
        return _run_gpu(method, q, k, v, seed)
    if method == "fa2 bf16":
        bf = [a.astype(ml_dtypes.bfloat16) for a in (q, k, v)]
        return fa2.forward(*bf, block_q=BLOCK, block_k=BLOCK).out
    kw = {"fp8 per-tensor": dict(scaling="tensor"), "fp8 block": dict(scaling="block"),
          "fp8 block+rotation": dict(scaling="block", rotate=True, seed=seed)}[method]
    return fp8.forward(q, k, v, block_q=BLOCK, block_k=BLOCK, **kw).out


def study(n: int = 4096, d: int = 128, seed: int = 0, heads: int = 1, distributions=DISTRIBUTIONS,
          methods=METHODS, progress=None) -> list[dict]:
    """Rows {distribution, method, rel_error, rmse}: ||out - ref|| / ||ref|| and sqrt(mean((out - ref)^2))."""
    rows = []
    for di, dist in enumerate(distributions):
        q, k, v = make_inputs(dist, n, d, heads, np.random.default_rng([seed, di]))
        ref, _ = attention64(q, k, v, causal=False, scale=1 / math.sqrt(d))      # (heads, n, d)
        ref = ref.transpose(1, 0, 2)[None]                                      # (1, n, heads, d)
        for method in methods:
            t0 = time.perf_counter()
            out = _run(method, q, k, v, seed)
            diff = out - ref
            rows.append({"distribution": dist, "method": method,
                         "rel_error": float(np.linalg.norm(diff) / np.linalg.norm(ref)),
                         "rmse": float(np.sqrt(np.mean(diff ** 2)))})
            if progress:
                progress(f"{dist:9s} {method:19s} {time.perf_counter() - t0:5.1f} s")
    return rows


ACCUMULATE_BITS = (None, 22, 16, 14, 13)


def accumulation(n: int = 1000, d: int = 128, seed: int = 0, heads: int = 2, gpu: bool = False) -> list[list]:
    """Rows [what, rel. difference from the exact model, rel. error vs float64]; bf16-rounded N(0,1) inputs and,
    per kernel, that kernel's blocks, so that only the arithmetic differs."""
    q, k, v = (a.astype(ml_dtypes.bfloat16).astype(np.float64)
               for a in make_inputs("normal", n, d, heads, np.random.default_rng(seed)))
    ref, _ = attention64(q, k, v, causal=False, scale=1 / math.sqrt(d))
    ref = ref.transpose(1, 0, 2)[None]
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))  # noqa: E731
    kernels = [("model", BLOCK, BLOCK)]
    if gpu:  # this device's kernel (wgmma on sm_90), and the mma.sync one (emulated e4m3 there), each with its tiles
        kernels = [(kernel, *k_fa2_fp8.config(d, kernel=kernel)[:2])
                   for kernel in dict.fromkeys((k_fa2_fp8.kernel_of(), "mma_sync"))]
    rows, models = [], {}
    for _, bq, bk in kernels:
        for bits in ACCUMULATE_BITS:
            if (bq, bk, bits) not in models:
                models[bq, bk, bits] = fp8.forward(q, k, v, block_q=bq, block_k=bk, accumulate_bits=bits).out
                rows.append([f"model {bq}x{bk}, " + (f"accumulator {bits} bits" if bits else "exact accumulator"),
                             rel(models[bq, bk, bits], models[bq, bk, None]), rel(models[bq, bk, bits], ref)])
    if gpu:
        import cupy

        from .timing import cast_half
        qg, kg, vg = (cast_half(cupy.asarray(a, dtype=cupy.float32), "bfloat16") for a in (q, k, v))
        for kernel, bq, bk in kernels:
            out, _ = k_fa2_fp8.forward(qg, kg, vg, causal=False, softmax_scale=1 / math.sqrt(d), return_lse=False,
                                       kernel=kernel)
            out = cupy.asnumpy(out).astype(np.float64)
            kind = kernel.replace("_", ".")
            for bits in ACCUMULATE_BITS:
                rows.append([f"GPU {kind} kernel ({bq}x{bk}) vs model, " + (f"accumulator {bits} bits" if bits else "exact"),
                             rel(out, models[bq, bk, bits]), rel(out, ref)])
    return rows


def main(argv=None) -> int:
    from tabulate import tabulate

    ap = argparse.ArgumentParser(prog="python -m fa_variants.fp8_study", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu", action="store_true", help="also run the GPU kernels (fa2, fa2_fp8) on the same inputs")
    ap.add_argument("--accumulation", action="store_true",
                    help="sensitivity to the tensor cores' accumulator precision instead (default --n 1000)")
    args = ap.parse_args(argv)
    if args.gpu and _gpu.reason():  # one line, not a CuPy traceback, where there is no usable GPU
        raise SystemExit(f"python -m fa_variants.fp8_study: --gpu needs a CUDA GPU here: {_gpu.reason()}")
    t0 = time.perf_counter()
    if args.accumulation:
        n = args.n if "--n" in (argv if argv is not None else sys.argv) else 1000
        rows = accumulation(n, args.d, args.seed, max(args.heads, 2), gpu=args.gpu)
        print(f"FP8 model with a truncated accumulator (32-wide steps), N={n}, d={args.d}, bf16-rounded N(0,1) inputs")
        print(tabulate([[w, f"{a:.2e}", f"{b:.2e}"] for w, a, b in rows], disable_numparse=True,
                       headers=["what", "rel. diff. from the exact model", "rel. error vs float64"]))
        return 0
    rows = study(args.n, args.d, args.seed, args.heads, methods=METHODS + (GPU_METHODS if args.gpu else ()),
                 progress=lambda s: print(s, file=sys.stderr, flush=True))
    gpu_note = " and this GPU's kernels (GPU rows)" if args.gpu else ""
    table = [[r["distribution"], r["method"], f"{r['rel_error']:.1e}", f"{r['rmse']:.1e}"] for r in rows]
    print(f"FP8 attention accuracy vs float64, N={args.n}, d={args.d}, heads={args.heads}, seed={args.seed}, "
          f"NumPy models (blocks {BLOCK}x{BLOCK}, p_scale 256){gpu_note}")
    print(tabulate(table, headers=["inputs", "method", "rel. error", "RMSE"], disable_numparse=True))
    print()
    print(PAPER_LINE)
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
