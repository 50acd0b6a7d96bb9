// FlashAttention-2 forward (Dao, 2023), on mma.sync tensor cores.
//
//   grid: (Q block i, head, batch)    one CTA owns Q_i (BM rows) and loops over every K/V block j
//   warps: split-Q                    warp w owns rows [w*WM, (w+1)*WM) of Q_i: no inter-warp reduction
//   normalization: deferred           O accumulates unnormalized in registers; one division by l at the end
//   pipeline: K/V double-buffered     cp.async of block j+1 is in flight while block j is computed;
//                                     one barrier per block
//
// Read beside fa1_fwd.cu: same pieces (common/), other loop order, other warp split, other normalization.
#include "common/epilogue.cuh"
#include "common/fragments.cuh"
#include "common/mask.cuh"

// One CTA's work: Q block i_block of (batch b, head h) against the K/V blocks MASK lets it see.
// EARLY_PREFETCH: issue block j+1's loads right after block j's barrier (longest overlap) or after block j's
// softmax (shorter live ranges: needed at d = 128, where the early position spills). Chosen per head dim by
// measurement (docs/results.md). D: the template head dim p.head_dim pads to. EPI: what the CTA does with its
// rows at the end (common/epilogue.cuh): O / l and LSE, or a split-KV partial. MASK: common/mask.cuh's policy.
template <class T, int D, int BM, int BN, int NWARPS, bool EARLY_PREFETCH, class EPI, class MASK, class Params>
__forceinline__ __device__ void fa2_block(const Params& p, const MASK& mask, int i_block, int h, int b) {
    using namespace fav;
    constexpr int THREADS = NWARPS * 32;
    constexpr int WM = BM / NWARPS, MT = WM / 16;  // rows per warp, m-tiles per warp
    constexpr int NT = BN / 8, DT = D / 8;          // n-tiles of S, n-tiles of O
    // Q fragments stay in registers for the whole loop when they fit; at d >= 96 they would crowd out the
    // O accumulator, so they are re-read from shared memory (ldmatrix) each block, as FlashAttention-2 does.
    constexpr bool Q_IN_REGS = MT * (D / 16) * 4 <= 32;
    using TQ = Tile<BM, D>;
    using TKV = Tile<BN, D>;
    static_assert(WM % 16 == 0 && BN % 16 == 0 && D % 16 == 0, "tile sizes must be multiples of 16");

    extern __shared__ __align__(16) unsigned char smem[];
    const u32 sQ = smem_u32(smem);
    // Shared memory: Q_i, then two stages of (K_j, V_j).
    auto sK = [&](int stage) { return sQ + TQ::BYTES + stage * 2 * TKV::BYTES; };
    auto sV = [&](int stage) { return sK(stage) + TKV::BYTES; };

    const int h_kv = h / p.group;
    const int m0 = i_block * BM, warp = threadIdx.x / 32, row0 = warp * WM;  // row0: first row of this warp in Q_i
    const int seqlen_k = mask.seqlen_k;
    const BlockRange blocks = mask.template kv_blocks<BM, BN>(m0, kv_split(p));

    const u16* Qi = p.q + b * p.q_b + h * p.q_h + m0 * p.q_n;
    const u16* Kb = p.k + b * p.k_b + h_kv * p.k_h;
    const u16* Vb = p.v + b * p.v_b + h_kv * p.v_h;
    auto load_kv = [&](int j, int stage) {  // one cp.async group per K/V block
        load_tile_async<BN, D, THREADS>(sK(stage), Kb + (i64)j * BN * p.k_n, p.k_n, seqlen_k - j * BN, p.head_dim);
        load_tile_async<BN, D, THREADS>(sV(stage), Vb + (i64)j * BN * p.v_n, p.v_n, seqlen_k - j * BN, p.head_dim);
        cp_async_commit();
    };

    load_tile_async<BM, D, THREADS>(sQ, Qi, p.q_n, p.seqlen_q - m0, p.head_dim);  // Q_i: once, in block 0's group
    if (blocks.count() > 0) load_kv(blocks.begin, 0);
    else cp_async_commit();

    float o[MT][DT][4] = {};                 // unnormalized O_i rows of this warp
    float m[MT][2], l[MT][2] = {};           // running row max (raw score units) and this thread's partial sums
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = neg_inf();
    u32 q_frag[Q_IN_REGS ? MT : 1][Q_IN_REGS ? D / 16 : 1][4];

    for (int j = blocks.begin; j < blocks.end; ++j) {
        const int stage = (j - blocks.begin) % 2;
        cp_async_wait<0>();  // K_j and V_j have landed (issued during block j-1)
        // One barrier per block: it publishes K_j and V_j to every warp and proves every warp is done with
        // block j-1. Between barriers the warps drift apart freely: one's softmax overlaps another's MMAs.
        __syncthreads();
        if (EARLY_PREFETCH && j + 1 < blocks.end) load_kv(j + 1, stage ^ 1);
        if (Q_IN_REGS && j == blocks.begin)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) load_a<TQ>(q_frag[mt][kk], sQ, row0 + mt * 16, kk * 16);

        // S = Q_i K_j^T (fp32 accumulate)
        float s[MT][NT][4] = {};
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if constexpr (Q_IN_REGS) {
#pragma unroll
                    for (int r = 0; r < 4; ++r) a[mt][r] = q_frag[mt][kk][r];
                } else {
                    load_a<TQ>(a[mt], sQ, row0 + mt * 16, kk * 16);
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt += 2) {
                u32 bk[4];
                load_b_rows<TKV>(bk, sK(stage), nt * 8, kk * 16);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816<T>(s[mt][nt], a[mt], bk[0], bk[1]);
                    mma_16816<T>(s[mt][nt + 1], a[mt], bk[2], bk[3]);
                }
            }
        }
        mask.apply_if_needed(s, m0, row0, j * BN);
        online_softmax_step(s, m, l, o, p.scale_log2);
        // The other stage is free for block j+1: every warp passed this block's barrier, so all are done
        // with block j-1. With no barrier before P V any more, V's ldmatrix must not be hoisted above the
        // softmax (its fragments would be live across it): the cp.async below, or an empty volatile asm,
        // pins the order.
        if (!EARLY_PREFETCH && j + 1 < blocks.end) load_kv(j + 1, stage ^ 1);
        if (EARLY_PREFETCH) asm volatile("" ::: "memory");

        // O += P~ V_j, with P~ taken straight from the S registers as the A operand.
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) repack_a<T>(a[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
            for (int dt = 0; dt < DT; dt += 2) {
                u32 bv[4];
                load_b_cols<TKV>(bv, sV(stage), kk * 16, dt * 8);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816<T>(o[mt][dt], a[mt], bv[0], bv[1]);
                    mma_16816<T>(o[mt][dt + 1], a[mt], bv[2], bv[3]);
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // with no K/V block to visit, Q's copies (from every thread) may still be landing
    mask.end_rows(o, m, l, p.scale_log2);

    // Epilogue: the one division by l (or a split's partial); O through shared memory for 16-byte stores. Each
    // warp reuses only its own rows of the Q tile, which only it has read: no CTA barrier needed.
    EPI::store(WarpRows<MT, DT>{o, m, l, p.scale_log2, b, h, m0 + row0},
               p, reinterpret_cast<u16*>(smem) + row0 * TQ::STRIDE);
}

template <class T, int D, int BM, int BN, int NWARPS, bool EARLY_PREFETCH, class EPI = fav::NormalizedOut<T, D>>
__global__ void __launch_bounds__(NWARPS * 32)
fa2_fwd(const fav::FwdParams p) {
    // Causal CTAs near the bottom do the most work: launch them first so the tail of the grid is short.
    fa2_block<T, D, BM, BN, NWARPS, EARLY_PREFETCH, EPI>(p, fav::CausalMask::of(p), gridDim.x - 1 - blockIdx.x,
                                                         blockIdx.y, blockIdx.z);
}

// The same loop under a window, softcap, ALiBi and sinks (AttnMask), over a dense batch or a packed one: a CTA of
// a packed batch takes its sequence's rows and keys (pointers moved to the sequence's first row, the lengths its
// own) and leaves at once where its Q block lies past the sequence's end (the grid covers the longest one).
template <class T, int D, int BM, int BN, int NWARPS, bool EARLY_PREFETCH>
__global__ void __launch_bounds__(NWARPS * 32)
fa2_fwd_masked(const fav::MaskedFwdParams p) {
    using namespace fav;
    const int i_block = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const MaskedFwdParams s = sequence_view(p, b);
    if (i_block * BM >= s.seqlen_q) return;
    fa2_block<T, D, BM, BN, NWARPS, EARLY_PREFETCH, NormalizedOut<T, D>>(
        s, AttnMask::of(p, s.seqlen_q, s.seqlen_k, b, h), i_block, h, b);
}
