"""The launch path on the GPU: cached plans stay correct and keep validating, under threads and streams; the
split-KV partial epilogue; the one bad-value rule in every kernel."""
from __future__ import annotations

import concurrent.futures
import math

import numpy as np
import pytest

import fa_variants as fav
from fa_variants import api, registry
from fa_variants.kernels import fa2 as fa2_launcher

from conftest import assert_matches, random_qkv_host, reference64, to_device, to_host

pytestmark = pytest.mark.gpu

PLANNED = ["fa1", "fa2"]          # the single-launch variants: their warm calls go through a plan
ALL = [v.name for v in registry.variants()]


def _host(rng, b=2, nq=130, nk=97, h=4, hkv=2, d=64, dtype="float16"):
    return random_qkv_host(rng, b, nq, nk, h, hkv, d, dtype)


def _bits(a):
    return to_host(a).view(np.uint16)


@pytest.mark.parametrize("variant", PLANNED)
def test_a_warm_call_uses_its_plan_and_matches(variant, rng):
    host = _host(rng)
    q, k, v = to_device(host)
    api.clear_plans()
    out1, lse1 = fav.attention(q, k, v, variant=variant, causal=True, return_lse=True)
    assert len(api._PLANS) == 1, "the first call of a signature should leave its plan"
    out2, lse2 = fav.attention(q, k, v, variant=variant, causal=True, return_lse=True)
    assert len(api._PLANS) == 1
    ref_out, ref_lse = reference64(*host, True)
    assert_matches(out2, ref_out, "float16", lse2, ref_lse, what=f"{variant} warm call")
    assert np.array_equal(_bits(out1), _bits(out2))


@pytest.mark.parametrize("variant", PLANNED)
def test_misuse_is_still_refused_after_a_cached_call(variant, rng):
    q, k, v = to_device(_host(rng))
    fav.attention(q, k, v, variant=variant, causal=True)
    with pytest.raises(TypeError, match="causal"):
        fav.attention(q, k, v, variant=variant, causal=1)         # == True, hashes alike: must not hit the plan
    with pytest.raises(TypeError, match="softmax_scale"):
        fav.attention(q, k, v, variant=variant, causal=True, softmax_scale=True)
    with pytest.raises(ValueError, match="heads"):
        fav.attention(q, k[:, :, :1].copy()[:, :, [0, 0, 0]], v[:, :, [0, 0, 0]], variant=variant)
    with pytest.raises(TypeError, match="dtype"):
        fav.attention(q, k.astype("float32"), v, variant=variant, causal=True)


@pytest.mark.parametrize("variant", PLANNED)
def test_plans_under_many_threads_and_streams(variant, rng):
    """Eight threads, each on its own stream, call three signatures in turn; every result equals the one computed
    alone (bitwise: the kernels are deterministic)."""
    import cupy
    shapes = [dict(nq=130, nk=97, d=64), dict(nq=257, nk=300, d=128), dict(nq=64, nk=64, d=80)]
    inputs = [to_device(_host(rng, **s)) for s in shapes]
    alone = [fav.attention(*x, variant=variant, causal=True) for x in inputs]
    cupy.cuda.Device().synchronize()
    api.clear_plans()

    def work(t):
        stream = cupy.cuda.Stream(non_blocking=True)
        outs = []
        with stream:
            for i in range(12):
                x = inputs[(t + i) % len(inputs)]
                outs.append(((t + i) % len(inputs), fav.attention(*x, variant=variant, causal=True)))
        stream.synchronize()
        return outs

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(work, range(8)))
    for outs in results:
        for i, out in outs:
            assert np.array_equal(_bits(out), _bits(alone[i])), f"thread result differs for shape {shapes[i]}"


def test_torch_warm_calls_stay_in_torch(rng):
    torch = pytest.importorskip("torch")
    host = _host(rng, dtype="bfloat16")
    q, k, v = (torch.from_numpy(a.view(np.uint16).astype(np.int16)).view(torch.bfloat16).cuda() for a in host)
    api.clear_plans()
    for _ in range(3):
        out, lse = fav.attention(q, k, v, variant="fa2", causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor) and out.dtype == torch.bfloat16
    assert len(api._PLANS) == 1
    ref_out, ref_lse = reference64(*host, True)
    assert_matches(out, ref_out, "bfloat16", lse, ref_lse, what="fa2 torch warm call")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out_s = fav.attention(q, k, v, variant="fa2", causal=True)
    s.synchronize()
    assert torch.equal(out_s, out), "a call on another torch stream must give the same result"


