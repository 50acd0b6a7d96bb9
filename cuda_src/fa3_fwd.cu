// FlashAttention-3 forward (Shah et al., 2024) on Hopper (sm_90a): fa2_fwd_sm90.cu's algorithm and wgmma tiles,
// with the three changes of the paper, composed here from the parts in hopper/ (docs/kernels/fa3.md tells the
// design and its measurements). Read beside fa2_fwd_sm90.cu.
//   warp specialization  one CTA = 1 + NC warpgroups. Warpgroup 0 is the producer (hopper/producer.cuh): one of
//                        its threads issues TMA copies (Q once per tile, then K_j and V_j into a ring of STAGES
//                        stages) and nothing else, and gives its registers to the NC consumer warpgroups
//                        (setmaxnreg), which only compute, each on 64 of the tile's BM = 64 NC query rows. Full and
//                        empty mbarriers per buffer (hopper/smem.cuh) replace fa2_fwd_sm90's __syncthreads: nobody
//                        waits for anybody else's softmax.
//   ping-pong            (PINGPONG) named barriers hand the tensor cores from one consumer to the next
//                        (hopper/mainloop.cuh), so that one consumer's softmax runs while another's GEMMs occupy them.
//   intra-warpgroup      (OVERLAP) S_j = Q K_j^T is issued together with O += P_{j-1} V_{j-1}: the softmax of block
//   overlap              j runs while the P V product of block j-1 is still on the tensor cores.
// And beyond the paper:
//   persistent grid      (PERSISTENT) one CTA per SM taking tiles from a counter, heaviest first, and a split last
//                        wave (hopper/scheduler.cuh); the next tile's first S beside this tile's last P V (CROSS)
//                        and O stored by TMA from shared memory (hopper/epilogue.cuh).
//   FP8 (fa3_fp8)        the same pipeline on e4m3 operands with fa2_fp8's scales, as a policy
//                        (hopper/precision.cuh).
//   lazy rescale         O's rescale only where a row's reference point moved by more than tau (FA4's rule).
//   masks                the K/V blocks are visited from the last to the first, as FA3 does: those that need a mask
//                        (common/mask.cuh: the causal diagonal, the seqlen_k tail) come first, then a mask-free loop.
//                        fa3_fwd_masked: the same CTA under AttnMask (a window, softcap, ALiBi, sinks) over a dense or
//                        a packed (varlen) batch, one CTA per tile.
#include "hopper/epilogue.cuh"
#include "hopper/producer.cuh"

// One CTA of fa3_fwd (K: hopper::Config): the producer warpgroup and the consumers, on mask policy `mask` (the
// launch's, or the CTA's sequence and head's). `out`: the parameters the epilogue stores through (the launch's,
// or its sequence's view).
template <class K>
__device__ __forceinline__ void fa3_cta(const fav::TmaDesc& tq, const fav::TmaDesc& tk, const fav::TmaDesc& tv,
                                        const fav::TmaDesc& to, const typename K::Params& p,
                                        const typename K::Params& out, const typename K::Mask& mask, int* tiles_next) {
    using namespace fav;
    K::Prec::before_reads();

    extern __shared__ unsigned char smem[];
    const hopper::SharedLayout<K> L(smem);
    L.check_size();
    const hopper::TileScheduler<K> sched{p, tiles_next};
    const int wg = threadIdx.x / 128;
    L.init_barriers();
    __syncthreads();

    if (wg == 0) {  // the producer warpgroup: one thread's TMA loads, its registers given to the consumers
        setmaxnreg_dec<24>();
        if (threadIdx.x == 0) hopper::Producer<K>{p, L, sched}.run(tq, tk, tv);
    } else {  // the consumer warpgroups: each its 64 rows of every tile, through the main loop and the epilogue
        setmaxnreg_inc<K::REGS>();
        const int c = wg - 1;                                   // rows [64c, 64c + 64) of each tile
        const int row0 = c * 64 + (threadIdx.x / 32 % 4) * 16;  // this warp's first row within a tile
        const bool leader = threadIdx.x % 32 == 0;              // arrives on the empty barriers for its warp
        int it = 0, q_uses = 0;  // K/V blocks and Q tiles consumed, as the producer counts them
        float o[1][K::DT][4];    // O, m and l of the tile in work
        float m[1][2], l[1][2];
        u32 pa[K::BN / K::KK][4];  // P~ as the A fragments of the next P V
        hopper::Mainloop<K> main(p, L, sched, mask, c, row0, leader, it, q_uses, o, m, l, pa);
        hopper::Epilogue<K> epi{out, to, L, sched, c, row0};
        using hopper::TileWork;
        if constexpr (!K::PERSISTENT) {  // the CTA's tile
            const TileWork x = main.tile_of(blockIdx.x);
            main.begin(x, 0);
            main.blocks_after_first(x, epi);
            main.last_pv(x);
            main.end_rows();
            epi.store(x, o, m, l);
        } else {
            // The scheduler's work items as the producer hands them over. A tile's last P V and its epilogue wait
            // for the next tile (prev is that tile). CROSS: if both have keys, the next tile's first S and its
            // softmax run beside that P V, instead of after the epilogue (one ping-pong turn instead of two, the
            // same for every consumer, so the turns stay matched).
            TileWork prev{};
            for (int k = 0;; ++k) {
                const int t = sched.receive(L, k, leader);
                const bool done = t >= sched.work_end();
                TileWork x{};
                if (!done) x = main.tile_of(t);
                // (a piece of a split tile ends alone: its meeting needs registers that x's first block would hold)
                const bool cross = K::CROSS && prev.n > 0 && x.n > 0 && !(K::SPLIT && prev.piece >= 0);
                bool parked = false;  // prev was a piece whose partial waits for the tile's last piece
                float mx[1][2] = {{neg_inf(), neg_inf()}}, lx[1][2] = {};  // x's (m, l) while O is still prev's
                if (cross && x.z == 0) {
                    mbar_wait(L.q_full(x.q), x.q_phase);
                    main.template visit<true>(x, 0, mx, lx);
                } else if (k > 0) {
                    main.last_pv(prev);
                    if (K::SPLIT && prev.piece >= 0) parked = !epi.split_meet(prev, o, m, l, main.softmax_log2);
                    if (cross) main.skip(x, 0, false);  // block 0 of x, skipped: its turn was prev's last P V's
                }
                if (k > 0 && !parked) epi.store(prev, o, m, l);
                if (done) break;
                if (cross && x.z == 0) {
                    main.restart();
                    m[0][0] = mx[0][0], m[0][1] = mx[0][1], l[0][0] = lx[0][0], l[0][1] = lx[0][1];
                } else {
                    main.begin(x, cross ? 1 : 0);
                }
                main.blocks_after_first(x, epi);
                prev = x;
            }
        }
        epi.finish();
        main.finish();
    }
}

