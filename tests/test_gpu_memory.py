"""Device memory comes back. After a forward and a backward of every variant that runs here, conftest's
``release_device_memory`` (what runs after every GPU test) returns the device's free memory to where it was: the
whole GPU suite then fits in one process on an 80 GB card, as each of its files does alone. GPU only."""
from __future__ import annotations

import pytest

import fa_variants as fav
from conftest import device_free_bytes, place, random_qkv_host, release_device_memory, to_device
from fa_variants import registry

pytestmark = pytest.mark.gpu

BATCH, HEADS, HEAD_DIM = 2, 8, 128   # q, k, v, dout, out, dq, dk, dv: 16 MiB each at seqlen 4096
SLACK = 16 * 2**20                   # under any one of those arrays; above cudaMalloc's 2 MiB granularity
ATTEMPTS = 3                         # other processes share the device (pytest-xdist's other workers): one that
                                     # allocates spoils one measurement, while a leak shows in every one


def _seqlen(free: int) -> int:
    """4096, or less where naive's forward and backward (about three fp32 seqlen x seqlen matrices per head) would
    take more than a tenth of the free memory."""
    n = 4096
    while n > 512 and 3 * 4 * BATCH * HEADS * n * n > free // 10:
        n //= 2
    return n


def _calls(rng, seqlen: int) -> None:
    """A forward of every variant that runs here, and its backward where it has one, on fresh inputs; keeps
    nothing."""
    import cupy
    host = random_qkv_host(rng, BATCH, seqlen, seqlen, HEADS, HEADS, HEAD_DIM, "float16")
    q, k, v = to_device(host)
    dout = place(random_qkv_host(rng, BATCH, seqlen, seqlen, HEADS, HEADS, HEAD_DIM, "float16")[0])
    for entry in registry.variants():
        if not entry.available()[0]:
            continue
        out, lse = fav.attention(q, k, v, variant=entry.name, causal=True, return_lse=True)
        assert bool(cupy.isfinite(out).all()), f"{entry.name}: non-finite output"
        if "backward" in entry.directions:
            grads = fav.attention_backward(dout, q, k, v, out, lse, variant=entry.name, causal=True)
            assert all(bool(cupy.isfinite(g).all()) for g in grads), f"{entry.name}: non-finite gradient"
    cupy.cuda.Device().synchronize()


def _forward_backward(rng, seqlen: int, pool) -> None:
    """_calls with every allocation from ``pool`` (None: CuPy's default pool). A pool of the caller's own is then
    emptied, as its owner would before dropping it: CuPy returns a dropped pool's cached blocks to the device only
    through free_all_blocks (in its memory.pyx, free blocks and their arena hold each other), and only the blocks no
    array holds. So its total after free_all_blocks is what the library keeps from it."""
    import cupy
    if pool is None:
        _calls(rng, seqlen)
        return
    with cupy.cuda.using_allocator(pool.malloc):
        _calls(rng, seqlen)
    release_device_memory()   # the library's plans dropped (a plan may hold a buffer from the pool current then)
    pool.free_all_blocks()
    assert pool.total_bytes() == 0, (f"the library keeps {pool.total_bytes() / 2**20:.1f} MiB allocated from the "
                                     f"caller's pool after the calls return")


@pytest.mark.parametrize("own_pool", [False, True], ids=["default-pool", "own-pool"])
def test_device_memory_returns_to_baseline_after_forward_and_backward(rng, own_pool):
    """own-pool: every allocation from a pool of the test's own that is gone when the calls return, as under
    conftest's ``poisoned``: whatever the library caches from it must not keep that pool's memory."""
    import cupy
    seqlen = _seqlen(device_free_bytes())
    _forward_backward(rng, seqlen, None)   # first calls: modules loaded, cuBLAS handles, per-stream buffers
    release_device_memory()
    leaked = []
    for _ in range(ATTEMPTS):
        before = device_free_bytes()
        _forward_backward(rng, seqlen, cupy.cuda.MemoryPool() if own_pool else None)
        release_device_memory()
        leaked.append(before - device_free_bytes())
        if leaked[-1] <= SLACK:
            return
    pytest.fail(f"seqlen {seqlen}: after each forward+backward and release_device_memory, "
                f"{', '.join(f'{b / 2**20:.0f}' for b in leaked)} MiB less device memory is free than before "
                f"(allowed: {SLACK / 2**20:.0f} MiB); CuPy's default pool holds "
                f"{cupy.get_default_memory_pool().total_bytes() / 2**20:.0f} MiB")
