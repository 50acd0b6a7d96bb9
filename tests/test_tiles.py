"""The tile launched is the tile reported (CPU, no GPU): what each forward launcher's ``plan`` launches (its kernel
instance, grid and block, with the GPU calls stubbed) is what the launcher's ``tiles()`` reports to the IO model,
what the NumPy model takes as its default blocks, what ``fa-variants explain`` prints, and what
docs/kernels/tiles.md lists: all of them read fa_variants/tiles.py."""
from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from fa_variants import registry, tiles
from fa_variants.kernels import common, fa1, fa2, fa2_fp8, fa3, fa3_fp8
from fa_variants.reference import fa3 as fa3_model

SEQLENS = (1, 37, 1000, 1024, 1025, 2048, 2049, 4097, 65536)
SMS = 132
DOC = Path(__file__).resolve().parents[1] / "docs" / "kernels" / "tiles.md"


class _Array:
    """What a plan reads of a CuPy array: shape, strides, dtype and the address."""

    def __init__(self, shape, dtype="float16", ptr=1 << 20):
        self.shape, self.dtype, self.data = tuple(shape), np.dtype(dtype), types.SimpleNamespace(ptr=ptr)
        self.strides = tuple(int(np.prod(self.shape[i + 1:])) * self.dtype.itemsize for i in range(len(shape)))


@pytest.fixture
def cpu_plans(monkeypatch):
    """plan() without a GPU: the kernel a plan loads is its instance name, tensor maps record their rows, the
    device has SMS SMs and the largest shared memory (sm_90)."""
    class Device:
        def __init__(self, *_):
            self.id = 0

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=Device, runtime=types.SimpleNamespace(getDevice=lambda: 0))))
    monkeypatch.setattr("fa_variants.jit.kernel", lambda source, name, *_: name)
    monkeypatch.setattr(common, "smem_limit", lambda: common.SM90_SMEM)
    monkeypatch.setattr("fa_variants.gpu.compute_capability", lambda: 90)
    for mod in (fa1, fa2, fa2_fp8, fa3, fa3_fp8):
        monkeypatch.setattr(mod, "function_of", lambda name, smem: name)
    for mod in (fa3, fa3_fp8):
        monkeypatch.setattr(mod, "MapTemplate", lambda ptr, shape, strides, itemsize, rows, *a: rows)
        monkeypatch.setattr(mod, "sm_count", lambda: SMS)


def _args(instance: str) -> list[str]:
    """The template arguments of a kernel instance name."""
    return [a.strip() for a in instance[instance.index("<") + 1:instance.rindex(">")].split(",")]


