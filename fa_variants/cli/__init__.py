"""``fa-variants``: compare the variants on this machine, explain their HBM traffic, build every kernel, profile
their DRAM traffic.

    fa-variants compare [--batch 4 --heads 16 --seqlen 4096 --head-dim 128 --dtype bfloat16 --causal ...] [--backward]
    fa-variants explain fa2 [--seqlen 4096 --head-dim 128] [--paper-blocks [--sram 32768] | --blocks 128x64] [--backward]
    fa-variants build [--arch 80,86,89,90a] [--variants fa1,fa2] [--jobs N]
    fa-variants profile [shape flags of compare] [--variants fa2]     (needs a GPU and Nsight Compute's ncu)

The report goes to stdout; progress lines go to stderr. ``python -m fa_variants.cli`` works without installing.
One shape means the same problem with and without a GPU: without one, ``compare`` runs the NumPy models, scaled
down to a CPU-sized version of that shape unless ``--full-size`` (the first line says which shape ran).

One module per command (compare with compare_forward and compare_backward, explain, build, profile), each with its
``add_parser`` and ``run``; what they share: args (flags and their types), shapes (the problem and its checks),
blocks (the IO model's block choice), reference (the float64 reference's subsets and errors), rows (compare's loop
on the GPU), text (progress, cells, notes, the progress bar).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from .. import __version__
from ..timing.torch_peers import torch_grads_to_cupy  # noqa: F401 - bench/bwd_sweep.py imports it from here
from . import build, compare, explain, profile
from .args import Parser
from .text import INSTALL_HINT, err_text

COMMANDS = (compare, explain, build, profile)
_CUDA_MODULES = ("cupy", "cupy_backends", "cuda", "fastrlock")


def make_parser() -> argparse.ArgumentParser:
    p = Parser(prog="fa-variants", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is no file (captured): nothing to silence
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """The ``fa-variants`` command; returns the exit status."""
    args = make_parser().parse_args(argv)
    try:
        rc = args.func(args)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:  # `fa-variants explain fa2 | head -3`: the reader left; stop quietly, as cat would
        _quiet_stdout()
        return 128 + 13  # what a shell reports for a process ended by SIGPIPE
    except KeyboardInterrupt:
        print("fa-variants: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as e:  # CuPy (the cuda extra) missing where a command needs it
        if (e.name or "").split(".")[0] not in _CUDA_MODULES:
            raise
        print(f"fa-variants {args.command}: {err_text(e)}; {INSTALL_HINT}", file=sys.stderr)
        return 1
