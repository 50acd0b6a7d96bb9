"""fa_variants/ablation.py and `fa-variants explain --measured`: the FA3 ablation read from what bench/ablation.py
writes, each lever's ratio computed from its two rows, and a clear error for a file that is not such a run."""
from __future__ import annotations

import json

import pytest

from fa_variants import ablation, cli

ROWS = [("fa2 (wgmma)", 400.0), ("fa3 -pingpong -overlap", 500.0), ("fa3 -overlap", 450.0),
        ("fa3 -pingpong", 600.0), ("fa3", 640.0), ("fa3 as shipped", 672.0)]


def _run(tmp_path, rows=ROWS, meta=None):
    f = tmp_path / "abl.json"
    f.write_text(json.dumps(dict(meta=meta or dict(card="a card", commit="abc1234"),
                                 rows=[dict(shape="bf16-d128-N4096-B4-H16-full", impl=i, ms=1.0, tflops=t)
                                       for i, t in rows])))
    return f


def test_each_lever_is_the_ratio_of_its_two_rows(tmp_path):
    out = ablation.text(ablation.load(_run(tmp_path)), "test")
    assert "a card" in out and "abc1234" in out
    lever = {line.rsplit(None, 1)[0].strip(): line.rsplit(None, 1)[1] for line in out.splitlines()
             if line.endswith("x") and not line.startswith("-")}
    assert lever["TMA + warp specialization (vs fa2's wgmma kernel)"] == f"{500 / 400:.3f}x"
    assert lever["ping-pong alone"] == f"{450 / 500:.3f}x"
    assert lever["intra-warpgroup overlap alone"] == f"{600 / 500:.3f}x"
    assert lever["ping-pong, with the overlap"] == f"{640 / 600:.3f}x"
    assert lever["all of FA3 over fa2"] == f"{640 / 400:.3f}x"
    assert lever["the shipped grid and tiles (by length)"] == f"{672 / 640:.3f}x"


def test_the_shipped_run_loads_and_names_its_card_and_commit():
    data = ablation.load()
    assert data["meta"]["card"] and data["meta"]["commit"]
    assert {r["impl"] for r in data["rows"]} == {impl for impl, _ in ROWS}


@pytest.mark.parametrize("content, why", [("not json", "not JSON"), ("[1, 2]", "bench/ablation.py --json"),
                                          ('{"rows": [{"impl": "fa3"}]}', "without shape, impl and tflops")])
def test_a_file_that_is_not_an_ablation_run_is_refused_by_name(tmp_path, content, why):
    f = tmp_path / "bad.json"
    f.write_text(content)
    with pytest.raises(ValueError, match=why):
        ablation.load(f)
    with pytest.raises(SystemExit, match="--measured"):
        cli.main(["explain", "fa3", "--measured", str(f)])


def test_explain_prints_a_given_run(tmp_path, capsys):
    assert cli.main(["explain", "fa3", "--measured", str(_run(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "a card" in out and f"{640 / 400:.3f}x" in out
