// Masks and logit transforms as policies: what a main loop asks about the keys a query may see, answered in one
// place, so that a new mask is one more struct here with the same members (docs/kernels/masks.md: which kernel
// asks what, and how a mask is added). A kernel builds its policy once from its parameters, Mask::of(params).
//
// which blocks a loop visits (a block none of whose keys is seen is never visited)
//   kv_blocks<BM, BN>(m0, within)      the K/V blocks [begin, end) of BN keys that the queries [m0, m0 + BM) see,
//                                      inside `within` (split-KV: the launch's sub-range); the Q-outer loops
//   q_blocks<BM>(key0)                 the Q blocks [begin, end) of BM queries that see any key from key0 on; the
//                                      K/V-outer loops (fa1's forward, the backwards' dK/dV passes)
//   blocks<BM, BN>(params, m0)         (static) kv_blocks within the launch's split, read from the parameters where
//                                      it is asked (fa3's producer keeps no mask in its 24 registers)
//   first_masked_block<BN>(q0)         from which K/V block on some key is hidden from some query >= q0 (fa3 runs
//                                      the blocks below it in a loop with no mask)
//   last_key(q0, q1)                   the last key any query of [q0, q1] sees, -1 where none (fa3 skips past it)
// whether a block needs the element test (the edge test: a block with no hidden key runs none)
//   needs_mask<QUERIES, KEYS>(q0, q_off, k0)    some key of [k0, k0 + KEYS) is hidden from some query of
//                                      [q0 + q_off, q0 + q_off + QUERIES); if_needs_mask(..., then) runs then() there
// the element test, and what it does to a block and to a row's end
//   visible(query, key)                the test itself; a backward selects P = 0 where it fails (a select, never a
//                                      product with a mask: P = exp2(S - LSE), LSE = -inf, must not make a NaN)
//   apply<MASKED>(s, row0, key0)       the forward's scores of one block (softmax.cuh's fragment layout, the warp's
//                                      rows from row0, keys from key0): hidden ones to -inf where MASKED (the block
//                                      holds one); a transform of every score (a softcap) acts whatever MASKED says
//   apply_if_needed(s, m0, row0, key0) apply with MASKED decided by the edge test (the loops that do not split their
//                                      blocks into masked and mask-free ones), rows m0 + row0 on
//   end_rows(o, m, l, scale_log2)      a row's (O, m, l) once its last block is in: the sinks join the denominator
// A query range is passed as (tile origin, warp offset) where the kernels formed the sum inside the test: formed in
// the caller, NVVM ordered the operands of the test otherwise and the machine code changed.
//
// AttnMask (after CausalMask) answers them for a sliding window, a softcap, ALiBi and sinks, one sequence of a packed
// batch at a time; PackedMask (the end of this file) is decoding's: the same keys and transforms for GQA-packed rows.
//
// CausalMask, the prefill kernels' policy: the seqlen_k tail (keys >= seqlen_k in the block that straddles it) and,
// with causal, the bottom-right aligned diagonal: query i sees key j iff j <= i + seqlen_k - seqlen_q (the
// flash-attn >= 2.1 convention when seqlen_q != seqlen_k).
#pragma once
#include "block_range.cuh"
#include "math.cuh"
#include "params.cuh"
#include "sequence.cuh"
#include "softmax.cuh"

namespace fav {

// The K/V blocks a launch is given (split-KV: FwdParams' sub-range); every block for the others.
__forceinline__ __device__ BlockRange kv_split(const FwdParams& p) { return {p.kv_block_begin, p.kv_block_end}; }
__forceinline__ __device__ BlockRange kv_split(const Fp8FwdParams&) { return all_blocks(); }
__forceinline__ __device__ BlockRange kv_split(const BwdParams&) { return all_blocks(); }

// CausalMask's mask on a warp's block of scores (softmax.cuh's fragment layout): -inf for every score whose key is
// past the end (>= seqlen_k) or, with causal, right of the bottom-right aligned diagonal (key > query + diag, diag =
// seqlen_k - seqlen_q). row0: this warp's first query row; key0: the block's first key. Called only on blocks that
// hold a hidden key. Its loop is softmax.cuh's for_each_score written out: through the lambda, every fa1, fa2, fp8
// and fa3 forward that masks with it got other machine code (docs/kernels/masks.md).
template <int MT, int NT>
__forceinline__ __device__ void mask_scores(float (&s)[MT][NT][4], int row0, int key0, int seqlen_k, int diag,
                                            bool causal) {
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = row0 + mt * 16 + g + 8 * (e / 2), key = key0 + nt * 8 + 2 * t + (e % 2);
                if (key >= seqlen_k || (causal && key > row + diag)) s[mt][nt][e] = neg_inf();
            }
}

