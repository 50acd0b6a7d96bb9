// The fused dQ of the Hopper backward (fa2_bwd_fused_writer_sm90): the two compute warpgroups of a dK/dV CTA
// leave each step's share dS_ij K_j of dQ_i in shared memory and go on; a third warpgroup, the writer, adds the
// shares into an fp32 dQ sum in global memory by bulk copies, each Q block's shares in DqOrder's fixed order (so
// the sum is the same bit for bit on every run). Two share buffers alternate, each with a full and an empty
// mbarrier and a slot naming the share's Q block and rank; a share of rank -1 ends the writer's walk.
#pragma once
#include "bwd_dkdv.cuh"

namespace fav {

// The shares a compute thread has handed over so far: share k goes to buffer k % 2.
struct DqShares {
    int sent;
};

// The role a persistent fused-dQ CTA takes in its m-th work item: K/V block j and the order of its Q blocks. CTA c
// of a head's n_kv takes block c; causal items alternate the roles (c, n_kv - 1 - c) and the visiting direction so
// that every CTA's two items add up to one head's work.
struct FusedItemRole {
    int j;
    DqOrder order;
};
template <int BN, int BM>
__forceinline__ __device__ FusedItemRole fused_item_role(const BwdParams& p, int c, int n_kv, int m) {
    const int n_q = (p.seqlen_q + BM - 1) / BM;
    const bool down = p.causal && (m & 1);
    const int j = down ? n_kv - 1 - c : c;
    const int i_first = BwdMask(p).q_blocks<BM>(j * BN).begin;
    return {j, DqOrder{p.causal ? (down ? DqOrder::DOWN : DqOrder::UP) : DqOrder::ROTATED, j, n_kv, n_q, i_first,
                       j * n_q / n_kv}};
}

// A persistent fused-dQ CTA's walk over its work items: CTA (group, c), c = blockIdx.x % n_kv, takes K/V block
// column c of every groups-th (batch, KV head) from `group` on, its m-th item in fused_item_role's role. The
// compute warpgroups and the producer walk it alike, so both sides agree on every item and step.
//   for (ItemWalk w(p, batch); w.more(); w.next()) ... w.role(p), w.h_kv(), w.b()
template <int BN, int BM>
struct ItemWalk {
    int n_kv, heads_kv, c, groups, items, item, m;
    __forceinline__ __device__ ItemWalk(const BwdParams& p, int batch) {
        const int block = blockIdx.x;  // (signed: the divisions by n_kv are)
        n_kv = (p.seqlen_k + BN - 1) / BN, heads_kv = p.heads / p.group;
        c = block % n_kv, groups = gridDim.x / n_kv, items = batch * heads_kv, item = block / n_kv, m = 0;
    }
    // (SequenceWalk's) with n_kv columns of CTAs given
    __forceinline__ __device__ ItemWalk(const BwdParams& p, int batch, int columns) {
        const int block = blockIdx.x;
        n_kv = columns, heads_kv = p.heads / p.group;
        c = block % n_kv, groups = gridDim.x / n_kv, items = batch * heads_kv, item = block / n_kv, m = 0;
    }
    __forceinline__ __device__ bool more() const { return item < items; }
    __forceinline__ __device__ void next() { item += groups, ++m; }
    __forceinline__ __device__ FusedItemRole role(const BwdParams& p) const {
        return fused_item_role<BN, BM>(p, c, n_kv, m);
    }
    __forceinline__ __device__ int h_kv() const { return item % heads_kv; }
    __forceinline__ __device__ int b() const { return item / heads_kv; }
    // (what SequenceWalk answers for a sequence of a masked call) the item's parameters and batch row, the items
    // run so far (the K/V barriers' phase), and where the tensor maps find its rows
    __forceinline__ __device__ const BwdParams& view(const BwdParams& p) const { return p; }
    __forceinline__ __device__ int view_b() const { return b(); }
    __forceinline__ __device__ int runs() const { return m; }
    __forceinline__ __device__ int q_row(int m0) const { return m0; }
    __forceinline__ __device__ int k_row(int key0) const { return key0; }
};

// Where Q block i of query head h keeps its share of the dQ sum, its counts, and fa3's stats, in Q blocks: a dense
// batch's (batch, heads, n_q) blocks; a packed one's (Q blocks of the packed rows + batch, heads), sequence seq's
// from q0 / BM + seq on (a sequence that starts inside a block takes one more), heads inner. (An int: the
// launchers keep the count below 2^31.)
template <int BM>
__forceinline__ __device__ int dq_block(const BwdParams& p, int b, int h, int i) {
    return (b * p.heads + h) * ((p.seqlen_q + BM - 1) / BM) + i;
}
template <int BM>
__forceinline__ __device__ int dq_block(const BwdSequence& s, int, int h, int i) {
    if (s.cu_seqlens_q == nullptr) return dq_block<BM>(static_cast<const BwdParams&>(s), s.seq, h, i);
    return (s.q0 / BM + s.seq + i) * s.heads + h;
}

// The columns of SequenceWalk's groups: the smallest divisor of the grid's CTAs that holds the longest sequence's
// n_kv K/V blocks (all the CTAs, one group, where none does), so that no CTA is left out of a group (a grid of
// groups x n_kv CTAs would leave SMs % n_kv SMs idle: half of them at 67 blocks on 132 SMs).
__forceinline__ __device__ int walk_columns(int n_kv, int ctas) {
    int columns = min(n_kv, ctas);
    while (ctas % columns) ++columns;
    return columns;
}

// fa3's masked backward's walk: ItemWalk's items (sequence, kv head), each on its sequence (sequence_view), on
// groups of walk_columns CTAs: a sequence of more K/V blocks than a group's columns is walked a chunk of that many
// blocks at a time, in order, each chunk an item of its own to the CTAs. CTA c takes column c of a chunk moved on by the columns of the
// chunks before it, so that the short sequences of a packed batch spread over the CTAs rather than all landing on
// the first columns; a chunk whose column is past its blocks is skipped (the compute warps and the producer walk
// alike), its CTAs then are those of its columns, all resident. A chunk's shares of a Q block follow those of the
// chunks before it (DqOrder::rank_in), which the group's CTAs walked earlier: no cycle. The order's mode alternates
// with the chunks walked (sub), the same for every CTA of one; a band (causal or a window) visits Q blocks UP and
// DOWN, a full mask ROTATED.
template <int BN, int BM>
struct SequenceWalk : ItemWalk<BN, BM> {
    using W = ItemWalk<BN, BM>;
    const MaskedBwdParams& p;
    BwdSequence seq;
    int n_b, chunk, c0, n_c;  // the sequence's K/V blocks; the chunk, its first block and its columns
    int col, shift, sub, run;  // this CTA's column of it, the columns moved, the chunks walked and run before it
    __forceinline__ __device__ SequenceWalk(const MaskedBwdParams& p, int batch)
        : W(p, batch, walk_columns((p.seqlen_k + BN - 1) / BN, gridDim.x)), p(p), seq(sequence_view(p, 0)), n_b(0),
          chunk(0), c0(0), n_c(0), col(0), shift(0), sub(-1), run(-1) {
        find();
    }
    // From the current (item, chunk) on, the first chunk this CTA has a column in.
    __forceinline__ __device__ void find() {
        while (W::more()) {
            if (chunk == 0) {
                seq = sequence_view(p, W::b());
                n_b = (seq.seqlen_k + BN - 1) / BN;
            }
            c0 = chunk * W::n_kv;
            if (c0 >= n_b) {
                W::next();
                chunk = 0;
                continue;
            }
            n_c = min(W::n_kv, n_b - c0);
            col = W::c - shift < 0 ? W::c - shift + W::n_kv : W::c - shift;
            shift = (shift + n_c) % W::n_kv;
            ++sub;
            if (col < n_c) {
                ++run;
                return;
            }
            ++chunk;
        }
    }
    __forceinline__ __device__ void next() { ++chunk, find(); }
    __forceinline__ __device__ FusedItemRole role(const MaskedBwdParams&) const {
        const bool band = p.causal || p.window_left >= 0 || p.window_right >= 0;
        const bool down = band && (sub & 1);
        const int j = c0 + (down ? n_c - 1 - col : col), n_q = (seq.seqlen_q + BM - 1) / BM;
        const BlockRange seen = BwdAttnMask(seq, 0).q_blocks<BM, BN>(j * BN);
        return {j, DqOrder{band ? (down ? DqOrder::DOWN : DqOrder::UP) : DqOrder::ROTATED, j, n_c,
                           band ? seen.end : n_q, seen.begin, (j - c0) * n_q / n_c, c0, c0 + n_c}};
    }
    __forceinline__ __device__ const BwdSequence& view(const MaskedBwdParams&) const { return seq; }
    __forceinline__ __device__ int view_b() const { return seq.b; }
    __forceinline__ __device__ int runs() const { return run; }
    __forceinline__ __device__ int q_row(int m0) const { return seq.q0 + m0; }
    __forceinline__ __device__ int k_row(int key0) const { return seq.k0 + key0; }
};

// The walk of a fused-dQ CTA whose items see parameters P (DkdvConfig's Params).
template <class P, int BN, int BM>
struct WalkOf {
    using type = ItemWalk<BN, BM>;
};
template <int BN, int BM>
struct WalkOf<BwdSequence, BN, BM> {
    using type = SequenceWalk<BN, BM>;
};

// The two share buffers (DkdvSmem's DQ on): each holds both warpgroups' 64 x 64 fp32 halves of a share.
template <int D, int BN, int BM>
struct DqBuffers {
    using L = DkdvSmem<D, BN, BM, 2, false>;
    u32 base;  // the CTA's 1024-aligned shared base
    __forceinline__ __device__ u32 half(int buf, int h) const { return base + L::DQ + buf * 2 * L::HALF + h * L::HALF; }
    __forceinline__ __device__ u32 full(int buf) const { return base + L::DQ_BARS + 8 * buf; }
    __forceinline__ __device__ u32 empty(int buf) const { return base + L::DQ_BARS + 16 + 8 * buf; }
    __forceinline__ __device__ u32 slot(int buf) const { return base + L::DQ_SLOTS + 8 * buf; }
    // (compute threads) until the writer has read the share two before `share` from the buffer `share` will take
    __forceinline__ __device__ void wait_free(int share) const { mbar_wait(empty(share % 2), ((share / 2) & 1) ^ 1); }
    // (one thread, before the CTA's first barrier) full: every compute thread arrives, once its part of the share
    // is stored; empty: both writer threads, once their copies have read it
    __forceinline__ __device__ void init(int compute_threads) const {
        for (int k = 0; k < 2; ++k) {
            mbar_init(full(k), compute_threads);
            mbar_init(empty(k), 2);
        }
    }
};

// dS_wg-half K_j, with dS^T already in shared memory (both warpgroups' keys make up the reduction): n64 wgmmas
// with A (dS) and B (K_j) both read MN-major, from two base descriptors stepped by constants (not BN / 8 of them
// held across the loop). The two warpgroups split dQ_i (BM x D) in halves of 64 x 64: by rows at BM 128, by columns
// at BM 64.
template <class C>
__forceinline__ __device__ void issue_dq_share(const DkdvCta<C>& cta, float (&dqs)[8][4]) {
    using TdS = typename C::TdS;
    using TKV = typename C::TKV;
    constexpr int QR0 = C::BM == 128 ? 64 : 0, DC0 = C::BM == 128 ? 0 : 64;  // times wg
    wgmma_fence();
    const u64 a0 = TdS::desc_mn(cta.smem.ds, 0, 2 * QR0 * cta.wg), b0 = TKV::desc_mn(cta.smem.k(), 0, 2 * DC0 * cta.wg);
#pragma unroll
    for (int kk = 0; kk < C::BN / 16; ++kk)
        wgmma_16_ss<typename C::T, 1, 1>(dqs, a0 + kk * TdS::W, b0 + kk * TKV::W, kk > 0);
    wgmma_commit();
}

// A compute warpgroup's step of the fused dQ once P^T is in: dV_j += P^T dO_i, dS^T and dK_j += dS^T Q_i, then dQ_i's
// share dS_ij K_j to the writer (share k of the CTA into buffer k % 2).
// dV reads P^T from shared memory at BM 128, so that its A fragments (32 registers) are not live under the dP^T
// wgmma: the compute warps then fit the 240 registers that setmaxnreg leaves them. Its place is this warpgroup's
// half of the buffer this step's share will take (a SwizzledTile of 64 keys x BM queries): only this warpgroup's dV
// reads it, and the share overwrites it once every wgmma of the step is done. (At BM 64 its 16 registers fit.
// Issuing dP^T only behind dV instead does not help at BM 128: P^T stays live for dS^T, and ptxas serializes the
// wgmmas all the same.)
// The share then goes into the buffer in fragment order: the (n, r) pair of thread x at float ((n * 2 + r) * 128 +
// x) * 2 of the warpgroup's half (8-byte pairs contiguous by thread: conflict-free; fa2_bwd_dq_convert reads this
// layout), with its slot: where it goes (an int: batch x heads x Q blocks < 2^31) and its rank in Q block i's order.
// chain: issue_dk's (the transforms' chain rule on dS^T, MASKED).
template <class C, class Chain>
__forceinline__ __device__ void fused_dq_step(const DkdvCta<C>& cta, const DkdvRegs<C>& r, DqShares& shares,
                                              const DqOrder& order, int stage, const float* delta, int h, int i,
                                              const Chain& chain) {
    using TP = SwizzledTile<64, 2 * C::BM>;
    const DqBuffers<C::D, C::BN, C::BM> bufs{cta.smem.base};
    const int share = shares.sent++, buf = share % 2;
    const u32 half = cta.smem.dq + buf * 2 * C::Smem::HALF + cta.wg * C::Smem::HALF;  // (bufs.half)
    if constexpr (C::BM == 128) {
        {
            u32 a[C::NT / 2][4];
            repack_all<typename C::T>(a, r.pt);
            store_a_rows<TP, C::NT>(half, cta.warp * 16, a);
        }
        fence_proxy_async();
        named_sync(1 + cta.wg, 128);  // this warpgroup's P^T in
        wgmma_fence();
        wgmma_ss_rows<typename C::T, TP, typename C::TQ, C::D, C::BM / 16>(r.dv[0], half, 0, cta.smem.dout(stage));
        wgmma_commit();
    } else {
        issue_dv(cta, r, stage);
    }
    wgmma_wait<1>();  // dP^T is in (dV may still run)
    hold_registers(r.dpt);
    issue_dk(cta, r, stage, delta, chain);
    store_a_rows<typename C::TdS, C::NT>(cta.smem.ds, cta.kr0, r.ads);
    fence_proxy_async();
    sync_cta<C>();  // both warpgroups' dS^T in
    float dqs[8][4];
    issue_dq_share(cta, dqs);
    wgmma_wait<0>();  // dV, dK, the share: P^T and dS^T are read
    hold_registers(dqs);
    hold_registers(r.dv[0]);
    hold_registers(r.dk[0]);
    const u32 mine = half + (threadIdx.x % 128) * 8;
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int k = 0; k < 2; ++k) st_shared_f32x2(mine + (n * 2 + k) * 128 * 8, dqs[n][2 * k], dqs[n][2 * k + 1]);
    fence_proxy_async();  // visible to the bulk copy that reads it
    if (threadIdx.x == 0) {
        if constexpr (C::MASKED) {
            st_shared(bufs.slot(buf), dq_block<C::BM>(cta.p, cta.b, h, i));
            st_shared(bufs.slot(buf) + 4, order.rank_in<C::BM, C::BN>(i, cta.mask));
        } else {
            const int n_q = (cta.mask.seqlen_q + C::BM - 1) / C::BM;
            st_shared(bufs.slot(buf), ((cta.b * cta.p.heads + h) * n_q + i));
            st_shared(bufs.slot(buf) + 4, order.rank<C::BM, C::BN>(i, cta.mask.seqlen_q, cta.mask.seqlen_k));
        }
    }
    mbar_arrive_if(bufs.full(buf), true);
}
template <class C>
__forceinline__ __device__ void fused_dq_step(const DkdvCta<C>& cta, const DkdvRegs<C>& r, DqShares& shares,
                                              const DqOrder& order, int stage, const float* delta, int h, int i) {
    fused_dq_step(cta, r, shares, order, stage, delta, h, i, [](float(&)[C::NT][4]) {});
}

