"""What the three NumPy models share: input preparation, masks, block sizes, the online-softmax rule, counters.

Everything here is computed in float64 so that a model differs from the exact softmax only by float64 rounding;
the models differ from each other only in loop order, normalization and which tensors cross "HBM".
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import ml_dtypes
import numpy as np

from ..arrays import check_dims, check_scalars

#: Default on-chip memory M of the papers, in *elements*: 128 KiB of fp32 = 32768. An H200 SM has 228 KB of
#: shared memory (227 KB usable by one block); the papers' analysis assumes "about 100 KB", and the kernels
#: double-buffer half-precision tiles, so a bit over half an SM is the honest budget. Being a power of two, it
#: gives power-of-two blocks for the usual head dims: d=64 -> (B_r, B_c) = (64, 128), d=128 -> (64, 64).
DEFAULT_SRAM = 32_768

#: Tensors the models may move through HBM. "LSE" is FA2's saved log-sum-exp; "l"/"m" are FA1's statistics.
#: The backward adds the gradients dO (given), dQ, dK, dV (computed), FA2's D = rowsum(dO o O), and naive's
#: materialized N_q x N_k gradients dP (of P) and dS (of S).
TENSORS = ("Q", "K", "V", "O", "S", "P", "l", "m", "LSE", "dO", "dQ", "dK", "dV", "D", "dP", "dS")


@dataclasses.dataclass
class Ledger:
    """Reads and writes by tensor over a whole call, in the units the subclass counts; ``NAMES``: the tensors it
    may count, so that a misspelt name raises instead of opening a new tensor and breaking the totals."""
    NAMES: ClassVar[tuple] = ()
    reads: dict = dataclasses.field(default_factory=dict)
    writes: dict = dataclasses.field(default_factory=dict)

    def _add(self, book: dict, name: str, n: int) -> None:
        if name not in self.NAMES:
            raise ValueError(f"tensor must be one of {self.NAMES}, got {name!r}")
        book[name] = book.get(name, 0) + int(n)

    def read(self, name: str, n: int) -> None:
        self._add(self.reads, name, n)

    def write(self, name: str, n: int) -> None:
        self._add(self.writes, name, n)

    @property
    def total(self) -> int:
        return sum(self.reads.values()) + sum(self.writes.values())


class AccessCounter(Ledger):
    """HBM element accesses by tensor, summed over the whole call (every batch and query head).

    Counts are elements, not bytes: ``iomodel.hbm_bytes`` applies the element sizes.
    """
    NAMES = TENSORS

    def by_tensor(self) -> dict:
        """tensor -> reads + writes, in ``TENSORS`` order, for the tensors that were touched."""
        return {t: self.reads.get(t, 0) + self.writes.get(t, 0)
                for t in TENSORS if t in self.reads or t in self.writes}


@dataclasses.dataclass
class ModelResult:
    out: np.ndarray            # float64 (batch, seqlen_q, heads, head_dim)
    lse: np.ndarray            # float64 (batch, heads, seqlen_q); -inf: no key seen; NaN: a NaN/Inf score
    hbm: AccessCounter
    blocks: tuple | None = None  # (B_r, B_c) the model ran with; None for naive (no tiling)


@dataclasses.dataclass
class BackwardResult:
    dq: np.ndarray             # float64 (batch, seqlen_q, heads, head_dim)
    dk: np.ndarray             # float64 (batch, seqlen_k, heads_kv, head_dim): summed over each query-head group
    dv: np.ndarray             # float64 (batch, seqlen_k, heads_kv, head_dim)
    hbm: AccessCounter
    blocks: tuple | None = None  # (B_r, B_c) the model ran with; None for naive (no tiling)
    flops: int = 0             # matmul FLOPs (2mnk per product) of the whole call, recomputation included
    dsinks: np.ndarray | None = None  # float64 (heads,): the sinks' gradient, where sinks were given


# ----------------------------------------------------------------------------------------------- inputs

def to_float64(x) -> np.ndarray:
    """float16, ml_dtypes.bfloat16, float32 or float64 array -> float64 (astype knows the ml_dtypes casts).

    A float64 array comes back as it is, not copied: the models never write to their inputs.
    """
    return np.asarray(x).astype(np.float64, copy=False)


def is_float_dtype(dtype) -> bool:
    """NumPy's floating types and ml_dtypes' (bfloat16, float8_*): the dtypes a model takes.

    ml_dtypes' types are opaque to NumPy (kind "V"), so they are recognised by ml_dtypes.finfo; complex is
    refused because the cast to float64 would drop the imaginary part with nothing but a warning.
    """
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return True
    if dtype.kind != "V":
        return False
    try:
        ml_dtypes.finfo(dtype)
    except (ValueError, TypeError):
        return False
    return True


def check_block(name: str, b):
    """None, or ``b`` as an int >= 1 (bools are refused: True would silently mean blocks of one row)."""
    if b is None:
        return None
    if isinstance(b, (bool, np.bool_)) or not isinstance(b, (int, np.integer)):
        raise TypeError(f"{name} must be an int >= 1 or None, got {type(b).__name__}")
    if b < 1:
        raise ValueError(f"{name} must be an int >= 1 or None, got {b}")
    return int(b)


def validate(q, k, v, *, causal, softmax_scale, block_q=None, block_k=None, check_size=None):
    """Every model's argument check, before any arithmetic: (q, k, v widened to float64, softmax scale).

    The scalars and the shapes go through attention()'s own checks (arrays.check_scalars, arrays.check_dims), so
    a misuse reads the same from either entry point; the layout rules (strides, alignment) are the kernels'
    needs, and the models take any NumPy array. ``check_size(q_shape, k_shape)``, where given, runs once the
    shapes are checked and before the float64 copies: a model too large for this host is refused before those
    are made (naive's N_q x N_k matrices).
    """
    check_scalars(causal, softmax_scale, False)  # as attention(): the scalars first, the arrays after
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        check_block(name, b)
    q, k, v = (np.asarray(x) for x in (q, k, v))
    for name, a in zip("qkv", (q, k, v)):
        if not is_float_dtype(a.dtype):
            raise TypeError(f"{name} must have a floating-point dtype (float16, bfloat16, float32, float64, "
                            f"float8_*), got {a.dtype}")
    check_dims(q, k, v)
    scale = check_scalars(causal, softmax_scale, False, head_dim=q.shape[3])
    if check_size is not None:
        check_size(q.shape, k.shape)
    return to_float64(q), to_float64(k), to_float64(v), scale


def kv_head_of(heads: int, heads_kv: int) -> np.ndarray:
    """KV head read by each query head under MQA/GQA: query head h uses kv head h // (heads // heads_kv)."""
    return np.arange(heads) // (heads // heads_kv)


def heads_major(q: np.ndarray, k: np.ndarray, v: np.ndarray):
    """(Q, K, V): float64, heads-major (batch, heads, seqlen, d), K and V expanded to one per query head.

    Expanding K/V mirrors the kernels: each (batch, query head) program reads its kv head's blocks itself,
    so GQA saves memory but not counted K/V reads. Takes validated inputs (see ``validate``).
    """
    kv = kv_head_of(q.shape[2], k.shape[2])
    return (to_float64(q).transpose(0, 2, 1, 3), to_float64(k)[:, :, kv].transpose(0, 2, 1, 3),
            to_float64(v)[:, :, kv].transpose(0, 2, 1, 3))


def prepare(q, k, v, *, causal, softmax_scale, block_q=None, block_k=None, check_size=None):
    """(Q, K, V, scale): ``validate``, then ``heads_major``. The one entry of the naive, fa1 and fa2 models."""
    q, k, v, scale = validate(q, k, v, causal=causal, softmax_scale=softmax_scale, block_q=block_q,
                              block_k=block_k, check_size=check_size)
    return (*heads_major(q, k, v), scale)


def to_flash_layout(O: np.ndarray) -> np.ndarray:
    """(batch, heads, seqlen, d) -> flash-attn's (batch, seqlen, heads, d)."""
    return np.ascontiguousarray(O.transpose(0, 2, 1, 3))


def validate_backward(dout, q, k, v, out, lse, *, causal, softmax_scale, block_q=None, block_k=None,
                      check_size=None):
    """Every backward model's argument check, before any arithmetic: (dout, q, k, v, out, lse widened to
    float64, softmax scale).

    q, k, v and the scalars go through the forward's ``validate`` (so the messages are attention()'s); then the
    forward's results handed back: dout and out must have q's shape, lse flash-attn's (batch, heads, seqlen_q).
    """
    q, k, v, scale = validate(q, k, v, causal=causal, softmax_scale=softmax_scale, block_q=block_q,
                              block_k=block_k, check_size=check_size)
    dout, out, lse = (np.asarray(x) for x in (dout, out, lse))
    for name, a in (("dout", dout), ("out", out), ("lse", lse)):
        if not is_float_dtype(a.dtype):
            raise TypeError(f"{name} must have a floating-point dtype (float16, bfloat16, float32, float64, "
                            f"float8_*), got {a.dtype}")
    for name, a in (("dout", dout), ("out", out)):
        if a.shape != q.shape:
            raise ValueError(f"{name} must have q's shape (batch, seqlen_q, heads, head_dim) = {q.shape}, "
                             f"got {a.shape}")
    want = (q.shape[0], q.shape[2], q.shape[1])
    if lse.shape != want:
        raise ValueError(f"lse must have shape (batch, heads, seqlen_q) = {want}, got {lse.shape}")
    return to_float64(dout), q, k, v, to_float64(out), to_float64(lse), scale


def prepare_backward(dout, q, k, v, out, lse, *, causal, softmax_scale, block_q=None, block_k=None,
                     check_size=None):
    """(dO, Q, K, V, O, LSE, scale, heads_kv): ``validate_backward``, then heads-major like ``prepare`` (K, V
    expanded to one per query head: every (batch, query head) program reads its kv head's blocks itself and
    writes its own dK, dV, which ``sum_over_groups`` then reduces). The one entry of the backward models."""
    dO, q, k, v, O, lse, scale = validate_backward(dout, q, k, v, out, lse, causal=causal,
                                                   softmax_scale=softmax_scale, block_q=block_q,
                                                   block_k=block_k, check_size=check_size)
    Q, K, V = heads_major(q, k, v)
    return dO.transpose(0, 2, 1, 3), Q, K, V, O.transpose(0, 2, 1, 3), lse, scale, k.shape[2]


def sum_over_groups(dX: np.ndarray, heads_kv: int) -> np.ndarray:
    """Per-query-head dK or dV (batch, heads, seqlen_k, d) -> (batch, seqlen_k, heads_kv, d), flash layout.

    Query heads g G .. g G + G - 1 share kv head g (``kv_head_of``), so its gradient is the sum of theirs. They
    are added one at a time in head order, a fixed order, so the result does not depend on how NumPy would
    pair up a reduction. (flash-attn likewise writes an expanded dk, dv per query head and sums the groups
    afterwards; that reduction is outside the kernels, and not counted as HBM traffic here.)
    """
    batch, heads, n, d = dX.shape
    grouped = dX.reshape(batch, heads_kv, heads // heads_kv, n, d)
    acc = grouped[:, :, 0].copy()
    for g in range(1, grouped.shape[2]):
        acc += grouped[:, :, g]
    return to_flash_layout(acc)


# ----------------------------------------------------------------------------------------------- masks, blocks

def causal_visible(rows, cols, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """Bottom-right causal mask: query i sees key j iff j <= i + seqlen_k - seqlen_q (flash-attn >= 2.1)."""
    return np.asarray(cols)[None, :] <= np.asarray(rows)[:, None] + (seqlen_k - seqlen_q)


def block_visited(row_last: int, col_first: int, seqlen_q: int, seqlen_k: int) -> bool:
    """False when a (Q block, K block) pair lies wholly above the causal diagonal: the kernels skip it."""
    return col_first <= row_last + (seqlen_k - seqlen_q)


def block_scores(Q_i, K_j, scale, rows: slice, cols: slice, seqlen_q: int, seqlen_k: int, causal: bool):
    """S_ij = Q_i K_j^T * scale of Q rows ``rows`` and keys ``cols``, -inf where the causal mask hides a key.

    The backward models recompute S with it (naive as well, over the whole matrix); a masked -inf gives
    P = exp(-inf - LSE) = 0 there, so no gradient flows through a hidden key.
    """
    S = Q_i @ K_j.swapaxes(-1, -2) * scale
    if causal:
        S = np.where(causal_visible(np.arange(seqlen_q)[rows], np.arange(seqlen_k)[cols], seqlen_q, seqlen_k),
                     S, -np.inf)
    return S


def paper_blocks(sram: int, head_dim: int) -> tuple[int, int]:
    """The FlashAttention paper's block sizes for on-chip memory of ``sram`` elements: (B_r, B_c).

    B_c = ceil(M / 4d) so that K_j, V_j, Q_i, O_i (4 tiles of B x d) fit in M; B_r = min(B_c, d) caps the
    B_r x B_c score tile at M/4 as well.
    """
    if sram < 1 or head_dim < 1:
        raise ValueError(f"sram and head_dim must be >= 1, got {sram}, {head_dim}")
    b_c = math.ceil(sram / (4 * head_dim))
    return min(b_c, head_dim), b_c


def resolve_blocks(head_dim: int, block_q=None, block_k=None, sram=None) -> tuple[int, int]:
    """(B_r, B_c): the ones given, else the paper's for ``sram`` (default ``DEFAULT_SRAM``) elements."""
    b_r, b_c = paper_blocks(DEFAULT_SRAM if sram is None else sram, head_dim)
    block_q, block_k = check_block("block_q", block_q), check_block("block_k", block_k)
    return (b_r if block_q is None else block_q), (b_c if block_k is None else block_k)


def block_slices(n: int, b: int) -> list[slice]:
    """The T = ceil(n / b) blocks of a length-n axis; the last one is short when b does not divide n."""
    return [slice(s, min(s + b, n)) for s in range(0, n, b)]


# ----------------------------------------------------------------------------------------------- online softmax

def exp_shift(m: np.ndarray) -> np.ndarray:
    """The max subtracted before exp: m, or 0 where m = -inf (a row that has seen no visible key yet).

    Subtracting -inf would give exp(-inf - -inf) = NaN; with 0 every exp of a masked score is exp(-inf) = 0
    and the row's sums stay 0. The kernels make the same substitution. A NaN m is left alone (it is not
    -inf), so a NaN score poisons its row's sum instead of being dropped.
    """
    return np.where(m == -np.inf, np.zeros((), m.dtype), m)


# Under the exponentials below, +Inf - +Inf = NaN is the intended result (a +Inf score poisons its row, as in
# the kernels and torch SDPA), not something for NumPy to warn about.

def row_exp(S: np.ndarray, m: np.ndarray) -> np.ndarray:
    """exp(S - m) along each row of S, m one max per row (``exp_shift``: -inf counts as 0)."""
    with np.errstate(invalid="ignore"):
        return np.exp(S - exp_shift(m)[..., None])


def rescale(m_old: np.ndarray, m_new: np.ndarray) -> np.ndarray:
    """e^(m_old - m_new), the factor that moves sums taken under max m_old to max m_new (0 if m_old = -inf)."""
    with np.errstate(invalid="ignore"):
        return np.exp(m_old - exp_shift(m_new))


def online_softmax_step(m, l, acc, S, V):
    """One K/V block of the online softmax with deferred normalization (FA2's rule; FA1 normalizes instead).

    m, l: (..., rows) running max and sum; acc: (..., rows, d) unnormalized output; S: (..., rows, cols)
    scores of this block (-inf where masked); V: (..., cols, d). Returns the new (m, l, acc): after the last
    block, acc / l is the softmax-weighted sum over every block, exactly. np.maximum and ndarray.max keep
    NaN (unlike fmax), so once a row meets a NaN score its m, l and acc stay NaN for the rest of the loop.
    """
    m_new = np.maximum(m, S.max(axis=-1))
    P = row_exp(S, m_new)
    alpha = rescale(m, m_new)
    return m_new, alpha * l + P.sum(axis=-1), alpha[..., None] * acc + P @ V


# The bad-value rule, the kernels' epilogue's too: l == 0 *exactly* means the row saw no visible key (every
# weight was exp(-inf) = 0); it gives O = 0 and LSE = -inf. A NaN or +Inf score (from a NaN or Inf in q or k)
# makes l NaN, which is not 0, so it flows through the division and the log: that row's O and LSE are NaN, as
# torch SDPA gives. Testing ``l > 0`` instead would be false for NaN too and quietly turn a poisoned row into
# an empty one. (A row whose visible scores are all -inf, which only an infinite input can cause, has l = 0 and
# reads as empty, as it does in the kernels.)

def normalize(acc: np.ndarray, l: np.ndarray) -> np.ndarray:
    """acc / l; a row with l = 0 is divided by 1 instead, so it keeps its acc, an exact 0 for finite V.

    Not forced to 0: a NaN in V that met a zero weight is 0 * NaN = NaN in acc, as in the kernels' P V.
    """
    return acc / np.where(l == 0, np.ones((), l.dtype), l)[..., None]


def logsumexp_from(m: np.ndarray, l: np.ndarray) -> np.ndarray:
    """LSE = m + log l; -inf where l = 0 (no visible key), without the log(0) warning; NaN where l is NaN."""
    empty = l == 0
    return np.where(empty, -np.inf, m + np.log(np.where(empty, np.ones((), l.dtype), l)))


def online_softmax(scores, values, splits, dtype=np.float64):
    """softmax(scores) @ values, visiting the scores block by block with the models' update rule.

    The teaching piece: however the row is split, the result equals the one-shot softmax up to rounding in
    ``dtype`` (try float16). ``splits`` is a block size (int) or the block lengths (summing to len(scores)).
    ``values`` is (n,) or (n, d); the result is a scalar or (d,) array of ``dtype``.
    """
    s = np.asarray(scores, dtype=np.float64).astype(dtype)
    v = np.asarray(values, dtype=np.float64).astype(dtype)
    n = s.shape[0]
    lengths = [min(splits, n - a) for a in range(0, n, splits)] if np.isscalar(splits) else list(splits)
    if sum(lengths) != n or min(lengths) < 1:
        raise ValueError(f"splits {splits!r} must cover the {n} scores with blocks of length >= 1")
    v2 = v.reshape(n, -1)
    m = np.full(1, -np.inf, dtype)
    l = np.zeros(1, dtype)
    acc = np.zeros((1, v2.shape[1]), dtype)
    start = 0
    for b in lengths:
        m, l, acc = online_softmax_step(m, l, acc, s[None, start:start + b], v2[start:start + b])
        start += b
    out = (acc / l[:, None])[0]
    return out[0] if v.ndim == 1 else out


# ----------------------------------------------------------------------------------------------- backward

# The backward's rule follows plain float arithmetic: a row that saw no key has LSE = -inf, so its P is
# exp(-inf - 0) = 0 (``row_exp``'s shift) and its dS, dQ are exact zeros; a NaN that reached a row's O or LSE
# in the forward reaches that row's P, dS, dQ and, through dS^T and P^T, the dK, dV of the keys in its visited
# blocks. 0 * Inf = NaN is an intended result there, not something for NumPy to warn about.

def rowsum_product(dO: np.ndarray, O: np.ndarray) -> np.ndarray:
    """D = rowsum(dO o O), one value per query row: equal to rowsum(P o dP) (as dP P^T = dO V^T P^T = dO O^T
    row by row), so the softmax's backward needs the d-wide O instead of the N_k-wide P."""
    with np.errstate(invalid="ignore"):
        return (dO * O).sum(axis=-1)


def softmax_backward(P: np.ndarray, dP: np.ndarray, D: np.ndarray) -> np.ndarray:
    """dS = P o (dP - D): the gradient of the scores from that of P, row by row (D from ``rowsum_product``)."""
    with np.errstate(invalid="ignore"):
        return P * (dP - D[..., None])


def matmul_flops(programs: int, rows: int, cols: int, d: int, products: int = 1) -> int:
    """FLOPs of ``products`` matrix products of one rows x cols block with d-wide operands (2 rows cols d each:
    S = Q K^T, P V, P^T dO, dO V^T, dS K and dS^T Q all are), over ``programs`` (batch, head) programs."""
    return 2 * programs * rows * cols * d * products
