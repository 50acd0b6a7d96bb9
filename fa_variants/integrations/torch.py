"""torch autograd and torch.compile for ``fa_variants.attention``: two opaque custom ops.

``fa_variants::attention_fwd`` runs ``api.attention`` (return_lse=True) and ``fa_variants::attention_bwd`` runs
``backward.attention_backward``; ``register_autograd`` ties them together (torch records them as one autograd
Function node), and ``register_fake`` gives torch.compile their output shapes, so a compiled graph keeps each as
one call it does not trace into (our arrays cross DLPack/NumPy, which a trace cannot follow).

``api.attention`` sends torch tensors here when one requires grad or when Dynamo traces them (torch.compile),
so ``fav.attention`` itself works in a compiled graph, fullgraph=True included; ``attention`` below is that same
call, without the detour. The LSE is returned detached: it is not differentiable.
"""
# No `from __future__ import annotations`: torch.library infers the ops' schemas from real annotations.
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import api, arrays, backward


@torch.library.custom_op("fa_variants::attention_fwd", mutates_args=())
def _forward(q: Tensor, k: Tensor, v: Tensor, variant: str, causal: bool, softmax_scale: Optional[float],
             backend: str) -> Tuple[Tensor, Tensor]:
    # Detached: the op's body runs below autograd, but q, k, v may still say requires_grad, which would send
    # api.attention back here (and DLPack refuses such tensors).
    return api.attention(q.detach(), k.detach(), v.detach(), variant=variant, causal=causal,
                         softmax_scale=softmax_scale, return_lse=True, backend=backend)


@_forward.register_fake
def _forward_fake(q, k, v, variant, causal, softmax_scale, backend):
    b, nq, h, d = q.shape
    return q.new_empty((b, nq, h, d)), q.new_empty((b, h, nq), dtype=torch.float32)


@torch.library.custom_op("fa_variants::attention_bwd", mutates_args=())
def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, variant: str,
              causal: bool, softmax_scale: Optional[float], backend: str) -> Tuple[Tensor, Tensor, Tensor]:
    # Detached as in _forward: the saved q, k, v still say requires_grad, and DLPack refuses such tensors.
    return backward.attention_backward(*(t.detach() for t in (dout, q, k, v, out, lse)), variant=variant,
                                       causal=causal, softmax_scale=softmax_scale, backend=backend)


@_backward.register_fake
def _backward_fake(dout, q, k, v, out, lse, variant, causal, softmax_scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, variant, causal, softmax_scale, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (variant, causal, softmax_scale, backend)


def _grad(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    # An unused output's gradient may come as None, and sum()'s is an expanded (stride 0) tensor: give the
    # backward a dense one, as flash-attn does.
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    dq, dk, dv = _backward(dout, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None


_forward.register_autograd(_grad, setup_context=_setup_context)


def attention(q, k, v, *, variant: str = "fa2", causal: bool = False, softmax_scale: Optional[float] = None,
              return_lse: bool = False, backend: str = "auto"):
    """``fa_variants.attention`` for torch tensors, recorded for autograd and opaque to torch.compile."""
    # The scalars are checked here, as attention() would, because the op's schema would otherwise report
    # causal=1 or a str scale in its own words; the arrays are checked inside, by attention().
    api.get(variant)
    if backend not in api.BACKENDS:
        raise ValueError(f"backend must be one of {list(api.BACKENDS)}, got {backend!r}")
    arrays.check_scalars(causal, softmax_scale, return_lse)
    for name, x in zip(arrays.NAMES, (q, k, v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor like the others when a tensor requires grad, got "
                            f"{type(x).__name__}")
    out, lse = _forward(q, k, v, variant, bool(causal), None if softmax_scale is None else float(softmax_scale),
                        backend)
    return (out, lse.detach()) if return_lse else out
