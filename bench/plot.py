"""TFLOP/s against sequence length, from pytest-benchmark's saved JSON: one PNG, one subplot per group.

    pytest bench --benchmark-json=results.json          (or --benchmark-autosave: .benchmarks/**/*.json)
    PYTHONPATH=$PWD python3 bench/plot.py results.json -o bench/tflops.png
    python3 bench/plot.py                               # the newest file under .benchmarks/
    python3 bench/plot.py results.json --dtype all --timer do_bench

Each subplot is one (dtype, head_dim, causal) group of the bench; each line one variant (ours and both torch
SDPA backends), TFLOP/s (from the ``extra_info`` that bench/test_bench.py records) against N on a log2 axis.
Default: the bf16 groups (d = 64, 128, 256, causal and not); ``--dtype all`` adds fp16. Several files may be
given: a later file's point replaces an earlier one's. Needs matplotlib (imported only to draw).
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
from fa_variants.timing.shapes import Shape


TIMER_KEYS = {"events": "tflops", "do_bench": "tflops_do_bench"}
_SHORT = {"bfloat16": "bf16", "float16": "fp16"}


# ------------------------------------------------------------------------------------------------ reading
def forward_records(doc: dict):
    """(shape id, variant, extra_info) of every forward benchmark of one pytest-benchmark JSON document that
    bench/test_bench.py recorded (backward cases carry a direction; benchmarks of other tests have no shape)."""
    for b in doc.get("benchmarks", []):
        info = b.get("extra_info") or {}
        if info.get("direction", "fwd") != "fwd" or info.get("shape") is None or info.get("variant") is None:
            continue
        yield info["shape"], info["variant"], info


def benchmark_points(doc: dict, timer: str = "events"):
    """(group, variant, N, TFLOP/s) for every forward benchmark of one pytest-benchmark JSON document that
    recorded a TFLOP/s for ``timer``; group = (dtype, head_dim, causal)."""
    key = TIMER_KEYS[timer]
    for shape_id, variant, info in forward_records(doc):
        value = info.get(key)
        if value is None:
            continue
        try:
            shape = Shape.parse(shape_id)
        except ValueError:
            continue
        yield (shape.dtype, shape.head_dim, shape.causal), variant, shape.seqlen_q, float(value)


def load(paths, timer: str = "events") -> dict:
    """{group: {variant: sorted [(N, TFLOP/s)]}} from the JSON files ``paths`` (later files win on a clash)."""
    merged = {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        for group, variant, n, value in benchmark_points(doc, timer):
            merged[group, variant, n] = value
    out = collections.defaultdict(lambda: collections.defaultdict(list))
    for (group, variant, n), value in sorted(merged.items()):
        out[group][variant].append((n, value))
    return {g: dict(v) for g, v in out.items()}


def select(groups: dict, dtype: str = "bf16") -> dict:
    """The groups of one dtype ('bf16', 'fp16', or 'all')."""
    if dtype == "all":
        return groups
    return {g: v for g, v in groups.items() if _SHORT.get(g[0], g[0]) == dtype}


def layout(groups) -> tuple[list, list]:
    """(rows, columns) of the subplot grid: a row per (dtype, causal), a column per head dim."""
    rows = sorted({(g[0], g[2]) for g in groups}, key=lambda r: (r[0] != "bfloat16", r[0], r[1]))
    cols = sorted({g[1] for g in groups})
    return rows, cols


def newest_saved(root: str = ".benchmarks") -> str | None:
    files = glob.glob(os.path.join(root, "**", "*.json"), recursive=True)
    return max(files, key=os.path.getmtime) if files else None


def _n_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


# ------------------------------------------------------------------------------------------------ drawing
def draw(groups: dict, out: str, timer: str = "events"):
    import matplotlib
    matplotlib.use("Agg")                    # files only: no display on the GPU machine
    import matplotlib.pyplot as plt

    rows, cols = layout(groups)
    variants = sorted({v for g in groups.values() for v in g}, key=lambda v: (v.startswith("torch-"), v))
    colors = {v: plt.get_cmap("tab10")(i % 10) for i, v in enumerate(variants)}
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(4.2 * len(cols), 3.4 * len(rows)), squeeze=False)
    for i, (dtype, causal) in enumerate(rows):
        for j, d in enumerate(cols):
            ax = axes[i][j]
            series = groups.get((dtype, d, causal))
            if not series:
                ax.axis("off")
                continue
            for v in variants:
                if v in series:
                    ns, tf = zip(*series[v])
                    ax.plot(ns, tf, marker="o", ms=3, color=colors[v], label=v,
                            linestyle="--" if v.startswith("torch-") else "-")
            ns = sorted({n for pts in series.values() for n, _ in pts})
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns, [_n_label(n) for n in ns])
            ax.minorticks_off()              # log2 minor ticks between powers of two only clutter
            ax.set_title(f"{_SHORT.get(dtype, dtype)} d={d} {'causal' if causal else 'full'}", fontsize=10)
            ax.set_xlabel("N (seqlen)")
            ax.set_ylabel("TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
    handles = [plt.Line2D([], [], color=colors[v], marker="o", linestyle="--" if v.startswith("torch-") else "-")
               for v in variants]
    fig.legend(handles, variants, loc="lower center", ncol=min(len(variants), 7), fontsize=9)
    what = "median CUDA-event time" if timer == "events" else "triton do_bench median"
    fig.suptitle(f"forward TFLOP/s (4BHN^2d, /2 causal; {what}; B*N = 16K tokens)")
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="*", help="pytest-benchmark JSON files (default: newest under .benchmarks/)")
    ap.add_argument("-o", "--out", default="bench/tflops.png")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "all"])
    ap.add_argument("--timer", default="events", choices=sorted(TIMER_KEYS))
    args = ap.parse_args(argv)
    paths = args.json or [p for p in [newest_saved()] if p]
    if not paths:
        sys.exit("no JSON given and none under .benchmarks/ (run pytest bench --benchmark-autosave)")
    groups = select(load(paths, args.timer), args.dtype)
    if not groups:
        sys.exit(f"no {args.dtype} benchmark with a '{TIMER_KEYS[args.timer]}' in {', '.join(paths)}")
    try:
        draw(groups, args.out, args.timer)
    except ImportError as e:
        sys.exit(f"plot needs matplotlib ({e}): pip install matplotlib")
    n = sum(len(pts) for g in groups.values() for pts in g.values())
    print(f"{args.out}: {len(groups)} subplots, {n} points from {', '.join(paths)}", file=sys.stderr)


if __name__ == "__main__":
    main()
