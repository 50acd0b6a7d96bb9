"""torch autograd through ``fav.attention`` (fa_variants/integrations/torch.py), on CPU tensors: with no GPU here,
backend auto runs fa2's NumPy models forward and backward.

Gradients follow flash-attn's criterion: their max-abs error against torch's autograd of a float64 dense attention
is at most 3x the error of the same dense attention computed by torch in the input dtype; and their relative
error is within conftest's TOL. torch.compile: the ops are opaque custom ops (opcheck, and a fullgraph
aot_eager compile whose gradients equal eager's).
"""
from __future__ import annotations

import numpy as np
import pytest

import fa_variants as fav
from conftest import GRAD_TOL, TOL, has_gpu, random_qkv_host, rel_err

torch = pytest.importorskip("torch")
fat = pytest.importorskip("fa_variants.integrations.torch")

# Without a GPU, auto runs the NumPy models (what these tests are about); with one, auto would run the kernels on
# copies of these CPU tensors (tests/test_gpu_backward.py's subject), so they ask for the models by name.
BACKEND = "numpy" if has_gpu() else "auto"
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _tensors(rng, b, nq, nk, h, hkv, d, dtype, requires_grad=True):
    """Leaf torch tensors q, k, v (of ``dtype``) and an output gradient, from N(0, 1) values."""
    tdt = TORCH_DTYPES[dtype]
    host = random_qkv_host(rng, b, nq, nk, h, hkv, d, dtype)
    q, k, v = (torch.from_numpy(a.view(np.int16).copy()).view(tdt).requires_grad_(requires_grad) for a in host)
    dout = torch.from_numpy(rng.standard_normal(q.shape, dtype=np.float32)).to(tdt)
    return q, k, v, dout


def dense_attention(q, k, v, causal=False, scale=None):
    """softmax(q k^T * scale) v by torch ops in the inputs' dtype (flash-attn's attention_ref, upcast=False):
    GQA by repeating k, v heads; causal bottom-right aligned (the cases here give every row a key)."""
    nq, h, d = q.shape[1:]
    nk, hkv = k.shape[1:3]
    k, v = (x.repeat_interleave(h // hkv, dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (d ** -0.5 if scale is None else scale)
    if causal:
        visible = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
        s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v)


def _grads(fn, q, k, v, dout, dtype=None):
    """(out, dq, dk, dv) of ``fn`` by autograd, on fresh leaf copies of q, k, v (cast to ``dtype``)."""
    leaves = [x.detach().to(dtype or x.dtype).requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout.to(out.dtype))
    return (out, *(x.grad for x in leaves))


CASES = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, causal)
    (2, 29, 37, 4, 2, False),
    (2, 29, 37, 4, 2, True),     # seqlen_q < seqlen_k: bottom-right diagonal
    (1, 33, 33, 4, 1, True),     # MQA
    (2, 41, 23, 2, 2, False),    # seqlen_q > seqlen_k
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Nq{}-Nk{}-H{}-Hkv{}{}".format(*c[:5], "-causal" * c[5]))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gradients_match_torch_autograd(dtype, case, rng):
    b, nq, nk, h, hkv, causal = case
    q, k, v, dout = _tensors(rng, b, nq, nk, h, hkv, 64, dtype)
    out = fav.attention(q, k, v, causal=causal, backend=BACKEND)
    assert out.grad_fn is not None and out.dtype == q.dtype
    out.backward(dout)
    ours = (out, q.grad, k.grad, v.grad)
    ref = _grads(lambda *a: dense_attention(*a, causal=causal), q, k, v, dout, torch.float64)
    same_dtype = _grads(lambda *a: dense_attention(*a, causal=causal), q, k, v, dout)
    for name, x, r, base, inp in zip(("out", "dq", "dk", "dv"), ours, ref, same_dtype, (q, q, k, v)):
        assert x.dtype == inp.dtype and x.shape == inp.shape, name
        assert_flash_criterion(name, x, r, base, dtype)


