// FlashAttention-2 backward (Dao, 2023, Algorithm 2) on mma.sync tensor cores: recomputation, deterministic.
//
//   pass 1  fa2_bwd_delta   D_i = rowsum(dO_i * O_i) in fp32, one warp per query row
//   pass 2  fa2_bwd_dkdv    grid (K/V block j x column slice, kv head, batch): K_j, V_j in shared memory, dK_j, dV_j
//                           in registers; loop over the group's query heads and, for each, the Q blocks that see
//                           block j: recompute S^T = K_j Q_i^T and P^T = exp(S^T - LSE_i) from the forward's LSE,
//                           dV_j += P^T dO_i, dP^T = V_j dO_i^T, dS^T = P^T * (dP^T - D_i), dK_j += dS^T Q_i
//                           (common/backward.cuh: key_rows_step). GQA's sum over the query heads of a group happens
//                           in that loop, in a fixed order.
//   pass 3  fa2_bwd_dq      grid (Q block i x column slice, head, batch): Q_i, dO_i in shared memory, dQ_i in
//                           registers; loop over the K/V blocks i sees: S, P, dP = dO_i V_j^T, dS, dQ_i += dS K_j.
//
// Pass 3 replaces FA2's atomic adds of dQ (which make dQ differ run to run) at the price of computing S, P and dP
// a second time. In pass 2 a warp owns 16 keys, so its S^T block has keys as rows and queries as columns (the mma
// C layout of softmax.cuh transposed): LSE and D are per column there, per row in pass 3.
//
// Column slices (DC < D, head dims above 128): a warp's 16 rows of dK and dV take 2 D / 8 fp32 registers a thread
// each (256 at D = 256), so a CTA accumulates only columns [c0, c0 + DC) of its gradients, c0 = slice * DC, and
// the D / DC slices of one block are neighbouring CTAs (blockIdx.x = block * (D / DC) + slice). Each recomputes
// S^T and dP^T over the whole head dim: a slice costs the QK^T and dO V^T products again, not registers.
// DC = D is the unsplit kernel. Every slice's results are its own columns: still deterministic.
#include "common/backward.cuh"
#include "common/epilogue.cuh"
#include "common/mask.cuh"

// The delta pass is independent of the head dim's template (any head_dim a multiple of 8): other backwards (the
// Hopper one) launch it too, through kernels/fa2_bwd.py's delta().
template <class T, int NWARPS>
__global__ void __launch_bounds__(NWARPS * 32)
fa2_bwd_delta(const fav::BwdParams p) {
    using namespace fav;
    const int i = blockIdx.x * NWARPS + threadIdx.x / 32, h = blockIdx.y, b = blockIdx.z, lane = threadIdx.x % 32;
    if (i >= p.seqlen_q) return;
    const float sum = row_delta<T>(p, b, h, i, lane);
    if (lane == 0) p.delta[((i64)b * p.heads + h) * p.seqlen_q + i] = sum;
}

