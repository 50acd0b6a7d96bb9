"""``fa-variants compare [--backward]``: its flags, and which comparison runs (forward or backward, on the GPU or
the NumPy models on the CPU)."""
from __future__ import annotations

import argparse

from .. import gpu
from ..timing import torch_peers
from . import compare_backward, compare_forward
from .args import add_block_args, add_shape_args, non_negative, parse_variants, positive


def add_parser(sub) -> None:
    c = sub.add_parser("compare", help="run every variant (and torch SDPA) on the same inputs: time, "
                       "TFLOP/s, error, modeled HBM traffic, extra memory (the NumPy models without a GPU)")
    add_shape_args(c)
    c.add_argument("--repeats", type=positive, default=30, help="timed calls (median reported), default 30")
    c.add_argument("--warmup", type=non_negative, default=5, help="untimed calls first, default 5")
    c.add_argument("--numpy", action="store_true", help="run the NumPy models even when there is a GPU")
    c.add_argument("--flex", action="store_true",
                   help="FlexAttention (torch.compile of flex_attention, compiled per shape on first use) beside torch "
                   "SDPA's backends; needs torch")
    c.add_argument("--full-size", action="store_true",
                   help="NumPy models: run the requested shape even when it is large (slow), instead of a "
                   "CPU-sized version of it")
    add_block_args(c, "on-chip memory M in elements for --paper-blocks")
    c.add_argument("--backward", action="store_true",
                   help="compare the backward instead: our variants through fav.attention_backward (rows say "
                   "why where the GPU backward is unavailable), torch SDPA's flash and cuDNN backwards; TFLOP/s "
                   "count 2.5x the forward's FLOPs; dq/dk/dv errors against a float64 backward (the NumPy "
                   "backward models without a GPU)")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.dtype == "fp8" and not args.backward:  # the FP8 comparison: the fp8 variants on bf16 inputs
        args.dtype = "bfloat16"    # (quantized on the fly) beside the bf16 ones (fa3, fa3_fp8: Hopper only)
        args.variants = args.variants or "fa2,fa3,fa2_fp8,fa3_fp8"
    if args.flex:
        _check_flex(args)
    why_no_gpu = "forced by --numpy" if args.numpy else gpu.reason()
    notes = []
    if why_no_gpu and args.flex:
        notes.append(f"torch-flex not run: the NumPy models run without torch's peers ({why_no_gpu})")
    if args.backward:
        chosen, lacking = compare_backward.chosen_variants(args)
        if why_no_gpu:
            return compare_backward.on_numpy(args, chosen, why_no_gpu, lacking + notes)
        return compare_backward.on_gpu(args, chosen, lacking)
    chosen = parse_variants(args.variants)
    if why_no_gpu:
        return compare_forward.on_numpy(args, chosen, why_no_gpu, notes)
    return compare_forward.on_gpu(args, chosen)


def _check_flex(args: argparse.Namespace) -> None:
    """--flex asks for a torch peer by name: without torch (or FlexAttention in it), or with --no-torch, the command
    ends in one line rather than leaving the row out."""
    command = "fa-variants compare" + (" --backward" if args.backward else "")
    if args.no_torch:
        raise SystemExit(f"{command}: --flex times FlexAttention, a torch peer, and --no-torch leaves the torch "
                         f"peers out: give one of them")
    why = torch_peers.flex_status()
    if why:
        raise SystemExit(f"{command}: --flex needs FlexAttention: {why}")
