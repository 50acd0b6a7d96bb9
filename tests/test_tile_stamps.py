"""bench/tile_stamps.py without a GPU: its stamps still patch into fa3_fwd.cu (every anchor once) and the patched
source compiles for sm_90a; its summary reads a boundary and its parts off stamps written by hand."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import tile_stamps as ts  # noqa: E402
from fa_variants import jit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_the_stamps_patch_into_the_current_kernel():
    src = (ROOT / "cuda_src" / "fa3_fwd.cu").read_text()
    out = ts.patched(src)
    assert out.count("clock64()") == 5 and out.count("substamp(") == 3 and "fav_stamps" in out
    with pytest.raises(ValueError, match="anchor"):
        ts.patched(src.replace("        auto store_out = [&](const TileWork& x) {", ""))


@pytest.mark.skipif(not jit.nvrtc_available(), reason="NVRTC not available")
def test_the_stamped_kernel_compiles(tmp_path):
    tree = ts.copy_patched(tmp_path / "tree")
    expr = "fa3_fwd<fav::BFloat16, 128, 192, 2, true, true, 2, true, true>"  # fa3_fp8 d 128, persistent
    code = textwrap.dedent(f"""
        from fa_variants import jit
        c = jit.compile_source("fa3_fwd.cu", ({expr!r},), "sm_90a")
        print("ok", jit.__file__)
    """)
    # cwd: the tree, since `python -c` puts the working directory before PYTHONPATH (run from this repository's
    # root, it compiled the unstamped kernel)
    env = {"PYTHONPATH": str(tree), "FA_VARIANTS_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]
    assert run.stdout.split()[1].startswith(str(tree)), run.stdout


def test_summary_of_hand_written_stamps():
    st = np.zeros((ts.CTAS, ts.CONSUMERS, ts.STAMP_K, ts.SLOTS), dtype=np.int64)
    # one consumer, two tiles of 11 blocks: blocks of 100 cycles, a boundary of 250 (slot wait 10, first block 140,
    # the previous tile's epilogue 100)
    # (its epilogue split 10 + 60 + 20 + 10 by the TMA epilogue's stamps e1-e3 in slots 8-10)
    st[0, 0, 0] = [0, 120, 120, 1120, 11, 0, 0, 0, 0, 0, 0, 0]
    st[0, 0, 1] = [1130, 1270, 1370, 2370, 11, 1, 1, 0, 1280, 1340, 1360, 0]
    s = ts.summary(st, 128)
    assert s["tiles"] == 1 and s["block cycles"] == 100
    assert s["boundary"] == (250, 2.5) and s["slot wait"] == (10, 0.1)
    assert s["first block"] == (140, 1.4) and s["previous epilogue"] == (100, 1.0)
    assert s["O buffer wait"] == (10, 0.1) and s["O to shared"] == (60, 0.6)
    assert s["fence + barrier"] == (20, 0.2) and s["TMA issue"] == (10, 0.1)
    st[0, 0, 1, 8:11] = 0  # no epilogue stamps (O not stored by TMA): no such parts
    assert "O to shared" not in ts.summary(st, 128)


def test_cases_are_checked():
    with pytest.raises(SystemExit):
        ts.main(["fa2:bf16-d128-N8192-B2-H16-full"])
