// What the operands' element type changes in fa3_fwd, as a policy: Precision16 (fp16 / bf16 Q, K, V: fa3) and
// PrecisionFp8 (e4m3 Q, K, V^T with fa2_fp8's block scales: fa3_fp8). The producer, the main loop and the
// epilogue call these and never test the element type themselves.
//
// Each policy says
//   layout      bytes per element (EB), keys per wgmma k-step (KK: always 32 bytes of the reduction), the K and V
//               tiles of the ring (fp8: V^T [d][key], keys in fp8_quantize.cu's vt_key order, so that V^T is the
//               K-major B operand e4m3 P V needs), how the producer addresses V's TMA boxes
//   products    the wgmma of S = Q K^T and of O += P V, V's descriptor, P~'s conversion into A fragments
//               (16-bit: repack_a; fp8: e4m3 times P_SCALE, repack_a_e4m3)
//   softmax     how a block's scores are scaled (16-bit: scale_log2; fp8: the scales of Q's tile and K's block
//               times scale_log2, folded into the exponent with P_SCALE) and how far a row's reference point may
//               lag its max (RESCALE_TAU)
//   epilogue    V's channel scales and the store policies of common/epilogue.cuh (fp8: Fp8DequantOut, which also
//               undoes P_SCALE)
//   tuning      the code shapes ptxas schedules best per element type and head dim (docs/kernels/fa3.md has the
//               measurements): STEP_DESC, LATE_PV_WAIT, INT_MAX, EXP_TURNS
#pragma once
#include "../common/epilogue.cuh"
#include "../common/fp8.cuh"
#include "../common/fragments.cuh"
#include "../common/params.cuh"
#include "../common/tma.cuh"
#include "../common/wgmma.cuh"
#include "../common/wgmma_n.cuh"

namespace fav {
namespace hopper {

template <class T, int D, int BN, bool PERSISTENT>
struct Precision16 {
    using Params = Fa3FwdParams;
    static constexpr int EB = 2;                // bytes per element of Q, K, V
    static constexpr int KK = 16;               // reduction step of one wgmma: k16
    static constexpr int DN = D < 128 ? D : 128;  // output columns per P V wgmma (n64 or n128)
    using TK = SwizzledTile<BN, 2 * D>;         // [key][d]: K-major B of Q K^T
    using TV = TK;                              // V [key][d], read N-major as the B of P V (imm-trans-b)
    // How far a row's max may grow before its reference point (and O) is moved: P~ <= 2^tau (FA4's choice).
    static constexpr float RESCALE_TAU = 8.f;
    // The seqlen_k tail block is computed BN - TAIL_STEP keys wide where it holds no more (the main loop's TAIL_BN).
    static constexpr int TAIL_STEP = 32;
    static constexpr bool O_OWN_BUFFER = false;  // O leaves through its tile's Q buffer (same rows, same bytes)
    static constexpr float LSE_LOG2 = 0.f;       // no power of two in the row sums
    // The k-steps' descriptors as one per operand plus constants (SwizzledTile::step) rather than each formed from
    // its address: fewer uniform-datapath instructions a step, a gain at d 128 and 256 only.
    static constexpr bool STEP_DESC = D >= 128;
    static constexpr bool LATE_PV_WAIT = false, INT_MAX = false, EXP_TURNS = false;
    static constexpr int EXP_FMA_EVERY = 0;

    __forceinline__ __device__ static void before_reads() {}

    // V_j's TMA box c (64 columns of d) into a ring stage; k0: the sequence's first key row in the map (packed).
    __forceinline__ __device__ static void load_v(u32 dst, const TmaDesc& tv, u32 bar, int j, int c, int h_kv, int b,
                                                  int k0) {
        tma_load_4d(dst, tv, bar, c * TV::W / EB, k0 + j * BN, h_kv, b);
    }
    template <int N>
    __forceinline__ __device__ static void mma_qk(float (&s)[N][4], u64 a, u64 b, int accumulate) {
        wgmma_16_ss<T>(s, a, b, accumulate);
    }
    __forceinline__ __device__ static void mma_pv(float (&o)[DN / 8][4], const u32 (&a)[4], u64 b) {
        wgmma_16_rs<T>(o, a, b, 1);
    }
    // V's descriptor for k-step kk (keys 16 kk ..) and output columns nn DN ..: V read N-major.
    __forceinline__ __device__ static u64 desc_v(u32 sv, int kk, int nn) {
        if constexpr (STEP_DESC) return TV::desc_mn(sv, 0, 0) + TV::step_mn(kk * 16, nn * DN * 2);
        else return TV::desc_mn(sv, kk * 16, nn * DN * 2);
    }
    // P~ (a block's exponentials, NS n-tiles of 8 keys) into the A fragments of P V.
    template <int NS>
    __forceinline__ __device__ static void pack_p(u32 (&pa)[BN / KK][4], const float (&s)[1][NS][4]) {
#pragma unroll
        for (int kk = 0; kk < NS * 8 / KK; ++kk) repack_a<T>(pa[kk], s[0][2 * kk], s[0][2 * kk + 1]);
    }

