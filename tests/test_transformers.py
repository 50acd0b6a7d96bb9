"""fa_variants as a transformers attention implementation (fa_variants/integrations/transformers.py).

A tiny randomly initialised Llama (hidden 64, 2 layers, 4 heads over 2 kv heads: GQA, head dim 16, vocab 128)
run with ``attn_implementation="sdpa"`` and with ours, on the same weights and inputs:

* CPU (every test not marked gpu): ours on ``backend="numpy"`` (fa2's NumPy models, forward and backward), the
  model in bfloat16, the dtype the kernels take, so nothing is cast and the q/k/v views go in as transformers
  makes them; sdpa runs the same bfloat16 model. Logits and every parameter's gradient after one training step
  agree within a relative-norm bound, greedy generation gives the same token ids, and a continuation from a KV
  cache (seqlen_q < seqlen_k: bottom-right causal) gives the full forward's logits. A float32 model runs too:
  ours casts q/k/v to bfloat16 and the output back (the one test of that path). Masks, dropout, windows and the
  rest raise ``Unsupported``.
* GPU (marked gpu): the same model in bfloat16 on CUDA with ``backend="auto"`` (fa2's kernels): logits and
  generation, and one training step through fa2's GPU backward.

Seeds are fixed (weights and token ids): greedy decoding compares argmaxes, and a random draw could put two
logits within a rounding of each other; the test reports the smallest top-1 margin if it fails.
"""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.masking_utils")
if not hasattr(transformers, "AttentionInterface") or not hasattr(transformers, "AttentionMaskInterface"):
    pytest.skip("transformers without AttentionInterface/AttentionMaskInterface", allow_module_level=True)

import fa_variants as fav  # noqa: E402
from conftest import TOL  # noqa: E402
from fa_variants.integrations import transformers as fat  # noqa: E402

CPU_IMPL = fat.register("fa_variants_numpy", variant="fa2", backend="numpy")
GPU_IMPL = fat.register("fa_variants", variant="fa2")   # backend auto: the kernels on CUDA tensors

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64,
              initializer_range=0.1)
SEQ = 24
LOGITS_TOL = 2e-2   # relative norm, bf16 model vs bf16 model (measured 9.0e-3 here)
GRAD_TOL = 5e-2     # per parameter, relative norm (measured at most 1.7e-2 here)


def make_model(impl: str = "sdpa", dtype=torch.bfloat16, device="cpu", **overrides):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**CONFIG, **overrides})
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    if impl != "sdpa":
        model.set_attn_implementation(impl)
    return model


def with_impl(model, impl: str):
    """A copy of ``model`` (same weights) that runs ``impl``."""
    other = copy.deepcopy(model)
    other.set_attn_implementation(impl)
    assert other.config._attn_implementation == impl
    return other


def token_ids(batch=2, n=SEQ, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG["vocab_size"], (batch, n), generator=g).to(device)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.fixture
def calls(monkeypatch):
    """Every fav.attention call the integration makes: proof that ours ran, and with what."""
    seen = []
    real = fat.api.attention

    def spy(q, k, v, **kw):
        seen.append(dict(q=tuple(q.shape), k=tuple(k.shape), q_stride=q.stride(), k_stride=k.stride(),
                         dtype=q.dtype, grad=q.requires_grad, tensors=(q, k, v), **kw))
        return real(q, k, v, **kw)

    class Api:  # fa_variants.api as the integration module sees it (the torch custom op keeps the real one)
        def __getattr__(self, name):
            return getattr(fat_api, name)

    fat_api = fat.api
    api = Api()
    api.attention = spy
    monkeypatch.setattr(fat, "api", api)
    return seen


