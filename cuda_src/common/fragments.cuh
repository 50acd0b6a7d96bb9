// Warp-level mma.sync operand fragments from padded shared-memory tiles (Tile<ROWS, D>), and the repacking
// of an fp32 accumulator into a 16-bit A operand. Layouts: see mma_16816 in ptx.cuh.
#pragma once
#include "tile.cuh"

namespace fav {

__forceinline__ __device__ int lane_id() { return threadIdx.x % 32; }

// A operand (16 x 16) from rows [row0, row0+16), cols [col0, col0+16) of a row-major tile.
// Matrices in a0..a3 order: (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15).
template <class TILE>
__forceinline__ __device__ void load_a(u32 (&a)[4], u32 tile, int row0, int col0) {
    const int l = lane_id();
    ldmatrix_x4(a, TILE::at(tile, row0 + (l % 8) + 8 * ((l / 8) % 2), col0 + 8 * (l / 16)));
}

// B operands of S = Q K^T for two n-tiles: keys [key0, key0+16), reduction cols [col0, col0+16) of a K tile
// stored [key][d]. Rows of K are B's columns, already k-contiguous, so no transpose:
// b[0], b[1] serve keys key0..key0+7 and b[2], b[3] keys key0+8..key0+15.
template <class TILE>
__forceinline__ __device__ void load_b_rows(u32 (&b)[4], u32 tile, int key0, int col0) {
    const int l = lane_id();
    ldmatrix_x4(b, TILE::at(tile, key0 + (l % 8) + 8 * (l / 16), col0 + 8 * ((l / 8) % 2)));
}

// B operands of O = P V for two n-tiles: reduction rows (keys) [key0, key0+16), output cols [col0, col0+16) of a
// V tile stored [key][d]. B must be k(=key)-contiguous, V is d-contiguous: ldmatrix.trans transposes on the fly.
// b[0], b[1] serve cols col0..col0+7 and b[2], b[3] cols col0+8..col0+15.
template <class TILE>
__forceinline__ __device__ void load_b_cols(u32 (&b)[4], u32 tile, int key0, int col0) {
    const int l = lane_id();
    ldmatrix_x4_trans(b, TILE::at(tile, key0 + (l % 8) + 8 * ((l / 8) % 2), col0 + 8 * (l / 16)));
}

// The accumulator of S for n-tiles 2k and 2k+1 (keys 16k .. 16k+15) is, element for element, the A operand of
// P V for reduction step k: c0,c1 -> a0 (row g), c2,c3 -> a1 (row g+8), next tile's c0,c1 -> a2, c2,c3 -> a3.
// So P never leaves registers: convert to 16 bits and repack.
template <class T>
__forceinline__ __device__ void repack_a(u32 (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = T::pack(lo[0], lo[1]);
    a[1] = T::pack(lo[2], lo[3]);
    a[2] = T::pack(hi[0], hi[1]);
    a[3] = T::pack(hi[2], hi[3]);
}

// Warp-level products of 16 rows, for kernels that write their loops through them (the backward):
//   acc (16 x 8NT) += A B^T   A: rows [a_row, a_row + 16) of tile TA, B: rows [0, 8NT) of tile TB, both over their
//                             first 16 KSTEPS columns (the mma reduction); B's rows are its columns, as K in S = Q K^T
template <class T, class TA, class TB, int KSTEPS, int NT>
__forceinline__ __device__ void warp_mma_abt(float (&acc)[1][NT][4], u32 tile_a, int a_row, u32 tile_b) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        u32 a[4];
        load_a<TA>(a, tile_a, a_row, kk * 16);
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
            u32 b[4];
            load_b_rows<TB>(b, tile_b, nt * 8, kk * 16);
            mma_16816<T>(acc[0][nt], a, b[0], b[1]);
            mma_16816<T>(acc[0][nt + 1], a, b[2], b[3]);
        }
    }
}

//   acc (16 x 8DT) += P B     P: fp32 accumulator rows of 16 x 8PT (rounded to T as the A operand, repack_a), B:
//                             rows [0, 8PT) of tile TB (the reduction), as V in O = P V
template <class T, class TB, int PT, int DT>
__forceinline__ __device__ void warp_mma_pb(float (&acc)[1][DT][4], const float (&p)[1][PT][4], u32 tile_b) {
#pragma unroll
    for (int kk = 0; kk < PT / 2; ++kk) {
        u32 a[4];
        repack_a<T>(a, p[0][2 * kk], p[0][2 * kk + 1]);
#pragma unroll
        for (int dt = 0; dt < DT; dt += 2) {
            u32 b[4];
            load_b_cols<TB>(b, tile_b, kk * 16, dt * 8);
            mma_16816<T>(acc[0][dt], a, b[0], b[1]);
            mma_16816<T>(acc[0][dt + 1], a, b[2], b[3]);
        }
    }
}

}  // namespace fav
