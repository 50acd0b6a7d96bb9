"""fa-variants: FlashAttention versions as raw CUDA kernels compiled at run time, each beside a NumPy model.

    import fa_variants as fav
    out = fav.attention(q, k, v, variant="fa2", causal=True)
    fav.variants()     # the registry
    fav.get("fa1")     # one entry: .forward (GPU), .reference (NumPy model), .io_model (HBM traffic)
"""
from . import fp8
from .api import BackendUnavailable, attention
from .jit import CompileError
from .registry import Variant, get, variants

__all__ = ["attention", "variants", "get", "Variant", "CompileError", "BackendUnavailable", "fp8"]
__version__ = "0.1.0"
