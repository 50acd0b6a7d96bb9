"""``fa-variants explain decode``: split-KV decoding (FlashDecoding) over a KV cache: why one program per (batch,
head) leaves the card idle at small batch, what the split count buys, the bytes of one call (the NumPy model's
count beside the closed form) and the merge's algebra."""
from __future__ import annotations

import argparse
import math
import textwrap

import ml_dtypes
import numpy as np
from tabulate import tabulate

from ..reference import decode as model
from ..reference import masks
from .args import positive

# The model's steps at most: one per (KV head, block of keys) over the batch (Python loops, about 20 us each)
EXPLAIN_MAX_BLOCKS = 1 << 18
CANDIDATE_SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)
WIDTH = 116

MERGE_ALGEBRA = """\
The merge. Split s saw keys K_s and wrote O_s = sum_{j in K_s} e^(x_j - LSE_s) v_j, normalized by its own sum,
with LSE_s = log sum_{j in K_s} e^(x_j) (x_j the scaled scores of one row). Over all keys,
    LSE = log sum_s e^(LSE_s) = M + log sum_s e^(LSE_s - M),   M = max_s LSE_s,
    O   = sum_s e^(LSE_s - LSE) O_s.
This is the online softmax's step m_new = max(m, m_j), l = e^(m - m_new) l + l_j, O = e^(m - m_new) O + ... with
whole partial results in place of blocks: LSE_s carries a split's max and sum in one number, and the weights
e^(LSE_s - LSE) sum to 1. It is associative and commutative (fav.merge_states, also the step of cascade attention
and of context parallelism); a split that saw no key has LSE_s = -inf and weight 0; if every split is empty the row
is 0 with LSE = -inf."""


def add_arguments(e: argparse.ArgumentParser) -> None:
    """The shape flags of ``explain decode`` (besides --seqlen, the cache length, --head-dim and --dtype)."""
    g = e.add_argument_group("explain decode", "the decoding step's shape: --seqlen is the tokens in the cache")
    g.add_argument("--batch", type=positive, default=1, help="explain decode: sequences, default 1")
    g.add_argument("--heads", type=positive, default=32, help="explain decode: query heads, default 32")
    g.add_argument("--heads-kv", type=positive, default=8, help="explain decode: KV heads, default 8")
    g.add_argument("--seqlen-q", type=positive, default=1, help="explain decode: query tokens per step, default 1")
    g.add_argument("--splits", type=int, default=0, help="explain decode: num_splits, default 0 (the rule's)")
    g.add_argument("--sms", type=positive, default=model.H100_SMS,
                   help=f"explain decode: the card's SM count, default {model.H100_SMS} (H100 SXM, H200)")
    g.add_argument("--page-size", type=positive, default=None, help="explain decode: a paged cache's page size")


def run(args: argparse.Namespace) -> int:
    batch, heads, heads_kv, nq, n, d = (args.batch, args.heads, args.heads_kv, args.seqlen_q, args.seqlen,
                                        args.head_dim)
    if heads % heads_kv:
        raise SystemExit(f"fa-variants explain decode: --heads ({heads}) must be a multiple of --heads-kv ({heads_kv})")
    try:
        model.check_num_splits(args.splits)
    except ValueError as e:
        raise SystemExit(f"fa-variants explain decode: --splits: {e}") from None
    blocks = math.ceil(n / model.DEFAULT_BLOCK_N)
    if batch * heads_kv * blocks > EXPLAIN_MAX_BLOCKS:
        raise SystemExit(f"fa-variants explain decode: {batch * heads_kv * blocks:,} (KV head, block) steps are too "
                         f"many for the NumPy model (at most {EXPLAIN_MAX_BLOCKS:,}); use a smaller --seqlen or "
                         f"--batch")
    window = _window(args)
    seen = n if window[0] < 0 else min(n, window[0] + nq)   # the keys some query sees: what is split and read
    chosen = args.splits or model.choose_num_splits(batch, heads_kv, seen, args.sms)
    print(f"decode: split-KV decoding (FlashDecoding) over a KV cache; batch {batch}, {heads} query heads on "
          f"{heads_kv} KV heads (GQA {heads // heads_kv}:1), seqlen_q {nq}, {n} cached tokens, d {d}, {args.dtype}"
          f"{'' if args.page_size is None else f', pages of {args.page_size}'}"
          f"{'' if window == (-1, -1) else f', window {window}: {seen} keys seen'}")
    print(model.LOOPS + "\n")
    print(_why_split(batch, heads, heads_kv, args.sms) + "\n")
    print(_splits_table(batch, heads, heads_kv, nq, seen, d, args.sms, chosen, np.dtype(args.dtype).itemsize) + "\n")
    print(_bytes_table(args, chosen, window, seen) + "\n")
    print(MERGE_ALGEBRA)
    return 0


