"""Host (CPU) torch tensors and JAX arrays in, the same framework out, bfloat16 included: NumPy's DLPack import
knows no bfloat16, so those come in through their 16-bit patterns (arrays._host_import)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fa_variants as fav

from conftest import assert_matches, random_qkv_host, reference64


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_cpu_tensors(dtype, rng):
    torch = pytest.importorskip("torch")
    host = random_qkv_host(rng, 1, 33, 40, 4, 2, 64, dtype)
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    q, k, v = (torch.from_numpy(a.view(np.int16).copy()).view(tdt) for a in host)
    out, lse = fav.attention(q, k, v, variant="fa2", causal=True, return_lse=True, backend="numpy")
    assert isinstance(out, torch.Tensor) and out.dtype == tdt and tuple(out.shape) == tuple(q.shape)
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    out_np = out.view(torch.int16).numpy().view(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    ref_out, ref_lse = reference64(*host, True)
    assert_matches(out_np, ref_out, dtype, lse.numpy(), ref_lse, what=f"torch cpu {dtype}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_jax_cpu_arrays(dtype, rng):
    jnp = pytest.importorskip("jax.numpy")
    host = random_qkv_host(rng, 1, 33, 40, 4, 2, 64, dtype)
    q, k, v = (jnp.asarray(a) for a in host)
    out = fav.attention(q, k, v, variant="fa1", causal=False, backend="numpy")
    assert type(out).__module__.split(".")[0] in ("jax", "jaxlib") and str(out.dtype) == dtype
    ref_out, _ = reference64(*host, False)
    assert_matches(np.asarray(out), ref_out, dtype, what=f"jax cpu {dtype}")


def test_an_unreadable_host_array_is_a_type_error():
    class Weird:
        dtype = "complex-ish"

        def __dlpack__(self, stream=None):
            raise BufferError("no")

        def __dlpack_device__(self):
            return (1, 0)

        def __array__(self, dtype=None):
            raise TypeError("no")

    with pytest.raises(TypeError, match=r"\bq\b.*cannot be read on the host"):
        fav.attention(Weird(), Weird(), Weird(), backend="numpy")
