// fa2_bwd.cu on Hopper's warpgroup MMA (sm_90a): the same deterministic three-pass FlashAttention-2 backward, as
// fa2_fwd_sm90.cu is fa2_fwd.cu. Pass 1 (D = rowsum(dO * O)) is fa2_bwd.cu's fa2_bwd_delta, launched as it is; the
// two passes here change the matrix instruction and, with it, the unit of work:
//   dkdv  grid (K/V block j, kv head, batch): a warpgroup owns 64 keys of K_j, V_j (BN = 64 or 128: one or two
//         warpgroups) and their dK, dV in registers; loop over the group's query heads, head-major, and the Q blocks
//         of BM = 64 queries that see block j: S^T = K Q^T, P^T = exp2(S^T scale_log2 - LSE2[col]),
//         dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - D[col]), dK += dS^T Q. A 64 x BM accumulator has keys
//         as rows and queries as columns here, so LSE and D are per column (from shared memory).
//   dq    grid (Q block i, head, batch): a warpgroup owns 64 query rows and their dQ; loop over the K/V blocks
//         i sees: S = Q K^T, P (LSE, D per row: registers), dP = dO V^T, dS, dQ += dS K.
// Operands: every tile ([row][d], 16-bit) sits in wgmma's 128-byte swizzled K-major layout (common/wgmma.cuh).
// The products whose reduction runs over d read them K-major (desc); the ones whose reduction runs over rows
// (queries for dV and dK, keys for dQ) read the same tile N-major (desc_mn, imm-trans-b), as the forward reads V.
// P^T and dS^T (dS) stay in registers as the A operand of the next product: repack_a turns accumulator columns
// 16k .. 16k + 15 into the A fragment of reduction step k (the forward's P V).
// Overlap inside a step only: S^T and dP^T are issued together (two commit groups) so that the tensor cores run
// dP^T while the threads compute P^T; dV runs while they compute dS^T. Q/dO (dkdv) and K/V (dq) tiles are
// double-buffered with cp.async, one barrier per step.
// dkdv PIPE (the three passes' dK/dV pass at d 64 and 128; FA3's backward order): step s ends by issuing step
// s+1's S^T behind its own dV and dK wgmmas, then waits on all three, so the tensor cores go from dK_s straight
// into S^T_{s+1} across the barrier and the load of step s+2; step s+1 then opens with dP^T. Q/dO take three
// stages (the stage being loaded was last read by step s-1's wgmmas, which every warpgroup has waited on before
// the barrier), and the queries' LSE and D travel by cp.async with the tiles (the other steps load them with
// blocking LDGs: before S^T, or, LOAD_LATE, behind the step's first products). Past the last step the issue reads
// a zero-filled stage (no branch while dK is in flight).
// The fused dQ (d = 64, 128; below DqOrder): the dkdv pass also adds each K/V block's share dS_ij K_j into an fp32
// dQ sum, in a fixed order (FUSED), by its own threads (fa2_bwd_fused_sm90, _pair_sm90) or by a writer warpgroup
// that takes the shares from shared memory (WRITER, fa2_bwd_fused_writer_sm90: the default at d 64 and 128).
// d = 256: a warpgroup's dK and dV of 64 keys would take 256 fp32 registers a thread, so the two gradients go to
// different warpgroups. SPLIT 2 (the default): one CTA of two warpgroups per 64 keys, warpgroup 0 computes S^T,
// P^T and dV and hands P^T (fp32, through shared memory) to warpgroup 1, which computes dP^T, dS^T and dK: the
// four products of the step, once each. SPLIT 1 (the first version): the dkdv grid doubles, even CTAs compute dK
// only (S^T, dP^T, dK), odd ones dV only (S^T, dV), each recomputing S^T (1.25x the work).
// Tile parameters (kernels/fa2_bwd_sm90.py's tables; the trailing template arguments default to the first
// version's tiles, whose machine code they leave as it was): dkdv BN = 64, 128 or 192 keys (one to three
// warpgroups), BM = 32, 64 or 128 queries per step (the N of S^T and dP^T), BM_DV the dV CTAs' BM where the d = 256
// split gives them another (they hold no V, so their Q/dO stages take its place); dq BM = 64, 128 or 192 queries
// (one to three warpgroups), BN = 32, 64 or 128 keys per step; MINB: the launch bounds' CTAs per SM (a register cap
// of 64K / (MINB x threads)); PIPE (dkdv) as above.
#include "common/backward.cuh"
#include "common/block_range.cuh"
#include "common/epilogue.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"
#include "common/wgmma_n.cuh"

namespace fav {

// load_swizzled_async needs 8 whole rows per pass of THREADS 16-byte copies (rows of at most 2 THREADS bytes);
// wider rows (d = 256 with one warpgroup) go in column parts of 2 THREADS bytes, each a tile of the same slabs.
// A CTA of three warpgroups (384 threads) copies with its first 256 threads (whole passes of 64-row tiles).
template <int ROWS, int KB, int THREADS>
__forceinline__ __device__ void load_rows_async(u32 tile, const unsigned char* __restrict__ g, i64 ld,
                                                int valid_rows, int valid_bytes) {
    constexpr int LT = (THREADS & (THREADS - 1)) == 0 ? THREADS : 256;  // copying threads: a power of 2
    constexpr int PART = KB < 2 * LT ? KB : 2 * LT;
    using Tile = SwizzledTile<ROWS, KB>;
    static_assert(KB % PART == 0 && SwizzledTile<ROWS, PART>::W == Tile::W, "parts made of whole slabs");
    static_assert(LT <= THREADS, "power-of-2 copying threads");
    if (LT < THREADS && threadIdx.x >= LT) return;
#pragma unroll
    for (int c = 0; c < KB / PART; ++c)
        load_swizzled_async<ROWS, PART, LT>(tile + c * (PART / Tile::W) * Tile::SLAB, g + c * PART, ld,
                                            valid_rows, valid_bytes - c * PART);
}

// acc (64 x 8 DT, this warpgroup) += A B with A from registers (a: BK / 16 reduction steps of repack_a) and B
// rows [0, BK) of an N-major tile (the reduction index is the tile's row): D / DN wgmmas of n64 or n128 per step.
template <class T, class TB, int D, int KSTEPS>
__forceinline__ __device__ void wgmma_rs_rows(float (&acc)[D / 8][4], const u32 (&a)[KSTEPS][4], u32 tile_b) {
    constexpr int DN = D < 128 ? D : 128;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
        for (int n = 0; n < D / DN; ++n)
            wgmma_16_rs<T>(reinterpret_cast<float(&)[DN / 8][4]>(acc[n * DN / 8]), a[kk],
                           TB::desc_mn(tile_b, kk * 16, n * DN * 2), 1);
}

// A warp's 16 rows [row0, row0 + 16) of a 16-bit operand in A fragments (repack_all's: a[kk][r] holds row g + 8
// (r % 2), columns 16 kk + 8 (r / 2) + 2t, + 1) into a K-major tile in shared memory, for a wgmma to read.
template <class Tile, int NT>
__forceinline__ __device__ void store_a_rows(u32 tile, int row0, const u32 (&a)[NT / 2][4]) {
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r)
            st_shared(tile + Tile::offset(row0 + g + 8 * (r % 2), 2 * (16 * kk + 8 * (r / 2) + 2 * t)), (int)a[kk][r]);
}

