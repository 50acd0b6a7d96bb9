"""``fa-variants build``: compile every kernel instance the variants ship with NVRTC (no GPU needed) into the disk
cache the kernels load from (FA_VARIANTS_CACHE), so that no first call compiles; a table of registers, shared
memory and spills; a non-zero exit on an error or a spill.

NVRTC compiles one program at a time within a process, so the units of work, one (source, instance, arch) each,
go to a pool of worker processes (--jobs, default: the CPUs this process may run on), the largest sources first.
An instance that several variants share (the head-dim pad, the fp8 quantizers) is compiled once."""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import multiprocessing
import os
import sys
import time

from tabulate import tabulate

from .. import jit
from ..registry import STEP_KERNELS, VARIANTS, Variant
from .args import parse_variants, positive
from .text import INSTALL_HINT, ProgressBar, err_text, progress

LOG_LIMIT = 4000          # characters of a failure's NVRTC log printed without -v


def cpu_count() -> int:
    """The CPUs this process may run on (its affinity mask, where the OS has one), at least 1."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:
        return os.cpu_count() or 1


def add_parser(sub) -> None:
    b = sub.add_parser("build", help="compile every kernel specialization with NVRTC (no GPU needed) into the "
                       "disk cache the kernels load from (FA_VARIANTS_CACHE), so that no first call compiles; "
                       "table of registers, shared memory, spills; non-zero exit on an error or a spill")
    b.add_argument("--arch", help="comma-separated, e.g. 80,86,89,90a (default: each variant's own archs; "
                   "90 means 90a)")
    b.add_argument("--variants", help=f"comma-separated subset of {','.join(VARIANTS)}")
    b.add_argument("--jobs", type=positive, default=cpu_count(),
                   help="compile processes (default: the CPU count, %(default)s here)")
    b.add_argument("-v", "--verbose", action="store_true", help="full NVRTC logs of failures")
    b.set_defaults(func=run)


@dataclasses.dataclass(frozen=True)
class Unit:
    """One NVRTC program: one template instance of one source for one arch (one cubin in the cache)."""
    source: str
    expr: str
    arch: str


def compile_unit(unit: Unit) -> tuple[list[jit.PtxasReport], float]:
    """Compile ``unit`` into the kernel cache (in a worker process): its ptxas reports and the seconds it took."""
    t0 = time.perf_counter()
    compiled = jit.compile_into_cache(unit.source, (unit.expr,), unit.arch)
    return compiled.reports(), time.perf_counter() - t0


def compile_all(units: list[Unit], jobs: int) -> dict[Unit, tuple | BaseException]:
    """{unit: (reports, seconds) or the exception it raised}, ``jobs`` processes at a time (in this process when 1),
    with a progress bar on stderr."""
    order = sorted(units, key=_cost, reverse=True)      # the longest first: none is left to run alone at the end
    bar = ProgressBar(len(order))
    results = {}

    def done(unit: Unit, res) -> None:
        results[unit] = res
        if isinstance(res, BaseException):
            bar.step(f"{unit.arch} {unit.expr} FAILED: {err_text(res, 200)}", keep=True)
        else:
            bar.step(f"{unit.arch} {unit.expr} ({res[1]:.1f} s)")

    try:
        if jobs == 1 or len(order) == 1:
            for unit in order:
                try:
                    done(unit, compile_unit(unit))
                except Exception as e:  # noqa: BLE001 - reported in the table, with its log
                    done(unit, e)
            return results
        # spawn, not fork: a worker needs NVRTC only, and a fresh interpreter inherits no CUDA context or threads
        pool = concurrent.futures.ProcessPoolExecutor(min(jobs, len(order)),
                                                      mp_context=multiprocessing.get_context("spawn"))
        try:
            futures = {pool.submit(compile_unit, unit): unit for unit in order}
            for fut in concurrent.futures.as_completed(futures):
                try:
                    done(futures[fut], fut.result())
                except Exception as e:  # noqa: BLE001 - a compile error, or a worker that died (BrokenProcessPool)
                    done(futures[fut], e)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        return results
    finally:
        bar.close()


_FLAT_SIZE: dict[str, int] = {}


def _cost(unit: Unit) -> int:
    """NVRTC's work on ``unit``, as far as it can be told before compiling: the size of its flattened source."""
    if unit.source not in _FLAT_SIZE:
        try:
            _FLAT_SIZE[unit.source] = len(jit.flatten(unit.source))
        except OSError:            # a source that does not read: its compile reports why
            _FLAT_SIZE[unit.source] = 0
    return _FLAT_SIZE[unit.source]


