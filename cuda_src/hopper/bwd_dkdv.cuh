// The parts of the Hopper backward's dK/dV pass (fa2_bwd_sm90.cu's dkdv_block composes them into FA2's backward
// loop): a CTA owns K/V block j and steps over the (query head, Q block) pairs that see it. Per step, in registers
// with keys as rows and queries as columns (a warpgroup's 64 keys x BM queries):
//   loads       Q_i, dO_i and the queries' LSE and D into a stage of shared memory (cp.async; K_j, V_j once)
//   products    S^T = K_j Q_i^T and dP^T = V_j dO_i^T on the tensor cores (wgmma, one commit group each)
//   P^T         exp2(S^T scale_log2 - LSE[query]) where the key sees the query, else 0 (BwdMask)
//   dV          dV_j += P^T dO_i, P^T repacked as the A operand from registers
//   dS^T, dK    dS^T = P^T o (dP^T - D[query]), dK_j += dS^T Q_i
// and what they share: the template arguments (DkdvConfig), the shared memory (DkdvSmem, DkdvTiles), where a warp
// stands (DkdvCta) and the steps it takes (QSteps, in DqOrder's order for the fused dQ). The fused dQ's share of
// each step (dS_ij K_j for the writer warpgroup) is bwd_dq_writer.cuh's; dK_j and dV_j go out in dkdv_block.
// Where a value is formed and which function a line sits in decide what NVVM and ptxas make of the kernel; the
// parts keep the lines of the measured kernel together as they were (docs/kernels/fa2_bwd.md).
#pragma once
#include "../common/backward.cuh"
#include "../common/epilogue.cuh"
#include "../common/tma.cuh"
#include "bwd_mask.cuh"
#include "bwd_operands.cuh"

