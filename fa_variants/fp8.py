"""FP8 (e4m3) attention with FA3-style block scaling: quantize once, attend many times (a KV cache).

    import fa_variants as fav
    qz = fav.fp8.quantize(q, k, v)                  # fp16/bf16 CuPy (or DLPack) arrays, flash-attn layout
    out = fav.fp8.attention(qz, causal=True)        # e4m3 tensor cores; out in q's dtype
    out = fav.attention(q, k, v, variant="fa2_fp8") # the same, quantizing on the fly
    qz = fav.fp8.quantize(q, k, v, variant="fa3_fp8")   # for FA3's Hopper pipeline (sm_90a): its scale blocks

    kv = fav.fp8.quantize_kv(k, v)                  # a KV cache: quantize K and V once ...
    out = fav.fp8.attention(kv, q=q_new)            # ... and attend with each new fp16/bf16 q
    qz = fav.fp8.quantize(q, k, v, rotate=True)     # incoherent processing: Q and K times one random
                                                    # Hadamard rotation (Q K^T unchanged, outliers spread)

Q and K get one float32 scale per block of rows (the kernel's Q and K tiles), V one per channel, and V is
stored transposed with its keys permuted for the PV product (cuda_src/fp8_quantize.cu). The NumPy model of
the same arithmetic is ``fa_variants.reference.fp8``; ``python -m fa_variants.fp8_study`` is the FA3 paper's
accuracy experiment. fa2_fp8 needs compute capability 8.9: sm_89 runs e4m3 mma.sync (cuda_src/fa2_fp8_fwd.cu),
Hopper runs e4m3 wgmma (cuda_src/fa2_fp8_fwd_sm90.cu), since ptxas only emulates e4m3 mma.sync there
(docs/design.md). fa3_fp8 (cuda_src/fa3_fwd.cu's FP8 instances) is Hopper only. Tensors quantized for one variant
carry its scale blocks and are read by that variant's kernel (``attention`` follows ``qz.variant``).
"""
from __future__ import annotations

import dataclasses
import functools

from . import arrays
from .reference.fp8 import hadamard_rotation
from .kernels import fa2_fp8, fa3_fp8
from .registry import get

#: The fp8 variants and their launcher modules (quantize, quantize_q, quantize_kv, plan, run_quantized).
LAUNCHERS = {"fa2_fp8": fa2_fp8, "fa3_fp8": fa3_fp8}
NAME = "fa2_fp8"  # the default variant


@dataclasses.dataclass
class Quantized:
    """e4m3 Q (optional), K, V^T and their scales, as fa2_fp8's kernel reads them (CuPy arrays on one device)."""
    parts: dict    # q, sq (absent after quantize_kv), k, sk, vt, sv, seqlen_k, head_dim, tiles, dtypes
    wrap: object   # hands results back as the caller's array type
    variant: str = NAME  # the fp8 variant whose kernel reads them (its scale blocks)
    plans: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)  # call signature -> plan


def _check_variant(variant):
    if not isinstance(variant, str) or variant not in LAUNCHERS:
        raise ValueError(f"variant must be one of {sorted(LAUNCHERS)}, got {variant!r}")
    return variant


def _kernels(variant: str = NAME):
    """The variant's launcher module, once the GPU is known to run it."""
    ok, why = get(variant).available()
    if not ok:
        raise RuntimeError(f"{variant} cannot run on this GPU: {why}")
    return LAUNCHERS[variant]


def _import_gpu(q, k, v):
    entry = get(NAME)
    inp = arrays.import_arrays(q, k, v)
    arrays.check_shapes(inp, entry)
    if not inp.on_gpu:
        raise TypeError("q, k, v must be GPU arrays (CuPy, or torch/JAX through DLPack) to quantize on the GPU; "
                        "the NumPy model is fa_variants.reference.fp8")
    return inp


def _check_rotation(rotate, seed):
    if not isinstance(rotate, bool):
        raise TypeError(f"rotate must be True or False, got {rotate!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0 (it picks the rotation's random signs), got {seed!r}")
    return seed if rotate else None


@functools.lru_cache(maxsize=16)
def _rotation_on_device(d: int, seed: int, device_id: int):
    """The fp32 rotation matrix on one device, built once: a KV cache rotates every new q with it. Allocated by
    cudaMalloc, not from the caller's current pool, which this cache would otherwise keep a block of."""
    import cupy
    with cupy.cuda.Device(device_id), cupy.cuda.using_allocator(None):
        return cupy.asarray(hadamard_rotation(d, seed), dtype=cupy.float32)


def _rotated(x, seed):
    """x R for the seeded Hadamard rotation R of reference.fp8.hadamard_rotation, computed in fp32 and rounded
    back to x's dtype (that rounding, 2^-9 relative for bf16, is far below e4m3's 2^-4); x itself is unchanged."""
    if seed is None:
        return x
    import cupy
    R = _rotation_on_device(x.shape[3], seed, x.device.id)
    return (x.astype(cupy.float32) @ R).astype(x.dtype)


