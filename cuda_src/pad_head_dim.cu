// q, k or v of a head dim that is not a multiple of 8, copied into rows padded with zeros to the next one: the
// attention kernels read 16-byte chunks of 16-byte aligned rows, which rows of an odd number of 16-bit elements
// are not. One pass, 2-byte accesses coalesced along the row; the padded columns add nothing to Q K^T or P V.
#include "common/params.cuh"

// ROWS rows per CTA, one thread per column (width <= THREADS). The rows' source offsets are worked out once per
// CTA (three divisions a row would otherwise cost every thread more than its copy), and each thread issues its
// ROWS loads before its first store: 2-byte accesses need that many in flight.
template <int THREADS, int ROWS>
__global__ void __launch_bounds__(THREADS)
pad_head_dim(const fav::PadParams p) {
    __shared__ i64 src_row[ROWS];
    const int c = threadIdx.x, r0 = blockIdx.x * ROWS;
    if (c < ROWS) {
        const int r = r0 + c;
        const int h = r % p.heads, n = (r / p.heads) % p.seqlen, b = r / (p.heads * p.seqlen);
        src_row[c] = b * p.s_b + n * p.s_n + h * p.s_h;
    }
    __syncthreads();
    if (c >= p.width) return;
    u16 x[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) x[i] = r0 + i < p.rows && c < p.head_dim ? p.src[src_row[i] + c] : (u16)0;
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
        if (r0 + i < p.rows) p.dst[(i64)(r0 + i) * p.width + c] = x[i];
}
