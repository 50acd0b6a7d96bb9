"""fa3's two grids on the GPU: one CTA per tile, and the persistent grid (one CTA per SM walking the tiles), on
shapes with more tiles than the H200 has SMs (132), so that a CTA's Q ring, K/V ring phases and ping-pong turns
carry over from one tile to the next; tiles whose rows see no key (causal, N_q > N_k) mixed in. The persistent grid
does the same arithmetic in the same order, so its output must be bitwise identical to the one-tile-per-CTA grid's
(its LSE to the last bits: the two epilogues compute it in separately compiled code).
test_gpu_forward.py runs the rest of the forward suite on whichever grid is the default."""
from __future__ import annotations

import numpy as np
import pytest

import fa_variants as fav
from conftest import Case, assert_matches, new_seed, random_qkv_host, reference64, to_device, to_host

pytestmark = pytest.mark.gpu

CASES = [
    Case(3, 1000, 777, 8, 2, 128, True),        # 8 x 8 x 3 = 192 tiles of 128 rows, GQA 4:1
    Case(2, 2000, 2000, 16, 16, 64, False),     # 11 x 16 x 2 = 352 tiles of 192 rows
    Case(1, 3000, 1000, 8, 1, 256, True),       # 24 x 8 tiles, MQA; rows 0..1999 see no key
    Case(4, 129, 300, 40, 8, 96, True),         # 2 x 40 x 4 = 320 small tiles, padded head dim
]


def _run(case, dtype, host, persistent: str, monkeypatch, poisoned, split: str = "0"):
    monkeypatch.setenv("FA_VARIANTS_FA3_PERSISTENT", persistent)
    monkeypatch.setenv("FA_VARIANTS_FA3_SPLIT", split)  # the split tail merges partials: other bits
    fav.clear_plans()
    q, k, v = to_device(host)
    with poisoned(case):
        out, lse = fav.attention(q, k, v, variant="fa3", causal=case.causal, return_lse=True)
        return to_host(out), to_host(lse)


@pytest.fixture(autouse=True)
def _fresh_plans():
    yield
    fav.clear_plans()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_persistent_grid_matches_float64_and_the_tile_grid_bitwise(request, monkeypatch, poisoned, case, dtype):
    ok, why = fav.get("fa3").available()
    if not ok:
        pytest.skip(why)
    seed = new_seed()
    request.node.user_properties.append(("seed", seed))
    host = random_qkv_host(np.random.default_rng(seed), case.batch, case.seqlen_q, case.seqlen_k, case.heads,
                           case.heads_kv, case.head_dim, dtype)
    ref_out, ref_lse = reference64(*host, causal=case.causal)
    per_tile = _run(case, dtype, host, "0", monkeypatch, poisoned)
    persistent = _run(case, dtype, host, "1", monkeypatch, poisoned)
    for (out, lse), grid in ((per_tile, "one CTA per tile"), (persistent, "persistent")):
        assert_matches(out, ref_out, dtype, lse, ref_lse, what=f"fa3 {grid} {case.id} {dtype}")
    assert np.array_equal(per_tile[0].view(np.uint16), persistent[0].view(np.uint16)), "out differs bitwise"
    # LSE = (m + log2 l) ln 2 is the epilogues' own arithmetic (staged and register stores compile apart): a few
    # ulp of its terms, so of the largest |LSE| (a relative bound fails where m and log2 l nearly cancel)
    assert np.array_equal(np.isneginf(per_tile[1]), np.isneginf(persistent[1]))
    finite = np.isfinite(per_tile[1])
    a, b = per_tile[1][finite], persistent[1][finite]
    ulp = np.finfo(np.float32).eps * max(1.0, float(np.abs(a).max()))
    assert np.abs(a - b).max() <= 4 * ulp, f"lse differs by {np.abs(a - b).max():.3g} (4 ulp of max |lse|: {4 * ulp:.3g})"


