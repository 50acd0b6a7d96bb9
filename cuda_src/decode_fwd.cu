// FlashDecoding (Dao, Haziza, Massa, Sizov, 2023): attention of a few query tokens over a long KV cache, with the
// cache cut along its length so that a small batch still fills the card.
//
//   grid: (split s, Q tile x KV head g, batch b)   one CTA reads split s of sequence b's keys at KV head g, once
//   rows: GQA packing               the query heads that share KV head g, times the seqlen_q tokens, are the rows
//                                   of one Q tile (row r: token r / group, head g * group + r % group)
//   warps: split-K within the CTA   warp w takes keys [16w, 16w + 16) of every block of 64: with a handful of rows
//                                   there is nothing to split along Q. Each warp runs its own online softmax; the
//                                   CTA merges the four at the end (merge_states' algebra, in shared memory)
//   pipeline: an NSTAGE-deep cp.async ring of K/V blocks: a loop bound by its reads lives on the bytes in flight
//   e4m3 cache: K's bytes go from the ring straight into B fragments (its head dims and Q's permuted alike, so a
//                                   thread's four bytes are one register's load); V is converted to fp16 in shared
//                                   memory, as ldmatrix.trans has no 8-bit form, and P V runs in fp16
//   mask: PackedMask (mask.cuh)     causal, a window, a softcap, ALiBi, for packed rows: the splits cut only the keys
//                                   some row of the tile sees, so a window of w reads w + seqlen_q keys of any cache
//   end: one split: O / l and the LSE; more: the split's normalized O and its LSE in fp32 (merge_states.cu); the
//                                   sinks join split 0's rows where the warps' states are merged
//   launches: kv_append -> decode_split -> merge_states, each behind the one before with programmatic dependent
//                                   launch (sm_90): a kernel's launch overlaps the tail of the one it waits for
//
// Read beside fa2_fwd.cu: the same fragments, softmax and mask interface; the rows are packed heads, the warps
// split the keys instead of the queries, and the grid adds the split.
#include "common/epilogue.cuh"
#include "common/fragments.cuh"
#include "common/kvcache.cuh"
#include "common/mask.cuh"

namespace fav {
namespace decode {

constexpr int NWARPS = 4, THREADS = NWARPS * 32;
constexpr int KW = 16;             // keys per warp per block
constexpr int BN = NWARPS * KW;    // keys per block
constexpr int SPLIT_N = 128;       // the split granularity (reference/decode.py's DEFAULT_BLOCK_N)

// Shared memory: the Q tile, then NSTAGE stages of (K block, V block) as they land (KV's bytes per element, rows
// padded by 16 bytes), then for an e4m3 cache the fp16 V block it is converted into. At the end the warps' partial
// results take the place of the stages.
template <int D, int ROWS, int NSTAGE, class KV>
struct Smem {
    using TQ = Tile<ROWS, D>;
    using TKV = Tile<BN, D>;                              // a 16-bit K or V block, as the MMAs read it
    static constexpr bool DEQUANTIZES = KV::BYTES != 2;
    static constexpr int RAW_STRIDE = D * KV::BYTES + 16;  // bytes per landed row (16-bit: TKV's row)
    static constexpr int RAW_BYTES = BN * RAW_STRIDE;
    static constexpr int STAGES = TQ::BYTES;
    static constexpr int DEQUANT = STAGES + NSTAGE * 2 * RAW_BYTES;
    static constexpr int LOOP_BYTES = DEQUANT + (DEQUANTIZES ? TKV::BYTES : 0);
    static constexpr int O_STRIDE = D + 4;                // floats per row of a warp's partial O
    static constexpr int MERGE_BYTES = STAGES + NWARPS * ROWS * (2 + O_STRIDE) * 4;
    static constexpr int BYTES = LOOP_BYTES > MERGE_BYTES ? LOOP_BYTES : MERGE_BYTES;

