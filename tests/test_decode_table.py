"""The decoding kernels' table (fa_variants/kernels/decode.py), without a GPU: every shipped instance fits its
arch's shared memory, the ring is at least two deep, the packed rows choose their m-tiles as documented."""
from __future__ import annotations

import re

import pytest

from fa_variants.kernels import decode as k

OPT_IN = {"sm_80": 163 * 1024, "sm_90a": 227 * 1024}   # shared memory a block may opt into
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
        assert k.smem_bytes(d, mt, stages, kv_bytes) <= OPT_IN[arch], expr
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
