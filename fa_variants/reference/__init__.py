"""NumPy models of each algorithm, float64, following the kernels' loop order and block names."""
from . import fa1, fa2, naive
from .common import DEFAULT_SRAM, AccessCounter, BackwardResult, ModelResult, online_softmax, paper_blocks

__all__ = ["naive", "fa1", "fa2", "AccessCounter", "ModelResult", "BackwardResult", "online_softmax", "paper_blocks", "DEFAULT_SRAM"]