    __forceinline__ __device__ static u32 k_raw(u32 base, int stage) { return base + STAGES + stage * 2 * RAW_BYTES; }
    __forceinline__ __device__ static u32 v_raw(u32 base, int stage) { return k_raw(base, stage) + RAW_BYTES; }
};

// Rows [r0, r0 + ROWS) of the packed Q tile of (b, KV head g): row r is token r / group of query head
// g * group + r % group; rows past seqlen_q * group and columns past head_dim are zero-filled.
template <int D, int ROWS>
__forceinline__ __device__ void load_q(u32 tile, const DecodeParams& p, int b, int g, int r0) {
    constexpr int CHUNKS = D / 8;
    const int rows = p.seqlen_q * p.group;
    for (int c = threadIdx.x; c < ROWS * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS, k = (c % CHUNKS) * 8, row = r0 + r;
        const bool ok = row < rows && k < p.head_dim;
        const int i = row / p.group, h = g * p.group + row % p.group;
        cp_async_16(Tile<ROWS, D>::at(tile, r, k), ok ? p.q + b * p.q_b + i * p.q_n + h * p.q_h + k : p.q, ok);
    }
}

// A thread's share of a K/V block's copies: 16 bytes at byte c of rows r, r + ROWS_PER_PASS, ... of the block.
// Paged, `locate` finds those rows (page-table loads) a block ahead of `load`, which issues the copies: the
// lookups' latency then passes while the block before is computed, not in front of the copies.
template <int D, class KV, bool PAGED>
struct BlockCopies {
    static constexpr int CHUNKS = D * KV::BYTES / 16, ROWS_PER_PASS = THREADS / CHUNKS, PASSES = BN / ROWS_PER_PASS;
    static constexpr int STRIDE = Smem<D, 16, 2, KV>::RAW_STRIDE;
    static_assert(THREADS % CHUNKS == 0 && BN % ROWS_PER_PASS == 0, "a pass covers whole rows");
    int2 at[PASSES];   // paged: (page, row) of each row as looked up; (0, 0) for rows not copied
    int key0;

    __forceinline__ __device__ static int r() { return threadIdx.x / CHUNKS; }
    __forceinline__ __device__ static int c() { return (threadIdx.x % CHUNKS) * 16; }

    // Keys [key0, key0 + BN): those at or past key_end, and bytes past row_bytes, are not copied.
    __forceinline__ __device__ void locate(const CacheRows<PAGED>& rows, int first_key, int key_end, int row_bytes) {
        key0 = first_key;
        if constexpr (PAGED) rows.template lookup_run<PASSES, ROWS_PER_PASS>(key0 + r(), key_end, c() < row_bytes, at);
    }
    // The located block into a stage (the zero-fill of what is not copied), K and V of one KV head (byte pointers
    // at the head, byte strides of the cache's first two axes).
    __forceinline__ __device__ void load(u32 dst_k, u32 dst_v, const unsigned char* k, const unsigned char* v,
                                         const i64 (&k_stride)[2], const i64 (&v_stride)[2],
                                         const CacheRows<PAGED>& rows, int key_end, int row_bytes,
                                         bool& pages_ok) const {
        const bool col_ok = c() < row_bytes;
        // Contiguous: the thread's rows are ROWS_PER_PASS apart in one sequence, a pointer stepped from the first;
        // paged: each row on its own page.
        const unsigned char *row_k = k + c(), *row_v = v + c();
        if constexpr (!PAGED) {
            row_k += rows.b * k_stride[0] + (i64)(key0 + r()) * k_stride[1];
            row_v += rows.b * v_stride[0] + (i64)(key0 + r()) * v_stride[1];
        }
        const i64 step_k = ROWS_PER_PASS * k_stride[1], step_v = ROWS_PER_PASS * v_stride[1];
#pragma unroll
        for (int i = 0; i < PASSES; ++i) {
            const int row = r() + i * ROWS_PER_PASS;
            const bool in = col_ok && key0 + row < key_end;
            const u32 off = row * STRIDE + c();
            const unsigned char *src_k = row_k, *src_v = row_v;
            if constexpr (PAGED) {
                const int2 at_i = rows.checked(at[i], pages_ok);
                src_k += at_i.x * k_stride[0] + at_i.y * k_stride[1];
                src_v += at_i.x * v_stride[0] + at_i.y * v_stride[1];
            } else {
                row_k += step_k, row_v += step_v;
            }
            cp_async_16(dst_k + off, in ? src_k : k, in);
            cp_async_16(dst_v + off, in ? src_v : v, in);
        }
    }
};

// Four e4m3 values (one register, the first in the lowest byte) -> four of T, two to a register.
template <class T>
__forceinline__ __device__ void e4m3x4_to(u32 x, u32& lo, u32& hi) {
    u32 h0, h1;  // f16x2: e4m3 is exact in fp16 (and in bf16)
    asm("{ .reg .b16 a, b; mov.b32 {a, b}, %2; cvt.rn.f16x2.e4m3x2 %0, a; cvt.rn.f16x2.e4m3x2 %1, b; }"
        : "=r"(h0), "=r"(h1) : "r"(x));
    if constexpr (T::is_bf16) {
        lo = T::pack(Half::to_float(h0 & 0xffff), Half::to_float(h0 >> 16));
        hi = T::pack(Half::to_float(h1 & 0xffff), Half::to_float(h1 >> 16));
    } else {
        lo = h0, hi = h1;
    }
}

// S = Q K_w^T over a warp's KW keys (two n-tiles), one struct per cache format, each keeping Q's A fragments in
// registers where they fit beside O (fa2_fwd.cu's rule, q_in_regs) and reading them again each block where they do
// not.
template <int D, int MT>
constexpr bool q_in_regs() {
    return MT * (D / 16) * 4 <= 32;
}

// A 16-bit K block: ldmatrix from the ring.
template <class T, class TQ, int D, int MT>
struct ScoresBits16 {
    using TKV = Tile<BN, D>;
    static constexpr bool Q_IN_REGS = q_in_regs<D, MT>();
    u32 q[Q_IN_REGS ? MT : 1][Q_IN_REGS ? D / 16 : 1][4];