namespace fav {

// A dK/dV CTA's shared memory, byte offsets from its 1024-aligned base: K_j, V_j (NO_V: K_j only), STAGES of (Q_i,
// dO_i), STAGES of the queries' LSE and D, then (FUSED) dS^T and the writer's two shares of both halves (64 x 64
// fp32 each) with their full and empty mbarriers.
template <int D, int BN, int BM, int STAGES, bool NO_V>
struct DkdvSmem {
    static constexpr u32 KV = (NO_V ? 1 : 2) * SwizzledTile<BN, 2 * D>::BYTES;
    static constexpr u32 QDO = 2 * SwizzledTile<BM, 2 * D>::BYTES;  // a stage of (Q_i, dO_i), from KV on
    static constexpr u32 STATS = KV + STAGES * QDO;
    // DS: dS^T for the fused dQ, or (XCHG) the step's P^T, 64 x BM fp32 in fragment order
    static constexpr u32 DS = STATS + ((STAGES * 2 * BM * 4 + 1023) & ~1023);
    static constexpr u32 DQ = DS + SwizzledTile<BN, 2 * BM>::BYTES;
    // FUSED: full(k) at DQ_BARS + 8k, empty(k) at + 16; the slots (a share's Q block and rank, two ints) at
    // DQ_SLOTS + 8k, ending 16 bytes on (kernels/fa2_bwd_sm90.py's fused_smem counts them)
    static constexpr u32 HALF = 64 * 64 * 4, DQ_BARS = DQ + 2 * 2 * HALF, DQ_SLOTS = DQ_BARS + 32;
};

// A dK/dV CTA's template arguments and what follows from them: K/V block j of BN keys (64 per warpgroup), BM
// queries per step. DK, DV: which gradients it computes (both, or one each at d = 256). NO_V (dV only): V gets no
// shared memory, the Q/dO stages start where it would. PIPE: step s+1's S^T issued before step s's dV/dK are
// waited on (fa2_bwd_sm90.cu's header). FUSED: each step's share of dQ goes to a writer warpgroup
// (bwd_dq_writer.cuh). XCHG (d = 256): one warpgroup of a CTA of two on the same 64 keys, with the other's
// gradient: the dV one (warpgroup 0) computes P^T and leaves it in shared memory, the dK one takes it from there
// instead of computing S^T. P_: the parameters a work item sees, BwdParams, or fa3's masked backward's BwdSequence
// (one sequence of a masked call: AttnMask, MASKED).
template <class T_, int D_, int BN_, int BM_, bool DK_, bool DV_, bool NO_V_ = false, bool PIPE_ = false,
          bool FUSED_ = false, bool XCHG_ = false, class P_ = BwdParams>
struct DkdvConfig {
    using T = T_;
    using Params = P_;
    using Mask = typename BwdMaskOf<P_>::type;
    static constexpr bool MASKED = Mask::TRANSFORMS;
    static constexpr int D = D_, BN = BN_, BM = BM_;
    static constexpr bool DK = DK_, DV = DV_, NO_V = NO_V_, PIPE = PIPE_, FUSED = FUSED_, XCHG = XCHG_;
    static constexpr int THREADS = XCHG ? 256 : 2 * BN, NT = BM / 8, DT = D / 8, STAGES = PIPE ? 3 : 2;
    using TQ = SwizzledTile<BM, 2 * D>;   // Q_i, dO_i [query][d]: K-major B of S^T, dP^T; N-major B of dK, dV
    using TKV = SwizzledTile<BN, 2 * D>;  // K_j, V_j [key][d]: K-major A of S^T, dP^T; N-major B of dQ (FUSED)
    using TdS = SwizzledTile<BN, 2 * BM>; // dS^T [key][query] (FUSED): the MN-major A of dQ = dS K
    using Smem = DkdvSmem<D, BN, BM, STAGES, NO_V>;
    static_assert((BN == 64 || BN == 128 || BN == 192) && (D == 64 || D == 128 || D == 256), "1-3 warpgroups");
    static_assert(BM == 32 || BM == 64 || BM == 128, "wgmma n32 / n64 / n128 blocks");
    static_assert(!(NO_V && DK), "dK needs V (dP^T)");
    static_assert(!XCHG || (BN == 64 && DK != DV && !NO_V && !PIPE && !FUSED), "a warpgroup per gradient");
    static_assert(!PIPE || BN <= 128, "PIPE's loads are branch-free for <= 256 threads");
    // FUSED: the two warpgroups split dQ_i (BM x D) in halves of 64 x 64: by rows at BM 128, by columns at BM 64
    static_assert(!FUSED || (DK && DV && !PIPE && BN == 128 && BM * D == 128 * 64),
                  "fused dQ: 128 x 64 or 64 x 128");
};

// FUSED: the order in which the dK/dV CTAs of one (batch, kv head) add their shares dS_ij K_j into dQ_i. It is
// fixed, so the sum is the same bit for bit on every run, and it is the order in which the shares arrive when the
// n_kv CTAs of a head run side by side (fa2_bwd_fused_writer_sm90's grid: one CTA per K/V block j, every head's
// CTAs resident at once), so that a CTA rarely waits for its turn:
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
    int i_lo;    // ROTATED: the first Q block, j n_q / n_kv (divided once, not at every step)
    int c0, c1;  // (rank_in) the K/V blocks [c0, c1) of j's chunk; 0, 0 for rank
    __forceinline__ __device__ int block(int k) const {  // the Q block of this CTA's k-th step of a query head
        if (mode == UP) return i_first + k;
        if (mode == DOWN) return n_q - 1 - k;
        const int i = i_lo + k;
        return i < n_q ? i : i - n_q;
    }
    template <int BM, int BN>  // BN: the keys of one contributor (a CTA's block)
    __forceinline__ __device__ int rank(int i, int seqlen_q, int seqlen_k) const {
        if (mode == UP) return kv_block_range<BM, BN>(i * BM, seqlen_q, seqlen_k, true).end - 1 - j;
        if (mode == DOWN) return j;
        const int t = ((i + 1) * n_kv - 1) / n_q - j;
        return t < 0 ? t + n_kv : t;
    }
    // fa3's masked backward's: the same in the K/V blocks of one chunk [c0, c1) of a sequence's blocks (a sequence
    // of more blocks than the grid has columns is walked a chunk at a time, in order), after the shares of the
    // chunks before it. UP and DOWN count from the blocks Q block i sees, under any mask whose blocks form a band
    // (a window, causal or not); n_q is then one past the last Q block j sees, where DOWN starts. ROTATED (a full
    // mask, every block seen) rotates over the chunk's n_kv blocks.
    template <int BM, int BN, class Mask>
    __forceinline__ __device__ int rank_in(int i, const Mask& mask) const {
        if (mode == ROTATED) {
            const int t = ((i + 1) * n_kv - 1) / n_q - (j - c0);
            return c0 + (t < 0 ? t + n_kv : t);
        }
        const BlockRange seen = mask.template kv_blocks<BM, BN>(i * BM);
        const int before = max(0, min(seen.end, c0) - seen.begin);
        return before + (mode == UP ? min(seen.end, c1) - 1 - j : j - max(seen.begin, c0));
    }
};

