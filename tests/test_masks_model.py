"""The mask and logit-transform policies (reference/masks.py) in the NumPy models, forward and backward, against a
float64 reference written here from the definitions (the full score matrix, the mask applied elementwise), which
imports nothing from the library; its gradients are checked against finite differences. Also: the block questions
the models ask (which blocks, which need a mask) against brute force, varlen against per-sequence calls, the tiles
a window skips, and every bad mask argument refused. Inputs are fresh each run (``rng``: the seed is in a failed
test's report)."""
import functools
import warnings

import numpy as np
import pytest

from fa_variants.reference import fa1, fa2, fa3, masks, naive, varlen
from fa_variants.reference.budget import LongRunWarning

EXACT = 1e-12        # relative norm error of a float64 model against the float64 reference
GRAD_EXACT = 1e-10   # the same for gradients (a few more N-long sums)
FORWARDS = {"naive": naive.forward, "fa1": fa1.forward, "fa2": fa2.forward, "fa3": fa3.forward}
BACKWARDS = {"naive": naive.backward, "fa1": fa1.backward, "fa2": fa2.backward,
             "fa2_atomic": functools.partial(fa2.backward, dq_mode="atomic")}
BLOCKS = dict(block_q=8, block_k=16)


# ------------------------------------------------------------------------------------------ the yardstick

def visible_keys(n_q, n_k, causal, window):
    """(n_q, n_k) bool from the definitions: bottom-right causal j <= i + n_k - n_q; window i + diag - left <= j
    <= i + diag + right, -1 unbounded (flash-attn's docstring)."""
    i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    diag = n_k - n_q
    vis = np.ones((n_q, n_k), bool)
    if causal:
        vis &= j <= i + diag
    if window[0] >= 0:
        vis &= j >= i + diag - window[0]
    if window[1] >= 0:
        vis &= j <= i + diag + window[1]
    return vis


