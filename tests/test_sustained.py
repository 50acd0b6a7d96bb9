"""bench/sustained.py without a GPU: its arguments are checked before anything is timed."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import sustained  # noqa: E402


def test_too_few_calls_for_one_window():
    with pytest.raises(SystemExit, match="--calls must be at least 50"):
        sustained.main(["--calls", "10"])


def test_a_bad_shape_id_names_the_expected_form():
    with pytest.raises(ValueError, match="not a shape id"):
        sustained.main(["--shape", "bf16-d128"])
