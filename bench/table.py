"""The README's forward results table from pytest-benchmark JSON, and the fp8 quantization budget per shape.

    FAV_TIMING_REST_S=0.2 pytest bench --benchmark-json=bench.json -k "not naive and not fa1 and not mma_sync"
    PYTHONPATH=$PWD python3 bench/table.py bench.json                   (TFLOP/s by CUDA events; the ratios)
    PYTHONPATH=$PWD python3 bench/table.py bench.json --fp8-budget      (fa3_fp8 quantizing in the call)

The table: one row per shape, TFLOP/s of each variant (this library's in registry order, the pre-quantized fp8
calls, torch's peers), fa3 / cuDNN by both timers, and each fp8 variant quantizing in the call and pre-quantized
over best16, the best 16-bit TFLOP/s of the row (this library's and torch's).

--fp8-budget reads issue 9's target for an fp8 variant quantizing in the call, at least 1.05x best16, as time. Per
shape: the time it allows (the FLOPs at 1.05 best16), the pre-quantized kernel's, what quantizing added, and the
margin left for quantization (allowed - pre-quantized); beside it the floor of any separate quantizer, reading K and
V in 16 bits and writing them in e4m3 at the card's copy rate (--copy-tbs: bytes read + written a second; 4.26 on
the H200, ../shared/anchors/h200-peers.md), Q left out as if the kernel quantized Q for free. Verdicts:
    pass        the quantizing call reached 1.05x best16
    kernel      margin < 0: the pre-quantized kernel alone is below the target
    floor       0 <= margin < the K/V floor: no separate quantizer can make it
    quantizer   otherwise: a quantizer nearer the copy rate could
(bench/convert_probe.py measures the other road, converting K and V inside the kernel.)
"""
from __future__ import annotations

import argparse
import json
import sys

from tabulate import tabulate

from fa_variants import registry
from fa_variants.timing.shapes import Shape
from fa_variants.timing.torch_peers import peer_names
from plot import forward_records  # (bench/, beside this script)

PREQUANT = "_prequant"
TARGET = 1.05
H200_COPY_TBS = 4.26


def load(paths) -> dict:
    """{shape id: {variant: extra_info}} from pytest-benchmark JSON files, shapes in the order first seen (a later
    file's case replaces an earlier one's)."""
    rows: dict = {}
    for path in paths:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit(f"{path}: not a readable pytest-benchmark JSON file ({e})") from None
        for shape_id, variant, info in forward_records(doc):
            rows.setdefault(shape_id, {})[variant] = info
    return rows


def fp8_names() -> list:
    return [v.name for v in registry.variants() if v.operand_dtype is not None]


def columns(rows: dict) -> list:
    """The variants present, this library's first (registry order, then other names such as fa2_mma_sync), then
    the pre-quantized fp8 calls, then torch's peers."""
    seen = {v for r in rows.values() for v in r}
    peers = [p for p in peer_names(True) if p in seen]
    ours = [v.name for v in registry.variants() if v.name in seen]
    pre = [f"{v}{PREQUANT}" for v in fp8_names() if f"{v}{PREQUANT}" in seen]
    rest = sorted(seen - set(ours) - set(pre) - set(peers))
    return ours + rest + pre + peers


def best16(row: dict) -> float | None:
    """The best 16-bit TFLOP/s of a row: every variant but the fp8 ones and their pre-quantized calls."""
    fp8 = set(fp8_names())
    vals = [i["tflops"] for v, i in row.items() if v.removesuffix(PREQUANT) not in fp8 and i.get("tflops")]
    return max(vals) if vals else None


def _ratio(row, a, b, key="tflops"):
    x, y = row.get(a, {}).get(key), row.get(b, {}).get(key)
    return x / y if x and y else None


