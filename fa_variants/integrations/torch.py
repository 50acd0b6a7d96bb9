"""torch autograd and torch.compile for ``fa_variants.attention`` and ``fa_variants.attention_varlen`` (two opaque
custom ops each, forward and backward), and torch.compile for ``fa_variants.attention_with_kvcache`` (one, which
writes the cache in place).

``fa_variants::attention_fwd`` runs the forward (``forward.attention``, return_lse=True) and
``fa_variants::attention_bwd`` the backward (``backward.attention_backward``); ``register_autograd`` ties them
together (torch records them as one autograd Function node), and ``register_fake`` gives torch.compile their
output shapes, so a compiled graph keeps each as one call it does not trace into (our arrays cross DLPack/NumPy,
which a trace cannot follow).

``fa_variants.attention`` sends torch tensors here when one requires grad or when Dynamo traces them
(torch.compile), so it works in a compiled graph, fullgraph=True included; ``attention`` below is that same call,
without the detour. The LSE is returned detached: it is not differentiable.

The gradient of every variant's forward: the backward op runs the forward variant's own backward where it has
one (naive, fa1, fa2, fa3), and ``variant="auto"``'s backward (the fastest here: fa3's on Hopper, fa2's elsewhere)
for a forward without one (fa2_fp8, fa3_fp8, and ``auto`` itself), with the forward's causal and softmax_scale, on
the forward's out and lse. For the fp8 forwards that is the gradient of 16-bit attention at an fp8 forward's out
and lse. ``torch.use_deterministic_algorithms(True)`` asks the backward for its fixed order.
"""
# No `from __future__ import annotations`: torch.library infers the ops' schemas from real annotations.
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import arrays, backward, decode, dispatch, forward, varlen
from ..reference import masks


@torch.library.custom_op("fa_variants::attention_fwd", mutates_args=())
def _forward(q: Tensor, k: Tensor, v: Tensor, variant: str, causal: bool, softmax_scale: Optional[float],
             backend: str) -> Tuple[Tensor, Tensor]:
    # Detached: the op's body runs below autograd, but q, k, v may still say requires_grad, which DLPack refuses.
    return forward.attention(q.detach(), k.detach(), v.detach(), variant, causal, softmax_scale, True, backend)


@_forward.register_fake
def _forward_fake(q, k, v, variant, causal, softmax_scale, backend):
    b, nq, h, d = q.shape
    return q.new_empty((b, nq, h, d)), q.new_empty((b, h, nq), dtype=torch.float32)


def _deterministic(variant: str) -> bool | None:
    """torch's switch (torch.use_deterministic_algorithms) for the backward: True asks for the fixed order; else the
    variant's default. fa1's backward, which adds dQ atomically, keeps running either way (its dK and dV are
    deterministic, its dQ is not), rather than refusing a switch that torch itself treats as a warning or error."""
    return True if torch.are_deterministic_algorithms_enabled() and variant != "fa1" else None


@torch.library.custom_op("fa_variants::attention_bwd", mutates_args=())
def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, variant: str,
              causal: bool, softmax_scale: Optional[float], backend: str) -> Tuple[Tensor, Tensor, Tensor]:
    # Detached as in _forward: the saved q, k, v still say requires_grad, and DLPack refuses such tensors. The
    # flags are the forward's own (the autograd node carries them), so lse needs no spot check.
    return backward.attention_backward(*(t.detach() for t in (dout, q, k, v, out, lse)), variant=variant,
                                       causal=causal, softmax_scale=softmax_scale, backend=backend, check_lse=False,
                                       deterministic=_deterministic(variant))


