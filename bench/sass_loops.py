"""The loops of kernels in this tree and what each issues (no GPU): per loop, its instructions, its MMAs (HGMMA,
QGMMA, HMMA), its special-function operations (MUFU) and its most frequent opcodes. A main loop's instructions a
block against another kernel's are where an issue-bound step shows (docs/masks.md, "bare and softcap-only loops").

    python3 bench/sass_loops.py fa3_fwd.cu "fa3_fwd_masked<fav::BFloat16, 128, 128, 2, true, 2>"
    python3 bench/sass_loops.py --mma 16 --arch sm_90a fa3_bwd.cu "fa3_bwd<fav::BFloat16, 128, 128, 64>"

--mma N keeps the loops holding exactly N MMAs (a main-loop step's count: d / 16 + BN / 16 for fa3's forward).
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fa_variants import jit, sass  # noqa: E402

MMA = ("HGMMA", "QGMMA", "HMMA")


def loop_rows(instructions: list[tuple[str, str]], mma: int | None = None) -> list[list]:
    """A row per loop of one function's (opcode, text) instructions: its span, sizes and top opcodes."""
    rows = []
    for first, last in sass.loops([t for _, t in instructions]):
        body = instructions[first:last + 1]
        ops = collections.Counter(op for op, _ in body)
        n_mma = sum(ops[op] for op in MMA)
        if n_mma == 0 or (mma is not None and n_mma != mma):
            continue
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(8))
        rows.append([f"{first * 16:#x}-{last * 16:#x}", len(body), n_mma, ops["MUFU"], top])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source")
    ap.add_argument("exprs", nargs="+")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--mma", type=int, help="only the loops with this many MMA instructions")
    args = ap.parse_args()
    path, lowered = jit.cached_cubin(args.source, tuple(args.exprs), args.arch)
    functions = sass.instructions_by_function(path)
    for expr in args.exprs:
        print(expr)
        print(tabulate(loop_rows(functions[lowered[expr]], args.mma),
                       headers=["span", "instructions", "MMA", "MUFU", "most frequent"]))
        print()


if __name__ == "__main__":
    main()