def reference(q, k, v, dout=None, *, causal=False, window=(-1, -1), softcap=0.0, sinks=None, alibi=None,
              scale=None):
    """Forward (and, with ``dout``, backward) in float64, one (batch, head) at a time, every score at once.

    T = softcap tanh(S / softcap) - slope |i + diag - j|, -inf where hidden; the sink is one more logit of each row,
    with no value. Backward from the softmax's Jacobian (D = rowsum(P o dP), not the models' rowsum(dO o O)),
    dS = dT (1 - tanh^2) under a softcap, dsink = -sum_i P_sink,i D_i. Returns a dict."""
    b, n_q, h, d = q.shape
    n_k, h_kv = k.shape[1], k.shape[2]
    group = h // h_kv
    scale = 1 / np.sqrt(d) if scale is None else scale
    vis = visible_keys(n_q, n_k, causal, window)
    dist = np.abs(np.arange(n_q)[:, None] + (n_k - n_q) - np.arange(n_k)[None, :])
    r = dict(out=np.zeros(q.shape), lse=np.full((b, h, n_q), -np.inf), dq=np.zeros(q.shape),
             dk=np.zeros(k.shape), dv=np.zeros(v.shape), dsinks=np.zeros(h))
    for bi in range(b):
        for hi in range(h):
            Q, K, V = q[bi, :, hi], k[bi, :, hi // group], v[bi, :, hi // group]
            S = Q @ K.T * scale
            T = softcap * np.tanh(S / softcap) if softcap else S.copy()
            if alibi is not None:
                T -= (alibi[hi] if alibi.ndim == 1 else alibi[bi, hi]) * dist
            T = np.where(vis, T, -np.inf)
            logits = T if sinks is None else np.concatenate([T, np.full((n_q, 1), sinks[hi])], axis=1)
            mx = logits.max(axis=1)
            mx = np.where(np.isneginf(mx), 0.0, mx)
            E = np.exp(logits - mx[:, None])
            Z = E.sum(axis=1)
            seen = Z > 0
            P = E / np.where(seen, Z, 1.0)[:, None]
            P_keys = P[:, :n_k]
            r["out"][bi, :, hi] = P_keys @ V
            with np.errstate(divide="ignore"):
                r["lse"][bi, hi] = np.where(seen, mx + np.log(np.where(seen, Z, 1.0)), -np.inf)
            if dout is None:
                continue
            dO = dout[bi, :, hi]
            dP = dO @ V.T
            D = (P_keys * dP).sum(axis=1)
            dS = P_keys * (dP - D[:, None])
            if softcap:
                dS = dS * (1 - np.tanh(S / softcap) ** 2)
            r["dq"][bi, :, hi] = dS @ K * scale
            r["dk"][bi, :, hi // group] += dS.T @ Q * scale
            r["dv"][bi, :, hi // group] += P_keys.T @ dO
            if sinks is not None:
                r["dsinks"][hi] -= (P[:, n_k] * D).sum()
    return r


def rel(a, b):
    den = np.linalg.norm(b)
    return np.linalg.norm(a - b) / (den if den > 0 else 1.0)


# ------------------------------------------------------------------------------------------ inputs and cases

def inputs(rng, batch, n_q, n_k, heads=4, heads_kv=2, d=8, scale=1.5):
    q = rng.standard_normal((batch, n_q, heads, d)) * scale
    k = rng.standard_normal((batch, n_k, heads_kv, d)) * scale
    v = rng.standard_normal((batch, n_k, heads_kv, d))
    return q, k, v


def mask_kw(rng, case, batch=2, heads=4):
    """The keywords of a named case (fresh slopes and sinks)."""
    slopes = rng.uniform(0.05, 0.5, heads).astype(np.float32)
    table = {
        "left window": dict(window=(5, -1)),
        "right window": dict(window=(-1, 3)),
        "causal window": dict(causal=True, window=(6, 2)),
        "diagonal only": dict(window=(0, 0)),
        "window past the sequence": dict(causal=True, window=(1000, 1000)),
        "softcap": dict(softcap=1.5),
        "alibi": dict(alibi_slopes=slopes),
        "alibi per batch": dict(causal=True, alibi_slopes=rng.uniform(0.05, 0.5, (batch, heads)).astype(np.float32)),
        "sinks": dict(sinks=rng.standard_normal(heads)),
        "everything": dict(causal=True, window=(7, 0), softcap=2.0, alibi_slopes=slopes,
                           sinks=rng.standard_normal(heads) + 2.0),
    }
    return table[case]


CASES = ["left window", "right window", "causal window", "diagonal only", "window past the sequence", "softcap",
         "alibi", "alibi per batch", "sinks", "everything"]
SIZES = [(1, 1), (1, 37), (37, 1), (37, 37), (45, 23), (23, 45)]


def ref_kw(kw):
    """The models' keywords as the reference's."""
    out = {k: v for k, v in kw.items() if k not in ("alibi_slopes",)}
    if "alibi_slopes" in kw:
        out["alibi"] = kw["alibi_slopes"].astype(np.float64)
    return out


def quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # no invalid-value / divide warnings from masked rows
        warnings.simplefilter("ignore", LongRunWarning)
        return fn(*args, **kw)


def assert_lse(got, want, where):
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), f"rows that see no key differ: {where}"
    seen = np.isfinite(want)
    np.testing.assert_allclose(got[seen], want[seen], rtol=1e-12, atol=1e-12, err_msg=where)


# ------------------------------------------------------------------------------------------ the yardstick itself

@pytest.mark.parametrize("case", ["everything", "alibi per batch", "right window"])
def test_reference_gradients_are_the_finite_differences(rng, case):
    """The reference's backward (written from the softmax's Jacobian) against central differences of its forward:
    L = sum(out o dout), a few entries of q, k, v and every sink."""
    q, k, v = inputs(rng, 2, 7, 9, heads=2, heads_kv=1, d=4)
    kw = ref_kw(mask_kw(rng, case, batch=2, heads=2))
    if "sinks" not in kw:
        kw["sinks"] = rng.standard_normal(2)
    dout = rng.standard_normal(q.shape)
    r = reference(q, k, v, dout, **kw)
    loss = lambda q_, k_, v_, s_: (reference(q_, k_, v_, **{**kw, "sinks": s_})["out"] * dout).sum()  # noqa: E731
    eps = 1e-6
    for name, arr, grad in (("q", q, r["dq"]), ("k", k, r["dk"]), ("v", v, r["dv"]), ("sinks", kw["sinks"], r["dsinks"])):
        flat = [np.unravel_index(i, arr.shape) for i in rng.choice(arr.size, min(arr.size, 6), replace=False)]
        for idx in flat:
            args = dict(q_=q, k_=k, v_=v, s_=kw["sinks"])
            key = {"q": "q_", "k": "k_", "v": "v_", "sinks": "s_"}[name]
            plus, minus = arr.copy(), arr.copy()
            plus[idx] += eps
            minus[idx] -= eps
            fd = (loss(**{**args, key: plus}) - loss(**{**args, key: minus})) / (2 * eps)
            assert abs(fd - grad[idx]) <= 1e-6 * max(1.0, abs(fd)), (name, idx, fd, grad[idx])


def test_reference_rows_with_no_key_and_a_sink():
    """A row that sees no key: out 0 and LSE -inf, or with a sink LSE = the sink's logit (FlashAttention-4's rule)."""
    q, k, v = inputs(np.random.default_rng(0), 1, 5, 2, heads=2, heads_kv=2)
    r = reference(q, k, v, causal=True)
    assert (r["out"][0, :3] == 0).all() and np.isneginf(r["lse"][0, :, :3]).all()
    r = reference(q, k, v, causal=True, sinks=np.array([0.5, -1.0]))
    assert (r["out"][0, :3] == 0).all() and np.array_equal(r["lse"][0, :, 0], [0.5, -1.0])


# ------------------------------------------------------------------------------------------ the models

@pytest.mark.parametrize("model", FORWARDS)
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_the_reference(rng, model, case):
    for n_q, n_k in SIZES:
        q, k, v = inputs(rng, 2, n_q, n_k)
        kw = mask_kw(rng, case)
        res = quiet(FORWARDS[model], q, k, v, **kw, **BLOCKS)
        want = reference(q, k, v, **ref_kw(kw))
        where = f"{model} {case} n_q={n_q} n_k={n_k}"
        assert rel(res.out, want["out"]) < EXACT, where
        assert_lse(res.lse, want["lse"], where)


@pytest.mark.parametrize("model", BACKWARDS)
@pytest.mark.parametrize("case", CASES)
def test_backward_matches_the_reference(rng, model, case):
    for n_q, n_k in SIZES:
        q, k, v = inputs(rng, 2, n_q, n_k)
        dout = rng.standard_normal(q.shape)
        kw = mask_kw(rng, case)
        want = reference(q, k, v, dout, **ref_kw(kw))
        res = quiet(BACKWARDS[model], dout, q, k, v, want["out"], want["lse"], **kw, **BLOCKS)
        where = f"{model} {case} n_q={n_q} n_k={n_k}"
        for name in ("dq", "dk", "dv"):
            assert rel(getattr(res, name), want[name]) < GRAD_EXACT, f"{name}: {where}"
        if "sinks" in kw:
            assert rel(res.dsinks, want["dsinks"]) < GRAD_EXACT, f"dsinks: {where}"
        else:
            assert res.dsinks is None


def test_fa3_with_its_own_tiles_and_lazy_rescaling(rng):
    """fa3's default tiles (128-row CTAs of two consumers, descending blocks) and lazy rescaling under every
    policy at once, over a window narrower than a tile."""
    q, k, v = inputs(rng, 1, 300, 260, heads=2, heads_kv=1, d=16)
    kw = dict(causal=True, window=(70, 0), softcap=2.0, alibi_slopes=np.array([0.1, 0.3], np.float32),
              sinks=np.array([1.0, -0.5]))
    res = quiet(fa3.forward, q, k, v, **kw)
    want = reference(q, k, v, **ref_kw(kw))
    assert rel(res.out, want["out"]) < EXACT
    assert_lse(res.lse, want["lse"], "fa3")


def test_models_agree_with_the_library_dense_reference(rng):
    """reference/dense.py (the CLI's and bench's yardstick) takes the same keywords and gives the same numbers."""
    from fa_variants.reference import dense
    q, k, v = inputs(rng, 2, 23, 31)
    dout = rng.standard_normal(q.shape)
    kw = mask_kw(rng, "everything")
    want = reference(q, k, v, dout, **ref_kw(kw))
    out, lse = dense.attention64(q, k, v, scale=1 / np.sqrt(8), **kw)
    assert rel(out.reshape(2, 4, 23, 8).transpose(0, 2, 1, 3), want["out"]) < EXACT
    assert_lse(lse.reshape(2, 4, 23), want["lse"], "dense")
    dq, dk, dv, dsinks = dense.reference_backward(dout, q, k, v, scale=1 / np.sqrt(8), **kw)
    for got, name in ((dq, "dq"), (dk, "dk"), (dv, "dv"), (dsinks, "dsinks")):
        assert rel(got, want[name]) < GRAD_EXACT, name


# ------------------------------------------------------------------------------------------ the block questions

MASKS = [dict(), dict(causal=True), dict(window=(5, -1)), dict(window=(-1, 4)), dict(causal=True, window=(9, 3)),
         dict(window=(0, 0)), dict(window=(2, 30))]


@pytest.mark.parametrize("kw", MASKS, ids=str)
@pytest.mark.parametrize("n_q,n_k", [(1, 1), (37, 37), (50, 20), (20, 50), (64, 64)])
@pytest.mark.parametrize("b_r,b_c", [(8, 16), (16, 8), (7, 5)])
def test_blocks_and_needs_mask_are_the_brute_force_answers(kw, n_q, n_k, b_r, b_c):
    """A Q block visits exactly the K blocks holding a key one of its rows sees; a visited block needs the mask
    exactly where some row misses one of its keys; q_blocks is blocks' transpose; first/last_key are the ends."""
    m = masks.Mask.of(n_q, n_k, **kw)
    vis = visible_keys(n_q, n_k, kw.get("causal", False), kw.get("window", (-1, -1)))
    assert np.array_equal(m.visible(slice(0, n_q), slice(0, n_k)), vis)
    pairs = set()
    for i, rows in enumerate(masks.block_slices(n_q, b_r)):
        want = [c for c in masks.block_slices(n_k, b_c) if vis[rows, c].any()]
        got = m.blocks(rows, b_c)
        assert got == want, (rows, got, want)
        assert m.blocks_and_masks(rows, b_c) == [(c, m.needs_mask(rows, c)) for c in got]
        for c in got:
            assert m.needs_mask(rows, c) == (not vis[rows, c].all()), (rows, c)
            pairs.add((rows.start, c.start))
        seen = np.nonzero(vis[rows].any(axis=0))[0]
        assert m.first_key(rows.start, rows.stop - 1) == (seen.min() if seen.size else -1)
        assert m.last_key(rows.start, rows.stop - 1) == (seen.max() if seen.size else -1)
    assert {(r.start, c.start) for c in m.key_blocks(b_c) for r in m.q_blocks(c, b_r)} == pairs
    assert m.pairs(b_r, b_c) == len(pairs)


def test_a_window_makes_the_masked_blocks_a_prefix_and_a_suffix():
    """fa3's descending visits under a causal window: masked blocks first (the diagonal's), unmasked ones, masked
    ones last (the window's left edge): the kernel's loop in three runs."""
    m = masks.Mask.of(1024, 1024, causal=True, window=(300, 0))
    visits = fa3.kv_visits(slice(512, 640), 1024, 1024, 64, True, m)
    flags = [needs for _, needs in visits]
    assert flags[0] and flags[-1] and not all(flags)
    first_clear, last_clear = flags.index(False), len(flags) - 1 - flags[::-1].index(False)
    assert not any(flags[first_clear:last_clear + 1]), flags


def test_key_length_for_a_kv_cache():
    """The KV-cache case (reference/decode.py's): a K tensor of 100 keys of which the first 37 are filled; the mask
    of seqlen_k = 37 never visits a block past key 36 and hides key 37 on (the bottom-right diagonal at 37)."""
    m = masks.Mask.of(4, 37, causal=True)
    assert m.blocks(slice(0, 4), 16) == [slice(0, 16), slice(16, 32), slice(32, 37)]
    vis = m.visible(slice(0, 4), slice(0, 48))
    assert np.array_equal(vis.sum(axis=1), [34, 35, 36, 37]) and not vis[:, 37:].any()
    assert masks.KeyLength(37) in m.restrictions


def test_a_window_visits_order_n_w_tiles():
    """A window of w keys over N visits about N w / (B_r B_c) tiles (plus the edges), not N^2 / (B_r B_c): at N
    32768, w 4096 at most 1.15 x (w / N) of the dense tiles, and doubling N doubles the count."""
    n, w, b = 32768, 4096, 128
    t = masks.tile_count(n, n, b, b, causal=True, window=(w, 0))
    assert t.visited <= 1.15 * (w / n) * t.dense, t
    assert t.visited <= (n // b) * (w // b + 2), t
    t2 = masks.tile_count(2 * n, 2 * n, b, b, causal=True, window=(w, 0))
    assert 1.9 * t.visited <= t2.visited <= 2.1 * t.visited, (t, t2)
    assert t.masked <= 2 * (n // b) + 1, t   # per Q block: the diagonal's and the window edge's


def test_the_models_count_only_the_tiles_they_visit(rng):
    """The IO counters follow the mask's tiles: under a window of 40 over 600 keys, fa2 reads the keys of the
    visited blocks only (its inner loop streams K), fa1 the query rows of the visited pairs only (its inner loop
    streams Q), a fraction of the dense call's."""
    q, k, v = inputs(rng, 1, 600, 600, heads=1, heads_kv=1, d=8)
    kw = dict(causal=True, window=(40, 0))
    m = masks.Mask.of(600, 600, **kw)
    pairs = [(rows, c) for rows in masks.block_slices(600, 32) for c in m.blocks(rows, 32)]
    for model, tensor, size in ((fa2.forward, "K", lambda r, c: c.stop - c.start),
                                (fa1.forward, "Q", lambda r, c: r.stop - r.start)):
        dense = quiet(model, q, k, v, block_q=32, block_k=32).hbm.by_tensor()[tensor]
        masked = quiet(model, q, k, v, block_q=32, block_k=32, **kw).hbm.by_tensor()[tensor]
        assert masked == 8 * sum(size(r, c) for r, c in pairs) < 0.2 * dense, (model, masked, dense)


# ------------------------------------------------------------------------------------------ varlen

def packed(rng, lens_q, lens_k, heads=4, heads_kv=2, d=8):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]), heads, d)) * 1.5
    k = rng.standard_normal((int(cu_k[-1]), heads_kv, d)) * 1.5
    v = rng.standard_normal((int(cu_k[-1]), heads_kv, d))
    return q, k, v, cu_q, cu_k


