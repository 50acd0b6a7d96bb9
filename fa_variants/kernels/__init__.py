"""One launcher per variant. Each module defines:

    SOURCE                      the .cu file in cuda_src/
    specializations()           every template instance `fa-variants build` compiles (name expressions)
    tiles(head_dim)             (block_q, block_k) the kernel uses: what the IO model is evaluated with
    forward(q, k, v, *, causal, softmax_scale, return_lse) -> (out, lse or None)
                                on validated CuPy arrays, on the current stream
    extra_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, itemsize)
                                device memory allocated beyond the output and the LSE
"""
