"""The GPU backwards' launchers on the CPU (no GPU needed): naive's memory refusal as a pure function, the tile
tables of fa2_bwd and fa1_bwd against every arch's shared memory and the kernels' static shapes, and what each
launcher hands to NVRTC. (That every instance compiles without spills for every arch is test_jit's.)"""
from __future__ import annotations

import re

import pytest

from fa_variants import registry
from fa_variants.kernels import common, fa1_bwd, fa2_bwd, naive

SMEM = {"sm_90a": common.SM90_SMEM, "sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024}


# ------------------------------------------------------------------------------------------------ naive
def test_naive_backward_bytes_counts_two_score_matrices():
    b, h, hkv, nq, nk, d = 2, 8, 2, 300, 500, 64
    need = naive.backward_bytes(b, h, hkv, nq, nk, d)
    assert need >= 2 * 4 * b * h * nq * nk                      # P and dP (dS in place), fp32
    assert need - 2 * 4 * b * h * nq * nk == 4 * d * 6 * (b * h * nq + b * hkv * nk)
    assert naive.backward_bytes(b, h, hkv, 2 * nq, nk, d) > need


def test_naive_backward_refuses_131072_on_an_h200():
    why = naive.backward_refusal(1, 16, 16, 131072, 131072, 128, free_bytes=140 * 2**30)
    assert why and "131072" in why and "GiB" in why and "free" in why and "fa2" in why, why
    need = float(re.search(r"needs ([\d.]+) GiB", why).group(1))
    assert need > 2048                                          # 2 x 16 x 131072^2 x 4 bytes = 2 TiB
    assert naive.backward_refusal(1, 16, 16, 4096, 4096, 128, free_bytes=140 * 2**30) == ""


def test_naive_backward_refusal_threshold():
    args = (1, 4, 4, 1000, 1000, 64)
    need = naive.backward_bytes(*args)
    assert naive.backward_refusal(*args, free_bytes=int(need / 0.9) + 1) == ""
    assert naive.backward_refusal(*args, free_bytes=need) != ""


def test_naive_refusal_is_a_memory_error_and_a_value_error():
    assert issubclass(naive.AttentionTooLarge, MemoryError) and issubclass(naive.AttentionTooLarge, ValueError)


# ------------------------------------------------------------------------------------------------ tiles
@pytest.mark.parametrize("arch", list(SMEM))
@pytest.mark.parametrize("d", common.TEMPLATE_DIMS)
def test_fa2_backward_tiles_fit_every_arch(arch, d):
    kv = common.pick_tiles(fa2_bwd.DKDV_TILES, fa2_bwd.dkdv_smem, d, SMEM[arch])
    qc = common.pick_tiles(fa2_bwd.DQ_TILES, fa2_bwd.dq_smem, d, SMEM[arch])
    for bm, bn, w, dc in (kv, qc):
        assert d % dc == 0 and dc % 16 == 0 and bm % 16 == 0 and bn % 16 == 0
    assert kv[1] == 16 * kv[2] and qc[0] == 16 * qc[2]   # a warp owns 16 keys (dK/dV) or 16 query rows (dQ)
    assert kv[3] <= 128                                  # dK + dV of 16 rows: at most 2 x 64 registers a thread


@pytest.mark.parametrize("arch", list(SMEM))
@pytest.mark.parametrize("d", common.TEMPLATE_DIMS)
def test_fa1_backward_tiles_fit_every_arch(arch, d):
    bm, bn, w, dc = fa1_bwd.config(d, SMEM[arch])
    assert fa1_bwd.smem_bytes(d, (bm, bn, w, dc)) <= SMEM[arch]
    assert d % dc == 0 and dc % 16 == 0 and dc <= 128 and bn == 16 * w and bm % 16 == 0
    assert (32 * w) % bm == 0                            # whole rows per thread group in the D_i sums


def test_fa1_backward_takes_every_head_dim_up_to_256():
    for d in range(8, 257, 8):
        assert common.template_dim(d, fa1_bwd.DIMS) >= d
    assert fa2_bwd.DIMS == fa1_bwd.DIMS == common.TEMPLATE_DIMS


# ------------------------------------------------------------------------------------------------ units
@pytest.mark.parametrize("name, source", [("naive", naive.BWD_SOURCE), ("fa1", fa1_bwd.SOURCE),
                                          ("fa2", fa2_bwd.SOURCE)])
def test_backward_sources_are_compile_units_for_every_arch(name, source):
    launcher = registry.get(name).launcher
    assert launcher.backward_fn is not None
    for arch in registry.get(name).archs:
        assert source in launcher.compile_units(arch), (name, arch)


def test_instances_follow_the_tile_tables():
    exprs = fa1_bwd.specializations()
    for d, cfgs in fa1_bwd.TILES.items():
        for bm, bn, w, dc in cfgs:
            assert f"fa1_bwd<fav::Half, {d}, {dc}, {bm}, {bn}, {w}>" in exprs
    assert fa1_bwd.convert_instance("fav::BFloat16") in exprs
    exprs = fa2_bwd.specializations()
    assert fa2_bwd.delta_instance("fav::Half") in exprs
    for d in fa2_bwd.DIMS:
        for cfg in fa2_bwd.DKDV_TILES[d]:
            assert fa2_bwd.dkdv_instance("fav::Half", d, cfg) in exprs
        for cfg in fa2_bwd.DQ_TILES[d]:
            assert fa2_bwd.dq_instance("fav::BFloat16", d, cfg) in exprs
