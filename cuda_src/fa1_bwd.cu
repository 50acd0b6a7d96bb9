// FlashAttention-1 backward, Algorithm 4 of Dao et al. (2022) without dropout, on mma.sync tensor cores.
//
//   grid: (K/V block j x column slice, kv head, batch)    the outer loop over j, one CTA per block (FA1's own
//                                                         kernel splits it over CTAs the same way, num_splits)
//   line 7:  K_j, V_j loaded to shared memory once; dK_j, dV_j (line 8) in registers
//   line 9:  inner loop over the Q blocks i that see block j (and over the group's query heads: GQA sums dK_j, dV_j
//            over them on chip)
//   line 10: Q_i, O_i, dO_i and the forward's statistics (LSE: l = 1, m = LSE, see reference/fa1.py) loaded at
//            every (i, j) step, two stages deep
//   line 19: D_i = rowsum(dO_i o O_i) computed here from the O_i and dO_i tiles, at every step, as the paper does
//            (fa2 computes it once, in a pass of its own)
//   lines 11-22: S_ij, P_ij, dV_j, dP_ij, dS_ij, dK_j through common/backward.cuh's key_rows_step (a warp owns
//            16 keys, so these live transposed: keys as rows); then dS_ij goes through shared memory and
//   line 21: dQ_i <- dQ_i + tau dS_ij K_j is a read-modify-write of an fp32 dQ in HBM at every step: atomic adds,
//            since the CTAs of other blocks j update the same rows at the same time. The order of those adds
//            varies run to run, so fa1's dQ is not bitwise deterministic (fa2's is: it computes dQ in a pass of
//            its own). fa1_bwd_dq_convert rounds the fp32 dQ to the input's format afterwards.
//
// fa1 passes the fp32 dQ accumulator (batch, seqlen_q, heads, head_dim) in BwdParams' dq (declared u16* for the
// 16-bit gradient, which here is the conversion pass's output), and leaves delta unused: D is computed inside.
//
// Column slices (DC < D, head dims above 128): as fa2_bwd_dkdv, a CTA accumulates only columns [c0, c0 + DC) of
// dK_j and dV_j, and adds only those columns of dQ_i; S, P, dP and dS are recomputed whole by each slice.
#include "common/backward.cuh"
#include "common/epilogue.cuh"
#include "common/mask.cuh"

namespace fav {

// Columns of dQ a warp computes at a time in the dQ update: the widest multiple of 16, at most 32, that divides
// DC and still gives every warp at least one (16 rows x CW) piece when there are enough (64 spills at d = 128:
// its 32 accumulator registers come on top of dK_j and dV_j).
constexpr int fa1_dq_chunk(int dc, int row_groups, int warps) {
    for (int cw = dc < 32 ? dc : 32; cw >= 16; cw -= 16)
        if (dc % cw == 0 && row_groups * (dc / cw) >= warps) return cw;
    return 16;
}

template <int D, int BM, int BN>
struct Fa1BwdSmem {  // byte offsets into dynamic shared memory; mirrored by kernels/fa1_bwd.py's smem_bytes
    using TQ = Tile<BM, D>;
    using TKV = Tile<BN, D>;
    using TDS = Tile<BN, BM>;                                     // dS^T: keys as rows, 16-bit
    static constexpr int K = 0, V = K + TKV::BYTES;
    static constexpr int QS = V + TKV::BYTES;                     // two stages of (Q_i, dO_i, O_i)
    static constexpr int DS = QS + 6 * TQ::BYTES;
    static constexpr int STATS = DS + TDS::BYTES;                 // [2][BM] LSE (log2) per stage, then [BM] D_i
    static constexpr int BYTES = STATS + 3 * BM * 4;
};

}  // namespace fav