struct CausalMask {
    int seqlen_q, seqlen_k;
    int diag;     // seqlen_k - seqlen_q: query i sees keys up to i + diag
    bool causal;

    template <class Params>
    __forceinline__ __device__ static CausalMask of(const Params& p) {
        const int seqlen_k = p.seqlen_k, seqlen_q = p.seqlen_q;
        const bool causal = p.causal;
        return {seqlen_q, seqlen_k, seqlen_k - seqlen_q, causal};
    }

    // ---- which blocks a loop visits
    template <int BM, int BN>
    __forceinline__ __device__ BlockRange kv_blocks(int m0, BlockRange within = all_blocks()) const {
        return kv_block_range<BM, BN>(m0, seqlen_q, seqlen_k, causal, within.begin, within.end);
    }
    template <int BM, int BN = 0>
    __forceinline__ __device__ BlockRange q_blocks(int key0) const {
        return {first_q_block<BM>(key0, seqlen_q, seqlen_k, causal), (seqlen_q + BM - 1) / BM};
    }
    template <int BN>
    __forceinline__ __device__ int first_masked_block(int q0) const {
        return max(0, causal ? min(seqlen_k, q0 + diag + 1) : seqlen_k) / BN;
    }
    __forceinline__ __device__ int last_key(int q0, int q1) const {
        return q1 < q0 ? -1 : causal ? q1 + diag : seqlen_k - 1;
    }
    template <int BM, int BN, class Params>
    __forceinline__ __device__ static BlockRange blocks(const Params& p, int m0, int /*h*/ = 0, int /*b*/ = 0) {
        const int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k;
        const bool causal = p.causal;
        const BlockRange split = kv_split(p);
        return kv_block_range<BM, BN>(m0, seqlen_q, seqlen_k, causal, split.begin, split.end);
    }

    // ---- the edge test (causal: the first query sees the fewest keys, so it alone decides)
    template <int QUERIES, int KEYS, class Then>
    __forceinline__ __device__ void if_needs_mask(int q0, int q_off, int k0, const Then& then) const {
        const int sk = seqlen_k, d = diag;
        const bool c = causal;
        if (k0 + KEYS > sk || (c && k0 + KEYS - 1 > q0 + q_off + d)) then();
    }
    template <int QUERIES, int KEYS>
    __forceinline__ __device__ bool needs_mask(int q0, int q_off, int k0) const {
        bool needs = false;
        if_needs_mask<QUERIES, KEYS>(q0, q_off, k0, [&] { needs = true; });
        return needs;
    }

    // ---- the element test, and the forward's use of it
    __forceinline__ __device__ bool visible(int query, int key) const {
        return key < seqlen_k && !(causal && key > query + diag);
    }
    template <bool MASKED, int MT, int NT>
    __forceinline__ __device__ void apply(float (&s)[MT][NT][4], int row0, int key0) const {
        if constexpr (MASKED) mask_scores(s, row0, key0, seqlen_k, diag, causal);
    }
    template <int MT, int NT>
    __forceinline__ __device__ void apply_if_needed(float (&s)[MT][NT][4], int m0, int row0, int key0) const {
        if_needs_mask<16 * MT, 8 * NT>(m0, row0, key0, [&] { apply<true>(s, m0 + row0, key0); });
    }
    template <int MT, int DT>
    __forceinline__ __device__ void end_rows(float (&)[MT][DT][4], float (&)[MT][2], float (&)[MT][2], float) const {}

    // ---- what a kernel must do for it: one policy for the whole launch (BY_SEQUENCE: one per sequence and head,
    // built where the tile is known), no blocks below a row's first key that need the element test (LOW_EDGE: a
    // window's left side), nothing at a row's end (end_rows), no transform of the scores (so no chain rule in the
    // backward), one policy for every query head
    static constexpr bool BY_SEQUENCE = false, LOW_EDGE = false;
    static constexpr bool TRANSFORMS = false;
    template <class Params>
    __forceinline__ __device__ const CausalMask& for_head(const Params&, int) const { return *this; }
};

