// The Hopper backward's mask policy (fa2_bwd_sm90.cu): causal, bottom-right aligned (key j is visible to query i
// iff j <= i + seqlen_k - seqlen_q), and the tails of seqlen_q and seqlen_k. It answers the passes' three
// questions: which blocks a tile visits (the Q blocks a K/V block's CTA steps over, the K/V blocks a Q block's CTA
// steps over), whether a warp's block of keys against a block of queries needs the element test at all (`edge`),
// and the test applied to an accumulator fragment: a select to exactly 0, never a product with a mask (P = exp2(S -
// LSE) with LSE = -inf for a query that saw no key must not make a NaN).
#pragma once
#include "../common/block_range.cuh"
#include "../common/params.cuh"

namespace fav {

// The mask as one thread sees it: the problem's lengths and flag, and the thread's place in a 64 x N accumulator
// fragment (wgmma.cuh's D layout: element e of column block nt is row 16 warp + g + 8 (e / 2), column 8 nt + 2t +
// e % 2 of its warpgroup's 64 rows).
struct BwdMask {
    int g, t;  // lane / 4, lane % 4
    int seqlen_q, seqlen_k, diag;  // diag = seqlen_k - seqlen_q
    bool causal;

    __forceinline__ __device__ explicit BwdMask(const BwdParams& p)
        : g(threadIdx.x % 32 / 4), t(threadIdx.x % 4), seqlen_q(p.seqlen_q), seqlen_k(p.seqlen_k),
          diag(p.seqlen_k - p.seqlen_q), causal(p.causal) {}

    // ---- which blocks a tile visits
    template <int BM>
    __forceinline__ __device__ int q_blocks() const { return (seqlen_q + BM - 1) / BM; }
    // The first Q block of BM queries that sees any key from key0 on (the dK/dV pass's first step).
    template <int BM>
    __forceinline__ __device__ int first_q_block(int key0) const {
        return fav::first_q_block<BM>(key0, seqlen_q, seqlen_k, causal);
    }
    // The K/V blocks of BN keys that the Q block of BM queries from m0 sees (the dQ pass's steps).
    template <int BM, int BN>
    __forceinline__ __device__ BlockRange kv_blocks(int m0) const {
        return kv_block_range<BM, BN>(m0, seqlen_q, seqlen_k, causal);
    }

    // ---- the test applied to a fragment
    // The dK/dV pass's (keys as rows): this warp's 16 rows of a 64 x 8 NT fragment, keys kw.. (the warp's first),
    // against the queries of the columns, m0.. . Each element becomes value(nt, e, col) where its key sees its
    // query, else 0; value is computed for every element (no branch). A warp whose 16 keys are all visible to query
    // m0 (hence to all the later ones) skips the test (edge false).
    // The dQ pass (fa2_bwd_dq_sm90, queries as rows) writes the same test out in its loop, with the roles of rows
    // and columns exchanged: this kernel's machine code is the one measured, and the test behind a function
    // boundary compiles to other instructions there.
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
