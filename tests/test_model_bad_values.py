"""The NumPy models on bad values and bad arguments: the kernels' rule, and attention()'s argument checks.

The rule (torch SDPA's): a NaN or Inf in q or k gives NaN in the output rows it reaches and NaN LSE there; a
NaN in v gives NaN in its channel of the rows that use its key; a row that sees no key gives zeros and
LSE = -inf, never NaN; every other row is untouched. Inputs are fresh each run (seed in a failed test's report).
"""
import warnings

import ml_dtypes
import numpy as np
import pytest

from conftest import LSE_ATOL_FP8, TOL, reference64, rel_err
from fa_variants import registry
from fa_variants.reference import common, dense, fa1, fa2, fp8, naive

MODELS = {"naive": naive.forward, "fa1": fa1.forward, "fa2": fa2.forward, "fa2_fp8": fp8.forward}
FLOAT64_MODELS = ("naive", "fa1", "fa2")
EXACT = 1e-12            # float64 models against the float64 reference: rounding only
BLOCKS = dict(block_q=8, block_k=16)
B, NQ, NK, H, HKV, D = 2, 21, 37, 4, 2, 16


def inputs(rng, n_q=NQ, n_k=NK, d=D):
    return (rng.standard_normal((B, n_q, H, d)), rng.standard_normal((B, n_k, HKV, d)),
            rng.standard_normal((B, n_k, HKV, d)))


def sees(j, n_q, n_k, causal):
    """(n_q,) bool: the query rows that see key j (bottom-right causal mask)."""
    rows = np.arange(n_q)
    return rows + (n_k - n_q) >= j if causal else np.ones(n_q, bool)


