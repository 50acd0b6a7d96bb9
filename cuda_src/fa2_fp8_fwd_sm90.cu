// fa2_fp8_fwd.cu on Hopper's warpgroup MMA (sm_90a). On sm_90, e4m3 mma.sync is not native: ptxas widens the
// operands to f16 for HMMA, at bf16 speed. wgmma.mma_async with e4m3 operands (QGMMA) is the fp8 path.
//
// Same algorithm, quantized operands and scale folding as fa2_fp8_fwd.cu (FA2 loop order: one CTA per Q block,
// the K/V blocks in an inner loop, O in registers, deferred normalization). What changes is the unit of work:
//   warps -> warpgroups  each warpgroup of 4 warps owns 64 query rows (BM = 64 NWG); its S = Q K^T and O += P V
//                        are single wgmma instructions of 64 x BN and 64 x min(D, 128)
//   operands             Q, K and V^T tiles live in shared memory in wgmma's swizzled K-major layout
//                        (common/wgmma.cuh), read by the tensor cores through descriptors; P stays in
//                        registers as the A operand of P V, in the same order as on mma.sync (so V^T's key
//                        permutation, vt_key, is the same)
//   pipeline             FA3's intra-warpgroup overlap: block j's softmax runs on the threads while the tensor
//                        cores do block j-1's P V; all threads cp.async block j+1 meanwhile, into the third of
//                        three K/V stages; one barrier per block, as in fa2_fwd.cu
#include "common/fp8.cuh"
#include "common/mask.cuh"
#include "common/wgmma.cuh"

