// Which K/V blocks a CTA visits: the causal range (bottom-right aligned) and a [begin, end) sub-range of it.
#pragma once
#include "math.cuh"

namespace fav {

// K/V blocks [begin, end) of BN keys seen by query rows [m0, m0 + BM) (clipped to seqlen_q). Causal: key j is
// visible to query i iff j <= i + seqlen_k - seqlen_q, so blocks wholly right of the last row's diagonal are
// skipped. [kv_begin, kv_end) restricts the range further (split-KV: one launch or CTA per sub-range); the
// result may be empty (begin >= end), and then the CTA still writes its rows (zeros, or an empty partial).
struct BlockRange {
    int begin, end;
    __forceinline__ __device__ int count() const { return end > begin ? end - begin : 0; }
};
// Every block: the range a launch without a split-KV sub-range is given.
__forceinline__ __device__ BlockRange all_blocks() { return {0, 1 << 30}; }

template <int BM, int BN>
__forceinline__ __device__ BlockRange kv_block_range(int m0, int seqlen_q, int seqlen_k, bool causal,
                                                     int kv_begin = 0, int kv_end = 1 << 30) {
    int n = (seqlen_k + BN - 1) / BN;
    if (causal) {
        const int last_row = min(m0 + BM, seqlen_q) - 1;
        n = min(n, max(0, last_row + (seqlen_k - seqlen_q) + BN) / BN);  // blocks holding a key <= last diagonal
    }
    return {kv_begin, min(kv_end, n)};
}

// The transpose, for FA1's loop order (outer loop over K/V blocks): the first Q block of BM rows that sees any
// key of the block starting at key0. Q blocks before it are wholly left of the diagonal for every key here.
template <int BM>
__forceinline__ __device__ int first_q_block(int key0, int seqlen_q, int seqlen_k, bool causal) {
    return causal ? max(0, key0 - (seqlen_k - seqlen_q)) / BM : 0;
}

}  // namespace fav
