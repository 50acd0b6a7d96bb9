"""The Hopper kernels' machine code holds the instructions their design is about, and no spills: checked on the
sm_90a cubins NVRTC makes here (no GPU needed), with cuobjdump (the ``test`` extra installs it).

    wgmma        HGMMA (fp16/bf16) or QGMMA (e4m3) in every wgmma kernel; never HMMA's emulation of e4m3
    fa3          UTMALDG (TMA loads), USETMAXREG (the producer's registers to the consumers), forward and backward;
                 no LDGSTS (cp.async) in the forward;
                 UTMASTG (TMA stores of O) where the persistent grid pipelines across tiles (16-bit; TMA_OUT)
    spills       no LDL / STL in any of them: a spilled accumulator would serialize the wgmmas
    exp turns    fa3_fp8 at d 128 (fa3_fwd.cu's EXP_TURNS): every turn passed after a softmax (a BAR.ARV whose thread
                 count is read from the row sums) comes after that block's exponentials, not before them
    integer max  fa3_fp8 at d 64 and 128 (fa3_fwd.cu's INT_MAX): the row maxima by VIMNMX3 (softmax.cuh's row_max_int)
    mask test    fa3's backward: P^T's exponentials in two loops, with the mask's element test and without
    softcap      the masked forwards cap a score with one MUFU.TANH, and no reciprocal a score
    bare loop    fa3's masked forward has loops without the transforms' instructions, for the calls whose mask has
                 none (a window, a packed batch), and loops with the softcap's alone
"""
from __future__ import annotations

import pytest

from fa_variants import jit, registry, sass
from fa_variants.kernels import fa2_masked, fa3, fa3_bwd, fa3_fp8, fa3_masked
from fa_variants.tiles import Fa3Tile
from fa_variants.sass import cuobjdump_missing, instructions_by_function, sass_by_function

NO_CUOBJDUMP = cuobjdump_missing()
needs_cuobjdump = pytest.mark.skipif(bool(NO_CUOBJDUMP), reason=NO_CUOBJDUMP)

# source -> the instructions every function in it must hold, and those none may hold
WGMMA_SOURCES = {
    "fa2_fwd_sm90.cu": ({"HGMMA"}, {"LDL", "STL"}),
    "fa2_fp8_fwd_sm90.cu": ({"QGMMA"}, {"HGMMA", "LDL", "STL"}),
    "fa2_bwd_sm90.cu": ({"HGMMA"}, {"LDL", "STL"}),
    "fa3_fwd.cu": ({"UTMALDG", "USETMAXREG"}, {"LDGSTS", "LDL", "STL"}),
    "fa3_bwd.cu": ({"HGMMA", "UTMALDG", "USETMAXREG"}, {"LDL", "STL"}),
}
# kernels in those sources that are no MMA kernels (they need none of the instructions, and hold none of the forbidden):
# the fused dQ's fp32 sum scaled into the input dtype, fa3's backward's LSE / D preprocessing
ELEMENTWISE = ("fa2_bwd_dq_convert<", "fa3_bwd_dq_convert_masked<", "fa3_bwd_stats")
# fa3_fwd.cu serves both 16-bit fa3 and fa3_fp8: the FP8 flag picks the MMA (must hold, must not hold)
FA3_MMA = {False: ("HGMMA", "QGMMA"), True: ("QGMMA", "HGMMA")}


def fa3_stores_o_by_tma(expr: str) -> bool:
    """kernels/fa3.py's stores_o_by_tma (the kernel's TMA_OUT) for an instance name
    fa3_fwd<T, D, BN, STAGES, PINGPONG, OVERLAP, NC, PERSISTENT[, FP8]>; fa3_fwd_masked's (one CTA per tile) never."""
    if expr.startswith("fa3_fwd_masked<"):
        return False
    t, d, bn, stages, pp, overlap, nc, pers, *fp8 = (a.strip() for a in expr[expr.index("<") + 1:-1].split(","))
    cfg = Fa3Tile(64 * int(nc), int(bn), int(stages), pp == "true", pers == "true")
    return fa3.stores_o_by_tma(int(d), cfg, overlap == "true", itemsize=1 if fp8 == ["true"] else 2)


def instructions(source: str, expr: str) -> list[str]:
    """The SASS instructions of one instance of ``source``, in order (its sm_90a cubin from the kernel cache)."""
    path, lowered = jit.cached_cubin(source, (expr,), "sm_90a")
    return [t for _, t in instructions_by_function(path)[lowered[expr]]]


