"""The NumPy backward models against a float64 backward written here from the definition (and torch autograd
in float64 where torch imports): they must agree to float64 rounding, whatever the loop order, block sizes,
masking or head grouping. Inputs are fresh each run (``rng``: the seed is in a failed test's report)."""
import functools
import warnings

import ml_dtypes
import numpy as np
import pytest

from fa_variants import registry
from fa_variants.reference import dense, fa1, fa2, naive

MODELS = {"naive": naive.backward, "fa1": fa1.backward, "fa2": fa2.backward,
          "fa2_atomic": functools.partial(fa2.backward, dq_mode="atomic")}
EXACT = 1e-10   # relative norm error: float64 rounding of a few N-long sums is ~1e-15; 1e-10 still catches a slip


# ------------------------------------------------------------------------------------------ the yardstick

def dense_attention_grads(dout, q, k, v, causal, softmax_scale=None):
    """(out, lse, dq, dk, dv) in float64, one head at a time from the definition, sharing no code with the
    library: P = softmax(q k^T scale) with the bottom-right causal mask, O = P V, and the softmax's Jacobian
    dS = P o (dP - rowsum(P o dP)) (the models use rowsum(dO o O)). Plain float arithmetic: a row that sees no
    key has P = 0 (out 0, lse -inf, zero gradients); a NaN reaches whatever its row's P reaches."""
    b, n_q, h, d = q.shape
    n_k, h_kv = k.shape[1], k.shape[2]
    group = h // h_kv
    scale = 1 / np.sqrt(d) if softmax_scale is None else softmax_scale
    visible = np.ones((n_q, n_k), bool)
    if causal:
        visible = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + n_k - n_q
    out, dq = np.zeros((b, n_q, h, d)), np.zeros((b, n_q, h, d))
    dk, dv = np.zeros((b, n_k, h_kv, d)), np.zeros((b, n_k, h_kv, d))
    lse = np.full((b, h, n_q), -np.inf)
    f64 = functools.partial(np.asarray, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        for bi in range(b):
            for hi in range(h):
                Q, K, V, dO = f64(q[bi, :, hi]), f64(k[bi, :, hi // group]), f64(v[bi, :, hi // group]), \
                    f64(dout[bi, :, hi])
                S = np.where(visible, Q @ K.T * scale, -np.inf)
                mx = S.max(axis=1)
                mx = np.where(mx == -np.inf, 0.0, mx)
                E = np.exp(S - mx[:, None])
                l = E.sum(axis=1)
                empty = l == 0
                P = E / np.where(empty, 1.0, l)[:, None]
                out[bi, :, hi] = P @ V
                lse[bi, hi] = np.where(empty, -np.inf, mx + np.log(np.where(empty, 1.0, l)))
                dP = dO @ V.T
                dS = P * (dP - (P * dP).sum(axis=1, keepdims=True))
                dq[bi, :, hi] = dS @ K * scale
                dk[bi, :, hi // group] += dS.T @ Q * scale
                dv[bi, :, hi // group] += P.T @ dO
    return out, lse, dq, dk, dv


def inputs(rng, batch, n_q, n_k, heads, heads_kv, d, scale=1.0):
    q = rng.standard_normal((batch, n_q, heads, d)) * scale
    k = rng.standard_normal((batch, n_k, heads_kv, d)) * scale
    v = rng.standard_normal((batch, n_k, heads_kv, d))
    dout = rng.standard_normal((batch, n_q, heads, d))
    return dout, q, k, v


def rel(a, b):
    nb = np.linalg.norm(b)
    assert nb > 0, "reference is all zeros: such a comparison cannot fail"
    return np.linalg.norm(a - b) / nb


def run(name, dout, q, k, v, out, lse, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no divide-by-zero / invalid-value warnings, masked rows included
        return MODELS[name](dout, q, k, v, out, lse, **kw)


def check(name, dout, q, k, v, causal, exact=EXACT, **kw):
    """Run ``name`` on the yardstick's own out and lse and compare dq, dk, dv; returns the model's result."""
    out, lse, dq, dk, dv = dense_attention_grads(dout, q, k, v, causal, kw.get("softmax_scale"))
    res = run(name, dout, q, k, v, out, lse, causal=causal, **kw)
    where = f"{name} q{q.shape} k{k.shape} causal={causal} {kw}"
    for got, want, arg in ((res.dq, dq, q), (res.dk, dk, k), (res.dv, dv, v)):
        assert got.dtype == np.float64 and got.shape == arg.shape, where
        assert np.isfinite(got).all(), where
        if not want.any():   # one visible key per row (N_k = 1): P = 1, dS = 0 exactly, so dq = dk = 0 ...
            assert np.abs(got).max() < 1e-13, where   # ... up to D = rowsum(dO o O)'s rounding in the models
            continue
        err = rel(got, want)
        assert err < exact, f"relative error {err:.2e}: {where}"
    return res


# ------------------------------------------------------------------------------------------ exactness

@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("n_q,n_k", [(1, 1), (1, 37), (37, 1), (37, 37), (100, 37), (37, 100), (100, 100)])
@pytest.mark.parametrize("causal", [False, True])
def test_odd_sizes(rng, name, n_q, n_k, causal):
    dout, q, k, v = inputs(rng, 2, n_q, n_k, 3, 3, 16)
    res = check(name, dout, q, k, v, causal, block_q=16, block_k=24)
    assert res.blocks == (None if name == "naive" else (16, 24))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("d", [1, 40, 64, 111])
@pytest.mark.parametrize("n_q,n_k", [(37, 100), (100, 37)])
def test_head_dims_with_paper_blocks(rng, name, d, n_q, n_k):
    dout, q, k, v = inputs(rng, 1, n_q, n_k, 2, 2, d)
    check(name, dout, q, k, v, True)    # default blocks: paper_blocks(DEFAULT_SRAM, d)
    check(name, dout, q, k, v, False, block_q=13, block_k=29)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("heads,heads_kv", [(8, 2), (4, 1)])  # GQA 4:1 and MQA
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_mqa_sum_over_the_group(rng, name, heads, heads_kv, causal):
    dout, q, k, v = inputs(rng, 2, 45, 70, heads, heads_kv, 32)
    res = check(name, dout, q, k, v, causal, block_q=7, block_k=13)
    # the same call with k, v given to every query head: its dk, dv per query head sum to the grouped ones
    group = heads // heads_kv
    full = run(name, dout, q, np.repeat(k, group, axis=2), np.repeat(v, group, axis=2),
               *dense_attention_grads(dout, q, k, v, causal)[:2], causal=causal, block_q=7, block_k=13)
    for grouped, per_head in ((res.dk, full.dk), (res.dv, full.dv)):
        summed = per_head.reshape(*per_head.shape[:2], heads_kv, group, per_head.shape[3]).sum(axis=3)
        np.testing.assert_allclose(grouped, summed, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("name", MODELS)
def test_deterministic(rng, name):
    """The GQA sum and every accumulation run in a fixed order: the same call gives the same bits."""
    dout, q, k, v = inputs(rng, 1, 50, 60, 4, 1, 16)
    out, lse = dense_attention_grads(dout, q, k, v, True)[:2]
    a, b = (run(name, dout, q, k, v, out, lse, causal=True, block_q=8, block_k=16) for _ in range(2))
    for x, y in ((a.dq, b.dq), (a.dk, b.dk), (a.dv, b.dv)):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("block_q,block_k", [(1, 1), (3, 5), (64, 7), (128, 256)])
def test_block_sizes_that_do_not_divide(rng, name, block_q, block_k):
    dout, q, k, v = inputs(rng, 1, 61, 83, 2, 1, 8)
    check(name, dout, q, k, v, True, block_q=block_q, block_k=block_k)


@pytest.mark.parametrize("name", MODELS)
def test_large_scores_and_a_given_scale(rng, name):
    dout, q, k, v = inputs(rng, 1, 100, 100, 2, 2, 32, scale=30.0)   # scores in the thousands
    # exp(s - lse) with |s| ~ 3000 carries ~3000 ulp of relative error per element, and dS = P (dP - D) cancels:
    # measured up to 1.01e-10 against the dense yardstick (a CI run), so this case gets 1e-8
    check(name, dout, q, k, v, False, exact=1e-8, block_q=16, block_k=32)
    check(name, dout, q, k, v, True, exact=1e-8, block_q=16, block_k=32, softmax_scale=0.05)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_input_dtypes(rng, name, dtype):
    """Half and single precision inputs (lse as the kernels return it: float32) are widened; float64 out."""
    dout, q, k, v = (a.astype(dtype) for a in inputs(rng, 1, 33, 40, 2, 2, 16))
    out, lse, dq, dk, dv = dense_attention_grads(dout, q, k, v, True, 0.3)
    res = run(name, dout, q, k, v, out.astype(dtype), lse.astype(np.float32), causal=True, block_q=8,
              block_k=16, softmax_scale=0.3)
    for got, want in ((res.dq, dq), (res.dk, dk), (res.dv, dv)):
        assert got.dtype == np.float64
        assert rel(got, want) < 1e-2   # only out's and lse's roundings separate them


def test_models_agree_with_each_other(rng):
    dout, q, k, v = inputs(rng, 1, 300, 300, 2, 1, 64)
    out, lse = dense_attention_grads(dout, q, k, v, True)[:2]
    res = [run(n, dout, q, k, v, out, lse, causal=True, block_q=32, block_k=48) for n in MODELS]
    for r in res[1:]:
        for got, want in ((r.dq, res[0].dq), (r.dk, res[0].dk), (r.dv, res[0].dv)):
            np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)


def test_against_torch_autograd(rng):
    """torch's own autograd of dense float64 attention, when torch imports (the project's CI has none)."""
    torch = pytest.importorskip("torch")
    for n_q, n_k, causal, heads, heads_kv in ((37, 100, True, 4, 2), (100, 37, True, 4, 1), (61, 61, False, 2, 2)):
        dout, q, k, v = inputs(rng, 2, n_q, n_k, heads, heads_kv, 24)
        group = heads // heads_kv
        tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
        Q = tq.permute(0, 2, 1, 3)
        K, V = (t.permute(0, 2, 1, 3).repeat_interleave(group, dim=1) for t in (tk, tv))
        S = Q @ K.transpose(-1, -2) / np.sqrt(24)
        if causal:
            mask = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + n_k - n_q
            S = S.masked_fill(~mask, float("-inf"))
        # a row that sees no key: torch's softmax of all -inf is NaN, and its autograd would spread it; such a
        # row gets weight 0 here instead (its output 0, as the library's), so torch stays NaN-free
        live = torch.isfinite(S).any(dim=-1, keepdim=True)
        lse = torch.logsumexp(S, dim=-1).detach().numpy()
        P = torch.softmax(S.masked_fill(~live, 0.0), dim=-1) * live
        out = (P @ V).permute(0, 2, 1, 3)
        out.backward(torch.tensor(dout))
        for name in MODELS:
            res = run(name, dout, q, k, v, out.detach().numpy(), lse, causal=causal, block_q=16, block_k=24)
            for got, t in ((res.dq, tq), (res.dk, tk), (res.dv, tv)):
                assert rel(got, t.grad.numpy()) < EXACT, (name, n_q, n_k, causal)


def test_dense_reference_backward_is_the_definition(rng):
    """reference/dense.py's backward (for the CLI and the bench) against this file's, GQA and empty rows."""
    for n_q, n_k, causal in ((50, 20, True), (37, 100, True), (40, 40, False)):
        dout, q, k, v = inputs(rng, 2, n_q, n_k, 4, 2, 16)
        _, _, dq, dk, dv = dense_attention_grads(dout, q, k, v, causal, 0.25)
        got = dense.reference_backward(dout, q, k, v, causal=causal, scale=0.25)
        for g, w in zip(got, (dq, dk, dv)):
            assert rel(g, w) < 1e-13


def test_registry_points_at_the_models():
    for name, model in (("naive", naive), ("fa1", fa1), ("fa2", fa2)):
        assert registry.get(name).reference_backward is model.backward
        assert isinstance(model.LOOPS_BACKWARD, str) and model.LOOPS_BACKWARD
    assert registry.get("fa2_fp8").reference_backward is None


# ------------------------------------------------------------------------------------------ bad values

@pytest.mark.parametrize("name", MODELS)
def test_rows_without_keys_get_zero_gradients(rng, name):
    dout, q, k, v = inputs(rng, 2, 50, 20, 2, 2, 16)  # causal, N_q > N_k: rows 0..29 see no key
    res = check(name, dout, q, k, v, True, block_q=8, block_k=8)
    assert (res.dq[:, :30] == 0).all() and (res.dq[:, 30:] != 0).any()


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_q_reaches_its_dq_row_only(rng, name, causal):
    B, NQ, NK, H, HKV, D = 2, 21, 37, 4, 2, 16
    dout, q, k, v = inputs(rng, B, NQ, NK, H, HKV, D)
    clean = dense_attention_grads(dout, q, k, v, causal)
    b, r, h = 1, int(rng.integers(NQ)), int(rng.integers(H))
    q[b, r, h, int(rng.integers(D))] = np.nan
    out, lse = dense_attention_grads(dout, q, k, v, causal)[:2]     # the forward's NaN row: out and lse NaN
    assert np.isnan(out[b, r, h]).all() and np.isnan(lse[b, h, r])
    res = run(name, dout, q, k, v, out, lse, causal=causal, block_q=8, block_k=16)
    assert np.isnan(res.dq[b, r, h]).all()
    keep = np.ones((B, NQ, H), bool)
    keep[b, r, h] = False
    assert np.isfinite(res.dq[keep]).all() and rel(res.dq[keep], clean[2][keep]) < EXACT
    # dk, dv: the NaN reaches kv head h // (H / HKV) of batch b (through dS^T Q and P^T dO), and nothing else
    hk = h // (H // HKV)
    seen = np.arange(NK) <= r + NK - NQ if causal else np.ones(NK, bool)
    for got, want in ((res.dk, clean[3]), (res.dv, clean[4])):
        assert np.isnan(got[b, seen, hk]).all()
        other = np.ones((B, HKV), bool)
        other[b, hk] = False
        assert np.isfinite(got.transpose(0, 2, 1, 3)[other]).all()
        assert rel(got.transpose(0, 2, 1, 3)[other], want.transpose(0, 2, 1, 3)[other]) < EXACT


# ------------------------------------------------------------------------------------------ misuse

def _args(rng):
    dout, q, k, v = inputs(rng, 1, 8, 8, 2, 2, 16)
    out, lse = dense_attention_grads(dout, q, k, v, False)[:2]
    return dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("change,error,match", [
    (dict(dout="shape"), ValueError, "dout must have q's shape"),
    (dict(out="shape"), ValueError, "out must have q's shape"),
    (dict(lse="shape"), ValueError, r"lse must have shape \(batch, heads, seqlen_q\)"),
    (dict(lse="int"), TypeError, "lse must have a floating-point dtype"),
    (dict(dout="complex"), TypeError, "dout must have a floating-point dtype"),
    (dict(out="int"), TypeError, "out must have a floating-point dtype"),
    (dict(q="int"), TypeError, "q must have a floating-point dtype"),
    (dict(k="heads", v="heads"), ValueError, "multiple"),
    (dict(q="rank"), ValueError, "q must have 4 dimensions"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a real number"),
    (dict(block_q=0), ValueError, "block_q must be an int >= 1"),
    (dict(block_k=True), TypeError, "block_k must be an int >= 1"),
])
def test_misuse_names_the_argument(rng, name, change, error, match):
    a = _args(rng)
    kw = {}
    for arg, how in change.items():
        if arg in a:
            x = a[arg]
            a[arg] = {"shape": x[..., :-1], "int": x.astype(np.int32),
                      "complex": x.astype(np.complex128), "heads": np.repeat(x, 3, axis=2)[:, :, :3],
                      "rank": x[0]}[how]
        else:
            kw[arg] = how
    with pytest.raises(error, match=match):
        MODELS[name](a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], **kw)


def test_fa2_dq_mode_is_checked(rng):
    a = _args(rng)
    for bad in ("fast", None, 1):
        with pytest.raises(ValueError, match="dq_mode must be one of"):
            fa2.backward(*a.values(), dq_mode=bad)
