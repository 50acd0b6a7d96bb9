"""NVRTC compilation of the kernels in ``cuda_src/``, for a named arch or for the current device.

NVRTC needs no GPU, so ``compile_source(..., arch="sm_90a")`` works on a machine without one (CI uses that to
compile every kernel for every supported arch). ``kernel(...)`` compiles for the current device, loads the
cubin through CuPy and caches the result in memory and on disk (``cached_cubin``: the disk half, no GPU needed).

The kernels include no CUDA toolkit header (fp16/bf16 are handled as raw bits through PTX), so the only
includes are the project's own ``#include "common/..."`` headers. Those are flattened into one translation
unit before hashing: editing a header changes the cache key.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import re
import uuid
from pathlib import Path

SUPPORTED_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a")
_BASE_OPTIONS = ("--std=c++17", "-default-device", "--ptxas-options=-v")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
# Part of every cache key. 2: cubins whole (format 1 cached them one byte short) and a manifest per cubin.
_CACHE_FORMAT = 2


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


def nvrtc_available() -> bool:
    """Whether CuPy's NVRTC binding is installed (the cuda12/cuda13 extra). Compiling needs it, not a GPU."""
    return importlib.util.find_spec("cupy_backends") is not None


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
    for part in (code, arch, repr(options), repr(name_expressions), repr(nvrtc_version()), str(_CACHE_FORMAT)):
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
        cubin = get_cubin(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return Compiled(name, arch, cubin, log, lowered)


@functools.lru_cache(maxsize=1)
def _nvrtc_cubin_functions():
    """(nvrtcGetCUBINSize, nvrtcGetCUBIN) from the very NVRTC library CuPy loaded: CuPy 14 finds it with
    cuda.pathfinder, whose cached answer we reuse, and dlopen of a path already loaded returns that same copy (a
    program handle from one copy of NVRTC means nothing to another)."""
    from cuda import pathfinder

    lib = ctypes.CDLL(pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path)
    size_fn, get_fn = lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN
    size_fn.argtypes, size_fn.restype = (ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)), ctypes.c_int
    get_fn.argtypes, get_fn.restype = (ctypes.c_void_p, ctypes.c_char_p), ctypes.c_int
    return size_fn, get_fn


def get_cubin(prog: int) -> bytes:
    """The whole cubin of compiled NVRTC program ``prog`` (a handle from CuPy's ``nvrtc.createProgram``).

    Not CuPy's ``nvrtc.getCUBIN``: it returns ``cubin_ptr[:cubinSizeRet-1]`` (cupy_backends/cuda/libs/nvrtc.pyx,
    CuPy 14.2), stripping a "trailing NUL" as for PTX and logs. A cubin is binary and nvrtcGetCUBINSize is its
    exact size, so that cuts the last byte of the ELF program-header table, which cuobjdump and nvdisasm refuse."""
    from cupy_backends.cuda.libs import nvrtc

    size_fn, get_fn = _nvrtc_cubin_functions()
    size = ctypes.c_size_t()
    nvrtc.check_status(size_fn(prog, ctypes.byref(size)))
    if size.value == 0:
        raise CompileError("NVRTC produced no cubin (was a virtual arch, compute_XX, asked for?)")
    buf = ctypes.create_string_buffer(size.value)
    nvrtc.check_status(get_fn(prog, buf))
    return buf.raw


def device_arch(device=None) -> str:
    """The arch to compile for on the current (or given) CuPy device: sm_90a on Hopper, sm_XY elsewhere."""
    import cupy
    dev = cupy.cuda.Device() if device is None else device
    cc = int(dev.compute_capability)
    return f"sm_{cc}a" if cc == 90 else f"sm_{cc}"


def _cache_paths(code: str, name: str, name_expressions: tuple, arch: str, options: tuple) -> tuple[Path, Path]:
    """(cubin, manifest) paths of one compile of flattened source ``code`` in the disk cache."""
    key = cache_key(code, arch, options, name_expressions)
    cubin = _cache_dir() / f"{Path(name).stem}-{arch}-{key}.cubin"
    return cubin, cubin.with_suffix(".json")


