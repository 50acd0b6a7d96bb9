"""``fa_variants.attention`` argument checking (CPU; the same misuse cases also run on CuPy arrays on a GPU).

Every misuse must raise TypeError/ValueError naming the argument, before anything is copied to the GPU, a
kernel is launched or a NumPy model runs. Then the NumPy-model path (``backend="numpy"``) end to end.
"""
from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest

import fa_variants as fav
from fa_variants.kernels import KernelLauncher
from fa_variants import arrays, dispatch, registry
from conftest import assert_matches, has_gpu, place, random_qkv_host, reference64

ENTRIES = registry.variants()
IDS = [v.name for v in ENTRIES]
SUPPORTED_DTYPES = [np.float16, ml_dtypes.bfloat16]


def _head_dim(v, prefer=64):
    return prefer if prefer in v.head_dims else v.head_dims[0]


def _bad_head_dim(v):
    return next(d for d in (40, 257, 512) if d not in v.head_dims)


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    if request.param == "numpy":
        return np
    import cupy
    return cupy


@pytest.fixture
def nothing_runs(monkeypatch):
    """Make any dispatch (GPU copy, launcher import, NumPy model) fail loudly: misuse must stop before it."""
    def boom(*a, **k):
        raise AssertionError("validation let a misuse through to dispatch")

    no_launch = KernelLauncher(sources=boom, forward_fn=boom, tiles_fn=boom, extra_bytes_fn=boom, backward_fn=boom)
    for name, entry in registry.VARIANTS.items():
        monkeypatch.setitem(registry.VARIANTS, name, dataclasses.replace(entry, reference=boom, launcher=no_launch))
    monkeypatch.setattr(arrays, "to_cupy", boom)
    monkeypatch.setattr(dispatch, "resolve_backend", boom)


@pytest.fixture
def make(xp, rng):
    """make(shape_q=(B, Nq, H, d), shape_kv=(B, Nk, Hkv, d), dtype) -> q, k, v random arrays on ``xp``."""
    def _make(q_shape=(2, 5, 4, 64), kv_shape=(2, 7, 2, 64), dtype=np.float16):
        def one(shape):
            return xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
        return one(q_shape), one(kv_shape), one(kv_shape)
    return _make


def _raises(exc, pattern, q, k, v, **kw):
    kw.setdefault("variant", "naive")
    with pytest.raises(exc, match=pattern) as info:
        fav.attention(q, k, v, **kw)
    return info


