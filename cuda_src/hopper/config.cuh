// fa3_fwd's compile-time configuration: the template parameters and every constant derived from them, in one
// place, so that the producer, the main loop, the epilogue and the tile scheduler agree on them.
#pragma once
#include "../common/mask.cuh"
#include "precision.cuh"

namespace fav {
namespace hopper {

template <class T_, int D_, int BN_, int STAGES_, bool PINGPONG_, bool OVERLAP_, int NC_, bool PERSISTENT_, bool FP8_,
          class Mask_ = CausalMask>
struct Config {
    using T = T_;  // the output's element type (fp16 / bf16); also Q, K, V's, but for fp8
    static constexpr int D = D_, BN = BN_, STAGES = STAGES_, NC = NC_;
    static constexpr bool PINGPONG = PINGPONG_, OVERLAP = OVERLAP_, PERSISTENT = PERSISTENT_, FP8 = FP8_;
    using Prec = typename Pick<FP8, PrecisionFp8<T, D, BN, PERSISTENT>, Precision16<T, D, BN, PERSISTENT>>::type;
    // The mask policy (common/mask.cuh): CausalMask, one for the launch; or AttnMask (window, softcap, ALiBi,
    // sinks), one per sequence of a dense or packed batch, with its parameters (MaskedFwdParams), one CTA per tile.
    using Mask = Mask_;
    using Params = typename Pick<Mask::BY_SEQUENCE, MaskedFwdParams, typename Prec::Params>::type;
    static_assert(!Mask::BY_SEQUENCE || (!PERSISTENT && !FP8), "a mask per sequence: 16-bit, one CTA per tile");

    // A CTA: the producer warpgroup and NC consumer warpgroups, each on 64 of the tile's BM query rows.
    static constexpr int BM = 64 * NC, DT = D / 8, CONSUMERS = 128 * NC;
    static constexpr int REGS = NC == 2 ? 240 : 160;  // the consumers' share once the producer keeps 24
    static constexpr int KK = Prec::KK, DN = Prec::DN;
    using TQ = SwizzledTile<BM, Prec::EB * D>;  // [row][d], in slabs of 128 (or 64) bytes, one TMA box each
    using TK = typename Prec::TK;
    using TV = typename Prec::TV;
    using TO = SwizzledTile<BM, 2 * D>;         // 16-bit O rows, as a TMA store reads them
    static_assert(BN % KK == 0 && (D == 64 || D == 128 || D == 256), "whole k-steps of P V; 64-column slabs");
    static_assert(NC == 2 || NC == 3, "two or three consumer warpgroups");

    // Shared memory: 1024 bytes of alignment slack, the Q buffers, fp8's O buffer, the K/V ring, the mbarriers.
    static constexpr int RING = STAGES * (TK::BYTES + TV::BYTES), BARS = 8 * (8 + 4 * STAGES) + 8;
    // CROSS: the persistent grid pipelines across tiles (the next tile's first S is issued with this tile's last
    // P V) where a second Q buffer fits beside the ring: the next tile's Q must land while this one's is still read.
    static constexpr bool CROSS = PERSISTENT && OVERLAP && 1024 + 2 * TQ::BYTES + RING + BARS <= MAX_DYNAMIC_SMEM;
    static constexpr int QBUF = CROSS ? 2 : 1;
    // TMA_OUT: a tile's O leaves by TMA from shared memory, where the persistent grid pipelines across tiles: each
    // consumer writes its rows there in the output's format and one of its threads stores them (the consumers'
    // 4-byte stores from registers cost more). 16-bit: over its own 64 rows of the tile's Q buffer, which its last
    // S has read (O_IN_Q); fp8: into a buffer of its own where that fits too (OBUF bytes). Elsewhere (d 256)
    // shared memory is busy with the next tile's loads: O goes out straight from registers.
    static constexpr int OBUF_BYTES = Prec::O_OWN_BUFFER ? TO::BYTES : 0;
    static constexpr bool TMA_OUT = CROSS && 1024 + 2 * TQ::BYTES + OBUF_BYTES + RING + BARS <= MAX_DYNAMIC_SMEM;
    static constexpr bool O_IN_Q = TMA_OUT && !Prec::O_OWN_BUFFER;
    static constexpr int OBUF = TMA_OUT && Prec::O_OWN_BUFFER ? OBUF_BYTES : 0;
    // The launcher sizes shared memory by the same rule (kernels/fa3.py's smem_bytes).
    static constexpr int SMEM_BYTES = 1024 + QBUF * TQ::BYTES + OBUF + RING + BARS;
    // SPLIT: the persistent grid's last wave spread over every SM (scheduler.cuh), where the pieces of a tile can
    // meet: their partial O goes through a workspace and the tile's O leaves by TMA.
    static constexpr bool SPLIT = TMA_OUT;
    // TAIL_BN: the seqlen_k tail block, where it holds at most TAIL_BN keys, is computed at that width (S as
    // m64 x TAIL_BN, its P V over TAIL_BN keys) rather than over keys past seqlen_k. It is the first block
    // visited, so the step that visits it and the next (which issues its P V) are compiled at both widths.
    // (With the overlap only: without it each step issues its own P V.)
    static constexpr int TAIL_BN = OVERLAP ? BN - Prec::TAIL_STEP : 0;
    // EXP_TURNS: the consumers take turns at the SFU (round robin, as ping-pong does at the tensor cores), so that
    // one consumer's exponentials run at a time at full speed; EXP_FMA: every EXP_FMA-th exponential on the FMA
    // units instead. fp8 at d 128 only (its policy says where).
    static constexpr bool EXP_TURNS = Prec::EXP_TURNS && PINGPONG;
    static constexpr int EXP_FMA = EXP_TURNS ? Prec::EXP_FMA_EVERY : 0;
};

}  // namespace hopper
}  // namespace fav
