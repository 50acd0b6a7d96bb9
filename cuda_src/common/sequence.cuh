// A batch's sequence as a kernel sees it. A dense batch's sequences all have the launch's lengths; a packed (varlen)
// batch's sequence b is rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and o and rows [cu_seqlens_k[b], ...) of k
// and v (flash-attn's layout), the launch's lengths then the longest ones.
#pragma once
#include "params.cuh"

namespace fav {

struct PackedSequence {
    int seqlen_q, seqlen_k;
    int q0, k0;  // its first row of q (and o) and of k (and v) in a packed batch; 0 in a dense one
};

template <class Params>
__forceinline__ __device__ PackedSequence sequence_of(const Params& p, int) {
    return {p.seqlen_q, p.seqlen_k, 0, 0};
}
__forceinline__ __device__ PackedSequence sequence_of(const MaskedFwdParams& p, int b) {
    if (p.cu_seqlens_q == nullptr) return {p.seqlen_q, p.seqlen_k, 0, 0};
    const int q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
    return {p.cu_seqlens_q[b + 1] - q0, p.cu_seqlens_k[b + 1] - k0, q0, k0};
}

// The parameters of sequence b as those of a batch of its own: its lengths, the pointers moved to its first rows
// (a packed batch's batch strides are 0), the LSE's to its rows of (heads, total_q) or of (batch, heads, seqlen_q).
// What fa2's masked forward runs its CTA on, and fa3's masked epilogue stores through.
__forceinline__ __device__ MaskedFwdParams sequence_view(const MaskedFwdParams& p, int b) {
    MaskedFwdParams s = p;
    if (p.cu_seqlens_q != nullptr) {
        const int q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
        s.seqlen_q = p.cu_seqlens_q[b + 1] - q0;
        s.seqlen_k = p.cu_seqlens_k[b + 1] - k0;
        s.q += q0 * p.q_n, s.o += q0 * p.o_n, s.k += k0 * p.k_n, s.v += k0 * p.v_n;
        if (s.lse != nullptr) s.lse += q0;
    } else if (s.lse != nullptr) {
        s.lse += (i64)b * p.heads * p.seqlen_q;
    }
    return s;
}

}  // namespace fav
