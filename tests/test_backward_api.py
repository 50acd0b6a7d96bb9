"""``fa_variants.attention_backward``: argument checking, backend choice, and the NumPy-model path end to end.

The gradients are checked against ``dense_backward64`` below, written from the definition (with the models'
interface: P from the saved LSE) and itself checked against central differences of conftest's float64 forward.
"""
from __future__ import annotations

import dataclasses
import math
import types

import ml_dtypes
import numpy as np
import pytest

import fa_variants as fav
from fa_variants import arrays, backward, dispatch, registry
from conftest import GRAD_TOL, TOL, has_gpu, place, random_qkv_host, reference64, rel_err

ENTRIES = registry.variants()
GPU_MESSAGE = r"variant 'fa2' has no backward kernel; variant='auto' runs the fastest backward here"


# ------------------------------------------------------------------------------------------------ the reference
def dense_backward64(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None):
    """(dq, dk, dv) in float64 from the definition, with the model interface: P = exp(S - lse) from the saved
    LSE, dS = P o (dO V^T - rowsum(dO o O)); dk, dv summed over each group of query heads."""
    dout, q, k, v, out, lse = (np.asarray(a).astype(np.float64) for a in (dout, q, k, v, out, lse))
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    group = h // hkv
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    visible = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq) if causal else np.ones((nq, nk), bool)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for bi in range(b):
        for hi in range(h):
            kh, vh, o, do = k[bi, :, hi // group], v[bi, :, hi // group], out[bi, :, hi], dout[bi, :, hi]
            row_lse = lse[bi, hi][:, None]
            row_lse = np.where(np.isfinite(row_lse), row_lse, np.inf)  # -inf: no key seen; exp(s - inf) = 0
            p = np.where(visible, np.exp(q[bi, :, hi] @ kh.T * scale - row_lse), 0.0)
            ds = p * (do @ vh.T - (do * o).sum(axis=1, keepdims=True))
            dq[bi, :, hi] = ds @ kh * scale
            dk[bi, :, hi // group] += ds.T @ q[bi, :, hi] * scale
            dv[bi, :, hi // group] += p.T @ do
    return types.SimpleNamespace(dq=dq, dk=dk, dv=dv)


@pytest.mark.parametrize("causal, nq, nk", [(False, 3, 4), (True, 5, 3)])  # 5 > 3: two rows see no key
def test_dense_backward_matches_central_differences(causal, nq, nk, rng):
    q, k, v = (rng.standard_normal(s) for s in ((1, nq, 2, 4), (1, nk, 1, 4), (1, nk, 1, 4)))
    dout = rng.standard_normal(q.shape)
    scale = 0.8
    out, lse = reference64(q, k, v, causal, scale)
    got = dense_backward64(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale)
    h = 1e-6
    for name, x, g in (("q", q, got.dq), ("k", k, got.dk), ("v", v, got.dv)):
        num = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            x0 = x[i]
            x[i] = x0 + h
            up = (dout * reference64(q, k, v, causal, scale)[0]).sum()
            x[i] = x0 - h
            down = (dout * reference64(q, k, v, causal, scale)[0]).sum()
            x[i] = x0
            num[i] = (up - down) / (2 * h)
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-8, err_msg=f"d{name}")


# ------------------------------------------------------------------------------------------------ inputs
def _case(rng, dtype="float16", b=2, nq=5, nk=7, h=4, hkv=2, d=64, causal=False):
    """(dout, q, k, v, out, lse): random inputs, their float64 forward rounded as attention() returns it."""
    q, k, v = random_qkv_host(rng, b, nq, nk, h, hkv, d, dtype)
    out, lse = reference64(q, k, v, causal, None)
    dout = rng.standard_normal(q.shape, dtype=np.float32).astype(q.dtype)
    return dout, q, k, v, out.astype(q.dtype), lse.astype(np.float32)


@pytest.fixture
def nothing_runs(monkeypatch):
    """Any model, GPU copy or backend choice fails loudly: a misuse must be reported before them."""
    def boom(*a, **k):
        raise AssertionError("validation let a misuse through")

    for name, entry in registry.VARIANTS.items():
        monkeypatch.setitem(registry.VARIANTS, name, dataclasses.replace(entry, reference_backward=boom))
    monkeypatch.setattr(arrays, "to_cupy", boom)
    monkeypatch.setattr(dispatch, "resolve_backend", boom)


class _FakeGpuArray:
    """Claims to live on a CUDA device through DLPack, and fails if anyone actually tries to import it."""
    shape, ndim = (2, 5, 4, 64), 4

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, *a, **k):
        raise AssertionError("a device mismatch must be reported before any array is imported")


def _raises(exc, pattern, args, **kw):
    with pytest.raises(exc, match=pattern) as info:
        fav.attention_backward(*args, **kw)
    return info


# ------------------------------------------------------------------------------------------------ misuse
@pytest.mark.usefixtures("nothing_runs")
class TestMisuse:
    @pytest.mark.parametrize("which", ["dout", "out"])
    def test_wrong_shape(self, which, rng):
        t = dict(zip(backward.NAMES, _case(rng)))
        t[which] = t[which][:, :3].copy()
        _raises(ValueError, rf"^{which} must have q's shape \(2, 5, 4, 64\), got \(2, 3, 4, 64\)", t.values())

    @pytest.mark.parametrize("which, dtype", [("dout", ml_dtypes.bfloat16), ("out", np.float32)])
    def test_wrong_dtype(self, which, dtype, rng):
        t = dict(zip(backward.NAMES, _case(rng)))
        t[which] = t[which].astype(dtype)
        _raises(TypeError, rf"^{which} must have q's dtype float16, got {np.dtype(dtype).name}", t.values())

    def test_lse_shape(self, rng):
        t = dict(zip(backward.NAMES, _case(rng)))
        t["lse"] = t["lse"].transpose(0, 2, 1).copy()   # (batch, seqlen_q, heads): the layout of out, not of lse
        _raises(ValueError, r"^lse must have shape \(batch, heads, seqlen_q\) = \(2, 4, 5\)", t.values())

    @pytest.mark.parametrize("dtype", [np.float64, np.float16])
    def test_lse_dtype(self, dtype, rng):
        t = dict(zip(backward.NAMES, _case(rng)))
        t["lse"] = t["lse"].astype(dtype)
        _raises(TypeError, rf"^lse must be float32.*got {np.dtype(dtype).name}", t.values())

    @pytest.mark.parametrize("which", ["dout", "out", "lse"])
    @pytest.mark.parametrize("bad", [[[1.0]], None, 2.0])
    def test_not_an_array(self, which, bad, rng):
        t = dict(zip(backward.NAMES, _case(rng)))
        t[which] = bad
        _raises(TypeError, rf"^{which} must be a NumPy or CuPy array", t.values())

    @pytest.mark.parametrize("which", ["dout", "q", "out", "lse"])
    def test_host_and_gpu_mixed(self, which, rng):
        t = dict(zip(backward.NAMES, _case(rng)))
        t[which] = _FakeGpuArray()
        _raises(ValueError, rf"same device.*{which} on GPU", t.values())

    @pytest.mark.parametrize("which", backward.NAMES)
    def test_masked_arrays(self, which, rng):
        t = dict(zip(backward.NAMES, _case(rng)))
        t[which] = np.ma.masked_array(t[which], mask=np.ones(t[which].shape, bool))
        _raises(TypeError, rf"^{which} is a NumPy masked array, and attention would ignore its mask", t.values())

    def test_q_k_v_follow_the_forward_rules(self, rng):
        args = _case(rng)
        dout, q, k, v, out, lse = args
        _raises(ValueError, r"^q must have 4 dimensions", (dout, q[0], k, v, out, lse))
        _raises(TypeError, r"share one dtype.*k bfloat16", (dout, q, k.astype(ml_dtypes.bfloat16), v, out, lse))
        _raises(TypeError, r"accepts? dtypes.*float32", [a.astype(np.float32) for a in args[:5]] + [lse])
        _raises(ValueError, r"heads of q \(4\).*multiple.*\(3\)", (dout, q, k[:, :, :1].repeat(3, 2),
                                                                   v[:, :, :1].repeat(3, 2), out, lse))
        _raises(ValueError, r"^v has negative strides", (dout, q, k, v[:, ::-1], out, lse))

    @pytest.mark.parametrize("kw, exc, pattern", [
        (dict(causal=1), TypeError, r"causal must be a bool"),
        (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale must be finite"),
        (dict(softmax_scale="0.1"), TypeError, r"softmax_scale"),
        (dict(variant="FA2"), ValueError, r"variant must be 'auto' or one of"),
        (dict(backend="tpu"), ValueError, r"backend must be one of \['auto', 'cuda', 'numpy'\]"),
        (dict(check_lse="no"), TypeError, r"check_lse must be a bool, got str"),
        (dict(deterministic=1), TypeError, r"deterministic must be a bool or None, got int"),
        (dict(deterministic="yes", window=(4, 0)), TypeError, r"deterministic must be a bool or None, got str"),
    ])
    def test_scalars(self, kw, exc, pattern, rng):
        _raises(exc, pattern, _case(rng), **kw)


# ------------------------------------------------------------------------------------------------ backends
def _without_gpu_backward(monkeypatch):
    """fa2 as a variant whose GPU side has no backward (its NumPy model must not run in its place)."""
    def boom(*a, **k):
        raise AssertionError("the NumPy model ran for a GPU call")
    monkeypatch.setitem(registry.VARIANTS, "fa2", dataclasses.replace(registry.get("fa2"), reference_backward=boom,
                                                                      directions=("forward",)))


def test_cuda_backend_says_there_is_no_gpu_backward(monkeypatch, rng):
    _without_gpu_backward(monkeypatch)
    with pytest.raises(fav.BackendUnavailable, match=GPU_MESSAGE):
        fav.attention_backward(*_case(rng), variant="fa2", backend="cuda")


@pytest.mark.skipif(has_gpu(), reason="a CUDA GPU is present")
def test_cuda_backend_without_a_gpu_says_so(monkeypatch, rng):
    def boom(*a, **k):
        raise AssertionError("the NumPy model ran for backend='cuda'")
    monkeypatch.setitem(registry.VARIANTS, "fa2", dataclasses.replace(registry.get("fa2"), reference_backward=boom))
    with pytest.raises(fav.BackendUnavailable, match=r"'fa2' cannot run on the GPU here"):
        fav.attention_backward(*_case(rng), variant="fa2", backend="cuda")
    with pytest.raises(fav.BackendUnavailable, match=r"backend='cuda', but"):
        fav.attention_backward(*_case(rng), backend="cuda")


@pytest.mark.skipif(not has_gpu(), reason="needs a GPU: auto picks it for host arrays")
def test_auto_with_a_gpu_does_not_fall_back_to_the_model(monkeypatch, rng):
    _without_gpu_backward(monkeypatch)
    with pytest.raises(fav.BackendUnavailable, match=GPU_MESSAGE):
        fav.attention_backward(*_case(rng), variant="fa2")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [32, 37])
def test_cupy_and_host_arrays_run_the_kernels(rng, head_dim):
    """GPU arrays give CuPy gradients, host arrays NumPy ones (through the device), both near the float64 model
    (head_dim 37: the zero-padded path)."""
    import cupy
    host = _case(rng, d=head_dim)
    dev = [cupy.asarray(a) for a in host]
    want = fav.attention_backward(*host, backend="numpy")
    ref = registry.get("fa2").reference_backward(*(a.astype(np.float64) for a in host))
    for got in (fav.attention_backward(*dev), fav.attention_backward(*host)):
        for g, w, r in zip(got, want, (ref.dq, ref.dk, ref.dv)):
            g = cupy.asnumpy(g) if isinstance(g, cupy.ndarray) else g
            assert g.shape == w.shape and g.dtype == w.dtype and g.flags.c_contiguous
            assert rel_err(g, r) <= GRAD_TOL[str(w.dtype)]
    assert all(isinstance(g, cupy.ndarray) for g in fav.attention_backward(*dev))
    assert all(isinstance(g, np.ndarray) for g in fav.attention_backward(*host))


@pytest.mark.skipif(has_gpu(), reason="a CUDA GPU is present: auto picks the GPU")
def test_auto_without_gpu_runs_the_model(rng):
    args = _case(rng)
    for got, want in zip(fav.attention_backward(*args), fav.attention_backward(*args, backend="numpy")):
        assert np.array_equal(got, want)


def test_a_variant_without_a_backward_model_says_so(monkeypatch, rng):
    monkeypatch.setitem(registry.VARIANTS, "fa2", dataclasses.replace(registry.get("fa2"), reference_backward=None))
    with pytest.raises(fav.BackendUnavailable, match=r"'fa2' has no NumPy backward model"):
        fav.attention_backward(*_case(rng), variant="fa2", backend="numpy")
    with pytest.raises(fav.BackendUnavailable, match=r"fa2, which variant 'auto' runs then, has no NumPy backward"):
        fav.attention_backward(*_case(rng), backend="numpy")


# ------------------------------------------------------------------------------------------------ the NumPy model
CASES = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, causal, strided)
    (2, 37, 29, 4, 2, False, False),
    (2, 37, 29, 4, 2, True, False),    # seqlen_q > seqlen_k: the first 8 rows see no key
    (1, 29, 37, 4, 1, True, True),     # seqlen_q < seqlen_k, MQA, strided views
    (1, 1, 3, 2, 2, True, False),      # one query (with one key, dq = dk = 0 exactly: nothing to compare)
]


