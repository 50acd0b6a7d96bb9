"""Masks and logit transforms as small policies: the NumPy side of ``cuda_src/common/mask.cuh``.

A call's mask is one ``Mask``, composed of restrictions on the keys a query row sees,
    KeyLength(seqlen_k)         keys 0 .. seqlen_k - 1 exist (a packed sequence's length; a KV cache's fill)
    Causal(diag)                query i sees keys j <= i + diag, diag = seqlen_k - seqlen_q (bottom-right)
    Window(left, right, diag)   i + diag - left <= j <= i + diag + right, -1 meaning unbounded (flash-attn's)
and of transforms of the scores S = scale q k^T,
    Softcap(cap)                S -> cap tanh(S / cap), before the mask and the bias (Gemma 2)
    Alibi(slopes, diag)         S -> S - slope |i + diag - j|, slopes per head or per (batch, head)
    Sinks(values)               one logit per head that joins every row's denominator without a value (gpt-oss)
(docs/masks.md has each convention with its source). Each restriction gives row i an interval of keys; so does
their intersection, [first(i), last(i)], both ends non-decreasing in i by steps of at most one, so the rows of a
Q block together see one contiguous range of keys and every K/V block outside it is skipped (tile skipping: a
window of w keys over N costs O(N w)).

What a main loop asks of a ``Mask``, as it asks mask.cuh's policy:
    blocks(rows, block_k)       the K/V blocks the Q rows ``rows`` visit, ascending   (mask.cuh blocks<BM, BN>)
    needs_mask(rows, cols)      whether some row of the pair misses some key of it    (first_masked_block)
    first_key / last_key        the first / last key any of the rows r0..r1 sees      (last_key)
    apply(S, rows, cols, masked) the transformed scores, -inf where hidden if masked (apply<MASKED>)
and the backward asks ``chain`` (the softcap's derivative), the sinks ``fold`` their logit into a row's running
(m, l) and give their gradient (``sink_grad``). ``rows`` and ``cols`` are slices of this sequence's positions.

Varlen bounds (``VarlenBounds``): the cumulative lengths of a packed batch, each sequence its own ``Mask``.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from .common import block_slices, exp_shift, logsumexp_from, rescale

UNBOUNDED = -1  # a window side of -1: no bound on that side (flash-attn's convention)


# ----------------------------------------------------------------------------------------------- the arguments

def check_window(window) -> tuple[int, int]:
    """(left, right) as two ints >= -1 (a tuple or list of two ints; -1: unbounded on that side)."""
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a (left, right) pair of ints >= -1 (-1: unbounded), got {window!r}")
    for side in window:
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer)):
            raise TypeError(f"window must be a (left, right) pair of ints >= -1 (-1: unbounded), got {window!r}")
    left, right = int(window[0]), int(window[1])
    if left < UNBOUNDED or right < UNBOUNDED:
        raise ValueError(f"window sides must be >= -1 (-1: unbounded), got {window!r}")
    return left, right


def check_softcap(softcap) -> float:
    """The softcap as a float: 0 (none) or a finite positive cap."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number >= 0 (0: no softcap), got {type(softcap).__name__}")
    cap = float(softcap)
    if not math.isfinite(cap) or cap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0: no softcap), got {softcap!r}")
    return cap


def _float_array(name: str, a, what: str) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array {what}, got {type(a).__name__}")
    from .common import is_float_dtype
    if not is_float_dtype(a.dtype):
        raise TypeError(f"{name} must have a floating-point dtype, got {a.dtype}")
    return a.astype(np.float64)


def check_sinks(sinks, heads: int) -> np.ndarray | None:
    """None, or the sinks as float64 (heads,): one logit per query head."""
    if sinks is None:
        return None
    s = _float_array("sinks", sinks, f"of shape (heads,) = ({heads},)")
    if s.shape != (heads,):
        raise ValueError(f"sinks must have shape (heads,) = ({heads},), one logit per query head, got {s.shape}")
    return s


