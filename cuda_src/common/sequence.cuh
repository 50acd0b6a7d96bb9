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

namespace fav {

// The backward's view of sequence `seq` of a masked call (fa2's masked passes, fa3's masked backward): the
// parameters of a batch of its own, as sequence_view's for the forward (its lengths; in a packed batch the
// pointers of q, o, dO, dq, k, v, dk, dv, LSE and D moved to its first rows, whose (heads, total_q) LSE and D keep
// their head stride lse_h), with where it sits: the batch row b its dense strides address (0 when packed), and
// its first rows q0, k0 of the packed tensors (0 in a dense batch), where fa3's tensor maps find it.
struct BwdSequence : MaskedBwdParams {
    int seq, b, q0, k0;
};
__forceinline__ __device__ BwdSequence sequence_view(const MaskedBwdParams& params, int seq) {
    BwdSequence s{params, seq, seq, 0, 0};
    if (params.cu_seqlens_q != nullptr) {
        const int q0 = params.cu_seqlens_q[seq], k0 = params.cu_seqlens_k[seq];
        const i64 ldq = (i64)params.heads * params.head_dim, ldk = (i64)(params.heads / params.group) * params.head_dim;
        s.seqlen_q = params.cu_seqlens_q[seq + 1] - q0;
        s.seqlen_k = params.cu_seqlens_k[seq + 1] - k0;
        s.q += q0 * params.q_n, s.o += q0 * params.o_n, s.dout += q0 * params.do_n, s.dq += q0 * ldq;
        s.k += k0 * params.k_n, s.v += k0 * params.v_n, s.dk += k0 * ldk, s.dv += k0 * ldk;
        s.lse += q0, s.delta += q0;
        s.b = 0, s.q0 = q0, s.k0 = k0;
    } else {
        const i64 at = (i64)seq * params.heads * params.seqlen_q;
        s.lse += at, s.delta += at;
    }
    return s;
}

}  // namespace fav
