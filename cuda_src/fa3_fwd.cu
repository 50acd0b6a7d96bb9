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
//                        block j-1's rescale factor once P_{j-2} V_{j-2} is done, before P_{j-1} V_{j-1} is
//                        added: one block later than FA2 rescales, same arithmetic.
//   persistent grid      (PERSISTENT) one CTA per SM; its producer takes tiles from a global counter (tiles_next:
//                        first its blockIdx.x, then gridDim.x + atomicAdd), so an SM that finishes early takes the
//                        next tile in the heavy-first order (longest processing time first, what the hardware
//                        does for one CTA per tile), and hands each to the consumers through a two-slot ring in
//                        shared memory. It loads the next tile's Q and K/V while the consumers finish this one.
//                        Where it pipelines across tiles (CROSS), each consumer writes its O rows into shared
//                        memory (SwizzledOut) and sends them out by TMA (TMA_OUT): 16-bit over its own rows of
//                        the tile's Q buffer, which nothing reads any more; fp8 into a buffer of its own. Else
//                        (d 256) O goes out straight from registers (DirectOut: shared memory is busy).
//                        Non-causal, the last wave's tiles are cut into one K/V range per SM, merged by each
//                        tile's last piece (SPLIT). Without PERSISTENT: one CTA per tile, O staged through
//                        shared memory (NormalizedOut).
//   FP8 (fa3_fp8)        the same pipeline on e4m3 operands, fa2_fp8's quantized layouts and scales: Q and K
//                        e4m3 rows (one scale per Q tile and per K block), V^T (keys in vt_key order, one
//                        scale per channel), QGMMA k32 steps, S's block-pair scale and P's x 256 folded into the
//                        softmax's exponent, P repacked to e4m3 in registers, O dequantized on the way out
//                        (Fp8DequantOut's scales; through shared memory on both grids: +5-12 % over 4-byte
//                        stores from registers at N 4K-8K, bench/NOTES.md, thirteenth session). e4m3 halves the
//                        tensor cores' time per key, not the exponentials': at d 128 the consumers also take turns
//                        at the SFU (EXP_TURNS).
// O's rescale (every instance): after the P V that O was waited for, and only where a reference point of the
// warp's rows moved. The references move lazily (FA4's rule, softmax.cuh's reference_moves): only when a row's max
// has grown by more than RESCALE_TAU, so P~ <= 2^tau and most blocks skip the rescale.
// The K/V blocks are visited from the last to the first, as FA3 does: the blocks that need a mask (the causal
// diagonal, the seqlen_k tail) come first, and the loop after them is mask-free. While a wgmma is in flight
// nothing may branch (ptxas completes every wgmma at a control-flow join), so masking is a compile-time case of
// the step and the barrier arrivals in flight are predicated, not branched. Causal, a consumer skips the first
// blocks that none of its own 64 rows sees (TileWork::z), passing its ping-pong turns without a wgmma.
#include "common/block_range.cuh"
#include "common/epilogue.cuh"
#include "common/fp8.cuh"
#include "common/fragments.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"
#include "common/wgmma_n.cuh"
#include "hopper/producer.cuh"


template <class T, int D, int BN, int STAGES, bool PINGPONG, bool OVERLAP, int NC = 2, bool PERSISTENT = false,
          bool FP8 = false>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