// The masks and logit transforms of real batches (fa2_fwd.cu's fa2_fwd_masked; reference/masks.py is the model):
// each row sees one interval of keys, [i + diag - left, i + diag + right] within [0, seqlen_k), where a causal call
// is a right side of 0 and an unbounded side is one longer than the sequences; the scores are capped (softcap
// tanh(S / softcap)) before the mask, then biased (ALiBi: -slope |i + diag - j|); the sinks join every row's
// denominator at its end. Both ends of the interval grow with i, so a Q tile's rows see one contiguous range of
// K/V blocks (kv_blocks), and a block needs the element test only where it crosses an end (if_needs_mask).
// The scores arrive raw (Q K^T, softmax_scale applied later in the exponent), so the transforms work in raw units:
// cap / scale for the cap, slope / scale for the bias.
// The sinks a kernel's parameters carry (the forward's; the backward needs none: its LSE holds them).
// What AttnMask::apply<false> does to a call's scores: nothing (RAW), the softcap alone (CAPPED), or the softcap and
// the ALiBi bias, either of them maybe off (TRANSFORMED: every test made). A kernel that runs a loop of its own for
// each (fa3's forward and backward) takes the class from the policy (AttnMask::scores): where the loops branch,
// ptxas knows what holds in each.
enum class Scores { RAW, CAPPED, TRANSFORMED };
// A raw score capped, cap tanh(x / cap): one MUFU operation beside the softmax's exponential (the form through
// e^(2x / cap) takes two, an exponential and a reciprocal, and leaves the special-function unit the bound).
__forceinline__ __device__ float capped(float x, float cap) {
    return cap * tanhf_approx(x * (1.f / cap));
}
__forceinline__ __device__ const float* sinks_of(const MaskedFwdParams& p) { return p.sinks; }
__forceinline__ __device__ const float* sinks_of(const MaskedBwdParams&) { return nullptr; }

struct AttnMask {
    int seqlen_q, seqlen_k, diag;
    int left, right;       // the window's sides, bounded (an unbounded side is longer than any distance here)
    float cap;             // softcap in raw units; 0: none
    float slope;           // ALiBi slope in raw units; 0: none
    float sink_log2;       // the sink's logit in log2 units; -inf: no sink
    const float* slopes;   // this sequence's row of ALiBi slopes (null: none), for for_head

    // A sequence's policy (MaskedFwdParams or MaskedBwdParams): its lengths (a packed batch's b-th, or the dense
    // batch's), query head h.
    template <class Params>
    __forceinline__ __device__ static AttnMask of(const Params& p, int seqlen_q, int seqlen_k, int b, int h) {
        const int far = seqlen_q + seqlen_k + 1;  // farther than any query is from any key
        const int left = p.window_left < 0 ? far : p.window_left;
        int right = p.window_right < 0 ? far : p.window_right;
        if (p.causal) right = min(right, 0);
        const float* slopes = p.alibi_slopes ? p.alibi_slopes + b * p.alibi_b : nullptr;
        const float slope = slopes ? slopes[h] * p.inv_scale : 0.f;
        const float sink = sinks_of(p) ? sinks_of(p)[h] * 1.4426950408889634f : neg_inf();
        return {seqlen_q, seqlen_k, seqlen_k - seqlen_q, left, right, p.softcap_raw, slope, sink, slopes};
    }
    // The same sequence's policy for query head h (the dK/dV pass steps over a group's heads).
    template <class Params>
    __forceinline__ __device__ AttnMask for_head(const Params& p, int h) const {
        AttnMask m = *this;
        if (slopes) m.slope = slopes[h] * p.inv_scale;
        return m;
    }
    static constexpr bool BY_SEQUENCE = true, LOW_EDGE = true;
    static constexpr bool TRANSFORMS = true;

    // softcap, then ALiBi, of a raw score (query row, key)
    __forceinline__ __device__ float transform(float x, int row, int key) const {
        if (cap > 0.f) x = capped(x, cap);
        if (slope != 0.f) x -= slope * fabsf(float(row + diag - key));
        return x;
    }

