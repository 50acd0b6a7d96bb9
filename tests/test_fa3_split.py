"""fa3's split tail (kernels/fa3.py tail_split, fa3_fwd.cu's SPLIT), checked on the host: the ranges it cuts the
last wave's K/V blocks into cover them once, one per CTA at most, each tile in at most MAX_PIECES + 1 pieces; and
it stays off where it does not pay or cannot run (causal, no TMA store, a full last wave, short tiles), and
``split=True`` (the GPU tests' small shapes) forces it wherever it can run."""
import pytest

from fa_variants.kernels import fa3
from fa_variants.tiles import FA3_FP8_TILES


@pytest.mark.parametrize("tiles, ctas, nb", [(352, 132, 16), (192, 132, 7), (320, 132, 2), (2048, 132, 26),
                                             (2048, 132, 103), (2752, 132, 16), (300, 114, 40), (133, 132, 50)])
def test_ranges_cover_the_last_wave_once(tiles, ctas, nb):
    last, w, ranges = fa3.tail_split(tiles, ctas, nb, causal=False, tma_out=True, split=True)
    assert last == tiles % ctas and 0 < w < nb and ranges <= ctas
    # the kernel's arithmetic (piece_at, split_meet): range i is blocks [i w, min((i + 1) w, last nb)) end to end
    covered = [0] * (last * nb)
    for i in range(ranges):
        for g in range(i * w, min((i + 1) * w, last * nb)):
            covered[g] += 1
    assert covered == [1] * (last * nb)
    for tile in range(last):
        first, final = tile * nb // w, ((tile + 1) * nb - 1) // w
        assert final < ranges and final - first + 1 <= fa3.MAX_PIECES + 1
        assert final * w >= tile * nb  # the merger, the tile's last range, begins inside it: a first piece


def test_off_where_it_does_not_pay_or_cannot_run():
    assert fa3.tail_split(2048, 132, 26, causal=False, tma_out=True)[2] > 0       # d 128 N 4K: on
    assert fa3.tail_split(2048, 132, 13, causal=False, tma_out=True) == (0, 0, 0)  # N 2K: short tiles
    assert fa3.tail_split(2048, 132, 26, causal=True, tma_out=True) == (0, 0, 0)
    assert fa3.tail_split(2048, 132, 26, causal=False, tma_out=False) == (0, 0, 0)
    assert fa3.tail_split(2112, 132, 26, causal=False, tma_out=True) == (0, 0, 0)  # 16 whole waves
    assert fa3.tail_split(130, 132, 26, causal=False, tma_out=True) == (0, 0, 0)   # one wave
    assert fa3.tail_split(2230, 132, 26, causal=False, tma_out=True) == (0, 0, 0)  # last wave 118 of 132 SMs
    assert fa3.tail_split(2048, 132, 26, causal=False, tma_out=True, split=False) == (0, 0, 0)
    assert fa3.tail_split(2048, 132, 13, causal=False, tma_out=True, split=True)[2] > 0  # forced: short tiles too
    assert fa3.tail_split(2048, 132, 26, causal=True, tma_out=True, split=True) == (0, 0, 0)  # cannot run
    with pytest.raises(TypeError, match="split"):
        fa3.tail_split(2048, 132, 26, causal=False, tma_out=True, split=1)


def test_fa3_fp8_splits_where_its_o_buffer_fits():
    """fa3_fp8's persistent tiles (d 64, 128) store O by TMA from a buffer of their own, so their last wave can be
    split; every fa3_fp8 instance's shared memory (Q buffers, that O buffer, the K/V ring) fits sm_90's."""
    from fa_variants.kernels.common import SM90_SMEM
    for d, tile in FA3_FP8_TILES.items():
        tma = fa3.stores_o_by_tma(d, tile, itemsize=1)
        assert tma == (tile.persistent and d < 256), (d, tile)
        assert fa3.smem_bytes(d, tile, itemsize=1) <= SM90_SMEM
        if tma:
            per_tile = tile._replace(persistent=False)  # one Q buffer, no O buffer
            assert fa3.smem_bytes(d, tile, itemsize=1) == (fa3.smem_bytes(d, per_tile, itemsize=1)
                                                           + tile.block_q * d + fa3.o_buffer_bytes(d, tile))