# ------------------------------------------------------------------------------------------------ shapes
@pytest.mark.usefixtures("nothing_runs")
class TestShapes:
    @pytest.mark.parametrize("which", ["q", "k", "v"])
    @pytest.mark.parametrize("rank", [3, 5])
    def test_wrong_rank(self, make, which, rank):
        t = dict(zip("qkv", make()))
        a = t[which]
        t[which] = a[0] if rank == 3 else a[None]
        _raises(ValueError, rf"^{which} must have 4 dimensions", t["q"], t["k"], t["v"])

    @pytest.mark.parametrize("which", ["k", "v"])
    def test_batch_mismatch(self, make, which):
        t = dict(zip("qkv", make()))
        t[which] = t[which][:1]
        _raises(ValueError, rf"batch.*q 2.*{which} 1", t["q"], t["k"], t["v"])

    @pytest.mark.parametrize("which", ["q", "k", "v"])
    def test_head_dim_mismatch(self, make, which):
        t = dict(zip("qkv", make()))
        t[which] = t[which][..., :32].copy()
        _raises(ValueError, rf"head_dim.*{which} 32", t["q"], t["k"], t["v"])

    def test_k_v_seqlen_mismatch(self, make):
        q, k, v = make()
        _raises(ValueError, r"\bk\b and \bv\b.*seqlen_k", q, k, v[:, :3].copy())

    def test_k_v_heads_mismatch(self, make):
        q, k, v = make()
        _raises(ValueError, r"\bk\b and \bv\b.*heads_kv", q, k[:, :, :1].copy(), v)

    @pytest.mark.parametrize("heads, heads_kv", [(3, 2), (4, 3), (1, 2)])
    def test_heads_not_divisible(self, make, heads, heads_kv):
        q, k, v = make((2, 5, heads, 64), (2, 7, heads_kv, 64))
        _raises(ValueError, rf"heads of q \({heads}\).*multiple.*\({heads_kv}\)", q, k, v)

    @pytest.mark.parametrize("axis", [0, 1, 2, 3])
    @pytest.mark.parametrize("which", ["q", "k"])
    def test_zero_size(self, make, which, axis):
        q_shape, kv_shape = [2, 5, 4, 64], [2, 7, 2, 64]
        (q_shape if which == "q" else kv_shape)[axis] = 0
        q, k, v = make(tuple(q_shape), tuple(kv_shape))
        _raises(ValueError, rf"{which} has a zero-size dimension", q, k, v)

    @pytest.mark.parametrize("which", ["q", "k", "v"])
    def test_last_dim_not_contiguous(self, make, which):
        wide = dict(zip("qkv", make((2, 5, 4, 128), (2, 7, 2, 128))))
        t = {n: a[..., :64] for n, a in wide.items()}  # head_dim 64, last dimension contiguous: valid
        t[which] = wide[which][..., ::2]               # head_dim 64 with a 4-byte element stride
        _raises(ValueError, rf"^{which} must be contiguous in its last dimension", t["q"], t["k"], t["v"])

    @pytest.mark.parametrize("which", ["q", "k", "v"])
    def test_negative_strides(self, make, which):
        t = dict(zip("qkv", make()))
        t[which] = t[which][:, ::-1]
        _raises(ValueError, rf"^{which} has negative strides", t["q"], t["k"], t["v"])


# ------------------------------------------------------------------------------------------------ dtypes
@pytest.mark.usefixtures("nothing_runs")
class TestDtypes:
    @pytest.mark.parametrize("which", ["k", "v"])
    def test_dtype_mismatch(self, make, which):
        t = dict(zip("qkv", make()))
        t[which] = t[which].astype(ml_dtypes.bfloat16)
        _raises(TypeError, rf"share one dtype.*{which} bfloat16", t["q"], t["k"], t["v"])

    @pytest.mark.parametrize("v", ENTRIES, ids=IDS)
    @pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int8, np.bool_])
    def test_unsupported_dtype(self, make, v, dtype):
        if np.dtype(dtype).name in v.dtypes:
            pytest.skip(f"{v.name} accepts {np.dtype(dtype).name}")
        d = _head_dim(v)
        q, k, vv = (a.astype(dtype) for a in make((1, 5, 2, d), (1, 7, 2, d)))
        info = _raises(TypeError, rf"dtype.*{np.dtype(dtype).name}", q, k, vv, variant=v.name)
        for ok in v.dtypes:
            assert ok in str(info.value), f"the message should list {ok}: {info.value}"

    @pytest.mark.parametrize("v", ENTRIES, ids=IDS)
    def test_unsupported_head_dim(self, make, v):
        bad = _bad_head_dim(v)
        q, k, vv = make((1, 5, 2, bad), (1, 7, 2, bad))
        info = _raises(ValueError, rf"head_dim.*{bad}", q, k, vv, variant=v.name)
        assert v.head_dims_text in str(info.value)

    def test_fa2_rejects_head_dim_257_and_float32(self, make):
        q, k, v = make((1, 5, 2, 257), (1, 7, 2, 257))
        _raises(ValueError, r"head_dim.*257", q, k, v, variant="fa2")
        q, k, v = (a.astype(np.float32) for a in make((1, 5, 2, 64), (1, 7, 2, 64)))
        _raises(TypeError, r"dtype.*float32", q, k, v, variant="fa2")


