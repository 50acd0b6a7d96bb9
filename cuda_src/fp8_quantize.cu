// fp16/bf16 -> e4m3 quantization for fa2_fp8_fwd.cu, with FA3-style scales (scale = amax / 448, 1 where amax = 0,
// so a block's largest value lands on e4m3's largest and nothing saturates).
//
//   quantize_rows   Q and K: one scale per (batch, head, block of BLOCK rows); output (B, H, N, D) e4m3
//   channel_amax    V, pass 1: per (batch, head, channel) max |v| over the sequence (atomicMax on the bits)
//   quantize_vt     V, pass 2: output V^T (B, H, D, N_pad) e4m3, keys permuted in 32-key groups (vt_key)
//
// amax ignores NaN and Inf, so scales stay finite; a NaN or Inf value itself becomes e4m3 NaN (0x7f) and so
// poisons exactly the outputs it touches (satfinite alone would turn Inf into a finite 448).
#include "common/ptx.cuh"

namespace fav {

__forceinline__ __device__ bool finite(float x) { return fabsf(x) <= 3.4e38f; }  // false for NaN and +-Inf

__forceinline__ __device__ float scale_of(float amax) { return amax > 0.f ? amax / 448.f : 1.f; }

// One e4m3 byte of x / scale (x * inv_scale), NaN for a non-finite x.
__forceinline__ __device__ u32 to_e4m3(float x, float inv_scale) {
    return finite(x) ? (pack_e4m3x4(x * inv_scale, 0.f, 0.f, 0.f) & 0xffu) : 0x7fu;
}

// Key stored at position p (0..31) of a 32-key group of V^T: the order in which a thread of fa2_fp8_fwd holds
// P's values as the A operand (see the comment at the top of fa2_fp8_fwd.cu).
__forceinline__ __device__ int vt_key(int p) {
    const int q = p % 16, t = q / 4, i = q % 4;
    return (p / 16) * 16 + (i / 2) * 8 + 2 * t + (i % 2);
}

// Block reduction of a max over THREADS threads; every thread gets the result.
template <int THREADS>
__forceinline__ __device__ float block_max(float x, float* red) {
    x = warp_max(x);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = x;
    __syncthreads();
    float r = 0.f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) r = fmaxf(r, red[w]);
    __syncthreads();
    return r;
}

}  // namespace fav

// grid (ceil(N / BLOCK), H, B). x: (B, N, H, D) with element strides (x_b, x_n, x_h), last dim contiguous.
template <class T, int D, int BLOCK, int THREADS>
__global__ void __launch_bounds__(THREADS)
quantize_rows(const u16* __restrict__ x, i64 x_b, i64 x_n, i64 x_h, int seqlen, unsigned char* __restrict__ xq,
              float* __restrict__ scale) {
    using namespace fav;
    __shared__ float red[THREADS / 32];
    const int blk = blockIdx.x, h = blockIdx.y, b = blockIdx.z, heads = gridDim.y;
    const int r0 = blk * BLOCK, rows = min(BLOCK, seqlen - r0);
    const u16* xb = x + b * x_b + h * x_h + (i64)r0 * x_n;
    float amax = 0.f;
    for (int e = threadIdx.x; e < rows * D; e += THREADS) {
        const float v = fabsf(T::to_float(xb[(e / D) * x_n + e % D]));
        if (finite(v)) amax = fmaxf(amax, v);
    }
    amax = block_max<THREADS>(amax, red);
    const float s = scale_of(amax), inv = 1.f / s;
    const i64 bh = (i64)b * heads + h;
    if (threadIdx.x == 0) scale[bh * gridDim.x + blk] = s;
    unsigned char* out = xq + (bh * seqlen + r0) * D;
    for (int e = threadIdx.x * 4; e < rows * D; e += THREADS * 4) {  // 4 bytes per store
        const u16* src = xb + (e / D) * x_n + e % D;
        u32 word = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) word |= to_e4m3(T::to_float(src[i]), inv) << (8 * i);
        *reinterpret_cast<u32*>(out + e) = word;
    }
}

// grid (ceil(N / ROWS), H, B); amax (B, H, D) zero-initialized. Non-negative floats order like their bits.
template <class T, int D, int ROWS, int THREADS>
__global__ void __launch_bounds__(THREADS)
channel_amax(const u16* __restrict__ x, i64 x_b, i64 x_n, i64 x_h, int seqlen, float* __restrict__ amax) {
    using namespace fav;
    const int h = blockIdx.y, b = blockIdx.z, r0 = blockIdx.x * ROWS, rows = min(ROWS, seqlen - r0);
    const u16* xb = x + b * x_b + h * x_h + (i64)r0 * x_n;
    for (int c = threadIdx.x; c < D; c += THREADS) {
        float m = 0.f;
        for (int r = 0; r < rows; ++r) {
            const float v = fabsf(T::to_float(xb[r * x_n + c]));
            if (finite(v)) m = fmaxf(m, v);
        }
        atomicMax(reinterpret_cast<int*>(amax) + ((i64)b * gridDim.y + h) * D + c, __float_as_int(m));
    }
}

// grid (seqlen_pad / 32, H, B); item (c, p4) writes keys p4*4 .. p4*4+3 of channel c of one 32-key group.
// Keys past seqlen are zero (the attention kernel loads whole padded blocks of V^T).
template <class T, int D, int THREADS>
__global__ void __launch_bounds__(THREADS)
quantize_vt(const u16* __restrict__ x, i64 x_b, i64 x_n, i64 x_h, int seqlen, int seqlen_pad,
            const float* __restrict__ amax, unsigned char* __restrict__ vt, float* __restrict__ scale) {
    using namespace fav;
    const int h = blockIdx.y, b = blockIdx.z, k0 = blockIdx.x * 32;
    const i64 bh = (i64)b * gridDim.y + h;
    for (int item = threadIdx.x; item < D * 8; item += THREADS) {
        const int c = item / 8, p4 = item % 8;
        const float s = scale_of(amax[bh * D + c]), inv = 1.f / s;
        if (blockIdx.x == 0 && p4 == 0) scale[bh * D + c] = s;
        const u16* xb = x + b * x_b + h * x_h + c;
        u32 word = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int key = k0 + vt_key(p4 * 4 + i);
            if (key < seqlen) word |= to_e4m3(T::to_float(xb[key * x_n]), inv) << (8 * i);
        }
        *reinterpret_cast<u32*>(vt + (bh * D + c) * seqlen_pad + k0 + p4 * 4) = word;
    }
}
