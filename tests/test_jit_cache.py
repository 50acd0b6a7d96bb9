"""The cubins the JIT produces and its disk cache (CPU: NVRTC needs no GPU, except the one `gpu` test).

* Every cubin is a whole ELF image: CuPy's ``nvrtc.getCUBIN`` drops the last byte, and jit must not.
* ``jit.cached_cubin`` serves only a complete, matching (cubin, manifest) pair: processes and threads compiling
  one kernel at once all end with identical valid cubins, and a damaged entry is recompiled, not loaded.

Most tests compile a one-line probe kernel from a private cuda_src/ (a fraction of a second per arch), so they
stay fast and do not depend on the real kernels' template lists.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import struct
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fa_variants import jit

pytestmark = pytest.mark.skipif(not jit.nvrtc_available(), reason="NVRTC comes with the cuda12/cuda13 extra")

PROBE = "probe.cu"
PROBE_EXPR = "probe<3>"
PROBE_CODE = 'template <int N> __global__ void probe(float* o) { o[threadIdx.x] = N * 1.5f + threadIdx.x; }\n'
RACERS = 4  # processes, and threads, compiling one kernel at once

# ----------------------------------------------------------------------------------------------- ELF extents
SHT_NOBITS = 8  # a section that occupies no file bytes (.bss, .nv.shared.*)


def elf_extent_errors(image: bytes) -> list[str]:
    """What of a little-endian ELF64 image lies past its end: the header tables, segments, sections."""
    if image[:4] != b"\x7fELF" or image[4:6] != b"\x02\x01" or len(image) < 64:
        return ["not a little-endian ELF64 image"]
    e_phoff, e_shoff = struct.unpack_from("<QQ", image, 0x20)
    e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", image, 0x36)
    errors = []

    def check(what, offset, size):
        if offset + size > len(image):
            errors.append(f"{what} [{offset}, {offset + size}) ends past the file ({len(image)} bytes)")

    check("program-header table", e_phoff, e_phentsize * e_phnum)
    check("section-header table", e_shoff, e_shentsize * e_shnum)
    if errors:  # the entries below would be read from outside the image
        return errors
    for i in range(e_phnum):  # Elf64_Phdr: p_type, p_flags, p_offset @8, p_vaddr, p_paddr, p_filesz @32
        p_offset, = struct.unpack_from("<Q", image, e_phoff + i * e_phentsize + 8)
        p_filesz, = struct.unpack_from("<Q", image, e_phoff + i * e_phentsize + 32)
        check(f"segment {i}", p_offset, p_filesz)
    for i in range(e_shnum):  # Elf64_Shdr: sh_name, sh_type @4, sh_flags, sh_addr, sh_offset @24, sh_size @32
        sh_type, = struct.unpack_from("<I", image, e_shoff + i * e_shentsize + 4)
        sh_offset, sh_size = struct.unpack_from("<QQ", image, e_shoff + i * e_shentsize + 24)
        if sh_type != SHT_NOBITS:
            check(f"section {i}", sh_offset, sh_size)
    return errors


def _write_probe(src_dir: Path) -> None:
    (src_dir / "common").mkdir(parents=True, exist_ok=True)
    (src_dir / PROBE).write_text(PROBE_CODE)


@pytest.fixture
def probe_src(tmp_path, monkeypatch):
    """A private cuda_src/ holding only the probe kernel, which jit reads instead of the real one."""
    src = tmp_path / "cuda_src"
    _write_probe(src)
    monkeypatch.setattr(jit, "cuda_src_dir", lambda: src)
    return src


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh, empty FA_VARIANTS_CACHE, and no compile memoized in this process."""
    path = tmp_path / "kernel-cache"
    monkeypatch.setenv("FA_VARIANTS_CACHE", str(path))
    jit._compile_code.cache_clear()
    return path


@pytest.fixture
def compiles(monkeypatch):
    """A list that gets one entry per compile jit asks for (memoized or not): how a cache miss shows."""
    calls, real = [], jit._compile_code
    monkeypatch.setattr(jit, "_compile_code", lambda *a: calls.append(a[1]) or real(*a))
    return calls


def _assert_whole_elf(image: bytes, what: str) -> None:
    errors = elf_extent_errors(image)
    assert not errors, f"{what}: {'; '.join(errors)}"


@pytest.mark.parametrize("arch", jit.SUPPORTED_ARCHS)
def test_compiled_cubin_is_a_whole_elf(probe_src, arch):
    cubin = jit.compile_source(PROBE, (PROBE_EXPR,), arch).cubin
    _assert_whole_elf(cubin, arch)
    # the check catches the bug it is here for: CuPy's getCUBIN returns exactly this, one byte short
    assert elf_extent_errors(cubin[:-1]), "the ELF check does not notice a missing last byte"


def test_a_real_kernel_is_a_whole_elf_in_memory_and_on_disk(cache_dir):
    from fa_variants.kernels import fa2
    expr = fa2.specializations()[0]
    _assert_whole_elf(jit.compile_source(fa2.SOURCE, (expr,), "sm_90a").cubin, expr)
    path, lowered = jit.cached_cubin(fa2.SOURCE, (expr,), "sm_90a")
    _assert_whole_elf(path.read_bytes(), str(path))
    assert set(lowered) == {expr}


