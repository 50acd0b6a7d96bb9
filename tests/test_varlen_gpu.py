"""The masked kernels on the GPU: fa2's (kernels/fa2_masked.py) forward and backward and fa3's forward
(kernels/fa3_masked.py, sm_90a), on packed (varlen) batches and the mask keywords of ``attention()`` and
``attention_backward()``, against the float64 reference of
tests/test_masks_model.py on fresh random inputs, every output poisoned (NaN) before the call: zero-length and
length-1 sequences, seqlen_q != seqlen_k, GQA, windows larger than the sequence, head dims that pad, strided inputs;
rows past cu_seqlens_q[-1]; a NaN reaches only its row; torch tensors in and out."""
import numpy as np
import pytest
from conftest import DTYPES, GRAD_TOL, LSE_ATOL, TOL, Case, has_gpu, rel_err, to_host
from test_masks_model import reference

import fa_variants as fav

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")]

H, HKV = 4, 2
LENS_Q = [1, 0, 37, 1000, 300, 5, 0]      # length 0 and 1, seqlen_q != seqlen_k, a sequence without keys
LENS_K = [1, 5, 37, 1000, 777, 0, 0]

MASKS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(64, 16)),
    "causal window": dict(causal=True, window=(100, -1)),
    "wide window": dict(causal=True, window=(600, 0)),    # blocks masked at both ends, mask-free ones between
    "window past the sequence": dict(window=(5000, 3000)),
    "softcap": dict(softcap=2.5),
    "alibi": dict(causal=True, alibi="per sequence"),
    "sinks": dict(sinks=True),
    "everything": dict(causal=True, window=(200, 0), softcap=3.0, alibi="per head", sinks=True),
}


# The forward kernels: fa2's everywhere, fa3's where it runs (sm_90a; "auto" takes it there)
KERNELS = ["fa2", "fa3"]


def _kernel(variant: str) -> str:
    ok, why = fav.get(variant).available()
    if not ok:
        pytest.skip(f"{variant}: {why}")
    return variant


def _masks(rng, name, batch, heads=H):
    """The call's keywords: the case's, with random ALiBi slopes and sinks where it asks for them."""
    kw = dict(MASKS[name])
    alibi = kw.pop("alibi", None)
    if alibi is not None:
        shape = (batch, heads) if alibi == "per sequence" else (heads,)
        kw["alibi_slopes"] = rng.uniform(0.01, 0.3, shape).astype(np.float32)
    if kw.pop("sinks", False):
        kw["sinks"] = (rng.standard_normal(heads) + 1.0).astype(np.float32)
    return kw


def _ref_kw(kw, b):
    out = {n: x for n, x in kw.items() if n not in ("alibi_slopes", "sinks")}
    if "sinks" in kw:
        out["sinks"] = kw["sinks"].astype(np.float64)
    if "alibi_slopes" in kw:
        s = kw["alibi_slopes"]
        out["alibi"] = (s[b] if s.ndim == 2 else s).astype(np.float64)
    return out


def _packed(rng, dtype, d, lens_q, lens_k):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    dt = DTYPES[dtype]
    q = rng.standard_normal((int(cu_q[-1]), H, d)).astype(dt)
    k = rng.standard_normal((int(cu_k[-1]), HKV, d)).astype(dt)
    v = rng.standard_normal((int(cu_k[-1]), HKV, d)).astype(dt)
    return q, k, v, cu_q, cu_k


def _check_sequence(out, lse, q, k, v, rows, keys, kw, b, dtype):
    f = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
    if rows.stop == rows.start:
        return
    if keys.stop == keys.start:   # no key: 0, and the sink's logit (or -inf)
        assert (f(out[rows]) == 0).all(), b
        want = kw["sinks"][:, None].repeat(rows.stop - rows.start, 1) if "sinks" in kw else -np.inf
        np.testing.assert_allclose(lse[:, rows], np.broadcast_to(want, lse[:, rows].shape), atol=LSE_ATOL)
        return
    want = reference(f(q[None, rows]), f(k[None, keys]), f(v[None, keys]), **_ref_kw(kw, b))
    if np.linalg.norm(want["out"]) > 0:
        assert rel_err(out[None, rows], want["out"]) <= TOL[dtype], b
    ref_lse = want["lse"][0]
    assert np.array_equal(np.isneginf(lse[:, rows]), np.isneginf(ref_lse)), b
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[:, rows][fin], ref_lse[fin], atol=LSE_ATOL, rtol=1e-5)