LENS = ([3, 0, 17, 1, 9, 0], [5, 4, 17, 0, 30, 0])  # zero-length queries, keys, both; length 1; n_q != n_k


@pytest.mark.parametrize("name", ["naive", "fa1", "fa2", "fa3"])
def test_varlen_is_the_per_sequence_reference(rng, name):
    q, k, v, cu_q, cu_k = packed(rng, *LENS)
    kw = mask_kw(rng, "everything", batch=len(LENS[0]))
    kw["alibi_slopes"] = rng.uniform(0.05, 0.5, (len(LENS[0]), 4)).astype(np.float32)   # one row per sequence
    res = quiet(varlen.forward, FORWARDS[name], q, k, v, cu_q, cu_k, **kw, **BLOCKS)
    assert res.out.shape == q.shape and res.lse.shape == (4, q.shape[0])
    for b in range(len(LENS[0])):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop == rows.start:
            continue
        if keys.stop == keys.start:   # no key: 0 and the sink's logit
            assert (res.out[rows] == 0).all() and np.array_equal(res.lse[:, rows], np.repeat(kw["sinks"][:, None],
                                                                                               rows.stop - rows.start, 1))
            continue
        want = reference(q[None, rows], k[None, keys], v[None, keys],
                         **ref_kw({**kw, "alibi_slopes": kw["alibi_slopes"][b]}))
        assert rel(res.out[rows], want["out"][0]) < EXACT, b
        assert_lse(res.lse[:, rows], want["lse"][0], f"sequence {b}")