def assert_flash_criterion(name, x, ref, base, dtype):
    """flash-attn's criterion: max-abs error against float64 at most 3x torch's in the same dtype (``base``), and
    the relative error within TOL."""
    x, ref, base = (t.detach().double() for t in (x, ref, base))
    err, base_err = (x - ref).abs().max().item(), (base - ref).abs().max().item()
    assert err <= 3 * base_err, f"{name}: max-abs error {err:.3e} > 3 x torch's {dtype} error {base_err:.3e}"
    rel = rel_err(x.numpy(), ref.numpy())
    assert rel <= TOL[dtype], f"{name}: relative error {rel:.2e} > {TOL[dtype]:.0e}"


def test_lse_is_returned_but_not_differentiable(rng):
    q, k, v, dout = _tensors(rng, 1, 17, 19, 2, 2, 32, "bfloat16")
    out, lse = fav.attention(q, k, v, causal=True, return_lse=True, backend=BACKEND)
    assert out.requires_grad and not lse.requires_grad and lse.dtype == torch.float32
    want_out, want_lse = fav.attention(q.detach(), k.detach(), v.detach(), causal=True, return_lse=True,
                                       backend=BACKEND)
    assert torch.equal(out.detach(), want_out) and torch.equal(lse, want_lse)
    (out.float() * dout.float()).sum().backward()  # sum() hands the op an expanded (stride 0) gradient
    assert all(x.grad is not None and x.grad.dtype == torch.bfloat16 for x in (q, k, v))


def test_autograd_equals_a_direct_attention_backward_call(rng):
    q, k, v, dout = _tensors(rng, 2, 13, 21, 4, 2, 64, "bfloat16")
    out = fav.attention(q, k, v, causal=True, softmax_scale=0.3, backend=BACKEND)
    out.backward(dout)
    qd, kd, vd = (x.detach() for x in (q, k, v))
    _, lse = fav.attention(qd, kd, vd, causal=True, softmax_scale=0.3, return_lse=True, backend=BACKEND)
    grads = fav.attention_backward(dout, qd, kd, vd, out.detach(), lse, causal=True, softmax_scale=0.3,
                                   backend=BACKEND)
    for g, x in zip(grads, (q, k, v)):
        assert isinstance(g, torch.Tensor) and g.dtype == torch.bfloat16 and torch.equal(g, x.grad)


def test_only_the_inputs_that_require_grad_get_one(rng):
    q, k, v, dout = _tensors(rng, 1, 9, 11, 2, 1, 32, "float16", requires_grad=False)
    q.requires_grad_()
    fav.attention(q, k, v, backend=BACKEND).backward(dout)
    assert q.grad is not None and k.grad is None and v.grad is None


def test_no_grad_records_nothing(rng):
    q, k, v, _ = _tensors(rng, 1, 9, 11, 2, 1, 32, "float16")
    with torch.no_grad():
        out = fav.attention(q, k, v, backend=BACKEND)
    assert not out.requires_grad and out.grad_fn is None
    assert torch.equal(out, fav.attention(q.detach(), k.detach(), v.detach(), backend=BACKEND))


def test_misuse_is_reported_before_anything_runs(rng):
    q, k, v, _ = _tensors(rng, 1, 9, 11, 2, 1, 32, "float16")
    with pytest.raises(TypeError, match=r"causal must be a bool"):
        fav.attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match=r"backend must be one of"):
        fav.attention(q, k, v, backend="CUDA")
    with pytest.raises(TypeError, match=r"^k must be a torch.Tensor"):
        fav.attention(q, k.detach().numpy(), v)
    with pytest.raises(TypeError, match=r"accepts? dtypes.*float32"):
        fav.attention(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match=r"heads of q \(2\).*multiple"):
        fav.attention(q, k.repeat(1, 1, 3, 1), v.repeat(1, 1, 3, 1))


