"""fa2's wgmma backward (kernels/fa2_bwd_sm90.py) on the CPU: which backward fa2 runs where, its instances, its
shared memory. (Its compile for sm_90a without spills is test_jit's; its results are test_gpu_backward's.)"""
from __future__ import annotations

import pytest

from fa_variants import gpu, registry
from fa_variants.kernels import common, fa2, fa2_bwd, fa2_bwd_sm90 as k


@pytest.mark.parametrize("cc, kernel, head_dim, want", [
    (90, None, 64, "wgmma"), (90, None, 128, "wgmma"), (90, None, 256, "wgmma"), (90, None, 40, "wgmma"),
    (90, "mma_sync", 64, "mma_sync"), (80, None, 64, "mma_sync"), (89, None, 128, "mma_sync"),
])
def test_fa2_backward_dispatch(monkeypatch, cc, kernel, head_dim, want):
    monkeypatch.setattr(gpu, "compute_capability", lambda: cc)
    called = []
    monkeypatch.setattr(k, "backward", lambda *a, **kw: called.append("wgmma"))
    monkeypatch.setattr(fa2_bwd, "backward", lambda *a, **kw: called.append("mma_sync"))

    class Q:
        shape = (1, 8, 2, head_dim)
    if kernel:  # fa2.backward(kernel=...): the mma.sync backward on Hopper
        fa2.backward(None, Q(), None, None, None, None, causal=False, softmax_scale=1.0, kernel=kernel)
    else:
        registry.get("fa2").launcher.backward(None, Q(), None, None, None, None, causal=False, softmax_scale=1.0)
    assert called == [want]


def test_supports():
    assert [d for d in range(1, 300) if k.supports(d)] == list(range(8, 257, 8))


def test_compiled_for_sm90a_only():
    units = registry.get("fa2").launcher.compile_units
    assert k.SOURCE == fa2.SM90_BWD_SOURCE
    assert k.SOURCE in units("sm_90a") and all(k.SOURCE not in units(a) for a in ("sm_80", "sm_86", "sm_89"))
    assert set(units("sm_90a")[k.SOURCE]) == set(k.specializations())


def test_tiles_fit_the_h200():
    for d in k.DIMS:
        assert k.dkdv_smem(d, k.DKDV_TILES[d][0]) <= common.SM90_SMEM
        assert k.dq_smem(d, k.DQ_TILES[d][0]) <= common.SM90_SMEM
        # the epilogues stage dK and dV (or dQ) rows of D + 8 elements over the tiles
        bn, split = k.dkdv_config(k.DKDV_TILES[d][0])[:2]
        assert (1 if split else 2) * bn * (d + 8) * 2 <= k.dkdv_smem(d, k.DKDV_TILES[d][0]) - 1024
        assert k.DQ_TILES[d][0][0] * (d + 8) * 2 <= k.dq_smem(d, k.DQ_TILES[d][0]) - 1024
    for d in k.FUSED_TILES:
        assert k.fused_smem(d) <= common.SM90_SMEM


# ------------------------------------------------------------------------------------------- the fused dQ's order
def _visibility(seqlen_q, seqlen_k, bm, bn, causal):
    """first_q_block(j), kv_blocks_seen(i) and the visible (i, j) pairs, from reference.common.block_visited."""
    from fa_variants.reference.common import block_visited
    n_q, n_kv = -(-seqlen_q // bm), -(-seqlen_k // bn)
    seen = {(i, j) for i in range(n_q) for j in range(n_kv)
            if not causal or block_visited(min((i + 1) * bm, seqlen_q) - 1, j * bn, seqlen_q, seqlen_k)}
    first = {j: min(i for i in range(n_q) if (i, j) in seen) for j in range(n_kv)}
    count = {i: sum((i, j) in seen for j in range(n_kv)) for i in range(n_q)}
    return n_q, n_kv, seen, first.__getitem__, count.__getitem__


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (37, 300), (300, 37), (1000, 1000), (4097, 4097),
                                                (130, 8192), (8192, 130), (2048, 4096), (640, 512)])
