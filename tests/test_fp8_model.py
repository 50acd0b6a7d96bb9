"""The FP8 (e4m3) NumPy model (fa_variants/reference/fp8.py) and its accuracy study, on the CPU.

Quantization must round-trip within e4m3's step and scale large inputs into range; the rotation must be
orthogonal; the attention model must be close to float64 (within the fp8 tolerance) yet really quantize; NaN
must stay visible; rows without keys give zeros. Inputs are fresh each run (seed in a failed test's report)."""
import math
import warnings

import ml_dtypes
import numpy as np
import pytest

from conftest import TOL, new_seed, reference64, rel_err
from fa_variants import fp8_study
from fa_variants.reference import fp8

E4M3_HALF_STEP = 2.0 ** -4   # round to nearest with 3 mantissa bits: |error| <= 2^-4 relative for normals
SMALLEST_NORMAL = 2.0 ** -6
SMALLEST_SUBNORMAL = 2.0 ** -9


def check_roundtrip(x, z):
    """Every entry of x within e4m3's rounding of its dequantized value, and nothing saturated or NaN."""
    vals = z.values.astype(np.float64)
    s = z.scale_per_element()
    assert np.isfinite(vals).all(), "finite input produced a NaN e4m3 value"
    assert np.abs(vals).max() <= 448
    back = z.dequantize()
    scaled = np.abs(x) / s
    normal = scaled >= SMALLEST_NORMAL
    assert normal.mean() > 0.9, "test inputs should be mostly in the normal range"
    rel = np.abs(back[normal] - x[normal]) / np.abs(x[normal])
    assert rel.max() <= E4M3_HALF_STEP * (1 + 1e-6), f"normal values off by {rel.max():.3g} relative"
    # subnormals: absolute error at most half the subnormal step, in scaled units
    sub_err = np.abs(back[~normal] - x[~normal]) / s[~normal]
    assert sub_err.size == 0 or sub_err.max() <= SMALLEST_SUBNORMAL / 2 * (1 + 1e-6)


# ---------------------------------------------------------------------------------------------- quantization

@pytest.mark.parametrize("block", [64, 37])
def test_block_quantization_round_trip_and_scales(rng, block):
    b, n, h, d = 2, 150, 3, 64
    # blocks of wildly different magnitude, up to fp16's largest value 65504 (far beyond e4m3's 448)
    mag = 10.0 ** rng.uniform(-3, 3.5, size=(b, 1, h, 1))
    x = np.clip(rng.standard_normal((b, n, h, d)) * mag, -65504, 65504).astype(np.float16)
    x[0, 5, 1, 7] = np.float16(65504)
    x[1, n - 1, 2, 0] = np.float16(-65504)
    z = fp8.quantize(x, block=block)
    x = x.astype(np.float64)
    t = math.ceil(n / block)
    assert z.values.dtype == ml_dtypes.float8_e4m3fn and z.values.shape == x.shape
    assert z.scale.dtype == np.float32 and z.scale.shape == (b, h, t)
    for j in range(t):
        amax = np.abs(x[:, j * block:(j + 1) * block]).max(axis=(1, 3))          # (b, h)
        np.testing.assert_allclose(z.scale[:, :, j], amax / 448, rtol=1e-6)
        # the block's largest entry lands on 448: the range is used, nothing above it is clipped
        top = np.abs(z.values[:, j * block:(j + 1) * block].astype(np.float64)).max(axis=(1, 3))
        assert (top == 448).all()
    check_roundtrip(x, z)
    # fp16's extreme values come back within e4m3's step, not saturated at 448 * scale of a smaller block
    back = z.dequantize()
    assert abs(back[0, 5, 1, 7] / 65504 - 1) <= E4M3_HALF_STEP
    assert abs(back[1, n - 1, 2, 0] / -65504 - 1) <= E4M3_HALF_STEP


def test_per_channel_v_scales(rng):
    b, n, h, d = 2, 77, 2, 32
    chan = 10.0 ** np.linspace(-2, 4, d)                    # every channel its own magnitude
    x = rng.standard_normal((b, n, h, d)) * chan
    z = fp8.quantize(x, granularity="channel")
    assert z.scale.shape == (b, h, d) and z.scale.dtype == np.float32
    np.testing.assert_allclose(z.scale, np.abs(x).max(axis=1) / 448, rtol=1e-6)
    assert (np.abs(z.values.astype(np.float64)).max(axis=1) == 448).all()
    check_roundtrip(x, z)


