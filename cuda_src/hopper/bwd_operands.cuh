// The operands of the Hopper backward's warpgroup MMAs (fa2_bwd_sm90.cu): tiles copied into wgmma's swizzled
// layout, products whose A comes from registers or shared memory and whose B is read K-major or N-major, and the
// 16-bit A fragments of an fp32 accumulator. A warpgroup's accumulator is 64 rows x N (wgmma.cuh's D layout).
#pragma once
#include "../common/fragments.cuh"
#include "../common/wgmma.cuh"
#include "../common/wgmma_n.cuh"

namespace fav {

// load_swizzled_async needs 8 whole rows per pass of THREADS 16-byte copies (rows of at most 2 THREADS bytes);
// wider rows (d = 256 with one warpgroup) go in column parts of 2 THREADS bytes, each a tile of the same slabs.
// A CTA of three warpgroups (384 threads) copies with its first 256 threads (whole passes of 64-row tiles).
template <int ROWS, int KB, int THREADS>
__forceinline__ __device__ void load_rows_async(u32 tile, const unsigned char* __restrict__ g, i64 ld,
                                                int valid_rows, int valid_bytes) {
    constexpr int LT = (THREADS & (THREADS - 1)) == 0 ? THREADS : 256;  // copying threads: a power of 2
    constexpr int PART = KB < 2 * LT ? KB : 2 * LT;
    using Tile = SwizzledTile<ROWS, KB>;
    static_assert(KB % PART == 0 && SwizzledTile<ROWS, PART>::W == Tile::W, "parts made of whole slabs");
    static_assert(LT <= THREADS, "power-of-2 copying threads");
    if (LT < THREADS && threadIdx.x >= LT) return;
#pragma unroll
    for (int c = 0; c < KB / PART; ++c)
        load_swizzled_async<ROWS, PART, LT>(tile + c * (PART / Tile::W) * Tile::SLAB, g + c * PART, ld,
                                            valid_rows, valid_bytes - c * PART);
}

// acc (64 x 8 DT, this warpgroup) += A B with A from registers (a: BK / 16 reduction steps of repack_a) and B
// rows [0, BK) of an N-major tile (the reduction index is the tile's row): D / DN wgmmas of n64 or n128 per step.
template <class T, class TB, int D, int KSTEPS>
__forceinline__ __device__ void wgmma_rs_rows(float (&acc)[D / 8][4], const u32 (&a)[KSTEPS][4], u32 tile_b) {
    constexpr int DN = D < 128 ? D : 128;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
        for (int n = 0; n < D / DN; ++n)
            wgmma_16_rs<T>(reinterpret_cast<float(&)[DN / 8][4]>(acc[n * DN / 8]), a[kk],
                           TB::desc_mn(tile_b, kk * 16, n * DN * 2), 1);
}

// A warp's 16 rows [row0, row0 + 16) of a 16-bit operand in A fragments (repack_all's: a[kk][r] holds row g + 8
// (r % 2), columns 16 kk + 8 (r / 2) + 2t, + 1) into a K-major tile in shared memory, for a wgmma to read.
template <class Tile, int NT>
__forceinline__ __device__ void store_a_rows(u32 tile, int row0, const u32 (&a)[NT / 2][4]) {
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r)
            st_shared(tile + Tile::offset(row0 + g + 8 * (r % 2), 2 * (16 * kk + 8 * (r / 2) + 2 * t)), (int)a[kk][r]);
}

// The same with A from shared memory: rows [a_row, a_row + 64) of the K-major tile TA, columns [0, 16 KSTEPS)
// (the fused dQ's writer variant, whose P^T and dS^T sit there): n64 wgmmas with B read MN-major.
template <class T, class TA, class TB, int D, int KSTEPS>
__forceinline__ __device__ void wgmma_ss_rows(float (&acc)[D / 8][4], u32 tile_a, int a_row, u32 tile_b) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
        for (int n = 0; n < D / 64; ++n)
            wgmma_16_ss<T, 0, 1>(reinterpret_cast<float(&)[8][4]>(acc[n * 8]), TA::desc(tile_a, a_row, kk * 32),
                                 TB::desc_mn(tile_b, kk * 16, n * 128), 1);
}

// acc (64 x 8 NT) = A B^T over d: A rows [a_row, a_row + 64) of tile TA, B rows [0, 8 NT) of tile TB, both K-major.
template <class T, class TA, class TB, int D, int NT>
__forceinline__ __device__ void wgmma_ss_abt(float (&acc)[NT][4], u32 tile_a, int a_row, u32 tile_b) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        wgmma_16_ss<T>(acc, TA::desc(tile_a, a_row, kk * 32), TB::desc(tile_b, 0, kk * 32), kk > 0);
}

// The 16-bit A fragments of an fp32 accumulator (64 x 8 NT): reduction step k takes columns 16k .. 16k + 15.
template <class T, int NT>
__forceinline__ __device__ void repack_all(u32 (&a)[NT / 2][4], const float (&acc)[NT][4]) {
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) repack_a<T>(a[kk], acc[2 * kk], acc[2 * kk + 1]);
}

}  // namespace fav
