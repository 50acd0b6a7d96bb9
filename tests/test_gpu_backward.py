"""The GPU backwards through ``fav.attention_backward``, for every registry variant whose directions include
"backward", against a float64 backward written here from the definition, and against flash-attn's criterion
(max-abs error at most 3x that of the same computation in the input dtype by torch). GPU only.

fa2 runs two kernels: the API picks wgmma (kernels/fa2_bwd_sm90.py) on sm_90 and mma.sync (kernels/fa2_bwd.py)
elsewhere; on sm_90 the implementation "fa2:mma_sync" runs the API with fa2's kernel choice patched to mma.sync so
that the mma.sync kernels (their column-split instances above d = 128 included) are tested there too.

Every gradient is computed on a CuPy memory pool whose free memory is NaN bytes (conftest's ``poisoned``), so an
element the backward forgets to write fails the comparison.
"""
from __future__ import annotations

import functools
import math
import zlib

import numpy as np
import pytest

import fa_variants as fav
from conftest import GRAD_TOL, Case, new_seed, random_qkv_host, to_device, to_host
from fa_variants import registry

pytestmark = pytest.mark.gpu

BACKWARD_VARIANTS = [v.name for v in registry.variants() if "backward" in v.directions]
# fa2 on Hopper: each scheme of kernels/fa2_bwd_sm90.py on every shape (the default picks by shape): the three
# passes ("separate") and the fused dQ ("writer"), "writer_few_sms" with the grid cut to 8 SMs, so that each group
# of CTAs takes several heads (causal: both directions)
SCHEMES = ["separate", "writer", "writer_few_sms"]
IMPLS = BACKWARD_VARIANTS + (["fa2:mma_sync"] + [f"fa2:{k}" for k in SCHEMES] if "fa2" in BACKWARD_VARIANTS else [])
# fa3 with dQ's shares added as they come (deterministic=False; the default is its fixed order), and on 8 SMs,
# where each CTA of its persistent grid takes several heads (causal: both directions) and a head of more than 8 K/V
# blocks (seqlen_k > 1024) runs the masked kernel with no mask, its walk a chunk of 8 blocks at a time
IMPLS += ["fa3:unordered", "fa3:few_sms"] if "fa3" in BACKWARD_VARIANTS else []
DTYPES = ["float16", "bfloat16"]
SEED = new_seed()  # one per test run: the inputs (and their float64 gradients) are shared by the implementations

CASES = [
    Case(1, 1, 1, 2, 2, 64, False),              # seqlen 1
    Case(2, 37, 37, 3, 3, 64, True),
    Case(1, 1000, 1000, 2, 2, 128, True),
    Case(1, 4097, 4097, 1, 1, 64, True),         # seqlen 4097, one head
    Case(1, 37, 300, 4, 2, 64, True),            # seqlen_q < seqlen_k, causal (bottom-right)
    Case(1, 300, 37, 4, 2, 64, True),            # seqlen_q > seqlen_k: rows that see no key
    Case(2, 257, 300, 16, 2, 64, False),         # GQA 8:1
    Case(2, 200, 200, 4, 1, 128, True),          # MQA
    Case(1, 130, 97, 4, 2, 32, False),
    Case(1, 130, 97, 4, 2, 37, True),            # odd head dim: zero-padded to 40 by the API, template 64
    Case(1, 130, 97, 4, 2, 80, True),            # template 96
    Case(1, 130, 97, 4, 2, 96, False),
    Case(1, 130, 97, 4, 2, 160, False),          # mma.sync: dK/dV in two column slices of 80
    Case(1, 130, 97, 4, 2, 192, False),          # wgmma: padded to 256
    Case(1, 97, 130, 4, 2, 200, True),           # template 224; seqlen_q < seqlen_k
    Case(1, 200, 300, 4, 2, 256, True),          # wgmma: a warpgroup per gradient; mma.sync: two slices
    Case(2, 333, 1000, 4, 2, 256, False),        # d 256 over many Q blocks, seqlen_q < seqlen_k, GQA
    Case(1, 300, 120, 8, 1, 256, True),          # MQA at 256, seqlen_q > seqlen_k
    Case(1, 1000, 1000, 2, 2, 64, False, True),  # strided inputs
    Case(1, 257, 300, 4, 2, 128, True, True),    # strided, causal
]


def _seed(request):
    request.node.user_properties.append(("seed", SEED))


