"""One launcher per variant. Each module defines:

    SOURCE                      the .cu file in cuda_src/
    specializations()           every template instance of SOURCE that `fa-variants build` compiles
    SOURCES (optional)          {source: instances} when the variant needs more than one .cu (fa2_fp8's quantizer)
    SOURCE_ARCHS (optional)     {source: archs} for a source that only some archs can compile (wgmma: sm_90a)
    tiles(head_dim)             (block_q, block_k) the kernel uses: what the IO model is evaluated with
    forward(q, k, v, *, causal, softmax_scale, return_lse) -> (out, lse or None)
                                on validated CuPy arrays, on the current stream
    extra_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, itemsize)
                                device memory allocated beyond the output and the LSE
"""


def compile_units(mod, arch: str | None = None) -> dict:
    """{source file: template instances} that make up a launcher for ``arch`` (all archs when None): what `build`
    and the tests compile."""
    units = {mod.SOURCE: tuple(mod.specializations())}
    for source, exprs in getattr(mod, "SOURCES", {}).items():
        units[source] = units.get(source, ()) + tuple(exprs)
    only = getattr(mod, "SOURCE_ARCHS", {})
    return {s: e for s, e in units.items() if arch is None or s not in only or arch in only[s]}
