"""The torch peers a measurement puts beside ours: torch SDPA with one backend forced (FlashAttention-2, cuDNN, the
unfused math path) and FlexAttention, all on CuPy's stream so that the same CUDA events time them.

The backward peers: ``torch_sdpa_grad_sets`` runs SDPA's forward once (backend forced, q, k, v requiring grad)
outside any timed region and ``torch_grad_fn`` times ``torch.autograd.grad(out, (q, k, v), dout,
retain_graph=True)`` alone; ``torch_sdpa_fwdbwd_fn`` times both. torch stays an optional import: every function
takes the torch module that ``torch_status`` returned.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util

from .shapes import Shape

TORCH_BACKENDS = {"torch-flash": "FLASH_ATTENTION", "torch-cudnn": "CUDNN_ATTENTION"}
# The other torch peers: its unfused SDPA (autograd keeps the softmax P), for bench/recompute.py; and FlexAttention
# (torch.nn.attention.flex_attention under torch.compile: a Triton kernel on the GPU, compiled once per shape and
# direction), on by default in `pytest bench`, with --flex in `compare` and `bench/devcheck.py`.
FLEX = "torch-flex"
OTHER_TORCH_BACKENDS = {"torch-math": "MATH", FLEX: None}
TORCH_PEERS = (*TORCH_BACKENDS, FLEX)  # what the tables show as torch's, not ours (ratios: TORCH_BACKENDS only)


def peer_names(flex: bool) -> list[str]:
    """The torch peers a table times: SDPA's flash and cuDNN backends, and FlexAttention with ``flex``."""
    return [*TORCH_BACKENDS, *([FLEX] if flex else [])]


@functools.lru_cache(maxsize=1)
def _compiled_flex(torch):
    """flex_attention under torch.compile, one specialization per shape. Dynamo's recompile limit (8 by default)
    would otherwise send the ninth shape of a sweep to eager flex_attention, silently many times slower: raise it,
    and make hitting it an error rather than a fallback."""
    from torch.nn.attention.flex_attention import flex_attention
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 4096))
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True
    return torch.compile(flex_attention, dynamic=False)


def torch_flex_fn(torch, shape: Shape, softmax_scale: float, device: str = "cuda"):
    """A callable (q, k, v) -> out on torch (B, H, N, d) tensors: FlexAttention with this library's conventions,
    causal aligned bottom-right (key j visible to query i iff j <= i + N_k - N_q: a block mask, so fully masked
    blocks are skipped) and GQA by ``enable_gqa``. Compiled by torch.compile on first call (per shape)."""
    from torch.nn.attention.flex_attention import create_block_mask
    block_mask = None
    if shape.causal:
        diag = shape.nk - shape.seqlen_q
        block_mask = create_block_mask(lambda b, h, i, j: j <= i + diag, B=None, H=None, Q_LEN=shape.seqlen_q,
                                       KV_LEN=shape.nk, device=device)
    kwargs = dict(block_mask=block_mask, scale=float(softmax_scale), enable_gqa=shape.hkv != shape.heads)
    flex = _compiled_flex(torch)
    return lambda q, k, v: flex(q, k, v, **kwargs)