def query_heads_of(hk):
    return [h for h in range(H) if h // (H // HKV) == hk]


def assert_rows_match(name, res, ref, ref_lse, keep):
    """The rows where ``keep`` (batch, seqlen_q, heads) is True are finite and match the float64 reference."""
    out = res.out[keep]
    assert np.isfinite(out).all(), f"{name}: a bad value leaked into {int((~np.isfinite(out)).any(-1).sum())} clean rows"
    tol = EXACT if name in FLOAT64_MODELS else TOL["float8_e4m3fn"]
    assert rel_err(out, ref[keep]) <= tol, name
    lse, want = res.lse.transpose(0, 2, 1)[keep], ref_lse.transpose(0, 2, 1)[keep]
    assert np.array_equal(np.isneginf(lse), np.isneginf(want)) and not np.isnan(lse).any(), name
    fin = np.isfinite(want)
    np.testing.assert_allclose(lse[fin], want[fin], rtol=EXACT if name in FLOAT64_MODELS else 0,
                               atol=EXACT if name in FLOAT64_MODELS else LSE_ATOL_FP8, err_msg=name)


def assert_rows_untouched(name, res, clean, keep):
    """The rows where ``keep`` is True are bit for bit the model's rows on the inputs without the bad value: the
    rule says untouched, and an fp8 model's scales ignore non-finite values, so no tolerance is needed. (Against
    the float64 reference instead, an fp8 model's error on a subset of these tiny rows, median 0.048, reached the
    fp8 tolerance 0.06 by chance in CI on 2026-12-04. Its accuracy is test_fp8_model.py's.)"""
    assert np.array_equal(res.out[keep], clean.out[keep]), f"{name}: clean rows changed"
    lse, want = res.lse.transpose(0, 2, 1)[keep], clean.lse.transpose(0, 2, 1)[keep]
    assert np.array_equal(lse, want), f"{name}: clean rows' LSE changed"


# ---------------------------------------------------------------------------------------------- bad values

@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("causal", [False, True])
def test_bad_value_in_q_poisons_its_row_only(rng, name, bad, causal):
    q, k, v = inputs(rng)
    b, r, h = 1, int(rng.integers(NQ)), int(rng.integers(H))   # N_k > N_q: every row sees keys, causal too
    clean = MODELS[name](q, k, v, causal=causal, **BLOCKS)   # the other rows must not change
    assert_rows_match(name, clean, *reference64(q, k, v, causal=causal), np.ones((B, NQ, H), bool))
    # The smallest |value| of the row: never its Q block's amax, which the fp8 models' block scale is made of (the
    # bad value, left out of the amax, would otherwise change the scale of every row in the block). An Inf meets
    # keys of both signs, so some score is +Inf: NaN.
    q[b, r, h, int(np.argmin(np.abs(q[b, r, h].astype(np.float64))))] = bad
    res = MODELS[name](q, k, v, causal=causal, **BLOCKS)
    assert np.isnan(res.out[b, r, h]).all() and np.isnan(res.lse[b, h, r]), name
    keep = np.ones((B, NQ, H), bool)
    keep[b, r, h] = False
    assert_rows_untouched(name, res, clean, keep)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("causal", [False, True])
def test_bad_value_in_k_poisons_the_rows_that_see_it(rng, name, bad, causal):
    q, k, v = inputs(rng, n_q=NK)   # square: causal row i sees keys 0..i
    b, j, hk, c = 0, int(rng.integers(3, NK - 3)), int(rng.integers(HKV)), int(rng.integers(D))
    heads = query_heads_of(hk)
    q[b, :, heads, c] = np.abs(q[b, :, heads, c]) + 0.5   # q . k = +Inf for an Inf in k, in every row
    clean = MODELS[name](q, k, v, causal=causal, **BLOCKS)
    assert_rows_match(name, clean, *reference64(q, k, v, causal=causal), np.ones((B, NK, H), bool))
    k[b, j, hk, c] = bad
    res = MODELS[name](q, k, v, causal=causal, **BLOCKS)
    hit = np.zeros((B, NK, H), bool)
    hit[b] = sees(j, NK, NK, causal)[:, None] & np.isin(np.arange(H), heads)[None, :]
    assert np.isnan(res.out[hit]).all(), name
    assert np.isnan(res.lse.transpose(0, 2, 1)[hit]).all(), name
    assert_rows_untouched(name, res, clean, ~hit)


@pytest.mark.parametrize("name", FLOAT64_MODELS)   # e4m3 has no Inf: fa2_fp8 makes any Inf a NaN
def test_minus_inf_score_drops_its_key_like_a_mask(rng, name):
    """+Inf in k against a negative q channel is a score of -Inf: weight 0, the other keys renormalize (torch
    SDPA does the same); nothing is NaN."""
    q, k, v = inputs(rng)
    b, j, hk, c = 1, int(rng.integers(NK)), int(rng.integers(HKV)), int(rng.integers(D))
    heads = query_heads_of(hk)
    q[b, :, heads, c] = -np.abs(q[b, :, heads, c]) - 0.5
    k[b, j, hk, c] = np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = MODELS[name](q, k, v, causal=False, **BLOCKS)
    assert_rows_match(name, res, *reference64(q, k, v), np.ones((B, NQ, H), bool))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_v_reaches_its_channel_of_the_rows_that_use_it(rng, name, causal):
    q, k, v = inputs(rng, n_q=NK)
    b, j, hk, c = 1, int(rng.integers(3, NK - 3)), int(rng.integers(HKV)), int(rng.integers(D))
    heads = query_heads_of(hk)
    ref, ref_lse = reference64(q, k, v, causal=causal)   # clean: a row that does not see key j ignores it
    v[b, j, hk, c] = np.nan
    res = MODELS[name](q, k, v, causal=causal, **BLOCKS)
    rows = sees(j, NK, NK, causal)
    assert np.isnan(res.out[b][np.ix_(rows, heads, [c])]).all(), name
    # the LSE never reads V; the other channels, batches and kv heads are untouched
    np.testing.assert_allclose(res.lse, ref_lse, rtol=EXACT if name in FLOAT64_MODELS else 0,
                               atol=EXACT if name in FLOAT64_MODELS else LSE_ATOL_FP8, err_msg=name)
    other = np.ones(D, bool)
    other[c] = False
    tol = EXACT if name in FLOAT64_MODELS else TOL["float8_e4m3fn"]
    assert np.isfinite(res.out[..., other]).all() and rel_err(res.out[..., other], ref[..., other]) <= tol
    # channel c of a row that does not see key j: 0 * NaN through a block's P V is NaN (plain float
    # arithmetic, as in the kernels), but never a finite wrong value
    col = res.out[..., c]
    fin = np.isfinite(col)
    np.testing.assert_allclose(col[fin], ref[..., c][fin], rtol=1e-9 if name in FLOAT64_MODELS else 0.5,
                               atol=1e-9 if name in FLOAT64_MODELS else 0.5, err_msg=name)


@pytest.mark.parametrize("name", MODELS)
def test_rows_without_keys_are_zero_never_nan(rng, name):
    n_q, n_k = 50, 20                                   # causal: rows 0..29 see no key
    q, k, v = inputs(rng, n_q=n_q, n_k=n_k)
    ref = reference64(q, k, v, causal=True)
    q[0, 3, 1, 5] = np.nan                              # a row that sees no key stays empty even so
    res = MODELS[name](q, k, v, causal=True, **BLOCKS)
    assert not np.isnan(res.out).any() and not np.isnan(res.lse).any(), name
    assert (res.out[:, :n_q - n_k] == 0).all() and np.isneginf(res.lse[:, :, :n_q - n_k]).all(), name
    assert np.isfinite(res.lse[:, :, n_q - n_k:]).all(), name
    keep = np.ones((B, n_q, H), bool)
    keep[:, :n_q - n_k] = False
    assert_rows_match(name, res, *ref, keep)


def test_dense_reference_follows_the_same_rule(rng):
    """reference/dense.py, what the CLI and bench/devcheck.py check kernels against, agrees with the models."""
    n_q, n_k = 30, 20                                   # causal: rows 0..9 see no key
    q, k, v = inputs(rng, n_q=n_q, n_k=n_k)
    q[1, 15, 2, 4] = np.nan
    res = fa2.forward(q, k, v, causal=True, **BLOCKS)
    out, lse = dense.attention64(q, k, v, causal=True, scale=1 / np.sqrt(D))   # (B*H, Nq, d), (B*H, Nq)
    pair = 1 * H + 2
    assert np.isnan(out[pair, 15]).all() and np.isnan(lse[pair, 15])
    assert (out[:, :n_q - n_k] == 0).all() and np.isneginf(lse[:, :n_q - n_k]).all()
    np.testing.assert_allclose(out, res.out.transpose(0, 2, 1, 3).reshape(B * H, n_q, D), rtol=EXACT, atol=EXACT)
    np.testing.assert_allclose(lse, res.lse.reshape(B * H, n_q), rtol=EXACT, atol=EXACT)


@pytest.mark.parametrize("name", FLOAT64_MODELS)
@pytest.mark.parametrize("causal", [False, True])
def test_huge_bf16_scores_stay_finite_in_float64(rng, name, causal):
    """Scores of ~1e40 overflow fp32 but not float64: the models give the exact answer, without a warning."""
    q, k, v = inputs(rng)
    q, k = ((a * 1e20).astype(ml_dtypes.bfloat16) for a in (q, k))
    v = v.astype(ml_dtypes.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = MODELS[name](q, k, v, causal=causal, **BLOCKS)
    ref, ref_lse = reference64(q, k, v, causal=causal)
    assert np.isfinite(res.lse).all() and np.abs(res.lse).max() > 1e30
    assert_rows_match(name, res, ref, ref_lse, np.ones((B, NQ, H), bool))


# ---------------------------------------------------------------------------------------------- bad arguments

def _q3(q, k, v):
    return q[0], k, v


MISUSE = {  # id: (keyword arguments, or a function of (q, k, v) giving the inputs), error, the argument named
    "causal-str": (dict(causal="yes"), TypeError, "causal"),
    "causal-int": (dict(causal=1), TypeError, "causal"),
    "scale-bool": (dict(softmax_scale=True), TypeError, "softmax_scale"),
    "scale-str": (dict(softmax_scale="0.1"), TypeError, "softmax_scale"),
    "scale-nan": (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    "scale-inf": (dict(softmax_scale=float("inf")), ValueError, "softmax_scale"),
    "block_q-0": (dict(block_q=0), ValueError, "block_q"),
    "block_k-neg": (dict(block_k=-16), ValueError, "block_k"),
    "block_q-float": (dict(block_q=8.0), TypeError, "block_q"),
    "block_k-bool": (dict(block_k=True), TypeError, "block_k"),
    "q-3d": (_q3, ValueError, "q must have 4 dimensions"),
    "k-zero-size": (lambda q, k, v: (q, k[:, :0], v[:, :0]), ValueError, "k has a zero-size dimension"),
    "batch": (lambda q, k, v: (q[:1], k, v), ValueError, "batch"),
    "head_dim": (lambda q, k, v: (q, k[..., :-1], v[..., :-1]), ValueError, "head_dim"),
    "v-seqlen": (lambda q, k, v: (q, k, v[:, :-1]), ValueError, "seqlen_k"),
    "v-heads": (lambda q, k, v: (q, k, v[:, :, :1]), ValueError, "heads_kv"),
    "heads-gqa": (lambda q, k, v: (q[:, :, :3], k, v), ValueError, "multiple of heads"),
    "q-int": (lambda q, k, v: (q.astype(np.int32), k, v), TypeError, "q must have a floating-point dtype"),
    "v-complex": (lambda q, k, v: (q, k, v.astype(np.complex64)), TypeError, "v must have a floating-point"),
}


@pytest.mark.parametrize("variant", list(registry.VARIANTS))
@pytest.mark.parametrize("case", MISUSE)
def test_reference_rejects_misuse(rng, variant, case):
    how, error, named = MISUSE[case]
    q, k, v = inputs(rng)
    args, kw = ((q, k, v), dict(how)) if isinstance(how, dict) else (how(q, k, v), {})
    kw.setdefault("causal", False)
    with pytest.raises(error, match=named):
        registry.get(variant).reference(*args, **kw)


@pytest.mark.parametrize("kw", [dict(causal="yes"), dict(softmax_scale=True), dict(softmax_scale=float("nan"))],
                         ids=["causal", "scale-type", "scale-value"])
def test_reference_and_attention_word_scalar_errors_alike(rng, kw):
    import fa_variants as fav
    q, k, v = (a.astype(np.float16) for a in inputs(rng))
    with pytest.raises((TypeError, ValueError)) as from_api:
        fav.attention(q, k, v, backend="numpy", **kw)
    with pytest.raises(from_api.type) as from_model:
        fa2.forward(q, k, v, **kw)
    assert str(from_model.value) == str(from_api.value)


# ---------------------------------------------------------------------------------------------- head dims

@pytest.mark.parametrize("d", [1, 7, 40, 59, 80, 111, 160, 192, 224, 256])
def test_paper_blocks_are_sane_for_every_head_dim(d):
    M = common.DEFAULT_SRAM
    B_r, B_c = common.resolve_blocks(d)
    assert (B_r, B_c) == common.paper_blocks(M, d)
    assert all(isinstance(b, int) and b >= 1 for b in (B_r, B_c))
    assert B_r <= min(B_c, d)
    assert 4 * (B_c - 1) * d < M <= 4 * B_c * d     # B_c = ceil(M / 4d): K, V, Q, O tiles fill M, no more


@pytest.mark.parametrize("name", FLOAT64_MODELS)
@pytest.mark.parametrize("d", [1, 40, 59, 111, 160, 224])
def test_any_head_dim_matches_float64(rng, name, d):
    q, k, v = inputs(rng, n_q=19, n_k=45, d=d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = MODELS[name](q, k, v, causal=True)         # the paper's blocks for this d
    assert_rows_match(name, res, *reference64(q, k, v, causal=True), np.ones((B, 19, H), bool))
