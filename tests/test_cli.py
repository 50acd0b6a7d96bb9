"""The ``fa-variants`` command line and the README, on the CPU (no GPU needed; a GPU is hidden where present)."""
from __future__ import annotations

import dataclasses
import io
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import fa_variants
from conftest import TOL
from fa_variants import cli, gpu, registry
from fa_variants.cli import reference as cli_reference
from fa_variants.cli import shapes as cli_shapes
from fa_variants.cli.blocks import Blocks
from fa_variants.timing.inputs import MAX_SETS, random_dout, random_inputs, rotation_count
from fa_variants.timing.shapes import Shape, attention_flops, tflops
from fa_variants.timing import torch_peers
from fa_variants.timing.torch_peers import torch_status

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_gpu(monkeypatch):
    """Make the library's one GPU probe say "no GPU" (compare takes its NumPy path) even on a machine with one."""
    monkeypatch.setattr(gpu, "probe", lambda device_id=None: gpu.Probe(None, "no CUDA device"))


def run_cli(argv, capsys):
    """(exit status, stdout, stderr) of ``fa-variants argv`` in-process, as a shell would see them."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        out, err = capsys.readouterr()
        if isinstance(e.code, str):
            return 1, out, err + e.code + "\n"
        return (e.code or 0), out, err
    out, err = capsys.readouterr()
    return rc, out, err


def test_compare_without_gpu_runs_the_numpy_models(no_gpu, capsys):
    rc = cli.main(["compare"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    # one default shape with and without a GPU; without one, a CPU-sized version of it runs, and says so
    assert lines[0].startswith("no CUDA GPU: running the NumPy models at a CPU-sized shape (B=1, H=2, N=1024, "
                               "d=128) instead of B=4, H=16, N=4096, d=128"), lines[0]
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


def test_build_fills_the_cache_a_first_call_loads_from(monkeypatch, tmp_path, capsys):
    """What `build` compiled, the runtime's lookup (jit.cached_cubin, as kernel() makes it) finds without NVRTC."""
    from fa_variants import jit
    from fa_variants.kernels import naive
    monkeypatch.setenv("FA_VARIANTS_CACHE", str(tmp_path))
    assert cli.main(["build", "--arch", "90a", "--variants", "naive", "--jobs", "2"]) == 0, capsys.readouterr().out
    assert list(tmp_path.glob("*.cubin")), "build wrote no cubin into FA_VARIANTS_CACHE"

    def no_compile(*a, **k):
        raise AssertionError("a built instance was compiled again")
    monkeypatch.setattr(jit, "_compile_code", no_compile)
    for source, exprs in naive.LAUNCHER.compile_units("sm_90a").items():
        for expr in exprs:
            path, lowered = jit.cached_cubin(source, (expr,), "sm_90a")
            assert path.exists() and expr in lowered


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
    assert attention_flops(2, 3, 5, 7, 11, causal=False) == 4 * 2 * 3 * 5 * 7 * 11
    assert attention_flops(2, 3, 5, 7, 11, causal=True) == 2 * 2 * 3 * 5 * 7 * 11
    assert tflops(1e12, 1000.0) == pytest.approx(1.0)


def test_shape_ids_round_trip():
    for s in (Shape(4, 16, 4096, 128, "bfloat16", True),
              Shape(2, 8, 100, 64, "float16", False, heads_kv=2, seqlen_k=300)):
        assert Shape.parse(s.id) == Shape.parse(Shape.parse(s.id).id)
        p = Shape.parse(s.id)
        assert (p.batch, p.heads, p.hkv, p.seqlen_q, p.nk, p.head_dim, p.dtype, p.causal) == \
               (s.batch, s.heads, s.hkv, s.seqlen_q, s.nk, s.head_dim, s.dtype, s.causal)


def test_rotation_spans_several_l2():
    l2 = 60_000_000
    n = rotation_count(10_000_000, l2)
    assert n * 10_000_000 >= 3 * l2 or n == MAX_SETS
    assert rotation_count(500_000_000, l2) == 2
    assert rotation_count(500_000_000, l2, free_bytes=1_000_000_000) == 1


def test_readme_names_every_variant_and_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    for entry in registry.variants():
        assert f"`{entry.name}`" in readme, f"README.md does not mention variant `{entry.name}`"
    for command in ('pip install -e ".[cuda12,test]"\n', "fa-variants compare\n", "\npytest\n"):
        assert command in readme, f"README.md lacks the set-up command {command.strip()!r} on a line of its own"


def test_compare_fp8_without_gpu_runs_the_fp8_models(no_gpu, capsys):
    rc = cli.main(["compare", "--dtype", "fp8"])
    table = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("|")]
    names = {ln.split("|")[1].strip() for ln in table}
    assert {"fa2", "fa3", "fa2_fp8", "fa3_fp8"} <= names and "naive" not in names, names
    assert rc == 0


# ------------------------------------------------------------------------------------------------ 1: build archs
def test_build_arch_90_builds_the_sm90a_instances(capsys):
    rc, out, err = run_cli(["build", "--arch", "90", "--variants", "naive", "--jobs", "1"], capsys)
    assert rc == 0, out + err
    assert "sm_90a" in err and "means sm_90a" in err           # said on stderr
    rows = [ln for ln in out.splitlines() if ln.startswith("| naive")]
    assert rows and all("| sm_90a" in ln for ln in rows), out


