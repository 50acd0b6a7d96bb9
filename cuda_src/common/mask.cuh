// Masks and logit transforms as policies: what a main loop asks about the keys a query may see, answered in one
// place, so that a new mask is one more struct here with the same members (docs/kernels/masks.md: which kernel
// asks what, and how a mask is added). A kernel builds its policy once from its parameters, Mask::of(params).
//
// which blocks a loop visits (a block none of whose keys is seen is never visited)
//   kv_blocks<BM, BN>(m0, within)      the K/V blocks [begin, end) of BN keys that the queries [m0, m0 + BM) see,
//                                      inside `within` (split-KV: the launch's sub-range); the Q-outer loops
//   q_blocks<BM>(key0)                 the Q blocks [begin, end) of BM queries that see any key from key0 on; the
//                                      K/V-outer loops (fa1's forward, the backwards' dK/dV passes)
//   blocks<BM, BN>(params, m0)         (static) kv_blocks within the launch's split, read from the parameters where
//                                      it is asked (fa3's producer keeps no mask in its 24 registers)
//   first_masked_block<BN>(q0)         from which K/V block on some key is hidden from some query >= q0 (fa3 runs
//                                      the blocks below it in a loop with no mask)
//   last_key(q0, q1)                   the last key any query of [q0, q1] sees, -1 where none (fa3 skips past it)
// whether a block needs the element test (the edge test: a block with no hidden key runs none)
//   needs_mask<QUERIES, KEYS>(q0, q_off, k0)    some key of [k0, k0 + KEYS) is hidden from some query of
//                                      [q0 + q_off, q0 + q_off + QUERIES); if_needs_mask(..., then) runs then() there
// the element test, and what it does to a block
//   visible(query, key)                the test itself; a backward selects P = 0 where it fails (a select, never a
//                                      product with a mask: P = exp2(S - LSE), LSE = -inf, must not make a NaN)
//   apply<MASKED>(s, row0, key0)       the forward's scores of one block (softmax.cuh's fragment layout, the warp's
//                                      rows from row0, keys from key0): hidden ones to -inf where MASKED (the block
//                                      holds one); a transform of every score (a softcap) acts whatever MASKED says
//   apply_if_needed(s, m0, row0, key0) apply with MASKED decided by the edge test (the loops that do not split their
//                                      blocks into masked and mask-free ones), rows m0 + row0 on
// A query range is passed as (tile origin, warp offset) where the kernels formed the sum inside the test: formed in
// the caller, NVVM ordered the operands of the test otherwise and the machine code changed.
//
// PackedCausalMask (the end of this file) is decoding's: the same questions for GQA-packed rows.
//
// CausalMask, the prefill kernels' policy: the seqlen_k tail (keys >= seqlen_k in the block that straddles it) and,
// with causal, the bottom-right aligned diagonal: query i sees key j iff j <= i + seqlen_k - seqlen_q (the
// flash-attn >= 2.1 convention when seqlen_q != seqlen_k).
#pragma once
#include "block_range.cuh"
#include "math.cuh"
#include "params.cuh"

namespace fav {

// The K/V blocks a launch is given (split-KV: FwdParams' sub-range); every block for the others.
__forceinline__ __device__ BlockRange kv_split(const FwdParams& p) { return {p.kv_block_begin, p.kv_block_end}; }
__forceinline__ __device__ BlockRange kv_split(const Fp8FwdParams&) { return all_blocks(); }
__forceinline__ __device__ BlockRange kv_split(const BwdParams&) { return all_blocks(); }

// CausalMask's mask on a warp's block of scores (softmax.cuh's fragment layout): -inf for every score whose key is
// past the end (>= seqlen_k) or, with causal, right of the bottom-right aligned diagonal (key > query + diag, diag =
// seqlen_k - seqlen_q). row0: this warp's first query row; key0: the block's first key. Called only on blocks that
// hold a hidden key.
template <int MT, int NT>
__forceinline__ __device__ void mask_scores(float (&s)[MT][NT][4], int row0, int key0, int seqlen_k, int diag,
                                            bool causal) {
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = row0 + mt * 16 + g + 8 * (e / 2), key = key0 + nt * 8 + 2 * t + (e % 2);
                if (key >= seqlen_k || (causal && key > row + diag)) s[mt][nt][e] = neg_inf();
            }
}

struct CausalMask {
    int seqlen_q, seqlen_k;
    int diag;     // seqlen_k - seqlen_q: query i sees keys up to i + diag
    bool causal;

