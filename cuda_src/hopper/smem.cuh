// fa3_fwd's shared memory: the Q buffers, fp8's O buffer, the K/V ring of STAGES stages, and the mbarriers that
// guard them (8 bytes each), then the persistent grid's two tile slots. Every swizzled tile starts 1024-byte
// aligned (the 128-byte swizzle repeats every 1024 bytes).
//
// The barriers, one phase per use:
//   q_full(q)     Q buffer q has landed (the producer's expect_tx arrival, then the TMA bytes)
//   q_empty(q)    every consumer warp has issued its last S on it (and, where O leaves over it, the TMA unit has
//                 read the O rows written there): the producer may load the tile after next into it
//   k_full(s), v_full(s)    K / V of ring stage s have landed
//   k_empty(s), v_empty(s)  every consumer warp is done with them
//   tile_full(k), tile_empty(k)   the persistent grid's slot k % 2 holds a tile / has been read (scheduler.cuh)
#pragma once
#include "config.cuh"

namespace fav {
namespace hopper {

template <class C>
struct SharedLayout {
    unsigned char* smem;  // the dynamic shared memory, as the kernel declares it
    u32 base;             // its first 1024-byte aligned address
    u32 o;                // fp8's O buffer (OBUF bytes, or none), after the Q buffers
    u32 bars;             // the first mbarrier's

    __forceinline__ __device__ explicit SharedLayout(unsigned char* smem_)
        : smem(smem_), base((smem_u32(smem_) + 1023) & ~1023u), o(q(C::QBUF)), bars(k(C::STAGES)) {}

    __forceinline__ __device__ u32 q(int i) const { return base + i * C::TQ::BYTES; }
    __forceinline__ __device__ u32 k(int s) const { return q(C::QBUF) + C::OBUF + s * (C::TK::BYTES + C::TV::BYTES); }
    __forceinline__ __device__ u32 v(int s) const { return k(s) + C::TK::BYTES; }
    __forceinline__ __device__ u32 q_full(int q) const { return bars + 8 * q; }
    __forceinline__ __device__ u32 q_empty(int q) const { return bars + 8 * (2 + q); }
    __forceinline__ __device__ u32 k_full(int s) const { return bars + 8 * (4 + s); }
    __forceinline__ __device__ u32 v_full(int s) const { return bars + 8 * (4 + C::STAGES + s); }
    __forceinline__ __device__ u32 k_empty(int s) const { return bars + 8 * (4 + 2 * C::STAGES + s); }
    __forceinline__ __device__ u32 v_empty(int s) const { return bars + 8 * (4 + 3 * C::STAGES + s); }
    __forceinline__ __device__ u32 tile_full(int k) const { return bars + 8 * (4 + 4 * C::STAGES + k % 2); }
    __forceinline__ __device__ u32 tile_empty(int k) const { return bars + 8 * (6 + 4 * C::STAGES + k % 2); }
    __forceinline__ __device__ u32 tile_slot(int k) const { return bars + 8 * (8 + 4 * C::STAGES) + 4 * (k % 2); }

    // A launch given less shared memory than the layout needs traps at once rather than overrunning it.
    __forceinline__ __device__ void check_size() const {
        if (threadIdx.x == 0 && dynamic_smem_bytes() < C::SMEM_BYTES) __trap();
    }

    // Thread 0 sets every barrier's expected arrivals; the caller synchronizes the CTA after.
    __forceinline__ __device__ void init_barriers() const {
        if (threadIdx.x == 0) {
            for (int q = 0; q < C::QBUF; ++q) {
                mbar_init(q_full(q), 1);
                // one arrival per consumer warp, once it has issued its last S on it; O_IN_Q: and one per
                // consumer, once the TMA unit has read the O rows written over it
                mbar_init(q_empty(q), C::O_IN_Q ? 5 * C::NC : 4 * C::NC);
            }
            for (int s = 0; s < C::STAGES; ++s) {
                mbar_init(k_full(s), 1);  // the producer's expect_tx arrival; the bytes complete the phase
                mbar_init(v_full(s), 1);
                mbar_init(k_empty(s), 4 * C::NC);  // one arrival per consumer warp
                mbar_init(v_empty(s), 4 * C::NC);
            }
            if (C::PERSISTENT)
                for (int k = 0; k < 2; ++k) {
                    mbar_init(tile_full(k), 1);          // the producer, once it has written the slot
                    mbar_init(tile_empty(k), 4 * C::NC);  // one arrival per consumer warp, once it has read it
                }
            fence_mbar_init();
        }
    }

    // One CTA per tile: once every consumer is done with Q and the ring, O is staged over them, in rows of D + 8
    // elements (Tile<16, D>), for 16-byte stores; the rows of the warp whose first row in the tile is row0.
    __forceinline__ __device__ u16* staging(int row0) const {
        return reinterpret_cast<u16*>(smem + (base - smem_u32(smem))) + row0 * Tile<16, C::D>::STRIDE;
    }
};

}  // namespace hopper
}  // namespace fav
