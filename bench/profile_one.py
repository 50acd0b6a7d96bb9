"""Launch one variant on one shape a few times: a target for ncu / compute-sanitizer.

    ncu --clock-control none -k regex:fa2_fwd --launch-skip 1 --launch-count 1 --section SpeedOfLight \\
        python3 bench/profile_one.py fa2 bf16-d128-N4096-B4-H16-full
    compute-sanitizer --tool racecheck python3 bench/profile_one.py fa1,fa2 fp16-d64-N67-B2-H3-causal,fp16-d128-N67-B2-H3-full --calls 1
    ncu --clock-control none -k regex:fa2_bwd --section SpeedOfLight \
        python3 bench/profile_one.py fa2 bf16-d64-N4096-B4-H32-full --backward --calls 1   (each pass's duration)
"""
import argparse

import cupy

from fa_variants import attention, attention_backward
from fa_variants.timing.inputs import random_inputs
from fa_variants.timing.shapes import Shape


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", help="comma-separated variant names")
    ap.add_argument("shapes", help="comma-separated shape ids, e.g. bf16-d128-N4096-B4-H16-causal")
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--backward", action="store_true", help="also run the backward (fav.attention_backward) after "
                    "each forward call")
    a = ap.parse_args()
    for shape in map(Shape.parse, a.shapes.split(",")):
        q, k, v = random_inputs(shape, cupy, seed=1)
        dout = random_inputs(shape, cupy, seed=2)[0] if a.backward else None
        for variant in a.variants.split(","):
            for _ in range(a.calls):
                if a.backward:
                    out, lse = attention(q, k, v, variant=variant, causal=shape.causal, return_lse=True)
                    grads = attention_backward(dout, q, k, v, out, lse, variant=variant, causal=shape.causal,
                                               check_lse=False)
                else:
                    out = attention(q, k, v, variant=variant, causal=shape.causal)
            cupy.cuda.Device().synchronize()
            finite = bool(cupy.isfinite(out.astype(cupy.float32)).all())
            if a.backward:
                finite &= all(bool(cupy.isfinite(g.astype(cupy.float32)).all()) for g in grads)
            print(variant, shape.id, "finite:", finite)


if __name__ == "__main__":
    main()
