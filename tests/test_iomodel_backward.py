"""The backward's closed-form traffic and FLOP formulas against the models' counters, and ``explain``'s backward."""
import math

import pytest

from fa_variants import iomodel, registry
from fa_variants.reference import fa1, fa2, naive

# name -> (model's backward, closed form, keyword arguments of both)
MODELS = {"naive": (naive.backward, iomodel.naive_backward_accesses, {}),
          "fa1": (fa1.backward, iomodel.fa1_backward_accesses, {}),
          "fa2": (fa2.backward, iomodel.fa2_backward_accesses, {}),
          "fa2_atomic": (fa2.backward, iomodel.fa2_backward_accesses, {"dq_mode": "atomic"})}
VARIANT = {"naive": "naive", "fa1": "fa1", "fa2": "fa2", "fa2_atomic": "fa2"}


def run(name, rng, n_q, n_k, d, block_q, block_k, causal=False, batch=1, heads=1, heads_kv=1):
    """The model's result on random inputs (the counts do not depend on the values)."""
    model, _, kw = MODELS[name]
    dout, q = (rng.standard_normal((batch, n_q, heads, d)) for _ in range(2))
    k, v = (rng.standard_normal((batch, n_k, heads_kv, d)) for _ in range(2))
    fwd = fa2.forward(q, k, v, causal=causal)
    return model(dout, q, k, v, fwd.out, fwd.lse, causal=causal, block_q=block_q, block_k=block_k, **kw)


def counted(res):
    by = res.hbm.by_tensor()
    return {**by, "total": sum(by.values())}


def formula(name, n_q, n_k, d, block_q, block_k, causal=False):
    _, closed, kw = MODELS[name]
    return closed(n_q, n_k, d, block_q, block_k, causal=causal, **kw)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("N,d,block_q,block_k", [(64, 16, 16, 16), (256, 32, 32, 64), (256, 64, 64, 32)])