    __forceinline__ __device__ void keep_q(u32 tile) {
        if constexpr (Q_IN_REGS)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) load_a<TQ>(q[mt][kk], tile, mt * 16, kk * 16);
    }
    __forceinline__ __device__ void operator()(float (&sc)[MT][KW / 8][4], u32 tile, u32 k, int key0) const {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 b[4];
            load_b_rows<TKV>(b, k, key0, kk * 16);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                u32 a[4];
                if constexpr (Q_IN_REGS) {
#pragma unroll
                    for (int r = 0; r < 4; ++r) a[r] = q[mt][kk][r];
                } else {
                    load_a<TQ>(a, tile, mt * 16, kk * 16);
                }
                mma_16816<T>(sc[mt][0], a, b[0], b[1]);
                mma_16816<T>(sc[mt][1], a, b[2], b[3]);
            }
        }
    }
};

// An e4m3 K block, converted in registers. S sums over head dims, so K's and Q's may be permuted alike: chunk
// 4i + c (16 dims) of the m16n8k16 operands takes dims 64i + 16t + 4c + (0, 1, 2, 3) at positions (2t, 2t + 1,
// 2t + 8, 2t + 9), t = lane % 4. A thread's B fragments of four chunks are then 16 consecutive bytes of its key's
// row, one 16-byte load and eight conversions, where the 16-bit path reads two ldmatrix per chunk pair; Q's of
// four chunks are 16 consecutive dims of rows g and g + 8 (four 16-byte loads).
template <class T, class TQ, int D, int MT>
struct ScoresE4M3 {
    static constexpr int RAW = Smem<D, 16, 2, E4M3>::RAW_STRIDE, GROUPS = D / 64;
    static constexpr bool Q_IN_REGS = q_in_regs<D, MT>();
    static_assert(D % 64 == 0, "whole groups of 64 head dims");
    u32 q[Q_IN_REGS ? MT : 1][Q_IN_REGS ? GROUPS : 1][4][4];

