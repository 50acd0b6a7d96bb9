"""Hugging Face transformers: ``fa_variants.attention`` as an attention implementation.

    from fa_variants.integrations.transformers import register
    register()                                    # name="fa_variants", variant="auto", backend="auto"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="fa_variants")

``register`` adds two functions under one name: an attention function to transformers' ``AttentionInterface``
and a mask function to its ``AttentionMaskInterface``. The mask function is the flash-attention path's rule
(``masking_utils.flash_attention_mask``) made strict: a causal or bidirectional pattern with no padding gives no
mask at all (no dense (N, N) mask is ever built) and the attention function runs ``fav.attention`` with
``causal=True`` or ``False``; a cache with more slots than tokens (StaticCache) gives the tokens per sequence, an
int32 tensor the attention function passes to ``fav.attention_with_kvcache`` as ``cache_seqlens``; a padding
mask is handed on as it is (2D bool), and the attention function unpads the batch into a variable-length one
(``fav.attention_varlen``, as transformers' flash-attention path does); anything else a mask would be needed for
raises ``Unsupported`` (a NotImplementedError) saying what it was, instead of being
ignored.

What the attention function does with transformers' arguments:

* query (B, H, N, d) and key/value (B, H_kv, N_k, d) are turned into flash-attn's layout by ``transpose(1, 2)``,
  a view (``fav.attention`` honours strides whose last one is 1): no copy, and no ``repeat_kv`` (GQA/MQA go
  through as H_kv heads). The output is (B, N, H, d), as transformers expects.
* Decoding goes through ``fav.attention_with_kvcache`` (split-KV over the cache, one kernel launch per step on
  the GPU): every call with a StaticCache (its slots are the cache, the tokens in them ``cache_seqlens``, read on
  the device, so ``generate()`` with a static cache compiles to one graph under torch.compile), and with
  ``variant="auto"`` every step of at most 16 query tokens that wants no gradient (a DynamicCache's k/v are the
  cache, full). A named variant runs its own kernels through ``fav.attention`` otherwise.
* ``scaling`` is the softmax scale. ``is_causal`` (a kwarg, else ``module.is_causal``) is causal masking,
  bottom-right aligned, which is what a KV cache needs (queries are the last N of the N_k keys); a single query
  row (decoding) sees every key either way and runs without the mask.
* float16/bfloat16 inputs run as they are. float32 inputs (a float32 model, or float32 layer norms under PEFT)
  are cast to the autocast dtype when autocast is on, else to the dtype of the module's first 16-bit
  ``nn.Linear``, else to bfloat16, and the output is cast back to float32: the kernels take 16-bit inputs only
  (transformers' own flash path casts the same way). The cast is the one copy this path makes.
* A padded batch (a 2D mask with zeros, the dynamic cache) and sequences packed in rows (position_ids that
  restart at 0: the mask hook hands on the sequence ids transformers' packed pattern holds) run as a
  variable-length batch (``attention_varlen``), training included.
* ``sliding_window`` (Mistral, Gemma 2's alternate layers), ``softcap`` (Gemma 2) and ``s_aux`` (gpt-oss's sinks)
  go to ``fav.attention``'s ``window=(sliding_window - 1, 0)``, ``softcap`` and ``sinks`` (and to
  ``attention_varlen``'s with padding or packing, and to ``attention_with_kvcache``'s when decoding), training
  included (the sinks get their gradient).
  On the GPU these run the masked kernels (fa3's forward on sm_90a, fa2's elsewhere; fa2's backward); the CPU
  tests below run the NumPy models, the GPU ones the kernels.
* ``Unsupported`` for: a 4D mask, padding with a StaticCache (under torch.compile, where the mask cannot be read
  on the host, a padded sequence of a StaticCache gets the length -1 instead, which the kernels turn into NaN
  rows), a StaticCache's sliding-window layers (their slots roll), ``cu_seq_lens_*`` without packed position_ids,
  chunked attention, custom mask overlays, position biases, a value head dim
  other than the query's, and attention dropout != 0 (there is no dropout in ``fav.attention``: transformers
  passes ``dropout=attention_dropout`` only in training, so set ``config.attention_dropout = 0`` or use
  ``model.eval()``).
* ``output_attentions=True`` gives ``None`` attention weights (as sdpa and flash do).

Gradients go through ``fav.attention``'s torch autograd Function (``fa_variants/integrations/torch.py``), so
training works wherever ``fav.attention_backward`` does: on the GPU through the variant's backward kernels (naive,
fa1, fa2; a forward without a backward of its own, such as fa3's that ``variant="auto"`` runs on Hopper, through
auto's backward), on the CPU through the NumPy models (``backend="numpy"`` or ``"auto"`` without a GPU).

Checked (tests/test_transformers.py) on the CPU with transformers 5.24 and 5.17 (and 5.25 for the cache paths):
a tiny Llama's logits, one training step's gradients and greedy generation against ``attn_implementation="sdpa"``,
64 new tokens at batch 1 and 4 with a DynamicCache and a StaticCache, and a StaticCache under torch.compile
(fullgraph); its CUDA tests (fa2's kernels inside the model, a training step through fa2's GPU backward) passed on
an H200 on 2026-12-01.
"""
from __future__ import annotations

