"""Bitwise A/B of two source trees: every shipped GPU kernel on fixed inputs, one SHA-256 per output.

A refactor that must not change what the kernels compute (a split into named parts, a table moved) is checked
by running this in each tree on the same card and comparing the digests:

    PYTHONPATH=/path/to/old python3 bench/bitwise.py save old.json
    PYTHONPATH=.            python3 bench/bitwise.py save new.json
    python3 bench/bitwise.py compare old.json new.json      # exit status 1 on any difference

It calls only the public API (``attention``, ``attention_backward`` with an explicit ``variant``), so any two
versions of the library can be compared. The shapes are the tests' odd sizes and the benchmark's matrix
(B·N = 16K tokens, H·d = 2048), which between them reach every tile configuration, grid and tail path.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys

import numpy as np

# (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, causal)
ODD = [(1, 1, 1, 2, 2, 64, False), (2, 37, 37, 3, 3, 64, True), (1, 1000, 1000, 2, 1, 128, True),
       (1, 37, 1000, 8, 1, 128, True), (1, 1000, 37, 4, 2, 72, True), (2, 4097, 4097, 2, 2, 128, False),
       (1, 300, 500, 2, 2, 32, True), (1, 513, 513, 2, 2, 256, True), (1, 64, 64, 16, 2, 208, False),
       (1, 4097, 4097, 4, 4, 80, True)]
MATRIX = [(16384 // n, n, n, 2048 // d, 2048 // d, d, c) for d in (64, 128, 256) for n in (1024, 2048, 8192)
          for c in (False, True)]
FORWARD = ("naive", "fa1", "fa2", "fa2_fp8", "fa3", "fa3_fp8")
BACKWARD = ("naive", "fa1", "fa2")
# backwards whose dQ is summed by fp32 atomic adds in an order that varies run to run (kernels/fa1_bwd.py): their dK
# and dV are digested, their dQ is not (tests/test_gpu_backward.py checks it against the float64 reference)
ATOMIC_DQ = ("fa1",)
DTYPES = ("float16", "bfloat16")


def inputs(shape, dtype: str, seed: int):
    import cupy
    import ml_dtypes
    b, nq, nk, h, hkv, d, _ = shape
    rng = np.random.default_rng(seed)
    np_dtype = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    make = lambda *s: cupy.asarray(rng.standard_normal(s, dtype=np.float32).astype(np_dtype))  # noqa: E731
    return make(b, nq, h, d), make(b, nk, hkv, d), make(b, nk, hkv, d), make(b, nq, h, d)


def digest(*arrays) -> str:
    import cupy
    h = hashlib.sha256()
    for a in arrays:
        h.update(cupy.asnumpy(a).view(np.uint8).tobytes())
    return h.hexdigest()[:24]


def cases():
    for i, shape in enumerate(ODD + MATRIX):
        for dtype in DTYPES:
            yield f"{'x'.join(map(str, shape[:6]))}-{'causal' if shape[6] else 'full'}-{dtype}", shape, dtype, i


def _write(path: str, digests: dict) -> None:
    with open(path, "w") as f:
        json.dump(digests, f, indent=0, sort_keys=True)


def save(path: str) -> int:
    import cupy
    import fa_variants as fav
    out = {}
    for name, shape, dtype, seed in cases():
        q, k, v, dout = inputs(shape, dtype, seed)
        causal, d, nk = shape[6], shape[5], shape[2]
        for variant in FORWARD:
            if variant.endswith("fp8") and d % 16:
                continue
            if variant in ("naive", "fa1") and nk > 4096:  # O(N^2) memory / one CTA per head: slow, same code
                continue
            ok, _ = fav.get(variant).available()
            if not ok:
                continue
            o, lse = fav.attention(q, k, v, variant=variant, causal=causal, return_lse=True)
            out[f"fwd-{variant}-{name}"] = digest(o, lse)
            if variant in BACKWARD and nk <= 4096:
                dq, dk, dv = fav.attention_backward(dout, q, k, v, o, lse, variant=variant, causal=causal)
                if variant in ATOMIC_DQ:
                    out[f"bwd-{variant}-{name}-dkdv"] = digest(dk, dv)
                else:
                    out[f"bwd-{variant}-{name}"] = digest(dq, dk, dv)
        del q, k, v, dout
        cupy.get_default_memory_pool().free_all_blocks()
        print(f"{name}: {len(out)} digests", file=sys.stderr, flush=True)
        _write(path, out)  # after every case: a run cut short still leaves what it computed
    print(f"{len(out)} digests -> {path}")
    return 0


def compare(a_path: str, b_path: str) -> int:
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    missing = sorted(set(a) ^ set(b))
    differ = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    print(f"{len(set(a) & set(b))} outputs in both: {len(differ)} differ; {len(missing)} in one file only")
    for k in differ:
        print(f"  differs: {k}")
    for k in missing:
        print(f"  only in {'the first' if k in a else 'the second'}: {k}")
    return 1 if differ or missing else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("save", help="run every case, write the digests as JSON").add_argument("path")
    c = sub.add_parser("compare", help="compare two digest files")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args(argv)
    return save(args.path) if args.cmd == "save" else compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
