"""``fa-variants profile``: DRAM and L2 bytes of one call per variant, measured by Nsight Compute
(``fa_variants.profile`` runs ncu), beside the IO model's HBM bytes. Needs a GPU and ncu."""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from typing import Sequence

from tabulate import tabulate

from .. import gpu
from .. import profile as ncu
from ..registry import Variant
from ..timing.shapes import Shape
from ..timing.torch_peers import TORCH_BACKENDS, torch_sdpa_unsupported
from .args import add_block_args, add_shape_args, parse_variants, positive
from .blocks import Blocks
from .shapes import shape_from_args, validate


def add_parser(sub) -> None:
    f = sub.add_parser("profile", help="measure DRAM and L2 bytes of one call per variant with Nsight Compute "
                       "(ncu), beside the IO model's HBM bytes (needs a GPU and ncu)")
    add_shape_args(f)
    add_block_args(f, "on-chip memory M in elements for --paper-blocks")
    f.add_argument("--ncu", default=os.environ.get("NCU", "ncu"), help="the ncu executable (default: $NCU or ncu on PATH)")
    f.add_argument("--timeout", type=positive, default=900, help="seconds per ncu run, default 900")
    f.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    chosen = parse_variants(args.variants, "profile")
    shape = shape_from_args(args)
    chosen, notes = validate("profile", chosen, shape, explicit=bool(args.variants))
    return profile(shape, chosen, Blocks.from_args(args), ncu_exe=args.ncu, with_torch=not args.no_torch,
                   seed=args.seed, timeout=args.timeout, verbose=args.verbose, notes=notes)


def profile(shape: Shape, chosen: Sequence[Variant], blocks: Blocks, *, ncu_exe: str = "ncu", with_torch: bool = True,
            seed: int = 0, timeout: float = 900, verbose: bool = False, notes: Sequence[str] = ()) -> int:
    """Profile ``chosen`` registry entries (and torch SDPA) at ``shape``; print one table; the exit status."""
    exe = ncu.find_ncu(ncu_exe)
    probe = gpu.probe()
    missing = []
    if exe is None:
        missing.append(f"Nsight Compute's ncu ({ncu_exe!r} is not on PATH; --ncu or $NCU names another)")
    if not probe.ok:
        missing.append(f"a CUDA GPU ({probe.reason})")
    if missing:
        print(f"fa-variants profile: needs {' and '.join(missing)}; nothing measured", file=sys.stderr)
        return 1

    peers, peer_why = _torch_peers(shape) if with_torch else ([], "--no-torch")
    print(f"GPU: {probe.name} (compute capability {probe.cc / 10:.1f}); ncu {ncu.ncu_version(exe)}; shape "
          f"B={shape.batch}, H={shape.heads}, H_kv={shape.hkv}, N={shape.seqlen_q}, N_k={shape.nk}, "
          f"d={shape.head_dim}, {shape.dtype}, {'causal' if shape.causal else 'not causal'}; one call each")
    rows, lines, failed = [], list(notes), False
    todo = list(chosen) + peers
    for i, item in enumerate(todo, 1):
        name = item if isinstance(item, str) else item.name
        modeled = None
        if not isinstance(item, str):
            ok, why = item.available()
            if not ok:
                lines.append(f"{name} not run here: {why}")
                continue
            (b_r, b_c), _ = blocks.pick(item, shape.head_dim, shape.causal)
            try:
                modeled = item.hbm_bytes(shape.batch, shape.heads, shape.seqlen_q, shape.nk, shape.head_dim,
                                         b_r, b_c, shape.causal, shape.itemsize)
            except Exception:  # noqa: BLE001 - no model for this variant: the cell stays empty
                modeled = None
        print(f"[{i}/{len(todo)}] {name}: ncu ...", file=sys.stderr, flush=True)
        try:
            r = ncu.measure(exe, name, shape, seed=seed, timeout=timeout, verbose=verbose)
        except ncu.ProfileError as e:
            failed |= not isinstance(item, str)
            rows.append([name, _gb(modeled), f"error: {e}", "", "", "", ""])
            continue
        total = r.read + r.write
        rows.append([name, _gb(modeled), _gb(r.read), _gb(r.write), _gb(total), _gb(r.l2),
                     "—" if not modeled else f"{total / modeled:.2f}"])
        lines.append(f"{name}: {len(r.kernels)} kernel{'s' if len(r.kernels) != 1 else ''} in the call "
                     f"({r.kernel_summary()})")
    print(tabulate(rows, headers=["variant", "modeled HBM GB", "DRAM read GB", "DRAM write GB", "DRAM total GB",
                                  "L2 GB", "DRAM/modeled"], tablefmt="github", disable_numparse=True))
    head = [
        "DRAM read/write, L2: ncu's dram__bytes_read.sum, dram__bytes_write.sum, lts__t_bytes.sum, summed over "
        "every kernel of one call; ncu flushes the caches before each kernel (cold L2) and leaves the clocks "
        "alone (--clock-control none); L2 counts every byte between the SMs and L2; DRAM write stays below the "
        "output's size where the output is still in L2 (write-back) when the kernel ends",
        f"modeled HBM: the registry's hbm_bytes (fa_variants.iomodel) with {blocks.describe()}; fa2_fp8's model "
        "counts the attention kernel's e4m3 operands, not the quantization kernels the call also runs",
    ]
    if not peers:
        head.append(f"torch SDPA rows not run: {peer_why}")
    for j, n in enumerate(head + lines, 1):
        print(f"  [{j}] {n}")
    return 1 if failed or not rows else 0


def _torch_peers(shape: Shape) -> tuple[list[str], str]:
    if importlib.util.find_spec("torch") is None:
        return [], "torch is not importable"
    why = torch_sdpa_unsupported(shape)
    return ([], why) if why else (list(TORCH_BACKENDS), "")


def _gb(x) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x / 1e9:.4f}"
