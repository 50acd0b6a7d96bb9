"""A warm decoding call (decode_cuda's plans by signature) without a GPU: CPU torch tensors stand in for CUDA ones
and the device's answers and the launch are stubbed (bench/decode_host.py's stub_the_device), so what runs is the
host path as a GPU call takes it. A signature that ran before skips the checks and takes the call's own pointers;
anything the checks read on the host (an int length, NumPy index arrays) is checked on every call; a misaligned
array is still refused; a bfloat16 sinks array is launched as its float32 copy."""
from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fa_variants as fav  # noqa: E402
from fa_variants import decode_cuda  # noqa: E402
from fa_variants.kernels import decode as kd  # noqa: E402
from fa_variants.kernels.params import DECODE  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import decode_host  # noqa: E402


@pytest.fixture
def launches(monkeypatch):
    """The split kernel's struct of every launch ({field: value}), and the calls that took the checked path."""
    decode_host.stub_the_device(monkeypatch.setattr)
    monkeypatch.setattr(decode_cuda, "_WARM", {})
    seen, checked = [], []

    def launch(func, grid, block, smem, stream, template, fmt, *ptrs, extra=(), after=False):
        buf = bytearray(template)
        struct.pack_into(fmt, buf, 0, *ptrs)
        if len(buf) == DECODE.dtype.itemsize:
            rec = np.frombuffer(bytes(buf), dtype=DECODE.dtype)[0]
            seen.append({f: rec[f].item() for f, _ in DECODE.fields})
    monkeypatch.setattr(kd, "launch", launch)
    real = decode_cuda._checked_call
    monkeypatch.setattr(decode_cuda, "_checked_call", lambda *a, **k: (checked.append(1), real(*a, **k))[1])
    return seen, checked


def arrays(n=64):
    q = torch.randn(2, 1, 8, 64).bfloat16()
    k, v = torch.randn(2, n, 2, 64).bfloat16(), torch.randn(2, n, 2, 64).bfloat16()
    return q, k, v, torch.full((2,), n, dtype=torch.int32)


def test_a_repeated_signature_skips_the_checks_and_takes_its_own_pointers(launches):
    seen, checked = launches
    for _ in range(3):
        q, k, v, lens = arrays()
        fav.attention_with_kvcache(q, k, v, cache_seqlens=lens)
        assert (seen[-1]["q"], seen[-1]["k"], seen[-1]["cache_seqlens"]) == (q.data_ptr(), k.data_ptr(),
                                                                             lens.data_ptr())
    assert len(checked) == 1 and len(seen) == 3
    q, k, v, lens = arrays(n=96)                                  # another shape: checked again
    fav.attention_with_kvcache(q, k, v, cache_seqlens=lens)
    fav.attention_with_kvcache(q, k, v, cache_seqlens=lens, window=(7, 0))   # another mask: checked again
    assert len(checked) == 3 and seen[-1]["window_left"] == 7


def test_host_lengths_are_checked_on_every_call(launches):
    seen, checked = launches
    q, k, v, _ = arrays()
    for n in (10, 20):
        fav.attention_with_kvcache(q, k, v, cache_seqlens=n)
    assert len(checked) == 2
    with pytest.raises(ValueError, match="cache_seqlens"):
        fav.attention_with_kvcache(q, k, v, cache_seqlens=65)        # beyond the cache: refused, never launched
    assert len(seen) == 2


def test_a_misaligned_array_on_a_warm_signature_is_refused(launches):
    seen, checked = launches
    q, k, v, lens = arrays()
    fav.attention_with_kvcache(q, k, v, cache_seqlens=lens)
    flat = torch.empty(q.numel() + 1, dtype=q.dtype)
    shifted = flat.as_strided(q.shape, q.stride(), storage_offset=1)   # the same facts, 2 bytes off
    with pytest.raises(ValueError, match="q must start on a 16-byte boundary"):
        fav.attention_with_kvcache(shifted, k, v, cache_seqlens=lens)
    assert len(seen) == 1


def test_bfloat16_sinks_are_launched_as_float32(launches):
    seen, _ = launches
    q, k, v, lens = arrays()
    sinks = torch.randn(8).bfloat16()
    for _ in range(2):   # the checked call, then the warm one
        fav.attention_with_kvcache(q, k, v, cache_seqlens=lens, sinks=sinks)
        assert seen[-1]["sinks"] not in (0, sinks.data_ptr())


def test_a_negative_scale_runs_on_a_negated_q(launches):
    """The kernel's row max is of the raw scores, so softmax_scale < 0 runs -q with |scale| (the same scores)."""
    seen, _ = launches
    q, k, v, lens = arrays()
    for _ in range(2):
        fav.attention_with_kvcache(q, k, v, cache_seqlens=lens, softmax_scale=-0.5)
        assert seen[-1]["q"] != q.data_ptr() and seen[-1]["scale_log2"] == pytest.approx(0.5 * 1.4426950408889634)