# ------------------------------------------------------------------------------------------------ CPU tests
def test_logits_match_sdpa(calls):
    ref = make_model()
    ours = with_impl(ref, CPU_IMPL)
    ids = token_ids()
    with torch.no_grad():
        want, got = ref(ids).logits, ours(ids).logits
        want32 = make_model(dtype=torch.float32)(ids).logits   # the same weights in float32
    assert got.dtype == torch.bfloat16 and got.shape == (2, SEQ, CONFIG["vocab_size"])
    assert rel(got, want) < LOGITS_TOL
    # ours is as close to the float32 model as sdpa's bf16 run is (both are bf16 models)
    assert rel(got, want32) < 1.5 * rel(want, want32) + 1e-3
    # one call per layer; GQA as 2 kv heads (no repeat_kv); k, v are (B, H, N, d) buffers seen as (B, N, H, d)
    # (q's buffer is already (B, N, H, d): the rotary embedding keeps q_proj's layout)
    assert len(calls) == CONFIG["num_hidden_layers"]
    for c in calls:
        assert c["q"] == (2, SEQ, 4, 16) and c["k"] == (2, SEQ, 2, 16)
        assert c["q_stride"] == (4 * SEQ * 16, 4 * 16, 16, 1) and c["k_stride"] == (2 * SEQ * 16, 16, SEQ * 16, 1)
        assert c["causal"] is True and c["softmax_scale"] == 16 ** -0.5 and c["dtype"] == torch.bfloat16
        assert c["backend"] == "numpy" and c["variant"] == "fa2"


def test_float32_model_runs_in_bfloat16(calls):
    ref = make_model(dtype=torch.float32)
    ours = with_impl(ref, CPU_IMPL)
    ids = token_ids()
    with torch.no_grad():
        want, got = ref(ids).logits, ours(ids).logits
    assert got.dtype == torch.float32
    assert rel(got, want) < 1e-2   # attention rounded to bf16 once per layer (measured 3.8e-3)
    assert calls and all(c["dtype"] == torch.bfloat16 for c in calls)