    // fp8's Q scale of a tile: none here. (The functions taking parameters take the kernel's: Params, or
    // MaskedFwdParams under a mask per sequence.)
    template <class P, class Sched, class Work>
    __forceinline__ __device__ static float q_scale(const P&, const Sched&, const Work&) { return 1.f; }
    // The online softmax of block j of tile x (softmax.cuh's, with the lazy rescale), m in score units;
    // scale_log2 = softmax_scale * log2(e) takes the scores to log2 units.
    template <bool MASKED, int EXP_FMA, class P, class Tile, int NS, class Turn>
    __forceinline__ __device__ static bool softmax(const P&, const Tile&, int, float (&s)[1][NS][4],
                                                   float (&m)[1][2], float (&l)[1][2], float (&alpha)[1][2],
                                                   float scale_log2, const Turn&) {
        return online_softmax_rescale<true>(s, m, l, scale_log2, alpha, RESCALE_TAU);
    }
    // What m is multiplied by to be in log2 units.
    __forceinline__ __device__ static float m_scale(float scale_log2) { return scale_log2; }

    // Epilogue: V's channel scales (none), and O / l from registers or staged through shared memory.
    template <class P>
    __forceinline__ __device__ static const float* col_scales(const P&, int, int) { return nullptr; }
    template <class Rows, class P>
    __forceinline__ __device__ static void store_direct(const Rows& rows, const P& p, const float*) {
        DirectOut<T, D>::store(rows, p);
    }
    template <class Rows, class P>
    __forceinline__ __device__ static void store_staged(const Rows& rows, const P& p, const float*, u16* stage) {
        NormalizedOut<T, D>::store(rows, p, stage);
    }
};

template <class T, int D, int BN, bool PERSISTENT>
struct PrecisionFp8 {
    // fa2_fp8's parameters; on the persistent grid with the split tail's fields (Fa3Fp8FwdParams)
    using Params = typename Pick<PERSISTENT, Fa3Fp8FwdParams, Fp8FwdParams>::type;
    static constexpr int EB = 1;
    static constexpr int KK = 32;               // k32 e4m3 QGMMA
    static constexpr int DN = D < 128 ? D : 128;
    using TK = SwizzledTile<BN, D>;             // [key][d]
    using TV = SwizzledTile<D, BN>;             // V^T [d][key]: the K-major B of P V
    // e4m3 P~ x 256 must stay below 448, e4m3's largest: 2^0.75 x 256 = 431.
    static constexpr float RESCALE_TAU = 0.75f;
    // The tail is cut in whole 32-key groups of V^T's vt_key order; BN 192 at d 128 leaves 64 or 128 keys at N 2^k.
    static constexpr int TAIL_STEP = 64;
    // 16-bit O rows are twice Q's e4m3 rows: O needs a buffer of its own to leave by TMA.
    static constexpr bool O_OWN_BUFFER = true;
    static constexpr float LSE_LOG2 = P_SCALE_LOG2;  // l sums P~ x P_SCALE: the LSE owes log2(P_SCALE)
    static constexpr bool STEP_DESC = false;
    // LATE_PV_WAIT: P_{u-1} V_{u-1} waited for after the exponentials (inside O's rescale branch, whose vote then
    // reads the row sums), at d 64, where the softmax is short next to the products.
    static constexpr bool LATE_PV_WAIT = D == 64;
    // INT_MAX: the mask-free blocks' row maxima by integer max (softmax.cuh's row_max_int; at d 256 ptxas then
    // serializes the wgmmas).
    static constexpr bool INT_MAX = D <= 128;
    // EXP_TURNS: at d 128 the SFU is one of the two limits: the consumers take turns at their exponentials (with
    // ping-pong), and every 16th exponential goes to the FMA units (math.cuh's exp2f_fma).
    static constexpr bool EXP_TURNS = D == 128;
    static constexpr int EXP_FMA_EVERY = 16;

