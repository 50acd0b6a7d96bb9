"""bench/bwd_sweep.py on the CPU: its candidate tiles are well-formed for the wgmma backward, the table override
restores the launcher's tables, and the default configs keep their kernel names. (Compiling the candidates is
``python3 bench/bwd_sweep.py --list``; timing them needs the H200.)"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from fa_variants.kernels import common, fa2_bwd_sm90 as k

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("bwd_sweep", ROOT / "bench" / "bwd_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_candidates_well_formed(sweep):
    assert set(sweep.CANDIDATES) == set(k.DIMS)
    for d, cands in sweep.CANDIDATES.items():
        assert 0 < len(cands) <= sweep.MAX_CANDIDATES
        labels = [c[0] for c in cands]
        assert len(set(labels)) == len(labels) and sweep.DEFAULT not in labels
        for label, dkdv, dq in cands:
            assert dkdv is not None or dq is not None, label
            kv = k.DKDV_TILES[d][0] if dkdv is None else dkdv
            qc = k.DQ_TILES[d][0] if dq is None else dq
            bn, split, bm, minb, bm_dv, pipe = k.dkdv_config(kv)
            assert pipe in (False, True) and (not pipe or bn <= 128)
            assert 2 <= len(kv) <= 6 and bn in (64, 128, 192) and bm in (32, 64, 128) and bm_dv in (32, 64, 128)
            assert (split != k.SPLIT_NONE) == (d == 256) and (split == k.SPLIT_CTAS or bm_dv == bm) and minb >= 1
            assert split != k.SPLIT_WARPGROUPS or bn == 64
            qbm, qbn, qminb = k.dq_config(qc)
            assert 2 <= len(qc) <= 3 and qbm in (64, 128, 192) and qbn in (32, 64, 128) and qminb >= 1
            # shared memory fits a Hopper CTA, the epilogues' staging (rows of D + 8) fits over the tiles, and the
            # register cap of the launch bounds leaves a thread at least 64 registers
            assert k.dkdv_smem(d, kv) <= common.SM90_SMEM and k.dq_smem(d, qc) <= common.SM90_SMEM
            assert 2 * bn * (d + 8) * 2 <= k.dkdv_smem(d, kv) - 1024
            assert qbm * (d + 8) * 2 <= k.dq_smem(d, qc) - 1024
            assert 65536 // (minb * k.dkdv_threads(kv)) >= 64 and 65536 // (qminb * 2 * qbm) >= 64
            # a candidate is a module of its own, apart from the default's
            assert sweep.modules("fav::BFloat16", d, dkdv, dq) != k.instances("fav::BFloat16", d)
        assert len({sweep.modules("fav::BFloat16", d, kv, q) for _, kv, q in cands}) == len(cands)


def test_default_names_unchanged():
    """The trailing template arguments are left out at their defaults: adding one leaves the names (and cache keys)."""
    assert k.instances("fav::BFloat16", 128) == ("fa2_bwd_dkdv_sm90<fav::BFloat16, 128, 128, false, 64, 1, 64, true>",
                                                 "fa2_bwd_dq_sm90<fav::BFloat16, 128, 192, 64>",
                                                 "fa2_bwd_fused_writer_sm90<fav::BFloat16, 128, 128, 64>",
                                                 "fa2_bwd_dq_convert<fav::BFloat16, 128, 128, 64, true>")
    assert k.instances("fav::Half", 256) == ("fa2_bwd_dkdv_sm90<fav::Half, 256, 64, 2>",
                                             "fa2_bwd_dkdv_sm90<fav::Half, 256, 128, true, 32, 1, 64>",
                                             "fa2_bwd_dq_sm90<fav::Half, 256, 128, 32>")
    assert k.dkdv_instance("T", 128, (128, False)) == "fa2_bwd_dkdv_sm90<T, 128, 128, false>"
    assert k.dq_instance("T", 128, (128, 64)) == "fa2_bwd_dq_sm90<T, 128, 128, 64>"
    assert k.dkdv_instance("T", 64, (128, False, 64)) == "fa2_bwd_dkdv_sm90<T, 64, 128, false>"
    assert k.dq_instance("T", 64, (128, 128, 1)) == "fa2_bwd_dq_sm90<T, 64, 128, 128>"
    assert k.dkdv_instance("T", 256, (64, True, 64, 1, 64)) == "fa2_bwd_dkdv_sm90<T, 256, 64, true>"
    assert k.dkdv_instance("T", 256, (128, True, 32)) == "fa2_bwd_dkdv_sm90<T, 256, 128, true, 32>"
    assert k.dkdv_instance("T", 256, (128, True, 32, 1, 64)) == "fa2_bwd_dkdv_sm90<T, 256, 128, true, 32, 1, 64>"
    assert k.dkdv_instance("T", 64, (64, False, 64, 3)) == "fa2_bwd_dkdv_sm90<T, 64, 64, false, 64, 3>"
    assert k.dq_instance("T", 64, (64, 64, 4)) == "fa2_bwd_dq_sm90<T, 64, 64, 64, 4>"
    assert k.dq_instance("T", 64, (64, 64, 1)) == "fa2_bwd_dq_sm90<T, 64, 64, 64>"
    # PIPE (off by default) is the sixth entry and template argument
    assert k.dkdv_instance("T", 128, (128, False, 64, 1, 64, False)) == "fa2_bwd_dkdv_sm90<T, 128, 128, false>"
    assert k.dkdv_instance("T", 128, (128, False, 64, 1, 64, True)) == \
        "fa2_bwd_dkdv_sm90<T, 128, 128, false, 64, 1, 64, true>"
    assert k.dkdv_config((128, False)) == (128, False, 64, 1, 64, False)
    # the warpgroup split: its own template argument, 256 threads on 64 keys, one CTA per K/V block
    assert k.dkdv_instance("T", 256, (64, k.SPLIT_WARPGROUPS, 64)) == "fa2_bwd_dkdv_sm90<T, 256, 64, 2>"
    assert k.dkdv_threads((64, k.SPLIT_WARPGROUPS)) == 256 and k.dkdv_threads((128, k.SPLIT_CTAS)) == 256
    assert k.dkdv_ctas((64, k.SPLIT_WARPGROUPS), 1000) == 16 and k.dkdv_ctas((128, k.SPLIT_CTAS), 1000) == 16
    assert k.dkdv_ctas((128, k.SPLIT_NONE), 1000) == 8
    # without the split, the smem is K, V, and per stage (two, three with PIPE) Q, dO, LSE and D
    for d in k.DIMS:
        bn, split, bm, _, _, pipe = k.dkdv_config(k.DKDV_TILES[d][0])
        stages = 3 if pipe else 2
        if not split:
            assert k.dkdv_smem(d, k.DKDV_TILES[d][0]) == 1024 + 2 * bn * 2 * d + stages * bm * (2 * 2 * d + 2 * 4)
    # the split's dV CTAs with a BM of their own hold no V: the larger of the two layouts
    # PIPE: three stages of Q, dO, LSE and D
    assert k.dkdv_smem(128, (128, False, 64, 1, 64, True)) == 1024 + 2 * 128 * 256 + 3 * (2 * 64 * 256 + 2 * 64 * 4)
    # the warpgroup split: K, V, two stages of Q and dO, the LSE/D stages padded to 1 KB (DkdvSmem's DS), P^T
    assert k.dkdv_smem(256, (64, 2, 64)) == 1024 + 2 * 64 * 512 + 2 * 2 * 64 * 512 + 1024 + 64 * 64 * 4
    assert k.dkdv_smem(256, (64, 2, 32)) == 1024 + 2 * 64 * 512 + 2 * 2 * 32 * 512 + 1024 + 64 * 32 * 4
    assert k.dkdv_smem(256, (128, True, 32, 1, 64)) == max(1024 + 2 * 128 * 512 + 4 * 32 * 512 + 4 * 32 * 4,
                                                           1024 + 128 * 512 + 4 * 64 * 512 + 4 * 64 * 4)


def test_override_restores_tables(sweep):
    kv0, q0 = dict(k.DKDV_TILES), dict(k.DQ_TILES)
    lists = {d: (k.DKDV_TILES[d], k.DQ_TILES[d]) for d in k.DIMS}
    for d, cands in sweep.CANDIDATES.items():
        for _, dkdv, dq in cands:
            with sweep.tiles(d, dkdv, dq):
                assert k.DKDV_TILES[d] == ([tuple(dkdv)] if dkdv is not None else kv0[d])
                assert k.DQ_TILES[d] == ([tuple(dq)] if dq is not None else q0[d])
                assert all(k.DKDV_TILES[o] is lists[o][0] for o in k.DIMS if o != d)
                # what the launcher picks and compiles inside the block
                want_kv = dkdv if dkdv is not None else kv0[d][0]
                assert common.pick_tiles(k.DKDV_TILES, k.dkdv_smem, d, common.SM90_SMEM) == tuple(want_kv)
                assert k.instances("fav::Half", d)[0] == k.dkdv_instance("fav::Half", d, want_kv)
            assert all(k.DKDV_TILES[o] is lists[o][0] and k.DQ_TILES[o] is lists[o][1] for o in k.DIMS)
    with pytest.raises(RuntimeError):
        with sweep.tiles(64, (64, False, 128), (64, 64, 4)):
            raise RuntimeError("a candidate failing mid-sweep")
    assert k.DKDV_TILES == kv0 and k.DQ_TILES == q0
    assert all(k.DKDV_TILES[d] is lists[d][0] and k.DQ_TILES[d] is lists[d][1] for d in k.DIMS)


def test_configs_cover_the_combos(sweep):
    for d, cands in sweep.CANDIDATES.items():
        pairs = sweep.configs(d)
        assert pairs[0] == (None, None) and len(set(pairs)) == len(pairs)
        kvs = [kv for _, kv, q in cands if q is None]
        qs = [q for _, kv, q in cands if kv is None]
        assert all((kv, q) in pairs for kv in kvs for q in qs)


def test_help_and_no_gpu():
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "bwd_sweep.py"), "--help"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "--dims" in res.stdout and "--quick" in res.stdout
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "bwd_sweep.py"), "--dims", "32"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--dims" in res.stderr
