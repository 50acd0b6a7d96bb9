// Hopper (sm_90a) warpgroup MMA: shared-memory operand descriptors, the swizzled tiles they describe, and the
// wgmma.mma_async wrappers the sm_90 kernels use (e4m3: fa2_fp8_fwd_sm90.cu; fp16/bf16: fa2_fwd_sm90.cu). A warpgroup is 4 consecutive warps (128 threads,
// the first warp index a multiple of 4); one wgmma computes a 64 x N block for the whole warpgroup.
//
// Fragments, with w = warp within the warpgroup, g = lane / 4, t = lane % 4:
//   D (64 x N fp32), float d[N/8][4]:  d[i][0..1] = D[16w + g][8i + 2t .. 8i + 2t + 1], d[i][2..3] = row 16w + g + 8.
//                                      Per warp this is mma.sync's C layout repeated over N/8 n-tiles, so the
//                                      softmax helpers of softmax.cuh work on it unchanged (as s[1][N/8][4]).
//   A from registers (64 x 32 e4m3), u32 a[4]: warp w's 16 rows in mma_16832_e4m3's A layout (ptx.cuh);
//                    (64 x 16 fp16/bf16), u32 a[4]: warp w's 16 rows in mma_16816's A layout (repack_a fills it).
//   A, B from shared memory: K-major (the 32-byte reduction slice contiguous in each row), 128-, 64- or 32-byte
//                            swizzled (SwizzledTile below), addressed by a 64-bit descriptor.
#pragma once
#include "ptx.cuh"

typedef unsigned long long u64;

namespace fav {

// ROWS rows of KB bytes each, K-major, in the canonical swizzled layout wgmma reads. Rows are cut into slabs of
// W = 128 bytes, or 64 where KB is not a multiple of 128 (64-byte swizzle: fa3_fp8's V^T over 192 keys), or 32
// where it is not one of 64 either (32-byte swizzle: V^T over 160 keys), slab s
// holding bytes [sW, sW + W) of every row, rows W apart; inside a slab the 16-byte
// chunk c of row r is stored at chunk c ^ ((r * W / 128) % (W / 16)): the hardware's XOR of address bits [4, 7)
// with bits [7, 10), which also spreads a column of chunks over all banks. Slabs must start 1024-byte aligned.
template <int ROWS, int KB>
struct SwizzledTile {
    static constexpr int W = KB % 128 == 0 ? 128 : KB % 64 == 0 ? 64 : 32;
    static constexpr int SLAB = ROWS * W;
    static constexpr int SLABS = KB / W;
    static constexpr int BYTES = ROWS * KB;
    static constexpr u64 MODE = W == 128 ? 1 : W == 64 ? 2 : 3;  // descriptor swizzle field: 128, 64, 32 B
    static_assert(KB % W == 0, "whole slabs: a row is a multiple of 32 bytes");
    static_assert(SLAB % 1024 == 0, "each slab must keep the 1024-byte alignment of the swizzle pattern");

    // Byte offset of the 16-byte chunk holding bytes [byte, byte + 16) of row `row`.
    __forceinline__ __device__ static u32 offset(int row, int byte) {
        const u32 lin = row * W + byte % W;
        return (byte / W) * SLAB + (lin ^ (((lin >> 7) & (W / 16 - 1)) << 4));
    }

    // Descriptor of the operand made of rows [row0, row0 + 64 or N) and reduction bytes [k0, k0 + 32).
    // Stepping k0 inside a slab just moves the start address: the swizzle is applied to the final address.
    // Fields: start >> 4 (bits 0-13), leading offset (16-29, unused for swizzled K-major: 1),
    // stride between 8-row groups >> 4 (32-45), swizzle mode (62-63).
    __forceinline__ __device__ static u64 desc(u32 base, int row0, int k0) {
        const u32 addr = base + (k0 / W) * SLAB + row0 * W + k0 % W;
        return (u64)((addr & 0x3ffff) >> 4) | (1ull << 16) | ((u64)(8 * W / 16) << 32) | (MODE << 62);
    }