// Pass 2 for K/V block j (columns from c0) of kv head h_kv in batch row b, under the mask policy (mask.cuh) that
// make_mask() builds. (Built after seqlen_q is read: the other order changed the plain kernels' machine code, and
// made fa2_bwd_dq at d 224 spill on sm_90a.)
template <class T, int D, int DC, int BM, int BN, int NWARPS, class Params, class MakeMask>
__forceinline__ __device__ void dkdv_block(const Params& p, const MakeMask& make_mask, int j, int c0, int h_kv,
                                           int b) {
    using namespace fav;
    constexpr int THREADS = NWARPS * 32, NT = BM / 8, DCT = DC / 8;
    using TQ = Tile<BM, D>;
    using TKV = Tile<BN, D>;
    static_assert(BN == 16 * NWARPS && BM % 16 == 0 && D % 16 == 0, "a warp owns 16 keys");
    static_assert(D % DC == 0 && DC % 16 == 0, "column slices of whole mma n-tile pairs");

    extern __shared__ __align__(16) unsigned char smem[];
    // Shared memory: K_j, V_j, then two stages of (Q_i, dO_i), then two stages of the rows' LSE (log2) and D.
    const u32 sK = smem_u32(smem), sV = sK + TKV::BYTES;
    auto sQ = [&](int stage) { return sV + TKV::BYTES + stage * 2 * TQ::BYTES; };
    auto sdO = [&](int stage) { return sQ(stage) + TQ::BYTES; };
    float* stats = reinterpret_cast<float*>(smem + 2 * TKV::BYTES + 4 * TQ::BYTES);  // [stage][lse2 | D][BM]

    const int warp = threadIdx.x / 32;
    const int seqlen_q = p.seqlen_q;
    const auto mask = make_mask();
    const int seqlen_k = mask.seqlen_k;
    const int key0 = j * BN, kr0 = warp * 16;  // the block's first key; this warp's first row of it
    const BlockRange q_range = mask.template q_blocks<BM, BN>(key0);   // the Q blocks that see block j
    const int i_first = q_range.begin, n_i = max(0, q_range.end - i_first);  // (per query head)
    const int steps = p.group * n_i;                              // (query head, Q block), head-major

    load_tile_async<BN, D, THREADS>(sK, p.k + b * p.k_b + h_kv * p.k_h + (i64)key0 * p.k_n, p.k_n, seqlen_k - key0,
                                    p.head_dim);
    load_tile_async<BN, D, THREADS>(sV, p.v + b * p.v_b + h_kv * p.v_h + (i64)key0 * p.v_n, p.v_n, seqlen_k - key0,
                                    p.head_dim);
    auto load_q = [&](int step, int stage) {  // one cp.async group per step (the first also carries K_j, V_j)
        const int h = h_kv * p.group + step / n_i, m0 = (i_first + step % n_i) * BM;
        load_tile_async<BM, D, THREADS>(sQ(stage), p.q + b * p.q_b + h * p.q_h + (i64)m0 * p.q_n, p.q_n,
                                        seqlen_q - m0, p.head_dim);
        load_tile_async<BM, D, THREADS>(sdO(stage), p.dout + b * p.do_b + h * p.do_h + (i64)m0 * p.do_n, p.do_n,
                                        seqlen_q - m0, p.head_dim);
        cp_async_commit();
        for (int r = threadIdx.x; r < BM; r += THREADS) {
            const RowStats st = row_stats(p, b, h, m0 + r);
            stats[(2 * stage) * BM + r] = st.lse2;
            stats[(2 * stage + 1) * BM + r] = st.delta;
        }
    };
    if (steps > 0) load_q(0, 0);
    else cp_async_commit();

    float dk[1][DCT][4] = {}, dv[1][DCT][4] = {};
    for (int s = 0; s < steps; ++s) {
        const int stage = s % 2, m0 = (i_first + s % n_i) * BM;
        cp_async_wait<0>();
        __syncthreads();  // step s visible to every warp; every warp is done with step s-1's stage
        if (s + 1 < steps) load_q(s + 1, stage ^ 1);
        float ds[1][NT][4];
        key_rows_step<T, D, BM, BN>(dk, dv, ds, sK, sV, kr0, sQ(stage), sdO(stage), c0, stats + (2 * stage) * BM,
                                    stats + (2 * stage + 1) * BM, p.scale_log2, key0, m0,
                                    mask.for_head(p, h_kv * p.group + s / n_i));
    }
    cp_async_wait<0>();
    __syncthreads();  // with no step to run, K_j's and V_j's copies (from every thread) may still be landing

    // dK = scale * dS^T Q and dV, columns [c0, c0 + DC), each staged through this warp's own rows of the K and V
    // tiles (which only this warp read) for 16-byte stores into contiguous (batch, seqlen_k, heads_kv, head_dim)
    // gradients.
    const int heads_kv = p.heads / p.group;
    const i64 ld = (i64)heads_kv * p.head_dim;
    const i64 at = ((i64)b * seqlen_k + key0 + kr0) * ld + (i64)h_kv * p.head_dim + c0;
    u16* stage_k = reinterpret_cast<u16*>(smem) + kr0 * TKV::STRIDE;
    u16* stage_v = reinterpret_cast<u16*>(smem + TKV::BYTES) + kr0 * TKV::STRIDE;
    const float scale[1][2] = {{p.scale, p.scale}}, one[1][2] = {{1.f, 1.f}};
    store_acc_rows<T, DC>(dk, scale, stage_k, p.dk + at, ld, seqlen_k - key0 - kr0, p.head_dim - c0);
    store_acc_rows<T, DC>(dv, one, stage_v, p.dv + at, ld, seqlen_k - key0 - kr0, p.head_dim - c0);
}

