"""fa3's grids on the GPU: the persistent grid (one CTA per SM taking tiles from a counter; d 64 and 128) and one
CTA per tile (d 256), each where the tile table runs it (fa_variants/tiles.py), on shapes with more tiles than the
H200 has SMs (132), so that a CTA's Q ring, K/V ring phases and ping-pong turns carry over from one tile to the
next; tiles whose rows see no key (causal, N_q > N_k) mixed in. The tiles a CTA takes differ from call to call, the
arithmetic of each tile does not: the output must repeat bitwise. The split last wave, forced on shapes where the
table leaves it off (``plan(split=True)``). test_gpu_forward.py runs the rest of the forward suite."""
from __future__ import annotations

import math

import numpy as np
import pytest

import fa_variants as fav
from conftest import Case, assert_matches, new_seed, random_qkv_host, reference64, to_device, to_host
from fa_variants.kernels import fa3
from fa_variants.tiles import fa3_tile

pytestmark = pytest.mark.gpu

CASES = [
    Case(3, 1000, 777, 8, 2, 128, True),        # 8 x 8 x 3 = 192 tiles of 128 rows, GQA 4:1
    Case(2, 2000, 2000, 16, 16, 64, False),     # 11 x 16 x 2 = 352 tiles of 192 rows
    Case(1, 3000, 1000, 8, 1, 256, True),       # 24 x 8 tiles, MQA; rows 0..1999 see no key
    Case(4, 129, 300, 40, 8, 96, True),         # 2 x 40 x 4 = 320 small tiles, padded head dim
]


def _run(case, host, poisoned, split=None):
    """fa3 through its plan (``split``: fa3.plan's; None: the table's rule), on poisoned outputs."""
    q, k, v = to_device(host)
    plan = fa3.plan(q, k, v, causal=case.causal, softmax_scale=1 / math.sqrt(case.head_dim), return_lse=True,
                    split=split)
    with poisoned(case):
        out, lse = plan.run_cupy(q, k, v)
        return to_host(out), to_host(lse)


def _launch(case, split=None) -> fa3.Fa3Launch:
    from fa_variants.kernels.common import sm_count
    return fa3.launch_of("bfloat16", batch=case.batch, heads=case.heads, seqlen_q=case.seqlen_q,
                         seqlen_k=case.seqlen_k, head_dim=case.head_dim, causal=case.causal, sms=sm_count(),
                         split=split)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_grid_of_the_table_matches_float64_and_repeats_bitwise(request, poisoned, case, dtype):
    ok, why = fav.get("fa3").available()
    if not ok:
        pytest.skip(why)
    seed = new_seed()
    request.node.user_properties.append(("seed", seed))
    host = random_qkv_host(np.random.default_rng(seed), case.batch, case.seqlen_q, case.seqlen_k, case.heads,
                           case.heads_kv, case.head_dim, dtype)
    ref_out, ref_lse = reference64(*host, causal=case.causal)
    assert _launch(case).tile.persistent == (case.head_dim <= 128), "the cases cover both grids"
    first, second = (_run(case, host, poisoned) for _ in range(2))
    assert_matches(first[0], ref_out, dtype, first[1], ref_lse, what=f"fa3 {case.id} {dtype}")
    assert np.array_equal(first[0].view(np.uint16), second[0].view(np.uint16)), "out differs across calls"
    assert np.array_equal(first[1], second[1], equal_nan=True), "lse differs across calls"