    // what apply<false> does to a score, and whether it changes one. (Written in this order, the tests a copy's
    // branch implies are the ones ptxas drops from it; written from the slope first, fa3's forward kept them all.)
    __forceinline__ __device__ Scores scores() const {
        return !transforms() ? Scores::RAW : cap > 0.f && slope == 0.f ? Scores::CAPPED : Scores::TRANSFORMED;
    }
    __forceinline__ __device__ bool transforms() const { return cap > 0.f || slope != 0.f; }

    __forceinline__ __device__ int first_key(int query) const { return max(0, query + diag - left); }
    __forceinline__ __device__ int last_key(int query) const { return min(seqlen_k - 1, query + diag + right); }

    // ---- which blocks a loop visits: those holding a key of the first row's first ..= the last row's last
    template <int BM, int BN>
    __forceinline__ __device__ BlockRange kv_blocks(int m0, BlockRange within = all_blocks()) const {
        const int first = first_key(m0), last = last_key(min(m0 + BM, seqlen_q) - 1);
        if (last < first) return {0, 0};
        return {max(within.begin, first / BN), min(within.end, last / BN + 1)};
    }
    // The blocks of tile m0 of query head h of sequence b, from the parameters alone (fa3's producer builds no
    // policy of its own: sequence.cuh's lengths, then kv_blocks)
    template <int BM, int BN, class Params>
    __forceinline__ __device__ static BlockRange blocks(const Params& p, int m0, int h, int b) {
        const PackedSequence s = sequence_of(p, b);
        return of(p, s.seqlen_q, s.seqlen_k, b, h).template kv_blocks<BM, BN>(m0, kv_split(p));
    }
    // From which K/V block on some key is hidden from some query >= q0 (past the first row's last key), and below
    // which block some key is hidden from some query <= q1 (before the last row's first key): the blocks fa3 runs
    // without the element test lie between.
    template <int BN>
    __forceinline__ __device__ int first_masked_block(int q0) const {
        return max(0, min(seqlen_k, q0 + diag + right + 1)) / BN;
    }
    template <int BN>
    __forceinline__ __device__ int masked_below(int q1) const {
        return (max(0, q1 + diag - left) + BN - 1) / BN;
    }
    // The last key any query of [q0, q1] sees, -1 where none does (the rows' intervals chain into one)
    __forceinline__ __device__ int last_key(int q0, int q1) const {
        const bool none = q1 < q0 || seqlen_k == 0 || q1 + diag + right < 0 || q0 + diag - left > seqlen_k - 1;
        return none ? -1 : min(seqlen_k - 1, q1 + diag + right);
    }

    // the Q blocks of BM queries that see some key of the block [key0, key0 + BN): query i sees key j iff
    // j - diag - right <= i <= j - diag + left (the K/V-outer loops: the backward's dK/dV pass)
    template <int BM, int BN>
    __forceinline__ __device__ BlockRange q_blocks(int key0) const {
        const int last_key = min(key0 + BN, seqlen_k) - 1;
        const int first = max(0, key0 - diag - right), last = min(seqlen_q - 1, last_key - diag + left);
        if (last < first) return {0, 0};
        return {first / BM, last / BM + 1};
    }

    // ---- the edge test: the last row starts latest, the first row ends earliest
    template <int QUERIES, int KEYS, class Then>
    __forceinline__ __device__ void if_needs_mask(int q0, int q_off, int k0, const Then& then) const {
        const int first = q0 + q_off;
        if (k0 + KEYS > seqlen_k || k0 < first + QUERIES - 1 + diag - left || k0 + KEYS - 1 > first + diag + right)
            then();
    }
    template <int QUERIES, int KEYS>
    __forceinline__ __device__ bool needs_mask(int q0, int q_off, int k0) const {
        bool needs = false;
        if_needs_mask<QUERIES, KEYS>(q0, q_off, k0, [&] { needs = true; });
        return needs;
    }

    __forceinline__ __device__ bool visible(int query, int key) const {
        return key < seqlen_k && key >= query + diag - left && key <= query + diag + right;
    }

