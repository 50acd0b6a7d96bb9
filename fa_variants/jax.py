"""JAX: ``attention`` with a custom VJP (``fa_variants.attention`` forward, ``attention_backward`` for jax.grad).

The backward is the forward variant's own where it has one, else ``variant="auto"``'s (fa3 and the fp8 variants
have none), with the forward's causal and softmax_scale.

Eager only. The arrays reach the kernels and the NumPy models through DLPack/NumPy, which needs memory, and
a traced value (inside jax.jit, vmap, scan, ...) has none: such a call raises a TypeError saying so, before
anything is read. jax.grad outside jit is fine: the custom VJP's rules then see concrete arrays.
"""
from __future__ import annotations

import functools

import jax

from . import api, backward, dispatch


def attention(q, k, v, *, variant: str = "auto", causal: bool = False, softmax_scale: float | None = None,
              backend: str = "auto"):
    """``fa_variants.attention(q, k, v, ...)`` on JAX arrays, differentiable by jax.grad / jax.vjp."""
    return _attention(q, k, v, variant, causal, softmax_scale, backend)


def _eager_only(**arrays) -> None:
    traced = [n for n, x in arrays.items() if isinstance(x, jax.core.Tracer)]
    if traced:
        raise TypeError(f"fa_variants.jax.attention runs eagerly only, and {', '.join(traced)} "
                        f"{'is a' if len(traced) == 1 else 'are'} JAX tracer{'s' * (len(traced) > 1)} (inside "
                        "jax.jit, vmap, scan or another tracing transformation): its kernels and NumPy models "
                        "read memory through DLPack/NumPy, which a traced value does not have. Call it outside jit.")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _attention(q, k, v, variant, causal, softmax_scale, backend):
    return _forward(q, k, v, variant, causal, softmax_scale, backend)[0]


def _forward(q, k, v, variant, causal, softmax_scale, backend):
    _eager_only(q=q, k=k, v=v)
    out, lse = api.attention(q, k, v, variant=variant, causal=causal, softmax_scale=softmax_scale,
                             return_lse=True, backend=backend)
    return out, (q, k, v, out, lse)


def _backward(variant, causal, softmax_scale, backend, saved, dout):
    q, k, v, out, lse = saved
    _eager_only(dout=dout)
    # The flags are the forward's own (the VJP carries them), so lse needs no spot check.
    return backward.attention_backward(dout, q, k, v, out, lse, variant=dispatch.backward_variant(variant),
                                       causal=causal, softmax_scale=softmax_scale, backend=backend, check_lse=False)


_attention.defvjp(_forward, _backward)
