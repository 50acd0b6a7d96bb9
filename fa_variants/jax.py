"""JAX: ``attention`` with a custom VJP (``fa_variants.attention`` forward, ``attention_backward`` for jax.grad).

The backward is the forward variant's own where it has one, else ``variant="auto"``'s (the fp8 variants have
none), with the forward's causal, softmax_scale and mask keywords (window, softcap, sinks with their gradient,
ALiBi).

Eager only. The arrays reach the kernels and the NumPy models through DLPack/NumPy, which needs memory, and
a traced value (inside jax.jit, vmap, scan, ...) has none: such a call raises a TypeError saying so, before
anything is read. jax.grad outside jit is fine: the custom VJP's rules then see concrete arrays.
"""
from __future__ import annotations

import functools

import jax

from . import api, backward, dispatch


def attention(q, k, v, *, variant: str = "auto", causal: bool = False, softmax_scale: float | None = None,
              backend: str = "auto", window=(-1, -1), softcap: float = 0.0, sinks=None, alibi_slopes=None):
    """``fa_variants.attention(q, k, v, ...)`` on JAX arrays, differentiable by jax.grad / jax.vjp, with its mask
    keywords (``window``, ``softcap``, ``sinks`` (heads,), which gets its gradient, and ``alibi_slopes``, which
    does not: a bias, not a parameter, as flash-attn treats it)."""
    window = tuple(window) if isinstance(window, (tuple, list)) else window
    return _attention(q, k, v, sinks, alibi_slopes, variant, causal, softmax_scale, backend, window, softcap)


def _eager_only(**arrays) -> None:
    traced = [n for n, x in arrays.items() if isinstance(x, jax.core.Tracer)]
    if traced:
        raise TypeError(f"fa_variants.jax.attention runs eagerly only, and {', '.join(traced)} "
                        f"{'is a' if len(traced) == 1 else 'are'} JAX tracer{'s' * (len(traced) > 1)} (inside "
                        "jax.jit, vmap, scan or another tracing transformation): its kernels and NumPy models "
                        "read memory through DLPack/NumPy, which a traced value does not have. Call it outside jit.")


# The differentiable arguments are q, k, v, sinks and alibi_slopes (arrays are not hashable, so not nondiff
# arguments; the slopes' cotangent is zero); the flags are static.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _attention(q, k, v, sinks, alibi_slopes, variant, causal, softmax_scale, backend, window, softcap):
    return _forward(q, k, v, sinks, alibi_slopes, variant, causal, softmax_scale, backend, window, softcap)[0]


def _forward(q, k, v, sinks, alibi_slopes, variant, causal, softmax_scale, backend, window, softcap):
    _eager_only(q=q, k=k, v=v, **({} if sinks is None else {"sinks": sinks}),
                **({} if alibi_slopes is None else {"alibi_slopes": alibi_slopes}))
    out, lse = api.attention(q, k, v, variant=variant, causal=causal, softmax_scale=softmax_scale,
                             return_lse=True, backend=backend, window=window, softcap=softcap, sinks=sinks,
                             alibi_slopes=alibi_slopes)
    return out, (q, k, v, sinks, alibi_slopes, out, lse)


def _backward(variant, causal, softmax_scale, backend, window, softcap, saved, dout):
    q, k, v, sinks, alibi_slopes, out, lse = saved
    _eager_only(dout=dout)
    # The flags are the forward's own (the VJP carries them), so lse needs no spot check.
    grads = backward.attention_backward(dout, q, k, v, out, lse, variant=dispatch.backward_variant(variant),
                                        causal=causal, softmax_scale=softmax_scale, backend=backend,
                                        check_lse=False, window=window, softcap=softcap, sinks=sinks,
                                        alibi_slopes=alibi_slopes)
    dsinks = grads[3] if sinks is not None else None
    dslopes = None if alibi_slopes is None else jax.numpy.zeros_like(alibi_slopes)
    return grads[0], grads[1], grads[2], dsinks, dslopes


_attention.defvjp(_forward, _backward)