template <class T, int D, int BN, int NWG, int CTAS_PER_SM = 1>
__global__ void __launch_bounds__(NWG * 128, CTAS_PER_SM)
fa2_fp8_fwd_sm90(const fav::Fp8FwdParams p) {
    using namespace fav;
    const CausalMask mask = CausalMask::of(p);
    const int seqlen_q = mask.seqlen_q, seqlen_k = mask.seqlen_k, seqlen_k_pad = p.seqlen_k_pad, group = p.group;
    constexpr int BM = 64 * NWG, THREADS = NWG * 128, NT = BN / 8, DT = D / 8;
    constexpr int DN = D < 128 ? D : 128;    // output columns per P V wgmma (n128 at most here)
    using TQ = SwizzledTile<BM, D>;           // [row][d], e4m3
    using TK = SwizzledTile<BN, D>;           // [key][d]
    using TV = SwizzledTile<D, BN>;           // V^T: [d][key], keys in vt_key order
    static_assert(BN % 32 == 0 && (BN == 64 || BN == 128) && D % 64 == 0, "wgmma n64 / n128 blocks");

    extern __shared__ unsigned char smem[];
    const u32 sQ = (smem_u32(smem) + 1023) & ~1023u;  // the swizzle pattern repeats every 1024 bytes
    auto sK = [&](int stage) { return sQ + TQ::BYTES + stage * (TK::BYTES + TV::BYTES); };  // 3 stages
    auto sV = [&](int stage) { return sK(stage) + TK::BYTES; };

    const int i_block = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z, h_kv = h / group;
    const int wg = threadIdx.x / 128, m0 = i_block * BM;
    const int row0 = wg * 64 + (threadIdx.x / 32 % 4) * 16;  // this warp's first row within the CTA's block
    const int n_blocks = mask.kv_blocks<BM, BN>(m0).end;

    const i64 bh = (i64)b * p.heads + h, bhk = (i64)b * (p.heads / group) + h_kv;
    const unsigned char* Qi = p.q + (bh * seqlen_q + m0) * D;
    const unsigned char* Kb = p.k + bhk * seqlen_k * D;
    const unsigned char* Vb = p.vt + bhk * D * seqlen_k_pad;
    const float q_scale = p.sq[bh * gridDim.x + i_block];
    auto load_kv = [&](int j, int stage) {
        load_swizzled_async<BN, D, THREADS>(sK(stage), Kb + (i64)j * BN * D, D, seqlen_k - j * BN);
        load_swizzled_async<D, BN, THREADS>(sV(stage), Vb + j * BN, seqlen_k_pad, D);  // padded: no edge
        cp_async_commit();
    };

    load_swizzled_async<BM, D, THREADS>(sQ, Qi, D, seqlen_q - m0);
    if (n_blocks > 0) load_kv(0, 0);
    else cp_async_commit();
    if (n_blocks > 1) load_kv(1, 1);

    float o[1][DT][4] = {};
    float m[1][2] = {{neg_inf(), neg_inf()}}, l[1][2] = {};  // as in fa2_fp8_fwd.cu, one m-tile per warp
    u32 pa[BN / 32][4];                                       // P~ of the previous block, e4m3: A of its P V

    // S_j = Q K_j^T for block j, scaled by its scale pair and masked: scores in log2 units.
    auto scores = [&](float (&s)[1][NT][4], int j) {
        const float pair_scale = p.scale_log2 * q_scale * p.sk[bhk * ((seqlen_k + BN - 1) / BN) + j];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[0][nt][e] *= pair_scale;
        // (The edge test written out: asked of the mask behind a function boundary, in this lambda, it compiles to
        // other instructions.)
        const int key0 = j * BN;
        if (key0 + BN > mask.seqlen_k || (mask.causal && key0 + BN - 1 > m0 + row0 + mask.diag))
            mask.apply<true>(s, m0 + row0, key0);
    };
    auto issue_qk = [&](float (&s)[1][NT][4], int stage) {
#pragma unroll
        for (int kc = 0; kc < D / 32; ++kc)
            wgmma_e4m3_ss(s[0], TQ::desc(sQ, wg * 64, kc * 32), TK::desc(sK(stage), 0, kc * 32), kc > 0);
        wgmma_commit();
    };
    auto issue_pv = [&](int stage) {
#pragma unroll
        for (int kc = 0; kc < BN / 32; ++kc)
#pragma unroll
            for (int n = 0; n < D / DN; ++n)
                wgmma_e4m3_rs(reinterpret_cast<float(&)[DN / 8][4]>(o[0][n * DN / 8]), pa[kc],
                              TV::desc(sV(stage), n * DN, kc * 32), 1);
        wgmma_commit();
    };
    auto pack_p = [&](const float (&s)[1][NT][4]) {
#pragma unroll
        for (int kc = 0; kc < BN / 32; ++kc)
            repack_a_e4m3(pa[kc], s[0][4 * kc], s[0][4 * kc + 1], s[0][4 * kc + 2], s[0][4 * kc + 3]);
    };

    // One K/V block. With PREV, block j-1's P V runs on the tensor cores while the threads do block j's softmax
    // (FA3's intra-warpgroup overlap); V_{j-1} is still being read while block j+1 loads, hence 3 stages.
    // Nothing may branch while that wgmma is in flight: ptxas waits for every wgmma at a control-flow join,
    // so the first block (no P V before it) is a separate compile-time case and masking comes before the issue.
    auto step = [&](int j, auto prev) {
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();                                       // block j visible; every warpgroup past block j-1
        if (j > 0 && j + 1 < n_blocks) load_kv(j + 1, (j + 1) % 3);

        float s[1][NT][4];
        wgmma_fence();
        issue_qk(s, j % 3);
        wgmma_wait<0>();
        hold_registers(s[0]);
        scores(s, j);
        if constexpr (decltype(prev)::value) {
            wgmma_fence();
            issue_pv((j - 1) % 3);                             // O += P_{j-1} V_{j-1} ...
        }
        float alpha[1][2];
        online_softmax_rescale(s, m, l, 1.f, alpha);           // ... while these threads compute P_j
        hold_registers(s[0]);  // exponentials before the wait in PTX (ptxas still sinks some)
        if constexpr (decltype(prev)::value) {
            wgmma_wait<0>();
            hold_registers(o[0]);
        }
        scale_rows(o, alpha);
        pack_p(s);
    };
    if (n_blocks > 0) step(0, flag<false>());
    for (int j = 1; j < n_blocks; ++j) step(j, flag<true>());
    if (n_blocks > 0) {                                        // the last block's P V
        wgmma_fence();
        issue_pv((n_blocks - 1) % 3);
        wgmma_wait<0>();
        hold_registers(o[0]);
    }
    cp_async_wait<0>();

    Fp8DequantOut<T, P_SCALE_LOG2>::store(WarpRows<1, DT>{o, m, l, 1.f, b, h, m0 + row0}, p, p.sv + bhk * D);
}