// The same with A from shared memory: rows [a_row, a_row + 64) of the K-major tile TA, columns [0, 16 KSTEPS)
// (the fused dQ's writer variant, whose P^T and dS^T sit there): n64 wgmmas with B read MN-major.
template <class T, class TA, class TB, int D, int KSTEPS>
__forceinline__ __device__ void wgmma_ss_rows(float (&acc)[D / 8][4], u32 tile_a, int a_row, u32 tile_b) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
        for (int n = 0; n < D / 64; ++n)
            wgmma_16_ss<T, 0, 1>(reinterpret_cast<float(&)[8][4]>(acc[n * 8]), TA::desc(tile_a, a_row, kk * 32),
                                 TB::desc_mn(tile_b, kk * 16, n * 128), 1);
}

// acc (64 x 8 NT) = A B^T over d: A rows [a_row, a_row + 64) of tile TA, B rows [0, 8 NT) of tile TB, both K-major.
template <class T, class TA, class TB, int D, int NT>
__forceinline__ __device__ void wgmma_ss_abt(float (&acc)[NT][4], u32 tile_a, int a_row, u32 tile_b) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        wgmma_16_ss<T>(acc, TA::desc(tile_a, a_row, kk * 32), TB::desc(tile_b, 0, kk * 32), kk > 0);
}

// The 16-bit A fragments of an fp32 accumulator (64 x 8 NT): reduction step k takes columns 16k .. 16k + 15.
template <class T, int NT>
__forceinline__ __device__ void repack_all(u32 (&a)[NT / 2][4], const float (&acc)[NT][4]) {
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) repack_a<T>(a[kk], acc[2 * kk], acc[2 * kk + 1]);
}

// FUSED (the fused dQ): the order in which the dK/dV CTAs of one (batch, kv head) add their shares dS_ij K_j into
// dQ_i. It is fixed, so the sum is the same bit for bit on every run, and it is the order in which the shares
// arrive when the n_kv CTAs of a head run side by side (fa2_bwd_fused_sm90's grid: one CTA per K/V block j, every
// head's CTAs resident at once), so that a CTA rarely waits for its turn:
//   ROTATED (not causal): CTA j visits the Q blocks from lo(j) = j n_q / n_kv on, cyclically, so at any step the
//     CTAs work on different Q blocks; block i's shares come from j = u(i), u(i) - 1, ... (mod n_kv), u(i) the last
//     CTA whose start is at or below i: rank (u(i) - j) mod n_kv.
//   UP (causal, even items): CTA j visits the blocks it sees from the first (i_first) up; the nearer block j is to
//     block i's diagonal, the sooner it gets there: rank j_end(i) - 1 - j (j_end(i): the K/V blocks i sees).
//   DOWN (causal, odd items, roles mirrored so that each CTA's two items add up to one head's work): from the last
//     block down. Role j's CTA held role n_kv - 1 - j in the even item before, j + 1 block rows of work, so the
//     smaller the role the sooner it starts, and the shares come in ascending j: rank j.
// kernels/fa2_bwd_sm90.py's dq_order mirrors this (tests/test_fa2_bwd_sm90.py checks that every block's ranks are
// 0 .. count - 1 and follow the arrival order).
struct DqOrder {
    enum Mode { ROTATED, UP, DOWN };
    int mode, j, n_kv, n_q, i_first;
    int i_lo;  // ROTATED: the first Q block, j n_q / n_kv (divided once, not at every step)
    __forceinline__ __device__ int block(int k) const {  // the Q block of this CTA's k-th step of a query head
        if (mode == UP) return i_first + k;
        if (mode == DOWN) return n_q - 1 - k;
        const int i = i_lo + k;
        return i < n_q ? i : i - n_q;
    }
    template <int BM, int BN>  // BN: the keys of one contributor (a CTA's block, or a pair's two)
    __forceinline__ __device__ int rank(int i, int seqlen_q, int seqlen_k) const {
        if (mode == UP) return kv_block_range<BM, BN>(i * BM, seqlen_q, seqlen_k, true).end - 1 - j;
        if (mode == DOWN) return j;
        const int t = ((i + 1) * n_kv - 1) / n_q - j;
        return t < 0 ? t + n_kv : t;
    }
};

// Where the fused dQ's shares go: acc (batch, heads, n_q BM, D) fp32, dQ_i's rows contiguous; counts (batch,
// heads, n_q, 2): the shares added so far to each Q block, per half of it (a warpgroup's).
// PAIR: the shares of a cluster's two CTAs (K/V blocks 2P, 2P + 1) are summed on chip first, each CTA adding one
// half of the pair's sum; `exchanges` counts the pair's swaps (their buffers alternate) or, WRITER, the CTA's
// shares (buffer k % 2 takes share k).
struct DqShares {
    float* acc;
    int* counts;
    int exchanges;
};

// dkdv_block's shared memory, byte offsets from its 1024-aligned base: K_j, V_j (NO_V: K_j only), STAGES of (Q_i,
// dO_i), STAGES of the queries' LSE and D, then (FUSED) dS^T and the dQ buffers: PAIR's two of the peer's half, or
// WRITER's two shares of both halves (64 x 64 fp32 each) with their full and empty mbarriers.
template <int D, int BN, int BM, int STAGES, bool NO_V>
struct DkdvSmem {
    static constexpr u32 KV = (NO_V ? 1 : 2) * SwizzledTile<BN, 2 * D>::BYTES;
    static constexpr u32 QDO = 2 * SwizzledTile<BM, 2 * D>::BYTES;  // a stage of (Q_i, dO_i), from KV on
    static constexpr u32 STATS = KV + STAGES * QDO;
    // DS: dS^T for the fused dQ, or (XCHG) the step's P^T, 64 x BM fp32 in fragment order
    static constexpr u32 DS = STATS + ((STAGES * 2 * BM * 4 + 1023) & ~1023);
    static constexpr u32 DQ = DS + SwizzledTile<BN, 2 * BM>::BYTES;
    // WRITER: full(k) at DQ_BARS + 8k, empty(k) at + 16; the slots (a share's Q block and rank, two ints) at
    // DQ_SLOTS + 8k, ending 16 bytes on (kernels/fa2_bwd_sm90.py's fused_smem counts them)
    static constexpr u32 HALF = 64 * 64 * 4, DQ_BARS = DQ + 2 * 2 * HALF, DQ_SLOTS = DQ_BARS + 32;
};

