// Scalar helpers shared by every kernel: exp2 on the SFU, warp reductions, 16-bit float conversions.
// NVRTC-safe: no CUDA toolkit header is included; fp16/bf16 are carried as raw 16-bit patterns.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

namespace fav {

// A compile-time bool as a type, to select a branch of a generic lambda with if constexpr (no <type_traits>).
template <bool V>
struct flag {
    static constexpr bool value = V;
};
// A compile-time int as a type (flag's counterpart): a width chosen per call of a generic lambda.
template <int V>
struct num {
    static constexpr int value = V;
};

// Pick<C, A, B>::type is A when C holds, else B (std::conditional, which needs <type_traits>).
template <bool C, class A, class B>
struct Pick {
    using type = A;
};
template <class A, class B>
struct Pick<false, A, B> {
    using type = B;
};

__forceinline__ __device__ float neg_inf() { return __int_as_float(0xff800000u); }
__forceinline__ __device__ float min_normal() { return __int_as_float(0x00800000u); }  // FLT_MIN

// Base-2 exponential on the special-function unit; ex2(-inf) = +0, which masking relies on.
__forceinline__ __device__ float exp2f_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Hyperbolic tangent on the special-function unit (sm_75+): one MUFU operation, relative error about 2^-11 (the
// PTX ISA's bound), what a 16-bit input's rounding puts into the score it multiplies; tanh(+-inf) = +-1.
__forceinline__ __device__ float tanhf_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Base-2 exponential on the FMA units, for a share of a softmax's exponentials where the special-function unit is
// what limits (FA4's idea): 2^x = 2^k p(x - k), k = round(x), p a degree-2 fit of 2^f on [-1/2, 1/2] (relative
// error 1.7e-3: for P that is rounded to e4m3, whose step is 2^-4, only). x is clamped at -127, where 2^k is built
// as +0, so that 2^-inf = +0 as exp2f_approx's; a NaN stays NaN (max.NaN, then NaN times 2^k).
__forceinline__ __device__ float exp2f_fma(float x) {
    float xc;
    asm("max.NaN.f32 %0, %1, 0fC2FE0000;" : "=f"(xc) : "f"(x));  // max(x, -127)
    const float y = xc + 12582912.f;         // 1.5 * 2^23: k in the low bits of y's pattern
    const float fr = xc - (y - 12582912.f);  // x - k, in [-1/2, 1/2]
    const float p = fmaf(fmaf(0.23842521f, fr, 0.70344067f), fr, 1.00044286f);
    return p * __int_as_float((__float_as_int(y) << 23) + 0x3f800000);  // p 2^k: the pattern of 2^k is (k + 127) << 23
}

__forceinline__ __device__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__forceinline__ __device__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// 16-bit float formats as tag types: Half (IEEE fp16) and BFloat16. Each knows how to convert to and
// from fp32, one value or two packed in a 32-bit register (the layout mma.sync fragments use).
struct Half {
    static constexpr bool is_bf16 = false;
    __forceinline__ __device__ static float to_float(u16 x) {
        float f;
        asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(x));
        return f;
    }
    __forceinline__ __device__ static u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};

struct BFloat16 {
    static constexpr bool is_bf16 = true;
    __forceinline__ __device__ static float to_float(u16 x) { return __uint_as_float(((u32)x) << 16); }
    __forceinline__ __device__ static u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};

}  // namespace fav