def results_table(rows: dict) -> str:
    cols = columns(rows)
    fp8 = [v for v in fp8_names() if v in cols]
    headers = ["shape", *cols, "fa3 / cuDNN", "fa3 / cuDNN do_bench"]
    headers += [h for v in fp8 for h in (f"{v} / best16", f"{v} prequant / best16")]
    table = []
    for shape_id, row in rows.items():
        b16 = best16(row)
        line = [shape_id] + [row[v]["tflops"] if v in row and row[v].get("tflops") else None for v in cols]
        line += [_ratio(row, "fa3", "torch-cudnn"), _ratio(row, "fa3", "torch-cudnn", "tflops_do_bench")]
        for v in fp8:
            for name in (v, v + PREQUANT):
                t = row.get(name, {}).get("tflops")
                line.append(t / b16 if t and b16 else None)
        table.append(line)
    fmt = ["", *[".1f"] * len(cols), *[".3f"] * (len(headers) - 1 - len(cols))]
    return tabulate(table, headers=headers, tablefmt="github", floatfmt=fmt, missingval="-")


def budget(shape_id: str, row: dict, variant: str, copy_tbs: float) -> dict | None:
    """The time budget of ``variant`` quantizing in the call on one row (None without both of its calls and a
    16-bit peer)."""
    b16, quant, pre = best16(row), row.get(variant), row.get(variant + PREQUANT)
    if not (b16 and quant and pre):
        return None
    s = Shape.parse(shape_id)
    allowed_us = s.flops / (TARGET * b16 * 1e12) * 1e6
    pre_us, quant_us = pre["median_ms"] * 1e3, quant["median_ms"] * 1e3
    kv_bytes = 2 * s.batch * s.hkv * s.nk * s.head_dim * s.itemsize
    floor_us = 1.5 * kv_bytes / (copy_tbs * 1e12) * 1e6   # read in 16 bits, written in e4m3
    margin = allowed_us - pre_us
    verdict = ("pass" if quant_us <= allowed_us else "kernel" if margin < 0 else "floor" if margin < floor_us
               else "quantizer")
    return dict(shape=shape_id, ratio=allowed_us * TARGET / quant_us, allowed_us=allowed_us,  # = TFLOP/s / best16
                pre_us=pre_us, quant_us=quant_us, quantizing_us=quant_us - pre_us, margin_us=margin,
                kv_floor_us=floor_us, verdict=verdict)


def budget_table(rows: dict, variant: str, copy_tbs: float) -> str:
    out = [b for s, r in rows.items() if (b := budget(s, r, variant, copy_tbs))]
    if not out:
        return f"no shape has {variant}, {variant}{PREQUANT} and a 16-bit variant"
    keys = ["shape", "ratio", "allowed_us", "pre_us", "quant_us", "quantizing_us", "margin_us", "kv_floor_us",
            "verdict"]
    headers = ["shape", f"{variant} / best16", "allowed µs", "pre-quantized µs", "quantizing µs",
               "quantization µs", "margin µs", "K/V floor µs", "verdict"]
    text = tabulate([[b[k] for k in keys] for b in out], headers=headers, tablefmt="github",
                    floatfmt=["", ".3f", *[".1f"] * 6, ""])
    counts = {v: sum(b["verdict"] == v for b in out) for v in ("pass", "kernel", "floor", "quantizer")}
    return text + "\n\n" + ", ".join(f"{k}: {n}" for k, n in counts.items()) + f" (of {len(out)} shapes)"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="pytest-benchmark JSON files (pytest bench --benchmark-json=...)")
    ap.add_argument("--fp8-budget", action="store_true", help="the fp8 quantization budget per shape instead")
    ap.add_argument("--variant", default="fa3_fp8", help="the fp8 variant of --fp8-budget (default fa3_fp8)")
    ap.add_argument("--copy-tbs", type=float, default=H200_COPY_TBS,
                    help=f"the card's copy rate in TB/s, read + written (default {H200_COPY_TBS}: the H200)")
    args = ap.parse_args(argv)
    rows = load(args.json)
    if not rows:
        sys.exit(f"no forward benchmark of bench/test_bench.py in {', '.join(args.json)}")
    if args.fp8_budget and args.variant not in fp8_names():
        ap.error(f"--variant must be one of {', '.join(fp8_names())}, got {args.variant!r}")
    print(budget_table(rows, args.variant, args.copy_tbs) if args.fp8_budget else results_table(rows))


if __name__ == "__main__":
    main()
