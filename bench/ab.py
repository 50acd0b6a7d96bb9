"""A/B timing of source trees in one device call: each tree's kernels compiled in parallel into a cache of its own,
then `bench/devcheck.py` run from each tree in turn, ROUNDS times (alternating, so that the card's state drifts
alike for all), and one table of every tree's TFLOP/s per round with its ratio to the first tree's.

    python3 bench/ab.py base=/path/to/old-tree new=. --rounds 2 -- --time short --variants fa3 --no-peers
    python3 bench/ab.py base=/path/to/old-tree new=. --varlen --rounds 3 -- --quick

--varlen: the masked kernels instead, through this checkout's bench/varlen.py run on each tree's library (its
kernel modules, fa_variants.kernels.fa2_masked and fa3_masked, as of 2026-12-06 and since): per case and
--columns (default fa3's forward and backward times), the milliseconds of each round and each tree's speed against
the first tree's (the ratio of the rounds' sums).

A tree is a checkout of this repository (`git worktree add --detach ../old HEAD~3`; on the device, carry it).
The column compared is devcheck's first number on each shape row (the first variant's TFLOP/s), or the one
--column names: a position (1 = the first number) or the start of its header, e.g. --column "fa3_fp8 prequant"
with --fp8-matrix, whose columns move with --variants and the peers (the pre-quantized and the quantizing fp8
columns stand side by side: by position, one off is the other). Without --variants the build compiles every variant.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tabulate import tabulate


def build(tree: Path, cache: Path, variants: str | None, jobs: int) -> int:
    cmd = [sys.executable, "-m", "fa_variants.cli", "build", "--arch", "90a", "--jobs", str(jobs)]
    if variants:
        cmd += ["--variants", variants]
    env = dict(os.environ, PYTHONPATH=str(tree), FA_VARIANTS_CACHE=str(cache))
    return subprocess.run(cmd, cwd=tree, env=env, capture_output=True).returncode


def devcheck(tree: Path, cache: Path, args: list[str]) -> str:
    """devcheck's output in ``tree``; a failed run (an option or shape set that tree's devcheck lacks, a crash) is
    said on stderr with its last line, and its rows then read "-" rather than vanishing from the table."""
    env = dict(os.environ, PYTHONPATH=str(tree), FA_VARIANTS_CACHE=str(cache))
    run = subprocess.run([sys.executable, "bench/devcheck.py", *args], cwd=tree, env=env, capture_output=True,
                         text=True)
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        print(f"devcheck in {tree} failed (rc {run.returncode}): {last}", file=sys.stderr, flush=True)
    return run.stdout


def varlen_times(tree: Path, cache: Path, args: list[str], columns: list[str]) -> dict[str, float]:
    """{"case: column": milliseconds} of one run of this checkout's bench/varlen.py on ``tree``'s library; a failed
    run is said on stderr and gives {}."""
    env = dict(os.environ, PYTHONPATH=str(tree), FA_VARIANTS_CACHE=str(cache))
    with tempfile.TemporaryDirectory() as d:
        rows_json = Path(d) / "rows.json"
        run = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "varlen.py"), "--json",
                              str(rows_json), *args], cwd=tree, env=env, capture_output=True, text=True)
        if run.returncode != 0 or not rows_json.exists():
            last = (run.stderr.strip().splitlines() or ["(no stderr)"])[-1]
            print(f"varlen.py on {tree} failed (rc {run.returncode}): {last}", file=sys.stderr, flush=True)
            return {}
        rows = json.loads(rows_json.read_text())
    return {f"{r['case']}: {c}": r[c] for r in rows for c in columns if c in r}


def numbers(out: str, column: int | str) -> dict[str, float]:
    """{shape id: the column-th number of its row} from devcheck's tables; a str column is the position of the
    first header cell (tabulate's columns: two or more spaces apart) that starts with it, in each table."""
    res = {}
    for line in out.splitlines():
        cells = line.split()
        if isinstance(column, str) and cells[:1] == ["shape"]:
            heads = re.split(r"\s{2,}", line.strip())
            column = next((i for i, h in enumerate(heads) if h.startswith(column)), column)
            continue
        if cells and cells[0][:5] in ("bf16-", "fp16-") and isinstance(column, int):
            try:
                res[cells[0]] = float(cells[column])
            except (IndexError, ValueError):
                pass
    return res


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, script_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="+", help="NAME=PATH, the first one the reference")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--column", type=lambda c: int(c) if c.isdigit() else c, default=1,
                    help="which number of a shape row to compare: a position (default 1) or a header's start")
    ap.add_argument("--cache-root", default="/tmp/fav-ab")
    ap.add_argument("--varlen", action="store_true", help="time the masked kernels by bench/varlen.py")
    ap.add_argument("--columns", default="fa3 fwd ms,fa3 bwd ms", help="--varlen: its JSON's columns to compare")
    a = ap.parse_args(ours)
    trees = [(n, Path(p).resolve()) for n, p in (t.split("=", 1) for t in a.trees)]
    variants = script_args[script_args.index("--variants") + 1] if "--variants" in script_args else None
    caches = {n: Path(a.cache_root) / n for n, _ in trees}
    jobs = max(1, (os.cpu_count() or 1) // len(trees))
    with ThreadPoolExecutor(len(trees)) as pool:  # each build runs its own threads; the trees build side by side
        rcs = list(pool.map(lambda t: build(t[1], caches[t[0]], variants, jobs), trees))
    for (n, _), rc in zip(trees, rcs):
        print(f"build {n}: rc {rc}" + ("" if rc == 0 else " (a spill or a compile error: see fa-variants build)"))
    runs = {n: [] for n, _ in trees}
    for r in range(a.rounds):
        for n, path in trees:
            print(f"round {r + 1}: {n}", file=sys.stderr, flush=True)
            if a.varlen:
                runs[n].append(varlen_times(path, caches[n], script_args, a.columns.split(",")))
            else:
                runs[n].append(numbers(devcheck(path, caches[n], script_args), a.column))
    # varlen.py gives times (lower is faster), devcheck TFLOP/s: either way the ratio is a speed against the first
    speed = (lambda mine, base: sum(base) / sum(mine)) if a.varlen else (lambda mine, base: sum(mine) / sum(base))
    shown = "{:.3g}" if a.varlen else "{:.1f}"
    ref = trees[0][0]
    rows = []
    # every shape any tree measured, in the order first seen: a tree whose run failed shows "-", not an empty table
    for shape in dict.fromkeys(s for n, _ in trees for run in runs[n] for s in run):
        row = [shape]
        for n, _ in trees:
            vals = [run.get(shape) for run in runs[n]]
            row.append(" / ".join("-" if v is None else shown.format(v) for v in vals))
        for n, _ in trees[1:]:
            mine = [run.get(shape) for run in runs[n]]
            base = [run.get(shape) for run in runs[ref]]
            ok = None not in mine and None not in base
            row.append(f"{speed(mine, base):.3f}" if ok else "-")
        rows.append(row)
    heads = (["case: ms" if a.varlen else "shape"] + [f"{n} (per round)" for n, _ in trees]
             + [f"{n} / {ref} speed" if a.varlen else f"{n} / {ref}" for n, _ in trees[1:]])
    print(tabulate(rows, headers=heads, disable_numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