def torch_status() -> tuple[object, str]:
    """(torch module, '') when torch with CUDA is importable, else (None, why not)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return None, f"torch is not importable ({type(e).__name__})"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
    except Exception:  # noqa: BLE001
        return None, f"torch {torch.__version__} has no torch.nn.attention.sdpa_kernel (needs torch >= 2.3)"
    if not torch.cuda.is_available():
        return None, "torch has no CUDA device"
    return torch, ""


def torch_sdpa_unsupported(shape: Shape) -> str:
    """Why torch SDPA cannot compute the same thing as our kernels for ``shape`` ('' when it can)."""
    if shape.causal and shape.seqlen_q != shape.nk:
        return ("torch SDPA aligns the causal mask top-left when seqlen_q != seqlen_k; our kernels align it "
                "bottom-right (flash-attn >= 2.1), so the results differ")
    return ""


def as_torch_bhnd(torch, x):
    """CuPy (B, N, H, d) -> torch (B, H, N, d) view, zero-copy through DLPack."""
    try:
        t = torch.from_dlpack(x)
    except Exception:  # noqa: BLE001 - a DLPack without bf16: move the bits and reinterpret
        import numpy as np
        t = torch.from_dlpack(x.view(np.int16)).view(torch.bfloat16 if x.dtype.name == "bfloat16" else torch.float16)
    return t.transpose(1, 2)


def torch_sdpa_fn(torch, peer: str, shape: Shape, softmax_scale: float):
    """A callable (q, k, v) -> out (torch, (B, H, N, d)) running SDPA with one backend forced (``FLEX``:
    FlexAttention), on the current CuPy stream. ``peer`` is a key of TORCH_BACKENDS (or OTHER_TORCH_BACKENDS)."""
    import cupy
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ptr = cupy.cuda.get_current_stream().ptr
    if peer == FLEX:
        flex = torch_flex_fn(torch, shape, softmax_scale, device=f"cuda:{cupy.cuda.Device().id}")

        def flex_on_stream(q, k, v):
            with on_cupy_stream(torch, ptr):
                return flex(q, k, v)

        return flex_on_stream
    backend = getattr(SDPBackend, {**TORCH_BACKENDS, **OTHER_TORCH_BACKENDS}[peer])
    F = torch.nn.functional
    kwargs = dict(is_causal=bool(shape.causal), scale=float(softmax_scale))
    if shape.hkv != shape.heads:
        kwargs["enable_gqa"] = True

    def fn(q, k, v):
        with on_cupy_stream(torch, ptr), sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    return fn


def on_cupy_stream(torch, ptr: int | None = None):
    """A context in which torch's current stream is CuPy's (``ptr``, default: CuPy's current stream), so that
    torch work, and torch events, are ordered with our kernels; no-op when they are the same stream already."""
    if ptr is None:
        import cupy
        ptr = cupy.cuda.get_current_stream().ptr
    if torch.cuda.current_stream().cuda_stream == ptr:
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(ptr))


def torch_leaf_sets(torch, sets, douts=None):
    """[(q, k, v[, dout])] torch (B, H, N, d) views of CuPy input sets, q, k, v detached leaves that require
    grad (zero-copy: they share the CuPy arrays' memory), dout a plain view."""
    out = []
    for i, s in enumerate(sets):
        leaves = tuple(as_torch_bhnd(torch, a).detach().requires_grad_(True) for a in s)
        out.append(leaves + ((as_torch_bhnd(torch, douts[i]),) if douts is not None else ()))
    return out


def torch_sdpa_grad_sets(torch, peer: str, shape: Shape, softmax_scale: float, sets, douts):
    """For timing SDPA's backward alone: [(out, q, k, v, dout)] per input set, where the forward
    ``out = SDPA(q, k, v)`` (backend ``peer`` forced, q, k, v requiring grad) has run once, here, outside any
    timed region; ``out`` holds its autograd graph, which ``torch_grad_fn`` keeps (retain_graph) call after call.
    The backward runs the kernel of the forward's backend (the graph records which)."""
    fwd = torch_sdpa_fn(torch, peer, shape, softmax_scale)
    res = []
    for q, k, v, dout in torch_leaf_sets(torch, sets, douts):
        res.append((fwd(q, k, v), q, k, v, dout))
    return res


def torch_grad_fn(torch, ptr: int | None = None):
    """fn(out, q, k, v, dout) -> (dq, dk, dv): ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)``
    with torch's stream set to CuPy's (``ptr``, default CuPy's current stream), so it is ordered with, and timed
    by, events on that stream. (The backward kernels run on the stream their forward ran on: CuPy's, when the
    forward came from ``torch_sdpa_fn``.)"""
    if ptr is None:
        import cupy
        ptr = cupy.cuda.get_current_stream().ptr

    def fn(out, q, k, v, dout):
        with on_cupy_stream(torch, ptr):
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    return fn


def torch_sdpa_fwdbwd_fn(torch, peer: str, shape: Shape, softmax_scale: float):
    """fn(q, k, v, dout) -> (dq, dk, dv): SDPA's forward (backend ``peer`` forced) then its backward, on CuPy's
    current stream; q, k, v must require grad (``torch_leaf_sets``)."""
    import cupy
    ptr = cupy.cuda.get_current_stream().ptr
    fwd = torch_sdpa_fn(torch, peer, shape, softmax_scale)

    def fn(q, k, v, dout):
        out = fwd(q, k, v)
        with on_cupy_stream(torch, ptr):
            return torch.autograd.grad(out, (q, k, v), dout)

    return fn



def flex_status() -> str:
    """Why FlexAttention cannot be timed here ('' when torch has it): asked for by name (``compare --flex``), its
    absence is an error, not a row left out in silence."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (FlexAttention is torch.nn.attention.flex_attention: pip install torch)"
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a broken install
        return f"torch does not import ({type(e).__name__}: {e})"
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no FlexAttention (torch.nn.attention.flex_attention: torch >= 2.5)"
    return ""


def torch_grads_to_cupy(torch, grads, dtype):
    """torch (B, H, N, d) gradients -> CuPy arrays in flash-attn's (B, N, H, d) layout of ``dtype`` (bf16 through
    its 16-bit pattern: DLPack may not carry bfloat16)."""
    import cupy
    out = []
    for g in grads:
        t = g.detach().transpose(1, 2)
        if t.dtype == torch.bfloat16:
            out.append(cupy.from_dlpack(t.contiguous().view(torch.int16)).view(dtype))
        else:
            out.append(cupy.from_dlpack(t))
    return out
