// fa2_bwd.cu on Hopper's warpgroup MMA (sm_90a): the same deterministic FlashAttention-2 backward, as
// fa2_fwd_sm90.cu is fa2_fwd.cu. Pass 1 (D = rowsum(dO * O)) is fa2_bwd.cu's fa2_bwd_delta, launched as it is; the
// passes here change the matrix instruction and, with it, the unit of work:
//   dkdv  grid (K/V block j, kv head, batch): a warpgroup owns 64 keys of K_j, V_j (BN = 64 or 128: one or two
//         warpgroups) and their dK, dV in registers; loop over the group's query heads, head-major, and the Q blocks
//         of BM queries that see block j: S^T = K Q^T, P^T = exp2(S^T scale_log2 - LSE2[col]),
//         dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - D[col]), dK += dS^T Q. A 64 x BM accumulator has keys
//         as rows and queries as columns here, so LSE and D are per column (from shared memory). dkdv_block below
//         composes the parts in hopper/bwd_dkdv.cuh; the mask is hopper/bwd_mask.cuh's policy.
//   dq    grid (Q block i, head, batch): a warpgroup owns 64 query rows and their dQ; loop over the K/V blocks
//         i sees: S = Q K^T, P (LSE, D per row: registers), dP = dO V^T, dS, dQ += dS K.
//   the fused dQ (d = 64, 128: the default there): the dkdv pass also hands each K/V block's share dS_ij K_j to a
//         writer warpgroup, which adds it into an fp32 dQ sum in a fixed order (hopper/bwd_dq_writer.cuh):
//         fa2_bwd_fused_writer_sm90, then fa2_bwd_dq_convert, instead of the dq pass (5 products instead of 7).
// Operands: every tile ([row][d], 16-bit) sits in wgmma's 128-byte swizzled K-major layout (common/wgmma.cuh).
// The products whose reduction runs over d read them K-major (desc); the ones whose reduction runs over rows
// (queries for dV and dK, keys for dQ) read the same tile N-major (desc_mn, imm-trans-b), as the forward reads V.
// P^T and dS^T (dS) stay in registers as the A operand of the next product: repack_a turns accumulator columns
// 16k .. 16k + 15 into the A fragment of reduction step k (the forward's P V).
// Overlap inside a step: S^T and dP^T are issued together (two commit groups) so that the tensor cores run dP^T
// while the threads compute P^T; dV runs while they compute dS^T. Q/dO (dkdv) and K/V (dq) tiles are
// double-buffered with cp.async, one barrier per step.
// dkdv PIPE (the three passes' dK/dV pass at d 64 and 128; FA3's backward order): step s ends by issuing step
// s+1's S^T behind its own dV and dK wgmmas, then waits on all three, so the tensor cores go from dK_s straight
// into S^T_{s+1} across the barrier and the load of step s+2; step s+1 then opens with dP^T. Q/dO take three
// stages (the stage being loaded was last read by step s-1's wgmmas, which every warpgroup has waited on before
// the barrier), and the queries' LSE and D travel by cp.async with the tiles (the other steps load them with
// blocking loads: before S^T, or, LOAD_LATE, behind the step's first products). Past the last step the issue reads
// a zero-filled stage (no branch while dK is in flight).
// d = 256: a warpgroup's dK and dV of 64 keys would take 256 fp32 registers a thread, so the two gradients go to
// different warpgroups. SPLIT 2 (the default): one CTA of two warpgroups per 64 keys, warpgroup 0 computes S^T,
// P^T and dV and hands P^T (fp32, through shared memory) to warpgroup 1, which computes dP^T, dS^T and dK: the
// four products of the step, once each. SPLIT 1 (where shared memory is short of SPLIT 2's): the dkdv grid doubles,
// even CTAs compute dK only (S^T, dP^T, dK), odd ones dV only (S^T, dV), each recomputing S^T (1.25x the work).
// Tile parameters (kernels/fa2_bwd_sm90.py's tables; trailing template arguments at their defaults are left out of
// the instance names): dkdv BN = 64, 128 or 192 keys (one to three warpgroups), BM = 32, 64 or 128 queries per step
// (the N of S^T and dP^T), BM_DV the dV CTAs' BM where the d = 256 split gives them another (they hold no V, so
// their Q/dO stages take its place); dq BM = 64, 128 or 192 queries (one to three warpgroups), BN = 32, 64 or 128
// keys per step; MINB: the launch bounds' CTAs per SM (a register cap of 64K / (MINB x threads)); PIPE (dkdv) as
// above.
#include "hopper/bwd_dkdv.cuh"
#include "hopper/bwd_dq_writer.cuh"
#include "hopper/bwd_mask.cuh"
#include "hopper/bwd_operands.cuh"

