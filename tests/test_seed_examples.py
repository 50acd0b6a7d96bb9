"""The worked examples the project teaches with: online softmax is exact however the row is split, and in
fp16 its rounding error shrinks as blocks grow while a block-local softmax is simply wrong."""
import numpy as np
import pytest

from fa_variants.reference import online_softmax


def one_shot(scores, values):
    e = np.exp(scores - scores.max())
    return e @ values / e.sum()


# (a) three scores, two blocks ------------------------------------------------------------------------------

SCORES = np.array([1.414, 0.707, 0.707])
VALUES = np.array([1.0, 0.0, 1.0])


def test_worked_example_one_shot():
    assert abs(one_shot(SCORES, VALUES) - 0.7518) < 5e-4


@pytest.mark.parametrize("splits", [(2, 1), (1, 2), (3,), (1, 1, 1)])
@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_worked_example_any_split(splits, dtype):
    out = online_softmax(SCORES, VALUES, splits, dtype)
    assert abs(float(out) - 0.7518) < 5e-4          # 0.752 to 3 decimals whichever way it is split
    if dtype is np.float64:
        assert abs(out - one_shot(SCORES, VALUES)) < 1e-15


def test_random_splits_are_exact_in_float64():
    seed = int(np.random.SeedSequence().entropy % 2**63)
    rng = np.random.default_rng(seed)
    s, v = rng.normal(0, 5, 1000), rng.standard_normal((1000, 8))
    cuts = np.sort(rng.choice(np.arange(1, 1000), size=20, replace=False))
    splits = np.diff(np.concatenate([[0], cuts, [1000]])).tolist()
    np.testing.assert_allclose(online_softmax(s, v, splits), one_shot(s, v), rtol=1e-13, atol=1e-15,
                               err_msg=f"seed={seed} splits={splits}")


# (b) the fp16 exercise ---------------------------------------------------------------------------------------

BLOCKS = (2, 8, 32, 128)


def block_local_softmax(scores, values, block):
    """The wrong method: softmax each block on its own (its own max and sum), then average the blocks' outputs.

    It ignores that blocks carry different mass e^(m_b) l_b, which is exactly what the online rescaling by
    e^(m_old - m_new) accounts for; computed in float64, so its error is the method's, not rounding.
    """
    outs = [one_shot(scores[a:a + block], values[a:a + block]) for a in range(0, len(scores), block)]
    return np.mean(outs, axis=0)


def rel_err(x, ref):
    return np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref)


def test_fp16_error_shrinks_with_block_size_and_beats_block_local_softmax():
    rng = np.random.default_rng(2023)
    s, v = rng.normal(0, 3, 4096), rng.standard_normal((4096, 16))   # spread scores: the max moves often
    ref = one_shot(s, v)
    online = {b: rel_err(online_softmax(s, v, b, np.float16), ref) for b in BLOCKS}
    wrong = {b: rel_err(block_local_softmax(s, v, b), ref) for b in BLOCKS}
    report = {b: f"online fp16 {online[b]:.2e}, block-local {wrong[b]:.2e}" for b in BLOCKS}

    # fewer fp16 rescale-and-accumulate steps, less rounding: non-increasing up to 50% noise, 4x overall
    for small, big in zip(BLOCKS, BLOCKS[1:]):
        assert online[big] <= 1.5 * online[small], report
    assert online[2] > 4 * online[128], report
    for b in BLOCKS:
        assert online[b] < 0.05, report            # fp16 rounding, not a wrong answer
        assert 10 * online[b] < wrong[b], report   # the block-local method is wrong, at every block size
