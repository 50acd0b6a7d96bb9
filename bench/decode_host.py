"""The host's cost of a warm ``attention_with_kvcache`` call on the GPU path, measured on any machine: CPU torch
tensors stand in for CUDA ones, and the device's answers (the CUfunction, the arch, the SM count) and the launch are
stubbed, so what is timed is this library's Python between the call and the driver. On a GPU machine
bench/decode.py's do_bench column is the whole cost as a user sees it; this isolates the part a change to the
Python can move.

    python bench/decode_host.py [--calls 5000] [--masks] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np
import torch

import fa_variants as fav
from fa_variants import arrays, decode_cuda, gpu
from fa_variants.kernels import decode as kd
from fa_variants.kernels import launch as kl
from fa_variants.kernels.decode import DevArray


class _HostFramework(kd.Framework):
    """torch's allocation on the CPU, stream 0."""

    def __init__(self, like):
        self.torch, self.lib, self.device, self.stream = True, torch, torch.device("cpu"), 0


def stub_the_device(patch=setattr) -> None:
    """Make the GPU path run on CPU tensors: they claim the GPU, live on device 0, and nothing reaches a driver.
    ``patch(obj, name, value)``: setattr, or a test's monkeypatch.setattr (undone after the test)."""
    of = DevArray.of
    patch(DevArray, "of", staticmethod(lambda x: of(x)._replace(device=0)))
    patch(gpu, "available", lambda: True)
    patch(arrays, "_claims_gpu", lambda x: None if x is None else not isinstance(x, (int, np.ndarray)))
    patch(decode_cuda, "_device_array", lambda name, x: (x, DevArray.of(x)))
    patch(decode_cuda, "Framework", _HostFramework)
    patch(kd, "arch_of", lambda device: "sm_90a")
    patch(kd, "num_sms", lambda device: 132)
    patch(kd, "smem_limit", lambda: 227 * 1024)
    patch(kd, "_function", lambda source, expr, smem=0: 1)
    patch(kl, "launch_argv", lambda *a, **k: None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--masks", action="store_true", help="a window of 128 and float32 sinks (gpt-oss's layers)")
    ap.add_argument("--profile", action="store_true", help="cProfile of 2000 calls, by time spent in each function")
    args = ap.parse_args()
    stub_the_device()
    q = torch.randn(1, 1, 32, 128).bfloat16()
    k, v = torch.randn(1, 2048, 8, 128).bfloat16(), torch.randn(1, 2048, 8, 128).bfloat16()
    kw = dict(cache_seqlens=torch.full((1,), 2048, dtype=torch.int32))
    if args.masks:
        kw.update(window=(127, 0), sinks=torch.randn(32))
    call = lambda: fav.attention_with_kvcache(q, k, v, **kw)  # noqa: E731
    for _ in range(200):
        call()
    t = time.perf_counter()
    for _ in range(args.calls):
        call()
    print(f"{(time.perf_counter() - t) / args.calls * 1e6:.1f} us a call (1 x 2K, 32:8 heads, d 128, torch; host only)")
    if args.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(2000):
            call()
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())


if __name__ == "__main__":
    main()
