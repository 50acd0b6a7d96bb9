"""bench/wait_position.py's SASS reading, on instruction lists written by hand (no compiler): the counts between an
overlapped step's two waits, and the loop a step sits in (how NOTES compares two builds' main loops)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import wait_position as wp  # noqa: E402

S_WAIT, PV_WAIT = "WARPGROUP.DEPBAR.LE gsb0, 0x1 ;", "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;"


def test_counts_between_the_s_wait_and_the_pv_wait():
    text = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;", S_WAIT, "FMNMX R0, R1, R2, !PT ;",
            "MUFU.EX2 R3, R4 ;", PV_WAIT, "MUFU.EX2 R5, R6 ;", "F2FP.BF16.F32.PACK_AB R7, R5, R3 ;",
            "HGMMA.64x128x16.F32.BF16 R24, R8, gdesc[UR4], R24 ;"]
    (step,) = wp.steps(text)
    assert (step["FMNMX"], step["MUFU.EX2"], step["F2FP"], step["step"]) == (1, 1, 0, 2)
    assert step["at"] == 1


def test_loop_around_is_the_shortest_backward_branch_over_the_step():
    text = ["A ;", "B ;", "@P0 BRA 0x10 ;", "C ;", "BRA 0x0 ;", "@P1 BRA 0x40 ;"]
    assert wp.loop_around(text, 1) == 2     # [1, 2]: the branch at 2 back to instruction 1
    assert wp.loop_around(text, 3) == 5     # only the outer branch at 4 back to 0 holds instruction 3
    assert wp.loop_around(text, 0) == 5     # the inner loop starts after it
    assert wp.loop_around(["A ;", "BRA 0x20 ;", "C ;"], 0) is None  # a forward branch is no loop
