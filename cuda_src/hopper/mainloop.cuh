// fa3_fwd's consumer main loop: one consumer warpgroup's 64 rows of a tile, over the tile's K/V blocks as the
// producer lands them in the ring. Per block: S = Q K^T (wgmma from shared memory), the mask, the online softmax
// with the lazy rescale, P~ repacked into registers as the A operand, O += P~ V (wgmma, A from registers).
//
//   ping-pong        (PINGPONG) named barriers hand the tensor cores from one consumer to the next, round robin:
//                    a consumer issues its wgmmas only after the previous one has issued its own, so one
//                    consumer's softmax runs while another's GEMMs occupy the tensor cores.
//   overlap          (OVERLAP) S_u = Q K_u^T is issued together with O += P_{u-1} V_{u-1}: the softmax of block u
//                    runs while the P V product of block u-1 is still on the tensor cores. O takes block u-1's
//                    rescale once P_{u-2} V_{u-2} is done, before P_{u-1} V_{u-1} is added: one block later than
//                    FA2 rescales, the same arithmetic.
//   lazy rescale     O's rescale only where a reference point of the warp's rows moved; the references move only
//                    when a row's max has grown by more than RESCALE_TAU (FA4's rule, softmax.cuh's
//                    reference_moves), so P~ <= 2^tau and most blocks skip it.
//   block order      The K/V blocks are visited from the last to the first, as FA3 does: the blocks that need a
//                    mask (the causal diagonal, the seqlen_k tail) come first, and the loop after them is
//                    mask-free (under a window, the blocks past its left edge need the mask again: a third loop).
//                    Causal, a consumer skips the first blocks that none of its own 64 rows sees (TileWork::z),
//                    passing its ping-pong turns without a wgmma. The mask policy (C::Mask) also transforms the
//                    scores of every block (softcap, ALiBi), masked or not.
// While a wgmma is in flight nothing may branch (ptxas completes every wgmma at a control-flow join), so masking
// is a compile-time case of the step, and the barrier arrivals in flight are predicated, not branched.
#pragma once
#include "scheduler.cuh"

namespace fav {
namespace hopper {

// fa3_fwd's named barriers (bar.sync ids; 0 is __syncthreads): consumer c's ping-pong turn PINGPONG + c, all the
// consumers CONSUMERS, consumer c's own warpgroup WARPGROUP + c, consumer c's turn at the SFU EXP_TURN + c.
namespace bar {
constexpr int PINGPONG = 1, CONSUMERS = 4, WARPGROUP = 5, EXP_TURN = 8;
}

// Ping-pong: consumer c issues after wait() on its barrier, which the previous consumer's pass() (bar.arrive)
// completes once it has issued. The last consumer passes first (start), so consumer 0 begins; the turns run on
// across tiles (every consumer visits the same blocks, skipped or not).
template <class C>
struct PingPong {
    int c;
    __device__ void wait() const { if constexpr (C::PINGPONG) named_sync(bar::PINGPONG + c, 256); }
    __device__ void pass() const { if constexpr (C::PINGPONG) named_arrive(bar::PINGPONG + (c + 1) % C::NC, 256); }
};

// EXP_TURNS: the consumers also take turns at their exponentials (round robin as above): the SFU runs one
// consumer's exponentials at a time, at full speed, instead of two consumers' interleaved at half speed each,
// while the other takes its row max or issues its wgmmas. Every consumer takes one turn per block of every tile,
// visited or skipped, so the turns stay matched. (NoTurn: softmax.cuh's, which does nothing.)
struct ExpTurn {
    int mine, next;
    __forceinline__ __device__ void wait() const { named_sync(mine, 256); }
    // The thread count read from the row sums (never negative, so always 256): with a plain bar.arrive ptxas
    // scheduled the pass before every exponential, and the turn passed at once.
    __forceinline__ __device__ void pass(const float (&l)[1][2]) const {
        named_arrive(next, l[0][0] < 0.f || l[0][1] < 0.f ? 288 : 256);
    }
};

// A tile as the consumers see it: its rows and key blocks, where block u = 0 sits in the K/V ring, its Q buffer,
// and (fp8) Q's scale. The steps take it as an argument: at a CROSS tile boundary a step works on two tiles, the
// next one's first S beside this one's last P V.
struct TileWork {
    Work w;
    int h_kv;        // its K/V head
    int n, j_mask;   // its blocks, and the first that needs a mask for this consumer's rows
    int j_low;       // and below which blocks need it again (a window's left edge; 0 for the others)
    int z;           // its leading blocks that none of this consumer's rows sees (skipped), < n
    int it;          // ring index of its block u = 0
    int q, q_phase;  // its Q buffer, and that buffer's phase
    float q_scale;   // fp8: Q's scale times scale_log2
    int piece;       // SPLIT: its work item's piece number (2 i + j) if it is a piece, else -1
    bool narrow;     // its block u = 0 is the seqlen_k tail, visited at TAIL_BN keys (then z = 0, n >= 2)
};

template <class C>
struct Mainloop {
    using T = typename C::T;
    using Prec = typename C::Prec;
    using Params = typename C::Params;
    using TQ = typename C::TQ;
    using TK = typename C::TK;
    using TV = typename C::TV;
    using Turn = typename Pick<C::EXP_TURNS, ExpTurn, NoTurn>::type;
    using Mask = typename C::Mask;
    static constexpr int D = C::D, BN = C::BN, BM = C::BM, DT = C::DT, KK = C::KK, DN = C::DN;
    static constexpr int STAGES = C::STAGES, TAIL_BN = C::TAIL_BN;
    static constexpr bool OVERLAP = C::OVERLAP;

