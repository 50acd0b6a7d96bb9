"""Ring attention simulated in NumPy: ``world`` ranks in one process, in distributed.py's loop order, with counters
of what each rank computes and sends.

Rank r holds its chunks of the sequence (``chunks_of``: chunk r of world, or zigzag's r and 2 world - 1 - r of
2 world) for q, k and v. Step s: rank r holds the K/V block of rank (r - s) mod world, attends its queries to it
(every pair of chunks that sees something: full when the key chunk comes first, causal on the diagonal, skipped
when it comes later) and merges the partial (out, LSE) into its running state (decode.merge, merge_states' model);
then it passes the block to rank r + 1. The backward passes each block around once more with its dK, dV (fp32) and
one last hop home: world - 1 K/V blocks and world dK/dV pairs sent per rank, against world - 1 blocks forward.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .decode import merge
from .dense import attention64


def chunks_of(rank: int, world: int, zigzag: bool) -> tuple[int, ...]:
    """The sequence chunks a rank holds, in order: (rank,) of world chunks, or zigzag's (rank, 2 world - 1 - rank)
    of 2 * world (distributed.py's layout)."""
    return (rank, 2 * world - 1 - rank) if zigzag else (rank,)


def pairs(rank: int, src: int, world: int, causal: bool, zigzag: bool):
    """(query chunk index, key chunk index, causal) of every pair of rank ``rank``'s chunks and ``src``'s that sees
    something: all of them without causal; with it a key chunk before the query chunk in full, the same chunk under
    the causal mask, a later one not at all."""
    mine, theirs = chunks_of(rank, world, zigzag), chunks_of(src, world, zigzag)
    for i, a in enumerate(mine):
        for j, c in enumerate(theirs):
            if not causal or c < a:
                yield i, j, False
            elif c == a:
                yield i, j, True


@dataclasses.dataclass
class RingResult:
    out: np.ndarray               # (batch, seqlen, heads, d) float64, the whole sequence in order
    lse: np.ndarray               # (batch, heads, seqlen)
    pair_flops: np.ndarray        # (steps, world): the products of Q K^T and P V each rank runs at each step
    sent_bytes: np.ndarray        # (world,): K/V bytes each rank sends in the forward (at ``itemsize`` an element)


def forward(q, k, v, world: int, *, causal: bool = True, zigzag: bool | None = None, softmax_scale=None,
            itemsize: int = 2) -> RingResult:
    """The ring's forward over full-sequence q (batch, seqlen, heads, d), k and v (batch, seqlen, heads_kv, d):
    sharded into ``world`` ranks, run step by step, and put back in sequence order."""
    zigzag = causal if zigzag is None else zigzag
    b, n, h, d = q.shape
    pieces = 2 * world if zigzag else world
    if n % pieces:
        raise ValueError(f"seqlen {n} must be a multiple of {pieces} to shard over {world} ranks")
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    size = n // pieces
    chunk = lambda x, c: x[:, c * size:(c + 1) * size]  # noqa: E731
    out, lse = np.zeros((b, n, h, d)), np.full((b, h, n), -np.inf)
    flops = np.zeros((world, world))
    for rank in range(world):
        for i, a in enumerate(chunks_of(rank, world, zigzag)):
            states = []
            for step in range(world):
                src = (rank - step) % world
                for qi, kj, diag in pairs(rank, src, world, causal, zigzag):
                    if qi != i:
                        continue
                    c = chunks_of(src, world, zigzag)[kj]
                    o, l = attention64(chunk(q, a), chunk(k, c), chunk(v, c), causal=diag, scale=scale)
                    states.append((o.reshape(b, h, size, d), l.reshape(b, h, size)))
                    flops[step, rank] += 4.0 * b * h * size * size * d * (0.5 if diag else 1.0)
            o, l = merge(np.stack([s[0] for s in states]), np.stack([s[1] for s in states]))
            out[:, a * size:(a + 1) * size] = o.transpose(0, 2, 1, 3)
            lse[:, :, a * size:(a + 1) * size] = l
    block = 2 * b * (n // world) * k.shape[2] * d * itemsize    # one rank's K and V
    return RingResult(out, lse, flops, np.full(world, (world - 1) * block, dtype=np.int64))


def step_times(seqlen: int, world: int, *, batch: int = 1, heads: int = 32, heads_kv: int = 8, head_dim: int = 128,
               causal: bool = True, zigzag: bool | None = None, tflops: float = 500.0, link_gbs: float = 200.0,
               itemsize: int = 2):
    """Per step of the forward on the busiest rank: (compute µs, transfer µs of the next block) at ``tflops`` and a
    link of ``link_gbs`` GB/s each way, counted as the model counts (no run)."""
    zigzag = causal if zigzag is None else zigzag
    pieces = 2 * world if zigzag else world
    size = seqlen // pieces
    block = 2 * batch * (seqlen // world) * heads_kv * head_dim * itemsize
    rows = []
    for step in range(world):
        busiest = 0.0
        for rank in range(world):
            f = sum(4.0 * batch * heads * size * size * head_dim * (0.5 if diag else 1.0)
                    for _, _, diag in pairs(rank, (rank - step) % world, world, causal, zigzag))
            busiest = max(busiest, f)
        send = block / (link_gbs * 1e3) if step + 1 < world else 0.0
        rows.append((step, busiest / (tflops * 1e6), send))
    return rows, block