namespace fav {

// One dK/dV CTA (C: a DkdvConfig): FA2's backward for K/V block j (the paper's Algorithm 2, its outer loop's
// body), each line one part of hopper/bwd_dkdv.cuh. FUSED: `order` is the Q blocks' sequence and `shares` the CTA's
// count of dQ shares handed to the writer (bwd_dq_writer.cuh).
template <class C>
__forceinline__ __device__ void dkdv_block(const BwdParams& p, int j, int h_kv, int b, DqOrder order = {},
                                           DqShares* shares = nullptr) {
    extern __shared__ unsigned char smem[];
    const DkdvCta<C> cta(p, smem, j, h_kv, b, order);
    const QSteps<C>& steps = cta.steps;
    // XCHG, FUSED: the next step's loads go behind this step's first products, whose issue they would delay (load_q
    // waits for its LSE/D loads to store them). PIPE's LSE/D go by cp.async.
    constexpr bool LOAD_LATE = C::XCHG || C::FUSED;

    load_kv(cta);  // K_j, V_j
    if (C::PIPE || steps.count > 0) load_q(cta, 0, QStep{0, 0}, 0);  // Q_i, dO_i, LSE_i, D_i of step 0
    else cp_async_commit();

    // dK_j = dV_j = 0; the step's S^T, dP^T, P^T, dS^T (PIPE: the last two apart from the first two)
    float dk[1][C::DT][4] = {}, dv[1][C::DT][4] = {};
    float st[C::NT][4], dpt[C::NT][4], own[C::PIPE ? 2 : 1][C::NT][4];
    u32 ads[C::NT / 2][4];
    const DkdvRegs<C> r{dk, dv, st, dpt, C::PIPE ? own[0] : st, C::PIPE ? own[C::PIPE ? 1 : 0] : dpt, ads};
    const PtExchange<C> xchg(smem, cta.smem.base);
    if constexpr (C::PIPE) {  // step 1's loads, step 0's S^T
        load_q(cta, 1, steps.after(QStep{0, 0}), 1);
        cp_async_wait<1>();
        fence_proxy_async();
        sync_cta<C>();  // step 0 visible to the tensor cores
        issue_st(cta, r, 0, true, false);
        wgmma_wait<0>();
    }
    // (the cursor alone is carried around the loop, not the step number too: one register more made ptxas spill in
    // the fused dQ's compute warps at d 64)
    for (QStep cur = steps.first(p.group); cur.hq < p.group; cur = steps.after(cur)) {
        const int s = steps.number(cur);
        const int stage = s % C::STAGES, m0 = steps.block(cur) * C::BM, h = h_kv * p.group + cur.hq;

        // S^T = K_j Q_i^T, dP^T = V_j dO_i^T
        if constexpr (C::PIPE) {  // S^T came in with the previous step's last wait
            hold_registers(r.st);
            issue_st(cta, r, stage, false, true);
        } else {
            cp_async_wait<0>();
            fence_proxy_async();
            sync_cta<C>();  // step s visible to the tensor cores; every warpgroup is done with step s-1's stage
            if (!LOAD_LATE && s + 1 < steps.count) load_q(cta, s + 1, steps.after(cur), stage ^ 1);
            if constexpr (C::FUSED)  // the writer has read share - 2 from the buffer this step's share will take
                DqBuffers<C::D, C::BN, C::BM>{cta.smem.base}.wait_free(shares->sent);
            // XCHG: S^T in the dV warpgroup, dP^T in the dK one behind it (barrier 5: S^T is issued), so that S^T,
            // whose P^T both warpgroups then wait for, comes out first
            if constexpr (C::XCHG && C::DK) named_sync(5, 256);
            issue_st(cta, r, stage, !(C::XCHG && C::DK), true);
            if constexpr (C::XCHG && C::DV) named_arrive(5, 256);
            if (LOAD_LATE && s + 1 < steps.count) load_q(cta, s + 1, steps.after(cur), stage ^ 1);
        }

        // P^T = exp2(S^T scale_log2 - LSE_i), masked (XCHG: the dK warpgroup takes the dV one's)
        const float* lse2 = cta.smem.stats + (2 * stage) * C::BM;
        const float* delta = lse2 + C::BM;
        if constexpr (C::XCHG && C::DK) {
            xchg.take(r.pt);
        } else {
            wgmma_wait<C::DK ? 1 : 0>();  // S^T is in (dP^T may still run)
            hold_registers(r.st);
            recompute_pt(cta, r, lse2, m0);
            if constexpr (C::XCHG) xchg.give(r.pt);
        }

        if constexpr (C::FUSED) {  // dV_j, dK_j as below, and dQ_i's share dS_ij K_j to the writer
            fused_dq_step(cta, r, *shares, order, stage, delta, h, m0 / C::BM);
            continue;
        }
        // dV_j += P^T dO_i
        if constexpr (C::DV) issue_dv(cta, r, stage);
        // dS^T = P^T o (dP^T - D_i), dK_j += dS^T Q_i
        if constexpr (C::DK) {
            wgmma_wait<C::DV ? 1 : 0>();  // dP^T is in (dV may still run)
            hold_registers(r.dpt);
            issue_dk(cta, r, stage, delta);
        }
        if constexpr (C::PIPE) {
            cp_async_wait<0>();
            fence_proxy_async();
            sync_cta<C>();  // step s+1 visible; every warpgroup has waited on step s-1's wgmmas (its stage is free)
            load_q(cta, s + 2, steps.after(steps.after(cur)), (s + 2) % C::STAGES);
            issue_st(cta, r, (s + 1) % C::STAGES, true, false);  // behind step s's dV, dK
        }
        // Before the next barrier lets this stage be overwritten. (PIPE: also S^T of step s+1; a wgmma in flight
        // across the loop's back edge would make ptxas serialize them, C7514.)
        wgmma_wait<0>();
        if constexpr (C::DK) hold_registers(r.dk[0]);  // (held, an unused accumulator would stay live)
        if constexpr (C::DV) hold_registers(r.dv[0]);
    }
    cp_async_wait<0>();
    sync_cta<C>();  // every warpgroup is done with the tiles (and K_j's copies have landed with no step to run)

    store_dkdv(cta, dk, dv);  // dK_j = scale * dS^T Q and dV_j, staged over this warp's rows of the tiles
}

}  // namespace fav