import logging

import torch

from .. import api, decode, dispatch, varlen

__all__ = ["register", "Unsupported", "attention_function", "mask_function"]

_log = logging.getLogger(__name__)
_warned: set = set()
# transformers.masking_utils, bound by register(): mask_function runs inside the model's forward, which torch.compile
# traces, and Dynamo (torch 2.11) cannot trace an import through transformers' lazy module
_masking_utils = None


class Unsupported(NotImplementedError):
    """The model asked for something ``fa_variants`` attention cannot do (yet): a mask, dropout, a window..."""


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        _log.warning(msg)


def register(name: str = "fa_variants", variant: str = "auto", *, backend: str = "auto") -> str:
    """Register ``variant`` (run on ``backend``) with transformers as ``attn_implementation=name``.

    Adds ``attention_function(variant, backend)`` to ``transformers.AttentionInterface`` and ``mask_function``
    to ``transformers.AttentionMaskInterface`` under ``name`` (library-wide; registering a name again replaces
    it). Returns ``name``. Several names may be registered, e.g. one per variant or backend.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if name.startswith("paged|") or "/" in name or name in ("eager", "sdpa", "flex_attention") or \
            name.startswith("flash_attention"):
        raise ValueError(f"name {name!r} is one transformers gives a meaning of its own (a built-in, a "
                         "'paged|' prefix or a hub kernel 'org/repo'): choose another")
    dispatch.check_variant(variant)  # an unknown variant raises here, naming the known ones
    dispatch.check_backend(backend)
    global _masking_utils
    from transformers import masking_utils
    from transformers.modeling_utils import AttentionInterface

    _masking_utils = masking_utils
    AttentionInterface.register(name, attention_function(variant, backend))
    masking_utils.AttentionMaskInterface.register(name, mask_function)
    return name


# ------------------------------------------------------------------------------------------------------- masks
def mask_function(batch_size: int, q_length: int | None = None, kv_length: int | None = None, q_offset=None,
                  kv_offset: int = 0, mask_function=None, attention_mask: torch.Tensor | None = None,
                  **kwargs) -> torch.Tensor | None:
    """transformers' mask hook: ``None`` (no mask) for causal or bidirectional attention without padding, whose
    queries are the last ``q_length`` of the ``kv_length`` keys; for a cache with more slots than tokens, whose
    length is a tensor (StaticCache), the tokens per sequence: an int32 tensor (batch,), which the attention
    function reads as attention_with_kvcache's ``cache_seqlens``; a padding mask, (batch, kv_length) bool, for a
    padded batch; the sequence ids (batch, seqlen) int64 for packed sequences; ``Unsupported`` for everything
    else.

    The signature is that of ``masking_utils.flash_attention_mask`` (transformers 5.x); transformers 4.5x passed
    ``cache_position`` instead of ``q_offset``, which is read when it comes.
    """
    mu = _masking_utils
    if mu is None:   # called before any register()
        from transformers import masking_utils as mu
    if _is_cache_seqlens(attention_mask):   # made by this function for generate(), handed back by the model
        return attention_mask
    cache_position = kwargs.get("cache_position")
    if q_length is None:  # transformers 4.5x
        q_length = int(cache_position.shape[0])
    if kv_length is None:
        kv_length = q_length
    pattern = mu.causal_mask_function if mask_function is None else mask_function
    if pattern is mu.causal_mask_function:
        causal = True
    elif pattern is getattr(mu, "bidirectional_mask_function", None):
        causal = False
    elif _sliding_window(pattern, mu) is not None:
        # Causal within a sliding window: the attention function gets the window as its sliding_window argument
        # (the model passes it), so the mask is the causal one.
        causal = True
    elif attention_mask is None and (ids := _packed_sequence_ids(pattern, mu)) is not None:
        # Packed sequences (position_ids that restart, the packing collators): the tokens' sequence ids, from
        # which the attention function cuts the rows into a variable-length batch.
        return ids
    else:
        what = getattr(pattern, "__qualname__", None) or type(pattern).__name__
        raise Unsupported(
            f"fa_variants attention takes only plain causal or bidirectional attention; the model asked for a "
            f"mask pattern built by {what} (chunked attention, packed sequences beside a mask, a block overlay "
            f"or a custom and_/or_mask_function): use attn_implementation='sdpa' for this model or input")

    if isinstance(q_offset, torch.Tensor) or (q_offset is None and isinstance(cache_position, torch.Tensor)
                                              and torch.compiler.is_compiling()):
        # A cache that reports its length as a tensor (StaticCache: max_cache_len slots, the first q_offset +
        # q_length of them tokens) or whose positions cannot be read while tracing: the attention function gets
        # the tokens per sequence and runs attention_with_kvcache over the slots, reading nothing on the host.
        return _cache_seqlens(batch_size, q_offset, cache_position, q_length, attention_mask, kwargs.get("device"))
    q_start = _q_start(q_offset, cache_position)
    if kv_offset == 0 and q_start + q_length < kv_length:
        # The same cache before its first write (its length still the int 0): tokens in the first slots.
        return _cache_seqlens(batch_size, q_start, None, q_length, attention_mask, kwargs.get("device"))

    if attention_mask is not None:
        _check_mask_shape(attention_mask, kv_length, q_start, q_length, kv_offset)
        attention_mask = attention_mask[:, -kv_length:]
        if not bool(attention_mask.all()):
            # A padded batch: the attention function unpads it into a variable-length one (flash-attn's path).
            return attention_mask.to(torch.bool)
    if causal:
        # Bottom-right causal masking is right only when the queries are the last q_length of the keys, which
        # hold positions kv_offset .. kv_offset + kv_length - 1, every slot a token: true without a cache and
        # with a DynamicCache.
        if q_start + q_length != kv_offset + kv_length:
            raise Unsupported(_cache_slots_message(kv_length, q_start, q_length, kv_offset))
    return None


def _closure(f, maker: str) -> dict | None:
    """The variables a mask function made by transformers' ``maker`` closes over; None for another function."""
    import inspect
    if not getattr(f, "__qualname__", "").startswith(maker + ".<locals>."):
        return None
    return inspect.getclosurevars(f).nonlocals