def _variant(impl: str, monkeypatch) -> str:
    """The registry name of an implementation, with its environment set (or a skip where it is the default)."""
    name, _, kernel = impl.partition(":")
    if kernel:
        from fa_variants import gpu
        if gpu.compute_capability() != 90:
            pytest.skip(f"{name} runs {kernel} by default here")
        if kernel == "unordered":  # deterministic=False (_grads)
            return name
        if kernel == "few_sms":  # fa3's grid cut to 8 SMs (its launcher sizes it as fa2's fused dQ does)
            import cupy
            from fa_variants.kernels import common
            monkeypatch.setitem(common.SMS, cupy.cuda.Device().id, 8)
            return name
        if kernel not in SCHEMES:  # mma_sync: the kernel fa2's plan and backward take where the device has no wgmma
            from fa_variants.kernels import fa2
            monkeypatch.setattr(fa2, "uses_wgmma", lambda: False)
            return name
        mode, _, few = kernel.partition("_few")
        from fa_variants.kernels import fa2_bwd_sm90
        monkeypatch.setattr(fa2_bwd_sm90, "dq_mode", lambda d, causal: mode if d in fa2_bwd_sm90.FUSED_TILES
                            else "separate")
        if few:  # 8 SMs
            import cupy
            from fa_variants.kernels import common
            monkeypatch.setitem(common.SMS, cupy.cuda.Device().id, 8)
    return name


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


@functools.lru_cache(maxsize=None)
def _host(case: Case, dtype: str):
    """(q, k, v, dout) on the host in ``dtype`` and their float64 (dq, dk, dv): computed once per case and dtype."""
    rng = np.random.default_rng([SEED, zlib.crc32(f"{case.id}-{dtype}".encode())])
    host = random_qkv_host(rng, case.batch, case.seqlen_q, case.seqlen_k, case.heads, case.heads_kv,
                           case.head_dim, dtype)
    dout = random_qkv_host(rng, case.batch, case.seqlen_q, case.seqlen_q, case.heads, case.heads, case.head_dim,
                           dtype)[0]
    ref = backward64(dout, *host, case.causal, 1.0 / math.sqrt(case.head_dim))
    return host, dout, ref


def _inputs(name: str, case: Case, dtype: str, host=None, dout_h=None):
    """CuPy (dout, q, k, v, out, lse): the variant's own forward's out and lse."""
    import cupy
    if host is None:
        host, dout_h, _ = _host(case, dtype)
    q, k, v = to_device(host, case.strided)
    out, lse = fav.attention(q, k, v, variant=name, causal=case.causal, return_lse=True)
    return cupy.asarray(dout_h), q, k, v, out, lse


def _grads(name, case, args, poisoned, deterministic=None):
    """fav.attention_backward on a NaN-poisoned pool (every fresh allocation starts as NaN)."""
    with poisoned(case):
        return fav.attention_backward(*args, variant=name, causal=case.causal, deterministic=deterministic)


def _deterministic_of(impl: str) -> bool | None:
    return False if impl.endswith(":unordered") else None


def rel_err_floor(got, want) -> float:
    """||got - want|| / ||want||, with ||want|| floored at an RMS of 1e-3: a gradient that is exactly zero in
    float64 (seqlen 1: dS = 0) is compared in absolute terms instead of dividing by ~0."""
    floor = 1e-3 * math.sqrt(want.size)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), floor))


def assert_grads(grads, ref, dtype, what=""):
    bound = GRAD_TOL[dtype]
    for gname, got, want in zip(("dq", "dk", "dv"), grads, ref):
        g = to_host(got).astype(np.float64)
        assert g.shape == want.shape, f"{what} {gname}: shape {g.shape}, expected {want.shape}"
        bad = int((~np.isfinite(g)).sum())
        assert bad == 0, f"{what} {gname}: {bad} non-finite elements (unwritten memory is NaN here)"
        err = rel_err_floor(g, want)
        assert err <= bound, f"{what} {gname}: relative error {err:.3e} > {bound} ({dtype})"


# ------------------------------------------------------------------------------------------------ float64
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gradients_match_float64(request, monkeypatch, poisoned, case, dtype, impl):
    _seed(request)
    name = _variant(impl, monkeypatch)
    args = _inputs(name, case, dtype)
    grads = _grads(name, case, args, poisoned, _deterministic_of(impl))
    for g, a in zip(grads, args[1:4]):
        assert type(g) is type(a) and g.dtype == a.dtype
    assert_grads(grads, _host(case, dtype)[2], dtype, f"{impl} {case.id}")