    const Params& p;
    const SharedLayout<C>& L;
    const TileScheduler<C>& sched;
    const Mask mask;       // the launch's, or (BY_SEQUENCE) the CTA's sequence and head's
    const int c;           // rows [64 c, 64 c + 64) of each tile
    const int row0;        // this warp's first row within a tile
    const bool leader;     // arrives on the empty barriers for its warp
    const PingPong<C> pingpong;
    Turn exp_turn;
    float softmax_log2;    // softmax_scale * log2(e), read once for the kernel
    // The consumer's registers and ring position, declared by the kernel (the epilogue reads them too): K/V blocks
    // and Q tiles consumed so far, as the producer counts them; O, m and l of the tile in work (set by restart()
    // before its first block); P~ of the block whose P V is next, as A fragments (16-bit, or e4m3 x 256).
    int &it, &q_uses;
    float (&o)[1][DT][4];
    float (&m)[1][2], (&l)[1][2];
    u32 (&pa)[BN / KK][4];

    static __device__ Turn turn_of(int c) {
        if constexpr (C::EXP_TURNS) return ExpTurn{bar::EXP_TURN + c, bar::EXP_TURN + (c + 1) % C::NC};
        else return NoTurn{};
    }

    // Consumer c (its warp's first row row0, leader its first thread) on the registers o, m, l, pa and the ring
    // counters it, q_uses. The last consumer passes the first turns (ping-pong's and the SFU's), so that consumer
    // 0 starts.
    __forceinline__ __device__ Mainloop(const Params& p_, const SharedLayout<C>& L_, const TileScheduler<C>& sched_,
                                        const Mask& mask_, int c_, int row0_, bool leader_, int& it_,
                                        int& q_uses_, float (&o_)[1][DT][4], float (&m_)[1][2], float (&l_)[1][2],
                                        u32 (&pa_)[BN / KK][4])
        : p(p_), L(L_), sched(sched_), mask(mask_), c(c_), row0(row0_), leader(leader_), pingpong{c_}, it(it_),
          q_uses(q_uses_), o(o_), m(m_), l(l_), pa(pa_) {
        if (C::PINGPONG && c == C::NC - 1) named_arrive(bar::PINGPONG, 256);
        exp_turn = turn_of(c);
        if (C::EXP_TURNS && c == C::NC - 1) named_arrive(bar::EXP_TURN, 256);
        softmax_log2 = p.scale_log2;  // (read inside the step, it moved ptxas's schedule)
    }