    // fp8 quantizing on the fly is launched behind its quantizer, which may still run (kernels/fa2_fp8.py's
    // QuantizeAndAttend): nothing reads memory before that has ended. (A no-op in any other launch.)
    __forceinline__ __device__ static void before_reads() { griddep_wait(); }

    // V^T_j's TMA box c: all D rows, TV::W keys.
    __forceinline__ __device__ static void load_v(u32 dst, const TmaDesc& tv, u32 bar, int j, int c, int h_kv, int b,
                                                  int /*k0: 0, no packed batch*/) {
        tma_load_4d(dst, tv, bar, j * BN + c * TV::W, 0, h_kv, b);
    }
    template <int N>
    __forceinline__ __device__ static void mma_qk(float (&s)[N][4], u64 a, u64 b, int accumulate) {
        wgmma_e4m3_ss(s, a, b, accumulate);
    }
    __forceinline__ __device__ static void mma_pv(float (&o)[DN / 8][4], const u32 (&a)[4], u64 b) {
        wgmma_e4m3_rs(o, a, b, 1);
    }
    __forceinline__ __device__ static u64 desc_v(u32 sv, int kk, int nn) { return TV::desc(sv, nn * DN, kk * 32); }
    // P~, already times P_SCALE (online_softmax_rescale_folded), rounded to e4m3 A fragments.
    template <int NS>
    __forceinline__ __device__ static void pack_p(u32 (&pa)[BN / KK][4], const float (&s)[1][NS][4]) {
#pragma unroll
        for (int kk = 0; kk < NS * 8 / KK; ++kk)
            repack_a_e4m3(pa[kk], s[0][4 * kk], s[0][4 * kk + 1], s[0][4 * kk + 2], s[0][4 * kk + 3], 1.f);
    }

    // Q's scale of the tile times scale_log2 (one per Q tile of BM rows).
    template <class Sched, class Work>
    __forceinline__ __device__ static float q_scale(const Params& p, const Sched& sched, const Work& w) {
        return p.scale_log2 * p.sq[((i64)w.b * p.heads + w.h) * sched.q_blocks() + w.m0 / Sched::BM];
    }
    // The online softmax of block j of tile x with f and P_SCALE folded into the exponent's FMA, m in log2 units:
    // S_j in log2 units is S_j times f, the scales of Q's tile and of K's block j times scale_log2. f is kept at
    // least FLT_MIN, so that a masked -inf times f stays -inf at softmax_scale 0; the launcher makes f positive (a
    // negative softmax_scale runs on -Q). K's scale is addressed afresh every block: a row pointer held for the
    // tile made ptxas schedule the main loop worse. The turn brackets the exponentials (NoTurn, or the
    // consumers' turns at the SFU).
    template <bool MASKED, int EXP_FMA, class Tile, int NS, class Turn>
    __forceinline__ __device__ static bool softmax(const Params& p, const Tile& x, int j, float (&s)[1][NS][4],
                                                   float (&m)[1][2], float (&l)[1][2], float (&alpha)[1][2], float,
                                                   const Turn& turn) {
        const i64 bhk = (i64)x.w.b * p.heads_kv + x.h_kv;
        const float f = fmaxf(x.q_scale * p.sk[bhk * ((p.seqlen_k + BN - 1) / BN) + j], min_normal());
        return online_softmax_rescale_folded<INT_MAX && !MASKED, EXP_FMA>(s, m, l, f, (float)P_SCALE_LOG2, alpha,
                                                                           RESCALE_TAU, turn);
    }
    __forceinline__ __device__ static float m_scale(float) { return 1.f; }  // m is in log2 units already

    // Epilogue: O * s_v / l, s_v the channel scales of this kv head.
    __forceinline__ __device__ static const float* col_scales(const Params& p, int b, int h_kv) {
        return p.sv + ((i64)b * p.heads_kv + h_kv) * D;
    }
    template <class Rows>
    __forceinline__ __device__ static void store_direct(const Rows& rows, const Params& p, const float* sv) {
        Fp8DequantOut<T, P_SCALE_LOG2, true>::store(rows, p, sv);
    }
    template <class Rows>
    __forceinline__ __device__ static void store_staged(const Rows& rows, const Params& p, const float* sv,
                                                        u16* stage) {
        Fp8DequantOut<T, P_SCALE_LOG2, true>::template staged<D>(rows, p, sv, stage);
    }
};

}  // namespace hopper
}  // namespace fav
