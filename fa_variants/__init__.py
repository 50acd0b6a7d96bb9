"""fa-variants: FlashAttention versions as raw CUDA kernels compiled at run time, each beside a NumPy model.

    import fa_variants as fav
    out = fav.attention(q, k, v, variant="fa2", causal=True)
    out, lse = fav.attention(q, k, v, causal=True, return_lse=True)    # what the backward needs
    dq, dk, dv = fav.attention_backward(dout, q, k, v, out, lse, causal=True)
    fav.variants()     # the registry
    fav.get("fa1")     # one entry: .launcher (GPU), .reference / .reference_backward (NumPy models), .io_model
"""
from . import fp8
from .api import BackendUnavailable, attention, clear_plans
from .backward import attention_backward
from .jit import CompileError
from .registry import Variant, get, variants

__all__ = ["attention", "attention_backward", "variants", "get", "Variant", "CompileError", "BackendUnavailable", "fp8",
           "clear_plans"]
__version__ = "0.1.0"
