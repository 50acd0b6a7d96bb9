"""Decoding over a KV cache: fa-variants' attention_with_kvcache against torch SDPA's flash and cuDNN backends and
FlashAttention-4 (where installed), on the same torch tensors, in one run.

    python bench/decode.py [--quick] [--fp16] [--json FILE]
    python bench/decode.py --splits 4,8,16,32,64    # the step's time against its split count, per shape
    python bench/decode.py --host                   # the host's cost of a warm call, ours and cuDNN's, and a profile
    python bench/decode.py --trace                  # a graphed step kernel by kernel: durations and gaps (CUPTI)
    python bench/decode.py --compare a.json b.json  # runs saved with --json, case by case (an A/B of two trees)

GB/s counts K and V read once (the bytes a decoding step cannot avoid; with a window, the window's). Kernel time:
CUDA events around one call, the L2 flushed before each (a 1 x 8K cache fits in L2) and the host's cost hidden
behind a sleep kernel, median of --reps. As a user sees it: triton's do_bench (host cost included, L2 not flushed),
and one step captured in a CUDA graph and replayed. SDPA's is_causal is top-left when seqlen_q > 1, so the peers get
seqlen_q = 1 only (there causal and full coincide). The window rows (gpt-oss's sliding layers: a window of 128 and
sinks) have no peer here: SDPA takes neither.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch
from tabulate import tabulate

import fa_variants as fav

HEADS, HEADS_KV, D = 32, 8, 128
SHAPES = [(1, 8192), (1, 32768), (1, 131072), (8, 8192), (32, 4096), (4, 131072), (64, 2048)]


def flush_l2(buf):
    buf.zero_()


SLEEP_CYCLES = 2_000_000   # about 1 ms of GPU time: longer than any call's host cost


def kernel_ms(fn, reps: int, flush) -> float:
    """The GPU's time for one call: the GPU is kept busy (a sleep kernel) while the host enqueues it, so the
    events bracket the kernels alone, not the host's work between them."""
    times = []
    for _ in range(reps):
        flush()
        torch.cuda._sleep(SLEEP_CYCLES)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def capture(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one call of fn, warmed up on a side stream first (torch's rule), replayed once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def graph_ms(fn, reps: int) -> float:
    g = capture(fn)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def peers(q, k, v):
    """{name: fn} of the peers for a seqlen_q = 1 step over contiguous (B, N, Hkv, d) caches."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    out = {}
    for name, backend in (("torch-flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        try:
            run()
            out[name] = run
        except Exception as e:  # noqa: BLE001 - a backend that refuses the shape is left out, said so
            print(f"  {name}: {type(e).__name__}: {str(e)[:100]}")
    try:
        from flash_attn.cute import flash_attn_func
        flash_attn_func(q, k, v, causal=True)
        out["fa4"] = lambda: flash_attn_func(q, k, v, causal=True)
    except Exception as e:  # noqa: BLE001
        print(f"  fa4: {type(e).__name__}: {str(e)[:100]}")
    return out


def cudnn(q, k, v) -> dict:
    """{"cudnn": fn}, SDPA's cuDNN backend alone of the peers (empty where it refuses the shape)."""
    return {name: fn for name, fn in peers(q, k, v).items() if name == "cudnn"}


def step_inputs(batch: int, n: int, seqlen_q: int = 1, dtype: str = "bfloat16"):
    """q (batch, seqlen_q, HEADS, D) and contiguous caches k, v (batch, n, HEADS_KV, D), full: cache_seqlens n."""
    torch.manual_seed(0)
    q = torch.randn(batch, seqlen_q, HEADS, D, device="cuda", dtype=getattr(torch, dtype))
    k = torch.randn(batch, n, HEADS_KV, D, device="cuda", dtype=getattr(torch, dtype))
    v = torch.randn_like(k)
    return q, k, v, torch.full((batch,), n, dtype=torch.int32, device="cuda")


def paged_copy(x, page_size: int, order):
    """x (B, N, Hkv, d) as pages of page_size tokens: logical page i of the B * N / page_size lands on page order[i]
    (a shuffle), so sequence b's page table row is order[b * N / page_size:][:N / page_size]."""
    b, n, h, d = x.shape
    pages = torch.empty((b * n // page_size, page_size, h, d), dtype=x.dtype, device=x.device)
    pages[order] = x.reshape(-1, page_size, h, d)
    return pages


def run_shape(batch, n, seqlen_q, reps, flush, with_peers=True, paged=None, fp8=False, dtype="bfloat16",
              window=None, num_splits=0, user_times=True):
    q, k, v, seqlens = step_inputs(batch, n, seqlen_q, dtype)
    kc, vc, table, kd, vd = k, v, None, None, None
    if fp8:   # per (sequence, KV head) scales from the amax: e4m3 has no infinity, past 448 is NaN
        kd, vd = (x.abs().amax(dim=(1, 3)).float() / 448 for x in (k, v))
        kc, vc = (x.float().div(s[:, None, :, None]).to(torch.float8_e4m3fn) for x, s in ((k, kd), (v, vd)))
    if paged:
        order = torch.randperm(batch * n // paged, device="cuda")
        kc, vc = paged_copy(kc, paged, order), paged_copy(vc, paged, order)
        table = order.view(batch, n // paged).to(torch.int32)
    kv_bytes = 2 * batch * min(n, window or n) * HEADS_KV * D * (1 if fp8 else 2)
    masks = {} if window is None else dict(window=(window - 1, 0), sinks=torch.randn(HEADS, device="cuda"))

    def ours():
        return fav.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table, k_descale=kd,
                                          v_descale=vd, causal=True, num_splits=num_splits, **masks)
    rows = {}
    fns = {"fa-variants": ours}
    if with_peers and seqlen_q == 1 and not paged and not fp8 and dtype == "bfloat16" and window is None:
        fns.update(peers(q, k, v))
    from triton.testing import do_bench
    for name, fn in fns.items():
        fn()
        ms = kernel_ms(fn, reps, flush)
        rows[name] = dict(ms=ms, gbps=kv_bytes / ms / 1e6, graph_ms=graph_ms(fn, 50) if name != "fa4" else float("nan"),
                          do_bench_ms=do_bench(fn, warmup=25, rep=100) if user_times else float("nan"))
    return rows


def split_sweep(shapes, splits, reps, flush):
    """Per shape (contiguous cache, seqlen_q 1): the step's kernel and graph time at each split count, the rule's
    own choice (0) first, cuDNN's beside."""
    from fa_variants.kernels import decode as kd
    from fa_variants.reference.decode import choose_num_splits
    table = []
    for batch, n in shapes:
        auto = choose_num_splits(batch, HEADS_KV, n, kd.num_sms(torch.cuda.current_device()), kd.SPLIT_N)
        for i, count in enumerate((0, *splits)):
            if count > n // kd.SPLIT_N:
                continue
            rows = run_shape(batch, n, 1, reps, flush, with_peers=i == 0, num_splits=count, user_times=False)
            ours, peer = rows["fa-variants"], rows.get("cudnn")
            table.append([batch, n, f"{auto} (rule)" if count == 0 else count, f"{ours['gbps']:.0f}",
                          f"{ours['ms'] * 1e3:.1f}", f"{ours['graph_ms'] * 1e3:.1f}",
                          f"{peer['gbps']:.0f}" if peer else "", f"{peer['ms'] * 1e3:.1f}" if peer else ""])
            print(table[-1], flush=True)
    print(tabulate(table, headers=["batch", "KV tokens", "splits", "GB/s", "us kernel", "us graph", "cuDNN GB/s",
                                   "cuDNN us kernel"]))


def trace(shapes, steps: int = 20) -> None:
    """Where a graphed step's time goes, kernel by kernel (CUPTI through torch.profiler): per shape, ``steps``
    replays of a graph of one step, ours and cuDNN's, and for each kernel its median duration and the median gap
    between the previous kernel's end and its start (for the first kernel of a step: the previous step's last)."""
    from torch.profiler import ProfilerActivity, profile
    table = []
    for batch, n in shapes:
        q, k, v, seqlens = step_inputs(batch, n)
        ours = lambda: fav.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True)  # noqa: E731
        for name, fn in {"fa-variants": ours, **cudnn(q, k, v)}.items():
            g = capture(fn)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    g.replay()
                torch.cuda.synchronize()
            kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                             key=lambda e: e.time_range.start)
            per_step = len(kernels) // steps
            for i in range(per_step):
                at = range(i, per_step * steps, per_step)
                gaps = [kernels[j].time_range.start - kernels[j - 1].time_range.end for j in at if j > 0]
                table.append([batch, n, name, kernels[i].name[:60],
                              f"{statistics.median(kernels[j].time_range.elapsed_us() for j in at):.1f}",
                              f"{statistics.median(gaps):.1f}" if gaps else "-"])
            step_us = (kernels[-1].time_range.end - kernels[0].time_range.start) / steps
            table.append([batch, n, name, "(the step, first start to last end / steps)", f"{step_us:.1f}", ""])
            print(table[-1], flush=True)
    print(tabulate(table, headers=["batch", "KV tokens", "who", "kernel", "us median", "us gap before"]))


def host_cost(calls: int) -> None:
    """The host's cost of a warm call (1 x 2K, seqlen_q 1): back-to-back calls with no synchronization, timed on
    the host (the GPU's work is shorter than the host's here, so the host is what is timed), ours and SDPA's with
    cuDNN; then the top of a cProfile of ours."""
    q, k, v, seqlens = step_inputs(1, 2048)
    ours = lambda: fav.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True)  # noqa: E731
    for name, fn in {"fa-variants": ours, **cudnn(q, k, v)}.items():
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        enqueue = (time.perf_counter() - t) / calls
        torch.cuda.synchronize()
        print(f"{name}: {enqueue * 1e6:.1f} us a call on the host (1 x 2K, {calls} calls)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        ours()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())


def compare(paths: list[str]) -> None:
    """Our kernel time per case across runs saved with --json (trees or rounds of an A/B): each run's microseconds
    and its speed against the first run's; no GPU needed."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append({json.dumps({k: v for k, v in r.items() if k != "rows"}, sort_keys=True): r["rows"]
                         for r in json.load(f)["record"]})
    table = []
    for case in runs[0]:
        first = runs[0][case]["fa-variants"]["ms"]
        times = [run[case]["fa-variants"]["ms"] if case in run else float("nan") for run in runs]
        table.append([", ".join(f"{k} {v}" for k, v in json.loads(case).items() if v is not None),
                      *(f"{t * 1e3:.1f}" for t in times), *(f"{first / t:.3f}" for t in times[1:])])
    print(tabulate(table, headers=["case", *(f"us {p}" for p in paths), *(f"speed {p}" for p in paths[1:])]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--fp16", action="store_true", help="also fp16 q over a 16-bit and an fp8 cache (the fp8 cache's "
                    "conversion differs with q's format)")
    ap.add_argument("--splits", help="comma-separated split counts: the sweep instead of the table")
    ap.add_argument("--host", action="store_true", help="the host's cost of a warm call instead of the table")
    ap.add_argument("--calls", type=int, default=3000, help="--host: calls timed")
    ap.add_argument("--trace", action="store_true", help="each kernel of a graphed step, its duration and the gap "
                    "before it (CUPTI), ours and cuDNN's, instead of the table")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="our kernel times of runs saved with --json, "
                    "side by side with their speed against the first (no GPU)")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare)
        return
    if args.host:
        host_cost(args.calls)
        return
    if args.trace:
        trace(SHAPES[:3] if args.quick else SHAPES)
        return
    flush_buf = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    flush = lambda: flush_l2(flush_buf)  # noqa: E731
    if args.splits:
        split_sweep(SHAPES[:3] if args.quick else SHAPES, [int(x) for x in args.splits.split(",")], args.reps, flush)
        return
    card = torch.cuda.get_device_name()
    table, record = [], []
    shapes = SHAPES[:3] if args.quick else SHAPES
    variants = [dict(seqlen_q=1), dict(seqlen_q=4), dict(seqlen_q=1, paged=16), dict(seqlen_q=1, paged=256),
                dict(seqlen_q=1, fp8=True), dict(seqlen_q=1, window=128)]   # gpt-oss's sliding layers (with sinks)
    if args.fp16:
        variants += [dict(seqlen_q=1, dtype="float16"), dict(seqlen_q=1, fp8=True, dtype="float16")]
    for batch, n in shapes:
        for var in variants:
            rows = run_shape(batch, n, reps=args.reps, flush=flush, **var)
            best = max((r["gbps"] for name, r in rows.items() if name != "fa-variants"), default=float("nan"))
            best_user = min((r["do_bench_ms"] for name, r in rows.items() if name != "fa-variants"),
                            default=float("nan"))
            ours = rows["fa-variants"]
            q_fmt = {"bfloat16": "bf16", "float16": "fp16"}[var.get("dtype", "bfloat16")]
            table.append([batch, n, var.get("seqlen_q"), var.get("paged") or "-",
                          f"fp8 ({q_fmt} q)" if var.get("fp8") else
                          f"{q_fmt}, window {var['window']} + sinks" if var.get("window") else q_fmt,
                          f"{ours['gbps']:.0f}", f"{ours['ms'] * 1e3:.1f}", f"{ours['do_bench_ms'] * 1e3:.1f}",
                          f"{ours['graph_ms'] * 1e3:.1f}",
                          *(f"{rows[p]['gbps']:.0f}" if p in rows else "-" for p in ("torch-flash", "cudnn", "fa4")),
                          f"{ours['gbps'] / best:.2f}" if best == best else "-",
                          f"{best_user * 1e3:.1f}" if best_user == best_user else "-"])
            record.append(dict(batch=batch, n=n, **var, rows=rows))
            print(table[-1], flush=True)
    print(f"\n{card}, torch {torch.__version__}; {HEADS}:{HEADS_KV} heads, d {D}; q in the cache column's format "
          f"(an fp8 cache: as noted); GB/s of K and V read once")
    print(tabulate(table, headers=["batch", "KV tokens", "q", "page", "cache", "GB/s", "us kernel", "us do_bench",
                                   "us graph", "torch flash", "cuDNN", "FA4", "x best", "best peer us do_bench"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(card=card, torch=torch.__version__, record=record), f, indent=1)


if __name__ == "__main__":
    main()