template <class T, int D, int BN, int STAGES, bool PINGPONG, bool OVERLAP, int NC = 2, bool PERSISTENT = false,
          bool FP8 = false>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
fa3_fwd(const __grid_constant__ fav::TmaDesc tq, const __grid_constant__ fav::TmaDesc tk,
        const __grid_constant__ fav::TmaDesc tv,
        const __grid_constant__ fav::TmaDesc to,  // O (TMA_OUT instances), boxes of 64 rows
        // fp8: Fp8FwdParams, on the persistent grid with its split tail (Fa3Fp8FwdParams)
        const typename fav::Pick<FP8, typename fav::Pick<PERSISTENT, fav::Fa3Fp8FwdParams, fav::Fp8FwdParams>::type,
                                 fav::Fa3FwdParams>::type p,
        int* tiles_next) {  // PERSISTENT: the tile counter pair of this stream, zero between launches
    using K = fav::hopper::Config<T, D, BN, STAGES, PINGPONG, OVERLAP, NC, PERSISTENT, FP8>;
    fa3_cta<K>(tq, tk, tv, to, p, p, fav::CausalMask::of(p), tiles_next);
}

// Under a sliding window, a softcap, ALiBi and sinks (AttnMask), over a dense batch or a packed one, one CTA per
// (Q block, head, sequence) tile, the grid sized by the longest sequence: a CTA whose Q block lies past its
// sequence's end leaves at once. Its policy is its sequence's and head's; its O and LSE go out through the
// sequence's view of the parameters (common/sequence.cuh), its loads through the tensor maps at the sequence's rows.
template <class T, int D, int BN, int STAGES, bool PINGPONG, int NC>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
fa3_fwd_masked(const __grid_constant__ fav::TmaDesc tq, const __grid_constant__ fav::TmaDesc tk,
               const __grid_constant__ fav::TmaDesc tv, const __grid_constant__ fav::TmaDesc to,
               const fav::MaskedFwdParams p, int* tiles_next) {
    using namespace fav;
    using K = hopper::Config<T, D, BN, STAGES, PINGPONG, true, NC, false, false, AttnMask>;
    const hopper::Work w = hopper::TileScheduler<K>{p, tiles_next}.tile_at(blockIdx.x);
    const MaskedFwdParams s = sequence_view(p, w.b);
    if (w.m0 >= s.seqlen_q) return;
    fa3_cta<K>(tq, tk, tv, to, p, s, AttnMask::of(p, s.seqlen_q, s.seqlen_k, w.b, w.h), tiles_next);
}