@pytest.mark.skipif(has_gpu(), reason="a CUDA GPU is present: backend='cuda' runs the kernels")
def test_backend_cuda_backward_is_unavailable(rng):
    q, k, v, dout = _tensors(rng, 1, 9, 11, 2, 1, 32, "float16", requires_grad=False)
    out, lse = fav.attention(q, k, v, return_lse=True, backend=BACKEND)
    with pytest.raises(fav.BackendUnavailable, match=r"backend='cuda', but no usable"):
        fav.attention_backward(dout, q, k, v, out, lse, backend="cuda")


# ------------------------------------------------------------------------------------------------ torch.compile
def test_custom_ops_pass_opcheck(rng):
    q, k, v, dout = _tensors(rng, 1, 9, 11, 2, 1, 32, "bfloat16")
    torch.library.opcheck(fat._forward, (q, k, v, "fa2", True, None, BACKEND))
    out, lse = fav.attention(q.detach(), k.detach(), v.detach(), causal=True, return_lse=True,
                                       backend=BACKEND)
    torch.library.opcheck(fat._backward, (dout, q.detach(), k.detach(), v.detach(), out, lse, "fa2", True, 0.2,
                                          BACKEND))


def test_compiles_as_an_opaque_op(rng):
    q, k, v, dout = _tensors(rng, 1, 9, 11, 2, 1, 32, "float16")

    def loss(attn, q, k, v):
        return (attn(q, k, v, causal=True, backend=BACKEND).float() * dout.float()).sum()

    eager = _grads(lambda *a: fav.attention(*a, causal=True, backend=BACKEND), q, k, v, dout)
    for attn in (fav.attention, fat.attention):  # under Dynamo, fav.attention hands its tensors to fat.attention
        compiled = torch.compile(lambda q, k, v: loss(attn, q, k, v), backend="aot_eager", fullgraph=True)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        compiled(*leaves).backward()
        for x, want in zip(leaves, eager[1:]):
            assert torch.equal(x.grad, want)
        with torch.no_grad():  # tensors that need no grad too (fav.attention's own path would use DLPack)
            out = torch.compile(lambda q, k, v: attn(q, k, v, causal=True, backend=BACKEND), backend="aot_eager",
                                fullgraph=True)(q.detach(), k.detach(), v.detach())
        assert torch.equal(out, eager[0].detach())




# ------------------------------------------------------------------------------------------------ varlen
VARLEN_LENS = (5, 0, 23, 1, 11)   # a sequence without tokens among them


def _packed(rng, dtype, lens=VARLEN_LENS, h=4, hkv=2, d=32):
    """Packed q, k, v leaves (total, heads, d), an output gradient, and the int32 cumulative lengths."""
    q, k, v, dout = _tensors(rng, 1, sum(lens), sum(lens), h, hkv, d, dtype)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    return *(x[0].detach().requires_grad_() for x in (q, k, v)), dout[0], cu


def _per_sequence(fn, cu):
    """attention over each sequence on its own (fn on (1, n, heads, d) slices), packed back."""
    def run(q, k, v):
        parts = [fn(q[None, s:e], k[None, s:e], v[None, s:e])[0] for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())
                 if e > s]
        return torch.cat(parts)
    return run


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_varlen_gradients_match_torch_autograd(dtype, rng):
    """attention_varlen under autograd (its torch ops): flash-attn's criterion against float64, per sequence."""
    q, k, v, dout, cu = _packed(rng, dtype)
    n = max(VARLEN_LENS)
    got = _grads(lambda q, k, v: fav.attention_varlen(q, k, v, cu, cu, n, n, causal=True, backend=BACKEND),
                 q, k, v, dout)
    want = _grads(_per_sequence(lambda *a: dense_attention(*a, causal=True), cu), q, k, v, dout, torch.float64)
    same = _grads(_per_sequence(lambda *a: dense_attention(*a, causal=True), cu), q, k, v, dout)
    for name, g, w, s in zip(("out", "dq", "dk", "dv"), got, want, same):
        assert_flash_criterion(name, g, w, s, dtype)