def test_counts_equal_closed_form_when_blocks_divide(rng, name, N, d, block_q, block_k):
    assert counted(run(name, rng, N, N, d, block_q, block_k)) == formula(name, N, N, d, block_q, block_k)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("n_q,n_k,block_q,block_k", [(100, 37, 16, 24), (37, 100, 16, 24), (61, 83, 7, 5),
                                                      (1, 50, 8, 8), (50, 1, 8, 8), (1, 1, 4, 4),
                                                      (128, 128, 32, 32), (37, 37, 64, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_counts_and_flops_equal_closed_form_any_size_and_causal(rng, name, n_q, n_k, block_q, block_k, causal):
    res = run(name, rng, n_q, n_k, 8, block_q, block_k, causal)
    assert counted(res) == formula(name, n_q, n_k, 8, block_q, block_k, causal)
    assert res.flops == iomodel.backward_flops(VARIANT[name], n_q, n_k, 8, block_q, block_k, causal,
                                               **MODELS[name][2])


@pytest.mark.parametrize("name", MODELS)
def test_paper_blocks_by_default(rng, name):
    """Blocks None: model and closed form both take the paper's for DEFAULT_SRAM (d = 40: 40 x 205)."""
    assert counted(run(name, rng, 300, 450, 40, None, None, True)) == formula(name, 300, 450, 40, None, None, True)


@pytest.mark.parametrize("name", MODELS)
def test_whole_call_is_batch_times_heads_and_gqa_saves_no_reads(rng, name):
    one = formula(name, 70, 90, 16, 16, 32, True)
    res = run(name, rng, 70, 90, 16, 16, 32, True, batch=2, heads=6, heads_kv=2)
    assert counted(res) == {t: 12 * n for t, n in one.items()}
    assert res.flops == 12 * iomodel.backward_flops(VARIANT[name], 70, 90, 16, 16, 32, True, **MODELS[name][2])


@pytest.mark.parametrize("N,d", [(1, 1), (100, 64), (1024, 128)])
def test_standard_backward_is_naive_count(rng, N, d):
    assert iomodel.standard_backward(N, d) == 7 * N * N + 10 * N * d
    assert iomodel.naive_backward_accesses(N, N, d)["total"] == iomodel.standard_backward(N, d)
    if N <= 100:
        assert counted(run("naive", rng, N, N, d, None, None))["total"] == iomodel.standard_backward(N, d)


@pytest.mark.parametrize("N,d,B_r,B_c", [(1024, 64, 64, 128), (512, 128, 64, 64), (1000, 100, 40, 250)])
def test_closed_forms_written_out(N, d, B_r, B_c):
    """The docstrings' non-causal formulas, term by term, with T_r = N / B_r and T_c = N / B_c."""
    T_r, T_c = math.ceil(N / B_r), math.ceil(N / B_c)
    one = iomodel.fa1_backward_accesses(N, N, d, B_r, B_c)
    assert one == iomodel._with_total({"Q": T_c * N * d, "O": T_c * N * d, "dO": T_c * N * d, "l": T_c * N,
                                       "m": T_c * N, "K": N * d, "V": N * d, "dQ": N * d + 2 * T_c * N * d,
                                       "dK": 2 * N * d, "dV": 2 * N * d})
    assert one["total"] == (5 * d + 2) * T_c * N + 7 * N * d
    sep = iomodel.fa2_backward_accesses(N, N, d, B_r, B_c)
    assert sep == iomodel._with_total({"Q": N * d + T_c * N * d, "K": N * d + T_r * N * d,
                                       "V": N * d + T_r * N * d, "O": N * d, "LSE": N + T_c * N,
                                       "dO": 2 * N * d + T_c * N * d, "D": 2 * N + T_c * N, "dQ": N * d,
                                       "dK": N * d, "dV": N * d})
    atomic = iomodel.fa2_backward_accesses(N, N, d, B_r, B_c, dq_mode="atomic")
    assert atomic == iomodel._with_total({"Q": T_c * N * d, "K": N * d, "V": N * d, "O": N * d, "LSE": T_c * N,
                                          "dO": N * d + T_c * N * d, "D": N + T_c * N,
                                          "dQ": N * d + 2 * T_c * N * d, "dK": N * d, "dV": N * d})
    # the separate dQ pass: dQ written once instead of 2 T_c round trips, paid with K, V per Q block
    assert sep["dQ"] - atomic["dQ"] == -2 * T_c * N * d
    assert (sep["K"] + sep["V"]) - (atomic["K"] + atomic["V"]) == 2 * T_r * N * d


def _n2_coefficients(d, B_r, B_c):
    """The N^2 coefficient of each backward's total at N_q = N_k = N, non-causal (the docstrings' formulas)."""
    return {"naive": 7, "fa1": (5 * d + 2) / B_c, "fa2": (2 * d + 2) / B_c + 2 * d / B_r,
            "fa2_atomic": (4 * d + 2) / B_c}


@pytest.mark.parametrize("d,M", [(64, 32_768), (128, 32_768), (128, 65_536), (256, 262_144)])
def test_flash_backward_beats_the_standard_one_only_with_large_enough_blocks(d, M):
    """The flash backwards trade naive's 7N^2 for re-reads of about (2..5) d N^2 / B: fewer elements than the
    standard backward only when the blocks are about d or larger. At d = 128 with M = 32768 elements the
    paper's blocks are 64 x 64 and every one of them moves more than 7N^2 + 10Nd (coefficients 8 to 10)."""
    B_r, B_c = iomodel.paper_blocks(M, d)
    N = 256 * B_c   # large enough for the N^2 terms to decide (closed forms only: no model runs)
    std = iomodel.standard_backward(N, d)
    for name, c in _n2_coefficients(d, B_r, B_c).items():
        total = formula(name, N, N, d, B_r, B_c)["total"]
        assert abs(total / (N * N) - c) < 0.2, (name, total / (N * N), c)   # the Nd terms: O(d / N)
        if name != "naive":
            assert (total < std) == (c < 7), (name, d, M, c)
    if (d, M) == (128, 32_768):
        assert all(c > 7 for n, c in _n2_coefficients(d, B_r, B_c).items() if n != "naive")
    if (d, M) == (64, 32_768):
        assert all(formula(n, N, N, d, B_r, B_c)["total"] < std / 2 for n in MODELS if n != "naive")


@pytest.mark.parametrize("N,d", [(256, 64), (1000, 40)])
def test_recompute_flops_ratios(N, d):
    """Non-causal matmul FLOPs against the forward's 4N^2d: standard 2x, recomputation 2.5x, FA2's separate
    dQ pass 3.5x; causal saves about half (the visited triangle plus the diagonal blocks)."""
    fwd = iomodel.forward_flops(N, N, d)
    assert fwd == 4 * N * N * d
    ratios = {(v, m): iomodel.backward_flops(v, N, N, d, 32, 64, dq_mode=m) / fwd
              for v, m in (("naive", "separate"), ("fa1", "separate"), ("fa2", "separate"), ("fa2", "atomic"))}
    assert ratios == {("naive", "separate"): 2, ("fa1", "separate"): 2.5, ("fa2", "separate"): 3.5,
                      ("fa2", "atomic"): 2.5}
    # causal: the visible triangle N(N+1)/2 plus, per Q block, the masked rest of its last K block (< B_c keys)
    area = iomodel.backward_flops("fa1", N, N, d, 32, 64, causal=True) // (2 * 5 * d)
    assert N * (N + 1) // 2 <= area < N * (N + 1) // 2 + math.ceil(N / 32) * 32 * 64
    assert iomodel.backward_flops("naive", N, N, d, causal=True) == 2 * fwd   # naive does not skip


def test_bad_dq_mode_and_variant():
    with pytest.raises(ValueError, match="dq_mode"):
        iomodel.fa2_backward_accesses(64, 64, 16, 16, 16, dq_mode="fast")
    with pytest.raises(ValueError, match="variant"):
        iomodel.backward_flops("fa2_fp8", 64, 64, 16)


def test_registry_io_model_backward_is_the_closed_form():
    for name, closed in (("naive", iomodel.naive_backward_accesses), ("fa1", iomodel.fa1_backward_accesses),
                         ("fa2", iomodel.fa2_backward_accesses)):
        entry = registry.get(name)
        assert entry.io_model_backward is closed
        assert entry.io_model_backward(256, 256, 64, 64, 64) == closed(256, 256, 64, 64, 64, causal=False)
    assert registry.get("fa2_fp8").io_model_backward is None


@pytest.mark.parametrize("name", ["naive", "fa1", "fa2"])
def test_explain_backward_shows_formula_equal_to_count(name):
    entry = registry.get(name)
    text = iomodel.explain(entry, 512, 64, 32_768, backward=True)
    blocks = iomodel.paper_blocks(32_768, 64)
    total = entry.io_model_backward(512, 512, 64, *blocks)["total"]
    line = next(ln for ln in text.splitlines() if ln.startswith("total"))
    assert line.split()[1:] == [f"{total:,}", f"{total:,}"]
    assert text.splitlines()[0].startswith(f"{name} backward: N=512, d=64")
    module = {"naive": naive, "fa1": fa1, "fa2": fa2}[name]
    assert module.LOOPS_BACKWARD in text
    flops = iomodel.backward_flops(name, 512, 512, 64, *blocks)
    assert f"this backward {flops:,} formula, {flops:,} counted" in text
    ratio = {"naive": "2x", "fa1": "2.5x", "fa2": "3.5x"}[name]
    assert f"= {ratio} the forward" in text
    if name == "fa2":
        assert 'dq_mode="atomic"' in text and "2.5x the forward" in text
    if name != "naive":
        assert "recompute trade" in text and "x naive's)" in text


def test_explain_forward_is_unchanged_by_default():
    assert iomodel.explain(registry.get("fa2"), 256, 64) == iomodel.explain(registry.get("fa2"), 256, 64,
                                                                          backward=False)
    assert "backward" not in iomodel.explain(registry.get("fa2"), 256, 64)


def test_explain_backward_without_a_model_says_so():
    with pytest.raises(ValueError, match="fa2_fp8 has no backward model"):
        iomodel.explain(registry.get("fa2_fp8"), 256, 64, backward=True)
