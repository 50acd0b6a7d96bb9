"""Device memory a call takes: the peak of CuPy's memory pool during a block (``compare``'s "extra mem" column and
bench/recompute.py's memory model)."""
from __future__ import annotations

class PeakMemory:
    """Peak bytes held in CuPy's memory pool during a ``with`` block, above what was held when it started.

    ``with PeakMemory() as pm: out = f(...)``; then ``pm.peak`` (bytes). Counts pool allocations only
    (not cuBLAS workspaces or other libraries' own cudaMalloc)."""

    def __enter__(self):
        from cupy.cuda import memory_hook

        outer = self

        class _Hook(memory_hook.MemoryHook):
            name = "fa_variants_peak"

            def malloc_postprocess(self, **kw):
                outer.live += kw["mem_size"]
                outer.peak = max(outer.peak, outer.live)

            def free_postprocess(self, **kw):
                outer.live -= kw["mem_size"]

        self.live = self.peak = 0
        self._hook = _Hook()
        self._hook.__enter__()
        return self

    def __exit__(self, *exc):
        self._hook.__exit__(*exc)
        return False


def nbytes_rounded(*arrays) -> int:
    """Bytes of arrays as CuPy's pool allocates them (rounded up to 512)."""
    return sum(-(-a.nbytes // 512) * 512 for a in arrays if a is not None)