@pytest.mark.parametrize("name", ["fa2", "fa1", "naive"])
def test_varlen_backward_is_the_per_sequence_reference(rng, name):
    q, k, v, cu_q, cu_k = packed(rng, *LENS)
    dout = rng.standard_normal(q.shape)
    kw = mask_kw(rng, "everything", batch=len(LENS[0]))
    fwd = quiet(varlen.forward, fa2.forward, q, k, v, cu_q, cu_k, **kw, **BLOCKS)
    res = quiet(varlen.backward, BACKWARDS[name], dout, q, k, v, fwd.out, fwd.lse, cu_q, cu_k, **kw, **BLOCKS)
    dsinks = np.zeros(4)
    for b in range(len(LENS[0])):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop == rows.start or keys.stop == keys.start:
            assert (res.dq[rows] == 0).all() and (res.dk[keys] == 0).all()
            continue
        want = reference(q[None, rows], k[None, keys], v[None, keys], dout[None, rows], **ref_kw(kw))
        for got, wanted in ((res.dq[rows], want["dq"][0]), (res.dk[keys], want["dk"][0]),
                            (res.dv[keys], want["dv"][0])):
            assert rel(got, wanted) < GRAD_EXACT, b
        dsinks += want["dsinks"]
    assert rel(res.dsinks, dsinks) < GRAD_EXACT


