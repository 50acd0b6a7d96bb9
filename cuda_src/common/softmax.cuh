// The softmax pieces shared by the FA1 and FA2 kernels, on mma.sync accumulator fragments.
//
// A warp's S block is float s[MT][NT][4]: MT m-tiles of 16 rows, NT n-tiles of 8 keys (layout of mma_16816's C).
// Thread (g = lane/4, t = lane%4) holds rows g and g+8 of each m-tile: s[mt][nt][0..1] are row g, keys
// 8nt+2t, 8nt+2t+1; s[mt][nt][2..3] row g+8. A row is spread over the 4 threads of a quad: reduce with shfl 1, 2.
#pragma once
#include "math.cuh"

namespace fav {

__forceinline__ __device__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__forceinline__ __device__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// f(score, row, key) for each of a warp's scores of a block, its rows from row0 and keys from key0 (the layout
// above: the mask policies' element walk).
template <int MT, int NT, class F>
__forceinline__ __device__ void for_each_score(float (&s)[MT][NT][4], int row0, int key0, const F& f) {
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                f(s[mt][nt][e], row0 + mt * 16 + g + 8 * (e / 2), key0 + nt * 8 + 2 * t + (e % 2));
}

// Row maxima of a block (over the quad too), one per (m-tile, half): max[mt][0] row g, max[mt][1] row g+8,
// each folded into the value mx holds. A thread's 2 NT values of a row are reduced as a tree (depth log2 2 NT
// rather than a chain of 2 NT dependent FMNMX: the row max is on every block's critical path).
template <int MT, int NT>
__forceinline__ __device__ void row_max(const float (&s)[MT][NT][4], float (&mx)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float x[NT];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) x[nt] = fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]);
#pragma unroll
            for (int width = 1; width < NT; width *= 2)
#pragma unroll
                for (int nt = 0; nt + width < NT; nt += 2 * width) x[nt] = fmaxf(x[nt], x[nt + width]);
            mx[mt][h] = quad_max(fmaxf(mx[mt][h], x[0]));
        }
}

// row_max by a signed-integer max of the scores' bit patterns, three at a time (sm_90's VIMNMX3, a DPX instruction,
// about half the instructions of FMNMX's pairs; __vimax3_s32 is emulated below sm_90, where nothing uses this).
// Non-negative floats (+inf and NaN above the finite ones) order as their patterns do, and every pattern with the
// sign bit set is below all of them, so wherever a row holds a score whose sign bit is clear the integer max is the
// float max. A row of negative scores only (rare outside the masked blocks, which do not use this) sends its warp to
// row_max's float path, after the quad's reduction. A NaN score gives a NaN max, where fmaxf would skip it: the
// row's output is NaN either way (exp2 of NaN).
template <int N>
__forceinline__ __device__ int max3_tree(const int (&x)[N]) {
    if constexpr (N == 1) {
        return x[0];
    } else if constexpr (N == 2) {
        return max(x[0], x[1]);
    } else {
        constexpr int M = (N + 2) / 3;
        int y[M];
#pragma unroll
        for (int i = 0; i < M; ++i)
            y[i] = 3 * i + 2 < N ? __vimax3_s32(x[3 * i], x[3 * i + 1], x[3 * i + 2])
                 : 3 * i + 1 < N ? max(x[3 * i], x[3 * i + 1]) : x[3 * i];
        return max3_tree(y);
    }
}
template <int MT, int NT>
__forceinline__ __device__ void row_max_int(const float (&s)[MT][NT][4], float (&mx)[MT][2]) {
    int r[MT][2];
    bool negative = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int x[2 * NT];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                x[2 * nt] = __float_as_int(s[mt][nt][2 * h]);
                x[2 * nt + 1] = __float_as_int(s[mt][nt][2 * h + 1]);
            }
            r[mt][h] = max3_tree(x);
        }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            r[mt][h] = max(r[mt][h], __shfl_xor_sync(0xffffffffu, r[mt][h], 1));
            r[mt][h] = max(r[mt][h], __shfl_xor_sync(0xffffffffu, r[mt][h], 2));
            negative |= r[mt][h] < 0;
        }
    // (warp-uniform: row_max's quad shuffles take the whole warp)
    if (!__any_sync(0xffffffffu, negative)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) mx[mt][h] = fmaxf(mx[mt][h], __int_as_float(r[mt][h]));
    } else {  // a row of the warp's whose every score is negative (or -0, -inf, a negative NaN)
        row_max(s, mx);
    }
}

