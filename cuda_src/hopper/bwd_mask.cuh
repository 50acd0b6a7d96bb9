// The Hopper backward's view of the mask policy (fa2_bwd_sm90.cu, fa3_bwd.cu): common/mask.cuh's CausalMask,
// which answers which blocks a tile visits (q_blocks: the Q blocks a K/V block's CTA steps over; kv_blocks: the K/V
// blocks a Q block's CTA steps over), and where this thread's elements sit in a 64 x N accumulator fragment, for
// the test applied to one: a select to exactly 0, never a product with a mask (P = exp2(S - LSE) with LSE = -inf
// for a query that saw no key must not make a NaN). BwdAttnMask is fa3's masked backward's: AttnMask (a window,
// softcap, ALiBi) on one sequence of a packed or dense batch, the same questions and the transforms' part of P^T
// and dS^T.
#pragma once
#include "../common/mask.cuh"
#include "../common/sequence.cuh"

namespace fav {

// This thread's place in a 64 x N accumulator fragment (wgmma.cuh's D layout: element e of column block nt is row
// 16 warp + g + 8 (e / 2), column 8 nt + 2t + e % 2 of its warpgroup's 64 rows).
struct FragmentLane {
    int g, t;  // lane / 4, lane % 4
};

// (The parameters are read here seqlen_q first, as this backward's kernels read them: CausalMask::of, which reads
// seqlen_k first, compiled the dQ passes to other instructions.)
struct BwdMask : FragmentLane, CausalMask {
    __forceinline__ __device__ explicit BwdMask(const BwdParams& p)
        : FragmentLane{int(threadIdx.x % 32 / 4), int(threadIdx.x % 4)},
          CausalMask{p.seqlen_q, p.seqlen_k, p.seqlen_k - p.seqlen_q, p.causal != 0} {}
    // (every query head sees the same mask: the head is BwdAttnMask's)
    __forceinline__ __device__ BwdMask(const BwdParams& p, int) : BwdMask(p) {}
    __forceinline__ __device__ const BwdMask& for_head(const BwdParams&, int) const { return *this; }

    // The dK/dV pass's test (keys as rows): this warp's 16 rows of a 64 x 8 NT fragment, keys kw.. (the warp's
    // first), against the queries of the columns, m0.. . Each element becomes value(nt, e, col) where its query
    // sees its key, else 0. Only a warp some of whose 16 keys are hidden from some query of the block (edge: past
    // seqlen_k, or right of query m0's diagonal) runs the element test; the others take a loop without it. (As one
    // loop with `!edge ||` in each element's select, the 8 NT x 4 tests were formed and kept as a bit mask in a
    // register at every step, whether the warp needed them or not.) The dQ pass (fa2_bwd_dq_sm90, queries as rows)
    // writes the same test out in its loop, with the roles of rows and columns exchanged.
    template <int NT, class Value>
    __forceinline__ __device__ void apply_key_rows(float (&frag)[NT][4], int kw, int m0, Value value) const {
        const bool edge = kw + 16 > seqlen_k || (causal && kw + 15 > m0 + diag);
        if (!edge) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) frag[nt][e] = value(nt, e, nt * 8 + 2 * t + e % 2);
            return;
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = nt * 8 + 2 * t + e % 2, key = kw + g + 8 * (e / 2);
                const float x = value(nt, e, col);
                frag[nt][e] = key < seqlen_k && !(causal && key > m0 + col + diag) ? x : 0.f;
            }
    }
};

// AttnMask for the dK/dV pass of one sequence (a BwdSequence view), keys as rows: P^T of the capped and biased
// scores, zero where the key does not see the query, and dS^T of the raw scores (the softcap's chain rule). Built
// for the kv head's first query head; for_head moves the ALiBi slope to a step's head.
struct BwdAttnMask : FragmentLane, AttnMask {
    __forceinline__ __device__ BwdAttnMask(const BwdSequence& s, int h)
        : FragmentLane{int(threadIdx.x % 32 / 4), int(threadIdx.x % 4)},
          AttnMask(AttnMask::of(s, s.seqlen_q, s.seqlen_k, s.seq, h)) {}
    __forceinline__ __device__ BwdAttnMask for_head(const BwdSequence& s, int h) const {
        BwdAttnMask m = *this;
        if (slopes) m.slope = slopes[h] * s.inv_scale;
        return m;
    }

