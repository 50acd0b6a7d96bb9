"""CPU tests of the benchmarks' pure-Python parts: TFLOP/s with the real head dim, the summary's peer ratios,
plot's reading of pytest-benchmark JSON and launch_cost's table. Nothing here needs a GPU."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from fa_variants.timing.events import rest_seconds
from fa_variants.timing.inputs import random_dout, random_inputs
from fa_variants.timing import torch_peers, user_view
from fa_variants.timing.shapes import (DIRECTIONS, Shape, backward_flops, bench_group, direction_flops, parse_directions,
                                     tflops)
from fa_variants.timing.tables import Skipped, Timed, peer_ratios, skip_lines, speedup, summary_tables
from fa_variants.timing.torch_peers import (torch_flex_fn, torch_grad_fn, torch_leaf_sets, torch_sdpa_fwdbwd_fn,
                                           torch_sdpa_grad_sets)
from fa_variants.timing.user_view import user_view_ms

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _script(name: str):
    """bench/<name>.py as a module (bench/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


headdims, plot, launch_cost = _script("headdims"), _script("plot"), _script("launch_cost")


# ------------------------------------------------------------------------------------------------ head dims
def test_heads_and_padding():
    assert [headdims.heads_for(d) for d in (64, 128, 256)] == [32, 16, 8]          # exact where d divides 2048
    assert [headdims.heads_for(d) for d in (80, 111, 160, 192, 224)] == [26, 18, 13, 11, 9]   # rounded
    assert [headdims.padded_dim(d) for d in (80, 111, 160, 192, 224)] == [96, 128, 160, 192, 224]
    assert headdims.padded_dim(160, (32, 64, 96, 128, 256)) == 256               # fa2's tile dims
    with pytest.raises(ValueError):
        headdims.padded_dim(257)


def test_templates_come_from_the_tile_table():
    from fa_variants.kernels import fa2
    table = fa2.SM90_TILES if fa2.uses_wgmma() else fa2.TILES  # the kernel this device (or the H200) runs
    assert headdims.templates_of("fa2") == tuple(sorted(table))
    assert headdims.templates_of("no_such_variant") == headdims.TEMPLATE_DIMS


def test_tflops_use_the_real_head_dim():
    s = headdims.problem(111, causal=True)
    assert (s.batch, s.heads, s.seqlen_q, s.head_dim, s.dtype) == (4, 18, 4096, 111, "bfloat16")
    assert s.flops == 4 * 4 * 18 * 4096 ** 2 * 111 / 2
    row = headdims.row_values("fa2", 111, True, headdims.TEMPLATE_DIMS, {111: 2.0, 128: 2.5}, peer_ms=None)
    assert row["pads_to"] == 128 and row["heads"] == 18
    assert row["tflops"] == pytest.approx(s.flops / 2e-3 / 1e12)
    t = Shape(4, 18, 4096, 128, "bfloat16", True)                                   # the template, same B, H, N
    assert row["template_shape"] == t.id
    assert row["template_tflops"] == pytest.approx(t.flops / 2.5e-3 / 1e12)
    assert row["padded_over_template"] == pytest.approx(0.8)
    assert row["torch_flash_tflops"] is None and row["over_torch_flash"] is None and row["error"] is None


def test_headdims_rows_with_errors_and_templates():
    err = headdims.row_values("fa1", 80, False, (32, 64, 96, 128, 256), {80: "d=80: KeyError: 80", 96: 1.0}, 0.5)
    assert err["ms"] is None and err["padded_over_template"] is None and "KeyError" in err["error"]
    assert err["torch_flash_tflops"] == pytest.approx(headdims.problem(80, False).flops / 0.5e-3 / 1e12)
    same = headdims.row_values("fa2", 160, False, headdims.TEMPLATE_DIMS, {160: 1.0}, 2.0)
    assert same["pads_to"] == 160 and same["padded_over_template"] is None
    assert same["over_torch_flash"] == pytest.approx(2.0)
    headers, body = headdims.table([err, same])
    assert len(body) == 2 and all(len(r) == len(headers) for r in body)
    assert body[1][4] == "(template)" and body[1][9] == "2.00"
    json.dumps([err, same])


# ------------------------------------------------------------------------------------------------ summary
S1 = Shape(4, 16, 4096, 128, "bfloat16", False)
S2 = Shape(2, 16, 8192, 128, "bfloat16", True)


def _results():
    return [Timed(S1, "torch-flash", 2.0, 2.4), Timed(S1, "torch-cudnn", 1.0, 1.2), Timed(S1, "fa2", 1.6, 2.0),
            Timed(S1, "fa1", 8.0, None), Timed(S2, "torch-flash", 3.0, None), Timed(S2, "fa2", 2.5, None)]


def test_speedup_is_peer_time_over_time():
    assert speedup(2.0, 1.6) == pytest.approx(1.25)
    assert speedup(None, 1.0) is None and speedup(1.0, None) is None
    assert speedup(1.0, 0.0) is None


def test_peer_ratios_by_both_timers():
    res = _results()
    r = peer_ratios(res, res[2])
    assert r["over_torch_flash"] == pytest.approx(2.0 / 1.6)
    assert r["over_torch_flash_do_bench"] == pytest.approx(2.4 / 2.0)
    assert r["over_torch_cudnn"] == pytest.approx(1.0 / 1.6)
    assert r["over_torch_cudnn_do_bench"] == pytest.approx(1.2 / 2.0)
    r2 = peer_ratios(res, res[5])                   # S2: no cuDNN, no do_bench
    assert r2["over_torch_flash"] == pytest.approx(3.0 / 2.5)
    assert r2["over_torch_flash_do_bench"] is None and r2["over_torch_cudnn"] is None
    assert peer_ratios([], Timed(S1, "fa2", 1.0))["over_torch_flash"] is None


def test_summary_tables():
    tables = summary_tables(_results())
    assert len(tables) == 2
    _, head, rows = tables[0]
    assert head == ["shape", "fa2 TFLOP/s", "fa1 TFLOP/s", "torch-flash TFLOP/s", "torch-cudnn TFLOP/s",
                    "fa2 / flash", "fa1 / flash"]                       # ours first, though the peers ran first
    assert [r[0] for r in rows] == [S1.id, S2.id]
    assert rows[0][1] == f"{tflops(S1.flops, 1.6):.1f}" and rows[0][5] == "1.25" and rows[0][6] == "0.25"
    assert rows[1][2] == "" and rows[1][4] == "" and rows[1][6] == ""       # absent cases: empty cells
    title, head, rows = tables[1]
    assert "fa2" in title
    assert head == ["shape", "fa2 TFLOP/s", "fa2 TFLOP/s do_bench", "fa2 / flash", "fa2 / flash do_bench",
                    "fa2 / cudnn", "fa2 / cudnn do_bench"]
    assert rows[0][3:] == ["1.25", "1.20", "0.62", "0.60"]
    assert rows[1][2] == "" and rows[1][3] == "1.20" and rows[1][4:] == ["", "", ""]


def test_summary_without_peers_or_results():
    assert summary_tables([]) == []
    tables = summary_tables([Timed(S1, "fa1", 1.0)])
    assert len(tables) == 1 and tables[0][1] == ["shape", "fa1 TFLOP/s"]


def test_user_view_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)          # import triton -> ImportError
    monkeypatch.delitem(sys.modules, "triton.testing", raising=False)
    ms, why = user_view_ms(lambda: None)
    assert ms is None and "triton" in why