    // softcap and ALiBi on every score of the block; -inf where hidden, if MASKED. Rows from row0, keys from key0.
    template <bool MASKED, int MT, int NT>
    __forceinline__ __device__ void apply(float (&s)[MT][NT][4], int row0, int key0) const {
        for_each_score(s, row0, key0, [&](float& x, int row, int key) {
            const float y = transform(x, row, key);   // before the select: a branch per score otherwise
            x = MASKED && !visible(row, key) ? neg_inf() : y;
        });
    }
    template <int MT, int NT>
    __forceinline__ __device__ void apply_if_needed(float (&s)[MT][NT][4], int m0, int row0, int key0) const {
        bool masked = false;
        if_needs_mask<16 * MT, 8 * NT>(m0, row0, key0, [&] { masked = true; });
        if (masked) apply<true>(s, m0 + row0, key0);
        else if (transforms()) apply<false>(s, m0 + row0, key0);
    }

    // ---- the backward's: P of a recomputed raw score from the row's LSE (log2 units), exactly 0 where hidden (a
    // select: LSE = -inf must not make a NaN); and dS of the raw score from dS of the transformed one, the softcap's
    // derivative 1 - tanh^2 (tanh read back from P itself: T = (log2 P + LSE) / scale less the ALiBi bias; where P
    // is 0 so is dS, and nothing is read back)
    __forceinline__ __device__ float p_of(float s, float scale_log2, float lse2, int row, int key) const {
        return visible(row, key) ? exp2f_approx(transform(s, row, key) * scale_log2 - lse2) : 0.f;
    }
    __forceinline__ __device__ float ds_raw(float ds, float p, float scale_log2, float lse2, int row, int key) const {
        if (cap <= 0.f || !(p > 0.f)) return ds;
        const float capped = (__log2f(p) + lse2) / scale_log2 + slope * fabsf(float(row + diag - key));
        const float th = capped / cap;
        return ds * (1.f - th * th);
    }
    // The same with the reciprocals of scale_log2 and the cap given (fa3's masked backward forms them once a step
    // rather than dividing twice a score; held across fa2's masked dK/dV loop, they made it spill at d 64 on sm_80).
    // BIASED = false: the caller knows the ALiBi slope is 0 (no bias to add back).
    template <bool BIASED = true>
    __forceinline__ __device__ float ds_raw_by(float ds, float p, float inv_scale_log2, float inv_cap, float lse2,
                                               int row, int key) const {
        if (cap <= 0.f || !(p > 0.f)) return ds;
        const float bias = BIASED ? slope * fabsf(float(row + diag - key)) : 0.f;
        const float th = ((__log2f(p) + lse2) * inv_scale_log2 + bias) * inv_cap;
        return ds * (1.f - th * th);
    }

    // The sink joins each row's denominator as one more logit without a value: the row's reference point moves to
    // max(m, sink) (O and l rescaled as the online softmax does), and exp2(sink - m) is added once per row (by the
    // quad's first thread: l is still a per-thread partial). A row that saw no key ends with l = 1, O = 0.
    template <int MT, int DT>
    __forceinline__ __device__ void end_rows(float (&o)[MT][DT][4], float (&m)[MT][2], float (&l)[MT][2],
                                             float scale_log2) const {
        if (sink_log2 == neg_inf()) return;
        const bool first = threadIdx.x % 4 == 0;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float m_log2 = m[mt][r] == neg_inf() ? neg_inf() : m[mt][r] * scale_log2;
                const float m_new = fmaxf(m_log2, sink_log2);
                const float alpha = exp2f_approx(m_log2 - m_new);
                l[mt][r] = l[mt][r] * alpha + (first ? exp2f_approx(sink_log2 - m_new) : 0.f);
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) o[mt][dt][2 * r] *= alpha, o[mt][dt][2 * r + 1] *= alpha;
                m[mt][r] = m_new / scale_log2;
            }
    }
};

// Decoding's policy (decode_fwd.cu): AttnMask's keys and transforms for GQA-packed rows. A tile's rows are query
// tokens packed with the query heads that share one KV head (row r: token r / group, head g * group + r % group), so
// a row's keys follow its token and its ALiBi slope and sink its head; each thread keeps those of its own rows
// (softmax.cuh's fragment layout: rows g and g + 8 of each m-tile). The tile's rows see one range of keys, `span`
// (a window's older keys are never read); a CTA takes its split of it, `keys`, and is masked at the split's end.
template <int MT>
struct PackedMask {
    int2 keys;             // [x, y): the keys this CTA's split reads
    int diag;              // seqlen_k - seqlen_q
    int left, right;       // the window's sides, bounded (AttnMask's); causal: right <= 0
    int t_first, t_last;   // the tile's first and last query token
    float cap;             // softcap in raw units; 0: none
    int token[MT][2];      // the token of each of this thread's rows
    float slope[MT][2];    // ALiBi slope in raw units of each of this thread's rows' heads
    bool biased;           // ALiBi slopes given