def test_per_tensor_scale_and_zero_block(rng):
    x = rng.standard_normal((1, 64, 2, 16)) * 300
    z = fp8.quantize(x, granularity="tensor")
    assert z.scale.shape == () and np.isclose(z.scale, np.abs(x).max() / 448, rtol=1e-6)
    check_roundtrip(x, z)
    x[:, :32] = 0
    z = fp8.quantize(x, block=32)
    assert (z.scale[:, :, 0] == 1).all() and (z.values[:, :32].astype(np.float64) == 0).all()


def test_quantize_non_finite_becomes_nan_with_finite_scale(rng):
    x = rng.standard_normal((1, 64, 1, 16))
    x[0, 3, 0, 2], x[0, 9, 0, 5] = np.nan, np.inf
    z = fp8.quantize(x, block=64)
    assert np.isfinite(z.scale).all()
    vals = z.values.astype(np.float64)
    assert np.isnan(vals[0, 3, 0, 2]) and np.isnan(vals[0, 9, 0, 5])
    assert np.isnan(vals).sum() == 2
    with pytest.raises(ValueError, match="granularity"):
        fp8.quantize(x, granularity="row")


# ---------------------------------------------------------------------------------------------- rotation

@pytest.mark.parametrize("d", [1, 2, 64, 128, 256])
def test_rotation_is_orthogonal_and_keeps_qk(rng, d):
    R = fp8.hadamard_rotation(d, seed=int(rng.integers(2**31)))
    np.testing.assert_allclose(R @ R.T, np.eye(d), rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.abs(R), 1 / math.sqrt(d), rtol=1e-15)
    q = rng.standard_normal((2, 33, 3, d))
    k = rng.standard_normal((2, 40, 3, d))
    qr, kr = fp8.rotate_qk(q, k, seed=7)
    before = np.einsum("bihd,bjhd->bhij", q, k)
    after = np.einsum("bihd,bjhd->bhij", qr, kr)
    assert np.abs(after - before).max() <= 1e-12 * max(1.0, np.abs(before).max())
    if d >= 64:  # the rotation really acts: q itself changes, and a different seed gives another matrix
        assert np.abs(qr - q).max() > 0.1
        assert np.abs(fp8.hadamard_rotation(d, 1) - fp8.hadamard_rotation(d, 2)).max() > 0


@pytest.mark.parametrize("d", [96, 3, 0])
def test_rotation_needs_power_of_two_head_dim(rng, d):
    with pytest.raises(ValueError, match="head_dim"):
        fp8.hadamard_rotation(d, 0)
    if d:
        q = rng.standard_normal((1, 8, 1, d))
        with pytest.raises(ValueError, match="head_dim"):
            fp8.forward(q, q, q, rotate=True)
        assert np.isfinite(fp8.forward(q, q, q).out).all()     # without rotation any head_dim is fine


# ---------------------------------------------------------------------------------------------- the model

SHAPES = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, causal); GQA 4:1 throughout
    (32, 1, 257, 8, 2, False), (32, 1, 257, 8, 2, True), (2, 37, 257, 4, 1, True), (2, 257, 37, 4, 1, True),
    (2, 257, 257, 4, 1, False), (2, 37, 1, 4, 1, False),
]
# e4m3's 3 mantissa bits put the N(0,1) error near 5.2% (std ~0.15% at these sizes, measured over 40 seeds);
# seqlen_q = 1 gets more batches and heads so that its error is averaged over as many entries as the others: with
# 8 batches its tail reached the 6% bound once in 3000 seeds (6.76%; CI met a 6.23%), with 32 the largest of 2000
# seeds was 5.65% (std 0.08%), tensor or block scaling.


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("scaling", ["block", "tensor"])
@pytest.mark.parametrize("batch,n_q,n_k,h,h_kv,causal", SHAPES)
def test_fp8_model_close_to_float64_but_quantized(rng, batch, n_q, n_k, h, h_kv, causal, scaling, rotate):
    d = 64
    q = rng.standard_normal((batch, n_q, h, d))
    k = rng.standard_normal((batch, n_k, h_kv, d))
    v = rng.standard_normal((batch, n_k, h_kv, d))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                          # no NaN/overflow warnings on clean input
        res = fp8.forward(q, k, v, causal=causal, rotate=rotate, scaling=scaling, seed=3)
    ref, ref_lse = reference64(q, k, v, causal=causal)
    assert res.out.shape == q.shape and res.lse.shape == (batch, h, n_q)
    assert np.isfinite(res.out).all()
    err = rel_err(res.out, ref)
    assert err <= TOL["float8_e4m3fn"], f"error {err:.3g} above the fp8 tolerance"
    if n_k > 1 or scaling == "tensor":
        assert err > 1e-4, f"error {err:.3g}: the model does not really quantize"
    else:  # one key: P = 1 and v / (its per-channel scale) = +-448 exactly, so the block model is exact
        assert err < 1e-6
    empty = np.isneginf(ref_lse)
    assert (np.isneginf(res.lse) == empty).all()
    assert np.abs(res.lse[~empty] - ref_lse[~empty]).max() < 0.5
    assert res.blocks == (128, 64)