def _train_step_grads(model, ids, labels=None, **inputs):
    """One training step's loss and gradients (labels: ids by default; inputs: attention_mask, position_ids)."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids if labels is None else labels, **inputs).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _routers(model) -> list:
    """The mixture-of-experts routers of ``model`` (gpt-oss's), in call order; none in a dense model."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def with_ref_routes(ref_run, ours_run, ref, ours):
    """(ref_run(), ours_run()), where each router of ``ours`` chooses the experts that ``ref``'s chose in the same
    call (its weights still the softmax of its own logits at those experts). A top-k choice is discontinuous:
    outputs that differ at bfloat16's rounding can send a token to another expert, and one such token moves a
    tiny gpt-oss's logits by about 0.07 (relative norm), three times LOGITS_TOL (docs/masks.md). With the experts
    pinned, what remains is what attention changed. A dense model runs as it is."""
    chosen, hooks = [], []
    try:
        hooks = [r.register_forward_hook(lambda m, i, out: chosen.append(out[-1].detach())) for r in _routers(ref)]
        want = ref_run()
    finally:
        for h in hooks:
            h.remove()
    calls = iter(chosen)

    def pin(m, i, out):
        logits, idx = out[0], next(calls)
        return logits, torch.softmax(logits.gather(-1, idx), dim=1, dtype=logits.dtype), idx

    hooks = [r.register_forward_hook(pin) for r in _routers(ours)]
    try:
        got = ours_run()
    finally:
        for h in hooks:
            h.remove()
    return want, got


def assert_step_matches(ref, ours, ids, **inputs):
    """The loss within 1 % of sdpa's, every parameter's gradient within GRAD_TOL (ours' experts chosen as ref's:
    with_ref_routes)."""
    (loss_ref, g_ref), (loss, g) = with_ref_routes(lambda: _train_step_grads(ref, ids, **inputs),
                                                   lambda: _train_step_grads(ours, ids, **inputs), ref, ours)
    assert abs(float(loss) - float(loss_ref)) < 1e-2 * abs(float(loss_ref))
    errs = {name: rel(g[name], g_ref[name]) for name in g_ref if g_ref[name] is not None}
    assert len(errs) == len(list(ref.parameters())), "a parameter got no gradient"
    worst = max(errs, key=errs.get)
    assert errs[worst] < GRAD_TOL, f"{worst}: {errs[worst]:.3g}"


def test_training_step_gradients_match_sdpa(calls):
    ref = make_model()
    ours = with_impl(ref, CPU_IMPL)
    assert_step_matches(ref, ours, token_ids())
    assert calls and all(c["grad"] for c in calls)   # the autograd path of fav.attention ran


def _top1_margin(logits):
    top = logits.float().topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


def test_greedy_generation_matches_sdpa(calls):
    ref = make_model()
    ours = with_impl(ref, CPU_IMPL)
    prompt = token_ids(n=16)
    mask = torch.ones_like(prompt)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, min_new_tokens=8,
              pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    want = ref.generate(prompt, **kw)
    got = ours.generate(prompt, **kw)
    margin = min(_top1_margin(s) for s in want.scores)
    assert torch.equal(got.sequences, want.sequences), f"smallest top-1 logit margin of sdpa's run: {margin:.3g}"
    assert got.sequences.shape == (2, 16 + 8)
    # the prefill is causal; each decoding step is one query row against the cache (bottom-right causal = none)
    per_layer = calls[::CONFIG["num_hidden_layers"]]
    assert per_layer[0]["q"][1] == 16 and per_layer[0]["causal"] is True
    assert [c["k"][1] for c in per_layer[1:]] == list(range(17, 24))
    assert all(c["q"][1] == 1 and c["causal"] is False for c in per_layer[1:])


AUTO_CPU_IMPL = fat.register("fa_variants_auto_numpy", variant="auto", backend="numpy")
AUTO_IMPL = fat.register("fa_variants_auto")   # variant and backend auto: the kernels on CUDA tensors
TIE = 2   # greedy choices may part where the two best logits lie within TIE roundings (eps * the row's largest)


@pytest.fixture
def decode_calls(monkeypatch):
    """Every fav.attention_with_kvcache call the integration makes."""
    seen = []
    real = fat.decode.attention_with_kvcache

    def spy(q, k_cache, v_cache, **kw):
        seen.append(dict(q=tuple(q.shape), k_cache=tuple(k_cache.shape), **kw))
        return real(q, k_cache, v_cache, **kw)

    class Decode:
        attention_with_kvcache = staticmethod(spy)
    monkeypatch.setattr(fat, "decode", Decode)
    return seen


def assert_same_greedy(want, got, prompt_len: int, dtype=torch.bfloat16) -> None:
    """got's tokens are want's (sdpa's), row by row, or part from them first at a step where both runs' two best
    logits lie within TIE roundings (of the model's dtype) of each other: a tie that the last bit of any attention
    breaks its own way."""
    for r in range(want.sequences.shape[0]):
        parted = (want.sequences[r] != got.sequences[r]).nonzero()
        if len(parted) == 0:
            continue
        col = int(parted[0])
        step, a, b = col - prompt_len, int(want.sequences[r, col]), int(got.sequences[r, col])
        sw, sg = want.scores[step][r].float(), got.scores[step][r].float()
        eps = torch.finfo(dtype).eps * float(sw[sw.isfinite()].abs().max())   # the model's dtype, the row's scale
        gaps = float(sw[a] - sw[b]) / eps, float(sg[b] - sg[a]) / eps
        assert max(gaps) <= TIE, (f"row {r} parts from sdpa at new token {step}: {b} for {a}, logit gaps "
                                  f"{gaps[0]:.2f} (sdpa) and {gaps[1]:.2f} (ours) roundings: not a tie")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("batch", [1, 4])
def test_generation_through_kvcache_matches_sdpa(batch, cache, calls, decode_calls):
    """variant="auto": the prefill through attention(), each new token through attention_with_kvcache over the
    cache (a DynamicCache's tensors, or a StaticCache's slots with the tokens they hold), 64 greedy tokens."""
    ref = make_model(max_position_embeddings=128)
    ours = with_impl(ref, AUTO_CPU_IMPL)
    prompt = token_ids(batch=batch, n=SEQ, seed=batch)   # 24 tokens: a prefill, more than a decoding step
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=64, min_new_tokens=64, do_sample=False,
              pad_token_id=0, output_scores=True, return_dict_in_generate=True, cache_implementation=cache)
    want = ref.generate(prompt, **kw)
    got = ours.generate(prompt, **kw)
    assert got.sequences.shape == (batch, SEQ + 64)
    assert_same_greedy(want, got, SEQ)
    layers = CONFIG["num_hidden_layers"]
    steps = decode_calls[::layers]
    if cache == "dynamic":   # prefill: attention(); then one query against every token so far
        assert len(calls) == layers and calls[0]["q"][1] == SEQ
        assert [c["cache_seqlens"] for c in steps] == list(range(SEQ + 1, SEQ + 64))
        assert all(c["k_cache"][1] == c["cache_seqlens"] for c in steps)
    else:                    # every call: all the static cache's slots (the last token's is never written), the
        assert not calls and len(steps) == 64      # tokens in them as a tensor
        assert [c["cache_seqlens"].tolist() for c in steps] == [[n] * batch for n in range(SEQ, SEQ + 64)]
        assert all(c["k_cache"][1] == SEQ + 63 and c["cache_seqlens"].dtype == torch.int32 for c in steps)
    assert steps[0]["q"][1] == (SEQ if cache == "static" else 1) and all(c["q"][1] == 1 for c in steps[1:])


