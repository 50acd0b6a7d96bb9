// Masks and logit transforms as policies: what a main loop asks about the keys a query row may see, answered in
// one place, so that a new mask touches this header and not the kernels. A policy answers
//   blocks<BM, BN>(params, m0)    which K/V blocks the query rows [m0, m0 + BM) visit (the others are skipped)
//   first_masked_block<BN>(row)   from which block on some key is hidden from some row >= row (the main loop
//                                 runs the blocks below it without a mask)
//   last_key(r0, r1)              the last key that any of the rows [r0, r1] sees (the blocks past it are skipped)
//   apply<MASKED>(s, row0, key0)  the mask and transforms on one block's scores; MASKED: the block holds a hidden
//                                 key (a transform of every score, a softcap, acts whatever MASKED says)
// A kernel builds its policy from its parameters (Mask::of(params)) where it reads them; blocks() reads them
// itself where it is asked (fa3's producer, with 24 registers, keeps no mask).
//
// CausalMask, the one policy today: the seqlen_k tail (keys >= seqlen_k in the block that straddles it) and,
// with causal, the bottom-right aligned diagonal: query i sees key j iff j <= i + seqlen_k - seqlen_q (the
// flash-attn >= 2.1 convention when seqlen_q != seqlen_k). A window, a softcap, attention sinks, ALiBi or varlen
// bounds are fields or policies here with the same members.
#pragma once
#include "block_range.cuh"
#include "params.cuh"
#include "softmax.cuh"

namespace fav {

// The K/V blocks a launch is given (split-KV: FwdParams' sub-range); every block for the fp8 forwards.
__forceinline__ __device__ BlockRange kv_split(const FwdParams& p) { return {p.kv_block_begin, p.kv_block_end}; }
__forceinline__ __device__ BlockRange kv_split(const Fp8FwdParams&) { return {0, 1 << 30}; }

struct CausalMask {
    int seqlen_k;
    int diag;     // seqlen_k - seqlen_q: query i sees keys up to i + diag
    bool causal;

    template <class Params>
    __forceinline__ __device__ static CausalMask of(const Params& p) {
        const int seqlen_k = p.seqlen_k;
        return {seqlen_k, seqlen_k - p.seqlen_q, p.causal != 0};
    }

    // K/V blocks [begin, end) of BN keys that the rows [m0, m0 + BM) see, within the launch's split-KV range.
    // Read from the parameters where it is asked (fa3's producer keeps no mask in its 24 registers).
    template <int BM, int BN, class Params>
    __forceinline__ __device__ static BlockRange blocks(const Params& p, int m0) {
        const int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k;
        const bool causal = p.causal;
        const BlockRange split = kv_split(p);
        return kv_block_range<BM, BN>(m0, seqlen_q, seqlen_k, causal, split.begin, split.end);
    }
    // Blocks j >= first_masked_block(row) hold a key that some row >= row must not see (past seqlen_k or, causal,
    // right of row's diagonal); the blocks below are visible to every such row.
    template <int BN>
    __forceinline__ __device__ int first_masked_block(int row) const {
        return max(0, causal ? min(seqlen_k, row + diag + 1) : seqlen_k) / BN;
    }
    // The last key that any of the rows [r0, r1] sees (causal: r1's diagonal), or -1 where there is none (r1 < r0).
    __forceinline__ __device__ int last_key(int r0, int r1) const {
        return r1 < r0 ? -1 : causal ? r1 + diag : seqlen_k - 1;
    }
    // The scores of a block of keys from key0 on, the warp's rows from row0 on (softmax.cuh's fragment layout):
    // the hidden ones set to -inf, in a block that holds any (MASKED).
    template <bool MASKED, int MT, int NT>
    __forceinline__ __device__ void apply(float (&s)[MT][NT][4], int row0, int key0) const {
        if constexpr (MASKED) mask_scores(s, row0, key0, seqlen_k, diag, causal);
    }
};

}  // namespace fav