// (compute threads) The end of a CTA's walk: a last share of rank -1.
template <int D, int BN, int BM>
__forceinline__ __device__ void end_dq_shares(const DqShares& shares) {
    extern __shared__ unsigned char smem[];
    const DqBuffers<D, BN, BM> bufs{(smem_u32(smem) + 1023) & ~1023u};
    const u32 buf = shares.sent % 2;
    mbar_wait(bufs.empty(buf), ((shares.sent / 2) & 1) ^ 1);
    if (threadIdx.x == 0) st_shared(bufs.slot(buf) + 4, -1);
    mbar_arrive_if(bufs.full(buf), true);
}

// The writer warpgroup: lane 0 of its warps 0 and 1 each take one half of every share the compute warpgroups leave
// (buffer k % 2 of the CTA's k-th share, with its slot; rank -1 ends the walk): wait for the full barrier, then
// (ORDERED) for the Q block's count to reach the rank, store (rank 0) or add the 16 KB half by one bulk copy, hand
// the buffer back once it is read, and release the count once the copy is complete. The compute warps go on
// meanwhile; they wait only when both buffers are still unread. dq_acc: (batch, heads, n_q, half, 64 x 64) fp32;
// dq_counts (batch, heads, n_q, 2): the shares added so far to each half of each Q block. Not ORDERED: every share
// is added as it comes, into a zeroed dq_acc (no counts): the sum's rounding then depends on the arrival order.
template <int D, int BN, int BM, bool ORDERED = true>
__forceinline__ __device__ void dq_writer(float* dq_acc, int* dq_counts) {
    using L = DkdvSmem<D, BN, BM, 2, false>;
    extern __shared__ unsigned char smem[];
    const DqBuffers<D, BN, BM> bufs{(smem_u32(smem) + 1023) & ~1023u};
    const int half = threadIdx.x / 32 % 4;
    if (half >= 2 || threadIdx.x % 32 != 0) return;
    for (int share = 0;; ++share) {
        const int buf = share % 2;
        const u32 full = bufs.full(buf), empty = full + 16, slot = bufs.slot(buf);
        mbar_wait(full, (share / 2) & 1);
        const int block = ld_shared(slot), rank = ld_shared(slot + 4);
        if (rank < 0) break;
        const i64 at = 2 * (i64)block + half;  // (batch, head, Q block, half)
        if constexpr (ORDERED) {
            wait_count_at_least(dq_counts + at, rank);
            fence_proxy_async_global();  // the earlier shares' copies, seen through the count, come first
        }
        const u32 src = bufs.half(buf, half);
        if (ORDERED && rank == 0) bulk_store(dq_acc + at * 64 * 64, src, L::HALF);
        else bulk_reduce_add_f32(dq_acc + at * 64 * 64, src, L::HALF);
        bulk_commit();
        bulk_wait_read<0>();
        mbar_arrive_if(empty, true);
        if constexpr (ORDERED) {
            bulk_wait<0>();
            fence_proxy_async_global();
            release_own_count(dq_counts + at);
        }
    }
    bulk_wait<0>();
}

