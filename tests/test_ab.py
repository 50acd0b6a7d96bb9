"""bench/ab.py without a GPU: the parsing of devcheck's tables and the per-round table with its ratios."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import ab  # noqa: E402

TABLE = """[1/2] bf16-d128-N4096-B4-H16-full
shape                             fa3 TF/s    fa3_fp8 prequant TF/s
------------------------------  ----------  -----------------------
bf16-d128-N4096-B4-H16-full          650.2                    702.2
fp16-d64-N2048-B8-H32-causal         380.6                    336.1
"""


def test_numbers_reads_the_chosen_column_of_each_shape_row():
    assert ab.numbers(TABLE, 1) == {"bf16-d128-N4096-B4-H16-full": 650.2, "fp16-d64-N2048-B8-H32-causal": 380.6}
    assert ab.numbers(TABLE, 2)["bf16-d128-N4096-B4-H16-full"] == 702.2
    assert ab.numbers(TABLE, 5) == {}  # no such column: no number, not a crash


def test_numbers_finds_a_column_by_its_header():
    """--column "fa3_fp8 prequant": the position from the header, whatever variants come before it; a header no
    table has gives no number."""
    assert ab.numbers(TABLE, "fa3_fp8 prequant") == {"bf16-d128-N4096-B4-H16-full": 702.2,
                                                      "fp16-d64-N2048-B8-H32-causal": 336.1}
    assert ab.numbers(TABLE, "fa3 TF/s")["fp16-d64-N2048-B8-H32-causal"] == 380.6
    assert ab.numbers(TABLE, "fa3_fp8 +quant") == {}


def test_main_alternates_the_trees_and_gives_each_ratio_to_the_first(monkeypatch, capsys, tmp_path):
    calls = []
    speed = {"old": 500.0, "new": 550.0}
    monkeypatch.setattr(ab, "build", lambda tree, cache, variants, jobs: 0)

    def fake_devcheck(tree, cache, args):
        calls.append(cache.name)
        return f"bf16-d64-N4096-B4-H32-full   {speed[cache.name]}\n"
    monkeypatch.setattr(ab, "devcheck", fake_devcheck)
    assert ab.main([f"old={tmp_path}", f"new={tmp_path}", "--rounds", "2", "--cache-root", str(tmp_path),
                    "--", "--time", "short"]) == 0
    assert calls == ["old", "new", "old", "new"]
    out = capsys.readouterr().out
    assert "500.0 / 500.0" in out and "550.0 / 550.0" in out and "1.100" in out


def test_a_tree_whose_run_fails_reads_dash_and_the_others_still_show(monkeypatch, capsys, tmp_path):
    """The reference tree's devcheck lacking a shape set (it fails, no rows) left the whole table empty before."""
    monkeypatch.setattr(ab, "build", lambda tree, cache, variants, jobs: 0)
    monkeypatch.setattr(ab, "devcheck", lambda tree, cache, args:
                        "" if cache.name == "old" else "bf16-d64-N4096-B4-H32-causal   480.5\n")
    assert ab.main([f"old={tmp_path}", f"new={tmp_path}", "--rounds", "1", "--cache-root", str(tmp_path),
                    "--", "--time", "causal"]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("bf16-d64")]
    assert row and row[0].split()[1:] == ["-", "480.5", "-"]


def test_devcheck_says_when_a_run_fails(monkeypatch, capsys, tmp_path):
    class Failed:
        returncode, stdout, stderr = 2, "", "Traceback ...\nKeyError: 'causal'\n"
    monkeypatch.setattr(ab.subprocess, "run", lambda *a, **k: Failed())
    assert ab.devcheck(tmp_path, tmp_path / "c", ["--time", "causal"]) == ""
    assert "failed (rc 2): KeyError: 'causal'" in capsys.readouterr().err


def test_varlen_mode_compares_times_as_speeds(monkeypatch, capsys, tmp_path):
    """--varlen: bench/varlen.py's milliseconds per case and column; the ratio is the first tree's time over the
    other's, so a faster tree reads above 1."""
    ms = {"old": 2.0, "new": 1.6}
    monkeypatch.setattr(ab, "build", lambda tree, cache, variants, jobs: 0)
    seen = []

    def fake_varlen(tree, cache, args, columns):
        seen.append((cache.name, args, columns))
        return {f"packed 2 docs: {c}": ms[cache.name] for c in columns}
    monkeypatch.setattr(ab, "varlen_times", fake_varlen)
    assert ab.main([f"old={tmp_path}", f"new={tmp_path}", "--varlen", "--rounds", "2", "--cache-root", str(tmp_path),
                    "--", "--quick"]) == 0
    assert [n for n, _, _ in seen] == ["old", "new", "old", "new"]
    assert seen[0][1] == ["--quick"] and seen[0][2] == ["fa3 fwd ms", "fa3 bwd ms"]
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("packed 2 docs: fa3 fwd ms")]
    assert row and row[0].split()[-1] == "1.250" and "1.6 / 1.6" in row[0]
    assert "new / old speed" in out


def test_varlen_times_reads_the_runs_json_and_says_a_failure(monkeypatch, capsys, tmp_path):
    class Done:
        returncode, stderr = 0, ""

    def fake_run(cmd, **kw):
        path = cmd[cmd.index("--json") + 1]
        Path(path).write_text('[{"case": "dense 2 x 8192", "fa3 fwd ms": 1.06, "fa2 fwd ms": 2.0}]')
        assert kw["env"]["PYTHONPATH"] == str(tmp_path) and cmd[-1] == "--quick"
        return Done()
    monkeypatch.setattr(ab.subprocess, "run", fake_run)
    assert ab.varlen_times(tmp_path, tmp_path / "c", ["--quick"], ["fa3 fwd ms", "fa3 bwd ms"]) == \
        {"dense 2 x 8192: fa3 fwd ms": 1.06}

    class Failed:
        returncode, stderr = 1, "Traceback ...\nImportError: cannot import name 'fa3_masked'\n"
    monkeypatch.setattr(ab.subprocess, "run", lambda cmd, **kw: Failed())
    assert ab.varlen_times(tmp_path, tmp_path / "c", [], ["fa3 fwd ms"]) == {}
    assert "failed (rc 1): ImportError" in capsys.readouterr().err