def test_varlen_costs_its_sequences(rng):
    """A packed batch's K reads are the sum of its sequences' (each cut at its own length), far below a padded
    batch's: 4 sequences of 8 to 200 tokens, causal."""
    lens = [8, 200, 30, 64]
    q, k, v, cu_q, cu_k = packed(rng, lens, lens, heads=1, heads_kv=1)
    res = quiet(varlen.forward, fa2.forward, q, k, v, cu_q, cu_k, causal=True, **BLOCKS)
    alone = sum(quiet(fa2.forward, q[None, a:b], k[None, a:b], v[None, a:b], causal=True, **BLOCKS)
                .hbm.by_tensor()["K"] for a, b in zip(cu_q[:-1], cu_q[1:]))
    assert res.hbm.by_tensor()["K"] == alone
    t = masks.tile_count(lens, lens, 8, 16, causal=True)
    assert t.visited < 0.4 * t.dense, t


# ------------------------------------------------------------------------------------------ refusals

@pytest.mark.parametrize("kw,error,match", [
    (dict(window=(-2, 0)), ValueError, "window"),
    (dict(window=(3,)), TypeError, "window"),
    (dict(window=(1.5, 0)), TypeError, "window"),
    (dict(window=(True, 0)), TypeError, "window"),
    (dict(window="left"), TypeError, "window"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap=True), TypeError, "softcap"),
    (dict(softcap="30"), TypeError, "softcap"),
    (dict(sinks=np.zeros(3)), ValueError, "sinks"),
    (dict(sinks=np.zeros((1, 4))), ValueError, "sinks"),
    (dict(sinks=np.zeros(4, np.int32)), TypeError, "sinks"),
    (dict(sinks=[0.0] * 4), TypeError, "sinks"),
    (dict(alibi_slopes=np.zeros(3, np.float32)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=np.zeros((3, 4), np.float32)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=np.zeros(4, np.int64)), TypeError, "alibi_slopes"),
])
@pytest.mark.parametrize("model", ["naive", "fa1", "fa2", "fa3"])
def test_bad_mask_arguments_are_refused(rng, model, kw, error, match):
    q, k, v = inputs(rng, 2, 5, 6)
    with pytest.raises(error, match=match):
        FORWARDS[model](q, k, v, **kw)