def test_user_view_calls_do_bench_median(monkeypatch):
    seen = {}

    def do_bench(fn, **kw):
        seen.update(kw, out=fn())
        return 1.5

    triton = types.ModuleType("triton")
    triton.testing = types.SimpleNamespace(do_bench=do_bench)
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.testing", triton.testing)
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    monkeypatch.setattr(user_view, "on_cupy_stream", lambda torch, ptr=None: contextlib.nullcontext())
    assert user_view_ms(lambda a, b: a + b, (2, 3)) == (1.5, "")
    assert seen == {"warmup": 25, "rep": 100, "return_mode": "median", "out": 5}

    def broken(fn, **kw):
        raise RuntimeError("no device")
    triton.testing.do_bench = broken
    monkeypatch.setattr(user_view, "_DO_BENCH_FAILURES", [])
    for _ in range(user_view.MAX_DO_BENCH_FAILURES):
        ms, why = user_view_ms(lambda: None)
        assert ms is None and "RuntimeError: no device" in why
    ms, why = user_view_ms(lambda: None)              # then it stops trying
    assert ms is None and "not tried" in why
    triton.testing.do_bench = do_bench
    user_view._DO_BENCH_FAILURES.clear()
    assert user_view_ms(lambda: 1)[0] == 1.5


# ------------------------------------------------------------------------------------------------ plot
def _bench_doc(points):
    """A pytest-benchmark JSON document with one benchmark per (shape, variant, tflops, tflops_do_bench)."""
    benches = []
    for shape, variant, tf, tf_db in points:
        benches.append({"group": None, "name": f"test_forward[{shape.id}-{variant}]",
                        "params": {"shape": shape.id, "variant": variant},
                        "stats": {"median": 0.001},
                        "extra_info": {"variant": variant, "shape": shape.id, "tflops": tf, "tflops_do_bench": tf_db}})
    benches.append({"name": "test_other", "params": None, "stats": {}, "extra_info": {}})   # not ours: skipped
    return {"machine_info": {}, "commit_info": {}, "benchmarks": benches, "datetime": "", "version": "5.1.0"}


