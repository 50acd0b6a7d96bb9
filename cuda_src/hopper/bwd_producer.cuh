// fa3_bwd's loads: one thread of the third warpgroup fills the dK/dV CTA's shared memory by TMA while the compute
// warpgroups run, instead of the compute threads' cp.async copies and blocking LSE/D loads of fa2_bwd_sm90. K_j
// and V_j arrive once per work item; each step's Q_i, dO_i (tensor maps) and its queries' LSE and D (one bulk copy
// from fa3_bwd_stats's padded layout) go into a ring of two stages. Full and empty mbarriers carry the protocol, as
// in the forward (producer.cuh):
//   full(s)     the producer's arrival with the stage's bytes
//   empty(s)    one arrival per compute warp, once its last wgmma of the step has read the stage
//   kv_full     the producer's arrival with the bytes of K_j and V_j
//   kv_empty    one arrival per compute warp, once its epilogue (staged over K_j, V_j) is done
// The producer walks the same work items and steps as the compute warps (fused_item_role, QSteps), so both sides
// agree on every stage's contents without talking.
#pragma once
#include "bwd_dq_writer.cuh"

namespace fav {

// The ring's mbarriers, after the fused dQ's slots (DkdvSmem's DQ_SLOTS + 16 on).
template <class C>
struct BwdRing {
    static constexpr int STAGES = 2;
    static constexpr u32 BYTES = 48;
    u32 at;
    __forceinline__ __device__ explicit BwdRing(u32 base) : at(base + C::Smem::DQ_SLOTS + 16) {}
    __forceinline__ __device__ u32 full(int s) const { return at + 8 * s; }
    __forceinline__ __device__ u32 empty(int s) const { return at + 16 + 8 * s; }
    __forceinline__ __device__ u32 kv_full() const { return at + 32; }
    __forceinline__ __device__ u32 kv_empty() const { return at + 40; }
    // (one thread, before the CTA's first barrier)
    __forceinline__ __device__ void init() const {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full(s), 1);
            mbar_init(empty(s), C::THREADS / 32);
        }
        mbar_init(kv_full(), 1);
        mbar_init(kv_empty(), C::THREADS / 32);
    }
    // The ring position of the CTA's g-th step (counted over all its work items): its stage and phase.
    __forceinline__ __device__ static int stage(int g) { return g % STAGES; }
    __forceinline__ __device__ static int phase(int g) { return (g / STAGES) & 1; }
};

// The producer warp (one lane issues): for every work item of the CTA, K_j and V_j once the previous item's epilogue has left their tiles,
// then for every step Q_i, dO_i and the stats of Q block i (stats: (batch, heads, Q blocks, LSE in log2 units of
// BM queries, D of BM queries), fa3_bwd_stats's) into the next stage once the compute warps are done with it. Rows
// past seqlen_q land as zero Q and dO rows (the maps' extent), with LSE +inf and D 0: P^T is 0 there. MASKED (P:
// MaskedBwdParams): each item on its sequence (SequenceWalk), whose rows the maps reach at the sequence's first
// rows of the packed tensors; rows past its end are the next sequence's or zeros, their LSE +inf all the same.
template <class C, class P>
__forceinline__ __device__ void bwd_producer(const P& p, const TmaDesc& tq, const TmaDesc& tdo,
                                             const TmaDesc& tk, const TmaDesc& tv, const float* stats, int batch) {
    using TQ = typename C::TQ;
    using TKV = typename C::TKV;
    constexpr u32 STATS = 2 * C::BM * 4;
    extern __shared__ unsigned char smem[];
    const DkdvTiles<C> tiles(smem);
    const BwdRing<C> ring(tiles.base);
    const int n_q = (p.seqlen_q + C::BM - 1) / C::BM;
    const bool leader = threadIdx.x % 32 == 0;  // issues the copies; the warp walks the steps with it
    int g = 0;  // steps loaded so far
    for (typename WalkOf<typename C::Params, C::BN, C::BM>::type w(p, batch); w.more(); w.next()) {
        const FusedItemRole role = w.role(p);
        const typename C::Params& s_p = w.view(p);
        const int h_kv = w.h_kv(), b = w.view_b(), key0 = role.j * C::BN;
        mbar_wait(ring.kv_empty(), (w.runs() & 1) ^ 1);
        if (leader) {
            mbar_expect_tx(ring.kv_full(), 2 * TKV::BYTES);
            for (int s = 0; s < TKV::SLABS; ++s) {
                tma_load_4d(tiles.k() + s * TKV::SLAB, tk, ring.kv_full(), s * TKV::W / 2, w.k_row(key0), h_kv, b);
                tma_load_4d(tiles.v() + s * TKV::SLAB, tv, ring.kv_full(), s * TKV::W / 2, w.k_row(key0), h_kv, b);
            }
        }
        const QSteps<C> steps(s_p, typename C::Mask(s_p, h_kv * p.group), key0, role.order);
        for (QStep cur = steps.first(p.group); cur.hq < p.group; cur = steps.after(cur), ++g) {
            const int stage = ring.stage(g), i = steps.block(cur), h = h_kv * p.group + cur.hq;
            mbar_wait(ring.empty(stage), ring.phase(g) ^ 1);
            if (!leader) continue;
            mbar_expect_tx(ring.full(stage), 2 * TQ::BYTES + STATS);
            const int row = w.q_row(i * C::BM);
            for (int s = 0; s < TQ::SLABS; ++s) {
                tma_load_4d(tiles.q(stage) + s * TQ::SLAB, tq, ring.full(stage), s * TQ::W / 2, row, h, b);
                tma_load_4d(tiles.dout(stage) + s * TQ::SLAB, tdo, ring.full(stage), s * TQ::W / 2, row, h, b);
            }
            const i64 block = C::MASKED ? dq_block<C::BM>(s_p, b, h, i) : ((i64)b * p.heads + h) * n_q + i;
            bulk_load(smem_u32(tiles.stats + 2 * stage * C::BM), stats + block * 2 * C::BM, STATS, ring.full(stage));
        }
    }
}

}  // namespace fav
