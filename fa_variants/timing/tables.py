"""The bench's results as tables: one ``Timed`` per case, ratios to the torch peers of the same shape and
direction by both timers (CUDA events and do_bench), and the summary printed at the end of ``pytest bench``.
Results carry a direction ("fwd", "bwd", "fwdbwd"); ratios are taken between cases of one shape and one
direction."""
from __future__ import annotations

import dataclasses
import math

from .shapes import DIRECTION_TAGS, DIRECTIONS, Shape, direction_flops, tflops
from .torch_peers import TORCH_BACKENDS, TORCH_PEERS

@dataclasses.dataclass(frozen=True)
class Timed:
    """One benchmark case's result: the shape, the variant, and its median time by each timer (ms)."""
    shape: Shape
    variant: str
    ms: float                          # EventTimer: pad kernel, inputs rotating through more than L2
    ms_do_bench: float | None = None   # user_view_ms (triton do_bench); None where triton is absent
    direction: str = "fwd"             # "fwd", "bwd" (the backward alone) or "fwdbwd"

    @property
    def flops(self) -> float:
        return direction_flops(self.shape, self.direction)


def speedup(peer_ms, ms) -> float | None:
    """TFLOP/s of a case over its peer's on the same shape (= peer time / case time); None if either is missing."""
    if peer_ms is None or ms is None or not (peer_ms > 0 and ms > 0):
        return None
    return peer_ms / ms


def _peer_key(peer: str) -> str:
    return "over_" + peer.replace("-", "_")          # 'torch-flash' -> 'over_torch_flash'


def peer_ratios(results, case: Timed) -> dict:
    """{'over_torch_flash': x, 'over_torch_flash_do_bench': y, 'over_torch_cudnn': ..., ...}: ``case`` against
    the torch peers among ``results`` on the same shape and in the same direction (a backward against torch's
    backward), by each timer (None where a peer or a time is missing). The bench runs the peers of a shape first,
    so every other case finds them measured on the same inputs."""
    found = {(r.shape.id, r.variant, r.direction): r for r in results}
    out = {}
    for peer in TORCH_BACKENDS:
        p = found.get((case.shape.id, peer, case.direction))
        out[_peer_key(peer)] = speedup(p.ms if p else None, case.ms)
        out[_peer_key(peer) + "_do_bench"] = speedup(p.ms_do_bench if p else None, case.ms_do_bench)
    return out


def _fmt(x, spec: str = ".2f") -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


#: The backward summary's focus: fa2 through the API, and fa2's mma.sync backward kernel timed directly (the bench's
#: opt-in ``fa2_bwd_kernel`` case).
BACKWARD_FOCUS = ("fa2", "fa2_bwd_kernel")
_TITLES = {
    "fwd": "forward TFLOP/s (median CUDA-event time; 4BHN^2d, /2 causal)",
    "bwd": "backward TFLOP/s (median CUDA-event time; 2.5 x 4BHN^2d, /2 causal; torch: autograd.grad of SDPA's "
           "output, forward excluded)",
    "fwdbwd": "forward+backward TFLOP/s (median CUDA-event time; 3.5 x 4BHN^2d, /2 causal)",
}


def summary_tables(results, focus=("fa2",),
                   backward_focus=BACKWARD_FOCUS) -> list[tuple[str, list[str], list[list[str]]]]:
    """[(title, headers, rows)] of the summary at the end of ``pytest bench``, for each direction that has results
    (forward, backward, forward+backward, in that order):

    1. TFLOP/s of every variant per shape (CUDA-event timer) and each of ours over torch-flash.
    2. For each ``focus`` variant that ran (``backward_focus`` for the backward directions): its TFLOP/s and its
       ratios over torch-flash and torch-cudnn by both timers (event timer and do_bench), one row per shape.
    Ratios compare cases of one shape and one direction; a backward's TFLOP/s counts 2.5x the forward FLOPs."""
    results = list(results)
    tables = []
    for direction in DIRECTIONS:
        these = [r for r in results if r.direction == direction]
        if these:
            tables += _direction_tables(these, direction, focus if direction == "fwd" else backward_focus)
    return tables


def _direction_tables(results, direction: str, focus) -> list:
    tag = DIRECTION_TAGS[direction]
    t = f" {tag}" if tag else ""
    by = {(r.shape.id, r.variant): r for r in results}
    shapes = list(dict.fromkeys(r.shape for r in results))
    seen = list(dict.fromkeys(r.variant for r in results))
    ours = [n for n in seen if n not in TORCH_PEERS]
    names = ours + [n for n in TORCH_PEERS if n in seen]        # ours first, whatever order the cases ran in
    has_flash = "torch-flash" in names
    headers = (["shape"] + [f"{n}{t} TFLOP/s" for n in names]
               + ([f"{n}{t} / flash{t}" for n in ours] if has_flash else []))
    rows = []
    for s in shapes:
        row = [s.id] + [_fmt(tflops(by[s.id, n].flops, by[s.id, n].ms) if (s.id, n) in by else None, ".1f")
                        for n in names]
        if has_flash:
            row += [_fmt(peer_ratios(results, by[s.id, n])["over_torch_flash"] if (s.id, n) in by else None)
                    for n in ours]
        rows.append(row)
    tables = [(_TITLES[direction], headers, rows)]
    what = {"fwd": "", "bwd": " backward", "fwdbwd": " forward+backward"}[direction]
    for v in (f for f in focus if f in names):
        head = ["shape", f"{v}{t} TFLOP/s", f"{v}{t} TFLOP/s do_bench"]
        for peer in TORCH_BACKENDS:
            short = peer.split("-")[1]
            head += [f"{v}{t} / {short}{t}", f"{v}{t} / {short}{t} do_bench"]
        body = []
        for s in shapes:
            r = by.get((s.id, v))
            if r is None:
                continue
            ratios = peer_ratios(results, r)
            db = tflops(r.flops, r.ms_do_bench) if r.ms_do_bench else None
            line = [s.id, _fmt(tflops(r.flops, r.ms), ".1f"), _fmt(db, ".1f")]
            for peer in TORCH_BACKENDS:
                line += [_fmt(ratios[_peer_key(peer)]), _fmt(ratios[_peer_key(peer) + "_do_bench"])]
            body.append(line)
        peers = f"torch SDPA's{what}" if what else "torch SDPA"
        tables.append((f"{v}{what} against {peers} on the same inputs, both timers (X / peer = peer time / X time)",
                       head, body))
    return tables


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A benchmark case that did not run, and why (the bench's backward cases record theirs)."""
    shape: Shape
    variant: str
    direction: str
    reason: str


def skip_lines(skipped) -> list[str]:
    """One line per (direction, variant, reason) among ``skipped``, with how many shapes it covers, in the order
    first seen: 'bwd naive: skipped on 6 shapes: <the reason>'."""
    counts = {}
    for s in skipped:
        key = (s.direction, s.variant, s.reason)
        counts[key] = counts.get(key, 0) + 1
    out = []
    for (direction, variant, reason), n in counts.items():
        tag = DIRECTION_TAGS[direction] or "fwd"
        out.append(f"{tag} {variant}: skipped on {n} shape{'s' if n != 1 else ''}: {reason}")
    return out