def check_alibi(alibi_slopes, heads: int, batch: int) -> np.ndarray | None:
    """None, or the ALiBi slopes as float64 (batch or 1, heads)."""
    if alibi_slopes is None:
        return None
    a = _float_array("alibi_slopes", alibi_slopes, f"of shape (heads,) or (batch, heads) = ({heads},) or "
                     f"({batch}, {heads})")
    if a.shape == (heads,):
        return a[None, :]
    if a.shape != (batch, heads):
        raise ValueError(f"alibi_slopes must have shape (heads,) = ({heads},) or (batch, heads) = ({batch}, "
                         f"{heads}), got {a.shape}")
    return a


def window_as_causal(seqlen_q: int, seqlen_k: int, causal: bool, window) -> bool | None:
    """The ``causal`` flag of a call without a window that hides exactly the keys this one hides, or None where the
    window hides keys no such call does. A left side hides nothing when left >= seqlen_k - 1 (the last row's window
    starts at key 0 or before); a right side hides nothing when right >= seqlen_q - 1 (the first row's window ends
    at the last key or after), or under ``causal`` (the diagonal ends every row's keys first); right = 0 is causal
    (flash-attn's own reading of window (-1, 0))."""
    left, right = check_window(window)
    if left != UNBOUNDED and left < seqlen_k - 1:
        return None
    if causal or right == UNBOUNDED or right >= seqlen_q - 1:
        return bool(causal)
    return True if right == 0 else None


# ----------------------------------------------------------------------------------------------- restrictions

@dataclasses.dataclass(frozen=True)
class KeyLength:
    """Keys 0 .. seqlen_k - 1 exist: a packed sequence's keys, or the filled part of a KV cache (its
    cache_seqlens) when the K tensor holds more. The one restriction every ``Mask`` has."""
    seqlen_k: int

    def first(self, rows):
        return np.zeros_like(rows)

    def last(self, rows):
        return np.full_like(rows, self.seqlen_k - 1)


@dataclasses.dataclass(frozen=True)
class Causal:
    """Bottom-right causal: query i sees keys j <= i + diag, diag = seqlen_k - seqlen_q (flash-attn >= 2.1)."""
    diag: int

    def first(self, rows):
        return np.zeros_like(rows)

    def last(self, rows):
        return rows + self.diag


@dataclasses.dataclass(frozen=True)
class Window:
    """Sliding window: query i sees keys i + diag - left <= j <= i + diag + right; a side of -1 is unbounded."""
    left: int
    right: int
    diag: int

    def first(self, rows):
        return np.zeros_like(rows) if self.left == UNBOUNDED else rows + self.diag - self.left

    def last(self, rows):
        return np.full_like(rows, np.iinfo(np.int64).max) if self.right == UNBOUNDED else \
            rows + self.diag + self.right


# ----------------------------------------------------------------------------------------------- transforms

@dataclasses.dataclass(frozen=True)
class Softcap:
    """S -> cap tanh(S / cap) (Gemma 2), applied to the scaled scores before the mask and the bias."""
    cap: float

    def apply(self, S):
        return self.cap * np.tanh(S / self.cap)

    def chain(self, dT, S):
        """dS from dT, the gradient of the capped scores: d(cap tanh(S / cap))/dS = 1 - tanh(S / cap)^2."""
        return dT * (1.0 - np.tanh(S / self.cap) ** 2)


@dataclasses.dataclass(frozen=True)
class Alibi:
    """A bias -slope |i + diag - j| on the score of query i and key j (flash-attn's ALiBi, in the units of the
    scaled scores). ``slopes`` broadcasts against the scores' leading dimensions: (batch or 1, heads, 1, 1) for
    (batch, heads, rows, cols) blocks, (1, 1) for one (batch, head) pair (``Mask.pick``)."""
    slopes: np.ndarray
    diag: int

    def bias(self, rows: slice, cols: slice):
        i = np.arange(rows.start, rows.stop)[:, None]
        j = np.arange(cols.start, cols.stop)[None, :]
        return -self.slopes * np.abs(i + self.diag - j)


