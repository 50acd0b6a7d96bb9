"""FlashAttention-3 forward (Shah et al. 2024) on Hopper, in the loop order of ``cuda_src/fa3_fwd.cu``.

One CTA per (Q block of B_r = 64 NC rows, head, batch; NC = 2 in the default tiles: 128 rows), 1 + NC
warpgroups. Warpgroup 0 is the producer: one thread issues the TMA copies, Q_i once, then K_j and V_j into a
ring of ``stages`` shared-memory slots. Warpgroups 1..NC are consumers 0..NC-1: consumer c owns rows
[64c, 64c + 64) of the Q block (``consumer_rows``) and runs FA2's online softmax with deferred normalization on
them, all reading the same K_j, V_j from shared memory.
``PIPELINE`` (printed by ``fa-variants explain fa3``) describes the barriers that the model leaves out.

What differs from ``reference/fa2.py``, and what this model reproduces:

* The K/V blocks are visited in DESCENDING order, from the last block the CTA sees down to block 0
  (``kv_visits``). The blocks that need a mask (the causal diagonal's, the short tail block of N_k) are the
  highest-numbered ones a CTA visits, so they come first, and the rest of the loop runs without masks. Here a
  mask is applied only where ``kv_visits`` says the kernel applies one: the comparison with the dense reference
  (tests/test_models_fa3.py) is what shows that the unmasked blocks really need none. With a window's left
  bound (reference/masks.py) the lowest blocks a CTA visits need a mask as well: masked blocks first, unmasked
  ones, then masked ones again, last. The short tail block is a
  short slice here; the kernel computes it at B_c - 32 keys where it holds no more (fp8: B_c - 64; fa3_fwd.cu's
  TAIL_BN), at B_c otherwise: the keys past N_k are masked to exact zeros either way.
* Per consumer, intra-warpgroup overlap (the kernel's OVERLAP): S_j = Q K_j^T is issued together with, and
  before, O += P_prev V_prev, the product of the previous block's probabilities; O has taken the previous block's
  rescale factor e^(m - m_new) before that product is added (the kernel applies it once that P V's predecessor
  is done, and only where a reference moved), the softmax of S_j runs while the product is still on the tensor
  cores, and the last block's P V comes after the loop (``_consume``). As a recurrence this is FA2's
  O = e^(m - m_new) O + P_j V_j with each step issued one block later: the floating-point operations are the same
  ones, in the same order, so with FA2's running max (``rescale_tau=0``) the model equals FA2's update over the
  same (descending) sequence of blocks bit for bit, and FA2's ascending model up to rounding. (Likewise the kernel
  with OVERLAP off, FA2's step, applies the same operations to O in the same order: its output should be
  bit-identical to OVERLAP on.)
* Lazy rescaling (FA4's rule, the kernel's RESCALE_TAU): a row's reference point m moves to its new max only
  when that has grown by more than tau (log2 units), so P <= 2^tau and O's rescale is skipped on most blocks
  (``lazy_reference``). The softmax is the same; only the rounding moves.

Precision follows ``reference/fa2.py``: float64 throughout (the kernel's S and O accumulate in fp32 and its P V
takes P as a 16-bit wgmma operand; fa2's model does not round either). ``round_p=True`` rounds P to the input's
float16 / bfloat16 before P V, as the kernel does, with l summed from the unrounded P (the kernel sums its fp32
P). ``forward_fp8`` is the same pipeline on e4m3 operands with fa2_fp8's scaling (``reference/fp8.py``).

HBM traffic is FA2's for the same blocks (``iomodel.fa2_accesses``) but for one case: per CTA the producer
loads Q_i once and each visited K_j, V_j once, shared by the consumers; O_i and LSE_i are written once. A CTA
that sees no key at all (causal with N_q > N_k: its Q block lies wholly above the diagonal) loads nothing, not
even Q_i, and writes zeros and -inf; fa2's kernels load Q_i there anyway. ``accesses`` is the closed form.
Per head, with T_r = ceil(N_q / B_r), non-causal:  N_q d (Q) + 2 T_r N_k d (K, V) + N_q d (O) + N_q (LSE).
"""
from __future__ import annotations

import numpy as np

from ..tiles import (FA3_ABLATION_DIM, FA3_ABLATION_TILE, FA3_BWD_TILES, FA3_FP8_TILES, FA3_TILES, fa3_tile,
                     template_dim)
from . import fa2 as _fa2
from . import fp8 as _fp8
from .common import (AccessCounter, ModelResult, block_slices, check_block, logsumexp_from, normalize, prepare,
                     rescale, row_exp, to_flash_layout, validate)
from .masks import Mask

#: Query rows per consumer warpgroup: a CTA of B_r rows has ceil(B_r / 64) consumers (the kernel's BM = 64 NC).
CONSUMER_ROWS = 64

#: FA4's lazy rescaling, the kernel's RESCALE_TAU (cuda_src/fa3_fwd.cu; a test reads it there): a row's reference
#: point (the max subtracted before exp) moves to its new max only once that has grown by more than tau, in log2
#: units, so P~ <= 2^tau and O is rescaled only when some reference moves. 16-bit P takes 2^8; fa3_fp8's e4m3
#: P~ x 256 must stay under 448, e4m3's largest value.
RESCALE_TAU = 8.0
FP8_RESCALE_TAU = 0.75