fa3_fwd(const __grid_constant__ fav::TmaDesc tq, const __grid_constant__ fav::TmaDesc tk,
        const __grid_constant__ fav::TmaDesc tv,
        const __grid_constant__ fav::TmaDesc to,  // O (TMA_OUT instances), boxes of 64 rows
        // fp8: Fp8FwdParams, on the persistent grid with its split tail (Fa3Fp8FwdParams)
        const typename fav::Pick<FP8, typename fav::Pick<PERSISTENT, fav::Fa3Fp8FwdParams, fav::Fp8FwdParams>::type,
                                 fav::FwdParams>::type p,
        int* tiles_next) {  // PERSISTENT: the tile counter pair of this stream, zero between launches
    using namespace fav;
    using K = hopper::Config<T, D, BN, STAGES, PINGPONG, OVERLAP, NC, PERSISTENT, FP8>;
    using Prec = typename K::Prec;
    constexpr int BM = K::BM, DT = K::DT, CONSUMERS = K::CONSUMERS;
    constexpr int EB = Prec::EB;
    constexpr int KK = K::KK;
    constexpr int REGS = K::REGS;
    constexpr int DN = K::DN;
    using TQ = typename K::TQ;
    using TK = typename K::TK;
    using TV = typename K::TV;
    constexpr float RESCALE_TAU = Prec::RESCALE_TAU;
    Prec::before_reads();
    constexpr bool CROSS = K::CROSS;
    constexpr int QBUF = K::QBUF;
    using TO = typename K::TO;
    constexpr bool TMA_OUT = K::TMA_OUT, O_IN_Q = K::O_IN_Q, SPLIT = K::SPLIT;
    constexpr int TAIL_BN = K::TAIL_BN;

    extern __shared__ unsigned char smem[];
    const hopper::SharedLayout<K> L(smem);
    L.check_size();

    const hopper::TileScheduler<K> sched{p, tiles_next};
    const int seqlen_k = p.seqlen_k, diag = seqlen_k - p.seqlen_q;
    const bool causal = p.causal;
    const int wg = threadIdx.x / 128;

    L.init_barriers();
    __syncthreads();

    if (wg == 0) {  // ------------------------------------------------------------------------------ producer
        setmaxnreg_dec<24>();
        if (threadIdx.x == 0) hopper::Producer<K>{p, L, sched}.run(tq, tk, tv);
    } else {  // ---------------------------------------------------------------------------------- consumers
        setmaxnreg_inc<REGS>();
        const int c = wg - 1;                                   // rows [64c, 64c + 64) of each tile
        const int row0 = c * 64 + (threadIdx.x / 32 % 4) * 16;  // this warp's first row within a tile
        const bool leader = threadIdx.x % 32 == 0;              // arrives on the empty barriers for its warp

        // Ping-pong: consumer c issues after `sched_wait` on barrier 1 + c, which the previous consumer's
        // `sched_pass` (bar.arrive) completes once it has issued. The last consumer passes first, so consumer 0
        // starts; the turns run on across tiles (every consumer visits the same blocks). (Barrier 0 is
        // __syncthreads, barrier 4 the consumers' own, 5 + c consumer c's own, 8 + c EXP_TURNS'.)
        auto sched_wait = [&] { if constexpr (PINGPONG) named_sync(1 + c, 256); };
        auto sched_pass = [&] { if constexpr (PINGPONG) named_arrive(1 + (c + 1) % NC, 256); };
        if (PINGPONG && c == NC - 1) named_arrive(1, 256);
        // EXP_TURNS: the consumers also take turns at their exponentials (barriers 8 + c, round robin as above):
        // the SFU (16 MUFU lanes an SM, 8 cycles a warp's MUFU.EX2 on its sub-partition) runs one consumer's
        // exponentials at a time instead of two consumers' interleaved, each at half speed, while the other
        // takes its row max or issues its wgmmas. fp8 at d 128, where the SFU is one of the two limits: +8-11 %
        // on the H200; d 64 (three consumers) lost 10-12 % and d 256 (at the fp8 matmul ceiling) 1.5 %
        // (bench/NOTES.md, sixteenth session). Every consumer takes one turn per block of every tile, visited or
        // skipped, so the turns stay matched.
        constexpr bool EXP_TURNS = FP8 && PINGPONG && D == 128;
        struct ExpTurn {
            int mine, next;
            __forceinline__ __device__ void wait() const { named_sync(mine, 256); }
            // The thread count read from the row sums (never negative, so always 256): a plain bar.arrive, ptxas
            // scheduled it before every exponential, and the turn then passed at once.
            __forceinline__ __device__ void pass(const float (&l)[1][2]) const {
                named_arrive(next, l[0][0] < 0.f || l[0][1] < 0.f ? 288 : 256);
            }
        };
        const auto exp_turn = [&] {  // (NoTurn: softmax.cuh's, which does nothing)
            if constexpr (EXP_TURNS) return ExpTurn{8 + c, 8 + (c + 1) % NC};
            else return NoTurn{};
        }();
        auto exp_turn_alone = [&] {  // a skipped block's turn
            const float none[1][2] = {};
            exp_turn.wait();
            exp_turn.pass(none);
        };
        if (EXP_TURNS && c == NC - 1) named_arrive(8, 256);

        // A tile as the consumers see it: its rows and key blocks, where block u = 0 sits in the K/V ring, its Q
        // buffer, and (fp8) Q's scale. The steps take it as an argument: at a CROSS tile boundary the step works
        // on two tiles, the next one's first S beside this one's last P V.
        struct TileWork {
            hopper::Work w;
            int h_kv;        // its K/V head
            int n, j_mask;   // its blocks, and the first that needs a mask for this consumer's rows
            int z;           // its leading blocks that none of this consumer's rows sees (skipped), < n
            int it;          // ring index of its block u = 0
            int q, q_phase;  // its Q buffer, and that buffer's phase
            float q_scale;   // fp8: Q's scale times scale_log2
            int piece;       // SPLIT: its work item's piece number (2 i + j) if it is a piece, else -1
            bool narrow;     // its block u = 0 is the seqlen_k tail, visited at TAIL_BN keys (then z = 0, n >= 2)
        };
        int it = 0, q_uses = 0;  // as the producer counts them
        auto tile_of = [&](int t) {
            TileWork x;
            x.w = sched.tile_at(t);
            x.h_kv = x.w.h / p.group;
            // The shuffle tells ptxas the block count is warp-uniform: without it, the loop over the blocks held
            // its bound in a vector register and ptxas put a WARPSYNC before every wgmma of the loop.
            x.n = __shfl_sync(0xffffffffu, x.w.blocks.count(), 0);
            // Blocks j >= j_mask hold a key that some row of this consumer must not see (past seqlen_k or,
            // causal, right of its first row's diagonal); the blocks below are visible to every row.
            const int r0 = x.w.m0 + 64 * c, r1 = min(r0 + 63, p.seqlen_q - 1);  // its first and last real row
            // (Both depend on the consumer, so on threadIdx.x: the shuffles keep them warp-uniform for ptxas.)
            x.j_mask = __shfl_sync(0xffffffffu, max(0, causal ? min(seqlen_k, r0 + diag + 1) : seqlen_k) / BN, 0);
            // The blocks visited first (j from end - 1 down) that hold no key for any of its rows: causal, right
            // of its last row's diagonal, or every block if it has no real row (the short last Q block). It
            // skips them (their K and V go back to the producer unread, and its ping-pong turn passes without a
            // wgmma), but never the tile's last, so that every consumer has a first and a last P V per tile.
            // Tiles of BM = 192 on 128-key blocks: 6 % of the causal tensor-core work at N 2K.
            const int hi = r1 < r0 ? -1 : causal ? r1 + diag : seqlen_k - 1;  // its last visible key, or -1
            const int z = hi < 0 ? x.n : x.w.blocks.end - 1 - hi / BN;
            x.z = __shfl_sync(0xffffffffu, max(0, min(z, x.n - 1)), 0);
            x.it = it;
            x.q = q_uses % QBUF;
            x.q_phase = (q_uses / QBUF) & 1;
            // fp8: S_j in log2 units is S_j times f, the scales of Q's tile and of K's block j times scale_log2;
            // the softmax folds f (and P_SCALE) into its exponent's FMA, m in log2 units. f is kept at least
            // FLT_MIN, so that a masked -inf times f stays -inf at softmax_scale 0; the launcher makes f positive
            // (a negative softmax_scale runs on -Q). 16-bit: the softmax applies scale_log2 itself.
            x.piece = SPLIT && t >= sched.full_tiles() ? t - sched.full_tiles() : -1;
            // Block u = 1 (whose step issues the narrow P V) must be one without a mask: the narrow P V is compiled
            // into the mask-free step only.
            const int end = x.w.blocks.end;
            x.narrow = TAIL_BN > 0 && x.z == 0 && x.n >= 2 && end == sched.kv_blocks() &&
                       seqlen_k - (end - 1) * BN <= TAIL_BN && end - 2 < x.j_mask;
            x.q_scale = Prec::q_scale(p, sched, x.w);
            if (x.n > 0) {
                it += x.n;
                ++q_uses;
            }
            return x;
        };

        float o[1][DT][4];  // O, m and l of the tile in work, set by restart() before its first block
        float m[1][2], l[1][2];
        u32 pa[BN / KK][4];  // P~ of the block whose P V is next, as A fragments (16-bit, or e4m3 x 256)
        auto restart = [&] {  // O, m and l of a tile before its first block
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[0][dt][e] = 0.f;
            m[0][0] = m[0][1] = neg_inf();
            l[0][0] = l[0][1] = 0.f;
        };

        // A k-step is 32 bytes of the reduction: 16 fp16/bf16 or 32 e4m3 values. STEP_DESC: the k-steps'
        // descriptors are one per operand plus constants (SwizzledTile::step) rather than each formed from its
        // address: ~70 uniform-datapath instructions fewer a step at d 128, +1-3 % at d 128 and 256 on the
        // H200, but -3 % at d 64 (three consumers) and -2..+3 % on fp8 (bench/NOTES.md, eighth session).
        constexpr bool STEP_DESC = !FP8 && D >= 128;
        auto desc_a = [&](int q, int kk) { return STEP_DESC ? TQ::desc(L.q(q), c * 64, 0) + TQ::step(0, kk * 32)
                                                            : TQ::desc(L.q(q), c * 64, kk * 32); };
        auto desc_k = [&](int stage, int kk) { return STEP_DESC ? TK::desc(L.k(stage), 0, 0) + TK::step(0, kk * 32)
                                                                : TK::desc(L.k(stage), 0, kk * 32); };
        auto desc_v = [&](int stage, int kk, int nn) { return Prec::desc_v(L.v(stage), kk, nn); };
        auto issue_qk = [&](auto& s, int q, int stage) {  // s: float[1][keys / 8][4]
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / KK; ++kk) {
                const u64 a = desc_a(q, kk), b = desc_k(stage, kk);
                Prec::mma_qk(s[0], a, b, kk > 0);
            }
            wgmma_commit();
        };
        auto issue_pv = [&](int stage, auto keys) {  // over the block's first keys (num<BN> or num<TAIL_BN>)
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < decltype(keys)::value / KK; ++kk)
#pragma unroll
                for (int nn = 0; nn < D / DN; ++nn) {
                    auto& acc = reinterpret_cast<float(&)[DN / 8][4]>(o[0][nn * DN / 8]);
                    Prec::mma_pv(acc, pa[kk], desc_v(stage, kk, nn));
                }
            wgmma_commit();
        };
        auto pack_p = [&](const auto& s) { Prec::pack_p(pa, s); };
        // LATE_PV_WAIT: in an overlapped step, where P_{u-1} V_{u-1} is waited for. Written after the softmax,
        // ptxas still hoists that wait above most of the exponentials (it interleaves them with P's packing,
        // which overwrites the A fragments the P V in flight reads), so the softmax of block u starts only once
        // P_{u-1} V_{u-1} is done. With the wait inside O's rescale branch, whose vote reads the row sums, every
        // exponential comes first. The branch's vote must then be the warpgroup's (a barrier with an OR), since
        // all four warps must execute the wait at one place (synccheck). fp8 d 64: on (+5 % at N 16K over the
        // plain wait); fp8 d 128 and 256: off, the warpgroup's vote cost 2-4 % there, more than the late wait
        // gains; 16-bit: -2 to -5 % (the packs then follow the last exponential, in series). (bench/NOTES.md,
        // twelfth and sixteenth sessions.)
        constexpr bool LATE_PV_WAIT = FP8 && D == 64;
        // Read here, once for the kernel: read inside the step, it moved d 64's schedule and cost 3 % (eighth
        // session).
        const float softmax_log2 = p.scale_log2;
        // INT_MAX: fp8's row maxima by the integer max of the scores' patterns (softmax.cuh's row_max_int) in the
        // blocks without a mask, whose rows rarely hold only negative scores: +3-4 % at d 64 and 128; d 256 not
        // (ptxas then injected a warpgroup.arrive, C7519); the 16-bit kernels lost 1-3 % at d 128 with it
        // (bench/NOTES.md, seventeenth session).
        constexpr bool INT_MAX = FP8 && D <= 128;
        // EXP_FMA: every EXP_FMA-th exponential of a thread's on the FMA units (math.cuh's exp2f_fma) instead of the
        // SFU, for fp8 at d 128, where the SFU is one of the two limits (EXP_TURNS): every 16th (6 of a block's 96)
        // +1.5-4 % on the H200 (N 1K-16K), every 12th or 24th a little less, every 8th +0.5-1.5 %, every 4th -2 %,
        // every 2nd -15 % (bench/NOTES.md, nineteenth session).
        constexpr int EXP_FMA = EXP_TURNS ? 16 : 0;
        // The online softmax of block j of tile x into (mx, lx). alpha: what O is multiplied by for this block.
        // Returns whether O needs it (warp-uniform: the rescale below is a branch, not predicated work). (K's
        // scale is addressed afresh every step on purpose: a row pointer held once a tile, 136 instructions
        // fewer, made fa3_fp8 d 64 14-16 % slower on the H200; bench/NOTES.md, sixth session.)
        auto softmax = [&](const TileWork& x, auto& s, int j, float (&mx)[1][2], float (&lx)[1][2],
                           float (&alpha)[1][2], auto masked) {
            const bool moved = Prec::template softmax<decltype(masked)::value, K::EXP_FMA>(p, x, j, s, mx, lx, alpha,
                                                                                          softmax_log2, exp_turn);
            // LATE_PV_WAIT: lx < 0 never holds (a sum of exponentials, or NaN), but reading it makes the vote, and
            // so the rescale's branch in the step, wait for every exponential: ptxas cannot sink them past it. The
            // branch then holds a wgmma wait, which every warp of the warpgroup must execute at the same place
            // (compute-sanitizer synccheck: "mismatching warpgroup instruction pc" with a per-warp vote), so the
            // vote is the consumer's (its barrier 5 + c), not the warp's.
            if constexpr (LATE_PV_WAIT) return named_any(5 + c, 128, moved || lx[0][0] < 0.f || lx[0][1] < 0.f);
            else return __any_sync(0xffffffffu, moved);
        };
        // Tile x's u-th block in the ring; u = -1 is the previous tile's last (the ring runs on across tiles).
        auto stage_of = [&](const TileWork& x, int u) { return (x.it + u) % STAGES; };
        auto phase_of = [&](const TileWork& x, int u) { return ((x.it + u) / STAGES) & 1; };
        auto pv_alone = [&](const TileWork& x, int u) {  // P_u V_u in a ping-pong turn of its own, V_u released
            mbar_wait(L.v_full(stage_of(x, u)), phase_of(x, u));
            sched_wait();
            issue_pv(stage_of(x, u), num<BN>());
            sched_pass();
            wgmma_wait<0>();
            hold_registers(o[0]);
            mbar_arrive_if(L.v_empty(stage_of(x, u)), leader);
        };

        // Visit u of x.n (block j = end - 1 - u). OVERLAP: S_u is issued with P_{u-1} V_{u-1}; without it,
        // S_u waits, its softmax rescales O at once and P_u V_u follows: fa2_fwd_sm90's step, with TMA
        // barriers. The tile's last S releases its Q buffer (q_empty) for the producer's tile after next. O takes
        // block u's alpha once nothing is in flight (after P_{u-1} V_{u-1}, before P_u V_u), where a branch is
        // free, and only if a row of the warp moved its reference (before, O is still 0). The softmax runs into
        // (mx, lx): (m, l), or at a CROSS boundary (u = 0, overlapped: the P V in flight is the previous tile's
        // last) the next tile's fresh pair, while m and l are still the previous tile's, for its epilogue.
        // s_keys, pv_keys: the width of S_u and of the P V in flight, num<BN> but at a narrow tail (TAIL_BN).
        auto step = [&](const TileWork& x, int u, auto masked, auto overlapped, auto s_keys, auto pv_keys,
                        float (&mx)[1][2], float (&lx)[1][2]) {
            constexpr bool MASKED = decltype(masked)::value, PREV = decltype(overlapped)::value;
            const int j = x.w.blocks.end - 1 - u;
            float s[1][decltype(s_keys)::value / 8][4];
            mbar_wait(L.k_full(stage_of(x, u)), phase_of(x, u));
            if constexpr (PREV) mbar_wait(L.v_full(stage_of(x, u - 1)), phase_of(x, u - 1));
            sched_wait();
            issue_qk(s, x.q, stage_of(x, u));
            if constexpr (PREV) issue_pv(stage_of(x, u - 1), pv_keys);  // O is in block u-1's reference already
            sched_pass();
            wgmma_wait<PREV ? 1 : 0>();
            hold_registers(s[0]);
            mbar_arrive_if(L.k_empty(stage_of(x, u)), leader);
            mbar_arrive_if(L.q_empty(x.q), leader && u == x.n - 1);
            if constexpr (MASKED) mask_scores(s, x.w.m0 + row0, j * BN, seqlen_k, diag, causal);
            float alpha[1][2];
            const bool moved = softmax(x, s, j, mx, lx, alpha, masked);
            // O is still 0 at the first visited block, and at a CROSS boundary (u = 0, PREV) O is the previous
            // tile's, which this block's alpha must not touch. (An overlapped step inside the loop is past both.)
            const bool rescale = (PREV ? u > 0 : u > x.z) && moved;
            if constexpr (LATE_PV_WAIT)
                if (rescale) {
                    if constexpr (PREV) wgmma_wait<0>();  // (the wait below is then a no-op)
                    scale_rows(o, alpha);
                }
            if constexpr (PREV) {
                wgmma_wait<0>();
                hold_registers(o[0]);
                mbar_arrive_if(L.v_empty(stage_of(x, u - 1)), leader);
            }
            pack_p(s);
            if constexpr (!LATE_PV_WAIT)
                if (rescale) scale_rows(o, alpha);
            if constexpr (!OVERLAP) pv_alone(x, u);  // P_u V_u now
        };
        // A tile's first visited block u (u = z, or 0 at a CROSS boundary); the P V in flight is never narrow.
        auto visit = [&](const TileWork& x, int u, auto overlapped, float (&mx)[1][2], float (&lx)[1][2]) {
            if constexpr (TAIL_BN > 0)
                if (x.narrow) {  // (then u = 0)
                    step(x, u, flag<true>(), overlapped, num<TAIL_BN>(), num<BN>(), mx, lx);
                    return;
                }
            if (x.w.blocks.end - 1 - u >= x.j_mask) step(x, u, flag<true>(), overlapped, num<BN>(), num<BN>(), mx, lx);
            else step(x, u, flag<false>(), overlapped, num<BN>(), num<BN>(), mx, lx);
        };
        // A skipped block u of tile x: its stages go back to the producer once they have landed (an arrival
        // before that could complete the empty barrier's previous phase), and the consumer's turns pass without
        // a wgmma, so that every consumer takes as many turns as the others.
        auto skip = [&](const TileWork& x, int u, bool turn) {
            mbar_wait(L.k_full(stage_of(x, u)), phase_of(x, u));
            mbar_arrive_if(L.k_empty(stage_of(x, u)), leader);
            mbar_wait(L.v_full(stage_of(x, u)), phase_of(x, u));
            mbar_arrive_if(L.v_empty(stage_of(x, u)), leader);
            exp_turn_alone();
            for (int i = 0; turn && i < (OVERLAP ? 1 : 2); ++i) {
                sched_wait();
                sched_pass();
            }
        };
        auto last_pv = [&](const TileWork& x) {  // OVERLAP: the last block's P V, with nothing beside it
            if (!OVERLAP || x.n == 0) return;
            pv_alone(x, x.n - 1);
        };
        // One CTA per tile: once every consumer is done with Q and the ring, O is staged over them, in rows of D + 8
        // elements (Tile<16, D>), for 16-byte stores; this warp's rows.
        auto staging = [&] {
            named_sync(4, CONSUMERS);
            return L.staging(row0);
        };
        // SPLIT: a piece of a tail tile at its end, on this consumer's rows. The tile's last piece in key order
        // merges (true: it then stores the tile as any other); the others leave their O, m and l in the workspace,
        // count themselves done and release their Q buffer (false). The last piece's range is handed out after the
        // others', so they are all under way when it waits for them: nothing waits for a piece not yet begun. A
        // partial is per thread, in its fragment layout (DT float4 of O, then m and l of its two rows): every access
        // a coalesced float4. (A ticket, the last piece to end merging, moved ptxas's schedule of the main loop:
        // its P V wait before every exponential. Counting and waiting compile to a reduction and loads.)
        auto split_meet = [&](const TileWork& x) {
            const hopper::TailTile tt = sched.tail_tile(x.piece);
            const int tile = tt.tile, first = tt.first, last = tt.last;  // its ranges
            if (first == last) return true;
            const int tid = threadIdx.x % 128;
            int* done = sched.pieces_done(tile, c);  // its pieces that have left their partial
            auto part = [&](int e) {  // this thread's partial of piece e
                return reinterpret_cast<float4*>(hopper::tail_of(p).ws) + (i64)(e * NC + c) * (DT + 1) * 128 + tid;
            };
            if ((x.piece >> 1) < last) {
                float4* dst = part(x.piece);
#pragma unroll
                for (int dt = 0; dt < DT; ++dt)
                    dst[dt * 128] = make_float4(o[0][dt][0], o[0][dt][1], o[0][dt][2], o[0][dt][3]);
                dst[DT * 128] = make_float4(m[0][0], m[0][1], l[0][0], l[0][1]);
                named_sync(5 + c, 128);
                if (tid == 0) {
                    release_count(done);
                    mbar_arrive_if(L.q_empty(x.q), O_IN_Q);  // the arrival its TMA store would have made
                }
                return false;
            }
            if (tid == 0) {
                wait_count_at_least(done, last - first);
                *done = 0;  // for the next launch on this stream
            }
            named_sync(5 + c, 128);
            // The rows' new reference is the largest of the pieces'; each piece's O and l are taken to it (a row
            // a piece saw no key of has O = l = 0 there), its own first, then the others in key order (range
            // first + s; its second piece where the range began in the tile before).
            auto piece_no = [&](int i) { return tt.piece_no(i); };
            float top[2] = {m[0][0], m[0][1]};
            for (int i = first; i < last; ++i) {
                const float4 ml = __ldcg(part(piece_no(i)) + DT * 128);
                top[0] = fmaxf(top[0], ml.x), top[1] = fmaxf(top[1], ml.y);
            }
            const float m_log2 = Prec::m_scale(softmax_log2);
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
        };
        // O_IN_Q: the Q buffer whose O rows the storing thread has sent but not yet seen read (-1: none), and its
        // release to the producer once they are read.
        int o_pending = -1;
        auto release_o = [&] {
            if constexpr (O_IN_Q)
                if (threadIdx.x % 128 == 0 && o_pending >= 0) {
                    bulk_wait_read<0>();
                    mbar_arrive_if(L.q_empty(o_pending), true);
                    o_pending = -1;
                }
        };
        auto store_out = [&](const TileWork& x) {  // O / l and the LSE of tile x's rows
            const WarpRows<1, DT> rows{o, m, l, Prec::m_scale(p.scale_log2), x.w.b, x.w.h, x.w.m0 + row0};
            const float* sv = Prec::col_scales(p, x.w.b, x.h_kv);  // fp8: V's channel scales of this tile's kv head
            if constexpr (TMA_OUT) {
                if (x.n == 0) {  // no key: no Q buffer of its own either (16-bit)
                    Prec::store_direct(rows, p, sv);
                    return;
                }
                if constexpr (!O_IN_Q) {  // O's own buffer is free once the TMA unit has read the previous tile's
                    if (threadIdx.x % 128 == 0) bulk_wait_read<0>();  // rows out of it: the storing thread waits,
                    named_sync(5 + c, 128);                           // its consumer with it
                }
                const u32 tile = O_IN_Q ? L.q(x.q) : L.o;
                SwizzledOut<T, TO>::store(rows, p, tile, row0, sv, Prec::LSE_LOG2);
                fence_proxy_async();     // this thread's rows, before the TMA unit reads them
                named_sync(5 + c, 128);  // all of this consumer's rows
                if (threadIdx.x % 128 == 0) {
                    for (int slab = 0; slab < TO::SLABS; ++slab)  // boxes of 64 rows of 128 bytes
                        tma_store_4d(to, tile + slab * TO::SLAB + c * 64 * TO::W, slab * TO::W / 2,
                                     x.w.m0 + 64 * c, x.w.h, x.w.b);
                    bulk_commit();
                    if constexpr (O_IN_Q) o_pending = x.q;  // released by release_o
                }
            } else if constexpr (PERSISTENT) {
                Prec::store_direct(rows, p, sv);
            } else {
                Prec::store_staged(rows, p, sv, staging());
            }
        };

        // A tile's skipped blocks from u0 on, then its first visited block, alone.
        auto begin = [&](const TileWork& x, int u0) {
            restart();
            if (x.n > 0) {
                mbar_wait(L.q_full(x.q), x.q_phase);
                for (int u = u0; u < x.z; ++u) skip(x, u, true);
                visit(x, x.z, flag<false>(), m, l);
            }
        };
        // The blocks that need a mask come first (j from end - 1 down): a loop of their own, so that the mask-free
        // loop has no branch (written as one loop, ptxas kept both steps in it: +0-2 %, bench/NOTES.md).
        auto blocks_after_first = [&](const TileWork& x) {
            int u = x.z + 1;
            if constexpr (TAIL_BN > 0)  // block 0's narrow P V beside S_1 (block 1 needs no mask: x.narrow)
                if (x.narrow) step(x, u++, flag<false>(), flag<OVERLAP>(), num<BN>(), num<TAIL_BN>(), m, l);
            for (; u < x.n && x.w.blocks.end - 1 - u >= x.j_mask; ++u)
                step(x, u, flag<true>(), flag<OVERLAP>(), num<BN>(), num<BN>(), m, l);
            release_o();  // (nothing in flight between steps: a branch is free here)
            for (; u < x.n; ++u) step(x, u, flag<false>(), flag<OVERLAP>(), num<BN>(), num<BN>(), m, l);
        };
        if constexpr (!PERSISTENT) {
            const TileWork x = tile_of(blockIdx.x);
            begin(x, 0);
            blocks_after_first(x);
            last_pv(x);
            store_out(x);
        } else {
            // A tile's last P V and its epilogue wait for the next tile (prev is that tile). CROSS: if both have
            // keys, the next tile's first S and its softmax run beside that P V, instead of after the epilogue
            // (one ping-pong turn instead of two, the same for every consumer, so the turns stay matched).
            TileWork prev{};
            for (int k = 0;; ++k) {
                const int t = sched.receive(L, k, leader);
                const bool done = t >= sched.work_end();
                TileWork x{};
                if (!done) x = tile_of(t);
                // (a piece of a split tile ends alone: its meeting needs registers that x's first block would hold)
                const bool cross = CROSS && prev.n > 0 && x.n > 0 && !(SPLIT && prev.piece >= 0);
                bool parked = false;  // prev was a piece whose partial waits for the tile's last piece
                float mx[1][2] = {{neg_inf(), neg_inf()}}, lx[1][2] = {};  // x's (m, l) while O is still prev's
                if (cross && x.z == 0) {
                    mbar_wait(L.q_full(x.q), x.q_phase);
                    visit(x, 0, flag<true>(), mx, lx);
                } else if (k > 0) {
                    last_pv(prev);
                    if (SPLIT && prev.piece >= 0) parked = !split_meet(prev);
                    if (cross) skip(x, 0, false);  // block 0 of x, skipped: its turn was prev's last P V's
                }
                if (k > 0 && !parked) store_out(prev);
                if (done) break;
                if (cross && x.z == 0) {
                    restart();
                    m[0][0] = mx[0][0], m[0][1] = mx[0][1], l[0][0] = lx[0][0], l[0][1] = lx[0][1];
                } else {
                    begin(x, cross ? 1 : 0);
                }
                blocks_after_first(x);
                prev = x;
            }
        }
        // The last tile's O rows read out by the TMA unit before the CTA's shared memory goes
        if (TMA_OUT && threadIdx.x % 128 == 0) bulk_wait_read<0>();
        if (PINGPONG && c == 0) named_sync(1, 256);  // the last consumer's last pass: every bar.arrive matched
        if (EXP_TURNS && c == 0) named_sync(8, 256);
    }
}
