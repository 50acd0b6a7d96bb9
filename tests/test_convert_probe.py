"""bench/convert_probe.py without a GPU: its edits still patch into fa3_fwd.cu and the fa3 launcher (every anchor
once), and the probe's kernels compile for sm_90a, fp8 (converting warps) and 16-bit (untouched) alike."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import convert_probe as cp  # noqa: E402
import patch_tree  # noqa: E402
from fa_variants import jit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_the_edits_patch_into_the_current_sources():
    for rel, edits in cp.EDITS.items():
        src = (ROOT / rel).read_text()
        out = patch_tree.patched(src, edits, "convert_probe", rel)
        assert out != src and "probe" in out
    kernel = patch_tree.patched((ROOT / "cuda_src/fa3_fwd.cu").read_text(), cp.KERNEL_EDITS, "convert_probe", "k")
    assert kernel.count("named_sync(14, 96)") == 2 and "ld_shared(conv_done) == it + 1" in kernel
    with pytest.raises(ValueError, match="convert_probe: cuda_src/fa3_fwd.cu no longer holds"):
        patch_tree.patched("", cp.KERNEL_EDITS, "convert_probe", "cuda_src/fa3_fwd.cu")


def test_the_probe_layout_adds_the_same_bytes_as_the_kernel(tmp_path):
    """The launcher's shared-memory size in the probe copy: the fp8 layout grows by the converters' barriers, flag and
    scratch, the 16-bit one not at all (the kernel traps on less than its own layout)."""
    tree = cp.copy_patched(tmp_path / "tree")
    code = textwrap.dedent("""
        from fa_variants.kernels import fa3
        cfg = (128, 192, 2, 1, 1)
        print(fa3._layout_bytes(128, cfg, 1, 2), fa3._layout_bytes(128, cfg, 2, 2))
    """)
    # cwd: each tree, since `python -c` puts the working directory before PYTHONPATH
    here, probe = (subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(t), "PATH": "/usr/bin:/bin"},
                                  cwd=t, capture_output=True, text=True) for t in (ROOT, tree))
    (fp8, b16), (fp8_p, b16_p) = (map(int, r.stdout.split()) for r in (here, probe))
    assert fp8_p - fp8 == 16 * 2 + 16 + cp.SCRATCH and b16_p == b16


@pytest.mark.skipif(not jit.nvrtc_available(), reason="NVRTC not available")
def test_the_probe_kernels_compile(tmp_path):
    tree = cp.copy_patched(tmp_path / "tree")
    exprs = ("fa3_fwd<fav::BFloat16, 128, 192, 2, true, true, 2, true, true>",   # fa3_fp8 d 128, persistent
             "fa3_fwd<fav::BFloat16, 256, 128, 2, true, true, 2, false, true>",  # fa3_fp8 d 256, one CTA a tile
             "fa3_fwd<fav::BFloat16, 128, 176, 2, true, true, 2, false, false>")  # 16-bit fa3, no converter
    code = textwrap.dedent(f"""
        from fa_variants import jit
        c = jit.compile_source("fa3_fwd.cu", {exprs!r}, "sm_90a")
        print("ok", jit.__file__)
    """)
    env = {"PYTHONPATH": str(tree), "FA_VARIANTS_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]
    assert run.stdout.split()[1].startswith(str(tree)), run.stdout