def test_p_scale_keeps_small_probabilities(rng):
    """One sink key scores ~7.5 above 2047 others, whose probabilities (~e^-7.5 < 2^-10) flush to zero in e4m3
    unless P is multiplied by 256 before the cast; together they carry half of the softmax mass."""
    d, n = 64, 2048
    q = 0.1 * rng.standard_normal((1, 64, 2, d))
    q[..., 0] = 1
    k = rng.standard_normal((1, n, 2, d))
    k[:, 0, :, 0] = 7.5 * math.sqrt(d)
    v = rng.standard_normal((1, n, 2, d)) + 1.0               # a nonzero mean: the small terms do not cancel
    ref, _ = reference64(q, k, v)
    e1 = rel_err(fp8.forward(q, k, v, p_scale=1).out, ref)
    e256 = rel_err(fp8.forward(q, k, v, p_scale=256).out, ref)
    assert e256 <= e1 and e256 < 0.2 * e1, f"p_scale 256: {e256:.3g}, p_scale 1: {e1:.3g}"
    for bad in (3, 512, 0, -2, float("nan")):
        with pytest.raises(ValueError, match="p_scale"):
            fp8.forward(q, k, v, p_scale=bad)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("rotate", [False, True])
def test_nan_in_a_query_row_stays_in_that_row(rng, bad, rotate):
    q = rng.standard_normal((2, 200, 2, 64))
    k = rng.standard_normal((2, 150, 1, 64))
    v = rng.standard_normal((2, 150, 1, 64))
    q[1, 70, 0, 5] = bad
    res = fp8.forward(q, k, v, rotate=rotate)
    assert np.isnan(res.out[1, 70, 0]).all() and np.isnan(res.lse[1, 0, 70])
    others = np.ones(res.out.shape[:3], bool)
    others[1, 70, 0] = False
    assert np.isfinite(res.out[others]).all(), "a NaN in one query row leaked into other rows"
    assert np.isfinite(np.delete(res.lse.reshape(-1), np.ravel_multi_index((1, 0, 70), res.lse.shape))).all()


def test_nan_in_a_key_reaches_the_rows_that_see_it(rng):
    q = rng.standard_normal((1, 40, 2, 64))
    k = rng.standard_normal((1, 40, 2, 64))
    v = rng.standard_normal((1, 40, 2, 64))
    k[0, 20, 1, 0] = np.nan
    res = fp8.forward(q, k, v, causal=True)
    assert np.isnan(res.out[0, 20:, 1]).all()                 # rows 20.. of head 1 see key 20
    assert np.isfinite(res.out[0, :20, 1]).all() and np.isfinite(res.out[0, :, 0]).all()


def test_rows_without_visible_keys_are_zero(rng):
    n_q, n_k = 100, 30                                        # causal: the first 70 rows see no key
    q = rng.standard_normal((1, n_q, 2, 64))
    k = rng.standard_normal((1, n_k, 2, 64))
    v = rng.standard_normal((1, n_k, 2, 64)) + 1.0
    res = fp8.forward(q, k, v, causal=True, block_q=32, block_k=16)
    assert (res.out[:, :n_q - n_k] == 0).all() and np.isneginf(res.lse[:, :, :n_q - n_k]).all()
    assert np.isfinite(res.lse[:, :, n_q - n_k:]).all() and (np.abs(res.out[:, n_q - n_k:]) > 0).any(axis=-1).all()


# ---------------------------------------------------------------------------------------------- the study