// A step's query head (hq: h_kv's hq-th) and k-th Q block of that head.
struct QStep {
    int hq, k;
};

// The steps of a dK/dV CTA: for each query head of the kv head's group (head-major), the n_i Q blocks that see
// block j, from i_first on (FUSED: in DqOrder's sequence). A cursor is advanced one step at a time rather than
// divided out of the step number (a division by n_i at every step is a cost the compute warps would see).
template <class C>
struct QSteps {
    DqOrder order;
    int i_first, n_i, count;  // the first Q block; Q blocks per query head that see block j; steps in all
    template <class Mask>
    __forceinline__ __device__ QSteps(const BwdParams& p, const Mask& mask, int key0, const DqOrder& order)
        : order(order), i_first(C::FUSED ? order.i_first : mask.template q_blocks<C::BM, C::BN>(key0).begin),
          n_i(max(0, mask.template q_blocks<C::BM, C::BN>(key0).end - i_first)), count(p.group * n_i) {}
    __forceinline__ __device__ QStep first(int group) const { return QStep{n_i > 0 ? 0 : group, 0}; }
    __forceinline__ __device__ QStep after(QStep c) const {
        return c.k + 1 < n_i ? QStep{c.hq, c.k + 1} : QStep{c.hq + 1, 0};
    }
    __forceinline__ __device__ int number(QStep c) const { return c.hq * n_i + c.k; }
    __forceinline__ __device__ int block(QStep c) const { return C::FUSED ? order.block(c.k) : i_first + c.k; }
};

// The addresses of a dK/dV CTA's shared memory (DkdvSmem; 1024-byte aligned for the swizzle). The queries' LSE
// are in log2 units (PIPE: as stored, scaled at use).
template <class C>
struct DkdvTiles {
    u32 base;      // the first 1024-aligned byte of the dynamic shared memory (shared-window address)
    float* stats;  // STAGES x (LSE of BM queries, D of BM queries)
    u32 ds, dq;    // dS^T (XCHG: P^T); the fused dQ's share buffers
    __forceinline__ __device__ explicit DkdvTiles(unsigned char* smem)
        : base((smem_u32(smem) + 1023) & ~1023u),
          stats(reinterpret_cast<float*>(smem + (base - smem_u32(smem)) + C::Smem::STATS)), ds(base + C::Smem::DS),
          dq(base + C::Smem::DQ) {}
    __forceinline__ __device__ u32 k() const { return base; }
    __forceinline__ __device__ u32 v() const { return base + C::TKV::BYTES; }
    __forceinline__ __device__ u32 q(int stage) const { return base + C::Smem::KV + stage * C::Smem::QDO; }
    __forceinline__ __device__ u32 dout(int stage) const { return q(stage) + C::TQ::BYTES; }
};