def _why_split(batch: int, heads: int, heads_kv: int, sms: int) -> str:
    packed = batch * heads_kv
    return textwrap.fill(
        f"Why split. The prefill kernels run one CTA per (batch, query head, Q block): {batch * heads} CTAs here, "
        f"each walking the whole cache; GQA packing makes it one per (batch, KV head): {packed}. On {sms} SMs that "
        f"is {min(1.0, packed / sms):.0%} of the SMs busy, and a CTA streams the cache at what one SM's loads in "
        f"flight allow, so the card's read rate is out of reach however long the cache. Measured 2026-12-05 on an "
        f"H100 (one run; GB/s of K and V, 32:8 heads, d 128): fa3's prefill kernel with seqlen_q 1 read a 128K "
        f"cache at 508 GB/s at batch 1 (32 CTAs) and 2038 GB/s at batch 4 (128 CTAs); cuDNN 2787 and 3023. "
        f"Cutting each cache into S splits makes {packed} x S CTAs; the price is the partial results (O_s, LSE_s "
        f"in fp32) written and read back by the merge.", WIDTH)


def _splits_table(batch, heads, heads_kv, nq, n, d, sms, chosen, kv_bytes) -> str:
    blocks = max(1, math.ceil(n / model.DEFAULT_BLOCK_N))
    kv = 2 * batch * n * heads_kv * d * kv_bytes
    rows = []
    for s in sorted({c for c in CANDIDATE_SPLITS if c <= blocks} | {chosen}):
        ctas = batch * heads_kv * s
        partials = 2 * s * batch * nq * heads * (d + 1) * model.PARTIAL_BYTES if s > 1 else 0
        per_split = math.ceil(blocks / s) * model.DEFAULT_BLOCK_N
        rows.append(("->" if s == chosen else "", s, ctas, f"{ctas / sms:.2f}",
                     f"{model.wave_efficiency(ctas, sms):.0%}", min(per_split, n), f"{partials / kv:.2%}"))
    table = tabulate(rows, headers=("", "splits", "CTAs", "waves", "last-wave fill", "keys per split",
                                    "merge bytes / K,V bytes"), colalign=("left",) + ("right",) * 6)
    return textwrap.fill(f"What the split count buys (num_splits=0: the fewest splits within {model.NEAR_BEST:.0%} of "
                         f"the best wave fill, none when {model.FILL_ENOUGH:.0%} of the SMs are busy already; blocks "
                         f"of {model.DEFAULT_BLOCK_N} keys, {sms} SMs):", WIDTH) + "\n" + table


def _window(args: argparse.Namespace) -> tuple:
    """explain mask's --window LEFT RIGHT, as the call's window (-1: unbounded)."""
    window = tuple(getattr(args, "window", None) or (-1, -1))
    try:
        return masks.check_window(window)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"fa-variants explain decode: --window: {e}") from None


def _bytes_table(args: argparse.Namespace, splits: int, window: tuple, seen: int) -> str:
    """The model run once at the shape (random values) beside traffic_formula; with a window, over the keys it
    shows (``seen`` of each sequence)."""
    batch, heads, heads_kv, nq, n, d = (args.batch, args.heads, args.heads_kv, args.seqlen_q, args.seqlen,
                                        args.head_dim)
    dtype = ml_dtypes.bfloat16 if args.dtype == "bfloat16" else np.float16
    rng = np.random.default_rng()
    page_table = None
    if args.page_size is None:
        shape = (batch, n, heads_kv, d)
    else:
        per_seq = math.ceil(n / args.page_size)
        shape = (batch * per_seq, args.page_size, heads_kv, d)
        page_table = rng.permutation(batch * per_seq).reshape(batch, per_seq).astype(np.int32)
    k_cache, v_cache = (rng.standard_normal(shape, np.float32).astype(dtype) for _ in range(2))
    q = rng.standard_normal((batch, nq, heads, d), np.float32).astype(dtype)
    res = model.forward(q, k_cache, v_cache, cache_seqlens=n, page_table=page_table, num_splits=splits,
                        window=window)
    counted = res.traffic.rows()
    formula = model.traffic_formula([seen] * batch, seqlen_q=nq, heads=heads, heads_kv=heads_kv, head_dim=d,
                                    seqlen_new=0, num_splits=splits, q_bytes=q.itemsize, kv_bytes=k_cache.itemsize)
    rows = [(t, way, f"{formula.get((t, way), 0):,}", f"{counted.get((t, way), 0):,}")
            for t, way in sorted(set(formula) | set(counted), key=lambda k: (model.TENSORS.index(k[0]), k[1]))]
    total_f, total_c = sum(formula.values()), sum(counted.values())
    rows.append(("total", "", f"{total_f:,}", f"{total_c:,}"))
    kv = formula[("k_cache", "read")] + formula[("v_cache", "read")]
    head = textwrap.fill(f"Bytes of one call with {splits} split{'s' * (splits > 1)} (the NumPy model's count, run "
                         f"once on random values, beside the closed form reference/decode.py:traffic_formula; "
                         f"metadata not counted):", WIDTH)
    table = tabulate(rows, headers=("tensor", "", "closed form", "counted"),
                     colalign=("left", "left", "right", "right"))
    return (head + "\n" + table
            + "\n" + textwrap.fill(f"K and V read once each: {kv / total_f:.1%} of the bytes (GQA packing: the "
                                   f"{heads // heads_kv} query heads of a KV head share its reads; unpacked, K and V "
                                   f"would be read {heads // heads_kv} times)", WIDTH))