def test_static_cache_generation_under_torch_compile(monkeypatch):
    """generate() with a StaticCache and the model's forward compiled whole (fullgraph): attention_with_kvcache
    is one opaque op with the cache lengths as a tensor, so one graph serves every decoding step."""
    from fa_variants.reference import decode as decode_model
    runs = []   # the NumPy model's runs, inside the op's body (never traced: a list there would cost guards)
    real = decode_model.forward
    monkeypatch.setattr(decode_model, "forward", lambda *a, **kw: runs.append(1) or real(*a, **kw))
    ref = make_model(max_position_embeddings=128)
    ours = with_impl(ref, AUTO_CPU_IMPL)
    prompt = token_ids(batch=4, n=SEQ, seed=4)
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=64, min_new_tokens=64, do_sample=False,
              pad_token_id=0, output_scores=True, return_dict_in_generate=True, cache_implementation="static")
    want = ref.generate(prompt, **kw)
    torch._dynamo.reset()
    ours.forward = torch.compile(ours.forward, fullgraph=True)
    got = ours.generate(prompt, **kw)
    assert_same_greedy(want, got, SEQ)
    assert len(runs) == 64 * CONFIG["num_hidden_layers"], "not every step went through attention_with_kvcache"


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_continuation_from_kv_cache_is_bottom_right_causal(calls):
    """8 new tokens against a 16-token cache (seqlen_q 8 < seqlen_k 24) give the full forward's logits."""
    ours = make_model(CPU_IMPL)
    ids = token_ids()
    with torch.no_grad():
        full = ours(ids).logits
        cache = ours(ids[:, :16], use_cache=True).past_key_values
        calls.clear()
        tail = ours(ids[:, 16:], past_key_values=cache, use_cache=True).logits
    assert calls[0]["q"][1] == 8 and calls[0]["k"][1] == SEQ and calls[0]["causal"] is True
    assert rel(tail, full[:, 16:]) < 1e-2   # measured 0: the NumPy model computes each row alike