def _sliding_window(pattern, mu) -> int | None:
    """The window of transformers' sliding-window causal pattern (and_masks(sliding_window_overlay(w),
    causal_mask_function)), None for any other pattern."""
    parts = (_closure(pattern, "and_masks") or {}).get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2 or mu.causal_mask_function not in parts:
        return None
    overlay = next((c for f in parts if (c := _closure(f, "sliding_window_overlay"))), None)
    return None if overlay is None else overlay.get("sliding_window")


def _packed_sequence_ids(pattern, mu) -> torch.Tensor | None:
    """The (batch, seqlen) sequence ids that transformers' packed-sequence pattern closes over (causal attention
    within each of several sequences packed in a row), or None for any other pattern. The pattern is
    and_masks(remap_positions_for_packed_sequence(causal_mask_function, ...), packed_sequence_mask_function(ids))
    in transformers 5.x; anything else, or another version's shape of it, is not recognised (then Unsupported)."""
    inner = (_closure(pattern, "and_masks") or {}).get("mask_functions")
    if not isinstance(inner, tuple) or len(inner) != 2:
        return None
    remap = next((p for f in inner if (p := _closure(f, "remap_positions_for_packed_sequence"))), None)
    packed = next((p for f in inner if (p := _closure(f, "packed_sequence_mask_function"))), None)
    if remap is None or packed is None or remap.get("mask_function") is not mu.causal_mask_function:
        return None
    ids = packed.get("packed_sequence_mask")
    return ids.to(torch.int64) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None


