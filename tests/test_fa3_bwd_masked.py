"""fa3's masked backward without a GPU: its walk over a packed batch's sequences (kernels/fa3_bwd.py's
masked_shares, the mirror of bwd_dq_writer.cuh's SequenceWalk) hands every Q block one share from each K/V block
that sees it, ranked 0 .. count - 1, and the writers, each waiting for its share's rank, all finish (the kernel
would hang where they do not); and where the launcher runs it."""
import pytest

from fa_variants.kernels import fa3_bwd
from fa_variants.reference.masks import Mask
from fa_variants.tiles import FA3_BWD_TILES

# (seqlens_q, seqlens_k): a packed batch with empty, one-token and long sequences; a dense-looking one; cross
CASES = [
    ([1, 0, 37, 1000, 300, 4097], [1, 0, 37, 1000, 300, 4097]),
    ([640, 640], [640, 640]),
    ([37, 300, 129], [300, 37, 1000]),
    ([0, 5], [7, 0]),
]
MASKS = [dict(causal=False), dict(causal=True), dict(causal=True, window=(200, 0)),
         dict(causal=False, window=(100, 300)), dict(causal=False, window=(0, 0)), dict(causal=False, window=(-1, 64))]


def _writers_finish(walks) -> dict:
    """Run the ordered writers: a CTA's next share is added once its Q block's count reaches its rank. Returns the
    counts; fails where no writer can go on while shares remain (a hang)."""
    counts, at = {}, [0] * len(walks)
    left = sum(map(len, walks))
    while left:
        moved = False
        for c, shares in enumerate(walks):
            while at[c] < len(shares) and counts.get(shares[at[c]][0], 0) == shares[at[c]][1]:
                block = shares[at[c]][0]
                counts[block] = counts.get(block, 0) + 1
                at[c] += 1
                left -= 1
                moved = True
        assert moved, f"the writers wait on each other: {[w[a] for w, a in zip(walks, at) if a < len(w)]}"
    return counts


@pytest.mark.parametrize("seqlens", CASES)
@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize("d", sorted(FA3_BWD_TILES))
@pytest.mark.parametrize("heads_kv, group, ctas", [(2, 2, "a column each"), (1, 3, "two columns each"), (2, 1, 3),
                                                   (2, 1, 13), (1, 2, 12)])
def test_masked_walk_adds_every_share_once_in_a_fixed_order(seqlens, mask, d, heads_kv, group, ctas):
    """... on grids of one CTA a K/V block of the longest sequence, two, 3 CTAs (fewer than the longest
    sequence's blocks: it is walked a chunk of 3 blocks at a time), 13 (one group: no divisor holds the blocks)
    and 12 (groups of 4, 6 or 12)."""
    seqlens_q, seqlens_k = seqlens
    bm, bn = FA3_BWD_TILES[d].block_q, FA3_BWD_TILES[d].block_k
    n_kv = -(-max(seqlens_k) // bn)
    ctas = {"a column each": n_kv, "two columns each": 2 * n_kv}.get(ctas, ctas)
    walks = fa3_bwd.masked_shares(seqlens_q, seqlens_k, heads_kv, group, ctas, bm, bn, **mask)
    counts = _writers_finish(walks)
    expect = {}
    for b, (sq, sk) in enumerate(zip(seqlens_q, seqlens_k)):
        m = Mask.of(sq, sk, **mask)
        for h in range(heads_kv * group):
            for i in range(-(-sq // bm)):
                n = len(m.blocks(slice(i * bm, min(i * bm + bm, sq)), bn))
                if n:
                    expect[(b, h, i)] = n
    assert counts == expect


def test_masked_grid_where_it_applies():
    """The launcher's rule: head dims up to 128 (else fa2's masked passes run); a CTA for each K/V block of the call
    (when packed, at most the packed rows' blocks plus one a sequence), up to the SMs; no CTAs for an empty batch;
    and the walk's groups: the smallest divisor of the CTAs that holds the longest sequence's blocks."""
    import numpy as np
    from fa_variants.kernels import common
    from fa_variants.kernels.masked import Masks

    class Dev:
        id = 0

    class Arr:
        def __init__(self, *shape):
            self.shape, self.device = shape, Dev()

    common.SMS[0] = 132
    try:
        packed = Masks(cu_seqlens_q=np.array([0, 5, 9]), cu_seqlens_k=np.array([0, 5, 9]), max_seqlen_q=5,
                       max_seqlen_k=16896, total_q=9, total_k=9)
        assert fa3_bwd.masked_grid(Arr(9, 4, 128), Arr(9, 2, 128), packed) == (1 + 2) * 2   # 9 rows' block + 2
        long = Masks(cu_seqlens_q=np.array([0, 5, 30000]), cu_seqlens_k=np.array([0, 5, 30000]), max_seqlen_q=29995,
                     max_seqlen_k=29995, total_q=30000, total_k=30000)
        assert fa3_bwd.masked_grid(Arr(30000, 4, 128), Arr(30000, 2, 128), long) == 132
        assert fa3_bwd.masked_grid(Arr(9, 4, 256), Arr(9, 2, 256), packed) == 0
        dense = Masks(window=(64, 0))
        assert fa3_bwd.masked_grid(Arr(3, 1000, 8, 64), Arr(3, 1000, 2, 64), dense) == 6 * 8
        assert fa3_bwd.masked_grid(Arr(0, 1000, 8, 64), Arr(0, 1000, 2, 64), dense) == 0
        assert fa3_bwd.masked_grid(Arr(2, 8960, 8, 64), Arr(2, 8960, 8, 64), dense) == 132
        assert [fa3_bwd.walk_columns(n, 132) for n in (8, 32, 64, 70, 110, 132, 200)] == [11, 33, 66, 132, 132,
                                                                                          132, 132]
        assert fa3_bwd.walk_columns(8, 48) == 8 and fa3_bwd.walk_columns(5, 13) == 13
    finally:
        del common.SMS[0]
