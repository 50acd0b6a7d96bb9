// The Hopper backward's view of the mask policy (fa2_bwd_sm90.cu): common/mask.cuh's CausalMask, which answers
// which blocks a tile visits (q_blocks: the Q blocks a K/V block's CTA steps over; kv_blocks: the K/V blocks a Q
// block's CTA steps over), and where this thread's elements sit in a 64 x N accumulator fragment, for the test
// applied to one: a select to exactly 0, never a product with a mask (P = exp2(S - LSE) with LSE = -inf for a query
// that saw no key must not make a NaN).
#pragma once
#include "../common/mask.cuh"

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

    // The dK/dV pass's test (keys as rows): this warp's 16 rows of a 64 x 8 NT fragment, keys kw.. (the warp's
    // first), against the queries of the columns, m0.. . Each element becomes value(nt, e, col) where its query
    // sees its key, else 0; value is computed for every element (no branch). A warp whose 16 keys are all visible
    // to query m0 (hence to all the later ones) skips the test (edge false). The policy's needs_mask and visible,
    // called here, compiled to other instructions, so the causal test stays written out on its fields
    // (docs/kernels/masks.md). The dQ pass (fa2_bwd_dq_sm90, queries as rows) writes the same test out in its loop,
    // with the roles of rows and columns exchanged: behind a function boundary it compiles to other instructions.
    template <int NT, class Value>
    __forceinline__ __device__ void apply_key_rows(float (&frag)[NT][4], int kw, int m0, Value value) const {
        const bool edge = kw + 16 > seqlen_k || (causal && kw + 15 > m0 + diag);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = nt * 8 + 2 * t + e % 2, key = kw + g + 8 * (e / 2);
                const float x = value(nt, e, col);
                frag[nt][e] = !edge || (key < seqlen_k && !(causal && key > m0 + col + diag)) ? x : 0.f;
            }
    }
};

}  // namespace fav
