"""bench/table.py on hand-made pytest-benchmark JSON: its columns, ratios and fp8 budget verdicts (no GPU)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import table  # noqa: E402
from fa_variants.timing import Shape  # noqa: E402

# (shape, {variant: TFLOP/s}): four rows of `pytest bench` on the H200 on 2026-12-04 at 10eec9d (docs/results.md), one
# per verdict
ROWS = [
    ("bf16-d64-N1024-B16-H32-causal", {"fa3": 316.2, "torch-cudnn": 332.3, "fa3_fp8": 188.2, "fa3_fp8_prequant": 275.1}),
    ("bf16-d128-N2048-B8-H16-causal", {"fa3": 550.0, "torch-cudnn": 507.4, "fa3_fp8": 425.6, "fa3_fp8_prequant": 635.9}),
    ("bf16-d256-N4096-B4-H8-causal", {"fa3": 659.4, "torch-cudnn": 603.3, "fa3_fp8": 688.6, "fa3_fp8_prequant": 948.1}),
    ("bf16-d128-N4096-B4-H16-full", {"fa3": 735.3, "torch-cudnn": 679.9, "fa3_fp8": 779.0, "fa3_fp8_prequant": 928.5}),
]


def _doc(rows=ROWS, backward=False):
    out = []
    for shape_id, tfs in rows:
        flops = Shape.parse(shape_id).flops
        for v, tf in tfs.items():
            info = dict(shape=shape_id, variant=v, tflops=tf, median_ms=flops / (tf * 1e12) * 1e3,
                        tflops_do_bench=tf * 0.97)
            if backward:
                info.update(direction="bwd", variant=f"{v} bwd")
            out.append({"extra_info": info})
    out.append({"extra_info": {}})  # a benchmark of another test
    return {"benchmarks": out}


def test_columns_and_ratios(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_doc()))
    rows = table.load([path])
    assert list(rows) == [s for s, _ in ROWS]
    assert table.columns(rows) == ["fa3", "fa3_fp8", "fa3_fp8_prequant", "torch-cudnn"]
    assert table.best16(rows["bf16-d64-N1024-B16-H32-causal"]) == 332.3      # cuDNN leads there
    text = table.results_table(rows)
    assert "fa3_fp8 / best16" in text and "fa3 / cuDNN do_bench" in text
    line = next(li for li in text.splitlines() if li.startswith("| bf16-d128-N4096"))
    assert "1.08" in line                                                    # fa3 / cuDNN = 735.3 / 679.9


def test_budget_verdicts():
    rows = {s: {v: i for v, i in ((x["extra_info"]["variant"], x["extra_info"]) for x in _doc()["benchmarks"]
                                   if x["extra_info"].get("shape") == s)} for s, _ in ROWS}
    got = {s: table.budget(s, r, "fa3_fp8", table.H200_COPY_TBS) for s, r in rows.items()}
    assert [b["verdict"] for b in got.values()] == ["kernel", "floor", "quantizer", "pass"]
    b = got["bf16-d128-N2048-B8-H16-causal"]
    # K and V of B 8, H 16, N 2K, d 128 in bf16 (134 MB) read and written as e4m3 (67 MB) at 4.26 TB/s: 47 us
    assert abs(b["kv_floor_us"] - 1.5 * 2 * 8 * 16 * 2048 * 128 * 2 / 4.26e6) < 1e-6
    assert abs(b["ratio"] - 425.6 / 550.0) < 1e-9
    assert table.budget("bf16-d64-N1024-B16-H32-causal", {"fa3": rows["bf16-d64-N1024-B16-H32-causal"]["fa3"]},
                        "fa3_fp8", 4.26) is None


def test_backward_cases_are_left_out(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_doc(backward=True)))
    assert table.load([path]) == {}


def test_a_file_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text("not json")
    with pytest.raises(SystemExit, match="bench.json: not a readable pytest-benchmark JSON"):
        table.load([path])
