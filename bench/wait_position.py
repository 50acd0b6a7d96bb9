"""Where the wait for the P V in flight sits in each overlapped step of an fa3 / fa3_fp8 instance (no GPU).

    python3 bench/wait_position.py "fa3_fwd<fav::BFloat16, 128, 192, 2, true, true, 2, false, true>"

An overlapped step waits twice: for its S (WARPGROUP.DEPBAR.LE gsb0, 0x1) and then for the previous block's P V
(DEPBAR ... 0x0). Per such step the table counts the row-max, exponential and pack instructions between the two
waits: the exponentials after the second wait run only once that P V is done (bench/NOTES.md, twelfth session,
fa3_fwd.cu's LATE_PV_WAIT). The last column is the length of the shortest loop around the step (a backward
branch over it): for the main loop's step, the instructions one K/V block costs, which is how two builds'
main loops were compared in the thirteenth session.
"""
import argparse
import re
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fa_variants import jit  # noqa: E402
from fa_variants.sass import instructions_by_function  # noqa: E402

COUNTED = ("FMNMX", "FFMA", "MUFU.EX2", "F2FP")
_PATTERN = {k: re.compile(r"\b" + re.escape(k) + r"\b") for k in COUNTED}


def steps(text: list[str]) -> list[dict]:
    """Per overlapped step (an S wait followed, before any wgmma or other S wait, by a P V wait): the counts of
    COUNTED between the two waits, and the exponentials of the whole step (up to its next wgmma)."""
    out = []
    for i, t in enumerate(text):
        if "DEPBAR.LE gsb0, 0x1" not in t:
            continue
        counts = dict.fromkeys(COUNTED, 0)
        for j in range(i + 1, len(text)):
            if "DEPBAR.LE gsb0, 0x0" in text[j]:
                ex2 = counts["MUFU.EX2"]
                for t2 in text[j + 1:]:
                    if "GMMA" in t2:
                        break
                    ex2 += bool(_PATTERN["MUFU.EX2"].search(t2))
                out.append({**counts, "step": ex2, "at": i})
                break
            if "GMMA" in text[j] or "DEPBAR.LE gsb0, 0x1" in text[j]:
                break
            for k in COUNTED:
                counts[k] += bool(_PATTERN[k].search(text[j]))
    return out


_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def loop_around(text: list[str], at: int) -> int | None:
    """Instructions in the shortest loop holding instruction ``at``: a branch back to an address at or before it
    (cuobjdump prints every 16-byte instruction, so instruction i sits at byte 16 i); None outside every loop."""
    best = None
    for i, t in enumerate(text):
        m = _BRANCH.search(t)
        if m and i >= at and int(m.group(1), 16) // 16 <= at:
            n = i - int(m.group(1), 16) // 16 + 1
            best = n if best is None else min(best, n)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("exprs", nargs="+", help="fa3_fwd name expressions, as kernels/fa3.py spells them")
    ap.add_argument("--arch", default="sm_90a")
    args = ap.parse_args(argv)
    rows = []
    for e in args.exprs:
        c = jit.compile_source("fa3_fwd.cu", (e,), args.arch)
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "k.cubin"
            cubin.write_bytes(c.cubin)
            text = [t for _, t in instructions_by_function(cubin)[c.lowered[e]]]
        for n, s in enumerate(steps(text)):
            rows.append([e, n, *(s[k] for k in COUNTED), s["step"], loop_around(text, s["at"]) or "-"])
    print(tabulate(rows, headers=["expression", "step", *(f"{k} before the P V wait" for k in COUNTED),
                                  "MUFU.EX2 in the step", "instructions of its loop"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