LOOPS = """\
for i in 1..T_r:           (one CTA each) producer: load Q_i once, then K_j, V_j, j = J_i down to 1, into the ring
  consumer c in 0..NC-1:   rows 64c..64c+63 of Q_i; O = 0, l = 0, m = -inf in its registers
    j = J_ic (the last block one of its rows sees; causal J_ic <= J_i, the blocks above skipped):
                           S = Q_i K_j^T * scale; m = rowmax S; P = exp(S - m); l = rowsum P
    for j = J_ic-1 down to 1: S = Q_i K_j^T * scale      (issued first; masked in the first blocks only)
                           O = e^(m_prev - m) O + P V_(j+1)   (block j+1's rescale and P V, on the tensor cores
                                                               while this block's softmax runs)
                           m_new = max(m, rowmax S) if that exceeds m by more than tau, else m (lazy rescaling)
                           P = exp(S - m_new); l = e^(m - m_new) l + rowsum P; m = m_new
    O = e^(m_prev - m) O + P V_1; write O / l and LSE = m + log l (once)"""


def default_blocks(head_dim: int, block_q=None, block_k=None, causal=False, seqlen_k=None,
                   fp8=False) -> tuple[int, int]:
    """(B_r, B_c): the ones given, else the tile the kernel launches for a call of ``head_dim`` over ``seqlen_k``
    keys with this mask (fa3's, or fa3_fp8's with ``fp8``; fa_variants/tiles.py ``fa3_tile``)."""
    tile = fa3_tile(head_dim, seqlen_k, causal, fp8)
    block_q, block_k = check_block("block_q", block_q), check_block("block_k", block_k)
    return (tile.block_q if block_q is None else block_q), (tile.block_k if block_k is None else block_k)


def consumer_rows(rows: slice) -> list[slice]:
    """The query rows of each consumer warpgroup of the CTA that owns ``rows``: consumer c takes rows
    [64c, 64c + 64) of the block (``CONSUMER_ROWS``). In the short last Q block a consumer may own no real row
    (it still runs in the kernel, on the zero rows TMA fills in, and writes nothing): left out. Blocks below 64
    rows (the tests' small ones) have a single consumer."""
    return [slice(a, min(a + CONSUMER_ROWS, rows.stop)) for a in range(rows.start, rows.stop, CONSUMER_ROWS)]


def _mask(seqlen_q: int, seqlen_k: int, causal: bool, mask: Mask | None) -> Mask:
    """``mask``, or the plain causal (or no) mask of the call: the structure functions below take either."""
    return Mask.of(seqlen_q, seqlen_k, causal=causal) if mask is None else mask


def kv_visits(rows: slice, seqlen_q: int, seqlen_k: int, block_k: int, causal: bool,
              mask: Mask | None = None) -> list[tuple[slice, bool]]:
    """The K/V blocks the CTA owning Q rows ``rows`` visits, in the kernel's order, each with "needs a mask".

    Descending: from the last block any of its rows sees down to the first (``Mask.blocks``: causal, the blocks
    wholly above the bottom-right diagonal are skipped, as in fa2; with a window, those left of it too). A block
    needs a mask when it is the short tail block of N_k (the kernel's TMA fills the missing keys with zeros,
    scores 0 rather than -inf) or some row of the CTA misses a key of it (causal: the block's first row misses its
    last key). Causal, those are always the first ones visited: the masked blocks form a prefix of the list and
    the kernel's loop splits into masked steps, then unmasked ones (a window's left bound adds masked steps at the
    end). ``mask``: a reference/masks.py ``Mask`` (default: the plain ``causal`` one).
    """
    mask = _mask(seqlen_q, seqlen_k, causal, mask)
    return [(cols, needs_mask(cols, rows, seqlen_q, seqlen_k, block_k, causal, mask))
            for cols in reversed(mask.blocks(rows, block_k))]


def needs_mask(cols: slice, rows: slice, seqlen_q: int, seqlen_k: int, block_k: int, causal: bool,
               mask: Mask | None = None) -> bool:
    """Whether K block ``cols`` needs a mask for Q rows ``rows``: it is N_k's short tail block, or some row misses
    a key of it (causal: the first row misses its last key; ``Mask.needs_mask``)."""
    return (cols.stop - cols.start < block_k) or _mask(seqlen_q, seqlen_k, causal, mask).needs_mask(rows, cols)


def consumer_visits(visits, rows: slice, seqlen_q: int, seqlen_k: int, block_k: int,
                    causal: bool, mask: Mask | None = None) -> list[tuple[slice, bool]]:
    """The blocks of its CTA's ``visits`` that the consumer owning Q rows ``rows`` works on, each with "needs a
    mask" for its own rows (the kernel's per-consumer j_mask: the short tail block, or causal, a block whose
    last key its first row does not see).

    Causal, the first blocks the CTA visits may hold no key that any of this consumer's rows sees (they lie right
    of its last row's diagonal: with B_r = 192 on 128-key blocks, consumer 0 misses one or two blocks of every
    tile). The kernel's consumer skips those (it hands their stages back unread and lets its ping-pong turn pass
    without a wgmma) but never the CTA's last block, so every consumer has a first and a last P V. (Under a
    window, blocks at the end of the list that none of its rows sees are computed, masked whole.)
    """
    mask = _mask(seqlen_q, seqlen_k, causal, mask)
    first = 0
    while first < len(visits) - 1 and not mask.visits(rows, visits[first][0]):
        first += 1
    return [(cols, needs_mask(cols, rows, seqlen_q, seqlen_k, block_k, causal, mask)) for cols, _ in visits[first:]]


