"""One GPU call per development iteration: check every GPU variant on odd shapes, then time a sweep.

    PYTHONPATH=. python3 bench/devcheck.py [--check] [--time SHAPE_SET] [--variants fa1,fa2]

The check compares against a float64 reference computed on the GPU (CuPy einsum), so it is cheap enough to
run on every iteration; the full correctness suite is `pytest -m gpu tests`. Timing uses fa_variants.timing
(CUDA events, warm-up, L2-busting input rotation, medians) with torch SDPA in the same run.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import math
import sys
import time

from tabulate import tabulate

from fa_variants import attention, registry, tiles, timing
from fa_variants.tolerances import LSE_ATOL, LSE_ATOL_FP8, TOL
from fa_variants.reference.dense import all_pairs, attention64, rel_error
from fa_variants.timing import (Shape, cast_half, gpu_input_sets, median, time_cuda, torch_sdpa_fn, torch_sdpa_unsupported,
                                torch_status, as_torch_bhnd)

CHECK_SHAPES = [  # (B, Nq, Nk, H, Hkv, d, causal)
    (1, 1, 1, 2, 2, 64, False), (2, 37, 37, 3, 3, 64, True), (1, 1000, 1000, 2, 1, 128, True),
    (1, 37, 1000, 8, 1, 128, True), (1, 1000, 37, 4, 2, 96, True), (2, 4097, 4097, 2, 2, 128, False),
    (1, 300, 500, 2, 2, 32, True), (1, 513, 513, 2, 2, 256, True), (1, 64, 64, 16, 2, 128, False),
]

# The issue's matrix: B*N = 16K tokens, heads*d = 2048, N from 1K to 16K; plus FA1's small-grid case.
ISSUE = [Shape(16384 // n, 2048 // d, n, d, dt, c) for dt in ("bfloat16", "float16") for d in (64, 128)
         for n in (1024, 2048, 4096, 8192, 16384) for c in (False, True)]
# Issue 9's matrix: d 64, 128 and 256, N 1K-16K, causal and not, bf16 and fp16 (B*N = 16K, H*d = 2048).
FA3_MATRIX = [Shape(16384 // n, 2048 // d, n, d, dt, c) for dt in ("bfloat16", "float16") for d in (64, 128, 256)
              for n in (1024, 2048, 4096, 8192, 16384) for c in (False, True)]
SETS = {
    "quick": [Shape(4, 16, 4096, 128, "bfloat16", False), Shape(4, 16, 4096, 128, "bfloat16", True),
              Shape(8, 32, 2048, 64, "float16", False), Shape(2, 8, 8192, 256, "bfloat16", False)],
    "issue": ISSUE,
    "fa3": FA3_MATRIX,
    "fa3_bf16": [s for s in FA3_MATRIX if s.dtype == "bfloat16"],
    "tiles": [Shape(4, 32, 4096, 64, "bfloat16", False), Shape(4, 16, 4096, 128, "bfloat16", False),
              Shape(4, 16, 4096, 128, "bfloat16", True), Shape(4, 8, 4096, 256, "bfloat16", False)],
    "fp8": [Shape(4, 16, 4096, 128, "bfloat16", False), Shape(2, 16, 8192, 128, "bfloat16", False),
            Shape(1, 16, 16384, 128, "bfloat16", False), Shape(4, 8, 4096, 256, "bfloat16", False),
            Shape(1, 8, 16384, 256, "bfloat16", False)],
    "fp8_tiles": [Shape(4, 32, 4096, 64, "bfloat16", False), Shape(1, 32, 16384, 64, "bfloat16", False),
                  Shape(4, 16, 4096, 128, "bfloat16", False), Shape(2, 16, 8192, 128, "bfloat16", False),
                  Shape(1, 16, 16384, 128, "bfloat16", False), Shape(1, 16, 16384, 128, "bfloat16", True),
                  Shape(4, 8, 4096, 256, "bfloat16", False), Shape(1, 8, 16384, 256, "bfloat16", False)],
    "short": [Shape(16384 // n, 2048 // d, n, d, "bfloat16", c) for d in (64, 128, 256) for n in (2048, 4096)
              for c in (False, True)],
    "causal": [Shape(16384 // n, 2048 // d, n, d, "bfloat16", True) for d in (64, 128, 256) for n in (2048, 4096, 8192)],
    "small-grid": [Shape(1, 16, 16384, 128, "bfloat16", False), Shape(1, 16, 16384, 128, "bfloat16", True)],
    # d 128 where the floor is closest (N 2K) and its neighbour, both dtypes and masks
    "d128": [Shape(16384 // n, 16, n, 128, dt, c) for dt in ("bfloat16", "float16") for n in (2048, 4096)
             for c in (False, True)],
    # The last wave's cost at d 128: at N 2K, 2048 tiles of 128 rows are 15.5 waves on 132 SMs, 2112 (H 33) are
    # 16; at N 4K, 4096 are 31.03 waves, 4224 (H 33) 32
    "waves": [Shape(8, 16, 2048, 128, "bfloat16", False), Shape(4, 33, 2048, 128, "bfloat16", False),
              Shape(8, 16, 4096, 128, "bfloat16", False), Shape(4, 33, 4096, 128, "bfloat16", False)],
    # d 256 where the floor is closest (N 2K, non-causal) and its neighbour, both dtypes
    "d256": [Shape(16384 // n, 8, n, 256, dt, False) for dt in ("bfloat16", "float16") for n in (2048, 4096)],
    # d 64's long non-causal rows, where the persistent grid splits its last wave
    "d64long": [Shape(16384 // n, 32, n, 64, dt, False) for dt in ("bfloat16", "float16") for n in (8192, 16384)],
    # The same at the matrix's long rows: H 16 is 2048 tiles (15.5 waves), H 33 4224 (32)
    "tail": [Shape(16384 // n, h, n, 128, "bfloat16", False) for n in (4096, 8192, 16384) for h in (16, 33)],
    # Where seqlen_k's tail block is part-empty at the tiles of long rows (BN 160 at d 128, 80 at d 256): the
    # narrow tail block's shapes (fa3_fwd.cu's TAIL_BN), non-causal
    "narrow": [Shape(16384 // n, 2048 // d, n, d, dt, False) for dt in ("bfloat16", "float16") for d in (128, 256)
               for n in (1024, 2048, 4096)],
    "narrow_fp8": [Shape(16384 // n, 16, n, 128, "bfloat16", False) for n in (1024, 2048, 4096, 8192, 16384)],
    # fa3_fp8 where quantization in the call costs the most (short rows), one causal shape beside them
    "fp8_short": [Shape(16384 // n, 2048 // d, n, d, "bfloat16", False) for d in (64, 128, 256) for n in (1024, 2048, 4096)]
    + [Shape(4, 16, 4096, 128, "bfloat16", True)],
    # d 64's long causal rows on the persistent grid (against one CTA per tile: --tiles fa3:64=192,128,2,1,0)
    "d64causal": [Shape(16384 // n, 32, n, 64, dt, True) for dt in ("bfloat16", "float16") for n in (4096, 8192, 16384)],
}


# The tile types of a --tiles spec, by (variant, kernel): the tuple of template arguments each kernel takes.
TILE_TYPES = {("fa1", None): tiles.Tile, ("fa2", "wgmma"): tiles.Tile, ("fa2", "mma_sync"): tiles.Fa2Tile,
              ("fa2_fp8", "wgmma"): tiles.Fp8WgmmaTile, ("fa2_fp8", "mma_sync"): tiles.Tile,
              ("fa3", None): tiles.Fa3Tile, ("fa3_fp8", None): tiles.Fa3Tile}


@dataclasses.dataclass(frozen=True)
class Run:
    """How devcheck calls a variant: through the API as a user does, or, for a tile sweep (``tiles``: template head
    dim -> tile) or another kernel than the device's (``kernel``: fa2's and fa2_fp8's "wgmma" or "mma_sync"),
    through its launcher with those as explicit arguments."""
    variant: str
    kernel: str | None = None
    tiles: tuple = ()   # ((template head dim, tile), ...)

    @property
    def tag(self) -> str:
        return self.variant + ("-mma.sync" if self.kernel == "mma_sync" else "")

    @property
    def launcher(self):
        return importlib.import_module(f"fa_variants.kernels.{self.variant}")

    @property
    def through_api(self) -> bool:
        """No tile or kernel of its own: the call a user makes."""
        return not self.kernel and not self.tiles

    def tile(self, head_dim: int):
        """This run's tile at ``head_dim``'s template dim (None: the table's)."""
        mod = self.launcher
        dim = (mod.kernel_dim(head_dim, self.kernel) if self.variant == "fa2" else
               tiles.fa3_template_dim(head_dim) if self.variant.startswith("fa3") else
               mod.fp8_template_dim(head_dim) if self.variant == "fa2_fp8" else tiles.template_dim(head_dim))
        return dict(self.tiles).get(dim)

    def _kw(self, head_dim: int) -> dict:
        kw = {"kernel": self.kernel} if self.kernel else {}
        tile = self.tile(head_dim)
        return kw | ({"tile": tile} if tile is not None else {})

    def call(self, shape: Shape, scale: float):
        """fn(q, k, v) -> out for inputs of ``shape`` (fp8: quantizing in the call)."""
        if self.through_api:
            return lambda q, k, v: attention(q, k, v, variant=self.variant, causal=shape.causal, softmax_scale=scale)
        if self.variant == "fa2_fp8":
            quantize, attend = self.quantize(shape), self.attend_quantized(shape, scale)
            return lambda q, k, v: attend(quantize(q, k, v))
        kw = dict(causal=shape.causal, softmax_scale=scale, return_lse=False)
        if self.variant == "fa3_fp8":  # the shipped quantize-and-attend plan, on this run's tile
            from fa_variants.kernels import fa2_fp8
            tile = self.tile(shape.head_dim) or self.launcher.config(shape.head_dim)
            make = lambda q, k, v: fa2_fp8.quantize_and_attend(  # noqa: E731
                q, k, v, tile, functools.partial(self.launcher.plan, tile=tile), self.launcher.launch_behind_quantizer,
                **kw)
        else:
            make = lambda q, k, v: self.launcher.plan(q, k, v, **kw, **self._kw(shape.head_dim))  # noqa: E731
        plans = {}  # every input set of a shape has one signature: one plan

        def fn(q, k, v):
            key = (q.shape, q.strides, k.shape, k.strides, q.dtype)
            if key not in plans:
                plans[key] = make(q, k, v)
            return plans[key].run_cupy(q, k, v)[0]
        return fn

    def quantize(self, shape: Shape):
        """fn(q, k, v) -> this run's quantized operands (fp8 variants)."""
        import fa_variants as fav
        if self.through_api:
            return lambda q, k, v: fav.fp8.quantize(q, k, v, variant=self.variant)
        from fa_variants.kernels import fa2_fp8
        tile = self.tile(shape.head_dim)
        if tile is None:
            tile = self.launcher.config(shape.head_dim, **({"kernel": self.kernel} if self.kernel else {}))
        return lambda q, k, v: fa2_fp8.quantize(q, k, v, tile)

    def attend_quantized(self, shape: Shape, scale: float):
        """fn(quantized operands) -> out (fp8 variants)."""
        import fa_variants as fav
        if self.through_api:
            return lambda qz: fav.fp8.attention(qz, causal=shape.causal, softmax_scale=scale)
        kw = dict(causal=shape.causal, softmax_scale=scale, return_lse=False, **self._kw(shape.head_dim))
        return lambda qz: self.launcher.run_quantized(self.launcher.plan(qz, **kw), qz)[0]


def parse_tiles(spec: str) -> dict[tuple[str, str | None], tuple]:
    """{(variant, kernel): ((template head dim, tile), ...)} from --tiles: 'fa3:128=128,160,2,1,1;fa2.mma_sync:128=
    128,32,4,0' (a variant's tile at a template head dim; fa2 and fa2_fp8 name their kernel, wgmma or mma_sync)."""
    runs: dict = {}
    for part in filter(None, spec.split(";")):
        name, _, rest = part.partition(":")
        variant, _, kernel = name.partition(".")
        kernel = kernel or None
        if (variant, kernel) not in TILE_TYPES:
            raise SystemExit(f"--tiles: {name!r} is none of {sorted(f'{v}.{k}' if k else v for v, k in TILE_TYPES)}")
        dim, _, values = rest.partition("=")
        tile = TILE_TYPES[variant, kernel](*(int(x) for x in values.split(",")))
        runs[variant, kernel] = runs.get((variant, kernel), ()) + ((int(dim), tile),)
        print(f"tiles: {name} d={dim} -> {tile}")
    return runs


def check(names):
    import cupy
    rows, bad = [], 0
    for (b, nq, nk, h, hkv, d, causal) in CHECK_SHAPES:
        for dtype in ("float16", "bfloat16"):
            rng = cupy.random.default_rng()
            mk = lambda n, hh: cast_half(rng.standard_normal((b, n, hh, d), dtype=cupy.float32), dtype)  # noqa: E731
            q, k, v = mk(nq, h), mk(nk, hkv), mk(nk, hkv)
            scale = 1 / math.sqrt(d)
            ref, ref_lse = attention64(q, k, v, causal=causal, scale=scale)   # (B*H, Nq, d), (B*H, Nq)
            pairs = all_pairs(b, h)
            for name in names:
                out, lse = attention(q, k, v, variant=name, causal=causal, return_lse=True)
                out2 = attention(q, k, v, variant=name, causal=causal)
                err = rel_error(out, ref, pairs)
                lse = cupy.stack([lse[bb, hh] for bb, hh in pairs])
                fin = cupy.isfinite(ref_lse)
                lse_err = float(cupy.abs(lse[fin] - ref_lse[fin]).max()) if bool(fin.any()) else 0.0
                lse_inf_ok = bool((cupy.isneginf(lse) == ~fin).all())
                det = bool((out == out2).all())
                fp8 = registry.get(name).operand_dtype is not None  # the tests' tolerances, by operand format
                tol, lse_tol = (TOL["float8_e4m3fn"], LSE_ATOL_FP8) if fp8 else (TOL[dtype], LSE_ATOL)
                ok = err <= tol and lse_err <= lse_tol and lse_inf_ok and det and not bool(cupy.isnan(out).any())
                bad += not ok
                rows.append([name, dtype, f"B{b} Nq{nq} Nk{nk} H{h}/{hkv} d{d}{' causal' if causal else ''}",
                             f"{err:.2e}", f"{lse_err:.1e}", lse_inf_ok, det, "ok" if ok else "FAIL"])
    print(tabulate(rows, headers=["variant", "dtype", "shape", "rel err", "lse err", "-inf ok", "determ.", ""]))
    return bad


def time_sweep(shapes, runs, repeats):
    import cupy
    torch, why = torch_status()
    timed = lambda fn, s: median(time_cuda(fn, warmup=3, repeats=repeats, rotate_inputs=s))  # noqa: E731
    names = [r.tag for r in runs]
    rows = []
    for i, shape in enumerate(shapes):
        print(f"[{i + 1}/{len(shapes)}] {shape.id}", file=sys.stderr, flush=True)
        sets = gpu_input_sets(shape)
        scale = 1 / math.sqrt(shape.head_dim)
        res = {}
        for run in runs:
            res[run.tag] = timed(run.call(shape, scale), sets)
        res.update(torch_peers(torch, shape, scale, sets, timed))
        del sets
        cupy.get_default_memory_pool().free_all_blocks()
        tf = {k: shape.flops / (ms * 1e-3) / 1e12 for k, ms in res.items()}
        row = [shape.id] + [f"{tf[k]:.1f}" if k in tf else "" for k in names + PEERS]
        for k in names:
            row.append(f"{tf[k] / tf['torch-flash']:.2f}" if k in tf and "torch-flash" in tf else "")
        for k in names:
            row.append(f"{tf[k] / tf['torch-cudnn']:.2f}" if k in tf and "torch-cudnn" in tf else "")
        rows.append(row)
    heads = ["shape"] + [f"{k} TF/s" for k in names + PEERS] + \
        [f"{k}/flash" for k in names] + [f"{k}/cudnn" for k in names]
    print(tabulate(rows, headers=heads))


def memory_check():
    """fa2 at B=1, H=16, N=128K, d=128 allocates only O and LSE; naive refuses the shape with its clear error."""
    import cupy
    from fa_variants.timing import PeakMemory, random_inputs
    shape = Shape(1, 16, 131072, 128, "bfloat16", False)
    q, k, v = random_inputs(shape, cupy, 0)
    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()
    with PeakMemory() as pm:
        out, lse = attention(q, k, v, variant="fa2", return_lse=True)
        cupy.cuda.Device().synchronize()
    print(f"{shape.id}: inputs {3 * q.nbytes / 2**20:.0f} MiB; fa2 pool peak during the call {pm.peak / 2**20:.1f} MiB "
          f"= out {out.nbytes / 2**20:.1f} MiB + lse {lse.nbytes / 2**20:.2f} MiB "
          f"(pool used before {before / 2**20:.0f} MiB, after {pool.used_bytes() / 2**20:.0f} MiB); "
          f"finite: {bool(cupy.isfinite(out.astype(cupy.float32)).all())}")
    try:
        attention(q, k, v, variant="naive")
        print("naive: ran (unexpected)")
    except MemoryError as e:
        print(f"naive refused: {type(e).__name__}: {e}")


# The quantizers' shapes: issue 9's (B N = 16K, H d = 2048; causal does not matter to them), bf16
QUANT_SHAPES = [s for s in FA3_MATRIX if s.dtype == "bfloat16" and not s.causal]


def _quant_bytes(q, k, v) -> int:
    """What quantizing q, k, v must move: bf16 Q, K read once, V twice (its channel amax first), e4m3 written."""
    return q.nbytes + k.nbytes + 2 * v.nbytes + (q.nbytes + k.nbytes + v.nbytes) // 2


def _copy_ms(nbytes: int, repeats: int) -> float:
    """A device-to-device copy of nbytes / 2 bytes (so nbytes moved): the bandwidth ceiling in the same run."""
    import cupy
    src = cupy.empty(nbytes // 2, cupy.uint8)
    dst = cupy.empty_like(src)
    return median(time_cuda(lambda: dst.__setitem__(Ellipsis, src), warmup=3, repeats=repeats))


def _host_us(fn, args, calls: int = 20) -> float:
    """Host time of one call: ``calls`` calls without synchronizing (the launch queue absorbs them), per call."""
    import cupy
    fn(*args)
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    us = (time.perf_counter() - t0) / calls * 1e6
    cupy.cuda.Device().synchronize()
    return us


def quant_bandwidth(repeats, variants=("fa3_fp8", "fa2_fp8"), threads=None):
    """fa_variants.fp8.quantize alone, per fp8 variant (its scale blocks): GPU time by events, GB/s of the bytes it
    must move (_quant_bytes), the share of a copy of as many bytes timed beside it, and the host time of a call.
    ``threads``: quantize_qk_amax CTA sizes to sweep (fa2_fp8.quantize_parts' ``threads``) instead."""
    import fa_variants as fav
    from fa_variants.kernels import fa2_fp8
    names = [n for n in variants if registry.get(n).available()[0]]
    rows = []
    for i, shape in enumerate(QUANT_SHAPES):
        print(f"[{i + 1}/{len(QUANT_SHAPES)}] {shape.id}", file=sys.stderr, flush=True)
        sets = gpu_input_sets(shape)
        moved = _quant_bytes(*sets[0])
        copy = _copy_ms(moved, repeats)
        row = [shape.id, f"{copy * 1e3:.1f}"]
        for name in names:
            if threads:
                blocks = registry.get(name).launcher.tiles(shape.head_dim)
                runs = [(f"{name} {t} threads", lambda q, k, v, t=t: fa2_fp8.quantize_parts(q, k, v, blocks, t))
                        for t in threads]
            else:
                runs = [(name, lambda q, k, v, n=name: fav.fp8.quantize(q, k, v, variant=n))]
            for tag, fn in runs:
                ms = median(time_cuda(fn, warmup=3, repeats=repeats, rotate_inputs=sets))
                row += [f"{ms * 1e3:.1f}", f"{moved / ms / 1e6:.0f}", f"{copy / ms:.2f}"]
                if not threads:
                    row.append(f"{_host_us(fn, sets[0]):.0f}")
        rows.append(row)
        del sets
    heads = ["shape", "copy us"]
    for name in names:
        for tag in ([f"{name} {t} threads" for t in threads] if threads else [name]):
            heads += [f"{tag} us", "GB/s", "of copy"] + ([] if threads else ["host us"])
    print(tabulate(rows, headers=heads))


PEERS = timing.peer_names(flex=False)  # main() sets it from --flex / --no-peers


def torch_peers(torch, shape, scale, sets, timed) -> dict:
    """{peer: median ms} of torch SDPA's flash and cuDNN backends (and FlexAttention with --flex) on ``sets``,
    timed by ``timed(fn, sets)``; empty without torch or for a shape SDPA does not take."""
    if torch is None or torch_sdpa_unsupported(shape):
        return {}
    tsets = [tuple(as_torch_bhnd(torch, a) for a in s) for s in sets]
    res = {}
    for peer in PEERS:
        try:
            t0 = time.perf_counter()
            res[peer] = timed(torch_sdpa_fn(torch, peer, shape, scale), tsets)
            if peer == timing.FLEX:  # its compile is per shape: say what it costs
                print(f"  {peer}: {time.perf_counter() - t0:.1f} s with its compile", file=sys.stderr)
        except Exception as e:  # noqa: BLE001
            print(f"  {peer}: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
    return res


def fp8_sweep(shapes, repeats, runs):
    """The fp8 variants against this library's bf16 ones and torch SDPA, in one run: pre-quantized operands (a KV
    cache, the issue's headline) and quantization included. Ratios: against the first 16-bit variant, and against
    the best 16-bit number of the row (fa3 and torch's backends included)."""
    import cupy
    torch, _ = torch_status()
    runs = [r for r in runs if registry.get(r.variant).available()[0]]
    half = [r for r in runs if registry.get(r.variant).operand_dtype is None]
    fp8 = [r for r in runs if registry.get(r.variant).operand_dtype is not None]
    rows = []
    for i, shape in enumerate(shapes):
        print(f"[{i + 1}/{len(shapes)}] {shape.id}", file=sys.stderr, flush=True)
        sets = gpu_input_sets(shape)
        scale = 1 / math.sqrt(shape.head_dim)
        t = lambda fn, s=sets: median(time_cuda(fn, warmup=3, repeats=repeats, rotate_inputs=s))  # noqa: E731
        res = {r.tag: t(r.call(shape, scale)) for r in half}
        for run in fp8:
            quantize = run.quantize(shape)
            qsets = [(quantize(*s),) for s in sets]
            res[run.tag + " prequant"] = t(run.attend_quantized(shape, scale), qsets)
            del qsets
            res[run.tag + " +quant"] = t(run.call(shape, scale))
        res.update(torch_peers(torch, shape, scale, sets, t))
        del sets
        cupy.get_default_memory_pool().free_all_blocks()
        tf = {k: shape.flops / (ms * 1e-3) / 1e12 for k, ms in res.items()}
        # (no 16-bit number: --variants of fp8 ones only with --no-peers, an A/B of fp8 kernels alone)
        best16 = max((v for k, v in tf.items() if "fp8" not in k), default=math.nan)
        best = fp8[-1].tag  # the last fp8 variant (fa3_fp8 where it runs)
        base = half[0].tag if half else "torch-cudnn"
        rows.append([shape.id] + [f"{v:.1f}" for v in tf.values()]
                    + [f"{tf[best + ' prequant'] / tf.get(base, math.nan):.2f}", f"{tf[best + ' +quant'] / best16:.2f}",
                       f"{tf[best + ' prequant'] / best16:.2f}"])
        heads = (["shape"] + [f"{k} TF/s" for k in tf]
                 + [f"{best} prequant/{base}", f"{best} +quant/best16", f"{best} prequant/best16"])
    print(tabulate(rows, headers=heads))


def runs_of(names, overrides) -> list[Run]:
    """A Run per variant of --variants, or one per kernel a --tiles spec names for it (``parse_tiles``)."""
    runs = []
    for name in names:
        mine = [(kernel, t) for (variant, kernel), t in overrides.items() if variant == name]
        runs += [Run(name, kernel, t) for kernel, t in mine] or [Run(name)]
    return runs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--time", default="", help=f"shape set: {', '.join(SETS)} (comma-separated)")
    ap.add_argument("--variants", default="naive,fa1,fa2")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--memory", action="store_true", help="fa2 / naive at B=1, H=16, N=131072, d=128")
    ap.add_argument("--quant", action="store_true",
                    help="fp8 quantization alone (the fp8 variants among --variants, else both): time, bandwidth, host")
    ap.add_argument("--quant-threads", default="", metavar="N,N",
                    help="fp8 quantization with these quantize_qk_amax CTA sizes (e.g. 256,512,1024)")
    ap.add_argument("--fp8", action="store_true", help="fa2_fp8 and fa3_fp8 (pre-quantized, +quantization; fa2_fp8's "
                    "mma.sync kernel too) vs fa2 and fa3")
    ap.add_argument("--flex", action="store_true", help="FlexAttention (torch.compile) beside torch SDPA's backends")
    ap.add_argument("--no-peers", action="store_true", help="time this library's variants only (tile sweeps)")
    ap.add_argument("--fp8-matrix", default="", metavar="SET",
                    help="the fp8 variants among --variants (e.g. fa2,fa3,fa2_fp8,fa3_fp8) beside the 16-bit ones and "
                         "torch on a shape set (fa3_bf16: issue 9's bf16 matrix), pre-quantized and +quantization")
    ap.add_argument("--tiles", default="", help="time these tiles instead of the table's (fa_variants/tiles.py), "
                    "through the launchers' plan(tile=...): 'fa3:128=128,160,2,1,1;fa3:64=192,128,2,1,1'; fa2 and "
                    "fa2_fp8 name the kernel: 'fa2.mma_sync:128=128,32,4,0', 'fa2_fp8.wgmma:64=128,64,8,2'")
    a = ap.parse_args()
    PEERS[:] = [] if a.no_peers else timing.peer_names(a.flex)
    names = [n for n in a.variants.split(",") if n]
    for n in names:
        registry.get(n)
    runs = runs_of(names, parse_tiles(a.tiles))
    bad = check(names) if a.check else 0
    if a.memory:
        memory_check()
    fp8_names = [n for n in names if registry.get(n).operand_dtype is not None] or ["fa3_fp8", "fa2_fp8"]
    if a.quant:
        quant_bandwidth(a.repeats, fp8_names)
    if a.quant_threads:
        quant_bandwidth(a.repeats, fp8_names, threads=[int(t) for t in a.quant_threads.split(",")])
    if a.fp8:  # fa2_fp8's mma.sync kernel (emulated e4m3 on sm_90) for contrast
        fp8_sweep(SETS["fp8"], a.repeats, [Run(n) for n in ("fa2", "fa3", "fa2_fp8")]
                  + [Run("fa2_fp8", "mma_sync"), Run("fa3_fp8")])
    if a.fp8_matrix:
        fp8_sweep(SETS[a.fp8_matrix], a.repeats, runs)
    for s in filter(None, a.time.split(",")):
        time_sweep(SETS[s], runs, a.repeats)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