@dataclasses.dataclass(frozen=True)
class Sinks:
    """One logit per query head in every row's softmax denominator, with no value (gpt-oss): as if each row had
    one more key, of score ``values[h]`` and value 0. ``values`` broadcasts against a row statistic's leading
    dimensions: (heads, 1) for (batch, heads, rows), a scalar for one (batch, head) pair."""
    values: np.ndarray

    def fold(self, m, l):
        """(m', l', alpha): the running max and sum of a row after the sink joins them (the online softmax's step
        with one more score and a zero value); the output accumulator is multiplied by alpha = e^(m - m').
        Folding into the empty state (m = -inf, l = 0) gives (sink, 1): a row that sees no key has O = 0 and
        LSE = its sink."""
        m_new = np.maximum(m, self.values)
        alpha = rescale(m, m_new)
        with np.errstate(invalid="ignore"):
            return m_new, alpha * l + np.exp(self.values - exp_shift(m_new)), alpha

    def grad(self, lse, D):
        """dL/dsink per head: -sum over rows of P_sink D, P_sink = e^(sink - LSE), D = rowsum(dO o O) (the
        softmax's Jacobian with a zero value: dL/dsink = -P_sink rowsum(P o dP) = -P_sink rowsum(dO o O)).
        ``lse`` and ``D`` are (batch, heads, rows); the result (heads,) sums over batch and rows."""
        with np.errstate(invalid="ignore"):
            p_sink = np.exp(self.values - exp_shift(lse))
            return -(p_sink * D).sum(axis=(0, 2))


# ----------------------------------------------------------------------------------------------- the composition