@pytest.mark.parametrize("d", [64, 128, 72, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("variant", KERNELS)
def test_packed_batch_matches_float64(rng, poisoned, variant, mask, dtype, d):
    import cupy
    variant = _kernel(variant)
    q, k, v, cu_q, cu_k = _packed(rng, dtype, d, LENS_Q, LENS_K)
    kw = _masks(rng, mask, len(LENS_Q))
    dev = lambda a: cupy.asarray(a)  # noqa: E731
    dkw = {n: dev(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    with poisoned(Case(1, q.shape[0], k.shape[0], H, HKV, d, False)):
        out, lse = fav.attention_varlen(dev(q), dev(k), dev(v), dev(cu_q), dev(cu_k), max(LENS_Q), max(LENS_K),
                                        return_lse=True, variant=variant, **dkw)
    assert isinstance(out, cupy.ndarray) and out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (H, q.shape[0]) and lse.dtype == np.float32
    out, lse = to_host(out), to_host(lse)
    for b in range(len(LENS_Q)):
        _check_sequence(out, lse, q, k, v, slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1]), kw, b, dtype)


DENSE = [Case(2, 37, 1000, 8, 2, 128, True), Case(1, 1000, 37, 4, 4, 64, False), Case(2, 1, 4097, 4, 1, 64, True),
         Case(1, 513, 513, 2, 2, 256, True), Case(1, 300, 500, 4, 2, 80, False, True)]


@pytest.mark.parametrize("mask", ["window", "causal window", "wide window", "softcap", "alibi", "sinks", "everything"])
@pytest.mark.parametrize("case", DENSE, ids=[c.id for c in DENSE])
@pytest.mark.parametrize("variant", KERNELS)
def test_masked_attention_matches_float64(rng, poisoned, variant, case, mask):
    """attention() with mask keywords on GPU arrays (seqlen_q != seqlen_k, GQA, padded head dims, strided views)."""
    import cupy
    variant = _kernel(variant)
    b, nq, nk, h, hkv, d = case[:6]
    dt = DTYPES["bfloat16"]
    shape_q, shape_k = (b, nq, h, d), (b, nk, hkv, d)
    if case.strided:   # every other head of a wider tensor: strides that are not the contiguous ones
        qh = rng.standard_normal((b, nq, 2 * h, d)).astype(dt)
        kh = rng.standard_normal((b, nk, 2 * hkv, d)).astype(dt)
        vh = rng.standard_normal((b, nk, 2 * hkv, d)).astype(dt)
        qd, kd, vd = (cupy.asarray(a)[:, :, ::2] for a in (qh, kh, vh))
        q, k, v = qh[:, :, ::2], kh[:, :, ::2], vh[:, :, ::2]
    else:
        q, k, v = (rng.standard_normal(s).astype(dt) for s in (shape_q, shape_k, shape_k))
        qd, kd, vd = (cupy.asarray(a) for a in (q, k, v))
    kw = _masks(rng, mask, b, h)
    kw.setdefault("causal", case.causal)
    dkw = {n: cupy.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    with poisoned(case):
        out, lse = fav.attention(qd, kd, vd, return_lse=True, variant=variant, **dkw)
    out, lse = to_host(out), to_host(lse)
    f = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
    ref_kw = {n: x for n, x in kw.items() if n not in ("alibi_slopes", "sinks")}
    if "sinks" in kw:
        ref_kw["sinks"] = kw["sinks"].astype(np.float64)
    if "alibi_slopes" in kw:   # (heads,) or (batch, heads): the reference takes both
        ref_kw["alibi"] = kw["alibi_slopes"].astype(np.float64)
    want = reference(f(q), f(k), f(v), **ref_kw)
    assert rel_err(out, want["out"]) <= TOL["bfloat16"]
    assert np.array_equal(np.isneginf(lse), np.isneginf(want["lse"]))
    fin = np.isfinite(want["lse"])
    np.testing.assert_allclose(lse[fin], want["lse"][fin], atol=LSE_ATOL, rtol=1e-5)


def test_rows_past_the_last_sequence_and_nan_rows(rng, poisoned):
    """Rows of q past cu_seqlens_q[-1]: 0 and -inf (never left as the allocator's bytes). A NaN in one query: NaN
    in its row alone."""
    import cupy
    q, k, v, cu_q, cu_k = _packed(rng, "float16", 64, [5, 40], [9, 50])
    q[3, 1, 7] = np.nan
    short = np.array([0, 5, 30], np.int32)
    with poisoned(Case(1, 45, 59, H, HKV, 64, False)):
        out, lse = fav.attention_varlen(*(cupy.asarray(a) for a in (q, k, v, short, cu_k)), 40, 50,
                                        return_lse=True, window=(8, 8), softcap=4.0)
    out, lse = to_host(out).astype(np.float32), to_host(lse)
    assert (out[30:] == 0).all() and np.isneginf(lse[:, 30:]).all()
    nan_rows = np.zeros(out.shape[:2], bool)
    nan_rows[3, 1] = True
    assert np.isnan(out[nan_rows]).all() and np.isfinite(out[:30][~nan_rows[:30]]).all()


def test_torch_tensors_in_and_out(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    q, k, v, cu_q, cu_k = _packed(rng, "float16", 128, [17, 200], [30, 190])
    t = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
    kw = dict(causal=True, window=(32, 0), sinks=(rng.standard_normal(H)).astype(np.float32))
    out = fav.attention_varlen(t(q), t(k), t(v), t(cu_q), t(cu_k), 200, 190, causal=True, window=(32, 0),
                               sinks=t(kw["sinks"]))
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.shape == q.shape
    for b in range(2):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        want = reference(*(a.astype(np.float64)[None] for a in (q[rows], k[keys], v[keys])), **_ref_kw(kw, b))
        assert rel_err(out[rows].cpu().numpy()[None], want["out"]) <= TOL["float16"]


BACKWARD_MASKS = ["plain", "causal", "window", "causal window", "softcap", "alibi", "sinks", "everything"]


def _runs(variant, monkeypatch) -> list:
    """The calls of fa3's masked backward kernels (kernels/fa3_bwd.py's masked_gradients) a test makes: variant
    "fa3" must run them (at head dims up to 128), fa2 never."""
    from fa_variants.kernels import fa3_bwd
    calls = []
    real = fa3_bwd.masked_gradients

    def spy(*a, **kw):
        calls.append(a[1].shape)
        return real(*a, **kw)
    monkeypatch.setattr(fa3_bwd, "masked_gradients", spy)
    return calls


@pytest.mark.parametrize("d", [64, 128, 72, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mask", BACKWARD_MASKS)
@pytest.mark.parametrize("variant", KERNELS + ["fa3 on 3 SMs", "fa3 unordered"])
def test_packed_backward_matches_float64(rng, poisoned, monkeypatch, variant, mask, dtype, d):
    """dq, dk, dv (and dsinks) of a packed batch against float64 per sequence, on fa2's masked passes and on fa3's
    masked backward (d 256: fa2's passes under variant "fa3"), also with its grid cut to 3 SMs (the longer
    sequences walked 3 K/V blocks at a time) and with dQ's shares added as they come (deterministic=False); rows of
    k and v past the last sequence get zero gradients."""
    import cupy
    ordered = variant != "fa3 unordered"
    if variant == "fa3 on 3 SMs":
        from fa_variants.kernels import common
        monkeypatch.setitem(common.SMS, cupy.cuda.Device().id, 3)
    variant = variant.split()[0]
    variant = _kernel(variant)
    calls = _runs(variant, monkeypatch)
    lens_q, lens_k = [1, 0, 37, 300, 200, 5], [1, 5, 37, 777, 200, 0]
    q, k, v, cu_q, cu_k = _packed(rng, dtype, d, lens_q, lens_k)
    k_extra = np.concatenate([k, rng.standard_normal((3, HKV, d)).astype(k.dtype)])   # rows no sequence holds
    v_extra = np.concatenate([v, rng.standard_normal((3, HKV, d)).astype(v.dtype)])
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    kw = _masks(rng, mask, len(lens_q))
    dev = {n: cupy.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    args = [cupy.asarray(a) for a in (q, k_extra, v_extra)]
    lens = dict(cu_seqlens_q=cupy.asarray(cu_q), cu_seqlens_k=cupy.asarray(cu_k), max_seqlen_q=max(lens_q),
                max_seqlen_k=max(lens_k))
    out, lse = fav.attention_varlen(*args, lens["cu_seqlens_q"], lens["cu_seqlens_k"], max(lens_q), max(lens_k),
                                    return_lse=True, variant=variant, **dev)
    order = dict(deterministic=None if ordered else False)
    with poisoned(Case(1, q.shape[0], k_extra.shape[0], H, HKV, d, False)):
        grads = fav.attention_backward(cupy.asarray(dout), *args, out, lse, variant=variant, **order, **lens, **dev)
    if ordered:
        again = fav.attention_backward(cupy.asarray(dout), *args, out, lse, variant=variant, **lens, **dev)
        assert all(bool((a == b).all()) for a, b in zip(grads, again)), "not the same bits on a second run"
    assert len(calls) == ((2 if ordered else 1) if variant == "fa3" and d <= 128 else 0)
    assert len(grads) == (4 if "sinks" in kw else 3)
    dq, dk, dv = (to_host(g).astype(np.float64) for g in grads[:3])
    assert (dk[k.shape[0]:] == 0).all() and (dv[k.shape[0]:] == 0).all()
    f = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
    want = {n: np.zeros(a.shape) for n, a in (("dq", q), ("dk", k), ("dv", v))}
    dsinks = np.zeros(H)
    for b in range(len(lens_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop == rows.start or keys.stop == keys.start:
            continue
        r = reference(f(q[None, rows]), f(k[None, keys]), f(v[None, keys]), f(dout[None, rows]), **_ref_kw(kw, b))
        want["dq"][rows], want["dk"][keys], want["dv"][keys] = r["dq"][0], r["dk"][0], r["dv"][0]
        dsinks += r["dsinks"]
    for name, got in (("dq", dq), ("dk", dk[:k.shape[0]]), ("dv", dv[:k.shape[0]])):
        assert rel_err(got, want[name]) <= GRAD_TOL[dtype], name
    if "sinks" in kw:
        np.testing.assert_allclose(to_host(grads[3]).astype(np.float64), dsinks, rtol=GRAD_TOL[dtype],
                                   atol=GRAD_TOL[dtype] * np.abs(dsinks).max())


@pytest.mark.parametrize("mask", ["window", "softcap", "everything"])
@pytest.mark.parametrize("case", DENSE[:3] + DENSE[4:], ids=[c.id for c in DENSE[:3] + DENSE[4:]])
@pytest.mark.parametrize("variant", KERNELS)
def test_masked_attention_backward_matches_float64(rng, poisoned, monkeypatch, variant, case, mask):
    """attention_backward() with mask keywords on GPU arrays: seqlen_q != seqlen_k, GQA, padded head dims, strided;
    fa2's masked passes and fa3's masked backward."""
    import cupy
    variant = _kernel(variant)
    calls = _runs(variant, monkeypatch)
    b, nq, nk, h, hkv, d = case[:6]
    dt = DTYPES["float16"]
    q, k, v = (rng.standard_normal(s).astype(dt) for s in ((b, nq, h, d), (b, nk, hkv, d), (b, nk, hkv, d)))
    dout = rng.standard_normal(q.shape).astype(dt)
    kw = _masks(rng, mask, b, h)
    kw.setdefault("causal", case.causal)
    dkw = {n: cupy.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    qd, kd, vd = (cupy.asarray(a) for a in (q, k, v))
    if case.strided:
        qd = cupy.asarray(np.stack([q, q], axis=3).reshape(b, nq, 2 * h, d))[:, :, ::2]   # q, every other head
    out, lse = fav.attention(qd, kd, vd, return_lse=True, variant=variant, **dkw)
    with poisoned(case):
        grads = fav.attention_backward(cupy.asarray(dout), qd, kd, vd, out, lse, variant=variant, **dkw)
    assert len(calls) == (1 if variant == "fa3" and d <= 128 else 0)
    f = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
    ref_kw = {n: x for n, x in kw.items() if n not in ("alibi_slopes", "sinks")}
    if "sinks" in kw:
        ref_kw["sinks"] = kw["sinks"].astype(np.float64)
    if "alibi_slopes" in kw:
        ref_kw["alibi"] = kw["alibi_slopes"].astype(np.float64)
    want = reference(f(q), f(k), f(v), f(dout), **ref_kw)
    for name, got in zip(("dq", "dk", "dv"), grads):
        assert rel_err(got, want[name]) <= GRAD_TOL["float16"], name


def test_variants_without_a_masked_kernel_are_refused_by_name(rng):
    import cupy
    q, k, v, cu_q, cu_k = (cupy.asarray(a) for a in _packed(rng, "float16", 64, [3], [4]))
    with pytest.raises(NotImplementedError, match="variant 'fa1'.*'auto', 'fa2' or 'fa3'"):
        fav.attention_varlen(q, k, v, cu_q, cu_k, 3, 4, variant="fa1")
    with pytest.raises(NotImplementedError, match="variant 'naive'.*'auto', 'fa2' or 'fa3'"):
        fav.attention_backward(q[None], q[None], k[None], v[None], q[None], cupy.zeros((1, H, 3), cupy.float32),
                               softcap=2.0, variant="naive")
