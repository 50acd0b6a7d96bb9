"""FP8 (e4m3) attention in FA2's loop order with FA3-style block scaling: the NumPy model of ``fa2_fp8``.

Quantization (``quantize``), for inputs in flash-attn's layout (batch, seqlen, heads, head_dim):

* Q and K, ``granularity="block"``: one float32 scale per (batch, head, block of ``block`` rows), scale =
  amax / 448 (1 where amax = 0). Values are divided by the scale, so the block's largest entry lands on
  e4m3's largest finite value 448: inputs up to fp16's 65504 are scaled into range, never saturated. In the
  attention model the Q scale blocks are the kernel's Q blocks (B_r rows) and the K scale blocks its K blocks
  (B_c rows), so each (Q block i, K block j) pair carries ONE factor sq_i * sk_j that folds into the softmax
  scale of that pair: S_ij = (Qq_i Kq_j^T) * (sq_i * sk_j * softmax_scale).
* V, ``granularity="channel"``: one float32 scale per (batch, head, channel) over the whole sequence. The PV
  product reduces over keys; a scale per block of keys would differ between the terms of that sum and would
  have to be applied inside it (one extra multiply per K block per output element, or a rescaled P); a
  per-channel scale is constant along the reduction, factors out of it, and is applied once to O at the end
  (together with 1 / p_scale and 1 / l). The price: one outlier key inflates its channel's scale for every key.
* ``granularity="tensor"``: one scale for the whole tensor (the baseline of the FA3 paper's study).

Non-finite inputs. The amax ignores NaN and +-Inf (the kernel's reduction takes max(|x|) over finite x), so a
scale is always finite and positive; a NaN or Inf entry becomes e4m3 NaN (the format has no Inf). The NaN then
reaches exactly the rows it touches: a bad query row gives a NaN output row, a bad key every row that sees that
key, a bad V entry that channel of every row that sees its key. It never turns into a finite wrong answer,
and it never spreads through a shared scale to the other rows of its block.

Incoherent processing (``rotate=True``): Q and K are multiplied on the right, along head_dim, by the same
orthogonal R = H diag(s) / sqrt(d) (H the d x d Sylvester Hadamard matrix, s seeded random signs), which leaves
QK^T = (QR)(KR)^T unchanged and spreads an outlier of one channel over all d channels before quantizing.

The attention loop is ``reference/fa2.py``'s: outer Q blocks, inner K/V blocks, running max m, running sum l,
unnormalized O, one division at the end. P = exp(S - m_new) is summed into l in full precision BEFORE
rounding (the kernel sums its fp32 P, as fa2 does), then multiplied by ``p_scale`` (a power of two, so
exactly) and rounded to e4m3 for P Vq. e4m3's smallest normal is 2^-6 and its smallest subnormal 2^-9: without
the factor every probability below ~2^-10 of the row max would flush to zero, with 256 those down to ~2^-18
survive. Everything else is float64 (the kernel's e4m3 x e4m3 products are exact and its sums fp32).
"""
from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from .budget import Progress, pairs_visited
from .common import (AccessCounter, ModelResult, block_slices, block_visited, causal_visible,
                     heads_major, kv_head_of, logsumexp_from, normalize, rescale, row_exp, to_flash_layout, to_float64,
                     validate)

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0
GRANULARITIES = ("block", "channel", "tensor")
SCALINGS = ("block", "tensor")
DEFAULT_BLOCKS = (128, 64)  # forward()'s (block_q, block_k) when they are None

LOOPS = """\
quantize: Qq, sq per (b, h, B_r rows); Kq, sk per (b, h, B_c rows); Vq, sv per (b, h, channel)
for i in 1..T_r:           (one CTA each) load Qq_i, sq_i; O_i = 0, l_i = 0, m_i = -inf on chip
  for j in 1..T_c:         load Kq_j, sk_j, Vq_j; S_ij = (Qq_i Kq_j^T) * (sq_i sk_j scale)
                           m_new = max(m_i, rowmax S_ij); P_ij = exp(S_ij - m_new)
                           l_i = e^(m_i - m_new) l_i + rowsum P_ij            (fp32 P, before rounding)
                           O_i = e^(m_i - m_new) O_i + e4m3(p_scale P_ij) Vq_j
  write O_i * sv / (p_scale l_i) and LSE_i = m_i + log l_i (once)"""


