"""Does ``lse`` come from a forward with these ``causal`` and ``softmax_scale``? A spot check on a few rows.

A backward recomputes P = exp(S - lse) from the lse it is handed: an lse made with another mask or scale gives a
wrong gradient and no other sign of it. So ``attention_backward`` recomputes in float32, with the flags it was
given, the lse of up to ``ROWS`` query rows (row 0, the first row that sees a key, rows spread down to the last) in
each of up to ``PAIRS`` (batch, head) pairs spread over the call (keys read in chunks of at most ``CHUNK_BYTES``),
and compares.

What a genuine match may differ by: a 16-bit forward's lse is float32 (about 1e-5 here); an fp8 forward's carries
the e4m3 rounding of q and k into every score, an error proportional to the scores' size, with a standard
deviation of at most about SIGMA ``M_i``, ``M_i = |scale| ||q_i|| rms_j ||k_j|| / sqrt(d)`` (a score's typical
size, whatever the cancellation in q_i . k_j). So the difference of row i is read in those units,
z_i = (lse_i - recomputed_i) / (M_i + FLOOR), and the flags disagree when one row has |z_i| > ROW_SIGMAS SIGMA, or
the n rows' mean has |mean z| > MEAN_SIGMAS SIGMA / sqrt(n) (fp8 errors are independent from row to row and average
out; another mask or scale moves the rows together). A row that sees no key under one mask and some under the
other (-inf against a number) disagrees outright; rows that are NaN or +inf on either side are skipped (a NaN input
gives NaN where it reaches).

What it cannot see: flags whose lse differ by less than that, e.g. causal with seqlen_q much smaller than
seqlen_k (every row sees almost every key either way), another scale on scores that are all near zero, or a
scale off by less than about 2x with only a row or two to compare (one query row and one head).
"""
from __future__ import annotations

import numpy as np

from . import arrays

ROWS = 16               # query rows compared per (batch, head) pair
PAIRS = 4               # (batch, head) pairs compared
CHUNK_BYTES = 1 << 24   # float32 keys converted at a time
FLOOR = 0.1             # added to M_i: rows of zeros (or scale 0) leave the float32 rounding alone
SIGMA = 0.05            # an fp8 forward's per-row error in units of M_i (e4m3 keeps 3 mantissa bits of q and k)
ROW_SIGMAS = 10         # one row further off than this many SIGMA disagrees
MEAN_SIGMAS = 8         # ... and so does a mean of n rows further off than this many SIGMA / sqrt(n)


