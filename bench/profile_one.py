"""Launch one variant on one shape a few times: a target for ncu / compute-sanitizer.

    ncu --clock-control none -k regex:fa2_fwd --launch-skip 1 --launch-count 1 --section SpeedOfLight \\
        python3 bench/profile_one.py fa2 bf16-d128-N4096-B4-H16-full
    compute-sanitizer --tool racecheck python3 bench/profile_one.py fa1 fp16-d64-N67-B2-H3-causal --calls 1
"""
import argparse

import cupy

from fa_variants import attention
from fa_variants.timing import Shape, random_inputs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variant")
    ap.add_argument("shape", help="a shape id, e.g. bf16-d128-N4096-B4-H16-causal")
    ap.add_argument("--calls", type=int, default=2)
    a = ap.parse_args()
    shape = Shape.parse(a.shape)
    q, k, v = random_inputs(shape, cupy, seed=1)
    for _ in range(a.calls):
        out = attention(q, k, v, variant=a.variant, causal=shape.causal)
    cupy.cuda.Device().synchronize()
    print(a.variant, shape.id, "ok", bool(cupy.isfinite(out.astype(cupy.float32)).all()))


if __name__ == "__main__":
    main()
