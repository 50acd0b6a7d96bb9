// The pieces the two fa2_fp8 kernels (mma.sync and wgmma) share: P's repacking into an e4m3 A operand, and the
// epilogue that undoes P's x256 and V's per-channel scale. Both work on mma.sync-shaped fragments (ptx.cuh).
#pragma once
#include "ptx.cuh"
#include "softmax.cuh"

namespace fav {

// P~ is multiplied by this power of two before it is rounded to e4m3 (exact): probabilities down to 2^-17 of the
// row max stay above e4m3's smallest subnormal 2^-9; the epilogue divides it out once.
constexpr float P_SCALE = 256.f;

// A operand of P V for reduction step k (keys 32k .. 32k+31) from S's n-tiles 4k .. 4k+3, times P_SCALE.
// Thread (g, t) holds keys {2t, 2t+1, 8+2t, 9+2t} in a[0] / a[1] and {16+2t, ..., 25+2t} in a[2] / a[3]: not the
// A layout's {4t..4t+3}, so V^T's keys are stored in this order instead (fp8_quantize.cu: vt_key).
__forceinline__ __device__ void repack_a_e4m3(u32 (&a)[4], const float (&s0)[4], const float (&s1)[4],
                                              const float (&s2)[4], const float (&s3)[4]) {
    constexpr float p = P_SCALE;
    a[0] = pack_e4m3x4(s0[0] * p, s0[1] * p, s1[0] * p, s1[1] * p);  // row g
    a[1] = pack_e4m3x4(s0[2] * p, s0[3] * p, s1[2] * p, s1[3] * p);  // row g + 8
    a[2] = pack_e4m3x4(s2[0] * p, s2[1] * p, s3[0] * p, s3[1] * p);
    a[3] = pack_e4m3x4(s2[2] * p, s2[3] * p, s3[2] * p, s3[3] * p);
}

// Epilogue of one warp's rows: out = O * sv / (P_SCALE * l) as T, LSE = (m + log2 l) ln 2 (m in log2 units).
// q_row0: the warp's first query row; out is (B, seqlen_q, heads, D), lse (B, heads, seqlen_q); sv: this kv head's
// channel scales. A row that saw no key (l = 0) is written as zeros with LSE -inf; a NaN input stays NaN.
template <class T, int MT, int DT>
__forceinline__ __device__ void store_output_fp8(const float (&o)[MT][DT][4], const float (&m)[MT][2],
                                                 const float (&l)[MT][2], const float* __restrict__ sv,
                                                 u16* __restrict__ out, float* __restrict__ lse, int b, int h,
                                                 int heads, int seqlen_q, int q_row0) {
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const i64 o_n = (i64)heads * DT * 8;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float sum = quad_sum(l[mt][r]);
            const bool seen = !(sum <= 0.f);  // true for NaN too: a NaN input must give NaN, never zeros
            const float inv = seen ? 1.f / (P_SCALE * sum) : 0.f;
            const int q_row = q_row0 + mt * 16 + g + 8 * r;
            if (q_row >= seqlen_q) continue;
            u16* orow = out + ((i64)b * seqlen_q + q_row) * o_n + (i64)h * DT * 8;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const int c = dt * 8 + 2 * t;
                *reinterpret_cast<u32*>(orow + c) =
                    T::pack(o[mt][dt][2 * r] * inv * sv[c], o[mt][dt][2 * r + 1] * inv * sv[c + 1]);
            }
            if (t == 0) lse[((i64)b * heads + h) * seqlen_q + q_row] =
                seen ? (m[mt][r] + __log2f(sum)) * 0.6931471805599453f : neg_inf();
        }
}

}  // namespace fav