@pytest.mark.parametrize("d", sorted(k.FUSED_TILES))
def test_fused_dq_order_is_a_fixed_order_in_arrival_order(causal, seqlen_q, seqlen_k, d):
    """Every Q block gets one share from each K/V block it sees, ranked 0 .. count - 1 (so the counts the kernel
    waits on are reached, and the sum's order is fixed); ranked in the order the shares arrive when a head's CTAs
    run side by side one step at a time (so that waiting is rare); and a CTA only waits for lower ranks of CTAs
    that never wait for it (DOWN: smaller roles; UP: larger; ROTATED: earlier steps)."""
    bn, bm = k.FUSED_TILES[d]
    n_q, n_kv, seen, first, count = _visibility(seqlen_q, seqlen_k, bm, bn, causal)
    for odd in ([False, True] if causal else [False]):
        arrivals = {}  # Q block -> [(rank, arrival time, role)]
        for j in range(n_kv):
            blocks, rank = k.dq_order(causal, odd, j, n_kv, n_q, first, count)
            assert sorted(blocks) == sorted(i for i in range(n_q) if (i, j) in seen)
            # DOWN: the role's CTA started after its even item, role n_kv - 1 - j's work
            start = (n_q - first(n_kv - 1 - j)) if odd else 0
            for step, i in enumerate(blocks):
                arrivals.setdefault(i, []).append((rank[i], start + step, j))
        for i in range(n_q):
            got = sorted(arrivals.get(i, []))
            assert [r for r, _, _ in got] == list(range(count(i))), (odd, i)
            times = [t for _, t, _ in got]
            assert times == sorted(times), f"block {i}: shares ranked out of arrival order {got}"
            roles = [j for _, _, j in got]
            if causal:
                assert roles == sorted(roles, reverse=not odd), (odd, i, roles)


def test_dq_mode_defaults():
    """The scheme by shape: the fused dQ (its writer kernel) at the head dims it serves, the three passes elsewhere;
    both are shipped instances, and only those."""
    for (d, causal), mode in k.DEFAULT_DQ.items():
        assert d in k.FUSED_TILES and mode in k.SCHEMES and k.dq_mode(d, causal) == mode
    assert k.dq_mode(256, True) == "separate" and k.dq_mode(256, False) == "separate"
    assert k.dq_mode(128, False) == "writer" and k.dq_mode(64, True) == "writer"
    assert set(k.SCHEMES) == {"separate", "writer"}
    for d in k.DIMS:
        names = k.instances("fav::Half", d)
        assert names[0] == k.dkdv_instance("fav::Half", d, k.DKDV_TILES[d][0])
        assert any(n.startswith(k.FUSED_KERNEL + "<") for n in names) == (d in k.FUSED_TILES)


@pytest.mark.parametrize("scheme", ["fused", "fused_single", "Writer", ""])
def test_backward_refuses_an_unknown_scheme(scheme):
    """Before any array is looked at (no GPU needed): the scheme is named in the error."""
    with pytest.raises(ValueError, match="scheme"):
        k.backward(None, None, None, None, None, None, causal=False, softmax_scale=1.0, scheme=scheme)


def test_fused_pass_sizes():
    """The fused pass's contributors per head and its buffers, as the launcher and bench/recompute.py use them."""
    assert k.fused_contributors(128, 1000) == 8 and k.fused_contributors(64, 16384) == 128
    # d 128: 64-query blocks; d 64: 128-query blocks; the counts hold one int per half of a Q block
    assert k.fused_buffers(2, 3, 1000, 128) == ((2, 3, 16 * 64, 128), (2, 3, 16, 2))
    assert k.fused_buffers(1, 4, 300, 64) == ((1, 4, 3 * 128, 64), (1, 4, 3, 2))
    assert k.fused_threads(64) == k.fused_threads(128) == 384


def test_fused_grid_needs_a_head_resident(monkeypatch):
    """Groups of a head's n_kv CTAs, as many as fit the SMs (at most one per item); 0 where one head does not fit."""
    from fa_variants.kernels import common
    monkeypatch.setitem(common.SMS, 99, 132)
    assert k.fused_grid(99, 8, 1000) == 16 * 8 and k.fused_grid(99, 8, 3) == 3 * 8
    assert k.fused_grid(99, 132, 5) == 132 and k.fused_grid(99, 133, 5) == 0 and k.fused_grid(99, 0, 5) == 0