// dQ = scale x the fused pass's fp32 sum, one thread's 8 columns of a query row (x: the row's chunk of 8 columns
// in (row, chunk) order) of head h, batch row b, into q's layout (contiguous); Q blocks that see no key get zeros
// (no share was stored there). The sum is in the writer's layout, (Q blocks as dq_block numbers them, half,
// 64 x 64 in fragment order: the pair of columns 8n + 2t, + 1 of row 16 w + 8 r + g at float ((n * 2 + r) * 128 +
// 32 w + 4 g + t) * 2 of its half), so that a row's 8 columns from 8n on are again 8 consecutive floats.
// fa2_bwd_sm90.cu's fa2_bwd_dq_convert (p: BwdParams) and fa3_bwd.cu's masked one (p: a BwdSequence) run it.
template <class T, int D, int BN, int BM, class P>
__forceinline__ __device__ void convert_dq_row(const P& p, int b, int h, int x, const float* dq_acc) {
    static_assert(BM * D == 2 * 64 * 64, "the writer's two 64 x 64 halves");
    const int chunks = p.head_dim / 8;
    if (x >= p.seqlen_q * chunks) return;
    const typename BwdMaskOf<P>::type mask(p, h);
    const int q = x / chunks, col = x % chunks * 8, i = q / BM;
    const bool seen = mask.template kv_blocks<BM, BN>(i * BM).count() > 0;
    // halves by rows at BM 128 (d 64), by columns at BM 64 (d 128)
    const int rq = q % BM, half = BM == 128 ? rq / 64 : col / 64, row = rq % 64, n = col % 64 / 8;
    const float* src = dq_acc + ((i64)dq_block<BM>(p, b, h, i) * 2 + half) * 64 * 64 +
                       ((n * 2 + row % 16 / 8) * 128 + row / 16 * 32 + row % 8 * 4) * 2;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = seen ? src[e] : 0.f;
    u32 packed[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) packed[e] = T::pack(v[2 * e] * p.scale, v[2 * e + 1] * p.scale);
    *reinterpret_cast<uint4*>(p.dq + ((i64)b * p.seqlen_q + q) * p.heads * p.head_dim + (i64)h * p.head_dim + col) =
        make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

}  // namespace fav
