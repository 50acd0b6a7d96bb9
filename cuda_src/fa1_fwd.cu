// FlashAttention-1 forward, Algorithm 1 of Dao et al. (2022), on mma.sync tensor cores.
//
//   grid: (head, batch)               one CTA per (batch, head) walks the whole attention matrix
//   loops: outer over K/V blocks j    K_j, V_j loaded to shared memory once;
//          inner over Q blocks i      Q_i, O_i, l_i, m_i loaded from and written back to HBM at every (i, j)
//   warps: split-K                    the warps share Q_i and split K_j / V_j; their partial maxima, sums and
//                                     P~V products are combined through shared memory behind barriers
//   normalization: per block          O_i <- diag(l_new)^-1 (diag(l_i) e^(m_i - m_new) O_i + e^(m~ - m_new) P~ V_j)
//
// O, l, m live in a float32 workspace (the honest choice for a value rescaled Tc times); the output is cast once
// at the end. Read beside fa2_fwd.cu: same pieces (common/), other loop order, other warp split, other normalization.
#include "common/epilogue.cuh"
#include "common/fragments.cuh"
#include "common/mask.cuh"

template <class T, int D, int BM, int BN, int NWARPS>
struct Fa1Smem {  // byte offsets into dynamic shared memory
    using TQ = fav::Tile<BM, D>;
    using TKV = fav::Tile<BN, D>;
    static constexpr int F32_STRIDE = D + 8;  // fp32 rows padded by 32 bytes: conflict-free fragment writes
    static constexpr int K = 0, V = K + TKV::BYTES, Q = V + TKV::BYTES;                 // Q: two stages
    static constexpr int PV = Q + 2 * TQ::BYTES;                                          // [NWARPS][BM][F32_STRIDE]
    static constexpr int O = PV + NWARPS * BM * F32_STRIDE * 4;                           // O_i prefetch, fp32
    static constexpr int LM = O + BM * F32_STRIDE * 4;                                    // l_i, m_i prefetch [2][BM]
    static constexpr int MW = LM + 2 * BM * 4;                                            // m~_w, l~_w [2][NWARPS][BM]
    static constexpr int COEF = MW + 2 * NWARPS * BM * 4;                                 // [NWARPS + 1][BM]
    static constexpr int BYTES = COEF + (NWARPS + 1) * BM * 4;
};

