// Standard attention's middle step: P = softmax(scale * S) row by row, in place over S (fp32), with the
// bottom-right causal mask and the row's log-sum-exp. The two GEMMs around it are cuBLAS (through CuPy).
#include "common/math.cuh"

// One CTA per row of S; rows are ordered (batch, head, query). THREADS threads stride over the keys.
template <int THREADS>
__global__ void __launch_bounds__(THREADS)
row_softmax(float* __restrict__ S, float* __restrict__ lse, i64 rows, int seqlen_q, int seqlen_k,
            float scale_log2, int causal) {
    const i64 row = blockIdx.x;
    if (row >= rows) return;
    float* s = S + row * (i64)seqlen_k;
    const int query = (int)(row % seqlen_q);
    // Keys 0 .. last are visible; bottom-right alignment shifts the diagonal by seqlen_k - seqlen_q.
    const int last = causal ? min(seqlen_k - 1, query + seqlen_k - seqlen_q) : seqlen_k - 1;

    __shared__ float red[THREADS / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

    float m = fav::neg_inf();
    for (int j = threadIdx.x; j <= last; j += THREADS) m = fmaxf(m, s[j] * scale_log2);
    m = fav::warp_max(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = fav::neg_inf();
    for (int w = 0; w < THREADS / 32; ++w) m = fmaxf(m, red[w]);
    __syncthreads();

    float l = 0.f;
    for (int j = threadIdx.x; j <= last; j += THREADS) l += fav::exp2f_approx(s[j] * scale_log2 - m);
    l = fav::warp_sum(l);
    if (lane == 0) red[warp] = l;
    __syncthreads();
    l = 0.f;
    for (int w = 0; w < THREADS / 32; ++w) l += red[w];

    // A row with no visible key (causal, seqlen_q > seqlen_k) gets P = 0 and lse = -inf, never NaN.
    const float inv_l = last >= 0 ? 1.f / l : 0.f;
    for (int j = threadIdx.x; j < seqlen_k; j += THREADS)
        s[j] = j <= last ? fav::exp2f_approx(s[j] * scale_log2 - m) * inv_l : 0.f;
    if (threadIdx.x == 0) lse[row] = last >= 0 ? (m + __log2f(l)) * 0.69314718055994531f : fav::neg_inf();
}
