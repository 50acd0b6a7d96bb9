"""The FA3 NumPy model (fa_variants/reference/fa3.py) on the CPU: against the tests' own float64 attention
(conftest.reference64), against FA2's model (same arithmetic, blocks in the other order), its HBM counts against
iomodel's closed form, its block order and consumer split, the P rounding option and the FP8 pipeline.
Inputs are fresh each run (seed in a failed test's report; FA_VARIANTS_SEED replays)."""
import re
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from conftest import TOL, reference64, rel_err
from fa_variants import iomodel
from fa_variants.reference import common, fa2, fa3, fp8
from fa_variants.tiles import fa3_tile

EXACT = 1e-12   # float64 model against float64 attention: rounding only


def inputs(rng, batch, n_q, n_k, heads, heads_kv, d, scale=1.0, dtype=np.float64):
    q = rng.standard_normal((batch, n_q, heads, d)) * scale
    k = rng.standard_normal((batch, n_k, heads_kv, d)) * scale
    v = rng.standard_normal((batch, n_k, heads_kv, d))
    return tuple(a.astype(dtype) for a in (q, k, v))


def run(model, q, k, v, causal, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no divide-by-zero / invalid-value warnings from rows that see no key
        return model(q, k, v, causal=causal, **kw)


def check(q, k, v, causal, tol=EXACT, **kw):
    """fa3.forward against reference64: shapes, the error bound, -inf LSE exactly where no key is seen."""
    res = run(fa3.forward, q, k, v, causal, **kw)
    ref_out, ref_lse = reference64(q, k, v, causal, kw.get("softmax_scale"))
    where = f"q{q.shape} k{k.shape} causal={causal} {kw}"
    assert res.out.dtype == np.float64 and res.out.shape == q.shape, where
    assert res.lse.shape == (q.shape[0], q.shape[2], q.shape[1]), where
    assert np.isfinite(res.out).all(), where
    err = rel_err(res.out, ref_out)
    assert err < tol, f"relative error {err:.2e}: {where}"
    assert np.array_equal(np.isneginf(res.lse), np.isneginf(ref_lse)), where
    seen = np.isfinite(ref_lse)
    np.testing.assert_allclose(res.lse[seen], ref_lse[seen], rtol=1e-12, atol=max(tol, 1e-12), err_msg=where)
    return res


# ---------------------------------------------------------------------------------------------- vs float64

@pytest.mark.parametrize("n_q,n_k", [(1, 1), (1, 37), (37, 1), (37, 37), (1000, 37), (37, 1000), (1000, 1000)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("blocks", [None, (16, 24)], ids=["kernel-tiles", "16x24"])
def test_odd_sizes(rng, n_q, n_k, causal, blocks):
    q, k, v = inputs(rng, 1, n_q, n_k, 2, 2, 8)
    kw = {} if blocks is None else dict(block_q=blocks[0], block_k=blocks[1])
    res = check(q, k, v, causal, **kw)
    assert res.blocks == (blocks or fa3_tile(8, n_k, causal)[:2])


@pytest.mark.parametrize("n_q,n_k", [(300, 129), (129, 300), (128, 256), (256, 128), (200, 201)])
@pytest.mark.parametrize("blocks", [(128, 128), (128, 64), (64, 128), (7, 13)])
def test_causal_seqlen_q_differs_from_seqlen_k(rng, n_q, n_k, blocks):
    q, k, v = inputs(rng, 2, n_q, n_k, 2, 1, 16)
    check(q, k, v, True, block_q=blocks[0], block_k=blocks[1])


@pytest.mark.parametrize("heads,heads_kv", [(8, 2), (4, 1)])   # GQA 4:1 and MQA
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_mqa(rng, heads, heads_kv, causal):
    q, k, v = inputs(rng, 2, 45, 70, heads, heads_kv, 32)
    check(q, k, v, causal, block_q=12, block_k=16)


@pytest.mark.parametrize("d,short,short_causal,long,long_causal", [
    (8, (192, 128), (192, 128), (192, 128), (192, 128)), (64, (192, 128), (192, 128), (192, 128), (192, 128)),
    (100, (128, 128), (128, 128), (128, 160), (128, 128)), (128, (128, 128), (128, 128), (128, 160), (128, 128)),
    (160, (128, 64), (128, 64), (128, 80), (128, 80)), (256, (128, 64), (128, 64), (128, 80), (128, 80))])
def test_kernel_tiles_by_head_dim(rng, d, short, short_causal, long, long_causal):
    """The default blocks are the tiles the kernel launches (fa_variants/tiles.py): at N_k = 140, whole key blocks
    at d 128 and 256 (their short tiles); past the short tiles' bounds, d 128's 160-key blocks (128 causal) and
    d 256's 80."""
    q, k, v = inputs(rng, 1, 150, 140, 1, 1, d)
    assert check(q, k, v, False).blocks == short
    assert check(q, k, v, True).blocks == short_causal
    assert fa3.default_blocks(d, seqlen_k=4096) == fa3.default_blocks(d) == long
    assert fa3.default_blocks(d, causal=True, seqlen_k=4096) == long_causal


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_half_inputs(rng, dtype, causal):
    """fp16 / bf16 inputs: exact on their values by default (fa2's float64 convention); round_p=True rounds P to
    that dtype before P V, as the kernel's wgmma operand, and lands within the kernels' tolerance."""
    q, k, v = inputs(rng, 2, 133, 301, 4, 2, 64, dtype=dtype)
    exact = check(q, k, v, causal, block_q=64, block_k=32, softmax_scale=0.2)
    rounded = run(fa3.forward, q, k, v, causal, block_q=64, block_k=32, softmax_scale=0.2, round_p=True)
    ref_out, ref_lse = reference64(q, k, v, causal, 0.2)
    err = rel_err(rounded.out, ref_out)
    name = np.dtype(dtype).name
    assert 1e-7 < err < TOL[name] / 4, f"round_p error {err:.2e} ({name})"
    assert np.array_equal(rounded.lse, exact.lse), "l is summed from the unrounded P: LSE does not change"


def test_round_p_needs_a_16_bit_input(rng):
    q, k, v = inputs(rng, 1, 8, 8, 1, 1, 16)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        fa3.forward(q, k, v, round_p=True)
    with pytest.raises(TypeError, match="round_p"):
        fa3.forward(q.astype(np.float16), k, v, round_p=1)


@pytest.mark.parametrize("blocks", [(8, 8), (128, 128), (7, 5)])
def test_rows_without_keys_are_zero_with_neg_inf_lse(rng, blocks):
    q, k, v = inputs(rng, 2, 50, 20, 2, 2, 16)  # causal, N_q > N_k: rows 0..29 see no key
    res = check(q, k, v, True, block_q=blocks[0], block_k=blocks[1])
    assert (res.out[:, :30] == 0).all()
    assert np.isneginf(res.lse[:, :, :30]).all() and np.isfinite(res.lse[:, :, 30:]).all()


def test_large_scores_stay_finite_and_exact(rng):
    q, k, v = inputs(rng, 1, 100, 100, 2, 2, 32, scale=30.0)   # scores in the thousands
    check(q, k, v, False, block_q=16, block_k=32)
    check(q, k, v, True, block_q=16, block_k=32)


def test_bad_values_follow_fa2(rng):
    """NaN / Inf in q, k or v: the same NaN pattern as fa2's model (the kernels' rule), the rest equal."""
    q, k, v = inputs(rng, 1, 40, 50, 2, 1, 16)
    q[0, 3, 1, 2], k[0, 44, 0, 5], v[0, 7, 0, 9] = np.nan, np.inf, np.nan
    for causal in (False, True):
        with np.errstate(invalid="ignore"):
            a = fa3.forward(q, k, v, causal=causal, block_q=8, block_k=16)
            b = fa2.forward(q, k, v, causal=causal, block_q=8, block_k=16)
        assert np.array_equal(np.isnan(a.out), np.isnan(b.out)) and np.isnan(a.out).any()
        assert np.array_equal(np.isnan(a.lse), np.isnan(b.lse))
        np.testing.assert_allclose(a.out, b.out, rtol=1e-12, atol=1e-13)


# ---------------------------------------------------------------------------------------------- vs fa2

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q,n_k,blocks", [(300, 300, (32, 48)), (257, 1000, (128, 128)), (1000, 257, (128, 64)),
                                            (61, 83, (7, 5))])
def test_equals_fa2_up_to_rounding(rng, causal, n_q, n_k, blocks):
    q, k, v = inputs(rng, 1, n_q, n_k, 2, 1, 32)
    kw = dict(block_q=blocks[0], block_k=blocks[1])
    a, b = run(fa3.forward, q, k, v, causal, **kw), run(fa2.forward, q, k, v, causal, **kw)
    np.testing.assert_allclose(a.out, b.out, rtol=1e-12, atol=1e-13)
    assert np.array_equal(np.isneginf(a.lse), np.isneginf(b.lse))
    np.testing.assert_allclose(a.lse, b.lse, rtol=1e-13)
    assert a.blocks == b.blocks
    assert_same_traffic_but_empty_ctas(a, b, n_q, n_k, blocks[0], causal)


def assert_same_traffic_but_empty_ctas(a, b, n_q, n_k, block_q, causal, programs=2):
    """fa3's counts are fa2's, except the Q rows of CTAs that see no key (causal, N_q > N_k): not loaded."""
    skipped = (max(0, n_q - n_k) // block_q) * block_q if causal else 0
    fa2_by = b.hbm.by_tensor()
    want = {**fa2_by, "Q": fa2_by["Q"] - programs * skipped * (a.out.shape[3])}
    assert a.hbm.by_tensor() == want


def _fa2_descending(q, k, v, causal, B_r, B_c):
    """FA2's update rule (common.online_softmax_step) per consumer's rows, over the blocks fa3 visits, in its
    order: written without fa3's pipeline, to show the pipeline's reordering is the same arithmetic."""
    Q, K, V, scale = common.prepare(q, k, v, causal=causal, softmax_scale=None)
    N_q, N_k = Q.shape[2], K.shape[2]
    O, LSE = np.zeros_like(Q), np.empty(Q.shape[:3])
    for rows in common.block_slices(N_q, B_r):
        for r in fa3.consumer_rows(rows):
            shape = Q[:, :, r].shape
            m, l, acc = np.full(shape[:3], -np.inf), np.zeros(shape[:3]), np.zeros(shape)
            visits = fa3.consumer_visits(fa3.kv_visits(rows, N_q, N_k, B_c, causal), r, N_q, N_k, B_c, causal)
            for cols, masked in visits:
                S = common.block_scores(Q[:, :, r], K[:, :, cols], scale, r, cols, N_q, N_k, causal)
                m, l, acc = common.online_softmax_step(m, l, acc, S, V[:, :, cols])
            O[:, :, r], LSE[:, :, r] = common.normalize(acc, l), common.logsumexp_from(m, l)
    return common.to_flash_layout(O), LSE


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q,n_k,blocks", [(300, 300, (32, 48)), (200, 130, (128, 64)), (61, 83, (7, 5))])
def test_is_fa2s_update_in_descending_order_bit_for_bit(rng, causal, n_q, n_k, blocks):
    """S_j issued before P_prev V_prev, O rescaled after it: FA2's O = a O + P V with every operation the same,
    so with FA2's running max (rescale_tau = 0) the result is identical, bit for bit, to FA2's rule run over the
    same blocks in the same order."""
    q, k, v = inputs(rng, 2, n_q, n_k, 2, 2, 16)
    res = run(fa3.forward, q, k, v, causal, block_q=blocks[0], block_k=blocks[1], rescale_tau=0.0)
    out, lse = _fa2_descending(q, k, v, causal, *blocks)
    assert np.array_equal(res.out, out)
    assert np.array_equal(res.lse, lse)


# ---------------------------------------------------------------------------------------------- lazy rescaling

def test_rescale_thresholds_are_the_kernels():
    """The model's thresholds are the ones fa3_fwd.cu compiles in (hopper/precision.cuh's RESCALE_TAU: Precision16's,
    then PrecisionFp8's)."""
    src = (Path(__file__).resolve().parents[1] / "cuda_src" / "hopper" / "precision.cuh").read_text()
    found = re.findall(r"RESCALE_TAU = ([0-9.]+)f;", src)
    assert len(found) == 2, "RESCALE_TAU's definitions in hopper/precision.cuh"
    assert (float(found[0]), float(found[1])) == (fa3.RESCALE_TAU, fa3.FP8_RESCALE_TAU)


@pytest.mark.parametrize("tau", [0.0, 0.75, 8.0, 30.0])
@pytest.mark.parametrize("causal", [False, True])
def test_lazy_reference_changes_rounding_only(rng, tau, causal):
    """A reference point that lags its row max by up to tau gives the same softmax: float64 rounding apart."""
    q, k, v = inputs(rng, 1, 130, 700, 2, 1, 16, scale=2.0)
    lazy = run(fa3.forward, q, k, v, causal, block_q=64, block_k=32, rescale_tau=tau)
    eager = run(fa3.forward, q, k, v, causal, block_q=64, block_k=32, rescale_tau=0.0)
    assert rel_err(lazy.out, eager.out) < EXACT
    np.testing.assert_allclose(lazy.lse, eager.lse, rtol=1e-13)
    check(q, k, v, causal, block_q=64, block_k=32, rescale_tau=tau)


def test_lazy_reference_moves_past_tau_only():
    m = np.array([-np.inf, -np.inf, 1.0, 1.0, 1.0, np.nan])
    row_max = np.array([-np.inf, 3.0, 1.0 + 0.5 * np.log(2), 1.0 + 2 * np.log(2), np.nan, 2.0])
    got = fa3.lazy_reference(m, row_max, tau=1.0)
    # all -inf stays; from -inf it moves; half a log2 unit stays; two move; a NaN max keeps m; a NaN m stays NaN
    np.testing.assert_array_equal(got, [-np.inf, 3.0, 1.0, 1.0 + 2 * np.log(2), 1.0, np.nan])
    np.testing.assert_array_equal(fa3.lazy_reference(m[2:4], row_max[2:4], 0.0), row_max[2:4])  # tau 0: FA2's max


def test_rescale_tau_is_checked(rng):
    q, k, v = inputs(rng, 1, 8, 8, 1, 1, 16)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="rescale_tau"):
            fa3.forward(q, k, v, rescale_tau=bad)
    with pytest.raises(ValueError, match="448"):
        fa3.forward_fp8(q, k, v, rescale_tau=1.0)  # 256 x 2 > 448
    fa3.forward_fp8(q, k, v, rescale_tau=1.0, p_scale=128.0)


# ---------------------------------------------------------------------------------------------- structure

@pytest.mark.parametrize("n_q,n_k", [(1, 1), (37, 1000), (1000, 37), (1000, 1000), (129, 257), (50, 20)])
@pytest.mark.parametrize("B_r,B_c", [(128, 128), (128, 64), (64, 128), (7, 13)])
@pytest.mark.parametrize("causal", [False, True])
def test_blocks_descend_and_masked_blocks_come_first(n_q, n_k, B_r, B_c, causal):
    for rows in common.block_slices(n_q, B_r):
        visits = fa3.kv_visits(rows, n_q, n_k, B_c, causal)
        cols = [c for c, _ in visits]
        fa2_order = [c for c in common.block_slices(n_k, B_c)
                     if not causal or common.block_visited(rows.stop - 1, c.start, n_q, n_k)]
        assert cols == fa2_order[::-1], "fa2's blocks, the other way round"
        masked = [m for _, m in visits]
        assert masked == sorted(masked, reverse=True), f"masked blocks are not a prefix: {masked}"
        # a block without a mask really needs none: every row of the CTA sees every key of it
        visible = common.causal_visible(np.arange(rows.start, rows.stop), np.arange(n_k), n_q, n_k)
        for c, m in visits:
            needs = (c.stop - c.start < B_c) or (causal and not visible[:, c].all())
            assert m == needs, (rows, c)
        if causal:   # at most the diagonal's blocks (ceil(B_r / B_c) + 1) and the tail
            assert sum(masked) <= -(-B_r // B_c) + 2


@pytest.mark.parametrize("n_q,n_k", [(1, 1), (37, 1000), (1000, 37), (1000, 1000), (2048, 2048), (129, 257)])
@pytest.mark.parametrize("B_r,B_c", [(192, 128), (128, 80), (128, 128), (7, 13)])
@pytest.mark.parametrize("causal", [False, True])
def test_consumers_skip_only_blocks_they_cannot_see(n_q, n_k, B_r, B_c, causal):
    """A consumer's blocks are its CTA's less a prefix that none of its rows sees (never all of them), and a
    block needs a mask for it exactly where one of its rows misses a key of the block."""
    skipped = 0
    for rows in common.block_slices(n_q, B_r):
        visits = fa3.kv_visits(rows, n_q, n_k, B_c, causal)
        for r in fa3.consumer_rows(rows):
            own = fa3.consumer_visits(visits, r, n_q, n_k, B_c, causal)
            assert [c for c, _ in own] == [c for c, _ in visits[len(visits) - len(own):]], "a suffix"
            assert bool(own) == bool(visits), "never every block"
            visible = common.causal_visible(np.arange(r.start, r.stop), np.arange(n_k), n_q, n_k)
            for c, _ in visits[:len(visits) - len(own)]:
                assert causal and not visible[:, c].any(), (r, c)
            for c, m in own:
                needs = (c.stop - c.start < B_c) or (causal and not visible[:, c].all())
                assert m == needs, (r, c)
            skipped += len(visits) - len(own)
    if causal and (n_q, n_k, B_r, B_c) == (2048, 2048, 192, 128):
        # tiles at m0 = 384 k: consumers 0 and 1 skip one block each; at 384 k + 192: consumer 0 one; the last
        # tile (128 rows at m0 = 1920) none: 5 x 2 + 5 x 1
        assert skipped == 15, skipped


@pytest.mark.parametrize("B_r", [192, 128, 64, 7, 1])
def test_consumers_split_the_q_block(B_r):
    """64 rows per consumer warpgroup (the kernel's BM = 64 NC); the short last block may have fewer consumers."""
    for n in (1, 37, 128, 1000):
        for rows in common.block_slices(n, B_r):
            parts = fa3.consumer_rows(rows)
            assert 1 <= len(parts) <= -(-B_r // 64)
            assert parts[0].start == rows.start and parts[-1].stop == rows.stop
            assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
            assert all(p.stop - p.start == 64 for p in parts[:-1]) and parts[-1].stop - parts[-1].start <= 64
    assert fa3.consumer_rows(slice(128, 256)) == [slice(128, 192), slice(192, 256)]
    assert fa3.consumer_rows(slice(192, 384)) == [slice(192, 256), slice(256, 320), slice(320, 384)]
    assert fa3.consumer_rows(slice(256, 300)) == [slice(256, 300)]


@pytest.mark.parametrize("causal", [False, True])
def test_three_consumers(rng, causal):
    """The kernel's NC = 3 configuration: B_r = 192."""
    q, k, v = inputs(rng, 1, 500, 450, 2, 1, 32)
    assert check(q, k, v, causal, block_q=192, block_k=128).blocks == (192, 128)


# ---------------------------------------------------------------------------------------------- HBM traffic

def counted(model, n_q, n_k, d, block_q, block_k, causal=False, batch=1, heads=1, heads_kv=1, rng=None):
    rng = rng or np.random.default_rng()
    q, k, v = inputs(rng, batch, n_q, n_k, heads, heads_kv, d)
    by = model(q, k, v, causal=causal, block_q=block_q, block_k=block_k).hbm.by_tensor()
    return {**by, "total": sum(by.values())}


@pytest.mark.parametrize("model", [fa3.forward, fa3.forward_fp8], ids=["fa3", "fa3_fp8"])
@pytest.mark.parametrize("N,d,block_q,block_k", [(64, 16, 16, 16), (256, 32, 32, 64), (256, 64, 128, 128),
                                                  (512, 64, 128, 128), (384, 128, 128, 128), (256, 256, 128, 64)])
def test_counts_equal_closed_form_when_blocks_divide(model, N, d, block_q, block_k):
    got = counted(model, N, N, d, block_q, block_k)
    assert got == iomodel.fa2_accesses(N, N, d, block_q, block_k)
    T_r = N // block_q
    assert got == {"Q": N * d, "K": T_r * N * d, "V": T_r * N * d, "O": N * d, "LSE": N,
                   "total": 2 * N * d + 2 * T_r * N * d + N}


@pytest.mark.parametrize("n_q,n_k,block_q,block_k", [(100, 37, 16, 24), (37, 100, 16, 24), (61, 83, 7, 5),
                                                      (1, 50, 8, 8), (50, 1, 8, 8), (1000, 300, 128, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_counts_equal_closed_form_any_size_and_causal(n_q, n_k, block_q, block_k, causal):
    assert counted(fa3.forward, n_q, n_k, 8, block_q, block_k, causal) == fa3.accesses(n_q, n_k, 8, block_q,
                                                                                      block_k, causal)


def test_closed_form_is_fa2s_but_for_ctas_that_see_no_key():
    d = 8
    for n_q, n_k, causal in [(300, 300, True), (100, 300, True), (300, 100, False), (128, 127, True)]:
        assert fa3.accesses(n_q, n_k, d, 16, 24, causal) == iomodel.fa2_accesses(n_q, n_k, d, 16, 24, causal)
    # causal, N_q = 50 > N_k = 20, B_r = 8: Q blocks 0..2 (rows 0..23) end above the diagonal (row 29 is the
    # last that sees nothing): their CTAs load no Q, K or V; Q block 3 (rows 24..31) sees keys through rows 30, 31
    fa3_counts, fa2_counts = fa3.accesses(50, 20, d, 8, 8, True), iomodel.fa2_accesses(50, 20, d, 8, 8, True)
    assert fa3_counts["Q"] == (50 - 24) * d and fa2_counts["Q"] == 50 * d
    assert {t: n for t, n in fa3_counts.items() if t not in ("Q", "total")} == \
        {t: n for t, n in fa2_counts.items() if t not in ("Q", "total")}
    assert fa3_counts["total"] == fa2_counts["total"] - 24 * d
    # None: the kernel's tiles, not the paper's blocks fa2_accesses would pick
    assert fa3.accesses(1000, 1000, 64) == iomodel.fa2_accesses(1000, 1000, 64, 192, 128)
    assert fa3.accesses(4000, 4000, 256, causal=True) == iomodel.fa2_accesses(4000, 4000, 256, 128, 80, True)
    # causal d 256 up to N_k 2048: its short tiles
    assert fa3.accesses(1000, 2048, 256, causal=True) == iomodel.fa2_accesses(1000, 2048, 256, 128, 64, True)
    assert fa3.accesses_fp8(1000, 1000, 128) == fa3.accesses(1000, 1000, 128, *fa3_tile(128, fp8=True)[:2])


def test_whole_call_is_batch_times_heads_and_gqa_saves_no_reads():
    one = iomodel.fa2_accesses(70, 90, 16, 16, 32, True)
    many = counted(fa3.forward, 70, 90, 16, 16, 32, True, batch=2, heads=6, heads_kv=2)
    assert many == {t: 12 * n for t, n in one.items()}


# ---------------------------------------------------------------------------------------------- FP8

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q,n_k,heads,heads_kv", [(37, 1000, 2, 1), (300, 129, 4, 2), (1000, 37, 1, 1)])
def test_fp8_close_to_float64(rng, causal, n_q, n_k, heads, heads_kv):
    q, k, v = inputs(rng, 1, n_q, n_k, heads, heads_kv, 64)
    res = run(fa3.forward_fp8, q, k, v, causal)
    ref_out, ref_lse = reference64(q, k, v, causal)
    assert res.blocks == fa3_tile(64, fp8=True)[:2] == (192, 160)
    assert 1e-4 < rel_err(res.out, ref_out) < TOL["float8_e4m3fn"], "quantizes, within the fp8 tolerance"
    assert np.array_equal(np.isneginf(res.lse), np.isneginf(ref_lse))
    empty = np.isneginf(ref_lse).transpose(0, 2, 1)
    assert (res.out[empty] == 0).all()


@pytest.mark.parametrize("scaling", ["block", "tensor"])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_is_fa2_fp8_on_one_k_block(rng, scaling, causal):
    """One K block: the two orders are one order, so fa3's fp8 pipeline is fa2_fp8's model up to rounding."""
    q, k, v = inputs(rng, 2, 200, 60, 2, 1, 32)
    kw = dict(block_q=128, block_k=64, scaling=scaling, rotate=True)
    a = run(fa3.forward_fp8, q, k, v, causal, rescale_tau=0.0, **kw)
    b = run(fp8.forward, q, k, v, causal, **kw)
    np.testing.assert_allclose(a.out, b.out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(a.lse, b.lse, rtol=1e-13)
    assert_same_traffic_but_empty_ctas(a, b, 200, 60, 128, causal, programs=4)


@pytest.mark.parametrize("accumulate_bits", [None, 13])
def test_fp8_descending_is_fa2_fp8_on_reversed_keys(rng, accumulate_bits):
    """Several K blocks: P is rounded to e4m3 under the running max, which depends on the order, so fa3_fp8 and
    fa2_fp8 differ by fp8 rounding. Reversing the keys (N_k a multiple of B_c) gives fa2_fp8 fa3's order: the
    same blocks, scales and maxes; then only float64 rounding separates them (with fa2_fp8's running max:
    rescale_tau = 0)."""
    q, k, v = inputs(rng, 1, 150, 256, 2, 2, 32)
    kw = dict(block_q=64, block_k=64, accumulate_bits=accumulate_bits)
    a = run(fa3.forward_fp8, q, k, v, False, rescale_tau=0.0, **kw)
    b = run(fp8.forward, q, k[:, ::-1], v[:, ::-1], False, **kw)
    c = run(fp8.forward, q, k, v, False, **kw)
    tol = 1e-12 if accumulate_bits is None else 1e-3   # a truncated accumulator sees the keys in another order
    assert rel_err(a.out, b.out) < tol
    assert rel_err(a.out, c.out) < TOL["float8_e4m3fn"]


def test_fp8_default_blocks_follow_head_dim(rng):
    q, k, v = inputs(rng, 1, 20, 20, 1, 1, 160)
    assert fa3.forward_fp8(q, k, v).blocks == fa3_tile(256, fp8=True)[:2] == (128, 128)
    with pytest.raises(ValueError, match="scaling"):
        fa3.forward_fp8(q, k, v, scaling="channel")
    with pytest.raises(ValueError, match="p_scale"):
        fa3.forward_fp8(q, k, v, p_scale=3.0)


# ---------------------------------------------------------------------------------------------- arguments, text

def test_bad_arguments_raise_as_fa2(rng):
    q, k, v = inputs(rng, 1, 8, 8, 3, 2, 16)
    with pytest.raises(ValueError, match="multiple"):
        fa3.forward(q, k, v)
    q, k, v = inputs(rng, 1, 8, 8, 2, 1, 16)
    with pytest.raises(ValueError):
        fa3.forward(q[0], k[0], v[0])
    for bad in (True, 0, 1.5):
        with pytest.raises((TypeError, ValueError)):
            fa3.forward(q, k, v, block_q=bad)


def test_teaching_text():
    for text in (fa3.LOOPS, fa3.PIPELINE):
        assert isinstance(text, str) and text.count("\n") >= 5
    assert "for" in fa3.LOOPS and "down to" in fa3.LOOPS
    p = fa3.PIPELINE
    for word in ("producer", "consumer", "TMA", "full[s]", "empty[s]", "expect_tx", "complete_tx",
                 "ping-pong", "named barrier", "intra-warpgroup", "wgmma.wait_group", "measured (docs/kernels/fa3.md"):
        assert word in p, word
    # no performance number is stated: those belong to docs/
    number = re.search(r"(?<!\w)\d[\d.,]*\s*(TFLOP|GB/s|TB/s|%|ms\b|us\b|x faster)", p)
    assert not number, f"a measured number in the text: {number.group(0)!r}"


# ------------------------------------------------------------------------------------ the split last wave

@pytest.mark.parametrize("n_k,split", [(1000, 1), (1000, 3), (4097, 5), (37, 1), (37, 2), (300, 1)])
def test_split_pieces_merge_to_the_unsplit_answer(rng, n_k, split):
    """Tiles cut into pieces of ``split`` K/V blocks and merged by the last piece (the kernel's split_meet order):
    float64 attention to rounding, the unsplit model's answer to rounding, and the HBM counts of the pieces (Q once
    a piece, a partial O, l and m written and read back for every piece but the last)."""
    q, k, v = inputs(rng, 2, 300, n_k, 4, 2, 64, scale=2.0)
    split_res = check(q, k, v, False, block_q=64, block_k=32, split_blocks=split)
    whole = run(fa3.forward, q, k, v, False, block_q=64, block_k=32)
    assert rel_err(split_res.out, whole.out) < EXACT
    pieces = -(-(-(-n_k // 32)) // split)  # K/V blocks of 32 keys, then pieces of `split` blocks
    extra = 2 * 4 * 300 * (pieces - 1)     # programs (batch x heads) x Q rows, once per piece but the last
    assert split_res.hbm.reads["Q"] - whole.hbm.reads["Q"] == extra * 64
    assert split_res.hbm.writes["O"] - whole.hbm.writes["O"] == split_res.hbm.reads.get("O", 0) == extra * 64
    assert split_res.hbm.writes.get("l", 0) == split_res.hbm.writes.get("m", 0) == extra


@pytest.mark.parametrize("model", [fa3.forward, fa3.forward_fp8], ids=["fa3", "fa3_fp8"])
def test_split_is_refused_where_the_kernel_does_not_split(rng, model):
    q, k, v = inputs(rng, 1, 37, 37, 1, 1, 8)
    with pytest.raises(ValueError, match="non-causal"):
        model(q, k, v, causal=True, split_blocks=2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="split_blocks"):
            model(q, k, v, split_blocks=bad)


@pytest.mark.parametrize("n_k,split", [(1000, 3), (4097, 5), (300, 1)])
def test_fp8_split_pieces_round_p_against_their_own_max(rng, n_k, split):
    """fa3_fp8's split (the persistent grid's last wave): a piece starts its own running max, so it rounds other P
    values to e4m3 than the unsplit pass. The LSE (l sums the unrounded P) is the unsplit one to float64 rounding;
    O is float64's within the fp8 tolerance and the unsplit model's within twice the unsplit model's own error,
    but not to rounding (the GPU test holds the kernel to the same: test_gpu_fp8.py's split tail)."""
    q, k, v = inputs(rng, 2, 300, n_k, 4, 2, 64)
    kw = dict(block_q=64, block_k=32)
    split_res = run(fa3.forward_fp8, q, k, v, False, split_blocks=split, **kw)
    whole = run(fa3.forward_fp8, q, k, v, False, **kw)
    ref_out, _ = reference64(q, k, v, False)
    np.testing.assert_allclose(split_res.lse, whole.lse, rtol=0, atol=1e-12)
    err = rel_err(whole.out, ref_out)
    assert rel_err(split_res.out, ref_out) < TOL["float8_e4m3fn"]
    assert 1e-6 < rel_err(split_res.out, whole.out) <= 2 * err, "the pieces round P under their own maxima"


def test_merge_keeps_nan_and_empty_rows():
    """A piece's NaN row reaches the merged row; a row a piece saw no key of (m = -inf, O = l = 0) adds nothing."""
    O = np.ones((1, 1, 2, 4))
    parts = [(O, np.array([[[np.nan, -np.inf]]]), np.array([[[1.0, 0.0]]])),
             (2 * O, np.array([[[0.5, 0.25]]]), np.array([[[2.0, 3.0]]]))]
    O_m, m, l = fa3.merge_pieces(parts)
    assert np.isnan(O_m[0, 0, 0]).all() and np.isnan(l[0, 0, 0])
    assert m[0, 0, 1] == 0.25 and l[0, 0, 1] == 3.0 and (O_m[0, 0, 1] == 2.0).all()