def test_varlen_ops_pass_opcheck_and_compile(rng):
    q, k, v, dout, cu = _packed(rng, "bfloat16")
    n = max(VARLEN_LENS)
    args = (cu, cu, n, n, "fa2", True, None, -1, -1, 0.0, None, None, BACKEND)
    torch.library.opcheck(fat._varlen_forward, (q.detach(), k.detach(), v.detach(), *args))
    out, lse = fat._varlen_forward(q.detach(), k.detach(), v.detach(), *args)
    torch.library.opcheck(fat._varlen_backward, (dout, q.detach(), k.detach(), v.detach(), out, lse, *args))

    def call(q, k, v):
        return fav.attention_varlen(q, k, v, cu, cu, n, n, causal=True, backend=BACKEND)
    eager = _grads(call, q, k, v, dout)
    compiled = _grads(torch.compile(call, backend="aot_eager", fullgraph=True), q, k, v, dout)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


# ------------------------------------------------------------------------------------------------ masks
MASKS = {
    "window": dict(causal=True, window=(7, 0)),
    "softcap": dict(softcap=2.0),
    "alibi": dict(causal=True, alibi_slopes=np.array([0.1, 0.3, 0.05, 0.2], np.float32)),
    "sinks": dict(causal=True, sinks=np.array([0.5, -1.0, 1.5, 0.0], np.float32)),
    "everything": dict(causal=True, window=(9, 2), softcap=3.0, sinks=np.array([1.0, 0.0, -0.5, 2.0], np.float32),
                       alibi_slopes=np.array([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]], np.float32)),
}


def _mask_args(kw, requires_grad=True):
    """attention()'s keywords as torch tensors (sinks a leaf that requires grad), and the float64 reference's."""
    args = {n: torch.from_numpy(x.copy()) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    if "sinks" in args:
        args["sinks"].requires_grad_(requires_grad)
    ref = {n: x for n, x in kw.items() if n not in ("sinks", "alibi_slopes")}
    if "sinks" in kw:
        ref["sinks"] = kw["sinks"].astype(np.float64)
    if "alibi_slopes" in kw:
        ref["alibi"] = kw["alibi_slopes"].astype(np.float64)
    return args, ref


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "varlen"])
def test_masked_gradients_match_float64(mask, packed, rng):
    """attention() with mask keywords, and attention_varlen, under autograd (the varlen torch ops): dq, dk, dv and
    the sinks' gradient against the float64 reference of tests/test_masks_model.py."""
    from test_masks_model import reference
    dtype = "float16"
    q, k, v, dout = _tensors(rng, 2, 29, 37, 4, 2, 32, dtype)
    args, ref_kw = _mask_args(MASKS[mask])
    if packed:
        cu = torch.tensor([0, 29, 58], dtype=torch.int32), torch.tensor([0, 37, 74], dtype=torch.int32)
        flat = [x.detach().reshape(-1, *x.shape[2:]).requires_grad_() for x in (q, k, v)]
        out = fav.attention_varlen(*flat, *cu, 29, 37, backend=BACKEND, **args)
        out.backward(dout.reshape(-1, *dout.shape[2:]))
        grads = [x.grad.reshape(y.shape) for x, y in zip(flat, (q, k, v))]
    else:
        out = fav.attention(q, k, v, backend=BACKEND, **args)
        out.backward(dout)
        grads = [q.grad, k.grad, v.grad]
    f = lambda x: x.detach().double().numpy()  # noqa: E731
    want = reference(f(q), f(k), f(v), f(dout), **ref_kw)
    assert rel_err(out.reshape(q.shape).detach().float().numpy(), want["out"]) <= TOL[dtype]
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert rel_err(g.float().numpy(), want[name]) <= GRAD_TOL[dtype], name
    if "sinks" in args:
        got = args["sinks"].grad.double().numpy()
        assert args["sinks"].grad.dtype == torch.float32
        # as the other gradients, by the norm: one head's dsink is a sum over rows that may nearly cancel, so its
        # own relative error is not bounded (a seed gave -0.02667 against -0.02806 beside heads near 1)
        assert rel_err(got, want["dsinks"]) <= GRAD_TOL[dtype], "dsinks"


