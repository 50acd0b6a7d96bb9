"""Context parallelism on torch.distributed: attention over a sequence split across the ranks of a process group.

    from fa_variants import distributed as fad
    q, k, v = (fad.shard(x, group=g) for x in (q_full, k_full, v_full))    # this rank's part of the sequence
    out = fad.ring_attention(q, k, v, group=g, causal=True)                 # torch autograd
    out_full = fad.unshard(out, group=g)

Ring attention: each rank keeps its queries; the K/V blocks travel around the ring (rank r sends to r + 1), and at
each step a rank attends its queries to the block it holds and folds the result into its running output with the
block's log-sum-exp: out = sum_s e^(LSE_s - LSE) out_s, the seed's online-softmax rescaling applied to whole partial
results (merge_states' algebra). The next block's transfer is posted before the step's attention, so it hides
behind it. The backward sends each block around once more with its dK and dV accumulating on the way (every rank
adds its queries' share), and one last hop takes them home; dQ stays where it is. A step's gradients come from
attention_backward on the rank's queries and the visiting block with the whole row's out and LSE: P = e^(S - LSE)
is then each key's true weight and D = rowsum(dO o O) the whole row's.

Causal masking needs a balanced split: in sequence order, rank 0's queries see almost nothing and the last rank's
almost everything. ``zigzag`` (the default for causal) cuts the sequence into 2 * world chunks and gives rank r
chunks r and 2 * world - 1 - r, so every rank does the same work: a query chunk a against a key chunk c is full
when c < a, causal (the diagonal) when c == a, and skipped when c > a.

Ulysses attention: an all-to-all turns the sequence split into a head split (every rank then holds the whole
sequence for heads / world of the heads), one local attention runs, and a second all-to-all turns it back. It needs
heads divisible by the world size (K/V heads that are not are repeated up to the query heads).

The transport is torch.distributed's point-to-point sends (NCCL on GPUs, gloo on CPUs: gloo has no all_to_all, so
Ulysses' exchange is made of sends too); the attention is ``fav.attention`` / ``fav.attention_backward`` on this
rank's tensors, any variant, GPU kernels or (CPU tensors) the NumPy models. ``reference/ring.py`` simulates the
ring in NumPy with counters of the bytes each rank sends, and ``fa-variants explain ring`` sets a step's compute
against its transfer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import api, dispatch
from . import backward as backward_mod
from .reference.ring import chunks_of, pairs   # the layout and the pairs a step computes: the model's own

__all__ = ["ring_attention", "ulysses_attention", "shard", "unshard", "chunks_of"]


# ------------------------------------------------------------------------------------------------ the layout
def _world(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def shard(x: torch.Tensor, group=None, *, zigzag: bool = True, dim: int = 1) -> torch.Tensor:
    """This rank's part of the full sequence ``x`` (a copy): its chunks (``chunks_of``) along ``dim``, whose length
    must divide into 2 * world chunks (zigzag) or world chunks."""
    rank, world = _world(group)
    pieces = 2 * world if zigzag else world
    if x.shape[dim] % pieces:
        raise ValueError(f"the sequence length {x.shape[dim]} must be a multiple of {pieces} "
                         f"({'2 x ' if zigzag else ''}world size {world}) to shard")
    parts = x.chunk(pieces, dim=dim)
    return torch.cat([parts[c] for c in chunks_of(rank, world, zigzag)], dim=dim).contiguous()


def unshard(x: torch.Tensor, group=None, *, zigzag: bool = True, dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's part (an all-gather; every rank gets it; not differentiable)."""
    rank, world = _world(group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    per = len(chunks_of(0, world, zigzag))
    order = {}
    for r, part in enumerate(parts):
        for c, piece in zip(chunks_of(r, world, zigzag), part.chunk(per, dim=dim)):
            order[c] = piece
    return torch.cat([order[c] for c in sorted(order)], dim=dim)


# ------------------------------------------------------------------------------------------------ the ring
def _global(group, rank: int) -> int:
    """The global rank of ``group``'s rank (P2POp takes global ranks)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _exchange(send: list, recv: list, rank: int, world: int, group):
    """Post the sends of ``send`` to rank + 1 and the receives into ``recv`` from rank - 1; returns the requests."""
    nxt, prv = _global(group, (rank + 1) % world), _global(group, (rank - 1) % world)
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in send]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in recv]
    return dist.batch_isend_irecv(ops)


def _merge(acc_out, acc_lse, out, lse):
    """(acc_out, acc_lse) and one more state over other keys, merged in place (float32 out, lse (B, H, N)): rows
    that saw nothing (LSE -inf) add nothing."""
    new = torch.logaddexp(acc_lse, lse)
    finite = torch.isfinite(new)
    safe = torch.where(finite, new, torch.zeros_like(new))
    w_acc = torch.where(finite, torch.exp(acc_lse - safe), torch.zeros_like(new))
    w_new = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(new))
    acc_out.mul_(w_acc.transpose(1, 2)[..., None]).add_(out.float() * w_new.transpose(1, 2)[..., None])
    acc_lse.copy_(new)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, zigzag, variant, backend):
        q, k, v = (x.detach() for x in (q, k, v))   # (their views would still say requires_grad)
        rank, world = _world(group)
        per = len(chunks_of(0, world, zigzag))
        qs = q.chunk(per, dim=1)
        b, _, h, d = q.shape
        outs = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in qs]
        lses = [torch.full((b, h, x.shape[1]), float("-inf"), device=q.device) for x in qs]
        kv = [k.contiguous(), v.contiguous()]
        for step in range(world):
            src = (rank - step) % world
            nxt = [torch.empty_like(t) for t in kv] if step + 1 < world else None
            reqs = _exchange(kv, nxt, rank, world, group) if nxt is not None else []
            ks, vs = kv[0].chunk(per, dim=1), kv[1].chunk(per, dim=1)
            for i, j, diag in pairs(rank, src, world, causal, zigzag):
                out, lse = api.attention(qs[i], ks[j], vs[j], causal=diag, softmax_scale=scale, return_lse=True,
                                         variant=variant, backend=backend)
                _merge(outs[i], lses[i], out, lse)
            for r in reqs:
                r.wait()
            kv = nxt if nxt is not None else kv
        out = torch.cat(outs, dim=1).to(q.dtype)
        lse = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, scale, zigzag, variant, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = (x.detach() for x in ctx.saved_tensors)
        dout = dout.detach()
        group, causal, scale, zigzag, variant, backend = ctx.args
        rank, world = _world(group)
        per = len(chunks_of(0, world, zigzag))
        bwd_variant = dispatch.backward_variant(variant)
        qs, outs, douts = q.chunk(per, dim=1), out.chunk(per, dim=1), dout.contiguous().chunk(per, dim=1)
        lses = lse.chunk(per, dim=2)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dqs = dq.chunk(per, dim=1)
        travel = [k.contiguous(), v.contiguous(), torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                  torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
        for step in range(world):
            src = (rank - step) % world
            ks, vs, dks, dvs = (t.chunk(per, dim=1) for t in travel)
            for i, j, diag in pairs(rank, src, world, causal, zigzag):
                g = backward_mod.attention_backward(douts[i], qs[i], ks[j], vs[j], outs[i], lses[i].contiguous(),
                                                    causal=diag, softmax_scale=scale, check_lse=False,
                                                    variant=bwd_variant, backend=backend)
                dqs[i].add_(g[0].float())
                dks[j].add_(g[1].float())
                dvs[j].add_(g[2].float())
            # the block and its gradients so far go on; after the last step only the gradients, home (rank + 1)
            send = travel if step + 1 < world else travel[2:]
            if world > 1:
                nxt = [torch.empty_like(t) for t in send]
                for r in _exchange(send, nxt, rank, world, group):
                    r.wait()
                travel = nxt if step + 1 < world else travel[:2] + nxt
        return dq.to(q.dtype), travel[2].to(k.dtype), travel[3].to(v.dtype), None, None, None, None, None, None


def ring_attention(q, k, v, group=None, causal: bool = True, softmax_scale: float | None = None, *,
                   zigzag: bool | None = None, variant: str = "auto", backend: str = "auto"):
    """Attention of this rank's queries over the whole sequence's keys, the K/V blocks passed around the ring of
    ``group`` (default: the world). q (batch, n_local, heads, d), k and v (batch, n_local, heads_kv, d): this rank's
    part of the sequence (``shard``), in the layout ``zigzag`` says (default: zigzag when causal). Returns this
    rank's rows of the output; differentiable in q, k and v (torch autograd). ``variant``/``backend``:
    ``fav.attention``'s, for every step."""
    zigzag = bool(causal) if zigzag is None else bool(zigzag)
    _check(q, k, v, group, zigzag)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return _Ring.apply(q, k, v, group, bool(causal), scale, zigzag, variant, backend)


def _check(q, k, v, group, zigzag: bool) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise TypeError(f"{name} must be a 4D torch.Tensor (batch, n_local, heads, head_dim), got "
                            f"{type(x).__name__} {getattr(x, 'shape', '')}")
    if k.shape != v.shape or q.shape[1] != k.shape[1] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q, k, v must share batch, local length and head dim (k and v one shape), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group first")
    if zigzag and q.shape[1] % 2:
        raise ValueError(f"the zigzag layout holds two equal chunks a rank: the local length must be even, got "
                         f"{q.shape[1]}")


# ------------------------------------------------------------------------------------------------ Ulysses
def _all_to_all(x: torch.Tensor, split: int, cat: int, group) -> torch.Tensor:
    """Every rank's ``x`` cut into world pieces along ``split``; piece j goes to rank j, and what arrives is
    joined along ``cat`` in rank order (point-to-point sends: gloo has no all_to_all)."""
    rank, world = _world(group)
    pieces = [p.contiguous() for p in x.chunk(world, dim=split)]
    got = [torch.empty_like(pieces[0]) for _ in range(world)]
    got[rank].copy_(pieces[rank])
    ops = []
    for j in range(world):
        if j != rank:
            ops += [dist.P2POp(dist.isend, pieces[j], _global(group, j), group),
                    dist.P2POp(dist.irecv, got[j], _global(group, j), group)]
    if ops:
        for r in dist.batch_isend_irecv(ops):
            r.wait()
    return torch.cat(got, dim=cat)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split, cat, group):
        ctx.args = (split, cat, group)
        return _all_to_all(x, split, cat, group)

    @staticmethod
    def backward(ctx, grad):
        split, cat, group = ctx.args
        return _all_to_all(grad, cat, split, group), None, None, None


def ulysses_attention(q, k, v, group=None, causal: bool = True, softmax_scale: float | None = None, *,
                      variant: str = "auto", backend: str = "auto"):
    """Attention of this rank's rows of a sequence split in order (``shard(..., zigzag=False)``) by two all-to-alls
    over heads: heads (and K/V heads, repeated up to the query heads where they do not divide) must divide by the
    world size of ``group``. Differentiable in q, k and v."""
    _check(q, k, v, group, zigzag=False)
    _, world = _world(group)
    h, hkv = q.shape[2], k.shape[2]
    if h % world:
        raise ValueError(f"ulysses_attention needs heads divisible by the world size, got {h} heads and {world} "
                         f"ranks (ring_attention has no such need)")
    if hkv % world:
        k, v = (x.repeat_interleave(h // hkv, dim=2) for x in (k, v))
    full = [_AllToAll.apply(x, 2, 1, group) for x in (q, k, v)]      # (batch, n, heads / world, d)
    out = api.attention(*full, causal=causal, softmax_scale=softmax_scale, variant=variant, backend=backend)
    return _AllToAll.apply(out, 1, 2, group)
