"""``attention()``: the public entry point of the forward.

A warm call (a signature validated before, whose plan is kept) costs a key, a dict lookup, an allocation and one
cuLaunchKernel (forward.py). On a miss, torch tensors that need autograd go through the torch custom ops
(integrations/torch.py), and everything else through forward.run: every check, then dispatch (which variant,
which backend: ``variant="auto"`` by default, choice.py), then a kernel or a NumPy model. The layers go one way:
api -> integrations.torch -> forward -> dispatch -> choice -> registry -> kernels, reference -> arrays.
"""
from __future__ import annotations

from . import arrays, forward, plans, varlen
from .dispatch import BackendUnavailable

__all__ = ["attention", "clear_plans", "BackendUnavailable"]

_PLANS = plans.PLANS


def attention(q, k, v, *, variant: str = "auto", causal: bool = False, softmax_scale: float | None = None,
              return_lse: bool = False, backend: str = "auto", window=(-1, -1), softcap: float = 0.0, sinks=None,
              alibi_slopes=None):
    """Scaled dot-product attention softmax(q k^T * scale) v in flash-attn's layout.

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim), heads % heads_kv == 0.
    Causal masking is bottom-right aligned; a row that sees no key gives zeros and lse = -inf.
    Returns an array of q's type, shape and dtype (and lse, float32 (batch, heads, seqlen_q), with return_lse).

    ``variant="auto"`` runs the fastest correct kernel for this GPU, dtype and head dim (``fav.explain_choice``
    says which and why), or without a usable GPU fa2's NumPy model; a name from ``fav.variants()`` runs that one.
    ``backend``: "auto" (the GPU when the variant runs here, else the NumPy model for host arrays), "cuda" or
    "numpy". Torch tensors that require grad are recorded for autograd (integrations/torch.py).

    ``window=(left, right)``, ``softcap``, ``sinks`` (heads,) and ``alibi_slopes`` (heads,) or (batch, heads):
    masks and logit transforms (varlen.py, docs/masks.md): the masked kernels run them on GPU arrays (fa3's forward
    on sm_90a, fa2's elsewhere; fa2's backward), the NumPy models on host arrays; under torch autograd q, k, v and sinks get their gradients.
    """
    if not varlen.is_plain(window, softcap, sinks, alibi_slopes):
        return varlen.attention_masked(q, k, v, variant=variant, causal=causal, softmax_scale=softmax_scale,
                                       return_lse=return_lse, backend=backend, window=window, softcap=softcap,
                                       sinks=sinks, alibi_slopes=alibi_slopes, plain=attention)
    try:
        key = forward.signature(q, k, v, variant, causal, softmax_scale, return_lse, backend)
        launch = None if key is None else _PLANS.get(key)
    except Exception:  # noqa: BLE001 - an unhashable argument, or arrays the keyer cannot read: the full path
        key = launch = None  # reports what is wrong with them
    if launch is not None:
        out, lse = launch(q, k, v)
        return (out, lse) if return_lse else out
    # Torch tensors that require grad, and torch tensors under torch.compile (Dynamo cannot trace DLPack), go
    # through torch custom ops whose body calls forward.attention on detached tensors. Checked only after a
    # plan miss, so it costs the warm path nothing: such a call never stores a plan under its own key
    # (requires_grad is part of it), so every such call misses and comes here. (This is forward.attention with
    # the detour between its lookup and its full path.)
    if arrays.torch_op_needed(q, k, v):
        from .integrations import torch as torch_ops
        return torch_ops.attention(q, k, v, variant=variant, causal=causal, softmax_scale=softmax_scale,
                                   return_lse=return_lse, backend=backend)
    return forward.run(q, k, v, variant, causal, softmax_scale, return_lse, backend, key)


def clear_plans() -> None:
    """Forget every cached launch plan: ``attention()``'s and the launchers'. Needed after changing the tile
    table or the shared-memory limit at run time, which change the tiles a plan was made with."""
    plans.clear()