// One dkdv CTA: K/V block j of BN keys, BM queries per step; DK, DV: which gradients it computes (both, or one
// each at d = 256). NO_V (dV only): V gets no shared memory, the Q/dO stages start where it would. PIPE: step
// s+1's S^T issued before step s's dV/dK are waited on (the header). XCHG (SPLIT 2, d = 256): one warpgroup of a
// CTA of two on the same 64 keys, with the other's gradient: the dV one (warpgroup 0) computes P^T and leaves it in
// shared memory, the dK one takes it from there instead of computing S^T.
template <class T, int D, int BN, int BM, bool DK, bool DV, bool NO_V = false, bool PIPE = false, bool FUSED = false,
          bool XCHG = false>
__forceinline__ __device__ void dkdv_block(const BwdParams& p, int j, int h_kv, int b, DqOrder order = {},
                                           DqShares* dq = nullptr) {
    constexpr int THREADS = XCHG ? 256 : 2 * BN, NT = BM / 8, DT = D / 8, STAGES = PIPE ? 3 : 2;
    using TQ = SwizzledTile<BM, 2 * D>;   // Q_i, dO_i [query][d]: K-major B of S^T, dP^T; N-major B of dK, dV
    using TKV = SwizzledTile<BN, 2 * D>;  // K_j, V_j [key][d]: K-major A of S^T, dP^T; N-major B of dQ (FUSED)
    using TdS = SwizzledTile<BN, 2 * BM>; // dS^T [key][query] (FUSED): the MN-major A of dQ = dS K
    static_assert((BN == 64 || BN == 128 || BN == 192) && (D == 64 || D == 128 || D == 256), "1-3 warpgroups");
    static_assert(BM == 32 || BM == 64 || BM == 128, "wgmma n32 / n64 / n128 blocks");
    static_assert(!(NO_V && DK), "dK needs V (dP^T)");
    static_assert(!XCHG || (BN == 64 && DK != DV && !NO_V && !PIPE && !FUSED), "a warpgroup per gradient");
    static_assert(!PIPE || BN <= 128, "PIPE's loads are branch-free for <= 256 threads");
    // FUSED: the two warpgroups split dQ_i (BM x D) in halves of 64 x 64: by rows at BM 128, by columns at BM 64
    static_assert(!FUSED || (DK && DV && !PIPE && BN == 128 && BM * D == 128 * 64),
                  "fused dQ: 128 x 64 or 64 x 128");

    extern __shared__ unsigned char smem[];
    // Shared memory (1024-byte aligned for the swizzle): K_j, V_j, STAGES of (Q_i, dO_i), then STAGES of the
    // queries' LSE (log2 units; PIPE: as stored, scaled at use) and D.
    using L = DkdvSmem<D, BN, BM, STAGES, NO_V>;
    const u32 base = (smem_u32(smem) + 1023) & ~1023u;
    const u32 sK = base, sV = sK + TKV::BYTES;
    auto sQ = [&](int stage) { return base + L::KV + stage * L::QDO; };
    auto sdO = [&](int stage) { return sQ(stage) + TQ::BYTES; };
    float* stats = reinterpret_cast<float*>(smem + (base - smem_u32(smem)) + L::STATS);
    const u32 sdS = base + L::DS, sdQ = base + L::DQ;
    // WRITER: a warpgroup of its own does the adds, so only the 2 BN compute threads meet at the CTA's barriers.
    // XCHG: the two warpgroups run different instances of this function, which meet at barrier 3 as well.
    auto sync_cta = [&] {
        if constexpr (FUSED || XCHG) named_sync(3, THREADS);
        else __syncthreads();
    };

    const int wg = threadIdx.x / 128, warp = threadIdx.x / 32 % 4;
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    const int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k, diag = seqlen_k - seqlen_q;
    const bool causal = p.causal;
    const int kw0 = XCHG ? 0 : wg * 64;        // this warpgroup's first key of the block (XCHG: both take all 64)
    const int key0 = j * BN, kr0 = kw0 + warp * 16;  // the block's first key; this warp's first row of it
    // (FUSED: the order's, a pair's first block for both of its CTAs, so that they visit the same Q blocks)
    const int i_first = FUSED ? order.i_first : first_q_block<BM>(key0, seqlen_q, seqlen_k, causal);
    const int n_i = max(0, (seqlen_q + BM - 1) / BM - i_first);  // Q blocks per query head that see block j
    const int steps = p.group * n_i;                              // (query head, Q block), head-major
    const int row_bytes = 2 * p.head_dim;                         // columns past it are zero-filled
    // A step's query head (hq: h_kv's hq-th) and k-th Q block of that head, advanced one step at a time: divisions
    // by n_i at every step took about 10 % of the writer's compute-warp samples at d 64 (ncu, seventh session).
    struct Step { int hq, k; };
    auto after = [&](Step c) { return c.k + 1 < n_i ? Step{c.hq, c.k + 1} : Step{c.hq + 1, 0}; };
    auto q_block = [&](Step c) { return FUSED ? order.block(c.k) : i_first + c.k; };

    load_rows_async<BN, 2 * D, THREADS>(sK, reinterpret_cast<const unsigned char*>(p.k + b * p.k_b + h_kv * p.k_h +
                                                                                   (i64)key0 * p.k_n),
                                        p.k_n * 2, seqlen_k - key0, row_bytes);
    if constexpr (DK || XCHG)  // V enters dP^T only (XCHG: each warpgroup copies its share of both tiles)
        load_rows_async<BN, 2 * D, THREADS>(sV, reinterpret_cast<const unsigned char*>(p.v + b * p.v_b +
                                                                                       h_kv * p.v_h +
                                                                                       (i64)key0 * p.v_n),
                                            p.v_n * 2, seqlen_k - key0, row_bytes);
    // One cp.async group per step (the first also carries K_j, V_j). PIPE loads every step number it is given: a
    // step past the last one is all zero-fill (no reads).
    auto load_q = [&](int step, Step c, int stage) {  // c: the cursor of step `step`
        const bool live = !PIPE || step < steps;
        const int h = h_kv * p.group + (live ? c.hq : 0), m0 = (live ? q_block(c) : i_first) * BM;
        const int rows = live ? seqlen_q - m0 : 0;
        load_rows_async<BM, 2 * D, THREADS>(sQ(stage), reinterpret_cast<const unsigned char*>(p.q + b * p.q_b +
                                                                                              h * p.q_h +
                                                                                              (i64)m0 * p.q_n),
                                            p.q_n * 2, rows, row_bytes);
        load_rows_async<BM, 2 * D, THREADS>(sdO(stage), reinterpret_cast<const unsigned char*>(p.dout + b * p.do_b +
                                                                                               h * p.do_h +
                                                                                               (i64)m0 * p.do_n),
                                            p.do_n * 2, rows, row_bytes);
        if constexpr (PIPE) {
            // Queries past seqlen_q get LSE = D = 0: their Q and dO rows are zero, so S^T = 0, P^T = 1, dP^T = 0,
            // and they add P^T x 0 to dV and 1 x (0 - 0) x 0 to dK.
            const int r = threadIdx.x;
            const i64 at = ((i64)b * p.heads + h) * seqlen_q + m0 + r;
            const bool ok = r < rows;
            if (r < BM) {  // (predicated: BM <= THREADS)
                cp_async_4(smem_u32(stats + (2 * stage) * BM + r), ok ? p.lse + at : p.lse, ok);
                cp_async_4(smem_u32(stats + (2 * stage + 1) * BM + r), ok ? p.delta + at : p.delta, ok);
            }
            cp_async_commit();
        } else {
            cp_async_commit();
            for (int r = threadIdx.x; r < BM; r += THREADS) {
                const RowStats st = row_stats(p, b, h, m0 + r);
                stats[(2 * stage) * BM + r] = st.lse2;
                stats[(2 * stage + 1) * BM + r] = st.delta;
            }
        }
    };
    if (PIPE || steps > 0) load_q(0, Step{0, 0}, 0);
    else cp_async_commit();

    float dk[1][DT][4] = {}, dv[1][DT][4] = {};  // this warp's 16 keys x D (rows 16 warp + g, + 8 of the warpgroup)
    // S^T, P^T, dP^T, dS^T: 64 keys x BM queries each. PIPE gives P^T and dS^T registers of their own (else they
    // overwrite S^T, dP^T): it issues the next S^T into st while this step's dK is in flight, and ptxas serializes
    // wgmmas (C7515) whose accumulators non-wgmma instructions wrote inside the pipeline.
    float st[NT][4], dpt[NT][4], own[PIPE ? 2 : 1][NT][4];
    float(&pt)[NT][4] = PIPE ? own[0] : st;
    float(&dst)[NT][4] = PIPE ? own[PIPE ? 1 : 0] : dpt;
    // S^T = K_wg Q_i^T (with_st), dP^T = V_wg dO_i^T (with_dp): one commit group each
    auto issue_st = [&](int stage, bool with_st, bool with_dp) {
        wgmma_fence();
        if (with_st) {
            wgmma_ss_abt<T, TKV, TQ, D>(st, sK, kw0, sQ(stage));
            wgmma_commit();
        }
        if (DK && with_dp) {
            wgmma_ss_abt<T, TKV, TQ, D>(dpt, sV, kw0, sdO(stage));
            wgmma_commit();
        }
    };
    // P^T: element (key row, query col) = exp2(S^T scale_log2 - LSE2[query]) where the key is visible,
    // else exactly 0 (a select: LSE = -inf for a query that saw no key must not make a NaN). A warp whose 16
    // keys are all visible to the block's first query (hence to all of them) skips the test.
    auto p_of_st = [&](const float* lse2, int m0) {
        const int kw = key0 + kr0;
        const bool edge = kw + 16 > seqlen_k || (causal && kw + 15 > m0 + diag);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = nt * 8 + 2 * t + e % 2, key = kw + g + 8 * (e / 2);
                const float l2 = PIPE ? lse2[col] * -LOG2E : -lse2[col];  // (load_q's product, negated)
                const float x = exp2f_approx(fmaf(st[nt][e], p.scale_log2, l2));
                pt[nt][e] = !edge || (key < seqlen_k && !(causal && key > m0 + col + diag)) ? x : 0.f;
            }
    };
    // dV_j += P^T dO_i: P^T from the registers (reduction index: the queries), dO_i read N-major
    auto issue_dv = [&](int stage) {
        u32 a[NT / 2][4];
        repack_all<T>(a, pt);
        wgmma_fence();
        wgmma_rs_rows<T, TQ, D>(dv[0], a, sdO(stage));
        wgmma_commit();
    };
    // dS^T = P^T * (dP^T - D[query]), then dK_j += dS^T Q_i (Q_i read N-major)
    u32 ads[NT / 2][4];  // dS^T as 16-bit A fragments (FUSED: also stored for dQ)
    auto issue_dk = [&](int stage, const float* delta) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) dst[nt][e] = pt[nt][e] * (dpt[nt][e] - delta[nt * 8 + 2 * t + e % 2]);
        repack_all<T>(ads, dst);
        wgmma_fence();
        wgmma_rs_rows<T, TQ, D>(dk[0], ads, sQ(stage));
        wgmma_commit();
    };

    // FUSED: dQ_i's share dS_ij K_j. dS^T goes to shared memory (both warpgroups' keys make up the reduction);
    // warpgroup wg takes its 64 x 64 half (rows qr0.., columns dc0..) and, once the Q block's count reaches this
    // CTA's rank, stores (rank 0) or adds it to dQ's fp32 accumulator. The count is released one step later,
    // after a barrier every thread of the CTA passes after its adds (`pending`).
    constexpr int QR0 = BM == 128 ? 64 : 0, DC0 = BM == 128 ? 0 : 64;  // times wg
    auto dq_share_issue = [&](float (&dqs)[8][4]) {  // dS_wg-half K_j: both warpgroups' keys in the reduction
        wgmma_fence();
        // (WRITER: two base descriptors stepped by constants, not BN / 8 of them held across the loop)
        const u64 a0 = TdS::desc_mn(sdS, 0, 2 * QR0 * wg), b0 = TKV::desc_mn(sK, 0, 2 * DC0 * wg);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            wgmma_16_ss<T, 1, 1>(dqs, a0 + kk * TdS::W, b0 + kk * TKV::W, kk > 0);
        wgmma_commit();
    };
    // WRITER: P^T goes through shared memory and dV reads it from there, so that its A fragments (32 registers)
    // are not live under the dP^T wgmma: the compute warps then fit the 240 registers that setmaxnreg leaves
    // them. Its place is this warpgroup's half of the buffer this step's share will take (`share % 2`, 16 KB; a
    // SwizzledTile of 64 keys x BM queries): only this warpgroup's dV reads it, and the share overwrites it once
    // every wgmma of the step is done. The share then goes there for the writer warpgroup (dq_writer) in
    // fragment order: the (n, r) pair of thread x at float ((n * 2 + r) * 128 + x) * 2 of the half (8-byte pairs
    // contiguous by thread: conflict-free; fa2_bwd_dq_convert's FRAG).
    using TP = SwizzledTile<64, 2 * BM>;
    // (at BM 64 its 16 registers fit. Issuing dP^T only behind dV instead does not help at BM 128: pt stays live
    // for dS^T, and ptxas serializes the wgmmas all the same)
    constexpr bool P_SMEM = BM == 128;
    auto writer_step = [&](int stage, const float* delta, int h, int i) {
        const int share = dq->exchanges++, buf = share % 2;
        const u32 half = sdQ + buf * 2 * L::HALF + wg * L::HALF;
        if constexpr (P_SMEM) {
            {
                u32 a[NT / 2][4];
                repack_all<T>(a, pt);
                store_a_rows<TP, NT>(half, warp * 16, a);
            }
            fence_proxy_async();
            named_sync(1 + wg, 128);  // this warpgroup's P^T in
            wgmma_fence();
            wgmma_ss_rows<T, TP, TQ, D, BM / 16>(dv[0], half, 0, sdO(stage));
            wgmma_commit();
        } else {
            issue_dv(stage);
        }
        wgmma_wait<1>();  // dP^T is in (dV may still run)
        hold_registers(dpt);
        issue_dk(stage, delta);
        store_a_rows<TdS, NT>(sdS, kr0, ads);
        fence_proxy_async();
        sync_cta();  // both warpgroups' dS^T in
        float dqs[8][4];
        dq_share_issue(dqs);
        wgmma_wait<0>();  // dV, dK, the share: P^T and dS^T are read
        hold_registers(dqs);
        hold_registers(dv[0]);
        hold_registers(dk[0]);
        const u32 mine = half + (threadIdx.x % 128) * 8;
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int r = 0; r < 2; ++r) st_shared_f32x2(mine + (n * 2 + r) * 128 * 8, dqs[n][2 * r], dqs[n][2 * r + 1]);
        fence_proxy_async();  // visible to the bulk copy that reads it
        if (threadIdx.x == 0) {  // where it goes (an int: batch x heads x Q blocks < 2^31), and its turn
            const int n_q = (seqlen_q + BM - 1) / BM;
            st_shared(base + L::DQ_SLOTS + 8 * buf, ((b * p.heads + h) * n_q + i));
            st_shared(base + L::DQ_SLOTS + 8 * buf + 4, order.rank<BM, BN>(i, seqlen_q, seqlen_k));
        }
        mbar_arrive_if(base + L::DQ_BARS + 8 * buf, true);
    };

    // XCHG: P^T from the dV warpgroup to the dK one, in fragment order (thread x's float4 of column block nt at
    // (nt * 128 + x) * 16 bytes: the same thread of the other warpgroup holds the same keys and queries). One buffer
    // is enough: it is written again only after the next step's CTA barrier, which the reader passes after reading.
    // Barrier 4: P^T is in; barrier 5: S^T is issued (dP^T goes to the tensor cores behind it, so that S^T, whose
    // softmax both warpgroups then wait for, comes out first).
    float4* const px = reinterpret_cast<float4*>(smem + (base - smem_u32(smem)) + L::DS) + threadIdx.x % 128;
    auto give_pt = [&] {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) px[nt * 128] = make_float4(pt[nt][0], pt[nt][1], pt[nt][2], pt[nt][3]);
        named_arrive(4, 256);
    };
    auto take_pt = [&] {
        named_sync(4, 256);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const float4 v = px[nt * 128];
            pt[nt][0] = v.x, pt[nt][1] = v.y, pt[nt][2] = v.z, pt[nt][3] = v.w;
        }
    };

    constexpr bool LOAD_LATE = XCHG || FUSED;  // (not PIPE: its LSE/D go by cp.async)
    if constexpr (PIPE) {
        load_q(1, after(Step{0, 0}), 1);
        cp_async_wait<1>();
        fence_proxy_async();
        sync_cta();  // step 0 visible to the tensor cores
        issue_st(0, true, false);
        wgmma_wait<0>();
    }
    // (the cursor alone is carried around the loop, not the step number too: one register more made ptxas spill in
    // the writer at d 64)
    for (Step cur{n_i > 0 ? 0 : p.group, 0}; cur.hq < p.group; cur = after(cur)) {
        const int s = cur.hq * n_i + cur.k;  // the step number
        const int stage = s % STAGES, m0 = q_block(cur) * BM, h = h_kv * p.group + cur.hq;
        if constexpr (PIPE) {  // S^T came in with the previous step's last wait
            hold_registers(st);
            issue_st(stage, false, true);
        } else {
            cp_async_wait<0>();
            fence_proxy_async();
            sync_cta();  // step s visible to the tensor cores; every warpgroup is done with step s-1's stage
            if (!LOAD_LATE && s + 1 < steps) load_q(s + 1, after(cur), stage ^ 1);
            if constexpr (FUSED)  // the writer has read share - 2 from the buffer this step's share will take
                mbar_wait(base + L::DQ_BARS + 16 + 8 * (dq->exchanges % 2), ((dq->exchanges / 2) & 1) ^ 1);
            if constexpr (XCHG && DK) named_sync(5, 256);
            issue_st(stage, !(XCHG && DK), true);  // (XCHG: S^T in the dV warpgroup, dP^T in the dK one)
            if constexpr (XCHG && DV) named_arrive(5, 256);
            // LOAD_LATE: the next step's loads behind the first products, whose issue they delayed (load_q waits
            // for its LSE/D loads to store them; at d 256 the dK warpgroup then waited at barrier 5: 18 % of its
            // samples)
            if (LOAD_LATE && s + 1 < steps) load_q(s + 1, after(cur), stage ^ 1);
        }
        const float* lse2 = stats + (2 * stage) * BM;
        const float* delta = lse2 + BM;
        if constexpr (XCHG && DK) {
            take_pt();
        } else {
            wgmma_wait<DK ? 1 : 0>();  // S^T is in (dP^T may still run)
            hold_registers(st);
            p_of_st(lse2, m0);
            if constexpr (XCHG) give_pt();
        }
        if constexpr (FUSED) {
            writer_step(stage, delta, h, m0 / BM);
            continue;
        }
        if constexpr (DV) issue_dv(stage);
        if constexpr (DK) {
            wgmma_wait<DV ? 1 : 0>();  // dP^T is in (dV may still run)
            hold_registers(dpt);
            issue_dk(stage, delta);
        }
        if constexpr (PIPE) {
            cp_async_wait<0>();
            fence_proxy_async();
            sync_cta();  // step s+1 visible; every warpgroup has waited on step s-1's wgmmas (its stage is free)
            load_q(s + 2, after(after(cur)), (s + 2) % STAGES);
            issue_st((s + 1) % STAGES, true, false);  // behind step s's dV, dK
        }
        // Before the next barrier lets this stage be overwritten. (PIPE: also S^T of step s+1; a wgmma in flight
        // across the loop's back edge would make ptxas serialize them, C7514.)
        wgmma_wait<0>();
        if constexpr (DK) hold_registers(dk[0]);  // (held, an unused accumulator would stay live)
        if constexpr (DV) hold_registers(dv[0]);
    }
    cp_async_wait<0>();
    sync_cta();  // every warpgroup is done with the tiles (and K_j's copies have landed with no step to run)

    // dK = scale * dS^T Q and dV, each staged through shared memory (this warp's own 16 rows) for 16-byte stores
    // into contiguous (batch, seqlen_k, heads_kv, head_dim) gradients.
    const int heads_kv = p.heads / p.group;
    const i64 ld = (i64)heads_kv * p.head_dim, at = ((i64)b * seqlen_k + key0 + kr0) * ld + (i64)h_kv * p.head_dim;
    u16* stage_k = reinterpret_cast<u16*>(smem + (base - smem_u32(smem))) + kr0 * Tile<16, D>::STRIDE;
    u16* stage_v = stage_k + BN * Tile<16, D>::STRIDE;
    if constexpr (DK) {
        const float scale[1][2] = {{p.scale, p.scale}};
        store_acc_rows<T, D>(dk, scale, stage_k, p.dk + at, ld, seqlen_k - key0 - kr0, p.head_dim);
    }
    if constexpr (DV) {
        const float one[1][2] = {{1.f, 1.f}};
        store_acc_rows<T, D>(dv, one, stage_v, p.dv + at, ld, seqlen_k - key0 - kr0, p.head_dim);
    }
}

}  // namespace fav