@dataclasses.dataclass
class Quantized:
    """e4m3 values and their float32 scales: x ~= values * scale (broadcast as ``granularity`` says).

    values: float8_e4m3fn, the input's shape (batch, seqlen, heads, d).
    scale:  float32; "block": (batch, heads, ceil(seqlen / block)); "channel": (batch, heads, d); "tensor": ().
    """
    values: np.ndarray
    scale: np.ndarray
    granularity: str
    block: int | None = None

    def scale_per_element(self) -> np.ndarray:
        """The scale broadcast to (batch, seqlen, heads, d), float64."""
        b, n, h, d = self.values.shape
        s = self.scale.astype(np.float64)
        if self.granularity == "tensor":
            return np.broadcast_to(s, (b, n, h, d))
        if self.granularity == "channel":
            return np.broadcast_to(s[:, None, :, :], (b, n, h, d))
        rows = np.repeat(s, self.block, axis=2)[:, :, :n]          # (b, h, n)
        return np.broadcast_to(rows.transpose(0, 2, 1)[..., None], (b, n, h, d))

    def dequantize(self) -> np.ndarray:
        """values * scale in float64, (batch, seqlen, heads, d)."""
        return self.values.astype(np.float64) * self.scale_per_element()


def _finite_amax(x: np.ndarray, axis) -> np.ndarray:
    """max |x| over ``axis`` ignoring NaN/Inf (0 where nothing finite): the scale never becomes NaN or Inf."""
    return np.where(np.isfinite(x), np.abs(x), 0.0).max(axis=axis)


def _scale_from(amax: np.ndarray) -> np.ndarray:
    scale = (amax / E4M3_MAX).astype(np.float32)
    # amax/448 can underflow float32 for tiny amax (< ~6e-43): fall back to 1 like amax = 0 (values are ~0).
    return np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)


def _cast(scaled: np.ndarray) -> np.ndarray:
    """float64 -> e4m3, round to nearest even. The clip only absorbs float32 rounding of the scale (|x| can
    exceed 448 by a float32 ulp); it never saturates a real value. NaN stays NaN (clip keeps it), Inf -> NaN."""
    finite = np.isfinite(scaled)
    return np.where(finite, np.clip(scaled, -E4M3_MAX, E4M3_MAX), np.nan).astype(E4M3)


