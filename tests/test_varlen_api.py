"""fav.attention_varlen and the mask keywords of fav.attention / fav.attention_backward on host arrays: the NumPy
models behind them, against the float64 reference of tests/test_masks_model.py (written from the definitions,
its gradients checked by finite differences) and against per-sequence calls; a window that hides nothing more than
causal takes the plain path; every bad argument is refused, naming it, before any work; what no GPU kernel takes
(variants other than fa2 and fa3) is refused with NotImplementedError (tests/test_varlen_gpu.py runs the masked
kernels). Inputs are fresh each run (``rng``: the seed is in a failed test's
report)."""
import numpy as np
import pytest
from conftest import DTYPES, GRAD_TOL, TOL, has_gpu, rel_err
from test_masks_model import reference, visible_keys

import fa_variants as fav
from fa_variants import varlen as fa_varlen
from fa_variants.reference import masks

LENS_Q = [3, 0, 17, 1, 9, 0, 4]   # zero-length queries, keys, both; length 1; seqlen_q != seqlen_k
LENS_K = [5, 4, 17, 0, 30, 0, 1]
H, HKV, D = 4, 2, 16


def packed(rng, dtype="float16", lens_q=LENS_Q, lens_k=LENS_K):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    dt = DTYPES[dtype]
    q = (rng.standard_normal((int(cu_q[-1]), H, D)) * 1.5).astype(dt)
    k = (rng.standard_normal((int(cu_k[-1]), HKV, D)) * 1.5).astype(dt)
    v = rng.standard_normal((int(cu_k[-1]), HKV, D)).astype(dt)
    return q, k, v, cu_q, cu_k


def masks_kw(rng, batch):
    """Every policy at once: a causal window, a softcap, ALiBi per sequence, sinks."""
    return dict(causal=True, window=(6, 0), softcap=3.0,
                alibi_slopes=rng.uniform(0.05, 0.5, (batch, H)).astype(np.float32),
                sinks=rng.standard_normal(H).astype(np.float32) + 1.0)


def ref_kw(kw, b=None):
    out = {n: x for n, x in kw.items() if n != "alibi_slopes"}
    if "sinks" in out:
        out["sinks"] = out["sinks"].astype(np.float64)
    if "alibi_slopes" in kw:
        slopes = kw["alibi_slopes"]
        out["alibi"] = (slopes if b is None or slopes.ndim == 1 else slopes[b]).astype(np.float64)
    return out


def f64(a):
    return np.asarray(a).astype(np.float64)


