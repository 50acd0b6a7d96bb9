"""Split-KV decoding (FlashDecoding) over a KV cache, in the loop order of the kernel it specifies.

A decoding step has few query rows (seqlen_q from 1 to about 16) and a long cache. The prefill kernels give each
(batch, query head) one program that walks the whole cache: at batch 1 that is a handful of CTAs on a card of 132
SMs, and each reads its share of the cache at a fraction of the card's bandwidth. Here:

- GQA packing: one program per (batch, KV head) takes the ``group = heads // heads_kv`` query heads that share
  the KV head and all seqlen_q tokens as the rows of one tile (row r: token r // group, head r % group of the
  group), so each K/V byte is read from memory once, whatever the group size.
- Split-KV: the cache of each sequence is cut along its length into ``num_splits`` ranges of whole blocks of
  ``block_n`` keys; program (b, g, s) runs the online softmax over its range and writes a partial result: O_s
  normalized by its own row sums and LSE_s, both in fp32. An empty range writes O_s = 0, LSE_s = -inf.
- Merge: a second step combines the partials of each row with ``merge`` (the online-softmax rescale applied to
  whole partial results). With one split the program writes the output and LSE itself and there is no merge.

New tokens (k, v) are first appended to the cache in place (a separate small step: read k, v, write the cache),
then attended from the cache like the rest. The bytes each step moves are counted (``Traffic``) and given in
closed form by ``traffic_formula``: the K/V reads are the cache's tokens once, the merge adds 4 (d + 1) bytes per
(split, row) written and read again. Metadata (lengths, page-table entries, descale factors) is not counted: a
few bytes per program, and 4 bytes per page per KV head, which is 2 / (d * kv_bytes * page_size) of the K/V bytes
(0.8 % at page size 1, d 128, 16 bits; 0.05 % at page size 16).
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from ..arrays import check_scalars
from ..kvcache import CacheCall, append, check_call
from .budget import Progress
from . import masks
from .common import Ledger, exp_shift, logsumexp_from, normalize, online_softmax_step

LOOPS = """\
append:                    for b: write k[b], v[b] into the cache at cache_seqlens[b] .. + seqlen_new (in place)
for (b, g, s) in batch x heads_kv x num_splits:      (one CTA each)
  Q_t = q[b, :, g*G:(g+1)*G] as seqlen_q*G rows      (GQA packing: K/V of head g read once for all G heads)
  m = -inf, l = 0, O = 0 on chip
  for j in the blocks of split s (whole blocks of block_n keys, through the page table):
                           load K_j, V_j; S = Q_t K_j^T * scale * k_descale; softcap, ALiBi, mask (causal and window,
                           bottom-right per sequence: reference/masks.py's Mask, each row its token's and head's)
                           m_new = max(m, rowmax S); P = exp(S - m_new)
                           l = e^(m - m_new) l + rowsum P; O = e^(m - m_new) O + P V_j
  split 0 only: the sinks join m and l (one more logit per row, no value)
  write O_s = v_descale * O / l and LSE_s = m + log l in fp32   (an empty split: 0 and -inf)
merge (one program per row): LSE = log sum_s e^LSE_s;  O = sum_s e^(LSE_s - LSE) O_s   (num_splits = 1: no merge)"""

DEFAULT_BLOCK_N = 128      # keys per K/V block: the split granularity
H100_SMS = 132             # the SM count num_splits=0 plans for where no GPU is asked (an H100 SXM's)
MAX_SPLITS = 256           # the most splits a call may ask for (each adds 4 (d + 1) bytes per query row twice)
AUTO_MAX_SPLITS = 128      # the most the rule picks
FILL_ENOUGH = 0.8          # programs >= this fraction of the SMs: one wave is nearly full, no split
NEAR_BEST = 0.95           # the rule takes the fewest splits within this fraction of the best wave efficiency

# The tensors the model moves, and the precision of its partials.
TENSORS = ("q", "k_cache", "v_cache", "k_new", "v_new", "o_partial", "lse_partial", "out", "lse")
PARTIAL_BYTES = 4


# ------------------------------------------------------------------------------------------------ the split rule
def choose_num_splits(batch: int, heads_kv: int, seqlen_k: int, num_sms: int = H100_SMS,
                      block_n: int = DEFAULT_BLOCK_N) -> int:
    """The split count of ``num_splits=0``: a pure function of the grid and the card.

    P = batch * heads_kv programs (GQA packing) over n = ceil(seqlen_k / block_n) blocks. If P already fills
    FILL_ENOUGH of the SMs, or there is at most one block, no split. Otherwise, for each s in 1..min(128, SMs, n)
    the grid of P s CTAs runs in w = P s / SMs waves with efficiency w / ceil(w) (the fraction of the last wave's
    SMs busy); s is eligible when its splits are shorter than those of s - 1 (ceil(n / s) < ceil(n / (s - 1)):
    whole blocks make some counts add a CTA without shortening any split). The rule returns the smallest eligible
    s whose efficiency is within NEAR_BEST (95 %) of the best eligible one: fewer splits, fewer partials to merge.

    flash-attn's num_splits_heuristic is this rule with 85 %, over its programs (one per query head) and twice the
    SMs (two of its 128-thread CTAs per SM; a kernel that keeps k CTAs per SM passes num_sms * k here). With 85 %,
    batch 1, 8 KV heads and 128K tokens would take 14 splits (112 CTAs: 15 % of the SMs idle) where 95 % takes 16
    (128 CTAs). A decoding step is bound by its reads, and the 2 extra splits' partials add 0.01 % to them, so the
    idle SMs cost more than the splits.
    """
    programs = batch * heads_kv
    n_blocks = -(-seqlen_k // block_n)
    if n_blocks <= 1 or programs >= FILL_ENOUGH * num_sms:
        return 1
    efficiency = {s: wave_efficiency(programs * s, num_sms)
                  for s in range(1, min(AUTO_MAX_SPLITS, num_sms, n_blocks) + 1)
                  if s == 1 or -(-n_blocks // s) != -(-n_blocks // (s - 1))}
    best = max(efficiency.values())
    return min(s for s, e in efficiency.items() if e >= NEAR_BEST * best)


def wave_efficiency(ctas: int, num_sms: int) -> float:
    """The fraction of SM slots busy over the waves a grid of ``ctas`` takes (one CTA per SM per wave)."""
    waves = ctas / num_sms
    return waves / math.ceil(waves)


def check_num_splits(num_splits) -> int:
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, (numbers.Integral, np.integer)):
        raise TypeError(f"num_splits must be an int (0: chosen from the shape), got {type(num_splits).__name__}")
    if not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be 0 (chosen from the shape) or 1..{MAX_SPLITS}, got {num_splits}")
    return int(num_splits)


def split_ranges(seqlen_k: int, num_splits: int, block_n: int = DEFAULT_BLOCK_N,
                 first_key: int = 0) -> list[tuple[int, int]]:
    """The key range [start, stop) of each of ``num_splits`` splits of the keys [first_key, seqlen_k) a program's
    rows see: each split takes ceil(n / num_splits) whole blocks of ``block_n`` keys from first_key on (n =
    ceil((seqlen_k - first_key) / block_n)), the last one what is left; the splits past the end are empty (start ==
    stop). first_key > 0 where a window hides the cache's older keys from every row."""
    span = max(seqlen_k - first_key, 0)
    per_split = -(-(-(-span // block_n)) // num_splits) * block_n
    return [(first_key + min(s * per_split, span), first_key + min((s + 1) * per_split, span))
            for s in range(num_splits)]


# ------------------------------------------------------------------------------------------------ masks
@dataclasses.dataclass(frozen=True)
class MaskArgs:
    """A call's mask keywords, checked (reference/masks.py's conventions): what every sequence's ``Mask`` is built
    from."""
    causal: bool
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: np.ndarray | None = None   # float64 (1 or batch, heads)
    sinks: np.ndarray | None = None          # float64 (heads,)

    @classmethod
    def of(cls, call: CacheCall, causal: bool, window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None):
        slopes = None if alibi_slopes is None else masks.check_alibi(alibi_slopes, call.heads, call.batch)
        return cls(bool(causal), masks.check_window(window), masks.check_softcap(softcap), slopes,
                   masks.check_sinks(sinks, call.heads))

    def sequence(self, call: CacheCall, b: int) -> masks.Mask:
        """Sequence b's mask: its seqlen_q queries over its keys after the append, bottom-right."""
        slopes = None if self.alibi_slopes is None else self.alibi_slopes[b if len(self.alibi_slopes) > 1 else 0]
        return masks.Mask.of(call.seqlen_q, int(call.seqlens_k[b]), causal=self.causal, window=self.window,
                             softcap=self.softcap, alibi_slopes=slopes, sinks=self.sinks, heads=call.heads)

    def key_span(self, call: CacheCall, b: int) -> tuple[int, int]:
        """[first, stop) of the keys any query of sequence b sees: the splits cut this range (a window's older keys
        are never read); (0, 0) where no query sees a key."""
        mask = self.sequence(call, b)
        last = mask.last_key(0, call.seqlen_q - 1)
        return (0, 0) if last < 0 else (mask.first_key(0, call.seqlen_q - 1), last + 1)


def group_mask(mask: masks.Mask, g: int, group: int) -> masks.Mask:
    """A sequence's mask for the query heads of KV head g, its transforms acting on (group, seqlen_q, keys) scores
    and (group, seqlen_q) row statistics (a program's packed rows, head-major)."""
    heads = slice(g * group, (g + 1) * group)
    alibi = None if mask.alibi is None else masks.Alibi(mask.alibi.slopes[0, heads], mask.alibi.diag)
    sinks = None if mask.sinks is None else masks.Sinks(mask.sinks.values[heads])
    return dataclasses.replace(mask, alibi=alibi, sinks=sinks)


# ------------------------------------------------------------------------------------------------ the merge
def merge(outs: np.ndarray, lses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Attention states merged: outs (S, ..., d) and lses (S, ...) of S partial results over disjoint key sets
    -> (out (..., d), lse (...)) of attention over their union, in float64.

    With M = max_s LSE_s: w_s = e^(LSE_s - M), LSE = M + log sum_s w_s, O = sum_s w_s O_s / sum_s w_s; each O_s is
    normalized by its own row sum, so w_s O_s / sum w is the online softmax's rescale applied to a whole partial.
    A state with LSE = -inf (no key) contributes nothing, whatever its O holds; all empty: O = 0, LSE = -inf. A
    NaN LSE makes its row NaN. The states are added in index order (the kernel's order).
    """
    outs, lses = np.asarray(outs, np.float64), np.asarray(lses, np.float64)
    top = exp_shift(lses.max(axis=0))               # -inf (every state empty) -> 0: exp(-inf - 0) = 0, no NaN
    total = np.zeros(lses.shape[1:])
    acc = np.zeros(outs.shape[1:])
    with np.errstate(invalid="ignore"):             # NaN LSE: a NaN row is the intended result
        for o_s, lse_s in zip(outs, lses):
            w = np.exp(lse_s - top)
            total += w
            acc += np.where((lse_s == -np.inf)[..., None], 0.0, w[..., None] * o_s)
    return normalize(acc, total), logsumexp_from(top, total)


# ------------------------------------------------------------------------------------------------ traffic
class Traffic(Ledger):
    """Bytes read and written by tensor over a whole call (append, splits and merge)."""
    NAMES = TENSORS

    def rows(self) -> dict:
        """{(tensor, "read"/"write"): bytes} of the tensors moved, in TENSORS order."""
        return {(t, way): book[t] for t in TENSORS for way, book in (("read", self.reads), ("write", self.writes))
                if book.get(t)}


def traffic_formula(seqlens_k, *, seqlen_q: int, heads: int, heads_kv: int, head_dim: int, seqlen_new: int,
                    num_splits: int, block_n: int = DEFAULT_BLOCK_N, q_bytes: int = 2, kv_bytes: int = 2) -> dict:
    """The bytes of one call in closed form, keyed as ``Traffic.rows``, from the per-sequence key counts
    ``seqlens_k`` (after the append). With n_b = ceil(L_b / block_n) blocks and c_b = ceil(n_b / S) per split,
    sequence b has e_b = ceil(n_b / c_b) non-empty splits (0 if L_b = 0), each reading its Q tile once:

        q           read   sum_b e_b * seqlen_q * heads * d * q_bytes
        k/v_cache   read   sum_b L_b * heads_kv * d * kv_bytes          (each token once: GQA packing)
        k/v_new     read   batch * seqlen_new * heads_kv * d * kv_bytes (the append; written to the cache as much)
        o_partial   write and read   S * batch * seqlen_q * heads * d * 4    (S > 1 only)
        lse_partial write and read   S * batch * seqlen_q * heads * 4        (S > 1 only)
        out, lse    write  batch * seqlen_q * heads * (d * q_bytes + 4)
    """
    lengths = np.asarray(seqlens_k, np.int64)
    batch, s = len(lengths), num_splits
    n = -(-lengths // block_n)
    per = -(-n // s)
    busy = np.where(n > 0, -(-n // np.maximum(per, 1)), 0)
    rows_all = batch * seqlen_q * heads
    kv = int(lengths.sum()) * heads_kv * head_dim * kv_bytes
    new = batch * seqlen_new * heads_kv * head_dim * kv_bytes
    out = {("q", "read"): int(busy.sum()) * seqlen_q * heads * head_dim * q_bytes,
           ("k_cache", "read"): kv, ("k_cache", "write"): new, ("v_cache", "read"): kv, ("v_cache", "write"): new,
           ("k_new", "read"): new, ("v_new", "read"): new}
    if s > 1:
        for way in ("read", "write"):
            out[("o_partial", way)] = s * rows_all * head_dim * PARTIAL_BYTES
            out[("lse_partial", way)] = s * rows_all * PARTIAL_BYTES
    out[("out", "write")] = rows_all * head_dim * q_bytes
    out[("lse", "write")] = rows_all * 4
    return {key: out[key] for key in sorted(out, key=lambda k: (TENSORS.index(k[0]), k[1])) if out[key]}


# ------------------------------------------------------------------------------------------------ the model
@dataclasses.dataclass
class DecodeResult:
    out: np.ndarray          # float64 (batch, seqlen_q, heads, head_dim)
    lse: np.ndarray          # float64 (batch, heads, seqlen_q); -inf: the row saw no key
    traffic: Traffic
    num_splits: int          # the splits it ran with (num_splits=0 resolved)
    block_n: int


def forward(q, k_cache, v_cache, *, cache_seqlens, page_table=None, k=None, v=None, causal=True,
            softmax_scale=None, num_splits=0, k_descale=None, v_descale=None, window=(-1, -1), softcap=0.0,
            alibi_slopes=None, sinks=None, block_n=DEFAULT_BLOCK_N, num_sms=H100_SMS) -> DecodeResult:
    """flash_attn_with_kvcache's step as the kernel runs it, on float64 copies of the values read.

    Every argument is checked first (``kvcache.check_call``, the mask keywords by reference/masks.py); then k, v are
    appended to k_cache, v_cache *in place* (the caller's arrays: that is the operation), the splits run, and the
    merge. ``num_splits=0`` takes ``choose_num_splits`` for ``num_sms`` SMs; ``block_n`` is the split granularity.
    An fp8 (float8_e4m3fn) cache is read exactly (every e4m3 value is a float64) and dequantized by the per-(batch,
    KV head) factors: k_descale folds into the softmax scale, v_descale multiplies each split's output.

    The mask keywords are attention()'s, each sequence's queries its last seqlen_q tokens: ``window`` (left, right)
    bounds the keys, and the splits cut only the keys some query sees (a window of w reads w + seqlen_q keys
    however long the cache); ``softcap`` and ``alibi_slopes`` transform the scores; ``sinks`` join the first
    split's denominators (once per row: the merge adds the splits' states, so a sink folded into each would count
    num_splits times).
    """
    scale = check_scalars(causal, softmax_scale, False)
    num_splits = check_num_splits(num_splits)
    if isinstance(block_n, (bool, np.bool_)) or not isinstance(block_n, (numbers.Integral, np.integer)) or block_n < 1:
        raise ValueError(f"block_n must be an int >= 1, got {block_n!r}")
    call = check_call(q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table, k=k, v=v,
                      k_descale=k_descale, v_descale=v_descale)
    mask_args = MaskArgs.of(call, causal, window, softcap, alibi_slopes, sinks)
    scale = 1.0 / math.sqrt(call.head_dim) if scale is None else scale
    traffic = Traffic()
    if call.seqlen_new:
        _append(call, k_cache, v_cache, k, v, traffic)
    spans = [mask_args.key_span(call, b) for b in range(call.batch)]
    longest = max(stop - first for first, stop in spans)
    splits = num_splits or choose_num_splits(call.batch, call.heads_kv, longest, num_sms, block_n)
    q_in = np.asarray(q)
    o_parts = np.zeros((splits, call.batch, call.seqlen_q, call.heads, call.head_dim))
    lse_parts = np.full((splits, call.batch, call.seqlen_q, call.heads), -np.inf)
    program = _Program(call, k_cache, v_cache, scale, block_n, traffic, Progress(
        f"the decode model (batch {call.batch} x heads_kv {call.heads_kv} x {splits} splits, "
        f"{sum(stop - first for first, stop in spans)} keys in all)",
        sum(-(-(stop - first) // block_n) for first, stop in spans) * call.heads_kv))
    for b in range(call.batch):                                    # the grid: (batch, KV head, split)
        mask = mask_args.sequence(call, b)
        ranges = split_ranges(spans[b][1], splits, block_n, spans[b][0])
        for g in range(call.heads_kv):
            heads = slice(g * call.group, (g + 1) * call.group)
            for s, (start, stop) in enumerate(ranges):
                sinks_here = s == 0 and mask.sinks is not None
                if start == stop and not sinks_here:
                    continue                                       # an empty split: (0, -inf) as initialized
                o_parts[s, b, :, heads], lse_parts[s, b, :, heads] = program.run(
                    q_in[b, :, heads], b, g, start, stop, group_mask(mask, g, call.group), sinks_here)
    program.progress.close()
    out, lse = _write_results(o_parts, lse_parts, q_in.dtype.itemsize, traffic)
    return DecodeResult(out=out, lse=lse.transpose(0, 2, 1), traffic=traffic, num_splits=splits, block_n=block_n)


def _append(call: CacheCall, k_cache, v_cache, k, v, traffic: Traffic) -> None:
    append(call, k_cache, v_cache, k, v)
    for name, new in (("k", k), ("v", v)):
        traffic.read(f"{name}_new", new.nbytes)
        traffic.write(f"{name}_cache", new.nbytes)


@dataclasses.dataclass
class _Program:
    """What every program of one call shares: the cache, the scale, the block size, the counters."""
    call: CacheCall
    k_cache: np.ndarray
    v_cache: np.ndarray
    scale: float
    block_n: int
    traffic: Traffic
    progress: Progress

    def run(self, q_heads: np.ndarray, b: int, g: int, start: int, stop: int, mask: masks.Mask, fold_sinks: bool):
        """Program (b, g, s) over keys [start, stop) with its group's queries q_heads (seqlen_q, group, d) under
        its group's ``mask`` (``group_mask``), folding the sinks in at the end when ``fold_sinks``: the partial
        (O_s (seqlen_q, group, d), LSE_s (seqlen_q, group)) in float64."""
        call, nq, group, d = self.call, *q_heads.shape
        Q_t = q_heads.astype(np.float64).reshape(nq * group, d)   # GQA packing: row r = (token r // G, head r % G)
        self.traffic.read("q", q_heads.nbytes)
        k_scale = self.scale * (1.0 if call.k_descale is None else call.k_descale[b, g])
        m, l, acc = np.full(nq * group, -np.inf), np.zeros(nq * group), np.zeros((nq * group, d))
        tokens = slice(0, nq)
        for j in range(start, stop, self.block_n):
            keys = slice(j, min(j + self.block_n, stop))
            rows = call.rows(b, keys.start, keys.stop)             # through the page table: blocks may straddle pages
            K_j = self.k_cache[rows[0], rows[1], g].astype(np.float64)
            V_j = self.v_cache[rows[0], rows[1], g].astype(np.float64)
            self.traffic.read("k_cache", K_j.size * self.k_cache.dtype.itemsize)
            self.traffic.read("v_cache", V_j.size * self.v_cache.dtype.itemsize)
            S = _by_head(Q_t @ K_j.T * k_scale, nq, group)       # (group, seqlen_q, keys): the mask's layout
            S = _packed(mask.apply(S, tokens, keys, mask.needs_mask(tokens, keys)))
            m, l, acc = online_softmax_step(m, l, acc, S, V_j)
            self.progress.step()
        if fold_sinks:                                             # the sink: one more logit with no value
            by_head = lambda x: x.reshape(nq, group).T            # noqa: E731 - (group, nq), as the sinks broadcast
            m, l, alpha = (x.T.reshape(-1) for x in mask.fold_sinks(by_head(m), by_head(l)))
            acc = acc * alpha[:, None]
        o = normalize(acc, l) * (1.0 if call.v_descale is None else call.v_descale[b, g])
        return o.reshape(nq, group, d), logsumexp_from(m, l).reshape(nq, group)


def _by_head(x: np.ndarray, nq: int, group: int) -> np.ndarray:
    """Packed rows (nq * group, n) as (group, nq, n): row r = (token r // group, head r % group)."""
    return x.reshape(nq, group, -1).transpose(1, 0, 2)


def _packed(x: np.ndarray) -> np.ndarray:
    """_by_head's inverse."""
    group, nq, n = x.shape
    return x.transpose(1, 0, 2).reshape(nq * group, n)


def _write_results(o_parts, lse_parts, out_bytes: int, traffic: Traffic):
    """One split: its program's result is the output. More: the partials cross memory in fp32 and are merged."""
    if o_parts.shape[0] == 1:
        out, lse = o_parts[0], lse_parts[0]
    else:
        o_parts, lse_parts = o_parts.astype(np.float32), lse_parts.astype(np.float32)   # as the kernel stores them
        for way in ("write", "read"):
            getattr(traffic, way)("o_partial", o_parts.nbytes)
            getattr(traffic, way)("lse_partial", lse_parts.nbytes)
        out, lse = merge(o_parts, lse_parts)
    traffic.write("out", out.size * out_bytes)
    traffic.write("lse", lse.size * 4)
    return out, lse
