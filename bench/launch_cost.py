"""Per-call host cost: how long one ``fav.attention`` call takes when the GPU work is negligible.

    PYTHONPATH=$PWD python3 bench/launch_cost.py [--repeats 7] [--calls 2000] [--json out.json] [--no-kernels]
        [--backward] [--profile VARIANT:INPUTS]

A tiny problem (batch 1, seqlen 16, heads 2, head_dim 64, fp16, not causal) is called ``--calls`` times back to
back with one device synchronization at the end; time per call = wall time / calls, and the number reported is
the median of ``--repeats`` such repeats, after a warm-up (compilation, then a few hundred calls). The kernels
take a few microseconds, less than the host needs to issue them, so the queue never fills and the wall time is
the host's: argument checks, DLPack import, allocation, launch.

Rows: every registry variant (fa2_fp8 quantizing on the fly), fa2_fp8 on operands quantized once beforehand
(``fav.fp8.quantize``, then ``fav.fp8.attention`` timed), each with CuPy arrays and with torch tensors; torch
SDPA as a user porting from flash-attn calls it (transposes from and to (B, N, H, d) included), with the default
backend choice and with the flash backend forced (``sdpa_kernel`` entered once, outside the loop). Kernels per
call are counted afterwards with torch's profiler (CUPTI sees every kernel of the process, CuPy's too);
memsets and copies are counted apart.

Prints a table (targets: 15 us with CuPy arrays, 25 us with torch tensors, for fa1, fa2 and pre-quantized
fa2_fp8) and writes the rows as JSON. A variant that cannot run here gets a row saying why; one whose call raises
gets a row with the error. Progress goes to stderr.

``--backward``: the same for the backward call alone, ``fav.attention_backward(dout, q, k, v, out, lse,
check_lse=False)`` as the torch op makes it, every variant with a backward (no targets), beside torch SDPA's backward
alone (``torch.autograd.grad`` of one forward's output, kept). ``--profile VARIANT:INPUTS`` (e.g. fa3:torch): then
cProfile that row's calls and print the 25 functions with the most time of their own.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import io
import json
import platform
import pstats
import sys
import time

from tabulate import tabulate

from fa_variants import registry
from fa_variants.timing.inputs import random_inputs
from fa_variants.timing.shapes import Shape, median
from fa_variants.timing.torch_peers import torch_status

SHAPE = Shape(batch=1, heads=2, seqlen_q=16, head_dim=64, dtype="float16", causal=False)
PREQUANT = "fa2_fp8_prequant"
SDPA, SDPA_FLASH = "torch-sdpa", "torch-sdpa-flash"
TARGET_US = {"cupy": 15.0, "torch": 25.0}
TARGETED = ("fa1", "fa2", PREQUANT)
WARMUP_CALLS = 300
KERNEL_COUNT_CALLS = 20


@dataclasses.dataclass
class Row:
    """One (variant, input type): per-call microseconds of each repeat, or why there are none."""
    variant: str
    inputs: str                           # 'cupy' or 'torch'
    us: list = dataclasses.field(default_factory=list)
    note: str = ""                        # why it did not run, or the error it raised
    kernels: float | None = None          # kernel launches per call (torch profiler)
    memops: float | None = None           # memsets and memory copies per call
    direction: str = "forward"            # or "backward": the backward call alone (no targets)

    @property
    def median_us(self) -> float | None:
        return median(self.us) if self.us else None


# ------------------------------------------------------------------------------------------------ pure parts
def per_call_us(wall_s: float, calls: int) -> float:
    return wall_s / calls * 1e6


def target_us(variant: str, inputs: str, direction: str = "forward") -> float | None:
    return TARGET_US[inputs] if variant in TARGETED and direction == "forward" else None


def verdict(row: Row) -> str:
    """'yes' / 'no' against the row's target, '' where it has none or did not run."""
    target, med = target_us(row.variant, row.inputs, row.direction), row.median_us
    if target is None or med is None:
        return ""
    return "yes" if med <= target else "no"


def _count_text(row: Row) -> str:
    if row.kernels is None:
        return ""
    text = f"{row.kernels:g}"
    return text + (f" (+{row.memops:g} mem)" if row.memops else "")


def table(rows) -> tuple[list[str], list[list[str]]]:
    headers = ["variant", "inputs", "us/call", "min..max", "target us", "meets", "kernels/call", "note"]
    body = []
    for r in rows:
        med, target = r.median_us, target_us(r.variant, r.inputs, r.direction)
        spread = f"{min(r.us):.1f}..{max(r.us):.1f}" if r.us else ""
        body.append([r.variant, r.inputs, "" if med is None else f"{med:.1f}", spread,
                     "" if target is None else f"{target:g}", verdict(r), _count_text(r), r.note])
    return headers, body