def test_padded_batch_matches_sdpa_on_real_tokens(calls):
    """A left-padded batch runs as a variable-length one (attention_varlen): logits on the real tokens as sdpa's;
    padded rows are not compared (sdpa gives them values of its own, ours zeros from attention)."""
    ref = make_model()
    ours = with_impl(ref, AUTO_CPU_IMPL)
    ids, mask = left_padded(pads=(0, 5, 11, 17))
    with torch.no_grad():
        want, got = ref(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    real = mask.bool()
    assert rel(got[real], want[real]) < LOGITS_TOL
    assert not calls   # every layer went through attention_varlen, none through attention()


def left_padded(pads, n=SEQ, seed=5):
    ids = token_ids(batch=len(pads), n=n, seed=seed)
    mask = torch.ones_like(ids)
    for b, p in enumerate(pads):
        mask[b, :p], ids[b, :p] = 0, 0
    return ids, mask


def padded_labels(ids, mask):
    """Labels of a left-padded batch for a training step: -100 on the pads, and on each row's first real token too,
    which the loss would otherwise predict from the last pad's logits. A pad's query sees no key, and what attention
    gives such a row is a convention, not a value (ours is zero, as flash-attn's), and the reference's sdpa keeps
    its own (docs/masks.md)."""
    first_real = mask.cumsum(dim=1) == 1
    return ids.masked_fill((mask == 0) | first_real, -100)


def test_padded_generation_matches_sdpa():
    """Four prompts of different lengths, left-padded, 64 new greedy tokens: the prefill and every step through
    attention_varlen over the unpadded tokens."""
    ref = make_model(max_position_embeddings=128)
    ours = with_impl(ref, AUTO_CPU_IMPL)
    ids, mask = left_padded(pads=(0, 5, 11, 17))
    kw = dict(attention_mask=mask, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0,
              output_scores=True, return_dict_in_generate=True)
    want = ref.generate(ids, **kw)
    got = ours.generate(ids, **kw)
    assert_same_greedy(want, got, SEQ)


def test_padded_training_step_matches_sdpa():
    """One training step on a left-padded batch (labels -100 on the pads): the loss and every parameter's
    gradient as sdpa's, through attention_varlen's autograd op."""
    ref = make_model()
    ours = with_impl(ref, AUTO_CPU_IMPL)
    ids, mask = left_padded(pads=(0, 7))
    assert_step_matches(ref, ours, ids, attention_mask=mask, labels=padded_labels(ids, mask))


def test_packed_training_step_matches_sdpa():
    """Sequences packed in rows (position_ids that restart at 0, as the packing collators make them): each row cut
    into a variable-length batch; logits, the loss and every gradient as sdpa's, which masks across sequences."""
    ref = make_model()
    ours = with_impl(ref, AUTO_CPU_IMPL)
    ids = token_ids()
    pos = torch.stack([torch.cat([torch.arange(7), torch.arange(12), torch.arange(5)]),
                       torch.cat([torch.arange(20), torch.arange(4)])])
    with torch.no_grad():
        want, got = ref(ids, position_ids=pos).logits, ours(ids, position_ids=pos).logits
        unpacked = ours(ids).logits
    assert rel(got, want) < LOGITS_TOL < rel(unpacked, want)   # the packing is what made them agree
    assert_step_matches(ref, ours, ids, position_ids=pos)


WINDOWED = {   # model, the implementation it is compared with, its masks, what turns them off
    "mistral": ("Mistral", "sdpa", dict(sliding_window=8), dict(sliding_window=None)),
    "gemma2": ("Gemma2", "eager", dict(sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=None,
                                       query_pre_attn_scalar=16), dict(sliding_window=4096)),  # no sdpa: softcap
    "gpt_oss": ("GptOss", "eager", dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                                        layer_types=["sliding_attention", "full_attention"]), dict(sinks=-1e4)),
}


def _windowed_model(name, device="cpu", **overrides):
    prefix, impl, masks, _ = WINDOWED[name]
    sinks = overrides.pop("sinks", None)
    torch.manual_seed(0)
    cfg = getattr(transformers, prefix + "Config")(**{**CONFIG, "max_position_embeddings": 128, **masks,
                                                       **overrides})
    cfg._attn_implementation = impl
    model = getattr(transformers, prefix + "ForCausalLM")(cfg).to(device=device, dtype=torch.bfloat16).eval()
    with torch.no_grad():   # gpt-oss's sinks: N(0, 1), or so low that they take nothing from any row
        for m in model.modules():
            if isinstance(getattr(m, "sinks", None), torch.nn.Parameter):
                m.sinks.normal_(0.0, 1.0) if sinks is None else m.sinks.fill_(sinks)
    return model