// Where a warp of a dK/dV CTA stands: the problem, its shared memory, its (batch, kv head, K/V block), its
// warpgroup and warp, the mask as its threads see it, its keys, and the steps it takes. (The members are computed
// in the order they are declared, which is the order the kernel's instructions were measured with.)
template <class C>
struct DkdvCta {
    const typename C::Params& p;
    DkdvTiles<C> smem;
    int b, h_kv;
    int wg, warp;       // this warpgroup of the CTA, this warp of the warpgroup
    typename C::Mask mask;  // (MASKED: of the kv head's first query head)
    int kw0;            // this warpgroup's first key of the block (XCHG: both take all 64)
    int key0, kr0;      // the block's first key; this warp's first row of it
    QSteps<C> steps;
    int row_bytes;      // bytes of a head_dim row (columns past it are zero-filled)
    __forceinline__ __device__ DkdvCta(const typename C::Params& p, unsigned char* shared, int j, int h_kv, int b,
                                       const DqOrder& order)
        : p(p), smem(shared), b(b), h_kv(h_kv), wg(threadIdx.x / 128), warp(threadIdx.x / 32 % 4),
          mask(p, h_kv * p.group),
          kw0(C::XCHG ? 0 : wg * 64), key0(j * C::BN), kr0(kw0 + warp * 16), steps(p, mask, key0, order),
          row_bytes(2 * p.head_dim) {}
};

// The CTA's barrier among the threads that run this pass: FUSED leaves out the writer warpgroup, and XCHG's two
// warpgroups run different instances of dkdv_block; both meet at barrier 3.
template <class C>
__forceinline__ __device__ void sync_cta() {
    if constexpr (C::FUSED || C::XCHG) named_sync(3, C::THREADS);
    else __syncthreads();
}

// ---------------------------------------------------------------------------------------------------- loads
// K_j and, where dP^T needs it, V_j (XCHG: each warpgroup copies its share of both tiles).
template <class C>
__forceinline__ __device__ void load_kv(const DkdvCta<C>& cta) {
    const BwdParams& p = cta.p;
    load_rows_async<C::BN, 2 * C::D, C::THREADS>(
        cta.smem.k(), reinterpret_cast<const unsigned char*>(p.k + cta.b * p.k_b + cta.h_kv * p.k_h +
                                                             (i64)cta.key0 * p.k_n),
        p.k_n * 2, cta.mask.seqlen_k - cta.key0, cta.row_bytes);
    if constexpr (C::DK || C::XCHG)
        load_rows_async<C::BN, 2 * C::D, C::THREADS>(
            cta.smem.v(), reinterpret_cast<const unsigned char*>(p.v + cta.b * p.v_b + cta.h_kv * p.v_h +
                                                                 (i64)cta.key0 * p.v_n),
            p.v_n * 2, cta.mask.seqlen_k - cta.key0, cta.row_bytes);
}

// Step `step` (cursor c)'s Q_i, dO_i and its queries' LSE and D into `stage`: one cp.async group (the first also
// carries K_j, V_j). PIPE loads every step number it is given: a step past the last one is all zero-fill (no
// reads), and its LSE and D travel by cp.async with the tiles; the other steps load them with blocking loads and
// store them themselves.
template <class C>
__forceinline__ __device__ void load_q(const DkdvCta<C>& cta, int step, QStep c, int stage) {
    const BwdParams& p = cta.p;
    const QSteps<C>& steps = cta.steps;
    const bool live = !C::PIPE || step < steps.count;
    const int h = cta.h_kv * p.group + (live ? c.hq : 0), m0 = (live ? steps.block(c) : steps.i_first) * C::BM;
    const int rows = live ? cta.mask.seqlen_q - m0 : 0;
    load_rows_async<C::BM, 2 * C::D, C::THREADS>(cta.smem.q(stage),
                                                 reinterpret_cast<const unsigned char*>(p.q + cta.b * p.q_b +
                                                                                        h * p.q_h +
                                                                                        (i64)m0 * p.q_n),
                                                 p.q_n * 2, rows, cta.row_bytes);
    load_rows_async<C::BM, 2 * C::D, C::THREADS>(cta.smem.dout(stage),
                                                 reinterpret_cast<const unsigned char*>(p.dout + cta.b * p.do_b +
                                                                                        h * p.do_h +
                                                                                        (i64)m0 * p.do_n),
                                                 p.do_n * 2, rows, cta.row_bytes);
    if constexpr (C::PIPE) {
        // Queries past seqlen_q get LSE = D = 0: their Q and dO rows are zero, so S^T = 0, P^T = 1, dP^T = 0,
        // and they add P^T x 0 to dV and 1 x (0 - 0) x 0 to dK.
        const int r = threadIdx.x;
        const i64 at = ((i64)cta.b * p.heads + h) * cta.mask.seqlen_q + m0 + r;
        const bool ok = r < rows;
        if (r < C::BM) {  // (predicated: BM <= THREADS)
            cp_async_4(smem_u32(cta.smem.stats + (2 * stage) * C::BM + r), ok ? p.lse + at : p.lse, ok);
            cp_async_4(smem_u32(cta.smem.stats + (2 * stage + 1) * C::BM + r), ok ? p.delta + at : p.delta, ok);
        }
        cp_async_commit();
    } else {
        cp_async_commit();
        for (int r = threadIdx.x; r < C::BM; r += C::THREADS) {
            const RowStats st = row_stats(p, cta.b, h, m0 + r);
            cta.smem.stats[(2 * stage) * C::BM + r] = st.lse2;
            cta.smem.stats[(2 * stage + 1) * C::BM + r] = st.delta;
        }
    }
}

