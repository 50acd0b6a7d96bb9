// The in-place append of a decoding step's new keys and values to its KV cache: k[b, i], v[b, i] into row
// cache_seqlens[b] + i of sequence b (through the page table when paged), before the step attends to them. One
// warp per (b, i, KV head) row, in the cache's element type. A row past the cache's capacity, or on a page outside
// it, is not written (the host refuses such calls where it can see the lengths; decode_fwd.cu turns the sequence's
// rows to NaN).
#include "common/kvcache.cuh"
#include "common/ptx.cuh"

constexpr int APPEND_WARPS = 4;

// E: the cache's element (u16, or unsigned char for e4m3); PAGED: through page_table.
template <class E, bool PAGED>
__global__ void __launch_bounds__(APPEND_WARPS * 32)
kv_append(const fav::AppendParams p) {
    using namespace fav;
    griddep_launch_dependents();  // decode_split may start now: it waits for this grid's writes before reading
    const i64 item = (i64)blockIdx.x * APPEND_WARPS + threadIdx.x / 32;
    if (item >= (i64)p.batch * p.seqlen_new * p.heads_kv) return;
    const int h = item % p.heads_kv, i = (item / p.heads_kv) % p.seqlen_new;
    const int b = item / ((i64)p.heads_kv * p.seqlen_new);
    const Sequence seq = Sequence::of(p, b);
    if (!seq.fits) return;
    bool ok = true;
    const int2 at = CacheRows<PAGED>::of(p, b).at(seq.cached + i, ok);
    if (!ok) return;
    const E* k = static_cast<const E*>(p.k) + b * p.kn_b + i * p.kn_n + h * p.kn_h;
    const E* v = static_cast<const E*>(p.v) + b * p.vn_b + i * p.vn_n + h * p.vn_h;
    E* kc = static_cast<E*>(p.k_cache) + at.x * p.k_b + at.y * p.k_n + h * p.k_h;
    E* vc = static_cast<E*>(p.v_cache) + at.x * p.v_b + at.y * p.v_n + h * p.v_h;
    for (int c = threadIdx.x % 32; c < p.head_dim; c += 32) {
        kc[c] = k[c];
        vc[c] = v[c];
    }
}