    template <class Params>
    __forceinline__ __device__ static CausalMask of(const Params& p) {
        const int seqlen_k = p.seqlen_k, seqlen_q = p.seqlen_q;
        const bool causal = p.causal;
        return {seqlen_q, seqlen_k, seqlen_k - seqlen_q, causal};
    }

    // ---- which blocks a loop visits
    template <int BM, int BN>
    __forceinline__ __device__ BlockRange kv_blocks(int m0, BlockRange within = all_blocks()) const {
        return kv_block_range<BM, BN>(m0, seqlen_q, seqlen_k, causal, within.begin, within.end);
    }
    template <int BM>
    __forceinline__ __device__ BlockRange q_blocks(int key0) const {
        return {first_q_block<BM>(key0, seqlen_q, seqlen_k, causal), (seqlen_q + BM - 1) / BM};
    }
    template <int BN>
    __forceinline__ __device__ int first_masked_block(int q0) const {
        return max(0, causal ? min(seqlen_k, q0 + diag + 1) : seqlen_k) / BN;
    }
    __forceinline__ __device__ int last_key(int q0, int q1) const {
        return q1 < q0 ? -1 : causal ? q1 + diag : seqlen_k - 1;
    }
    template <int BM, int BN, class Params>
    __forceinline__ __device__ static BlockRange blocks(const Params& p, int m0) {
        const int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k;
        const bool causal = p.causal;
        const BlockRange split = kv_split(p);
        return kv_block_range<BM, BN>(m0, seqlen_q, seqlen_k, causal, split.begin, split.end);
    }

    // ---- the edge test (causal: the first query sees the fewest keys, so it alone decides)
    template <int QUERIES, int KEYS, class Then>
    __forceinline__ __device__ void if_needs_mask(int q0, int q_off, int k0, const Then& then) const {
        const int sk = seqlen_k, d = diag;
        const bool c = causal;
        if (k0 + KEYS > sk || (c && k0 + KEYS - 1 > q0 + q_off + d)) then();
    }
    template <int QUERIES, int KEYS>
    __forceinline__ __device__ bool needs_mask(int q0, int q_off, int k0) const {
        bool needs = false;
        if_needs_mask<QUERIES, KEYS>(q0, q_off, k0, [&] { needs = true; });
        return needs;
    }

    // ---- the element test, and the forward's use of it
    __forceinline__ __device__ bool visible(int query, int key) const {
        return key < seqlen_k && !(causal && key > query + diag);
    }
    template <bool MASKED, int MT, int NT>
    __forceinline__ __device__ void apply(float (&s)[MT][NT][4], int row0, int key0) const {
        if constexpr (MASKED) mask_scores(s, row0, key0, seqlen_k, diag, causal);
    }
    template <int MT, int NT>
    __forceinline__ __device__ void apply_if_needed(float (&s)[MT][NT][4], int m0, int row0, int key0) const {
        if_needs_mask<16 * MT, 8 * NT>(m0, row0, key0, [&] { apply<true>(s, m0 + row0, key0); });
    }
};

// Decoding's policy (decode_fwd.cu): a tile's rows are query tokens packed with the query heads that share one KV
// head (GQA packing: row r is token r / group), and a CTA's keys end where its split does (key_end <= seqlen_k).
// Row r sees key j iff j < key_end and, with causal, j <= r / group + diag (bottom-right within the sequence).
struct PackedCausalMask {
    int key_end;
    int diag;     // seqlen_k - seqlen_q
    int group;    // rows per query token
    bool causal;

    // some key of [k0, k0 + KEYS) is hidden from some row >= r0 (the first row's token sees the fewest keys)
    template <int KEYS>
    __forceinline__ __device__ bool needs_mask(int r0, int k0) const {
        return k0 + KEYS > key_end || (causal && k0 + KEYS - 1 > r0 / group + diag);
    }
    __forceinline__ __device__ bool visible(int row, int key) const {
        return key < key_end && !(causal && key > row / group + diag);
    }
    // a warp's scores (softmax.cuh's fragment layout), rows from row0, keys from key0: hidden ones to -inf
    template <int MT, int NT>
    __forceinline__ __device__ void apply(float (&s)[MT][NT][4], int row0, int key0) const {
        const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!visible(row0 + mt * 16 + g + 8 * (e / 2), key0 + nt * 8 + 2 * t + (e % 2)))
                        s[mt][nt][e] = neg_inf();
    }
};

}  // namespace fav