# Non-causal shapes whose last wave the persistent grid splits (on 132 SMs): the d 64 case above (352 tiles, 88 in
# the last wave, 16 blocks each: 2-3 pieces a tile); d 128, GQA 4:1 (192 tiles, 60 last, 7 blocks of 160 keys:
# pieces of 4 and 3); padded d 96 with a one-row last Q block (320 tiles, 56 last, 2 blocks: pieces of one block).
SPLIT_CASES = [CASES[1], Case(3, 1000, 1000, 8, 2, 128, False), Case(4, 129, 300, 40, 8, 96, False)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=[c.id for c in SPLIT_CASES])
def test_split_tail_matches_float64_and_repeats_bitwise(request, poisoned, case, dtype):
    """The last wave's tiles cut into pieces on several CTAs and merged by the last piece: against float64, against
    the unsplit grid (within the tolerance: the merge adds in another order), and bitwise equal across calls with
    other inputs in between (their merges' counts must be reset, or the second call would read the first's
    partials)."""
    ok, why = fav.get("fa3").available()
    if not ok:
        pytest.skip(why)
    # these short tiles split only when asked to
    assert _launch(case, split=True).tail[2] > 0 and _launch(case).tail[2] == 0, "the case does not split"
    seed = new_seed()
    request.node.user_properties.append(("seed", seed))
    rng = np.random.default_rng(seed)
    hosts = [random_qkv_host(rng, case.batch, case.seqlen_q, case.seqlen_k, case.heads, case.heads_kv,
                             case.head_dim, dtype) for _ in range(2)]
    runs = [_run(case, hosts[i], poisoned, split=True) for i in (0, 1, 0)]
    for i in (0, 1):
        ref_out, ref_lse = reference64(*hosts[i], causal=False)
        assert_matches(runs[i][0], ref_out, dtype, runs[i][1], ref_lse, what=f"fa3 split {case.id} {dtype}")
    assert np.array_equal(runs[0][0].view(np.uint16), runs[2][0].view(np.uint16)), "split: out differs across calls"
    assert np.array_equal(runs[0][1], runs[2][1], equal_nan=True), "split: lse differs across calls"
    unsplit = _run(case, hosts[0], poisoned, split=False)
    assert_matches(runs[0][0], unsplit[0].astype(np.float64), dtype, runs[0][1], unsplit[1],
                   what=f"fa3 split against unsplit {case.id} {dtype}")


def test_persistent_tile_counter_resets_across_launches_and_streams(poisoned):
    """The persistent grid takes tiles from a counter pair per stream that its last CTA zeroes: launches of
    different grids (12 and 132 CTAs) back to back, on two streams at once, each give the output of a launch on
    its own, bitwise (a counter left unreset or shared would skip tiles, which stay NaN in the poisoned output)."""
    import cupy
    ok, why = fav.get("fa3").available()
    if not ok:
        pytest.skip(why)
    rng = np.random.default_rng(new_seed())
    cases = [Case(1, 300, 300, 4, 4, 128, False), CASES[1]]   # 3 x 4 = 12 tiles; 352 tiles on 132 CTAs
    assert all(_launch(c).tile.persistent for c in cases)
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


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_narrow_tail_block_at_its_bounds(request, poisoned, head_dim, causal):
    """The seqlen_k tail block is computed at TAIL_BN = BN - 32 keys where it holds no more (fa3_fwd.cu): seqlen_k
    with exactly TAIL_BN keys in the last block (the narrow step's widest), one key (its narrowest) and TAIL_BN + 1
    (the full step), against float64; seqlen_q != seqlen_k so that the causal diagonal crosses the tail block's rows
    differently per tile."""
    ok, why = fav.get("fa3").available()
    if not ok:
        pytest.skip(why)
    seed = new_seed()
    request.node.user_properties.append(("seed", seed))
    rng = np.random.default_rng(seed)
    for around in (600, 2600):  # the short tiles (d 128 and 256) and the long ones
        bn = fa3_tile(head_dim, around, causal).block_k
        for tail in (bn - 32, 1, bn - 31):
            seqlen_k = around // bn * bn + tail
            case = Case(2, seqlen_k - 37, seqlen_k, 4, 2, head_dim, causal)
            assert fa3_tile(head_dim, seqlen_k, causal).block_k == bn
            host = random_qkv_host(rng, case.batch, case.seqlen_q, case.seqlen_k, case.heads, case.heads_kv,
                                   case.head_dim, "bfloat16")
            ref_out, ref_lse = reference64(*host, causal=causal)
            out, lse = _run(case, host, poisoned)
            assert_matches(out, ref_out, "bfloat16", lse, ref_lse, what=f"fa3 narrow tail {case.id} tail {tail}")
