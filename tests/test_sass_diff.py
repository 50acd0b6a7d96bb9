"""bench/sass_diff.py, the tool behind "SASS identical to <commit>" claims: a tree against its own HEAD compiles to
the same instructions, and a kernel whose source differs is reported as different (exit status 1)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fa_variants import jit
from fa_variants.kernels.common import PAD_INSTANCES, PAD_SOURCE
from fa_variants.sass import cuobjdump_missing

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

pytestmark = [
    pytest.mark.skipif(bool(cuobjdump_missing()), reason=cuobjdump_missing()),
    pytest.mark.skipif(not jit.nvrtc_available(), reason="NVRTC not available"),
    pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout"),
]


def _clean(path: str) -> bool:
    return subprocess.run(["git", "diff", "--quiet", "HEAD", "--", path], cwd=ROOT).returncode == 0


def test_head_against_itself_is_identical(capsys):
    import sass_diff
    if not _clean(f"cuda_src/{PAD_SOURCE}") or not _clean("fa_variants/jit.py"):
        pytest.skip("the pad kernel's source or the JIT layer has local changes")
    assert sass_diff.main(["--against", "HEAD", PAD_SOURCE, PAD_INSTANCES[0]]) == 0
    assert "identical" in capsys.readouterr().out


def test_a_changed_kernel_is_reported(capsys):
    """d95efed (fa3_fwd.cu's fp8 K-scale row once a tile) against its parent: the fp8 instance differs."""
    import sass_diff
    if subprocess.run(["git", "cat-file", "-e", "d95efed^{commit}"], cwd=ROOT).returncode:
        pytest.skip("history without d95efed (a shallow clone)")
    expr = "fa3_fwd<fav::BFloat16, 64, 128, 2, true, true, 3, true, true>"
    assert sass_diff.main(["--here", "d95efed", "--against", "d95efed~1", "fa3_fwd.cu", expr]) == 1
    assert "DIFFERENT" in capsys.readouterr().out