    // After the last tile: the last consumer's last passes are matched, so every bar.arrive has its bar.sync.
    __forceinline__ __device__ void finish() const {
        if (C::PINGPONG && c == 0) named_sync(bar::PINGPONG, 256);
        if (C::EXP_TURNS && c == 0) named_sync(bar::EXP_TURN, 256);
    }

    __device__ void exp_turn_alone() const {  // a skipped block's turn at the SFU
        const float none[1][2] = {};
        exp_turn.wait();
        exp_turn.pass(none);
    }

    // The tile's sequence: its query rows and K/V blocks (the launch's, or under a mask per sequence the mask's).
    __device__ int seqlen_q() const {
        if constexpr (Mask::BY_SEQUENCE) return mask.seqlen_q;
        else return p.seqlen_q;
    }
    __device__ int kv_blocks() const {
        if constexpr (Mask::BY_SEQUENCE) return (mask.seqlen_k + BN - 1) / BN;
        else return sched.kv_blocks();
    }

    // Work item t as this consumer sees it; counts its blocks and Q buffer in the ring.
    __device__ TileWork tile_of(int t) {
        TileWork x;
        x.w = sched.tile_at(t);
        x.h_kv = x.w.h / p.group;
        // The shuffle tells ptxas the block count is warp-uniform: without it, the loop over the blocks held its
        // bound in a vector register and ptxas put a WARPSYNC before every wgmma of the loop.
        x.n = __shfl_sync(0xffffffffu, x.w.blocks.count(), 0);
        const int r0 = x.w.m0 + 64 * c, r1 = min(r0 + 63, seqlen_q() - 1);  // its first and last real row
        // (Both depend on the consumer, so on threadIdx.x: the shuffles keep them warp-uniform for ptxas.)
        x.j_mask = __shfl_sync(0xffffffffu, mask.template first_masked_block<BN>(r0), 0);
        x.j_low = 0;
        if constexpr (Mask::LOW_EDGE) x.j_low = __shfl_sync(0xffffffffu, mask.template masked_below<BN>(r1), 0);
        // The blocks visited first (j from end - 1 down) that hold no key for any of its rows: causal, right of its
        // last row's diagonal, or every block if it has no real row (the short last Q block). It skips them (their
        // K and V go back to the producer unread, and its ping-pong turn passes without a wgmma), but never the
        // tile's last, so that every consumer has a first and a last P V per tile.
        const int hi = mask.last_key(r0, r1);  // its last visible key, or -1
        const int z = hi < 0 ? x.n : x.w.blocks.end - 1 - hi / BN;
        x.z = __shfl_sync(0xffffffffu, max(0, min(z, x.n - 1)), 0);
        x.it = it;
        x.q = q_uses % C::QBUF;
        x.q_phase = (q_uses / C::QBUF) & 1;
        x.piece = C::SPLIT && t >= sched.full_tiles() ? t - sched.full_tiles() : -1;
        // Block u = 1 (whose step issues the narrow P V) must be one without a mask: the narrow P V is compiled
        // into the mask-free step only.
        const int end = x.w.blocks.end;
        x.narrow = TAIL_BN > 0 && x.z == 0 && x.n >= 2 && end == kv_blocks() &&
                   mask.seqlen_k - (end - 1) * BN <= TAIL_BN && end - 2 < x.j_mask &&
                   (!Mask::LOW_EDGE || end - 2 >= x.j_low);
        x.q_scale = Prec::q_scale(p, sched, x.w);
        if (x.n > 0) {
            it += x.n;
            ++q_uses;
        }
        return x;
    }

    __device__ void restart() {  // O, m and l of a tile before its first block
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[0][dt][e] = 0.f;
        m[0][0] = m[0][1] = neg_inf();
        l[0][0] = l[0][1] = 0.f;
    }

