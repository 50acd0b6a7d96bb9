"""Context parallelism (fa_variants/distributed.py) on CPU processes with gloo: ring attention (zigzag and in-order
layouts, causal and not, GQA) and Ulysses attention, with 2 and 4 ranks, give every rank's rows of the output and
of dq, dk, dv as one process's attention of the whole sequence does (the NumPy models on both sides); and the
layout helpers shard and unshard. One spawn per world size runs every case (a process start costs seconds)."""
from __future__ import annotations

import os
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

B, H, HKV, D = 1, 4, 2, 16
N = 48                      # 2 x 4 ranks x 6: zigzag chunks of 6 tokens at world 4
# (name, function, causal, zigzag); the reference is fav.attention over the whole sequence with the same causal
CASES = [("ring zigzag causal", "ring", True, True), ("ring in order causal", "ring", True, False),
         ("ring full", "ring", False, False), ("ulysses causal", "ulysses", True, False)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, N, h, D, generator=g).to(torch.float16) for h in (H, HKV, HKV, H))
    return q, k, v, dout


def _worker(rank: int, world: int, port: int, seed: int, results):
    try:
        _run(rank, world, port, seed, results)
    except BaseException as e:  # noqa: BLE001 - reported to the test, which would otherwise wait for a result
        import traceback
        results.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _run(rank: int, world: int, port: int, seed: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import fa_variants as fav
        from fa_variants import distributed as fad
        q, k, v, dout = _inputs(seed)
        mine = {}
        for name, fn, causal, zigzag in CASES:
            leaves = [fad.shard(x, zigzag=zigzag).requires_grad_() for x in (q, k, v)]
            call = fad.ring_attention if fn == "ring" else fad.ulysses_attention
            kw = dict(zigzag=zigzag) if fn == "ring" else {}
            out = call(*leaves, causal=causal, backend="numpy", **kw)
            out.backward(fad.shard(dout, zigzag=zigzag))
            full = [fad.unshard(t.detach(), zigzag=zigzag) for t in (out, *(x.grad for x in leaves))]
            mine[name] = [t.float().numpy() for t in full]
        if rank == 0:   # the reference, in one process
            ref = {}
            for causal in (True, False):
                leaves = [x.clone().requires_grad_() for x in (q, k, v)]
                out = fav.attention(*leaves, causal=causal, backend="numpy")
                out.backward(dout)
                ref[causal] = [t.detach().float().numpy() for t in (out, *(x.grad for x in leaves))]
            mine["reference"] = ref
        results.put((rank, mine))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ring_and_ulysses_match_one_process(world):
    mp = torch.multiprocessing.get_context("spawn")
    results = mp.Queue()
    seed = int(np.random.SeedSequence().entropy % 2**31)
    port = _free_port()
    procs = [mp.Process(target=_worker, args=(r, world, port, seed, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=240) for _ in range(world))
    errors = {r: x for r, x in got.items() if isinstance(x, str)}
    assert not errors, errors
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    ref = got[0]["reference"]
    for name, _, causal, _ in CASES:
        for r in range(world):   # every rank gathered the whole sequence: each must be the reference
            for what, a, b in zip(("out", "dq", "dk", "dv"), got[r][name], ref[causal]):
                err = np.linalg.norm(a - b) / np.linalg.norm(b)
                assert err <= 5e-3, f"{name}, world {world}, rank {r}: {what} off by {err:.2g} (seed {seed})"


def test_shard_and_unshard_are_inverse_and_balanced():
    """Without a process group: the zigzag chunks of each rank, checked on the layout helper itself."""
    from fa_variants.distributed import chunks_of
    for world in (1, 2, 3, 4, 8):
        held = sorted(c for r in range(world) for c in chunks_of(r, world, True))
        assert held == list(range(2 * world))
        # causal work per rank: a query chunk a sees a + 1/2 chunks of keys; zigzag's pairs sum to 2 world
        work = [sum(a + 0.5 for a in chunks_of(r, world, True)) for r in range(world)]
        assert len(set(work)) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_a_ring_of_one_gpu_is_attention(causal):
    """A world of one process on one GPU over NCCL (the degenerate ring: no send, the local steps only): the
    kernels' output and gradients equal fav.attention's on the same CUDA tensors, bf16, GQA 2:1."""
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs a CUDA GPU and NCCL")
    import fa_variants as fav
    from fa_variants import distributed as fad
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        g = torch.Generator(device="cuda").manual_seed(int(np.random.SeedSequence().entropy % 2**31))
        q, k, v, dout = (torch.randn(2, 1000, h, 128, generator=g, device="cuda", dtype=torch.bfloat16)
                         for h in (8, 4, 4, 8))
        results = []
        for fn in (lambda *x: fad.ring_attention(*x, causal=causal), lambda *x: fav.attention(*x, causal=causal)):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out = fn(*leaves)
            out.backward(dout)
            results.append([out.detach().float(), *(x.grad.float() for x in leaves)])
        for what, a, b in zip(("out", "dq", "dk", "dv"), *results):
            err = (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()
            assert err <= 1e-2, f"{what}: ring of one GPU off by {err:.2g} from fav.attention"
    finally:
        dist.destroy_process_group()
