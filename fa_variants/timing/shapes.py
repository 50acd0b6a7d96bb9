"""What a measurement is of: the attention problem (``Shape``), the directions a case times, and the FLOP
conventions that turn a time into TFLOP/s.

**TFLOP/s** = 4 * B * H * Nq * Nk * d / time, **halved for causal** (the flash-attn / FlashAttention-2 paper
convention, also used by the peer numbers in anchors/h200-peers.md). With bottom-right causal and Nq != Nk the
exact count of visible pairs differs; the convention is kept so that numbers compare with others'. The
**backward** counts 2.5x the forward's FLOPs and forward+backward 3.5x (``direction_flops``; flash-attn's
benchmark and the anchors' convention), whatever a given backward really computes (fa2's deterministic backward
does 3.5x, the standard one 2x: ``iomodel.backward_flops``).
"""
from __future__ import annotations

import dataclasses
import re
import statistics

_DTYPE_SHORT = {"float16": "fp16", "bfloat16": "bf16"}
_SHORT_DTYPE = {v: k for k, v in _DTYPE_SHORT.items()}


# ------------------------------------------------------------------------------------------------ arithmetic
def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal) -> float:
    """Forward FLOPs by the convention 4 * B * H * Nq * Nk * d, halved for causal (whatever the alignment)."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


def backward_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal) -> float:
    """Backward FLOPs by the convention: 2.5 x ``attention_flops`` (so also halved for causal)."""
    return FLOPS_FACTOR["bwd"] * attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal)


# ------------------------------------------------------------------------------------------------ directions
#: What a benchmark case times: the forward, the backward alone (given q, k, v, out, lse, dout), or both.
DIRECTIONS = ("fwd", "bwd", "fwdbwd")
DIRECTION_NAMES = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward+backward"}
DIRECTION_TAGS = {"fwd": "", "bwd": "bwd", "fwdbwd": "fwd+bwd"}   # suffix of group names and table headers
FLOPS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}           # x the forward's 4BHNqNkd (/2 causal)
_DIRECTION_ALIASES = {"fwd+bwd": "fwdbwd", "fwd_bwd": "fwdbwd", "forward": "fwd", "backward": "bwd"}


def parse_directions(text: str | None) -> tuple[str, ...]:
    """``FAV_BENCH_DIRECTIONS``: 'fwd,bwd,fwdbwd' (any subset, any order; empty or None: all) -> the
    directions in DIRECTIONS order. ValueError naming the bad entry and the choices."""
    if text is None or not text.strip():
        return DIRECTIONS
    asked = set()
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        part = _DIRECTION_ALIASES.get(part, part)
        if part not in DIRECTIONS:
            raise ValueError(f"FAV_BENCH_DIRECTIONS: unknown direction {part!r} in {text!r}; choose from "
                             f"{','.join(DIRECTIONS)} (comma-separated)")
        asked.add(part)
    if not asked:
        raise ValueError(f"FAV_BENCH_DIRECTIONS names no direction: {text!r}; choose from {','.join(DIRECTIONS)}")
    return tuple(d for d in DIRECTIONS if d in asked)


def direction_flops(shape: "Shape", direction: str = "fwd") -> float:
    """FLOPs of one call of ``direction`` on ``shape`` by the convention (forward x FLOPS_FACTOR)."""
    if direction not in FLOPS_FACTOR:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    return FLOPS_FACTOR[direction] * shape.flops


def bench_group(shape_id: str, direction: str = "fwd") -> str:
    """pytest-benchmark group of a case: 'shape=<id>' for the forward, 'shape=<id> bwd' and
    'shape=<id> fwd+bwd' for the others, so sorted groups keep one shape's directions next to each other."""
    tag = DIRECTION_TAGS[direction]
    return f"shape={shape_id}" + (f" {tag}" if tag else "")


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms > 0 else float("nan")


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


# ------------------------------------------------------------------------------------------------ shapes
@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention problem. ``id`` is a compact, parseable name used in benchmark ids and tables."""
    batch: int
    heads: int
    seqlen_q: int
    head_dim: int
    dtype: str = "bfloat16"
    causal: bool = False
    heads_kv: int | None = None      # None: = heads
    seqlen_k: int | None = None      # None: = seqlen_q

    @property
    def hkv(self) -> int:
        return self.heads if self.heads_kv is None else self.heads_kv

    @property
    def nk(self) -> int:
        return self.seqlen_q if self.seqlen_k is None else self.seqlen_k

    @property
    def itemsize(self) -> int:
        return 2

    @property
    def flops(self) -> float:
        return attention_flops(self.batch, self.heads, self.seqlen_q, self.nk, self.head_dim, self.causal)

    @property
    def input_bytes(self) -> int:
        """Bytes of one (q, k, v) set."""
        return self.itemsize * self.batch * self.head_dim * (self.heads * self.seqlen_q + 2 * self.hkv * self.nk)

    @property
    def id(self) -> str:
        parts = [_DTYPE_SHORT.get(self.dtype, self.dtype), f"d{self.head_dim}", f"N{self.seqlen_q}"]
        if self.nk != self.seqlen_q:
            parts.append(f"Nk{self.nk}")
        parts += [f"B{self.batch}", f"H{self.heads}"]
        if self.hkv != self.heads:
            parts.append(f"Hkv{self.hkv}")
        parts.append("causal" if self.causal else "full")
        return "-".join(parts)

    def __str__(self):
        return self.id

    @classmethod
    def parse(cls, text: str) -> "Shape":
        """Inverse of ``id``: 'bf16-d128-N4096-B4-H16-causal' -> Shape(...)."""
        fields = text.split("-")
        if len(fields) < 5 or fields[-1] not in ("causal", "full"):
            raise ValueError(f"not a shape id: {text!r} (expected like 'bf16-d128-N4096-B4-H16-causal')")
        dtype = _SHORT_DTYPE.get(fields[0], fields[0])
        vals = {}
        for f in fields[1:-1]:
            m = re.fullmatch(r"(d|Nk|N|B|Hkv|H)(\d+)", f)
            if not m:
                raise ValueError(f"not a shape id: {text!r} (bad field {f!r})")
            vals[m.group(1)] = int(m.group(2))
        return cls(batch=vals["B"], heads=vals["H"], seqlen_q=vals["N"], head_dim=vals["d"], dtype=dtype,
                   causal=fields[-1] == "causal", heads_kv=vals.get("Hkv"), seqlen_k=vals.get("Nk"))