// ---------------------------------------------------------------------------------------------------- registers
// A warp's registers, as the parts below name them: its 16 keys' rows of dK_j and dV_j (rows 16 warp + g, + 8 of the
// warpgroup; D columns), the step's S^T, dP^T, P^T and dS^T (64 keys x BM queries each: 8 BM / 8 = NT fragments of
// 4), and dS^T as 16-bit A fragments (FUSED: also stored for dQ). dkdv_block declares the arrays (where they are
// declared decides what ptxas makes of them) and hands the parts this view of them. PIPE gives P^T and dS^T
// arrays of their own; elsewhere they overwrite S^T and dP^T.
template <class C>
struct DkdvRegs {
    using Acc = float[1][C::DT][4];
    using Frag = float[C::NT][4];
    Acc& dk;
    Acc& dv;
    Frag& st;
    Frag& dpt;
    Frag& pt;
    Frag& dst;
    u32 (&ads)[C::NT / 2][4];
};

// ---------------------------------------------------------------------------------------------------- products
// S^T = K_wg Q_i^T (with_st), dP^T = V_wg dO_i^T (with_dp, DK only): one commit group each.
template <class C>
__forceinline__ __device__ void issue_st(const DkdvCta<C>& cta, const DkdvRegs<C>& r, int stage, bool with_st,
                                         bool with_dp) {
    using T = typename C::T;
    wgmma_fence();
    if (with_st) {
        wgmma_ss_abt<T, typename C::TKV, typename C::TQ, C::D>(r.st, cta.smem.k(), cta.kw0, cta.smem.q(stage));
        wgmma_commit();
    }
    if (C::DK && with_dp) {
        wgmma_ss_abt<T, typename C::TKV, typename C::TQ, C::D>(r.dpt, cta.smem.v(), cta.kw0, cta.smem.dout(stage));
        wgmma_commit();
    }
}

// P^T: element (key row, query col) = exp2(S^T scale_log2 - LSE2[query]) where the key sees the query, else 0
// (BwdMask::apply_key_rows).
template <class C>
__forceinline__ __device__ void recompute_pt(const DkdvCta<C>& cta, const DkdvRegs<C>& r, const float* lse2, int m0) {
    cta.mask.apply_key_rows(r.pt, cta.key0 + cta.kr0, m0, [&](int nt, int e, int col) {
        const float l2 = C::PIPE ? lse2[col] * -LOG2E : -lse2[col];  // (load_q's product, negated)
        return exp2f_approx(fmaf(r.st[nt][e], cta.p.scale_log2, l2));
    });
}

// dV_j += P^T dO_i: P^T from the registers (reduction index: the queries), dO_i read N-major.
template <class C>
__forceinline__ __device__ void issue_dv(const DkdvCta<C>& cta, const DkdvRegs<C>& r, int stage) {
    u32 a[C::NT / 2][4];
    repack_all<typename C::T>(a, r.pt);
    wgmma_fence();
    wgmma_rs_rows<typename C::T, typename C::TQ, C::D>(r.dv[0], a, cta.smem.dout(stage));
    wgmma_commit();
}

