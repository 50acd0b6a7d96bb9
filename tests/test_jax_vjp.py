"""``fa_variants.jax.attention``: a custom VJP over fav.attention / fav.attention_backward, eager only, on CPU JAX
arrays (with no GPU here, backend auto runs fa2's NumPy models). Values and jax.grad against a jnp float32
reference, and with the mask keywords against tests/test_masks_model.py's float64 one; under jax.jit (or vmap) a
TypeError that names the limitation."""
from __future__ import annotations

import numpy as np
import pytest

import fa_variants as fav
from conftest import GRAD_TOL, TOL, has_gpu, random_qkv_host, rel_err

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
faj = pytest.importorskip("fa_variants.jax")

BACKEND = "numpy" if has_gpu() else "auto"  # as in test_torch_autograd: with a GPU, auto has no backward to run
EAGER_ONLY = r"runs eagerly only.*JAX tracer.*jax\.jit.*DLPack/NumPy"


def reference(q, k, v, causal=False, scale=None):
    """softmax(q k^T * scale) v in jnp float32: GQA by repeating k, v heads; causal bottom-right aligned."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    nq, h, d = q.shape[1:]
    nk, hkv = k.shape[1:3]
    k, v = (jnp.repeat(x, h // hkv, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (d ** -0.5 if scale is None else scale)
    if causal:
        s = jnp.where(jnp.arange(nk)[None, :] <= jnp.arange(nq)[:, None] + (nk - nq), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _inputs(rng, b, nq, nk, h, hkv, d, dtype):
    q, k, v = (jnp.asarray(a) for a in random_qkv_host(rng, b, nq, nk, h, hkv, d, dtype))
    return q, k, v, jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32))


CASES = [(2, 29, 37, 4, 2, False), (2, 29, 37, 4, 2, True), (1, 33, 33, 4, 1, True)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Nq{}-Nk{}-H{}-Hkv{}{}".format(*c[:5], "-causal" * c[5]))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_values_and_grads(dtype, case, rng):
    b, nq, nk, h, hkv, causal = case
    q, k, v, g = _inputs(rng, b, nq, nk, h, hkv, 64, dtype)
    scale = 0.6 / 8

    def loss(fn, q, k, v):
        return (fn(q, k, v).astype(jnp.float32) * g).sum()

    out = faj.attention(q, k, v, causal=causal, softmax_scale=scale, backend=BACKEND)
    assert isinstance(out, jax.Array) and out.dtype == q.dtype and out.shape == q.shape
    assert rel_err(np.asarray(out), np.asarray(reference(q, k, v, causal, scale))) <= TOL[dtype]

    ours = jax.grad(lambda *a: loss(lambda *x: faj.attention(*x, causal=causal, softmax_scale=scale,
                                                             backend=BACKEND), *a), argnums=(0, 1, 2))(q, k, v)
    # the reference differentiates float32 copies, so its gradients are not rounded to the input dtype
    ref = jax.grad(lambda *a: loss(lambda *x: reference(*x, causal, scale), *a), argnums=(0, 1, 2))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    for name, x, r, inp in zip(("dq", "dk", "dv"), ours, ref, (q, k, v)):
        assert x.dtype == inp.dtype and x.shape == inp.shape, name
        err = rel_err(np.asarray(x), np.asarray(r))
        assert err <= TOL[dtype], f"{name}: relative error {err:.2e} > {TOL[dtype]:.0e}"


def test_vjp_equals_a_direct_attention_backward_call(rng):
    q, k, v, g = _inputs(rng, 1, 13, 17, 4, 2, 32, "bfloat16")
    g = g.astype(jnp.bfloat16)
    out, vjp = jax.vjp(lambda *a: faj.attention(*a, causal=True, backend=BACKEND), q, k, v)
    got = vjp(g)
    _, lse = fav.attention(q, k, v, causal=True, return_lse=True, backend=BACKEND)
    want = fav.attention_backward(g, q, k, v, out, lse, causal=True, backend=BACKEND)
    for a, b in zip(got, want):
        assert isinstance(b, jax.Array) and b.dtype == jnp.bfloat16 and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("variant", ["fa3", "fa2_fp8"])
def test_forwards_without_a_backward_use_autos(variant, rng):
    """fa3 and fa2_fp8 have no backward: jax.grad runs variant='auto''s, with the forward's flags."""
    q, k, v, g = _inputs(rng, 1, 13, 17, 4, 2, 64, "bfloat16")
    g = g.astype(jnp.bfloat16)
    out, vjp = jax.vjp(lambda *a: faj.attention(*a, variant=variant, causal=True, backend=BACKEND), q, k, v)
    _, lse = fav.attention(q, k, v, variant=variant, causal=True, return_lse=True, backend=BACKEND)
    want = fav.attention_backward(g, q, k, v, out, lse, causal=True, backend=BACKEND)
    for a, b in zip(vjp(g), want):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_jit_and_vmap_raise_a_clear_error(rng):
    q, k, v, g = _inputs(rng, 1, 5, 6, 2, 2, 16, "float16")

    def loss(q, k, v):
        return (faj.attention(q, k, v, backend=BACKEND).astype(jnp.float32) * g).sum()

    with pytest.raises(TypeError, match=EAGER_ONLY):
        jax.jit(loss)(q, k, v)
    with pytest.raises(TypeError, match=EAGER_ONLY):
        jax.jit(jax.grad(loss))(q, k, v)
    with pytest.raises(TypeError, match=r"runs eagerly only.*\bq is a JAX tracer"):
        jax.vmap(lambda q: faj.attention(q, k, v, backend=BACKEND))(q[None])


def test_misuse_is_attention_s_error(rng):
    q, k, v, _ = _inputs(rng, 1, 5, 6, 2, 2, 16, "float16")
    with pytest.raises(TypeError, match=r"causal must be a bool"):
        faj.attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match=r"head_dim differs"):
        faj.attention(q, k[..., :8], v)


@pytest.mark.parametrize("masks", [dict(causal=True, window=(5, 0)), dict(window=(4, 3), softcap=2.5),
                                   dict(causal=True, sinks=True, alibi=True)],
                         ids=["causal window", "window softcap", "sinks alibi"])
def test_mask_keywords_values_and_grads(masks, rng):
    """The mask keywords through the custom VJP: out and the gradients of q, k, v (and the sinks') against the
    float64 reference of tests/test_masks_model.py; the ALiBi slopes get a zero cotangent."""
    from test_masks_model import reference
    q, k, v, g = _inputs(rng, 2, 23, 29, 4, 2, 32, "float16")
    kw = {n: x for n, x in masks.items() if n not in ("sinks", "alibi")}
    ref_kw = dict(kw)
    if masks.get("sinks"):
        kw["sinks"] = jnp.asarray(rng.standard_normal(4).astype(np.float32))
        ref_kw["sinks"] = np.asarray(kw["sinks"], np.float64)
    if masks.get("alibi"):
        kw["alibi_slopes"] = jnp.asarray(rng.uniform(0.05, 0.3, 4).astype(np.float32))
        ref_kw["alibi"] = np.asarray(kw["alibi_slopes"], np.float64)
    f64 = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
    want = reference(f64(q), f64(k), f64(v), f64(g), **ref_kw)
    sinks, slopes = kw.pop("sinks", None), kw.pop("alibi_slopes", None)

    def loss(q, k, v, sinks, slopes):
        out = faj.attention(q, k, v, sinks=sinks, alibi_slopes=slopes, backend=BACKEND, **kw)
        return (out.astype(jnp.float32) * g).sum(), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, sinks, slopes)
    assert rel_err(np.asarray(out), want["out"]) <= TOL["float16"]
    for name, x in zip(("dq", "dk", "dv"), grads[:3]):
        assert rel_err(np.asarray(x), want[name]) <= GRAD_TOL["float16"], name
    if sinks is not None:
        assert grads[3].dtype == sinks.dtype and rel_err(np.asarray(grads[3]), want["dsinks"]) <= GRAD_TOL["float16"]
    if slopes is not None:
        assert not np.asarray(grads[4]).any()