    __forceinline__ __device__ static void q_group(u32 (&a)[4][4], u32 tile, int row0, int i) {
        const int row = row0 + lane_id() / 4, col = 64 * i + 16 * (lane_id() % 4);
        const uint4 g0 = lds_128(TQ::at(tile, row, col)), g1 = lds_128(TQ::at(tile, row, col + 8));
        const uint4 h0 = lds_128(TQ::at(tile, row + 8, col)), h1 = lds_128(TQ::at(tile, row + 8, col + 8));
        const u32 lo[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
        const u32 hi[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            a[c][0] = lo[2 * c], a[c][1] = hi[2 * c];
            a[c][2] = lo[2 * c + 1], a[c][3] = hi[2 * c + 1];
        }
    }
    __forceinline__ __device__ static void k_group(u32 (&b)[4][2], u32 k, int key, int i) {
        const uint4 x = lds_128(k + key * RAW + 64 * i + 16 * (lane_id() % 4));
        e4m3x4_to<T>(x.x, b[0][0], b[0][1]);
        e4m3x4_to<T>(x.y, b[1][0], b[1][1]);
        e4m3x4_to<T>(x.z, b[2][0], b[2][1]);
        e4m3x4_to<T>(x.w, b[3][0], b[3][1]);
    }
    __forceinline__ __device__ void keep_q(u32 tile) {
        if constexpr (Q_IN_REGS)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int i = 0; i < GROUPS; ++i) q_group(q[mt][i], tile, mt * 16, i);
    }
    __forceinline__ __device__ void operator()(float (&sc)[MT][KW / 8][4], u32 tile, u32 k, int key0) const {
#pragma unroll
        for (int i = 0; i < GROUPS; ++i) {
            u32 b[KW / 8][4][2];
#pragma unroll
            for (int nt = 0; nt < KW / 8; ++nt) k_group(b[nt], k, key0 + nt * 8 + lane_id() / 4, i);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if constexpr (Q_IN_REGS) {
                    mma_group(sc[mt], q[mt][i], b);
                } else {
                    u32 a[4][4];
                    q_group(a, tile, mt * 16, i);
                    mma_group(sc[mt], a, b);
                }
            }
        }
    }
    __forceinline__ __device__ static void mma_group(float (&sc)[KW / 8][4], const u32 (&a)[4][4],
                                                     const u32 (&b)[KW / 8][4][2]) {
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
            for (int nt = 0; nt < KW / 8; ++nt) mma_16816<T>(sc[nt], a[c], b[nt][c][0], b[nt][c][1]);
    }
};

template <class T, class TQ, int D, int MT, class KV>
struct ScoresOf {
    using type = ScoresBits16<T, TQ, D, MT>;
};
template <class T, class TQ, int D, int MT>
struct ScoresOf<T, TQ, D, MT, E4M3> {
    using type = ScoresE4M3<T, TQ, D, MT>;
};

// A warp's KW rows of a landed e4m3 V block (RAW_STRIDE-byte rows) into the fp16 Tile<BN, D> its P V products then
// read. Each warp reads back only the rows it wrote (its own keys), so the warps need no barrier between converting
// and computing: each goes on as soon as its own rows are done.
template <int D>
__forceinline__ __device__ void dequantize_v_rows(unsigned char* smem, u32 base, u32 dst, u32 src, int row0) {
    constexpr int CHUNKS = D / 16, RAW = Smem<D, 16, 2, E4M3>::RAW_STRIDE;
    static_assert(KW * CHUNKS % 32 == 0, "whole passes of the warp");
#pragma unroll
    for (int i = 0; i < KW * CHUNKS / 32; ++i) {
        const int c = i * 32 + lane_id(), r = row0 + c / CHUNKS, k = (c % CHUNKS) * 16;
        const uint4 x = *reinterpret_cast<const uint4*>(smem + (src - base) + r * RAW + k);
        uint4 a, b;
        e4m3x4_to<Half>(x.x, a.x, a.y);
        e4m3x4_to<Half>(x.y, a.z, a.w);
        e4m3x4_to<Half>(x.z, b.x, b.y);
        e4m3x4_to<Half>(x.w, b.z, b.w);
        uint4* out = reinterpret_cast<uint4*>(smem + (dst - base) + Tile<BN, D>::at(0, r, k));
        out[0] = a, out[1] = b;
    }
    __syncwarp();
}

