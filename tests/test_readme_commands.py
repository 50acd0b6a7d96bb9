"""Every ``fa-variants ...`` command README.md shows runs, as written, and exits 0 on this machine.

The commands come from README.md's shell code blocks (``pip install ... && fa-variants compare`` counts as
``fa-variants compare``) and from its inline code spans that are whole commands (no ``<placeholder>``, no
``...``). They run in-process through ``cli.main``. Only ``fa-variants profile`` needs a GPU (and ncu), and is
skipped without one: without a GPU, ``compare`` runs the NumPy models at a CPU-sized shape and ``build`` needs
only NVRTC. On a machine with a GPU the same commands take their GPU paths.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from fa_variants import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHELL_FENCES = ("", "bash", "sh", "shell", "console")
# Compiles every kernel for every arch: minutes. .ci/run runs exactly this command on every CI run (before
# pytest), so the test skips it; test_build_of_the_readme_archs_for_one_variant checks the same archs quickly.
RUN_BY_CI = "fa-variants build --arch 80,86,89,90a"


def _commands_in(line: str) -> list[str]:
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []
    cmds, cur = [], []
    for w in words + ["&&"]:
        if w in ("&&", "||", ";", "|"):
            if cur and cur[0] == "fa-variants":
                cmds.append(shlex.join(cur))
            cur = []
        else:
            cur.append(w)
    return cmds


def readme_commands() -> list[tuple[str, str]]:
    """(command, where in README.md) for every distinct fa-variants command, in order of appearance."""
    text = README.read_text()
    found: dict[str, str] = {}
    for m in re.finditer(r"^```([\w-]*)[^\n]*\n(.*?)^```", text, re.S | re.M):
        if m.group(1).lower() not in SHELL_FENCES:
            continue
        first = text.count("\n", 0, m.start()) + 2
        for i, line in enumerate(m.group(2).splitlines()):
            for cmd in _commands_in(line):
                found.setdefault(cmd, f"README.md:{first + i} (code block)")
    for m in re.finditer(r"(?<!`)`(fa-variants[^`\n]*)`(?!`)", text):
        span = m.group(1)
        if "<" in span or "..." in span or "[" in span:
            continue
        for cmd in _commands_in(span):
            found.setdefault(cmd, f"README.md:{text.count(chr(10), 0, m.start()) + 1} (inline)")
    return list(found.items())


COMMANDS = readme_commands()


def test_readme_shows_commands():
    cmds = [c for c, _ in COMMANDS]
    assert "fa-variants compare" in cmds and len(cmds) >= 5, cmds
    assert RUN_BY_CI in cmds, "README no longer shows the build command that .ci/run runs: update RUN_BY_CI"


@pytest.mark.parametrize("cmd, where", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_readme_command_runs(cmd, where, capsys):
    if cmd == RUN_BY_CI:
        pytest.skip(".ci/run runs this full build (every kernel, every arch) itself")
    if cmd.startswith("fa-variants profile"):   # the one command that needs a GPU (and Nsight Compute)
        from fa_variants import gpu, profile
        if not gpu.available() or profile.find_ncu() is None:
            pytest.skip("`fa-variants profile` needs a CUDA GPU and ncu")
    argv = shlex.split(cmd)[1:]
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = 1 if isinstance(e.code, str) else (e.code or 0)
        if isinstance(e.code, str):
            print(e.code)
    out, err = capsys.readouterr()
    assert rc == 0, f"{where}: `{cmd}` exited {rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
    assert out.strip(), f"{where}: `{cmd}` printed nothing"


def test_build_of_the_readme_archs_for_one_variant(capsys):
    """RUN_BY_CI narrowed to one variant (the narrowing is this test's, README does not show it)."""
    rc = cli.main(shlex.split(RUN_BY_CI)[1:] + ["--variants", "naive"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for arch in ("sm_80", "sm_86", "sm_89", "sm_90a"):
        assert f"| {arch}" in out, out
