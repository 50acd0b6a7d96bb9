// The kernels' parameter structs: one per kernel family, passed by value (it lands in the constant bank, as
// separate arguments would). fa_variants/kernels/params.py mirrors each field for field and appends
// static_asserts of the size and of every offset to each compiled source (the generated header included at
// the end), so a Python/C++ mismatch fails compilation instead of corrupting a launch.
#pragma once
#include "math.cuh"

namespace fav {

// The 16-bit forwards (fa1, fa2, fa3; fa3 with its extension, Fa3FwdParams). Strides are in elements; every
// pointer is 16-byte aligned and every stride but the last a multiple of 8 elements (the launcher copies inputs that
// are not).
struct FwdParams {
    const u16* q;          // (batch, seqlen_q, heads, head_dim)
    const u16* k;          // (batch, seqlen_k, heads_kv, head_dim)
    const u16* v;
    u16* o;                // (batch, seqlen_q, heads, head_dim), strides o_b, o_n, o_h
    float* lse;            // (batch, heads, seqlen_q) float32; null: not written
    float* o_ws;           // fp32 workspaces: fa1's O, l, m (Algorithm 1's HBM-resident state) or a split's
    float* l_ws;           // partial (unnormalized O, l, m: PartialOut)
    float* m_ws;
    i64 q_b, q_n, q_h;
    i64 k_b, k_n, k_h;
    i64 v_b, v_n, v_h;
    i64 o_b, o_n, o_h;
    int batch, seqlen_q, seqlen_k;
    int heads, group;      // group = heads / heads_kv: query head h reads kv head h / group
    int head_dim;          // the real d (a multiple of 8) <= the template D: columns at or past it are
                           // zero-filled on load and never stored
    int kv_block_begin;    // [begin, end) sub-range of K/V blocks this launch visits (split-KV); the
    int kv_block_end;      // causal range clips it further
    float scale_log2;      // softmax_scale * log2(e)
    int causal;            // bottom-right aligned
};

// fa3's: FwdParams and the persistent grid's split tail (hopper/scheduler.cuh): its last tail_tiles tiles are cut
// along their K/V blocks into tail_ranges ranges of tail_blocks blocks (the last one shorter), one work item each
// (0: no split); their partials go to FwdParams' o_ws. (Derived: the base has no tail padding, so these follow it.)
struct Fa3FwdParams : FwdParams {
    int tail_tiles, tail_blocks, tail_ranges;
};

// fa2's masked forward (fa2_fwd.cu's fa2_fwd_masked): FwdParams and what AttnMask (mask.cuh) reads. Packed
// (varlen) calls give cu_seqlens: sequence b is rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and o and keys
// [cu_seqlens_k[b], ...) of k and v, whose batch strides are 0; seqlen_q and seqlen_k are then the longest lengths.
// (Derived: the base has no tail padding, so these follow it.)
struct MaskedFwdParams : FwdParams {
    const int* cu_seqlens_q;     // (batch + 1,) cumulative lengths; null: a dense batch
    const int* cu_seqlens_k;
    const float* alibi_slopes;   // (batch or 1, heads); null: no ALiBi
    const float* sinks;          // (heads,) one logit per query head, in S's units; null: no sinks
    i64 lse_h;                   // the LSE's head stride: seqlen_q, (batch, heads, seqlen_q), or total_q, (heads, total_q)
    int alibi_b;                 // alibi_slopes' batch stride: heads, or 0 for one row the batch shares
    int window_left;             // keys i + diag - left ..= i + diag + right are seen; -1: unbounded
    int window_right;
    float softcap_raw;           // the softcap in raw score units (softcap / softmax_scale); 0: none
    float inv_scale;             // 1 / softmax_scale: ALiBi's bias in raw score units
};

// The fp8 forwards (fa2_fp8, fa3_fp8): e4m3 operands in the quantizer's layouts (fp8_quantize.cu) and their scales.
struct Fp8FwdParams {
    const unsigned char* q;   // (batch, heads, seqlen_q, D) e4m3, columns >= head_dim zero
    const unsigned char* k;   // (batch, heads_kv, seqlen_k, D)
    const unsigned char* vt;  // (batch, heads_kv, D, seqlen_k_pad), keys in vt_key order
    const float* sq;          // (batch, heads, ceil(seqlen_q / BM)) one scale per Q block
    const float* sk;          // (batch, heads_kv, ceil(seqlen_k / BN)) one per K block
    const float* sv;          // (batch, heads_kv, D) one per V channel
    u16* o;                   // (batch, seqlen_q, heads, head_dim) contiguous rows of o_n elements
    float* lse;
    i64 o_b, o_n, o_h;
    int batch, seqlen_q, seqlen_k, seqlen_k_pad;
    int heads, group;
    int head_dim;
    float scale_log2;
    int causal;
    int heads_kv;             // heads / group, so that a kernel's per-block scale lookup needs no division
};

// fa3_fp8's on the persistent grid: fa2_fp8's struct and the split tail, as Fa3FwdParams adds it, with the
// partials' workspace. (An extension, not fields of Fp8FwdParams: fa2_fp8's 255-register mma.sync kernel at d 256
// spills with four fields more there.)
struct Fa3Fp8FwdParams : Fp8FwdParams {
    int tail_tiles, tail_blocks, tail_ranges;
    float* o_ws;              // the split tail's fp32 partials, patched in per stream
};

// The 16-bit backward (fa2_bwd.cu): the forward's inputs and output, dO, the forward's LSE, the row statistic
// D = rowsum(dO * O) the first pass writes, and the three gradients. Strides in elements, as FwdParams.
struct BwdParams {
    const u16* q;
    const u16* k;
    const u16* v;
    const u16* o;
    const u16* dout;
    const float* lse;      // (batch, heads, seqlen_q), natural log
    float* delta;          // (batch, heads, seqlen_q): D
    u16* dq;               // q's layout, contiguous
    u16* dk;               // k's layout (heads_kv heads), contiguous
    u16* dv;
    i64 q_b, q_n, q_h;
    i64 k_b, k_n, k_h;
    i64 v_b, v_n, v_h;
    i64 o_b, o_n, o_h;
    i64 do_b, do_n, do_h;
    int seqlen_q, seqlen_k;
    int heads, group;
    int head_dim;
    float scale_log2;      // softmax_scale * log2(e): P = exp2(S * scale_log2 - LSE * log2(e))
    float scale;           // softmax_scale: dQ = dS K scale, dK = dS^T Q scale
    int causal;
};

// fa2's masked backward (fa2_bwd.cu's *_masked kernels): BwdParams and what AttnMask reads, as MaskedFwdParams
// adds them (packed calls: batch strides 0, seqlen_q and seqlen_k the longest lengths; the LSE and D of a packed call
// are (heads, total_q), head stride lse_h). (Derived: the base has no tail padding, so these follow it.)
struct MaskedBwdParams : BwdParams {
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    const float* alibi_slopes;
    i64 lse_h;
    int alibi_b;
    int window_left, window_right;
    float softcap_raw;
    float inv_scale;
};

// The fp8 quantizers (fp8_quantize.cu): fp16/bf16 Q, K, V (strides in elements, as FwdParams) into the layouts
// Fp8FwdParams reads. A launch that quantizes Q only (a KV cache's new query) or K and V only has no items of the
// other parts.
struct QuantParams {
    const u16* q;             // (batch, seqlen_q, heads, D)
    const u16* k;             // (batch, seqlen_k, heads_kv, D)
    const u16* v;
    unsigned char* qq;        // (batch, heads, seqlen_q, D) e4m3
    unsigned char* kq;        // (batch, heads_kv, seqlen_k, D)
    unsigned char* vt;        // (batch, heads_kv, D, seqlen_k_pad), keys in vt_key order
    float* sq;                // (batch, heads, ceil(seqlen_q / BM))
    float* sk;                // (batch, heads_kv, ceil(seqlen_k / BN))
    float* sv;                // (batch, heads_kv, D)
    float* amax;              // (batch, heads_kv, D), zeroed before the first pass: V's channel amax
    i64 q_b, q_n, q_h;
    i64 k_b, k_n, k_h;
    i64 v_b, v_n, v_h;
    int heads, heads_kv, seqlen_q, seqlen_k, seqlen_k_pad;
    int q_items, k_items;     // quantize_qk_amax's CTAs of Q's row blocks and of K's; V's amax chunks follow
};

// Decoding over a KV cache (decode_fwd.cu, kv_append.cu). The cache is contiguous, (batch_cache, seqlen_cache,
// heads_kv, head_dim), or paged, (num_pages, page_size, heads_kv, head_dim) with page_table; its elements are 16-bit
// (q's format) or e4m3. Strides in elements of their own tensor. Sequence b holds cache_seqlens[b] + seqlen_new keys
// once the call's new ones are appended; a sequence whose length or pages fall outside the cache is never read or
// written past it, and its rows come out NaN (the host checks what it can see before a launch).
struct DecodeParams {
    const u16* q;                // (batch, seqlen_q, heads, head_dim)
    const void* k;               // the cache
    const void* v;
    const int* cache_seqlens;    // (batch,) keys before this call's append
    const int* page_table;       // (batch, max_pages); null: contiguous
    const float* k_descale;      // (batch, heads_kv) for an e4m3 cache; null: 1
    const float* v_descale;
    u16* o;                      // (batch, seqlen_q, heads, head_dim) strides o_b, o_n, o_h: one split's output
    float* lse;                  // (batch, heads, seqlen_q); null: not written
    float* o_part;               // (num_splits, batch, seqlen_q, heads, head_dim) fp32, normalized per split
    float* lse_part;             // (num_splits, batch, heads, seqlen_q)
    const float* sinks;          // (heads,) one logit per query head in every row's denominator; null: none
    const float* alibi_slopes;   // (batch or 1, heads) row stride alibi_b; null: none
    i64 q_b, q_n, q_h;
    i64 k_b, k_n, k_h;           // k_b: stride of the cache's first axis (a sequence's or a page's)
    i64 v_b, v_n, v_h;
    i64 o_b, o_n, o_h;
    int batch, seqlen_q, heads, heads_kv, group, head_dim;
    int seqlen_new;              // keys appended by this call
    int capacity;                // keys one sequence can hold: seqlen_cache, or max_pages * page_size
    int page_size, max_pages, num_pages;
    int num_splits;
    int row_tiles;               // Q tiles per (batch, KV head): ceil(seqlen_q * group / rows per tile)
    float scale_log2;            // softmax_scale * log2(e)
    int causal;                  // bottom-right within each sequence
    int window_left, window_right;   // -1: unbounded (the mask policies': mask.cuh)
    float softcap;               // in the units of the scaled scores; 0: none
    float inv_scale;             // 1 / softmax_scale: the transforms act on raw scores
    i64 alibi_b;                 // alibi_slopes' row stride: 0 (one row for every sequence) or heads
};

// The in-place append of a call's new keys and values (kv_append.cu): k, v (batch, seqlen_new, heads_kv, head_dim)
// into the cache at rows cache_seqlens[b] .. + seqlen_new, in the cache's element type.
struct AppendParams {
    const void* k;
    const void* v;
    void* k_cache;
    void* v_cache;
    const int* cache_seqlens;
    const int* page_table;
    i64 kn_b, kn_n, kn_h;        // k's strides
    i64 vn_b, vn_n, vn_h;
    i64 k_b, k_n, k_h;           // the caches'
    i64 v_b, v_n, v_h;
    int batch, seqlen_new, heads_kv, head_dim;
    int capacity, page_size, max_pages, num_pages;
};

// merge_states.cu: n attention states over disjoint key sets -> one. State s of row (b, n, h): out_s at
// o_parts + s*p_s + b*p_b + n*p_n + h*p_h (head_dim values), lse_s at lse_parts + s*l_s + b*l_b + h*l_h + n*l_n.
// The result: out + b*o_b + n*o_n + h*o_h, lse (batch, heads, seqlen) contiguous (null: not written).
struct MergeParams {
    const void* o_parts;
    const void* lse_parts;
    void* out;
    void* lse;
    i64 p_s, p_b, p_n, p_h;
    i64 l_s, l_b, l_h, l_n;
    i64 o_b, o_n, o_h;
    int states, batch, seqlen, heads, head_dim;
};

// The head-dim padding copy (pad_head_dim.cu): a (batch, seqlen, heads, head_dim) tensor with any strides into a
// contiguous one whose rows are `width` elements, zeros past head_dim.
struct PadParams {
    const u16* src;
    u16* dst;
    i64 s_b, s_n, s_h;
    int rows;              // batch * seqlen * heads
    int seqlen, heads;
    int head_dim, width;
};

}  // namespace fav

// offsetof for the generated asserts: NVRTC has no <cstddef> and no __builtin_offsetof, but its front end (EDG)
// folds __INTADDR__ of a member's address off a null base to a constant.
#define FAV_OFFSETOF(T, field) ((long long)__INTADDR__(&(((T*)0)->field)))
#include "generated/param_layout.cuh"
