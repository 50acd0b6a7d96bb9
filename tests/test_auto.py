"""``variant="auto"``, the default: the rule (choice.choose) on faked devices, its reading of the registry, the
errors when nothing fits, ``fav.explain_choice``, and what auto runs on this CPU machine (fa2's NumPy model)."""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import fa_variants as fav
from fa_variants import choice, dispatch, gpu, registry
from conftest import has_gpu, random_qkv_host

DTYPES = ["float16", "bfloat16"]


# ------------------------------------------------------------------------------------------------ the rule
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [1, 40, 64, 128, 200, 256])
@pytest.mark.parametrize("cc", [80, 86, 89])
def test_ampere_and_ada_run_fa2_both_ways(cc, head_dim, dtype):
    for direction in ("forward", "backward"):
        c = choice.choose(direction, cc, dtype, head_dim)
        assert (c.variant, c.backend) == ("fa2", "cuda"), c
        assert "fa3" in c.reason, f"the reason should say why fa3 was passed over: {c.reason}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [1, 8, 40, 64, 96, 128, 200, 256])
def test_hopper_runs_fa3_forward_and_backward(head_dim, dtype):
    fwd = choice.choose("forward", 90, dtype, head_dim)
    bwd = choice.choose("backward", 90, dtype, head_dim)
    assert (fwd.variant, fwd.backend) == ("fa3", "cuda")
    assert (bwd.variant, bwd.backend) == ("fa3", "cuda")


@pytest.mark.parametrize("cc", [100, 120])
def test_newer_than_hopper_runs_fa2(cc):
    c = choice.choose("forward", cc, "bfloat16", 128)
    assert c.variant == "fa2" and "runs on compute capability 9.0 only" in c.reason


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_without_a_gpu_the_numpy_model_of_fa2(direction):
    c = choice.choose(direction, None, "float16", 64, no_gpu="no CUDA device")
    assert (c.variant, c.backend) == ("fa2", "numpy") and "no CUDA device" in c.reason
    assert choice.choose(direction, 90, "float16", 64, backend="numpy").backend == "numpy"


def test_a_gpu_too_old_falls_back_to_the_model_for_auto_and_refuses_cuda():
    auto = choice.choose("forward", 75, "float16", 64)
    assert (auto.variant, auto.backend) == ("fa2", "numpy") and "compute capability 7.5" in auto.reason
    cuda = choice.choose("forward", 75, "float16", 64, backend="cuda")
    assert cuda.variant is None and cuda.refused == "device" and "needs compute capability 8.0+" in cuda.reason
    gone = choice.choose("forward", None, "float16", 64, backend="cuda", no_gpu="no CUDA device")
    assert gone.variant is None and gone.refused == "device" and "no CUDA device" in gone.reason


@pytest.mark.parametrize("cc", [None, 80, 90])
def test_unsupported_dtype_and_head_dim_say_what_is_accepted(cc):
    c = choice.choose("forward", cc, "float32", 64)
    assert c.variant is None and c.refused == "dtype" and "float32" in c.reason and "float16" in c.reason
    c = choice.choose("backward", cc, "float16", 300)
    assert c.variant is None and c.refused == "head_dim" and "300" in c.reason and "1..256" in c.reason


def test_bad_direction_or_backend():
    with pytest.raises(ValueError, match="direction must be one of"):
        choice.choose("sideways", 90, "float16", 64)
    with pytest.raises(ValueError, match="backend must be one of"):
        choice.choose("forward", 90, "float16", 64, backend="tpu")


def test_every_exact_variant_is_ranked_and_no_fp8_one_is():
    exact = {v.name for v in registry.variants() if v.operand_dtype is None}
    assert set(choice.FASTEST_FIRST) == exact
    assert choice.NUMPY_MODEL in exact


def test_the_rule_reads_the_registry(monkeypatch):
    """An fa3 that took only head dims in steps of 16, or ran on sm_90 and sm_100, changes the choice with no
    other edit."""
    fa3 = registry.get("fa3")
    monkeypatch.setitem(registry.VARIANTS, "fa3", dataclasses.replace(fa3, head_dims=range(16, 257, 16)))
    assert choice.choose("forward", 90, "float16", 64).variant == "fa3"
    c = choice.choose("forward", 90, "float16", 40)
    assert c.variant == "fa2" and "fa3 (takes head_dim 16..256 in steps of 16)" in c.reason
    monkeypatch.setitem(registry.VARIANTS, "fa3", dataclasses.replace(fa3, max_cc=100))
    assert choice.choose("forward", 100, "float16", 64).variant == "fa3"
    monkeypatch.setitem(registry.VARIANTS, "fa3", dataclasses.replace(fa3, directions=("forward", "backward"),
                                                                      launcher=registry.get("fa2").launcher))
    assert choice.choose("backward", 90, "float16", 64).variant == "fa3"


# ------------------------------------------------------------------------------------------------ dispatch
def _fake_gpu(monkeypatch, cc):
    monkeypatch.setattr(gpu, "probe", lambda device_id=None: gpu.Probe(cc, "" if cc else "no CUDA device", "fake"))


