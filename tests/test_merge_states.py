"""fav.merge_states: attention over disjoint key sets merged equals attention over their union (float64 reference),
in flash-attn's and FlashInfer's layouts, two-way, as lists and stacked; associative and commutative; a state with
LSE = -inf contributes nothing, all empty gives zeros and -inf, never NaN; misuse refused."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import fa_variants as fav
from conftest import reference64
from kvcache_cases import assert_lse, rel

EXACT = 1e-12


def keyed_states(rng, cuts, batch=2, nq=3, heads=4, heads_kv=2, d=8, causal=False):
    """(states, full): attention of q over the key ranges [cuts[i], cuts[i+1]) of one key set, each as
    (out (B, Nq, H, d), lse (B, H, Nq)) in float64, and over all of it."""
    q = rng.standard_normal((batch, nq, heads, d))
    k = rng.standard_normal((batch, cuts[-1], heads_kv, d))
    v = rng.standard_normal((batch, cuts[-1], heads_kv, d))
    states = [reference64(q, k[:, a:b], v[:, a:b], causal=causal) for a, b in zip(cuts, cuts[1:])]
    return states, reference64(q, k, v, causal=causal)


def flashinfer_layout(out, lse):
    """(B, Nq, H, d), (B, H, Nq) -> FlashInfer's (tokens, H, d), (tokens, H)."""
    b, nq, h, d = out.shape
    return out.reshape(b * nq, h, d), lse.transpose(0, 2, 1).reshape(b * nq, h)


def test_two_way_equals_attention_over_the_union(rng):
    (a, b), full = keyed_states(rng, [0, 37, 100])
    out, lse = fav.merge_states(a[0], a[1], b[0], b[1])
    assert rel(out, full[0]) <= EXACT
    assert np.abs(lse - full[1]).max() <= EXACT


def test_flashinfer_layout(rng):
    (a, b, c), full = keyed_states(rng, [0, 5, 6, 50])
    out, lse = fav.merge_states(*flashinfer_layout(*a), *flashinfer_layout(*b))
    ab = fav.merge_states(*a, *b)
    assert np.allclose(out, flashinfer_layout(*ab)[0], rtol=0, atol=1e-14)
    assert np.allclose(lse, flashinfer_layout(*ab)[1], rtol=0, atol=1e-14)
    # n-way, stacked on axis 1 as FlashInfer's merge_states takes them
    fi = [flashinfer_layout(*s) for s in (a, b, c)]
    out, lse = fav.merge_states(np.stack([o for o, _ in fi], axis=1), np.stack([l for _, l in fi], axis=1))
    ref_out, ref_lse = flashinfer_layout(*full)
    assert rel(out, ref_out) <= EXACT and np.abs(lse - ref_lse).max() <= EXACT


def test_n_way_lists_and_stacked(rng):
    states, full = keyed_states(rng, [0, 1, 17, 18, 40, 41])
    outs, lses = [s[0] for s in states], [s[1] for s in states]
    for got in (fav.merge_states(outs, lses), fav.merge_states(tuple(outs), tuple(lses)),
                fav.merge_states(np.stack(outs), np.stack(lses))):
        assert rel(got[0], full[0]) <= EXACT
        assert np.abs(got[1] - full[1]).max() <= EXACT
    one = fav.merge_states(outs[:1], lses[:1])             # one state merges to itself
    assert np.allclose(one[0], outs[0], rtol=0, atol=1e-15) and np.array_equal(one[1], lses[0])


def test_associative_and_commutative(rng):
    (a, b, c), _ = keyed_states(rng, [0, 10, 11, 29])
    left = fav.merge_states(*fav.merge_states(*a, *b), *c)
    right = fav.merge_states(*a, *fav.merge_states(*b, *c))
    flat = fav.merge_states([a[0], b[0], c[0]], [a[1], b[1], c[1]])
    swapped = fav.merge_states([c[0], a[0], b[0]], [c[1], a[1], b[1]])
    for other in (right, flat, swapped):
        assert np.allclose(left[0], other[0], rtol=0, atol=1e-14)
        assert np.allclose(left[1], other[1], rtol=0, atol=1e-14)


def test_float32_lse_and_16bit_out_keep_their_dtypes(rng):
    (a, b), full = keyed_states(rng, [0, 30, 64])
    out, lse = fav.merge_states(a[0].astype(np.float16), a[1].astype(np.float32), b[0].astype(np.float16),
                                b[1].astype(np.float32))
    assert out.dtype == np.float16 and lse.dtype == np.float32
    assert rel(out, full[0]) <= 2e-3
    assert_lse(lse, full[1])


def test_an_empty_state_contributes_nothing(rng):
    """A state that saw no key (LSE = -inf) leaves the other as it is, even with garbage (NaN, Inf) in its out."""
    (a,), _ = keyed_states(rng, [0, 20])
    garbage = np.full_like(a[0], np.nan)
    garbage[..., 0] = np.inf
    empty_lse = np.full_like(a[1], -np.inf)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for args in ((*a, garbage, empty_lse), (garbage, empty_lse, *a)):
            out, lse = fav.merge_states(*args)
            assert np.array_equal(out, a[0]) and np.array_equal(lse, a[1])