def _manifest(cubin: bytes, lowered: dict) -> dict:
    """What the manifest records: the mangled names, and the cubin's size and digest to validate it by."""
    return {"lowered": lowered, "cubin_bytes": len(cubin), "cubin_sha256": hashlib.sha256(cubin).hexdigest()}


def _read_cache(cubin_path: Path, manifest_path: Path, name_expressions: tuple) -> dict | None:
    """The lowered names of a valid cached entry, or None when it is missing, truncated, corrupt or mismatched
    (another process's cubin under a manifest it did not write fails the digest): the caller recompiles."""
    try:
        manifest = json.loads(manifest_path.read_text())
        cubin = cubin_path.read_bytes()
    except (OSError, ValueError):
        return None
    lowered = manifest.get("lowered") if isinstance(manifest, dict) else None
    if not isinstance(lowered, dict) or sorted(lowered) != sorted(name_expressions):
        return None
    return lowered if manifest == _manifest(cubin, lowered) else None


def _write_atomically(path: Path, data: bytes) -> None:
    """Install ``data`` at ``path`` through a temporary file of its own and os.replace, so a reader in any process
    or thread sees the old file or the whole new one, never a part. (Not fsync'd: a file that a crash leaves
    short fails its manifest's digest and is recompiled.)"""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")  # unique per writer, in path's file system
    # os.open rather than mkstemp: mode 0o666 under the umask, as a plain write would give (mkstemp makes 0600)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def cached_cubin(name: str, name_expressions: tuple, arch: str, options: tuple = ()) -> tuple[Path, dict]:
    """(path of the cubin, {name expression: mangled name}) for ``cuda_src/<name>`` on ``arch``, from the disk cache
    (``FA_VARIANTS_CACHE``) or compiled into it. Needs no GPU.

    Each entry is two files, each installed atomically: the raw cubin (what CuPy loads by path, and what cuobjdump
    reads) and then a JSON manifest with the mangled names and the cubin's size and SHA-256. Only a pair that
    matches is served. Processes and threads racing on one key each install a complete pair; which one wins does
    not matter, since any valid cubin for the key serves."""
    exprs, arch, options = tuple(name_expressions), normalize_arch(arch), tuple(options)
    code = flatten(name)  # read once: the key and the compile see the same text even if the file is being edited
    cubin_path, manifest_path = _cache_paths(code, name, exprs, arch, options)
    lowered = _read_cache(cubin_path, manifest_path, exprs)
    if lowered is None:
        compiled = _compile_code(code, name, exprs, arch, options)
        _install(cubin_path, manifest_path, compiled)
        lowered = compiled.lowered
    return cubin_path, lowered


def _install(cubin_path: Path, manifest_path: Path, compiled: Compiled) -> None:
    cubin_path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(cubin_path, compiled.cubin)
    _write_atomically(manifest_path, json.dumps(_manifest(compiled.cubin, compiled.lowered)).encode())


def compile_into_cache(name: str, name_expressions: tuple, arch: str, options: tuple = ()) -> Compiled:
    """``compile_source``, with the result installed in the disk cache under the key that ``kernel`` looks up for
    the same instances on ``arch``: `fa-variants build` run where the kernels will run leaves nothing for a first
    call to compile (the key holds NVRTC's version, so a build elsewhere only helps the same toolkit)."""
    exprs, arch, options = tuple(name_expressions), normalize_arch(arch), tuple(options)
    code = flatten(name)
    compiled = _compile_code(code, name, exprs, arch, options)
    _install(*_cache_paths(code, name, exprs, arch, options), compiled)
    return compiled


@functools.lru_cache(maxsize=None)
def _load(name: str, name_expressions: tuple, arch: str, options: tuple, device_id: int):
    import cupy

    path, lowered = cached_cubin(name, name_expressions, arch, options)
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