# Non-causal shapes whose last wave the persistent grid splits (on 132 SMs): the d 64 case above (352 tiles, 88 in
# the last wave, 16 blocks each: 2-3 pieces a tile); d 128, GQA 4:1 (192 tiles, 60 last, 7 blocks of 160 keys:
# pieces of 4 and 3); padded d 96 with a one-row last Q block (320 tiles, 56 last, 2 blocks: pieces of one block).
SPLIT_CASES = [CASES[1], Case(3, 1000, 1000, 8, 2, 128, False), Case(4, 129, 300, 40, 8, 96, False)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=[c.id for c in SPLIT_CASES])
def test_split_tail_matches_float64_and_repeats_bitwise(request, monkeypatch, poisoned, case, dtype):
    """The last wave's tiles cut into pieces on several CTAs and merged by the last piece: against float64, against
    the unsplit grid (within the tolerance: the merge adds in another order), and bitwise equal across calls with
    other inputs in between (their merges' counts must be reset, or the second call would read the first's
    partials)."""
    from fa_variants.kernels import fa3
    from fa_variants.kernels.common import cdiv, sm_count
    ok, why = fav.get("fa3").available()
    if not ok:
        pytest.skip(why)
    monkeypatch.setenv("FA_VARIANTS_FA3_SPLIT", "1")  # these short tiles split only when asked to
    d = fa3.template_dim(case.head_dim, fa3.DIMS)
    cfg = fa3.config(d, case.seqlen_k)
    tiles = cdiv(case.seqlen_q, cfg[0]) * case.heads * case.batch
    assert fa3.persistent(cfg) and fa3.tail_split(tiles, min(tiles, sm_count()), cdiv(case.seqlen_k, cfg[1]), False,
                                                  fa3.stores_o_by_tma(d, cfg))[2] > 0, "the case does not split"
    seed = new_seed()
    request.node.user_properties.append(("seed", seed))
    rng = np.random.default_rng(seed)
    hosts = [random_qkv_host(rng, case.batch, case.seqlen_q, case.seqlen_k, case.heads, case.heads_kv,
                             case.head_dim, dtype) for _ in range(2)]
    runs = [_run(case, dtype, hosts[i], "", monkeypatch, poisoned, split="1") for i in (0, 1, 0)]
    for i in (0, 1):
        ref_out, ref_lse = reference64(*hosts[i], causal=False)
        assert_matches(runs[i][0], ref_out, dtype, runs[i][1], ref_lse, what=f"fa3 split {case.id} {dtype}")
    assert np.array_equal(runs[0][0].view(np.uint16), runs[2][0].view(np.uint16)), "split: out differs across calls"
    assert np.array_equal(runs[0][1], runs[2][1], equal_nan=True), "split: lse differs across calls"
    unsplit = _run(case, dtype, hosts[0], "", monkeypatch, poisoned, split="0")
    assert_matches(runs[0][0], unsplit[0].astype(np.float64), dtype, runs[0][1], unsplit[1],
                   what=f"fa3 split against unsplit {case.id} {dtype}")


def test_persistent_tile_counter_resets_across_launches_and_streams(monkeypatch, poisoned):
    """The persistent grid takes tiles from a counter pair per stream that its last CTA zeroes: launches of
    different grids (12 and 132 CTAs) back to back, on two streams at once, each give the output of a launch on
    its own, bitwise (a counter left unreset or shared would skip tiles, which stay NaN in the poisoned output)."""
    import cupy
    ok, why = fav.get("fa3").available()
    if not ok:
        pytest.skip(why)
    monkeypatch.setenv("FA_VARIANTS_FA3_PERSISTENT", "1")
    fav.clear_plans()
    rng = np.random.default_rng(new_seed())
    cases = [Case(1, 300, 300, 4, 4, 128, False), CASES[1]]   # 3 x 4 = 12 tiles; 352 tiles on 132 CTAs
    inputs = [to_device(random_qkv_host(rng, c.batch, c.seqlen_q, c.seqlen_k, c.heads, c.heads_kv, c.head_dim,
                                        "bfloat16")) for c in cases]

    def call(i):
        with poisoned(cases[i]):
            return fav.attention(*inputs[i], variant="fa3", causal=cases[i].causal)

    alone = [to_host(call(i)) for i in range(2)]
    for i in range(2):
        assert not np.isnan(alone[i].astype(np.float32)).any(), f"{cases[i].id}: tiles left unwritten"
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    runs = []
    for _ in range(6):
        for s, stream in enumerate(streams):
            for i in (s, 1 - s):
                with stream:
                    runs.append((i, call(i)))
    cupy.cuda.Device().synchronize()
    for n, (i, out) in enumerate(runs):
        assert np.array_equal(to_host(out).view(np.uint16), alone[i].view(np.uint16)), \
            f"launch {n} ({cases[i].id}) differs from the same launch alone"


@pytest.mark.parametrize("persistent", ["0", "1"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_narrow_tail_block_at_its_bounds(request, monkeypatch, poisoned, head_dim, causal, persistent):
    """The seqlen_k tail block is computed at TAIL_BN = BN - 32 keys where it holds no more (fa3_fwd.cu): seqlen_k
    with exactly TAIL_BN keys in the last block (the narrow step's widest), one key (its narrowest) and TAIL_BN + 1
    (the full step), on either grid, against float64; seqlen_q != seqlen_k so that the causal diagonal crosses the
    tail block's rows differently per tile."""
    from fa_variants.kernels import fa3
    ok, why = fav.get("fa3").available()
    if not ok:
        pytest.skip(why)
    monkeypatch.setenv("FA_VARIANTS_FA3_PERSISTENT", persistent)
    seed = new_seed()
    request.node.user_properties.append(("seed", seed))
    rng = np.random.default_rng(seed)
    for around in (600, 2600):  # the short tiles (SHORT_TILES, CAUSAL_SHORT_TILES) and the long ones
        bn = fa3.config(head_dim, around, causal)[1]
        for tail in (bn - 32, 1, bn - 31):
            seqlen_k = around // bn * bn + tail
            case = Case(2, seqlen_k - 37, seqlen_k, 4, 2, head_dim, causal)
            assert fa3.config(head_dim, seqlen_k, causal)[1] == bn
            host = random_qkv_host(rng, case.batch, case.seqlen_q, case.seqlen_k, case.heads, case.heads_kv,
                                   case.head_dim, "bfloat16")
            ref_out, ref_lse = reference64(*host, causal=causal)
            out, lse = _run(case, "bfloat16", host, persistent, monkeypatch, poisoned)
            assert_matches(out, ref_out, "bfloat16", lse, ref_lse, what=f"fa3 narrow tail {case.id} tail {tail}")
