"""How fa-variants measures speed: one implementation shared by ``fa-variants compare`` and ``bench/``
(DESIGN.md, "Speed"). One module per purpose:

    shapes       the problem (``Shape``), the directions a case times, the FLOP conventions (TFLOP/s)
    inputs       random q, k, v and dout; several GPU input sets that together pass the L2
    events       CUDA-event timing with a pad kernel hiding host overhead; the clock handed to pytest-benchmark
    memory       the peak of CuPy's memory pool during a call
    torch_peers  torch SDPA (flash, cuDNN, math) and FlexAttention on CuPy's stream, forward and backward
    user_view    the second timer, triton.testing.do_bench, as a user sees a call
    tables       the bench's results: ratios to the torch peers, the summary tables, the skipped cases

Import from the module that holds a name. The names below are also importable from ``fa_variants.timing`` itself,
where the bench scripts and ``fp8_study`` take them from.
"""
from __future__ import annotations

from .events import time_cuda
from .inputs import cast_half, gpu_dout_sets, gpu_input_sets, random_inputs
from .memory import PeakMemory
from .shapes import Shape, direction_flops, median, tflops
from .tables import speedup
from .torch_peers import (FLEX, TORCH_BACKENDS, as_torch_bhnd, peer_names, torch_grad_fn, torch_sdpa_fn,
                          torch_sdpa_grad_sets, torch_sdpa_unsupported, torch_status)

__all__ = ["FLEX", "TORCH_BACKENDS", "PeakMemory", "Shape", "as_torch_bhnd", "cast_half", "direction_flops",
           "gpu_dout_sets", "gpu_input_sets", "median", "peer_names", "random_inputs", "speedup", "tflops",
           "time_cuda", "torch_grad_fn", "torch_sdpa_fn", "torch_sdpa_grad_sets", "torch_sdpa_unsupported",
           "torch_status"]