# ------------------------------------------------------------------------------------------------ flash-attn
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_flash_attn_criterion_against_torch(request, monkeypatch, poisoned, head_dim, dtype, impl):
    """max |grad - ref| at most 3x torch's own same-dtype error (math SDPA), flash-attn's test criterion."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    _seed(request)
    name = _variant(impl, monkeypatch)
    case = Case(2, 257, 257, 4, 4, head_dim, True)
    host, dout_h, ref = _host(case, dtype)
    grads = _grads(name, case, _inputs(name, case, dtype), poisoned, _deterministic_of(impl))
    scale = 1.0 / math.sqrt(case.head_dim)
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    t = [torch.from_numpy(a.view(np.int16).copy()).view(tdt).cuda().transpose(1, 2).requires_grad_()
         for a in host]
    tdo = torch.from_numpy(dout_h.view(np.int16).copy()).view(tdt).cuda().transpose(1, 2)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True, scale=scale)
    tg = torch.autograd.grad(o, t, tdo)
    for gname, ours, theirs, want in zip(("dq", "dk", "dv"), grads, tg, ref):
        mine = np.abs(to_host(ours).astype(np.float64) - want).max()
        torch_err = np.abs(theirs.transpose(1, 2).float().cpu().numpy().astype(np.float64) - want).max()
        assert mine <= 3 * torch_err + 1e-6, f"{impl} {gname}: max-abs {mine:.3e} > 3 x torch's {torch_err:.3e}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_autograd_through_attention(request, monkeypatch, impl, dtype):
    """torch CUDA tensors that require grad: fav.attention -> loss.backward() (integrations/torch.py's autograd
    path) against torch float64 autograd, by flash-attn's criterion (3x torch's own same-dtype error). GQA 2:1,
    causal with seqlen_q == seqlen_k (torch's is_causal is top-left aligned, ours bottom-right: equal there)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    _seed(request)
    name = _variant(impl, monkeypatch)
    case = Case(2, 200, 200, 4, 2, 64, True)
    host, dout_h, _ = _host(case, dtype)
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]

    def tensor(a, dt=tdt):
        return torch.from_numpy(a.view(np.int16).copy()).view(tdt).to(device="cuda", dtype=dt)

    q, k, v = (tensor(a).requires_grad_() for a in host)
    dout = tensor(dout_h)
    out = fav.attention(q, k, v, variant=name, causal=True)
    assert isinstance(out, torch.Tensor) and out.requires_grad
    (out.float() * dout.float()).sum().backward()   # d loss / d out = dout
    ours = [t.grad for t in (q, k, v)]

    def sdpa_grads(dt):
        ts = [tensor(a, dt).requires_grad_() for a in host]
        group = case.heads // case.heads_kv
        qq, kk, vv = (x.transpose(1, 2) for x in ts)
        kk, vv = kk.repeat_interleave(group, dim=1), vv.repeat_interleave(group, dim=1)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        o.transpose(1, 2).backward(tensor(dout_h, dt))
        return [x.grad for x in ts]

    ref = [g.double() for g in sdpa_grads(torch.float64)]
    same_dtype = sdpa_grads(tdt)
    for gname, a, b_, r in zip(("dq", "dk", "dv"), ours, same_dtype, ref):
        assert a.dtype == tdt and a.shape == r.shape, f"{gname}: {a.dtype} {tuple(a.shape)}"
        mine = (a.double() - r).abs().max().item()
        theirs = (b_.double() - r).abs().max().item()
        assert mine <= 3 * theirs + 1e-6, f"{impl} {gname}: max-abs {mine:.3e} > 3 x torch's {theirs:.3e}"


