"""What a NumPy model costs, said before it hurts (fa_variants/reference/budget.py): the naive model refuses a call
whose S and P would not fit in host memory, naming the memory, before allocating; the blocked models warn with an
estimate and draw a progress bar on stderr when a run will be long, and stay silent otherwise."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import fa_variants as fav
from fa_variants.reference import budget
from conftest import has_gpu, random_qkv_host


def _qkv(rng, n, d=8, heads=1):
    return random_qkv_host(rng, 1, n, n, heads, heads, d, "float16")


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_naive_at_a_huge_seqlen_names_the_memory_it_needs(direction, rng, monkeypatch):
    """N = 2M: S alone would be 32 TiB in float64. Refused before anything that size is allocated (the inputs'
    float64 copies included: at head_dim 128 those alone would be 6 GiB), as a MemoryError and a ValueError, with
    the GiB it needs and what to run instead."""
    from fa_variants.reference import common
    q, k, v = _qkv(rng, 2_000_000)
    monkeypatch.setattr(common, "to_float64", lambda x: pytest.fail("float64 copies made before the refusal"))
    with pytest.raises(budget.ModelTooLarge) as info:
        if direction == "forward":
            fav.attention(q, k, v, variant="naive", backend="numpy")
        else:
            lse = np.zeros((1, 1, q.shape[1]), np.float32)
            fav.attention_backward(q, q, k, v, q, lse, variant="naive", backend="numpy", check_lse=False)
    assert isinstance(info.value, MemoryError) and isinstance(info.value, ValueError)
    msg = str(info.value)
    assert f"naive {direction} NumPy model" in msg and "GiB of host memory" in msg and "variant='fa2'" in msg
    need = float(msg.split("needs about ")[1].split(" GiB")[0])
    matrices = budget.NAIVE_MATRICES if direction == "forward" else budget.NAIVE_BACKWARD_MATRICES
    assert need == pytest.approx(matrices * 8 * 2_000_000 ** 2 / 2**30, rel=1e-3)


def test_naive_fits_when_memory_allows_and_not_when_it_does_not(monkeypatch, rng):
    q, k, v = _qkv(rng, 64)
    fav.attention(q, k, v, variant="naive", backend="numpy")
    monkeypatch.setattr(budget, "available_memory", lambda: 1000)
    with pytest.raises(budget.ModelTooLarge, match=r"needs about 0\.0 GiB of host memory, and 0\.0 GiB is available"):
        fav.attention(q, k, v, variant="naive", backend="numpy")


def test_unknown_available_memory_runs(monkeypatch, rng):
    monkeypatch.setattr(budget, "available_memory", lambda: None)
    q, k, v = _qkv(rng, 16)
    assert fav.attention(q, k, v, variant="naive", backend="numpy").shape == q.shape


def test_available_memory_is_read_on_linux():
    mem = budget.available_memory()
    assert mem is None or mem > 0


@pytest.mark.parametrize("variant", ["fa1", "fa2", "fa2_fp8"])
def test_a_long_run_warns_with_its_estimate_and_shows_progress(variant, monkeypatch, capsys, rng):
    """Calibrated on the first pairs and judged long (thresholds set to zero here): a LongRunWarning with the
    estimated time, then a bar on stderr that ends at 100 %."""
    monkeypatch.setattr(budget, "CALIBRATE_SECONDS", 0.0)
    monkeypatch.setattr(budget, "WARN_SECONDS", 0.0)
    q, k, v = _qkv(rng, 300, d=64, heads=2)
    with pytest.warns(budget.LongRunWarning, match=r"NumPy model \(forward, batch 1 x heads 2 x 300 x 300, "
                                                   r"head_dim 64\) will take about \d+ s on this host"):
        fav.attention(q, k, v, variant=variant, causal=True, backend="numpy")
    err = capsys.readouterr().err
    assert "NumPy model (forward" in err and "100.0%" in err and "left" in err


def test_a_long_backward_warns_too(monkeypatch, capsys, rng):
    monkeypatch.setattr(budget, "CALIBRATE_SECONDS", 0.0)
    monkeypatch.setattr(budget, "WARN_SECONDS", 0.0)
    q, k, v = _qkv(rng, 200, d=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", budget.LongRunWarning)
        out, lse = fav.attention(q, k, v, return_lse=True, backend="numpy")
    capsys.readouterr()
    with pytest.warns(budget.LongRunWarning, match=r"fa2's NumPy model \(backward"):
        fav.attention_backward(out, q, k, v, out, lse, backend="numpy")
    assert "100.0%" in capsys.readouterr().err


def test_a_short_run_says_nothing(capsys, rng):
    q, k, v = _qkv(rng, 100, d=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", budget.LongRunWarning)
        fav.attention(q, k, v, variant="fa2", backend="numpy")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("nq, nk", [(37, 29), (29, 300), (300, 29), (1, 1), (64, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_the_pairs_counted_are_the_pairs_visited(nq, nk, causal, monkeypatch, rng):
    """Every model's progress ends at its total: pairs_visited counts exactly the block pairs the loops visit."""
    ends = []
    monkeypatch.setattr(budget.Progress, "close", lambda self: ends.append((self.what, self.done, self.total)))
    q, k, v = random_qkv_host(rng, 1, nq, nk, 2, 1, 64, "float16")
    for variant in ("fa1", "fa2", "fa2_fp8"):
        out, lse = fav.attention(q, k, v, variant=variant, causal=causal, return_lse=True, backend="numpy")
        if variant != "fa2_fp8":
            fav.attention_backward(out, q, k, v, out, lse, variant=variant, causal=causal, backend="numpy")
    assert len(ends) == 5 and all(done == total for _, done, total in ends), ends


@pytest.mark.skipif(has_gpu(), reason="a CUDA GPU is present: auto runs a kernel")
@pytest.mark.parametrize("variant", ["auto", "fa1"])
def test_seqlen_200k_on_the_cpu_warns_within_seconds(variant, rng):
    """The case that used to run for hours without a word: at N = 200K the warning comes after about
    CALIBRATE_SECONDS of work (made an error here, so that the run stops there)."""
    q, k, v = _qkv(rng, 200_000, d=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", budget.LongRunWarning)
        with pytest.raises(budget.LongRunWarning, match=r"\(forward, batch 1 x heads 1 x 200000 x 200000, head_dim "
                                                        r"64\) will take about \d+(\.\d)? (min|h) on this host"):
            fav.attention(q, k, v, variant=variant)
