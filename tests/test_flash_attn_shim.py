"""fa_variants.integrations.flash_attn: flash-attn's ``flash_attn_func`` and ``flash_attn_varlen_func`` signatures
on fa-variants, checked against a float64 attention written here from flash-attn's docstrings (causal
bottom-right; key j visible to query i within [i + N_k - N_q - left, i + N_k - N_q + right]; softcap c:
c tanh(S / c); ALiBi: -slope |i + N_k - N_q - j| on the scaled score), output and gradients through torch autograd.
On the CPU the NumPy models run (no GPU: backend auto); with a GPU, the same calls on CUDA tensors (gpu marker)
run the kernels ``auto`` picks there (fa3's backward on Hopper)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import GRAD_TOL, TOL, has_gpu, random_qkv_host

torch = pytest.importorskip("torch")
fa = pytest.importorskip("fa_variants.integrations.flash_attn")

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def reference(q, k, v, causal, scale, window=(-1, -1), softcap=0.0, slopes=None):
    """float64 attention of (batch, seqlen, heads, d) tensors by flash-attn's definitions, differentiable."""
    q, k, v = (x.double() for x in (q, k, v))
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    k, v = (x.repeat_interleave(h // hkv, dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    rel = torch.arange(nk)[None, :] - (torch.arange(nq) + nk - nq)[:, None]   # j - (i + N_k - N_q)
    if slopes is not None:
        s = s - slopes.double().reshape(-1, h, 1, 1) * rel.abs()
    left, right = window
    seen = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        seen &= rel <= 0
    if left >= 0:
        seen &= rel >= -left
    if right >= 0:
        seen &= rel <= right
    s = s.masked_fill(~seen, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)     # a row that sees no key: zeros
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _leaves(rng, b, nq, nk, h, hkv, d, dtype, device, packed=False):
    """Leaf q, k, v from N(0, 1) values; ``packed``: batch 1 dropped, varlen's (total, heads, d)."""
    tdt = TORCH_DTYPES[dtype]
    host = random_qkv_host(rng, b, nq, nk, h, hkv, d, dtype)
    return [torch.from_numpy((a[0] if packed else a).view(np.int16).copy()).view(tdt).to(device).requires_grad_()
            for a in host]


def _rel(a, b) -> float:
    return float(torch.linalg.norm(a.double() - b) / max(float(torch.linalg.norm(b)), 1e-3 * math.sqrt(b.numel())))


CASES = [  # (b, nq, nk, h, hkv, d, causal, window, softcap, alibi)
    (2, 37, 37, 4, 2, 32, True, (-1, -1), 0.0, False),
    (1, 20, 45, 4, 4, 64, True, (-1, -1), 0.0, False),       # seqlen_q < seqlen_k: bottom-right
    (1, 45, 20, 2, 1, 64, True, (-1, -1), 0.0, False),       # rows that see no key
    (1, 50, 50, 2, 2, 64, False, (8, 3), 0.0, False),
    (1, 50, 50, 2, 2, 64, True, (16, -1), 20.0, True),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_flash_attn_func_matches_float64(case, dtype, device, rng):
    if device == "cuda" and not (has_gpu() and torch.cuda.is_available()):
        pytest.skip("needs a CUDA GPU that torch sees")
    b, nq, nk, h, hkv, d, causal, window, softcap, alibi = case
    q, k, v = _leaves(rng, b, nq, nk, h, hkv, d, dtype, device)
    slopes = torch.rand(h, dtype=torch.float32, device=device) if alibi else None
    dout = torch.randn(b, nq, h, d, device=device).to(TORCH_DTYPES[dtype])
    out, lse, probs = fa.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                         alibi_slopes=slopes, return_attn_probs=True)
    out.backward(dout)
    assert probs is None and lse.shape == (b, h, nq) and lse.dtype == torch.float32
    ref_leaves = [x.detach().clone().cpu().requires_grad_() for x in (q, k, v)]
    ref = reference(*ref_leaves, causal, 1 / math.sqrt(d), window, softcap, None if slopes is None else slopes.cpu())
    ref.backward(dout.cpu().double())
    assert _rel(out.detach().cpu(), ref.detach()) <= TOL[dtype]
    for name, x, r in zip(("dq", "dk", "dv"), (q, k, v), ref_leaves):
        assert _rel(x.grad.cpu(), r.grad) <= GRAD_TOL[dtype], name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_flash_attn_varlen_func_is_each_sequence_alone(device, rng):
    """Three packed sequences (lengths 5, 0 and 30 queries; 9, 4 and 30 keys), causal: each one's rows equal
    flash_attn_func on that sequence alone; gradients flow to the packed tensors."""
    if device == "cuda" and not (has_gpu() and torch.cuda.is_available()):
        pytest.skip("needs a CUDA GPU that torch sees")
    lq, lk = (5, 0, 30), (9, 4, 30)
    q, k, v = _leaves(rng, 1, sum(lq), sum(lk), 4, 2, 64, "bfloat16", device, packed=True)
    cu = [torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32, device=device) for n in (lq, lk)]
    out = fa.flash_attn_varlen_func(q, k, v, cu[0], cu[1], max(lq), max(lk), causal=True)
    out.float().sum().backward()
    assert q.grad is not None and k.grad is not None
    for s in range(3):
        if lq[s] == 0:
            continue
        qs, ks, vs = (x.detach()[c[s]:c[s + 1]][None] for x, c in ((q, cu[0]), (k, cu[1]), (v, cu[1])))
        alone = fa.flash_attn_func(qs, ks, vs, causal=True)[0]
        assert _rel(out.detach()[cu[0][s]:cu[0][s + 1]].cpu(), alone.cpu().double()) <= TOL["bfloat16"]


@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(dropout_p=0.1), ValueError, r"dropout_p must be 0 \(fa-variants' kernels have no dropout\), got 0.1"),
    (dict(window_size=3), TypeError, r"window_size must be a pair \(left, right\), got 3"),
    (dict(return_attn_probs=1), TypeError, r"return_attn_probs must be a bool, got int"),
    (dict(deterministic="yes"), TypeError, r"deterministic must be a bool, got str"),
])
def test_refusals_name_the_argument(kw, exc, pattern, rng):
    q, k, v = _leaves(rng, 1, 8, 8, 2, 2, 32, "float16", "cpu")
    with pytest.raises(exc, match=pattern):
        fa.flash_attn_func(q, k, v, **kw)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_flash_attn_with_kvcache_appends_and_matches_float64(paged, device, rng):
    """Two sequences of 30 and 7 cached tokens, 2 new ones appended in place, a window and a softcap (flash-attn's
    defaults otherwise: causal False): the rows as the float64 reference over each sequence's 32 and 9 keys."""
    if device == "cuda" and not (has_gpu() and torch.cuda.is_available()):
        pytest.skip("needs a CUDA GPU that torch sees")
    lens, new, cap, h, hkv, d = (30, 7), 2, 40, 4, 2, 64
    q, k_all, v_all = _leaves(rng, 2, new, cap, h, hkv, d, "bfloat16", device)
    q, k_all, v_all = (x.detach() for x in (q, k_all, v_all))
    k_new, v_new = (torch.stack([x[b, lens[b]:lens[b] + new] for b in range(2)]) for x in (k_all, v_all))
    k_cache, v_cache = k_all.clone(), v_all.clone()
    for b in range(2):   # the new tokens' slots hold NaN until the append writes them
        k_cache[b, lens[b]:lens[b] + new] = v_cache[b, lens[b]:lens[b] + new] = math.nan
    table = None
    if paged:   # pages of 8 tokens, sequence b's in reverse order
        pages = cap // 8
        table = torch.tensor([[b * pages + pages - 1 - i for i in range(pages)] for b in range(2)], dtype=torch.int32,
                             device=device)
        k_cache, v_cache = (torch.empty(2 * pages, 8, hkv, d, dtype=x.dtype, device=device) for x in (k_all, v_all))
        for b in range(2):
            for i in range(pages):
                k_cache[table[b, i]], v_cache[table[b, i]] = k_all[b, 8 * i:8 * i + 8], v_all[b, 8 * i:8 * i + 8]
                slots = slice(max(lens[b] - 8 * i, 0), max(min(lens[b] + new - 8 * i, 8), 0))
                k_cache[table[b, i], slots] = v_cache[table[b, i], slots] = math.nan
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, block_table=table,
                                          cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device),
                                          window_size=(6, 0), softcap=3.0, return_softmax_lse=True)
    assert lse.shape == (2, h, new)
    for b in range(2):
        n = lens[b] + new
        ref = reference(q[b:b + 1].cpu(), k_all[b:b + 1, :n].cpu(), v_all[b:b + 1, :n].cpu(), False,
                        1 / math.sqrt(d), (6, 0), 3.0)
        assert _rel(out[b:b + 1].cpu(), ref) <= TOL["bfloat16"]


def test_flash_attn_with_kvcache_refuses_rotary_and_batch_index(rng):
    q, k, v = (x.detach() for x in _leaves(rng, 1, 1, 8, 2, 2, 32, "float16", "cpu"))
    for kw in (dict(rotary_cos=q, rotary_sin=q), dict(cache_batch_idx=torch.zeros(1, dtype=torch.int32)),
               dict(cache_leftpad=torch.zeros(1, dtype=torch.int32))):
        with pytest.raises(ValueError, match=f"{next(iter(kw))}.* not supported"):
            fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=8, **kw)
