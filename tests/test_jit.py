"""The NVRTC layer (CPU: NVRTC needs no GPU): flattening, compiling every registered kernel for every arch it
lists with no spills, the cache key, compile errors and arch names."""
from __future__ import annotations

import re
import shutil

import pytest

from fa_variants import jit, registry

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
# the tests that compile or hash with the NVRTC version need CuPy (the cuda extra), not a GPU
needs_nvrtc = pytest.mark.skipif(not jit.nvrtc_available(), reason="NVRTC comes with the cuda12/cuda13 extra")


def _sources():
    return sorted(p.name for p in jit.cuda_src_dir().glob("*.cu"))


@pytest.fixture
def src_copy(tmp_path, monkeypatch):
    """A private copy of cuda_src/ that jit reads instead of the real one."""
    dst = tmp_path / "cuda_src"
    shutil.copytree(jit.cuda_src_dir(), dst)
    monkeypatch.setattr(jit, "cuda_src_dir", lambda: dst)
    return dst


# ----------------------------------------------------------------------------------------------- flatten
@pytest.mark.parametrize("name", _sources())
def test_flatten_inlines_project_headers(name):
    raw = (jit.cuda_src_dir() / name).read_text()
    flat = jit.flatten(name)
    assert '#include "' not in flat
    for inc in INCLUDE.findall(raw):
        header = (jit.cuda_src_dir() / name).parent / inc
        body = [ln for ln in header.read_text().splitlines() if ln.strip() and not INCLUDE.match(ln)]
        longest = max(body, key=len)
        assert longest in flat, f"{inc} was not inlined into {name}"


def test_flatten_nested_and_repeated_includes_once(src_copy):
    (src_copy / "common" / "inner.cuh").write_text("#pragma once\nint inner_marker_7;\n")
    (src_copy / "common" / "outer.cuh").write_text('#include "inner.cuh"\nint outer_marker_3;\n')
    (src_copy / "t.cu").write_text('#include "common/outer.cuh"\n#include "common/inner.cuh"\n'
                                   '# include "common/outer.cuh"\nint main_marker_1;\n')
    flat = jit.flatten("t.cu")
    assert "#include" not in flat and "# include" not in flat
    assert flat.count("inner_marker_7") == 1 and flat.count("outer_marker_3") == 1
    assert flat.index("inner_marker_7") < flat.index("outer_marker_3") < flat.index("main_marker_1")


# ----------------------------------------------------------------------------------------------- compile
def shipped_instances() -> dict:
    """{(source, arch): instances}: what `fa-variants build` compiles, every launcher's units for every arch its
    variant lists, each instance once (pad_head_dim.cu, for one, serves five variants)."""
    units: dict = {}
    for v in registry.variants():
        for arch in v.archs:
            for source, exprs in v.launcher.compile_units(arch).items():
                assert exprs, f"{v.name}: no instances of {source} for {arch}"
                units.setdefault((source, arch), set()).update(exprs)
    for step_units, archs in registry.STEP_KERNELS.values():
        for arch in archs:
            for source, exprs in step_units(arch).items():
                units.setdefault((source, arch), set()).update(exprs)
    return {unit: sorted(exprs) for unit, exprs in sorted(units.items())}


def _instance_params():
    for (source, arch), exprs in shipped_instances().items():
        for expr in exprs:
            yield pytest.param(source, expr, arch, id=f"{arch}-{expr.replace('fav::', '')}")  # no '::' in a node id


# One test item per instance, compiled alone and installed in the kernel cache as `fa-variants build` does: the
# suite compiles everything that build ships (pytest-xdist spreads it over the workers: it is most of the suite's
# time), later tests that read a cubin from the cache (test_sass.py) find it there, and a failure names the instance.
@pytest.mark.parametrize("source, expr, arch", list(_instance_params()))
def test_every_shipped_instance_compiles_without_spills(source, expr, arch):
    compiled = jit.compile_into_cache(source, (expr,), arch)
    assert compiled.cubin, "empty cubin"
    reports = {r.kernel: r for r in compiled.reports()}
    assert expr in reports, f"no ptxas report for {expr}; log:\n{compiled.log}"
    r = reports[expr]
    assert r.spill_stores == 0 and r.spill_loads == 0, f"{expr} on {arch} spills: {r}"
    assert r.registers > 0, r


