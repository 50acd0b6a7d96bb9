"""Context parallelism's speed: ring attention over the ranks of a torchrun job against one GPU's attention at the
same per-GPU sequence length, forward and forward + backward, in one run.

    torchrun --nproc_per_node 2 bench/ring.py [--seqlen 131072] [--heads 32] [--heads-kv 8] [--head-dim 128]

Each rank holds seqlen / world tokens (zigzag for causal). The single-GPU baseline is one rank's attention of
seqlen / world tokens over themselves, scaled to the work a ring rank does (a causal ring rank computes world times
the baseline's pairs): per-GPU TFLOP/s of the ring against the baseline's is the ratio the issue asks for (0.9 or
more: the transfers hidden). CPU tensors with gloo run it too (--device cpu, tiny sizes: a smoke test).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import fa_variants as fav
from fa_variants import distributed as fad


def timed(fn, reps: int, cuda: bool) -> float:
    """Median seconds of fn() over reps, after a warm-up, every rank in step."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = "cuda" if cuda else "cpu"
    backend = "auto" if cuda else "numpy"
    n_local, h, hkv, d = args.seqlen // world, args.heads, args.heads_kv, args.head_dim
    g = torch.Generator(device=dev).manual_seed(rank)
    q, k, v = (torch.randn(1, n_local, x, d, device=dev, generator=g, dtype=torch.bfloat16) for x in (h, hkv, hkv))
    dout = torch.randn_like(q)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def ring_fwd():
        with torch.no_grad():
            fad.ring_attention(q, k, v, causal=True, backend=backend)

    def ring_step():
        fad.ring_attention(*leaves, causal=True, backend=backend).backward(dout)

    def one_fwd():
        with torch.no_grad():
            fav.attention(q, k, v, causal=True, backend=backend)

    def one_step():
        fav.attention(*leaves, causal=True, backend=backend).backward(dout)

    flops_ring = 4.0 * n_local * args.seqlen * h * d / 2       # a rank's share of the causal sequence's products
    flops_one = 4.0 * n_local * n_local * h * d / 2
    rows = []
    for name, ring, one, mult in (("forward", ring_fwd, one_fwd, 1.0), ("forward + backward", ring_step, one_step,
                                                                         3.5)):
        t_ring, t_one = timed(ring, args.reps, cuda), timed(one, args.reps, cuda)
        tf_ring, tf_one = mult * flops_ring / t_ring / 1e12, mult * flops_one / t_one / 1e12
        rows.append((name, t_ring * 1e3, tf_ring, t_one * 1e3, tf_one, tf_ring / tf_one))
    if rank == 0:
        card = torch.cuda.get_device_name() if cuda else "CPU"
        print(f"{card} x {world}, seqlen {args.seqlen} ({n_local} a rank, zigzag), heads {h} / {hkv}, d {d}, bf16, "
              f"causal")
        print(f"{'':20} {'ring ms':>10} {'TFLOP/s':>9} {'one rank ms':>11} {'TFLOP/s':>9} {'ratio':>6}")
        for name, a, b, c, e, r in rows:
            print(f"{name:20} {a:10.2f} {b:9.1f} {c:11.2f} {e:9.1f} {r:6.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
