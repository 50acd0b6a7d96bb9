"""DRAM and L2 bytes of ONE attention call, measured by Nsight Compute: what ``fa-variants profile`` puts beside
the IO model's HBM bytes.

Method. For each variant (and torch SDPA's flash and cuDNN backends when torch is importable) the parent runs

    ncu --profile-from-start off --clock-control none --metrics dram__bytes_read.sum,dram__bytes_write.sum,
        lts__t_bytes.sum --csv --log-file <tmp> python -m fa_variants.profile --child --target fa2 <shape>

The child allocates the inputs, makes one untimed call (it compiles and loads the kernel and fills the memory
pool), then brackets exactly one call with ``cudaProfilerStart`` / ``cudaProfilerStop``, synchronizing before
the stop: every kernel of that call is profiled (naive launches several, fa2_fp8 quantizes Q, K, V in kernels of
its own) and nothing else. ``parse_ncu_csv`` sums each metric over those kernels, in bytes whatever unit ncu
printed. ncu flushes the caches before each kernel (its default ``--cache-control all``), so DRAM bytes are
counted from a cold L2, the IO model's assumption; within a kernel L2 still serves K/V re-reads, which is
why DRAM/modeled falls below 1 where the model counts re-reads.

``fa-variants profile`` (fa_variants/cli/profile.py) runs ``measure`` per variant and prints the table; this
module imports nothing of the command line.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from .timing.inputs import random_inputs
from .timing.shapes import Shape
from .timing.torch_peers import TORCH_BACKENDS, as_torch_bhnd, torch_sdpa_fn

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum")
READ, WRITE, L2 = METRICS
# ncu's byte units (it scales to the largest that keeps the number readable unless --print-units base)
UNIT_BYTES = {
    "byte": 1, "bytes": 1, "b": 1,
    "kbyte": 1e3, "kb": 1e3, "mbyte": 1e6, "mb": 1e6, "gbyte": 1e9, "gb": 1e9, "tbyte": 1e12, "tb": 1e12,
    "kibyte": 2**10, "kib": 2**10, "mibyte": 2**20, "mib": 2**20, "gibyte": 2**30, "gib": 2**30,
    "tibyte": 2**40, "tib": 2**40,
}
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])


class ProfileError(RuntimeError):
    """One ncu run that gave no numbers; the message is one line saying why."""


@dataclasses.dataclass
class NcuResult:
    """Bytes per metric summed over every profiled kernel, and those kernels' names in launch order."""
    bytes: dict[str, float]
    kernels: list[str]

    @property
    def read(self) -> float:
        return self.bytes.get(READ, math.nan)

    @property
    def write(self) -> float:
        return self.bytes.get(WRITE, math.nan)

    @property
    def l2(self) -> float:
        return self.bytes.get(L2, math.nan)

    def kernel_summary(self, limit: int = 110) -> str:
        """The profiled kernels by name without template arguments, repeats counted: 'gemmSN_NN_kernel x2,
        row_softmax'."""
        counts: dict[str, int] = {}
        for n in self.kernels:
            base = re.split(r"[<(]", n, maxsplit=1)[0].strip().removeprefix("void ") or n
            counts[base] = counts.get(base, 0) + 1
        text = ", ".join(f"{k} x{c}" if c > 1 else k for k, c in counts.items())
        return text if len(text) <= limit else text[: limit - 3] + "..."


def to_bytes(value: str, unit: str) -> float:
    """ncu's ('1,234.5', 'Kbyte') -> 1234500.0. Commas are thousands separators, except in a value like '9,50'
    (a decimal comma: one comma, one or two digits after it, no point)."""
    v = value.strip().replace("\u00a0", "").replace(" ", "")
    if re.fullmatch(r"-?\d+,\d{1,2}", v):
        v = v.replace(",", ".")
    else:
        v = v.replace(",", "")
    u = unit.strip().lower()
    if u not in UNIT_BYTES:
        raise ValueError(f"unknown ncu unit {unit!r} for value {value!r}")
    return float(v) * UNIT_BYTES[u]