def quantize(x, *, granularity: str = "block", block: int = 64) -> Quantized:
    """x (batch, seqlen, heads, d), any float dtype -> ``Quantized`` e4m3 values with float32 scales.

    granularity: "block" (per batch, head, block of ``block`` rows: Q and K), "channel" (per batch, head,
    channel over the whole sequence: V), "tensor" (one scale).
    """
    x = to_float64(x)
    if x.ndim != 4 or 0 in x.shape:
        raise ValueError(f"x must be (batch, seqlen, heads, head_dim) with every size >= 1, got {x.shape}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "tensor":
        q = Quantized(x, _scale_from(_finite_amax(x, axis=None)), "tensor")
    elif granularity == "channel":
        q = Quantized(x, _scale_from(_finite_amax(x, axis=1)), "channel")      # (b, h, d)
    else:
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
            raise ValueError(f"block must be an int >= 1, got {block!r}")
        b, n, h, d = x.shape
        t = -(-n // block)
        pad = np.zeros((b, t * block, h, d))
        pad[:, :n] = x
        amax = _finite_amax(pad.reshape(b, t, block, h, d), axis=(2, 4))       # (b, t, h)
        q = Quantized(x, _scale_from(amax).transpose(0, 2, 1).copy(), "block", int(block))
    q.values = _cast(_scaled_like_kernel(x, q.scale_per_element()))
    return q


def _scaled_like_kernel(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """x / scale computed as cuda_src/fp8_quantize.cu does: x (exact in fp32: it came from fp16/bf16) times the
    fp32 reciprocal of the fp32 scale, rounded to fp32. Dividing in float64 instead rounds differently for the odd
    value near an e4m3 rounding boundary, and one such q or k element moves a score by ~1e-2: enough to hide a
    real bug behind the model-vs-kernel tolerance."""
    with np.errstate(invalid="ignore", over="ignore"):
        inv = (np.float32(1.0) / scale.astype(np.float32)).astype(np.float32)
        return (x.astype(np.float32) * inv).astype(np.float32).astype(np.float64)


def dequantize(q: Quantized) -> np.ndarray:
    return q.dequantize()


# ----------------------------------------------------------------------------------------------- rotation

def sylvester_hadamard(d: int) -> np.ndarray:
    """The d x d Hadamard matrix of +-1 entries (Sylvester's construction); d a power of two."""
    H = np.ones((1, 1))
    while H.shape[0] < d:
        H = np.block([[H, H], [H, -H]])
    return H


def hadamard_rotation(d: int, seed: int = 0) -> np.ndarray:
    """Orthogonal R = H diag(s) / sqrt(d), float64 (d, d), s random +-1 from ``seed``. Apply as x @ R."""
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 or d & (d - 1):
        raise ValueError(f"incoherent processing (rotate=True) needs head_dim a power of two, got head_dim={d!r}")
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=int(d))
    return sylvester_hadamard(int(d)) * signs[None, :] / math.sqrt(d)


def rotate_qk(q, k, seed: int = 0):
    """(q R, k R) in float64 for the seeded R: q k^T is unchanged up to float64 rounding."""
    q, k = to_float64(q), to_float64(k)
    R = hadamard_rotation(q.shape[-1], seed)
    return q @ R, k @ R


# ----------------------------------------------------------------------------------------------- the model

def _truncate(x: np.ndarray, bits: int) -> np.ndarray:
    """x with its mantissa cut to ``bits`` bits (toward zero)."""
    m, e = np.frexp(x)
    return np.ldexp(np.trunc(m * 2.0 ** bits) / 2.0 ** bits, e)


def tc_matmul(a, b, accumulate_bits=None, acc=None):
    """acc + a @ b as a tensor core computes it: exact products, the reduction in 32-wide steps (one e4m3 MMA
    instruction each), the running sum cut to ``accumulate_bits`` mantissa bits after every step. None: exact.
    Hopper's e4m3 wgmma keeps about 14 bits (DeepSeek-V3 report, sec. 3.3.2); docs/design.md compares."""
    if accumulate_bits is None:
        return a @ b if acc is None else acc + a @ b
    out = np.zeros(a.shape[:-1] + b.shape[-1:]) if acc is None else acc
    for c in range(0, a.shape[-1], 32):
        out = _truncate(out + a[..., c:c + 32] @ b[..., c:c + 32, :], accumulate_bits)
    return out


def _check_p_scale(p_scale) -> float:
    p = float(p_scale)
    if not (p > 0 and math.isfinite(p) and math.frexp(p)[0] == 0.5 and p <= 256):
        raise ValueError(f"p_scale must be a power of two <= 256 (so that p_scale * P <= 448 exactly), got {p_scale!r}")
    return p



def quantized_operands(q64, k64, v64, scaling: str, block_q: int, block_k: int, rotate: bool, seed):
    """The e4m3 operands and their scales as the FP8 models' loops take them: heads-major float64 copies of the
    e4m3 values Q, K, V (K/V expanded to one per query head, as fa2's model) and the scales sq (b, h, T_r), sk
    (b, h, T_c), sv (b, h, d): per block of rows and per channel of V ("block"), or one per tensor ("tensor"),
    after the optional rotation of Q and K."""
    if rotate:
        q64, k64 = rotate_qk(q64, k64, seed)
    if scaling == "block":
        Qz, Kz, Vz = quantize(q64, block=block_q), quantize(k64, block=block_k), quantize(v64, granularity="channel")
    else:
        Qz, Kz, Vz = (quantize(a, granularity="tensor") for a in (q64, k64, v64))
    Q, K, V = heads_major(Qz.values, Kz.values, Vz.values)
    batch, heads, N_q, d = Q.shape
    kv = kv_head_of(heads, k64.shape[2])
    T_r, T_c = -(-N_q // block_q), -(-K.shape[2] // block_k)
    if scaling == "block":
        return (Q, K, V, Qz.scale.astype(np.float64), Kz.scale.astype(np.float64)[:, kv],
                Vz.scale.astype(np.float64)[:, kv])
    return (Q, K, V, np.full((batch, heads, T_r), float(Qz.scale)), np.full((batch, heads, T_c), float(Kz.scale)),
            np.full((batch, heads, d), float(Vz.scale)))

def forward(q, k, v, *, causal=False, softmax_scale=None, block_q=None, block_k=None, rotate=False, seed=0,
            scaling="block", p_scale=256.0, accumulate_bits=None) -> ModelResult:
    """FP8 attention, FA2 loop order; q (batch, seqlen_q, heads, d), k/v (batch, seqlen_k, heads_kv, d).

    scaling="block": Q scales per ``block_q`` rows, K per ``block_k`` rows (the kernel's blocks; None:
    ``DEFAULT_BLOCKS``), V per channel.
    scaling="tensor": one scale each for Q, K and V. ``rotate``: incoherent processing of Q and K with the
    ``seed``-ed Hadamard rotation. ``accumulate_bits``: both products on a tensor core that keeps that many
    mantissa bits while accumulating (``tc_matmul``); None is exact. Returns ``ModelResult`` (out float64 in
    flash layout, lse, hbm, blocks).
    """
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    p_scale = _check_p_scale(p_scale)
    # the other models' checks, on the raw inputs: the default scale comes from the original head_dim
    q64, k64, v64, scale = validate(q, k, v, causal=causal, softmax_scale=softmax_scale, block_q=block_q,
                                    block_k=block_k)
    block_q = DEFAULT_BLOCKS[0] if block_q is None else int(block_q)
    block_k = DEFAULT_BLOCKS[1] if block_k is None else int(block_k)
    Q, K, V, sq, sk, sv = quantized_operands(q64, k64, v64, scaling, block_q, block_k, rotate, seed)
    batch, heads, N_q, d = Q.shape
    N_k = K.shape[2]

    programs = batch * heads
    hbm = AccessCounter()  # elements, as fa2's model; the kernel's Q/K/V elements are 1 byte instead of 2
    O = np.zeros_like(Q)
    LSE = np.empty((batch, heads, N_q))
    progress = Progress(f"the fp8 NumPy model (forward, batch {batch} x heads {heads} x {N_q} x {N_k}, head_dim {d})",
                        pairs_visited(N_q, N_k, block_q, block_k, causal))
    for i, rows in enumerate(block_slices(N_q, block_q)):    # outer loop: Q blocks, one CTA each
        Q_i = Q[:, :, rows]
        hbm.read("Q", programs * Q_i.shape[2] * d)
        m_i = np.full(Q_i.shape[:3], -np.inf)
        l_i = np.zeros(Q_i.shape[:3])
        O_i = np.zeros(Q_i.shape)
        for j, cols in enumerate(block_slices(N_k, block_k)):  # inner loop: K/V blocks
            if causal and not block_visited(rows.stop - 1, cols.start, N_q, N_k):
                break
            K_j, V_j = K[:, :, cols], V[:, :, cols]
            hbm.read("K", programs * K_j.shape[2] * d)
            hbm.read("V", programs * V_j.shape[2] * d)
            pair_scale = sq[:, :, i] * sk[:, :, j] * scale   # folded into the softmax scale of this pair
            S_ij = tc_matmul(Q_i, K_j.swapaxes(-1, -2), accumulate_bits) * pair_scale[..., None, None]
            if causal:
                S_ij = np.where(causal_visible(np.arange(N_q)[rows], np.arange(N_k)[cols], N_q, N_k),
                                S_ij, -np.inf)
            m_new = np.maximum(m_i, S_ij.max(axis=-1))       # NaN propagates (np.maximum, ndarray.max)
            P = row_exp(S_ij, m_new)
            alpha = rescale(m_i, m_new)
            l_i = alpha * l_i + P.sum(axis=-1)               # full-precision P, summed before rounding
            P8 = (P * p_scale).astype(E4M3).astype(np.float64)  # exact scaling, then e4m3 rounding
            O_i = tc_matmul(P8, V_j, accumulate_bits, acc=alpha[..., None] * O_i)  # O accumulates in the MMA
            m_i = m_new
            progress.step()
        # one normalization per row, V's per-channel scale and 1/p_scale (a power of two: exact) with it
        O[:, :, rows] = normalize(O_i * (sv / p_scale)[:, :, None, :], l_i)
        LSE[:, :, rows] = logsumexp_from(m_i, l_i)
        hbm.write("O", programs * O_i.shape[2] * d)
        hbm.write("LSE", programs * O_i.shape[2])
    progress.close()
    return ModelResult(out=to_flash_layout(O), lse=LSE, hbm=hbm, blocks=(block_q, block_k))