def test_all_empty_gives_zeros_and_minus_inf_never_nan(rng):
    shape = (2, 3, 4, 8)
    outs = [np.full(shape, np.nan), rng.standard_normal(shape), np.zeros(shape)]
    lses = [np.full((2, 4, 3), -np.inf, np.float32)] * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = fav.merge_states(outs, lses)
        out2, lse2 = fav.merge_states(outs[0], lses[0], outs[1], lses[1])
    for o, l in ((out, lse), (out2, lse2)):
        assert (o == 0).all() and np.isneginf(l).all() and l.dtype == np.float32


def masked_attention(q, k, v, visible):
    """float64 attention of q (Nq, d) over k, v (Nk, d) where ``visible`` (Nq, Nk): (out, lse), 0 and -inf for a
    row that sees nothing."""
    s = np.where(visible, q @ k.T / np.sqrt(q.shape[1]), -np.inf)
    seen = visible.any(axis=1)
    m = np.where(seen, s.max(axis=1), 0.0)
    p = np.exp(s - m[:, None])
    l = p.sum(axis=1)
    out = np.where(seen[:, None], p @ v / np.where(seen, l, 1.0)[:, None], 0.0)
    return out, np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)


def test_rows_empty_in_some_states_only(rng):
    """Causal attention of 12 rows over 12 keys cut into key ranges: early rows see no key of the later ranges,
    so their states there are (0, -inf); merged, they give the causal attention over all keys."""
    nq = nk = 12
    q, k, v = (rng.standard_normal((n, 8)) for n in (nq, nk, nk))
    visible = np.arange(nk)[None, :] <= np.arange(nq)[:, None]
    states = [masked_attention(q, k[a:b], v[a:b], visible[:, a:b]) for a, b in ((0, 5), (5, 6), (6, 12))]
    assert np.isneginf(states[2][1]).sum() == 6
    full = masked_attention(q, k, v, visible)
    out, lse = fav.merge_states([o[None, :, None] for o, _ in states], [l[None, None] for _, l in states])
    assert rel(out[0, :, 0], full[0]) <= EXACT and np.abs(lse[0, 0] - full[1]).max() <= EXACT


def test_nan_lse_gives_a_nan_row(rng):
    (a, b), _ = keyed_states(rng, [0, 4, 9])
    lse_b = b[1].copy()
    lse_b[0, 1, 2] = np.nan
    out, lse = fav.merge_states(*a, b[0], lse_b)
    assert np.isnan(lse[0, 1, 2]) and np.isnan(out[0, 2, 1]).all()
    assert np.isfinite(np.delete(lse.ravel(), np.ravel_multi_index((0, 1, 2), lse.shape))).all()


class _FakeGpuArray:
    __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0, False), "version": 3}


@pytest.mark.parametrize("args,err,words", [
    (lambda a, b: (a[0], a[1], b[0]), TypeError, "got out_b without lse_b"),
    (lambda a, b: (a[0], a[1], None, b[1]), TypeError, "got lse_b without out_b"),
    (lambda a, b: (a[0], a[1], b[0][:, :1], b[1]), ValueError, "out_b must have out_a's shape"),
    (lambda a, b: (a[0], a[1], b[0], b[1].transpose(0, 2, 1)), ValueError,
     "lse_b must have shape (batch, heads, seqlen)"),
    (lambda a, b: (a[0], a[1].astype(np.float16), b[0], b[1]), TypeError, "lse_a must be float32 or float64"),
    (lambda a, b: (a[0], a[1], b[0].astype(np.float32), b[1]), TypeError, "the states must share one dtype"),
    (lambda a, b: (a[0].astype(np.int32), a[1], b[0].astype(np.int32), b[1]), TypeError,
     "out_a must have a floating-point dtype"),
    (lambda a, b: (a[0][0, 0], a[1][0], b[0][0, 0], b[1][0]), ValueError, "out_a must be (batch, seqlen, heads"),
    (lambda a, b: ([a[0], b[0]], [a[1]]), ValueError, "two lists of one length"),
    (lambda a, b: ([], []), ValueError, "at least one state"),
    (lambda a, b: ([a[0]], a[1]), ValueError, "two lists of one length"),
    (lambda a, b: (a[0][0], a[1][0]), ValueError, "outs must be stacked states"),
    (lambda a, b: (a[0], a[1]), ValueError, "for two states: merge_states(out_a, lse_a, out_b, lse_b)"),
    (lambda a, b: (np.stack([a[0], b[0]]), np.stack([a[1], b[1]])[:, :, :, :1]), ValueError,
     "lses must have shape (states, batch, heads, seqlen)"),
    (lambda a, b: (a[0].tolist(), a[1], b[0], b[1]), TypeError, "out_a must be a NumPy array"),
    (lambda a, b: ([a[0], _FakeGpuArray()], [a[1], b[1]]), ValueError, "on the GPU while the rest are NumPy arrays"),
])
def test_misuse_is_refused(rng, args, err, words):
    (a, b), _ = keyed_states(rng, [0, 3, 7])
    a = (a[0], a[1].astype(np.float32))
    b = (b[0], b[1].astype(np.float32))
    with pytest.raises(err) as info:
        fav.merge_states(*args(a, b))
    assert words in str(info.value), f"message: {info.value}"
