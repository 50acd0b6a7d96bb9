"""The parameter structs: the Python mirror (kernels/params.py) against the C++ structs (common/params.cuh),
checked by the compiler through the generated static_asserts (CPU, NVRTC only)."""
from __future__ import annotations

import dataclasses

import pytest

from fa_variants import jit
from fa_variants.kernels import fa2, params

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (the cuda extra) is not installed")

ONE = (fa2.instance("fav::Half", 64, fa2.TILES[64][0]),)


def _compile(monkeypatch, structs):
    monkeypatch.setattr(params, "STRUCTS", structs)
    jit._compile_code.cache_clear()
    try:
        return jit.compile_source(fa2.SOURCE, ONE, "sm_80")
    finally:
        jit._compile_code.cache_clear()


def test_the_layout_asserts_are_compiled_in():
    flat = jit.flatten(fa2.SOURCE)
    for s in params.STRUCTS:
        assert f"sizeof(fav::{s.name}) == {s.size}" in flat
        for f, _ in s.fields:
            assert f"FAV_OFFSETOF(fav::{s.name}, {f}) == {s.offset(f)}" in flat


def test_the_mirror_compiles_against_the_structs(monkeypatch):
    assert _compile(monkeypatch, params.STRUCTS).cubin


def _changed(change):
    fields = list(params.FWD.fields)
    names = [f for f, _ in fields]
    if change == "swap":      # two fields in the other order (k after v)
        i = names.index("k")
        fields[i], fields[i + 1] = fields[i + 1], fields[i]
    elif change == "drop":    # a field forgotten on the Python side
        del fields[names.index("group")]
    else:                     # an int where C++ has a 64-bit stride (same offsets: only the size differs)
        fields[names.index("q_b")] = ("q_b", "int")
    return dataclasses.replace(params.FWD, fields=tuple(fields))


@pytest.mark.parametrize("change", ["swap", "drop", "retype"])
def test_a_mismatch_fails_compilation(monkeypatch, change):
    with pytest.raises(jit.CompileError, match="differs from fa_variants/kernels/params.py"):
        _compile(monkeypatch, (_changed(change), params.FP8_FWD))


def test_pack_and_pointer_fill():
    t = params.FWD.pack(**{f: 0 for f, _ in params.FWD.fields} | {"seqlen_q": 37, "scale_log2": 0.5})
    assert len(t) == params.FWD.size
    buf = params.fill_pointers(t, params.FWD.pointers_format, *range(1, len(params.FWD.pointers) + 1))
    import numpy as np
    rec = np.frombuffer(bytes(buf), dtype=params.FWD.dtype)[0]
    assert [int(rec[f]) for f in params.FWD.pointers] == list(range(1, 9))
    assert int(rec["seqlen_q"]) == 37 and float(rec["scale_log2"]) == 0.5
    with pytest.raises(ValueError, match="missing fields"):
        params.FWD.pack(q=0)


def test_a_zero_softmax_scale_reaches_the_kernels_as_float32s_smallest_normal():
    """Masked scores are -inf and the kernels multiply them by scale_log2: -inf * 0 would be NaN (fa1, fa2 and fa3
    returned all NaN at softmax_scale=0 before this), -inf * 2^-126 stays -inf, and finite scores times it round
    to an exponent of 0: every visible key weighs the same."""
    import numpy as np
    from fa_variants.kernels.common import LOG2E, scale_log2
    tiny = scale_log2(0.0)
    assert np.float32(tiny) == np.finfo(np.float32).tiny
    assert np.float32(-np.inf) * np.float32(tiny) == -np.inf
    assert np.exp2(np.float32(1e4) * np.float32(tiny)) == 1.0
    assert scale_log2(-0.5) == -0.5 * LOG2E and scale_log2(0.125) == 0.125 * LOG2E