@pytest.mark.filterwarnings("ignore")   # gpt-oss's config warns of its YaRN factor on a tiny context
@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_windowed_softcapped_and_sink_models_match(name, decode_calls):
    """Mistral (a window of 8 under a 24-token prompt), Gemma 2 (logit softcap, alternating windows), gpt-oss
    (sinks, alternating windows): logits and 64 greedy tokens as the reference implementation's, through
    attention()'s mask keywords and, decoding, attention_with_kvcache's, the DynamicCache's sliding layers cropped
    by transformers."""
    if not hasattr(transformers, WINDOWED[name][0] + "Config"):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    ref = _windowed_model(name)
    ours = with_impl(ref, AUTO_CPU_IMPL)
    ids = token_ids()
    with torch.no_grad():
        want, got = ref(ids).logits, ours(ids).logits
        unmasked = _windowed_model(name, **WINDOWED[name][3])(ids).logits
    assert rel(got, want) < LOGITS_TOL < rel(unmasked, want)   # the masks are what made them agree
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64, do_sample=False,
              pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        assert_same_greedy(ref.generate(ids, **kw), ours.generate(ids, **kw), SEQ)
    windowed = [c for c in decode_calls if c["window"] == (WINDOWED[name][2]["sliding_window"] - 1, 0)]
    assert windowed and all(c["q"][1] == 1 for c in decode_calls)   # every step over the cache, windows kept
    assert all((c.get("sinks") is not None) == (name == "gpt_oss") for c in decode_calls)
    assert all((c["softcap"] > 0) == (name == "gemma2") for c in decode_calls)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_windowed_softcapped_and_sink_training_step_matches(name):
    """One training step of each masked model: loss and every parameter's gradient (gpt-oss's sinks included)
    as the reference implementation's."""
    if not hasattr(transformers, WINDOWED[name][0] + "Config"):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    ref = _windowed_model(name)
    assert_step_matches(ref, with_impl(ref, AUTO_CPU_IMPL), token_ids())


def test_padding_mask_refusals():
    ours = make_model(CPU_IMPL)
    ids, mask = left_padded(pads=(5, 0))
    with pytest.raises(fat.Unsupported, match="StaticCache"):
        ours.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
                      cache_implementation="static")
    with pytest.raises(fat.Unsupported, match="4D"):  # a dense mask of the model's own making skips the hook
        ours(ids, attention_mask=torch.ones(2, 1, SEQ, SEQ, dtype=torch.bool))
    with torch.no_grad():                             # a mask of ones is no mask
        ours(ids, attention_mask=torch.ones_like(ids))


def test_dropout_in_training_raises():
    ours = make_model(CPU_IMPL, attention_dropout=0.1)
    ids = token_ids()
    ours.train()
    with pytest.raises(fat.Unsupported, match="dropout"):
        ours(ids, labels=ids)
    ours.eval()                                       # transformers passes dropout=0.0 in eval mode
    with torch.no_grad():
        ours(ids)


def test_unsupported_layouts_raise():
    ours = make_model(CPU_IMPL)
    ids = token_ids()
    attn = fat.attention_function("fa2", "numpy")
    module = ours.model.layers[0].self_attn
    q = torch.zeros(1, 4, 8, 16, dtype=torch.bfloat16)
    kv = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16)
    for kw, what in ((dict(cu_seq_lens_q=torch.tensor([0, 8])), "packed"),):
        with pytest.raises(fat.Unsupported, match=what):
            attn(module, q, kv, kv, None, scaling=0.25, **kw)
    out, weights = attn(module, q, kv, kv, None, scaling=0.25, is_causal=False)
    assert out.shape == (1, 8, 4, 16) and weights is None


