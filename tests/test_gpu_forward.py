"""Every registered variant whose launcher exists, on the GPU, against the float64 reference of conftest.py.

Inputs are fresh N(0, 1) draws each run (seeds are recorded on each test and printed on failure); the float64
reference of one (shape, dtype) is computed once per test run on the CPU and reused by every variant. Outputs
are poisoned: before each call the CuPy memory pool is emptied and refilled with one block of all-ones bytes
(NaN in every float format), so any output element or LSE entry a kernel forgets to write reads back as NaN.
"""
from __future__ import annotations

import numpy as np
import pytest

import fa_variants as fav
from fa_variants import arrays, registry
from conftest import Case, assert_matches, new_seed, place, random_qkv_host, reference64, to_device, to_host

pytestmark = pytest.mark.gpu

# Head dims tried on each variant: every template dim the kernels pad to, and padded dims in between (odd ones
# included: they go through the padded copy), so every instance and both padding paths run.
HEAD_DIMS = (1, 8, 16, 32, 40, 59, 64, 80, 96, 111, 128, 144, 160, 192, 200, 224, 256)


CASES = [
    Case(1, 1, 1, 2, 2, 64, False),
    Case(1, 1, 1, 2, 2, 64, True),
    Case(2, 37, 37, 3, 3, 64, False),            # batch > 1, heads > 1, odd length
    Case(2, 37, 37, 3, 3, 64, True),
    Case(1, 1000, 1000, 2, 2, 128, True),
    Case(1, 1000, 1000, 2, 2, 64, False, True),  # strided q, k, v
    Case(1, 4097, 4097, 2, 2, 64, False),
    Case(1, 4097, 4097, 2, 1, 128, True),        # long, MQA
    Case(1, 37, 1000, 2, 2, 64, True),           # seqlen_q < seqlen_k, causal (bottom-right)
    Case(1, 1000, 37, 2, 2, 64, True),           # seqlen_q > seqlen_k: 963 rows see no key
    Case(2, 1, 4097, 4, 2, 64, True),            # decoding: one query sees every key
    Case(1, 129, 65, 4, 2, 64, True, True),      # seqlen_q > seqlen_k, GQA, strided
    Case(2, 300, 257, 16, 2, 64, False),         # GQA 8:1
    Case(2, 257, 300, 16, 2, 64, True),          # GQA 8:1, causal
    Case(2, 200, 200, 4, 1, 64, True, True),     # MQA, strided
    Case(1, 200, 150, 4, 2, 128, False, "unaligned"),  # rows start at odd elements: still honoured
    Case(1, 70, 70, 2, 2, 64, True, "offset"),   # contiguous, but the base is not 16-byte aligned
]


def _dtypes(v):
    return [dt for dt in v.dtypes if dt in ("float16", "bfloat16")]


def _head_dims(v):
    return [d for d in HEAD_DIMS if d in v.head_dims]


def _variant_param(v, *values, id_):
    return pytest.param(v, *values, id=id_)


# Variants whose tensor cores take the input's own 16-bit format; fa2_fp8 (e4m3 operands, its own tolerances)
# is checked by test_gpu_fp8.py.
HALF_VARIANTS = [v for v in registry.variants() if v.operand_dtype is None]


def _cases():
    for v in HALF_VARIANTS:
        for dt in _dtypes(v):
            cases = [c for c in CASES if c.head_dim in v.head_dims]
            cases += [Case(2, 130, 97, 4, 2, d, causal) for d in _head_dims(v) for causal in (False, True)]
            for c in cases:
                yield _variant_param(v, dt, c, id_=f"{v.name}-{dt}-{c.id}")


def _per_variant_dtype():
    for v in HALF_VARIANTS:
        for dt in _dtypes(v):
            yield _variant_param(v, dt, id_=f"{v.name}-{dt}")


def _per_variant():
    for v in HALF_VARIANTS:
        yield _variant_param(v, id_=v.name)


def _runnable(v):
    ok, why = v.available()
    if not ok:
        pytest.skip(f"{v.name} cannot run here: {why}")


def _d(v, prefer=64):
    return prefer if prefer in v.head_dims else v.head_dims[0]


# ------------------------------------------------------------------------------------------------ helpers
_REFS: dict = {}