# ------------------------------------------------------------------------------------------ varlen forward

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("variant", ["auto", "fa1", "fa3"])
def test_varlen_matches_the_reference_per_sequence(rng, dtype, variant):
    q, k, v, cu_q, cu_k = packed(rng, dtype)
    kw = masks_kw(rng, len(LENS_Q))
    out, lse = fav.attention_varlen(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), return_lse=True,
                                    variant=variant, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (H, q.shape[0])
    for b in range(len(LENS_Q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.start == rows.stop:
            continue
        if keys.start == keys.stop:   # no key: out 0, lse = the sink's logit
            assert (f64(out[rows]) == 0).all()
            np.testing.assert_allclose(lse[:, rows], np.repeat(kw["sinks"][:, None], rows.stop - rows.start, 1))
            continue
        want = reference(f64(q[None, rows]), f64(k[None, keys]), f64(v[None, keys]), **ref_kw(kw, b))
        assert rel_err(out[None, rows], want["out"]) <= TOL[dtype], b
        np.testing.assert_allclose(lse[:, rows], want["lse"][0], rtol=1e-5, atol=1e-5)


def test_varlen_is_attention_per_sequence(rng):
    """A packed call gives, row for row, what attention() gives on each sequence alone (same model, same
    masks): bit for bit."""
    q, k, v, cu_q, cu_k = packed(rng)
    kw = dict(causal=True, window=(5, 2), softcap=2.0, sinks=rng.standard_normal(H).astype(np.float32))
    out, lse = fav.attention_varlen(q, k, v, cu_q, cu_k, 17, 30, return_lse=True, **kw)
    for b in range(len(LENS_Q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.start == rows.stop or keys.start == keys.stop:
            continue
        o, l = fav.attention(q[None, rows], k[None, keys], v[None, keys], return_lse=True, backend="numpy", **kw)
        assert np.array_equal(out[rows], o[0]) and np.array_equal(lse[:, rows], l[0]), b


def test_rows_past_the_last_sequence_and_an_empty_batch(rng):
    """Rows of q past cu_seqlens_q[-1] belong to no sequence: 0 and -inf. Every sequence empty: empty results."""
    q, k, v, cu_q, cu_k = packed(rng, lens_q=[3, 2], lens_k=[4, 4])
    cu_q_short = np.array([0, 3, 4], np.int32)
    out, lse = fav.attention_varlen(q, k, v, cu_q_short, cu_k, 3, 4, return_lse=True)
    assert (f64(out[4:]) == 0).all() and np.isneginf(lse[:, 4:]).all() and np.isfinite(lse[:, :4]).all()
    q0, k0 = np.zeros((0, H, D), np.float16), np.zeros((0, HKV, D), np.float16)
    zero = np.zeros(3, np.int32)
    out, lse = fav.attention_varlen(q0, k0, k0, zero, zero, 0, 0, return_lse=True)
    assert out.shape == (0, H, D) and lse.shape == (H, 0)


# ------------------------------------------------------------------------------------------ masks on attention()

CASES = {
    "window": dict(window=(4, 3)),
    "window past the sequence, causal": dict(causal=True, window=(500, 500)),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi_slopes=np.array([0.1, 0.2, 0.4, 0.8], np.float32)),
    "sinks": dict(sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("n_q,n_k", [(1, 1), (37, 23), (23, 37)])
def test_attention_and_its_backward_with_masks(rng, case, n_q, n_k):
    kw = CASES[case]
    q = (rng.standard_normal((2, n_q, H, D)) * 1.5).astype(np.float16)
    k = (rng.standard_normal((2, n_k, HKV, D)) * 1.5).astype(np.float16)
    v = rng.standard_normal((2, n_k, HKV, D)).astype(np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    want = reference(f64(q), f64(k), f64(v), f64(dout), **ref_kw(kw))
    out, lse = fav.attention(q, k, v, return_lse=True, backend="numpy", **kw)
    if np.linalg.norm(want["out"]) > 0:
        assert rel_err(out, want["out"]) <= TOL["float16"], case
    assert np.array_equal(np.isneginf(lse), np.isneginf(want["lse"]))
    grads = fav.attention_backward(dout, q, k, v, out, lse, backend="numpy", **kw)
    assert len(grads) == (4 if "sinks" in kw else 3)
    for got, name in zip(grads, ("dq", "dk", "dv", "dsinks")):
        assert got.dtype == (kw["sinks"].dtype if name == "dsinks" else q.dtype)
        if np.linalg.norm(want[name]) > 0:
            assert rel_err(got, want[name]) <= GRAD_TOL["float16"], (case, name)


def test_varlen_backward_is_the_per_sequence_backward(rng):
    q, k, v, cu_q, cu_k = packed(rng)
    kw = masks_kw(rng, len(LENS_Q))
    out, lse = fav.attention_varlen(q, k, v, cu_q, cu_k, 17, 30, return_lse=True, **kw)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    dq, dk, dv, dsinks = fav.attention_backward(dout, q, k, v, out, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                max_seqlen_q=17, max_seqlen_k=30, **kw)
    assert dq.shape == q.shape and dk.shape == k.shape and dsinks.shape == (H,) and dsinks.dtype == np.float32
    total = np.zeros(H)
    for b in range(len(LENS_Q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.start == rows.stop or keys.start == keys.stop:
            assert (f64(dq[rows]) == 0).all() and (f64(dk[keys]) == 0).all()
            continue
        seq_kw = {**kw, "alibi_slopes": kw["alibi_slopes"][b]}
        g = fav.attention_backward(dout[None, rows], q[None, rows], k[None, keys], v[None, keys], out[None, rows],
                                   lse[None, :, rows], backend="numpy", **seq_kw)
        for got, one in zip((dq[rows], dk[keys], dv[keys]), g[:3]):
            assert np.array_equal(got, one[0]), b
        total += g[3]
    np.testing.assert_allclose(dsinks, total, rtol=1e-5, atol=1e-6)


def test_a_window_that_hides_nothing_more_takes_the_plain_path(rng, monkeypatch):
    """window (N, 0) and (-1, 0) are causal; (N, N) is no mask: attention() runs them as the plain call (so the GPU
    kernels serve them); the reduction agrees with the elementwise masks everywhere."""
    q = rng.standard_normal((1, 9, H, D)).astype(np.float16)
    k = rng.standard_normal((1, 7, HKV, D)).astype(np.float16)
    for window, causal in (((100, 0), True), ((-1, 0), True), ((6, 8), False), ((-1, -1), False)):
        assert np.array_equal(fav.attention(q, k, k, window=list(window), backend="numpy"),
                              fav.attention(q, k, k, causal=causal, backend="numpy"))
    called = []
    monkeypatch.setattr(fa_varlen, "_model", lambda *a, **kw: called.append(a))
    fav.attention(q, k, k, window=(100, 0), backend="numpy")
    assert not called, "a reducible window went through the masked path"
    with pytest.raises(AttributeError):   # (the masked path does call it)
        fav.attention(q, k, k, window=(2, 0), backend="numpy")
    assert called


@pytest.mark.parametrize("n_q,n_k", [(1, 1), (1, 9), (9, 1), (7, 7), (5, 12), (12, 5)])
def test_window_as_causal_is_exact(n_q, n_k):
    """window_as_causal returns a flag exactly when the window's visibility is a plain call's."""
    plain = {c: visible_keys(n_q, n_k, c, (-1, -1)) for c in (False, True)}
    for causal in (False, True):
        for left in range(-1, n_k + 2):
            for right in range(-1, n_q + 2):
                vis = visible_keys(n_q, n_k, causal, (left, right))
                got = masks.window_as_causal(n_q, n_k, causal, (left, right))
                same = [c for c in (False, True) if np.array_equal(vis, plain[c])]
                if got is None:
                    assert not same, (causal, left, right)
                else:
                    assert got in same, (causal, left, right, got)


# ------------------------------------------------------------------------------------------ refusals

def call_varlen(rng, **over):
    q, k, v, cu_q, cu_k = packed(rng, lens_q=[3, 2, 4], lens_k=[2, 2, 5])
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4, max_seqlen_k=5)
    args.update(over)
    before = {n: np.array(a, copy=True) for n, a in args.items() if isinstance(a, np.ndarray)}
    try:
        fav.attention_varlen(**args)
    finally:
        for n, a in before.items():
            assert np.array_equal(args[n], a), f"{n} was modified"


I32 = lambda *x: np.array(x, np.int32)  # noqa: E731


@pytest.mark.parametrize("over,error,match", [
    (dict(cu_seqlens_q=I32(0, 3, 2, 9)), ValueError, "cu_seqlens_q must be non-decreasing"),
    (dict(cu_seqlens_k=I32(0, 2, 4, 10)), ValueError, "cu_seqlens_k ends at 10, beyond the 9 rows"),
    (dict(cu_seqlens_q=np.array([0, 3, 5, 9], np.int64)), TypeError, "cu_seqlens_q must have dtype int32"),
    (dict(cu_seqlens_k=[0, 2, 4, 9]), TypeError, "cu_seqlens_k must be a NumPy or CuPy array"),
    (dict(cu_seqlens_q=None), TypeError, "cu_seqlens_q is required"),
    (dict(cu_seqlens_q=I32(0, 3, 9)), ValueError, "same batch"),
    (dict(max_seqlen_q=3), ValueError, "max_seqlen_q must be at least the longest sequence's length 4"),
    (dict(max_seqlen_k=5.0), TypeError, "max_seqlen_k must be an int"),
    (dict(max_seqlen_k=True), TypeError, "max_seqlen_k must be an int"),
    (dict(window=(-2, 0)), ValueError, "window"),
    (dict(window=(1, 0, 0)), TypeError, "window"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=None), TypeError, "softcap"),
    (dict(sinks=np.zeros(3, np.float32)), ValueError, "sinks must have shape"),
    (dict(sinks=np.zeros(4, np.int32)), TypeError, "sinks must have dtype"),
    (dict(alibi_slopes=np.zeros((2, 4), np.float32)), ValueError, r"alibi_slopes must have shape \(heads,\)"),
    (dict(alibi_slopes=np.zeros(4, np.float64)), TypeError, "alibi_slopes must have dtype float32"),
    (dict(causal=1), TypeError, "causal"),
    (dict(variant="fa9"), ValueError, "variant"),
    (dict(backend="tpu"), ValueError, "backend"),
    (dict(q=np.zeros((1, 9, 4, 16), np.float16)), ValueError, "q must have 3 dimensions"),
    (dict(v=np.zeros((9, 2, 8), np.float16)), ValueError, "k and v must have the same shape"),
    (dict(q=np.zeros((9, 3, 16), np.float16)), ValueError, "multiple of heads"),
    (dict(q=np.zeros((9, 4, 16), np.float32)), TypeError, "dtype"),
])
def test_bad_varlen_arguments_are_refused(rng, over, error, match):
    with pytest.raises(error, match=match):
        call_varlen(rng, **over)


def test_variants_without_masked_models_are_refused(rng):
    with pytest.raises(NotImplementedError, match="fa2_fp8.*takes no window"):
        call_varlen(rng, variant="fa2_fp8")


@pytest.mark.parametrize("over,error,match", [
    (dict(window=(-3, 0)), ValueError, "window"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(sinks=np.zeros((4, 1), np.float32)), ValueError, "sinks"),
    (dict(alibi_slopes=np.zeros((3, 4), np.float32)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=np.zeros(4, np.float16)), TypeError, "alibi_slopes"),
])
def test_bad_mask_arguments_on_attention_and_backward(rng, over, error, match):
    q = rng.standard_normal((2, 6, H, D)).astype(np.float16)
    k = rng.standard_normal((2, 5, HKV, D)).astype(np.float16)
    with pytest.raises(error, match=match):
        fav.attention(q, k, k, **over)
    out, lse = fav.attention(q, k, k, return_lse=True, backend="numpy")
    with pytest.raises(error, match=match):
        fav.attention_backward(q, q, k, k, out, lse, **over)


def test_backward_refusals(rng):
    q, k, v, cu_q, cu_k = packed(rng, lens_q=[3, 2], lens_k=[2, 4])
    out, lse = fav.attention_varlen(q, k, v, cu_q, cu_k, 3, 4, return_lse=True, window=(1, 1))
    common = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=4)
    with pytest.raises(TypeError, match="cu_seqlens_k is required"):
        fav.attention_backward(out, q, k, v, out, lse, cu_seqlens_q=cu_q, max_seqlen_q=3, max_seqlen_k=4)
    with pytest.raises(ValueError, match=r"lse must have shape \(heads, total_q\)"):
        fav.attention_backward(out, q, k, v, out, lse[:, :-1], **common)
    with pytest.raises(TypeError, match="lse must have dtype float32"):
        fav.attention_backward(out, q, k, v, out, lse.astype(np.float64), **common)
    with pytest.raises(ValueError, match="lse does not match.*sees no key"):   # the forward's window was (1, 1)
        fav.attention_backward(out, q, k, v, out, lse, window=(0, 0), **common)
    with pytest.raises(ValueError, match="lse does not match.*differs by"):    # ... and it had no softcap
        fav.attention_backward(out, q, k, v, out, lse, window=(1, 1), softcap=0.5, **common)
    fav.attention_backward(out, q, k, v, out, lse, window=(0, 0), check_lse=False, **common)


def test_backend_cuda_checks_first_and_refuses_what_no_kernel_takes(rng):
    """backend="cuda": the checks come first (a bad argument is a ValueError wherever it would run); then the masked
    kernels run the call (BackendUnavailable where no GPU is usable, or for fa3 where no sm_90a one is), and other
    variants' kernels are refused by name, forward and backward."""
    q, k, v, cu_q, cu_k = packed(rng, lens_q=[3, 2], lens_k=[2, 4])
    with pytest.raises(ValueError, match="window"):
        fav.attention_varlen(q, k, v, cu_q, cu_k, 3, 4, backend="cuda", window=(-2, 0))
    with pytest.raises(NotImplementedError, match="variant 'fa1'.*'auto', 'fa2' or 'fa3'"):
        fav.attention_varlen(q, k, v, cu_q, cu_k, 3, 4, backend="cuda", variant="fa1")
    out, lse = fav.attention_varlen(q, k, v, cu_q, cu_k, 3, 4, return_lse=True)
    packed_kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=4, backend="cuda")
    with pytest.raises(NotImplementedError, match="variant 'naive'.*'auto', 'fa2' or 'fa3'"):
        fav.attention_backward(out, q, k, v, out, lse, variant="naive", **packed_kw)
    if not has_gpu():
        with pytest.raises(fav.BackendUnavailable, match="'fa2' cannot run on the GPU here"):
            fav.attention_varlen(q, k, v, cu_q, cu_k, 3, 4, backend="cuda")
        with pytest.raises(fav.BackendUnavailable, match="'fa3' cannot run on the GPU here"):
            fav.attention_varlen(q, k, v, cu_q, cu_k, 3, 4, backend="cuda", variant="fa3")
        with pytest.raises(fav.BackendUnavailable, match="'fa2' cannot run on the GPU here"):
            fav.attention_backward(out, q, k, v, out, lse, **packed_kw)
        qd, kd = q[None, :4], k[None, :5]
        out, lse = fav.attention(qd, kd, kd, backend="numpy", return_lse=True, softcap=5.0)
        with pytest.raises(fav.BackendUnavailable, match="'fa2' cannot run on the GPU here"):
            fav.attention_backward(out, qd, kd, kd, out, lse, backend="cuda", softcap=5.0)


@pytest.mark.gpu
def test_gpu_arrays_run_the_kernel_and_backend_numpy_runs_the_model(rng):
    import cupy
    q, k, v, cu_q, cu_k = packed(rng, lens_q=[3, 2], lens_k=[2, 4])
    dev = [cupy.asarray(a) for a in (q, k, v, cu_q, cu_k)]
    model = fav.attention_varlen(q, k, v, cu_q, cu_k, 3, 4)
    out = fav.attention_varlen(*dev, 3, 4)
    assert isinstance(out, cupy.ndarray) and rel_err(out, f64(model)) <= TOL["float16"]
    out = fav.attention_varlen(*dev, 3, 4, backend="numpy")
    assert isinstance(out, cupy.ndarray)
    assert np.array_equal(cupy.asnumpy(out), model)
    host = fav.attention_varlen(q, k, v, cu_q, cu_k, 3, 4, backend="cuda")
    assert isinstance(host, np.ndarray) and rel_err(host, f64(model)) <= TOL["float16"]
    with pytest.raises(ValueError, match="cu_seqlens_q must be on q's device"):
        fav.attention_varlen(*dev[:3], cu_q, dev[4], 3, 4)


def test_host_arrays_with_auto_run_the_model(rng):
    q, k, v, cu_q, cu_k = packed(rng, lens_q=[3, 2], lens_k=[2, 4])
    assert fav.attention_varlen(q, k, v, cu_q, cu_k, 3, 4).shape == q.shape
