// FlashAttention-2 forward on e4m3 tensor cores with FA3-style block scaling (sm_89+).
//
// fa2_fwd.cu's loop order, warp split and deferred normalization, with three changes:
//   operands        Q, K: e4m3 with one scale per block of rows (Q: this CTA's BM rows, K: each BN-key block);
//                   V: e4m3, transposed to [d][key] (the m16n8k32 B operand wants keys contiguous), one scale
//                   per channel, keys permuted inside each 32-key group to match P's register layout (below)
//   scores          S_ij = (Qq_i Kq_j^T) * sq_i * sk_j * scale * log2(e): the block pair's scales fold into
//                   one multiplier, and the running max is kept in those log2 units
//   P V             P~ * 256 (exact: a power of two) rounded to e4m3, so probabilities down to 2^-17 of the
//                   row max survive e4m3's 2^-9 floor; O * sv / (256 l) once at the end
//
// P's register layout. Thread (g, t) holds, of S's n-tiles 4k..4k+3 (keys 32k..32k+31), keys
// {2t, 2t+1, 8+2t, 9+2t} and {16+2t, 17+2t, 24+2t, 25+2t}; the A operand of m16n8k32 wants the reduction
// indices {4t..4t+3} and {16+4t..16+4t+3}. Rather than shuffle P between threads, the quantizer stores V's keys
// in that order (fp8_quantize.cu: vt_key), so the thread's own values are the right A operand as they stand.
#include "common/fp8.cuh"
#include "common/fragments.cuh"
#include "common/mask.cuh"

template <class T, int D, int BM, int BN, int NWARPS>
__global__ void __launch_bounds__(NWARPS * 32)
fa2_fp8_fwd(const fav::Fp8FwdParams p) {
    using namespace fav;
    const CausalMask mask = CausalMask::of(p);
    const int seqlen_q = mask.seqlen_q, seqlen_k = mask.seqlen_k, seqlen_k_pad = p.seqlen_k_pad, group = p.group;
    constexpr int THREADS = NWARPS * 32;
    constexpr int WM = BM / NWARPS, MT = WM / 16, NT = BN / 8, DT = D / 8;
    constexpr int KC = D / 32;               // k-chunks of Q K^T (32 e4m3 each)
    constexpr bool Q_IN_REGS = MT * KC * 4 <= 16;  // as in fa2_fwd.cu: beyond that, re-read Q each block
    // Rows of e4m3 are handled as rows of D/2 16-bit pairs: the same padded tiles, cp.async and ldmatrix.
    using TQ = Tile<BM, D / 2>;
    using TK = Tile<BN, D / 2>;
    using TV = Tile<D, BN / 2>;              // V^T: D rows (channels) of BN keys
    static_assert(WM % 16 == 0 && BN % 32 == 0 && D % 32 == 0, "tile sizes must be multiples of 16 / 32");

    extern __shared__ __align__(16) unsigned char smem[];
    const u32 sQ = smem_u32(smem);
    auto sK = [&](int stage) { return sQ + TQ::BYTES + stage * (TK::BYTES + TV::BYTES); };
    auto sV = [&](int stage) { return sK(stage) + TK::BYTES; };

    const int i_block = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z, h_kv = h / group;
    const int m0 = i_block * BM, warp = threadIdx.x / 32, row0 = warp * WM;
    const int n_blocks = mask.kv_blocks<BM, BN>(m0).end;

    const i64 bh = (i64)b * p.heads + h, bhk = (i64)b * (p.heads / group) + h_kv;
    const u16* Qi = reinterpret_cast<const u16*>(p.q) + (bh * seqlen_q + m0) * (D / 2);  // e4m3 pairs
    const u16* Kb = reinterpret_cast<const u16*>(p.k) + bhk * seqlen_k * (D / 2);
    const u16* Vb = reinterpret_cast<const u16*>(p.vt) + bhk * D * (seqlen_k_pad / 2);
    const float q_scale = p.sq[bh * gridDim.x + i_block];
    auto load_kv = [&](int j, int stage) {
        load_tile_async<BN, D / 2, THREADS>(sK(stage), Kb + (i64)j * BN * (D / 2), D / 2, seqlen_k - j * BN);
        load_tile_async<D, BN / 2, THREADS>(sV(stage), Vb + j * (BN / 2), seqlen_k_pad / 2, D);  // padded: no edge
        cp_async_commit();
    };

    load_tile_async<BM, D / 2, THREADS>(sQ, Qi, D / 2, seqlen_q - m0);
    if (n_blocks > 0) load_kv(0, 0);
    else cp_async_commit();

    float o[MT][DT][4] = {};
    float m[MT][2], l[MT][2] = {};           // running max in log2 units of the scaled scores; partial sums
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = neg_inf();
    u32 q_frag[Q_IN_REGS ? MT : 1][Q_IN_REGS ? KC : 1][4];

    for (int j = 0; j < n_blocks; ++j) {
        const int stage = j % 2;
        cp_async_wait<0>();
        __syncthreads();
        if (Q_IN_REGS && j == 0)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int kc = 0; kc < KC; ++kc) load_a<TQ>(q_frag[mt][kc], sQ, row0 + mt * 16, kc * 16);

        float s[MT][NT][4] = {};
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if constexpr (Q_IN_REGS) {
#pragma unroll
                    for (int r = 0; r < 4; ++r) a[mt][r] = q_frag[mt][kc][r];
                } else {
                    load_a<TQ>(a[mt], sQ, row0 + mt * 16, kc * 16);
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt += 2) {
                u32 bk[4];
                load_b_rows<TK>(bk, sK(stage), nt * 8, kc * 16);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16832_e4m3(s[mt][nt], a[mt], bk[0], bk[1]);
                    mma_16832_e4m3(s[mt][nt + 1], a[mt], bk[2], bk[3]);
                }
            }
        }
        // This block pair's scales fold into one multiplier: scores in log2 units from here on.
        const float pair_scale = p.scale_log2 * q_scale * p.sk[bhk * ((seqlen_k + BN - 1) / BN) + j];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt][e] *= pair_scale;
        mask.apply_if_needed(s, m0, row0, j * BN);

        online_softmax_step(s, m, l, o, 1.f);  // l sums the fp32 P~, before rounding
        if (j + 1 < n_blocks) load_kv(j + 1, stage ^ 1);  // the other stage: every warp is past block j-1

#pragma unroll
        for (int kc = 0; kc < BN / 32; ++kc) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                repack_a_e4m3(a[mt], s[mt][4 * kc], s[mt][4 * kc + 1], s[mt][4 * kc + 2], s[mt][4 * kc + 3]);
#pragma unroll
            for (int dt = 0; dt < DT; dt += 2) {
                u32 bv[4];
                load_b_rows<TV>(bv, sV(stage), dt * 8, kc * 16);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16832_e4m3(o[mt][dt], a[mt], bv[0], bv[1]);
                    mma_16832_e4m3(o[mt][dt + 1], a[mt], bv[2], bv[3]);
                }
            }
        }
    }
    cp_async_wait<0>();

    Fp8DequantOut<T, P_SCALE_LOG2>::store(WarpRows<MT, DT>{o, m, l, 1.f, b, h, m0 + row0}, p, p.sv + bhk * D);
}
