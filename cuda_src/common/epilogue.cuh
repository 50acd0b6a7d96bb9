// The end of a forward: what a CTA does with its rows once the K/V loop is over. One rule for every kernel, and
// one interface (Policy::store(rows, params, ...)) with four policies:
//   NormalizedOut   O / l in the input's format and LSE = m + ln l, staged through shared memory  (fa2, fa3)
//   SwizzledOut     the same, written into a swizzled shared tile that TMA then stores     (fa3's persistent grid)
//   DirectOut       the same, stored from registers                     (fa3's persistent grid, tiles without keys)
//   Fp8DequantOut   O * s_v / (256 l): undoes P's x256 and V's per-channel scale (fa2_fp8, fa3_fp8; from
//                   registers, or ::staged through shared memory where a CTA's loop has left it free)
//   PartialOut      unnormalized O, m (log2 units) and l to a float32 workspace            (split-KV)
// fa1 keeps O normalized in HBM at every step (Algorithm 1), so it uses the rule (finish_row) but no policy.
//
// The bad-value rule: a row whose sum is exactly 0 saw no key (masked), and gives O = 0, LSE = -inf. Anything
// else is divided through, so a NaN or Inf in q or k (which makes the row's sum NaN) gives NaN, as torch SDPA
// does; a NaN in v gives NaN in the columns it reaches through P V.
#pragma once
#include "params.cuh"
#include "softmax.cuh"
#include "tile.cuh"

namespace fav {

constexpr float LN2 = 0.6931471805599453f;

// 1 / sum, or 0 for a row that saw no key. NaN is not <= 0, so a NaN sum stays NaN.
__forceinline__ __device__ float inv_or_zero(float sum) { return sum <= 0.f ? 0.f : 1.f / sum; }

struct RowEnd {
    float inv;   // what O is multiplied by
    float lse;   // natural-log LSE of the row
};
// m_log2: the row max already in log2 units (m * scale_log2); sum: the row's full sum (reduced over the quad).
__forceinline__ __device__ RowEnd finish_row(float sum, float m_log2) {
    return {inv_or_zero(sum), sum <= 0.f ? neg_inf() : (m_log2 + __log2f(sum)) * LN2};
}

// A warp's rows at the end of the K/V loop, as mma.sync C fragments (softmax.cuh's layout): rows g and g+8 of
// each m-tile, l not yet reduced over the quad. m times m_scale is in log2 units (scale_log2 for fa2, whose m is
// in score units; 1 for fa2_fp8, which folds the scale into the scores).
template <int MT, int DT>
struct WarpRows {
    const float (&o)[MT][DT][4];
    const float (&m)[MT][2];
    const float (&l)[MT][2];
    float m_scale;
    int b, h, row0;   // batch, query head, this warp's first query row (absolute)
};

__forceinline__ __device__ void store_lse(float* lse, int b, int h, int heads, int seqlen_q, int row, float x) {
    if (lse != nullptr && row < seqlen_q) lse[((i64)b * heads + h) * seqlen_q + row] = x;
}
// A row's LSE where a kernel's parameters put it: (batch, heads, seqlen_q) for the plain forwards; for the masked
// one, whose per-sequence view has its pointer at the sequence's first row, a head stride of its own (packed calls
// give (heads, total_q), flash-attn's varlen layout).
template <class Params>
__forceinline__ __device__ void store_row_lse(const Params& p, int b, int h, int row, float x) {
    store_lse(p.lse, b, h, p.heads, p.seqlen_q, row, x);
}
__forceinline__ __device__ void store_row_lse(const MaskedFwdParams& p, int, int h, int row, float x) {
    if (p.lse != nullptr && row < p.seqlen_q) p.lse[h * p.lse_h + row] = x;
}

// Each of a warp's rows ended (finish_row of its quad-reduced sum and its max in log2 units, less `lse_log2`: a
// power of two its sum still holds), its LSE stored by the quad's first thread; `inv`: what the row's O is
// multiplied by, times `inv_scale`. For the policies that stage O: their stores follow for all rows at once.
template <int MT, int DT, class Params>
__forceinline__ __device__ void finish_rows(const WarpRows<MT, DT>& r, const Params& p, float (&inv)[MT][2],
                                            float lse_log2 = 0.f, float inv_scale = 1.f) {
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
            const RowEnd e = finish_row(quad_sum(r.l[mt][h2]), r.m[mt][h2] * r.m_scale - lse_log2);
            inv[mt][h2] = e.inv * inv_scale;
            if (t == 0) store_row_lse(p, r.b, r.h, r.row0 + mt * 16 + g + 8 * h2, e.lse);
        }
}