def case_data(request, case: Case, dtype: str, scale=1.0, softmax_scale=None):
    """(host q, k, v, ref out, ref lse) for ``case``: drawn and computed once per test run, reused by every
    variant; the seed is recorded on the requesting test."""
    key = (case, dtype, scale, softmax_scale)
    if key not in _REFS:
        seed = new_seed()
        host = random_qkv_host(np.random.default_rng(seed), case.batch, case.seqlen_q, case.seqlen_k, case.heads,
                               case.heads_kv, case.head_dim, dtype, scale)
        _REFS[key] = (seed, host, reference64(*host, case.causal, softmax_scale))
    seed, host, (ref_out, ref_lse) = _REFS[key]
    request.node.user_properties.append(("seed", seed))
    return host, ref_out, ref_lse


def snapshot(arrs):
    import cupy
    return [cupy.array(a.view(cupy.uint16 if a.dtype.itemsize == 2 else cupy.uint8), copy=True) for a in arrs]


def assert_unchanged(arrs, before):
    import cupy
    for n, a, a0 in zip("qkv", arrs, before):
        now = a.view(cupy.uint16 if a.dtype.itemsize == 2 else cupy.uint8)
        assert bool(cupy.array_equal(now, a0)), f"{n} was modified by the call"


def bits(a):
    return to_host(a).view(np.uint8 if a.dtype.itemsize == 1 else np.uint16 if a.dtype.itemsize == 2 else np.uint32)


# ------------------------------------------------------------------------------------------------ correctness
@pytest.mark.parametrize("variant, dtype, case", list(_cases()))
def test_matches_float64_reference(request, poisoned, variant, dtype, case):
    import cupy
    _runnable(variant)
    host, ref_out, ref_lse = case_data(request, case, dtype)
    q, k, v = to_device(host, case.strided)
    before = snapshot((q, k, v))
    with poisoned(case):
        out, lse = fav.attention(q, k, v, variant=variant.name, causal=case.causal, return_lse=True)
    assert isinstance(out, cupy.ndarray) and isinstance(lse, cupy.ndarray)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_matches(out, ref_out, dtype, lse, ref_lse, what=f"{variant.name} {dtype} {case.id}")
    assert_unchanged((q, k, v), before)


@pytest.mark.parametrize("variant, dtype", list(_per_variant_dtype()))
def test_explicit_softmax_scale_and_plain_return(request, poisoned, variant, dtype):
    import cupy
    _runnable(variant)
    case = Case(2, 190, 211, 4, 2, _d(variant), True)
    scale = 0.37  # far from 1/sqrt(d): a kernel that ignores it fails
    host, ref_out, _ = case_data(request, case, dtype, softmax_scale=scale)
    q, k, v = to_device(host)
    with poisoned(case):
        out = fav.attention(q, k, v, variant=variant.name, causal=True, softmax_scale=scale)
    assert isinstance(out, cupy.ndarray), f"return_lse=False must return the output alone, got {type(out)}"
    assert_matches(out, ref_out, dtype, what=f"{variant.name} softmax_scale={scale}")


@pytest.mark.parametrize("softmax_scale", [-0.37, 0.0], ids=["negative", "zero"])
@pytest.mark.parametrize("variant, dtype", list(_per_variant_dtype()))
def test_negative_and_zero_softmax_scale(request, poisoned, variant, dtype, softmax_scale):
    """Any finite scale is valid, as in torch SDPA. The kernels' row max over the raw scores needs a positive
    one, so the API runs a negative one on -q; at 0 every visible key weighs the same (masked scores are -inf,
    and -inf * 0 is NaN: the launchers pass float32's smallest normal instead). Before both fixes fa1, fa2 and
    fa3 returned all NaN for either scale on the H200."""
    import cupy
    _runnable(variant)
    case = Case(2, 190, 211, 4, 2, _d(variant), True)
    host, ref_out, ref_lse = case_data(request, case, dtype, softmax_scale=softmax_scale)
    q, k, v = to_device(host)
    before = snapshot((q, k, v))
    with poisoned(case):
        out, lse = fav.attention(q, k, v, variant=variant.name, causal=True, softmax_scale=softmax_scale,
                                 return_lse=True)
    assert isinstance(out, cupy.ndarray) and out.dtype == q.dtype
    assert_matches(out, ref_out, dtype, lse, ref_lse, what=f"{variant.name} softmax_scale={softmax_scale}")
    assert_unchanged((q, k, v), before)