def _shape(n, d, causal, dtype="bfloat16"):
    return Shape(16384 // n, 2048 // d, n, d, dtype, causal)


def test_plot_reads_pytest_benchmark_json(tmp_path):
    first = tmp_path / "a.json"
    first.write_text(json.dumps(_bench_doc([
        (_shape(2048, 128, False), "fa2", 300.0, 290.0), (_shape(1024, 128, False), "fa2", 280.0, None),
        (_shape(1024, 128, False), "torch-flash", 270.0, 260.0), (_shape(1024, 64, True), "fa1", 70.0, None),
        (_shape(1024, 64, False, "float16"), "fa2", 250.0, None)])))
    second = tmp_path / "b.json"
    second.write_text(json.dumps(_bench_doc([(_shape(2048, 128, False), "fa2", 310.0, None)])))
    groups = plot.load([first, second])
    assert groups[("bfloat16", 128, False)]["fa2"] == [(1024, 280.0), (2048, 310.0)]   # sorted by N; b.json wins
    assert groups[("bfloat16", 128, False)]["torch-flash"] == [(1024, 270.0)]
    assert groups[("bfloat16", 64, True)] == {"fa1": [(1024, 70.0)]}
    db = plot.load([first], timer="do_bench")
    assert db[("bfloat16", 128, False)] == {"fa2": [(2048, 290.0)], "torch-flash": [(1024, 260.0)]}
    bf = plot.select(groups, "bf16")
    assert set(bf) == {("bfloat16", 128, False), ("bfloat16", 64, True)}
    assert set(plot.select(groups, "all")) == set(groups)
    assert plot.layout(groups) == ([("bfloat16", False), ("bfloat16", True), ("float16", False)], [64, 128])


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_bench_doc([(_shape(n, d, c), v, 100.0 + n / 100, None)
                                           for n in (1024, 2048, 4096) for d in (64, 128) for c in (False, True)
                                           for v in ("fa2", "torch-flash")])))
    out = tmp_path / "t.png"
    plot.main([str(path), "-o", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------------ launch cost
def test_launch_cost_table():
    assert launch_cost.per_call_us(0.03, 2000) == pytest.approx(15.0)
    rows = [launch_cost.Row("fa2", "cupy", [12.0, 11.0, 13.0], kernels=1.0),
            launch_cost.Row("fa2", "torch", [30.0, 26.0, 28.0], kernels=1.0, memops=1.0),
            launch_cost.Row("naive", "cupy", [40.0]),
            launch_cost.Row("fa2_fp8_prequant", "cupy", note="skipped: needs compute capability >= 8.9"),
            launch_cost.Row("fa1", "torch", note="error: RuntimeError: boom"),
            launch_cost.Row("torch-sdpa-flash", "torch", [20.0])]
    headers, body = launch_cost.table(rows)
    assert headers[:6] == ["variant", "inputs", "us/call", "min..max", "target us", "meets"]
    assert body[0][2:7] == ["12.0", "11.0..13.0", "15", "yes", "1"]
    assert body[1][2:7] == ["28.0", "26.0..30.0", "25", "no", "1 (+1 mem)"]
    assert body[2][4:6] == ["", ""]                                   # naive: no target
    assert body[3][2] == "" and body[3][5] == "" and body[3][7].startswith("skipped")
    assert body[4][7] == "error: RuntimeError: boom"
    assert body[5][4] == ""                                           # torch SDPA: no target
    doc = json.loads(json.dumps(launch_cost.report(rows, {"shape": launch_cost.SHAPE.id})))
    assert doc["shape"] == "fp16-d64-N16-B1-H2-full"
    assert doc["rows"][0]["median_us"] == 12.0 and doc["rows"][0]["meets"] == "yes"
    assert doc["rows"][3]["median_us"] is None and doc["rows"][3]["target_us"] == 15.0


def test_launch_cost_cases_without_torch():
    """Every registry variant and the pre-quantized row, with both input types, and the two SDPA rows; without
    torch the torch rows say why instead of running."""
    from fa_variants import registry
    cases = list(launch_cost.cases(None, "torch is not importable"))
    names = [(n, i) for n, i, _, _ in cases]
    ours = [v.name for v in registry.variants()] + ["fa2_fp8_prequant"]
    assert names == [(n, "cupy") for n in ours] + [(n, "torch") for n in ours] + [
        ("torch-sdpa", "torch"), ("torch-sdpa-flash", "torch")]
    assert all(why for n, i, why, _ in cases if i == "torch")


def test_launch_cost_backward_cases_and_rows():
    """--backward: the variants with a backward, both input types, and the two SDPA rows; no targets."""
    from fa_variants import registry
    cases = list(launch_cost.cases(None, "torch is not importable", backward=True))
    ours = [v.name for v in registry.variants() if "backward" in v.directions]
    assert [(n, i) for n, i, _, _ in cases] == [(n, "cupy") for n in ours] + [(n, "torch") for n in ours] + [
        ("torch-sdpa", "torch"), ("torch-sdpa-flash", "torch")]
    rows = [launch_cost.Row("fa2", "cupy", [40.0], direction="backward")]
    assert launch_cost.table(rows)[1][0][4:6] == ["", ""]
    assert launch_cost.report(rows, {})["rows"][0]["target_us"] is None


def test_launch_cost_profile_names_its_row(monkeypatch):
    """--profile VARIANT:INPUTS profiles that row's calls; a row that did not run, or no such row, says so."""
    monkeypatch.setattr(launch_cost, "_sync", lambda: None)
    measured = [(launch_cost.Row("fa2", "cupy", [1.0]), lambda: (lambda: sum(range(10)), contextlib.nullcontext())),
                (launch_cost.Row("fa1", "torch", note="skipped: no torch"), None)]
    text = launch_cost.profile_row(measured, "fa2:cupy", 20)
    assert text.startswith("--profile fa2:cupy, 20 calls:") and "tottime" in text
    assert "did not run" in launch_cost.profile_row(measured, "fa1:torch", 20)
    assert "no such row" in launch_cost.profile_row(measured, "fa3:torch", 20)


def test_launch_cost_measure_keeps_going(monkeypatch):
    """A case whose build or call raises becomes an error row; the others are timed (host-only stand-ins)."""
    monkeypatch.setattr(launch_cost, "_sync", lambda: None)
    monkeypatch.setattr(launch_cost, "WARMUP_CALLS", 2)

    def boom():
        raise RuntimeError("no kernel")

    cases = [("fa2", "cupy", "", lambda: (lambda: None, contextlib.nullcontext())),
             ("fa1", "cupy", "", boom),
             ("naive", "torch", "", lambda: (boom, contextlib.nullcontext())),
             ("fa2_fp8", "cupy", "needs sm_89", boom)]
    rows = [r for r, _ in launch_cost.measure(cases, calls=10, repeats=3)]
    assert len(rows[0].us) == 3 and all(u >= 0 for u in rows[0].us) and rows[0].note == ""
    assert rows[1].note == "error: RuntimeError: no kernel" and rows[2].note.startswith("error: RuntimeError")
    assert rows[3].note == "skipped: needs sm_89" and rows[3].us == []


def test_headdims_measure_rows(monkeypatch):
    """Every (variant, mask, d) gets a row; the template is timed at the padded problem's B, H, N."""
    timed = []

    def fake_time(fn, shape, repeats, convert=None):
        timed.append(shape)
        return 1.0 + shape.head_dim / 1000

    monkeypatch.setattr(headdims, "_time", fake_time)
    monkeypatch.setattr(headdims.timing, "torch_status", lambda: (None, "no torch here"))
    monkeypatch.setattr(headdims, "templates_of", lambda v: headdims.TEMPLATE_DIMS)
    rows = headdims.measure(["fa1", "fa2"], repeats=1)
    assert len(rows) == 2 * 2 * len(headdims.PADDED_DIMS)
    r = next(r for r in rows if r["variant"] == "fa2" and r["head_dim"] == 80 and not r["causal"])
    assert r["pads_to"] == 96 and r["padded_over_template"] == pytest.approx(1.08 / 1.096)
    assert Shape(4, 26, 4096, 96, "bfloat16", False) in timed        # d = 96 at d = 80's H = 26
    assert sum(1 for s in timed if s.head_dim == 160) == 4            # a template itself: timed once per row


# ------------------------------------------------------------------------------------------------ backward
recompute = _script("recompute")
B1 = Shape(4, 16, 4096, 128, "bfloat16", False)
B2 = Shape(1, 16, 16384, 128, "bfloat16", True)


def test_backward_flops_are_2_5x_the_forward():
    assert backward_flops(4, 16, 4096, 4096, 128, False) == 2.5 * 4 * 4 * 16 * 4096 ** 2 * 128
    assert backward_flops(1, 16, 16384, 16384, 128, True) == 2.5 * 4 * 16 * 16384 ** 2 * 128 / 2
    assert direction_flops(B1, "fwd") == B1.flops
    assert direction_flops(B1, "bwd") == 2.5 * B1.flops
    assert direction_flops(B2, "fwdbwd") == 3.5 * B2.flops
    assert Timed(B2, "fa2", 1.0, None, "bwd").flops == 2.5 * B2.flops
    assert Timed(B2, "fa2", 1.0).flops == B2.flops                        # the forward stays the default
    with pytest.raises(ValueError, match="direction"):
        direction_flops(B1, "sideways")


def test_parse_directions():
    assert parse_directions(None) == ("fwd", "bwd", "fwdbwd")
    assert parse_directions("  ") == ("fwd", "bwd", "fwdbwd")
    assert parse_directions("bwd") == ("bwd",)
    assert parse_directions("fwdbwd, fwd") == ("fwd", "fwdbwd")      # DIRECTIONS order, whatever given
    assert parse_directions("fwd+bwd,BWD") == ("bwd", "fwdbwd")
    with pytest.raises(ValueError, match="unknown direction 'back'.*fwd,bwd,fwdbwd"):
        parse_directions("fwd,back")
    with pytest.raises(ValueError, match="names no direction"):
        parse_directions(",")


def test_bench_groups_keep_a_shapes_directions_together():
    assert bench_group(B1.id) == f"shape={B1.id}"                    # the forward's name: no suffix
    assert bench_group(B1.id, "bwd") == f"shape={B1.id} bwd"
    assert bench_group(B1.id, "fwdbwd") == f"shape={B1.id} fwd+bwd"
    ids = [Shape(16384 // n, 16, n, 128, "bfloat16", c).id for n in (1024, 2048) for c in (False, True)]
    names = sorted(bench_group(i, d) for i in ids for d in DIRECTIONS)
    for i in ids:                                                            # each shape's three are adjacent
        at = names.index(f"shape={i}")
        assert names[at:at + 3] == [f"shape={i}", f"shape={i} bwd", f"shape={i} fwd+bwd"]


def _bwd_results():
    return _results() + [
        Timed(S1, "torch-flash", 5.0, 6.0, "bwd"), Timed(S1, "torch-cudnn", 2.5, 3.0, "bwd"),
        Timed(S1, "fa2", 4.0, 4.0, "bwd"), Timed(S1, "fa2_bwd_kernel", 3.2, None, "bwd"),
        Timed(S2, "torch-flash", 8.0, None, "bwd"), Timed(S2, "torch-cudnn", 4.0, None, "bwd"),
        Timed(S1, "torch-flash", 7.0, None, "fwdbwd"), Timed(S1, "fa2", 7.0, None, "fwdbwd")]


def test_peer_ratios_stay_within_a_direction():
    res = _bwd_results()
    fa2_bwd = next(r for r in res if r.variant == "fa2" and r.direction == "bwd")
    r = peer_ratios(res, fa2_bwd)
    assert r["over_torch_flash"] == pytest.approx(5.0 / 4.0)                 # torch's backward, not its forward
    assert r["over_torch_flash_do_bench"] == pytest.approx(6.0 / 4.0)
    assert r["over_torch_cudnn"] == pytest.approx(2.5 / 4.0)
    fb = next(r for r in res if r.variant == "fa2" and r.direction == "fwdbwd")
    assert peer_ratios(res, fb)["over_torch_flash"] == pytest.approx(1.0)
    assert peer_ratios(res, fb)["over_torch_cudnn"] is None          # no cuDNN fwd+bwd measured
    assert peer_ratios(res, res[2])["over_torch_flash"] == pytest.approx(2.0 / 1.6)   # forward unchanged


def test_summary_tables_with_the_backward():
    tables = summary_tables(_bwd_results())
    titles = [t for t, _, _ in tables]
    assert titles[:2] == [t for t, _, _ in summary_tables(_results())]   # the forward's first, unchanged
    assert tables[:2] == summary_tables(_results())
    assert titles[2].startswith("backward TFLOP/s") and "2.5 x" in titles[2]
    assert titles[3].startswith("fa2 backward against torch SDPA's backward")
    assert titles[4].startswith("fa2_bwd_kernel backward")
    assert titles[5].startswith("forward+backward TFLOP/s") and "3.5 x" in titles[5]
    assert titles[6].startswith("fa2 forward+backward against")
    assert len(tables) == 7
    _, head, rows = tables[2]
    assert head == ["shape", "fa2 bwd TFLOP/s", "fa2_bwd_kernel bwd TFLOP/s", "torch-flash bwd TFLOP/s",
                    "torch-cudnn bwd TFLOP/s", "fa2 bwd / flash bwd", "fa2_bwd_kernel bwd / flash bwd"]
    assert [r[0] for r in rows] == [S1.id, S2.id]
    assert rows[0][1] == f"{tflops(2.5 * S1.flops, 4.0):.1f}"        # TFLOP/s with 2.5x the FLOPs
    assert rows[0][3] == f"{tflops(2.5 * S1.flops, 5.0):.1f}"
    assert rows[0][5:] == ["1.25", "1.56"]
    assert rows[1][1:3] == ["", ""] and rows[1][3] == f"{tflops(2.5 * S2.flops, 8.0):.1f}"
    _, head, rows = tables[3]
    assert head == ["shape", "fa2 bwd TFLOP/s", "fa2 bwd TFLOP/s do_bench", "fa2 bwd / flash bwd",
                    "fa2 bwd / flash bwd do_bench", "fa2 bwd / cudnn bwd", "fa2 bwd / cudnn bwd do_bench"]
    assert rows == [[S1.id, f"{tflops(2.5 * S1.flops, 4.0):.1f}", f"{tflops(2.5 * S1.flops, 4.0):.1f}",
                     "1.25", "1.50", "0.62", "0.75"]]                      # S2: fa2 did not run, no row
    _, head, rows = tables[5]
    assert rows[0][1] == f"{tflops(3.5 * S1.flops, 7.0):.1f}"


def test_summary_backward_with_only_the_peers():
    """While our backward is skipped, the backward table still shows torch's two backwards; no fa2 table."""
    only = [Timed(S1, "torch-flash", 5.0, None, "bwd"), Timed(S1, "torch-cudnn", 2.5, None, "bwd")]
    tables = summary_tables(only)
    assert len(tables) == 1 and tables[0][0].startswith("backward")
    assert tables[0][1] == ["shape", "torch-flash bwd TFLOP/s", "torch-cudnn bwd TFLOP/s"]


def test_skip_lines_count_shapes_per_reason():
    why = "fa2: variant 'fa2' cannot run on the GPU here: needs compute capability >= 8.0, this GPU is 7.5"
    skipped = [Skipped(S1, "fa2", "bwd", why), Skipped(S2, "fa2", "bwd", why),
               Skipped(S1, "fa2", "fwdbwd", why), Skipped(S1, "fa2_bwd_kernel", "bwd", "opt-in")]
    assert skip_lines(skipped) == [f"bwd fa2: skipped on 2 shapes: {why}",
                                   f"fwd+bwd fa2: skipped on 1 shape: {why}",
                                   "bwd fa2_bwd_kernel: skipped on 1 shape: opt-in"]
    assert skip_lines([]) == []


def test_torch_backward_helpers_on_the_cpu(monkeypatch):
    """torch_sdpa_grad_sets / torch_grad_fn / torch_sdpa_fwdbwd_fn on CPU tensors (torch's CPU flash kernel): the
    forward runs once, the timed call is autograd.grad alone (repeatable: retain_graph), gradients match autograd
    through an unfused float64 attention, and the leaves share the input arrays' memory."""
    torch = pytest.importorskip("torch")
    import numpy as np
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=0))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(torch_peers, "on_cupy_stream", lambda torch, ptr=None: contextlib.nullcontext())
    shape = Shape(2, 3, 40, 16, "bfloat16", True)
    scale = 0.3
    sets = [random_inputs(shape, np, seed) for seed in (0, 1)]
    douts = [random_dout(shape, np, 10_000 + i) for i in range(2)]
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting_sdpa(*a, **kw):
        calls.append(kw)
        return real_sdpa(*a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
    grad_sets = torch_sdpa_grad_sets(torch, "torch-flash", shape, scale, sets, douts)
    assert len(calls) == 2 and calls[0] == dict(is_causal=True, scale=scale)    # one forward per set, here
    grad = torch_grad_fn(torch)
    first = grad(*grad_sets[0])
    again = grad(*grad_sets[0])                                                  # the graph was retained
    assert len(calls) == 2                                                        # the timed call runs no forward
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    out, q, k, v, dout = grad_sets[0]
    assert q.is_leaf and q.requires_grad and q.shape == (2, 3, 40, 16)
    assert q.data_ptr() == sets[0][0].ctypes.data                                 # zero-copy views

    def ref_grads(i):
        q, k, v = (torch.from_numpy(a.astype(np.float64)).transpose(1, 2).requires_grad_(True) for a in sets[i])
        s = (q @ k.transpose(-1, -2)) * scale
        s = s.masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), float("-inf"))
        o = torch.softmax(s, -1) @ v
        return torch.autograd.grad(o, (q, k, v), torch.from_numpy(douts[i].astype(np.float64)).transpose(1, 2))

    for got, want in zip(first, ref_grads(0)):
        err = (got.double() - want).norm() / want.norm()
        assert err < 2e-2, err
    fb = torch_sdpa_fwdbwd_fn(torch, "torch-flash", shape, scale)
    leaves = torch_leaf_sets(torch, sets, douts)
    both = fb(*leaves[1])
    assert len(calls) == 3                                                        # fwd+bwd: its own forward
    for got, want in zip(both, ref_grads(1)):
        assert (got.double() - want).norm() / want.norm() < 2e-2


# ------------------------------------------------------------------------------------------------ recompute
@pytest.fixture
def h200_choice(monkeypatch):
    """No GPU here: fa2's FLOPs follow the H200's choice of scheme (the fused dQ where its grid fits)."""
    from fa_variants import gpu
    monkeypatch.setattr(gpu, "probe", lambda device_id=None: gpu.Probe(None, "no CUDA device"))


def test_recompute_flops_and_memory_model(h200_choice):
    s = Shape(1, 16, 4096, 128, "bfloat16", False)
    by = {i.name: i for i in recompute.IMPLS}
    fwd = 4 * 16 * 4096 ** 2 * 128
    assert recompute.flops_of(by["naive"], s) == 2 * fwd          # P stored: 4 products
    assert recompute.flops_of(by["torch-math"], s) == 2 * fwd
    assert recompute.flops_of(by["fa2"], s) == 2.5 * fwd          # the fused dQ (sm_90, d 128): 5 products
    assert recompute.flops_of(by["fa2_bwd_kernel"], s) == 3.5 * fwd   # mma.sync: the separate dQ pass, 7
    assert recompute.flops_of(by["torch-flash"], s) == 2.5 * fwd  # FA2 with atomic dQ: 5 products
    long = Shape(1, 16, 32768, 128, "bfloat16", False)            # 256 K/V blocks: more than 132 SMs hold at once
    assert recompute.fa2_dq_mode(long) == "separate" and recompute.flops_of(by["fa2"], long) == 3.5 * 64 * fwd
    assert recompute.flops_of(by["fa3"], s) == 2.5 * fwd          # FA3's backward: 5 products
    assert recompute.flops_of(by["fa3"], long) == 3.5 * 64 * fwd  # ... fa2's three passes past 128 keys per SM
    assert recompute.fa2_dq_mode(Shape(1, 16, 4096, 256, "bfloat16", False)) == "separate"  # no fused dQ at d 256
    c = Shape(1, 16, 4096, 128, "bfloat16", True)
    assert recompute.flops_of(by["naive"], c) == 2 * fwd          # the standard backward does not skip masked scores
    assert 1.25 * fwd < recompute.flops_of(by["fa2"], c) < 1.3 * fwd   # about half, plus the diagonal blocks
    assert 1.75 * fwd < recompute.flops_of(by["fa2_bwd_kernel"], c) < 1.8 * fwd
    m = recompute.MEMORY_SHAPE
    assert recompute.p_bytes(m) == 4 * 16 * 131072 ** 2 == 2**40            # 1 TiB
    assert recompute.delta_bytes(m) == 4 * 16 * 131072 == 8 * 2**20         # 8 MiB
    assert recompute.fused_dq_bytes(m) == 0                                 # 1024 K/V blocks: the three passes
    # the fused dQ's fp32 sum (64-query blocks at d 128) and its two counters per Q block
    assert recompute.fused_dq_bytes(Shape(1, 16, 16384, 128, "bfloat16", False)) == 4 * 16 * 256 * (64 * 128 + 2)


def test_recompute_rows_and_table(h200_choice):
    s = Shape(1, 16, 2048, 128, "bfloat16", False)
    fa2 = next(i for i in recompute.IMPLS if i.name == "fa2")
    r = recompute.row_values(fa2, s, ms=2.0, held=4096, bwd_peak=3 * 2**20)
    assert r["tflops_convention"] == pytest.approx(2.5 * s.flops / 2e-3 / 1e12)
    assert r["tflops_actual"] == pytest.approx(2.5 * s.flops / 2e-3 / 1e12)   # the fused dQ: 5 products
    skipped = recompute.row_values(fa2, s, status="skipped: no CUDA device")
    headers, body = recompute.table([r, skipped])
    assert headers[0] == "impl" and len(body) == 2 and all(len(b) == len(headers) for b in body)
    assert body[0][5] == "2.000" and body[0][9] == "3.0" and body[0][-1] == "measured"
    assert body[1][5] == "" and body[1][-1].startswith("skipped")
    json.dumps([r, skipped])


def test_recompute_without_a_gpu_reports_every_row_skipped(monkeypatch, tmp_path, capsys):
    from fa_variants import gpu
    monkeypatch.setattr(gpu, "probe", lambda device_id=None: gpu.Probe(None, "no CUDA device"))
    path = tmp_path / "r.json"
    assert recompute.main(["--json", str(path), "--seqlens", "2048,4096"]) == 0
    out = capsys.readouterr().out
    assert "1,024 GiB" in out and "not measured: no CUDA GPU (no CUDA device)" in out
    doc = json.loads(path.read_text())
    assert len(doc["rows"]) == 2 * len(recompute.IMPLS)
    assert all(r["ms"] is None and r["status"] == "not run: no CUDA GPU (no CUDA device)" for r in doc["rows"])
    assert doc["memory_check"]["p_fp32_bytes"] == 2**40 and doc["config"]["seqlens"] == [2048, 4096]


# ------------------------------------------------------------------------------------------------ bench collection
def _collect(env_directions):
    import os
    import subprocess
    env = dict(os.environ, PYTHONPATH=str(BENCH.parent))
    if env_directions is None:
        env.pop("FAV_BENCH_DIRECTIONS", None)
    else:
        env["FAV_BENCH_DIRECTIONS"] = env_directions
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:cacheprovider", str(BENCH)],
                          capture_output=True, text=True, env=env, cwd=BENCH.parent, timeout=300)