def units():
    """(source, name expression) of every instance of a wgmma source a registry entry compiles for sm_90a, one
    test item each: each reads its own cubin, the one tests/test_jit.py installs in the kernel cache."""
    seen = set()
    for v in registry.variants():
        for src, exprs in v.launcher.compile_units("sm_90a").items():
            for expr in exprs:
                if src in WGMMA_SOURCES and (src, expr) not in seen:
                    seen.add((src, expr))
                    yield pytest.param(src, expr, id=f"{v.name}-{expr}")


@needs_cuobjdump
@pytest.mark.parametrize("src,expr", list(units()))
def test_hopper_kernels_hold_their_instructions_and_no_spills(src, expr):
    path, lowered = jit.cached_cubin(src, (expr,), "sm_90a")
    ops = set(sass_by_function(path)[lowered[expr]])
    need, forbid = WGMMA_SOURCES[src]
    must, must_not = (set() if expr.startswith(ELEMENTWISE) else set(need)), set(forbid)
    if src == "fa3_fwd.cu":
        hold, avoid = FA3_MMA[expr in set(fa3_fp8.specializations())]
        must.add(hold)
        must_not.add(avoid)
        # O leaves by TMA exactly where the launcher says so (it then passes the output's tensor map)
        (must if fa3_stores_o_by_tma(expr) else must_not).add("UTMASTG")
    assert must <= ops, f"{expr}: no {sorted(must - ops)} in its SASS"
    assert not must_not & ops, f"{expr}: {sorted(must_not & ops)} in its SASS"


@needs_cuobjdump
@pytest.mark.parametrize("expr", [e for e in fa3_fp8.specializations() if e.split(",")[1].strip() == "128"])
def test_fa3_fp8_turns_bracket_the_exponentials(expr):
    """The consumers' turns at the SFU hold their exponentials: ptxas moves a plain bar.arrive above every MUFU (the
    turn then passes at once and the consumers' exponentials interleave again, which is slower). Between
    each such BAR.ARV and the BAR.SYNC before it lie at least a narrow tail block's exponentials (64 rows x 128 keys
    over 128 threads): MUFU.EX2s, and those on the FMA units (EXP_FMA), each marked by its FMNMX.NAN clamp."""
    ins = instructions("fa3_fwd.cu", expr)
    since_sync, passes = None, []
    for t in ins:
        if t.startswith("BAR.SYNC"):
            since_sync = 0
        elif ("MUFU.EX2" in t or t.startswith("FMNMX.NAN")) and since_sync is not None:
            since_sync += 1
        elif t.startswith("BAR.ARV") and t.split(",")[-1].strip().startswith("R"):  # thread count in a register
            passes.append(since_sync)
    assert passes, f"{expr}: no turn passed with its thread count in a register"
    assert min(passes) >= 64, f"{expr}: exponentials between a turn's wait and its pass: {passes}"


@needs_cuobjdump
@pytest.mark.parametrize("expr", [e for e in fa3_fp8.specializations() if int(e.split(",")[1]) <= 128])
def test_fa3_fp8_row_max_by_three_input_integer_max(expr):
    """fa3_fp8 at d 64 and 128 (fa3_fwd.cu's INT_MAX: FP8 && D <= 128) takes a mask-free block's row maxima as an
    integer max of the scores' bit patterns, three at a time (faster than float max): VIMNMX3 in the machine code, at
    least one row's worth (a thread holds BN / 4 scores of a row: BN / 8 three-input maxima reduce them)."""
    ins = instructions("fa3_fwd.cu", expr)
    bn = int(expr.split(",")[2])
    assert sum(t.startswith("VIMNMX3") for t in ins) >= bn // 8, f"{expr}: too few VIMNMX3 for its row max"


@needs_cuobjdump
@pytest.mark.parametrize("expr", [e for d in fa3_bwd.DIMS for e in fa3_bwd.module("fav::BFloat16", d)
                                  if e.startswith(("fa3_bwd<", "fa3_bwd_masked<"))])
