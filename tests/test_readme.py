"""README.md works as written: every fenced code block in it is run, or checked, by a test here.

Python blocks run in this process, each in a fresh namespace (so each carries its own imports), with README.md's
line numbers in their tracebacks:

* a block that imports CuPy works on GPU arrays: it runs in a ``gpu``-marked test (skipped without a GPU);
* a block that imports torch, jax or transformers skips when that library is missing;
* every other block runs on the CPU. No block may need the network (CI has none): the transformers block builds a
  tiny random model from a config instead of downloading one.

Shell blocks: each command (a line, or each part of one joined by ``&&``, ``||``, ``;``) is one test case, treated by
what it is (``command_kind``):

* ``fa-variants ...`` runs in-process through the CLI's ``main`` and must exit 0 and print something. Without a GPU
  ``compare`` runs the NumPy models at a CPU-sized shape. ``profile`` needs a GPU and Nsight Compute (``gpu``-marked).
* Commands too costly to run here are checked for what they name, not run: ``pip install -e ".[extras]"`` (an
  install: the extras must exist in pyproject.toml), ``pytest`` (the whole suite, which holds this test: its test
  paths must hold this file), ``pytest bench ...`` (GPU benchmarks of minutes: the suite and its options must exist)
  and ``python bench/SCRIPT ...`` (GPU runs of minutes, or files a GPU run writes: the script must exist, its
  ``--help`` must exit 0 and list every option the README gives it).
* A command of any other kind fails: teach ``command_kind`` about it.

Relative links in README.md and docs/ must point to files that exist, and an anchor to a heading of that page.
"""
from __future__ import annotations

import ast
import inspect
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PYPROJECT = ROOT / "pyproject.toml"
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.S | re.M)
SHELL = ("bash", "sh", "shell", "console")
OPTIONAL_LIBRARIES = ("torch", "jax", "transformers")   # importorskip'd where a block imports them
SEPARATORS = ("&&", "||", ";", "|")


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int            # README.md line of the block's first line of code

    @property
    def where(self) -> str:
        return f"README.md:{self.line}"


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    where: str

    def __str__(self) -> str:
        return shlex.join(self.argv)


def fenced_blocks(text: str) -> list[Block]:
    return [Block(m.group(1).lower(), m.group(2), text.count("\n", 0, m.start()) + 2) for m in FENCE.finditer(text)]


def commands_in(block: Block) -> list[Command]:
    """Every command of a shell block, comments dropped, split at the shell's separators."""
    found = []
    for i, line in enumerate(block.code.splitlines()):
        words, argv = shlex.split(line, comments=True), []
        for word in words + [SEPARATORS[0]]:
            if word in SEPARATORS:
                if argv:
                    found.append(Command(tuple(argv), f"README.md:{block.line + i}"))
                argv = []
            else:
                argv.append(word)
    return found


def imported_modules(code: str) -> set[str]:
    """The top-level names of every module a block imports."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def command_kind(cmd: Command) -> str:
    argv = cmd.argv
    if argv[0] == "fa-variants":
        return "cli on gpu" if argv[1:2] == ("profile",) else "cli"
    if argv[:2] == ("pip", "install"):
        return "pip install"
    if argv[0] == "pytest":
        return "pytest bench" if argv[1:2] == ("bench",) else "pytest"
    if argv[0] in ("python", "python3") and len(argv) > 1 and argv[1].startswith("bench/"):
        return "bench script"
    return "unknown"


BLOCKS = fenced_blocks(README.read_text())
PYTHON_BLOCKS = [b for b in BLOCKS if b.lang == "python"]
COMMANDS = [c for b in BLOCKS if b.lang in SHELL for c in commands_in(b)]


# ------------------------------------------------------------------------------------------------ the blocks
def test_every_block_is_python_or_shell():
    other = [f"{b.where} ({b.lang or 'no language'})" for b in BLOCKS if b.lang != "python" and b.lang not in SHELL]
    assert not other, f"fenced blocks this file cannot run: {other}; give each a python or bash fence"


def test_the_quick_start_covers_every_front_end():
    """CuPy, NumPy, torch, JAX and transformers each have a block (the README's promise to a new user)."""
    seen = set().union(*(imported_modules(b.code) for b in PYTHON_BLOCKS))
    missing = {"cupy", "numpy", "torch", "jax", "transformers"} - seen
    assert not missing, f"README.md's quick start has no block importing {sorted(missing)}"


def _run_python(block: Block) -> None:
    for name in sorted(imported_modules(block.code) & set(OPTIONAL_LIBRARIES)):
        pytest.importorskip(name)
    padded = "\n" * (block.line - 1) + block.code      # tracebacks then name README.md's own line numbers
    exec(compile(padded, str(README), "exec"), {"__name__": "__readme__"})


def _python_cases(on_gpu: bool):
    return [pytest.param(b, id=b.where) for b in PYTHON_BLOCKS if ("cupy" in imported_modules(b.code)) == on_gpu]


@pytest.mark.parametrize("block", _python_cases(on_gpu=False))
def test_python_block_runs(block):
    _run_python(block)


@pytest.mark.gpu
@pytest.mark.parametrize("block", _python_cases(on_gpu=True))
def test_python_block_runs_on_the_gpu(block):
    _run_python(block)


# ------------------------------------------------------------------------------------------------ the commands
def _run_cli(cmd: Command, capsys) -> None:
    from fa_variants.cli import main
    try:
        rc = main(list(cmd.argv[1:]))
    except SystemExit as e:             # argparse's own exits, and a command that exits with a message
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code)
    out, err = capsys.readouterr()
    assert rc == 0, f"{cmd.where}: `{cmd}` exited {rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
    assert out.strip(), f"{cmd.where}: `{cmd}` printed nothing"