// The end of a CTA: the four warps' (O, m, l) merged in shared memory (each warp's O scaled by its weight
// e^(m_w - M) / L, then summed), then the rows written: O and LSE (one split), or the split's fp32 partial. bad: the
// sequence did not fit its cache (or its pages): NaN rows. v_scale: an e4m3 cache's V dequantization factor.
template <class T, int D, int MT, class L>
__forceinline__ __device__ void merge_warps_and_store(const float (&o)[MT][D / 8][4], const float (&m)[MT][2],
                                                      const float (&l)[MT][2], float scale_log2, float v_scale,
                                                      bool bad, unsigned char* smem, const DecodeParams& p, int b,
                                                      int g, int s, int r0) {
    constexpr int ROWS = 16 * MT, DT = D / 8;
    float* m_w = reinterpret_cast<float*>(smem + L::STAGES);  // [warp][row], log2 units
    float* l_w = m_w + NWARPS * ROWS;
    float* o_w = l_w + NWARPS * ROWS;                         // [warp][row][O_STRIDE]
    const int warp = threadIdx.x / 32, gq = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
            const float sum = quad_sum(l[mt][h2]);
            if (t == 0) {
                const int row = mt * 16 + gq + 8 * h2;
                m_w[warp * ROWS + row] = m[mt][h2] * scale_log2;
                l_w[warp * ROWS + row] = sum;
            }
        }
    __syncthreads();
    // The sinks join the first split's rows as one more logit each, without a value (once per row: the merge adds
    // the splits' states). In log2 units; -inf: none.
    const float* sinks = s == 0 ? p.sinks : nullptr;
    auto sink_log2 = [&](int row) {
        return sinks ? sinks[g * p.group + (r0 + row) % p.group] * 1.4426950408889634f : neg_inf();
    };
    // A row's max over the warps and its sink (0 where all are -inf: then every weight is 0) and its total sum.
    auto row_total = [&](int row, float& top) {
        const float sink = sink_log2(row);
        top = sink;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) top = fmaxf(top, m_w[w * ROWS + row]);
        top = top == neg_inf() ? 0.f : top;
        float total = exp2f(sink - top);
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) total += l_w[w * ROWS + row] * exp2f(m_w[w * ROWS + row] - top);
        return total;
    };
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
            const int row = mt * 16 + gq + 8 * h2;
            float top;
            const float total = row_total(row, top);
            const float f = exp2f(m_w[warp * ROWS + row] - top) * inv_or_zero(total) * v_scale;
            float* dst = o_w + (warp * ROWS + row) * L::O_STRIDE + 2 * t;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
                *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(o[mt][dt][2 * h2] * f, o[mt][dt][2 * h2 + 1] * f);
        }
    __syncthreads();
    const int rows = p.seqlen_q * p.group;
    const float nan = __int_as_float(0x7fc00000);
    for (int c = threadIdx.x; c < ROWS * (D / 4); c += THREADS) {
        const int row = c / (D / 4), col = (c % (D / 4)) * 4, packed = r0 + row;
        if (packed >= rows || col >= p.head_dim) continue;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            const float4 x = *reinterpret_cast<const float4*>(o_w + (w * ROWS + row) * L::O_STRIDE + col);
            acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
        }
        if (bad) acc = make_float4(nan, nan, nan, nan);
        const int i = packed / p.group, h = g * p.group + packed % p.group;
        if (p.num_splits == 1) {
            *reinterpret_cast<uint2*>(p.o + b * p.o_b + i * p.o_n + h * p.o_h + col) =
                make_uint2(T::pack(acc.x, acc.y), T::pack(acc.z, acc.w));
        } else {
            float* dst = p.o_part + ((((i64)s * p.batch + b) * p.seqlen_q + i) * p.heads + h) * p.head_dim + col;
            *reinterpret_cast<float4*>(dst) = acc;
        }
    }
    float* lse = p.num_splits == 1 ? p.lse : p.lse_part;
    if (lse != nullptr && threadIdx.x < ROWS && r0 + (int)threadIdx.x < rows) {
        const int row = threadIdx.x, packed = r0 + row, i = packed / p.group, h = g * p.group + packed % p.group;
        float top;
        const float total = row_total(row, top);
        const float x = bad ? nan : finish_row(total, top).lse;
        lse[(((i64)(p.num_splits == 1 ? 0 : s) * p.batch + b) * p.heads + h) * p.seqlen_q + i] = x;
    }
}

}  // namespace decode
}  // namespace fav

