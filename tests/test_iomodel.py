"""The closed-form traffic formulas against the models' counters, and the papers' worked numbers."""
import math

import numpy as np
import pytest

from fa_variants import iomodel, registry
from fa_variants.reference import AccessCounter, common, fa1, fa2, naive

MODELS = {"naive": (naive, iomodel.naive_accesses), "fa1": (fa1, iomodel.fa1_accesses),
          "fa2": (fa2, iomodel.fa2_accesses)}


def counted(model, n_q, n_k, d, block_q, block_k, causal=False, batch=1, heads=1, heads_kv=1):
    rng = np.random.default_rng()
    q = rng.standard_normal((batch, n_q, heads, d))
    k, v = (rng.standard_normal((batch, n_k, heads_kv, d)) for _ in range(2))
    by = model.forward(q, k, v, causal=causal, block_q=block_q, block_k=block_k).hbm.by_tensor()
    return {**by, "total": sum(by.values())}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("N,d,block_q,block_k", [(64, 16, 16, 16), (256, 32, 32, 64), (256, 64, 64, 32)])
def test_counts_equal_closed_form_when_blocks_divide(name, N, d, block_q, block_k):
    model, formula = MODELS[name]
    assert counted(model, N, N, d, block_q, block_k) == formula(N, N, d, block_q, block_k)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("n_q,n_k,block_q,block_k", [(100, 37, 16, 24), (37, 100, 16, 24), (61, 83, 7, 5),
                                                      (1, 50, 8, 8), (50, 1, 8, 8), (128, 128, 32, 32)])
@pytest.mark.parametrize("causal", [False, True])
def test_counts_equal_closed_form_any_size_and_causal(name, n_q, n_k, block_q, block_k, causal):
    model, formula = MODELS[name]
    assert counted(model, n_q, n_k, 8, block_q, block_k, causal) == formula(n_q, n_k, 8, block_q, block_k, causal)


@pytest.mark.parametrize("name", MODELS)
def test_whole_call_is_batch_times_heads_and_gqa_saves_no_reads(name):
    model, formula = MODELS[name]
    one = formula(70, 90, 16, 16, 32, True)
    many = counted(model, 70, 90, 16, 16, 32, True, batch=2, heads=6, heads_kv=2)
    assert many == {t: 12 * n for t, n in one.items()}


def test_registry_io_model_is_the_closed_form():
    for name, (_, formula) in MODELS.items():
        assert registry.get(name).io_model is formula
        assert registry.get(name).io_model(256, 256, 64, 64, 64) == formula(256, 256, 64, 64, 64, causal=False)


@pytest.mark.parametrize("N,d", [(1, 1), (100, 64), (1024, 128), (4096, 64)])
def test_standard_attention_is_naive_count(N, d):
    assert iomodel.standard_attention(N, d) == 4 * N * N + 4 * N * d == iomodel.naive_accesses(N, N, d)["total"]
    if N <= 1024:
        assert counted(naive, N, N, d, None, None)["total"] == iomodel.standard_attention(N, d)


def test_paper_worked_numbers():
    assert iomodel.flash_ratio(64, 96_000) == pytest.approx(11.72, abs=0.005)
    assert iomodel.flash_ratio(100, 100_000) == 5
    N, d, M = 4096, 64, 96_000
    assert iomodel.standard_attention(N, d) / iomodel.kv_reread(N, d, M) == pytest.approx(
        iomodel.flash_ratio(d, M), rel=0.02)   # the N^2 terms dominate


@pytest.mark.parametrize("M,d", [(96_000, 64), (100_000, 100), (32_768, 64), (32_768, 128), (1000, 256)])
def test_paper_blocks(M, d):
    B_r, B_c = iomodel.paper_blocks(M, d)
    assert B_c == math.ceil(M / (4 * d)) and B_r == min(B_c, d)
    assert iomodel.paper_blocks is common.paper_blocks   # one implementation


