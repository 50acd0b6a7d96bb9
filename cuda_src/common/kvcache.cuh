// The KV cache as decoding reads and appends to it: where token t of a sequence lives (contiguous or through the
// page table), how long each sequence is, and the element formats a cache may hold.
#pragma once
#include "math.cuh"
#include "params.cuh"

namespace fav {

// A sequence's keys once this call's are appended, and whether the cache can hold them: a sequence whose length
// is negative or past the cache's capacity is never read or written (its rows come out NaN).
struct Sequence {
    int cached;     // cache_seqlens[b]: keys before the append
    int seqlen_k;   // cached + seqlen_new
    bool fits;
    template <class Params>
    __forceinline__ __device__ static Sequence of(const Params& p, int b) {
        const int cached = p.cache_seqlens[b], seqlen_k = cached + p.seqlen_new;
        return {cached, seqlen_k, cached >= 0 && seqlen_k <= p.capacity};
    }
};

// Token t's row in a cache of sequence b at one KV head: `at(t)` gives the row's index along the cache's first axis
// (the sequence itself, or its page) and along the second. PAGED: through page_table; a page index outside
// [0, num_pages) clears `ok` and points at row (0, 0), which exists, so nothing is read or written out of bounds.
template <bool PAGED>
struct CacheRows {
    int b;
    const int* pages;   // page_table's row of sequence b (PAGED)
    int page_size, num_pages;

    template <class Params>
    __forceinline__ __device__ static CacheRows of(const Params& p, int b) {
        return {b, PAGED ? p.page_table + (i64)b * p.max_pages : nullptr, p.page_size, p.num_pages};
    }
    // (first-axis index, second-axis index) of token t
    __forceinline__ __device__ int2 at(int t, bool& ok) const {
        if constexpr (PAGED) {
            const int index = t / page_size;
            return checked(make_int2(pages[index], t - index * page_size), ok);
        } else {
            return make_int2(b, t);
        }
    }
    // Paged: the page-table entries of tokens t0, t0 + STEP, ..., t0 + (N - 1) STEP as (page, row) pairs, not yet
    // checked (`checked` does that where they are used, so that the loads are all in flight together and nothing
    // waits for them here); tokens at or past `end` (or all, when !valid) are (0, 0) and not looked up. One
    // division for all N: the page advances by carries.
    template <int N, int STEP>
    __forceinline__ __device__ void lookup_run(int t0, int end, bool valid, int2 (&rows)[N]) const {
        static_assert(PAGED, "a contiguous cache has nothing to look up");
        int index[N], offset[N];
        index[0] = t0 / page_size, offset[0] = t0 - index[0] * page_size;
#pragma unroll
        for (int i = 1; i < N; ++i) {
            index[i] = index[i - 1], offset[i] = offset[i - 1] + STEP;
            for (; offset[i] >= page_size; offset[i] -= page_size) ++index[i];  // once for pages >= STEP
        }
#pragma unroll
        for (int i = 0; i < N; ++i)
            rows[i] = valid && t0 + i * STEP < end ? make_int2(pages[index[i]], offset[i]) : make_int2(0, 0);
    }
    // A looked-up (page, row), or (0, 0), which exists, with `ok` cleared when the page is outside [0, num_pages).
    __forceinline__ __device__ int2 checked(int2 row, bool& ok) const {
        const bool in_range = (unsigned)row.x < (unsigned)num_pages;
        ok = ok && in_range;
        return in_range ? row : make_int2(0, 0);
    }
};

// The element formats of a cache: 16-bit (q's) or e4m3 (one byte: K converted in registers to q's format, V in
// shared memory to fp16; decode_fwd.cu says why).
// PV<T>: the format P and V meet in for O += P V, with q in format T.
struct Bits16 {
    using Elem = u16;
    static constexpr int BYTES = 2;
    template <class T>
    using PV = T;
};
struct E4M3 {
    using Elem = unsigned char;
    static constexpr int BYTES = 1;
    template <class T>
    using PV = Half;  // e4m3 is exact in fp16 (one conversion instruction), and P in [0, 1] is finer there than in bf16
};

}  // namespace fav
