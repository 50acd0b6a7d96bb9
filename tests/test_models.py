"""The NumPy models against a direct float64 softmax: they must agree to float64 rounding, whatever the loop
order, block sizes, masking or head grouping. Inputs are fresh each run; the seed is in every failure message."""
import warnings

import ml_dtypes
import numpy as np
import pytest

from fa_variants.reference import fa1, fa2, naive
from fa_variants.reference.budget import LongRunWarning

MODELS = {"naive": naive, "fa1": fa1, "fa2": fa2}
EXACT = 1e-12


def make_inputs(batch, n_q, n_k, heads, heads_kv, d, scale=1.0):
    seed = int(np.random.SeedSequence().entropy % 2**63)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, n_q, heads, d)) * scale
    k = rng.standard_normal((batch, n_k, heads_kv, d)) * scale
    v = rng.standard_normal((batch, n_k, heads_kv, d))
    return q, k, v, seed


def direct_attention(q, k, v, causal, softmax_scale=None):
    """softmax(q k^T * scale) v one head at a time, sharing no code with the models: the yardstick.

    Returns (out, lse); rows with no visible key get 0 and -inf.
    """
    b, n_q, h, d = q.shape
    n_k, h_kv = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(d) if softmax_scale is None else softmax_scale
    out = np.zeros((b, n_q, h, d))
    lse = np.full((b, h, n_q), -np.inf)
    visible = np.ones((n_q, n_k), bool)
    if causal:
        visible = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + n_k - n_q
    live = visible.any(axis=1)
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // h_kv)
            s = q[bi, live, hi].astype(np.float64) @ k[bi, :, kv].astype(np.float64).T * scale
            s = np.where(visible[live], s, -np.inf)
            mx = s.max(axis=1, keepdims=True)
            e = np.exp(s - mx)
            out[bi, live, hi] = e @ v[bi, :, kv].astype(np.float64) / e.sum(axis=1, keepdims=True)
            lse[bi, hi, live] = mx[:, 0] + np.log(e.sum(axis=1))
    return out, lse


def check(name, q, k, v, seed, causal, **kw):
    ref_out, ref_lse = direct_attention(q, k, v, causal, kw.get("softmax_scale"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no divide-by-zero / invalid-value warnings from masked rows
        # a slow host's estimate of a long model run is not a numerical warning (tests/test_model_budget.py)
        warnings.simplefilter("ignore", LongRunWarning)
        res = MODELS[name].forward(q, k, v, causal=causal, **kw)
    where = f"{name} q{q.shape} k{k.shape} causal={causal} {kw} seed={seed}"
    assert res.out.dtype == np.float64 and res.out.shape == q.shape, where
    assert res.lse.shape == (q.shape[0], q.shape[2], q.shape[1]), where
    assert np.isfinite(res.out).all(), where
    err = np.linalg.norm(res.out - ref_out) / max(np.linalg.norm(ref_out), 1e-300)
    assert err < EXACT, f"relative error {err:.2e}: {where}"
    assert np.array_equal(np.isneginf(res.lse), np.isneginf(ref_lse)), where
    seen = np.isfinite(ref_lse)
    np.testing.assert_allclose(res.lse[seen], ref_lse[seen], rtol=1e-12, atol=1e-12, err_msg=where)
    return res


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("n_q,n_k", [(1, 1), (1, 37), (37, 37), (100, 37), (37, 100), (257, 257)])
@pytest.mark.parametrize("causal", [False, True])
def test_odd_sizes(name, n_q, n_k, causal):
    q, k, v, seed = make_inputs(2, n_q, n_k, 3, 3, 16)
    check(name, q, k, v, seed, causal, block_q=16, block_k=24)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_paper_blocks(name, causal):
    q, k, v, seed = make_inputs(1, 1000, 1000, 2, 2, 64)
    check(name, q, k, v, seed, causal)   # default blocks: paper_blocks(DEFAULT_SRAM, 64) = (64, 128)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("heads,heads_kv", [(8, 2), (4, 1)])  # GQA 4:1 and MQA
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_mqa(name, heads, heads_kv, causal):
    q, k, v, seed = make_inputs(2, 45, 70, heads, heads_kv, 32)
    check(name, q, k, v, seed, causal, block_q=7, block_k=13)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("block_q,block_k", [(1, 1), (3, 5), (64, 7), (128, 256)])
def test_block_sizes_that_do_not_divide(name, block_q, block_k):
    q, k, v, seed = make_inputs(1, 61, 83, 2, 1, 8)
    check(name, q, k, v, seed, True, block_q=block_q, block_k=block_k)


@pytest.mark.parametrize("name", MODELS)
def test_rows_without_keys_are_zero_with_neg_inf_lse(name):
    q, k, v, seed = make_inputs(2, 50, 20, 2, 2, 16)  # causal, N_q > N_k: rows 0..29 see no key
    res = check(name, q, k, v, seed, True, block_q=8, block_k=8)
    assert (res.out[:, :30] == 0).all(), seed
    assert np.isneginf(res.lse[:, :, :30]).all() and np.isfinite(res.lse[:, :, 30:]).all(), seed


@pytest.mark.parametrize("name", MODELS)
def test_large_scores_stay_finite_and_exact(name):
    q, k, v, seed = make_inputs(1, 100, 100, 2, 2, 32, scale=30.0)   # scores in the thousands
    check(name, q, k, v, seed, False, block_q=16, block_k=32)
    check(name, q, k, v, seed, True, block_q=16, block_k=32)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_input_dtypes(name, dtype):
    q, k, v, seed = make_inputs(1, 33, 40, 2, 2, 16)
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    check(name, q, k, v, seed, True, block_q=8, block_k=16, softmax_scale=0.3)


def test_models_agree_with_each_other():
    """Same numbers from three loop orders: deferred vs per-block normalization changes rounding only."""
    q, k, v, seed = make_inputs(1, 300, 300, 2, 1, 64)
    outs = [MODELS[n].forward(q, k, v, causal=True, block_q=32, block_k=48) for n in MODELS]
    for r in outs[1:]:
        np.testing.assert_allclose(r.out, outs[0].out, rtol=1e-12, atol=1e-13, err_msg=f"seed={seed}")
        np.testing.assert_allclose(r.lse, outs[0].lse, rtol=1e-13, err_msg=f"seed={seed}")


@pytest.mark.parametrize("name", MODELS)
def test_bad_shapes_raise(name):
    q, k, v, _ = make_inputs(1, 8, 8, 3, 2, 16)
    with pytest.raises(ValueError, match="multiple"):
        MODELS[name].forward(q, k, v)
    with pytest.raises(ValueError):
        MODELS[name].forward(q[0], k[0], v[0])
