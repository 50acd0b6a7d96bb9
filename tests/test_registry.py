"""The registry: the single source of truth the tests, benchmarks and CLI iterate over (CPU)."""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import fa_variants as fav
from fa_variants import jit, registry
from fa_variants.kernels import Launcher
from conftest import has_gpu

ENTRIES = registry.variants()
IDS = [v.name for v in ENTRIES]


def test_lists_the_core_variants():
    names = [v.name for v in ENTRIES]
    assert {"naive", "fa1", "fa2"} <= set(names), names
    assert len(names) == len(set(names)), f"duplicate names: {names}"


def test_public_reexports_are_the_registry():
    assert [v.name for v in fav.variants()] == [v.name for v in ENTRIES]
    for v in ENTRIES:
        assert fav.get(v.name) is v


@pytest.mark.parametrize("v", ENTRIES, ids=IDS)
def test_get_returns_the_entry(v):
    got = registry.get(v.name)
    assert got.name == v.name and got is registry.VARIANTS[v.name]


@pytest.mark.parametrize("bad", ["nope", "FA2", "", None, 2])
def test_get_unknown_lists_valid_names(bad):
    with pytest.raises(ValueError, match="variant") as exc:
        registry.get(bad)
    for v in ENTRIES:
        assert repr(v.name) in str(exc.value) or v.name in str(exc.value), f"{v.name} missing from: {exc.value}"


def _numpy_dtype(name):
    return np.dtype(getattr(ml_dtypes, name, name))


@pytest.mark.parametrize("v", ENTRIES, ids=IDS)
def test_entry_fields(v):
    assert isinstance(v.summary, str) and len(v.summary.strip()) > 10, v.summary
    assert isinstance(v.dtypes, tuple) and v.dtypes, v.dtypes
    for dt in v.dtypes:
        assert _numpy_dtype(dt).name == dt, f"{dt!r} is not a dtype name NumPy/ml_dtypes knows"
    assert isinstance(v.head_dims, range) and v.head_dims and v.head_dims.start >= 1 and v.head_dims[-1] == 256
    assert set(v.directions) <= set(registry.DIRECTIONS) and "forward" in v.directions
    assert all(isinstance(n, int) and n in (1, 2, 4) for n in v.tensor_bytes.values()), v.tensor_bytes
    assert isinstance(v.loops, str) and ("for" in v.loops or v.name == "naive")
    assert isinstance(v.min_cc, int) and v.min_cc >= 80, v.min_cc
    assert callable(v.reference), v.reference
    assert callable(v.io_model), v.io_model
    assert isinstance(v.launcher, Launcher), f"{v.name}: launcher {v.launcher!r} lacks the Launcher interface"
    assert v.launcher.compile_units(), f"{v.name}: a launcher must compile at least one kernel"
    assert v.archs, "an entry must name the archs `fa-variants build` compiles"
    for arch in v.archs:
        assert jit.normalize_arch(arch) == arch
        cc = int(re.fullmatch(r"sm_(\d+)[af]?", arch).group(1))
        assert cc >= v.min_cc, f"{v.name} lists {arch} below its min_cc {v.min_cc}"


@pytest.mark.parametrize("v", ENTRIES, ids=IDS)
def test_supports_agrees_with_fields(v):
    dt = v.dtypes[0]
    assert v.supports(dt, v.head_dims[0]) and v.supports(dt, 256)
    assert not v.supports("float32", v.head_dims[0])
    assert not v.supports(dt, 0) and not v.supports(dt, 257) and not v.supports(dt, 512)
    assert v.head_dims_text in repr(v)


def test_variants_print_readably():
    text = repr(fav.variants())
    for v in ENTRIES:
        assert v.name in text and v.head_dims_text in text
    assert "0x" not in text and "function" not in text, "no function addresses in the listing"
    assert ("runs here" in text) or ("not here" in text)


def test_registry_does_not_import_api():
    """api imports the registry; the registry (and the launchers it imports) never import api: no cycle."""
    import ast
    import inspect
    for mod in (registry, *[inspect.getmodule(v.launcher.forward_fn) for v in ENTRIES]):
        tree = ast.parse(inspect.getsource(mod))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | \
                   {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m == "api" or m.endswith(".api") for m in imported), f"{mod.__name__} imports api"


def test_one_gpu_probe():
    from fa_variants import gpu
    p = gpu.probe()
    assert p.ok == (p.cc is not None) and (p.ok or p.reason)
    assert gpu.available() == p.ok


@pytest.mark.skipif(has_gpu(), reason="a CUDA GPU is present")
@pytest.mark.parametrize("v", ENTRIES, ids=IDS)
def test_unavailable_without_gpu(v):
    ok, why = v.available()
    assert ok is False
    assert isinstance(why, str) and why.strip(), "available() must say why not"


@pytest.mark.gpu
@pytest.mark.parametrize("v", ENTRIES, ids=IDS)
def test_available_on_gpu_matches_compute_capability(v):
    import cupy
    cc = int(cupy.cuda.Device().compute_capability)
    ok, why = v.available()
    assert ok == (cc >= v.min_cc), (cc, v.min_cc, why)
    assert ok or why


def test_fa2_kernel_choice_and_its_tiles(monkeypatch):
    """sm_90 (and no GPU: the H200 is what the IO model describes) runs fa2's wgmma kernel with SM90_TILES at
    head dims padded to 64/128/256; kernel="mma_sync" and other GPUs run the mma.sync kernel."""
    from fa_variants import gpu
    from fa_variants.kernels import fa2 as k
    monkeypatch.setattr(gpu, "compute_capability", lambda: 90)
    assert k.uses_wgmma()
    assert [k.kernel_dim(d) for d in (1, 64, 65, 96, 128, 129, 160, 256)] == [64, 64, 128, 128, 128, 256, 256, 256]
    assert all(k.tiles(d) == tuple(k.SM90_TILES[k.kernel_dim(d)][0][:2]) for d in (40, 80, 200))
    assert k.kernel_dim(96, "mma_sync") == 96 and k.config(96, kernel="mma_sync")[:2] == tuple(k.TILES[96][0][:2])
    monkeypatch.setattr(gpu, "compute_capability", lambda: 80)
    assert not k.uses_wgmma() and k.kernel_dim(160) == 160