def _cache_seqlens(batch_size, q_offset, cache_position, q_length, attention_mask, device) -> torch.Tensor:
    """int32 (batch,): the tokens in each sequence's cache slots (q_offset + q_length), on the model's device."""
    if q_offset is None:
        q_offset = cache_position.reshape(-1)[0]
    if isinstance(q_offset, torch.Tensor):
        tokens = (q_offset + q_length).to(torch.int32).reshape(1).expand(batch_size)
    else:
        tokens = torch.full((batch_size,), q_offset + q_length, dtype=torch.int32, device=device)
    if attention_mask is not None:
        if not torch.compiler.is_compiling():
            _check_padding(attention_mask, attention_mask.shape[-1], None, q_length, 0)
        else:   # no host read while tracing: a padded sequence gets a length no cache has, hence NaN rows
            _check_mask_shape(attention_mask, attention_mask.shape[-1], None, q_length, 0)
            tokens = torch.where(attention_mask.all(dim=-1), tokens, torch.full_like(tokens, -1))
    return tokens.contiguous()


def _check_mask_shape(attention_mask, kv_length, q_start, q_length, kv_offset) -> None:
    """Unsupported for a mask that is not 2D over (at least) the last kv_length keys."""
    if attention_mask.dim() != 2:  # not from _preprocess_mask_arguments (a 4D mask skips this hook)
        raise Unsupported(f"fa_variants attention takes no dense attention mask (got one of shape "
                          f"{tuple(attention_mask.shape)}): pass none, or a 2D padding mask")
    if attention_mask.shape[-1] < kv_length:
        raise Unsupported(_cache_slots_message(kv_length, q_start, q_length, kv_offset))


def _check_padding(attention_mask, kv_length, q_start, q_length, kv_offset) -> None:
    """Unsupported for a mask that is not 2D ones over the last kv_length keys (a padded batch in a StaticCache)."""
    _check_mask_shape(attention_mask, kv_length, q_start, q_length, kv_offset)
    if not bool(attention_mask[:, -kv_length:].all()):
        raise Unsupported(
            "fa_variants attention takes a padding mask with the default (dynamic) cache, not with a StaticCache "
            "(attention_mask has zeros: left padding in generate): use cache_implementation='dynamic' for padded "
            "batches, or attn_implementation='sdpa'")


def _q_start(q_offset, cache_position):
    """The first query's position, an int."""
    if q_offset is None:
        q_offset = 0 if cache_position is None else cache_position[0]
    return int(q_offset)


def _cache_slots_message(kv_length, q_start, q_length, kv_offset=0) -> str:
    where = "" if q_start is None else f" for queries at positions {q_start}..{q_start + q_length - 1}"
    return (f"fa_variants attention needs k/v that hold exactly the tokens seen so far (a DynamicCache, or no "
            f"cache, or a StaticCache); got {kv_length} k/v slots starting at position {kv_offset}{where}, as a "
            f"sliding-window cache gives: that needs a mask, which is not implemented. Use the default dynamic "
            f"cache (generate(..., cache_implementation='dynamic')) or attn_implementation='sdpa'")