def run(args: argparse.Namespace) -> int:
    chosen = parse_variants(args.variants, "build")
    wanted = _archs(args.arch, chosen)
    plan, rows = _plan(chosen, wanted)
    bad = bool(rows)
    if not plan and not bad:
        raise SystemExit("fa-variants build: nothing to compile for these variants and archs")
    units = list(dict.fromkeys(unit for _, unit in plan))
    results = {}
    if units:
        version = _check_nvrtc()
        workers = 1 if args.jobs == 1 else min(args.jobs, len(units))
        progress(f"NVRTC {'.'.join(map(str, version))}: compiling {len(units)} kernel instances in "
                 f"{workers} process{'es' if workers > 1 else ''}")
        results = compile_all(units, args.jobs)
    for unit in units:                                  # each failure's log once, under the progress
        res = results[unit]
        if isinstance(res, BaseException):
            text = str(res)
            print(text if args.verbose or not isinstance(res, jit.CompileError) else text[:LOG_LIMIT], file=sys.stderr)
    for name, unit in plan:
        res = results[unit]
        if isinstance(res, BaseException):
            bad = True
            rows.append([name, unit.expr, unit.arch, "", "", "", f"error: {err_text(res, 200)}"])
            continue
        reports = [r for r in res[0] if r.kernel == unit.expr] or res[0]
        if not reports:
            bad = True
            rows.append([name, unit.expr, unit.arch, "", "", "", "error: no ptxas report in the NVRTC log"])
            continue
        for r in reports:
            spill = r.spill_stores + r.spill_loads
            bad |= spill > 0
            rows.append([name, r.kernel, unit.arch, str(r.registers), str(r.shared_bytes),
                         f"{r.spill_stores}/{r.spill_loads}", "SPILLS" if spill else "ok"])
    print(tabulate(rows, headers=["variant", "kernel instance", "arch", "registers", "static smem (B)",
                                  "spill st/ld (B)", "status"], tablefmt="github", disable_numparse=True))
    if bad:
        print("build FAILED: a launcher did not import, a kernel did not compile, or a kernel spills registers",
              file=sys.stderr)
    return 1 if bad else 0


def _plan(chosen: list[Variant], wanted: list[str] | None) -> tuple[list[tuple[str, Unit]], list[list[str]]]:
    """([(variant, unit)] in the table's order, error rows of launchers whose unit list does not build)."""
    plan, rows = [], []
    for entry in chosen:
        try:
            launcher = entry.launcher
            launcher.compile_units()  # a launcher whose unit list fails to build is reported here
        except Exception as e:  # noqa: BLE001 - a launcher that does not import is a build failure, reported
            rows.append([entry.name, f"(launcher {entry.launcher!r})", "", "", "", "", f"error: {err_text(e)}"])
            continue
        archs = [a for a in entry.archs if wanted is None or a in wanted]
        if not archs:
            progress(f"{entry.name}: none of its archs {list(entry.archs)} was asked for; skipped")
        plan += [(entry.name, Unit(source, expr, a)) for a in archs
                 for source, exprs in launcher.compile_units(a).items() for expr in exprs]
    if len(chosen) == len(VARIANTS):   # everything: the decoding step's kernels too
        plan += [(name, Unit(source, expr, a)) for name, (units, archs) in STEP_KERNELS.items()
                 for a in archs if wanted is None or a in wanted for source, exprs in units(a).items()
                 for expr in exprs]
    return plan, rows


def _archs(text: str | None, chosen: list[Variant]) -> list[str] | None:
    """The archs --arch asks for, normalized; sm_X means sm_Xa where the variants are built only for sm_Xa
    (Hopper: sm_90 -> sm_90a, said on stderr). An arch that selects no chosen variant ends the command."""
    if not text:
        return None
    try:
        asked = [jit.normalize_arch(a) for a in text.split(",") if a.strip()]
    except ValueError as e:
        raise SystemExit(f"fa-variants build: {e}") from None
    if not asked:
        raise SystemExit(f"fa-variants build: --arch names no arch: {text!r}")
    known = {a for e in chosen for a in e.archs}
    wanted = []
    for a in asked:
        if a not in known and a + "a" in known:
            progress(f"fa-variants build: {a} means {a}a here: the {a[3:]} kernels are compiled for the "
                     f"arch-specific target {a}a (Hopper's wgmma and register reallocation exist only there)")
            a += "a"
        if a not in wanted:
            wanted.append(a)
    none = [a for a in wanted if a not in known]
    if none:
        have = sorted(known, key=lambda s: (len(s), s))
        raise SystemExit(f"fa-variants build: {', '.join(none)} selects no kernel of "
                         f"{', '.join(e.name for e in chosen)}: they are built for {', '.join(have)}")
    return wanted


def _check_nvrtc() -> tuple[int, int]:
    try:
        return jit.nvrtc_version()
    except ImportError as e:
        raise SystemExit(f"fa-variants build: NVRTC is not available ({err_text(e)}); {INSTALL_HINT}") from None
    except Exception as e:  # noqa: BLE001 - CuPy present but its NVRTC library missing
        raise SystemExit(f"fa-variants build: NVRTC is not usable ({err_text(e)}); {INSTALL_HINT}") from None