template <class T, int D, int DC, int BM, int BN, int NWARPS>
__global__ void __launch_bounds__(NWARPS * 32)
fa2_bwd_dkdv(const fav::BwdParams p) {
    constexpr int SLICES = D / DC;
    dkdv_block<T, D, DC, BM, BN, NWARPS>(p, [&] { return fav::CausalMask::of(p); }, blockIdx.x / SLICES,
                                         (blockIdx.x % SLICES) * DC, blockIdx.y, blockIdx.z);
}

// Pass 3 for Q block i_block (columns from c0) of query head h in batch row b, under make_mask()'s policy.
template <class T, int D, int DC, int BM, int BN, int NWARPS, class Params, class MakeMask>
__forceinline__ __device__ void dq_block(const Params& p, const MakeMask& make_mask, int i_block, int c0, int h,
                                         int b) {
    using namespace fav;
    constexpr int THREADS = NWARPS * 32, NT = BN / 8, DCT = DC / 8;
    using TQ = Tile<BM, D>;
    using TKV = Tile<BN, D>;
    static_assert(BM == 16 * NWARPS && BN % 16 == 0 && D % 16 == 0, "a warp owns 16 query rows");
    static_assert(D % DC == 0 && DC % 16 == 0, "column slices of whole mma n-tile pairs");

    extern __shared__ __align__(16) unsigned char smem[];
    // Shared memory: Q_i, dO_i, then two stages of (K_j, V_j).
    const u32 sQ = smem_u32(smem), sdO = sQ + TQ::BYTES;
    auto sK = [&](int stage) { return sdO + TQ::BYTES + stage * 2 * TKV::BYTES; };
    auto sV = [&](int stage) { return sK(stage) + TKV::BYTES; };

    const int h_kv = h / p.group;
    const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const int seqlen_q = p.seqlen_q;
    const auto mask = make_mask();
    const int seqlen_k = mask.seqlen_k;
    const int m0 = i_block * BM, row0 = warp * 16;
    const BlockRange blocks = mask.template kv_blocks<BM, BN>(m0);

    load_tile_async<BM, D, THREADS>(sQ, p.q + b * p.q_b + h * p.q_h + (i64)m0 * p.q_n, p.q_n, seqlen_q - m0,
                                    p.head_dim);
    load_tile_async<BM, D, THREADS>(sdO, p.dout + b * p.do_b + h * p.do_h + (i64)m0 * p.do_n, p.do_n, seqlen_q - m0,
                                    p.head_dim);
    auto load_kv = [&](int j, int stage) {
        load_tile_async<BN, D, THREADS>(sK(stage), p.k + b * p.k_b + h_kv * p.k_h + (i64)j * BN * p.k_n, p.k_n,
                                        seqlen_k - j * BN, p.head_dim);
        load_tile_async<BN, D, THREADS>(sV(stage), p.v + b * p.v_b + h_kv * p.v_h + (i64)j * BN * p.v_n, p.v_n,
                                        seqlen_k - j * BN, p.head_dim);
        cp_async_commit();
    };
    if (blocks.count() > 0) load_kv(blocks.begin, 0);
    else cp_async_commit();

    float lse2[2], delta[2];  // this thread's two rows: LSE in log2 units and D
    fragment_row_stats(p, b, h, m0 + row0, lse2, delta);

    float dq[1][DCT][4] = {};
    for (int j = blocks.begin; j < blocks.end; ++j) {
        const int stage = (j - blocks.begin) % 2, key0 = j * BN;
        cp_async_wait<0>();
        __syncthreads();
        if (j + 1 < blocks.end) load_kv(j + 1, stage ^ 1);

        // S = Q_w K_j^T, then P in place
        float pr[1][NT][4] = {};
        warp_mma_abt<T, TQ, TKV, D / 16>(pr, sQ, row0, sK(stage));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                pr[0][nt][e] = recompute_p(mask, pr[0][nt][e], p.scale_log2, lse2[e / 2],
                                           key0 + nt * 8 + 2 * t + (e % 2), m0 + row0 + g + 8 * (e / 2), seqlen_k);

        // dP = dO_w V_j^T, then dS = P * (dP - D) in place
        float ds[1][NT][4] = {};
        warp_mma_abt<T, TQ, TKV, D / 16>(ds, sdO, row0, sV(stage));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                ds[0][nt][e] = pr[0][nt][e] * (ds[0][nt][e] - delta[e / 2]);
                if constexpr (decltype(mask)::TRANSFORMS)
                    ds[0][nt][e] = mask.ds_raw(ds[0][nt][e], pr[0][nt][e], p.scale_log2, lse2[e / 2],
                                               m0 + row0 + g + 8 * (e / 2), key0 + nt * 8 + 2 * t + (e % 2));
            }

        // dQ_i[:, c0 + DC) += dS K_j[:, c0 + DC)
        warp_mma_pb<T, TKV>(dq, ds, sK(stage) + 2 * c0);
    }
    cp_async_wait<0>();
    __syncthreads();  // with no K/V block to visit, Q's and dO's copies may still be landing

    // dQ = scale * dS K, columns [c0, c0 + DC), staged through this warp's own rows of the Q tile (which only this
    // warp read)
    const i64 ld = (i64)p.heads * p.head_dim;
    const float scale[1][2] = {{p.scale, p.scale}};
    store_acc_rows<T, DC>(dq, scale, reinterpret_cast<u16*>(smem) + row0 * TQ::STRIDE,
                          p.dq + ((i64)b * seqlen_q + m0 + row0) * ld + (i64)h * p.head_dim + c0, ld,
                          seqlen_q - m0 - row0, p.head_dim - c0);
}