// The reference point subtracted before exponentiating, in log2 units: m * scale * log2(e). A row whose scores
// are all -inf so far uses 0 instead, so that exp2(-inf - ref) = 0 rather than NaN.
__forceinline__ __device__ float exp2_ref(float m, float scale_log2) {
    return m == neg_inf() ? 0.f : m * scale_log2;
}

// s <- exp2(s * scale_log2 - ref) in place (P~), and this thread's partial row sums added to sum[mt][h]
// (not reduced over the quad: the row sum is only needed at the end, so FA2 reduces it once there).
// FMA_EVERY > 0: every FMA_EVERY-th value of each thread's by exp2f_fma on the FMA units instead of the MUFU.
template <int FMA_EVERY = 0, int MT, int NT>
__forceinline__ __device__ void exponentiate(float (&s)[MT][NT][4], const float (&ref)[MT][2], float scale_log2,
                                             float (&sum)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float x = fmaf(s[mt][nt][e], scale_log2, -ref[mt][e / 2]);
                const bool fma = FMA_EVERY > 0 && (nt * 4 + e) % (FMA_EVERY > 0 ? FMA_EVERY : 1) == FMA_EVERY - 1;
                const float p = fma ? exp2f_fma(x) : exp2f_approx(x);
                s[mt][nt][e] = p;
                sum[mt][e / 2] += p;
            }
}

// Multiply every row of an accumulator (C layout, MT x NT' x 4) by a per-row factor.
template <int MT, int NT>
__forceinline__ __device__ void scale_rows(float (&acc)[MT][NT][4], const float (&f)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] *= f[mt][e / 2];
}

// Where a row's reference point goes once its running max is m_cand (both in log2 units): FA2 moves it to every
// new max (tau = 0: alpha = 1 exactly when the max did not grow). FA4's lazy rescaling (tau > 0) moves it only when
// the max has grown by more than tau, so that P~ = exp2(s - ref) stays at most 2^tau and O's rescale is mostly
// skipped. Moving from -inf always happens (+inf > tau); a row still all -inf stays (NaN > tau is false).
__forceinline__ __device__ bool reference_moves(float m_cand, float m_old, float tau) { return m_cand - m_old > tau; }

// FlashAttention-2's online-softmax step for one block, deferred normalization: the new running max, l rescaled
// by alpha = exp2(m_old - m_new) (never divided here), then P~ = exp2(s * scale_log2 - m_new) in place with its row
// sums added to l. m is kept in the units of s; scale_log2 turns them into log2 units (1 when s already is).
// LAZY (fa3): m is the row's reference point instead, moved only as reference_moves says (tau in log2 units), and
// the result says whether a reference of this thread's rows moved: where none did, alpha = 1 and O needs no
// rescale. Without LAZY (fa2's kernels, whose machine code this keeps as it was) the result is always true.
// O must be rescaled by the same alpha: online_softmax_step does it at once; a kernel whose O is still being
// written by the tensor cores (fa2_fp8_fwd_sm90.cu, fa3_fwd.cu) takes alpha and rescales O once the MMA is done.
template <bool LAZY = false, int MT, int NT>
__forceinline__ __device__ bool online_softmax_rescale(float (&s)[MT][NT][4], float (&m)[MT][2], float (&l)[MT][2],
                                                       float scale_log2, float (&alpha)[MT][2], float tau = 0.f) {
    float m_new[MT][2], ref[MT][2];
    bool moved = !LAZY;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) m_new[mt][0] = m[mt][0], m_new[mt][1] = m[mt][1];
    row_max(s, m_new);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if constexpr (LAZY) {
                const bool move = reference_moves(m_new[mt][r] * scale_log2, m[mt][r] * scale_log2, tau);
                const float m_ref = move ? m_new[mt][r] : m[mt][r];
                ref[mt][r] = exp2_ref(m_ref, scale_log2);
                alpha[mt][r] = move ? exp2f_approx(m[mt][r] * scale_log2 - ref[mt][r]) : 1.f;
                m[mt][r] = m_ref;
                moved |= move;
            } else {
                ref[mt][r] = exp2_ref(m_new[mt][r], scale_log2);
                alpha[mt][r] = exp2f_approx(m[mt][r] * scale_log2 - ref[mt][r]);
                m[mt][r] = m_new[mt][r];
            }
            l[mt][r] *= alpha[mt][r];
        }
    exponentiate(s, ref, scale_log2, l);
    return moved;
}

