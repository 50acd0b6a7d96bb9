// fa3_fwd's producer: one thread of warpgroup 0 issues every TMA copy (Q once per tile, then K_j and V_j into the
// ring of STAGES stages) and does nothing else. The mbarriers of smem.cuh carry the protocol: before it reuses a
// buffer it waits for the buffer's empty barrier (the consumers' arrivals), and it announces the bytes on the
// buffer's full barrier, which the copy completes. The K/V blocks of a tile go in the order the consumers visit
// them: from the last to the first. Rows past seqlen_q or seqlen_k and columns past head_dim land as zeros (the
// tensor map's extent); in a packed batch, rows past a sequence's end are the next sequence's (the mask hides
// those keys, and those query rows are never stored).
#pragma once
#include "scheduler.cuh"

namespace fav {
namespace hopper {

// Where sequence b's rows are in the tensor maps: its first row of q and of k, and the maps' batch coordinate. A
// dense batch's maps are (batch, seqlen, heads, d); a packed batch's (1, total, heads, d), its sequences one after
// another (common/sequence.cuh).
struct TmaOrigin { int q, k, b; };
template <class Params>
__forceinline__ __device__ TmaOrigin tma_origin(const Params&, int b) { return {0, 0, b}; }
__forceinline__ __device__ TmaOrigin tma_origin(const MaskedFwdParams& p, int b) {
    if (p.cu_seqlens_q == nullptr) return {0, 0, b};
    const PackedSequence s = sequence_of(p, b);
    return {s.q0, s.k0, 0};
}

template <class C>
struct Producer {
    using Prec = typename C::Prec;
    using TQ = typename C::TQ;
    using TK = typename C::TK;
    using TV = typename C::TV;
    const typename C::Params& p;
    const SharedLayout<C> L;
    const TileScheduler<C> sched;
    int it = 0, q_uses = 0;  // K/V blocks and Q tiles loaded so far: their ring stage and phase

    // Q of tile w into the next Q buffer, once the last S on its previous tile is issued.
    __forceinline__ __device__ void load_q(const TmaDesc& tq, const Work& w, const TmaOrigin& at) {
        const int q = q_uses % C::QBUF;
        mbar_wait(L.q_empty(q), ((q_uses / C::QBUF) & 1) ^ 1);
        ++q_uses;
        mbar_expect_tx(L.q_full(q), TQ::BYTES);
        for (int c = 0; c < TQ::SLABS; ++c)
            tma_load_4d(L.q(q) + c * TQ::SLAB, tq, L.q_full(q), c * TQ::W / Prec::EB, at.q + w.m0, w.h, at.b);
    }
    // K_j and V_j of tile w, j from the last block down, each into the next ring stage once the consumers are
    // done with the block STAGES before it.
    __forceinline__ __device__ void load_kv(const TmaDesc& tk, const TmaDesc& tv, const Work& w, int h_kv,
                                            const TmaOrigin& at) {
        for (int j = w.blocks.end - 1; j >= w.blocks.begin; --j, ++it) {
            const int s = it % C::STAGES, phase = (it / C::STAGES) & 1;
            mbar_wait(L.k_empty(s), phase ^ 1);
            mbar_expect_tx(L.k_full(s), TK::BYTES);
            for (int c = 0; c < TK::SLABS; ++c)
                tma_load_4d(L.k(s) + c * TK::SLAB, tk, L.k_full(s), c * TK::W / Prec::EB, at.k + j * C::BN, h_kv,
                            at.b);
            mbar_wait(L.v_empty(s), phase ^ 1);
            mbar_expect_tx(L.v_full(s), TV::BYTES);
            for (int c = 0; c < TV::SLABS; ++c)
                Prec::load_v(L.v(s) + c * TV::SLAB, tv, L.v_full(s), j, c, h_kv, at.b, at.k);
        }
    }
    // Every work item of the CTA: one tile, or on the persistent grid the scheduler's items until the end, each
    // handed to the consumers before its loads.
    __forceinline__ __device__ void run(const TmaDesc& tq, const TmaDesc& tk, const TmaDesc& tv) {
        tma_prefetch_desc(tk);
        tma_prefetch_desc(tv);
        for (int k = 0, t = blockIdx.x;; ++k) {
            if constexpr (C::PERSISTENT) sched.publish(L, k, t);
            if (t >= sched.work_end()) break;
            const Work w = sched.tile_at(t);
            const int h_kv = w.h / p.group;
            const TmaOrigin at = tma_origin(p, w.b);
            if (w.blocks.count() > 0) load_q(tq, w, at);  // else no key for these rows: the consumers write 0
            load_kv(tk, tv, w, h_kv, at);
            if (!C::PERSISTENT) break;
            sched.advance(t);
        }
        if constexpr (C::PERSISTENT) sched.finish();
    }
};

}  // namespace hopper
}  // namespace fav
