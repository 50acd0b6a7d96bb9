// The merge of attention states (Juravsky et al.'s cascade inference; FlashDecoding's second step): n results of
// attention over disjoint key sets, each an O normalized by its own row sum and its LSE, into attention over their
// union. With M the largest LSE of a row:
//     LSE = M + log sum_s e^(LSE_s - M)      O = sum_s e^(LSE_s - LSE) O_s
// the online softmax's rescale applied to whole partial results. A state with LSE = -inf (it saw no key) adds
// nothing, whatever its O holds; every state empty: O = 0 and LSE = -inf; a NaN LSE makes its row NaN.
//
// One warp per row (b, n, h): its lanes walk the states' LSEs, then the row's columns, 32 apart (coalesced), each
// column's states read together.
#include "common/params.cuh"
#include "common/ptx.cuh"

namespace fav {
namespace merge {

// The element formats a state's O (and the result) may have, and the LSE's.
struct F32 {
    using E = float;
    __forceinline__ __device__ static float get(E x) { return x; }
    __forceinline__ __device__ static E put(float x) { return x; }
};
struct F64 {
    using E = double;
    __forceinline__ __device__ static double get(E x) { return x; }
    __forceinline__ __device__ static E put(double x) { return x; }
};
template <class T>  // Half, BFloat16
struct Bits16Of {
    using E = u16;
    __forceinline__ __device__ static float get(E x) { return T::to_float(x); }
    __forceinline__ __device__ static E put(float x) { return (E)(T::pack(x, 0.f) & 0xffffu); }
};

constexpr int WARPS = 4;

}  // namespace merge
}  // namespace fav

// TO: the states' O format; TL: the LSE's (F32, F64, the result's too); TR: the result's O format (TO for
// merge_states; q's format for decoding's fp32 partials); Acc: what the sums are kept in.
template <class TO, class TL, class TR, class Acc>
__global__ void __launch_bounds__(fav::merge::WARPS * 32)
merge_states(const fav::MergeParams p) {
    using namespace fav;
    using O = typename TO::E;
    using S = typename TL::E;
    griddep_wait();  // launched behind decode_split: its partials, complete (a plain launch: nothing to wait for)
    const i64 row = (i64)blockIdx.x * merge::WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= (i64)p.batch * p.seqlen * p.heads) return;
    const int h = row % p.heads, n = (row / p.heads) % p.seqlen, b = row / ((i64)p.heads * p.seqlen);
    const S* lse = static_cast<const S*>(p.lse_parts) + b * p.l_b + h * p.l_h + n * p.l_n;
    const O* parts = static_cast<const O*>(p.o_parts) + b * p.p_b + n * p.p_n + h * p.p_h;

    // The row's largest LSE (NaN noted apart: fmax would drop it) and the sum of the weights below it.
    const Acc NEG_INF = neg_inf(), NOT_A_NUMBER = __int_as_float(0x7fc00000);
    Acc top = NEG_INF;
    bool nan = false;
    for (int s = lane; s < p.states; s += 32) {
        const Acc x = TL::get(lse[s * p.l_s]);
        nan |= x != x;
        top = x > top ? x : top;
    }
    for (int o = 16; o > 0; o >>= 1) {
        const Acc other = __shfl_xor_sync(0xffffffffu, top, o);
        top = other > top ? other : top;
    }
    nan = __any_sync(0xffffffffu, nan);
    const Acc ref = top == NEG_INF ? Acc(0) : top;
    Acc total = 0;
    for (int s = lane; s < p.states; s += 32) total += exp(TL::get(lse[s * p.l_s]) - ref);
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    const Acc inv = total > 0 ? Acc(1) / total : Acc(0);

    typename TR::E* out = static_cast<typename TR::E*>(p.out) + b * p.o_b + n * p.o_n + h * p.o_h;
    // Each chunk of 32 states' weights is worked out once, a state per lane, into shared memory (-1 for a state
    // without keys), where every lane reads them: then a column's reads of the states do not wait for one another
    // (unrolled, they are in flight together).
    __shared__ Acc weights[merge::WARPS][32];
    Acc* w = weights[threadIdx.x / 32];
    for (int c0 = 0; c0 < p.head_dim; c0 += 32) {
        const int c = c0 + lane;
        Acc acc = 0;
        for (int s0 = 0; s0 < p.states; s0 += 32) {
            const Acc x = s0 + lane < p.states ? TL::get(lse[(s0 + lane) * p.l_s]) : NEG_INF;
            __syncwarp();  // the last chunk's weights are read
            w[lane] = x != NEG_INF ? exp(x - ref) * inv : Acc(-1);
            __syncwarp();
            const int chunk = min(32, p.states - s0);
            for (int i0 = 0; i0 < chunk; i0 += 8) {
#pragma unroll
                for (int i = i0; i < i0 + 8; ++i) {
                    const bool use = i < chunk && w[i] != Acc(-1);   // a weight is >= 0 or NaN
                    const Acc o = use && c < p.head_dim ? TO::get(parts[(s0 + i) * p.p_s + c]) : Acc(0);
                    acc += use ? w[i] * o : Acc(0);
                }
            }
        }
        if (c < p.head_dim) out[c] = TR::put(nan ? NOT_A_NUMBER : acc);
    }
    if (p.lse != nullptr && lane == 0) {
        const Acc x = nan ? NOT_A_NUMBER : total > 0 ? ref + log(total) : NEG_INF;
        static_cast<S*>(p.lse)[((i64)b * p.heads + h) * p.seqlen + n] = TL::put(x);
    }
}
