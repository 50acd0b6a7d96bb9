"""fa-variants: FlashAttention versions as raw CUDA kernels compiled at run time, each beside a NumPy model.

    import fa_variants as fav
    out = fav.attention(q, k, v, causal=True)                          # variant="auto": the fastest kernel here
    out = fav.attention(q, k, v, variant="fa1", causal=True)           # or any of fav.variants() by name
    out, lse = fav.attention(q, k, v, causal=True, return_lse=True)    # what the backward needs
    dq, dk, dv = fav.attention_backward(dout, q, k, v, out, lse, causal=True)
    out = fav.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True)
    fav.explain_choice(q, k, v)   # what "auto" runs forward and backward here, and why
    fav.variants()     # the registry
    fav.get("fa1")     # one entry: .launcher (GPU), .reference / .reference_backward (NumPy models), .io_model

The modules, top down (each imports only those below it): api (attention) and backward (attention_backward);
integrations.torch (autograd ops, imported by api for tensors that need it); forward (checks, plan cache, launch);
dispatch (variant="auto" and backends) over choice (the auto rule); registry over kernels/ and reference/;
arrays, plans, gpu, jit at the bottom.
"""
from . import fp8
from .api import attention, clear_plans
from .backward import attention_backward
from .decode import attention_with_kvcache, merge_states
from .dispatch import BackendUnavailable, explain_choice
from .jit import CompileError
from .registry import Variant, get, variants
from .varlen import attention_varlen

__all__ = ["attention", "attention_backward", "explain_choice", "variants", "get", "Variant", "CompileError",
           "BackendUnavailable", "fp8", "clear_plans", "attention_varlen",
           "attention_with_kvcache", "merge_states"]
__version__ = "0.1.0"