@pytest.mark.parametrize("variant, dtype", list(_per_variant_dtype()))
def test_poisoned_pool_unwritten_elements_show(request, poisoned, variant, dtype):
    """The poisoning works (a fresh allocation reads NaN), and the call still leaves no NaN behind."""
    import cupy
    _runnable(variant)
    case = Case(2, 333, 333, 4, 2, _d(variant), True)
    host, ref_out, ref_lse = case_data(request, case, dtype)
    q, k, v = to_device(host)
    with poisoned(case):
        probe = cupy.empty(q.shape, dtype=q.dtype)
        assert bool(cupy.isnan(probe.astype(cupy.float32)).all()), "poisoning did not reach new allocations"
        probe_lse = cupy.empty((case.batch, case.heads, case.seqlen_q), dtype=cupy.float32)
        assert bool(cupy.isnan(probe_lse).all()), "poisoning did not reach new allocations"
        del probe, probe_lse
    with poisoned(case):
        out, lse = fav.attention(q, k, v, variant=variant.name, causal=True, return_lse=True)
    assert not bool(cupy.isnan(out.astype(cupy.float32)).any()), "output holds NaN: elements left unwritten"
    assert not bool(cupy.isnan(lse).any()), "lse holds NaN: entries left unwritten"
    assert_matches(out, ref_out, dtype, lse, ref_lse, what=f"{variant.name} poisoned")


@pytest.mark.parametrize("variant, dtype", list(_per_variant_dtype()))
def test_two_calls_are_bitwise_equal(request, poisoned, variant, dtype):
    _runnable(variant)
    case = Case(2, 300, 257, 8, 2, _d(variant), True)
    host, ref_out, ref_lse = case_data(request, case, dtype)
    q, k, v = to_device(host)
    with poisoned(case):
        out1, lse1 = fav.attention(q, k, v, variant=variant.name, causal=True, return_lse=True)
    with poisoned(case):
        out2, lse2 = fav.attention(q, k, v, variant=variant.name, causal=True, return_lse=True)
    assert_matches(out1, ref_out, dtype, lse1, ref_lse, what="first call")
    assert np.array_equal(bits(out1), bits(out2)), "two calls on the same inputs differ"
    assert np.array_equal(bits(lse1), bits(lse2)), "two calls on the same inputs give different lse"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant, dtype", list(_per_variant_dtype()))
def test_inputs_times_30_stay_finite_and_correct(request, poisoned, variant, dtype, causal):
    _runnable(variant)
    case = Case(1, 513, 513, 2, 2, _d(variant), causal)
    host, ref_out, ref_lse = case_data(request, case, dtype, scale=30.0)
    q, k, v = to_device(host)
    with poisoned(case):
        out, lse = fav.attention(q, k, v, variant=variant.name, causal=causal, return_lse=True)
    assert_matches(out, ref_out, dtype, lse, ref_lse, what=f"{variant.name} inputs x30")


@pytest.mark.parametrize("variant, dtype", list(_per_variant_dtype()))
def test_causal_rows_without_keys_are_zero_with_lse_neg_inf(request, poisoned, variant, dtype):
    _runnable(variant)
    case = Case(2, 300, 100, 4, 2, _d(variant), True)
    host, ref_out, ref_lse = case_data(request, case, dtype)
    q, k, v = to_device(host)
    with poisoned(case):
        out, lse = fav.attention(q, k, v, variant=variant.name, causal=True, return_lse=True)
    o, l = to_host(out).astype(np.float32), to_host(lse)
    empty = case.seqlen_q - case.seqlen_k  # rows 0 .. 199 see no key under bottom-right alignment
    assert (o[:, :empty] == 0).all(), "rows with no visible key must be exactly zero"
    assert np.isneginf(l[:, :, :empty]).all(), "rows with no visible key must have lse = -inf"
    assert np.isfinite(l[:, :, empty:]).all() and (np.abs(o[:, empty:]) > 0).any()
    assert_matches(out, ref_out, dtype, lse, ref_lse, what=f"{variant.name} empty causal rows")


