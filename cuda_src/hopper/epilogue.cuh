// fa3_fwd's epilogue: what a consumer does with its 64 rows of a tile once the K/V loop is over (the rule itself,
// O / l and LSE = m + ln l, is common/epilogue.cuh's; the element type's store policies are precision.cuh's).
//
//   TMA out     (TMA_OUT: where the persistent grid pipelines across tiles) each consumer writes its rows into
//               shared memory in the output's format (SwizzledOut) and one of its threads stores them by TMA. 16-bit:
//               over its own 64 rows of the tile's Q buffer, which its last S has read; once the TMA unit has read
//               them, that thread arrives on the buffer's q_empty beside the warps' "last S issued" arrivals. It
//               waits for that read only after the next tile's masked blocks (release_o), not right after the
//               store: the producer needs the buffer for the tile after next only, and a wait there would hold the
//               whole consumer (a wgmma takes all four warps). fp8: into O's own buffer; the thread waits for the
//               TMA unit's read of the previous tile's rows only when its consumer is about to write the next.
//   direct      (the persistent grid elsewhere, d 256: shared memory is busy with the next tile's loads; and a tile
//               without keys, which has no Q buffer) O goes out straight from registers.
//   staged      (one CTA per tile) once every consumer is done with Q and the ring, O is staged over them for
//               16-byte stores.
//   split merge (SPLIT) a piece of a tail tile (scheduler.cuh) at its end: the tile's last piece in key order
//               merges the others' partial O, m, l (an fp32 workspace) into its own, then stores the tile.
#pragma once
#include "mainloop.cuh"

namespace fav {
namespace hopper {

template <class C>
struct Epilogue {
    using T = typename C::T;
    using Prec = typename C::Prec;
    using Params = typename C::Params;
    using TO = typename C::TO;
    static constexpr int D = C::D, DT = C::DT, NC = C::NC;

    const Params& p;
    const TmaDesc& to;  // the output's tensor map (TMA_OUT), boxes of 64 rows
    const SharedLayout<C>& L;
    const TileScheduler<C>& sched;
    const int c;
    const int row0;
    // O_IN_Q: the Q buffer whose O rows the storing thread has sent but not yet seen read (-1: none)
    int o_pending = -1;

    // One CTA per tile: this warp's rows of the staging tile, once every consumer is done with Q and the ring.
    __device__ u16* staging() const {
        named_sync(bar::CONSUMERS, C::CONSUMERS);
        return L.staging(row0);
    }

    // SPLIT: tile x, a piece of a tail tile, at its end, on this consumer's rows (O, m, l). The tile's last piece
    // in key order merges (true: it then stores the tile as any other); the others leave their O, m and l in the
    // workspace, count themselves done and release their Q buffer (false). The last piece's range is handed out
    // after the others', so they are all under way when it waits for them: nothing waits for a piece not yet
    // begun. A partial is per thread, in its fragment layout (DT float4 of O, then m and l of its two rows): every
    // access a coalesced float4. (Counting and waiting compile to a reduction and loads; a ticket, the last piece
    // to end merging, moved ptxas's schedule of the main loop.) m_scale: what m is multiplied by to be in log2
    // units.
    __device__ bool split_meet(const TileWork& x, float (&o)[1][DT][4], float (&m)[1][2], float (&l)[1][2],
                               float scale_log2) {
        const TailTile tt = sched.tail_tile(x.piece);
        const int tile = tt.tile, first = tt.first, last = tt.last;  // its ranges
        if (first == last) return true;
        const int tid = threadIdx.x % 128;
        int* done = sched.pieces_done(tile, c);  // its pieces that have left their partial
        auto part = [&](int e) {  // this thread's partial of piece e
            return reinterpret_cast<float4*>(tail_of(p).ws) + (i64)(e * NC + c) * (DT + 1) * 128 + tid;
        };
        if ((x.piece >> 1) < last) {
            float4* dst = part(x.piece);
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
                dst[dt * 128] = make_float4(o[0][dt][0], o[0][dt][1], o[0][dt][2], o[0][dt][3]);
            dst[DT * 128] = make_float4(m[0][0], m[0][1], l[0][0], l[0][1]);
            named_sync(bar::WARPGROUP + c, 128);
            if (tid == 0) {
                release_count(done);
                mbar_arrive_if(L.q_empty(x.q), C::O_IN_Q);  // the arrival its TMA store would have made
            }
            return false;
        }
        if (tid == 0) {
            wait_count_at_least(done, last - first);
            *done = 0;  // for the next launch on this stream
        }
        named_sync(bar::WARPGROUP + c, 128);
        // The rows' new reference is the largest of the pieces'; each piece's O and l are taken to it (a row a
        // piece saw no key of has O = l = 0 there), its own first, then the others in key order (range first + s;
        // its second piece where the range began in the tile before).
        auto piece_no = [&](int i) { return tt.piece_no(i); };
        float top[2] = {m[0][0], m[0][1]};
        for (int i = first; i < last; ++i) {
            const float4 ml = __ldcg(part(piece_no(i)) + DT * 128);
            top[0] = fmaxf(top[0], ml.x), top[1] = fmaxf(top[1], ml.y);
        }
        const float m_log2 = Prec::m_scale(scale_log2);  // (fp8's m is in log2 units already)
        const float ref0 = exp2_ref(top[0], m_log2), ref1 = exp2_ref(top[1], m_log2);
        auto factor = [&](float mp, float ref) { return mp == neg_inf() ? 0.f : exp2f_approx(mp * m_log2 - ref); };
        {
            const float f0 = factor(m[0][0], ref0), f1 = factor(m[0][1], ref1);
            l[0][0] *= f0, l[0][1] *= f1;
            scale_rows(o, {{f0, f1}});
        }
        for (int i = first; i < last; ++i) {
            const float4* src = part(piece_no(i));
            const float4 ml = __ldcg(src + DT * 128);
            const float f0 = factor(ml.x, ref0), f1 = factor(ml.y, ref1);
            l[0][0] = fmaf(ml.z, f0, l[0][0]), l[0][1] = fmaf(ml.w, f1, l[0][1]);
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const float4 v = __ldcg(src + dt * 128);
                o[0][dt][0] = fmaf(v.x, f0, o[0][dt][0]), o[0][dt][1] = fmaf(v.y, f0, o[0][dt][1]);
                o[0][dt][2] = fmaf(v.z, f1, o[0][dt][2]), o[0][dt][3] = fmaf(v.w, f1, o[0][dt][3]);
            }
        }
        m[0][0] = top[0], m[0][1] = top[1];
        return true;
    }