def _csv_rows(text: str) -> list[list[str]]:
    """The CSV part of ncu's output: lines starting with a double quote (==PROF==, ==WARNING== and the
    program's own lines are skipped)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    return [row for row in csv.reader(io.StringIO("\n".join(lines)))]


def parse_ncu_csv(text: str, metrics: Sequence[str] = METRICS) -> NcuResult:
    """Sum ``metrics`` over every kernel in ncu's ``--csv`` output, in bytes.

    Takes the details page (one row per kernel and metric: ..."ID",...,"Kernel Name",...,"Metric Name",
    "Metric Unit","Metric Value") and the raw page (one row per kernel, a column per metric, units on the
    second row). A metric that no kernel reported is absent from ``bytes``."""
    rows = _csv_rows(text)
    if not rows:
        return NcuResult({}, [])
    header = rows[0]
    col = {name: i for i, name in enumerate(header)}
    totals: dict[str, float] = {}
    kernels: dict[str, str] = {}
    if "Metric Name" in col:
        i_id, i_k = col.get("ID"), col.get("Kernel Name")
        i_n, i_u, i_v = col["Metric Name"], col["Metric Unit"], col["Metric Value"]
        for n, row in enumerate(rows[1:]):
            if row == header or len(row) <= max(i_n, i_u, i_v):
                continue
            kid = row[i_id] if i_id is not None else str(n)
            kernels.setdefault(kid, row[i_k] if i_k is not None else "?")
            if row[i_n] in metrics:
                try:
                    b = to_bytes(row[i_v], row[i_u])
                except ValueError:
                    if row[i_v].strip().lower() in ("n/a", ""):
                        continue
                    raise
                totals[row[i_n]] = totals.get(row[i_n], 0.0) + b
    else:
        present = [m for m in metrics if m in col]
        if not present:
            return NcuResult({}, [])
        body = rows[1:]
        units = {m: "byte" for m in present}
        if body and (not body[0][0].strip() or body[0][0].strip().lower() in ("", "id")):
            units = {m: body[0][col[m]] or "byte" for m in present}
            body = body[1:]
        i_id, i_k = col.get("ID"), col.get("Kernel Name")
        for n, row in enumerate(body):
            kid = row[i_id] if i_id is not None else str(n)
            kernels.setdefault(kid, row[i_k] if i_k is not None else "?")
            for m in present:
                if row[col[m]].strip().lower() not in ("", "n/a"):
                    totals[m] = totals.get(m, 0.0) + to_bytes(row[col[m]], units[m])
    return NcuResult(totals, list(kernels.values()))


# ------------------------------------------------------------------------------------------------ running ncu
def find_ncu(ncu: str = "ncu") -> str | None:
    """The ncu executable: ``ncu`` itself if it is a path to an executable, else its place on PATH, else the
    CUDA toolkit's usual places; None when there is none."""
    if os.sep in ncu:
        return ncu if os.path.isfile(ncu) and os.access(ncu, os.X_OK) else None
    found = shutil.which(ncu)
    if found or ncu != "ncu":
        return found
    for cand in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/ncu"):
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def ncu_command(ncu: str, log_file: str, metrics: Sequence[str] = METRICS) -> list[str]:
    return [ncu, "--profile-from-start", "off", "--clock-control", "none", "--metrics", ",".join(metrics),
            "--csv", "--log-file", log_file]


def shape_args(shape: Shape) -> list[str]:
    """The child's command-line flags for a ``shapes.Shape``."""
    a = ["--batch", str(shape.batch), "--heads", str(shape.heads), "--heads-kv", str(shape.hkv),
         "--seqlen", str(shape.seqlen_q), "--seqlen-k", str(shape.nk), "--head-dim", str(shape.head_dim),
         "--dtype", shape.dtype]
    return a + (["--causal"] if shape.causal else [])


def _why_failed(*texts: str) -> str:
    """The most telling line of ncu's and the child's output, for a run that gave no numbers."""
    lines = [ln.strip() for t in texts for ln in t.splitlines() if ln.strip()]
    for key in ("ERR_NVGPUCTRPERM", "==ERROR==", "Error:", "Traceback"):
        hits = [ln for ln in lines if key in ln]
        if hits:
            if key == "ERR_NVGPUCTRPERM":
                return "ncu may not read the GPU's performance counters here (ERR_NVGPUCTRPERM: needs root or " \
                       "NVreg_RestrictProfilingToAdminUsers=0)"
            if key == "Traceback":
                return lines[-1]
            return hits[0]
    if any("No kernels were profiled" in ln for ln in lines):
        return "no kernel ran between cudaProfilerStart and cudaProfilerStop"
    return lines[-1] if lines else "no output"


