"""The machine code (SASS) of a cubin, read by cuobjdump: no GPU needed. Serves the Hopper kernels' instruction
checks (tests/test_sass.py), bench/sass_diff.py (the same kernels in two trees, instruction for instruction) and
bench/sass_loops.py (a kernel's loops and what they issue).
cuobjdump comes with the ``test`` extra (nvidia-cuda-cuobjdump; it calls nvdisasm, which comes beside it), or with a
CUDA toolkit on PATH."""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

# an instruction line of cuobjdump --dump-sass: /*address*/ [predicate] OPCODE operands ;
_INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+((?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*);")


@functools.lru_cache(maxsize=1)
def cuobjdump() -> str | None:
    """cuobjdump on PATH, or the one the nvidia-cuda-cuobjdump wheel puts in site-packages/nvidia/cu*/bin."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for exe in sorted(Path(root).glob("cu*/bin/cuobjdump")):
            return str(exe)
    return None


# where a CUDA toolkit puts cuobjdump when it is installed but not on PATH
_TOOLKIT_HOME_VARS = ("CUDA_HOME", "CUDA_PATH")
_TOOLKIT_DEFAULT = "/usr/local/cuda"
_GET_IT = ('the test extra installs it: pip install -e ".[test]" (or pip install nvidia-cuda-cuobjdump '
           'nvidia-cuda-nvdisasm)')


def cuobjdump_missing() -> str:
    """'' when ``cuobjdump()`` finds cuobjdump, else the reason in words and how to get it (a skipped SASS test says
    this): not on PATH and no nvidia-cuda-cuobjdump wheel; or a toolkit's copy that is not on PATH."""
    if cuobjdump() is not None:
        return ""
    homes = [os.environ[v] for v in _TOOLKIT_HOME_VARS if os.environ.get(v)] + [_TOOLKIT_DEFAULT]
    for home in homes:
        exe = Path(home) / "bin" / "cuobjdump"
        if exe.is_file() and os.access(exe, os.X_OK):
            return (f"cuobjdump is not on PATH (a CUDA toolkit's is at {exe}: add {exe.parent} to PATH), and the "
                    f"nvidia-cuda-cuobjdump wheel is not installed; {_GET_IT}")
    return f"cuobjdump is not installed: not on PATH, and no nvidia-cuda-cuobjdump wheel; {_GET_IT}"


def _dump(cubin: Path) -> str:
    exe = cuobjdump()
    if exe is None:
        raise RuntimeError(cuobjdump_missing())
    env = dict(os.environ, PATH=f"{Path(exe).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run([exe, "--dump-sass", str(cubin)], capture_output=True, text=True, check=True,
                          env=env).stdout


def instructions_by_function(cubin: Path) -> dict[str, list[tuple[str, str]]]:
    """{mangled name: [(opcode, instruction text)]} of every function in a cubin."""
    out = {}
    for block in _dump(cubin).split("Function : ")[1:]:
        name, _, body = block.partition("\n")
        out[name.strip()] = [(m.group(2), m.group(1).strip()) for m in map(_INSTRUCTION.match, body.splitlines())
                             if m]
    return out


def sass_by_function(cubin: Path) -> dict[str, list[str]]:
    """{mangled name: opcodes} of every function in a cubin."""
    return {name: [op for op, _ in ins] for name, ins in instructions_by_function(cubin).items()}


def comparable(text: str) -> str:
    """An instruction with its immediates and addresses masked (branch targets and constant offsets move when
    code before them changes length; the instruction stays the same)."""
    return re.sub(r"0x[0-9a-f]+", "X", text)


def loops(instructions: list[str]) -> list[tuple[int, int]]:
    """The loops of one function, as (first, last) instruction indices: the span of each backward branch, innermost
    and outermost alike (a SASS instruction is 16 bytes, so a branch target's address is an index)."""
    out = []
    for i, text in enumerate(instructions):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) // 16 < i:
            out.append((int(m.group(1), 16) // 16, i))
    return out