    // O_IN_Q: the Q buffer of the O rows sent last goes back to the producer once the TMA unit has read them.
    __device__ void release_o() {
        if constexpr (C::O_IN_Q)
            if (threadIdx.x % 128 == 0 && o_pending >= 0) {
                bulk_wait_read<0>();
                mbar_arrive_if(L.q_empty(o_pending), true);
                o_pending = -1;
            }
    }

    // O / l and the LSE of tile x's rows.
    __device__ void store(const TileWork& x, const float (&o)[1][DT][4], const float (&m)[1][2],
                          const float (&l)[1][2]) {
        const WarpRows<1, DT> rows{o, m, l, Prec::m_scale(p.scale_log2), x.w.b, x.w.h, x.w.m0 + row0};
        const float* sv = Prec::col_scales(p, x.w.b, x.h_kv);  // fp8: V's channel scales of this tile's kv head
        if constexpr (C::TMA_OUT) {
            if (x.n == 0) {  // no key: no Q buffer of its own either (16-bit)
                Prec::store_direct(rows, p, sv);
                return;
            }
            if constexpr (!C::O_IN_Q) {  // O's own buffer is free once the TMA unit has read the previous tile's
                if (threadIdx.x % 128 == 0) bulk_wait_read<0>();  // rows out of it: the storing thread waits,
                named_sync(bar::WARPGROUP + c, 128);              // its consumer with it
            }
            const u32 tile = C::O_IN_Q ? L.q(x.q) : L.o;
            SwizzledOut<T, TO>::store(rows, p, tile, row0, sv, Prec::LSE_LOG2);
            fence_proxy_async();                  // this thread's rows, before the TMA unit reads them
            named_sync(bar::WARPGROUP + c, 128);  // all of this consumer's rows
            if (threadIdx.x % 128 == 0) {
                for (int slab = 0; slab < TO::SLABS; ++slab)  // boxes of 64 rows of 128 bytes
                    tma_store_4d(to, tile + slab * TO::SLAB + c * 64 * TO::W, slab * TO::W / 2, x.w.m0 + 64 * c,
                                 x.w.h, x.w.b);
                bulk_commit();
                if constexpr (C::O_IN_Q) o_pending = x.q;  // released by release_o
            }
        } else if constexpr (C::PERSISTENT) {
            Prec::store_direct(rows, p, sv);
        } else {
            Prec::store_staged(rows, p, sv, staging());
        }
    }
    // After the last tile: its O rows read out by the TMA unit before the CTA's shared memory goes.
    __forceinline__ __device__ void finish() const {
        if (C::TMA_OUT && threadIdx.x % 128 == 0) bulk_wait_read<0>();
    }
};

}  // namespace hopper
}  // namespace fav
