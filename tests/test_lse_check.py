"""attention_backward refuses an ``lse`` from a forward run with another ``causal`` or ``softmax_scale``
(fa_variants/lse_check.py), which would otherwise give a wrong gradient silently; and a genuine (out, lse) never
trips it: rows that see no key (-inf), seqlen_q != seqlen_k under causal masking, one query row, GQA, negative and
zero scales, large inputs, NaN rows, and the lse of every forward, the fp8 ones included."""
from __future__ import annotations

import numpy as np
import pytest

import fa_variants as fav
from fa_variants import lse_check, registry
from conftest import random_qkv_host

MISMATCH = r"lse does not match causal=.*Pass the causal and softmax_scale of the forward"
SHAPES = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv)
    (2, 64, 64, 4, 2),
    (1, 100, 64, 4, 4),     # seqlen_q > seqlen_k: under causal masking the first 36 rows see no key
    (2, 64, 200, 4, 1),     # seqlen_q < seqlen_k, MQA
    (1, 1, 50, 8, 2),       # one query row (decoding)
    (1, 37, 29, 2, 2),
]
IDS = ["B{}-Nq{}-Nk{}-H{}-Hkv{}".format(*s) for s in SHAPES]


def _forward(rng, shape, variant="fa2", causal=False, scale=None, magnitude=1.0, d=64, dtype="float16"):
    """(dout, q, k, v, out, lse) from ``variant``'s NumPy model."""
    b, nq, nk, h, hkv = shape
    q, k, v = random_qkv_host(rng, b, nq, nk, h, hkv, d, dtype, scale=magnitude)
    out, lse = fav.attention(q, k, v, variant=variant, causal=causal, softmax_scale=scale, return_lse=True,
                             backend="numpy")
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    return dout, q, k, v, out, lse


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("variant", [v.name for v in registry.variants()])
def test_a_genuine_forward_never_trips_the_check(variant, shape, rng):
    d = 64
    for causal in (False, True):
        for scale, magnitude in ((None, 1.0), (-0.2, 1.0), (0.0, 1.0), (None, 30.0)):
            dout, q, k, v, out, lse = _forward(rng, shape, variant, causal, scale, magnitude, d)
            lse_check.check(q, k, lse, causal=causal, softmax_scale=d ** -0.5 if scale is None else scale)
    fav.attention_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=None)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_another_causal_is_refused(shape, rng):
    if shape[1] == 1:
        pytest.skip("one query row sees every key either way: both flags give the same lse and gradient")
    for trial in range(4):
        for causal in (False, True):
            dout, q, k, v, out, lse = _forward(rng, shape, causal=causal, dtype=("float16", "bfloat16")[trial % 2])
            with pytest.raises(ValueError, match=MISMATCH):
                fav.attention_backward(dout, q, k, v, out, lse, causal=not causal)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("factor", [2.0, 0.5, "one"], ids=["x2", "x0.5", "scale 1.0 for the default"])
def test_another_softmax_scale_is_refused(shape, factor, rng):
    for trial in range(4):
        causal = bool(trial % 2)
        dout, q, k, v, out, lse = _forward(rng, shape, causal=causal)
        wrong = 1.0 if factor == "one" else factor / 8
        with pytest.raises(ValueError, match=MISMATCH):
            fav.attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=wrong)


@pytest.mark.parametrize("variant", ["fa2_fp8", "fa3_fp8", "fa3"])
def test_the_lse_of_forwards_without_a_backward_is_checked_too(variant, rng):
    dout, q, k, v, out, lse = _forward(rng, SHAPES[0], variant, causal=True)
    grads = fav.attention_backward(dout, q, k, v, out, lse, causal=True)      # auto's backward takes them
    assert all(np.isfinite(g.astype(np.float64)).all() for g in grads)
    with pytest.raises(ValueError, match=MISMATCH):
        fav.attention_backward(dout, q, k, v, out, lse, causal=False)


