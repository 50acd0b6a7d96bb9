// fp16/bf16 -> e4m3 quantization for the fp8 forwards (fa2_fp8, fa3_fp8), with FA3-style scales (scale =
// amax / 448, 1 where amax = 0, so a block's largest value lands on e4m3's largest and nothing saturates). Two
// launches quantize Q, K and V (fa_variants/kernels/fa2_fp8.py, QuantPlan):
//
//   quantize_qk_amax  one CTA per work item, three kinds in one grid:
//                       Q and K row blocks: one scale per (batch, head, block of BM or BN rows); out (B, H, N, D)
//                       V row chunks: per (batch, head, channel) max |v| over the sequence (atomicMax on the bits)
//   quantize_vt       V^T (B, H, D, N_pad) e4m3 with the channel scales, keys permuted in 32-key groups (vt_key)
//
// V's channel scales need all of V read before any of it can be quantized, so V is read twice; everything else
// once. One grid for the first pass (it was three launches) leaves one launch gap and one tail instead of three.
// V's chunks come last in it. The second pass reads V from DRAM again; a single launch that reads it the second
// time from L2 was slower, because each CTA's chain of loads, waits and releases, not DRAM bytes, sets the time
// (the measurements: docs/refuted.md).
//
// amax ignores NaN and Inf, so scales stay finite; a NaN or Inf value itself becomes e4m3 NaN (0x7f) and so
// poisons exactly the outputs it touches (satfinite alone would turn Inf into a finite 448).
//
// These kernels are bound by memory bandwidth: every global access is a 16-byte vector (8 fp16/bf16 values, or 16
// e4m3 bytes), consecutive lanes on consecutive addresses. That needs 16-byte aligned rows: the launcher checks
// the base pointer and strides and passes an aligned copy otherwise.
#include "common/params.cuh"
#include "common/ptx.cuh"

namespace fav {

__forceinline__ __device__ bool finite(float x) { return fabsf(x) <= 3.4e38f; }  // false for NaN and +-Inf

__forceinline__ __device__ float scale_of(float amax) { return amax > 0.f ? amax / 448.f : 1.f; }

// max(m, |x|) over finite x only: the amax ignores NaN and Inf.
__forceinline__ __device__ float finite_max(float m, float x) { return finite(x) ? fmaxf(m, fabsf(x)) : m; }

__forceinline__ __device__ uint4 load16(const u16* p) { return *reinterpret_cast<const uint4*>(p); }

// The 8 values of one 16-byte vector as fp32, lowest address first.
template <class T>
__forceinline__ __device__ void unpack8(const uint4& v, float (&f)[8]) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = T::to_float((u16)(w[i] & 0xffffu));
        f[2 * i + 1] = T::to_float((u16)(w[i] >> 16));
    }
}

// max(m, |x|) over the finite x of a 16-byte vector, on the 16-bit patterns: |x|'s pattern (sign bit cleared)
// orders like |x|, and NaN / Inf are the patterns from T's infinity up. Kept in integers so that the compiler does
// not carry 8 unpacked floats per vector across the block reduction to reuse them.
template <class T>
__forceinline__ __device__ u32 finite_max_bits(u32 m, const uint4& v) {
    constexpr u32 INF = T::is_bf16 ? 0x7f80u : 0x7c00u;
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 lo = w[i] & 0x7fffu, hi = (w[i] >> 16) & 0x7fffu;
        m = lo < INF ? max(m, lo) : m;
        m = hi < INF ? max(m, hi) : m;
    }
    return m;
}

// Four e4m3 bytes of x_i * inv (x0 in the lowest byte). A non-finite x is converted as 0 and its byte then set to
// 0x7f, so NaN and Inf both give exactly 0x7f whatever cvt would make of them.
__forceinline__ __device__ u32 e4m3x4(float x0, float x1, float x2, float x3, float inv) {
    const float x[4] = {x0, x1, x2, x3};
    float y[4];
    u32 nan = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        y[i] = finite(x[i]) ? x[i] * inv : 0.f;
        nan |= finite(x[i]) ? 0u : 0x7fu << (8 * i);
    }
    return pack_e4m3x4(y[0], y[1], y[2], y[3]) | nan;
}

// Key stored at position p of a group of 32 keys of V^T (any p: groups repeat every 32): the order in which a
// thread of fa2_fp8_fwd holds P's values as the A operand (see the comment at the top of fa2_fp8_fwd.cu).
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