template <class T, int D, int DC, int BM, int BN, int NWARPS>
__global__ void __launch_bounds__(NWARPS * 32)
fa1_bwd(const fav::BwdParams p) {
    using namespace fav;
    using S = Fa1BwdSmem<D, BM, BN>;
    using TQ = typename S::TQ;
    using TKV = typename S::TKV;
    using TDS = typename S::TDS;
    constexpr int THREADS = NWARPS * 32, NT = BM / 8, DCT = DC / 8, SLICES = D / DC;
    constexpr int TPR = THREADS / BM;                             // threads per row of the D_i sums
    constexpr int RG = BM / 16, CW = fa1_dq_chunk(DC, RG, NWARPS), PIECES = RG * (DC / CW);
    static_assert(BN == 16 * NWARPS && BM % 16 == 0 && D % 16 == 0, "a warp owns 16 keys");
    static_assert(D % DC == 0 && DC % 16 == 0 && DC % CW == 0, "column slices of whole mma n-tile pairs");
    static_assert(THREADS % BM == 0 && 32 % TPR == 0, "whole rows per warp in the D_i sums");

    extern __shared__ __align__(16) unsigned char smem[];
    const u32 base = smem_u32(smem), sK = base + S::K, sV = base + S::V, sdS = base + S::DS;
    auto sQ = [&](int stage) { return base + S::QS + stage * 3 * TQ::BYTES; };
    auto sdO = [&](int stage) { return sQ(stage) + TQ::BYTES; };
    auto sO = [&](int stage) { return sQ(stage) + 2 * TQ::BYTES; };
    float* lse2s = reinterpret_cast<float*>(smem + S::STATS);     // [stage][BM]
    float* sD = lse2s + 2 * BM;

    const int j = blockIdx.x / SLICES, c0 = (blockIdx.x % SLICES) * DC, h_kv = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const CausalMask mask = CausalMask::of(p);
    const int seqlen_q = mask.seqlen_q, seqlen_k = mask.seqlen_k, d = p.head_dim;
    const int key0 = j * BN, kr0 = warp * 16;
    const BlockRange q_range = mask.q_blocks<BM>(key0);  // Q blocks above the diagonal: skipped
    const int i_first = q_range.begin, n_i = max(0, q_range.end - i_first);
    const int steps = p.group * n_i;                              // (query head, Q block i), head-major
    float* dq_acc = reinterpret_cast<float*>(p.dq);               // fp32 (batch, seqlen_q, heads, head_dim)

    // Line 7: K_j, V_j.
    load_tile_async<BN, D, THREADS>(sK, p.k + b * p.k_b + h_kv * p.k_h + (i64)key0 * p.k_n, p.k_n, seqlen_k - key0, d);
    load_tile_async<BN, D, THREADS>(sV, p.v + b * p.v_b + h_kv * p.v_h + (i64)key0 * p.v_n, p.v_n, seqlen_k - key0, d);
    // Line 10: Q_i, dO_i, O_i and l_i, m_i (here LSE_i, in log2 units; +inf past seqlen_q, so that P = 0 there).
    auto load_q = [&](int step, int stage) {
        const int h = h_kv * p.group + step / n_i, m0 = (i_first + step % n_i) * BM;
        load_tile_async<BM, D, THREADS>(sQ(stage), p.q + b * p.q_b + h * p.q_h + (i64)m0 * p.q_n, p.q_n, seqlen_q - m0, d);
        load_tile_async<BM, D, THREADS>(sdO(stage), p.dout + b * p.do_b + h * p.do_h + (i64)m0 * p.do_n, p.do_n,
                                        seqlen_q - m0, d);
        load_tile_async<BM, D, THREADS>(sO(stage), p.o + b * p.o_b + h * p.o_h + (i64)m0 * p.o_n, p.o_n, seqlen_q - m0, d);
        cp_async_commit();
        for (int r = threadIdx.x; r < BM; r += THREADS) lse2s[stage * BM + r] = row_lse2(p, b, h, m0 + r);
    };
    if (steps > 0) load_q(0, 0);
    else cp_async_commit();

    float dk[1][DCT][4] = {}, dv[1][DCT][4] = {};   // line 8
    for (int s = 0; s < steps; ++s) {
        const int stage = s % 2, h = h_kv * p.group + s / n_i, m0 = (i_first + s % n_i) * BM;
        cp_async_wait<0>();
        __syncthreads();  // step s's tiles visible to every warp; every warp is done with step s-1 (dS^T, D, stage)
        if (s + 1 < steps) load_q(s + 1, stage ^ 1);

        // Line 19: D_i = rowsum(dO_i o O_i), TPR neighbouring threads per row, 16 bytes at a time (the padded
        // columns and rows are zeros in both tiles).
        {
            const int r = threadIdx.x / TPR, part = threadIdx.x % TPR;
            const unsigned char* o_row = smem + (sO(stage) - base) + r * TQ::STRIDE * 2;
            const unsigned char* do_row = smem + (sdO(stage) - base) + r * TQ::STRIDE * 2;
            float sum = 0.f;
#pragma unroll
            for (int c = part * 8; c < D; c += TPR * 8) {
                const uint4 x = *reinterpret_cast<const uint4*>(o_row + 2 * c);
                const uint4 y = *reinterpret_cast<const uint4*>(do_row + 2 * c);
                const u32 xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    sum += T::to_float((u16)xs[e]) * T::to_float((u16)ys[e]) +
                           T::to_float((u16)(xs[e] >> 16)) * T::to_float((u16)(ys[e] >> 16));
            }
#pragma unroll
            for (int o = TPR / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (part == 0) sD[r] = sum;
        }
        __syncthreads();

        // Lines 11-20, 22: S^T, P^T, dV_j += P^T dO_i, dP^T, dS^T, dK_j += dS^T Q_i (its scale at the end).
        float ds[1][NT][4];
        key_rows_step<T, D, BM, BN>(dk, dv, ds, sK, sV, kr0, sQ(stage), sdO(stage), c0, lse2s + stage * BM, sD,
                                    p.scale_log2, key0, m0, mask);

        // dS^T (16-bit, the dQ product's operand) to shared memory: this warp's 16 key rows.
        u16* ds_rows = reinterpret_cast<u16*>(smem + S::DS);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2)
                *reinterpret_cast<u32*>(ds_rows + (kr0 + g + 8 * h2) * TDS::STRIDE + nt * 8 + 2 * t) =
                    T::pack(ds[0][nt][2 * h2], ds[0][nt][2 * h2 + 1]);
        __syncthreads();

        // Line 21: dQ_i[:, c0 + DC) += tau dS_ij K_j[:, c0 + DC), in pieces of 16 rows x CW columns shared out
        // over the warps, each added to the fp32 dQ in HBM.
        for (int piece = warp; piece < PIECES; piece += NWARPS) {
            const int r0 = (piece % RG) * 16, col0 = c0 + (piece / RG) * CW;
            float acc[1][CW / 8][4] = {};
            warp_mma_atb<T, TDS, TKV, BN / 16>(acc, sdS, r0, sK + 2 * col0);
            float* dst = dq_acc + (((i64)b * seqlen_q + m0 + r0) * p.heads + h) * d;
            const i64 ld = (i64)p.heads * d;
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {
                const int row = r0 + g + 8 * h2;
                if (m0 + row >= seqlen_q) continue;
#pragma unroll
                for (int dt = 0; dt < CW / 8; ++dt) {
                    const int col = col0 + dt * 8 + 2 * t;
                    if (col >= d) continue;
                    atomicAdd(dst + (g + 8 * h2) * ld + col, p.scale * acc[0][dt][2 * h2]);
                    atomicAdd(dst + (g + 8 * h2) * ld + col + 1, p.scale * acc[0][dt][2 * h2 + 1]);
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with K_j (the dQ product reads all its rows); K, V copies have landed

    // Line 24: dK_j = tau dS^T Q (columns [c0, c0 + DC)) and dV_j, staged through this warp's own rows of the K and
    // V tiles for 16-byte stores into contiguous (batch, seqlen_k, heads_kv, head_dim) gradients.
    const int heads_kv = p.heads / p.group;
    const i64 ld = (i64)heads_kv * d;
    const i64 at = ((i64)b * seqlen_k + key0 + kr0) * ld + (i64)h_kv * d + c0;
    u16* stage_k = reinterpret_cast<u16*>(smem + S::K) + kr0 * TKV::STRIDE;
    u16* stage_v = reinterpret_cast<u16*>(smem + S::V) + kr0 * TKV::STRIDE;
    const float scale[1][2] = {{p.scale, p.scale}}, one[1][2] = {{1.f, 1.f}};
    store_acc_rows<T, DC>(dk, scale, stage_k, p.dk + at, ld, seqlen_k - key0 - kr0, d - c0);
    store_acc_rows<T, DC>(dv, one, stage_v, p.dv + at, ld, seqlen_k - key0 - kr0, d - c0);
}

// dQ in the input's format from the fp32 accumulator (same (batch, seqlen_q, heads, head_dim) layout, contiguous),
// two elements per thread.
template <class T, int THREADS>
__global__ void __launch_bounds__(THREADS)
fa1_bwd_dq_convert(const float* __restrict__ acc, u16* __restrict__ dq, i64 pairs) {
    for (i64 i = (i64)blockIdx.x * THREADS + threadIdx.x; i < pairs; i += (i64)gridDim.x * THREADS) {
        const float2 x = reinterpret_cast<const float2*>(acc)[i];
        reinterpret_cast<u32*>(dq)[i] = T::pack(x.x, x.y);
    }
}