    // Tile r0 of (sequence b, KV head g) with seqlen_k keys, split s of the span; inv_scale: 1 / the scale the raw
    // scores take (softmax_scale times an e4m3 cache's k_descale). fits: the sequence fits its cache (else no key).
    template <int SPLIT_N>
    __forceinline__ __device__ static PackedMask of(const DecodeParams& p, int seqlen_k, bool fits, int b, int g,
                                                    int r0, int s, float inv_scale) {
        PackedMask m;
        const int far = p.seqlen_q + seqlen_k + 1, rows = p.seqlen_q * p.group;
        m.diag = seqlen_k - p.seqlen_q;
        m.left = p.window_left < 0 ? far : p.window_left;
        m.right = p.window_right < 0 ? far : p.window_right;
        if (p.causal) m.right = min(m.right, 0);
        m.t_first = r0 / p.group;
        m.t_last = (min(r0 + 16 * MT, rows) - 1) / p.group;
        m.cap = p.softcap * inv_scale;
        const float* slopes = p.alibi_slopes ? p.alibi_slopes + b * p.alibi_b + g * p.group : nullptr;
        m.biased = slopes != nullptr;
        const int lane_row = (threadIdx.x % 32) / 4;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = r0 + mt * 16 + lane_row + 8 * h;
                m.token[mt][h] = row / p.group;
                m.slope[mt][h] = slopes ? slopes[row % p.group] * inv_scale : 0.f;
            }
        const int first = max(0, m.t_first + m.diag - m.left), stop = min(seqlen_k, m.t_last + m.diag + m.right + 1);
        m.keys = fits && first < stop ? split_range<SPLIT_N>(first, stop, s, p.num_splits) : make_int2(0, 0);
        return m;
    }
    // Split s of [first, stop): ceil(n / splits) whole SPLIT_N-key blocks each from first on (the model's
    // split_ranges); splits past the end are empty.
    template <int SPLIT_N>
    __forceinline__ __device__ static int2 split_range(int first, int stop, int s, int splits) {
        const int n = (stop - first + SPLIT_N - 1) / SPLIT_N, per = (n + splits - 1) / splits * SPLIT_N;
        return make_int2(min(first + s * per, stop), min(first + (s + 1) * per, stop));
    }

    __forceinline__ __device__ bool transforms() const { return cap > 0.f || biased; }
    // some key of [k0, k0 + KEYS) is hidden from some row of the tile: past the split's end, right of the first
    // token's last key, or left of the last token's first
    template <int KEYS>
    __forceinline__ __device__ bool needs_mask(int k0) const {
        return k0 + KEYS > keys.y || k0 + KEYS - 1 > t_first + diag + right || k0 < t_last + diag - left;
    }
    // a warp's scores (softmax.cuh's fragment layout), keys from key0: capped, biased, and -inf where hidden if
    // MASKED
    template <bool MASKED, int NT>
    __forceinline__ __device__ void apply(float (&s)[MT][NT][4], int key0) const {
        const int t = threadIdx.x % 4;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int h = e / 2, key = key0 + nt * 8 + 2 * t + (e % 2), i = token[mt][h] + diag;
                    float x = s[mt][nt][e];
                    if (cap > 0.f) x = capped(x, cap);
                    x -= slope[mt][h] * fabsf(float(i - key));
                    const bool seen = key < keys.y && key >= i - left && key <= i + right;
                    s[mt][nt][e] = MASKED && !seen ? neg_inf() : x;
                }
    }
    template <int NT>
    __forceinline__ __device__ void apply_if_needed(float (&s)[MT][NT][4], int key0) const {
        if (needs_mask<8 * NT>(key0)) apply<true>(s, key0);
        else if (transforms()) apply<false>(s, key0);
    }
};

}  // namespace fav