@dataclasses.dataclass(frozen=True)
class Mask:
    """One sequence's mask and transforms: what a main loop asks per block (see the module's docstring).

    ``seqlen_q`` query rows, ``seqlen_k`` keys (the K tensor may hold more: the blocks past seqlen_k are never
    visited). Build it with ``Mask.of``; ``restrictions`` always holds a ``KeyLength``.
    """
    seqlen_q: int
    seqlen_k: int
    restrictions: tuple
    softcap: Softcap | None = None
    alibi: Alibi | None = None
    sinks: Sinks | None = None

    @classmethod
    def of(cls, seqlen_q: int, seqlen_k: int, *, causal: bool = False, window=(-1, -1), softcap=0.0,
           alibi_slopes=None, sinks=None, heads: int | None = None, batch: int = 1) -> "Mask":
        """The mask of a call: ``window``, ``softcap`` checked here (``check_window``, ``check_softcap``);
        ``alibi_slopes`` (heads,) or (batch, heads) and ``sinks`` (heads,) as NumPy arrays, checked against
        ``heads`` (needed when either is given) and ``batch``."""
        left, right = check_window(window)
        cap = check_softcap(softcap)
        diag = seqlen_k - seqlen_q
        restrictions = [KeyLength(seqlen_k)]
        if causal:
            restrictions.append(Causal(diag))
        if (left, right) != (UNBOUNDED, UNBOUNDED):
            restrictions.append(Window(left, right, diag))
        if (alibi_slopes is not None or sinks is not None) and heads is None:
            raise TypeError("Mask.of needs heads to check alibi_slopes and sinks")
        slopes = check_alibi(alibi_slopes, heads, batch) if alibi_slopes is not None else None
        values = check_sinks(sinks, heads) if sinks is not None else None
        return cls(seqlen_q, seqlen_k, tuple(restrictions),
                   softcap=Softcap(cap) if cap > 0 else None,
                   alibi=None if slopes is None else Alibi(slopes[:, :, None, None], diag),
                   sinks=None if values is None else Sinks(values[:, None]))

    @classmethod
    def of_arrays(cls, Q, K, *, causal: bool = False, window=(-1, -1), softcap=0.0, alibi_slopes=None,
                  sinks=None) -> "Mask":
        """``Mask.of`` for a model's heads-major Q (batch, heads, seqlen_q, d) and K (batch, heads, seqlen_k, d)."""
        return cls.of(Q.shape[2], K.shape[2], causal=causal, window=window, softcap=softcap,
                      alibi_slopes=alibi_slopes, sinks=sinks, heads=Q.shape[1], batch=Q.shape[0])

    def pick(self, b: int, h: int) -> "Mask":
        """This mask for the one (batch b, query head h) pair, its transforms acting on 2-D (rows, cols) scores and
        (rows,) statistics (the dense reference's layout)."""
        alibi = None if self.alibi is None else \
            Alibi(self.alibi.slopes[b if self.alibi.slopes.shape[0] > 1 else 0, h], self.alibi.diag)
        sinks = None if self.sinks is None else Sinks(self.sinks.values[h, 0])
        return dataclasses.replace(self, alibi=alibi, sinks=sinks)

    # -------------------------------------------------------------------- which keys a row sees

    def key_range(self, rows: slice):
        """(first, last) int64 arrays: the keys row i of ``rows`` sees are first[i] .. last[i] (none where
        last < first)."""
        i = np.arange(rows.start, rows.stop, dtype=np.int64)
        first = np.max([r.first(i) for r in self.restrictions], axis=0)
        last = np.min([r.last(i) for r in self.restrictions], axis=0)
        return np.maximum(first, 0), last

    def visible(self, rows: slice, cols: slice):
        """(rows, cols) bool: which keys of ``cols`` each row of ``rows`` sees (the elementwise mask)."""
        first, last = (a[:, None] for a in self.key_range(rows))
        j = np.arange(cols.start, cols.stop)[None, :]
        return (j >= first) & (j <= last)

    @staticmethod
    def _span(first, last) -> tuple[int, int]:
        """(the first, the last) key that any row of a ``key_range`` sees; (-1, -1) where none sees one."""
        seen = first <= last
        return (int(first[seen].min()), int(last[seen].max())) if seen.any() else (-1, -1)

    def first_key(self, r0: int, r1: int) -> int:
        """The first key that any of the rows r0..r1 sees, or -1 where none sees a key."""
        return self._span(*self.key_range(slice(r0, r1 + 1)))[0]

    def last_key(self, r0: int, r1: int) -> int:
        """The last key that any of the rows r0..r1 sees, or -1 where none sees a key (mask.cuh's last_key)."""
        return self._span(*self.key_range(slice(r0, r1 + 1)))[1]

    # -------------------------------------------------------------------- blocks

    def blocks(self, rows: slice, block_k: int) -> list[slice]:
        """The K/V blocks (of ``block_k`` keys, cut at seqlen_k) that the Q rows ``rows`` visit, ascending: those
        that hold a key some row sees. The rows see one contiguous range of keys (module docstring), so these are
        consecutive blocks, and every other block is skipped."""
        return [cols for cols, _ in self.blocks_and_masks(rows, block_k)]

    def blocks_and_masks(self, rows: slice, block_k: int) -> list[tuple[slice, bool]]:
        """``blocks``, each with ``needs_mask``: (cols, needs the elementwise mask), ascending."""
        first, last = self.key_range(rows)
        cuts = [slice(j * block_k, min((j + 1) * block_k, self.seqlen_k))
                for j in self._block_indices(first, last, block_k)]
        return [(cols, self._hides(first, last, cols)) for cols in cuts]

    def _block_indices(self, first, last, block_k: int) -> range:
        """The indices of the K/V blocks that hold a key some row of a ``key_range`` sees: consecutive."""
        lo, hi = self._span(first, last)
        return range(0) if hi < 0 else range(lo // block_k, hi // block_k + 1)

    @staticmethod
    def _hides(first, last, cols: slice) -> bool:
        """Whether some row of a ``key_range`` (first, last) misses some key of ``cols``."""
        return bool(((first > cols.start) | (last < cols.stop - 1)).any())

    def visits(self, rows: slice, cols: slice) -> bool:
        """Whether some row of ``rows`` sees some key of ``cols`` (the pair is computed, not skipped)."""
        first, last = self.key_range(rows)
        return bool((np.maximum(first, cols.start) <= np.minimum(last, cols.stop - 1)).any())

    def q_blocks(self, cols: slice, block_q: int) -> list[slice]:
        """The Q blocks (of ``block_q`` rows) that visit K block ``cols``, ascending: what a backward program that
        owns a K/V block loops over."""
        return [rows for rows in block_slices(self.seqlen_q, block_q) if self.visits(rows, cols)]

    def key_blocks(self, block_k: int) -> list[slice]:
        """Every K/V block of this sequence's keys (the backward's K/V programs, one per block)."""
        return block_slices(self.seqlen_k, block_k)

    def needs_mask(self, rows: slice, cols: slice) -> bool:
        """Whether some row of ``rows`` misses some key of ``cols``: the block needs the elementwise mask. The
        blocks that do not are computed without one (the kernels' unmasked steps); the models' agreement with
        the dense reference is what shows they need none."""
        return self._hides(*self.key_range(rows), cols)

    def pairs(self, block_q: int, block_k: int) -> int:
        """The (Q block, K block) pairs a blocked model visits over this sequence (counted from each Q block's range
        of K/V blocks, without the blocks' mask tests: a model's progress bar asks it before the run)."""
        return sum(len(self._block_indices(*self.key_range(rows), block_k))
                   for rows in block_slices(self.seqlen_q, block_q))

    # -------------------------------------------------------------------- the scores

    @property
    def transforms_scores(self) -> bool:
        """Whether ``apply`` changes the scores of an unmasked block (a softcap or a bias)."""
        return self.softcap is not None or self.alibi is not None

    def apply(self, S, rows: slice, cols: slice, masked: bool):
        """The scores of a block as the softmax takes them: ``S`` = scale Q K^T of the rows ``rows`` and keys
        ``cols`` (trailing dimensions (rows, cols)), capped, biased, and -inf where a key is hidden when
        ``masked`` (the order of flash-attn's reference: softcap, mask, bias; a bias on -inf changes nothing)."""
        if self.softcap is not None:
            S = self.softcap.apply(S)
        if self.alibi is not None:
            S = S + self.alibi.bias(rows, cols)
        if masked:
            S = np.where(self.visible(rows, cols), S, -np.inf)
        return S

    def chain(self, dT, S):
        """The gradient of the raw scores S from that of ``apply``'s output: the softcap's derivative (the bias
        adds a constant, the mask gives P = 0 and so dT = 0 where it hides a key)."""
        return dT if self.softcap is None else self.softcap.chain(dT, S)

    def fold_sinks(self, m, l):
        """(m, l, alpha) with the sinks folded in (``Sinks.fold``); unchanged, alpha = 1, without sinks."""
        if self.sinks is None:
            return m, l, np.ones((), dtype=np.float64)
        return self.sinks.fold(m, l)

    def empty_lse(self, shape):
        """The LSE of rows that see no key: -inf, or the sink's logit."""
        m, l, _ = self.fold_sinks(np.full(shape, -np.inf), np.zeros(shape))
        return logsumexp_from(m, l)


# ----------------------------------------------------------------------------------------------- tile counts

@dataclasses.dataclass(frozen=True)
class TileCount:
    """Tiles (Q block, K/V block pairs) a forward computes under a mask, against the dense count."""
    visited: int     # computed
    masked: int      # of those, the ones that need the elementwise mask
    dense: int       # all pairs of the padded (batch, max_seqlen_q, max_seqlen_k) problem

    @property
    def fraction(self) -> float:
        return self.visited / self.dense if self.dense else 0.0


def tile_count(seqlens_q, seqlens_k, block_q: int, block_k: int, *, causal=False, window=(-1, -1)) -> TileCount:
    """The tiles a forward with ``block_q`` x ``block_k`` tiles runs over sequences of lengths ``seqlens_q``,
    ``seqlens_k`` (ints, or sequences of ints for a packed batch), against the dense max_seqlen_q x max_seqlen_k
    grid of every sequence (what a padded batch costs)."""
    lq, lk = np.atleast_1d(seqlens_q).astype(int), np.atleast_1d(seqlens_k).astype(int)
    if lq.shape != lk.shape:
        raise ValueError(f"seqlens_q and seqlens_k must have one length per sequence, got {lq.shape} and {lk.shape}")
    visited = masked = 0
    for n_q, n_k in zip(lq, lk):
        if n_q == 0 or n_k == 0:
            continue
        mask = Mask.of(int(n_q), int(n_k), causal=causal, window=window)
        for rows in block_slices(int(n_q), block_q):
            flags = [needs for _, needs in mask.blocks_and_masks(rows, block_k)]
            visited += len(flags)
            masked += sum(flags)
    dense = len(lq) * -(-int(lq.max(initial=0)) // block_q) * -(-int(lk.max(initial=0)) // block_k)
    return TileCount(visited, masked, dense)


# ----------------------------------------------------------------------------------------------- varlen bounds

def check_cu_seqlens(name: str, cu, total: int) -> np.ndarray:
    """A NumPy int32 (batch + 1,) array of cumulative lengths, 0 first, non-decreasing, at most ``total``, as
    int64; a TypeError or ValueError naming ``name`` otherwise."""
    if not isinstance(cu, np.ndarray):
        raise TypeError(f"{name} must be an int32 array of batch + 1 cumulative lengths, got {type(cu).__name__}")
    if cu.dtype != np.int32:
        raise TypeError(f"{name} must be int32 (flash-attn's cumulative lengths), got {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must have shape (batch + 1,) with batch >= 1, got {cu.shape}")
    c = cu.astype(np.int64)
    if c[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {c[0]}")
    steps = np.diff(c)
    if (steps < 0).any():
        b = int(np.argmax(steps < 0))
        raise ValueError(f"{name} must be non-decreasing (sequence lengths >= 0), got {name}[{b}] = {c[b]} > "
                         f"{name}[{b + 1}] = {c[b + 1]}")
    if c[-1] > total:
        raise ValueError(f"{name} ends at {c[-1]}, beyond the {total} rows of its tensor")
    return c


@dataclasses.dataclass(frozen=True)
class VarlenBounds:
    """A packed batch: sequence b's queries are rows cu_q[b] .. cu_q[b+1] - 1 of q, its keys rows cu_k[b] ..
    cu_k[b+1] - 1 of k and v (flash-attn's varlen layout). Each sequence is its own problem with its own
    bottom-right mask (``Mask.of(len_q, len_k, ...)``), as each CTA of a varlen kernel reads its sequence's
    bounds: a packed batch costs what its sequences cost, not max_seqlen^2."""
    cu_q: np.ndarray
    cu_k: np.ndarray

    @classmethod
    def of(cls, cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int) -> "VarlenBounds":
        cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q)
        cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k)
        if cu_q.shape != cu_k.shape:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same batch + 1 entries, got "
                             f"{cu_q.shape[0]} and {cu_k.shape[0]}")
        return cls(cu_q, cu_k)

    @property
    def batch(self) -> int:
        return self.cu_q.shape[0] - 1

    @property
    def seqlens_q(self) -> np.ndarray:
        return np.diff(self.cu_q)

    @property
    def seqlens_k(self) -> np.ndarray:
        return np.diff(self.cu_k)

    def sequences(self):
        """(b, query rows, key rows) of every sequence, as slices of the packed tensors."""
        return [(b, slice(int(self.cu_q[b]), int(self.cu_q[b + 1])), slice(int(self.cu_k[b]), int(self.cu_k[b + 1])))
                for b in range(self.batch)]

    def check_max(self, max_seqlen_q, max_seqlen_k) -> None:
        """max_seqlen_q, max_seqlen_k: ints at least the longest sequence's lengths (the kernels size their grid
        by them; a smaller one would leave rows uncomputed)."""
        for name, value, lengths in (("max_seqlen_q", max_seqlen_q, self.seqlens_q),
                                     ("max_seqlen_k", max_seqlen_k, self.seqlens_k)):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < lengths.max():
                raise ValueError(f"{name} must be at least the longest sequence's length {int(lengths.max())}, "
                                 f"got {value}")