// One scale block of Q or K: `rows` (<= BLOCK) rows of D values from xb (row stride x_n) into the contiguous e4m3
// rows at out, and its scale. The block is read once, all of a thread's loads in flight together, kept in registers
// for the amax and then quantized from there. Pair e of the block's 16-value pairs (row e / (D / 16)) belongs to
// thread e % THREADS: a thread loads 32 bytes and stores 16 (8-byte stores ran 6 % slower at d 128), a warp loads
// 1 KB of whole row segments and stores 512 contiguous bytes.
template <class T, int D, int BLOCK, int THREADS>
__forceinline__ __device__ void quantize_block(const u16* xb, i64 x_n, int rows, unsigned char* out, float* scale,
                                               float* red) {
    constexpr int ROW_PAIRS = D / 16, PAIRS = BLOCK * ROW_PAIRS, VEC = (PAIRS + THREADS - 1) / THREADS;
    uint4 v[VEC][2];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {  // rows past `rows` read as zero: they leave the amax alone
        const int e = threadIdx.x + j * THREADS, r = e / ROW_PAIRS;
        const bool ok = e < PAIRS && r < rows;
        const u16* src = xb + r * x_n + (e % ROW_PAIRS) * 16;
        v[j][0] = ok ? load16(src) : make_uint4(0u, 0u, 0u, 0u);
        v[j][1] = ok ? load16(src + 8) : make_uint4(0u, 0u, 0u, 0u);
    }
    u32 bits = 0;
#pragma unroll
    for (int j = 0; j < VEC; ++j) bits = finite_max_bits<T>(finite_max_bits<T>(bits, v[j][0]), v[j][1]);
    const float s = scale_of(block_max<THREADS>(T::to_float((u16)bits), red)), inv = 1.f / s;
    if (threadIdx.x == 0) *scale = s;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        const int e = threadIdx.x + j * THREADS;
        if (e >= PAIRS || e / ROW_PAIRS >= rows) continue;
        float f[8], g[8];
        unpack8<T>(v[j][0], f);
        unpack8<T>(v[j][1], g);
        *reinterpret_cast<uint4*>(out + (i64)e * 16) =
            make_uint4(e4m3x4(f[0], f[1], f[2], f[3], inv), e4m3x4(f[4], f[5], f[6], f[7], inv),
                       e4m3x4(g[0], g[1], g[2], g[3], inv), e4m3x4(g[4], g[5], g[6], g[7], inv));
    }
}

// Work item `item` of a row-block part (Q or K): block item % blocks of head (item / blocks) % heads of batch
// item / (blocks * heads).
template <class T, int D, int BLOCK, int THREADS>
__forceinline__ __device__ void quantize_rows_item(int item, const u16* x, i64 x_b, i64 x_n, i64 x_h, int seqlen,
                                                   int heads, unsigned char* xq, float* scale, float* red) {
    const int blocks = (seqlen + BLOCK - 1) / BLOCK, blk = item % blocks, bh = item / blocks;
    const int h = bh % heads, b = bh / heads, r0 = blk * BLOCK;
    quantize_block<T, D, BLOCK, THREADS>(x + b * x_b + h * x_h + (i64)r0 * x_n, x_n, min(BLOCK, seqlen - r0),
                                         xq + ((i64)bh * seqlen + r0) * D, scale + (i64)bh * blocks + blk, red);
}