def report(rows, meta: dict) -> dict:
    """The JSON document: the run's parameters and one entry per row."""
    return {**meta, "rows": [{**dataclasses.asdict(r), "median_us": r.median_us,
                              "target_us": target_us(r.variant, r.inputs, r.direction), "meets": verdict(r) or None}
                             for r in rows]}


# ------------------------------------------------------------------------------------------------ the cases
def _cupy_inputs():
    import cupy
    return random_inputs(SHAPE, cupy, seed=0)


def _torch_inputs(torch):
    size = (SHAPE.batch, SHAPE.seqlen_q, SHAPE.heads, SHAPE.head_dim)
    return tuple(torch.randn(size, device="cuda", dtype=torch.float16) for _ in range(3))


def _ours(variant: str, q, k, v):
    import fa_variants as fav
    return lambda: fav.attention(q, k, v, variant=variant, causal=SHAPE.causal)


def _prequant(q, k, v):
    import fa_variants as fav
    qz = fav.fp8.quantize(q, k, v)      # once, outside the timed calls (a KV cache)
    return lambda: fav.fp8.attention(qz, causal=SHAPE.causal)


def _ours_backward(variant: str, q, k, v):
    """The backward call alone, on one forward's out and lse (the forward's variant: the same name)."""
    import fa_variants as fav
    out, lse = fav.attention(q, k, v, variant=variant, causal=SHAPE.causal, return_lse=True)
    dout = out * 0.5 + q   # any array of out's shape, dtype and library
    return lambda: fav.attention_backward(dout, q, k, v, out, lse, variant=variant, causal=SHAPE.causal,
                                          check_lse=False)


def _sdpa_backward(torch, q, k, v):
    """torch SDPA's backward alone: autograd through one forward's output, the graph kept between calls."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = _sdpa(torch, q, k, v)()
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def _sdpa(torch, q, k, v):
    F = torch.nn.functional
    return lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=SHAPE.causal).transpose(1, 2)


def _flash_context():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def _unavailable(variant: str) -> str:
    """Why ``variant`` (a registry name or PREQUANT) cannot run here, '' when it can."""
    entry = registry.get("fa2_fp8" if variant == PREQUANT else variant)
    ok, why = entry.available()
    if not ok:
        return why
    if not entry.supports(SHAPE.dtype, SHAPE.head_dim):
        return f"does not take {SHAPE.dtype} at head_dim {SHAPE.head_dim}"
    return ""


def cases(torch, torch_why: str, backward: bool = False):
    """(variant, inputs, why not or '', build) for every row; ``build()`` -> (zero-argument call, context the
    timed loop runs in). Inputs are made inside ``build`` so that a failure there becomes that row's error.
    ``backward``: the backward calls, of every variant that has one."""
    if backward:
        ours = [v.name for v in registry.variants() if "backward" in v.directions]
    else:
        ours = [v.name for v in registry.variants()] + [PREQUANT]
    for inputs in ("cupy", "torch"):
        for name in ours:
            why = _unavailable(name) or (torch_why if inputs == "torch" else "")

            def build(name=name, inputs=inputs):
                qkv = _cupy_inputs() if inputs == "cupy" else _torch_inputs(torch)
                if backward:
                    return _ours_backward(name, *qkv), contextlib.nullcontext()
                call = _prequant(*qkv) if name == PREQUANT else _ours(name, *qkv)
                return call, contextlib.nullcontext()

            yield name, inputs, why, build
    for name in (SDPA, SDPA_FLASH):
        def build(name=name):
            # entered before the forward too: the backward runs the kernel the forward chose
            ctx = _flash_context() if name == SDPA_FLASH else contextlib.nullcontext()
            if backward:
                with ctx:
                    call = _sdpa_backward(torch, *_torch_inputs(torch))
                return call, contextlib.nullcontext()
            return _sdpa(torch, *_torch_inputs(torch)), ctx

        yield name, "torch", torch_why, build


# ------------------------------------------------------------------------------------------------ measuring
def _sync():
    import cupy
    cupy.cuda.runtime.deviceSynchronize()   # the whole device: CuPy's stream and torch's alike


def time_calls(call, calls: int, repeats: int, warmup: int | None = None) -> list[float]:
    """Per-call us of ``repeats`` runs of ``calls`` back-to-back calls, each ended by one synchronization."""
    for _ in range(WARMUP_CALLS if warmup is None else warmup):
        call()
    _sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        _sync()
        out.append(per_call_us(time.perf_counter() - t0, calls))
    return out


def count_gpu_ops(torch, call, n: int = KERNEL_COUNT_CALLS) -> tuple[float, float]:
    """(kernels, memsets + copies) per call, from torch's profiler over ``n`` calls."""
    from torch.profiler import ProfilerActivity, profile
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        _sync()
    gpu = [e for e in prof.events() if getattr(e.device_type, "name", str(e.device_type)).endswith("CUDA")]
    mem = sum(1 for e in gpu if e.name.startswith(("Memset", "Memcpy")))
    return (len(gpu) - mem) / n, mem / n