def test_a_source_is_compiled_only_for_the_archs_it_names():
    """fa2_fp8's wgmma source is sm_90a-only; its mma.sync source and the quantizers go to every arch it lists.
    Every .cu of cuda_src is some launcher's (or registry.STEP_KERNELS') unit for at least one arch (none is left
    uncompiled)."""
    from fa_variants.kernels import fa2_fp8 as mod
    launcher = registry.get("fa2_fp8").launcher
    assert set(launcher.compile_units("sm_89")) == {mod.SOURCE, mod.QUANT_SOURCE, mod.PAD_SOURCE}
    assert set(launcher.compile_units("sm_90a")) == {mod.SOURCE, mod.QUANT_SOURCE, mod.SM90_SOURCE, mod.PAD_SOURCE}
    from fa_variants.kernels import fa2
    from fa_variants.kernels import fa2_bwd
    assert set(registry.get("fa2").launcher.compile_units("sm_80")) == {fa2.SOURCE, fa2.PAD_SOURCE, fa2_bwd.SOURCE}
    assert fa2.SM90_SOURCE in registry.get("fa2").launcher.compile_units("sm_90a")
    for source, archs in mod.SOURCE_ARCHS.items():
        assert set(archs) <= set(registry.get("fa2_fp8").archs), f"{source}: an arch the entry does not build"
    used = {s for v in registry.variants() for a in v.archs for s in v.launcher.compile_units(a)}
    used |= {s for units, archs in registry.STEP_KERNELS.values() for a in archs for s in units(a)}
    assert used == set(_sources()), f"sources no launcher compiles: {set(_sources()) - used}"


# ----------------------------------------------------------------------------------------------- cache key
def _direct_includes(src_dir, name):
    return sorted(set(INCLUDE.findall((src_dir / name).read_text())))


def _key(name, arch="sm_80", exprs=("x",)):
    return jit.cache_key(jit.flatten(name), arch, (), exprs)


@needs_nvrtc
@pytest.mark.parametrize("name", _sources())
def test_cache_key_follows_header_text(src_copy, name):
    headers = _direct_includes(src_copy, name)
    if not headers:
        pytest.skip(f"{name} includes no project header")
    base = _key(name)
    assert _key(name) == base, "cache key is not deterministic"
    for inc in headers:
        path = src_copy / inc
        original = path.read_text()
        path.write_text(original + "\n// an edit: one more comment line\n")
        assert _key(name) != base, f"editing {inc} did not change the cache key of {name}"
        path.write_text(original)
        assert _key(name) == base, f"restoring {inc} did not restore the cache key of {name}"


@needs_nvrtc
def test_cache_key_follows_arch_options_and_names():
    name = _sources()[0]
    base = _key(name)
    assert _key(name, arch="sm_90a") != base
    assert _key(name, exprs=("y",)) != base
    assert jit.cache_key(jit.flatten(name), "sm_80", ("-lineinfo",), ("x",)) != base


@needs_nvrtc
def test_compile_source_sees_an_edited_header(src_copy):
    """compile_source must not serve a result compiled from older text."""
    body = '#include "common/math.cuh"\nextern "C" __global__ void probe(float* o) { o[0] = fav::neg_inf(); }\n'
    (src_copy / "probe.cu").write_text(body)
    first = jit.compile_source("probe.cu", (), "sm_80")
    math_h = src_copy / "common" / "math.cuh"
    math_h.write_text(math_h.read_text().replace("namespace fav {", "namespace fav {\nint broken_after_edit = ;", 1))
    with pytest.raises(jit.CompileError):
        jit.compile_source("probe.cu", (), "sm_80")
    assert first.cubin


# ----------------------------------------------------------------------------------------------- errors
@needs_nvrtc
def test_broken_source_raises_compile_error_with_nvrtc_log(src_copy):
    (src_copy / "broken.cu").write_text(
        '#include "common/math.cuh"\n'
        "template <int N> __global__ void k(float* o) { o[0] = this_name_is_not_declared_42 * N; }\n")
    with pytest.raises(jit.CompileError) as exc:
        jit.compile_source("broken.cu", ("k<1>",), "sm_80")
    msg = str(exc.value)
    assert "this_name_is_not_declared_42" in msg and "error" in msg.lower(), msg
    assert "broken.cu" in msg and "sm_80" in msg, msg


def test_compile_error_is_exported():
    import fa_variants
    assert fa_variants.CompileError is jit.CompileError
    assert issubclass(jit.CompileError, Exception)


# ----------------------------------------------------------------------------------------------- arch names
@pytest.mark.parametrize("arch, expect", [
    (80, "sm_80"), ("80", "sm_80"), ("90a", "sm_90a"), ("sm_86", "sm_86"), ("SM_89", "sm_89"),
    ("compute_90a", "sm_90a"), (" sm_90a ", "sm_90a"),
])
def test_normalize_arch_accepts(arch, expect):
    assert jit.normalize_arch(arch) == expect


@pytest.mark.parametrize("arch", [75, "75", "sm_70", "foo", "", "sm_", "90x", "sm_80_"])
def test_normalize_arch_rejects(arch):
    with pytest.raises(ValueError, match="arch"):
        jit.normalize_arch(arch)


def test_supported_archs_normalize():
    for a in jit.SUPPORTED_ARCHS:
        assert jit.normalize_arch(a) == a