@pytest.mark.parametrize("cu_q,cu_k,error,match", [
    ([0, 3, 2, 9], [0, 2, 4, 9], ValueError, "cu_seqlens_q must be non-decreasing"),
    ([0, 3, 5, 9], [0, 2, 4, 10], ValueError, "cu_seqlens_k ends at 10, beyond the 9 rows"),
    ([0, 3, 5, 10], [0, 2, 4, 9], ValueError, "cu_seqlens_q ends at 10"),
    ([1, 3, 5, 9], [0, 2, 4, 9], ValueError, "cu_seqlens_q must start at 0"),
    ([0, 3, 9], [0, 2, 4, 9], ValueError, "same batch"),
    ([9], [9], ValueError, "batch >= 1"),
])
def test_bad_cu_seqlens_are_refused(rng, cu_q, cu_k, error, match):
    q, k, v, _, _ = packed(rng, [3, 2, 4], [2, 2, 5])
    with pytest.raises(error, match=match):
        varlen.forward(fa2.forward, q, k, v, np.array(cu_q, np.int32), np.array(cu_k, np.int32))


def test_cu_seqlens_must_be_int32(rng):
    q, k, v, cu_q, cu_k = packed(rng, [3, 2], [2, 2])
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        varlen.forward(fa2.forward, q, k, v, cu_q.astype(np.int64), cu_k)
    with pytest.raises(TypeError, match="cu_seqlens_k must be an int32 array"):
        varlen.forward(fa2.forward, q, k, v, cu_q, [0, 2, 4])
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        varlen.forward(fa2.forward, q, k, v, cu_q, cu_k, alibi_slopes=np.zeros((3, 4), np.float32))