    // What a descriptor's start field moves by for an operand at (row0, k0) instead of (0, 0): the byte offset / 16.
    // desc(base, row0, k0) == desc(base, 0, 0) + step(row0, k0) while the tile lies in the first 256 KB of shared
    // memory (always: the field holds 14 bits of address / 16), so a loop over k-steps can add constants to one
    // descriptor instead of forming each one from its address.
    __forceinline__ __host__ __device__ static constexpr u64 step(int row0, int k0) {
        return ((k0 / W) * SLAB + row0 * W + k0 % W) >> 4;
    }
    __forceinline__ __host__ __device__ static constexpr u64 step_mn(int k_row0, int n0) {  // desc_mn's
        return ((n0 / W) * SLAB + k_row0 * W) >> 4;
    }

    // The same tile read as an MN-major B operand (wgmma's imm-trans-b = 1, 16-bit types only): rows are the
    // reduction (K) index, row bytes the N index. Operand: rows [k_row0, k_row0 + 16) and N bytes from n0 on.
    // In the MN-major canonical layout the leading offset steps between W-byte atoms of N (here: slabs) and the
    // stride offset between 8-row groups of K (8 rows of W bytes).
    __forceinline__ __device__ static u64 desc_mn(u32 base, int k_row0, int n0) {
        const u32 addr = base + (n0 / W) * SLAB + k_row0 * W;
        return (u64)((addr & 0x3ffff) >> 4) | ((u64)(SLAB >> 4) << 16) | ((u64)(8 * W / 16) << 32) | (MODE << 62);
    }
};

// Rows [0, ROWS) of a row-major slice of global memory (row stride `ld` bytes) into a SwizzledTile, 16 bytes per
// cp.async; rows at or beyond `valid_rows` and bytes at or beyond `valid_bytes` of a row are zero-filled. Not
// committed: the caller groups.
// Each thread keeps one 16-byte column and moves down ROWS_PER_PASS rows per pass, a multiple of 8: the swizzle
// (a function of the row modulo 8) is the same on every pass, so one address steps by a constant.
template <int ROWS, int KB, int THREADS>
__forceinline__ __device__ void load_swizzled_async(u32 tile, const unsigned char* __restrict__ g, i64 ld,
                                                    int valid_rows, int valid_bytes = KB) {
    constexpr int CHUNKS = KB / 16, ROWS_PER_PASS = THREADS / CHUNKS;
    static_assert(THREADS % CHUNKS == 0 && ROWS % ROWS_PER_PASS == 0 && ROWS_PER_PASS % 8 == 0,
                  "whole passes that keep each thread's swizzle");
    using Tile = SwizzledTile<ROWS, KB>;
    const int r = threadIdx.x / CHUNKS, k = (threadIdx.x % CHUNKS) * 16;
    const bool col_ok = k < valid_bytes;  // columns past a padded head dim are zero-filled
    const unsigned char* src = g + r * ld + k;
    u32 dst = tile + Tile::offset(r, k);
#pragma unroll
    for (int i = 0; i < ROWS / ROWS_PER_PASS; ++i) {
        const bool ok = col_ok && r + i * ROWS_PER_PASS < valid_rows;
        cp_async_16(dst, ok ? src : g, ok);
        src += ROWS_PER_PASS * ld;
        dst += ROWS_PER_PASS * Tile::W;
    }
}

// cp.async writes shared memory through the generic proxy, wgmma reads it through the async proxy: each writer
// fences between the two (then a barrier publishes the tile to the other warps).
__forceinline__ __device__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// wgmma.fence orders this warpgroup's register writes (accumulators, A fragments) before the next wgmma reads
// them; commit closes a group of issued wgmmas; wait<N> blocks until at most N groups are in flight.
__forceinline__ __device__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__forceinline__ __device__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__forceinline__ __device__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// The compiler does not know that a wgmma writes its accumulators after the asm statement returns: pinning each
// register here (after the wait) keeps it from moving reads of the results above the wait.
template <int NT>
__forceinline__ __device__ void hold_registers(float (&d)[NT][4]) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

// D (+)= A B for a 64 x N x 32 e4m3 block, fp32 accumulators; accumulate == 0 overwrites D. N is the size of d:
// n64 and n128, A from shared memory (_ss) or from registers (_rs), B always from shared memory.
__forceinline__ __device__ void wgmma_e4m3_ss(float (&d)[8][4], u64 a_desc, u64 b_desc, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1; }"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}
__forceinline__ __device__ void wgmma_e4m3_rs(float (&d)[8][4], const u32 (&a)[4], u64 b_desc, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1; }"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));
}
__forceinline__ __device__ void wgmma_e4m3_ss(float (&d)[16][4], u64 a_desc, u64 b_desc, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1; }"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}
__forceinline__ __device__ void wgmma_e4m3_rs(float (&d)[16][4], const u32 (&a)[4], u64 b_desc, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1; }"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));
}

