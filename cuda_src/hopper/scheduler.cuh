// fa3_fwd's tile scheduler: which work item each CTA takes, in which order, and what a work item is.
//
//   order            The tiles are the Q blocks of one (head, batch) after another, each head's heaviest (last,
//                    causal) Q blocks first, so that the CTAs running at one time share a few heads' K and V in L2
//                    (ordering by Q block across all heads first makes a wave read every head's K and V).
//   one CTA a tile   (not PERSISTENT) CTA blockIdx.x works on tile blockIdx.x; the hardware's block scheduler
//                    hands the heavy tiles out first. Under a mask per sequence (fa3_fwd_masked) the Q blocks are
//                    counted over the longest sequence, the batch being the sequences, and the kernel leaves a
//                    tile past its sequence's end at once; a tile's blocks are its sequence's (Mask::blocks).
//   persistent grid  (PERSISTENT) one CTA per SM. Its producer takes tile blockIdx.x first, then the next in the
//                    same heavy-first order from a global counter (gridDim.x + atomicAdd), so an SM that finishes
//                    early takes the next tile (longest processing time first), and hands each tile to the
//                    consumers through a two-slot ring in shared memory (publish / receive). It can then load the
//                    next tile's Q and K/V while the consumers finish this one.
//   split tail       (SPLIT; non-causal, whose tiles are equal; the launcher turns it on where the last wave would
//                    leave SMs idle, kernels/fa3.py's tail_split) The last tail_tiles tiles, fewer than the SMs,
//                    are cut along their K/V blocks: their blocks, end to end, make ranges of tail_blocks blocks,
//                    one work item each (stream-K's idea). A range covers the end of one tile and maybe the start
//                    of the next: two pieces. The pieces of a tile meet at its end (epilogue.cuh's split merge).
//
// Work items: the whole tiles [0, full_tiles()), then piece j of range i as full_tiles() + 2 i + j (j = 1 only
// where range i runs into a second tile); work_end() is past the last. The counts are recomputed where used
// (from the constant bank), not held: a value live into the producer's 24 registers is spilled.
#pragma once
#include "../common/mask.cuh"
#include "smem.cuh"

namespace fav {
namespace hopper {

// The split tail's parameters and its fp32 workspace (none for fa2_fp8's parameters: one CTA per tile).
struct Tail { int tiles, blocks, ranges; float* ws; };
__forceinline__ __device__ Tail tail_of(const Fa3FwdParams& p) {
    return {p.tail_tiles, p.tail_blocks, p.tail_ranges, p.o_ws};
}
__forceinline__ __device__ Tail tail_of(const Fp8FwdParams&) { return {0, 1, 0, nullptr}; }
__forceinline__ __device__ Tail tail_of(const MaskedFwdParams&) { return {0, 1, 0, nullptr}; }
__forceinline__ __device__ Tail tail_of(const Fa3Fp8FwdParams& p) {
    return {p.tail_tiles, p.tail_blocks, p.tail_ranges, p.o_ws};
}

struct Piece { int tile, begin, end; };         // its tile among the tail's, and its K/V blocks [begin, end)
struct Work { int m0, h, b; BlockRange blocks; };  // a work item: the Q tile's first row, head, batch; its blocks

// A tail tile's ranges [first, last]: the pieces that meet at its end (the last, in key order, merges).
struct TailTile {
    int tile, first, last;
    int nb, w;  // K/V blocks per tile, blocks per range
    // the work item's piece number of range i's piece in this tile: its second where the range began before it
    __forceinline__ __device__ int piece_no(int i) const { return 2 * i + (i * w < tile * nb ? 1 : 0); }
};

template <class C>
struct TileScheduler {
    static constexpr int BM = C::BM, BN = C::BN;
    const typename C::Params& p;
    int* counters;  // PERSISTENT: the tile counter pair of this stream, then the split tail's counts of pieces