// dS^T = P^T o (dP^T - D[query]), then dK_j += dS^T Q_i (Q_i read N-major). chain(dS^T): the logit transforms'
// chain rule, where the mask has transforms (StepMask::chain).
template <class C, class Chain>
__forceinline__ __device__ void issue_dk(const DkdvCta<C>& cta, const DkdvRegs<C>& r, int stage, const float* delta,
                                         const Chain& chain) {
    const int t = cta.mask.t;
#pragma unroll
    for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) r.dst[nt][e] = r.pt[nt][e] * (r.dpt[nt][e] - delta[nt * 8 + 2 * t + e % 2]);
    chain(r.dst);
    repack_all<typename C::T>(r.ads, r.dst);
    wgmma_fence();
    wgmma_rs_rows<typename C::T, typename C::TQ, C::D>(r.dk[0], r.ads, cta.smem.q(stage));
    wgmma_commit();
}
template <class C>
__forceinline__ __device__ void issue_dk(const DkdvCta<C>& cta, const DkdvRegs<C>& r, int stage, const float* delta) {
    issue_dk(cta, r, stage, delta, [](float(&)[C::NT][4]) {});
}

// ---------------------------------------------------------------------------------------------------- epilogue
// dK_j = scale * dS^T Q and dV_j, each staged through shared memory (this warp's own 16 rows of the K_j and V_j
// tiles, which every warpgroup must be done with) for 16-byte stores into contiguous (batch, seqlen_k, heads_kv,
// head_dim) gradients.
template <class C>
__forceinline__ __device__ void store_dkdv(const DkdvCta<C>& cta, const float (&dk)[1][C::DT][4],
                                           const float (&dv)[1][C::DT][4]) {
    extern __shared__ unsigned char smem[];
    const BwdParams& p = cta.p;
    const int heads_kv = p.heads / p.group, key0 = cta.key0, kr0 = cta.kr0, seqlen_k = cta.mask.seqlen_k;
    const i64 ld = (i64)heads_kv * p.head_dim;
    const i64 at = ((i64)cta.b * seqlen_k + key0 + kr0) * ld + (i64)cta.h_kv * p.head_dim;
    u16* stage_k = reinterpret_cast<u16*>(smem + (cta.smem.base - smem_u32(smem))) + kr0 * Tile<16, C::D>::STRIDE;
    u16* stage_v = stage_k + C::BN * Tile<16, C::D>::STRIDE;
    if constexpr (C::DK) {
        const float scale[1][2] = {{p.scale, p.scale}};
        store_acc_rows<typename C::T, C::D>(dk, scale, stage_k, p.dk + at, ld, seqlen_k - key0 - kr0, p.head_dim);
    }
    if constexpr (C::DV) {
        const float one[1][2] = {{1.f, 1.f}};
        store_acc_rows<typename C::T, C::D>(dv, one, stage_v, p.dv + at, ld, seqlen_k - key0 - kr0, p.head_dim);
    }
}

// XCHG: P^T from the dV warpgroup to the dK one, in fragment order (thread x's float4 of column block nt at
// (nt * 128 + x) * 16 bytes: the same thread of the other warpgroup holds the same keys and queries). One buffer
// is enough: it is written again only after the next step's CTA barrier, which the reader passes after reading.
// Barrier 4: P^T is in.
template <class C>
struct PtExchange {
    float4* px;
    // (smem: the dynamic shared memory, base: DkdvTiles' base; the address formed here, not from DkdvTiles::ptr,
    // keeps the kernel's instructions as they were measured)
    __forceinline__ __device__ PtExchange(unsigned char* smem, u32 base)
        : px(reinterpret_cast<float4*>(smem + (base - smem_u32(smem)) + C::Smem::DS) + threadIdx.x % 128) {}
    __forceinline__ __device__ void give(const float (&pt)[C::NT][4]) const {
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt) px[nt * 128] = make_float4(pt[nt][0], pt[nt][1], pt[nt][2], pt[nt][3]);
        named_arrive(4, 256);
    }
    __forceinline__ __device__ void take(float (&pt)[C::NT][4]) const {
        named_sync(4, 256);
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt) {
            const float4 v = px[nt * 128];
            pt[nt][0] = v.x, pt[nt][1] = v.y, pt[nt][2] = v.z, pt[nt][3] = v.w;
        }
    }
};

}  // namespace fav