@pytest.mark.parametrize("splits", [1, 3])
def test_split_kv_partials_merge_to_attention(rng, splits):
    """The PartialOut epilogue over K/V block ranges [begin, end), merged by rescaling: the same attention."""
    import cupy
    host = _host(rng, b=2, nq=100, nk=700, h=4, hkv=2, d=64)
    q, k, v = to_device(host)
    bn = fa2_launcher.partial_block_k()
    n_blocks = math.ceil(700 / bn)
    edges = np.linspace(0, n_blocks, splits + 1).round().astype(int)
    parts = [fa2_launcher.forward_partial(q, k, v, causal=True, softmax_scale=0.125, kv_blocks=(int(a), int(b)))
             for a, b in zip(edges[:-1], edges[1:])]
    out, lse = fa2_launcher.merge_partials(parts, q.dtype)
    ref_out, ref_lse = reference64(*host, True, 0.125)
    assert isinstance(out, cupy.ndarray)
    assert_matches(out, ref_out, "float16", lse, ref_lse, what=f"split-KV x{splits}")


def _runnable(variant):
    ok, why = registry.get(variant).available()
    if not ok:
        pytest.skip(why)


B, NQ, NK, H, D = 1, 160, 128, 2, 64
DIAG = NK - NQ                                   # bottom-right causal: row i sees keys <= i + DIAG
ROWS = np.arange(NQ)
EMPTY = ROWS + DIAG < 0                          # rows 0..31 see no key


@pytest.mark.parametrize("variant", ALL)
def test_nan_in_q_and_inf_in_k_reach_exactly_their_rows(variant, rng):
    """NaN in q gives NaN in its row; Inf in k NaN in the rows that see that key (as torch SDPA); rows that see
    no key stay zeros with LSE -inf; every other row is finite."""
    _runnable(variant)
    q, k, v = (np.array(a) for a in random_qkv_host(rng, B, NQ, NK, H, H, D, "float16"))
    q[0, 40, 0, 3] = np.nan                      # head 0, query row 40
    k[0, 90, 1, 5] = np.inf                      # head 1, key 90: rows >= 122 see it
    out, lse = fav.attention(*to_device((q, k, v)), variant=variant, causal=True, return_lse=True)
    o, l = to_host(out).astype(np.float64), to_host(lse)
    assert (o[0, EMPTY] == 0).all() and np.isneginf(l[0][:, EMPTY]).all(), "rows with no key: zeros, -inf"
    assert np.isnan(o[0, 40, 0]).all() and np.isnan(l[0, 0, 40]), "NaN in q must give NaN in its row"
    # A row that sees key 90 scores it q[5] * inf: +inf (or NaN at q[5] = 0) gives NaN, as in torch; -inf drops
    # the key like a mask. e4m3 has no Inf: the fp8 variants' quantizer makes it NaN, so every such row is NaN there.
    sees = ROWS + DIAG >= 90
    plus = (q[0, :, 1, 5].astype(np.float32) >= 0) | (registry.get(variant).operand_dtype == "float8_e4m3fn")
    assert np.isnan(o[0, sees & plus, 1]).all(), "Inf in k must give NaN in the rows it reaches"
    fine = ~EMPTY & (ROWS != 40)
    assert np.isfinite(o[0, fine, 0]).all() and np.isfinite(o[0, ~EMPTY & ~(sees & plus), 1]).all()


@pytest.mark.parametrize("variant", ALL)
def test_nan_in_v_reaches_the_rows_that_use_it(variant, rng):
    """NaN in one element of v gives NaN in that column of every row that sees its key, and nowhere in the
    other columns (0 x NaN is NaN, so rows of the same block that do not see the key may be NaN there too)."""
    _runnable(variant)
    q, k, v = (np.array(a) for a in random_qkv_host(rng, B, NQ, NK, H, H, D, "float16"))
    v[0, 20, 0, 9] = np.nan                      # head 0, key 20, column 9: rows >= 52 see it
    out = to_host(fav.attention(*to_device((q, k, v)), variant=variant, causal=True)).astype(np.float64)
    assert np.isnan(out[0, ROWS + DIAG >= 20, 0, 9]).all()
    others = np.delete(out[0, ~EMPTY, 0], 9, axis=-1)
    assert np.isfinite(others).all() and np.isfinite(out[0, :, 1]).all()


@pytest.mark.parametrize("d", [32, 64, 80, 96, 128, 160, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fa2_mma_sync_kernel_where_wgmma_is_the_default(rng, d, causal):
    """On Hopper fa2 runs its wgmma kernel; plan(kernel="mma_sync") runs the paper's mma.sync kernel, which must
    stay right too (it is what sm_80/86/89 run)."""
    host = _host(rng, b=2, nq=130, nk=97, h=4, hkv=2, d=d, dtype="bfloat16")
    q, k, v = to_device(host)
    plan = fa2_launcher.plan(q, k, v, causal=causal, softmax_scale=1 / math.sqrt(d), return_lse=True,
                             kernel="mma_sync")
    assert plan.block == 32 * fa2_launcher.config(d, kernel="mma_sync").warps
    out, lse = plan.run_cupy(q, k, v)
    ref_out, ref_lse = reference64(*host, causal)
    assert_matches(out, ref_out, "bfloat16", lse, ref_lse, what=f"fa2 mma.sync d={d}")
