"""PLACEHOLDER: being written."""
def forward(q, k, v, *, causal=False, softmax_scale=None, **blocks):
    raise NotImplementedError