// The same step for a kernel whose scores come with a scale per block (fa3_fp8: the dequantization scales of the
// block's Q tile and K block times scale_log2, f > 0) and whose P~ is wanted times 2^p_log2 (fp8.cuh's P_SCALE):
// m is kept in log2 units, the block's raw row max is scaled once per row, and both f and 2^p_log2 ride on the
// exponent's FMA, P~ = exp2(s f - (m_new - p_log2)), instead of two multiplies per score. l sums the scaled P~:
// the epilogue divides by it (the 2^p_log2 in O cancels) and takes p_log2 off the LSE. (Summing P~ on the tensor
// cores instead, a column of ones beside V, biased l low as it grew: QGMMA's accumulator truncates. A fresh
// accumulator per block was slower and still moved the LSE: docs/refuted.md.)
// tau and the result: online_softmax_rescale's.
// turn: a kernel that takes turns at the exponentials (fa3_fwd.cu's EXP_TURNS) waits for its turn before them
// and passes it on after them, given the row sums (which depend on every exponential: the pass may then not be
// scheduled before them); NoTurn does neither. INT_MAX: the block's row maxima by row_max_int (sm_90).
struct NoTurn {
    __forceinline__ __device__ void wait() const {}
    template <class L>
    __forceinline__ __device__ void pass(const L&) const {}
};
template <bool INT_MAX = false, int FMA_EVERY = 0, int MT, int NT, class Turn = NoTurn>
__forceinline__ __device__ bool online_softmax_rescale_folded(float (&s)[MT][NT][4], float (&m)[MT][2],
                                                              float (&l)[MT][2], float f, float p_log2,
                                                              float (&alpha)[MT][2], float tau = 0.f,
                                                              const Turn& turn = Turn()) {
    float mx[MT][2], ref[MT][2];
    bool moved = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) mx[mt][0] = mx[mt][1] = neg_inf();
    if constexpr (INT_MAX) row_max_int(s, mx);
    else row_max(s, mx);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float m_cand = fmaxf(m[mt][r], mx[mt][r] * f);
            const bool move = reference_moves(m_cand, m[mt][r], tau);
            const float m_new = move ? m_cand : m[mt][r], base = exp2_ref(m_new, 1.f);
            alpha[mt][r] = move ? exp2f_approx(m[mt][r] - base) : 1.f;
            l[mt][r] *= alpha[mt][r];
            m[mt][r] = m_new;
            ref[mt][r] = base - p_log2;
            moved |= move;
        }
    turn.wait();
    exponentiate<FMA_EVERY>(s, ref, f, l);
    turn.pass(l);
    return moved;
}

template <int MT, int NT, int DT>
__forceinline__ __device__ void online_softmax_step(float (&s)[MT][NT][4], float (&m)[MT][2], float (&l)[MT][2],
                                                    float (&o)[MT][DT][4], float scale_log2) {
    float alpha[MT][2];
    online_softmax_rescale(s, m, l, scale_log2, alpha);
    scale_rows(o, alpha);
}

}  // namespace fav