// SPLIT (d = 256) 1: blockIdx.x = 2 j + part, part 0 computes dK, part 1 dV (with BM_DV queries per step; when
// that differs from BM the dV part leaves V out of its shared memory). 2: warpgroup 0 of the CTA computes dV and
// P^T, warpgroup 1 dK (DkdvConfig's XCHG), on the same BN = 64 keys. PIPE: DkdvConfig's.
template <class T, int D, int BN, int SPLIT, int BM = 64, int MINB = 1, int BM_DV = BM, bool PIPE = false>
__global__ void __launch_bounds__((SPLIT == 2 ? 4 : 2) * BN, MINB)
fa2_bwd_dkdv_sm90(const fav::BwdParams p) {
    using namespace fav;
    static_assert(SPLIT == 1 || BM_DV == BM, "BM_DV is the CTA split's");
    // DkdvConfig<T, D, BN, BM, DK, DV, NO_V, PIPE, FUSED, XCHG>
    using Both = DkdvConfig<T, D, BN, BM, true, true, false, PIPE>;
    using DkCta = DkdvConfig<T, D, BN, BM, true, false, false, PIPE>;
    using DvCta = DkdvConfig<T, D, BN, BM_DV, false, true, (BM_DV != BM), PIPE>;
    using DvWarpgroup = DkdvConfig<T, D, BN, BM, false, true, false, false, false, true>;
    using DkWarpgroup = DkdvConfig<T, D, BN, BM, true, false, false, false, false, true>;
    if constexpr (SPLIT == 2) {
        if (threadIdx.x < 128) dkdv_block<DvWarpgroup>(p, blockIdx.x, blockIdx.y, blockIdx.z);  // S^T, P^T, dV
        else dkdv_block<DkWarpgroup>(p, blockIdx.x, blockIdx.y, blockIdx.z);                      // dP^T, dS^T, dK
    } else if constexpr (SPLIT == 1) {
        if (blockIdx.x % 2 == 0) dkdv_block<DkCta>(p, blockIdx.x / 2, blockIdx.y, blockIdx.z);
        else dkdv_block<DvCta>(p, blockIdx.x / 2, blockIdx.y, blockIdx.z);
    } else {
        dkdv_block<Both>(p, blockIdx.x, blockIdx.y, blockIdx.z);
    }
}