def _qkv(seqlen_k: int, head_dim: int, dtype="bfloat16", seqlen_q=None, batch=2, heads=4, heads_kv=2):
    d8 = -(-head_dim // 8) * 8  # what the launchers are given: rows padded to a multiple of 8
    n = seqlen_k if seqlen_q is None else seqlen_q
    return (_Array((batch, n, heads, d8), dtype), _Array((batch, seqlen_k, heads_kv, d8), dtype, 2 << 20),
            _Array((batch, seqlen_k, heads_kv, d8), dtype, 3 << 20))


# ------------------------------------------------------------------------------------------------ fa3
def _explain_rule(text: str, d: int, causal: bool, seqlen_k: int, fp8: bool = False) -> re.Match:
    """The one line of fa3's teaching text (what `fa-variants explain fa3` prints) whose head dim, mask and key
    range take in this call."""
    rule = re.compile(r"^  d=(?P<d>\d+) +(?P<mask>causal or not|non-causal|causal|any mask and N_k)(?:, (?:any N_k|"
                      r"N_k <= (?P<upto>\d+)|N_k > (?P<past>\d+)|(?P<low>\d+) < N_k <= (?P<high>\d+)))?: "
                      r"B_r x B_c = (?P<bm>\d+) x (?P<bn>\d+), n_st = (?P<stages>\d+), "
                      r"(?P<grid>persistent grid|one CTA per tile)$")
    at = text.index("fa3_fp8: the same kernel")  # fa3_fp8's tiles follow there
    lines = [m for m in map(rule.match, (text[at:] if fp8 else text[:at]).splitlines()) if m and int(m["d"]) == d]

    def takes(m):
        mask_ok = m["mask"] in ("causal or not", "any mask and N_k") or (m["mask"] == "causal") == causal
        low = int(m["past"] or m["low"] or 0)
        high = m["upto"] or m["high"]
        return mask_ok and seqlen_k > low and (high is None or seqlen_k <= int(high))

    found = [m for m in lines if takes(m)]
    assert len(found) == 1, (d, causal, seqlen_k, [m[0] for m in lines])
    return found[0]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fa3_tile_launched_is_the_tile_reported(cpu_plans, causal):
    launcher = registry.get("fa3").launcher
    for d in range(1, 257):
        for n in SEQLENS:
            plan = fa3.plan(*_qkv(n, d), causal=causal, softmax_scale=0.1, return_lse=True)
            _, D, bn, stages, pp, overlap, nc, persistent = _args(plan.func)
            launched = (64 * int(nc), int(bn))
            where = f"d={d} N_k={n} causal={causal}: {plan.func}"
            assert plan.maps[:3] == (launched[0], launched[1], launched[1]), where  # the TMA boxes: BM and BN rows
            assert launcher.tiles(d, causal, n) == launched, where
            assert fa3_model.default_blocks(d, causal=causal, seqlen_k=n) == launched, where
            assert plan.persistent == (persistent == "true") and plan.block == 128 * (1 + int(nc)), where
            assert plan.grid[0] == (min(SMS, plan.grid[0]) if plan.persistent else -(-n // launched[0]) * 4 * 2)
            rule = _explain_rule(fa3_model.PIPELINE, int(D), causal, n)
            assert (int(rule["bm"]), int(rule["bn"]), int(rule["stages"])) == launched + (int(stages),), where
            assert (rule["grid"] == "persistent grid") == plan.persistent, where
            assert overlap == "true" and pp == "true", where


def test_fa3_fp8_tile_launched_is_the_tile_reported(cpu_plans):
    """fa3_fp8's tiles depend on the head dim alone; the quantized operands carry them (their scale blocks)."""
    launcher = registry.get("fa3_fp8").launcher
    for d in range(16, 257, 16):
        tile = fa3_fp8.config(d)
        D = fa2_fp8.fp8_template_dim(d)
        for n in SEQLENS:
            for causal in (False, True):
                npad = -(-n // tile.block_k) * tile.block_k
                qz = dict(q=_Array((2, 4, n, D), "uint8"), k=_Array((2, 2, n, D), "uint8"),
                          vt=_Array((2, 2, D, npad), "uint8"), seqlen_k=n, head_dim=d, tiles=tuple(tile),
                          out_dtype=np.dtype("float16"))
                plan = fa3_fp8._plan(qz, causal=causal, softmax_scale=0.1, return_lse=False)
                _, _, bn, _, _, _, nc, persistent, fp8 = _args(plan.func)
                launched = (64 * int(nc), int(bn))
                assert fp8 == "true" and plan.maps[:2] == launched, plan.func
                assert launcher.tiles(d, causal, n) == launched == fa3_model.default_blocks(d, fp8=True), plan.func
                rule = _explain_rule(fa3_model.PIPELINE, D, causal, n, fp8=True)
                assert (int(rule["bm"]), int(rule["bn"])) == launched
                assert (rule["grid"] == "persistent grid") == plan.persistent == (persistent == "true")


def test_fa3_ablation_runs_fa3s_tile_on_one_cta_per_tile(cpu_plans):
    """bench/ablation.py's rows: the four (pingpong, overlap) instances, FA3's 128 x 176 tile, at any length."""
    seen = set()
    for n in (1000, 8192):
        for pp, ov in fa3.ABLATIONS:
            plan = fa3.plan(*_qkv(n, 128), causal=False, softmax_scale=0.1, return_lse=False, pingpong=pp, overlap=ov)
            assert _args(plan.func)[2:] == ["176", "2", str(pp).lower(), str(ov).lower(), "2", "false"]
            assert not plan.persistent and plan.func in fa3.specializations()
            seen.add(plan.func)
    assert len(seen) == 4
    with pytest.raises(ValueError, match="ablation"):
        fa3.plan(*_qkv(1000, 64), causal=False, softmax_scale=0.1, return_lse=False, pingpong=False)


def test_a_sweeps_tile_is_launched_and_checked(cpu_plans):
    """plan(tile=...) launches that tile (bench/devcheck.py --tiles), and refuses anything but the kernel's tuple."""
    qkv = _qkv(4096, 64)
    one_cta_per_tile = tiles.Fa3Tile(192, 128, 2, True, False)
    plan = fa3.plan(*qkv, causal=True, softmax_scale=0.1, return_lse=False, tile=one_cta_per_tile)
    assert _args(plan.func)[2:] == ["128", "2", "true", "true", "3", "false"] and not plan.persistent
    plan = fa2.plan(*qkv, causal=True, softmax_scale=0.1, return_lse=False, kernel="mma_sync",
                    tile=tiles.Fa2Tile(64, 32, 4, False))
    assert _args(plan.func)[2:] == ["64", "32", "4", "false"]
    for mod, kw in ((fa3, {}), (fa2, {"kernel": "mma_sync"}), (fa2, {}), (fa1, {})):
        with pytest.raises(TypeError, match="tile"):
            mod.plan(*qkv, causal=True, softmax_scale=0.1, return_lse=False, tile=(128, 64, 4, False, True), **kw)


def test_fa3_split_keyword_forces_the_split_last_wave(cpu_plans):
    """plan(split=True) splits a short tile's last wave, which the default leaves whole (the GPU tests' shapes);
    split=False never splits."""
    qkv = _qkv(2000, 64, seqlen_q=2000, batch=2, heads=16, heads_kv=16)  # 352 tiles of 192 rows, 16 blocks each
    plans = {s: fa3.plan(*qkv, causal=False, softmax_scale=0.1, return_lse=False, split=s) for s in (None, True, False)}
    assert plans[None].workspace == plans[False].workspace == 0 < plans[True].workspace
    assert plans[None].template == plans[False].template != plans[True].template


def test_every_instance_a_call_launches_is_compiled_and_no_other():
    """compile_units (what `fa-variants build` and the NVRTC tests compile) holds what launch_of picks over every
    head dim, mask and length, plus the ablation's four instances; nothing else."""
    launched = {fa3.launch_of(dt, batch=1, heads=1, seqlen_q=n, seqlen_k=n, head_dim=d, causal=c, sms=SMS).instance
                for dt in common.CTYPE for d in range(1, 257) for n in SEQLENS for c in (False, True)}
    ablation = {fa3.instance(common.CTYPE[dt], 128, tiles.FA3_ABLATION_TILE, pingpong=pp, overlap=ov)
                for dt in common.CTYPE for pp, ov in fa3.ABLATIONS}
    assert set(fa3.specializations()) == launched | ablation
    fp8 = {fa3.launch_of(dt, batch=1, heads=1, seqlen_q=n, seqlen_k=n, head_dim=d, causal=c, sms=SMS, fp8=True).instance
           for dt in common.CTYPE for d in range(16, 257, 16) for n in SEQLENS for c in (False, True)}
    assert set(fa3_fp8.specializations()) == fp8


# ------------------------------------------------------------------------------------------------ fa1, fa2, fa2_fp8
@pytest.mark.parametrize("kernel", ["wgmma", "mma_sync"])
def test_fa2_tile_launched_is_the_tile_reported(cpu_plans, monkeypatch, kernel):
    """On each of its kernels (the device's: sm_90 runs wgmma, the others mma.sync)."""
    monkeypatch.setattr("fa_variants.gpu.compute_capability", lambda: 90 if kernel == "wgmma" else 80)
    for d in range(1, 257):
        plan = fa2.plan(*_qkv(4096, d), causal=False, softmax_scale=0.1, return_lse=False)
        bm, bn = 4096 // plan.grid[0], int(_args(plan.func)[2 if kernel == "wgmma" else 3])  # one CTA per Q block
        assert plan.func.startswith("fa2_fwd_sm90<" if kernel == "wgmma" else "fa2_fwd<"), plan.func
        assert registry.get("fa2").launcher.tiles(d) == (bm, bn), plan.func


def test_fa1_tile_launched_is_the_tile_reported(cpu_plans):
    for d in range(1, 257):
        plan = fa1.plan(*_qkv(1000, d), causal=True, softmax_scale=0.1, return_lse=False)
        bm, bn, warps = map(int, _args(plan.func)[2:])
        assert registry.get("fa1").launcher.tiles(d) == (bm, bn) and plan.block == 32 * warps, plan.func


@pytest.mark.parametrize("kernel", ["wgmma", "mma_sync"])
def test_fa2_fp8_tile_launched_is_the_tile_reported(cpu_plans, kernel):
    for d in range(16, 257, 16):
        tile = fa2_fp8.config(d, kernel=kernel)
        D, n = fa2_fp8.fp8_template_dim(d), 4096
        npad = -(-n // tile.block_k) * tile.block_k
        qz = dict(q=_Array((2, 4, n, D), "uint8"), k=_Array((2, 2, n, D), "uint8"), vt=_Array((2, 2, D, npad), "uint8"),
                  seqlen_k=n, head_dim=d, tiles=tuple(tile), out_dtype=np.dtype("float16"))
        plan = fa2_fp8.plan(qz, causal=False, softmax_scale=0.1, return_lse=False, kernel=kernel)
        bn = int(_args(plan.func)[2 if kernel == "wgmma" else 3])
        assert (n // plan.grid[0], bn) == tile[:2], plan.func  # one CTA per Q block
        if kernel == "wgmma":  # the device's (the fixture's sm_90)
            assert registry.get("fa2_fp8").launcher.tiles(d) == tile[:2]
        with pytest.raises(ValueError, match="quantize"):  # operands quantized for the other kernel's tiles
            other = fa2_fp8.config(d, kernel="mma_sync" if kernel == "wgmma" else "wgmma")
            fa2_fp8.plan(dict(qz, tiles=tuple(other)), causal=False, softmax_scale=0.1, return_lse=False, kernel=kernel)


# ------------------------------------------------------------------------------------------------ the table itself
def test_fa3_rules_cover_every_length_once():
    """Each (head dim, mask) has rules of rising seqlen_k bounds ending in an unbounded one, and fa3_tile picks the
    first whose bound a call is within."""
    for (d, causal), rules in tiles.FA3_TILES.items():
        bounds = [b for b, _ in rules]
        assert bounds[-1] is None and all(b is not None for b in bounds[:-1]) and bounds[:-1] == sorted(bounds[:-1])
        for n in (1, *[b for b in bounds[:-1]], *[b + 1 for b in bounds[:-1]], 1 << 20):
            want = next(t for b, t in rules if b is None or n <= b)
            assert tiles.fa3_tile(d, n, causal) == want
        assert tiles.fa3_tile(d, None, causal) == rules[-1][1]
    with pytest.raises(ValueError, match="head_dim"):
        tiles.fa3_tile(257, 1000)


def test_tables_are_read_only():
    with pytest.raises(TypeError):
        tiles.FA2_TILES[64] = (tiles.Fa2Tile(64, 64, 4, False),)
    with pytest.raises(TypeError):
        tiles.FA3_TILES[64, False] = ()


def _doc_row(d: int, mask: str, keys: str, tile: tiles.Fa3Tile) -> str:
    grid = "persistent" if tile.persistent else "one CTA per tile"
    return f"| {d} | {mask} | {keys} | {tile.block_q} × {tile.block_k} | {tile.stages} | {grid} |"


def test_docs_list_the_table():
    """docs/kernels/tiles.md's fa3 tables list every rule of tiles.FA3_TILES and fa3_fp8's tiles, as they are."""
    text, fp8_text = DOC.read_text().split("\n## fa3_fp8\n")
    for (d, causal), rules in tiles.FA3_TILES.items():
        low = 0
        for bound, tile in rules:
            keys = ("any" if low == 0 else f"> {low}") if bound is None else (f"≤ {bound}" if low == 0 else
                                                                                f"{low + 1}–{bound}")
            row = _doc_row(d, "causal" if causal else "non-causal", keys, tile)
            assert row in text, row
            low = bound
    for d, tile in tiles.FA3_FP8_TILES.items():
        row = _doc_row(d, "any", "any", tile)
        assert row in fp8_text, row


def test_fa3_masked_runs_every_head_dim_on_a_compiled_instance():
    """kernels/fa3_masked.py: every head dim, padded to a multiple of 8, has a tile in FA3_MASKED_TILES (one CTA per
    tile) whose instance `fa-variants build` compiles, in both dtypes, within sm_90's shared memory."""
    from fa_variants.kernels import fa3_masked
    compiled = set(fa3.LAUNCHER.sources()[fa3.SOURCE])
    for d in range(8, 257, 8):
        dt = tiles.fa3_template_dim(d)
        tile = fa3_masked.TILES[dt]
        assert not tile.persistent
        assert fa3_masked.smem_bytes(dt, tile) <= common.SM90_SMEM
        for ctype in common.CTYPE.values():
            assert fa3_masked.instance(ctype, dt, tile) in compiled