# ------------------------------------------------------------------------------------------------ array kinds
@pytest.mark.parametrize("variant, dtype", list(_per_variant_dtype()))
def test_numpy_in_numpy_out(request, variant, dtype):
    _runnable(variant)
    case = Case(2, 77, 91, 4, 2, _d(variant), True, True)
    host, ref_out, ref_lse = case_data(request, case, dtype)
    q, k, v = (place(a, "numpy", True, role) for a, role in zip(host, "qkv"))
    before = [a.copy() for a in (q, k, v)]
    out, lse = fav.attention(q, k, v, variant=variant.name, causal=True, return_lse=True)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_matches(out, ref_out, dtype, lse, ref_lse, what=f"{variant.name} numpy in")
    for n, a, a0 in zip("qkv", (q, k, v), before):
        assert np.array_equal(bits(a), bits(a0)), f"{n} was modified"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("variant", list(_per_variant()))
def test_torch_in_torch_out_zero_copy(variant, dtype, rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    _runnable(variant)
    if dtype not in variant.dtypes:
        pytest.skip(f"{variant.name} does not take {dtype}")
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**62)))
    b, nq, nk, h, hkv, d = 2, 150, 170, 4, 2, _d(variant)
    q = torch.randn(b, h, nq, d, device="cuda", dtype=tdt, generator=gen).transpose(1, 2)  # strided view
    k = torch.randn(b, nk, hkv, d, device="cuda", dtype=tdt, generator=gen)
    v = torch.randn(b, nk, hkv, d, device="cuda", dtype=tdt, generator=gen)
    before = [t.clone() for t in (q, k, v)]

    inp = arrays.import_arrays(q, k, v)  # what attention() sees: views of torch's memory, not copies
    for n, t, a in zip("qkv", (q, k, v), (inp.q, inp.k, inp.v)):
        assert a.data.ptr == t.data_ptr(), f"{n} was copied on import"
        assert tuple(a.strides) == tuple(s * t.element_size() for s in t.stride()), f"{n} strides changed"

    out, lse = fav.attention(q, k, v, variant=variant.name, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert out.dtype == tdt and tuple(out.shape) == tuple(q.shape) and out.device == q.device
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (b, h, nq) and lse.device == q.device
    ref_out, ref_lse = reference64(q, k, v, True, None)
    assert_matches(out, ref_out, dtype, lse, ref_lse, what=f"{variant.name} torch {dtype}")
    for n, t, t0 in zip("qkv", (q, k, v), before):
        assert torch.equal(t, t0), f"{n} was modified"


@pytest.mark.parametrize("variant, dtype", list(_per_variant_dtype()))
def test_current_cupy_stream_is_honoured(request, variant, dtype):
    """On a non-blocking stream, q is only written after a ~0.1 s spin kernel; a call that ignored the current
    stream would read q before that write and disagree with the reference."""
    import cupy
    _runnable(variant)
    case = Case(2, 257, 300, 4, 2, _d(variant), True)
    host, ref_out, ref_lse = case_data(request, case, dtype)
    q_true, k, v = to_device(host)
    q = cupy.asarray(np.random.default_rng(0).standard_normal(q_true.shape, dtype=np.float32)).astype(q_true.dtype)
    spin = cupy.RawKernel(r'''
        extern "C" __global__ void spin(long long cycles) {
            long long t0 = clock64();
            while (clock64() - t0 < cycles) { }
        }''', "spin")
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        spin((1,), (1,), (np.int64(200_000_000),))
        q[...] = q_true
        out, lse = fav.attention(q, k, v, variant=variant.name, causal=True, return_lse=True)
    stream.synchronize()
    assert_matches(out, ref_out, dtype, lse, ref_lse, what=f"{variant.name} on a non-default stream")
    out_default = fav.attention(q_true, k, v, variant=variant.name, causal=True)
    assert np.array_equal(bits(out), bits(out_default)), "non-default stream and default stream results differ"


# ------------------------------------------------------------------------------------------------ naive limits
def test_naive_refuses_what_does_not_fit(rng):
    import cupy
    v = registry.get("naive")
    _runnable(v)
    shape = (1, 131072, 16, 128)  # S alone: 16 x 131072^2 fp32 = 1 TiB
    cupy.random.seed(int(rng.integers(2**31)))
    q, k, vv = (cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    used = pool.used_bytes()
    with pytest.raises((MemoryError, ValueError), match="fa2"):
        fav.attention(q, k, vv, variant="naive")
    assert pool.used_bytes() - used < 2**30, "naive allocated gigabytes before refusing"