# ------------------------------------------------------------------------------------------ explain

def test_explain_mask_prints_the_tile_counts(capsys):
    from fa_variants import cli
    assert cli.main(["explain", "mask", "--seqlen", "4096", "--causal", "--window", "512", "0",
                     "--blocks", "128x64"]) == 0
    t = masks.tile_count(4096, 4096, 128, 64, causal=True, window=(512, 0))
    text = capsys.readouterr().out
    assert "window (512, 0) over seqlen 4096; tiles 128x64" in text
    assert f"tiles computed: {t.visited:,} of {t.dense:,} dense" in text and f"{t.masked:,} of them" in text
    assert cli.main(["explain", "mask", "--seqlens", "100,0,900", "--blocks", "64x64"]) == 0
    assert "tiles computed: 229 of 675 dense" in capsys.readouterr().out   # 2 x 2 + 15 x 15 of 3 x 15 x 15
    with pytest.raises(SystemExit, match="--window"):
        cli.main(["explain", "mask", "--window", "-2", "0"])
    # without --blocks: the tiles of the masked forward that would run (fa3's on sm_90, fa2's on sm_80)
    assert cli.main(["explain", "mask", "--head-dim", "128", "--causal", "--device-cc", "90"]) == 0
    assert "tiles 128x128 (fa3's masked kernel tiles at d=128, sm_90)" in capsys.readouterr().out
    from fa_variants.kernels import fa2_masked
    from fa_variants.kernels.common import SMEM_BY_CC
    assert cli.main(["explain", "mask", "--head-dim", "100", "--device-cc", "86"]) == 0
    b_r, b_c = fa2_masked.tiles(100, SMEM_BY_CC[86])
    assert f"tiles {b_r}x{b_c} (fa2's masked kernel tiles at d=100, sm_86)" in capsys.readouterr().out
