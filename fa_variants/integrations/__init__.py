"""Framework integrations that need more than DLPack: autograd (``torch``) and transformers' attention registry
(``transformers``). Each module imports its framework,
so it is imported only when that framework's arrays come in (``api.attention`` imports ``torch`` for tensors
that require grad); JAX's custom VJP is ``fa_variants.jax``."""
