"""The split-KV decoding model (fa_variants/reference/decode.py) against a float64 dense reference on caches built
by the tests (tests/kvcache_cases.py): odd lengths, lengths that differ per sequence (zero included), seqlen_q
1..16, pages that straddle blocks, page size 1, GQA 1:1 to 64:1, several split counts, the append, fp8 caches;
its byte counters against the closed form; the split rule."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from fa_variants.reference import decode as model
from kvcache_cases import (MASK_CASES, SINGLE_SPLIT_TOL, SPLIT_MODEL_TOL, assert_lse, logical_from, make_cache,
                           mask_case, quantize_e4m3, reference, rel)


def run_case(rng, *, batch, lengths, seqlen_q, heads, heads_kv, d=16, page_size=None, num_splits=0, block_n=16,
             causal=True, capacity=None, dtype=np.float16, mask=None):
    lengths = np.asarray(lengths, np.int32)
    capacity = capacity or int(lengths.max()) + 3
    cache = make_cache(rng, batch, capacity, heads_kv, d, dtype, page_size)
    q = rng.standard_normal((batch, seqlen_q, heads, d)).astype(dtype)
    mask = mask or {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # no divide-by-zero or invalid-value warnings
        res = model.forward(q, cache.k_cache, cache.v_cache, cache_seqlens=lengths, page_table=cache.page_table,
                            causal=causal, num_splits=num_splits, block_n=block_n, **mask)
    ref_out, ref_lse = reference(q, cache.k_log, cache.v_log, lengths, causal, **mask)
    what = (f"B{batch} L{lengths.tolist()} Nq{seqlen_q} H{heads}:{heads_kv} page {page_size} splits {num_splits}"
            f"->{res.num_splits} causal={causal} {sorted(mask)}")
    tol = SINGLE_SPLIT_TOL if res.num_splits == 1 else SPLIT_MODEL_TOL
    if np.linalg.norm(ref_out) == 0:
        assert (res.out == 0).all(), what
    else:
        assert rel(res.out, ref_out) <= tol, f"{what}: error {rel(res.out, ref_out):.2e}"
    assert_lse(res.lse, ref_lse, what)
    return res


@pytest.mark.parametrize("length", [0, 1, 37, 4097])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_odd_cache_lengths(rng, length, num_splits):
    run_case(rng, batch=1, lengths=[length], seqlen_q=1, heads=2, heads_kv=1, num_splits=num_splits, block_n=128)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seqlen_q", [1, 2, 5, 16])
def test_lengths_that_differ_per_sequence(rng, seqlen_q, causal):
    """Sequence 0 is empty, sequence 1 shorter than seqlen_q (its first rows see no key when causal)."""
    run_case(rng, batch=4, lengths=[0, 3, 37, 130], seqlen_q=seqlen_q, heads=4, heads_kv=2, num_splits=3,
             causal=causal)


@pytest.mark.parametrize("case", MASK_CASES)
@pytest.mark.parametrize("seqlen_q", [1, 5, 16])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_mask_keywords(rng, case, seqlen_q, num_splits):
    """attention()'s mask keywords over a cache: sequence 0 empty (its rows see only their sinks), sequence 1
    shorter than seqlen_q, the others longer than the windows (the splits cut only the keys a row sees)."""
    mask = mask_case(rng, case, 4, 4)
    run_case(rng, batch=4, lengths=[0, 3, 37, 130], seqlen_q=seqlen_q, heads=4, heads_kv=2, num_splits=num_splits,
             causal=mask.pop("causal", True), mask=mask, page_size=5 if num_splits == 3 else None)


def test_a_window_reads_only_the_keys_it_shows(rng):
    """K/V bytes read: the keys some query sees (window 5, 4 tokens: 9 of each sequence), whatever the length."""
    lengths, nq, hkv, d = [3, 37, 130], 4, 2, 16
    res = run_case(rng, batch=3, lengths=lengths, seqlen_q=nq, heads=4, heads_kv=hkv, d=d, num_splits=3,
                   mask=dict(window=(5, 0)))
    seen = sum(min(n, 5 + nq) for n in lengths)
    assert res.traffic.reads["k_cache"] == res.traffic.reads["v_cache"] == seen * hkv * d * 2


@pytest.mark.parametrize("page_size", [1, 5, 16, 48])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_paged_cache(rng, page_size, num_splits):
    """block_n 16 over pages of 1, 5 (blocks straddle pages), 16 (aligned) and 48 (pages hold three blocks)."""
    run_case(rng, batch=3, lengths=[1, 37, 101], seqlen_q=3, heads=4, heads_kv=2, page_size=page_size,
             num_splits=num_splits)


@pytest.mark.parametrize("heads,heads_kv", [(3, 3), (4, 2), (8, 1), (16, 2), (64, 1)])
def test_gqa(rng, heads, heads_kv):
    run_case(rng, batch=2, lengths=[50, 9], seqlen_q=4, heads=heads, heads_kv=heads_kv, num_splits=0, d=8)


@pytest.mark.parametrize("num_splits", [2, 7, 40, model.MAX_SPLITS])
def test_more_splits_than_blocks_are_empty_partials(rng, num_splits):
    """Splits past the end are empty partials (0, -inf) that the merge must ignore."""
    res = run_case(rng, batch=2, lengths=[5, 70], seqlen_q=2, heads=2, heads_kv=1, num_splits=num_splits)
    assert res.num_splits == num_splits


def test_bottom_right_causal_with_new_tokens(rng):
    """With k, v appended, query i sees keys up to cache_seqlens + seqlen_new - seqlen_q + i; the appended
    tokens land in the cache, where the reference reads them."""
    batch, cap, hkv, d, new = 3, 40, 2, 8, 4
    cache = make_cache(rng, batch, cap, hkv, d, page_size=6)
    lengths = np.array([0, 11, 30], np.int32)
    k_new = rng.standard_normal((batch, new, hkv, d)).astype(np.float16)
    v_new = rng.standard_normal((batch, new, hkv, d)).astype(np.float16)
    q = rng.standard_normal((batch, new, 4, d)).astype(np.float16)
    res = model.forward(q, cache.k_cache, cache.v_cache, cache_seqlens=lengths, page_table=cache.page_table,
                        k=k_new, v=v_new, num_splits=2, block_n=8)
    expect_k, expect_v = cache.k_log.copy(), cache.v_log.copy()
    for b, n in enumerate(lengths):
        expect_k[b, n:n + new], expect_v[b, n:n + new] = k_new[b], v_new[b]
    got_k, got_v = logical_from(cache, batch, cap)
    assert np.array_equal(got_k, expect_k) and np.array_equal(got_v, expect_v), "the append wrote elsewhere"
    ref_out, ref_lse = reference(q, expect_k, expect_v, lengths + new, causal=True)
    assert rel(res.out, ref_out) <= SPLIT_MODEL_TOL
    assert_lse(res.lse, ref_lse)
    # sequence 0 had an empty cache: its query i sees exactly the new tokens 0..i
    assert np.isfinite(res.lse[0]).all()


def test_append_touches_nothing_else(rng):
    """Every cache byte outside the appended slots is unchanged, spare pages and unused slots included."""
    batch, cap, hkv, d, new = 2, 30, 1, 8, 5
    cache = make_cache(rng, batch, cap, hkv, d, page_size=4, extra_rows=3)
    before_k, before_v = cache.k_cache.copy(), cache.v_cache.copy()
    lengths = np.array([2, 21], np.int32)
    k_new = rng.standard_normal((batch, new, hkv, d)).astype(np.float16)
    model.forward(rng.standard_normal((batch, 1, 2, d)).astype(np.float16), cache.k_cache, cache.v_cache,
                  cache_seqlens=lengths, page_table=cache.page_table, k=k_new, v=k_new.copy(), num_splits=1)
    changed = np.zeros(cache.k_cache.shape[:2], bool)
    for b, n in enumerate(lengths):
        t = np.arange(n, n + new)
        changed[cache.page_table[b, t // 4], t % 4] = True
    assert np.array_equal(cache.k_cache[~changed], before_k[~changed])
    assert np.array_equal(cache.v_cache[~changed], before_v[~changed])


@pytest.mark.parametrize("page_size", [None, 3])
def test_fp8_cache_is_dequantized_exactly(rng, page_size):
    """An e4m3 cache with per-(batch, KV head) descale factors against float64 on the dequantized values."""
    batch, cap, hkv, d = 2, 60, 2, 16
    cache16 = make_cache(rng, batch, cap, hkv, d, np.float32, page_size)
    k8, kd = quantize_e4m3(cache16.k_cache.reshape(1, -1, hkv, d))
    v8, vd = quantize_e4m3(cache16.v_cache.reshape(1, -1, hkv, d))
    k_cache, v_cache = k8.reshape(cache16.k_cache.shape), v8.reshape(cache16.v_cache.shape)
    k_descale = np.repeat(kd, batch, axis=0) * rng.uniform(0.5, 2, (batch, hkv)).astype(np.float32)
    v_descale = np.repeat(vd, batch, axis=0) * rng.uniform(0.5, 2, (batch, hkv)).astype(np.float32)
    lengths = np.array([13, 59], np.int32)
    q = rng.standard_normal((batch, 3, 4, d)).astype(np.float16)
    res = model.forward(q, k_cache, v_cache, cache_seqlens=lengths, page_table=cache16.page_table, num_splits=3,
                        block_n=8, k_descale=k_descale, v_descale=v_descale)
    k_log, v_log = logical_from(cache16._replace(k_cache=k_cache, v_cache=v_cache), batch, cap)
    ref_out, ref_lse = reference(q, k_log, v_log, lengths, True, k_descale=k_descale, v_descale=v_descale)
    assert rel(res.out, ref_out) <= SPLIT_MODEL_TOL
    assert_lse(res.lse, ref_lse)
    assert res.traffic.reads["k_cache"] == int(lengths.sum()) * hkv * d * 1     # one byte per element


def test_split_count_does_not_change_the_result(rng):
    """Any split count computes the same attention (to the fp32 rounding of the partials)."""
    batch, cap, hkv, d = 2, 300, 2, 16
    cache = make_cache(rng, batch, cap, hkv, d, page_size=7)
    q = rng.standard_normal((batch, 2, 6, d)).astype(np.float16)
    lengths = np.array([299, 64], np.int32)
    one = model.forward(q, cache.k_cache, cache.v_cache, cache_seqlens=lengths, page_table=cache.page_table,
                        num_splits=1, block_n=16)
    for s in (2, 5, 19, 0):
        many = model.forward(q, cache.k_cache, cache.v_cache, cache_seqlens=lengths, page_table=cache.page_table,
                             num_splits=s, block_n=16)
        assert rel(many.out, one.out) <= SPLIT_MODEL_TOL
        assert np.abs(many.lse - one.lse).max() <= 1e-5


# ------------------------------------------------------------------------------------------------ bytes
def hand_count(lengths, seqlen_q, heads, heads_kv, d, new, splits, block_n, q_bytes, kv_bytes):
    """The bytes of a call counted by hand, split by split (not through traffic_formula's algebra)."""
    q_reads = 0
    for n in lengths:
        for s in range(splits):
            per = math.ceil(math.ceil(n / block_n) / splits) * block_n
            if min(n, s * per) < min(n, (s + 1) * per):
                q_reads += heads_kv * seqlen_q * (heads // heads_kv) * d * q_bytes
    rows = len(lengths) * seqlen_q * heads
    kv = sum(lengths) * heads_kv * d * kv_bytes
    appended = len(lengths) * new * heads_kv * d * kv_bytes
    partial = {} if splits == 1 else {("o_partial", w): splits * rows * d * 4 for w in ("read", "write")} | \
        {("lse_partial", w): splits * rows * 4 for w in ("read", "write")}
    counts = {("q", "read"): q_reads, ("k_cache", "read"): kv, ("v_cache", "read"): kv,
              ("k_cache", "write"): appended, ("v_cache", "write"): appended, ("k_new", "read"): appended,
              ("v_new", "read"): appended, ("out", "write"): rows * d * q_bytes, ("lse", "write"): rows * 4, **partial}
    return {key: n for key, n in counts.items() if n}


@pytest.mark.parametrize("splits,page_size,new", [(1, None, 0), (3, 5, 2), (8, None, 1), (40, 1, 3)])
def test_traffic_matches_the_closed_form(rng, splits, page_size, new):
    batch, hkv, heads, d, nq, block_n = 3, 2, 8, 8, 2, 16
    lengths = np.array([0, 37, 101], np.int32)
    cache = make_cache(rng, batch, 110, hkv, d, page_size=page_size)
    q = rng.standard_normal((batch, nq, heads, d)).astype(np.float16)
    kv_new = [rng.standard_normal((batch, new, hkv, d)).astype(np.float16) if new else None for _ in "kv"]
    res = model.forward(q, cache.k_cache, cache.v_cache, cache_seqlens=lengths, page_table=cache.page_table,
                        k=kv_new[0], v=kv_new[1], num_splits=splits, block_n=block_n)
    keys = (lengths + new).tolist()
    formula = model.traffic_formula(keys, seqlen_q=nq, heads=heads, heads_kv=hkv, head_dim=d, seqlen_new=new,
                                    num_splits=splits, block_n=block_n, q_bytes=2, kv_bytes=2)
    assert res.traffic.rows() == formula
    assert formula == hand_count(keys, nq, heads, hkv, d, new, splits, block_n, 2, 2)


def test_gqa_packing_reads_each_kv_byte_once(rng):
    """The K/V bytes read do not depend on how many query heads share a KV head."""
    cache = make_cache(rng, 1, 200, 2, 8)
    lengths = np.array([199], np.int32)
    reads = {}
    for heads in (2, 8, 32):
        q = rng.standard_normal((1, 4, heads, 8)).astype(np.float16)
        res = model.forward(q, cache.k_cache, cache.v_cache, cache_seqlens=lengths, num_splits=3, block_n=16)
        reads[heads] = (res.traffic.reads["k_cache"], res.traffic.reads["v_cache"])
    assert set(reads.values()) == {(199 * 2 * 8 * 2,) * 2}


# ------------------------------------------------------------------------------------------------ split rule
@pytest.mark.parametrize("batch,heads_kv,seqlen_k,expected", [
    (1, 8, 131072, 16),    # 8 programs: 16 splits -> 128 CTAs (0.97 of a wave); 14 (0.85) is too far from it
    (1, 8, 8192, 16),      # 64 blocks: 16 splits -> 128 CTAs
    (4, 8, 131072, 4),     # 32 programs -> 128 CTAs
    (8, 8, 8192, 2),       # 64 programs -> 128 CTAs
    (32, 8, 4096, 1),      # 256 programs fill the card already
    (64, 8, 2048, 1),
    (1, 8, 128, 1),        # one block: nothing to split
    (1, 1, 300, 3),        # three blocks: at most three splits
    (1, 8, 0, 1),          # an empty cache
])
def test_split_rule(batch, heads_kv, seqlen_k, expected):
    assert model.choose_num_splits(batch, heads_kv, seqlen_k) == expected


def test_split_rule_properties():
    for batch in (1, 2, 3, 5, 16, 40):
        for heads_kv in (1, 2, 8):
            for seqlen_k in (1, 129, 1000, 5000, 70000):
                for sms in (108, 132):
                    s = model.choose_num_splits(batch, heads_kv, seqlen_k, sms)
                    blocks = math.ceil(seqlen_k / model.DEFAULT_BLOCK_N)
                    assert 1 <= s <= max(1, min(blocks, model.AUTO_MAX_SPLITS))
                    if batch * heads_kv >= 0.8 * sms:
                        assert s == 1
                    if s > 1:   # eligible: shorter splits than s - 1 gives, so that every split has work
                        assert math.ceil(blocks / s) < math.ceil(blocks / (s - 1))
                        assert math.ceil(blocks / math.ceil(blocks / s)) == s


@pytest.mark.parametrize("seqlen_k,splits,block_n", [(0, 3, 16), (1, 1, 16), (37, 3, 16), (4097, 5, 128),
                                                     (100, 9, 16), (64, 4, 16)])
def test_split_ranges_cover_the_keys_in_whole_blocks(seqlen_k, splits, block_n):
    ranges = model.split_ranges(seqlen_k, splits, block_n)
    assert len(ranges) == splits
    assert ranges[0][0] == 0 and ranges[-1][1] == seqlen_k
    for (a, b), (c, _) in zip(ranges, ranges[1:]):
        assert b == c and a <= b
    for a, b in ranges:
        assert a == b or (a % block_n == 0 and (b % block_n == 0 or b == seqlen_k))
    sizes = [b - a for a, b in ranges]
    assert sizes == sorted(sizes, reverse=True)            # the empty splits, if any, are at the end


def test_split_ranges_start_at_the_first_key_seen():
    """A window's older keys are never cut into splits: the ranges cover [first_key, seqlen_k) in whole blocks."""
    assert model.split_ranges(100, 3, 16, first_key=40) == [(40, 72), (72, 100), (100, 100)]
    assert model.split_ranges(40, 2, 16, first_key=40) == [(40, 40), (40, 40)]


def test_model_refuses_bad_block_and_splits(rng):
    cache = make_cache(rng, 1, 8, 1, 4)
    q = rng.standard_normal((1, 1, 1, 4)).astype(np.float16)
    for kw, err in [(dict(block_n=0), ValueError), (dict(num_splits=-1), ValueError),
                    (dict(num_splits=model.MAX_SPLITS + 1), ValueError), (dict(num_splits=2.0), TypeError),
                    (dict(num_splits=True), TypeError)]:
        with pytest.raises(err):
            model.forward(q, cache.k_cache, cache.v_cache, cache_seqlens=3, **kw)


# ------------------------------------------------------------------------------------------------ explain decode
def _explain(capsys, *flags):
    from fa_variants import cli
    rc = cli.main(["explain", "decode", *flags])
    return rc, capsys.readouterr().out


@pytest.mark.parametrize("flags", [[], ["--batch", "3", "--seqlen", "1000", "--seqlen-q", "4", "--page-size", "7",
                                        "--heads", "16", "--heads-kv", "2", "--head-dim", "32", "--splits", "5"],
                                   ["--seqlen", "8192", "--window", "127", "0", "--splits", "5"]])
def test_explain_decode_counts_match_the_closed_form(capsys, flags):
    rc, out = _explain(capsys, *flags)
    assert rc == 0
    table = out[out.index("Bytes of one call"):out.index("The merge.")]
    rows = [line.split() for line in table.splitlines() if line.split()[:1] and line.split()[0] in
            (*model.TENSORS, "total")]
    assert len(rows) >= 6 and rows[-1][0] == "total"
    assert all(r[-1] == r[-2] for r in rows), table             # counted == closed form, tensor by tensor
    assert "Why split" in out and "LSE = log sum_s e^(LSE_s)" in out
    chosen = [line for line in out.splitlines() if line.startswith("->")]
    assert len(chosen) == 1 and chosen[0].split()[1] == ("5" if flags else "8")
    if "--window" in flags:   # a window of 128 keys: 128 of the 8192 read, whatever the splits
        assert "128 keys seen" in out and [r for r in rows if r[0] == "k_cache"][0][-1] == f"{128 * 8 * 64 * 2:,}"


@pytest.mark.parametrize("flags,words", [(["--heads", "6", "--heads-kv", "4"], "must be a multiple of --heads-kv"),
                                         (["--splits", "300"], "--splits: num_splits must be 0"),
                                         (["--seqlen", "40000000"], "too many for the NumPy model")])
def test_explain_decode_refuses_bad_flags(capsys, flags, words):
    with pytest.raises(SystemExit) as info:
        _explain(capsys, *flags)
    assert words in str(info.value)
