"""The decoding kernels' table (fa_variants/kernels/decode.py), without a GPU: every shipped instance fits its
arch's shared memory, the ring is at least two deep, the packed rows choose their m-tiles as documented."""
from __future__ import annotations

import re

import pytest

from fa_variants.kernels import decode as k

OPT_IN = {"sm_80": 163 * 1024, "sm_90a": 227 * 1024}   # shared memory a block may opt into
PER_SM = {"sm_80": 164 * 1024, "sm_90a": 228 * 1024}   # an SM's, of which the driver keeps 1 KB per resident CTA
INSTANCE = re.compile(r"decode_split<fav::\w+, (\d+), (\d+), (\d+), (true|false), fav::(\w+)>")


@pytest.mark.parametrize("arch", sorted(OPT_IN))
def test_every_instance_fits_its_arch(arch):
    exprs = k.compile_units(arch)[k.SOURCE]
    assert exprs
    for expr in exprs:
        d, mt, stages, _, kv = INSTANCE.fullmatch(expr).groups()
        d, mt, stages = int(d), int(mt), int(stages)
        kv_bytes = 1 if kv == "E4M3" else 2
        assert stages >= 2, expr
        smem = k.smem_bytes(d, mt, stages, kv_bytes)
        assert smem <= OPT_IN[arch], expr
        ctas = k.ctas_per_sm(d, mt, kv_bytes, arch)
        assert ctas * (smem + 1024) <= PER_SM[arch], f"{expr}: {ctas} CTAs of {smem} bytes do not fit one SM"
        assert mt * d <= 256, f"{expr}: O's registers (MT x D / 2 floats per thread) would spill"


def test_e4m3_instances_only_where_the_conversion_exists():
    assert not any("E4M3" in e for e in k.compile_units("sm_80")[k.SOURCE])
    assert any("E4M3" in e for e in k.compile_units("sm_90a")[k.SOURCE])


@pytest.mark.parametrize("rows, d, mt", [(1, 128, 1), (16, 128, 1), (17, 128, 2), (32, 64, 2), (128, 128, 2),
                                         (17, 256, 1), (4, 256, 1)])
def test_m_tiles(rows, d, mt):
    assert k.m_tiles(rows, d) == mt


def test_template_dims():
    assert [k.template_dim(d) for d in (8, 64, 72, 128, 136, 256)] == [64, 64, 128, 128, 256, 256]


def test_merge_instances_cover_decodings_partials():
    merges = k.compile_units("sm_90a")[k.MERGE_SOURCE]
    for dtype in ("float16", "bfloat16"):
        assert k.merge_instance("float32", "float32", dtype) in merges
    for dtype in k.MERGE_TYPES:
        assert k.merge_instance(dtype, "float32") in merges


def test_ctas_per_sm_only_where_their_rings_fit(monkeypatch):
    """A count in CTAS_PER_SM holds where that many rings of two stages or more share the budget; else one CTA."""
    monkeypatch.setitem(k.CTAS_PER_SM, ("sm_90a", 2), 2)
    assert k.ctas_per_sm(128, 1, 2, "sm_90a") == 2 and k.stages(128, 1, 2, "sm_90a") >= 2
    assert k.ctas_per_sm(256, 1, 2, "sm_90a") == 1    # two d 256 rings of two stages exceed the budget
    assert k.ctas_per_sm(128, 1, 1, "sm_90a") == 1    # the e4m3 cache's count is its own
    test_every_instance_fits_its_arch("sm_90a")
