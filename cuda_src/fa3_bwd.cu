// FlashAttention-3's backward (Shah et al., 2024, sec. 3.3 and Appendix B) on Hopper (sm_90a): fa2_bwd_sm90.cu's
// fused-dQ kernel (K/V-block parallel, dK and dV in registers, dQ's shares added by a writer warpgroup in a fixed
// order) with FA3's warp specialization of the loads, composed from the same parts (hopper/bwd_*.cuh). Read beside
// fa2_bwd_sm90.cu's fa2_bwd_fused_writer_sm90; what changes:
//   producer   one warp of the third warpgroup (hopper/bwd_producer.cuh) loads K_j, V_j once per work item and each
//              step's Q_i, dO_i by TMA, and the step's LSE and D by its lanes, into a ring of two stages with full
//              and empty mbarriers; the compute warpgroups issue no loads and never wait on a memory access of
//              their own: a step starts once its stage is full, and a warp frees the stage once its last wgmma
//              of the step has read it (fa2's kernel: cp.async copies and blocking LSE/D loads by the compute
//              threads, and a CTA barrier per step for them to land).
//   writer     the other warps of that warpgroup: the fused dQ's writer as in fa2 (hopper/bwd_dq_writer.cuh).
// Per step, each compute warpgroup on its 64 keys of K/V block j (the paper's Algorithm 2 body with dQ's share):
// S^T = K_j Q_i^T and dP^T = V_j dO_i^T (two commit groups), P^T = exp2(S^T scale_log2 - LSE_i) under the mask,
// dV_j += P^T dO_i, dS^T = P^T o (dP^T - D_i), dK_j += dS^T Q_i, dS^T to shared memory, then dQ_i's share
// dS_ij K_j (both warpgroups' keys) to the writer. dQ is the writer's fp32 sum, scaled into dq by
// fa2_bwd_dq_convert; the queries' LSE and D = rowsum(dO o O) come from fa3_bwd_stats before (kernels/fa3_bwd.py
// launches the three).
// BN = 128 keys per CTA (two compute warpgroups of 64), BM queries per step: 128 at d 64, 64 at d 128.
#include "hopper/bwd_producer.cuh"