def accesses(seqlen_q, seqlen_k, head_dim, block_q=None, block_k=None, causal=False, fp8=False) -> dict:
    """FA3's HBM element accesses per head, exact (causal included), with ``default_blocks`` for None: the keys
    of ``iomodel.fa2_accesses`` (which it calls), less the Q rows of the CTAs that see no key and so load nothing.

    Causal with N_q > N_k, Q block i sees no key iff its last row (i + 1) B_r - 1 < N_q - N_k: the first
    e = floor((N_q - N_k) / B_r) blocks, all full, so Q = (N_q - e B_r) d. Otherwise fa2's Q = N_q d.
    """
    from .. import iomodel   # here, not at the top: iomodel imports reference.common, the registry both
    B_r, B_c = default_blocks(head_dim, block_q, block_k, causal, seqlen_k, fp8)
    counts = iomodel.fa2_accesses(seqlen_q, seqlen_k, head_dim, B_r, B_c, causal)
    empty_rows = (max(0, seqlen_q - seqlen_k) // B_r) * B_r if causal else 0
    counts["Q"] -= empty_rows * head_dim
    counts["total"] -= empty_rows * head_dim
    return counts


def accesses_fp8(seqlen_q, seqlen_k, head_dim, block_q=None, block_k=None, causal=False) -> dict:
    """``accesses`` with fa3_fp8's tiles for None."""
    return accesses(seqlen_q, seqlen_k, head_dim, block_q, block_k, causal, fp8=True)


def lazy_reference(m, row_max, tau):
    """The reference points after a block whose row maxima are ``row_max`` (natural-log units, as S): the new
    max where it exceeds m by more than tau (log2 units), m elsewhere (the kernel's reference_moves). tau = 0 is
    FA2's running max. A row still all -inf keeps -inf; a NaN max keeps m (the NaN reaches l through P)."""
    m_cand = np.maximum(m, row_max)
    with np.errstate(invalid="ignore"):
        move = (m_cand - m) > tau * np.log(2.0)
    return np.where(move, m_cand, m)


def _check_tau(tau) -> float:
    tau = float(tau)
    if not (0.0 <= tau < 64.0):
        raise ValueError(f"rescale_tau must be a finite threshold >= 0 (log2 units), got {tau!r}")
    return tau


def _consume(visits, scores, product, operand, shape, tau=0.0):
    """One consumer warpgroup's mainloop, in the kernel's order: (O unnormalized, m, l) of its rows.

    ``scores(cols, masked)`` -> S (the wgmma S = Q K^T, scaled, -inf where masked); ``product(P, cols, O)`` ->
    O + P V_cols (the wgmma P V accumulating into O); ``operand(P)`` -> P as the P V wgmma takes it.
    ``shape``: (batch, heads, rows, d) of this consumer's O. np.maximum and ndarray.max keep NaN, as in fa2.
    ``tau``: the lazy rescaling's threshold (``lazy_reference``); m is then each row's reference point, within
    tau of its max.
    """
    O = np.zeros(shape)
    if not visits:                                    # no visible K block: O = 0, l = 0 -> LSE = -inf
        return O, np.full(shape[:3], -np.inf), np.zeros(shape[:3])
    (cols, masked), *rest = visits
    S = scores(cols, masked)                          # the first block: no running max to rescale yet
    m = S.max(axis=-1)
    P = row_exp(S, m)
    l = P.sum(axis=-1)
    alpha = np.zeros(shape[:3])                       # what O owes the last softmax: O = 0 owes nothing
    prev = cols
    for cols, masked in rest:
        S = scores(cols, masked)                      # issue S_j = Q K_j^T
        O = product(operand(P), prev, alpha[..., None] * O)  # O rescaled (1 where no reference moved), += P_prev V_prev
        m_new = lazy_reference(m, S.max(axis=-1), tau)  # wait for S_j only: softmax(S_j) overlaps P_prev V_prev
        P = row_exp(S, m_new)
        alpha = rescale(m, m_new)                     # 1 where the reference stayed: the kernel skips O's rescale
        l = alpha * l + P.sum(axis=-1)
        m, prev = m_new, cols
    return product(operand(P), prev, alpha[..., None] * O), m, l  # after the loop: O += P_last V_last


def merge_pieces(parts):
    """The kernel's split_meet (SPLIT): a tile cut along its K/V blocks, ``parts`` each piece's (O unnormalized,
    m, l) in key order. The last piece merges: every piece is taken to the largest reference point (a row a piece
    saw no key of has O = l = 0 there), its own first, then the others in key order."""
    (O, m, l), others = parts[-1], parts[:-1]
    top = m
    for _, m_p, _ in others:
        top = np.maximum(top, m_p)
    f = rescale(m, top)
    O, l = O * f[..., None], l * f
    for O_p, m_p, l_p in others:
        f = rescale(m_p, top)
        O, l = O + O_p * f[..., None], l + l_p * f
    return O, top, l


def _pieces(visits, B_c, split):
    """``visits`` (descending, as the kernel's) cut into pieces of ``split`` K/V blocks from key 0, in key order."""
    if not split or not visits:
        return [visits]
    groups = {}
    for cols, masked in visits:
        groups.setdefault(cols.start // B_c // split, []).append((cols, masked))
    return [groups[k] for k in sorted(groups)]


def _pipeline(Q, K, V, B_r, B_c, mask, scores, product, operand, finish, tau=0.0, split=None):
    """The CTA loop both models share: (O heads-major, LSE, hbm). ``mask``: the call's reference/masks.py
    ``Mask`` (which blocks each CTA and consumer visits, and the sinks folded in before ``finish``). The producer's
    loads are counted once per CTA (its consumers read the same shared-memory stage); ``scores(i, rows, j, cols,
    masked)``,
    ``product(P, j, cols, O)``, ``operand(P)`` and ``finish(i, O, l)`` (O / l and any dequantization) are the
    arithmetic, i and j the Q and K block numbers; ``tau`` the lazy rescaling's threshold (``_consume``).
    ``split``: every tile cut into pieces of that many K/V blocks, each consumed alone (its Q loaded again, its
    partial O, l, m written for the last piece, which reads them back) and merged (``merge_pieces``): the
    arithmetic of the persistent grid's split last wave, applied here to every tile."""
    batch, heads, N_q, d = Q.shape
    N_k = K.shape[2]
    programs = batch * heads  # every (batch, query head) CTA loads its own K/V blocks, GQA included
    hbm = AccessCounter()
    O = np.zeros_like(Q)
    LSE = np.empty((batch, heads, N_q))
    for i, rows in enumerate(block_slices(N_q, B_r)):         # one CTA per Q block
        visits = kv_visits(rows, N_q, N_k, B_c, False, mask)
        if visits:                                             # (a CTA that sees no key loads nothing)
            hbm.read("Q", programs * (rows.stop - rows.start) * d)  # producer: Q_i once ...
        for cols, _ in visits:                                 # ... then K_j, V_j through the ring, descending
            hbm.read("K", programs * (cols.stop - cols.start) * d)
            hbm.read("V", programs * (cols.stop - cols.start) * d)
        pieces = _pieces(visits, B_c, split)
        if visits and len(pieces) > 1:                         # each piece loads Q_i; all but the last leave a partial
            n = rows.stop - rows.start
            hbm.read("Q", programs * n * d * (len(pieces) - 1))
            for t in ("O", "l", "m"):
                hbm.write(t, programs * n * (d if t == "O" else 1) * (len(pieces) - 1))
                hbm.read(t, programs * n * (d if t == "O" else 1) * (len(pieces) - 1))
        for c_rows in consumer_rows(rows):                     # the consumer warpgroups
            O_c, m, l = merge_pieces([_consume(
                consumer_visits(piece, c_rows, N_q, N_k, B_c, False, mask),
                lambda cols, masked, c_rows=c_rows: scores(i, c_rows, cols.start // B_c, cols, masked),
                lambda P, cols, acc: product(P, cols.start // B_c, cols, acc),
                operand, (batch, heads, c_rows.stop - c_rows.start, d), tau) for piece in pieces])
            m, l, alpha = mask.fold_sinks(m, l)                # a sink: one more score, with no value
            O[:, :, c_rows] = finish(i, alpha[..., None] * O_c, l)  # deferred normalization: once per row
            LSE[:, :, c_rows] = logsumexp_from(m, l)
        hbm.write("O", programs * (rows.stop - rows.start) * d)
        hbm.write("LSE", programs * (rows.stop - rows.start))
    return O, LSE, hbm


def _check_split(split_blocks, causal):
    """``split_blocks`` as ``forward`` and ``forward_fp8`` take it: None, or a positive int on a non-causal call."""
    if split_blocks is None:
        return None
    if isinstance(split_blocks, bool) or not isinstance(split_blocks, (int, np.integer)) or split_blocks < 1:
        raise ValueError(f"split_blocks must be a positive int or None, got {split_blocks!r}")
    if causal:
        raise ValueError("split_blocks: the kernel splits non-causal tiles only (causal=True given)")
    return int(split_blocks)


def _p_operand(q, round_p):
    """P -> the P V operand: unchanged (fa2's float64 convention), or rounded to q's float16 / bfloat16."""
    if not isinstance(round_p, (bool, np.bool_)):
        raise TypeError(f"round_p must be a bool, got {type(round_p).__name__}")
    if not round_p:
        return lambda P: P
    dtype = np.asarray(q).dtype
    if dtype.name not in ("float16", "bfloat16"):
        raise ValueError(f"round_p=True rounds P to the input dtype as the kernel's 16-bit wgmma operand; "
                         f"q must be float16 or bfloat16, got {dtype}")
    return lambda P: P.astype(dtype).astype(np.float64)


def forward(q, k, v, *, causal=False, softmax_scale=None, block_q=None, block_k=None, round_p=False,
            rescale_tau=RESCALE_TAU, split_blocks=None, window=(-1, -1), softcap=0.0, sinks=None,
            alibi_slopes=None) -> ModelResult:
    """FA3's forward on float64 copies; q (batch, seqlen_q, heads, d), k/v (batch, seqlen_k, heads_kv, d).

    ``block_q``/``block_k`` default to the kernel's tiles (``default_blocks``). ``round_p``: P rounded to the
    input's 16-bit dtype before P V, as the kernel's wgmma operand (default False: float64, fa2's convention).
    ``rescale_tau``: the lazy rescaling's threshold in log2 units (``RESCALE_TAU``, the kernel's; 0: FA2's
    running max, with which this is FA2's update in descending block order, bit for bit).
    ``split_blocks``: every tile cut into pieces of that many K/V blocks and merged as the persistent grid's split
    last wave does (``merge_pieces``; non-causal only, as the kernel's).
    ``window``, ``softcap``, ``sinks`` (heads,), ``alibi_slopes`` (heads,) or (batch, heads): reference/masks.py.
    Returns ``ModelResult`` (out float64 in flash layout, lse, hbm, blocks)."""
    operand = _p_operand(q, round_p)
    split_blocks = _check_split(split_blocks, causal)
    rescale_tau = _check_tau(rescale_tau)
    Q, K, V, scale = prepare(q, k, v, causal=causal, softmax_scale=softmax_scale,
                              block_q=block_q, block_k=block_k)
    mask = Mask.of_arrays(Q, K, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                          sinks=sinks)
    d, N_k = Q.shape[3], K.shape[2]
    B_r, B_c = default_blocks(d, block_q, block_k, causal=causal, seqlen_k=N_k)
    O, LSE, hbm = _pipeline(
        Q, K, V, B_r, B_c, mask,
        scores=lambda i, rows, j, cols, masked: mask.apply(Q[:, :, rows] @ K[:, :, cols].swapaxes(-1, -2) * scale,
                                                           rows, cols, masked),
        product=lambda P, j, cols, acc: acc + P @ V[:, :, cols],
        operand=operand,
        finish=lambda i, O_c, l: normalize(O_c, l), tau=rescale_tau, split=split_blocks)
    return ModelResult(out=to_flash_layout(O), lse=LSE, hbm=hbm, blocks=(B_r, B_c))


def forward_fp8(q, k, v, *, causal=False, softmax_scale=None, block_q=None, block_k=None, rotate=False, seed=0,
                scaling="block", p_scale=256.0, accumulate_bits=None, rescale_tau=FP8_RESCALE_TAU,
                split_blocks=None) -> ModelResult:
    """FA3's pipeline on e4m3 operands: ``reference/fp8.py``'s ``forward`` (fa2_fp8) with FA3's block order
    (descending, masked blocks first), its consumer split and its blocks (``default_blocks``).

    The quantization is fp8.py's, called, not copied: Q scales per ``block_q`` rows (one per CTA), K per
    ``block_k`` rows, V per channel (``scaling="block"``) or one scale each (``"tensor"``); ``rotate``, ``seed``,
    ``p_scale`` and ``accumulate_bits`` mean what they mean there. P = exp(S - m_new) is summed into l before
    rounding, then e4m3(p_scale P) is the P V operand. ``rescale_tau``: the lazy rescaling's threshold
    (``FP8_RESCALE_TAU``, the kernel's; p_scale 2^tau must stay below e4m3's 448; 0: fa2_fp8's running max).

    Not fa2_fp8's numbers up to float64 rounding: P is rounded to e4m3 relative to the running max at the block,
    and that max depends on the order the blocks come in, so the two orders round different values (they agree
    within e4m3's rounding). On the same single block, or on keys reversed block for block, they are the same.
    ``split_blocks``: ``forward``'s (the persistent grid's split last wave, here on every tile). For the same reason
    a piece, which starts its own running max, rounds other P values than the unsplit pass: the merged O agrees
    with the unsplit one within e4m3's rounding, not to float64 rounding; l sums the unrounded P, so the LSE does.
    """
    if scaling not in _fp8.SCALINGS:
        raise ValueError(f"scaling must be one of {_fp8.SCALINGS}, got {scaling!r}")
    p_scale = _fp8._check_p_scale(p_scale)
    rescale_tau = _check_tau(rescale_tau)
    split_blocks = _check_split(split_blocks, causal)
    if p_scale * 2.0 ** rescale_tau > 448.0:
        raise ValueError(f"p_scale x 2^rescale_tau must stay <= 448 (e4m3's largest value, P~ <= 2^tau), got "
                         f"{p_scale:g} x 2^{rescale_tau:g}")
    q64, k64, v64, scale = validate(q, k, v, causal=causal, softmax_scale=softmax_scale, block_q=block_q,
                                    block_k=block_k)
    B_r, B_c = default_blocks(q64.shape[3], block_q, block_k, fp8=True)  # the original head dim, as the kernel pads
    Q, K, V, sq, sk, sv = _fp8.quantized_operands(q64, k64, v64, scaling, B_r, B_c, rotate, seed)
    N_q, N_k = Q.shape[2], K.shape[2]

    def scores(i, rows, j, cols, masked):
        S = _fp8.tc_matmul(Q[:, :, rows], K[:, :, cols].swapaxes(-1, -2), accumulate_bits)
        S = S * (sq[:, :, i] * sk[:, :, j] * scale)[..., None, None]   # the pair's scales fold into the softmax's
        return mask.apply(S, rows, cols, masked)

    mask = Mask.of(N_q, N_k, causal=causal)
    O, LSE, hbm = _pipeline(
        Q, K, V, B_r, B_c, mask, scores,
        product=lambda P8, j, cols, acc: _fp8.tc_matmul(P8, V[:, :, cols], accumulate_bits, acc=acc),
        operand=lambda P: (P * p_scale).astype(_fp8.E4M3).astype(np.float64),  # exact scaling, e4m3 rounding
        finish=lambda i, O_c, l: normalize(O_c * (sv / p_scale)[:, :, None, :], l), tau=rescale_tau,
        split=split_blocks)
    return ModelResult(out=to_flash_layout(O), lse=LSE, hbm=hbm, blocks=(B_r, B_c))


# ----------------------------------------------------------------------------------------------- the teaching text

def _keys(low: int, bound: int | None) -> str:
    """The seqlen_k range of a tile rule, in words."""
    if bound is None:
        return "any N_k" if low == 0 else f"N_k > {low}"
    return f"N_k <= {bound}" if low == 0 else f"{low} < N_k <= {bound}"


def _tile_text(d: int, tile, when: str, operands: str = "K+V", itemsize: int = 2) -> list[str]:
    """A tile as two lines: its sizes and grid, then arithmetic on them (not a measurement): the operand tiles'
    shared memory and a consumer thread's accumulator registers (128 threads per warpgroup)."""
    rows = CONSUMER_ROWS
    q_kib, kv_kib = tile.block_q * d * itemsize / 1024, 2 * tile.block_k * d * itemsize / 1024
    grid = "persistent grid" if tile.persistent else "one CTA per tile"
    return [f"  d={d:<3d} {when}: B_r x B_c = {tile.block_q} x {tile.block_k}, n_st = {tile.stages}, {grid}",
            f"          smem Q {q_kib:g} + {tile.stages} x ({operands}) {kv_kib:g} = "
            f"{q_kib + tile.stages * kv_kib:g} KiB; "
            f"a consumer thread holds O {rows * d // 128} + S {rows * tile.block_k // 128} fp32, "
            f"P {rows * tile.block_k * itemsize // 512} registers"]


def _tile_lines() -> list[str]:
    """fa3's tile rules (fa_variants/tiles.py FA3_TILES), the two masks' merged where they agree."""
    lines = []
    for d in sorted({d for d, _ in FA3_TILES}):
        masks = ("causal or not",) if FA3_TILES[d, False] == FA3_TILES[d, True] else ("non-causal", "causal")
        for mask in masks:
            low = 0
            for bound, tile in FA3_TILES[d, mask == "causal"]:
                lines += _tile_text(d, tile, f"{mask}, {_keys(low, bound)}")
                low = bound
    return lines


PIPELINE = "\n".join([
    "FA3 forward pipeline (sm_90a: TMA, mbarriers, wgmma, setmaxnreg; cuda_src/fa3_fwd.cu)",
    "",
    "CTA = 1 + NC warpgroups of 128 threads, one per (Q block i of B_r = 64 NC rows, head, batch); NC = 3 at",
    "d = 64 (512 threads, 192 rows), 2 above (384 threads, 128 rows). The last Q block is launched first",
    "(causal: it has the most K/V blocks to visit).",
    "  warpgroup 0      producer: one thread issues every TMA copy (cp.async.bulk.tensor), nothing else; the",
    "                   warpgroup gives its registers away (setmaxnreg 24) to the consumers (240 each with",
    "                   NC = 2, 160 with NC = 3)",
    "  warpgroup 1 + c  consumer c: query rows 64c..64c+63 of the block, its own m, l, O in registers",
    "  All consumers read the same Q_i, K_j, V_j from shared memory: one HBM load per CTA (fa2's traffic; a",
    "  CTA that sees no key, causal with N_q > N_k, loads nothing and writes zeros and LSE = -inf).",
    "",
    "producer, in order:  Q_i once (barrier q_full), then K_j and V_j for j = J_i (the last visible block) down",
    "  to 1: the t-th block (t = 0, 1, ...) into ring stage s = t mod n_st. The empty barriers keep it at most",
    "  n_st blocks ahead of the consumers. Descending order puts the blocks that need a mask (the causal",
    "  diagonal's, the tail block of N_k) first: the consumers' steps after them are compiled without a mask.",
    "  The tail block, where it holds at most B_c - 32 keys (fp8: B_c - 64), is computed at that width.",
    "  Causal, a consumer skips the first blocks that none of its 64 rows sees (right of its last row's",
    "  diagonal; consumer_visits): it hands their stages back and lets its ping-pong turn pass without a wgmma.",
    "",
    "K/V ring: n_st stages of a K_j and a V_j tile; per stage four mbarriers, K and V apart, so S = Q K_j^T",
    "can start before V_j has landed and K's slot is freed before V's:",
    "  k_full[s], v_full[s]    'the tile is in'. Initialised with 1 arrival: the producer's",
    "            mbarrier.arrive.expect_tx, which also announces the tile's bytes; the TMA unit counts them",
    "            down (complete_tx) as they land. The phase completes when the arrival is in and the count is 0:",
    "            no thread copies or polls the data. Consumers wait with try_wait.parity before the wgmma.",
    "  k_empty[s], v_empty[s]  'the slot may be refilled'. Initialised with 4 NC arrivals: lane 0 of each",
    "            consumer warp arrives once the wgmma that read the tile has retired (wgmma.wait_group); the",
    "            producer waits on it before its next TMA into the slot.",
    "  Phases: a barrier's phase bit flips each time it completes; the t-th use of stage s waits for parity",
    "  (t div n_st) mod 2 on the full barriers and the opposite on the empty ones, so the producer's first",
    "  n_st waits pass at once (the ring starts empty).",
    "",
    "ping-pong between the consumers (PINGPONG; inter-warpgroup overlap): named barriers 1..NC (bar.sync and",
    "  bar.arrive over 256 threads: the waiting warpgroup and the one that lets it go). Consumer c waits",
    "  (bar.sync 1 + c) before issuing the wgmmas of a step, and right after issuing them lets the next one go",
    "  (bar.arrive 1 + (c + 1) mod NC), round robin; the last consumer arrives once at the start, so consumer 0",
    "  issues first. One consumer's softmax (exp2 on the multi-function units, max and sum on the FMA units)",
    "  then runs while another's GEMMs hold the tensor cores (NC = 2):",
    "      tensor cores   | GEMMs of c0 | GEMMs of c1 | GEMMs of c0 | GEMMs of c1 | ...",
    "      consumer 0     | issue       | softmax     | issue       | softmax     |",
    "      consumer 1     | (waits)     | issue       | softmax     | issue       |",
    "  fa3_fp8 at d = 128 (EXP_TURNS): e4m3 halves the tensor cores' time per key but not the multi-function",
    "  units' (16 exp2 lanes an SM), so one consumer's softmax no longer fits under the other's GEMMs and the",
    "  two softmaxes overlap. The consumers then also take turns at their exponentials (named barriers 8 + c,",
    "  round robin as above): one consumer's exp2s run at the units' full rate while the other takes its row",
    "  max or issues its wgmmas (what it buys on the H200: docs/kernels/fa3.md). Every 16th of",
    "  a thread's exponentials there runs on the FMA units instead (EXP_FMA, math.cuh's exp2f_fma: 2^round(x)",
    "  built from its bit pattern times a degree-2 polynomial of the rest): a small share relieves the MUFU",
    "  lanes, a larger one takes issue slots the other consumer needs (docs/kernels/fa3.md).",
    "",
    "intra-warpgroup overlap (OVERLAP; inside one consumer: wgmma is asynchronous, issue, commit, wait later):",
    "  wait k_full (block j) and v_full (block j+1); [ping-pong wait]",
    "  issue S_j = Q K_j^T; issue O += P_(j+1) V_(j+1) (the previous block's P, 16-bit A fragments in registers)",
    "  [ping-pong pass]; wgmma.wait_group 1: S_j is done, P V still running -> release K_j's slot;",
    "  mask (first steps only); softmax(S_j): m_new, P_j, l, e^(m - m_new)   <- overlaps P_(j+1) V_(j+1)",
    "  wgmma.wait_group 0: P V done -> release V_(j+1)'s slot; P_j to 16-bit (its registers were P V's operand);",
    "  O *= e^(m - m_new), only if a row of the warp moved its reference (a warp vote and a branch: nothing is",
    "  in flight here, so the branch costs no wgmma wait). fa3_fp8 at d = 64 waits for P V inside that branch",
    "  instead, so that every exponential is issued first; the vote is then the warpgroup's (bar.red.or), since",
    "  all four warps must execute a wgmma.wait_group at one place (compute-sanitizer synccheck)",
    "",
    "lazy rescaling (FA4's rule; RESCALE_TAU): a row's reference point m moves to its new max only when that",
    "  has grown by more than tau (log2 units: 8 for 16-bit P, 0.75 for fa3_fp8's e4m3 P x 256 < 448), so P~",
    "  stays <= 2^tau and most blocks skip O's rescale (64 FMULs a thread a block at d = 128, 128 at d = 256).",
    "  The result is the same softmax (O / l and LSE = m + log l do not depend on where m sits); the model's",
    "  rescale_tau = 0 is FA2's running max, bit for bit.",
    "  The first block has no P V to pair with; after the loop comes O += P_1 V_1. Then named barrier 4 (every",
    "  consumer is done with Q and the ring), O / l staged through shared memory, O and LSE written once.",
    "  The arithmetic is FA2's online softmax with each P V issued one block later: the same operations in the",
    "  same order, so OVERLAP off (FA2's step: softmax, rescale, then P_j V_j at once) gives the same numbers.",
    "",
    "tiles (fa_variants/tiles.py, what a call launches; why each, measured: docs/kernels/tiles.md):",
    *_tile_lines(),
    f"  the ablation (bench/ablation.py): d={FA3_ABLATION_DIM}, B_r x B_c = {FA3_ABLATION_TILE.block_q} x "
    f"{FA3_ABLATION_TILE.block_k} (FA3's tile), one CTA per tile at every length",
    "",
    "grid: one CTA per tile (Q block, head, batch), last Q blocks first; or, where the tiles above say so, the",
    "  persistent grid: one CTA per SM whose producer takes the next tile from a global counter (atomicAdd; the",
    "  last CTA zeroes it for the next launch) and hands it to the consumers through two shared-memory slots with",
    "  full/empty mbarriers. It loads the next tile's Q and K/V while the consumers finish this one: no CTA",
    "  start and no Q wait between tiles, and an SM that finishes early takes the next tile (heaviest first).",
    "  Where a second Q buffer fits (CROSS: not at d = 256), the pipeline runs across tiles: the next tile's",
    "  first S and its softmax are issued beside this tile's last P V, so the tile boundary costs one overlapped",
    "  step plus the epilogue, not a lone P V, a lone S and an idle softmax. The epilogue there writes O over",
    "  the tile's own Q buffer (swizzled) and stores it by TMA; the storing thread waits for the TMA unit's read",
    "  only after the next tile's masked blocks, then hands the buffer back to the producer",
    "  (fa3_fp8, whose 16-bit O rows are twice its e4m3 Q rows: a buffer of its own); elsewhere on this grid",
    "  (16-bit d = 256) O leaves straight from registers. Non-causal, the last wave's",
    "  tiles (fewer than the SMs) are cut along their K/V blocks into one range per SM (SPLIT, stream-K's idea);",
    "  each tile's last piece merges the others' partial O, m, l (an fp32 workspace) into its own and stores it.",
    "",
    "fa3_fp8: the same kernel with its FP8 template flag (kernels/fa3_fp8.py): Q and K in e4m3 rows of d bytes,",
    "  V^T (d rows of B_c keys, fa2_fp8's quantizer layout: e4m3 wgmma wants both operands K-major), the wgmmas",
    "  32 values a step (QGMMA); the row max over the raw S_j, and S_j's scale f (its Q tile's and K_j's",
    "  scales) and P's x 256 folded into the exponent: P_j = exp2(S_j f - (m - 8)), packed to e4m3 in",
    "  registers; O / l times V's channel scales on the way out. At d = 64 and 128 the row max of a block",
    "  without a mask is an integer max of the scores' bit patterns, three at a time (sm_90's VIMNMX3): the",
    "  float max wherever a row holds a non-negative score, half the instructions of FMNMX pairs (a warp with",
    "  a row of negative scores only takes the float max). d = 64 and 128 run on the persistent grid, with",
    "  the split last wave and O stored by TMA; d = 256 one CTA per tile. Its tiles (fa_variants/tiles.py",
    "  FA3_FP8_TILES), at any mask and length:",
    *[line for d, tile in FA3_FP8_TILES.items()
      for line in _tile_text(d, tile, "any mask and N_k", operands="K+V^T", itemsize=1)],
    "",
    "measured (docs/kernels/fa3.md, dated, with the card):",
    "  fa3 vs fa2 TFLOP/s at d = 64, 128, 256, causal and not; fa3_fp8 pre-quantized and quantizing",
    "  PINGPONG off, OVERLAP off, both off (bench/ablation.py): printed below from a run's JSON (the shipped",
    "    one, or --measured FILE)",
])


# ----------------------------------------------------------------------------------------------------- backward
LOOPS_BACKWARD = """\
stats:   per Q block i: LSE_i (log2 units) and D_i = rowsum(dO_i o O_i), padded to B_r rows  (one pass)
for j in 1..T_c:           (a persistent CTA per K/V block; a head's T_c CTAs side by side)
  producer warp:           K_j, V_j once; then Q_i, dO_i, LSE_i, D_i of every step into a ring of 2 stages
  compute warpgroup w:     keys 64w..64w+63 of K_j; dK_j = dV_j = 0 in its registers
    for each query head of the group, for i over the Q blocks that see block j (in DqOrder's order):
      S^T = K_j Q_i^T, dP^T = V_j dO_i^T                  (issued together: dP^T runs while P^T is computed)
      P^T = exp2(S^T scale log2e - LSE_i) (masked to 0)   dV_j += P^T dO_i
            (the mask's element test only in a warp whose 16 keys cross the diagonal or the last key)
      dS^T = P^T o (dP^T - D_i)                           dK_j += dS^T Q_i
      dS^T -> shared memory; dQ_i share = dS_ij K_j       (both warpgroups' keys; half of dQ_i's columns or rows each)
  writer warps:            add each share into dQ_i's fp32 sum in a fixed order (rank 0 stores, then bulk adds)
  write dK_j * scale, dV_j (once)
convert: dQ = scale * the fp32 sum, in q's dtype"""


def backward_blocks(head_dim: int, block_q=None, block_k=None) -> tuple[int, int] | None:
    """(B_r, B_c) of fa3's backward for ``head_dim`` (tiles.FA3_BWD_TILES at the next template dim), the ones
    given taking precedence; None above the table's head dims, where fa3's backward is fa2's."""
    dims = tuple(FA3_BWD_TILES)
    if head_dim > dims[-1]:
        return None
    tile = FA3_BWD_TILES[template_dim(head_dim, dims)]
    block_q, block_k = check_block("block_q", block_q), check_block("block_k", block_k)
    return (tile.block_q if block_q is None else block_q), (tile.block_k if block_k is None else block_k)


def backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, block_q=None, block_k=None, **policies):
    """FlashAttention-3's backward (Shah et al. 2024, sec. 3.3), in the loop order of ``cuda_src/fa3_bwd.cu``
    (``LOOPS_BACKWARD``), on float64 copies.

    FA2's Algorithm 2 with dQ accumulated across the K/V-block programs, as the paper has it: one program per K/V
    block j keeps dK_j, dV_j on chip and hands every (i, j) pair's dS_ij K_j to dQ_i's fp32 sum in HBM, so S and
    dP are computed once (5 matrix products per pair, against the 7 of fa2's separate dQ pass). The kernel adds
    the shares in a fixed order (fa2_bwd_sm90.dq_order): the same bits on every run. As arithmetic this is
    ``reference/fa2.py``'s ``dq_mode="atomic"`` on fa3_bwd's blocks (tiles.FA3_BWD_TILES: B_c = 128 keys, B_r = 128
    queries at d 64, 64 at d 128); in float64 the order of the adds does not show. Above d 128 fa3's backward is
    fa2's (three passes: ``dq_mode="separate"``, fa2's blocks). ``policies``: the mask keywords fa2's model takes.

    HBM traffic per head (``iomodel.fa2_backward_accesses``, "atomic"): the dQ sum is read and written at every
    pair there; on the GPU the adds happen in L2 (bulk reduce-adds), which the count does not see.
    """
    blocks = backward_blocks(np.shape(q)[-1], block_q, block_k)
    if blocks is None:
        return _fa2.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, block_q=block_q,
                             block_k=block_k, **policies)
    return _fa2.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, block_q=blocks[0],
                         block_k=blocks[1], dq_mode="atomic", **policies)


def backward_accesses(seqlen_q, seqlen_k, head_dim, block_q=None, block_k=None, causal=False) -> dict:
    """HBM element accesses per head of ``backward`` (its blocks, its dQ mode)."""
    from ..iomodel import fa2_backward_accesses
    blocks = backward_blocks(head_dim, block_q, block_k)
    if blocks is None:
        return fa2_backward_accesses(seqlen_q, seqlen_k, head_dim, block_q, block_k, causal=causal)
    return fa2_backward_accesses(seqlen_q, seqlen_k, head_dim, *blocks, causal=causal, dq_mode="atomic")