// Work item `item` of V's amax part: ROWS rows of head (item / chunks) % heads, batch item / (chunks * heads); amax
// (B, H, D) zero-initialized (non-negative floats order like their bits). Thread t owns channels 8 (t % CG) ..
// 8 (t % CG) + 7 (one 16-byte vector a row) of rows t / CG, + RG, ...: a warp reads 32 / CG whole rows at a time.
// The row groups are reduced by shuffles within a warp, then through shared memory across warps, and one
// atomicMax a channel per CTA goes to global memory.
template <class T, int D, int ROWS, int THREADS>
__forceinline__ __device__ void channel_amax_item(int item, const u16* x, i64 x_b, i64 x_n, i64 x_h, int seqlen,
                                                  int heads, float* amax, float* red /* [THREADS / 32][D] */) {
    constexpr int CG = D / 8, RG = THREADS / CG, WARPS = THREADS / 32, LOADS = ROWS / RG;
    static_assert(32 % CG == 0 && THREADS % 32 == 0 && LOADS * RG == ROWS, "a warp holds whole rows; RG divides ROWS");
    const int chunks = (seqlen + ROWS - 1) / ROWS, bh = item / chunks, h = bh % heads, b = bh / heads;
    const int r0 = item % chunks * ROWS, rows = min(ROWS, seqlen - r0);
    const int cg = threadIdx.x % CG, rg = threadIdx.x / CG, lane = threadIdx.x % 32;
    const u16* xb = x + b * x_b + h * x_h + (i64)r0 * x_n + cg * 8;
    uint4 v[LOADS];
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {  // all loads first, so that they are in flight together
        const int r = rg + j * RG;
        v[j] = r < rows ? load16(xb + r * x_n) : make_uint4(0u, 0u, 0u, 0u);
    }
    float m[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
        float f[8];
        unpack8<T>(v[j], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) m[i] = finite_max(m[i], f[i]);
    }
#pragma unroll
    for (int o = CG; o < 32; o *= 2)  // lanes l and l ^ o (o >= CG) hold the same channels of other rows
#pragma unroll
        for (int i = 0; i < 8; ++i) m[i] = fmaxf(m[i], __shfl_xor_sync(0xffffffffu, m[i], o));
    if (lane < CG) {
        float4* dst = reinterpret_cast<float4*>(red + threadIdx.x / 32 * D + cg * 8);
        dst[0] = make_float4(m[0], m[1], m[2], m[3]);
        dst[1] = make_float4(m[4], m[5], m[6], m[7]);
    }
    __syncthreads();
    for (int c = threadIdx.x; c < D; c += THREADS) {
        float r = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) r = fmaxf(r, red[w * D + c]);
        atomicMax(reinterpret_cast<int*>(amax) + (i64)bh * D + c, __float_as_int(r));
    }
}

}  // namespace fav

// grid (q_items + k_items + V's chunks): Q's row blocks, then K's, then V's amax chunks (a part the launch does not
// quantize has no items). Every CTA is one item of one part, so the branch is uniform and each part's __syncthreads
// stay inside it.
template <class T, int D, int BM, int BN, int AMAX_ROWS, int THREADS>
__global__ void __launch_bounds__(THREADS)
quantize_qk_amax(const fav::QuantParams p) {
    using namespace fav;
    __shared__ __align__(16) float red[THREADS / 32 * D];  // block_max uses the first THREADS / 32
    griddep_launch_dependents();  // quantize_vt's CTAs may take the SMs the last wave frees (they wait for it)
    int item = blockIdx.x;
    if (item < p.q_items) {
        quantize_rows_item<T, D, BM, THREADS>(item, p.q, p.q_b, p.q_n, p.q_h, p.seqlen_q, p.heads, p.qq, p.sq, red);
        return;
    }
    item -= p.q_items;
    if (item < p.k_items) {
        quantize_rows_item<T, D, BN, THREADS>(item, p.k, p.k_b, p.k_n, p.k_h, p.seqlen_k, p.heads_kv, p.kq, p.sk, red);
        return;
    }
    channel_amax_item<T, D, AMAX_ROWS, THREADS>(item - p.k_items, p.v, p.v_b, p.v_n, p.v_h, p.seqlen_k, p.heads_kv,
                                                p.amax, red);
}

