"""bench/varlen.py's report on hand-made rows: a forward and a backward table, only the columns some case has
(no GPU)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import varlen  # noqa: E402


def test_report_splits_directions_and_keeps_only_measured_columns():
    rows = [dict(case="packed", **{"fa2 fwd ms": 8.0, "fa2 fwd TFLOP/s": 300.0, "fa2 bwd ms": 60.0,
                                   "fa2 bwd TFLOP/s": 100.0, "fa4 fwd ms": 4.0, "fa4 bwd ms": 11.0}),
            dict(case="window", **{"fa2 fwd ms": 3.5, "fa2 fwd TFLOP/s": 290.0, "fa2 bwd ms": 25.0,
                                   "fa2 bwd TFLOP/s": 101.0, "fa2 x dense time": 0.262, "fa2 bwd x dense time": 0.247,
                                   "ideal": 0.234, "flex fwd ms": 2.7})]
    text = varlen.report(rows)
    forward, backward = text.split("\n\nbackward\n")
    assert forward.startswith("forward\n")
    assert "flex ms" in forward and "flex ms" not in backward
    assert "fa4 ms" in forward and "fa4 ms" in backward
    assert "0.262" in forward and "0.247" in backward and "0.262" not in backward
    assert "fa3" not in text  # no fa3 column where no case has one (a CPU machine's kernels: fa2 only)
    assert "60" in backward and "60" not in forward.split("\n", 3)[-1]
