// FlashAttention-3 forward (Shah et al., 2024) on Hopper (sm_90a): fa2_fwd_sm90.cu's algorithm and wgmma tiles,
// with the three changes of the paper. Read beside fa2_fwd_sm90.cu.
//   warp specialization  one CTA = 1 + NC warpgroups. Warpgroup 0 is the producer: one of its threads issues TMA
//                        copies (Q once, then K_j and V_j into a ring of STAGES stages) and nothing else, and gives
//                        its registers to the NC consumer warpgroups (setmaxnreg: 24 / 240 with two consumers,
//                        24 / 160 with three), which only compute, each on 64 of the block's BM = 64 NC query rows.
//                        Full/empty mbarriers per stage replace fa2_fwd_sm90's __syncthreads: nobody waits for
//                        anybody else's softmax.
//   ping-pong            (PINGPONG) named barriers hand the tensor cores from one consumer to the next, round
//                        robin: a consumer issues its wgmmas only after the previous one has issued its own, so one
//                        consumer's softmax runs while another's GEMMs occupy the tensor cores.
//   intra-warpgroup      (OVERLAP) S_j = Q K_j^T is issued together with O += P_{j-1} V_{j-1}; the softmax of
//   overlap              block j runs while the P V product of block j-1 is still on the tensor cores. O takes
//                        block j-1's rescale factor between the two issues (while S_j is on the tensor cores),
//                        just before P_{j-1} V_{j-1} is added: one block later than FA2 rescales, same arithmetic.
// The K/V blocks are visited from the last to the first, as FA3 does: the blocks that need a mask (the causal
// diagonal, the seqlen_k tail) come first, and the loop after them is mask-free. While a wgmma is in flight
// nothing may branch (ptxas completes every wgmma at a control-flow join), so masking is a compile-time case of
// the step and the barrier arrivals in flight are predicated, not branched.
#include "common/block_range.cuh"
#include "common/epilogue.cuh"
#include "common/fragments.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"
#include "common/wgmma_n.cuh"

