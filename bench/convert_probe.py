"""fa3_fp8 with its K and V blocks converted inside the kernel, timed against this tree (needs a GPU).

A lower bound on what quantizing K and V inside the kernel would cost.

    python3 bench/convert_probe.py                                   (the fp8_short shapes, one round)
    python3 bench/convert_probe.py --rounds 2 -- --fp8-matrix fa3_bf16 --variants fa3_fp8 --no-peers --repeats 10

Why: with quantization in the timed call, fa3_fp8 pays a separate quantizer (~105-113 us on the H200 at B.N = 16K,
H.d = 2048), more than the margin of many short shapes. A kernel that took bf16 K and V would skip that pass but
convert each K/V block once per Q tile that reads it, with the only warps it has to spare: the producer warpgroup's
warps 1-3, 24 registers each after setmaxnreg (the consumers hold the rest of the register file).

A probe build, never the shipped one (bench/patch_tree.py copies this tree and patches the copy). In it those three
warps do, per K block and per V^T block, what such a kernel would have to: an amax pass over a tile of bf16 size
(the e4m3 tile the TMA unit landed, read as if it were bf16, twice over), the three warps' maxima exchanged on a
named barrier, then a conversion pass (unpack, scale, cvt to e4m3 pairs, pack, store). They store into a scratch
buffer, not over the block, so the consumers compute on the real operands and the outputs stay right; the time is a
lower bound, since the bf16 TMA traffic, V^T's transpose and the swizzled stores of a real conversion are left out.
The block reaches the consumers only once converted: the TMA unit completes a "landed" barrier that the warps wait
on, and the full barrier counts the three warps. The producer ends them with a flag that names the ring index of its
closing arrival (a bare flag let a warp that was behind read it early and leave its last blocks unconverted: a hang).

The copy is timed against this tree with bench/ab.py (fa3_fp8's pre-quantized column); bench/NOTES.md, twenty-second
session, has the first reading: 0.21-0.49 of the shipped kernel.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import patch_tree  # (bench/, beside this script)

ROOT = patch_tree.ROOT
SCRATCH = 3072  # bytes the converting warps store into (3 warps x 32 lanes x 8 bytes, four times over)

_CONVERTER = r'''        if constexpr (CONVERT) if (threadIdx.x >= 32) {  // (probe: bench/convert_probe.py) warps 1-3 convert
            const int ct = threadIdx.x - 32, lane = threadIdx.x % 32;
            const float scale_base = p.scale_log2;  // a run-time value, so that nothing folds
            // A tile of `bytes` e4m3 bytes, treated as the bf16 tile of twice its size: amax pass, exchange, conversion.
            auto convert = [&](u32 src, int bytes) {
                u32 mx = 0;
#pragma unroll 1
                for (int rep = 0; rep < 2; ++rep)
                    for (int off = ct * 16; off < bytes; off += 96 * 16) {
                        uint4 w;
                        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                                     : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w) : "r"(src + off));
                        mx = __vmaxu2(mx, w.x & 0x7fff7fffu);
                        mx = __vmaxu2(mx, w.y & 0x7fff7fffu);
                        mx = __vmaxu2(mx, w.z & 0x7fff7fffu);
                        mx = __vmaxu2(mx, w.w & 0x7fff7fffu);
                    }
#pragma unroll
                for (int o = 16; o > 0; o /= 2) mx = __vmaxu2(mx, __shfl_xor_sync(0xffffffffu, mx, o));
                if (lane == 0) st_shared(conv_done + 4 + 4 * (ct / 32), (int)mx);
                named_sync(14, 96);
                mx = __vmaxu2(__vmaxu2((u32)ld_shared(conv_done + 4), (u32)ld_shared(conv_done + 8)),
                              (u32)ld_shared(conv_done + 12));
                const float inv = scale_base * __uint_as_float(((mx & 0x7fffu) << 16) | 0x3f800000u);
#pragma unroll 1
                for (int rep = 0; rep < 2; ++rep)
                    for (int off = ct * 16, k = 0; off < bytes; off += 96 * 16, k ^= 768) {
                        uint4 w;
                        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                                     : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w) : "r"(src + off));
                        const u32 lo = pack_e4m3x4(
                            __uint_as_float(w.x << 16) * inv, __uint_as_float(w.x & 0xffff0000u) * inv,
                            __uint_as_float(w.y << 16) * inv, __uint_as_float(w.y & 0xffff0000u) * inv);
                        const u32 hi = pack_e4m3x4(
                            __uint_as_float(w.z << 16) * inv, __uint_as_float(w.z & 0xffff0000u) * inv,
                            __uint_as_float(w.w << 16) * inv, __uint_as_float(w.w & 0xffff0000u) * inv);
                        asm volatile("st.shared.v2.u32 [%0], {%1,%2};"
                                     ::"r"(conv_scr + rep * 1536 + k + ct * 8), "r"(lo), "r"(hi) : "memory");
                    }
                named_sync(14, 96);  // the maxima's slots are free for the next tile
            };
            for (int it = 0;; ++it) {  // the ring as the producer fills it
                const int s = it % STAGES, phase = (it / STAGES) & 1;
                mbar_wait(k_land(s), phase);
                if (ld_shared(conv_done) == it + 1) break;  // the producer's closing arrival, not a block
                convert(sK(s), TK::BYTES);
                fence_proxy_async();
                __syncwarp();
                mbar_arrive_if(k_full(s), lane == 0);
                mbar_wait(v_land(s), phase);
                convert(sV(s), TV::BYTES);
                fence_proxy_async();
                __syncwarp();
                mbar_arrive_if(v_full(s), lane == 0);
            }
        }
'''

# (anchor, replacement) in cuda_src/fa3_fwd.cu; CONVERT is on in the fp8 instances only
KERNEL_EDITS = (
    ("    constexpr int RING = STAGES * (TK::BYTES + TV::BYTES), BARS = 8 * (8 + 4 * STAGES) + 8;\n",
     "    constexpr bool CONVERT = FP8;  // (probe: bench/convert_probe.py)\n"
     f"    constexpr int BARS0 = 8 * (8 + 4 * STAGES) + 8, CONV_EXTRA = CONVERT ? 16 * STAGES + 16 + {SCRATCH} : 0;\n"
     "    constexpr int RING = STAGES * (TK::BYTES + TV::BYTES), BARS = BARS0 + CONV_EXTRA;\n"),
    ("    auto tile_slot = [&](int k) { return bars + 8 * (8 + 4 * STAGES) + 4 * (k % 2); };\n",
     "    auto tile_slot = [&](int k) { return bars + 8 * (8 + 4 * STAGES) + 4 * (k % 2); };\n"
     "    auto k_land = [&](int s) { return bars + BARS0 + 8 * s; };  // (probe) the TMA unit's K, V^T\n"
     "    auto v_land = [&](int s) { return bars + BARS0 + 8 * (STAGES + s); };\n"
     "    const u32 conv_done = bars + BARS0 + 16 * STAGES, conv_scr = conv_done + 16;  // flag, 3 maxima; scratch\n"),
    ("            mbar_init(k_full(s), 1);   // the producer's expect_tx arrival; the bytes complete the phase\n"
     "            mbar_init(v_full(s), 1);\n",
     "            mbar_init(k_full(s), CONVERT ? 3 : 1);  // (probe) the converting warps' arrivals\n"
     "            mbar_init(v_full(s), CONVERT ? 3 : 1);\n"
     "            if (CONVERT) { mbar_init(k_land(s), 1); mbar_init(v_land(s), 1); }\n"),
    ("        fence_mbar_init();\n    }\n    __syncthreads();\n",
     "        if (CONVERT) st_shared(conv_done, 0);\n        fence_mbar_init();\n    }\n    __syncthreads();\n"),
    ("                    mbar_expect_tx(k_full(s), TK::BYTES);\n"
     "                    for (int c = 0; c < TK::SLABS; ++c)\n"
     "                        tma_load_4d(sK(s) + c * TK::SLAB, tk, k_full(s), c * TK::W / EB, j * BN, h_kv, w.b);\n",
     "                    const u32 kb = CONVERT ? k_land(s) : k_full(s), vb = CONVERT ? v_land(s) : v_full(s);\n"
     "                    mbar_expect_tx(kb, TK::BYTES);\n"
     "                    for (int c = 0; c < TK::SLABS; ++c)\n"
     "                        tma_load_4d(sK(s) + c * TK::SLAB, tk, kb, c * TK::W / EB, j * BN, h_kv, w.b);\n"),
    ("                    mbar_expect_tx(v_full(s), TV::BYTES);\n",
     "                    mbar_expect_tx(vb, TV::BYTES);\n"),
    ("                        if constexpr (FP8) tma_load_4d(dst, tv, v_full(s), j * BN + c * TV::W, 0, h_kv, w.b);\n"
     "                        else tma_load_4d(dst, tv, v_full(s), c * TV::W / EB, j * BN, h_kv, w.b);\n",
     "                        if constexpr (FP8) tma_load_4d(dst, tv, vb, j * BN + c * TV::W, 0, h_kv, w.b);\n"
     "                        else tma_load_4d(dst, tv, vb, c * TV::W / EB, j * BN, h_kv, w.b);\n"),
    ("            // Every CTA takes exactly one tile past the end, last; the last CTA to do so zeroes the counter pair\n",
     "            if constexpr (CONVERT) {  // (probe) no block follows: once the ring index it is free, say so there\n"
     "                const int s = it % STAGES, phase = (it / STAGES) & 1;\n"
     "                mbar_wait(k_empty(s), phase ^ 1);\n"
     "                st_shared(conv_done, it + 1);\n"
     "                mbar_arrive_if(k_land(s), true);\n"
     "            }\n"
     "            // Every CTA takes exactly one tile past the end, last; the last CTA to do so zeroes the counter pair\n"),
    ("        }\n    } else {  // ---------------------------------------------------------------------------------- consumers\n",
     "        }\n" + _CONVERTER +
     "    } else {  // ---------------------------------------------------------------------------------- consumers\n"),
)
# the launcher sizes shared memory by the same layout: the fp8 instances' extra barriers, flag and scratch
LAUNCHER_EDITS = (
    ("    return 1024 + q_bufs * bm * itemsize * d + stages * 2 * bn * itemsize * d + _bars(stages)\n",
     "    return 1024 + q_bufs * bm * itemsize * d + stages * 2 * bn * itemsize * d + _bars(stages) + (\n"
     f"        16 * stages + 16 + {SCRATCH} if itemsize == 1 else 0)  # (probe: bench/convert_probe.py)\n"),
)
EDITS = {"cuda_src/fa3_fwd.cu": KERNEL_EDITS, "fa_variants/kernels/fa3.py": LAUNCHER_EDITS}
DEFAULT_DEVCHECK = ["--fp8-matrix", "fp8_short", "--variants", "fa3_fp8", "--no-peers", "--repeats", "10"]


def copy_patched(dest: Path) -> Path:
    """This tree with the converting warps in fa3_fp8, under dest."""
    return patch_tree.copy_patched(dest, EDITS, "convert_probe")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # after it: devcheck's arguments
    devcheck = argv[cut + 1:] if cut < len(argv) else DEFAULT_DEVCHECK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(argv[:cut])
    with tempfile.TemporaryDirectory(prefix="fav-convert-") as tmp:
        probe = copy_patched(Path(tmp) / "probe")
        cmd = [sys.executable, str(ROOT / "bench" / "ab.py"), f"shipped={ROOT}", f"probe={probe}",
               "--rounds", str(args.rounds), "--column", "fa3_fp8 prequant", "--", *devcheck]
        return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
