// Hopper's asynchronous machinery (sm_90a) for fa3: TMA tile loads, mbarriers, named barriers and setmaxnreg.
//
//   TMA        cp.async.bulk.tensor copies a box of a tensor described by a 128-byte tensor map (made on the host
//              by cuTensorMapEncodeTiled, kernels/tma.py) into shared memory, swizzled as the map says, without
//              threads: one thread issues it, an mbarrier learns of its completion ("complete_tx": the barrier
//              counts the bytes that landed). Boxes that reach past the tensor's extent are zero-filled, which is
//              what the seqlen tails and padded head dims need.
//   mbarrier   a 64-bit shared-memory barrier with a phase bit: a phase completes when its expected arrivals have
//              arrived and its expected transaction bytes have landed. Waiters poll for "the phase of parity P has
//              completed". A fresh barrier is in phase 0, so waiting for parity 1 returns at once: producers start
//              their waits on the "empty" barriers with parity 1 (the ring's stages start empty).
//   bar.sync / bar.arrive with an id and a thread count: named barriers (id 0 is __syncthreads), used for the
//              ping-pong between consumer warpgroups and for a barrier among the consumers only.
//   setmaxnreg moves registers between warpgroups: the producer gives its registers back, the consumers grow.
//              Needs __launch_bounds__(threads, 1) and each role as one branch of an if/else (ptxas C7508).
#pragma once
#include "ptx.cuh"

namespace fav {

// A CUtensorMap as the kernel sees it: opaque, 64-byte aligned, passed as a __grid_constant__ parameter so
// that its address is a parameter-space address the TMA unit can read.
struct alignas(64) TmaDesc {
    unsigned long long bits[16];
};

// The most dynamic shared memory one CTA may opt into on sm_90 (227 KB), and what this launch was given.
constexpr int MAX_DYNAMIC_SMEM = 227 * 1024;
__forceinline__ __device__ u32 dynamic_smem_bytes() {
    u32 n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}

__forceinline__ __device__ void mbar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes the inits visible to the async proxy (the TMA unit) before any copy signals the barriers.
__forceinline__ __device__ void fence_mbar_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival that also announces `bytes` of TMA transactions for the current phase.
__forceinline__ __device__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// One arrival by the calling thread when `leader` holds, in one predicated instruction: no branch, so it may sit
// between wgmma issue and wait (ptxas makes every in-flight wgmma complete at a control-flow join).
__forceinline__ __device__ void mbar_arrive_if(u32 bar, bool leader) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0]; }"
                 ::"r"(bar), "r"((int)leader) : "memory");
}
// Blocks until the phase of parity `parity` has completed.
__forceinline__ __device__ void mbar_wait(u32 bar, int parity) {
    asm volatile(
        "{ .reg .pred done;\n"
        "WAIT_%=: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=; }" ::"r"(bar), "r"(parity) : "memory");
}

// The box of a 4-d tensor map at coordinates (c0 innermost .. c3) into shared memory at `dst`, completion
// counted on `bar`. The map lives in kernel parameter space (its generic address is what the instruction takes).
__forceinline__ __device__ void tma_load_4d(u32 dst, const TmaDesc& map, u32 bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global memory into shared memory at `dst` by the
// TMA unit, without a tensor map, completion counted on `bar`.
__forceinline__ __device__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// The box of a 4-d tensor map at coordinates (c0 innermost .. c3) from shared memory at `src` (laid out and
// swizzled as a load of that box would leave it) to global memory, by the TMA unit, in this thread's bulk group
// (bulk_commit, bulk_wait_read below). Elements of the box outside the tensor's extent are not written. Generic
// stores of `src` need fence_proxy_async (wgmma.cuh) before the thread that issues this sees them.
__forceinline__ __device__ void tma_store_4d(const TmaDesc& map, u32 src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
                 ::"l"(reinterpret_cast<unsigned long long>(&map)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}
// 1-d bulk copies from shared to global memory (no tensor map): `bytes` (a multiple of 16; both addresses 16-byte
// aligned) stored, or added element-wise as fp32 at L2, by the TMA unit. They form bulk groups per thread: commit,
// then wait until at most N groups are unread (the shared memory may be overwritten) or incomplete (written).
__forceinline__ __device__ void bulk_store(void* dst, u32 src, u32 bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}
__forceinline__ __device__ void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst), "r"(src),
                 "r"(bytes) : "memory");
}
__forceinline__ __device__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__forceinline__ __device__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory"); }
template <int N>
__forceinline__ __device__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory"); }
// Orders this thread's generic-proxy accesses of global memory with its async-proxy ones (bulk copies), both ways.
__forceinline__ __device__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

__forceinline__ __device__ void tma_prefetch_desc(const TmaDesc& map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(&map)) : "memory");
}

// Thread block clusters: this CTA's rank in its cluster, a peer's address for a shared-memory address of ours
// (mapa: the same offset in CTA `rank`'s shared memory), a store there (distributed shared memory), and the
// cluster-wide barrier every thread of every CTA in the cluster arrives at (release) and waits on (acquire).
__forceinline__ __device__ u32 cluster_ctarank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__forceinline__ __device__ u32 peer_shared(u32 addr, u32 rank) {
    u32 a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(addr), "r"(rank));
    return a;
}
__forceinline__ __device__ void st_cluster_f32x2(u32 addr, float x, float y) {
    asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(x), "f"(y) : "memory");
}
__forceinline__ __device__ void cluster_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__forceinline__ __device__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

__forceinline__ __device__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__forceinline__ __device__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Whether p holds for any of the threads of named barrier id (a barrier with an OR reduction): the same answer in
// all of them, where __any_sync's is per warp.
__forceinline__ __device__ bool named_any(int id, int threads, bool p) {
    int r;
    asm volatile("{ .reg .pred q, a; setp.ne.b32 q, %1, 0; bar.red.or.pred a, %2, %3, q; selp.b32 %0, 1, 0, a; }"
                 : "=r"(r) : "r"((int)p), "r"(id), "r"(threads) : "memory");
    return r != 0;
}

template <int N>
__forceinline__ __device__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N)); }
template <int N>
__forceinline__ __device__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N)); }

}  // namespace fav
