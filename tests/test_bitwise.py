"""bench/bitwise.py's comparison: equal digest files pass, a changed or missing output fails and is named."""
import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location("bitwise", Path(__file__).parents[1] / "bench" / "bitwise.py")
bitwise = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bitwise)


def _write(tmp_path, name, data):
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return str(p)


def test_compare_equal_and_different(tmp_path, capsys):
    a = _write(tmp_path, "a.json", {"fwd-fa2-x": "11", "fwd-fa3-x": "22"})
    assert bitwise.compare(a, _write(tmp_path, "b.json", {"fwd-fa2-x": "11", "fwd-fa3-x": "22"})) == 0
    assert bitwise.compare(a, _write(tmp_path, "c.json", {"fwd-fa2-x": "11", "fwd-fa3-x": "23"})) == 1
    assert "differs: fwd-fa3-x" in capsys.readouterr().out
    assert bitwise.compare(a, _write(tmp_path, "d.json", {"fwd-fa2-x": "11"})) == 1
    assert "only in the first: fwd-fa3-x" in capsys.readouterr().out


def test_cases_cover_every_template_dim_and_both_masks():
    names = [c[0] for c in bitwise.cases()]
    assert len(names) == len(set(names))
    dims = {c[1][5] for c in bitwise.cases()}
    assert {64, 128, 256} <= dims and any(d % 16 for d in dims)
    assert {c[1][6] for c in bitwise.cases()} == {False, True}
