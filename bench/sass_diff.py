"""The machine code of kernels in this tree against another commit's, instruction for instruction (no GPU).

    python3 bench/sass_diff.py --against 64cbb12 fa3_fwd.cu "fa3_fwd<fav::BFloat16, 64, 128, 2, true, true, 3, true, true>"
    python3 bench/sass_diff.py --here d95efed --against d95efed~1 fa3_fwd.cu "..."     (two commits)
    python3 bench/sass_diff.py --diff --against HEAD fa3_fwd.cu "..."                   (and where they differ)

Each tree compiles the name expressions with its own NVRTC layer (fa_variants.jit of that tree, for --arch,
default sm_90a); cuobjdump reads both cubins (fa_variants.sass). Per expression: registers, instruction counts and
whether the instructions match with immediates and addresses masked. The docs' "SASS identical to ..."
claims (a change that leaves the kernels as they ran on the GPU, or a revert that restores them) come from this.
Exit status 1 if any expression differs.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fa_variants.sass import comparable, instructions_by_function  # noqa: E402

# run inside a tree (its package first on sys.path): compile, write the cubin, print {expr: [mangled, registers]}
_COMPILE = """
import json, sys
from fa_variants import jit
src, arch, out, exprs = sys.argv[1], sys.argv[2], sys.argv[3], tuple(sys.argv[4:])
c = jit.compile_source(src, exprs, arch)
open(out, "wb").write(c.cubin)
regs = {r.kernel: r.registers for r in c.reports()}
print(json.dumps({e: [c.lowered[e], regs.get(e)] for e in exprs}))
"""


def compile_in(tree: Path, source: str, exprs: list[str], arch: str, cubin: Path) -> dict:
    """{expression: (mangled name, registers)}, the cubin written to ``cubin``, as ``tree``'s code compiles them."""
    run = subprocess.run([sys.executable, "-c", _COMPILE, source, arch, str(cubin), *exprs], capture_output=True,
                         text=True, cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree),
                                                       FA_VARIANTS_CACHE=str(cubin.parent / "cache")))
    if run.returncode:
        raise SystemExit(f"compiling in {tree} failed:\n{run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="a commit (anything `git archive` takes)")
    ap.add_argument("--here", help="a commit to compare instead of the working tree")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--diff", action="store_true", help="also print where each differing expression's instructions "
                    "differ (a unified diff, immediates and addresses masked)")
    ap.add_argument("source", help="a file of cuda_src/, e.g. fa2_bwd_sm90.cu")
    ap.add_argument("exprs", nargs="+", help="kernel name expressions, as the launchers spell them")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)

        def tree_of(rev: str, name: str) -> Path:
            tree = tmp / name
            tree.mkdir()
            archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
            return tree

        here = tree_of(args.here, "here-tree") if args.here else ROOT
        old = tree_of(args.against, "tree")
        names = {}
        for label, tree in (("here", here), (args.against, old)):
            work = tmp / label.replace("/", "_")  # a branch name may hold slashes
            work.mkdir()
            names[label] = compile_in(tree, args.source, args.exprs, args.arch, work / "k.cubin")
            names[label]["sass"] = instructions_by_function(work / "k.cubin")
        rows, differ = [], 0
        for e in args.exprs:
            (m_new, r_new), (m_old, r_old) = names["here"][e], names[args.against][e]
            new, old_ins = names["here"]["sass"][m_new], names[args.against]["sass"][m_old]
            a, b = [comparable(t) for _, t in old_ins], [comparable(t) for _, t in new]
            same = a == b
            differ += not same
            if args.diff and not same:
                print(f"--- {e}: {args.against} -> {args.here or 'this tree'}")
                print("\n".join(difflib.unified_diff(a, b, lineterm="", n=2)))
            rows.append([e, f"{r_old} -> {r_new}", f"{len(old_ins)} -> {len(new)}", "identical" if same else "DIFFERENT"])
    print(tabulate(rows, headers=["expression", "registers", "instructions",
                                  f"SASS of {args.here or 'this tree'} vs {args.against}"]))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