# --------------------------------------------------------------------------------------------------- attention
_PACKED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def attention_function(variant: str = "auto", backend: str = "auto"):
    """The function transformers calls as ``ALL_ATTENTION_FUNCTIONS[name](module, query, key, value,
    attention_mask, dropout=..., scaling=..., **kwargs) -> (attn_output (B, N, H, d), None)``."""
    dispatch.check_variant(variant)
    dispatch.check_backend(backend)

    def fa_variants_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                                      dropout: float = 0.0, scaling: float | None = None,
                                      is_causal: bool | None = None, sliding_window: int | None = None,
                                      softcap: float | None = None, s_aux: torch.Tensor | None = None,
                                      position_bias: torch.Tensor | None = None, **kwargs):
        cache_seqlens = padding = sequence_ids = None
        if _is_cache_seqlens(attention_mask):    # mask_function's answer for a StaticCache
            cache_seqlens, attention_mask = attention_mask, None
        elif _is_token_mask(attention_mask, key, torch.bool):   # mask_function's answer for a padded batch
            padding, attention_mask = attention_mask, None
        elif _is_token_mask(attention_mask, key, torch.int64):   # and for packed sequences
            sequence_ids, attention_mask = attention_mask, None
        if attention_mask is not None:
            raise Unsupported(
                f"fa_variants attention takes no attention mask (got a {attention_mask.dim()}D one of shape "
                f"{tuple(attention_mask.shape)}): a padding mask comes as 2D (through this integration's mask "
                f"function), and a custom 4D mask cannot be expressed as causal/non-causal. Use "
                f"attn_implementation='sdpa' for such inputs")
        if dropout:
            raise Unsupported(
                f"fa_variants attention has no attention dropout (dropout={dropout} from the model in training "
                f"mode): set config.attention_dropout = 0.0 (or train with attn_implementation='sdpa')")
        if position_bias is not None:
            raise Unsupported(f"fa_variants attention does not implement an additive position bias "
                              f"(position_bias={_short(position_bias)})")
        packed = [name for name in _PACKED if kwargs.get(name) is not None]
        if packed and sequence_ids is None:
            raise Unsupported(f"fa_variants attention takes packed sequences from position_ids that restart at 0 "
                              f"(transformers' packing collators give both); got {', '.join(packed)} without "
                              f"them")
        if query.shape[-1] != value.shape[-1] or key.shape[-1] != query.shape[-1]:
            raise Unsupported(f"fa_variants attention needs one head dim for query, key and value; got "
                              f"{query.shape[-1]}, {key.shape[-1]}, {value.shape[-1]}")
        if kwargs.get("output_attentions", False):
            _warn_once("output_attentions", "fa_variants attention does not return attention weights "
                       "(output_attentions=True gives None); use attn_implementation='eager' for them")

        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        # One query row (decoding with a cache) sees every key under bottom-right causal masking: no mask.
        causal = bool(causal) and query.shape[2] > 1
        scale = None if scaling is None else float(scaling)
        # transformers' window: key j is seen by query i when i - sliding_window < j <= i (flash-attn's (w - 1, 0))
        masks = dict(window=(-1, -1) if sliding_window is None else (int(sliding_window) - 1, 0),
                     softcap=0.0 if softcap is None else float(softcap))
        plain = sliding_window is None and softcap is None and s_aux is None
        if s_aux is not None:   # gpt-oss: one logit per head in every row's softmax denominator
            masks["sinks"] = s_aux

        q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (B, N, H, d) views: no copy
        out_dtype = q.dtype
        if out_dtype == torch.float32:
            dt = _half_dtype(module, q)
            q, k, v = (x.to(dt) for x in (q, k, v))
        if padding is not None:
            out = _padded(q, k, v, padding, variant=variant, causal=causal, softmax_scale=scale, backend=backend,
                          **masks)
        elif sequence_ids is not None:
            out = _packed(q, k, v, sequence_ids, variant=variant, softmax_scale=scale, backend=backend, **masks)
        elif cache_seqlens is not None or _decoding_step(variant, q):
            # The cache as attention_with_kvcache's k_cache, v_cache: the first cache_seqlens slots of each
            # sequence are its tokens (all of them for a DynamicCache), the queries the last of those.
            out = decode.attention_with_kvcache(
                q, k, v, cache_seqlens=k.shape[1] if cache_seqlens is None else cache_seqlens, causal=causal,
                softmax_scale=scale, backend=backend, **masks)
        elif not plain:
            out = api.attention(q, k, v, variant=variant, causal=causal, softmax_scale=scale, backend=backend,
                                **masks)
        else:
            out = api.attention(q, k, v, variant=variant, causal=causal, softmax_scale=scale, backend=backend)
        return (out if out.dtype == out_dtype else out.to(out_dtype)), None

    fa_variants_attention_forward.__qualname__ = f"fa_variants_attention_forward[{variant}, {backend}]"
    fa_variants_attention_forward.variant, fa_variants_attention_forward.backend = variant, backend
    return fa_variants_attention_forward


