// The pieces the two fa2_fp8 kernels (mma.sync and wgmma) share: P's repacking into an e4m3 A operand (their
// epilogue, which undoes P's x256 and V's per-channel scale, is epilogue.cuh's Fp8DequantOut). Both work on
// mma.sync-shaped fragments (ptx.cuh).
#pragma once
#include "ptx.cuh"
#include "epilogue.cuh"
#include "softmax.cuh"

namespace fav {

// P~ is multiplied by this power of two before it is rounded to e4m3 (exact): probabilities down to 2^-17 of the
// row max stay above e4m3's smallest subnormal 2^-9; the epilogue divides it out once.
constexpr int P_SCALE_LOG2 = 8;
constexpr float P_SCALE = 1 << P_SCALE_LOG2;

// A operand of P V for reduction step k (keys 32k .. 32k+31) from S's n-tiles 4k .. 4k+3, times p (P_SCALE, or 1
// where the softmax has already scaled P~: online_softmax_rescale_folded).
// Thread (g, t) holds keys {2t, 2t+1, 8+2t, 9+2t} in a[0] / a[1] and {16+2t, ..., 25+2t} in a[2] / a[3]: not the
// A layout's {4t..4t+3}, so V^T's keys are stored in this order instead (fp8_quantize.cu: vt_key).
__forceinline__ __device__ void repack_a_e4m3(u32 (&a)[4], const float (&s0)[4], const float (&s1)[4],
                                              const float (&s2)[4], const float (&s3)[4], float p = P_SCALE) {
    a[0] = pack_e4m3x4(s0[0] * p, s0[1] * p, s1[0] * p, s1[1] * p);  // row g
    a[1] = pack_e4m3x4(s0[2] * p, s0[3] * p, s1[2] * p, s1[3] * p);  // row g + 8
    a[2] = pack_e4m3x4(s2[0] * p, s2[1] * p, s3[0] * p, s3[1] * p);
    a[3] = pack_e4m3x4(s2[2] * p, s2[3] * p, s3[2] * p, s3[3] * p);
}

}  // namespace fav
