"""FP8 (e4m3) attention with FA3-style block scaling: quantize once, attend many times (a KV cache).

    import fa_variants as fav
    qz = fav.fp8.quantize(q, k, v)                  # fp16/bf16 CuPy (or DLPack) arrays, flash-attn layout
    out = fav.fp8.attention(qz, causal=True)        # e4m3 tensor cores; out in q's dtype
    out = fav.attention(q, k, v, variant="fa2_fp8") # the same, quantizing on the fly

Q and K get one float32 scale per block of rows (the kernel's Q and K tiles), V one per channel, and V is
stored transposed with its keys permuted for the PV product (cuda_src/fp8_quantize.cu). The NumPy model of
the same arithmetic is ``fa_variants.reference.fp8``; ``python -m fa_variants.fp8_study`` is the FA3 paper's
accuracy experiment. Needs compute capability 8.9 (e4m3 mma.sync); on sm_90 that instruction is emulated by
ptxas (e4m3 unpacked to f16 for HMMA), so it is correct but not faster there: see bench/NOTES.md.
"""
from __future__ import annotations

import dataclasses

from . import arrays
from .registry import get

NAME = "fa2_fp8"


@dataclasses.dataclass
class Quantized:
    """e4m3 Q, K, V^T and their scales, as fa2_fp8's kernel reads them (CuPy arrays on one device)."""
    parts: dict
    wrap: object

    @property
    def shape(self):
        """(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim)."""
        b, h, nq, d = self.parts["q"].shape
        return b, nq, self.parts["seqlen_k"], h, self.parts["k"].shape[1], d


def quantize(q, k, v) -> Quantized:
    """Quantize fp16/bf16 q, k, v (GPU arrays, flash-attn layout) for ``attention``; checked like ``fav.attention``."""
    entry = get(NAME)
    inp = arrays.import_arrays(q, k, v)
    arrays.check_shapes(inp, entry)
    if not inp.on_gpu:
        raise TypeError("q, k, v must be GPU arrays (CuPy, or torch/JAX through DLPack) to quantize on the GPU; "
                        "the NumPy model is fa_variants.reference.fp8")
    ok, why = entry.available()
    if not ok:
        raise RuntimeError(f"{NAME} cannot run on this GPU: {why}")
    return Quantized(entry.kernels.quantize(inp.q, inp.k, inp.v), inp.wrap)


def attention(qz: Quantized, *, causal=False, softmax_scale=None, return_lse=False):
    """Attention on quantized tensors (from ``quantize``): an array of the original q's type and dtype."""
    if not isinstance(qz, Quantized):
        raise TypeError(f"qz must be the result of fa_variants.fp8.quantize, got {type(qz).__name__}")
    scale = arrays.check_scalars(causal, softmax_scale, return_lse, head_dim=qz.shape[5])
    out, lse = get(NAME).kernels.attention_quantized(qz.parts, causal=bool(causal), softmax_scale=scale,
                                                     return_lse=bool(return_lse))
    return (qz.wrap(out), qz.wrap(lse)) if return_lse else qz.wrap(out)
