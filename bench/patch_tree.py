"""A copy of this tree with edits at anchors: the diagnostic and probe builds (bench/tile_stamps.py,
bench/convert_probe.py) run from such a copy, never from the shipped sources.

An edit is (anchor, replacement); each anchor must occur exactly once in its file, so that a change to the kernel
that moves an anchor fails loudly (their CPU tests patch and compile the current sources) instead of patching the
wrong place.
"""
from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def patched(source: str, edits, who: str, name: str) -> str:
    """``source`` with ``edits`` applied; ValueError naming the anchor that is not there exactly once."""
    for anchor, replacement in edits:
        if source.count(anchor) != 1:
            raise ValueError(f"{who}: {name} no longer holds this anchor exactly once: {anchor!r}")
        source = source.replace(anchor, replacement)
    return source


def copy_patched(dest: Path, edits_by_file: dict, who: str) -> Path:
    """This tree's package, kernel sources and bench scripts under ``dest``, each file named in ``edits_by_file``
    (a path relative to the tree) patched with its edits."""
    for part in ("fa_variants", "cuda_src", "bench"):
        shutil.copytree(ROOT / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, edits in edits_by_file.items():
        path = dest / rel
        path.write_text(patched(path.read_text(), edits, who, rel))
    return dest