# ------------------------------------------------------------------------------------------------ scalars
@pytest.mark.usefixtures("nothing_runs")
class TestScalars:
    @pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), np.float32("nan"), np.inf])
    def test_non_finite_softmax_scale(self, make, scale):
        _raises(ValueError, r"softmax_scale must be finite", *make(), softmax_scale=scale)

    @pytest.mark.parametrize("scale", ["0.1", True, [0.1], 1j])
    def test_non_real_softmax_scale(self, make, scale):
        _raises(TypeError, r"softmax_scale", *make(), softmax_scale=scale)

    @pytest.mark.parametrize("causal", [1, 0, "yes", None, 1.0, np.int32(1)])
    def test_non_bool_causal(self, make, causal):
        _raises(TypeError, r"causal must be a bool", *make(), causal=causal)

    @pytest.mark.parametrize("flag", [1, "true", None])
    def test_non_bool_return_lse(self, make, flag):
        _raises(TypeError, r"return_lse must be a bool", *make(), return_lse=flag)

    @pytest.mark.parametrize("name", ["nope", "FA2", "flash", "", None])
    def test_unknown_variant_lists_valid_names(self, make, name):
        info = _raises(ValueError, r"variant", *make(), variant=name)
        for v in ENTRIES:
            assert v.name in str(info.value), f"{v.name} missing from: {info.value}"

    @pytest.mark.parametrize("backend", ["tpu", "CUDA", "", None])
    def test_unknown_backend(self, make, backend):
        info = _raises(ValueError, r"backend", *make(), backend=backend)
        for b in ("auto", "cuda", "numpy"):
            assert b in str(info.value)


# ------------------------------------------------------------------------------------------------ array kinds
class _FakeGpuArray:
    """Claims to live on a CUDA device through DLPack, and fails if anyone actually tries to import it."""
    shape, ndim = (2, 7, 2, 64), 4

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, device 0

    def __dlpack__(self, *a, **k):
        raise AssertionError("a device mismatch must be reported before any array is imported")


@pytest.mark.usefixtures("nothing_runs")
class TestArrayKinds:
    @pytest.mark.parametrize("which", ["q", "k", "v"])
    @pytest.mark.parametrize("bad", [[[1.0]], 3.0, "q", None])
    def test_not_an_array(self, which, bad, rng):
        t = dict(zip("qkv", (np.asarray(a) for a in random_qkv_host(rng, 1, 3, 3, 2, 2, 64, "float16"))))
        t[which] = bad
        _raises(TypeError, rf"^{which} must be a NumPy or CuPy array", t["q"], t["k"], t["v"])

    @pytest.mark.parametrize("which", ["q", "k", "v"])
    def test_host_and_gpu_mixed(self, which, rng):
        t = dict(zip("qkv", random_qkv_host(rng, 2, 5, 7, 2, 2, 64, "float16")))
        t[which] = _FakeGpuArray()
        _raises(ValueError, rf"same device.*{which} on GPU", t["q"], t["k"], t["v"])

    @pytest.mark.gpu
    @pytest.mark.parametrize("which", ["q", "k", "v"])
    def test_numpy_and_cupy_mixed(self, which, rng):
        import cupy
        t = dict(zip("qkv", random_qkv_host(rng, 2, 5, 7, 2, 2, 64, "float16")))
        t[which] = cupy.asarray(t[which])
        _raises(ValueError, rf"same device.*{which} on GPU", t["q"], t["k"], t["v"])

    @pytest.mark.gpu
    def test_cupy_arrays_on_two_devices(self, rng):
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 2:
            pytest.skip("needs two GPUs")
        host = random_qkv_host(rng, 2, 5, 7, 2, 2, 64, "float16")
        with cupy.cuda.Device(0):
            q, k = cupy.asarray(host[0]), cupy.asarray(host[1])
        with cupy.cuda.Device(1):
            v = cupy.asarray(host[2])
        _raises(ValueError, r"same device", q, k, v)


@pytest.mark.skipif(has_gpu(), reason="a CUDA GPU is present")
def test_cuda_backend_without_gpu_says_why(rng):
    q, k, v = random_qkv_host(rng, 1, 3, 3, 2, 2, 64, "float16")
    with pytest.raises(fav.BackendUnavailable, match=r"'fa2'.*cannot run on the GPU"):
        fav.attention(q, k, v, variant="fa2", backend="cuda")