    __device__ int q_blocks() const { return (p.seqlen_q + BM - 1) / BM; }
    __device__ int tiles() const { return q_blocks() * p.heads * p.batch; }
    __device__ int kv_blocks() const { return (p.seqlen_k + BN - 1) / BN; }
    __device__ int full_tiles() const { return tiles() - (C::SPLIT ? tail_of(p).tiles : 0); }
    __device__ int work_end() const { return full_tiles() + (C::SPLIT ? 2 * tail_of(p).ranges : 0); }
    __device__ Piece piece_at(int e) const {  // e = 2 i + j
        const int nb = kv_blocks(), g0 = (e >> 1) * tail_of(p).blocks;
        const int g1 = min(g0 + tail_of(p).blocks, tail_of(p).tiles * nb), tile = g0 / nb + (e & 1);
        return Piece{tile, (e & 1) ? 0 : g0 - tile * nb, min(nb, g1 - tile * nb)};
    }
    __device__ Work tile_at(int t) const {
        BlockRange piece{0, 0};
        const bool split = C::SPLIT && t >= full_tiles();
        if (split) {
            const Piece x = piece_at(t - full_tiles());
            piece = {x.begin, x.end};
            t = full_tiles() + x.tile;
        }
        const int qb = q_blocks(), i_block = qb - 1 - t % qb, hb = t / qb;
        const int m0 = i_block * BM, h = hb % p.heads, b = hb / p.heads;
        return Work{m0, h, b, split ? piece : C::Mask::template blocks<BM, BN>(p, m0, h, b)};
    }
    // The ranges of the tail tile that piece e is part of.
    __forceinline__ __device__ TailTile tail_tile(int e) const {
        const int nb = kv_blocks(), w = tail_of(p).blocks, tile = piece_at(e).tile;
        return {tile, tile * nb / w, ((tile + 1) * nb - 1) / w, nb, w};
    }
    // The count of consumer c's pieces of tail tile `tile` that have left their partial.
    __forceinline__ __device__ int* pieces_done(int tile, int c) const { return counters + 2 + tile * C::NC + c; }

    // The producer: the CTA's k-th work item t (work_end() or more: the end) into tile slot k % 2.
    __forceinline__ __device__ void publish(const SharedLayout<C>& L, int k, int t) const {
        mbar_wait(L.tile_empty(k), ((k / 2) & 1) ^ 1);
        st_shared(L.tile_slot(k), t);
        mbar_arrive_if(L.tile_full(k), true);
    }
    // The producer: t becomes the work item after it, taken once t's loads are issued (two blocks before the
    // consumers need it). A range's pieces go second first: its first piece is then the one that ends last, so a
    // tile's last piece in key order (a first piece, the merger) ends after the tile's other pieces (second pieces
    // done first, or a range inside the tile) instead of waiting a piece's time for them. Counts past the whole
    // tiles are ranges, each begun with its second piece where it has one (its end is then past 0). The shuffle
    // tells ptxas the counter's value is warp-uniform, so the tile arithmetic stays in uniform registers (in
    // vector registers, the producer's 24 spill).
    __forceinline__ __device__ void advance(int& t) const {
        if (C::SPLIT && t >= full_tiles() && ((t - full_tiles()) & 1) == 1) {
            --t;
            return;
        }
        t = gridDim.x + __shfl_sync(1u, atomicAdd(counters, 1), 0);
        if (C::SPLIT && t >= full_tiles()) {
            const int e = 2 * (t - full_tiles());
            t = e >= 2 * tail_of(p).ranges ? work_end() : full_tiles() + e + (piece_at(e + 1).end > 0 ? 1 : 0);
        }
    }
    // The producer, after its last item: every CTA takes exactly one item past the end, last; the last CTA to do
    // so zeroes the counter pair for the next launch on this stream (counters[1] counts the CTAs done with [0]).
    __forceinline__ __device__ void finish() const {
        __threadfence();
        if (atomicAdd(counters + 1, 1) == (int)gridDim.x - 1) {
            atomicExch(counters, 0);
            atomicExch(counters + 1, 0);
        }
    }
    // A consumer warp: its k-th work item. The warp's leader reads the slot and releases it; the others take its
    // value by a shuffle, so that no read is left unordered before the producer's next write (racecheck).
    __forceinline__ __device__ int receive(const SharedLayout<C>& L, int k, bool leader) const {
        mbar_wait(L.tile_full(k), (k / 2) & 1);
        const int t = __shfl_sync(0xffffffffu, leader ? ld_shared(L.tile_slot(k)) : 0, 0);
        mbar_arrive_if(L.tile_empty(k), leader);
        return t;
    }
};

}  // namespace hopper
}  // namespace fav