// A warp's accumulator rows (mma C layout, MT m-tiles), each times its factor f (rows g and g+8) and, given
// col_scale, each column times its own, converted to T and written through the warp's own rows of a shared tile
// (stride Tile<*, D>::STRIDE) with 16-byte stores: rows at or beyond valid_rows and columns at or beyond
// valid_cols are not stored (the backward's gradients).
template <class T, int D, int MT, int DT>
__forceinline__ __device__ void store_acc_rows(const float (&acc)[MT][DT][4], const float (&f)[MT][2], u16* stage,
                                               u16* __restrict__ dst, i64 ld, int valid_rows, int valid_cols,
                                               const float* __restrict__ col_scale = nullptr) {
    constexpr int STRIDE = Tile<16, D>::STRIDE;
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
            const int row = mt * 16 + g + 8 * h2;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const int c = dt * 8 + 2 * t;
                const float x = acc[mt][dt][2 * h2] * f[mt][h2], y = acc[mt][dt][2 * h2 + 1] * f[mt][h2];
                *reinterpret_cast<u32*>(stage + row * STRIDE + dt * 8 + 2 * t) =
                    col_scale ? T::pack(x * col_scale[c], y * col_scale[c + 1]) : T::pack(x, y);
            }
        }
    __syncwarp();
    store_rows_warp<MT * 16, D>(dst, ld, stage, valid_rows, valid_cols);
}

// O / l in T through the warp's own rows of a shared tile (stride Tile<*, D>::STRIDE) for 16-byte stores:
// store_acc_rows with the rows' 1 / l as factors; columns >= head_dim not stored; LSE by the quad's first thread.
template <class T, int D>
struct NormalizedOut {
    template <int MT, int DT, class Params>
    __forceinline__ __device__ static void store(const WarpRows<MT, DT>& r, const Params& p, u16* stage) {
        float inv[MT][2];
        finish_rows(r, p, inv);
        store_acc_rows<T, D>(r.o, inv, stage, p.o + r.b * p.o_b + (i64)r.row0 * p.o_n + r.h * p.o_h, p.o_n,
                             p.seqlen_q - r.row0, p.head_dim);
    }
};

// O / l straight from the accumulator registers (4-byte stores: a quad writes 16 contiguous bytes of a row) and
// LSE by the quad's first thread, for a kernel whose shared memory is already taken by its next tile's loads
// (fa3's persistent grid). Same rule as NormalizedOut; rows past seqlen_q and columns past head_dim not stored.
template <class T, int D>
struct DirectOut {
    template <int MT, int DT, class Params>
    __forceinline__ __device__ static void store(const WarpRows<MT, DT>& r, const Params& p, u16* = nullptr) {
        const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {
                const RowEnd e = finish_row(quad_sum(r.l[mt][h2]), r.m[mt][h2] * r.m_scale);
                const int row = r.row0 + mt * 16 + g + 8 * h2;
                if (t == 0) store_row_lse(p, r.b, r.h, row, e.lse);
                if (row >= p.seqlen_q) continue;
                u16* dst = p.o + r.b * p.o_b + (i64)row * p.o_n + r.h * p.o_h;
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    const int col = dt * 8 + 2 * t;  // head_dim is a multiple of 8: col < head_dim covers col + 1
                    if (col < p.head_dim)
                        *reinterpret_cast<u32*>(dst + col) =
                            T::pack(r.o[mt][dt][2 * h2] * e.inv, r.o[mt][dt][2 * h2 + 1] * e.inv);
                }
            }
    }
};

// O / l in T written into the warp's rows of a shared Tile (common/wgmma.cuh's SwizzledTile of 2 D-byte rows,
// the layout a TMA box of it loads and stores), LSE by the quad's first thread. `tile_row0`: the warp's first row
// within the tile. The 128-byte swizzle puts a row's 16-byte chunk k at k ^ (row % 8), so the 8 rows of one
// store land in 8 distinct chunks: no bank conflict. The caller fences, synchronizes and has one thread store
// the tile by TMA, which also leaves out the rows past seqlen_q and the columns past head_dim (its tensor map's
// extent): fa3's persistent grid, whose O goes out through the Q buffer its tile no longer reads (fa3_fp8: a
// buffer of its own). fa3_fp8 passes Fp8DequantOut's column scales (V's channel scales) and the power of two its
// row sums hold (P_SCALE_LOG2, owed by the LSE).
template <class T, class Tile>
struct SwizzledOut {
    template <int MT, int DT, class Params>
    __forceinline__ __device__ static void store(const WarpRows<MT, DT>& r, const Params& p, u32 tile,
                                                 int tile_row0, const float* __restrict__ col_scale = nullptr,
                                                 float lse_log2 = 0.f) {
        const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {
                const RowEnd e = finish_row(quad_sum(r.l[mt][h2]), r.m[mt][h2] * r.m_scale - lse_log2);
                const int row = mt * 16 + g + 8 * h2;
                if (t == 0) store_row_lse(p, r.b, r.h, r.row0 + row, e.lse);
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    const int c = dt * 8 + 2 * t;
                    float x = r.o[mt][dt][2 * h2] * e.inv, y = r.o[mt][dt][2 * h2 + 1] * e.inv;
                    if (col_scale) x *= col_scale[c], y *= col_scale[c + 1];
                    st_shared(tile + Tile::offset(tile_row0 + row, 2 * c), T::pack(x, y));
                }
            }
    }
};

