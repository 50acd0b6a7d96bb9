"""NVRTC compilation of the kernels in ``cuda_src/``, for a named arch or for the current device.

NVRTC needs no GPU, so ``compile_source(..., arch="sm_90a")`` works on a machine without one (CI uses that to
compile every kernel for every supported arch). ``kernel(...)`` compiles for the current device, loads the
cubin through CuPy and caches the result in memory and on disk.

The kernels include no CUDA toolkit header (fp16/bf16 are handled as raw bits through PTX), so the only
includes are the project's own ``#include "common/..."`` headers. Those are flattened into one translation
unit before hashing: editing a header changes the cache key.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
from pathlib import Path

SUPPORTED_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a")
_BASE_OPTIONS = ("--std=c++17", "-default-device", "--ptxas-options=-v")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


class CompileError(RuntimeError):
    """NVRTC rejected a kernel; the message carries the full NVRTC log."""


def cuda_src_dir() -> Path:
    """The ``cuda_src`` folder: inside the installed package, or beside it in a source tree."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda_src", here.parent / "cuda_src"):
        if (candidate / "common").is_dir():
            return candidate
    raise FileNotFoundError(f"cuda_src/ not found beside {here}; is the package installed with its data files?")


def flatten(name: str, _seen: set | None = None) -> str:
    """The source of ``cuda_src/<name>`` with the project's own ``#include "..."`` lines inlined (each once)."""
    seen = set() if _seen is None else _seen
    path = (cuda_src_dir() / name).resolve()
    if path in seen:
        return ""
    seen.add(path)
    out = []
    for line in path.read_text().splitlines():
        m = _INCLUDE.match(line)
        if m and m.group(1).startswith("generated/"):
            out.append(_generated_header(m.group(1), seen))
        elif m:
            rel = (path.parent / m.group(1)).relative_to(cuda_src_dir().resolve())
            out.append(flatten(str(rel), seen))
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def _generated_header(name: str, seen: set) -> str:
    """A header written by Python at compile time (today: the parameter structs' layout asserts, from
    kernels/params.py), inlined once like a file so that it is part of the cache key."""
    from .kernels.params import GENERATED
    if name not in GENERATED:
        raise FileNotFoundError(f"#include \"{name}\": no such generated header (known: {sorted(GENERATED)})")
    if name in seen:
        return ""
    seen.add(name)
    return GENERATED[name]()


def normalize_arch(arch: str | int) -> str:
    """'90a', 90, 'sm_90a', 'compute_90a' -> 'sm_90a'. Any cc of at least 8.0 is accepted."""
    s = str(arch).strip().lower().removeprefix("sm_").removeprefix("compute_")
    m = re.fullmatch(r"(\d+)([af]?)", s)
    if not m or int(m.group(1)) < 80:
        raise ValueError(f"arch must look like 80, 86, 89, 90a (compute capability >= 8.0), got {arch!r}")
    return f"sm_{m.group(1)}{m.group(2)}"


def nvrtc_version() -> tuple[int, int]:
    from cupy_backends.cuda.libs import nvrtc
    return tuple(nvrtc.getVersion())


@dataclasses.dataclass(frozen=True)
class PtxasReport:
    """What ptxas said about one kernel: registers, static shared memory, spills."""
    kernel: str
    registers: int
    shared_bytes: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int


@dataclasses.dataclass(frozen=True)
class Compiled:
    source: str
    arch: str
    cubin: bytes
    log: str
    lowered: dict  # name expression -> mangled name

    def reports(self) -> list[PtxasReport]:
        return parse_ptxas(self.log, self.lowered)


def parse_ptxas(log: str, lowered: dict) -> list[PtxasReport]:
    demangle = {v: k for k, v in lowered.items()}
    out, current, props = [], None, {}
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)'", line):
            current, props = m.group(1), {}
        elif current and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            props.update(stack=int(m.group(1)), st=int(m.group(2)), ld=int(m.group(3)))
        elif current and (m := re.search(r"Used (\d+) registers", line)):
            smem = re.search(r"(\d+) bytes smem", line)
            out.append(PtxasReport(demangle.get(current, current), int(m.group(1)), int(smem.group(1)) if smem else 0,
                                   props.get("st", 0), props.get("ld", 0), props.get("stack", 0)))
            current = None
    return out


def _cache_dir() -> Path:
    root = os.environ.get("FA_VARIANTS_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "fa_variants")
    return Path(root)


def cache_key(code: str, arch: str, options: tuple, name_expressions: tuple) -> str:
    h = hashlib.sha256()
    for part in (code, arch, repr(options), repr(name_expressions), repr(nvrtc_version())):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def compile_source(name: str, name_expressions: tuple, arch: str, options: tuple = ()) -> Compiled:
    """Compile ``cuda_src/<name>`` for ``arch`` with NVRTC and return the cubin, log and mangled names.

    Memoized on the flattened source text, so an edited ``.cu`` or header is recompiled, never served stale."""
    return _compile_code(flatten(name), name, tuple(name_expressions), normalize_arch(arch), tuple(options))


@functools.lru_cache(maxsize=None)
def _compile_code(code: str, name: str, name_expressions: tuple, arch: str, options: tuple) -> Compiled:
    from cupy_backends.cuda.libs import nvrtc

    opts = (f"-arch={arch}",) + _BASE_OPTIONS + tuple(options)
    prog = nvrtc.createProgram(code, name, [], [])
    try:
        for expr in name_expressions:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, list(opts))
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog).rstrip("\x00")
            raise CompileError(f"NVRTC failed to compile {name} for {arch} ({e}):\n{log}") from None
        log = nvrtc.getProgramLog(prog).rstrip("\x00")
        lowered = {expr: nvrtc.getLoweredName(prog, expr) for expr in name_expressions}
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return Compiled(name, arch, bytes(cubin), log, lowered)


def device_arch(device=None) -> str:
    """The arch to compile for on the current (or given) CuPy device: sm_90a on Hopper, sm_XY elsewhere."""
    import cupy
    dev = cupy.cuda.Device() if device is None else device
    cc = int(dev.compute_capability)
    return f"sm_{cc}a" if cc == 90 else f"sm_{cc}"


@functools.lru_cache(maxsize=None)
def _load(name: str, name_expressions: tuple, arch: str, options: tuple, device_id: int):
    import cupy

    code = flatten(name)
    key = cache_key(code, arch, options, name_expressions)
    path = _cache_dir() / f"{Path(name).stem}-{arch}-{key}.cubin"
    names_path = path.with_suffix(".names")
    if path.exists() and names_path.exists():
        lowered = dict(line.split("\t") for line in names_path.read_text().splitlines())
    else:
        compiled = compile_source(name, name_expressions, arch, options)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(compiled.cubin)
        os.replace(tmp, path)
        names_path.write_text("\n".join(f"{k}\t{v}" for k, v in compiled.lowered.items()))
        lowered = compiled.lowered
    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(path=str(path))
    return module, lowered


def kernel(name: str, expr: str, name_expressions: tuple | None = None, options: tuple = ()):
    """The ``cupy.RawKernel`` for template instance ``expr`` of ``cuda_src/<name>``, built for the current device.

    ``name_expressions`` lists every instance compiled into the same module (defaults to just ``expr``)."""
    import cupy

    exprs = tuple(name_expressions) if name_expressions else (expr,)
    dev = cupy.cuda.Device()
    module, lowered = _load(name, exprs, device_arch(dev), tuple(options), dev.id)
    return module.get_function(lowered[expr])