// D (+)= A B for a 64 x N x 16 block of fp16 or bf16 (T), fp32 accumulators, N = 64 or 128 (the size of d).
// _ss: A and B K-major in shared memory (S = Q K^T); _rs: A from registers, B N-major in shared memory
// (O += P V with V stored [key][d]: imm-trans-b = 1).
template <class T>
__forceinline__ __device__ void wgmma_16_ss(float (&d)[16][4], u64 a_desc, u64 b_desc, int accumulate) {
#define FAV_D64 "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
    "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
    "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
    "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
    "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
    "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
    "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
    "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
#define FAV_R64 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27," \
    "%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54," \
    "%55,%56,%57,%58,%59,%60,%61,%62,%63"
    if constexpr (T::is_bf16)
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" FAV_R64 "}, %64, %65, p, 1, 1, 0, 0; }"
                     : FAV_D64 : "l"(a_desc), "l"(b_desc), "r"(accumulate));
    else
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" FAV_R64 "}, %64, %65, p, 1, 1, 0, 0; }"
                     : FAV_D64 : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}
template <class T>
__forceinline__ __device__ void wgmma_16_rs(float (&d)[16][4], const u32 (&a)[4], u64 b_desc, int accumulate) {
    if constexpr (T::is_bf16)
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %69, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" FAV_R64 "}, {%64,%65,%66,%67}, %68, p, 1, 1, 1; }"
                     : FAV_D64 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));
    else
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %69, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" FAV_R64 "}, {%64,%65,%66,%67}, %68, p, 1, 1, 1; }"
                     : FAV_D64 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));
}
#undef FAV_D64
#undef FAV_R64
// n64: also with either operand MN-major (TA, TB = 1: imm-trans-a / -b; dQ = dS K reads dS^T and K transposed).
template <class T, int TA = 0, int TB = 0>
__forceinline__ __device__ void wgmma_16_ss(float (&d)[8][4], u64 a_desc, u64 b_desc, int accumulate) {
#define FAV_D32 "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
    "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
    "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
    "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define FAV_R32 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27," \
    "%28,%29,%30,%31"
    if constexpr (T::is_bf16)
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" FAV_R32 "}, %32, %33, p, 1, 1, %35, %36; }"
                     : FAV_D32 : "l"(a_desc), "l"(b_desc), "r"(accumulate), "n"(TA), "n"(TB));
    else
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" FAV_R32 "}, %32, %33, p, 1, 1, %35, %36; }"
                     : FAV_D32 : "l"(a_desc), "l"(b_desc), "r"(accumulate), "n"(TA), "n"(TB));
}
template <class T>
__forceinline__ __device__ void wgmma_16_rs(float (&d)[8][4], const u32 (&a)[4], u64 b_desc, int accumulate) {
    if constexpr (T::is_bf16)
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" FAV_R32 "}, {%32,%33,%34,%35}, %36, p, 1, 1, 1; }"
                     : FAV_D32 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));
    else
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" FAV_R32 "}, {%32,%33,%34,%35}, %36, p, 1, 1, 1; }"
                     : FAV_D32 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));
}
#undef FAV_D32
#undef FAV_R32

}  // namespace fav