def quantize(q, k, v, *, rotate: bool = False, seed: int = 0, variant: str = NAME) -> Quantized:
    """Quantize fp16/bf16 q, k, v (GPU arrays, flash-attn layout) for ``attention``; checked like ``fav.attention``.
    ``rotate``: incoherent processing, q and k multiplied by one random orthogonal (Hadamard, ``seed``-ed signs)
    matrix before quantization. ``variant``: the fp8 kernel that will read them ("fa2_fp8" or "fa3_fp8")."""
    rot = _check_rotation(rotate, seed)
    _check_variant(variant)
    inp = _import_gpu(q, k, v)
    parts = _kernels(variant).quantize(_rotated(inp.q, rot), _rotated(inp.k, rot), inp.v)
    return Quantized({**parts, "rotation": rot}, inp.wrap, variant)


def quantize_kv(k, v, *, rotate: bool = False, seed: int = 0, variant: str = NAME) -> Quantized:
    """Quantize K and V only (a KV cache); ``attention(kv, q=...)`` quantizes each q on the fly (rotated like K)."""
    rot = _check_rotation(rotate, seed)
    _check_variant(variant)
    inp = _import_gpu(k, k, v)  # k stands in for q: the checks of q against k are then trivially met
    parts = _kernels(variant).quantize_kv(_rotated(inp.k, rot), inp.v)
    return Quantized({**parts, "rotation": rot}, inp.wrap, variant)


def _with_q(parts: dict, q, variant: str):
    """K/V-only ``parts`` plus a freshly quantized ``q``, checked against them; and q's wrap."""
    inp = _import_gpu(q, q, q)
    qa = inp.q
    b, hkv = parts["k"].shape[:2]
    d = parts["head_dim"]
    if qa.shape[0] != b or qa.shape[3] != d or qa.shape[2] % hkv:
        raise ValueError(f"q must be (batch={b}, seqlen_q, heads (a multiple of {hkv}), head_dim={d}) to match the "
                         f"quantized K/V, got shape {tuple(qa.shape)}")
    if qa.dtype != parts["kv_dtype"]:
        raise TypeError(f"q's dtype {arrays.dtype_name(qa.dtype)} differs from the quantized K/V's "
                        f"({arrays.dtype_name(parts['kv_dtype'])})")
    return {**parts, **_kernels(variant).quantize_q(_rotated(qa, parts["rotation"]))}, inp.wrap


def attention(qz: Quantized, *, q=None, causal: bool = False, softmax_scale: float | None = None,
              return_lse: bool = False):
    """Attention on quantized tensors: ``qz`` from ``quantize``, or from ``quantize_kv`` together with ``q`` (an
    fp16/bf16 GPU array of K/V's dtype, batch and head_dim, its heads a multiple of K/V's). Returns an array of
    the original q's type and dtype (and the LSE with ``return_lse``)."""
    if not isinstance(qz, Quantized):
        raise TypeError(f"qz must be the result of fa_variants.fp8.quantize or quantize_kv, got {type(qz).__name__}")
    if ("q" in qz.parts) == (q is not None):
        raise ValueError("pass q exactly when qz holds only K and V (fa_variants.fp8.quantize_kv); "
                         "qz from fa_variants.fp8.quantize already holds q")
    launcher = LAUNCHERS[qz.variant]
    if q is None:  # pre-quantized: the launch plan of this call signature, made and checked once per qz
        try:
            key = (type(causal), causal, type(softmax_scale), softmax_scale, type(return_lse), return_lse,
                   _current_device())
            plan = qz.plans.get(key)
        except TypeError:  # an unhashable argument: check_scalars reports it
            key = plan = None
        if plan is None:
            scale = arrays.check_scalars(causal, softmax_scale, return_lse, head_dim=qz.parts["head_dim"])
            plan = launcher.plan(qz.parts, causal=bool(causal), softmax_scale=scale, return_lse=bool(return_lse))
            if key is not None:
                qz.plans[key] = plan
        out, lse = launcher.run_quantized(plan, qz.parts)
        return (qz.wrap(out), qz.wrap(lse)) if return_lse else qz.wrap(out)
    scale = arrays.check_scalars(causal, softmax_scale, return_lse)  # the scalars first, the arrays after
    parts, wrap = _with_q(qz.parts, q, qz.variant)
    scale = arrays.default_scale(scale, parts["head_dim"])
    out, lse = launcher.attention_quantized(parts, causal=bool(causal), softmax_scale=scale,
                                            return_lse=bool(return_lse))
    return (wrap(out), wrap(lse)) if return_lse else wrap(out)


def _current_device() -> int:
    import cupy
    return cupy.cuda.runtime.getDevice()