# ------------------------------------------------------------------------------------------------ NumPy models
MODEL_CASES = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, causal, strided)
    (2, 37, 29, 4, 2, False, False),
    (2, 37, 29, 4, 2, True, False),    # seqlen_q > seqlen_k: the first 8 rows see no key
    (1, 29, 37, 4, 1, True, True),     # seqlen_q < seqlen_k, MQA, strided views
    (1, 1, 1, 2, 2, True, False),
]


@pytest.mark.model
@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: "B{}-Nq{}-Nk{}-H{}-Hkv{}{}{}".format(
    *c[:5], "-causal" if c[5] else "", "-strided" if c[6] else ""))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("v", ENTRIES, ids=IDS)
def test_numpy_backend_runs_the_model(v, dtype, case, rng):
    if dtype not in v.dtypes:
        pytest.skip(f"{v.name} does not take {dtype}")
    b, nq, nk, h, hkv, causal, strided = case
    d = _head_dim(v)
    host = random_qkv_host(rng, b, nq, nk, h, hkv, d, dtype)
    q, k, vv = (place(a, "numpy", strided, r) for a, r in zip(host, "qkv"))
    before = [a.copy() for a in (q, k, vv)]
    scale = 0.7 / math.sqrt(d)
    out, lse = fav.attention(q, k, vv, variant=v.name, causal=causal, softmax_scale=scale,
                             return_lse=True, backend="numpy")
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (b, h, nq)
    ref_out, ref_lse = reference64(q, k, vv, causal, scale)
    assert_matches(out, ref_out, v.operand_dtype or dtype, lse, ref_lse, what=f"{v.name} NumPy model")
    for a, a0, n in zip((q, k, vv), before, "qkv"):
        assert np.array_equal(a.view(np.uint16), a0.view(np.uint16)), f"{n} was modified"


@pytest.mark.model
@pytest.mark.parametrize("v", ENTRIES, ids=IDS)
def test_numpy_backend_default_scale_and_plain_return(v, rng):
    d = _head_dim(v)
    q, k, vv = random_qkv_host(rng, 1, 17, 23, 2, 2, d, "float16")
    out = fav.attention(q, k, vv, variant=v.name, backend="numpy")
    assert isinstance(out, np.ndarray) and out.dtype == np.float16 and out.shape == q.shape
    ref_out, _ = reference64(q, k, vv, False, 1.0 / math.sqrt(d))
    assert_matches(out, ref_out, v.operand_dtype or "float16", what=f"{v.name} NumPy model, default scale")


@pytest.mark.model
@pytest.mark.skipif(has_gpu(), reason="a CUDA GPU is present: auto picks the GPU")
def test_auto_backend_without_gpu_uses_the_model(rng):
    q, k, v = random_qkv_host(rng, 1, 9, 9, 2, 2, 64, "bfloat16")
    out, lse = fav.attention(q, k, v, variant="fa2", causal=True, return_lse=True)
    assert out.dtype == ml_dtypes.bfloat16 and lse.dtype == np.float32
    ref_out, ref_lse = reference64(q, k, v, True, None)
    assert_matches(out, ref_out, "bfloat16", lse, ref_lse, what="auto backend, no GPU")


# ------------------------------------------------------------------------------------------------ masked arrays
@pytest.mark.usefixtures("nothing_runs")
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_masked_arrays_are_refused_naming_the_argument(which, rng):
    """A NumPy masked array's mask would be ignored (only its data is read): refused, whatever the mask holds."""
    t = dict(zip("qkv", random_qkv_host(rng, 1, 5, 7, 2, 2, 64, "float16")))
    t[which] = np.ma.masked_array(t[which], mask=np.zeros(t[which].shape, bool))
    t[which].mask[0, 0, 0, 0] = True
    _raises(TypeError, rf"^{which} is a NumPy masked array, and attention would ignore its mask", t["q"], t["k"],
            t["v"], variant="auto")