// Unnormalized O (fp32, D columns), m in log2 units and the reduced l, at row ((b * heads + h) * seqlen_q + row)
// of the workspaces: one launch's share of a split-KV forward, merged afterwards by rescaling each split's O and
// l by 2^(m_split - m_max). A split that saw no key of a row leaves l = 0, m = -inf there.
template <int D>
struct PartialOut {
    template <int MT, int DT>
    __forceinline__ __device__ static void store(const WarpRows<MT, DT>& r, const FwdParams& p, u16*) {
        const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {
                const float sum = quad_sum(r.l[mt][h2]);
                const int row = r.row0 + mt * 16 + g + 8 * h2;
                if (row >= p.seqlen_q) continue;
                const i64 at = ((i64)r.b * p.heads + r.h) * p.seqlen_q + row;
#pragma unroll
                for (int dt = 0; dt < DT; ++dt)
                    *reinterpret_cast<float2*>(p.o_ws + at * D + dt * 8 + 2 * t) =
                        make_float2(r.o[mt][dt][2 * h2], r.o[mt][dt][2 * h2 + 1]);
                if (t == 0) p.l_ws[at] = sum, p.m_ws[at] = sum <= 0.f ? neg_inf() : r.m[mt][h2] * r.m_scale;
            }
    }
};

// out = O * sv / (2^P_LOG2 l) in T, columns >= head_dim not stored; sv: this kv head's channel scales.
// 2^P_LOG2: the power of two P~ was multiplied by before its rounding to e4m3 (fp8.cuh's P_SCALE). P_IN_SUM: l
// summed the multiplied P~ (online_softmax_rescale_folded), so O / l has cancelled it and the LSE owes P_LOG2.
template <class T, int P_LOG2, bool P_IN_SUM = false>
struct Fp8DequantOut {
    template <int MT, int DT>
    __forceinline__ __device__ static void store(const WarpRows<MT, DT>& r, const Fp8FwdParams& p,
                                                 const float* __restrict__ sv) {
        const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {
                const RowEnd e = finish_row(quad_sum(r.l[mt][h2]), r.m[mt][h2] * r.m_scale - (P_IN_SUM ? P_LOG2 : 0));
                const float inv = P_IN_SUM ? e.inv : e.inv * (1.f / (1 << P_LOG2));  // exact: a power of two
                const int row = r.row0 + mt * 16 + g + 8 * h2;
                if (row >= p.seqlen_q) continue;
                u16* orow = p.o + r.b * p.o_b + (i64)row * p.o_n + r.h * p.o_h;
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    const int c = dt * 8 + 2 * t;
                    if (c < p.head_dim)
                        *reinterpret_cast<u32*>(orow + c) =
                            T::pack(r.o[mt][dt][2 * h2] * inv * sv[c], r.o[mt][dt][2 * h2 + 1] * inv * sv[c + 1]);
                }
                if (t == 0) store_lse(p.lse, r.b, r.h, p.heads, p.seqlen_q, row, e.lse);
            }
    }
    // The same values through the warp's own rows of a shared tile (stride Tile<*, D>::STRIDE), 16-byte stores
    // (NormalizedOut's staging): for a CTA whose shared memory is free once its loop is over.
    template <int D, int MT, int DT>
    __forceinline__ __device__ static void staged(const WarpRows<MT, DT>& r, const Fp8FwdParams& p,
                                                  const float* __restrict__ sv, u16* stage) {
        float inv[MT][2];
        finish_rows(r, p, inv, P_IN_SUM ? P_LOG2 : 0, P_IN_SUM ? 1.f : 1.f / (1 << P_LOG2));
        store_acc_rows<T, D>(r.o, inv, stage, p.o + r.b * p.o_b + (i64)r.row0 * p.o_n + r.h * p.o_h, p.o_n,
                             p.seqlen_q - r.row0, p.head_dim, sv);
    }
};

}  // namespace fav
