// Shared-memory tiles of 16-bit elements and the global <-> shared copies that fill and drain them.
#pragma once
#include "ptx.cuh"

namespace fav {

// A ROWS x D tile, row-major, each row padded by 16 bytes: row r starts at byte r * (2D + 16), so the eight row
// addresses of one ldmatrix (and eight 16-byte cp.async writes) land in eight distinct 16-byte bank groups for
// every template head dim (a multiple of 16, so D / 8 + 1 is odd): no bank conflicts, no swizzle arithmetic.
template <int ROWS, int D>
struct Tile {
    static constexpr int STRIDE = D + 8;                 // elements per padded row
    static constexpr int BYTES = ROWS * STRIDE * 2;
    __forceinline__ __device__ static u32 at(u32 base, int row, int col) { return base + (row * STRIDE + col) * 2; }
};

// Rows [0, ROWS) of a (rows, D) slice of global memory with row stride `ld` elements, into a Tile<ROWS, D>,
// 16 bytes per cp.async; rows at or beyond `valid_rows` and columns at or beyond `valid_cols` (a multiple of 8:
// the real head dim under a padded template D) are zero-filled, so the padded columns add nothing to Q K^T or
// P V. Not committed: the caller groups.
template <int ROWS, int D, int THREADS>
__forceinline__ __device__ void load_tile_async(u32 tile, const u16* __restrict__ g, i64 ld, int valid_rows,
                                                int valid_cols = D) {
    constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
    if constexpr (THREADS % CHUNKS == 0 && ROWS % (THREADS / CHUNKS) == 0) {
        // Thread -> (row, chunk) is fixed and each pass moves down ROWS_PER_PASS rows. Stepping one pointer
        // keeps the per-pass addresses out of registers (hoisted, they would cost 2 registers per pass).
        constexpr int ROWS_PER_PASS = THREADS / CHUNKS;
        const int r = threadIdx.x / CHUNKS, k = (threadIdx.x % CHUNKS) * 8;
        const bool col_ok = k < valid_cols;
        const u16* src = g + r * ld + k;
        u32 dst = Tile<ROWS, D>::at(tile, r, k);
#pragma unroll
        for (int i = 0; i < ROWS / ROWS_PER_PASS; ++i) {
            const bool ok = col_ok && r + i * ROWS_PER_PASS < valid_rows;
            cp_async_16(dst, ok ? src : g, ok);
            src += ROWS_PER_PASS * ld;
            dst += ROWS_PER_PASS * Tile<ROWS, D>::STRIDE * 2;
        }
    } else {  // head dims whose row does not divide the thread count (96): one chunk at a time
        for (int c = threadIdx.x; c < ROWS * CHUNKS; c += THREADS) {
            const int r = c / CHUNKS, k = (c % CHUNKS) * 8;
            const bool ok = r < valid_rows && k < valid_cols;
            cp_async_16(Tile<ROWS, D>::at(tile, r, k), ok ? g + r * ld + k : g, ok);
        }
    }
}

// Warp-cooperative copy of rows [0, ROWS) of a tile to global memory (row stride `ld`), 16 bytes per store,
// rows at or beyond `valid_rows` and columns at or beyond `valid_cols` (a multiple of 8) skipped. The warp must
// have written (and __syncwarp'ed) those rows.
template <int ROWS, int D>
__forceinline__ __device__ void store_rows_warp(u16* __restrict__ g, i64 ld, const u16* tile, int valid_rows,
                                                int valid_cols = D) {
    constexpr int CHUNKS = D / 8;
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / 32; ++i) {
        const int c = i * 32 + lane;
        const int r = c / CHUNKS, k = (c % CHUNKS) * 8;
        if (r < valid_rows && k < valid_cols)
            *reinterpret_cast<uint4*>(g + r * ld + k) =
                *reinterpret_cast<const uint4*>(tile + r * Tile<ROWS, D>::STRIDE + k);
    }
}

// ROWS contiguous rows of D fp32 values (a workspace in global memory, no ragged edge) into shared memory with
// a row stride of STRIDE floats, 16 bytes per cp.async. Not committed: the caller groups.
template <int ROWS, int D, int STRIDE, int THREADS>
__forceinline__ __device__ void load_f32_rows_async(u32 dst, const float* __restrict__ g) {
    constexpr int CHUNKS = D / 4;
#pragma unroll
    for (int i = 0; i < (ROWS * CHUNKS + THREADS - 1) / THREADS; ++i) {
        const int c = i * THREADS + threadIdx.x;
        if (ROWS * CHUNKS % THREADS == 0 || c < ROWS * CHUNKS)
            cp_async_16(dst + ((c / CHUNKS) * STRIDE + (c % CHUNKS) * 4) * 4, g + (i64)c * 4, true);
    }
}

}  // namespace fav
