"""fa_variants.sass.loops and bench/sass_loops.py's rows on hand-written instruction lists (no GPU, no cuobjdump)."""
import sys
from pathlib import Path

from fa_variants import sass

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import sass_loops  # noqa: E402


def program():
    """(opcode, text) of a function: a loop at [1, 4] holding two HGMMA and a MUFU, a forward branch at 5 (no loop),
    an outer loop [0, 7] around both."""
    texts = ["MOV R0, R1", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", "MUFU.EX2 R2, R3",
             "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24", "@P0 BRA 0x10", "@P1 BRA 0x70", "NOP", "BRA 0x0"]
    return [(t.split()[1 if t.startswith("@") else 0].split(".")[0], t) for t in texts]


def test_loops_are_the_spans_of_backward_branches():
    assert sass.loops([t for _, t in program()]) == [(1, 4), (0, 7)]


def test_loop_rows_count_mmas_and_keep_the_asked_count():
    rows = sass_loops.loop_rows(program())
    assert [r[:4] for r in rows] == [["0x10-0x40", 4, 2, 1], ["0x0-0x70", 8, 2, 1]]
    assert sass_loops.loop_rows(program(), mma=3) == []