// D: the template head dim p.head_dim pads to. The workspaces p.o_ws, p.l_ws, p.m_ws are (B*H, rows_pad[, D]).
template <class T, int D, int BM, int BN, int NWARPS>
__global__ void __launch_bounds__(NWARPS * 32, 1)
fa1_fwd(const fav::FwdParams p) {
    using namespace fav;
    using S = Fa1Smem<T, D, BM, BN, NWARPS>;
    using TQ = typename S::TQ;
    using TKV = typename S::TKV;
    constexpr int THREADS = NWARPS * 32, MT = BM / 16;
    constexpr int KW = BN / NWARPS, NT = KW / 8, DT = D / 8;  // keys per warp (split-K), n-tiles of S and of O
    constexpr int FS = S::F32_STRIDE;
    static_assert(BM % 16 == 0 && KW % 16 == 0 && D % 16 == 0, "tile sizes must be multiples of 16");

    extern __shared__ __align__(16) unsigned char smem[];
    const u32 base = smem_u32(smem);
    float* sPV = reinterpret_cast<float*>(smem + S::PV);
    float* sO = reinterpret_cast<float*>(smem + S::O);
    float* sLM = reinterpret_cast<float*>(smem + S::LM);     // [0][r] = l_i, [1][r] = m_i
    float* sMW = reinterpret_cast<float*>(smem + S::MW);     // [0][w][r] = m~_w, [1][w][r] = l~_w
    float* sCoef = reinterpret_cast<float*>(smem + S::COEF); // [w][r] for the P~V of warp w, [NWARPS][r] for O_i

    const int h = blockIdx.x, b = blockIdx.y, h_kv = h / p.group, warp = threadIdx.x / 32;
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const CausalMask mask = CausalMask::of(p);
    const int seqlen_q = mask.seqlen_q, seqlen_k = mask.seqlen_k, d = p.head_dim;
    const float scale_log2 = p.scale_log2;
    const int Tr = (seqlen_q + BM - 1) / BM, Tc = (seqlen_k + BN - 1) / BN, rows_pad = Tr * BM;
    const i64 bh = (i64)b * p.heads + h;
    const i64 q_n = p.q_n, k_n = p.k_n, v_n = p.v_n;
    const u16* Qb = p.q + b * p.q_b + h * p.q_h;
    float* Ob = p.o_ws + bh * rows_pad * D;
    float* lb = p.l_ws + bh * rows_pad;
    float* mb = p.m_ws + bh * rows_pad;

    // Algorithm 1, line 2: O = 0, l = 0, m = -inf in HBM.
    for (int e = threadIdx.x; e < rows_pad * D; e += THREADS) Ob[e] = 0.f;
    for (int r = threadIdx.x; r < rows_pad; r += THREADS) lb[r] = 0.f, mb[r] = neg_inf();
    __syncthreads();

    for (int j = 0; j < Tc; ++j) {
        const int key0 = j * BN;
        // Q blocks wholly above the causal diagonal for this K/V block are skipped.
        const int i_first = mask.q_blocks<BM>(key0).begin;
        if (i_first >= Tr) break;  // later K/V blocks are invisible to every row too

        // Line 6: load K_j, V_j to shared memory (once per outer step), and Q_{i_first}.
        load_tile_async<BN, D, THREADS>(base + S::K, p.k + b * p.k_b + h_kv * p.k_h + (i64)key0 * k_n, k_n,
                                        seqlen_k - key0, d);
        load_tile_async<BN, D, THREADS>(base + S::V, p.v + b * p.v_b + h_kv * p.v_h + (i64)key0 * v_n, v_n,
                                        seqlen_k - key0, d);
        load_tile_async<BM, D, THREADS>(base + S::Q, Qb + (i64)i_first * BM * q_n, q_n, seqlen_q - i_first * BM, d);
        cp_async_commit();

        for (int i = i_first; i < Tr; ++i) {
            const int m0 = i * BM, stage = (i - i_first) % 2;
            const u32 sQ = base + S::Q + stage * TQ::BYTES;
            // Line 8: load O_i, l_i, m_i (prefetched into shared memory while S and P~V are computed),
            // and Q_{i+1} for the next inner step.
            load_f32_rows_async<BM, D, FS, THREADS>(base + S::O, Ob + (i64)m0 * D);
            if (threadIdx.x < BM / 4) cp_async_16(base + S::LM + threadIdx.x * 16, lb + m0 + threadIdx.x * 4, true);
            else if (threadIdx.x < BM / 2)
                cp_async_16(base + S::LM + BM * 4 + (threadIdx.x - BM / 4) * 16, mb + m0 + (threadIdx.x - BM / 4) * 4, true);
            cp_async_commit();
            if (i + 1 < Tr)
                load_tile_async<BM, D, THREADS>(base + S::Q + (stage ^ 1) * TQ::BYTES, Qb + (i64)(m0 + BM) * q_n, q_n,
                                                seqlen_q - m0 - BM, d);
            cp_async_commit();
            cp_async_wait<2>();  // K_j, V_j, Q_i have landed
            __syncthreads();

            // Lines 9-10, this warp's slice of K_j: S_w = Q_i K_{j,w}^T, m~_w = rowmax, P~_w = exp(S_w - m~_w),
            // l~_w = rowsum(P~_w), and the partial product P~_w V_{j,w}.
            float s[MT][NT][4] = {};
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    u32 a[4];
                    load_a<TQ>(a, sQ, mt * 16, kk * 16);
#pragma unroll
                    for (int nt = 0; nt < NT; nt += 2) {
                        u32 bk[4];
                        load_b_rows<TKV>(bk, base + S::K, warp * KW + nt * 8, kk * 16);
                        mma_16816<T>(s[mt][nt], a, bk[0], bk[1]);
                        mma_16816<T>(s[mt][nt + 1], a, bk[2], bk[3]);
                    }
                }
            }
            mask.apply_if_needed(s, m0, 0, key0 + warp * KW);
            float mw[MT][2], ref[MT][2], lw[MT][2] = {};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) mw[mt][0] = mw[mt][1] = neg_inf();
            row_max(s, mw);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) ref[mt][0] = exp2_ref(mw[mt][0], scale_log2), ref[mt][1] = exp2_ref(mw[mt][1], scale_log2);
            exponentiate(s, ref, scale_log2, lw);

            float pv[MT][DT][4] = {};