def test_fa3_backward_tests_the_mask_only_where_a_warp_needs_it(expr):
    """A compute warp's P^T (BM / 2 elements a thread a step: 64 keys x BM queries over 128 threads) comes from two
    loops, one with the mask's element test for the warps whose keys cross an edge and one without
    (hopper/bwd_mask.cuh), so its exponentials stand twice in the machine code; the masked kernel's, twice for each
    of its three kinds of scores (raw, capped alone, capped and biased), the capped ones with the softcap's tanh,
    one MUFU.TANH (mask.cuh's capped). Written as one loop with the edge test in each element's select, ptxas formed
    every element's test at every step (docs/kernels/fa3_bwd.md, "The mask test"): the exponentials then stood once.
    The softcap's chain rule reads tanh back with one MUFU.LG2 a score, in a loop with the ALiBi bias and one
    without."""
    ins = instructions("fa3_bwd.cu", expr)
    per_thread = int(expr.split(",")[3].strip(" >")) // 2
    masked = expr.startswith("fa3_bwd_masked<")
    kinds = 3 if masked else 1  # the masked kernel's: raw, capped, capped and biased
    want = 2 * kinds * per_thread  # each loop with the element test and without
    assert sum("MUFU.EX2" in t for t in ins) == want, f"{expr}: not the loops' exponentials"
    want_tanh = 2 * 2 * per_thread if masked else 0
    assert sum("MUFU.TANH" in t for t in ins) == want_tanh, f"{expr}: not one tanh a capped score"
    want_lg2 = 2 * per_thread if masked else 0
    assert sum("MUFU.LG2" in t for t in ins) == want_lg2, f"{expr}: not one read-back a capped score"


@needs_cuobjdump
@pytest.mark.parametrize("module", [fa2_masked, fa3_masked], ids=["fa2_masked", "fa3_masked"])
def test_masked_forwards_cap_a_score_with_one_tanh(module):
    """mask.cuh's capped: cap tanh(s / cap) on the SFU's tanh, one MUFU a score beside the softmax's exponential. The
    form through e^(2s / cap) took an exponential and a reciprocal a score: a MUFU.RCP for each capped score, beside
    the few of the epilogue's 1 / l."""
    for expr in (e for e in module.specializations() if "BFloat16" in e):
        ins = instructions(module.SOURCE, expr)
        tanh, rcp = sum("MUFU.TANH" in t for t in ins), sum("MUFU.RCP" in t for t in ins)
        assert tanh > 0, f"{expr}: no MUFU.TANH"
        assert rcp < tanh, f"{expr}: {rcp} MUFU.RCP beside {tanh} MUFU.TANH"


@needs_cuobjdump
def test_fa3_masked_forward_has_bare_and_softcap_only_loops():
    """hopper/mainloop.cuh's blocks_after_first: the blocks after a tile's first run in one of three copies of the
    loops, chosen once per tile: bare, the softcap alone, or the softcap and ALiBi. The transforms' tests are uniform
    but predicated into every score (a branch there would complete the P V wgmma in flight), so one loop for all
    issued them at every block: 879 instructions a block at d 128 against the unmasked kernel's 492
    (docs/masks.md). Some loop of steps (a block's S and P V wgmmas) must hold neither the tanh nor the ALiBi
    distance (I2FP), and some the tanh without the distance or a branch around the tanh. (Up to d 128: at d 256 the
    copies made ptxas spill.)"""
    for expr in (e for e in fa3_masked.specializations() if "BFloat16" in e and int(e.split(",")[1]) <= 128):
        d, bn = (int(a) for a in expr.split(",")[1:3])
        ins = instructions(fa3_masked.SOURCE, expr)
        bodies = [ins[first:last + 1] for first, last in sass.loops(ins)]
        steps = [body for body in bodies if sum("HGMMA" in t for t in body) == d // 16 + bn // 16]  # S, P V
        assert steps, f"{expr}: no loop of main-loop steps found"
        tanh, i2fp, bra = ([sum(op in t for t in b) for b in steps] for op in ("MUFU.TANH", "I2FP", "BRA"))
        assert any(tanh[i] == 0 and i2fp[i] == 0 for i in range(len(steps))), \
            f"{expr}: every loop of steps holds the transforms"
        assert any(tanh[i] > 0 and i2fp[i] == 0 and bra[i] < tanh[i] // 4 for i in range(len(steps))), \
            f"{expr}: no loop of steps with the softcap alone, unbranched"


def test_a_missing_cuobjdump_says_why_and_how_to_get_it(monkeypatch, tmp_path):
    """The reason a SASS test is skipped with: not installed, or a toolkit's copy not on PATH; and the test extra."""
    monkeypatch.setattr(sass, "cuobjdump", lambda: None)
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sass, "_TOOLKIT_DEFAULT", str(tmp_path / "no-toolkit"))
    why = sass.cuobjdump_missing()
    assert why.startswith("cuobjdump is not installed: not on PATH") and 'pip install -e ".[test]"' in why, why
    exe = tmp_path / "cuda" / "bin" / "cuobjdump"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    why = sass.cuobjdump_missing()
    assert why.startswith("cuobjdump is not on PATH") and f"add {exe.parent} to PATH" in why, why
    with pytest.raises(RuntimeError, match="cuobjdump is not on PATH"):
        sass.sass_by_function(tmp_path / "any.cubin")