// The fused dQ (deterministic, two passes instead of three): a persistent grid of `groups` x n_kv CTAs, all
// resident at once (the launcher sizes it to the SMs), CTA (group, c) takes the role of K/V block j of every
// groups-th (batch, kv head) from `group` on, in DqOrder's order (fused_item_role). A CTA only ever waits for
// CTAs of its own head and group, which run beside it, for a share they add at an earlier step of theirs: no
// cycle. fa2_bwd_dq_convert then scales dQ into the input dtype.
namespace fav {
template <class T, int D, int BN, int BM>
__forceinline__ __device__ void fused_items(const BwdParams& p, int batch) {
    using C = DkdvConfig<T, D, BN, BM, true, true, false, false, true>;
    DqShares shares{0};
    for (ItemWalk<BN, BM> w(p, batch); w.more(); w.next()) {
        const FusedItemRole role = w.role(p);
        dkdv_block<C>(p, role.j, w.h_kv(), w.b(), role.order, &shares);
        // the epilogue staged dK, dV over K_j, V_j: done before the next item loads them
        named_sync(3, 2 * BN);
    }
    end_dq_shares<D, BN, BM>(shares);
}
}  // namespace fav

// The fused dQ's kernel (FA3's backward has such a writer): two compute warpgroups run fused_items, the third
// (dq_writer) takes the shares they leave in shared memory and adds them by bulk copies. The shares lie in fragment
// order there and in dq_acc (fa2_bwd_dq_convert's layout). Registers: 240 a compute thread, 24 a writer's.
template <class T, int D, int BN, int BM>
__global__ void __launch_bounds__(2 * BN + 128, 1)
fa2_bwd_fused_writer_sm90(const fav::BwdParams p, float* dq_acc, int* dq_counts, int batch) {
    using namespace fav;
    extern __shared__ unsigned char smem[];
    if (threadIdx.x == 0) {
        DqBuffers<D, BN, BM>{(smem_u32(smem) + 1023) & ~1023u}.init(2 * BN);
        fence_mbar_init();
    }
    __syncthreads();
    if (threadIdx.x < 2 * BN) {
        setmaxnreg_inc<240>();
        fused_items<T, D, BN, BM>(p, batch);
    } else {
        setmaxnreg_dec<24>();
        dq_writer<D, BN, BM>(dq_acc, dq_counts);
    }
}

// dQ = scale x the fused pass's fp32 sum, into q's layout (hopper/bwd_dq_writer.cuh's convert_dq_row). One thread
// per 8 columns of a row. FRAG names the sum's layout (true: the writer's fragment order, the only one).
template <class T, int D, int BN, int BM, bool FRAG>
__global__ void __launch_bounds__(256)
fa2_bwd_dq_convert(const fav::BwdParams p, const float* dq_acc) {
    static_assert(FRAG, "the writer's fragment order");
    fav::convert_dq_row<T, D, BN, BM>(p, blockIdx.z, blockIdx.y, blockIdx.x * 256 + threadIdx.x, dq_acc);
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
    const int wg = threadIdx.x / 128, warp = threadIdx.x / 32 % 4;
    const BwdMask mask(p);
    const int seqlen_q = mask.seqlen_q, seqlen_k = mask.seqlen_k;
    const int m0 = i_block * BM, row0 = wg * 64 + warp * 16;  // this warp's first row within the CTA's block
    const BlockRange blocks = mask.kv_blocks<BM, BN>(m0);
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

        // P in place (rows: queries, LSE per row), visible keys only: the mask's test on its fields, with keys as
        // columns (written out here, see BwdMask::apply_key_rows), only in a warp whose block crosses an edge
        const int qw = m0 + row0, g = mask.g, t = mask.t;
        const bool edge = key0 + BN > seqlen_k || (mask.causal && key0 + BN - 1 > qw + mask.diag);
        if (edge) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = key0 + nt * 8 + 2 * t + e % 2, query = qw + g + 8 * (e / 2);
                    const float x = exp2f_approx(fmaf(s[nt][e], p.scale_log2, -lse2[e / 2]));
                    s[nt][e] = key < seqlen_k && !(mask.causal && key > query + mask.diag) ? x : 0.f;
                }
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nt][e] = exp2f_approx(fmaf(s[nt][e], p.scale_log2, -lse2[e / 2]));
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
