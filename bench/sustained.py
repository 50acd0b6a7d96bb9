"""Time as a long run sees it: each variant (and torch peer) in bursts of a few calls after a second idle, the way
bench/devcheck.py's medians see it, then for CALLS calls back to back, reported by windows of 50 calls. Under
sustained load the card reaches its power cap and lowers its clocks: on the H200 the SM clock fell from 1980 to about
1650 MHz within ~80 ms and fa3 and cuDNN alike lost 11 % (bench/RESULTS.md, ninth part); the ratios between them held.

    PYTHONPATH=. python3 bench/sustained.py [--shape bf16-d128-N8192-B2-H16-full] [--variants fa3] [--peers torch-cudnn]
                                            [--calls 400] [--rounds 2]

Run `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv -lms 50`
beside it to see the clocks.
"""
from __future__ import annotations

import argparse
import math
import time

WINDOW = 50


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="bf16-d128-N8192-B2-H16-full")
    ap.add_argument("--variants", default="fa3", help="comma-separated registry names")
    ap.add_argument("--peers", default="torch-cudnn", help="comma-separated torch peers ('' for none)")
    ap.add_argument("--calls", type=int, default=400, help="back-to-back calls of the sustained run")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    from fa_variants.timing import Shape
    shape = Shape.parse(a.shape)
    if a.calls < WINDOW:
        raise SystemExit(f"--calls must be at least {WINDOW}, got {a.calls}")

    import numpy as np
    import fa_variants as fav
    from fa_variants.timing import as_torch_bhnd, gpu_input_sets, time_cuda, torch_sdpa_fn
    sets = gpu_input_sets(shape)
    fns = {v: (lambda q, k, v_, name=v: fav.attention(q, k, v_, variant=name, causal=shape.causal), sets)
           for v in filter(None, a.variants.split(","))}
    peers = [p for p in a.peers.split(",") if p]
    if peers:
        import torch
        tsets = [tuple(as_torch_bhnd(torch, x) for x in s) for s in sets]
        for p in peers:
            fns[p] = (torch_sdpa_fn(torch, p, shape, 1 / math.sqrt(shape.head_dim)), tsets)
    # per-call CUDA events, back to back (no pad kernel between calls: the card is to see the load as it comes)
    def timed(fn, s, warmup, n):
        return np.array(time_cuda(fn, warmup=warmup, repeats=n, rotate_inputs=s, pad=False))

    for fn, s in fns.values():
        timed(fn, s, 3, 1)  # compile and load
    tflops = lambda ms: shape.flops / (ms * 1e-3) / 1e12  # noqa: E731
    for r in range(a.rounds):
        for name, (fn, s) in fns.items():
            time.sleep(1.0)
            t = timed(fn, s, 3, 10)
            print(f"round {r + 1} burst      {name:12s} {tflops(np.median(t)):7.1f} TFLOP/s "
                  "(median of 10 calls after 3)")
        for name, (fn, s) in fns.items():
            time.sleep(1.0)
            t = timed(fn, s, 1, a.calls)
            windows = " ".join(f"{tflops(np.median(t[i:i + WINDOW])):.0f}"
                               for i in range(0, a.calls - WINDOW + 1, WINDOW))
            print(f"round {r + 1} sustained  {name:12s} TFLOP/s by {WINDOW}-call windows: {windows}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