// SPLIT (d = 256) 1: blockIdx.x = 2 j + part, part 0 computes dK, part 1 dV (with BM_DV queries per step; when
// that differs from BM the dV part leaves V out of its shared memory). 2: warpgroup 0 of the CTA computes dV and
// P^T, warpgroup 1 dK (dkdv_block's XCHG), on the same BN = 64 keys. PIPE: dkdv_block's.
template <class T, int D, int BN, int SPLIT, int BM = 64, int MINB = 1, int BM_DV = BM, bool PIPE = false>
__global__ void __launch_bounds__((SPLIT == 2 ? 4 : 2) * BN, MINB)
fa2_bwd_dkdv_sm90(const fav::BwdParams p) {
    static_assert(SPLIT == 1 || BM_DV == BM, "BM_DV is the CTA split's");
    if constexpr (SPLIT == 2) {
        // (template arguments: DK, DV, NO_V, PIPE, FUSED, XCHG)
        if (threadIdx.x < 128)  // warpgroup 0: S^T, P^T, dV
            fav::dkdv_block<T, D, BN, BM, false, true, false, false, false, true>(
                p, blockIdx.x, blockIdx.y, blockIdx.z);
        else  // warpgroup 1: dP^T, dS^T, dK
            fav::dkdv_block<T, D, BN, BM, true, false, false, false, false, true>(
                p, blockIdx.x, blockIdx.y, blockIdx.z);
    } else if constexpr (SPLIT == 1) {
        if (blockIdx.x % 2 == 0)
            fav::dkdv_block<T, D, BN, BM, true, false, false, PIPE>(p, blockIdx.x / 2, blockIdx.y, blockIdx.z);
        else
            fav::dkdv_block<T, D, BN, BM_DV, false, true, (BM_DV != BM), PIPE>(p, blockIdx.x / 2, blockIdx.y,
                                                                               blockIdx.z);
    } else {
        fav::dkdv_block<T, D, BN, BM, true, true, false, PIPE>(p, blockIdx.x, blockIdx.y, blockIdx.z);
    }
}

