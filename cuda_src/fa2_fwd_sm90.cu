// fa2_fwd.cu on Hopper's warpgroup MMA (sm_90a): the same FlashAttention-2 algorithm, one CTA per Q block, the
// K/V blocks in an inner loop, O in registers, deferred normalization, K/V double-buffered with cp.async and one
// barrier per block. What changes is the matrix instruction and, with it, the unit of work:
//   warps -> warpgroups  each warpgroup of 4 warps owns 64 query rows (BM = 128: two warpgroups); its S = Q K^T
//                        and O += P V are wgmma instructions of 64 x BN and 64 x DN, issued asynchronously and
//                        waited for before the softmax reads S (and before the next block rescales O)
//   operands             Q and K tiles in wgmma's 128-byte swizzled K-major layout (common/wgmma.cuh), read by the
//                        tensor cores through descriptors; V in the same layout, read N-major (imm-trans-b), so no
//                        transpose is needed; P stays in registers as the A operand of P V (repack_a)
// Nothing else of FlashAttention-3 is here (no TMA, no producer warp, no ping-pong, no overlap of one block's
// softmax with another's MMA): fa3_fwd.cu adds those. Read beside fa2_fwd.cu.
#include "common/epilogue.cuh"
#include "common/fragments.cuh"
#include "common/mask.cuh"
#include "common/wgmma.cuh"

template <class T, int D, int BN>
__global__ void __launch_bounds__(256, 1)
fa2_fwd_sm90(const fav::FwdParams p) {
    using namespace fav;
    constexpr int BM = 128, THREADS = 256, NT = BN / 8, DT = D / 8;
    constexpr int DN = D < 128 ? D : 128;    // output columns per P V wgmma (n64 or n128)
    using TQ = SwizzledTile<BM, 2 * D>;      // [row][d], 16-bit elements as bytes
    using TKV = SwizzledTile<BN, 2 * D>;     // [key][d]: K-major B of Q K^T, N-major B of P V
    static_assert((BN == 64 || BN == 128) && (D == 64 || D == 128 || D == 256), "wgmma n64 / n128 blocks");

    extern __shared__ unsigned char smem[];
    const u32 base = (smem_u32(smem) + 1023) & ~1023u;  // the swizzle pattern repeats every 1024 bytes
    const u32 sQ = base;
    auto sK = [&](int stage) { return sQ + TQ::BYTES + stage * 2 * TKV::BYTES; };
    auto sV = [&](int stage) { return sK(stage) + TKV::BYTES; };

    const int i_block = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z, h_kv = h / p.group;
    const int wg = threadIdx.x / 128, m0 = i_block * BM;
    const int row0 = wg * 64 + (threadIdx.x / 32 % 4) * 16;  // this warp's first row within the CTA's block
    const CausalMask mask = CausalMask::of(p);
    const int seqlen_k = mask.seqlen_k;
    const BlockRange blocks = mask.kv_blocks<BM, BN>(m0, kv_split(p));
    const int row_bytes = 2 * p.head_dim;  // columns past it are zero-filled

    const auto* Qi = reinterpret_cast<const unsigned char*>(p.q + b * p.q_b + h * p.q_h + m0 * p.q_n);
    const auto* Kb = reinterpret_cast<const unsigned char*>(p.k + b * p.k_b + h_kv * p.k_h);
    const auto* Vb = reinterpret_cast<const unsigned char*>(p.v + b * p.v_b + h_kv * p.v_h);
    auto load_kv = [&](int j, int stage) {  // one cp.async group per K/V block
        load_swizzled_async<BN, 2 * D, THREADS>(sK(stage), Kb + (i64)j * BN * p.k_n * 2, p.k_n * 2, seqlen_k - j * BN,
                                                row_bytes);
        load_swizzled_async<BN, 2 * D, THREADS>(sV(stage), Vb + (i64)j * BN * p.v_n * 2, p.v_n * 2, seqlen_k - j * BN,
                                                row_bytes);
        cp_async_commit();
    };

    load_swizzled_async<BM, 2 * D, THREADS>(sQ, Qi, p.q_n * 2, p.seqlen_q - m0, row_bytes);  // in block 0's group
    if (blocks.count() > 0) load_kv(blocks.begin, 0);
    else cp_async_commit();

    float o[1][DT][4] = {};                  // unnormalized O rows of this warp (mma.sync C layout per warp)
    float m[1][2] = {{neg_inf(), neg_inf()}}, l[1][2] = {};

    for (int j = blocks.begin; j < blocks.end; ++j) {
        const int stage = (j - blocks.begin) % 2;
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();  // K_j, V_j visible to the tensor cores; every warpgroup is done with block j-1
        if (j + 1 < blocks.end) load_kv(j + 1, stage ^ 1);

        // S = Q_i K_j^T: D / 16 wgmmas of 64 x BN x 16, accumulated in fp32
        float s[1][NT][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            wgmma_16_ss<T>(s[0], TQ::desc(sQ, wg * 64, kk * 32), TKV::desc(sK(stage), 0, kk * 32), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        hold_registers(s[0]);

        mask.apply_if_needed(s, m0, row0, j * BN);
        online_softmax_step(s, m, l, o, p.scale_log2);

        // O += P~ V_j, P~ taken from the S registers as the A operand, BN / 16 k-steps of D / DN wgmmas
        u32 a[BN / 16][4];
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) repack_a<T>(a[kk], s[0][2 * kk], s[0][2 * kk + 1]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
            for (int n = 0; n < D / DN; ++n)
                wgmma_16_rs<T>(reinterpret_cast<float(&)[DN / 8][4]>(o[0][n * DN / 8]), a[kk],
                               TKV::desc_mn(sV(stage), kk * 16, n * DN * 2), 1);
        wgmma_commit();
        wgmma_wait<0>();
        hold_registers(o[0]);
    }
    cp_async_wait<0>();
    __syncthreads();  // every warpgroup is done with the tiles: the epilogue stages O over them

    NormalizedOut<T, D>::store(WarpRows<1, DT>{o, m, l, p.scale_log2, b, h, m0 + row0}, p,
                               reinterpret_cast<u16*>(smem + (base - smem_u32(smem))) + row0 * Tile<16, D>::STRIDE);
}
