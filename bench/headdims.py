"""Padded head dims: is a head dim between the kernels' templates as fast as the template it is padded to?

    PYTHONPATH=$PWD python3 bench/headdims.py [--repeats 20] [--variants fa1,fa2] [--json out.json]

The kernels are compiled for a few head dims (the templates) and pad any other up to the next one inside, so
d = 80 runs the d = 96 kernel and d = 111 the d = 128 one (111 is also no multiple of 8, so its rows are not
16-byte aligned and the launcher copies the inputs first). For each variant, mask and d in 80, 111, 160, 192,
224, this times the problem at d and the same problem (same B, H, N) at the template it pads to, in bf16 with
N = 4096 and B * N = 16K tokens, H = 2048 / d rounded (H * d ~ 2048), using fa_variants.timing's CUDA-event
timer with inputs rotating through more than L2. TFLOP/s count the REAL d (4 * B * H * N^2 * d, halved when
causal), so a padded d computes fewer useful FLOPs than its template: "padded / template" is the ratio of the
two times (target <= 1.0: padding costs nothing beyond the template's own work). torch SDPA's flash backend on
the same problem at d stands beside it (an empty cell where torch refuses that head dim).

The templates are read from fa_variants/tiles.py (the head dims a kernel exists for).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from tabulate import tabulate

from fa_variants import registry, tiles, timing

PADDED_DIMS = (80, 111, 160, 192, 224)
TEMPLATE_DIMS = tiles.TEMPLATE_DIMS   # the 16-bit kernels' padding set
TOKENS, HIDDEN, SEQLEN = 16 * 1024, 2048, 4096
DTYPE = "bfloat16"


# ------------------------------------------------------------------------------------------------ pure parts
def heads_for(d: int) -> int:
    """H with H * d ~ 2048: exact where d divides 2048, else rounded."""
    return HIDDEN // d if HIDDEN % d == 0 else round(HIDDEN / d)


def padded_dim(d: int, templates=TEMPLATE_DIMS) -> int:
    """The template head dim the kernels run ``d`` at: the smallest template >= d."""
    fits = [t for t in templates if t >= d]
    if not fits:
        raise ValueError(f"head_dim {d} exceeds the largest template {max(templates)}")
    return min(fits)


def problem(d: int, causal: bool, heads: int | None = None) -> timing.Shape:
    """The benchmark problem at head dim ``d`` (``heads`` given: the padded problem's H, kept at the template)."""
    return timing.Shape(batch=TOKENS // SEQLEN, heads=heads_for(d) if heads is None else heads, seqlen_q=SEQLEN,
                        head_dim=d, dtype=DTYPE, causal=causal)


def templates_of(variant: str) -> tuple[int, ...]:
    """Head dims the kernel this device runs for ``variant`` is compiled for (fa_variants/tiles.py; fa2 on sm_90 runs
    its wgmma kernel's); TEMPLATE_DIMS for a name that is no variant."""
    from fa_variants.kernels import fa2
    dims = {"fa1": tiles.TEMPLATE_DIMS, "fa2": tuple(fa2.SM90_TILES) if fa2.uses_wgmma() else tiles.TEMPLATE_DIMS,
            "fa2_fp8": tiles.FP8_TEMPLATE_DIMS, "fa3": tiles.FA3_DIMS, "fa3_fp8": tiles.FP8_TEMPLATE_DIMS}
    return tuple(sorted(dims.get(variant, TEMPLATE_DIMS)))


def row_values(variant, d, causal, templates, ms, peer_ms) -> dict:
    """One row from measured medians: ``ms`` maps head dim -> ms (or an error string), ``peer_ms`` is torch
    flash's ms at d (None when it did not run). TFLOP/s count each problem's own (real) d."""
    pad = padded_dim(d, templates)
    shape, tshape = problem(d, causal), problem(pad, causal, heads=heads_for(d))
    t, tt = ms.get(d), ms.get(pad)
    ok = lambda x: isinstance(x, float)  # noqa: E731
    return {
        "variant": variant, "causal": causal, "head_dim": d, "heads": shape.heads, "batch": shape.batch,
        "seqlen": SEQLEN, "pads_to": pad, "shape": shape.id, "template_shape": tshape.id,
        "ms": t if ok(t) else None, "template_ms": tt if ok(tt) else None,
        "tflops": timing.tflops(shape.flops, t) if ok(t) else None,
        "template_tflops": timing.tflops(tshape.flops, tt) if ok(tt) else None,
        "padded_over_template": t / tt if ok(t) and ok(tt) and pad != d else None,   # None: d is a template
        "torch_flash_tflops": timing.tflops(shape.flops, peer_ms) if peer_ms else None,
        "over_torch_flash": timing.speedup(peer_ms, t if ok(t) else None),
        "error": "; ".join(str(x) for x in (t, tt) if isinstance(x, str)) or None,
    }


def table(rows) -> tuple[list[str], list[list[str]]]:
    f = lambda x, spec=".1f": "" if x is None else format(x, spec)  # noqa: E731
    headers = ["variant", "mask", "d", "H", "pads to", "TFLOP/s at d (real d)", "TFLOP/s at template",
               "padded / template time", "torch-flash TFLOP/s at d", "X / flash", "note"]
    body = []
    for r in rows:
        same = r["pads_to"] == r["head_dim"]
        body.append([r["variant"], "causal" if r["causal"] else "full", r["head_dim"], r["heads"],
                     "(template)" if same else r["pads_to"], f(r["tflops"]), "" if same else f(r["template_tflops"]),
                     f(r["padded_over_template"], ".2f"), f(r["torch_flash_tflops"]), f(r["over_torch_flash"], ".2f"),
                     r["error"] or ""])
    return headers, body


# ------------------------------------------------------------------------------------------------ measuring
def _time(fn, shape, repeats, convert=None) -> float | str:
    """Median ms of ``fn`` on L2-rotating inputs of ``shape`` (each CuPy set passed through ``convert`` first,
    when given), or the error it raised (as text)."""
    import cupy
    try:
        sets = timing.gpu_input_sets(shape)
        if convert is not None:
            sets = [convert(s) for s in sets]
        return timing.median(timing.time_cuda(fn, warmup=3, repeats=repeats, rotate_inputs=sets))
    except Exception as e:  # noqa: BLE001 - one failing dim leaves its cell empty, the rest still runs
        return f"d={shape.head_dim}: {type(e).__name__}: {str(e)[:120]}"
    finally:
        sets = None
        cupy.get_default_memory_pool().free_all_blocks()


def _ours(variant, causal):
    import fa_variants as fav
    return lambda q, k, v: fav.attention(q, k, v, variant=variant, causal=causal)


def _flash_ms(torch, shape, repeats) -> float | None:
    """torch SDPA (flash backend) at ``shape``, or None (reported on stderr) where it raises."""
    if torch is None:
        return None
    peer = timing.torch_sdpa_fn(torch, "torch-flash", shape, 1.0 / math.sqrt(shape.head_dim))
    ms = _time(peer, shape, repeats, convert=lambda s: tuple(timing.as_torch_bhnd(torch, a) for a in s))
    if isinstance(ms, str):
        print(f"  torch-flash {ms}", file=sys.stderr)
        return None
    return ms


def measure(variants, repeats, on_row=None) -> list[dict]:
    """Every row, in order; ``on_row(rows so far)`` after each (main writes the JSON there, so that a run cut
    short by a time limit still leaves what it measured)."""
    torch, why = timing.torch_status()
    if torch is None:
        print(f"torch-flash column empty: {why}", file=sys.stderr)
    flash = {}        # (d, causal) -> ms, shared by the variants
    rows = []
    for variant in variants:
        templates = templates_of(variant)
        for causal in (False, True):
            for d in PADDED_DIMS:
                print(f"[{variant} d={d} {'causal' if causal else 'full'}]", file=sys.stderr, flush=True)
                pad = padded_dim(d, templates)
                ms = {dd: _time(_ours(variant, causal), problem(dd, causal, heads=heads_for(d)), repeats)
                      for dd in dict.fromkeys((d, pad))}
                if (d, causal) not in flash:
                    flash[d, causal] = _flash_ms(torch, problem(d, causal), repeats)
                rows.append(row_values(variant, d, causal, templates, ms, flash[d, causal]))
                if on_row is not None:
                    on_row(rows)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--variants", default="fa1,fa2")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from fa_variants import gpu
    if not gpu.available():
        sys.exit(f"headdims needs a CUDA GPU: {gpu.reason()}")
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        registry.get(v)
    meta = {"device": gpu.probe().name, "dtype": DTYPE, "seqlen": SEQLEN, "tokens": TOKENS, "repeats": args.repeats,
            "timer": "median CUDA-event time (fa_variants.timing.time_cuda), inputs rotating through > L2"}

    def write(rows):
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**meta, "rows": rows}, f, indent=1)

    rows = measure(variants, args.repeats, on_row=write)
    headers, body = table(rows)
    print(f"padded head dims ({DTYPE}, N = {SEQLEN}, B = {TOKENS // SEQLEN}, H = 2048 / d rounded; median "
          f"CUDA-event time; TFLOP/s with the real d; target padded / template <= 1.0)")
    print(tabulate(body, headers=headers, tablefmt="github", disable_numparse=True))


if __name__ == "__main__":
    main()