@pytest.mark.parametrize("N,d,M", [(1024, 64, 32_768), (2048, 128, 65_536), (4096, 64, 16_384), (1000, 100, 10_000)])
def test_kv_reread_is_fa2_kv_term_with_square_paper_blocks(N, d, M):
    B = M // (4 * d)
    counts = iomodel.fa2_accesses(N, N, d, B, B)
    assert counts["K"] + counts["V"] == iomodel.kv_reread(N, d, M)


@pytest.mark.parametrize("N,d,M", [(1024, 64, 32_768), (2048, 128, 65_536), (4096, 64, 16_384), (1000, 100, 10_000)])
def test_fa1_moves_more_than_fa2_by_fa1_extra(N, d, M):
    B = iomodel.paper_blocks(M, d)[1]
    assert N % B == 0
    one, two = iomodel.fa1_accesses(N, N, d, B, B), iomodel.fa2_accesses(N, N, d, B, B)
    assert one["total"] > two["total"]
    assert one["total"] == two["total"] + iomodel.fa1_extra(N, d, M)
    assert one["O"] + one["l"] + one["m"] > two["O"] + two["LSE"]
    T = N // B   # leading term T N (d + 4) = 4 N^2 d (d + 4) / M, plus the boundary N (d + 1)
    assert iomodel.fa1_extra(N, d, M) == T * N * (d + 4) + N * (d + 1)
    if N <= 1024:   # and the models agree
        assert counted(fa1, N, N, d, B, B)["total"] - counted(fa2, N, N, d, B, B)["total"] == iomodel.fa1_extra(N, d, M)


def test_hbm_bytes():
    b, h, n, d = 2, 4, 256, 64
    per = {name: f(n, n, d, 64, 64) for name, (_, f) in MODELS.items()}
    assert registry.get("naive").hbm_bytes(b, h, n, n, d, 64, 64, False, 2) == b * h * (
        2 * (per["naive"]["Q"] + per["naive"]["K"] + per["naive"]["V"] + per["naive"]["O"])
        + 4 * (per["naive"]["S"] + per["naive"]["P"]))
    assert registry.get("fa2").hbm_bytes(b, h, n, n, d, 64, 64, False, 2) == b * h * (
        2 * (per["fa2"]["total"] - per["fa2"]["LSE"]) + 4 * per["fa2"]["LSE"])
    fa1_fp32 = per["fa1"]["O"] + per["fa1"]["l"] + per["fa1"]["m"]   # O makes its round trips in fp32
    assert registry.get("fa1").hbm_bytes(b, h, n, n, d, 64, 64, False, 2) == b * h * (
        2 * (per["fa1"]["total"] - fa1_fp32) + 4 * fa1_fp32)
    causal, full = (registry.get("fa2").hbm_bytes(b, h, n, n, d, 64, 64, c, 2) for c in (True, False))
    assert causal < full
    assert registry.get("fa2_fp8").hbm_bytes(b, h, n, n, d, 64, 64, False, 2) == b * h * (
        per["fa2"]["Q"] + per["fa2"]["K"] + per["fa2"]["V"] + 2 * per["fa2"]["O"] + 4 * per["fa2"]["LSE"])


@pytest.mark.parametrize("name", MODELS)
def test_explain_shows_formula_equal_to_count(name):
    text = iomodel.explain(registry.get(name), 512, 64, 32_768)
    total = MODELS[name][1](512, 512, 64, *iomodel.paper_blocks(32_768, 64))["total"]
    line = next(ln for ln in text.splitlines() if ln.startswith("total"))
    assert line.split()[1:] == [f"{total:,}", f"{total:,}"]
    assert "for" in text or name == "naive"


def test_access_counter():
    c = AccessCounter()
    c.read("Q", 10)
    c.read("Q", 5)
    c.write("O", 7)
    assert c.reads == {"Q": 15} and c.writes == {"O": 7} and c.total == 22 and c.by_tensor() == {"Q": 15, "O": 7}
    with pytest.raises(ValueError):
        c.read("X", 1)