def test_nan_rows_are_skipped_and_reach_the_gradients_they_should(rng):
    """A NaN in q gives NaN in its row of out and lse (the check skips it); dq is NaN in that row only, dk and dv
    in the key that row sees, and not in the other kv head (its NaN lse reaches no other head)."""
    b, nq, nk, h, hkv = 1, 64, 64, 4, 2
    q, k, v = (np.array(a) for a in random_qkv_host(rng, b, nq, nk, h, hkv, 64, "float16"))
    q[0, 0, 0, 5] = np.nan                                  # head 0, row 0: sampled by the check; sees key 0
    out, lse = fav.attention(q, k, v, causal=True, return_lse=True)
    assert np.isnan(out[0, 0, 0]).all() and np.isnan(lse[0, 0, 0])
    o = out.astype(np.float64)
    assert np.isfinite(np.delete(o[0, :, 0], 0, axis=0)).all() and np.isfinite(o[0, :, 1:]).all()
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    dq, dk, dv = (g.astype(np.float64) for g in fav.attention_backward(dout, q, k, v, out, lse, causal=True))
    assert np.isnan(dq[0, 0, 0]).all() and np.isfinite(np.delete(dq[0, :, 0], 0, axis=0)).all()
    assert np.isfinite(dq[0, :, 1:]).all()
    assert np.isnan(dk[0, 0, 0]).all() and np.isnan(dv[0, 0, 0]).all()         # key 0 of kv head 0
    assert np.isfinite(dk[0, :, 1]).all() and np.isfinite(dv[0, :, 1]).all()    # the other kv head


def test_check_lse_false_skips_the_check(rng):
    dout, q, k, v, out, lse = _forward(rng, SHAPES[0], causal=True)
    fav.attention_backward(dout, q, k, v, out, lse, causal=False, check_lse=False)
    with pytest.raises(TypeError, match="check_lse must be a bool"):
        fav.attention_backward(dout, q, k, v, out, lse, causal=True, check_lse=1)


def test_rows_and_pairs_compared():
    assert list(lse_check.rows_to_check(1, 50)) == [0]
    assert list(lse_check.rows_to_check(100, 64))[:2] == [0, 36]        # row 0 and the first that sees a key
    assert len(lse_check.rows_to_check(4096, 4096)) == lse_check.ROWS
    assert lse_check.pairs_to_check(1, 1) == [(0, 0)]
    pairs = lse_check.pairs_to_check(3, 8)
    assert len(pairs) == lse_check.PAIRS and pairs[0] == (0, 0) and pairs[-1] == (2, 7)


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("variant", [v.name for v in registry.variants()])
def test_kernel_forwards_pass_and_mismatches_fail_on_the_gpu(variant, rng):
    import cupy
    ok, why = registry.get(variant).available()
    if not ok:
        pytest.skip(why)
    for shape in SHAPES:
        b, nq, nk, h, hkv = shape
        q, k, v = (cupy.asarray(a) for a in random_qkv_host(rng, b, nq, nk, h, hkv, 64, "bfloat16"))
        for causal in (False, True):
            out, lse = fav.attention(q, k, v, variant=variant, causal=causal, return_lse=True)
            dout = cupy.asarray(rng.standard_normal(q.shape).astype(np.float32)).astype(q.dtype)
            fav.attention_backward(dout, q, k, v, out, lse, causal=causal)
            with pytest.raises(ValueError, match=MISMATCH):
                fav.attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=1.0)
            if nq > 1:
                with pytest.raises(ValueError, match=MISMATCH):
                    fav.attention_backward(dout, q, k, v, out, lse, causal=not causal)


@pytest.mark.gpu
def test_nan_rows_on_the_gpu(rng):
    """The NaN rule of the CPU test above, through auto's kernels (and the lse check skipping the NaN row)."""
    import cupy
    q, k, v = (np.array(a) for a in random_qkv_host(rng, 1, 64, 64, 4, 2, 64, "bfloat16"))
    q[0, 0, 0, 5] = np.nan
    q, k, v = (cupy.asarray(a) for a in (q, k, v))
    out, lse = fav.attention(q, k, v, causal=True, return_lse=True)
    o, l = cupy.asnumpy(out).astype(np.float64), cupy.asnumpy(lse)
    assert np.isnan(o[0, 0, 0]).all() and np.isnan(l[0, 0, 0]) and np.isfinite(o[0, 1:]).all()
    assert np.isfinite(o[0, :, 1:]).all()
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(np.float32)).astype(q.dtype)
    dq, dk, dv = (cupy.asnumpy(g).astype(np.float64) for g in fav.attention_backward(dout, q, k, v, out, lse,
                                                                                     causal=True))
    assert np.isnan(dq[0, 0, 0]).all() and np.isfinite(dq[0, 1:]).all() and np.isfinite(dq[0, :, 1:]).all()
    assert np.isnan(dk[0, 0, 0]).all() and np.isnan(dv[0, 0, 0]).all()
    assert np.isfinite(dk[0, :, 1]).all() and np.isfinite(dv[0, :, 1]).all()