def _run_cli_on_gpu(cmd: Command, capsys) -> None:
    from fa_variants.profile import find_ncu
    if find_ncu() is None:
        pytest.skip("`fa-variants profile` needs Nsight Compute's ncu")
    _run_cli(cmd, capsys)


def _extras_in_pyproject() -> set[str]:
    """The keys of pyproject.toml's [project.optional-dependencies] (read without tomllib: Python 3.10 has none)."""
    section = PYPROJECT.read_text().split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+)\s*=", section, re.M))


def _check_pip_install(cmd: Command, capsys) -> None:
    targets = [a for a in cmd.argv[2:] if not a.startswith("-")]
    assert targets, f"{cmd.where}: `{cmd}` installs nothing"
    for target in targets:
        path, _, extras = re.fullmatch(r"([^\[]+)(\[([\w,-]+)\])?", target).group(1, 2, 3)
        assert (ROOT / path / "pyproject.toml").is_file(), f"{cmd.where}: `{cmd}`: {path} is not this project"
        unknown = set((extras or "").split(",")) - {""} - _extras_in_pyproject()
        assert not unknown, f"{cmd.where}: `{cmd}` names extras pyproject.toml lacks: {sorted(unknown)}"


def _check_test_command(cmd: Command, capsys) -> None:
    assert cmd.argv == ("pytest",), f"{cmd.where}: the test command is `pytest` alone, found `{cmd}`"
    paths = re.search(r"^testpaths\s*=\s*\[(.*?)\]", PYPROJECT.read_text(), re.M)
    assert paths, "pyproject.toml sets no testpaths: a plain `pytest` would also collect bench/"
    roots = [ROOT / p for p in re.findall(r"[\"']([^\"']+)[\"']", paths.group(1))]
    assert any(root in Path(__file__).resolve().parents for root in roots), f"{__file__} is outside {roots}"


def _check_pytest_bench(cmd: Command, capsys) -> None:
    assert (ROOT / "bench" / "test_bench.py").is_file() and (ROOT / "bench" / "conftest.py").is_file()
    plugin = pytest.importorskip("pytest_benchmark.plugin")
    registered = inspect.getsource(plugin) + (ROOT / "bench" / "conftest.py").read_text()
    for option in (a.split("=")[0] for a in cmd.argv[2:] if a.startswith("--")):
        quoted = re.compile(f"[\"']{re.escape(option)}[\"']")
        assert quoted.search(registered), f"{cmd.where}: `{cmd}`: no plugin registers {option}"


def _check_bench_script(cmd: Command, capsys) -> None:
    script = ROOT / cmd.argv[1]
    assert script.is_file(), f"{cmd.where}: `{cmd}`: {cmd.argv[1]} does not exist"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"{cmd.where}: `{cmd.argv[1]} --help` exited {done.returncode}\n{done.stderr[-3000:]}"
    for option in (a.split("=")[0] for a in cmd.argv[2:] if a.startswith("-")):
        assert option in done.stdout, f"{cmd.where}: `{cmd}`: {cmd.argv[1]} has no option {option}"


def _unknown(cmd: Command, capsys) -> None:
    pytest.fail(f"{cmd.where}: `{cmd}` is a kind of command this file neither runs nor checks: see command_kind")


TREATMENT = {"cli": _run_cli, "cli on gpu": _run_cli_on_gpu, "pip install": _check_pip_install,
             "pytest": _check_test_command, "pytest bench": _check_pytest_bench, "bench script": _check_bench_script,
             "unknown": _unknown}


def test_readme_shows_commands():
    kinds = {command_kind(c) for c in COMMANDS}
    assert {"cli", "pip install", "pytest"} <= kinds, f"README.md lost its set-up commands: {sorted(kinds)}"


@pytest.mark.parametrize("cmd", [
    pytest.param(c, id=str(c), marks=[pytest.mark.gpu] if command_kind(c) == "cli on gpu" else [])
    for c in COMMANDS])
def test_readme_command(cmd, capsys):
    TREATMENT[command_kind(cmd)](cmd, capsys)


# ------------------------------------------------------------------------------------------------ the links
LINK = re.compile(r"\]\(([^)\s]+)\)")
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.*?)\s*$", FENCE.sub("", text), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z][a-z+.-]*:", target):       # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text()):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"
