"""One launcher per variant, each an object with the ``Launcher`` interface (its module builds it as ``LAUNCHER``).

A launcher works on validated CuPy arrays, on the current stream; ``fa_variants.api`` does the validation and
the conversions. Importing a launcher module needs no GPU and no CuPy: they are imported when a kernel launches.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Protocol, runtime_checkable


@runtime_checkable
class Launcher(Protocol):
    """What the registry, the API, the CLI and the tests may ask of a variant's GPU side."""

    def forward(self, q, k, v, *, causal: bool, softmax_scale: float, return_lse: bool) -> tuple:
        """(out, lse or None) for validated CuPy q, k, v, on the current stream."""

    def tiles(self, head_dim: int, causal: bool = False, seqlen_k: int | None = None) -> tuple[int, int]:
        """(block_q, block_k) of the kernel a call of this head dim, mask and seqlen_k launches on this device
        (seqlen_k None: the longest rows'): what the IO model is run with, and what ``plan`` launches."""

    def compile_units(self, arch: str | None = None) -> dict[str, tuple[str, ...]]:
        """{source file in cuda_src/: template instances} that make up this launcher for ``arch`` (every arch
        when None): what `fa-variants build` and the NVRTC tests compile."""

    def extra_bytes(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, itemsize: int = 2,
                    heads_kv: int | None = None) -> int:
        """Device memory allocated beyond the output and the LSE."""

    def plan(self, q, k, v, *, causal: bool, softmax_scale: float, return_lse: bool):
        """A launch plan (kernels/launch.py) for validated CuPy q, k, v that the kernel takes as they are
        (aligned, head dim a multiple of 8), or None when this launcher has none (several launches per call)."""

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float,
                 deterministic: bool = True) -> tuple:
        """(dq, dk, dv) for validated CuPy arrays, on the current stream; NotImplementedError when the variant
        has no GPU backward (the registry entry's directions say which have one). ``deterministic``: the same
        bits on every run, where the kernels offer a choice (``backward_order``)."""


@dataclasses.dataclass(frozen=True)
class KernelLauncher:
    """The ``Launcher`` a kernel module builds from its functions: sources and their instances, per-arch
    restrictions (a wgmma source only for sm_90a), tile choice, launch, extra memory."""
    sources: Callable[[], Mapping[str, tuple[str, ...]]]       # {source: instances}, every arch
    forward_fn: Callable
    tiles_fn: Callable[..., tuple]                             # (head_dim, causal, seqlen_k) -> (BM, BN)
    extra_bytes_fn: Callable
    source_archs: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    plan_fn: Callable | None = None
    backward_fn: Callable | None = None
    # The order of the backward's sums across CTAs: "fixed" (the same bits on every run), "varies" (atomic adds),
    # "either" (backward_fn takes deterministic=: a fixed order, or a faster one that varies)
    backward_order: str = "fixed"

    def forward(self, q, k, v, *, causal, softmax_scale, return_lse):
        return self.forward_fn(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)

    def tiles(self, head_dim, causal=False, seqlen_k=None):
        return tuple(self.tiles_fn(head_dim, causal, seqlen_k))[:2]

    def compile_units(self, arch=None):
        return {s: tuple(e) for s, e in self.sources().items()
                if arch is None or s not in self.source_archs or arch in self.source_archs[s]}

    def extra_bytes(self, batch, heads, seqlen_q, seqlen_k, head_dim, itemsize=2, heads_kv=None):
        return self.extra_bytes_fn(batch, heads, seqlen_q, seqlen_k, head_dim, itemsize, heads_kv)

    def plan(self, q, k, v, *, causal, softmax_scale, return_lse):
        if self.plan_fn is None:
            return None
        return self.plan_fn(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)

    def backward(self, dout, q, k, v, out, lse, *, causal, softmax_scale, deterministic=True):
        if self.backward_fn is None:
            raise NotImplementedError("this launcher has no GPU backward")
        if self.backward_order == "either":
            return self.backward_fn(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                    deterministic=deterministic)
        return self.backward_fn(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale)