// The fused dQ (deterministic, two passes instead of three): a persistent grid of `groups` x n_kv CTAs, all
// resident at once (the launcher sizes it to the SMs), CTA (group, c) takes the role of K/V block j of every
// groups-th (batch, kv head) from `group` on, in dkdv_block's FUSED order (DqOrder); causal items alternate the
// roles (c, n_kv - 1 - c) and the visiting direction so that every CTA's two items add up to one head's work.
// A CTA only ever waits for CTAs of its own head and group, which run beside it, for a share they add at an
// earlier step of theirs: no cycle. fa2_bwd_dq_convert then scales dQ into the input dtype.
namespace fav {
template <class T, int D, int BN, int BM>
__forceinline__ __device__ void fused_items(const BwdParams& p, float* dq_acc, int* dq_counts, int batch) {
    const int n_kv = (p.seqlen_k + BN - 1) / BN;
    const int n_q = (p.seqlen_q + BM - 1) / BM, heads_kv = p.heads / p.group;
    const int cta = blockIdx.x;
    const int c = cta % n_kv, groups = gridDim.x / n_kv;
    DqShares shares{dq_acc, dq_counts, 0};
    for (int item = cta / n_kv, m = 0; item < batch * heads_kv; item += groups, ++m) {
        const bool down = p.causal && (m & 1);
        const int u = down ? n_kv - 1 - c : c, j = u;
        const int i_first = first_q_block<BM>(u * BN, p.seqlen_q, p.seqlen_k, p.causal);
        const DqOrder order{p.causal ? (down ? DqOrder::DOWN : DqOrder::UP) : DqOrder::ROTATED, u, n_kv, n_q,
                            i_first, u * n_q / n_kv};
        dkdv_block<T, D, BN, BM, true, true, false, false, true>(p, j, item % heads_kv, item / heads_kv, order,
                                                                 &shares);
        // the epilogue staged dK, dV over K_j, V_j: done before the next item loads them
        named_sync(3, 2 * BN);
    }
    {  // the end, for the writer: a last share of rank -1
        using L = DkdvSmem<D, BN, BM, 2, false>;
        extern __shared__ unsigned char smem[];
        const u32 base = (smem_u32(smem) + 1023) & ~1023u, buf = shares.exchanges % 2;
        mbar_wait(base + L::DQ_BARS + 16 + 8 * buf, ((shares.exchanges / 2) & 1) ^ 1);
        if (threadIdx.x == 0) st_shared(base + L::DQ_SLOTS + 8 * buf + 4, -1);
        mbar_arrive_if(base + L::DQ_BARS + 8 * buf, true);
    }
}

// The dQ writer (fa2_bwd_fused_writer_sm90's last warpgroup): lane 0 of its warps 0 and 1 each take one half of
// every share the compute warpgroups leave in shared memory (buffer k % 2 of the CTA's k-th share, with its slot:
// the (batch, head, Q block) it belongs to and its rank; rank -1 ends the walk): wait for the full barrier, then
// for the Q block's count to reach the rank, store (rank 0) or add the 16 KB half by one bulk copy, hand the
// buffer back once it is read, and release the count once the copy is complete. The compute warps go on
// meanwhile; they wait only when both buffers are still unread.
template <int D, int BN, int BM>
__forceinline__ __device__ void dq_writer(float* dq_acc, int* dq_counts) {
    using L = DkdvSmem<D, BN, BM, 2, false>;
    extern __shared__ unsigned char smem[];
    const u32 base = (smem_u32(smem) + 1023) & ~1023u;
    const int half = threadIdx.x / 32 % 4;
    if (half >= 2 || threadIdx.x % 32 != 0) return;
    for (int share = 0;; ++share) {
        const int buf = share % 2;
        const u32 full = base + L::DQ_BARS + 8 * buf, empty = full + 16, slot = base + L::DQ_SLOTS + 8 * buf;
        mbar_wait(full, (share / 2) & 1);
        const int block = ld_shared(slot), rank = ld_shared(slot + 4);
        if (rank < 0) break;
        const i64 at = 2 * (i64)block + half;  // (batch, head, Q block, half)
        wait_count_at_least(dq_counts + at, rank);
        fence_proxy_async_global();  // the earlier shares' copies, seen through the count, come first
        const u32 src = base + L::DQ + buf * 2 * L::HALF + half * L::HALF;
        if (rank == 0) bulk_store(dq_acc + at * 64 * 64, src, L::HALF);
        else bulk_reduce_add_f32(dq_acc + at * 64 * 64, src, L::HALF);
        bulk_commit();
        bulk_wait_read<0>();
        mbar_arrive_if(empty, true);
        bulk_wait<0>();
        fence_proxy_async_global();
        release_own_count(dq_counts + at);
    }
    bulk_wait<0>();
}
}  // namespace fav

