"""A decoding step's launch plan (fa_variants/kernels/decode.py's StepPlan), without a GPU: which kernels a warm call
launches, in which order, on which stream, and which of the call's pointers lands in which field of each kernel's
parameter struct. The CUfunctions, the device's facts and the launch itself are stand-ins; the structs are the
real ones, read back field by field."""
from __future__ import annotations

import itertools
import struct as pystruct

import numpy as np
import pytest

from fa_variants.kernels import decode as k
from fa_variants.kernels.params import APPEND, DECODE, MERGE

STREAM = 7
STRUCTS = {k.APPEND_SOURCE: APPEND, k.SOURCE: DECODE, k.MERGE_SOURCE: MERGE}


class FakeFramework:
    """Allocation as NumPy arrays, each given a distinct fake device pointer."""
    stream = STREAM

    def __init__(self):
        self._next = itertools.count(0x10000, 0x1000)
        self.ptrs = {}

    def empty(self, shape, dtype):
        a = np.empty(shape, np.float32 if dtype == "float32" else np.float16)
        self.ptrs[id(a)] = next(self._next)
        return a

    def ptr(self, a):
        return self.ptrs[id(a)]


@pytest.fixture
def launches(monkeypatch):
    """Every launch a plan makes: (source, grid, after, {field: value} of its struct)."""
    seen = []
    monkeypatch.setattr(k, "_function", lambda source, expr, smem=0: source)
    monkeypatch.setattr(k, "arch_of", lambda device: "sm_90a")
    monkeypatch.setattr(k, "num_sms", lambda device: 132)
    monkeypatch.setattr(k, "smem_limit", lambda: 227 * 1024)

    def fake_launch(func, grid, block, smem, stream, template, fmt, *ptrs, extra=(), after=False):
        assert stream == STREAM
        struct = STRUCTS[func]
        buf = bytearray(template)
        pystruct.pack_into(fmt, buf, 0, *ptrs)
        rec = np.frombuffer(bytes(buf), dtype=struct.dtype)[0]
        seen.append((func, tuple(grid), after, {f: rec[f].item() for f, _ in struct.fields}))
    monkeypatch.setattr(k, "launch", fake_launch)
    return seen


def spec(shape, dtype="bfloat16"):
    return k._contiguous(shape, dtype, 0)


def plan(num_splits, append=False, return_lse=True, paged=False, **masks):
    q = spec((2, 1, 32, 128))
    cache = spec((64, 16, 8, 128)) if paged else spec((2, 4096, 8, 128))
    new = spec((2, 1, 8, 128))
    app = (k.append_launch(new, new, cache, cache, paged=paged, capacity=4096, page_size=16 if paged else 0,
                           max_pages=32 if paged else 0) if append else None)
    return k.step_plan(q, cache, cache, paged=paged, max_pages=32 if paged else 0, seqlen_new=1 if append else 0,
                       capacity=4096, max_seqlen_k=4096, causal=True, softmax_scale=0.088,
                       num_splits=num_splits, return_lse=return_lse, append=app, **masks)


PTRS = dict(q=0x100, k_cache=0x200, v_cache=0x300, cache_seqlens=0x400, page_table=0x500, k_descale=0x600,
            v_descale=0x700, k=0x800, v=0x900, alibi_slopes=0xa00, sinks=0xb00)


def test_one_split_writes_out_and_lse_directly(launches):
    fw = FakeFramework()
    out, lse = plan(num_splits=1).run(fw, **{n: PTRS[n] for n in ("q", "k_cache", "v_cache", "cache_seqlens")})
    assert [(src, grid, after) for src, grid, after, _ in launches] == [(k.SOURCE, (1, 8, 2), False)]
    f = launches[0][3]
    assert (f["q"], f["k"], f["v"], f["cache_seqlens"]) == (0x100, 0x200, 0x300, 0x400)
    assert (f["o"], f["lse"], f["o_part"], f["lse_part"]) == (fw.ptr(out), fw.ptr(lse), 0, 0)
    assert (f["page_table"], f["k_descale"], f["v_descale"]) == (0, 0, 0)
    assert out.shape == (2, 1, 32, 128) and lse.shape == (2, 32, 1)
    assert (f["num_splits"], f["heads"], f["heads_kv"], f["group"], f["causal"]) == (1, 32, 8, 4, 1)


def test_append_then_split_then_merge(launches):
    fw = FakeFramework()
    p = plan(num_splits=4, append=True, paged=True)
    out, lse = p.run(fw, **PTRS)
    assert [(src, after) for src, _, after, _ in launches] == [(k.APPEND_SOURCE, False), (k.SOURCE, True),
                                                               (k.MERGE_SOURCE, True)]
    app, split, merge = (f for *_, f in launches)
    # the append reads the new tokens and writes the caches; the split reads the caches
    assert (app["k"], app["v"], app["k_cache"], app["v_cache"]) == (0x800, 0x900, 0x200, 0x300)
    assert (app["cache_seqlens"], app["page_table"]) == (0x400, 0x500)
    assert (split["k"], split["v"], split["page_table"], split["k_descale"]) == (0x200, 0x300, 0x500, 0x600)
    assert (split["o"], split["lse"]) == (0, 0) and split["o_part"] and split["lse_part"]
    # the merge reads the split's partials and writes the call's out and lse
    assert (merge["o_parts"], merge["lse_parts"]) == (split["o_part"], split["lse_part"])
    assert (merge["out"], merge["lse"]) == (fw.ptr(out), fw.ptr(lse))
    assert (merge["states"], split["num_splits"], launches[1][1]) == (4, 4, (4, 8, 2))
    assert (split["page_size"], split["max_pages"], split["num_pages"]) == (16, 32, 64)
    # the partials' strides as the merge reads them: (split, batch, seqlen_q, heads, d), contiguous
    assert (merge["p_s"], merge["p_b"], merge["p_h"]) == (2 * 32 * 128, 32 * 128, 128)


def test_no_lse_asked_none_written(launches):
    fw = FakeFramework()
    out, lse = plan(num_splits=4, return_lse=False).run(fw, **{n: PTRS[n] for n in ("q", "k_cache", "v_cache",
                                                                                   "cache_seqlens")})
    assert lse is None and launches[-1][3]["lse"] == 0 and launches[-1][3]["out"] == fw.ptr(out)


def test_auto_split_count_is_the_models_rule(launches):
    """num_splits=0 takes the model's rule over the device's SMs."""
    from fa_variants.reference import decode as model
    assert plan(num_splits=0).num_splits == model.choose_num_splits(2, 8, 4096, 132, k.SPLIT_N)


def test_mask_keywords_reach_the_split(launches):
    """The window, softcap, per-sequence ALiBi rows and the sinks in the split's struct; a window's keys, not the
    cache's, in the split rule (a window of 128 over 4096 tokens: one split)."""
    p = plan(num_splits=0, window=(127, 0), softcap=30.0, alibi_rows=2)
    p.run(FakeFramework(), **PTRS)
    split = launches[0][3]
    assert (split["window_left"], split["window_right"], split["softcap"]) == (127, 0, 30.0)
    assert (split["alibi_slopes"], split["sinks"], split["alibi_b"]) == (0xa00, 0xb00, 32)
    assert split["inv_scale"] == pytest.approx(1 / 0.088) and p.num_splits == 1