// grid (ceil(N_pad / KEYS) * D / CHANNELS, H, B), after quantize_qk_amax: a CTA makes KEYS positions of V^T for
// CHANNELS of the D channels (CHANNELS = 128 at most keeps d = 256's loads in registers without halving the CTAs
// per SM). Keys past seqlen are zero (the attention kernels load whole padded blocks of V^T); positions past N_pad
// (a multiple of 32) are not written. The CTAs run in reverse order of their index, so that the first ones read the
// end of V, which quantize_qk_amax read last (+0.5-1.5 % measured, though ncu finds all of V read from DRAM).
//   1. Thread (cg, kq) loads the 4 keys that V^T stores at positions 4 kq .. 4 kq + 3 (vt_key), one 16-byte vector
//      of channels 8 cg .. 8 cg + 7 each; a warp is 8 channel groups x 4 quads, so it reads 128-byte row segments.
//      It quantizes them with the channel scales and writes, per channel, the 4 bytes as one word to shared memory.
//   2. The tile's channel rows (KEYS bytes each) go to V^T as 16-byte vectors, 8 lanes to a 128-byte row segment.
// Shared rows are 128 bytes (32 banks) and hold their 16-byte chunk k at chunk k ^ (c / 8 % 8) (c the channel): the
// 8 channel groups of a warp then write 8 distinct chunks in step 1, and the 8 lanes reading a row in step 2 too.
template <class T, int D, int KEYS, int CHANNELS, int THREADS>
__global__ void __launch_bounds__(THREADS)
quantize_vt(const fav::QuantParams p) {
    using namespace fav;
    constexpr int SPLIT = D / CHANNELS, CG = CHANNELS / 8, QUADS = KEYS / 4, CHUNKS = KEYS / 16, CG_WARPS = CG / 8;
    constexpr int QUAD_STEP = 4 * (THREADS / 32 / CG_WARPS), PASSES = QUADS / QUAD_STEP;
    static_assert(KEYS == 128, "the swizzle assumes 128-byte shared rows: 8 chunks over the 32 banks");
    static_assert(SPLIT * CHANNELS == D && CG % 8 == 0 && THREADS % (32 * CG_WARPS) == 0 &&
                  PASSES * QUAD_STEP == QUADS, "warps tile the channel groups evenly and the passes the quads");
    __shared__ __align__(16) u32 tile[CHANNELS][QUADS];
    __shared__ __align__(16) float inv_s[CHANNELS];
    griddep_wait();               // launched behind quantize_qk_amax: its amax, complete
    griddep_launch_dependents();  // fa3_fp8 quantizing on the fly comes next (it waits for this grid too)
    const int bx = gridDim.x - 1 - blockIdx.x, h = gridDim.y - 1 - blockIdx.y, b = gridDim.z - 1 - blockIdx.z;
    const int k0 = bx / SPLIT * KEYS, c0 = bx % SPLIT * CHANNELS, seqlen = p.seqlen_k, seqlen_pad = p.seqlen_k_pad;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const i64 bh = (i64)b * gridDim.y + h;
    const int cg = lane % 8 + 8 * (warp % CG_WARPS), kq0 = lane / 8 + 4 * (warp / CG_WARPS);
    const u16* xb = p.v + b * p.v_b + h * p.v_h + c0 + cg * 8;
    uint4 v[PASSES][4];
#pragma unroll
    for (int q = 0; q < PASSES; ++q)  // every load before the first barrier: they stay in flight across it
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int key = k0 + vt_key(4 * (kq0 + q * QUAD_STEP) + i);
            v[q][i] = key < seqlen ? load16(xb + key * p.v_n) : make_uint4(0u, 0u, 0u, 0u);
        }
    const float* am = p.amax + bh * D + c0;
    for (int c = threadIdx.x; c < CHANNELS; c += THREADS) {  // the scales once per CTA, not 8 per thread
        const float s = scale_of(am[c]);
        inv_s[c] = 1.f / s;
        if (k0 == 0) p.sv[bh * D + c0 + c] = s;
    }
    __syncthreads();
    float inv[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) inv[i] = inv_s[cg * 8 + i];
#pragma unroll
    for (int q = 0; q < PASSES; ++q) {
        const int kq = kq0 + q * QUAD_STEP;
        float f[4][8];
#pragma unroll
        for (int i = 0; i < 4; ++i) unpack8<T>(v[q][i], f[i]);
#pragma unroll
        for (int c = 0; c < 8; ++c)
            tile[cg * 8 + c][((kq / 4) ^ (cg % 8)) * 4 + kq % 4] = e4m3x4(f[0][c], f[1][c], f[2][c], f[3][c], inv[c]);
    }
    __syncthreads();
    unsigned char* out = p.vt + (bh * D + c0) * seqlen_pad + k0;
#pragma unroll
    for (int u = threadIdx.x; u < CHANNELS * CHUNKS; u += THREADS) {
        const int c = u / CHUNKS, k = u % CHUNKS;
        if (k0 + 16 * k < seqlen_pad)
            *reinterpret_cast<uint4*>(out + (i64)c * seqlen_pad + 16 * k) =
                *reinterpret_cast<const uint4*>(&tile[c][(k ^ (c / 8 % 8)) * 4]);
    }
}
