"""The one GPU probe: can CuPy reach a CUDA device here, and which compute capability does it have?

The registry, the launchers, the CLI, the tests and the benchmarks all ask this module, so that "is there a
GPU" has one answer (and one reason when there is none) everywhere.
"""
from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class Probe:
    cc: int | None      # compute capability of the current device as an int (90), None when there is none
    reason: str         # '' when a device is usable, else why not (one line)
    name: str = ""      # the device's name, when there is one

    @property
    def ok(self) -> bool:
        return self.cc is not None


@functools.lru_cache(maxsize=None)
def _probe(device_id: int | None) -> Probe:
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - any import failure means "no CuPy"
        return Probe(None, f"CuPy is not importable ({type(e).__name__}: {e}); install fa-variants[cuda12] or [cuda13]")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return Probe(None, "no CUDA device")
        dev = cupy.cuda.Device() if device_id is None else cupy.cuda.Device(device_id)
        name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"]
        return Probe(int(dev.compute_capability), "", name.decode() if isinstance(name, bytes) else str(name))
    except Exception as e:  # noqa: BLE001 - no driver, no device
        return Probe(None, f"no usable CUDA driver/device ({type(e).__name__})")


def probe(device_id: int | None = None) -> Probe:
    """What this machine offers (the current CuPy device, or ``device_id``); computed once per device."""
    return _probe(device_id)


def available() -> bool:
    return probe().ok


def reason() -> str:
    """'' when a CUDA device is usable, else why not."""
    return probe().reason


def compute_capability() -> int | None:
    return probe().cc