// The fused dQ with a warpgroup that only writes dQ (FA3's backward has one): the compute warpgroups leave each
// share in shared memory and go on; the writer takes the turns and adds them by bulk copies (dq_writer). The
// shares then lie in fragment order (fa2_bwd_dq_convert's FRAG). Registers: 240 a compute thread, 24 a writer's.
template <class T, int D, int BN, int BM>
__global__ void __launch_bounds__(2 * BN + 128, 1)
fa2_bwd_fused_writer_sm90(const fav::BwdParams p, float* dq_acc, int* dq_counts, int batch) {
    using namespace fav;
    extern __shared__ unsigned char smem[];
    const u32 bars = ((smem_u32(smem) + 1023) & ~1023u) + DkdvSmem<D, BN, BM, 2, false>::DQ_BARS;
    if (threadIdx.x == 0) {
        for (int k = 0; k < 2; ++k) {
            mbar_init(bars + 8 * k, 2 * BN);  // full: every compute thread, once its part of the share is stored
            mbar_init(bars + 16 + 8 * k, 2);  // empty: both writer threads, once their copies have read it
        }
        fence_mbar_init();
    }
    __syncthreads();
    if (threadIdx.x < 2 * BN) {
        setmaxnreg_inc<240>();
        fused_items<T, D, BN, BM>(p, dq_acc, dq_counts, batch);
    } else {
        setmaxnreg_dec<24>();
        dq_writer<D, BN, BM>(dq_acc, dq_counts);
    }
}