template <class T, int D, int BN, int STAGES, bool PINGPONG, bool OVERLAP, int NC = 2>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
fa3_fwd(const __grid_constant__ fav::TmaDesc tq, const __grid_constant__ fav::TmaDesc tk,
        const __grid_constant__ fav::TmaDesc tv, const fav::FwdParams p) {
    using namespace fav;
    constexpr int BM = 64 * NC, NT = BN / 8, DT = D / 8, SLABS = D / 64, CONSUMERS = 128 * NC;
    constexpr int REGS = NC == 2 ? 240 : 160;  // the consumers' share once the producer keeps 24
    constexpr int DN = D < 128 ? D : 128;    // output columns per P V wgmma (n64 or n128)
    using TQ = SwizzledTile<BM, 2 * D>;      // [row][d]: SLABS slabs of 64 columns, one TMA box each
    using TKV = SwizzledTile<BN, 2 * D>;     // [key][d]: K-major B of Q K^T, N-major B of P V
    static_assert(BN % 16 == 0 && (D == 64 || D == 128 || D == 256), "16-key steps of P V; 64-column slabs");
    static_assert(NC == 2 || NC == 3, "two or three consumer warpgroups");

    extern __shared__ unsigned char smem[];
    const u32 base = (smem_u32(smem) + 1023) & ~1023u;  // the 128-byte swizzle repeats every 1024 bytes
    const u32 sQ = base;
    auto sK = [&](int s) { return sQ + TQ::BYTES + s * 2 * TKV::BYTES; };
    auto sV = [&](int s) { return sK(s) + TKV::BYTES; };
    const u32 bars = sK(STAGES);  // mbarriers, 8 bytes each: Q; per stage K full, V full, K empty, V empty
    const u32 q_full = bars;
    auto k_full = [&](int s) { return bars + 8 * (1 + s); };
    auto v_full = [&](int s) { return bars + 8 * (1 + STAGES + s); };
    auto k_empty = [&](int s) { return bars + 8 * (1 + 2 * STAGES + s); };
    auto v_empty = [&](int s) { return bars + 8 * (1 + 3 * STAGES + s); };

    const int i_block = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z, h_kv = h / p.group;
    const int m0 = i_block * BM, wg = threadIdx.x / 128;
    const int seqlen_k = p.seqlen_k, diag = seqlen_k - p.seqlen_q;
    const bool causal = p.causal;
    const BlockRange blocks = kv_block_range<BM, BN>(m0, p.seqlen_q, seqlen_k, causal, p.kv_block_begin,
                                                     p.kv_block_end);
    const int n = blocks.count();

    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(k_full(s), 1);   // the producer's expect_tx arrival; the bytes complete the phase
            mbar_init(v_full(s), 1);
            mbar_init(k_empty(s), 4 * NC);  // one arrival per consumer warp
            mbar_init(v_empty(s), 4 * NC);
        }
        fence_mbar_init();
    }
    __syncthreads();

    if (wg == 0) {  // ------------------------------------------------------------------------------ producer
        setmaxnreg_dec<24>();
        if (threadIdx.x == 0 && n > 0) {
            tma_prefetch_desc(tk);
            tma_prefetch_desc(tv);
            mbar_expect_tx(q_full, TQ::BYTES);  // rows past seqlen_q and columns past head_dim land as zeros
            for (int c = 0; c < SLABS; ++c) tma_load_4d(sQ + c * TQ::SLAB, tq, q_full, 64 * c, m0, h, b);
            for (int t = 0; t < n; ++t) {
                const int j = blocks.end - 1 - t, s = t % STAGES, phase = (t / STAGES) & 1;
                mbar_wait(k_empty(s), phase ^ 1);  // the consumers are done with block t - STAGES's K
                mbar_expect_tx(k_full(s), TKV::BYTES);
                for (int c = 0; c < SLABS; ++c) tma_load_4d(sK(s) + c * TKV::SLAB, tk, k_full(s), 64 * c, j * BN, h_kv, b);
                mbar_wait(v_empty(s), phase ^ 1);
                mbar_expect_tx(v_full(s), TKV::BYTES);
                for (int c = 0; c < SLABS; ++c) tma_load_4d(sV(s) + c * TKV::SLAB, tv, v_full(s), 64 * c, j * BN, h_kv, b);
            }
        }
    } else {  // ---------------------------------------------------------------------------------- consumers
        setmaxnreg_inc<REGS>();
        const int c = wg - 1;                                   // rows [64c, 64c + 64) of the block
        const int row0 = c * 64 + (threadIdx.x / 32 % 4) * 16;  // this warp's first row within the block
        const bool leader = threadIdx.x % 32 == 0;              // arrives on the empty barriers for its warp
        // Blocks j >= j_mask hold a key that some row of this block must not see (past seqlen_k or, causal,
        // right of row m0's diagonal); the blocks below are visible to every row.
        const int j_mask = max(0, causal ? min(seqlen_k, m0 + diag + 1) : seqlen_k) / BN;

        float o[1][DT][4] = {};
        float m[1][2] = {{neg_inf(), neg_inf()}}, l[1][2] = {};
        float alpha[1][2];   // OVERLAP: the rescale factor O still owes to the last block's softmax
        u32 pa[BN / 16][4];  // P~ of the block whose P V is next, as 16-bit A fragments

        // Ping-pong: consumer c issues after `sched_wait` on barrier 1 + c, which the previous consumer's
        // `sched_pass` (bar.arrive) completes once it has issued. The last consumer passes first, so consumer 0
        // starts. (Barrier 0 is __syncthreads, barrier 4 the consumers' own.)
        auto sched_wait = [&] { if constexpr (PINGPONG) named_sync(1 + c, 256); };
        auto sched_pass = [&] { if constexpr (PINGPONG) named_arrive(1 + (c + 1) % NC, 256); };
        if (PINGPONG && c == NC - 1) named_arrive(1, 256);

        auto issue_qk = [&](float (&s)[1][NT][4], int stage) {
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk)
                wgmma_16_ss<T>(s[0], TQ::desc(sQ, c * 64, kk * 32), TKV::desc(sK(stage), 0, kk * 32), kk > 0);
            wgmma_commit();
        };
        auto issue_pv = [&](int stage) {
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
                for (int nn = 0; nn < D / DN; ++nn)
                    wgmma_16_rs<T>(reinterpret_cast<float(&)[DN / 8][4]>(o[0][nn * DN / 8]), pa[kk],
                                   TKV::desc_mn(sV(stage), kk * 16, nn * DN * 2), 1);
            wgmma_commit();
        };
        auto pack_p = [&](const float (&s)[1][NT][4]) {
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) repack_a<T>(pa[kk], s[0][2 * kk], s[0][2 * kk + 1]);
        };
        auto stage_of = [](int t) { return t % STAGES; };
        auto phase_of = [](int t) { return (t / STAGES) & 1; };

        // Visit t of n (block j = end - 1 - t). OVERLAP: S_t is issued with P_{t-1} V_{t-1}; without it, S_t
        // waits, its softmax rescales O at once and P_t V_t follows: fa2_fwd_sm90's step, with TMA barriers.
        auto step = [&](int t, auto masked, auto overlapped) {
            constexpr bool MASKED = decltype(masked)::value, PREV = decltype(overlapped)::value;
            const int j = blocks.end - 1 - t;
            float s[1][NT][4];
            mbar_wait(k_full(stage_of(t)), phase_of(t));
            if constexpr (PREV) mbar_wait(v_full(stage_of(t - 1)), phase_of(t - 1));
            sched_wait();
            issue_qk(s, stage_of(t));
            if constexpr (PREV) {
                scale_rows(o, alpha);  // under S_t's wgmmas: O now in block t-1's reference, ready for P_{t-1} V
                issue_pv(stage_of(t - 1));
            }
            sched_pass();
            wgmma_wait<PREV ? 1 : 0>();
            hold_registers(s[0]);
            mbar_arrive_if(k_empty(stage_of(t)), leader);
            if constexpr (MASKED) mask_scores(s, m0 + row0, j * BN, seqlen_k, diag, causal);
            online_softmax_rescale(s, m, l, p.scale_log2, alpha);
            if constexpr (PREV) {
                wgmma_wait<0>();
                hold_registers(o[0]);
                mbar_arrive_if(v_empty(stage_of(t - 1)), leader);
            }
            pack_p(s);
            if constexpr (!OVERLAP) {  // P_t V_t now, O rescaled first
                scale_rows(o, alpha);
                mbar_wait(v_full(stage_of(t)), phase_of(t));
                sched_wait();
                issue_pv(stage_of(t));
                sched_pass();
                wgmma_wait<0>();
                hold_registers(o[0]);
                mbar_arrive_if(v_empty(stage_of(t)), leader);
            }
        };
        auto visit = [&](int t, auto overlapped) {
            if (blocks.end - 1 - t >= j_mask) step(t, flag<true>(), overlapped);
            else step(t, flag<false>(), overlapped);
        };

        if (n > 0) {
            mbar_wait(q_full, 0);
            visit(0, flag<false>());
            for (int t = 1; t < n; ++t) visit(t, flag<OVERLAP>());
            if constexpr (OVERLAP) {  // the last block's P V
                mbar_wait(v_full(stage_of(n - 1)), phase_of(n - 1));
                sched_wait();
                scale_rows(o, alpha);
                issue_pv(stage_of(n - 1));
                sched_pass();
                wgmma_wait<0>();
                hold_registers(o[0]);
            }
        }
        if (PINGPONG && c == 0) named_sync(1, 256);  // the last consumer's last pass: every bar.arrive matched

        named_sync(4, CONSUMERS);  // every consumer is done with Q and the ring: the epilogue stages O over them
        NormalizedOut<T, D>::store(WarpRows<1, DT>{o, m, l, p.scale_log2, b, h, m0 + row0}, p,
                                   reinterpret_cast<u16*>(smem + (base - smem_u32(smem))) + row0 * Tile<16, D>::STRIDE);
    }
}