def test_bench_directions_switch_deselects_the_others():
    every = _collect(None)
    assert every.returncode == 0, every.stdout + every.stderr
    names = [ln for ln in every.stdout.splitlines() if "::test_" in ln]
    fwd = [n for n in names if "::test_forward[" in n]
    bwd = [n for n in names if "::test_backward[" in n and "-bwd-" in n]
    fb = [n for n in names if "::test_backward[" in n and "-fwdbwd-" in n]
    assert fwd and bwd and fb and len(names) == len(fwd) + len(bwd) + len(fb)
    assert len(bwd) == len(fb)
    for want in ("-bwd-torch-flash]", "-bwd-torch-cudnn]", "-bwd-fa2]", "-bwd-fa1]", "-bwd-naive]",
                 "-bwd-fa2_bwd_kernel]"):
        assert any(n.endswith(want) for n in bwd), want
    assert any("bf16-d256-N16384-B1-H8-causal-bwd-fa2]" in n for n in bwd)   # d = 256 too
    only = _collect("bwd")
    assert only.returncode == 0
    got = [ln for ln in only.stdout.splitlines() if "::test_" in ln]
    assert got == bwd and f"({len(fwd) + len(fb)} deselected)" in only.stdout
    bad = _collect("fwd,sideways")
    assert bad.returncode != 0 and "unknown direction 'sideways'" in bad.stdout + bad.stderr


