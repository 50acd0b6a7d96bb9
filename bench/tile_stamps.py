"""Where a persistent fa3 / fa3_fp8 tile's time goes: clock64 stamps per consumer and tile (needs a GPU).

    python3 bench/tile_stamps.py fa3_fp8:bf16-d128-N8192-B2-H16-full fa3:bf16-d128-N8192-B2-H16-full

A diagnostic build, never the shipped one: this tree is copied to a temporary directory and its fa3_fwd.cu gets
four stamps in the persistent grid's tile loop (``patched``), written to a ``__device__`` array by each consumer's
first thread: t0 when it has read tile k's slot, t1 after tile k's first block (with CROSS, issued beside the
previous tile's last P V), t2 after the previous tile's epilogue, t3 after tile k's other blocks. Three more split
the epilogue where O leaves by TMA (TMA_OUT): e1 once the O buffer is free (fp8: the TMA unit has read the previous
tile's rows out of it; 16-bit: no wait), e2 once this thread's O rows are in shared memory (SwizzledOut: the
normalization, fp8's dequantization with V's channel scales, the stores), e3 after the fence and the consumer's
barrier; t2 follows the TMA store's issue. The copy then
runs this script's ``--measure`` half (its own kernel cache, its own fa_variants), one call per argument after
three warm-up calls. Per shape, medians over every consumer and tile, in SM cycles and in block times (one block
of the main loop: (t3 - t2) / (n - 1)): the tile boundary t2[k] - t3[k-1] and its parts. bench/NOTES.md,
nineteenth session, has the first readings (a boundary of ~2.07 block times, the epilogue 0.6-0.7 of it).
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import patch_tree  # (bench/, beside this script)

STAMP_K = 40     # tiles stamped per CTA (later tiles are not)
SLOTS = 12       # per (CTA, consumer, tile): t0, t1, t2, t3, n, tile, cross, unused, e1, e2, e3, unused
CTAS, CONSUMERS = 264, 3

# (anchor in fa3_fwd.cu, what replaces it): each anchor must occur exactly once
_DECL = (f"constexpr int STAMP_K = {STAMP_K}, STAMP_SLOTS = {SLOTS};  // (diagnostic: bench/tile_stamps.py)\n"
         f"__device__ long long fav_stamps[{CTAS * CONSUMERS * STAMP_K * SLOTS}];\n")
_STAMP = ("        int stamp_k = 0;  // (diagnostic: the tile whose loop turn stores O, set before store_out)\n"
          "        auto stamp = [&](int k, int e, long long v) {\n"
          "            if (threadIdx.x % 128 == 0 && k < fav::STAMP_K)\n"
          "                fav::fav_stamps[((blockIdx.x * NC + c) * fav::STAMP_K + k) * fav::STAMP_SLOTS + e] = v;\n"
          "        };\n"
          "        auto substamp = [&](int e) { stamp(stamp_k, e, clock64()); };\n")
EDITS = (
    ("}  // namespace fav\n\ntemplate <class T, int D", _DECL + "}  // namespace fav\n\ntemplate <class T, int D"),
    ("        auto store_out = [&](const TileWork& x) {", _STAMP + "        auto store_out = [&](const TileWork& x) {"),
    ("                const u32 tile = O_IN_Q ? sQ(x.q) : sO;\n",
     "                substamp(8);\n                const u32 tile = O_IN_Q ? sQ(x.q) : sO;\n"),
    ("                SwizzledOut<T, TO>::store(rows, p, tile, row0, sv, FP8 ? P_SCALE_LOG2 : 0);\n",
     "                SwizzledOut<T, TO>::store(rows, p, tile, row0, sv, FP8 ? P_SCALE_LOG2 : 0);\n"
     "                substamp(9);\n"),
    ("                named_sync(5 + c, 128);  // all of this consumer's rows\n",
     "                named_sync(5 + c, 128);  // all of this consumer's rows\n                substamp(10);\n"),
    ("                mbar_arrive_if(tile_empty(k), leader);\n",
     "                mbar_arrive_if(tile_empty(k), leader);\n                stamp(k, 0, clock64());\n"),
    ("                if (!done) x = tile_of(t);\n",
     "                if (!done) x = tile_of(t);\n                stamp(k, 4, done ? -1 : x.n);\n"
     "                stamp(k, 5, t);\n"),
    ("                if (k > 0 && !parked) store_out(prev);\n",
     "                stamp(k, 1, clock64());\n                stamp_k = k;\n"
     "                if (k > 0 && !parked) store_out(prev);\n"
     "                stamp(k, 2, clock64());\n                stamp(k, 6, cross);\n"),
    ("                blocks_after_first(x);\n                prev = x;\n",
     "                blocks_after_first(x);\n                stamp(k, 3, clock64());\n                prev = x;\n"),
)


def patched(source: str) -> str:
    """fa3_fwd.cu with the stamps; ValueError naming an anchor that is not there exactly once."""
    return patch_tree.patched(source, EDITS, "tile_stamps", "fa3_fwd.cu")


def copy_patched(dest: Path) -> Path:
    """This tree's package and kernel sources, fa3_fwd.cu stamped, under dest."""
    return patch_tree.copy_patched(dest, {"cuda_src/fa3_fwd.cu": EDITS}, "tile_stamps")