#pragma unroll
            for (int kk = 0; kk < KW / 16; ++kk) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    u32 a[4];
                    repack_a<T>(a, s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
                    for (int dt = 0; dt < DT; dt += 2) {
                        u32 bv[4];
                        load_b_cols<TKV>(bv, base + S::V, warp * KW + kk * 16, dt * 8);
                        mma_16816<T>(pv[mt][dt], a, bv[0], bv[1]);
                        mma_16816<T>(pv[mt][dt + 1], a, bv[2], bv[3]);
                    }
                }
            }
            // Split-K: publish this warp's m~_w, l~_w and P~_w V_{j,w} for the combine.
            float* myPV = sPV + warp * BM * FS;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = mt * 16 + g + 8 * r;
                    const float lsum = quad_sum(lw[mt][r]);
                    if (t == 0) sMW[warp * BM + row] = mw[mt][r], sMW[(NWARPS + warp) * BM + row] = lsum;
#pragma unroll
                    for (int dt = 0; dt < DT; ++dt)
                        *reinterpret_cast<float2*>(myPV + row * FS + dt * 8 + 2 * t) =
                            make_float2(pv[mt][dt][2 * r], pv[mt][dt][2 * r + 1]);
                }
            cp_async_wait<1>();  // O_i, l_i, m_i have landed
            __syncthreads();

            // Lines 11-13, per row: m~ = max_w m~_w, l~ = sum_w e^(m~_w - m~) l~_w, m_new, l_new; the combine
            // coefficients of O_i and of each warp's P~V; l_i, m_i written back to HBM.
            if (threadIdx.x < BM) {
                const int r = threadIdx.x;
                const float l_i = sLM[r], m_i = sLM[BM + r];
                float m_t = neg_inf();
#pragma unroll
                for (int w = 0; w < NWARPS; ++w) m_t = fmaxf(m_t, sMW[w * BM + r]);
                const float m_new = fmaxf(m_i, m_t), ref_new = exp2_ref(m_new, scale_log2);
                float l_t = 0.f;  // l~ already expressed relative to m_new: sum_w e^(m~_w - m_new) l~_w
#pragma unroll
                for (int w = 0; w < NWARPS; ++w) {
                    const float c = exp2f_approx(sMW[w * BM + r] * scale_log2 - ref_new);
                    sCoef[w * BM + r] = c;
                    l_t += c * sMW[(NWARPS + w) * BM + r];
                }
                const float keep = exp2f_approx(m_i * scale_log2 - ref_new);
                const float l_new = keep * l_i + l_t;
                const float inv = inv_or_zero(l_new);  // epilogue.cuh's rule: NaN stays NaN
#pragma unroll
                for (int w = 0; w < NWARPS; ++w) sCoef[w * BM + r] *= inv;
                sCoef[NWARPS * BM + r] = keep * l_i * inv;
                lb[m0 + r] = l_new;
                mb[m0 + r] = m_new;
            }
            __syncthreads();

            // Line 12: O_i <- diag(l_new)^-1 (diag(l_i) e^(m_i - m_new) O_i + sum_w e^(m~_w - m_new) P~_w V_{j,w}),
            // written back to HBM.
            for (int c = threadIdx.x; c < BM * D / 4; c += THREADS) {
                const int r = c / (D / 4), col = (c % (D / 4)) * 4;
                const float keep = sCoef[NWARPS * BM + r];
                float4 acc = *reinterpret_cast<const float4*>(sO + r * FS + col);
                acc.x *= keep, acc.y *= keep, acc.z *= keep, acc.w *= keep;
#pragma unroll
                for (int w = 0; w < NWARPS; ++w) {
                    const float cw = sCoef[w * BM + r];
                    const float4 p = *reinterpret_cast<const float4*>(sPV + (w * BM + r) * FS + col);
                    acc.x += cw * p.x, acc.y += cw * p.y, acc.z += cw * p.z, acc.w += cw * p.w;
                }
                *reinterpret_cast<float4*>(Ob + (i64)(m0 + r) * D + col) = acc;
            }
            __syncthreads();  // shared buffers are reused by the next inner step
        }
        cp_async_wait<0>();
        __syncthreads();
    }

    // After the last K/V block O is final (it was normalized at every step): cast it, and LSE = m + ln l.
    for (int r = threadIdx.x; r < seqlen_q; r += THREADS)
        store_lse(p.lse, b, h, p.heads, seqlen_q, r, finish_row(lb[r], mb[r] * scale_log2).lse);
    u16* Ob16 = p.o + b * p.o_b + h * p.o_h;
    for (int c = threadIdx.x; c < seqlen_q * (D / 2); c += THREADS) {
        const int r = c / (D / 2), col = (c % (D / 2)) * 2;
        if (col >= d) continue;  // padded columns are not stored
        const float2 x = *reinterpret_cast<const float2*>(Ob + (i64)r * D + col);
        *reinterpret_cast<u32*>(Ob16 + r * p.o_n + col) = T::pack(x.x, x.y);
    }
}