    // P^T of this warp's 16 keys from kw (rows) and the queries m0 + col (columns), from the raw S^T:
    // exp2(transform(S) scale_log2 - LSE2[col]) where the key sees the query, else 0. The element test runs only
    // where some key of the warp's is hidden from some query of the block (the edge test); the transforms always.
    // (A loop for each case, chosen once: with the element test or without, and the scores raw, capped alone, or
    // capped and biased. Inside one loop the uniform tests would branch at every score, or the element tests and
    // the transforms' be formed whether needed or not: BwdMask::apply_key_rows.)
    template <int NT>
    __forceinline__ __device__ void p_key_rows(float (&pt)[NT][4], const float (&st)[NT][4], int kw, int m0,
                                               const float* lse2, float scale_log2) const {
        const Scores how = scores();
        if (needs_mask<8 * NT, 16>(m0, 0, kw)) p_key_rows<true>(how, pt, st, kw, m0, lse2, scale_log2);
        else p_key_rows<false>(how, pt, st, kw, m0, lse2, scale_log2);
    }
    template <bool EDGE, int NT>
    __forceinline__ __device__ void p_key_rows(Scores how, float (&pt)[NT][4], const float (&st)[NT][4], int kw,
                                               int m0, const float* lse2, float scale_log2) const {
        if (how == Scores::RAW) p_key_rows<Scores::RAW, EDGE>(pt, st, kw, m0, lse2, scale_log2);
        else if (how == Scores::CAPPED) p_key_rows<Scores::CAPPED, EDGE>(pt, st, kw, m0, lse2, scale_log2);
        else p_key_rows<Scores::TRANSFORMED, EDGE>(pt, st, kw, m0, lse2, scale_log2);
    }
    template <Scores HOW, bool EDGE, int NT>
    __forceinline__ __device__ void p_key_rows(float (&pt)[NT][4], const float (&st)[NT][4], int kw, int m0,
                                               const float* lse2, float scale_log2) const {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = nt * 8 + 2 * t + e % 2, key = kw + g + 8 * (e / 2), query = m0 + col;
                const float s = HOW == Scores::RAW      ? st[nt][e]
                                : HOW == Scores::CAPPED ? capped(st[nt][e], cap)
                                                        : transform(st[nt][e], query, key);
                const float x = exp2f_approx(fmaf(s, scale_log2, -lse2[col]));
                pt[nt][e] = !EDGE || visible(query, key) ? x : 0.f;
            }
    }
    // dS^T of the raw scores from dS^T of the transformed ones (ds_raw: the softcap's 1 - tanh^2, read back from
    // P^T); nothing to do without a softcap, no ALiBi bias to add back without a slope.
    template <int NT>
    __forceinline__ __device__ void ds_key_rows(float (&ds)[NT][4], const float (&pt)[NT][4], int kw, int m0,
                                                const float* lse2, float scale_log2) const {
        if (cap <= 0.f) return;
        if (slope == 0.f) ds_key_rows<false>(ds, pt, kw, m0, lse2, scale_log2);
        else ds_key_rows<true>(ds, pt, kw, m0, lse2, scale_log2);
    }
    template <bool BIASED, int NT>
    __forceinline__ __device__ void ds_key_rows(float (&ds)[NT][4], const float (&pt)[NT][4], int kw, int m0,
                                                const float* lse2, float scale_log2) const {
        const float inv_scale_log2 = 1.f / scale_log2, inv_cap = 1.f / cap;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = nt * 8 + 2 * t + e % 2;
                ds[nt][e] = ds_raw_by<BIASED>(ds[nt][e], pt[nt][e], inv_scale_log2, inv_cap, lse2[col], m0 + col,
                                              kw + g + 8 * (e / 2));
            }
    }
};

// The mask a Hopper dK/dV CTA builds from its parameters: CausalMask's for a plain call, AttnMask's for one
// sequence of a masked call.
template <class P>
struct BwdMaskOf {
    using type = BwdMask;
};
template <>
struct BwdMaskOf<BwdSequence> {
    using type = BwdAttnMask;
};

}  // namespace fav