def test_masked_ops_pass_opcheck_and_compile(rng):
    """The varlen ops with sinks and ALiBi pass opcheck; attention() with every mask keyword compiles (fullgraph)
    to the gradients eager autograd gives."""
    q, k, v, dout = _tensors(rng, 2, 29, 37, 4, 2, 32, "bfloat16")
    args, _ = _mask_args(MASKS["everything"])
    cu_q, cu_k = torch.tensor([0, 29, 58], dtype=torch.int32), torch.tensor([0, 37, 74], dtype=torch.int32)
    flat = [x.detach().reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    op_args = (cu_q, cu_k, 29, 37, "fa2", True, None, 9, 2, 3.0, args["sinks"].detach(), args["alibi_slopes"],
               BACKEND)
    torch.library.opcheck(fat._varlen_forward, (*flat, *op_args))
    out, lse = fat._varlen_forward(*flat, *op_args)
    torch.library.opcheck(fat._varlen_backward, (dout.reshape(-1, 4, 32), *flat, out, lse, *op_args))

    def call(q, k, v, sinks):
        return fav.attention(q, k, v, backend=BACKEND, **dict(args, sinks=sinks))
    results = []
    for fn in (call, torch.compile(call, backend="aot_eager", fullgraph=True)):
        leaves = [x.detach().requires_grad_() for x in (q, k, v, args["sinks"])]
        fn(*leaves).backward(dout)
        results.append([x.grad for x in leaves])
    for e, c in zip(*results):
        assert torch.equal(e, c)


# ------------------------------------------------------------------------------------------------ every forward
@pytest.mark.parametrize("variant", [v.name for v in fav.variants()])
def test_every_variants_forward_is_differentiable(variant, rng):
    """A named forward with a backward of its own is differentiated by it; one without (fa3, the fp8 variants) by
    variant='auto''s backward with the same causal and softmax_scale, on the forward's out and lse: the gradients
    equal that direct attention_backward call."""
    q, k, v, dout = _tensors(rng, 2, 29, 37, 4, 2, 64, "bfloat16")
    out = fav.attention(q, k, v, variant=variant, causal=True, softmax_scale=0.11, backend=BACKEND)
    out.backward(dout)
    qd, kd, vd = (x.detach() for x in (q, k, v))
    _, lse = fav.attention(qd, kd, vd, variant=variant, causal=True, softmax_scale=0.11, return_lse=True,
                           backend=BACKEND)
    has_backward = "backward" in fav.get(variant).directions
    want = fav.attention_backward(dout, qd, kd, vd, out.detach(), lse, variant=variant if has_backward else "auto",
                                  causal=True, softmax_scale=0.11, backend=BACKEND)
    for g, x in zip(want, (q, k, v)):
        assert torch.equal(g, x.grad), variant
    if fav.get(variant).operand_dtype is None:  # 16-bit forwards: the gradients of attention itself
        ref = _grads(lambda *a: dense_attention(*a, causal=True, scale=0.11), q, k, v, dout, torch.float64)
        for name, x, r in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref[1:]):
            assert rel_err(x.double().numpy(), r.numpy()) <= TOL["bfloat16"], f"{variant} {name}"


@pytest.mark.gpu
def test_auto_on_cuda_tensors_is_differentiable(rng):
    """variant='auto' on CUDA tensors (fa3's forward and fa2's backward on Hopper, fa2's both ways elsewhere)."""
    q, k, v, dout = (x.detach().cuda().requires_grad_(x.requires_grad) for x in _tensors(rng, 2, 300, 300, 4, 2, 128,
                                                                                          "bfloat16"))
    out = fav.attention(q, k, v, causal=True)
    out.backward(dout)
    ref = _grads(lambda *a: dense_attention(*a, causal=True), *(x.detach().cpu() for x in (q, k, v, dout)),
                 torch.float64)
    for name, x, r in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref):
        assert rel_err(x.detach().cpu().double().numpy(), r.detach().numpy()) <= TOL["bfloat16"] * 3, name
