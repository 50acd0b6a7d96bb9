// q, k or v of a head dim that is not a multiple of 8, copied into rows padded with zeros to the next one: the
// attention kernels read 16-byte chunks of 16-byte aligned rows, which rows of an odd number of 16-bit elements
// are not. One pass, 2-byte accesses coalesced along the row; the padded columns add nothing to Q K^T or P V.
#include "common/params.cuh"

// ROWS rows per CTA, one thread per column (width <= THREADS).
template <int THREADS, int ROWS>
__global__ void __launch_bounds__(THREADS)
pad_head_dim(const fav::PadParams p) {
    const int c = threadIdx.x;
    if (c >= p.width) return;
    for (int i = 0; i < ROWS; ++i) {
        const int r = blockIdx.x * ROWS + i;
        if (r >= p.rows) return;
        const int h = r % p.heads, n = (r / p.heads) % p.seqlen, b = r / (p.heads * p.seqlen);
        const u16 x = c < p.head_dim ? p.src[b * p.s_b + n * p.s_n + h * p.s_h + c] : (u16)0;
        p.dst[(i64)r * p.width + c] = x;
    }
}