def _check_model_path(variant, dtype, case, rng, scale=None):
    b, nq, nk, h, hkv, causal, strided = case
    entry = registry.get(variant)
    d = 64 if 64 in entry.head_dims else entry.head_dims[0]
    tol = entry.operand_dtype or dtype
    host = random_qkv_host(rng, b, nq, nk, h, hkv, d, dtype)
    q, k, v = (place(a, "numpy", strided, r) for a, r in zip(host, "qkv"))
    out, lse = fav.attention(q, k, v, variant=variant, causal=causal, softmax_scale=scale, return_lse=True,
                             backend="numpy")
    dout = place(rng.standard_normal(q.shape, dtype=np.float32).astype(q.dtype), "numpy", strided)
    given = (dout, q, k, v, out, lse)
    before = [a.copy() for a in given]
    grads = fav.attention_backward(*given, variant=variant, causal=causal, softmax_scale=scale, backend="numpy")
    for a, a0, n in zip(given, before, backward.NAMES):
        assert np.array_equal(a.view(np.uint8), a0.view(np.uint8)), f"{n} was modified"
    want = dense_backward64(*given, causal=causal, softmax_scale=scale)
    for g, x, w, n in zip(grads, (q, k, v), (want.dq, want.dk, want.dv), ("dq", "dk", "dv")):
        assert isinstance(g, np.ndarray) and g.dtype == x.dtype and g.shape == x.shape, n
        assert np.isfinite(g.astype(np.float64)).all(), f"{n} has non-finite values"
        err = rel_err(g, w)  # the model is float64: only the final rounding to the input dtype is left
        assert err <= TOL[tol], f"{variant} {n}: relative error {err:.2e} > {TOL[tol]:.0e} ({tol})"
    empty = ~np.isfinite(lse)                          # (b, h, nq): rows that saw no key get exact zeros
    assert (grads[0].transpose(0, 2, 1, 3)[empty] == 0).all()
    return grads


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Nq{}-Nk{}-H{}-Hkv{}{}{}".format(
    *c[:5], "-causal" if c[5] else "", "-strided" if c[6] else ""))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_numpy_backend_gradients(dtype, case, rng):
    _check_model_path("fa2", dtype, case, rng, scale=0.7 / math.sqrt(64))