def test_flex_peer_is_bottom_right_causal_with_gqa():
    """FlexAttention as a peer computes what our kernels do: causal aligned bottom-right (seqlen_q != seqlen_k,
    both ways) and GQA; checked on the CPU against float64 (torch.compile of flex_attention runs there too)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.nn.attention.flex_attention")
    from fa_variants.reference.dense import attention64
    rng = np.random.default_rng(7)
    for nq, nk, causal in ((37, 53, True), (53, 37, True), (40, 40, False)):
        shape = Shape(batch=1, heads=4, seqlen_q=nq, head_dim=32, dtype="float32", causal=causal,
                             heads_kv=2, seqlen_k=nk)
        q, k, v = (rng.standard_normal((1, n, h, 32)).astype(np.float32) for n, h in ((nq, 4), (nk, 2), (nk, 2)))
        fn = torch_flex_fn(torch, shape, 0.2, device="cpu")
        bhnd = [torch.from_numpy(a).transpose(1, 2).contiguous() for a in (q, k, v)]
        out = fn(*bhnd).transpose(1, 2).numpy().astype(np.float64)
        ref, _ = attention64(q, k, v, causal=causal, scale=0.2)          # (B * H, N_q, d)
        ref = ref.reshape(1, 4, nq, 32).transpose(0, 2, 1, 3)
        visible = (np.arange(nq) + nk - nq >= 0) if causal else np.ones(nq, bool)
        err = np.linalg.norm(out[:, visible] - ref[:, visible]) / np.linalg.norm(ref[:, visible])
        assert err < 1e-5, (nq, nk, causal, err)


def test_rest_seconds_reads_its_variable_and_refuses_nonsense(monkeypatch):
    monkeypatch.delenv("FAV_TIMING_REST_S", raising=False)
    assert rest_seconds() == 0.0
    monkeypatch.setenv("FAV_TIMING_REST_S", "0.5")
    assert rest_seconds() == 0.5
    assert rest_seconds(" ") == 0.0
    for bad in ("-1", "abc", "nan", "100"):
        with pytest.raises(ValueError, match="FAV_TIMING_REST_S"):
            rest_seconds(bad)
