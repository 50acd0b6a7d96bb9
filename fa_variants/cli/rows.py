"""``compare``'s loop on the GPU, forward and backward alike: our variants, then torch's peers, one result row
each, memory pools emptied between rows; and the line that says which GPU ran them."""
from __future__ import annotations

import argparse
import traceback

from .. import gpu, jit
from ..timing import torch_peers
from ..timing.shapes import Shape
from .text import err_text, progress

# failures that are a statement about the problem size, not a bug: reported in the table, exit code stays 0
EXPECTED_FAILURES = (MemoryError,)


def gpu_line() -> str:
    """'GPU: <name> (compute capability X.Y), CuPy <v>, NVRTC <v>': the first line of a comparison on the GPU."""
    import cupy
    dev = cupy.cuda.Device()
    return (f"GPU: {gpu.probe().name} (compute capability {dev.compute_capability}), CuPy {cupy.__version__}, "
            f"NVRTC {'.'.join(map(str, jit.nvrtc_version()))}")


def run_rows(chosen, shape: Shape, args: argparse.Namespace, what: str, run_torch, run_ours, skippable=()):
    """One result row per chosen variant (``run_ours(entry)``), then per torch peer (``run_torch(torch, name)``):
    an error row where one fails, a skipped row for a ``skippable`` exception, memory pools emptied between rows.
    Returns (results, unavailable variants with why, whether one of ours failed, the torch peers that ran, why
    torch did not)."""
    import cupy
    results, unavailable, failed = [], [], False
    torch, torch_why = (None, "--no-torch") if args.no_torch else torch_peers.torch_status()
    if torch is not None and torch_peers.torch_sdpa_unsupported(shape):
        torch_why = torch_peers.torch_sdpa_unsupported(shape)
        torch = None
    peers = torch_peers.peer_names(getattr(args, "flex", False)) if torch is not None else []
    todo = list(chosen) + peers
    for i, item in enumerate(todo, 1):
        label = item if isinstance(item, str) else item.name
        if not isinstance(item, str):
            ok, why = item.available()
            if not ok:
                unavailable.append((label, why))
                continue
        progress(f"[{i}/{len(todo)}] {label}{what} ...")
        try:
            results.append(run_torch(torch, item) if isinstance(item, str) else run_ours(item))
        except skippable as e:
            results.append(dict(variant=label, skipped=err_text(e, 300)))
        except Exception as e:  # noqa: BLE001 - our variants' failures set the exit code; a peer's do not
            failed |= not isinstance(item, str) and not isinstance(e, EXPECTED_FAILURES)
            if args.verbose:
                traceback.print_exc()
            results.append(dict(variant=label, error=err_text(e)))
        finally:
            cupy.get_default_memory_pool().free_all_blocks()
            if torch is not None:
                torch.cuda.empty_cache()
    return results, unavailable, failed, peers, torch_why