def measure(ncu: str, target: str, shape: Shape, *, seed: int = 0, timeout: float = 900,
            python: str = sys.executable, verbose: bool = False) -> NcuResult:
    """Run the child for ``target`` (a variant name or a key of ``TORCH_BACKENDS``) under ncu and return
    the summed bytes; ProfileError (one line) when ncu or the child fails or nothing was measured."""
    with tempfile.TemporaryDirectory(prefix="fa-variants-ncu-") as tmp:
        log = os.path.join(tmp, "ncu.csv")
        cmd = ncu_command(ncu, log) + [python, "-m", "fa_variants.profile", "--child", "--target", target,
                                       "--seed", str(seed)] + shape_args(shape)
        env = dict(os.environ, LC_ALL="C", LANG="C")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            raise ProfileError(f"ncu did not finish within {timeout:.0f} s (--timeout)") from None
        text = Path(log).read_text(errors="replace") if os.path.exists(log) else ""
    result = parse_ncu_csv(text)
    if proc.returncode != 0 or not result.bytes:
        if verbose:  # -v: the whole story (ncu's log, then the child's own output) on stderr
            print("\n".join(["$ " + " ".join(cmd), text, proc.stdout, proc.stderr]), file=sys.stderr)
        raise ProfileError(_why_failed(text, proc.stdout, proc.stderr))
    missing = [m for m in METRICS if m not in result.bytes]
    if missing:
        raise ProfileError(f"ncu reported no {', '.join(missing)}")
    return result


def ncu_version(ncu: str) -> str:
    try:
        out = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=60).stdout
    except Exception:  # noqa: BLE001
        return "?"
    m = re.search(r"Version\s+(\S+)", out)
    return m.group(1) if m else (out.strip().splitlines() or ["?"])[-1]


# ------------------------------------------------------------------------------------------------ the child
def child_main(argv: Sequence[str]) -> int:
    """Under ncu: inputs, one warm-up call, then exactly one call between cudaProfilerStart and Stop."""
    ap = argparse.ArgumentParser(prog="python -m fa_variants.profile --child")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--target", required=True, help="a variant name, torch-flash or torch-cudnn")
    for flag in ("--batch", "--heads", "--heads-kv", "--seqlen", "--seqlen-k", "--head-dim"):
        ap.add_argument(flag, type=int, required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    import cupy

    from .api import attention

    shape = Shape(batch=a.batch, heads=a.heads, seqlen_q=a.seqlen, head_dim=a.head_dim, dtype=a.dtype,
                         causal=a.causal, heads_kv=a.heads_kv, seqlen_k=a.seqlen_k)
    q, k, v = random_inputs(shape, cupy, seed=a.seed)
    scale = 1.0 / math.sqrt(shape.head_dim)
    if a.target in TORCH_BACKENDS:
        import torch
        fn = torch_sdpa_fn(torch, a.target, shape, scale)
        tq, tk, tv = (as_torch_bhnd(torch, x) for x in (q, k, v))

        def call():
            return fn(tq, tk, tv)
    else:
        def call():
            return attention(q, k, v, variant=a.target, causal=shape.causal, softmax_scale=scale, backend="cuda")

    out = call()                      # warm-up: compile, load, fill the memory pool
    del out
    dev = cupy.cuda.Device()
    dev.synchronize()
    cupy.cuda.runtime.profilerStart()
    out = call()
    dev.synchronize()
    cupy.cuda.runtime.profilerStop()
    del out
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--child" not in argv:
        raise SystemExit("python -m fa_variants.profile is the program `fa-variants profile` runs under ncu "
                         "(with --child); to profile, run `fa-variants profile ...` (or python -m fa_variants.cli "
                         "profile ...)")
    return child_main(argv)


if __name__ == "__main__":
    sys.exit(main())