namespace fav {

// One work item of a compute warpgroup: K/V block j of (batch b, kv head h_kv), the m-th item the CTA runs;
// shares counts the CTA's steps so far (each step hands one share to the writer), which is also the ring position.
// MASKED: p is the item's sequence (BwdSequence), P^T is the step's query head's (its ALiBi slope), and dS^T takes
// the softcap's chain rule.
template <class C>
__forceinline__ __device__ void fa3_dkdv_block(const typename C::Params& p, int j, int h_kv, int b,
                                               const DqOrder& order, DqShares& shares, int m) {
    extern __shared__ unsigned char smem[];
    const DkdvCta<C> cta(p, smem, j, h_kv, b, order);
    const QSteps<C>& steps = cta.steps;
    const BwdRing<C> ring(cta.smem.base);
    const DqBuffers<C::D, C::BN, C::BM> bufs{cta.smem.base};
    const bool leader = threadIdx.x % 32 == 0;  // arrives on the empty barriers for its warp

    float dk[1][C::DT][4] = {}, dv[1][C::DT][4] = {};
    float st[C::NT][4], dpt[C::NT][4];  // S^T, then P^T in place; dP^T, then dS^T in place
    u32 ads[C::NT / 2][4];
    const DkdvRegs<C> r{dk, dv, st, dpt, st, dpt, ads};

    mbar_wait(ring.kv_full(), m & 1);  // K_j, V_j
    for (QStep cur = steps.first(p.group); cur.hq < p.group; cur = steps.after(cur)) {
        const int g = shares.sent, stage = ring.stage(g);
        const int m0 = steps.block(cur) * C::BM, h = h_kv * p.group + cur.hq;
        mbar_wait(ring.full(stage), ring.phase(g));  // Q_i, dO_i, LSE_i, D_i
        sync_cta<C>();      // both warpgroups' shares of the last step have read dS^T
        bufs.wait_free(g);  // the writer has read share g - 2 from the buffer this step's share will take

        // S^T = K_j Q_i^T, dP^T = V_j dO_i^T
        issue_st(cta, r, stage, true, true);
        // P^T = exp2(S^T scale_log2 - LSE_i), masked
        const float* lse2 = cta.smem.stats + 2 * stage * C::BM;
        wgmma_wait<1>();  // S^T is in (dP^T may still run)
        hold_registers(r.st);
        // dV_j, dS^T, dK_j, and dQ_i's share dS_ij K_j to the writer
        if constexpr (C::MASKED) {
            const BwdAttnMask mask = cta.mask.for_head(p, h);
            const int kw = cta.key0 + cta.kr0;
            mask.p_key_rows(r.pt, r.st, kw, m0, lse2, p.scale_log2);
            fused_dq_step(cta, r, shares, order, stage, lse2 + C::BM, h, m0 / C::BM,
                          [&](float (&ds)[C::NT][4]) { mask.ds_key_rows(ds, r.pt, kw, m0, lse2, p.scale_log2); });
        } else {
            recompute_pt(cta, r, lse2, m0);
            fused_dq_step(cta, r, shares, order, stage, lse2 + C::BM, h, m0 / C::BM);
        }
        mbar_arrive_if(ring.empty(stage), leader);  // this warp's wgmmas of the step are done with the stage
    }
    sync_cta<C>();  // every warpgroup is done with K_j, V_j: the epilogue stages dK, dV over them
    store_dkdv(cta, dk, dv);
    fence_proxy_async();  // the staging's stores before the next item's TMA loads over them
    mbar_arrive_if(ring.kv_empty(), leader);
}

// The compute warpgroups' walk over the CTA's work items (ItemWalk, as fa2_bwd_sm90.cu's fused_items; MASKED:
// SequenceWalk, as the producer's).
template <class C, class P>
__forceinline__ __device__ void fa3_bwd_items(const P& p, int batch) {
    DqShares shares{0};
    for (typename WalkOf<typename C::Params, C::BN, C::BM>::type w(p, batch); w.more(); w.next()) {
        const FusedItemRole role = w.role(p);
        fa3_dkdv_block<C>(w.view(p), role.j, w.h_kv(), w.view_b(), role.order, shares, w.runs());
    }
    end_dq_shares<C::D, C::BN, C::BM>(shares);
}

// A CTA of the backward: its roles (below), each its own branch after its setmaxnreg.
template <class C, bool ORDERED, class P>
__forceinline__ __device__ void fa3_bwd_cta(const TmaDesc& tq, const TmaDesc& tdo, const TmaDesc& tk,
                                            const TmaDesc& tv, const P& p, const float* stats, float* dq_acc,
                                            int* dq_counts, int batch) {
    extern __shared__ unsigned char smem[];
    if (threadIdx.x == 0) {
        const u32 base = (smem_u32(smem) + 1023) & ~1023u;
        DqBuffers<C::D, C::BN, C::BM>{base}.init(2 * C::BN);
        BwdRing<C>(base).init();
        fence_mbar_init();
    }
    __syncthreads();
    if (threadIdx.x < 2 * C::BN) {
        setmaxnreg_inc<240>();
        fa3_bwd_items<C>(p, batch);
    } else if (threadIdx.x / 32 % 4 == 2) {
        setmaxnreg_dec<24>();
        bwd_producer<C>(p, tq, tdo, tk, tv, stats, batch);
    } else {
        setmaxnreg_dec<24>();
        dq_writer<C::D, C::BN, C::BM, ORDERED>(dq_acc, dq_counts);
    }
}

// The producer's stats of query row i of head h (FA3's preprocessing): in Q block i / BM's (dq_block's numbering),
// its LSE in log2 units, then its D = rowsum(dO o O), so that a step's stats are one bulk copy; rows past seqlen_q
// (up to the block's end) get LSE +inf and D 0 (their P is 0). One warp per row.
template <class T, int BM, class P>
__forceinline__ __device__ void stats_row(const P& p, int b, int h, int i, float* stats) {
    const int lane = threadIdx.x % 32;
    const float delta = i < p.seqlen_q ? row_delta<T>(p, b, h, i, lane) : 0.f;
    if (lane == 0) {
        float* block = stats + (i64)dq_block<BM>(p, b, h, i / BM) * 2 * BM;
        block[i % BM] = row_lse2(p, b, h, i);
        block[BM + i % BM] = delta;
    }
}

}  // namespace fav