DECODE_QUERIES = 16   # a step of at most this many query tokens is decoding: attention_with_kvcache runs it


def _decoding_step(variant: str, q: torch.Tensor) -> bool:
    """Whether ``variant="auto"`` runs this call as a decoding step over the cache: a few query tokens, and no
    gradient wanted (attention_with_kvcache has no backward). A named variant always runs its own kernels."""
    return variant == "auto" and q.shape[1] <= DECODE_QUERIES and not (torch.is_grad_enabled() and q.requires_grad)


def _is_token_mask(mask, key: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``mask`` is one value of ``dtype`` per key token (batch, seqlen_k): mask_function's answers."""
    return (isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.dtype == dtype
            and mask.shape == (key.shape[0], key.shape[2]))


def _padded(q, k, v, keep, *, variant, causal, softmax_scale, backend, window, softcap, sinks=None):
    """A padded batch as flash-attn's variable-length one: the tokens ``keep`` (batch, seqlen_k) marks, packed
    (q's are the last seqlen_q of them), run by ``attention_varlen`` (causal bottom-right per sequence), and
    scattered back; padded query rows give zeros. Differentiable: the gather, attention_varlen's torch op and
    the scatter are all recorded for autograd."""
    keep_q = keep[:, -q.shape[1]:]
    lens_q, lens_k = keep_q.sum(1, dtype=torch.int32), keep.sum(1, dtype=torch.int32)
    cu_q, cu_k = (torch.nn.functional.pad(n.cumsum(0, dtype=torch.int32), (1, 0)) for n in (lens_q, lens_k))
    out = varlen.attention_varlen(q[keep_q], k[keep], v[keep], cu_q, cu_k, int(lens_q.max()), int(lens_k.max()),
                               causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
                               sinks=sinks, variant=variant, backend=backend)
    full = out.new_zeros(q.shape)
    full[keep_q] = out
    return full


def _packed(q, k, v, sequence_ids, *, variant, softmax_scale, backend, window, softcap, sinks=None):
    """Rows of packed sequences (``sequence_ids`` (batch, seqlen): which sequence each token is in, a new one
    wherever the id changes) as one variable-length batch of every row's sequences, causal within each."""
    batch, n = sequence_ids.shape
    starts = torch.ones_like(sequence_ids, dtype=torch.bool)
    starts[:, 1:] = sequence_ids[:, 1:] != sequence_ids[:, :-1]
    first = starts.reshape(-1).nonzero().reshape(-1).to(torch.int32)
    cu = torch.cat([first, first.new_tensor([batch * n])])
    longest = int((cu[1:] - cu[:-1]).max())
    flat = [x.reshape(batch * n, *x.shape[2:]) for x in (q, k, v)]
    out = varlen.attention_varlen(*flat, cu, cu, longest, longest, causal=True, softmax_scale=softmax_scale,
                                  window=window, softcap=softcap, sinks=sinks, variant=variant, backend=backend)
    return out.reshape(q.shape)


def _is_cache_seqlens(mask) -> bool:
    return isinstance(mask, torch.Tensor) and mask.dim() == 1 and mask.dtype == torch.int32


def _half_dtype(module, q: torch.Tensor) -> torch.dtype:
    """The 16-bit dtype float32 inputs run in: autocast's, else the module's first 16-bit Linear's, else bf16."""
    half = (torch.float16, torch.bfloat16)
    dev = q.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        if dt in half:
            return dt
    for layer in module.modules() if isinstance(module, torch.nn.Module) else ():
        if isinstance(layer, torch.nn.Linear) and layer.weight.dtype in half:
            return layer.weight.dtype
    return torch.bfloat16


def _short(val) -> str:
    return f"a tensor of shape {tuple(val.shape)}" if isinstance(val, torch.Tensor) else repr(val)