@pytest.mark.parametrize("argv, why", [
    (["build", "--arch", "100", "--variants", "naive"], "sm_100 selects no kernel"),
    (["build", "--arch", "80", "--variants", "fa2_fp8"], "sm_80 selects no kernel of fa2_fp8"),
    (["build", "--arch", "86,120", "--variants", "naive"], "sm_120 selects no kernel"),
])
def test_build_arch_that_selects_nothing_fails(argv, why, capsys):
    rc, out, err = run_cli(argv, capsys)
    assert rc != 0 and why in err, err
    assert "built for" in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------ 3: one-line errors
@pytest.mark.parametrize("argv, says", [
    (["explain", "fa2", "--sram", "0"], "--sram: must be >= 1, got 0"),
    (["explain", "fa2", "--seqlen", "0"], "--seqlen: must be >= 1, got 0"),
    (["explain", "fa2", "--head-dim", "0"], "--head-dim: must be >= 1, got 0"),
    (["explain", "fa2", "--head-dim", "300"], "fa2 takes head_dim 1..256, got 300"),
    (["explain", "fa2_fp8", "--head-dim", "40"], "fa2_fp8 takes head_dim 16..256 in steps of 16, got 40"),
    (["explain", "fa2", "--blocks", "1x1"], "too many for the NumPy model"),
    (["explain", "fa2", "--blocks", "0x64"], "block sizes must be >= 1"),
    (["explain", "fa2", "--blocks", "64x32", "--paper-blocks"], "not allowed with argument"),
    (["compare", "--batch", "0"], "--batch: must be >= 1, got 0"),
    (["compare", "--repeats", "0"], "--repeats: must be >= 1, got 0"),
])
def test_bad_arguments_give_one_line_and_nonzero_exit(argv, says, capsys):
    rc, out, err = run_cli(argv, capsys)
    assert rc != 0
    assert says in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_build_without_the_cuda_extra_says_how_to_install(monkeypatch, capsys):
    # without the cuda extra `from cupy_backends.cuda.libs import nvrtc` raises ModuleNotFoundError: a None in
    # sys.modules, for the package and every submodule already imported, makes each such import do so
    for name in [n for n in sys.modules if n.split(".")[0] in ("cupy", "cupy_backends")] + ["cupy", "cupy_backends"]:
        monkeypatch.setitem(sys.modules, name, None)
    rc, out, err = run_cli(["build", "--arch", "90a", "--variants", "naive", "--jobs", "1"], capsys)
    assert rc != 0
    assert "NVRTC is not available" in err and "fa-variants[cuda12]" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_broken_pipe_exits_quietly():
    """`fa-variants explain fa2 | head -3`: the reader is gone before the report is written."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-m", "fa_variants.cli", "explain", "fa2", "--seqlen", "256"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    p.stdout.close()                  # the reader leaves at once: every write of the report gets EPIPE
    err = p.stderr.read().decode()
    rc = p.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
    assert rc == 141, (rc, err)


def test_head_of_explain_shows_the_blocks():
    cmd = f"{shlex.quote(sys.executable)} -m fa_variants.cli explain fa2 | head -3"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 3, r
    assert "Traceback" not in r.stderr, r.stderr
    from fa_variants.kernels import fa2
    bq, bk = fa2.tiles(64)
    assert f"blocks {bq}x{bk}" in r.stdout.splitlines()[1]


def test_fp8_study_gpu_without_a_gpu_is_one_line(no_gpu):
    from fa_variants import fp8_study
    with pytest.raises(SystemExit) as ei:
        fp8_study.main(["--gpu", "--n", "64"])
    assert isinstance(ei.value.code, str) and "--gpu needs a CUDA GPU" in ei.value.code


# ------------------------------------------------------------------------------------------------ 2, 5: shapes
README_COMPARE = ["compare", "--causal", "--dtype", "float16", "--seqlen", "8192", "--batch", "2", "--heads-kv", "4",
                  "--variants", "fa1,fa2"]


def test_readme_gqa_compare_runs_without_gpu_at_a_cpu_sized_shape(no_gpu, capsys):
    t0 = time.perf_counter()
    rc, out, err = run_cli(README_COMPARE, capsys)
    assert rc == 0, out + err
    assert time.perf_counter() - t0 < 60
    first = out.splitlines()[0]
    assert first.startswith("no CUDA GPU: running the NumPy models at a CPU-sized shape (B=1, H=4, N=1024, "
                            "d=128, H_kv=1) instead of B=2, H=16, N=8192, d=128, H_kv=4"), first
    assert "--full-size" in first
    names = [ln.split("|")[1].strip() for ln in out.splitlines() if ln.startswith("| fa")]
    assert names == ["fa1", "fa2"]


def test_default_heads_follow_heads_kv():
    args = cli.make_parser().parse_args(["compare", "--heads-kv", "32"])
    assert cli_shapes.shape_from_args(args).heads == 32
    args = cli.make_parser().parse_args(["compare", "--heads-kv", "3"])
    assert cli_shapes.shape_from_args(args).heads == 18
    args = cli.make_parser().parse_args(["compare"])
    s = cli_shapes.shape_from_args(args)
    assert (s.batch, s.heads, s.hkv, s.seqlen_q, s.head_dim) == (4, 16, 16, 4096, 128)


def test_cpu_sized_keeps_what_matters_and_fits():
    big = Shape(2, 16, 8192, 128, "float16", True, heads_kv=4, seqlen_k=16384)
    s = cli_shapes.cpu_sized(big)
    assert (s.head_dim, s.dtype, s.causal) == (128, "float16", True)
    assert s.heads % s.hkv == 0 and s.heads // s.hkv > 1          # GQA stays GQA
    assert s.nk == 2 * s.seqlen_q                                 # the N_k / N_q ratio is kept
    assert cli_shapes.fits_cpu(s) and s.batch == 1
    small = Shape(2, 4, 33, 32, "float16", True, heads_kv=2, seqlen_k=70)
    assert cli_shapes.cpu_sized(small) == small


def test_full_size_runs_the_requested_shape(no_gpu, capsys):
    argv = ["compare", "--variants", "fa2", "--batch", "3", "--heads", "2", "--seqlen", "1024", "--head-dim", "128"]
    rc, out, _ = run_cli(argv, capsys)
    assert rc == 0 and "CPU-sized shape" in out.splitlines()[0]
    rc, out, _ = run_cli(argv + ["--full-size"], capsys)
    assert rc == 0 and out.splitlines()[0].startswith(
        "no CUDA GPU: running the NumPy models at the requested size (B=3, H=2, N=1024, d=128)")


@pytest.mark.parametrize("argv, says", [
    (["--head-dim", "40", "--variants", "fa2_fp8"], "accepts head_dim in 16..256 in steps of 16, got 40"),
    (["--head-dim", "300"], "no variant takes this shape"),
    (["--head-dim", "300", "--variants", "fa2"], "accepts head_dim in 1..256, got 300"),
    (["--heads", "3", "--heads-kv", "2"], "--heads (3) must be a multiple of --heads-kv (2)"),
    (["--heads", "2", "--heads-kv", "4"], "--heads (2) must be a multiple of --heads-kv (4)"),
    (["--seqlen-k", "0"], "--seqlen-k: must be >= 1"),
    (["--dtype", "float32"], "invalid choice"),
])
def test_compare_refuses_what_attention_refuses(no_gpu, argv, says, capsys):
    rc, out, err = run_cli(["compare", *argv], capsys)
    assert rc != 0 and says in err, err
    assert len(err.strip().splitlines()) == 1 and not out.strip(), (out, err)


def test_compare_default_list_leaves_out_a_variant_that_refuses(no_gpu, capsys):
    rc, out, err = run_cli(["compare", "--head-dim", "40", "--seqlen", "64", "--batch", "1", "--heads", "1"], capsys)
    assert rc == 0, out + err
    names = [ln.split("|")[1].strip() for ln in out.splitlines() if ln.startswith("|")][2:]
    assert "fa2_fp8" not in names and "fa2" in names
    assert "fa2_fp8 not run: variant 'fa2_fp8' accepts head_dim in 16..256 in steps of 16, got 40" in out


@pytest.mark.parametrize("d", [1, 8, 40, 48, 64, 256, 257])
@pytest.mark.parametrize("heads, heads_kv", [(2, 2), (4, 2), (3, 2)])
def test_refusal_is_exactly_attention_s(d, heads, heads_kv):
    """compare refuses a shape for a variant exactly when fav.attention does."""
    rng = np.random.default_rng(0)
    shape = Shape(1, heads, 5, d, "float16", False, heads_kv=heads_kv, seqlen_k=7)
    q = rng.standard_normal((1, 5, heads, d)).astype(np.float16)
    k = rng.standard_normal((1, 7, heads_kv, d)).astype(np.float16)
    for entry in registry.variants():
        try:
            fa_variants.attention(q, k, k, variant=entry.name, backend="numpy")
            refused_by_attention = ""
        except (TypeError, ValueError) as e:
            refused_by_attention = str(e)
        assert cli_shapes.refusal(entry, shape) == refused_by_attention, entry.name


# ------------------------------------------------------------------------------------------------ 4: blocks
def test_blocks_choice_default_is_the_kernels_tiles():
    b = Blocks()
    for entry in registry.variants():
        blocks, source = b.pick(entry, 128)
        assert blocks == tuple(entry.launcher.tiles(128)), entry.name
        assert source == ("untiled" if blocks == (None, None) else "kernel")
    fa2 = registry.get("fa2")
    assert Blocks("paper", 32768).pick(fa2, 64) == ((64, 128), "paper")
    assert Blocks("given", given=(64, 32)).pick(fa2, 64) == ((64, 32), "given")
    assert Blocks("given", given=(64, 32)).pick(registry.get("naive"), 64) == ((None, None), "untiled")


def _explain_total(out: str) -> int:
    total = [ln for ln in out.splitlines() if ln.strip().startswith("total")][0]
    return int(re.findall(r"[\d,]+", total)[0].replace(",", ""))


@pytest.mark.parametrize("flags", [[], ["--paper-blocks"], ["--paper-blocks", "--sram", "8192"], ["--blocks", "64x32"]])
def test_compare_and_explain_use_one_block_choice(no_gpu, flags, capsys):
    n, d = 256, 64
    rc, out, _ = run_cli(["explain", "fa1", "--seqlen", str(n), "--head-dim", str(d), *flags], capsys)
    assert rc == 0
    per_head = _explain_total(out)
    expected = Blocks.from_args(cli.make_parser().parse_args(["explain", "fa1", *flags])).pick(registry.get("fa1"), d)[0]
    assert f"B_r={expected[0]}, B_c={expected[1]}" in out.splitlines()[0]
    assert out.splitlines()[1].startswith(f"(blocks {expected[0]}x{expected[1]}: ")
    rc, out, _ = run_cli(["compare", "--variants", "fa1", "--batch", "1", "--heads", "1", "--seqlen", str(n),
                          "--head-dim", str(d), *flags], capsys)
    assert rc == 0
    row = [ln for ln in out.splitlines() if ln.startswith("| fa1")][0].split("|")
    assert row[2].strip().startswith(f"{expected[0]}x{expected[1]}")
    assert float(row[6]) == pytest.approx(per_head / 1e6, abs=1e-3)
    note = [ln for ln in out.splitlines() if "] blocks: " in ln][0]
    assert ("--blocks" if "--blocks" in flags else "--paper-blocks" if flags else "each kernel's tiles") in note


def test_explain_says_where_its_blocks_come_from(capsys):
    rc, out, _ = run_cli(["explain", "fa2", "--seqlen", "512", "--head-dim", "128"], capsys)
    assert rc == 0
    from fa_variants.kernels import fa2
    bq, bk = fa2.tiles(128)
    assert f"B_r={bq}, B_c={bk}" in out.splitlines()[0]
    assert "fa2's kernel tiles at d=128" in out.splitlines()[1]
    rc, out, _ = run_cli(["explain", "fa2", "--seqlen", "512", "--head-dim", "128", "--paper-blocks"], capsys)
    assert "B_r=64, B_c=64" in out.splitlines()[0] and "the paper's blocks for M=32768" in out.splitlines()[1]
    rc, out, _ = run_cli(["explain", "naive", "--seqlen", "128"], capsys)
    assert rc == 0 and "no tiling" in out.splitlines()[1]



def _total_row(out):
    total = [ln for ln in out.splitlines() if ln.strip().startswith("total")]
    assert total, out
    return [int(n.replace(",", "")) for n in re.findall(r"[\d,]+", total[0])]


@pytest.mark.parametrize("name", ["fa1", "fa2"])
def test_explain_backward_prints_loops_table_and_trade(name, capsys):
    from fa_variants.reference import fa1, fa2
    rc, out, err = run_cli(["explain", name, "--backward", "--seqlen", "256", "--head-dim", "64"], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"{name} backward: N=256, d=64") and "B_r=64, B_c=128" in lines[0]
    assert "paper's blocks" in lines[1] and f"{name}'s GPU backward kernels pick their own tiles" in lines[1]
    assert {"fa1": fa1, "fa2": fa2}[name].LOOPS_BACKWARD in out
    formula, counted = _total_row(out)[:2]
    assert formula == counted == registry.get(name).io_model_backward(256, 256, 64, 64, 128)["total"]
    assert "recompute trade" in out and "standard backward 8N^2d" in out
    assert ("2.5x the forward" if name == "fa1" else "3.5x the forward") in out
    if name == "fa2":
        assert 'dq_mode="atomic"' in out
    rc, fwd, _ = run_cli(["explain", name, "--seqlen", "256", "--head-dim", "64"], capsys)
    assert rc == 0 and "backward" not in fwd   # the flag changes only what it asks for


def test_explain_backward_naive_and_given_blocks(capsys):
    rc, out, _ = run_cli(["explain", "naive", "--backward", "--seqlen", "128", "--head-dim", "32"], capsys)
    assert rc == 0 and "no tiling: naive materializes P, dP and dS" in out.splitlines()[1]
    assert _total_row(out)[:2] == [7 * 128 * 128 + 10 * 128 * 32] * 2
    rc, out, _ = run_cli(["explain", "fa1", "--backward", "--seqlen", "100", "--blocks", "16x24"], capsys)
    assert rc == 0 and "B_r=16, B_c=24" in out.splitlines()[0] and "given by --blocks" in out.splitlines()[1]
    formula, counted = _total_row(out)[:2]
    assert formula == counted == registry.get("fa1").io_model_backward(100, 100, 64, 16, 24)["total"]


def test_explain_backward_without_a_model_is_one_line(capsys):
    rc, out, err = run_cli(["explain", "fa2_fp8", "--backward"], capsys)
    assert rc != 0 and "fa2_fp8 has no backward model (--backward: naive, fa1, fa2, fa3)" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


# ------------------------------------------------------------------------------------------------ 6: packaging
def test_version(capsys):
    rc, out, _ = run_cli(["--version"], capsys)
    assert rc == 0 and out.strip() == f"fa-variants {fa_variants.__version__}"


def test_license_and_py_typed_are_shipped():
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    assert "Copyright (c) 2026 the fa-variants authors" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "fa_variants" / "py.typed").is_file()
    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in data["tool"]["setuptools"]["package-data"]["fa_variants"]


# ------------------------------------------------------------------------------------------------ 8: profile
NCU_SAMPLE = """\
==PROF== Connected to process 41233 (/usr/bin/python3.12)
==PROF== Profiling "gemmSN_NN_kernel" - 0: 0%....50%....100% - 1 pass
==PROF== Profiling "row_softmax" - 1: 0%....50%....100% - 1 pass
==PROF== Profiling "gemmSN_NN_kernel" - 2: 0%....50%....100% - 1 pass
==PROF== Disconnected from process 41233
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","41233","python3.12","127.0.0.1","void gemmSN_NN_kernel<float, 256, 4, 2, 8, 4, 4, false>(cublasGemmSmallNParams<float const, float const, float>)","1","7","(256, 1, 1)","(16, 64, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Mbyte","2.10"
"0","41233","python3.12","127.0.0.1","void gemmSN_NN_kernel<float, 256, 4, 2, 8, 4, 4, false>(cublasGemmSmallNParams<float const, float const, float>)","1","7","(256, 1, 1)","(16, 64, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","Kbyte","512.00"
"0","41233","python3.12","127.0.0.1","void gemmSN_NN_kernel<float, 256, 4, 2, 8, 4, 4, false>(cublasGemmSmallNParams<float const, float const, float>)","1","7","(256, 1, 1)","(16, 64, 1)","0","9.0","Command line profiler metrics","lts__t_bytes.sum","Mbyte","6.29"
"1","41233","python3.12","127.0.0.1","row_softmax","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","1,048,576"
"1","41233","python3.12","127.0.0.1","row_softmax","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","524,288"
"1","41233","python3.12","127.0.0.1","row_softmax","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","Command line profiler metrics","lts__t_bytes.sum","Gbyte","0.01"
"2","41233","python3.12","127.0.0.1","void gemmSN_NN_kernel<float, 256, 4, 2, 8, 4, 4, false>(cublasGemmSmallNParams<float const, float const, float>)","1","7","(256, 1, 1)","(16, 64, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","KB","100"
"2","41233","python3.12","127.0.0.1","void gemmSN_NN_kernel<float, 256, 4, 2, 8, 4, 4, false>(cublasGemmSmallNParams<float const, float const, float>)","1","7","(256, 1, 1)","(16, 64, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","MB","1.5"
"2","41233","python3.12","127.0.0.1","void gemmSN_NN_kernel<float, 256, 4, 2, 8, 4, 4, false>(cublasGemmSmallNParams<float const, float const, float>)","1","7","(256, 1, 1)","(16, 64, 1)","0","9.0","Command line profiler metrics","lts__t_bytes.sum","KiB","4"
"""


def test_ncu_csv_sums_every_kernel_in_bytes():
    from fa_variants import profile
    r = profile.parse_ncu_csv(NCU_SAMPLE)
    assert len(r.kernels) == 3 and r.kernels[1] == "row_softmax"
    assert r.read == pytest.approx(2.10e6 + 1_048_576 + 100e3)
    assert r.write == pytest.approx(512e3 + 524_288 + 1.5e6)
    assert r.l2 == pytest.approx(6.29e6 + 0.01e9 + 4 * 1024)


def test_ncu_csv_raw_page_and_odd_values():
    from fa_variants import profile
    raw = ('"ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum","lts__t_bytes.sum"\n'
           '"","","Mbyte","Kbyte","byte"\n'
           '"0","fa2_fwd<__nv_bfloat16, 128, 128, 64, 4, false>","33.55","262.14","100,000,000"\n'
           '"1","fa2_fwd<__nv_bfloat16, 128, 128, 64, 4, false>","1,5","0","n/a"\n')
    r = profile.parse_ncu_csv(raw)
    assert r.read == pytest.approx(33.55e6 + 1.5e6)             # "1,5": a decimal comma
    assert r.write == pytest.approx(262.14e3)
    assert r.l2 == pytest.approx(1e8)
    assert profile.parse_ncu_csv("==PROF== nothing profiled\n==WARNING== No kernels were profiled.\n").bytes == {}
    with pytest.raises(ValueError, match="unknown ncu unit"):
        profile.to_bytes("1", "furlong")


def test_ncu_command_is_the_documented_one():
    from fa_variants import profile
    cmd = profile.ncu_command("ncu", "/tmp/x.csv")
    text = " ".join(cmd)
    assert "--profile-from-start off" in text and "--clock-control none" in text and "--csv" in text
    assert "--metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum" in text
    shape = Shape(1, 4, 256, 64, "float16", True, heads_kv=2)
    args = profile.shape_args(shape)
    assert args[args.index("--heads-kv") + 1] == "2" and "--causal" in args


def test_profile_without_ncu_says_so(capsys):
    rc, out, err = run_cli(["profile", "--variants", "fa2", "--ncu", "/nonexistent/ncu"], capsys)
    assert rc != 0
    assert "needs Nsight Compute's ncu" in err and len(err.strip().splitlines()) == 1, err
    assert not out.strip()


def test_profile_without_gpu_says_so(no_gpu, monkeypatch, capsys):
    from fa_variants import profile
    monkeypatch.setattr(profile, "find_ncu", lambda ncu="ncu": "/usr/bin/ncu")
    rc, out, err = run_cli(["profile", "--variants", "fa2"], capsys)
    assert rc != 0 and "needs a CUDA GPU (no CUDA device)" in err, err


def test_profile_validates_the_shape_like_compare(capsys):
    rc, _, err = run_cli(["profile", "--variants", "fa2_fp8", "--head-dim", "40"], capsys)
    assert rc != 0 and "accepts head_dim in 16..256" in err


@pytest.mark.gpu
def test_profile_fa2_measures_dram_and_l2(capsys):
    from fa_variants import profile
    if profile.find_ncu() is None:
        pytest.skip("ncu (Nsight Compute) is not on PATH")
    rc, out, err = run_cli(["profile", "--variants", "fa2", "--batch", "1", "--heads", "4", "--seqlen", "2048",
                            "--head-dim", "128", "--no-torch"], capsys)
    assert rc == 0, out + err
    row = [ln for ln in out.splitlines() if ln.startswith("| fa2")][0]
    cells = [c.strip() for c in row.split("|")[1:-1]]
    modeled, read, write, total, l2, ratio = (float(c) for c in cells[1:])
    inputs = 3 * 1 * 4 * 2048 * 128 * 2 / 1e9
    assert read >= 0.5 * inputs, (read, inputs)             # a cold L2: Q, K, V come from DRAM at least once
    assert total == pytest.approx(read + write, abs=2e-4)
    assert l2 >= read and modeled > 0 and ratio > 0
    assert "1 kernel in the call (fa2_fwd" in out


# ------------------------------------------------------------------------------------------------ compare --backward
def _table_rows(out: str) -> dict:
    """{variant: [cells]} of the first markdown table in ``out``."""
    rows = {}
    for ln in out.splitlines():
        if ln.startswith("|") and not ln.startswith("|--"):
            cells = [c.strip() for c in ln.strip("|").split("|")]
            rows.setdefault(cells[0], cells)
    return rows


def test_compare_backward_without_gpu_runs_the_numpy_backward_models(no_gpu, capsys):
    rc, out, err = run_cli(["compare", "--backward"], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("no CUDA GPU: running the NumPy backward models at a CPU-sized shape (B=1, H=2, "
                               "N=1024, d=128) instead of B=4, H=16, N=4096, d=128"), lines[0]
    rows = _table_rows(out)
    assert rows["variant"][:6] == ["variant", "blocks B_r x B_c", "time (CPU, ms)", "err dq", "err dk", "err dv"]
    for name in ("naive", "fa1", "fa2"):
        cells = rows[name]
        errs = [float(c) for c in cells[3:6]]
        assert all(e < 1e-12 for e in errs), (name, errs)           # float64 models vs the float64 backward
        assert cells[6] == cells[7], f"{name}: HBM counted {cells[6]} != formula {cells[7]}"
        assert cells[8] == cells[9], f"{name}: FLOPs counted {cells[8]} != formula {cells[9]}"
    assert [rows[n][10] for n in ("naive", "fa1", "fa2")] == ["2.00", "2.50", "3.50"]   # x the forward's FLOPs
    assert "fa2_fp8" not in rows and "fa2_fp8 not run: it has no backward" in out
    assert "the paper's blocks" in out


def test_compare_backward_gqa_causal_unequal_lengths(no_gpu, capsys):
    rc, out, err = run_cli(["compare", "--backward", "--variants", "fa2,naive", "--batch", "2", "--heads", "4",
                            "--heads-kv", "2", "--seqlen", "33", "--seqlen-k", "70", "--head-dim", "32", "--causal",
                            "--dtype", "float16", "--blocks", "16x8"], capsys)
    assert rc == 0, err
    assert out.splitlines()[0].startswith("no CUDA GPU: running the NumPy backward models at the requested size "
                                          "(B=2, H=4, N=33, d=32, H_kv=2, N_k=70)")
    rows = _table_rows(out)
    assert set(rows) == {"variant", "fa2", "naive"}
    assert rows["fa2"][1] == "16x8 (--blocks)" and rows["naive"][1] == "—"
    assert all(float(c) < 1e-12 for r in ("fa2", "naive") for c in rows[r][3:6])


def test_compare_backward_error_column_sees_a_wrong_gradient(no_gpu, monkeypatch, capsys):
    """The error columns are measured: a model whose dk is 1 % off shows 1e-2 there and nowhere else."""
    fa2 = registry.get("fa2")
    real = fa2.reference_backward

    def off(*a, **kw):
        res = real(*a, **kw)
        return dataclasses.replace(res, dk=res.dk * 1.01)

    monkeypatch.setitem(registry.VARIANTS, "fa2", dataclasses.replace(fa2, reference_backward=off))
    rc, out, err = run_cli(["compare", "--backward", "--variants", "fa2", "--seqlen", "64", "--heads", "2",
                            "--batch", "1", "--head-dim", "16"], capsys)
    assert rc == 0, err
    cells = _table_rows(out)["fa2"]
    assert float(cells[3]) < 1e-12 and float(cells[5]) < 1e-12
    assert float(cells[4]) == pytest.approx(1e-2, rel=1e-3)


@pytest.mark.parametrize("argv,says", [
    (["--variants", "fa2_fp8"], "fa2_fp8 has no backward (--backward: naive, fa1, fa2, fa3)"),
    (["--dtype", "fp8"], "--dtype fp8 has no backward"),
    (["--variants", "fa9"], "unknown variant"),
])
def test_compare_backward_refusals_are_one_line(no_gpu, argv, says, capsys):
    rc, out, err = run_cli(["compare", "--backward"] + argv, capsys)
    assert rc != 0 and says in err and len(err.strip().splitlines()) == 1, err


def test_kv_pairs_and_gradient_errors():
    """The reference's subset is of (batch, kv head) pairs, each with all its query heads; grad_errors is
    ||g - ref|| / ||ref|| over exactly those pairs."""
    from fa_variants.reference.dense import reference_backward
    s = Shape(2, 8, 24, 16, "float16", True, heads_kv=2, seqlen_k=40)
    assert cli_reference.kv_pairs(s, 1e12) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    few = cli_reference.kv_pairs(s, 2.5 * 4 * 24 * 40 * 16 * 4 * 2)     # two pairs' worth (a group of 4 query heads)
    assert len(few) == 2 and few[0] == (0, 0) and few[-1] == (1, 1)
    q, k, v = random_inputs(s, np, seed=3)
    dout = random_dout(s, np, seed=4)
    full = reference_backward(dout, q, k, v, causal=True, scale=0.25)
    refs = cli_reference.reference_grads(dout, q, k, v, causal=True, scale=0.25, kv_pairs=few, group=4)
    assert np.array_equal(refs["dq"][1], full[0][1, :, 4:8]) and np.array_equal(refs["dk"][1], full[1][1, :, 1:2])
    assert cli_reference.grad_errors(full, refs, few, 4) == (0.0, 0.0, 0.0)
    bad = [g.copy() for g in full]
    bad[0][0, :, 4:8] += 1.0                          # outside the subset: not seen
    bad[2][1, :, 1] *= 1.5                            # inside: dv off by 50 % on one of the two pairs
    e = cli_reference.grad_errors(bad, refs, few, 4)
    assert e[0] == 0.0 and e[1] == 0.0
    want = 0.5 * np.linalg.norm(full[2][1, :, 1]) / np.sqrt(sum(np.sum(r * r) for r in refs["dv"]))
    assert e[2] == pytest.approx(want)
    assert "2 of the 4 (batch, kv head) pairs" in cli_reference.kv_subset_note(few, s)
    assert cli_reference.kv_subset_note(cli_reference.kv_pairs(s, 1e12), s) == ""


def test_compare_takes_flex(no_gpu, monkeypatch, capsys):
    """Without a GPU the NumPy models run, and the requested torch-flex row is said not to run (torch present)."""
    monkeypatch.setattr(torch_peers, "flex_status", lambda: "")
    rc, out, _ = run_cli(["compare", "--variants", "fa2", "--seqlen", "64", "--heads", "2", "--flex"], capsys)
    assert rc == 0 and "| fa2" in out
    assert "torch-flex not run: the NumPy models run without torch's peers (no CUDA device)" in out


@pytest.mark.parametrize("backward", [False, True])
def test_flex_without_torch_is_an_error(no_gpu, monkeypatch, backward, capsys):
    """--flex names a torch peer: where torch (or its FlexAttention) is missing the command says so, in one line,
    instead of leaving the row out in silence."""
    monkeypatch.setattr(torch_peers, "flex_status", lambda: "torch is not installed (FlexAttention is ...)")
    argv = ["compare", "--variants", "fa2", "--seqlen", "64", "--flex"] + (["--backward"] if backward else [])
    rc, out, err = run_cli(argv, capsys)
    assert rc != 0 and "--flex needs FlexAttention: torch is not installed" in err, err
    assert len(err.strip().splitlines()) == 1 and not out.strip()
    monkeypatch.setattr(torch_peers, "flex_status", lambda: "")
    rc, out, err = run_cli(argv + ["--no-torch"], capsys)
    assert rc != 0 and "--flex times FlexAttention, a torch peer, and --no-torch" in err, err


def test_flex_status_says_what_is_missing():
    """The real check, on this machine: '' with a torch that has FlexAttention, else why (naming torch)."""
    why = torch_peers.flex_status()
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except Exception:  # noqa: BLE001
        assert why.startswith("torch ") and "FlexAttention" in why, why
    else:
        assert why == ""


@pytest.mark.gpu
@pytest.mark.parametrize("backward", [False, True])
def test_compare_flex_row_on_the_gpu(backward, capsys):
    """compare --flex adds a torch-flex row (FlexAttention under torch.compile) with its ratio column, forward and
    backward, and its error in the same bounds as SDPA's (it computes the same attention)."""
    torch, why = torch_status()
    if torch is None:
        pytest.skip(why)
    argv = ["compare", "--variants", "fa2", "--batch", "1", "--heads", "4", "--seqlen", "512", "--head-dim", "64",
            "--causal", "--flex", "--repeats", "3", "--warmup", "1"] + (["--backward"] if backward else [])
    rc, out, err = run_cli(argv, capsys)
    assert rc == 0, out + err
    row = [ln for ln in out.splitlines() if ln.startswith("| torch-flex")]
    assert row and "error" not in row[0], out
    assert "x torch-flex" in out


# ------------------------------------------------------------------------------------------------ messages
def test_backward_blocks_say_why_from_the_registry(monkeypatch, capsys):
    """explain --backward and compare --backward take the paper's blocks and say why from the registry's directions:
    a GPU backward whose kernels' tiles the launcher does not report, or no GPU backward at all."""
    rc, out, _ = run_cli(["explain", "fa2", "--backward", "--seqlen", "256"], capsys)
    assert rc == 0 and "fa2's GPU backward kernels pick their own tiles, which its launcher does not report" in out
    assert "yet" not in out.splitlines()[1]
    fa2 = registry.get("fa2")
    monkeypatch.setitem(registry.VARIANTS, "fa2", dataclasses.replace(fa2, directions=("forward",)))
    rc, out, _ = run_cli(["explain", "fa2", "--backward", "--seqlen", "256"], capsys)
    assert rc == 0 and "fa2 has no GPU backward kernel, so no kernel tiles" in out.splitlines()[1]


def test_compare_backward_blocks_note_names_the_backward_kernels(no_gpu, capsys):
    rc, out, err = run_cli(["compare", "--backward", "--seqlen", "64", "--heads", "2", "--batch", "1",
                            "--head-dim", "16"], capsys)
    assert rc == 0, err
    note = [ln for ln in out.splitlines() if "] blocks: " in ln][0]
    assert "the GPU backward kernels of fa1, fa2 and fa3 pick their own tiles, which the launchers do not report" in note
    assert "yet" not in note and "naive" not in note         # naive does not tile


ORDINAL_HISTORY = re.compile(r"\bsessions?\b|\b(?:[a-z]+(?:st|nd|rd|th)|\d+(?:st|nd|rd|th)) (?:session|part|round|"
                             r"attempt|call|try)\b|\bearlier attempt", re.I)


@pytest.mark.parametrize("argv", [["explain", v.name] for v in registry.variants()]
                         + [["explain", v.name, "--backward"] for v in registry.variants() if v.reference_backward])
def test_explain_speaks_of_dates_not_of_work_periods(argv, capsys):
    rc, out, _ = run_cli(argv + ["--seqlen", "256"], capsys)
    assert rc == 0
    assert not ORDINAL_HISTORY.search(out), ORDINAL_HISTORY.search(out)


def test_explain_has_a_place_for_other_targets(monkeypatch, capsys):
    """A target that is not a variant (variant="auto"'s choice, when fav.explain_choice comes) is one entry of
    explain.OTHER_TARGETS: the parser takes its name and the command runs it."""
    from fa_variants.cli import explain
    monkeypatch.setitem(explain.OTHER_TARGETS, "auto", lambda args: print(f"auto at N={args.seqlen}") or 0)
    assert cli.main(["explain", "auto", "--seqlen", "77"]) == 0
    assert capsys.readouterr().out == "auto at N=77\n"


def test_profile_module_is_only_the_ncu_child():
    from fa_variants import profile
    with pytest.raises(SystemExit, match="run `fa-variants profile"):
        profile.main(["--variants", "fa2"])


# ------------------------------------------------------------------------------------------------ parallel build
def test_build_jobs_default_to_the_cpu_count():
    from fa_variants.cli import build
    assert cli.make_parser().parse_args(["build"]).jobs == build.cpu_count() >= 1


def test_build_error_in_a_worker_carries_the_nvrtc_log(monkeypatch, capsys):
    """Two units that do not compile, in two worker processes: each row says error, stderr has NVRTC's log."""
    from fa_variants.kernels import KernelLauncher
    from fa_variants.kernels import naive

    def sources():
        return {naive.SOURCE: ("row_softmax<undefined_one>", "row_softmax<undefined_two>")}

    broken = registry.Variant(name="broken", summary="", dtypes=("float16",), head_dims=range(1, 257), min_cc=80,
                              launcher=KernelLauncher(sources, None, lambda d: (None, None), None), reference=None,
                              io_model=None, tensor_bytes={}, loops="", archs=("sm_80",))
    monkeypatch.setitem(registry.VARIANTS, "broken", broken)
    rc, out, err = run_cli(["build", "--variants", "broken", "--jobs", "2"], capsys)
    assert rc != 0
    rows = [ln for ln in out.splitlines() if ln.startswith("| broken")]
    assert len(rows) == 2 and all("error: CompileError: NVRTC failed to compile" in r for r in rows), out
    assert "compiling 2 kernel instances in 2 processes" in err
    assert err.count("detected in the compilation of") == 2, err      # the end of each NVRTC log, once a unit
    assert "undefined_one" in err and "undefined_two" in err


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("live", [False, True])
def test_progress_bar(live):
    from fa_variants.cli.text import ProgressBar
    stream = _Terminal() if live else io.StringIO()
    bar = ProgressBar(4, stream)
    for i in range(4):
        bar.step(f"unit {i}", keep=i == 2)
    bar.close()
    text = stream.getvalue()
    if live:                              # redrawn in place; the kept line stays; a newline at the end
        assert text.count("\r[") == 4 and "[######------------------] 1/4" in text and "] 4/4" in text
        assert "\runit 2" in text and text.endswith("\n") and text.count("\n") == 2
    else:                                 # a log: one line per step
        assert text.splitlines() == ["[1/4] unit 0", "[2/4] unit 1", "[3/4] unit 2", "[4/4] unit 3"]


# ------------------------------------------------------------------------------------------------ imports
def _import_graph() -> dict[str, set[str]]:
    """{module of fa_variants: the fa_variants modules it imports anywhere in its text}."""
    import ast
    pkg_root = ROOT / "fa_variants"

    def name(p):
        parts = p.relative_to(ROOT).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    mods = {name(p): p for p in pkg_root.rglob("*.py")}
    graph = {}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        edges = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m:
                    edges.add(t)
        graph[m] = edges
    return graph


def test_imports_go_one_way():
    """Only the command line imports the command line, and no module of it (or of timing, profile, sass, iomodel)
    is part of an import cycle."""
    graph = _import_graph()
    assert not [m for m, e in graph.items() if not m.startswith("fa_variants.cli")
                and any(t.startswith("fa_variants.cli") for t in e)]

    def reaches(start, goal):
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m == goal:
                return True
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
        return False

    mine = [m for m in graph if m.startswith(("fa_variants.cli", "fa_variants.timing"))
            or m in ("fa_variants.profile", "fa_variants.sass", "fa_variants.iomodel")]
    assert len(mine) > 10
    assert [m for m in mine if reaches(m, m)] == []


@pytest.mark.parametrize("cc, chosen", [(90, "fa3"), (80, "fa2")])
def test_explain_auto_names_the_choice_for_a_device(cc, chosen, capsys):
    """`fa-variants explain auto` prints fav.explain_choice's answer: fa3 forward and backward on sm_90, fa2 on
    sm_80."""
    assert cli.main(["explain", "auto", "--head-dim", "128", "--device-cc", str(cc)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[2] == chosen and lines[1].split()[1] == chosen