// dQ = scale x the fused pass's fp32 sum, into q's layout (contiguous); Q blocks that see no key get zeros (no
// share was stored there). One thread per 8 columns of a row. The sum is in the writer's layout, (batch, heads,
// n_q, half, 64 x 64 in fragment order: the pair of columns 8n + 2t, + 1 of row 16 w + 8 r + g at float
// ((n * 2 + r) * 128 + 32 w + 4 g + t) * 2 of its half), so that a row's 8 columns from 8n on are again 8
// consecutive floats. FRAG names that layout (true: the only one).
template <class T, int D, int BN, int BM, bool FRAG>
__global__ void __launch_bounds__(256)
fa2_bwd_dq_convert(const fav::BwdParams p, const float* dq_acc) {
    using namespace fav;
    static_assert(FRAG && BM * D == 2 * 64 * 64, "the writer's two 64 x 64 halves");
    const int h = blockIdx.y, b = blockIdx.z, chunks = p.head_dim / 8;
    const int x = blockIdx.x * 256 + threadIdx.x;
    if (x >= p.seqlen_q * chunks) return;
    const int q = x / chunks, col = x % chunks * 8, i = q / BM, n_q = (p.seqlen_q + BM - 1) / BM;
    const bool seen = kv_block_range<BM, BN>(i * BM, p.seqlen_q, p.seqlen_k, p.causal).count() > 0;
    // halves by rows at BM 128 (d 64), by columns at BM 64 (d 128)
    const int rq = q % BM, half = BM == 128 ? rq / 64 : col / 64, row = rq % 64, n = col % 64 / 8;
    const float* src = dq_acc + ((((i64)b * p.heads + h) * n_q + i) * 2 + half) * 64 * 64 +
                       ((n * 2 + row % 16 / 8) * 128 + row / 16 * 32 + row % 8 * 4) * 2;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = seen ? src[e] : 0.f;
    u32 packed[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) packed[e] = T::pack(v[2 * e] * p.scale, v[2 * e + 1] * p.scale);
    *reinterpret_cast<uint4*>(p.dq + ((i64)b * p.seqlen_q + q) * p.heads * p.head_dim + (i64)h * p.head_dim + col) =
        make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

template <class T, int D, int BM, int BN, int MINB = 1>
__global__ void __launch_bounds__(2 * BM, MINB)
fa2_bwd_dq_sm90(const fav::BwdParams p) {
    using namespace fav;
    constexpr int THREADS = 2 * BM, NT = BN / 8, DT = D / 8;
    using TQ = SwizzledTile<BM, 2 * D>;   // Q_i, dO_i [query][d]: K-major A of S, dP
    using TKV = SwizzledTile<BN, 2 * D>;  // K_j, V_j [key][d]: K-major B of S, dP; K_j N-major B of dQ
    static_assert((BM == 64 || BM == 128 || BM == 192) && (BN == 32 || BN == 64 || BN == 128) &&
                  (D == 64 || D == 128 || D == 256), "wgmma n32 / n64 / n128 blocks, one to three warpgroups");

    extern __shared__ unsigned char smem[];
    // Shared memory (1024-byte aligned for the swizzle): Q_i, dO_i, then two stages of (K_j, V_j).
    const u32 base = (smem_u32(smem) + 1023) & ~1023u;
    const u32 sQ = base, sdO = sQ + TQ::BYTES;
    auto sK = [&](int stage) { return sdO + TQ::BYTES + stage * 2 * TKV::BYTES; };
    auto sV = [&](int stage) { return sK(stage) + TKV::BYTES; };

    const int i_block = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z, h_kv = h / p.group;
    const int wg = threadIdx.x / 128, warp = threadIdx.x / 32 % 4, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    const int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k, diag = seqlen_k - seqlen_q;
    const bool causal = p.causal;
    const int m0 = i_block * BM, row0 = wg * 64 + warp * 16;  // this warp's first row within the CTA's block
    const BlockRange blocks = kv_block_range<BM, BN>(m0, seqlen_q, seqlen_k, causal);
    const int row_bytes = 2 * p.head_dim;

    load_rows_async<BM, 2 * D, THREADS>(sQ, reinterpret_cast<const unsigned char*>(p.q + b * p.q_b + h * p.q_h +
                                                                                   (i64)m0 * p.q_n),
                                        p.q_n * 2, seqlen_q - m0, row_bytes);
    load_rows_async<BM, 2 * D, THREADS>(sdO, reinterpret_cast<const unsigned char*>(p.dout + b * p.do_b +
                                                                                    h * p.do_h + (i64)m0 * p.do_n),
                                        p.do_n * 2, seqlen_q - m0, row_bytes);
    const auto* Kb = reinterpret_cast<const unsigned char*>(p.k + b * p.k_b + h_kv * p.k_h);
    const auto* Vb = reinterpret_cast<const unsigned char*>(p.v + b * p.v_b + h_kv * p.v_h);
    auto load_kv = [&](int j, int stage) {  // one cp.async group per K/V block (the first also carries Q_i, dO_i)
        load_rows_async<BN, 2 * D, THREADS>(sK(stage), Kb + (i64)j * BN * p.k_n * 2, p.k_n * 2, seqlen_k - j * BN,
                                            row_bytes);
        load_rows_async<BN, 2 * D, THREADS>(sV(stage), Vb + (i64)j * BN * p.v_n * 2, p.v_n * 2, seqlen_k - j * BN,
                                            row_bytes);
        cp_async_commit();
    };
    if (blocks.count() > 0) load_kv(blocks.begin, 0);
    else cp_async_commit();

    float lse2[2], delta[2];  // this thread's two rows: LSE in log2 units and D
    fragment_row_stats(p, b, h, m0 + row0, lse2, delta);

    float dq[1][DT][4] = {};
    for (int j = blocks.begin; j < blocks.end; ++j) {
        const int stage = (j - blocks.begin) % 2, key0 = j * BN;
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();  // K_j, V_j visible to the tensor cores; every warpgroup is done with block j-1
        if (j + 1 < blocks.end) load_kv(j + 1, stage ^ 1);

        // S = Q_wg K_j^T, then dP = dO_wg V_j^T: 64 queries x BN keys each, two commit groups
        float s[NT][4], dp[NT][4];
        wgmma_fence();
        wgmma_ss_abt<T, TQ, TKV, D>(s, sQ, wg * 64, sK(stage));
        wgmma_commit();
        wgmma_ss_abt<T, TQ, TKV, D>(dp, sdO, wg * 64, sV(stage));
        wgmma_commit();
        wgmma_wait<1>();  // S is in (dP may still run)
        hold_registers(s);

        // P in place (rows: queries, LSE per row), visible keys only, by select as in dkdv
        const int qw = m0 + row0;
        const bool edge = key0 + BN > seqlen_k || (causal && key0 + BN - 1 > qw + diag);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + nt * 8 + 2 * t + e % 2, query = qw + g + 8 * (e / 2);
                const float x = exp2f_approx(fmaf(s[nt][e], p.scale_log2, -lse2[e / 2]));
                s[nt][e] = !edge || (key < seqlen_k && !(causal && key > query + diag)) ? x : 0.f;
            }

        // dS = P * (dP - D[row]) in place, then dQ_i += dS K_j (K_j read N-major)
        wgmma_wait<0>();
        hold_registers(dp);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[nt][e] = s[nt][e] * (dp[nt][e] - delta[e / 2]);
        u32 a[NT / 2][4];
        repack_all<T>(a, dp);
        wgmma_fence();
        wgmma_rs_rows<T, TKV, D>(dq[0], a, sK(stage));
        wgmma_commit();
        wgmma_wait<0>();  // before the next barrier lets this stage be overwritten
        hold_registers(dq[0]);
    }
    cp_async_wait<0>();
    __syncthreads();  // every warpgroup is done with the tiles: the epilogue stages dQ over them

    // dQ = scale * dS K, staged through this warp's own 16 rows of shared memory for 16-byte stores
    const i64 ld = (i64)p.heads * p.head_dim;
    const float scale[1][2] = {{p.scale, p.scale}};
    store_acc_rows<T, D>(dq, scale, reinterpret_cast<u16*>(smem + (base - smem_u32(smem))) + row0 * Tile<16, D>::STRIDE,
                         p.dq + ((i64)b * seqlen_q + m0 + row0) * ld + (i64)h * p.head_dim, ld,
                         seqlen_q - m0 - row0, p.head_dim);
}
