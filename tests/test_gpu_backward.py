"""fa2's GPU backward kernels against a float64 backward written here from the definition, and against
flash-attn's criterion: max-abs error at most 3x that of the same computation in the input dtype by torch. GPU
only. Each test runs both kernels where they run: mma_sync (kernels/fa2_bwd.py, every GPU) and wgmma
(kernels/fa2_bwd_sm90.py, sm_90 only; NOT YET RUN ON A GPU)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import fa_variants as fav
from conftest import GRAD_TOL, Case, new_seed, random_qkv_host, to_device, to_host

pytestmark = pytest.mark.gpu

CASES = [
    Case(1, 1, 1, 2, 2, 64, False),
    Case(2, 37, 37, 3, 3, 64, True),
    Case(1, 1000, 1000, 2, 2, 128, True),
    Case(1, 37, 300, 4, 2, 64, True),            # seqlen_q < seqlen_k, causal (bottom-right)
    Case(1, 300, 37, 4, 2, 64, True),            # seqlen_q > seqlen_k: rows that see no key
    Case(2, 257, 300, 16, 2, 64, False),         # GQA 8:1
    Case(2, 200, 200, 4, 1, 128, True),          # MQA
    Case(1, 130, 97, 4, 2, 32, False),
    Case(1, 130, 97, 4, 2, 80, True),            # padded head dim
    Case(1, 130, 97, 4, 2, 96, False),
    Case(1, 1000, 1000, 2, 2, 64, False, True),  # strided inputs
    Case(1, 200, 300, 4, 2, 256, True),          # wgmma: dK and dV in separate CTAs
    Case(1, 130, 97, 4, 2, 192, False),          # padded to 256
]
KERNELS = ["mma_sync", "wgmma"]


def _backward(kernel: str, head_dim: int):
    """The backward function of one kernel, or a skip where it does not run."""
    from fa_variants import gpu
    from fa_variants.kernels import fa2_bwd, fa2_bwd_sm90
    if kernel == "mma_sync":
        if head_dim > fa2_bwd.DIMS[-1]:
            pytest.skip(f"the mma_sync backward does not take head_dim {head_dim}")
        return fa2_bwd.backward
    if gpu.compute_capability() != 90:
        pytest.skip("the wgmma backward runs on sm_90 only")
    if not fa2_bwd_sm90.supports(head_dim):
        pytest.skip(f"the wgmma backward does not take head_dim {head_dim}")
    return fa2_bwd_sm90.backward


def backward64(dout, q, k, v, causal, scale):
    """dq, dk, dv in float64 from the definition (dk, dv summed over each group of query heads)."""
    dout, q, k, v = (np.asarray(a, dtype=np.float64) for a in (dout, q, k, v))
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    grp = h // hkv
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    visible = np.arange(nk)[None, :] <= (np.arange(nq) + nk - nq)[:, None] if causal else np.ones((nq, nk), bool)
    for bi in range(b):
        for hi in range(h):
            kh = hi // grp
            s = q[bi, :, hi] @ k[bi, :, kh].T * scale
            s = np.where(visible, s, -np.inf)
            mx = s.max(axis=1, keepdims=True)
            seen = np.isfinite(mx)
            e = np.where(seen, np.exp(s - np.where(seen, mx, 0)), 0)
            lsum = e.sum(axis=1, keepdims=True)
            p = np.where(lsum > 0, e / np.where(lsum > 0, lsum, 1), 0)
            o = p @ v[bi, :, kh]
            do = dout[bi, :, hi]
            dv[bi, :, kh] += p.T @ do
            dp = do @ v[bi, :, kh].T
            ds = p * (dp - (do * o).sum(axis=1, keepdims=True))
            dq[bi, :, hi] = ds @ k[bi, :, kh] * scale
            dk[bi, :, kh] += ds.T @ q[bi, :, hi] * scale
    return dq, dk, dv


def _run(case, dtype, rng, kernel="mma_sync"):
    import cupy
    backward = _backward(kernel, case.head_dim)
    host = random_qkv_host(rng, case.batch, case.seqlen_q, case.seqlen_k, case.heads, case.heads_kv,
                           case.head_dim, dtype)
    q, k, v = to_device(host, case.strided)
    dout_h = random_qkv_host(rng, case.batch, case.seqlen_q, case.seqlen_q, case.heads, case.heads, case.head_dim,
                             dtype)[0]
    dout = cupy.asarray(dout_h)
    scale = 1.0 / math.sqrt(case.head_dim)
    out, lse = fav.attention(q, k, v, variant="fa2", causal=case.causal, return_lse=True)
    grads = backward(dout, q, k, v, out, lse, causal=case.causal, softmax_scale=scale)
    return host, dout_h, grads, scale


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gradients_match_float64(request, case, dtype, kernel):
    seed = new_seed()
    request.node.user_properties.append(("seed", seed))
    rng = np.random.default_rng(seed)
    host, dout_h, (dq, dk, dv), scale = _run(case, dtype, rng, kernel)
    ref = backward64(dout_h, *host, case.causal, scale)
    bound = GRAD_TOL[dtype]
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        g = to_host(got).astype(np.float64)
        assert g.shape == want.shape and np.isfinite(g).all(), f"{name}: shape or non-finite values"
        err = np.linalg.norm(g - want) / max(np.linalg.norm(want), 1e-30)
        assert err <= bound, f"{name}: relative error {err:.3e} > {bound}"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_flash_attn_criterion_against_torch(rng, dtype, kernel):
    """max |grad - ref| at most 3x torch's own same-dtype error (math SDPA), flash-attn's test criterion."""
    torch = pytest.importorskip("torch")
    case = Case(2, 257, 257, 4, 4, 64, True)
    host, dout_h, grads, scale = _run(case, dtype, rng, kernel)
    ref = backward64(dout_h, *host, True, scale)
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    t = [torch.from_numpy(a.view(np.int16).copy()).view(tdt).cuda().transpose(1, 2).requires_grad_()
         for a in host]
    tdo = torch.from_numpy(dout_h.view(np.int16).copy()).view(tdt).cuda().transpose(1, 2)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True, scale=scale)
    tg = torch.autograd.grad(o, t, tdo)
    for name, ours, theirs, want in zip(("dq", "dk", "dv"), grads, tg, ref):
        mine = np.abs(to_host(ours).astype(np.float64) - want).max()
        torch_err = np.abs(theirs.transpose(1, 2).float().cpu().numpy().astype(np.float64) - want).max()
        assert mine <= 3 * torch_err + 1e-6, f"{name}: max-abs {mine:.3e} > 3 x torch's {torch_err:.3e}"


@pytest.mark.parametrize("kernel", KERNELS)
def test_bitwise_deterministic_and_no_key_rows_are_zero(rng, kernel):
    import cupy
    case = Case(1, 300, 100, 8, 2, 64, True)  # GQA 4:1; rows 0..199 see no key
    host, dout_h, g1, _ = _run(case, "bfloat16", rng, kernel)
    backward = _backward(kernel, case.head_dim)
    q, k, v = to_device(host)
    out, lse = fav.attention(q, k, v, variant="fa2", causal=True, return_lse=True)
    g2 = backward(cupy.asarray(dout_h), q, k, v, out, lse, causal=True, softmax_scale=0.125)
    g3 = backward(cupy.asarray(dout_h), q, k, v, out, lse, causal=True, softmax_scale=0.125)
    for a, b_ in zip(g2, g3):
        assert bool(cupy.array_equal(a.view(cupy.uint16), b_.view(cupy.uint16))), "two calls differ"
    dq = to_host(g1[0]).astype(np.float32)
    assert (dq[:, :200] == 0).all() and np.isfinite(dq).all()