@_backward.register_fake
def _backward_fake(dout, q, k, v, out, lse, variant, causal, softmax_scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, variant, causal, softmax_scale, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (dispatch.backward_variant(variant), causal, softmax_scale, backend)


def _grad(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _backward(_dense(dout, out), q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None


def _dense(dout, out):
    """The output gradient as the backwards take it. An unused output's may come as None, and sum()'s is an
    expanded (stride 0) tensor: give a dense one, as flash-attn does."""
    return torch.zeros_like(out) if dout is None else dout.contiguous()


_forward.register_autograd(_grad, setup_context=_setup_context)


def attention(q, k, v, *, variant: str = "auto", causal: bool = False, softmax_scale: Optional[float] = None,
              return_lse: bool = False, backend: str = "auto"):
    """``fa_variants.attention`` for torch tensors, recorded for autograd and opaque to torch.compile.

    Differentiable whatever ``variant`` runs the forward: one without a backward of its own (fa3, the fp8
    variants) is differentiated by ``variant="auto"``'s backward with the same causal and softmax_scale."""
    # The scalars are checked here, as attention() would, because the op's schema would otherwise report
    # causal=1 or a str scale in its own words; the arrays are checked inside, by forward.attention.
    dispatch.check_variant(variant)
    dispatch.check_backend(backend)
    arrays.check_scalars(causal, softmax_scale, return_lse)
    for name, x in zip(arrays.NAMES, (q, k, v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor like the others when a tensor requires grad, got "
                            f"{type(x).__name__}")
    out, lse = _forward(q, k, v, variant, bool(causal), None if softmax_scale is None else float(softmax_scale),
                        backend)
    return (out, lse.detach()) if return_lse else out


# ------------------------------------------------------------------------------------------------ KV cache
@torch.library.custom_op("fa_variants::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def _with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, page_table: Optional[Tensor],
                  k: Optional[Tensor], v: Optional[Tensor], causal: bool, softmax_scale: Optional[float],
                  num_splits: int, k_descale: Optional[Tensor], v_descale: Optional[Tensor], window_left: int,
                  window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                  sinks: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    # The cache is declared mutated whether or not k, v are given: torch.compile then orders this call after
    # every earlier write to the cache and before every later read, and never reuses a stale copy.
    return decode.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table,
                                         k=k, v=v, causal=causal, softmax_scale=softmax_scale, num_splits=num_splits,
                                         return_lse=True, k_descale=k_descale, v_descale=v_descale,
                                         window=(window_left, window_right), softcap=softcap,
                                         alibi_slopes=alibi_slopes, sinks=sinks)


@_with_kvcache.register_fake
def _with_kvcache_fake(q, k_cache, v_cache, cache_seqlens, page_table, k, v, causal, softmax_scale, num_splits,
                       k_descale, v_descale, window_left, window_right, softcap, alibi_slopes, sinks):
    b, nq, h, d = q.shape
    return q.new_empty((b, nq, h, d)), q.new_empty((b, h, nq), dtype=torch.float32)


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, page_table=None, k=None, v=None, causal=True,
                           softmax_scale=None, num_splits=0, return_lse=False, k_descale=None, v_descale=None,
                           window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None):
    """``fa_variants.attention_with_kvcache`` for torch tensors as one opaque op, so that torch.compile (and CUDA
    graphs under mode="reduce-overhead") take a decoding step whole. An int ``cache_seqlens`` becomes a tensor
    on q's device (checked by the kernels, as device lengths are)."""
    arrays.check_scalars(causal, softmax_scale, return_lse)
    num_splits = decode.model.check_num_splits(num_splits)
    if not isinstance(cache_seqlens, Tensor):
        if not isinstance(cache_seqlens, (int, torch.SymInt)) or isinstance(cache_seqlens, bool):
            raise TypeError(f"cache_seqlens must be an int or an int32 tensor, got {type(cache_seqlens).__name__}")
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    left, right = masks.check_window(window)
    out, lse = _with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, k, v, bool(causal),
                             None if softmax_scale is None else float(softmax_scale), num_splits, k_descale, v_descale,
                             left, right, masks.check_softcap(softcap), _as_tensor(alibi_slopes, q),
                             _as_tensor(sinks, q))
    return (out, lse) if return_lse else out


def _as_tensor(x, q: Tensor) -> Optional[Tensor]:
    """A side array (sinks, alibi_slopes) as the op's schema takes it: a tensor without grad (decoding has no
    backward); a NumPy array goes to q's device."""
    if x is None or isinstance(x, Tensor):
        return None if x is None else x.detach()
    return torch.as_tensor(arrays.to_numpy(x), device=q.device)


# ------------------------------------------------------------------------------------------------ varlen
@torch.library.custom_op("fa_variants::attention_varlen_fwd", mutates_args=())
def _varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                    max_seqlen_k: int, variant: str, causal: bool, softmax_scale: Optional[float], window_left: int,
                    window_right: int, softcap: float, sinks: Optional[Tensor], alibi_slopes: Optional[Tensor],
                    backend: str) -> Tuple[Tensor, Tensor]:
    return varlen.attention_varlen(q.detach(), k.detach(), v.detach(), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, causal=causal, window=(window_left, window_right), softcap=softcap,
                                   sinks=None if sinks is None else sinks.detach(), alibi_slopes=alibi_slopes,
                                   softmax_scale=softmax_scale, return_lse=True, variant=variant, backend=backend)


@_varlen_forward.register_fake
def _varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, variant, causal,
                         softmax_scale, window_left, window_right, softcap, sinks, alibi_slopes, backend):
    total_q, h, d = q.shape
    return q.new_empty((total_q, h, d)), q.new_empty((h, total_q), dtype=torch.float32)