def test_inputs_go_in_as_views(calls):
    """(B, H, N, d) query/key/value reach fav.attention as (B, N, H, d) views of the same memory."""
    attn = fat.attention_function("fa2", "numpy")
    module = make_model(CPU_IMPL).model.layers[0].self_attn
    g = torch.Generator().manual_seed(2)
    query = torch.randn(2, 4, 8, 16, generator=g).to(torch.bfloat16)
    key, value = (torch.randn(2, 2, 11, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    out, _ = attn(module, query, key, value, None, scaling=0.3)   # module.is_causal: causal, bottom-right
    (c,) = calls
    q, k, v = c["tensors"]
    for x, y in ((q, query), (k, key), (v, value)):
        assert x.data_ptr() == y.data_ptr() and x.shape == y.transpose(1, 2).shape
    want = fav.attention(query.transpose(1, 2).contiguous(), key.transpose(1, 2).contiguous(),
                         value.transpose(1, 2).contiguous(), causal=True, softmax_scale=0.3, backend="numpy")
    assert torch.equal(out, want) and c["causal"] is True and c["softmax_scale"] == 0.3


def test_register_checks_its_arguments():
    with pytest.raises(ValueError):
        fat.register("sdpa")
    with pytest.raises(ValueError):
        fat.register("mine", backend="tpu")
    with pytest.raises(Exception, match="nope"):
        fat.register("mine", variant="nope")
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    assert ALL_ATTENTION_FUNCTIONS[CPU_IMPL].backend == "numpy"
    assert ALL_MASK_ATTENTION_FUNCTIONS[CPU_IMPL] is fat.mask_function
    assert "mine" not in ALL_ATTENTION_FUNCTIONS


def test_register_defaults_to_auto():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    name = fat.register("fa_variants_default")
    assert (ALL_ATTENTION_FUNCTIONS[name].variant, ALL_ATTENTION_FUNCTIONS[name].backend) == ("auto", "auto")


# ------------------------------------------------------------------------------------------------ GPU tests
def _cuda_models():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    ref = make_model(device="cuda")
    return ref, with_impl(ref, GPU_IMPL)


@pytest.mark.gpu
def test_gpu_logits_match_sdpa(calls):
    ref, ours = _cuda_models()
    ids = token_ids(device="cuda")
    with torch.no_grad():
        want, got = ref(ids).logits, ours(ids).logits
    assert got.device.type == "cuda" and got.dtype == torch.bfloat16
    assert rel(got, want) < LOGITS_TOL
    assert calls and all(c["backend"] == "auto" for c in calls)


@pytest.mark.gpu
def test_gpu_greedy_generation_matches_sdpa(calls):
    ref, ours = _cuda_models()
    prompt = token_ids(n=16, device="cuda")
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=8, min_new_tokens=8, do_sample=False,
              pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    want = ref.generate(prompt, **kw)
    got = ours.generate(prompt, **kw)
    margin = min(_top1_margin(s) for s in want.scores)
    assert torch.equal(got.sequences, want.sequences), f"smallest top-1 logit margin of sdpa's run: {margin:.3g}"
    assert len(calls) == CONFIG["num_hidden_layers"] * 8


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_gpu_generation_through_kvcache_matches_sdpa(cache, decode_calls):
    """variant="auto" on CUDA: the decoding steps run decode_fwd.cu (and merge_states.cu) over the model's cache."""
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    ref = make_model(device="cuda", max_position_embeddings=128)
    ours = with_impl(ref, AUTO_IMPL)
    prompt = token_ids(batch=4, n=SEQ, device="cuda", seed=4)
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=64, min_new_tokens=64, do_sample=False,
              pad_token_id=0, output_scores=True, return_dict_in_generate=True, cache_implementation=cache)
    want = ref.generate(prompt, **kw)
    got = ours.generate(prompt, **kw)
    assert_same_greedy(want, got, SEQ)
    assert len(decode_calls) >= 63 * CONFIG["num_hidden_layers"]


@pytest.mark.gpu
def test_gpu_training_step_gradients_match_sdpa():
    ref, ours = _cuda_models()
    assert_step_matches(ref, ours, token_ids(device="cuda"))


@pytest.mark.gpu
def test_gpu_padded_generation_and_training_match_sdpa():
    """A left-padded batch on CUDA: 64 greedy tokens and a training step through attention_varlen, which runs
    the masked kernels (fa3's forward on sm_90a, fa2's elsewhere; fa2's backward) there."""
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    ref = make_model(device="cuda", max_position_embeddings=128)
    ours = with_impl(ref, AUTO_IMPL)
    ids, mask = (x.cuda() for x in left_padded(pads=(0, 5, 11, 17)))
    kw = dict(attention_mask=mask, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0,
              output_scores=True, return_dict_in_generate=True)
    assert_same_greedy(ref.generate(ids, **kw), ours.generate(ids, **kw), SEQ)
    assert_step_matches(ref, ours, ids, attention_mask=mask, labels=padded_labels(ids, mask))


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_gpu_windowed_softcapped_and_sink_models_match(name, decode_calls):
    """Mistral, Gemma 2 and gpt-oss on CUDA: logits and a training step through the masked kernels (gpt-oss's
    experts chosen as the reference chose them: with_ref_routes), and 64 greedy tokens whose steps run
    decode_fwd.cu with the models' windows, softcaps and sinks."""
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    if not hasattr(transformers, WINDOWED[name][0] + "Config"):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    ref = _windowed_model(name, device="cuda")
    ours = with_impl(ref, AUTO_IMPL)
    ids = token_ids(device="cuda")
    with torch.no_grad():
        want, got = with_ref_routes(lambda: ref(ids).logits, lambda: ours(ids).logits, ref, ours)
    assert rel(got, want) < LOGITS_TOL
    assert_step_matches(ref, ours, ids)
    if name != "gpt_oss":   # its routing parts from the reference's at near-ties (docs/masks.md), token by token
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                  pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        with torch.no_grad():
            assert_same_greedy(ref.generate(ids, **kw), ours.generate(ids, **kw), SEQ)
        assert decode_calls and all(c["window"][0] >= 0 or c["softcap"] > 0 for c in decode_calls)


def _compared_calls(monkeypatch):
    """Every masked attention call the models make (fa_variants.varlen.attention_varlen, which the torch ops run)
    and every masked backward, each run again by the NumPy model on host copies of the same inputs: a list of
    (what, relative error) per result."""
    from fa_variants import backward, varlen
    seen = []
    real_fwd, real_bwd = varlen.attention_varlen, backward.attention_backward
    host = lambda x: x.detach().cpu() if torch.is_tensor(x) else x   # noqa: E731

    def compare(what, got, args, kw, real):
        want = real(*map(host, args), **{**{k: host(x) for k, x in kw.items()}, "backend": "numpy"})
        seen.extend((f"{what}[{i}]", rel(g.cpu(), w)) for i, (g, w) in enumerate(zip(got, want)))

    def fwd(*args, **kw):
        got = real_fwd(*args, **kw)
        if kw.get("return_lse"):   # the op's own call (the outer public call returns out alone)
            compare("forward", got, args, kw, real_fwd)
        return got

    def bwd(*args, **kw):
        got = real_bwd(*args, **kw)
        if kw.get("cu_seqlens_q") is not None:
            compare("backward", got, args, kw, real_bwd)
        return got

    monkeypatch.setattr(varlen, "attention_varlen", fwd)
    monkeypatch.setattr(backward, "attention_backward", bwd)
    return seen


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", sorted(WINDOWED) + ["padded"])
def test_gpu_masked_models_every_call_matches_the_numpy_model(monkeypatch, name):
    """The models' own attention calls on CUDA (packed batches, windows, softcaps, sinks; a training step's
    backward), each against the NumPy model on the same inputs: the kernels' part of the model-level checks above,
    which also see what the reference implementations do with rows that see no key and top-k routing."""
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    if name != "padded" and not hasattr(transformers, WINDOWED[name][0] + "Config"):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    seen = _compared_calls(monkeypatch)
    if name == "padded":
        model = with_impl(make_model(device="cuda", max_position_embeddings=128), AUTO_IMPL)
        ids, mask = (x.cuda() for x in left_padded(pads=(0, 5, 11, 17)))
        _train_step_grads(model, ids, attention_mask=mask, labels=padded_labels(ids, mask))
    else:
        model = with_impl(_windowed_model(name, device="cuda"), AUTO_IMPL)
        _train_step_grads(model, token_ids(device="cuda"))
    kinds = {w.split("[")[0] for w, _ in seen}
    assert kinds == {"forward", "backward"}, f"{name}: the masked kernels ran {sorted(kinds) or 'no'} calls"
    worst = max(seen, key=lambda s: s[1])
    assert worst[1] < TOL["bfloat16"], f"{worst[0]}: {worst[1]:.3g} against the NumPy model"
