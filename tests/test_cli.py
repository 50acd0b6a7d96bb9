"""The ``fa-variants`` command line and the README, on the CPU (no GPU needed; a GPU is hidden where present)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import TOL
from fa_variants import cli, registry, timing

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_gpu(monkeypatch):
    """Make ``compare`` take its no-GPU path even on a machine with a GPU."""
    monkeypatch.setattr(cli, "_gpu_reason", lambda: "no CUDA device")


def test_compare_without_gpu_runs_the_numpy_models(no_gpu, capsys):
    rc = cli.main(["compare"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("no CUDA GPU: running the NumPy models at a small size (B=1, H=2, N=256, d=64)")
    table = [ln for ln in lines if ln.startswith("|")]
    for entry in registry.variants():
        row = [ln for ln in table if ln.split("|")[1].strip() == entry.name]
        assert row, f"no row for {entry.name} in\n{out}"
        assert "error" not in row[0], row[0]
        err = float(row[0].split("|")[4])
        if entry.operand_dtype is None:  # models of 16-bit-operand kernels are exact in float64
            assert err < 1e-12, f"{entry.name}: float64 model differs from the float64 reference by {err}"
        else:                            # fa2_fp8's model rounds its operands to e4m3: it must show
            assert 1e-4 < err < TOL[entry.operand_dtype], f"{entry.name}: model error {err} vs float64"
    assert "time (CPU, ms)" in out
    assert rc == 0


def test_compare_without_gpu_honours_shape_and_subset(no_gpu, capsys):
    rc = cli.main(["compare", "--variants", "fa2", "--batch", "2", "--heads", "4", "--heads-kv", "2",
                   "--seqlen", "33", "--seqlen-k", "70", "--head-dim", "32", "--causal", "--dtype", "float16"])
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("no CUDA GPU: running the NumPy models at the requested size "
                                          "(B=2, H=4, N=33, d=32, H_kv=2, N_k=70)")
    table = [ln.split("|")[1].strip() for ln in out.splitlines() if ln.startswith("|")]
    assert "fa2" in table and "fa1" not in table and "naive" not in table
    assert rc == 0


def test_compare_rejects_unknown_variant(no_gpu):
    with pytest.raises(SystemExit, match="unknown variant"):
        cli.main(["compare", "--variants", "fa9"])


def test_explain_fa2_prints_formula_and_counts(capsys):
    assert cli.main(["explain", "fa2", "--seqlen", "256", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    assert "fa2" in out and "N=256" in out and "d=64" in out
    assert "formula" in out and "counted" in out
    total = [ln for ln in out.splitlines() if ln.strip().startswith("total")]
    assert total, out
    numbers = re.findall(r"[\d,]+", total[0])
    assert len(numbers) >= 2 and numbers[0] == numbers[1] and int(numbers[0].replace(",", "")) > 0


def test_build_naive_for_sm90a(capsys):
    rc = cli.main(["build", "--arch", "90a", "--variants", "naive", "--jobs", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "registers" in out and "sm_90a" in out
    row = [ln for ln in out.splitlines() if "row_softmax" in ln]
    assert row and int(row[0].split("|")[4]) > 0


def test_build_reports_a_launcher_that_does_not_import(monkeypatch, capsys):
    from fa_variants.kernels import KernelLauncher

    def no_sources():
        raise ModuleNotFoundError("no module named 'does_not_exist'")

    broken = registry.Variant(name="broken", summary="", dtypes=("float16",), head_dims=range(1, 257), min_cc=80,
                              launcher=KernelLauncher(no_sources, None, None, None), reference=None,
                              io_model=None, tensor_bytes={}, loops="")
    monkeypatch.setitem(registry.VARIANTS, "broken", broken)
    rc = cli.main(["build", "--arch", "90a", "--variants", "broken"])
    out = capsys.readouterr().out
    assert rc != 0
    assert "broken" in out and "error" in out


def test_build_rejects_bad_arch():
    with pytest.raises(SystemExit, match="arch"):
        cli.main(["build", "--arch", "75"])


def test_flops_convention():
    assert timing.attention_flops(2, 3, 5, 7, 11, causal=False) == 4 * 2 * 3 * 5 * 7 * 11
    assert timing.attention_flops(2, 3, 5, 7, 11, causal=True) == 2 * 2 * 3 * 5 * 7 * 11
    assert timing.tflops(1e12, 1000.0) == pytest.approx(1.0)


def test_shape_ids_round_trip():
    for s in (timing.Shape(4, 16, 4096, 128, "bfloat16", True),
              timing.Shape(2, 8, 100, 64, "float16", False, heads_kv=2, seqlen_k=300)):
        assert timing.Shape.parse(s.id) == timing.Shape.parse(timing.Shape.parse(s.id).id)
        p = timing.Shape.parse(s.id)
        assert (p.batch, p.heads, p.hkv, p.seqlen_q, p.nk, p.head_dim, p.dtype, p.causal) == \
               (s.batch, s.heads, s.hkv, s.seqlen_q, s.nk, s.head_dim, s.dtype, s.causal)


def test_rotation_spans_several_l2():
    l2 = 60_000_000
    n = timing.rotation_count(10_000_000, l2)
    assert n * 10_000_000 >= 3 * l2 or n == timing.MAX_SETS
    assert timing.rotation_count(500_000_000, l2) == 2
    assert timing.rotation_count(500_000_000, l2, free_bytes=1_000_000_000) == 1


def test_readme_names_every_variant_and_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    for entry in registry.variants():
        assert f"`{entry.name}`" in readme, f"README.md does not mention variant `{entry.name}`"
    assert 'pip install -e ".[cuda12,test]" && fa-variants compare' in readme
    assert 'pip install -e ".[cuda12,test]" && pytest' in readme


def test_compare_fp8_without_gpu_runs_both_models(no_gpu, capsys):
    rc = cli.main(["compare", "--dtype", "fp8"])
    table = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("|")]
    names = {ln.split("|")[1].strip() for ln in table}
    assert {"fa2", "fa2_fp8"} <= names and "naive" not in names, names
    assert rc == 0