// A persistent grid of groups x n_kv CTAs, all resident at once (kernels/fa3_bwd.py sizes it to the SMs), as
// fa2_bwd_fused_writer_sm90's. ORDERED (deterministic): dQ's shares are added in DqOrder's fixed order; else as
// they come, into a zeroed sum (bwd_dq_writer.cuh's dq_writer). Warpgroups 0 and 1 compute (240 registers a thread); warpgroup 2 holds the writer
// (lane 0 of warps 0 and 1) and the producer (warp 2) at 24. Tensor maps: q, dout (boxes of BM rows), k, v
// (BN rows); stats: fa3_bwd_stats's.
template <class T, int D, int BN, int BM, bool ORDERED = true>
__global__ void __launch_bounds__(2 * BN + 128, 1)
fa3_bwd(const __grid_constant__ fav::TmaDesc tq, const __grid_constant__ fav::TmaDesc tdo,
        const __grid_constant__ fav::TmaDesc tk, const __grid_constant__ fav::TmaDesc tv, const fav::BwdParams p,
        const float* stats, float* dq_acc, int* dq_counts, int batch) {
    using C = fav::DkdvConfig<T, D, BN, BM, true, true, false, false, true>;
    fav::fa3_bwd_cta<C, ORDERED>(tq, tdo, tk, tv, p, stats, dq_acc, dq_counts, batch);
}

// The producer's LSE and D (FA3's preprocessing): per (batch, head, Q block of BM queries), the block's LSE in log2
// units, then its D = rowsum(dO o O), contiguous, so that a step's stats are one bulk copy; rows past seqlen_q get
// LSE +inf and D 0 (their P is 0). One warp per row, NWARPS rows a CTA; grid (n_q BM / NWARPS, heads, batch).
template <class T, int BM, int NWARPS>
__global__ void __launch_bounds__(NWARPS * 32)
fa3_bwd_stats(const fav::BwdParams p, float* stats) {
    const int i = blockIdx.x * NWARPS + threadIdx.x / 32;
    if (i >= (p.seqlen_q + BM - 1) / BM * BM) return;
    fav::stats_row<T, BM>(p, blockIdx.z, blockIdx.y, i, stats);
}

// ---- the masked backward: the same CTA under AttnMask (a window, softcap, ALiBi; the sinks are in the LSE), over
// a dense batch or a packed one (MaskedBwdParams; the maps of a packed batch's tensors as one sequence of their
// rows). Each work item is one sequence's (SequenceWalk); the stats and the dQ sum are numbered by dq_block.
// ORDERED as fa3_bwd's. kernels/fa3_bwd.py's masked_gradients launches the three.
template <class T, int D, int BN, int BM, bool ORDERED = true>
__global__ void __launch_bounds__(2 * BN + 128, 1)
fa3_bwd_masked(const __grid_constant__ fav::TmaDesc tq, const __grid_constant__ fav::TmaDesc tdo,
               const __grid_constant__ fav::TmaDesc tk, const __grid_constant__ fav::TmaDesc tv,
               const fav::MaskedBwdParams p, const float* stats, float* dq_acc, int* dq_counts, int batch) {
    using C = fav::DkdvConfig<T, D, BN, BM, true, true, false, false, true, false, fav::BwdSequence>;
    fav::fa3_bwd_cta<C, ORDERED>(tq, tdo, tk, tv, p, stats, dq_acc, dq_counts, batch);
}

// The stats of a masked call: grid (longest sequence's Q blocks x BM / NWARPS, heads, sequences).
template <class T, int BM, int NWARPS>
__global__ void __launch_bounds__(NWARPS * 32)
fa3_bwd_stats_masked(const fav::MaskedBwdParams params, float* stats) {
    using namespace fav;
    const BwdSequence s = sequence_view(params, blockIdx.z);
    const int i = blockIdx.x * NWARPS + threadIdx.x / 32;
    if (i >= (s.seqlen_q + BM - 1) / BM * BM) return;
    stats_row<T, BM>(s, s.b, blockIdx.y, i, stats);
}

// dQ of a masked call from its sum (convert_dq_row): grid (longest sequence's rows x head_dim / 8 / 256, heads,
// sequences).
template <class T, int D, int BN, int BM>
__global__ void __launch_bounds__(256)
fa3_bwd_dq_convert_masked(const fav::MaskedBwdParams params, const float* dq_acc) {
    const fav::BwdSequence s = fav::sequence_view(params, blockIdx.z);
    fav::convert_dq_row<T, D, BN, BM>(s, s.b, blockIdx.y, blockIdx.x * 256 + threadIdx.x, dq_acc);
}