@torch.library.custom_op("fa_variants::attention_varlen_bwd", mutates_args=())
def _varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, variant: str, causal: bool,
                     softmax_scale: Optional[float], window_left: int, window_right: int, softcap: float,
                     sinks: Optional[Tensor], alibi_slopes: Optional[Tensor],
                     backend: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks); dsinks is empty where no sinks are given (an op returns tensors only)."""
    grads = backward.attention_backward(*(t.detach() for t in (dout, q, k, v, out, lse)), variant=variant,
                                        causal=causal, softmax_scale=softmax_scale, backend=backend, check_lse=False,
                                        deterministic=_deterministic(variant), window=(window_left, window_right),
                                        softcap=softcap,
                                        sinks=None if sinks is None else sinks.detach(), alibi_slopes=alibi_slopes,
                                        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    return tuple(grads) if sinks is not None else (*grads, q.new_empty(0))


@_varlen_backward.register_fake
def _varlen_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, variant,
                          causal, softmax_scale, window_left, window_right, softcap, sinks, alibi_slopes, backend):
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, variant, causal, scale, left, right, softcap, sinks, slopes, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sinks, slopes)
    ctx.args = (max_q, max_k, dispatch.backward_variant(variant), causal, scale, left, right, softcap)
    ctx.backend = backend


def _varlen_grad(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k, sinks, slopes = ctx.saved_tensors
    dq, dk, dv, dsinks = _varlen_backward(_dense(dout, out), q, k, v, out, lse, cu_q, cu_k, *ctx.args, sinks, slopes,
                                          ctx.backend)
    return (dq, dk, dv) + (None,) * 10 + (None if sinks is None else dsinks, None, None)


_varlen_forward.register_autograd(_varlen_grad, setup_context=_varlen_setup_context)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, window, softcap,
                     softmax_scale, return_lse, variant, backend, sinks=None, alibi_slopes=None):
    """``fa_variants.attention_varlen`` for torch tensors (its arguments checked already), recorded for autograd
    (q, k, v and sinks) and opaque to torch.compile. The backward is ``variant``'s (auto's for a forward without
    one), with the forward's masks and bounds."""
    out, lse = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), variant,
                               bool(causal), None if softmax_scale is None else float(softmax_scale),
                               int(window[0]), int(window[1]), float(softcap), sinks, alibi_slopes, backend)
    return (out, lse.detach()) if return_lse else out


def attention_masked(q, k, v, *, causal, window, softcap, sinks, alibi_slopes, softmax_scale, return_lse, variant,
                     backend):
    """``fa_variants.attention`` with mask keywords for torch tensors, recorded for autograd: the dense batch as a
    packed one of equal lengths (a reshape; a copy only for strided inputs), through the varlen ops, and back."""
    b, n_q, h, d = q.shape
    n_k = k.shape[1]
    step = lambda n: torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=q.device)  # noqa: E731
    packed = [x.reshape(b * x.shape[1], x.shape[2], x.shape[3]) for x in (q, k, v)]
    out, lse = _varlen_forward(*packed, step(n_q), step(n_k), n_q, n_k, variant, bool(causal),
                               None if softmax_scale is None else float(softmax_scale), int(window[0]),
                               int(window[1]), float(softcap), sinks, alibi_slopes, backend)
    out = out.reshape(b, n_q, h, d)
    return (out, lse.detach().reshape(h, b, n_q).transpose(0, 1)) if return_lse else out