// T: q's format (Half, BFloat16); D: the template head dim p.head_dim pads to; MT: m-tiles of 16 packed rows per
// CTA; NSTAGE: K/V blocks in the ring; PAGED: through page_table; KV: the cache's elements (Bits16, E4M3).
template <class T, int D, int MT, int NSTAGE, bool PAGED, class KV>
__global__ void __launch_bounds__(fav::decode::THREADS)
decode_split(const fav::DecodeParams p) {
    using namespace fav;
    using namespace fav::decode;
    using L = Smem<D, 16 * MT, NSTAGE, KV>;
    using TQ = typename L::TQ;
    using TKV = typename L::TKV;
    using PV = typename KV::template PV<T>;  // P V's format
    constexpr int DT = D / 8, NT = KW / 8;
    static_assert(NSTAGE >= 2 && D % 16 == 0, "a ring of at least two stages; head dims in multiples of 16");

    griddep_wait();  // launched behind kv_append: the cache with this step's tokens (a plain launch: no wait)
    extern __shared__ __align__(16) unsigned char smem[];
    const u32 base = smem_u32(smem);
    const int s = blockIdx.x, g = blockIdx.y % p.heads_kv, r0 = blockIdx.y / p.heads_kv * (16 * MT), b = blockIdx.z;
    const int warp = threadIdx.x / 32;
    const Sequence seq = Sequence::of(p, b);
    const CacheRows<PAGED> rows = CacheRows<PAGED>::of(p, b);
    const float k_scale = p.k_descale ? p.k_descale[b * p.heads_kv + g] : 1.f;
    const float scale_log2 = p.scale_log2 * k_scale;
    const PackedMask<MT> mask =
        PackedMask<MT>::template of<SPLIT_N>(p, seq.seqlen_k, seq.fits, b, g, r0, s, p.inv_scale / k_scale);
    const int2 keys = mask.keys;
    const int n_blocks = (keys.y - keys.x + BN - 1) / BN;

    const unsigned char* kc = static_cast<const unsigned char*>(p.k) + g * p.k_h * KV::BYTES;
    const unsigned char* vc = static_cast<const unsigned char*>(p.v) + g * p.v_h * KV::BYTES;
    const i64 k_stride[2] = {p.k_b * KV::BYTES, p.k_n * KV::BYTES}, v_stride[2] = {p.v_b * KV::BYTES, p.v_n * KV::BYTES};
    const int row_bytes = p.head_dim * KV::BYTES;
    bool in_bounds = seq.fits;  // the sequence fits its cache, and every page index is in range (the loads clear it)
    BlockCopies<D, KV, PAGED> next;  // the next block to load, located
    auto locate = [&](int j) {
        if (j < n_blocks) next.locate(rows, keys.x + j * BN, keys.y, row_bytes);
    };
    auto load = [&](int j) {  // block j into its stage, one cp.async group (empty past the last block); j + 1 located
        if (j < n_blocks)
            next.load(L::k_raw(base, j % NSTAGE), L::v_raw(base, j % NSTAGE), kc, vc, k_stride, v_stride, rows,
                      keys.y, row_bytes, in_bounds);
        cp_async_commit();
        locate(j + 1);
    };
    locate(0);
    load_q<D, 16 * MT>(base, p, b, g, r0);  // in block 0's group
#pragma unroll
    for (int j = 0; j < NSTAGE - 1; ++j) load(j);

    float o[MT][DT][4] = {};
    float m[MT][2], l[MT][2] = {};
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = neg_inf();
    typename ScoresOf<T, TQ, D, MT, KV>::type scores;

    for (int j = 0; j < n_blocks; ++j) {
        cp_async_wait<NSTAGE - 2>();  // block j has landed
        // Publishes block j to every warp, and proves every warp done with block j - 1, whose stage is refilled now.
        __syncthreads();
        load(j + NSTAGE - 1);
        u32 sV = L::v_raw(base, j % NSTAGE);
        if constexpr (L::DEQUANTIZES) {
            dequantize_v_rows<D>(smem, base, base + L::DEQUANT, sV, warp * KW);
            sV = base + L::DEQUANT;
        }
        if (j == 0) scores.keep_q(base);

        float sc[MT][NT][4] = {};
        scores(sc, base, L::k_raw(base, j % NSTAGE), warp * KW);
        const int key0 = keys.x + j * BN + warp * KW;
        mask.apply_if_needed(sc, key0);
        online_softmax_step(sc, m, l, o, scale_log2);

        // O += P~ V_w, P~ straight from the S registers
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) repack_a<PV>(a[mt], sc[mt][0], sc[mt][1]);
#pragma unroll
        for (int dt = 0; dt < DT; dt += 2) {
            u32 bv[4];
            load_b_cols<TKV>(bv, sV, warp * KW, dt * 8);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816<PV>(o[mt][dt], a[mt], bv[0], bv[1]);
                mma_16816<PV>(o[mt][dt + 1], a[mt], bv[2], bv[3]);
            }
        }
    }
    griddep_launch_dependents();  // merge_states' CTAs may take the SMs as this grid's last ones finish
    cp_async_wait<0>();
    const bool bad = __syncthreads_or(!in_bounds);  // also: every warp is done with the ring
    const float v_scale = p.v_descale ? p.v_descale[b * p.heads_kv + g] : 1.f;
    merge_warps_and_store<T, D, MT, L>(o, m, l, scale_log2, v_scale, bad, smem, p, b, g, s, r0);
}
