// Standard attention's backward, the two elementwise steps between its cuBLAS products (kernels/naive.py):
//   naive_bwd_p   P = exp(S * scale - LSE) in place over S (fp32): the forward's P, recomputed from its LSE, with the
//                 bottom-right causal mask (exactly 0 where masked, also on a row with LSE = -inf)
//   naive_bwd_ds  dS = P o (dP - D) in place over dP (fp32), D = rowsum(dO o O) per row
// Rows of S, P, dP and dS are ordered (batch, head, query), as the forward's row_softmax; THREADS threads of one CTA
// stride over a row's keys.
#include "common/math.cuh"

template <int THREADS>
__global__ void __launch_bounds__(THREADS)
naive_bwd_p(float* __restrict__ S, const float* __restrict__ lse, i64 rows, int seqlen_q, int seqlen_k,
            float scale_log2, int causal) {
    const i64 row = blockIdx.x;
    if (row >= rows) return;
    float* s = S + row * (i64)seqlen_k;
    const int query = (int)(row % seqlen_q);
    const int last = causal ? min(seqlen_k - 1, query + seqlen_k - seqlen_q) : seqlen_k - 1;
    const float lse2 = lse[row] * 1.4426950408889634f;
    for (int j = threadIdx.x; j < seqlen_k; j += THREADS)
        s[j] = j <= last ? fav::exp2f_approx(s[j] * scale_log2 - lse2) : 0.f;
}

template <int THREADS>
__global__ void __launch_bounds__(THREADS)
naive_bwd_ds(float* __restrict__ dP, const float* __restrict__ P, const float* __restrict__ delta, i64 rows,
             int seqlen_k) {
    const i64 row = blockIdx.x;
    if (row >= rows) return;
    const i64 at = row * (i64)seqlen_k;
    const float d = delta[row];
    for (int j = threadIdx.x; j < seqlen_k; j += THREADS) dP[at + j] = P[at + j] * (dP[at + j] - d);
}