def measure(rows_in, calls: int, repeats: int, direction: str = "forward") -> list[tuple[Row, object]]:
    """Time each case; (row, build) pairs, so that kernels can be counted afterwards."""
    out = []
    for i, (name, inputs, why, build) in enumerate(rows_in):
        row = Row(name, inputs, direction=direction)
        print(f"[{i + 1}] {name} ({inputs})", file=sys.stderr, flush=True)
        if why:
            row.note = f"skipped: {why}"
        else:
            try:
                call, ctx = build()
                with ctx:
                    row.us = time_calls(call, calls, repeats)
            except Exception as e:  # noqa: BLE001 - one failing variant must not end the run
                row.note = f"error: {type(e).__name__}: {str(e)[:160]}"
        out.append((row, build))
    return out


def count_kernels(torch, measured):
    """Fill in kernels/call for every row that ran (profiling only after all timing: CUPTI slows the host)."""
    try:
        count_gpu_ops(torch, lambda: None, n=1)    # CUPTI starts up here, not during the first row's count
    except Exception as e:  # noqa: BLE001 - no profiler: no counts
        print(f"[count] torch profiler unusable: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
        return
    for row, build in measured:
        if not row.us:
            continue
        try:
            call, ctx = build()
            with ctx:
                call()
                row.kernels, row.memops = count_gpu_ops(torch, call)
        except Exception as e:  # noqa: BLE001 - the count is optional
            print(f"[count] {row.variant} ({row.inputs}): {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)


def profile_row(measured, which: str, calls: int) -> str:
    """cProfile of ``calls`` calls of the row ``which`` ('variant:inputs'), its 25 functions with the most time of
    their own; or why there is none."""
    for row, build in measured:
        if f"{row.variant}:{row.inputs}" != which:
            continue
        if not row.us:
            return f"--profile {which}: the row did not run ({row.note})"
        call, ctx = build()
        with ctx:
            call()
            _sync()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                call()
            prof.disable()
            _sync()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        return f"--profile {which}, {calls} calls:\n{text.getvalue()}"
    return f"--profile {which}: no such row (variant:inputs, e.g. fa3:torch)"


def _meta(args) -> dict:
    import cupy
    from fa_variants import gpu
    torch, _ = torch_status()
    return {"shape": SHAPE.id, "calls": args.calls, "repeats": args.repeats, "warmup_calls": WARMUP_CALLS,
            "device": gpu.probe().name, "python": platform.python_version(), "cupy": cupy.__version__,
            "torch": getattr(torch, "__version__", None), "timer": "wall clock / calls, one sync per repeat",
            "direction": "backward" if args.backward else "forward"}


def _write(path: str | None, rows, meta: dict):
    if path:
        with open(path, "w") as f:
            json.dump(report(rows, meta), f, indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--no-kernels", action="store_true", help="do not count kernels per call")
    ap.add_argument("--backward", action="store_true", help="the backward call alone, every variant that has one")
    ap.add_argument("--profile", default=None, metavar="VARIANT:INPUTS",
                    help="then cProfile that row's calls (e.g. fa3:torch)")
    args = ap.parse_args(argv)
    from fa_variants import gpu
    if not gpu.available():
        sys.exit(f"launch_cost needs a CUDA GPU: {gpu.reason()}")
    torch, torch_why = torch_status()
    meta = _meta(args)
    direction = meta["direction"]
    measured = measure(list(cases(torch, torch_why, args.backward)), args.calls, args.repeats, direction)
    rows = [r for r, _ in measured]
    _write(args.json, rows, meta)        # the times are safe on disk before the profiler starts
    if torch is not None and not args.no_kernels:
        count_kernels(torch, measured)
        _write(args.json, rows, meta)
    headers, body = table(rows)
    print(f"per-call host cost of the {direction}, {SHAPE.id}: median of {args.repeats} x {args.calls} back-to-back "
          f"calls, one sync each ({meta['device']})")
    print(tabulate(body, headers=headers, tablefmt="github", disable_numparse=True))
    if args.profile:
        print(profile_row(measured, args.profile, min(args.calls, 500)))


if __name__ == "__main__":
    main()