template <class T, int D, int DC, int BM, int BN, int NWARPS>
__global__ void __launch_bounds__(NWARPS * 32)
fa2_bwd_dq(const fav::BwdParams p) {
    // The heaviest Q blocks (causal: the last) first; the slices of one block are neighbours.
    constexpr int SLICES = D / DC;
    dq_block<T, D, DC, BM, BN, NWARPS>(p, [&] { return fav::CausalMask::of(p); },
                                       gridDim.x / SLICES - 1 - blockIdx.x / SLICES, (blockIdx.x % SLICES) * DC,
                                       blockIdx.y, blockIdx.z);
}

// ---- the masked backward: the same passes under AttnMask (windows, softcap, ALiBi; the sinks are in the LSE), over
// a dense batch or a packed one, each CTA on its sequence's view (sequence.cuh's sequence_view: the pointers at the
// sequence's first row when packed, the lengths its own; b, for the dense strides, is 0 in a packed view).
template <class T, int D, int DC, int BM, int BN, int NWARPS>
__global__ void __launch_bounds__(NWARPS * 32)
fa2_bwd_dkdv_masked(const fav::MaskedBwdParams params) {
    using namespace fav;
    constexpr int SLICES = D / DC;
    const int j = blockIdx.x / SLICES, h_kv = blockIdx.y;
    const BwdSequence view = sequence_view(params, blockIdx.z);
    if (j * BN >= view.seqlen_k) return;
    const MaskedBwdParams& p = view;
    dkdv_block<T, D, DC, BM, BN, NWARPS>(
        p, [&] { return AttnMask::of(p, p.seqlen_q, p.seqlen_k, blockIdx.z, h_kv * params.group); }, j,
        (blockIdx.x % SLICES) * DC, h_kv, view.b);
}

template <class T, int D, int DC, int BM, int BN, int NWARPS>
__global__ void __launch_bounds__(NWARPS * 32)
fa2_bwd_dq_masked(const fav::MaskedBwdParams params) {
    using namespace fav;
    constexpr int SLICES = D / DC;
    const int i_block = gridDim.x / SLICES - 1 - blockIdx.x / SLICES, h = blockIdx.y;
    const BwdSequence view = sequence_view(params, blockIdx.z);
    if (i_block * BM >= view.seqlen_q) return;
    const MaskedBwdParams& p = view;
    dq_block<T, D, DC, BM, BN, NWARPS>(p, [&] { return AttnMask::of(p, p.seqlen_q, p.seqlen_k, blockIdx.z, h); },
                                       i_block, (blockIdx.x % SLICES) * DC, h, view.b);
}
