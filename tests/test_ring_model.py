"""The NumPy ring (fa_variants/reference/ring.py) against one rank's float64 attention of the whole sequence, zigzag
and in order, causal and not, GQA; its work balance and byte counts; ``fa-variants explain ring``."""
import numpy as np
import pytest

from fa_variants.cli import main
from fa_variants.reference import ring
from fa_variants.reference.dense import attention64


@pytest.mark.parametrize("world, causal, zigzag", [(1, True, True), (2, True, True), (4, True, True),
                                                   (3, True, False), (4, False, False), (2, False, True)])
def test_ring_model_is_attention(rng, world, causal, zigzag):
    n = 2 * world * 5
    q, k, v = (rng.standard_normal((2, n, h, 8)) for h in (4, 2, 2))
    res = ring.forward(q, k, v, world, causal=causal, zigzag=zigzag, softmax_scale=0.3)
    out, lse = attention64(q, k, v, causal=causal, scale=0.3)
    np.testing.assert_allclose(res.out, out.reshape(2, 4, n, 8).transpose(0, 2, 1, 3), atol=1e-12)
    np.testing.assert_allclose(res.lse, lse.reshape(2, 4, n), atol=1e-12)
    block = 2 * 2 * (n // world) * 2 * 8 * 2
    assert (res.sent_bytes == (world - 1) * block).all()


def test_zigzag_balances_causal_work_and_in_order_does_not():
    rows_z, _ = ring.step_times(4096, 4, causal=True, zigzag=True)
    rows_o, _ = ring.step_times(4096, 4, causal=True, zigzag=False)
    per_rank = lambda zig: [sum(4 * 32 * (4096 // (8 if zig else 4)) ** 2 * 128 * (0.5 if d else 1)  # noqa: E731
                                for s in range(4) for _, _, d in ring.pairs(r, (r - s) % 4, 4, True, zig))
                            for r in range(4)]
    assert len(set(per_rank(True))) == 1
    assert max(per_rank(False)) == 7 * min(per_rank(False))   # the last rank's 3.5 blocks against rank 0's half
    assert sum(c for _, c, _ in rows_z) < sum(c for _, c, _ in rows_o)   # the busiest rank sets each step


def test_explain_ring(capsys):
    assert main(["explain", "ring", "--seqlen", "65536", "--world", "4", "--causal", "--heads", "16",
                 "--heads-kv", "4", "--head-dim", "128"]) == 0
    text = capsys.readouterr().out
    assert "zigzag" in text and "hidden" in text and "model check: 4 ranks, causal zigzag" in text
    with pytest.raises(SystemExit, match="multiple of 8"):
        main(["explain", "ring", "--seqlen", "100", "--world", "4", "--causal"])
