// Inline-PTX wrappers used by every tensor-core kernel: shared-memory addresses, cp.async, ldmatrix, mma.sync.
// Each is a small __forceinline__ function; the fragment layouts they produce are documented once, here.
#pragma once
#include "math.cuh"

namespace fav {

// 32-bit shared-memory address of a generic pointer into shared memory (what ldmatrix / cp.async take).
__forceinline__ __device__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// One 32-bit word at a 32-bit shared-memory address (slots beside mbarriers are addressed so: fa3's tile slots,
// fa2_bwd_sm90's dQ slots).
__forceinline__ __device__ void st_shared(u32 addr, int x) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(x) : "memory");
}
__forceinline__ __device__ int ld_shared(u32 addr) {
    int x;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(x) : "r"(addr) : "memory");
    return x;
}
__forceinline__ __device__ void st_shared_f32x2(u32 addr, float x, float y) {  // (8-byte aligned)
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(x), "f"(y) : "memory");
}
__forceinline__ __device__ float2 ld_shared_f32x2(u32 addr) {  // (8-byte aligned)
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
    return v;
}

// ---- An ordered sum in global memory (fa2_bwd_sm90's fused dQ) ---------------------------------------------
// Writers take turns on a counter: a writer waits until it reaches its rank (acquire), adds its share, and after
// a barrier of the threads that added one of them counts itself in (release). CUTLASS's semaphore pattern: the
// barrier orders the other threads' adds before the releasing thread's fence, which is cumulative. The wait
// spins on relaxed loads and acquires once (an acquire at gpu scope invalidates the SM's L1: CCTL.IVALL).
__forceinline__ __device__ void wait_count_at_least(const int* counter, int rank) {
    int seen;
    do asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    while (seen < rank);
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
}
__forceinline__ __device__ void release_count(int* counter) {
    asm volatile("fence.acq_rel.gpu;\n\tred.relaxed.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
}
// The same when the releasing thread made every write it releases itself: a release reduction, no fence (whose
// acquire half would invalidate L1).
__forceinline__ __device__ void release_own_count(int* counter) {
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
}
// Programmatic dependent launch (sm_90): a kernel launched with programmatic stream serialization
// (kernels/launch.py, after=True) may start before the kernel ahead of it on the stream has ended. Each of its
// threads calls griddep_wait() before it touches memory: it returns once that kernel has finished and its writes
// are visible. griddep_launch_dependents() lets such a kernel behind this one start (its CTAs take the SMs this
// kernel's last CTAs free). Both do nothing in a kernel launched the usual way, and before sm_90.
__forceinline__ __device__ void griddep_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__forceinline__ __device__ void griddep_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Two consecutive floats (8-byte aligned): stored (the first share) or added at L2 (the others).
__forceinline__ __device__ void st_global_f32x2(float* p, float x, float y) {
    asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(x), "f"(y) : "memory");
}
__forceinline__ __device__ void red_add_f32x2(float* p, float x, float y) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(x), "f"(y) : "memory");
}

// ---- cp.async: 16-byte global -> shared copies that bypass the register file and L1 ----------------------
// With valid == false nothing is read and the 16 bytes are zero-filled: ragged tile edges load zeros, so the
// math never sees uninitialized (possibly NaN) shared memory.
__forceinline__ __device__ void cp_async_16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
// 4-byte cp.async (one float: fa2_bwd_sm90's per-query LSE and D; .ca: the only form below 16 bytes); src-size 0
// zero-fills.
__forceinline__ __device__ void cp_async_4(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__forceinline__ __device__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>  // wait until at most N committed groups are still in flight
__forceinline__ __device__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// ---- 16 bytes from shared memory (a u32 shared address) --------------------------------------------------------
// volatile: the loop's ordering against the cp.async ring is the barriers', as for ldmatrix.
__forceinline__ __device__ uint4 lds_128(u32 addr) {
    uint4 r;
    asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr));
    return r;
}

// ---- ldmatrix: four 8x8 b16 matrices from shared memory into registers --------------------------------------
// Lane l gives the address of row (l % 8) of matrix (l / 8). Without .trans, lane l then holds, of each
// matrix r[i], the pair (row l/4, cols 2(l%4), 2(l%4)+1); with .trans the same pair of the transpose.
__forceinline__ __device__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__forceinline__ __device__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// ---- mma.sync m16n8k16, fp16/bf16 inputs, fp32 accumulate: D = A B + D --------------------------------------
// With g = lane / 4 and t = lane % 4:
//   A (16x16, row-major), 4 regs of 2 halves: a0 = A[g][2t..2t+1],   a1 = A[g+8][2t..],
//                                             a2 = A[g][2t+8..2t+9], a3 = A[g+8][2t+8..]
//   B (16x8, k-major "col"), 2 regs:          b0 = B[2t..2t+1][g],   b1 = B[2t+8..2t+9][g]
//   C/D (16x8 fp32), 4 regs:                  c0,c1 = C[g][2t..2t+1], c2,c3 = C[g+8][2t..2t+1]
template <class T>
__forceinline__ __device__ void mma_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if constexpr (T::is_bf16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// ---- mma.sync m16n8k32, e4m3 inputs, fp32 accumulate (sm_89+): D = A B + D ---------------------------------
// Same shape of fragments as mma_16816 with 8-bit elements, four to a register (lowest k in the lowest byte):
//   A (16x32): a0 = A[g][4t..4t+3], a1 = A[g+8][4t..4t+3], a2 = A[g][16+4t..], a3 = A[g+8][16+4t..]
//   B (32x8):  b0 = B[4t..4t+3][g], b1 = B[16+4t..16+4t+3][g]
//   C/D:       as mma_16816.
// ldmatrix (b16) loads these too: an 8x8 b16 matrix is 8 rows of 16 bytes, and lane l receives bytes
// 4(l%4) .. 4(l%4)+3 of row l/4 -- exactly a0 / b0 of a 16-byte-wide k chunk.
__forceinline__ __device__ void mma_16832_e4m3(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 890
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();  // e4m3 tensor cores need sm_89; the launcher refuses older GPUs before launching
#endif
}

// Four fp32 values -> four e4m3 bytes (round to nearest, saturating to +-448), x0 in the lowest byte.
__forceinline__ __device__ u32 pack_e4m3x4(float x0, float x1, float x2, float x3) {
#if __CUDA_ARCH__ >= 890
    u32 lo, hi;
    asm("{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, %2, %1; cvt.u32.u16 %0, t; }" : "=r"(lo) : "f"(x0), "f"(x1));
    asm("{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, %2, %1; cvt.u32.u16 %0, t; }" : "=r"(hi) : "f"(x2), "f"(x3));
    return lo | (hi << 16);
#else
    __trap();
    return 0;
#endif
}

}  // namespace fav