# ------------------------------------------------------------------------------------------------ properties
DET_CASES = [Case(1, 300, 100, 8, 2, 64, True), Case(1, 300, 100, 8, 2, 256, True)]  # GQA 4:1; rows 0..199 see no key


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", DET_CASES, ids=[c.id for c in DET_CASES])
def test_deterministic_and_no_key_rows_are_zero(request, monkeypatch, poisoned, impl, case):
    """With deterministic=True, fa2 (both kernels), fa3 and naive: bitwise the same gradients on every call. fa1
    (which refuses deterministic=True on the GPU: test_fa1_refuses_deterministic): dK and dV too (each is one
    CTA's registers), dQ not (atomic adds in an order that varies), only close. fa3 with deterministic=False (dQ's
    shares added as they come): dK and dV bitwise, dQ close. Query rows that see no key: dQ exactly zero."""
    import cupy
    _seed(request)
    name = _variant(impl, monkeypatch)
    args = _inputs(name, case, "bfloat16")
    g1, g2 = (_grads(name, case, args, poisoned, True if name != "fa1" else None) for _ in range(2))
    bitwise = ("dq", "dk", "dv") if name != "fa1" else ("dk", "dv")
    if name == "fa3":
        g3 = _grads(name, case, args, poisoned, False)
        for gname, a, b_ in zip(("dq", "dk", "dv"), g1, g3):
            if gname == "dq":
                assert rel_err_floor(to_host(b_).astype(np.float64), to_host(a).astype(np.float64)) <= 1e-2
            else:
                assert bool(cupy.array_equal(a.view(cupy.uint16), b_.view(cupy.uint16))), f"{impl} {gname}"
    for gname, a, b_ in zip(("dq", "dk", "dv"), g1, g2):
        if gname in bitwise:
            assert bool(cupy.array_equal(a.view(cupy.uint16), b_.view(cupy.uint16))), f"{impl} {gname}: calls differ"
        else:
            assert rel_err_floor(to_host(a).astype(np.float64), to_host(b_).astype(np.float64)) <= 1e-2
    dq = to_host(g1[0]).astype(np.float32)
    assert np.isfinite(dq).all()
    assert (dq[:, :200] == 0).all(), f"{impl}: rows that see no key have nonzero dq"
    assert_grads(g1, _host(case, "bfloat16")[2], "bfloat16", f"{impl} {case.id}")


def test_fa1_refuses_deterministic(request):
    """fa1 adds dQ atomically: deterministic=True is refused by name, before anything is allocated."""
    import cupy
    if "fa1" not in BACKWARD_VARIANTS:
        pytest.skip("fa1 has no GPU backward here")
    _seed(request)
    case = Case(1, 64, 64, 2, 2, 64, False)
    args = _inputs("fa1", case, "float16")
    used = cupy.get_default_memory_pool().used_bytes()
    with pytest.raises(ValueError, match=r"deterministic=True: fa1's GPU backward adds dQ atomically"):
        fav.attention_backward(*args, variant="fa1", deterministic=True)
    assert cupy.get_default_memory_pool().used_bytes() == used


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_in_q_reaches_what_it_should(request, monkeypatch, impl):
    """A NaN at q[0, 5, 1, 3] (kv head 0 of batch 0): NaN in that query's dq row, and in all of dk and dv of
    (batch 0, kv head 0), where its P row reaches through dV = P^T dO and dK = dS^T Q; every other gradient finite."""
    _seed(request)
    name = _variant(impl, monkeypatch)
    case = Case(2, 40, 50, 4, 2, 64, False)
    host, dout_h, _ = _host(case, "float16")
    q = host[0].copy()
    q[0, 5, 1, 3] = np.nan
    args = _inputs(name, case, "float16", (q, host[1], host[2]), dout_h)
    dq, dk, dv = (to_host(g).astype(np.float32) for g in fav.attention_backward(*args, variant=name))
    nan_dq = np.zeros(dq.shape, bool)
    nan_dq[0, 5, 1] = True
    nan_kv = np.zeros(dk.shape, bool)
    nan_kv[0, :, 0] = True
    assert np.isnan(dq[nan_dq]).all() and np.isfinite(dq[~nan_dq]).all(), f"{impl}: dq"
    for gname, g in (("dk", dk), ("dv", dv)):
        assert np.isnan(g[nan_kv]).all() and np.isfinite(g[~nan_kv]).all(), f"{impl}: {gname}"


def test_naive_refuses_what_does_not_fit():
    """B=1, H=16, N=131072: P and dP alone are 2 TiB. Refused with the sizes and the memory needed vs free, before
    any allocation (the pool's used bytes are unchanged)."""
    import cupy
    if "naive" not in BACKWARD_VARIANTS:
        pytest.skip("naive has no GPU backward in the registry yet")
    b, n, h, d = 1, 131072, 16, 128
    q, k, v, out, dout = (cupy.zeros((b, n, h, d), cupy.float16) for _ in range(5))
    lse = cupy.full((b, h, n), math.log(n), cupy.float32)  # what a forward of these gives: lse_check passes
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    used = pool.used_bytes()
    with pytest.raises((MemoryError, ValueError), match=r"(?s)131072.*GiB.*free.*fa2"):
        fav.attention_backward(dout, q, k, v, out, lse, variant="naive")
    assert pool.used_bytes() == used, "naive allocated before refusing"