def test_study_block_and_rotation_beat_per_tensor_on_outliers():
    # Fixed seed: over seeds 0-19 the ratio (block+rotation / per-tensor RMSE) at this size ranged 0.57-0.96,
    # so a fresh seed could occasionally cross 1 at n=256; the claim is checked where it is deterministic.
    rows = fp8_study.study(n=256, d=64, seed=0)
    assert {(r["distribution"], r["method"]) for r in rows} == {
        (dd, m) for dd in fp8_study.DISTRIBUTIONS for m in fp8_study.METHODS}
    by = {(r["distribution"], r["method"]): r for r in rows}
    for key in ("rel_error", "rmse"):
        assert by["outliers", "fp8 block+rotation"][key] <= by["outliers", "fp8 per-tensor"][key]
    for dd in fp8_study.DISTRIBUTIONS:                         # fp8 really is coarser than bf16
        assert by[dd, "fa2 bf16"]["rel_error"] < by[dd, "fp8 block"]["rel_error"]
    assert all(0 < r["rel_error"] < 1 and r["rmse"] > 0 for r in rows)


def test_truncated_accumulator_model():
    rng = np.random.default_rng(new_seed())
    a, b = rng.standard_normal((3, 16, 96)), rng.standard_normal((3, 96, 8))
    assert np.array_equal(fp8.tc_matmul(a, b), a @ b)
    assert np.allclose(fp8.tc_matmul(a, b, 50), a @ b, rtol=1e-12, atol=1e-12)
    rough = fp8.tc_matmul(a, b, 8)
    assert 1e-4 < np.abs(rough - a @ b).max() < 0.5        # 8 bits: visibly coarse, still the same product
    acc = rng.standard_normal((3, 16, 8))
    assert np.allclose(fp8.tc_matmul(a, b, None, acc=acc), acc + a @ b)
    q, k, v = (rng.standard_normal((1, 70, 2, 64)) for _ in range(3))
    exact = fp8.forward(q, k, v, block_q=32, block_k=32).out
    assert np.array_equal(fp8.forward(q, k, v, block_q=32, block_k=32, accumulate_bits=None).out, exact)
    d14 = np.linalg.norm(fp8.forward(q, k, v, block_q=32, block_k=32, accumulate_bits=14).out - exact)
    assert 0 < d14 / np.linalg.norm(exact) < 2e-2


def test_fp8_kernel_choice_and_its_tiles(monkeypatch):
    """sm_90 (and no GPU: the H200 is what the IO model describes) runs the wgmma kernel with SM90_TILES;
    kernel="mma_sync" selects the mma.sync kernel and its TILES. Both tables cover the entry's
    head dims, and the tiles reported to the IO model are the chosen kernel's."""
    from fa_variants import gpu, registry
    from fa_variants.kernels import fa2_fp8 as k
    entry = registry.get("fa2_fp8")
    assert set(k.TILES) == set(k.SM90_TILES)
    assert {k.fp8_template_dim(d) for d in entry.head_dims} == set(k.TILES), "every head dim pads to a template"
    monkeypatch.setattr(gpu, "compute_capability", lambda: 90)
    assert k.uses_wgmma()
    assert all(k.tiles(d) == tuple(k.SM90_TILES[d][0][:2]) for d in k.TILES)
    assert all(k.config(d, kernel="mma_sync")[:2] == tuple(k.TILES[d][0][:2]) for d in k.TILES)
    monkeypatch.setattr(gpu, "compute_capability", lambda: 89)
    assert not k.uses_wgmma()


# ---------------------------------------------------------------------------------------------- fav.fp8 API
def test_fp8_api_rejects_misuse_before_touching_a_gpu():
    import fa_variants as fav
    q = np.ones((1, 8, 2, 64), dtype=np.float16)
    with pytest.raises(TypeError, match="GPU arrays"):
        fav.fp8.quantize(q, q, q)
    with pytest.raises(TypeError, match="qz must be the result of fa_variants.fp8.quantize"):
        fav.fp8.attention(q)
    kv_only = fav.fp8.Quantized(parts={"k": None}, wrap=None)
    with pytest.raises(ValueError, match="pass q exactly when qz holds only K and V"):
        fav.fp8.attention(kv_only)
    with pytest.raises(ValueError, match="head_dim"):
        fav.fp8.quantize(np.ones((1, 8, 2, 40), dtype=np.float16), q[..., :40], q[..., :40])
    with pytest.raises(TypeError, match="rotate must be True or False"):
        fav.fp8.quantize(q, q, q, rotate=1)
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        fav.fp8.quantize_kv(q, q, rotate=True, seed=-1)
