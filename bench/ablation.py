"""The FA3 paper's ablation (Shah et al. 2024, Table 2: H100, d = 128, 661 TFLOP/s with warp specialization and
the two-stage pipeline, 582 without warp specialization, 570 without the pipeline), measured on this card:

    PYTHONPATH=. python3 bench/ablation.py [--seqlen 8192] [--causal] [--dtype bfloat16] [--repeats 20] [--rest 0.2]
                                     [--json f]
    fa-variants explain fa3 --measured f     (the rows and what each lever buys; without --measured: the shipped run)

Rows, each the same attention on the same inputs (d = 128, B * N = 16K tokens, 16 heads):
  fa2 (wgmma)                     fa2_fwd_sm90.cu: wgmma, cp.async by every thread, one barrier per K/V block;
                                  no TMA, no warp specialization, no overlap (the paper's "no warp specialization")
  fa3 -pingpong -overlap          TMA producer warpgroup and mbarrier ring only
  fa3 -overlap                    + ping-pong between the two consumer warpgroups
  fa3 -pingpong                   + intra-warpgroup overlap (softmax of block j under P V of block j-1)
  fa3                             both (the shipped levers, on one CTA per tile with FA3's 128 x 176 tile)
  fa3 as shipped                  what the registry runs: its tile and grid by length (fa_variants/tiles.py)
TFLOP/s = 4 B H N^2 d / time (x 0.5 causal); CUDA-event medians with L2-busting input rotation (fa_variants.timing),
the rows interleaved over --rounds rounds, each row's time the median of its rounds' medians, so that no row is read
in a state of the card of its own. The GPU idles --rest seconds before each row's burst of calls, as devcheck's and
`pytest bench`'s cases start (FAV_TIMING_REST_S): the card's boost clock. Run back to back (--rest 0), the rows reach
the H200's power cap within ~80 ms and are read at its lowered clock, the fastest rows the most
(docs/kernels/tiles.md, "The ablation's tile").
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

from tabulate import tabulate

from fa_variants.timing import Shape, gpu_input_sets, median, time_cuda

D = 128
PAPER = ("H100 SXM5, d 128 (FA3 Table 2): 661 TFLOP/s with both, 582 without warp specialization, 570 without the "
         "intra-warpgroup pipelining")


def rows_for(shape: Shape, repeats: int, rounds: int, rest: float):
    import cupy
    from fa_variants.kernels import fa2, fa3
    sets = gpu_input_sets(shape)
    scale = 1 / math.sqrt(D)
    kw = dict(causal=shape.causal, softmax_scale=scale, return_lse=False)
    impls = [("fa2 (wgmma)", "no", "no", "no", fa2.plan(*sets[0], kernel="wgmma", **kw))]
    for pp, ov in ((False, False), (True, False), (False, True), (True, True)):
        name = "fa3" + ("" if pp else " -pingpong") + ("" if ov else " -overlap")
        impls.append((name, "yes", "yes" if pp else "no", "yes" if ov else "no", fa3.plan(*sets[0], pingpong=pp,
                                                                                       overlap=ov, **kw)))
    # The ablation's instances run one CTA per tile with FA3's tile at every length (tiles.FA3_ABLATION_TILE); the
    # shipped fa3 picks its grid and tile by length (tiles.fa3_tile), which devcheck and `pytest bench` time.
    impls.append(("fa3 as shipped", "yes", "table", "yes", fa3.plan(*sets[0], **kw)))
    calls = [lambda q, k, v, plan=plan: plan.run_cupy(q, k, v) for *_, plan in impls]
    for call in calls:  # first calls (and compiles) out of the way
        call(*sets[0])
    cupy.cuda.runtime.deviceSynchronize()

    def timed(call):
        time.sleep(rest)
        return median(time_cuda(call, warmup=2, repeats=repeats, rotate_inputs=sets))

    per_round = [[timed(call) for call in calls] for _ in range(rounds)]
    out = []
    for i, (name, ws, pp, ov, _) in enumerate(impls):
        ms = median([r[i] for r in per_round])
        out.append(dict(impl=name, warp_specialized=ws, pingpong=pp, overlap=ov, ms=ms,
                        tflops=shape.flops / (ms * 1e-3) / 1e12))
    del sets
    cupy.get_default_memory_pool().free_all_blocks()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--repeats", type=int, default=20, help="timed calls of a row per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds over all rows, interleaved")
    ap.add_argument("--rest", type=float, default=0.2, help="seconds the GPU idles before each row's burst "
                    "(0: back to back, at the power cap's clock)")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    table, records = [], []
    for n in a.seqlen:
        shape = Shape(16384 // n, 2048 // D, n, D, a.dtype, a.causal)
        rows = rows_for(shape, a.repeats, a.rounds, a.rest)
        best = next(r["tflops"] for r in rows if r["impl"] == "fa3")
        for r in rows:
            table.append([shape.id, r["impl"], r["warp_specialized"], r["pingpong"], r["overlap"], f"{r['ms']:.3f}",
                          f"{r['tflops']:.1f}", f"{r['tflops'] / best:.2f}"])
            records.append(dict(shape=shape.id, **r))
    print(tabulate(table, headers=["shape", "impl", "TMA + warp spec.", "ping-pong", "intra-WG overlap", "ms",
                                   "TFLOP/s", "x fa3"]))
    print(f"FA3 paper, not measured here: {PAPER}")
    if a.json:  # what `fa-variants explain fa3 --measured FILE` prints (fa_variants/ablation.py)
        import cupy
        meta = dict(card=cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode(),
                    commit=os.environ.get("COMMIT") or _git_commit(), date=time.strftime("%Y-%m-%d"),
                    command="python3 bench/ablation.py " + " ".join(sys.argv[1:]),
                    paper=PAPER)
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, rows=records), f, indent=1)


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


if __name__ == "__main__":
    main()