def test_default_scale_is_one_over_sqrt_head_dim(rng):
    args = _case(rng)
    for a, b in zip(fav.attention_backward(*args, backend="numpy"),
                    fav.attention_backward(*args, softmax_scale=1 / math.sqrt(64), backend="numpy")):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("v", ENTRIES, ids=[v.name for v in ENTRIES])
def test_every_registered_backward_model(v, rng):
    if v.reference_backward is None:
        pytest.skip(f"{v.name} has no NumPy backward model")
    _check_model_path(v.name, v.dtypes[0], CASES[1], rng)


# ------------------------------------------------------------------------------------------------ dout's layout
def _layouts(a, xp):
    """``a`` (B, N, H, d) in layouts a caller may hand over: every stride but the last one's honoured, a strided
    last dimension, negative strides, and a broadcast (stride 0) of one row."""
    wide = xp.zeros(a.shape[:3] + (2 * a.shape[3],), a.dtype)
    wide[..., ::2] = xp.asarray(a)
    flipped = xp.ascontiguousarray(xp.asarray(a)[:, ::-1])[:, ::-1]
    transposed = xp.ascontiguousarray(xp.asarray(a).transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    return {"outer strides": transposed, "strided last dim": wide[..., ::2], "negative strides": flipped}


def _same(a, b):
    a, b = (np.asarray(x.get() if hasattr(x, "get") else x) for x in (a, b))
    return a.shape == b.shape and np.array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("xp_name", ["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("which", ["dout", "out"])
def test_dout_and_out_of_any_layout_give_the_same_gradients(which, xp_name, rng):
    """dout (and out) are read right whatever their strides: the gradients equal those of contiguous copies, bit
    for bit, on the NumPy model and on the GPU; a broadcast dout (stride 0, as sum() hands autograd) too."""
    xp = np if xp_name == "numpy" else pytest.importorskip("cupy")
    host = list(_case(rng, b=2, nq=37, nk=29, h=4, hkv=2, d=64, causal=True))
    given = [xp.asarray(a) for a in host]
    i = backward.NAMES.index(which)
    want = fav.attention_backward(*given, causal=True)
    for name, view in _layouts(host[i], xp).items():
        args = list(given)
        args[i] = view
        got = fav.attention_backward(*args, causal=True)
        assert all(_same(g, w) for g, w in zip(got, want)), f"{which} with {name}"
    if which == "dout":
        row = xp.asarray(host[0][:1, :1, :1])
        args = list(given)
        args[0] = xp.broadcast_to(row, host[0].shape)
        dense = list(given)
        dense[0] = xp.ascontiguousarray(args[0])
        got, want = fav.attention_backward(*args, causal=True), fav.attention_backward(*dense, causal=True)
        assert all(_same(g, w) for g, w in zip(got, want)), "broadcast dout"