@pytest.mark.skipif(shutil.which("cuobjdump") is None, reason="cuobjdump not on PATH (pip install nvidia-cuda-cuobjdump)")
def test_cuobjdump_reads_a_cached_cubin(probe_src, cache_dir):
    path, lowered = jit.cached_cubin(PROBE, (PROBE_EXPR,), "sm_90a")
    out = subprocess.run(["cuobjdump", "--dump-sass", str(path)], capture_output=True, text=True, check=True)
    assert lowered[PROBE_EXPR] in out.stdout, out.stdout + out.stderr


# ----------------------------------------------------------------------------------------------- the cache
def _entry_files(cache: Path) -> list[Path]:
    return sorted(cache.iterdir())


def _assert_one_valid_entry(cache: Path) -> bytes:
    """The cache holds exactly one cubin and its manifest, no temporary file, and they match: return the cubin."""
    files = _entry_files(cache)
    assert [f.suffix for f in files] == [".cubin", ".json"], f"expected one cubin + manifest, found {files}"
    cubin = files[0].read_bytes()
    manifest = json.loads(files[1].read_text())
    _assert_whole_elf(cubin, str(files[0]))
    assert manifest["cubin_bytes"] == len(cubin)
    assert jit._read_cache(files[0], files[1], (PROBE_EXPR,)) == manifest["lowered"]
    return cubin


def test_a_cached_entry_is_served_without_compiling(probe_src, cache_dir, compiles):
    first = jit.cached_cubin(PROBE, (PROBE_EXPR,), "sm_80")
    assert compiles == [PROBE]
    assert jit.cached_cubin(PROBE, (PROBE_EXPR,), "sm_80") == first
    assert compiles == [PROBE], "an intact entry was compiled again"
    _assert_one_valid_entry(cache_dir)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _wrong_names(path: Path) -> None:
    manifest = json.loads(path.read_text())
    manifest["lowered"] = {"probe<4>": "_Z5probeILi4EEvPf"}
    path.write_text(json.dumps(manifest))


DAMAGE = {
    "cubin truncated": (".cubin", _truncate),
    "cubin last byte changed": (".cubin", _flip_last_byte),
    "cubin empty": (".cubin", lambda p: p.write_bytes(b"")),
    "cubin missing": (".cubin", Path.unlink),
    "manifest truncated": (".json", _truncate),
    "manifest not json": (".json", lambda p: p.write_bytes(b"\xff\x00 not json")),
    "manifest a list": (".json", lambda p: p.write_text("[]")),
    "manifest of other names": (".json", _wrong_names),
    "manifest missing": (".json", Path.unlink),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_entry_is_recompiled(probe_src, cache_dir, compiles, damage):
    good_path, lowered = jit.cached_cubin(PROBE, (PROBE_EXPR,), "sm_80")
    good = good_path.read_bytes()
    suffix, spoil = DAMAGE[damage]
    spoil(good_path.with_suffix(suffix))
    assert jit.cached_cubin(PROBE, (PROBE_EXPR,), "sm_80") == (good_path, lowered)
    assert compiles == [PROBE, PROBE], f"{damage}: served without recompiling"
    assert _assert_one_valid_entry(cache_dir) == good


def _compile_in_child(src_dir: str, cache: str, barrier, results) -> None:
    """One racer process (spawned: a fresh interpreter, no state shared with the test)."""
    os.environ["FA_VARIANTS_CACHE"] = cache
    from fa_variants import jit as child_jit
    child_jit.cuda_src_dir = lambda: Path(src_dir)
    child_jit.nvrtc_version()  # load NVRTC before the barrier, so the compiles really overlap
    barrier.wait(timeout=60)
    path, lowered = child_jit.cached_cubin(PROBE, (PROBE_EXPR,), "sm_80")
    results.put((path.read_bytes(), lowered))


def test_processes_compiling_one_kernel_at_once_get_identical_valid_cubins(tmp_path):
    src, cache = tmp_path / "cuda_src", tmp_path / "kernel-cache"
    _write_probe(src)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(RACERS), ctx.Queue()
    procs = [ctx.Process(target=_compile_in_child, args=(str(src), str(cache), barrier, results))
             for _ in range(RACERS)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * RACERS
    on_disk = _assert_one_valid_entry(cache)
    assert all(cubin == on_disk for cubin, _ in got), "racing processes saw different cubins"
    assert len({json.dumps(lowered) for _, lowered in got}) == 1


def test_threads_compiling_one_kernel_at_once_get_identical_valid_cubins(probe_src, cache_dir):
    barrier = threading.Barrier(RACERS)

    def racer(_):
        barrier.wait(timeout=60)
        path, lowered = jit.cached_cubin(PROBE, (PROBE_EXPR,), "sm_80")
        return path.read_bytes(), lowered

    with ThreadPoolExecutor(RACERS) as pool:
        got = list(pool.map(racer, range(RACERS)))
    on_disk = _assert_one_valid_entry(cache_dir)
    assert all(cubin == on_disk for cubin, _ in got), "racing threads saw different cubins"
    assert all(lowered == got[0][1] for _, lowered in got)


# ----------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
def test_kernel_loads_a_cached_cubin_and_runs(probe_src, cache_dir, compiles):
    """The whole cubin loads through CuPy, first freshly compiled, then (in a new module) from the disk cache."""
    import cupy
    expect = 3 * 1.5 + cupy.arange(32, dtype=cupy.float32)
    for _ in range(2):
        jit._load.cache_clear()
        out = cupy.zeros(32, cupy.float32)
        jit.kernel(PROBE, PROBE_EXPR)((1,), (32,), (out,))
        assert cupy.array_equal(out, expect)
    assert compiles == [PROBE], "the second load did not come from the disk cache"
