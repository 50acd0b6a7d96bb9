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

// Base-2 exponential on the FMA pipe (FlashAttention-4's way to unload the special-function unit, which does 16
// exponentials a clock per SM against the FMA pipe's 128 FMAs): x = j + f with j = round(x) by the 1.5 * 2^23
// trick, 2^f for f in [-0.5, 0.5] by a cubic (relative error < 1.02e-4, below bf16's and e4m3's rounding; fitted
// in bench/NOTES.md, eighth session), times 2^j made in the exponent bits. Like ex2: x <= -127 (a masked -inf)
// gives exactly +0 (2^j's bits are 0), a NaN stays NaN (max.NaN keeps it); x must stay below 128.
__forceinline__ __device__ float exp2_poly(float x) {
    asm("max.NaN.f32 %0, %0, 0fC2FE0000;" : "+f"(x));  // -127
    const float t = x + 12582912.f, j = t - 12582912.f, f = x - j;  // 12582912 = 1.5 * 2^23: t's low bits = j
    const float p = fmaf(fmaf(fmaf(0.05500976f, f, 0.242211f), f, 0.6932828f), f, 1.f);
    return p * __int_as_float((__float_as_int(t) - 0x4b400000 + 127) << 23);
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