    // The k-steps' descriptors of Q (this consumer's 64 rows) and K: a k-step is 32 bytes of the reduction.
    __device__ u64 desc_a(int q, int kk) const {
        return Prec::STEP_DESC ? TQ::desc(L.q(q), c * 64, 0) + TQ::step(0, kk * 32) : TQ::desc(L.q(q), c * 64, kk * 32);
    }
    __device__ u64 desc_k(int stage, int kk) const {
        return Prec::STEP_DESC ? TK::desc(L.k(stage), 0, 0) + TK::step(0, kk * 32) : TK::desc(L.k(stage), 0, kk * 32);
    }
    template <int KEYS>
    __device__ void issue_qk(float (&s)[1][KEYS / 8][4], int q, int stage) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / KK; ++kk) {
            const u64 a = desc_a(q, kk), b = desc_k(stage, kk);
            Prec::mma_qk(s[0], a, b, kk > 0);
        }
        wgmma_commit();
    }
    template <int KEYS>  // over the block's first KEYS keys (BN, or TAIL_BN)
    __device__ void issue_pv(int stage) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KEYS / KK; ++kk)
#pragma unroll
            for (int nn = 0; nn < D / DN; ++nn) {
                auto& acc = reinterpret_cast<float(&)[DN / 8][4]>(o[0][nn * DN / 8]);
                Prec::mma_pv(acc, pa[kk], Prec::desc_v(L.v(stage), kk, nn));
            }
        wgmma_commit();
    }

    // The online softmax of block j of tile x into (mx, lx). alpha: what O is multiplied by for this block.
    // Returns whether O needs it (warp-uniform: the rescale in the step is a branch, not predicated work).
    template <bool MASKED, int NS>
    __device__ bool softmax(const TileWork& x, float (&s)[1][NS][4], int j, float (&mx)[1][2], float (&lx)[1][2],
                            float (&alpha)[1][2]) {
        const bool moved = Prec::template softmax<MASKED, C::EXP_FMA>(p, x, j, s, mx, lx, alpha, softmax_log2, exp_turn);
        // LATE_PV_WAIT: lx < 0 never holds (a sum of exponentials, or NaN), but reading it makes the vote, and so
        // the rescale's branch in the step, wait for every exponential: ptxas cannot sink them past it. The branch
        // then holds a wgmma wait, which every warp of the warpgroup must execute at the same place
        // (compute-sanitizer synccheck: "mismatching warpgroup instruction pc" with a per-warp vote), so the vote
        // is the consumer's (its barrier WARPGROUP + c), not the warp's.
        if constexpr (Prec::LATE_PV_WAIT)
            return named_any(bar::WARPGROUP + c, 128, moved || lx[0][0] < 0.f || lx[0][1] < 0.f);
        else return __any_sync(0xffffffffu, moved);
    }

    // Tile x's u-th block in the ring; u = -1 is the previous tile's last (the ring runs on across tiles).
    __device__ int stage_of(const TileWork& x, int u) const { return (x.it + u) % STAGES; }
    __device__ int phase_of(const TileWork& x, int u) const { return ((x.it + u) / STAGES) & 1; }

    __device__ void pv_alone(const TileWork& x, int u) {  // P_u V_u in a ping-pong turn of its own, V_u released
        mbar_wait(L.v_full(stage_of(x, u)), phase_of(x, u));
        pingpong.wait();
        issue_pv<BN>(stage_of(x, u));
        pingpong.pass();
        wgmma_wait<0>();
        hold_registers(o[0]);
        mbar_arrive_if(L.v_empty(stage_of(x, u)), leader);
    }

    // Visit u of x.n (block j = end - 1 - u). PREV (OVERLAP): S_u is issued with P_{u-1} V_{u-1}; without it, S_u
    // waits, its softmax rescales O at once and P_u V_u follows: fa2_fwd_sm90's step, with TMA barriers. The
    // tile's last S releases its Q buffer (q_empty) for the producer's tile after next. O takes block u's alpha
    // once nothing is in flight (after P_{u-1} V_{u-1}, before P_u V_u), where a branch is free, and only if a row
    // of the warp moved its reference (before, O is still 0). The softmax runs into (mx, lx): (m, l), or at a CROSS
    // boundary (u = 0, PREV: the P V in flight is the previous tile's last) the next tile's fresh pair, while m and
    // l are still the previous tile's, for its epilogue. S_KEYS, PV_KEYS: the width of S_u and of the P V in
    // flight, BN but at a narrow tail (TAIL_BN). BARE: a block without the element test under a mask that does not
    // transform the scores (AttnMask::scores() RAW), whose scores go to the softmax as they come.
    template <bool MASKED, bool PREV, int S_KEYS, int PV_KEYS, bool BARE = false>
    __device__ void step(const TileWork& x, int u, float (&mx)[1][2], float (&lx)[1][2]) {
        const int j = x.w.blocks.end - 1 - u;
        float s[1][S_KEYS / 8][4];
        mbar_wait(L.k_full(stage_of(x, u)), phase_of(x, u));
        if constexpr (PREV) mbar_wait(L.v_full(stage_of(x, u - 1)), phase_of(x, u - 1));
        pingpong.wait();
        issue_qk<S_KEYS>(s, x.q, stage_of(x, u));
        if constexpr (PREV) issue_pv<PV_KEYS>(stage_of(x, u - 1));  // O is in block u-1's reference already
        pingpong.pass();
        wgmma_wait<PREV ? 1 : 0>();
        hold_registers(s[0]);
        mbar_arrive_if(L.k_empty(stage_of(x, u)), leader);
        mbar_arrive_if(L.q_empty(x.q), leader && u == x.n - 1);
        if constexpr (!BARE) mask.template apply<MASKED>(s, x.w.m0 + row0, j * BN);
        float alpha[1][2];
        const bool moved = softmax<MASKED>(x, s, j, mx, lx, alpha);
        // O is still 0 at the first visited block, and at a CROSS boundary (u = 0, PREV) O is the previous tile's,
        // which this block's alpha must not touch. (An overlapped step inside the loop is past both.)
        const bool rescale = (PREV ? u > 0 : u > x.z) && moved;
        if constexpr (Prec::LATE_PV_WAIT)
            if (rescale) {
                if constexpr (PREV) wgmma_wait<0>();  // (the wait below is then a no-op)
                scale_rows(o, alpha);
            }
        if constexpr (PREV) {
            wgmma_wait<0>();
            hold_registers(o[0]);
            mbar_arrive_if(L.v_empty(stage_of(x, u - 1)), leader);
        }
        Prec::pack_p(pa, s);
        if constexpr (!Prec::LATE_PV_WAIT)
            if (rescale) scale_rows(o, alpha);
        if constexpr (!OVERLAP) pv_alone(x, u);  // P_u V_u now
    }
    // A tile's first visited block u (u = z, or 0 at a CROSS boundary); the P V in flight is never narrow.
    template <bool PREV>
    __device__ void visit(const TileWork& x, int u, float (&mx)[1][2], float (&lx)[1][2]) {
        if constexpr (TAIL_BN > 0)
            if (x.narrow) {  // (then u = 0)
                step<true, PREV, TAIL_BN, BN>(x, u, mx, lx);
                return;
            }
        const int j = x.w.blocks.end - 1 - u;
        if (j >= x.j_mask || (Mask::LOW_EDGE && j < x.j_low)) step<true, PREV, BN, BN>(x, u, mx, lx);
        else step<false, PREV, BN, BN>(x, u, mx, lx);
    }
    // A skipped block u of tile x: its stages go back to the producer once they have landed (an arrival before
    // that could complete the empty barrier's previous phase), and the consumer's turns pass without a wgmma, so
    // that every consumer takes as many turns as the others.
    __device__ void skip(const TileWork& x, int u, bool turn) {
        mbar_wait(L.k_full(stage_of(x, u)), phase_of(x, u));
        mbar_arrive_if(L.k_empty(stage_of(x, u)), leader);
        mbar_wait(L.v_full(stage_of(x, u)), phase_of(x, u));
        mbar_arrive_if(L.v_empty(stage_of(x, u)), leader);
        exp_turn_alone();
        for (int i = 0; turn && i < (OVERLAP ? 1 : 2); ++i) {
            pingpong.wait();
            pingpong.pass();
        }
    }
    __device__ void last_pv(const TileWork& x) {  // OVERLAP: the last block's P V, with nothing beside it
        if (!OVERLAP || x.n == 0) return;
        pv_alone(x, x.n - 1);
    }
    // A tile's skipped blocks from u0 on, then its first visited block, alone.
    __device__ void begin(const TileWork& x, int u0) {
        restart();
        if (x.n > 0) {
            mbar_wait(L.q_full(x.q), x.q_phase);
            for (int u = u0; u < x.z; ++u) skip(x, u, true);
            visit<false>(x, x.z, m, l);
        }
    }
    // The blocks after the first: those that need a mask come first (j from end - 1 down), a loop of their own,
    // so that the mask-free loop has no branch (written as one loop, ptxas kept both steps in it). Between the
    // two loops nothing is in flight (a branch is free there): the epilogue releases the previous tile's O buffer.
    // Under a window the blocks below j_low need the mask again: a third loop. A mask that can transform the scores
    // (softcap, ALiBi) has a copy of these loops for each class of its scores (common/mask.cuh's Scores), chosen
    // once per tile: RAW, whose mask-free blocks leave the scores as they come (BARE); CAPPED, a copy of its own in
    // which ptxas, knowing the cap on and the slope 0, drops the ALiBi and the cap's test; TRANSFORMED, every test
    // made (also a mask that transforms nothing: CausalMask). Otherwise the tests are predicated into every score of
    // every loop, issued whether they apply or not (a branch there would complete the P V wgmma in flight). Not at
    // d 256, whose wider O leaves no registers for more copies (ptxas spills), and whose products outweigh the
    // softmax's issue slots more than at d 128.
    template <class Epilogue>
    __device__ void blocks_after_first(const TileWork& x, Epilogue& epi) {
        if constexpr (Mask::TRANSFORMS && D <= 128) {
            const Scores how = mask.scores();
            if (how == Scores::RAW) return blocks_after_first<Scores::RAW>(x, epi);
            if (how == Scores::CAPPED) return blocks_after_first<Scores::CAPPED>(x, epi);
        }
        blocks_after_first<Scores::TRANSFORMED>(x, epi);
    }
    template <Scores HOW, class Epilogue>
    __device__ void blocks_after_first(const TileWork& x, Epilogue& epi) {
        constexpr bool BARE = HOW == Scores::RAW;
        int u = x.z + 1;
        if constexpr (TAIL_BN > 0)  // block 0's narrow P V beside S_1 (block 1 needs no mask: x.narrow)
            if (x.narrow) step<false, OVERLAP, BN, TAIL_BN>(x, u++, m, l);
        for (; u < x.n && x.w.blocks.end - 1 - u >= x.j_mask; ++u) step<true, OVERLAP, BN, BN>(x, u, m, l);
        epi.release_o();
        if constexpr (Mask::LOW_EDGE) {
            for (; u < x.n && x.w.blocks.end - 1 - u >= x.j_low; ++u) step<false, OVERLAP, BN, BN, BARE>(x, u, m, l);
            for (; u < x.n; ++u) step<true, OVERLAP, BN, BN>(x, u, m, l);
        } else {
            for (; u < x.n; ++u) step<false, OVERLAP, BN, BN, BARE>(x, u, m, l);
        }
    }
    // A tile's rows once its last block is in: what the mask adds at a row's end (the sinks; nothing for most).
    __device__ void end_rows() { mask.end_rows(o, m, l, softmax_log2); }
};

}  // namespace hopper
}  // namespace fav
