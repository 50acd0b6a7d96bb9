"""Real batches on the GPU: the masked kernels on a packed batch of documents, a sliding window, and each logit
transform, forward and backward (fa2's, kernels/fa2_masked.py, and on sm_90a fa3's, kernels/fa3_masked.py), against
the same kernels on a plain problem, in one run; FlashAttention-4 (flash_attn.cute) on the same arrays and masks
where it is installed, and FlexAttention on the window.

    python bench/varlen.py [--quick] [--json FILE]
    python bench/varlen.py --report FILE       # the tables of a saved run, on any machine

Kernel time: CUDA events around the launcher's call (the public API's host checks, which read cu_seqlens back to
the host, are not in it), median of --reps after a warm-up. TFLOP/s count the products a causal problem needs:
4 n_q n_k d heads, halved under causal, summed over the sequences; the backward 2.5 times the forward's.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics

import cupy
import ml_dtypes
import numpy as np
from tabulate import tabulate

import fa_variants as fav
from fa_variants.kernels import fa2_masked, fa3, fa3_masked
from fa_variants.kernels.masked import Masks
from fa_variants.varlen import is_plain

H, D = 16, 128
DT = ml_dtypes.bfloat16


def timed_ms(fn, reps: int) -> float:
    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b))
    return statistics.median(times)


def rand(shape, rng):
    return cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(DT))


def flex_window_ms(n: int, w: int, reps: int) -> float | None:
    """FlexAttention (torch.compile) on one causal sequence of n tokens under a sliding window of w keys left of the
    diagonal, as a block mask (fully hidden blocks skipped): the forward's kernel time; None without torch."""
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError:
        return None
    from fa_variants.timing.torch_peers import _compiled_flex
    flex = _compiled_flex(torch)
    q, k, v = (torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = create_block_mask(lambda b, h, i, j: (j <= i) & (j >= i - w), B=None, H=None, Q_LEN=n, KV_LEN=n,
                             device="cuda")
    # (torch's default stream is the legacy one CuPy's events record on: timed_ms brackets the call)
    return timed_ms(lambda: flex(q, k, v, block_mask=mask, scale=D ** -0.5), reps)


def fa4_times(q, k, v, masks, causal, dout, reps) -> dict:
    """FlashAttention-4 (flash-attn-4, flash_attn.cute) on the same CuPy arrays, zero-copy through DLPack, with the
    same mask: {"fa4 fwd ms", "fa4 bwd ms"} (the backward alone, the forward's graph kept), or {} where it is not
    installed or refuses the case (said so)."""
    try:
        import torch
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except ImportError as e:
        print(f"  fa4: not run ({e})")
        return {}
    if masks.alibi_slopes is not None:
        return {}
    qt, kt, vt = (torch.from_dlpack(x).requires_grad_() for x in (q, k, v))
    kw = dict(softmax_scale=D ** -0.5, causal=causal, softcap=masks.softcap,
              window_size=tuple(None if s < 0 else s for s in masks.window),
              learnable_sink=None if masks.sinks is None else torch.from_dlpack(masks.sinks))
    if masks.packed:
        cu_q, cu_k = torch.from_dlpack(masks.cu_seqlens_q), torch.from_dlpack(masks.cu_seqlens_k)
        fwd = functools.partial(flash_attn_varlen_func, qt, kt, vt, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                max_seqlen_q=masks.max_seqlen_q, max_seqlen_k=masks.max_seqlen_k, **kw)
    else:
        fwd = functools.partial(flash_attn_func, qt, kt, vt, **kw)
    row = {}
    try:
        row["fa4 fwd ms"] = timed_ms(fwd, reps)
        out = fwd()
        out = out[0] if isinstance(out, tuple) else out
        dout_t = torch.from_dlpack(dout)
        row["fa4 bwd ms"] = timed_ms(lambda: torch.autograd.grad(out, (qt, kt, vt), dout_t, retain_graph=True), reps)
    except Exception as e:  # noqa: BLE001 - a case FA4 refuses is left out of its column, said so
        print(f"  fa4: {type(e).__name__}: {str(e)[:160]}")
    return row


def unmasked_times(q, k, v, causal, dout, reps) -> dict:
    """fa3's kernels without the mask machinery (what `attention()` runs on a plain problem) on the same arrays:
    what the masked kernels' varlen addressing and mask tests cost where they have nothing to do."""
    scale = D ** -0.5
    out, lse = fa3.forward(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    return {"fa3 plain-kernel fwd ms": timed_ms(lambda: fa3.forward(q, k, v, causal=causal, softmax_scale=scale,
                                                                      return_lse=True), reps),
            "fa3 plain-kernel bwd ms": timed_ms(lambda: fa3.backward(dout, q, k, v, out, lse, causal=causal,
                                                                       softmax_scale=scale), reps)}


def causal_flops(lens_q, lens_k) -> float:
    return sum(4.0 * nq * nk * D * H * (0.5 if nq == nk else 1.0) for nq, nk in zip(lens_q, lens_k))


# the kernels timed, forward and backward: fa2's, and fa3's where it runs (its backward also with dQ's shares added
# as they come: "fa3u", deterministic=False)
FORWARDS = {"fa2": fa2_masked, **({"fa3": fa3_masked} if fav.get("fa3").available()[0] else {})}
BACKWARDS = {**{n: m.backward for n, m in FORWARDS.items()},
             **({"fa3u": functools.partial(fa3_masked.backward, deterministic=False)} if "fa3" in FORWARDS else {})}


def run_case(name, q, k, v, masks, causal, flops, reps, rng):
    scale = D ** -0.5
    row = dict(case=name)
    for kname, kernel in FORWARDS.items():
        def fwd(kernel=kernel):
            return kernel.forward(q, k, v, causal=causal, softmax_scale=scale, return_lse=True, masks=masks)
        t_f = timed_ms(fwd, reps)
        row[f"{kname} fwd ms"], row[f"{kname} fwd TFLOP/s"] = t_f, flops / t_f / 1e9
    out, lse = fa2_masked.forward(q, k, v, causal=causal, softmax_scale=scale, return_lse=True, masks=masks)
    dout = cupy.asarray(rng.standard_normal(out.shape, dtype=np.float32).astype(DT))
    for kname, backward in BACKWARDS.items():
        def bwd(backward=backward):
            return backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, masks=masks)
        t_b = timed_ms(bwd, reps)
        row[f"{kname} bwd ms"], row[f"{kname} bwd TFLOP/s"] = t_b, 2.5 * flops / t_b / 1e9
    if "fa3" in FORWARDS and is_plain(masks.window, masks.softcap, masks.sinks, masks.alibi_slopes,
                                      cu_seqlens_q=masks.cu_seqlens_q, cu_seqlens_k=masks.cu_seqlens_k):
        row.update(unmasked_times(q, k, v, causal, dout, reps))
    row.update(fa4_times(q, k, v, masks, causal, dout, reps))
    for c in ("fwd", "bwd"):
        if f"fa4 {c} ms" in row and "fa3" in FORWARDS:
            row[f"fa3 {c} x fa4 speed"] = row[f"fa4 {c} ms"] / row[f"fa3 {c} ms"]
    return row


def report(rows: list) -> str:
    """The forward's table, then the backward's: a row a case, a column for each kernel's time (and TFLOP/s), then
    the ratios the case has (against dense, against the plain kernel, fa3's speed against FA4's); the columns no
    case has are left out."""
    def table(direction: str) -> str:
        short = "fwd" if direction == "forward" else "bwd"
        kernels = [k for k in ("fa2", "fa3", "fa3u", "fa3 plain-kernel", "fa4") if any(f"{k} {short} ms" in r
                                                                                      for r in rows)]
        cols = [(f"{k} {short} ms", f"{k} ms") for k in kernels]
        cols += [(f"{k} {short} TFLOP/s", f"{k} TFLOP/s") for k in kernels if any(f"{k} {short} TFLOP/s" in r
                                                                                  for r in rows)]
        dense = "x dense time" if short == "fwd" else "bwd x dense time"
        cols += [(f"{k} {dense}", f"{k} x dense") for k in kernels] + [("ideal", "ideal (w/N)")]
        cols += [(f"{k} {short} x plain", f"{k} x plain") for k in kernels]
        cols += [(f"fa3 {short} x fa4 speed", "fa3 speed / fa4")]
        if short == "fwd":
            cols += [("flex fwd ms", "flex ms")]
        cols = [(key, head) for key, head in cols if any(key in r for r in rows)]
        body = [[r["case"]] + [f"{r[key]:.3g}" if key in r else "" for key, _ in cols] for r in rows]
        return f"{direction}\n" + tabulate(body, headers=["case"] + [head for _, head in cols])
    return table("forward") + "\n\n" + table("backward")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--report", metavar="JSON", help="print the tables of a run saved by --json (no GPU needed)")
    args = ap.parse_args()
    if args.report:
        print(report(json.load(open(args.report))))
        return
    rng = np.random.default_rng(0)
    rows = []

    # a packed batch of documents, 128 to 16K tokens, 64K in all, causal; against one dense sequence of 8K
    total = 16384 if args.quick else 65536
    lens = []
    while sum(lens) < total:
        lens.append(int(min(total - sum(lens), rng.integers(128, 16385))))
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    q, k, v = rand((total, H, D), rng), rand((total, H, D), rng), rand((total, H, D), rng)
    packed = Masks(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens), total_q=total,
                   total_k=total)
    rows.append(run_case(f"packed {len(lens)} docs, {total} tokens", q, k, v, packed, True,
                         causal_flops(lens, lens), args.reps, rng))
    n = 8192
    qd, kd, vd = (rand((total // n, n, H, D), rng) for _ in range(3))
    rows.append(run_case(f"dense {total // n} x {n}", qd, kd, vd, Masks(), True,
                         (total // n) * causal_flops([n], [n]), args.reps, rng))

    # a window of 4K over 32K (causal): its cost against the dense causal problem's
    n, w = (8192, 1024) if args.quick else (32768, 4096)
    qd, kd, vd = (rand((1, n, H, D), rng) for _ in range(3))
    dense = run_case(f"causal {n}", qd, kd, vd, Masks(), True, causal_flops([n], [n]), args.reps, rng)
    win_flops = 4.0 * D * H * sum(min(i + 1, w + 1) for i in range(n))
    win = run_case(f"causal window {w} of {n}", qd, kd, vd, Masks(window=(w, 0)), True, win_flops, args.reps, rng)
    for kname in FORWARDS:
        win[f"{kname} x dense time"] = win[f"{kname} fwd ms"] / dense[f"{kname} fwd ms"]
        win[f"{kname} bwd x dense time"] = win[f"{kname} bwd ms"] / dense[f"{kname} bwd ms"]
    win["ideal"] = win_flops / causal_flops([n], [n])
    flex_ms = flex_window_ms(n, w, args.reps)
    if flex_ms is not None:
        win["flex fwd ms"] = flex_ms
    rows += [dense, win]

    # each transform against the plain masked kernel, 2 x 8K causal
    b, n = 2, (4096 if args.quick else 8192)
    qd, kd, vd = (rand((b, n, H, D), rng) for _ in range(3))
    flops = b * causal_flops([n], [n])
    plain = run_case(f"plain {b} x {n}", qd, kd, vd, Masks(), True, flops, args.reps, rng)
    rows.append(plain)
    for name, m in (("softcap 30", Masks(softcap=30.0)),
                    ("sinks", Masks(sinks=cupy.asarray(rng.standard_normal(H).astype(np.float32)))),
                    ("alibi", Masks(alibi_slopes=cupy.asarray(rng.uniform(0.01, 0.2, H).astype(np.float32))))):
        r = run_case(f"{name} {b} x {n}", qd, kd, vd, m, True, flops, args.reps, rng)
        for kname in FORWARDS:
            r[f"{kname} fwd x plain"] = r[f"{kname} fwd ms"] / plain[f"{kname} fwd ms"]
            r[f"{kname} bwd x plain"] = r[f"{kname} bwd ms"] / plain[f"{kname} bwd ms"]
        rows.append(r)

    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, bf16, heads {H}, d {D}")
    print(report(rows))
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
