// What the 16-bit backwards share (fa2_bwd.cu, fa1_bwd.cu; fa2_bwd_sm90.cu takes LOG2E): P recomputed from the
// forward's LSE, and one step of a warp that owns 16 keys of a K/V block against one Q block (S^T, P^T, dV, dP^T,
// dS^T, dK), with dK and dV accumulated over a slice of their columns, so that head dims above 128 split their
// gradients' columns over CTAs instead of over registers. Also the A operand of a matrix stored transposed (dS from
// dS^T), for dQ = dS K.
#pragma once
#include "fragments.cuh"
#include "mask.cuh"
#include "params.cuh"

namespace fav {

constexpr float LOG2E = 1.4426950408889634f;

// Query row `row` of head (b, h): its LSE in log2 units (P = exp2(S * scale_log2 - lse2)) and D = rowsum(dO * O).
// A row past seqlen_q gets lse2 = +inf, so that its P is 0, and D = 0; its loads are not made.
__forceinline__ __device__ float row_lse2(const BwdParams& p, int b, int h, int row) {
    return row < p.seqlen_q ? p.lse[((i64)b * p.heads + h) * p.seqlen_q + row] * LOG2E : __int_as_float(0x7f800000);
}
// D = rowsum(dO * O) of query row i of head (b, h), summed by the 32 lanes of a warp (every lane gets it).
template <class T>
__forceinline__ __device__ float row_delta(const BwdParams& p, int b, int h, int i, int lane) {
    const u16* o = p.o + b * p.o_b + (i64)i * p.o_n + h * p.o_h;
    const u16* dout = p.dout + b * p.do_b + (i64)i * p.do_n + h * p.do_h;
    float sum = 0.f;
    for (int c = 2 * lane; c < p.head_dim; c += 64) {  // head_dim is a multiple of 8: whole pairs
        const u32 x = *reinterpret_cast<const u32*>(o + c), y = *reinterpret_cast<const u32*>(dout + c);
        sum += T::to_float((u16)x) * T::to_float((u16)y) + T::to_float((u16)(x >> 16)) * T::to_float((u16)(y >> 16));
    }
    return warp_sum(sum);
}
struct RowStats {
    float lse2, delta;
};
__forceinline__ __device__ RowStats row_stats(const BwdParams& p, int b, int h, int row) {
    return {row_lse2(p, b, h, row), row < p.seqlen_q ? p.delta[((i64)b * p.heads + h) * p.seqlen_q + row] : 0.f};
}
// The masked backward's view of one sequence (or batch row) has its LSE and D pointers at the sequence's first row
// and a head stride of its own (packed calls: (heads, total_q)); b is 0 there.
__forceinline__ __device__ float row_lse2(const MaskedBwdParams& p, int, int h, int row) {
    return row < p.seqlen_q ? p.lse[h * p.lse_h + row] * LOG2E : __int_as_float(0x7f800000);
}
__forceinline__ __device__ RowStats row_stats(const MaskedBwdParams& p, int, int h, int row) {
    if (row >= p.seqlen_q) return {__int_as_float(0x7f800000), 0.f};
    const i64 at = h * p.lse_h + row;
    return {p.lse[at] * LOG2E, p.delta[at]};
}
// The two rows a thread holds in an mma C fragment: g and g + 8 (g = lane / 4) of the warp's 16 from row0.
template <class Params>
__forceinline__ __device__ void fragment_row_stats(const Params& p, int b, int h, int row0, float (&lse2)[2],
                                                   float (&delta)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const RowStats st = row_stats(p, b, h, row0 + (threadIdx.x % 32) / 4 + 8 * r);
        lse2[r] = st.lse2, delta[r] = st.delta;
    }
}

// P = exp2(s * scale_log2 - lse_log2) where the key is visible (key < seqlen_k; causal: key <= query + diag), else
// exactly 0 (a select, not a product with a mask: LSE = -inf on a row that saw no key must not make a NaN). The
// values are the mask policy's (mask.cuh); its visible(), called here, compiled the dK/dV pass to other
// instructions, so the causal test stays written out (docs/kernels/masks.md).
__forceinline__ __device__ float recompute_p(float s, float scale_log2, float lse_log2, int key, int query,
                                             int seqlen_k, int diag, bool causal) {
    const bool visible = key < seqlen_k && !(causal && key > query + diag);
    return visible ? exp2f_approx(s * scale_log2 - lse_log2) : 0.f;
}
// recompute_p under a mask policy: the written-out test for CausalMask, AttnMask's own (its transforms too).
// seqlen_k: the policy's, where the caller holds it already (fa2_bwd's dQ pass at d 224 spilled when it was read
// from the policy here)
__forceinline__ __device__ float recompute_p(const CausalMask& m, float s, float scale_log2, float lse_log2, int key,
                                             int query, int seqlen_k) {
    return recompute_p(s, scale_log2, lse_log2, key, query, seqlen_k, m.diag, m.causal);
}
__forceinline__ __device__ float recompute_p(const AttnMask& m, float s, float scale_log2, float lse_log2, int key,
                                             int query, int) {
    return m.p_of(s, scale_log2, lse_log2, query, key);
}