def summary(stamps, head_dim: int) -> dict:
    """Medians over consumers and tiles (k >= 1 with keys) of the tile boundary and its parts, in cycles and in
    block times; stamps: (CTAS, CONSUMERS, STAMP_K, SLOTS) int64."""
    import numpy as np
    nc = 3 if head_dim == 64 else 2
    per_block, parts = [], {"boundary": [], "slot wait": [], "first block": [], "previous epilogue": []}
    epi = {"O buffer wait": [], "O to shared": [], "fence + barrier": [], "TMA issue": []}
    for s in stamps[:, :nc].reshape(-1, STAMP_K, SLOTS):
        for k in range(1, STAMP_K):
            if s[k, 4] <= 0 or 0 in (s[k, 0], s[k, 3], s[k - 1, 3]):
                continue
            per_block.append((s[k, 3] - s[k, 2]) / max(1, s[k, 4] - 1))
            parts["boundary"].append(s[k, 2] - s[k - 1, 3])
            parts["slot wait"].append(s[k, 0] - s[k - 1, 3])
            parts["first block"].append(s[k, 1] - s[k, 0])
            parts["previous epilogue"].append(s[k, 2] - s[k, 1])
            if 0 not in (s[k, 8], s[k, 9], s[k, 10]):  # O left by TMA (e1-e3 stamped)
                epi["O buffer wait"].append(s[k, 8] - s[k, 1])
                epi["O to shared"].append(s[k, 9] - s[k, 8])
                epi["fence + barrier"].append(s[k, 10] - s[k, 9])
                epi["TMA issue"].append(s[k, 2] - s[k, 10])
    if not per_block:
        raise RuntimeError("tile_stamps: no tile with a previous one was stamped (a grid of one tile per CTA?)")
    block = float(np.median(per_block))
    parts.update({name: v for name, v in epi.items() if v})
    return {"tiles": len(per_block), "block cycles": block,
            **{name: (float(np.median(v)), float(np.median(v)) / block) for name, v in parts.items()}}


PARTS = ("boundary", "slot wait", "first block", "previous epilogue", "O buffer wait", "O to shared",
         "fence + barrier", "TMA issue")


def measure(args) -> None:
    """(Run inside the stamped copy.) One stamped call per variant:shape."""
    import cupy
    import numpy as np
    from tabulate import tabulate

    import fa_variants as fav
    from fa_variants import jit, timing
    from fa_variants.timing import Shape

    modules = []
    load = jit._load

    def recording_load(*a):
        out = load(*a)
        modules.append(out[0])
        return out
    jit._load = recording_load  # the stamps live in the module that holds the kernel: remember each one loaded
    rows = []
    for spec in args.cases:
        variant, shape_id = spec.split(":")
        shp = Shape.parse(shape_id)
        scale = 1 / math.sqrt(shp.head_dim)
        q, k, v = timing.random_inputs(shp, cupy, 0)
        if variant == "fa3_fp8":
            qz = fav.fp8.quantize(q, k, v, variant="fa3_fp8")
            call = lambda: fav.fp8.attention(qz, causal=shp.causal, softmax_scale=scale)  # noqa: E731
        else:
            call = lambda: fav.attention(q, k, v, variant=variant, causal=shp.causal,  # noqa: E731
                                         softmax_scale=scale, backend="cuda")
        for _ in range(3):
            call()
        cupy.cuda.get_current_stream().synchronize()
        ptr = next(m.get_global("_ZN3fav10fav_stampsE") for m in reversed(modules)
                   if _has_global(m, "_ZN3fav10fav_stampsE"))
        stamps = cupy.ndarray((CTAS, CONSUMERS, STAMP_K, SLOTS), dtype=cupy.int64, memptr=ptr)
        stamps.fill(0)
        call()
        cupy.cuda.get_current_stream().synchronize()
        st = stamps.get()
        if args.save:
            np.save(Path(args.save) / f"stamps-{variant}-{shp.id}.npy", st)
        s = summary(st, shp.head_dim)
        rows.append([variant, shp.id, s["tiles"], round(s["block cycles"])]
                    + [f"{s[p][0]:.0f} ({s[p][1]:.2f})" if p in s else "-" for p in PARTS])
    print(tabulate(rows, headers=["variant", "shape", "tiles", "block (cycles)", "boundary: cycles (blocks)",
                                  *PARTS[1:]]))


def _has_global(module, name: str) -> bool:
    try:
        module.get_global(name)
        return True
    except Exception:  # noqa: BLE001 - a module without the symbol (the quantizers')
        return False


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+", help="variant:shape, e.g. fa3_fp8:bf16-d128-N8192-B2-H16-full "
                    "(fa3 or fa3_fp8 on a shape that runs the persistent grid)")
    ap.add_argument("--save", default="", help="a folder for the raw stamps (.npy per case)")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # (inside the stamped copy)
    args = ap.parse_args(argv)
    for spec in args.cases:
        if spec.count(":") != 1 or spec.split(":")[0] not in ("fa3", "fa3_fp8"):
            ap.error(f"a case is fa3:<shape> or fa3_fp8:<shape>, got {spec!r}")
    if args.measure:
        return measure(args)
    with tempfile.TemporaryDirectory(prefix="fav-stamps-") as tmp:
        tree = copy_patched(Path(tmp))
        env = dict(os.environ, PYTHONPATH=str(tree), FA_VARIANTS_CACHE=str(Path(tmp) / "cache"))
        cmd = [sys.executable, str(tree / "bench" / "tile_stamps.py"), "--measure", *args.cases]
        if args.save:
            cmd += ["--save", str(Path(args.save).resolve())]
        return subprocess.run(cmd, env=env, cwd=tree).returncode


if __name__ == "__main__":
    sys.exit(main())
