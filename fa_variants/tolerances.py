"""The tolerances every check of a kernel against float64 (and against its own NumPy model) uses: the GPU tests
(tests/conftest.py re-exports them) and bench/devcheck.py's quick check. One place, so that a bench and a test
never disagree about what "correct" means."""
# Relative error ||out - ref|| / ||ref|| against the float64 reference, per input dtype. e4m3's is the format's
# error on Q, K, V and P, about 5 % on N(0, 1) inputs with a spread from seed to seed (docs/design.md, "Accuracy"):
# its bound stands well clear of that spread, and the tight check of the fp8 kernels is against their own model.
TOL = {"float16": 2e-3, "bfloat16": 1e-2, "float8_e4m3fn": 8e-2}
# Log-sum-exp, in natural-log units, where the reference is finite. e4m3 operands carry their rounding into the
# scores: q and k each off by up to 2^-4 relative per element gives a score error of std ~0.05 for N(0,1) inputs,
# and a row with few keys inherits it whole, so the fp8 bound is 5 sigma. (Against its own model, fa2_fp8's LSE
# must agree to FP8_MODEL_LSE_ATOL: that is the tight check.)
LSE_ATOL = 1e-3
LSE_ATOL_FP8 = 0.25
FP8_MODEL_LSE_ATOL = 2e-3
# fa2_fp8 against its own NumPy model (same quantization, same block order): far tighter than against float64,
# which is what shows that the remaining error is the format's and not a bug. Per kernel: the mma.sync kernel
# (fp32 accumulation) measured 1.6e-3 on every test case; Hopper's e4m3 wgmma (QGMMA) keeps fewer accumulator
# bits than fp32 (DeepSeek-V3 report, sec. 3.3.2: about 14), which moves scores by ~1e-4 and flips some of P's
# e4m3 roundings: measured 2.1e-3 to 6.3e-3 on the H200, the size by which a 13-14-bit accumulator moves the
# NumPy model (`python -m fa_variants.fp8_study --accumulation --gpu`, docs/design.md).
FP8_MODEL_TOL = {"mma_sync": 5e-3, "wgmma": 1e-2}
# ... and in every case at most this fraction of the kernel's error against float64 (measured <= 0.16).
FP8_MODEL_TO_FLOAT64 = 0.25
# fp32 scores lose absolute precision as they grow (|lse| ~ 3000 when inputs are scaled by 30), so the LSE bound
# widens by this fraction of |lse|; at the usual |lse| ~ 10 it adds 1e-5 and changes nothing.
LSE_RTOL = 1e-6
# Gradients (dq, dk, dv) against float64, relative norm: the backward chains four rounded matmuls (S, dP in fp32
# from 16-bit operands; P and dS rounded to 16 bits as MMA operands), so its bound is wider than the output's.
GRAD_TOL = {"float16": 5e-3, "bfloat16": 3e-2}