// A operand (16 x 16) of rows [row0, row0+16), reduction cols [col0, col0+16) of a matrix A stored transposed in
// a row-major tile (tile row = A's column): ldmatrix.trans hands each lane A's pair (row g, cols 2t, 2t+1), the
// a0..a3 order of load_a (mma_16816 in ptx.cuh).
template <class TILE>
__forceinline__ __device__ void load_a_trans(u32 (&a)[4], u32 tile, int row0, int col0) {
    const int l = lane_id();
    ldmatrix_x4_trans(a, TILE::at(tile, col0 + (l % 8) + 8 * (l / 16), row0 + 8 * ((l / 8) % 2)));
}

//   acc (16 x 8DT) += A B     A: rows [a_row, a_row + 16) of a matrix stored transposed in tile TA ([k][row]),
//                             over k [0, 16 KSTEPS); B: rows [0, 16 KSTEPS) of tile TB (the reduction), its
//                             columns [0, 8DT) from tile_b (offset the base for a slice), as V in O = P V
template <class T, class TA, class TB, int KSTEPS, int DT>
__forceinline__ __device__ void warp_mma_atb(float (&acc)[1][DT][4], u32 tile_a, int a_row, u32 tile_b) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        u32 a[4];
        load_a_trans<TA>(a, tile_a, a_row, kk * 16);
#pragma unroll
        for (int dt = 0; dt < DT; dt += 2) {
            u32 b[4];
            load_b_cols<TB>(b, tile_b, kk * 16, dt * 8);
            mma_16816<T>(acc[0][dt], a, b[0], b[1]);
            mma_16816<T>(acc[0][dt + 1], a, b[2], b[3]);
        }
    }
}

// One step of a warp owning keys [key0 + kr0, key0 + kr0 + 16) (rows kr0.. of the K and V tiles, Tile<*, D>)
// against a Q block of BM queries from m0 (Q and dO tiles, Tile<BM, D>; lse2 = LSE * log2(e) and D per query, in
// shared memory, LSE = +inf past seqlen_q so that P = 0 there). In registers, keys as rows and queries as columns:
//   S^T = K_w Q^T (over all D columns), P^T = exp(S^T - LSE)         (recompute_p)
//   dV_w[:, c0 + 8DCT) += P^T dO[:, c0 + 8DCT)                        P^T repacked as the A operand
//   dP^T = V_w dO^T (over all D columns), dS^T = P^T (dP^T - D)       left in ds for the caller (fa1: dQ)
//   dK_w[:, c0 + 8DCT) += dS^T Q[:, c0 + 8DCT)                        unscaled: the caller multiplies by scale
// c0: the first column of the gradients' slice (a multiple of 8; 0 and 8DCT = D when there is no split). mask: the
// mask policy (mask.cuh); its values are read once, here.
template <class T, int D, int BM, int BN, int DCT, class Mask>
__forceinline__ __device__ void key_rows_step(float (&dk)[1][DCT][4], float (&dv)[1][DCT][4], float (&ds)[1][BM / 8][4],
                                              u32 sK, u32 sV, int kr0, u32 sQ, u32 sdO, int c0,
                                              const float* lse2, const float* delta, float scale_log2, int key0,
                                              int m0, const Mask& mask) {
    using TQ = Tile<BM, D>;
    using TKV = Tile<BN, D>;
    constexpr int NT = BM / 8;
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;

    float pt[1][NT][4] = {};
    warp_mma_abt<T, TKV, TQ, D / 16>(pt, sK, kr0, sQ);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = nt * 8 + 2 * t + (e % 2);
            pt[0][nt][e] = recompute_p(mask, pt[0][nt][e], scale_log2, lse2[col], key0 + kr0 + g + 8 * (e / 2),
                                       m0 + col, mask.seqlen_k);
        }

    warp_mma_pb<T, TQ>(dv, pt, sdO + 2 * c0);

#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[0][nt][e] = 0.f;
    warp_mma_abt<T, TKV, TQ, D / 16>(ds, sV, kr0, sdO);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = nt * 8 + 2 * t + (e % 2);
            ds[0][nt][e] = pt[0][nt][e] * (ds[0][nt][e] - delta[col]);
            if constexpr (Mask::TRANSFORMS)
                ds[0][nt][e] = mask.ds_raw(ds[0][nt][e], pt[0][nt][e], scale_log2, lse2[col], m0 + col,
                                           key0 + kr0 + g + 8 * (e / 2));
        }

    warp_mma_pb<T, TQ>(dk, ds, sQ + 2 * c0);
}

}  // namespace fav
