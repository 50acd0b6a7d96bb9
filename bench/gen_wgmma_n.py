"""Writes cuda_src/common/wgmma_n.cuh: wgmma_16_ss overloads for the key-block widths in NS (fa3's BN other than
n64 / n128, and the backward's n32), and wgmma_e4m3_ss overloads (k32) for those in NS_E4M3 (fa3_fp8's wide key
blocks). inline asm cannot take a register array, so each width's operand list is spelled out here once.

    python3 bench/gen_wgmma_n.py            (from the repository root)
"""
from pathlib import Path

NS = (32, 48, 80, 96, 144, 160, 176, 192)
NS_E4M3 = (96, 160, 192, 256)

HEAD = """// wgmma.mma_async m64nNk16 with both operands in shared memory (fp16/bf16, fp32 accumulators) for key-block
// widths other than wgmma.cuh's n64 and n128: fa3's S = Q K^T over BN = 80, 96, 144, 160, 176 or 192 keys
// (FA3's own tiles are 128 x 176 at d = 128 and 128 x 80 at d = 256) and over its narrow tail blocks of BN - 32
// keys (32 to 144), and fa2_bwd_sm90's n32 (S^T over 32 queries or S over 32 keys at d = 256). Same contract as wgmma_16_ss in wgmma.cuh: d is the
// 64 x N accumulator in its fragment layout (N/8 n-tiles of 4), accumulate == 0 overwrites it.
// wgmma_e4m3_ss: the same for e4m3 operands (m64nNk32, K-major both), fa3_fp8's S over 160, 192 or 256 keys
// and over its narrow tail blocks of BN - 64 (96 at d = 64).
// The operand lists are spelled out because inline asm cannot take a register array; this file is written by
// bench/gen_wgmma_n.py (run it to add a width), not by hand.
#pragma once
#include "wgmma.cuh"

namespace fav {
"""


def overload(n: int) -> str:
    nt, regs = n // 8, n // 2
    outs = ", ".join(f'"+f"(d[{i}][{e}])' for i in range(nt) for e in range(4))
    lst = ",".join(f"%{i}" for i in range(regs))
    body = [f'''        asm volatile("{{ .reg .pred p; setp.ne.b32 p, %{regs + 2}, 0;\\n"
                     "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty} {{{lst}}}, %{regs}, %{regs + 1}, p, 1, 1, 0, 0; }}"
                     : {outs}
                     : "l"(a_desc), "l"(b_desc), "r"(accumulate));''' for ty in ("bf16", "f16")]
    return f'''template <class T>
__forceinline__ __device__ void wgmma_16_ss(float (&d)[{nt}][4], u64 a_desc, u64 b_desc, int accumulate) {{
    if constexpr (T::is_bf16)
{body[0]}
    else
{body[1]}
}}
'''


def overload_e4m3(n: int) -> str:
    nt, regs = n // 8, n // 2
    outs = ", ".join(f'"+f"(d[{i}][{e}])' for i in range(nt) for e in range(4))
    lst = ",".join(f"%{i}" for i in range(regs))
    return f'''__forceinline__ __device__ void wgmma_e4m3_ss(float (&d)[{nt}][4], u64 a_desc, u64 b_desc, int accumulate) {{
    asm volatile("{{ .reg .pred p; setp.ne.b32 p, %{regs + 2}, 0;\\n"
                 "wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{lst}}}, %{regs}, %{regs + 1}, p, 1, 1; }}"
                 : {outs}
                 : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}}
'''


def main():
    text = "\n".join([HEAD] + [overload(n) for n in NS] + [overload_e4m3(n) for n in NS_E4M3]
                     + ["}  // namespace fav\n"])
    (Path(__file__).resolve().parents[1] / "cuda_src" / "common" / "wgmma_n.cuh").write_text(text)


if __name__ == "__main__":
    main()