def rows_to_check(seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """Row 0, the first row that sees a key under causal masking, and ROWS rows spread from there to the last."""
    first = max(0, seqlen_q - seqlen_k)
    spread = np.linspace(first, seqlen_q - 1, min(ROWS, seqlen_q - first)).round().astype(np.int64)
    return np.unique(np.concatenate([[0, first], spread]))


def pairs_to_check(batch: int, heads: int) -> list:
    """Up to PAIRS (batch, head) pairs, evenly spaced over all of them, the first and the last included."""
    total = batch * heads
    picks = np.unique(np.linspace(0, total - 1, min(PAIRS, total)).round().astype(np.int64))
    return [(int(i) // heads, int(i) % heads) for i in picks]


def recompute(q, k, rows: np.ndarray, pairs: list, *, causal: bool, softmax_scale: float):
    """(lse, M), float32 arrays (pairs, rows) of q's library: the log-sum-exp of the scores of ``rows`` in each
    (batch, head) of ``pairs``, and their score scale M (see above). All pairs at once: a dozen launches on a GPU."""
    xp = _xp(q)
    nq, h, d = q.shape[1:]
    nk, hkv = k.shape[1:3]
    b = xp.asarray([p[0] for p in pairs])[:, None]
    hq = xp.asarray([p[1] for p in pairs])[:, None]
    r = xp.asarray(rows)
    qr = q[b, r[None, :], hq, :].astype(xp.float32)                         # (P, R, d)
    s = xp.empty((len(pairs), len(rows), nk), xp.float32)
    k_sq = 0.0
    step = max(1, CHUNK_BYTES // (4 * d * len(pairs)))
    for start in range(0, nk, step):
        kc = k[b[:, 0], start:start + step, hq[:, 0] // (h // hkv), :].astype(xp.float32)   # (P, keys, d)
        s[:, :, start:start + step] = qr @ kc.swapaxes(1, 2)
        k_sq = k_sq + (kc * kc).sum(axis=(1, 2))
    s *= xp.float32(softmax_scale)
    if causal:
        visible = xp.arange(nk)[None, :] <= r[:, None] + (nk - nq)
        s = xp.where(visible, s, xp.float32(-np.inf))
    m = s.max(axis=2)
    m = xp.where(xp.isfinite(m), m, xp.float32(0))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):    # log(0): a row that sees no key
        lse = xp.log(xp.exp(s - m[..., None]).sum(axis=2)) + m
    scale_m = abs(softmax_scale) * xp.sqrt((qr * qr).sum(axis=2)) * xp.sqrt(k_sq / nk)[:, None] / np.sqrt(d)
    return lse, scale_m


def mismatch(given: np.ndarray, mine: np.ndarray, scale_m: np.ndarray) -> str | None:
    """Why the forward's lse ``given`` of some rows cannot have the recomputed values ``mine`` (None: it can)."""
    one_empty = np.isneginf(given) != np.isneginf(mine)
    if one_empty.any():
        i = int(np.argmax(one_empty))
        return f"a row that {'sees no key' if np.isneginf(given[i]) else 'sees keys'} in the forward's lse " \
               f"{'sees keys' if np.isneginf(given[i]) else 'sees no key'} under these flags"
    both = np.isfinite(given) & np.isfinite(mine)
    z = (given[both] - mine[both]) / (scale_m[both] + FLOOR)
    if not z.size:
        return None
    row_tol, mean_tol = ROW_SIGMAS * SIGMA, MEAN_SIGMAS * SIGMA / np.sqrt(z.size)
    if np.abs(z).max() > row_tol:
        return f"a row's lse differs by {np.abs(z).max():.2f} score units (at most {row_tol:.2f} for a genuine match)"
    if abs(z.mean()) > mean_tol:
        return f"the lse of {z.size} rows differ by {z.mean():+.2f} score units on average (at most " \
               f"{mean_tol:.2f} for a genuine match)"
    return None


def check(q, k, lse, *, causal: bool, softmax_scale: float) -> None:
    """A ValueError when ``lse`` (batch, heads, seqlen_q) cannot come from attention(q, k, ..., causal=causal,
    softmax_scale=softmax_scale) with k (and v) of these shapes; q, k, lse NumPy or CuPy arrays of one library."""
    xp = _xp(q)
    rows = rows_to_check(q.shape[1], k.shape[1])
    pairs = pairs_to_check(q.shape[0], q.shape[2])
    lse_r, scale_m = recompute(q, k, rows, pairs, causal=causal, softmax_scale=softmax_scale)
    b = xp.asarray([p[0] for p in pairs])[:, None]
    hq = xp.asarray([p[1] for p in pairs])[:, None]
    given = lse[b, hq, xp.asarray(rows)[None, :]].astype(xp.float32)
    why = mismatch(*arrays.to_numpy(xp.stack([given, lse_r, scale_m.astype(xp.float32)])).reshape(3, -1))
    if why is not None:
        raise ValueError(f"lse does not match causal={causal}, softmax_scale={softmax_scale:g}: {why}. Pass the "
                         f"causal and softmax_scale of the forward that returned out and lse")


def _xp(a):
    """NumPy for NumPy arrays, else CuPy."""
    if isinstance(a, np.ndarray):
        return np
    import cupy
    return cupy
