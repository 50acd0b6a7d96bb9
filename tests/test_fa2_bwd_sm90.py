"""fa2's wgmma backward (kernels/fa2_bwd_sm90.py) on the CPU: which backward fa2 runs where, its instances, its
shared memory. (Its compile for sm_90a without spills is test_jit's; its results are test_gpu_backward's.)"""
from __future__ import annotations

import pytest

from fa_variants import gpu, registry
from fa_variants.kernels import common, fa2, fa2_bwd, fa2_bwd_sm90 as k


@pytest.mark.parametrize("cc, env, head_dim, want", [
    (90, None, 64, "wgmma"), (90, None, 128, "wgmma"), (90, None, 256, "wgmma"), (90, None, 40, "wgmma"),
    (90, "mma_sync", 64, "mma_sync"), (80, None, 64, "mma_sync"), (89, None, 128, "mma_sync"),
])
def test_fa2_backward_dispatch(monkeypatch, cc, env, head_dim, want):
    monkeypatch.setattr(gpu, "compute_capability", lambda: cc)
    if env:
        monkeypatch.setenv("FA_VARIANTS_FA2_KERNEL", env)
    else:
        monkeypatch.delenv("FA_VARIANTS_FA2_KERNEL", raising=False)
    called = []
    monkeypatch.setattr(k, "backward", lambda *a, **kw: called.append("wgmma"))
    monkeypatch.setattr(fa2_bwd, "backward", lambda *a, **kw: called.append("mma_sync"))

    class Q:
        shape = (1, 8, 2, head_dim)
    registry.get("fa2").launcher.backward(None, Q(), None, None, None, None, causal=False, softmax_scale=1.0)
    assert called == [want]


def test_supports():
    assert [d for d in range(1, 300) if k.supports(d)] == list(range(8, 257, 8))


def test_compiled_for_sm90a_only():
    units = registry.get("fa2").launcher.compile_units
    assert k.SOURCE == fa2.SM90_BWD_SOURCE
    assert k.SOURCE in units("sm_90a") and all(k.SOURCE not in units(a) for a in ("sm_80", "sm_86", "sm_89"))
    assert set(units("sm_90a")[k.SOURCE]) == set(k.specializations())


def test_tiles_fit_the_h200():
    for d in k.DIMS:
        assert k.dkdv_smem(d, k.DKDV_TILES[d][0]) <= common.SM90_SMEM
        assert k.dq_smem(d, k.DQ_TILES[d][0]) <= common.SM90_SMEM
        # the epilogues stage dK and dV (or dQ) rows of D + 8 elements over the tiles
        bn, split = k.dkdv_config(k.DKDV_TILES[d][0])[:2]
        assert (1 if split else 2) * bn * (d + 8) * 2 <= k.dkdv_smem(d, k.DKDV_TILES[d][0]) - 1024
        assert k.DQ_TILES[d][0][0] * (d + 8) * 2 <= k.dq_smem(d, k.DQ_TILES[d][0]) - 1024
