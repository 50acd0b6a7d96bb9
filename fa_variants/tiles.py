"""The tile configurations of the forward kernels and of fa3's backward: one table per kernel, and for fa3's
forward the one function that says which configuration a call launches (``fa3_tile``).

Everything that speaks of a kernel's tiles reads them here: the launchers (fa_variants/kernels/) compile and launch
them, their ``tiles()`` report them to the IO model, the NumPy models (fa_variants/reference/) take them as their
default blocks, ``fa-variants explain`` prints them, and docs/kernels/tiles.md gives each choice's measurement.
Pure data and pure functions: no GPU, no CuPy.

A table maps a template head dim (the kernels are compiled for a few; any other head dim runs on the next one up,
its extra columns zero) to its candidates, fastest first; the launcher runs the first whose shared memory fits the
device (sm_90 227 KB, sm_80 163 KB, sm_86/89 99 KB). The tiles are named tuples: they unpack and compare as the
tuples of template arguments they stand for.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import NamedTuple


class Tile(NamedTuple):
    """fa1_fwd.cu, fa2_fwd_sm90.cu (wgmma) and fa2_fp8_fwd.cu (mma.sync e4m3)."""
    block_q: int     # BM: rows of Q per CTA (fa2_fp8: Q's scale block)
    block_k: int     # BN: keys per K/V block (fa2_fp8: K's scale block)
    warps: int       # fa1: the warps split BN (split-K); the others: each warp owns BM / warps rows


class Fa2Tile(NamedTuple):
    """fa2_fwd.cu (mma.sync): each warp owns BM / warps rows of Q."""
    block_q: int
    block_k: int
    warps: int
    early_prefetch: bool  # the next K/V block's loads issued before the QK^T MMAs rather than after the softmax


class Fp8WgmmaTile(NamedTuple):
    """fa2_fp8_fwd_sm90.cu: two warpgroups of 64 rows (BM = Q's scale block, BN = K's)."""
    block_q: int
    block_k: int
    warps: int
    ctas_per_sm: int = 1  # CTAs per SM the kernel's registers are capped for


class Fa3Tile(NamedTuple):
    """fa3_fwd.cu (16-bit and e4m3): a producer warpgroup and BM / 64 consumer warpgroups."""
    block_q: int       # BM: 64 query rows per consumer warpgroup
    block_k: int       # BN: keys per K/V block
    stages: int        # K/V ring stages
    pingpong: bool     # the consumers take turns at the tensor cores
    persistent: bool   # one CTA per SM taking tiles from a counter, instead of one CTA per tile

    @property
    def consumers(self) -> int:
        return self.block_q // 64

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers)


def _frozen(table: dict) -> MappingProxyType:
    return MappingProxyType({d: tuple(cands) for d, cands in table.items()})


#: The head dims the 16-bit fa1 / fa2 kernels are instantiated for (fa2's mma.sync and fa1's tables' keys).
TEMPLATE_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)


def template_dim(head_dim: int, dims=TEMPLATE_DIMS) -> int:
    """The template head dim a kernel pads ``head_dim`` to: the smallest of ``dims`` at least as large."""
    for t in dims:
        if head_dim <= t:
            return t
    raise ValueError(f"head_dim must be at most {dims[-1]}, got {head_dim}")


def first_fitting(candidates, smem_bytes, head_dim: int, limit: int):
    """The first of ``candidates`` (fastest first) whose ``smem_bytes(head_dim, tile)`` fits ``limit`` bytes."""
    for tile in candidates:
        if smem_bytes(head_dim, tile) <= limit:
            return tile
    raise ValueError(f"no tile configuration for head_dim {head_dim} fits {limit} bytes of shared memory")


# ------------------------------------------------------------------------------------------------ fa1
#: The warps split BN, so each holds a BM x (BN / warps) score block and a BM x d partial P~V: BM shrinks as d
#: grows to keep that in registers; the smaller entries are the sm_80 and sm_86/89 choices.
FA1_TILES = _frozen({
    32: [Tile(64, 128, 4)],
    64: [Tile(32, 128, 4), Tile(32, 64, 4)],
    96: [Tile(32, 128, 4), Tile(16, 64, 4)],
    128: [Tile(32, 128, 4), Tile(32, 64, 4), Tile(16, 64, 4)],
    160: [Tile(16, 64, 4), Tile(16, 32, 2), Tile(16, 16, 1)],
    192: [Tile(16, 64, 4), Tile(16, 32, 2), Tile(16, 16, 1)],
    224: [Tile(16, 64, 4), Tile(16, 32, 2), Tile(16, 16, 1)],
    256: [Tile(16, 64, 4), Tile(16, 32, 2), Tile(16, 16, 1)],
})

# ------------------------------------------------------------------------------------------------ fa2
#: fa2_fwd.cu (mma.sync; sm_80, sm_86, sm_89). 32 rows per warp (two m16 tiles) wherever the registers allow: a
#: warp of 16 rows reads the whole K and V tile from shared memory for half the MMAs. Above d = 128 one warp's 16
#: rows of O take 4 D / 8 registers a thread, so 8 warps share the 128 rows. The early prefetch spills at d = 96
#: and d = 128 (and 4 bytes at d = 32 on sm_80).
FA2_TILES = _frozen({
    32: [Fa2Tile(128, 64, 4, False)],
    64: [Fa2Tile(128, 64, 4, True)],
    96: [Fa2Tile(128, 64, 4, False)],
    128: [Fa2Tile(128, 64, 4, False), Fa2Tile(128, 32, 4, False)],
    160: [Fa2Tile(128, 64, 8, True), Fa2Tile(64, 32, 4, True)],
    192: [Fa2Tile(128, 64, 8, True), Fa2Tile(64, 32, 4, True)],
    224: [Fa2Tile(128, 64, 8, True), Fa2Tile(64, 32, 4, True), Fa2Tile(32, 32, 2, True)],
    256: [Fa2Tile(128, 64, 8, True), Fa2Tile(64, 32, 4, True), Fa2Tile(32, 32, 2, True)],
})
assert tuple(FA2_TILES) == tuple(FA1_TILES) == TEMPLATE_DIMS

#: fa2_fwd.cu's fa2_fwd_masked (windows, softcap, ALiBi, sinks, packed batches): fa2's tiles where they compile
#: without spills for sm_80 and sm_90a; the mask's registers (its interval, cap, slope, sink) push d = 96 and 128 to
#: 32-key blocks and d = 256 to 64 query rows (d = 160's smaller tile loses its early prefetch).
FA2_MASKED_TILES = _frozen({**FA2_TILES, 96: [Fa2Tile(128, 32, 4, False)], 128: [Fa2Tile(128, 32, 4, False)],
                            160: [Fa2Tile(128, 64, 8, True), Fa2Tile(64, 32, 4, False)],
                            256: [Fa2Tile(64, 32, 4, True), Fa2Tile(32, 32, 2, True)]})

#: fa2_fwd_sm90.cu (wgmma, sm_90): two warpgroups of 64 rows. Its tiles are K-major 128-byte swizzled rows of 64,
#: 128 or 256 elements, so other head dims pad to those; 128-key blocks where the O accumulator leaves room for S
#: and P (d = 256: O takes 128 registers, so 64 keys).
FA2_WGMMA_TILES = _frozen({64: [Tile(128, 128, 8)], 128: [Tile(128, 128, 8)], 256: [Tile(128, 64, 8)]})

# ------------------------------------------------------------------------------------------------ fa2_fp8
#: The head dims the fp8 kernels are instantiated for (wgmma's K-major e4m3 tiles need multiples of 64).
FP8_TEMPLATE_DIMS = (64, 128, 256)

#: fa2_fp8_fwd.cu (mma.sync e4m3; sm_89, and sm_90 where ptxas emulates it with f16 HMMA at a cost in registers):
#: the largest tiles that compile without spills for both.
FA2_FP8_TILES = _frozen({64: [Tile(128, 32, 4)], 128: [Tile(64, 64, 4)], 256: [Tile(128, 32, 8)]})

#: fa2_fp8_fwd_sm90.cu (wgmma e4m3): 128-key blocks where the O accumulator leaves room (d = 256: 64); d = 64 on
#: 64-key blocks with two CTAs per SM (102 registers), where d = 128 would spill.
FA2_FP8_WGMMA_TILES = _frozen({64: [Fp8WgmmaTile(128, 64, 8, 2)], 128: [Fp8WgmmaTile(128, 128, 8)],
                               256: [Fp8WgmmaTile(128, 64, 8)]})
assert tuple(FA2_FP8_TILES) == tuple(FA2_FP8_WGMMA_TILES) == FP8_TEMPLATE_DIMS

# ------------------------------------------------------------------------------------------------ fa3
#: The head dims fa3_fwd.cu is instantiated for (wgmma's 128-byte swizzled K-major rows), 16-bit and e4m3.
FA3_DIMS = (64, 128, 256)

_PERSISTENT, _PER_TILE = True, False

#: (template head dim, causal) -> ((largest seqlen_k, tile), ..., (None, tile)): a call takes the first entry whose
#: bound its seqlen_k is within (None: no bound). Wide key blocks amortize a block's fixed work (barrier waits, row
#: max, O rescale) where O (D / 2 registers a consumer thread) leaves room for S, P and the next S. d = 64: three
#: consumers (BM = 192) keep the tensor cores fed where a block's GEMMs are short next to its softmax. d = 128: 160
#: keys, where a second Q buffer fits beside the K/V ring, so the persistent grid pipelines across tiles; up to
#: N_k = 1024, 128-key blocks leave no short last block; causal, 128 keys waste less of the diagonal block.
#: d = 256: O takes 128 registers, so 80 keys (two stages of K and V at 80 keys: 224 of the 227 KB), 64 where they
#: leave no masked or short block; no room for the persistent grid's second Q buffer, one CTA per tile.
FA3_TILES = MappingProxyType({
    (64, False): ((None, Fa3Tile(192, 128, 2, True, _PERSISTENT)),),
    (64, True): ((None, Fa3Tile(192, 128, 2, True, _PERSISTENT)),),
    (128, False): ((1024, Fa3Tile(128, 128, 2, True, _PERSISTENT)), (None, Fa3Tile(128, 160, 2, True, _PERSISTENT))),
    (128, True): ((None, Fa3Tile(128, 128, 2, True, _PERSISTENT)),),
    (256, False): ((1024, Fa3Tile(128, 64, 2, True, _PER_TILE)), (None, Fa3Tile(128, 80, 2, True, _PER_TILE))),
    (256, True): ((2048, Fa3Tile(128, 64, 2, True, _PER_TILE)), (None, Fa3Tile(128, 80, 2, True, _PER_TILE))),
})
assert {d for d, _ in FA3_TILES} == set(FA3_DIMS)

#: fa3_fp8 (fa3_fwd.cu's e4m3 instances), at any mask and length. BM is Q's scale block and BN K's (the quantizers
#: take them). e4m3 halves the shared memory and the P fragments of the 16-bit tiles; S (BN / 2 fp32 registers a
#: thread) and O (D / 2) stay: 192 keys at d = 128 (V^T in 64-byte slabs), FA3's 160 at d = 64 (32-byte slabs).
#: d = 64 and 128 on the persistent grid, where O leaves by TMA from a buffer of its own; d = 256 has no room for
#: that buffer.
FA3_FP8_TILES = MappingProxyType({64: Fa3Tile(192, 160, 2, True, _PERSISTENT),
                                  128: Fa3Tile(128, 192, 2, True, _PERSISTENT),
                                  256: Fa3Tile(128, 128, 2, True, _PER_TILE)})

#: fa3_fwd.cu's fa3_fwd_masked (windows, softcap, ALiBi, sinks, packed batches): one CTA per tile (a grid sized by
#: the longest sequence, whose CTAs past their sequence's end leave at once), fa3's blocks of 128 keys at d 64 and
#: 128 (a window's two edges are masked: narrower blocks waste less of them) and 80 at d 256.
FA3_MASKED_TILES = MappingProxyType({64: Fa3Tile(192, 128, 2, True, _PER_TILE),
                                     128: Fa3Tile(128, 128, 2, True, _PER_TILE),
                                     256: Fa3Tile(128, 80, 2, True, _PER_TILE)})

#: The FA3 paper's ablation (Table 2) runs at d = 128 on FA3's own tile, one CTA per tile at every length, with
#: ping-pong and the intra-warpgroup overlap each on or off (kernels/fa3.py ``plan(pingpong=, overlap=)``).
FA3_ABLATION_DIM = 128
FA3_ABLATION_TILE = Fa3Tile(128, 176, 2, True, _PER_TILE)


def fa3_template_dim(head_dim: int) -> int:
    """The template head dim fa3 and fa3_fp8 run ``head_dim`` at: 64, 128 or 256."""
    return template_dim(head_dim, FA3_DIMS)


def fa3_tile(head_dim: int, seqlen_k: int | None = None, causal: bool = False, fp8: bool = False) -> Fa3Tile:
    """The tile (and grid) fa3, or fa3_fp8 with ``fp8``, launches for a call of ``head_dim`` over ``seqlen_k``
    keys; ``seqlen_k`` None: the tile of the longest rows."""
    d = fa3_template_dim(head_dim)
    if fp8:
        return FA3_FP8_TILES[d]
    for bound, tile in FA3_TILES[d, bool(causal)]:
        if bound is None or (seqlen_k is not None and seqlen_k <= bound):
            return tile
    raise AssertionError("every fa3 rule ends with an unbounded entry")


def fa3_instances(fp8: bool = False) -> tuple[tuple[int, Fa3Tile], ...]:
    """Every (template head dim, tile) a call of fa3 (or fa3_fp8) can launch, each once."""
    if fp8:
        return tuple(FA3_FP8_TILES.items())
    return tuple(dict.fromkeys((d, tile) for (d, _), rules in FA3_TILES.items() for _, tile in rules))


class Fa3BwdTile(NamedTuple):
    """fa3_bwd.cu: a persistent dK/dV CTA of two compute warpgroups (64 keys each), the dQ writer and the producer."""
    block_q: int     # BM: queries per step (the N of S^T and dP^T; dQ's share is BM x d in two 64 x 64 halves)
    block_k: int     # BN: keys per CTA


#: fa3's backward by template head dim: 128 keys a CTA, and queries per step so that a step's share of dQ is
#: two 64 x 64 fp32 halves, one per compute warpgroup (by rows at d 64, by columns at d 128). Head dims above 128
#: run fa2's Hopper backward (kernels/fa3_bwd.py).
FA3_BWD_TILES = MappingProxyType({64: Fa3BwdTile(128, 128), 128: Fa3BwdTile(64, 128)})