@pytest.mark.parametrize("cc, forward, backward", [(80, "fa2", "fa2"), (90, "fa3", "fa3")])
def test_dispatch_resolves_auto_on_a_faked_device(monkeypatch, cc, forward, backward):
    _fake_gpu(monkeypatch, cc)
    for direction, want in (("forward", forward), ("backward", backward)):
        entry, where = dispatch.resolve(direction, "auto", "bfloat16", 128, False, "auto")
        assert (entry.name, where) == (want, "cuda")


def test_dispatch_never_hands_gpu_arrays_to_the_model(monkeypatch):
    _fake_gpu(monkeypatch, 75)
    assert dispatch.resolve("forward", "auto", "float16", 64, False, "auto")[1] == "numpy"   # host arrays
    with pytest.raises(fav.BackendUnavailable, match="compute capability 7.5"):
        dispatch.resolve("forward", "auto", "float16", 64, True, "auto")
    assert dispatch.resolve("forward", "auto", "float16", 64, True, "numpy")[1] == "numpy"  # asked for


@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(dtype="float32"), TypeError, r"variant 'auto' runs .* accept dtypes .*got float32"),
    (dict(head_dim=257), ValueError, r"variant 'auto' runs .* accept head_dim in 1..256 .*got 257"),
])
def test_auto_refusals_raise_the_argument_errors(kw, exc, pattern, rng):
    d = kw.get("head_dim", 64)
    q, k, v = (a.astype(kw.get("dtype", np.float16)) for a in random_qkv_host(rng, 1, 5, 7, 2, 2, d, "float16"))
    with pytest.raises(exc, match=pattern):
        fav.attention(q, k, v)
    with pytest.raises(exc, match=pattern):
        fav.attention_backward(q, q, k, v, q, np.zeros((1, 2, 5), np.float32))


def test_backward_variant_of_each_forward():
    assert dispatch.backward_variant("auto") == "auto"
    for v in registry.variants():
        want = v.name if "backward" in v.directions else "auto"
        assert dispatch.backward_variant(v.name) == want
    assert dispatch.backward_variant("fa3") == "fa3" and dispatch.backward_variant("fa2_fp8") == "auto"


# ------------------------------------------------------------------------------------------------ explain
def test_explain_choice_by_dtype_and_head_dim_on_a_named_device():
    report = fav.explain_choice(dtype="bfloat16", head_dim=128, device_cc=90)
    assert (report.forward.variant, report.backward.variant) == ("fa3", "fa3")
    text = repr(report)
    assert text.splitlines()[0].startswith("forward : fa3 (GPU)") and "backward: fa3 (GPU)" in text
    assert fav.explain_choice(dtype=ml_dtypes.bfloat16, head_dim=128, device_cc=80).forward.variant == "fa2"


def test_explain_choice_of_arrays_here(rng):
    q, k, v = random_qkv_host(rng, 1, 5, 7, 4, 2, 96, "bfloat16")
    report = fav.explain_choice(q, k, v)
    if not has_gpu():
        assert (report.forward.variant, report.forward.backend) == ("fa2", "numpy")
    assert report.forward.direction == "forward" and report.backward.direction == "backward"
    assert fav.explain_choice(q).forward == report.forward


@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(), TypeError, "needs q .* or both dtype and head_dim"),
    (dict(dtype="float16"), TypeError, "needs q"),
    (dict(dtype="float16", head_dim=0), ValueError, "head_dim must be an int >= 1"),
    (dict(dtype="float16", head_dim=64, device_cc="sm_90"), ValueError, "device_cc must be"),
    (dict(dtype="float16", head_dim=64, backend="tpu"), ValueError, "backend must be one of"),
])
def test_explain_choice_misuse(kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fav.explain_choice(**kw)


# ------------------------------------------------------------------------------------------------ on this machine
@pytest.mark.skipif(has_gpu(), reason="a CUDA GPU is present: auto runs a kernel")
def test_auto_is_the_default_and_runs_fa2s_model_here(rng):
    q, k, v = random_qkv_host(rng, 2, 37, 29, 4, 2, 64, "bfloat16")
    out, lse = fav.attention(q, k, v, causal=True, return_lse=True)
    want, want_lse = fav.attention(q, k, v, causal=True, return_lse=True, variant="fa2", backend="numpy")
    assert np.array_equal(out.view(np.uint16), want.view(np.uint16)) and np.array_equal(lse, want_lse)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    got = fav.attention_backward(dout, q, k, v, out, lse, causal=True)
    ref = fav.attention_backward(dout, q, k, v, out, lse, causal=True, variant="fa2", backend="numpy")
    assert all(np.array_equal(a.view(np.uint16), b.view(np.uint16)) for a, b in zip(got, ref))


def test_masked_forward_is_fa3s_on_hopper_and_fa2s_elsewhere():
    """A masked call's forward (window, softcap, sinks, ALiBi, varlen) under variant="auto": fa3's masked kernel on
    sm_90a, fa2's on every other device (and without one); what explain mask counts its tiles by."""
    assert choice.masked_forward(90) == "fa3"
    assert [choice.masked_forward(cc) for cc in (80, 86, 89, 100, 120, None)] == ["fa2"] * 6
    assert set(choice.MASKED_FORWARD) <= set(choice.FASTEST_FIRST)
