"""What the masked kernels share on the host (kernels/fa2_masked.py, kernels/fa3_masked.py): a call's masks as the
kernels take them (``Masks``), the arrays as they read them (``launchable``), the outputs and the parameter struct
MaskedFwdParams (``prepare``), and the calls themselves around a kernel's launches (``forward``, ``backward``). The
backward's struct, MaskedBwdParams, shares the mask fields (``mask_fields``; ``bwd_template`` packs it)."""
from __future__ import annotations

import dataclasses

from .common import check_grid, elem_strides, ensure_vector_aligned, negated, pad_last_dim, round_up, scale_log2

SIDE_ARRAYS = ("sinks", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k")   # Masks' device arrays


@dataclasses.dataclass(frozen=True)
class Masks:
    """What a call asks beyond a plain forward, checked by the caller (varlen.py): the window's sides (-1:
    unbounded), the softcap (0: none), and the side arrays as CuPy arrays on q's device (or None): sinks (heads,),
    alibi_slopes (heads,) or (batch, heads) float32, cu_seqlens_q/_k (batch + 1,) int32, with the longest lengths
    and cu_seqlens_q[-1], cu_seqlens_k[-1] as host ints (the caller read them to check the lengths)."""
    window: tuple = (-1, -1)
    softcap: float = 0.0
    sinks: object = None
    alibi_slopes: object = None
    cu_seqlens_q: object = None
    cu_seqlens_k: object = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    total_q: int = 0
    total_k: int = 0

    @property
    def packed(self) -> bool:
        return self.cu_seqlens_q is not None


def check_scale(softmax_scale: float, masks: Masks) -> None:
    """The kernel applies the softcap and ALiBi to raw scores (q . k), in units of 1 / softmax_scale: a scale of 0
    has none."""
    if softmax_scale == 0 and (masks.softcap > 0 or masks.alibi_slopes is not None):
        raise ValueError("softmax_scale = 0 with softcap or alibi_slopes: not supported on the GPU (every score is "
                         "0 there; pass a nonzero softmax_scale)")


def forward(q, k, v, *, causal: bool, softmax_scale: float, return_lse: bool, masks: Masks, run):
    """(out, lse or None) for CuPy q, k, v: dense (batch, seqlen, heads, d) or, with masks.cu_seqlens_q, packed
    (total, heads, d). out has q's shape; lse is (batch, heads, seqlen_q), or (heads, total_q) when packed. Rows of
    a packed q past cu_seqlens_q[-1] give 0 and -inf. A negative scale runs on a negated copy of q. ``run``: the
    kernel's launch, run(q, k, v, prepared), on the arrays as launchable gives them, into prepared's outputs."""
    check_scale(softmax_scale, masks)
    if softmax_scale < 0:
        q, softmax_scale = negated(q), -softmax_scale
    d = q.shape[-1]
    q4, k4, v4 = launchable((q, k, v), masks.packed)
    prepared = prepare(q4, k4, v4, causal, softmax_scale, return_lse, masks)
    if not prepared.empty:
        run(q4, k4, v4, prepared)
    return as_given(prepared.out, d, masks.packed), prepared.lse


def backward(dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float, masks: Masks, gradients):
    """(dq, dk, dv, dsinks or None) for CuPy arrays of forward's layouts (lse (batch, heads, seqlen_q), or (heads,
    total_q) when packed); dsinks float32 (heads,). A negative scale runs on a negated copy of q (dq negated back).
    ``gradients(dout, q, k, v, out, lse, causal, scale, masks)``: a kernel's (dq, dk, dv, D or None) on the arrays as
    launchable gives them, D = rowsum(dO o O) as fa2_bwd.delta lays it out where the kernel computed it so (the
    sinks' gradient needs it; computed here otherwise). Rows of a packed q, k, v past the last sequence get zero
    gradients."""
    import cupy
    from . import fa2_bwd
    check_scale(softmax_scale, masks)
    flip = softmax_scale < 0
    if flip:
        q, softmax_scale = negated(q), -softmax_scale
    packed = masks.packed
    d = q.shape[-1]
    dout4, q4, k4, v4, out4 = launchable((dout, q, k, v, out), packed)
    lse = cupy.ascontiguousarray(lse, dtype=cupy.float32)
    *grads, dlt = gradients(dout4, q4, k4, v4, out4, lse, causal, softmax_scale, masks)
    dq, dk, dv = (as_given(g, d, packed) for g in grads)
    if flip:
        dq = negated(dq)
    dsinks = None
    if masks.sinks is not None:
        if dlt is None:
            dlt = fa2_bwd.delta(dout4, out4)   # (1, heads, total_q) when packed: D is per row, whatever its sequence
        # dsink_h = -sum over rows of P_sink * D, P_sink = exp(sink_h - LSE): rows that saw nothing (LSE -inf,
        # past the last sequence) add nothing
        l64 = lse.reshape(lse.shape[-2], -1) if packed else lse.transpose(1, 0, 2).reshape(lse.shape[1], -1)
        d64 = dlt.reshape(lse.shape[-2], -1) if packed else dlt.transpose(1, 0, 2).reshape(lse.shape[1], -1)
        sink = masks.sinks.astype(cupy.float64)[:, None]
        p_sink = cupy.where(cupy.isneginf(l64), 0.0, cupy.exp(sink - l64.astype(cupy.float64)))
        dsinks = -(p_sink * d64).sum(axis=1)
    return dq, dk, dv, dsinks


@dataclasses.dataclass
class BwdLaunch:
    """A masked backward's launch as fa2's and fa3's kernels share it: the gradients (zeros where rows of a packed
    batch belong to no sequence, else uninitialized), MaskedBwdParams with zero pointers, the sequences and the
    longest ones' rows, and the device arrays the struct points to (alive until the launches are queued)."""
    dq: object
    dk: object
    dv: object
    template: bytes
    batch: int
    rows_q: int
    rows_k: int
    held: list

    @property
    def empty(self) -> bool:
        return self.batch == 0 or self.rows_q == 0 or self.rows_k == 0

    def pointers(self, q, k, v, out, dout, lse, delta) -> tuple:
        """MaskedBwdParams' leading pointers (delta: None where the kernel keeps D elsewhere)."""
        return tuple(a.data.ptr for a in (q, k, v, out, dout, lse)) + (ptr(delta),) + tuple(
            a.data.ptr for a in (self.dq, self.dk, self.dv))


def bwd_launch(dout, q, k, v, out, causal: bool, softmax_scale: float, masks: Masks) -> BwdLaunch:
    """The gradients and MaskedBwdParams of a masked backward over launchable arrays (a packed batch's strides 0
    between sequences, its lengths the longest ones; the LSE's head stride the rows of q)."""
    import cupy
    from .params import MASKED_BWD
    _, nq, h, dp = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    packed = masks.packed
    batch = masks.cu_seqlens_q.shape[0] - 1 if packed else q.shape[0]
    fill = cupy.zeros if packed and (masks.total_q < nq or masks.total_k < nk) else cupy.empty
    dq, dk, dv = fill(q.shape, q.dtype), fill(k.shape, k.dtype), fill(v.shape, v.dtype)
    rows_q, rows_k = (masks.max_seqlen_q, masks.max_seqlen_k) if packed else (nq, nk)
    check_grid(h, "heads")
    check_grid(batch, "batch")
    strides = {n: elem_strides(a) for n, a in (("q", q), ("k", k), ("v", v), ("o", out), ("do", dout))}
    if packed:
        strides = {n: (0,) + st[1:] for n, st in strides.items()}
    fields, held = mask_fields(masks, softmax_scale, h)
    template = MASKED_BWD.pack(
        q=0, k=0, v=0, o=0, dout=0, lse=0, delta=0, dq=0, dk=0, dv=0,
        **{f"{n}_{axis}": st[i] for n, st in strides.items() for i, axis in enumerate("bnh")},
        seqlen_q=rows_q, seqlen_k=rows_k, heads=h, group=h // hkv, head_dim=dp,
        scale_log2=scale_log2(softmax_scale), scale=softmax_scale, causal=int(bool(causal)),
        lse_h=nq, **fields)
    return BwdLaunch(dq, dk, dv, template, batch, rows_q, rows_k, held)


def launchable(xs, packed: bool) -> list:
    """Arrays as the kernels read them: (batch, seqlen, heads, d) (a packed one as batch 1), rows padded to a
    multiple of 8 elements (a copy) or else 16-byte aligned (a copy where they are not)."""
    four = [a[None] if packed else a for a in xs]
    d = four[0].shape[3]
    if d % 8:
        return [pad_last_dim(a, round_up(d, 8)) for a in four]
    return [ensure_vector_aligned(a) for a in four]


def as_given(a, d: int, packed: bool):
    """A result of launchable's layout back in the caller's: the first d columns, the packed batch axis gone."""
    a = a[..., :d] if d % 8 else a
    return a[0] if packed else a


@dataclasses.dataclass
class Prepared:
    """A masked forward's launch as fa2's and fa3's kernels share it: the outputs (rows no sequence holds already 0
    and -inf), MaskedFwdParams with zero pointers, the sequences and the longest one's rows, and the device arrays
    the struct points to (alive until the launch is queued). ``empty``: nothing to launch."""
    out: object
    lse: object
    template: bytes
    batch: int
    rows: int
    held: list
    empty: bool

    def pointers(self, q, k, v) -> tuple:
        """MaskedFwdParams' leading pointers for a launch on q, k, v into these outputs (no workspaces)."""
        return (q.data.ptr, k.data.ptr, v.data.ptr, self.out.data.ptr, ptr(self.lse), 0, 0, 0)


def prepare(q, k, v, causal: bool, softmax_scale: float, return_lse: bool, masks: Masks) -> Prepared:
    """The outputs and parameter struct of a masked forward over launchable q, k, v."""
    import cupy
    _, nq, h, dp = q.shape
    packed = masks.packed
    batch = masks.cu_seqlens_q.shape[0] - 1 if packed else q.shape[0]
    rows = masks.max_seqlen_q if packed else nq
    check_grid(h, "heads")
    check_grid(batch, "batch")
    # rows of a packed q that no sequence holds are never visited: zeros and -inf there
    uncovered = packed and masks.total_q < nq
    fill = cupy.zeros if uncovered else cupy.empty
    out = fill((1 if packed else batch, nq, h, dp), q.dtype)
    lse = None
    if return_lse:
        shape = (h, nq) if packed else (batch, h, nq)
        lse = cupy.full(shape, -cupy.inf, cupy.float32) if uncovered else cupy.empty(shape, cupy.float32)
    qs, ks, vs = elem_strides(q), elem_strides(k), elem_strides(v)
    if packed:
        qs, ks, vs = (0, qs[1], qs[2]), (0, ks[1], ks[2]), (0, vs[1], vs[2])
    o_b = 0 if packed else nq * h * dp
    sinks = None if masks.sinks is None else cupy.ascontiguousarray(masks.sinks, dtype=cupy.float32)
    fields, held = mask_fields(masks, softmax_scale, h)
    from .params import KV_BLOCKS_ALL, MASKED_FWD
    template = MASKED_FWD.pack(
        q=0, k=0, v=0, o=0, lse=0, o_ws=0, l_ws=0, m_ws=0,
        q_b=qs[0], q_n=qs[1], q_h=qs[2], k_b=ks[0], k_n=ks[1], k_h=ks[2], v_b=vs[0], v_n=vs[1], v_h=vs[2],
        o_b=o_b, o_n=h * dp, o_h=dp, batch=batch, seqlen_q=rows if packed else nq,
        seqlen_k=k.shape[1], heads=h, group=h // k.shape[2], head_dim=dp, kv_block_begin=0,
        kv_block_end=KV_BLOCKS_ALL, scale_log2=scale_log2(softmax_scale), causal=int(bool(causal)),
        sinks=ptr(sinks), lse_h=nq, **fields)
    return Prepared(out, lse, template, batch, rows, held + [sinks], rows == 0 or batch == 0 or nq == 0)


def ptr(a) -> int:
    return 0 if a is None else a.data.ptr


def mask_fields(masks: Masks, softmax_scale: float, heads: int) -> tuple[dict, list]:
    """The fields MaskedFwdParams and MaskedBwdParams share past their bases (every one but sinks, lse_h), and the
    device arrays their pointers name (to keep alive until the launches are queued)."""
    import cupy
    side = [None if a is None else cupy.ascontiguousarray(a, dtype=dt) for a, dt in
            ((masks.cu_seqlens_q, cupy.int32), (masks.cu_seqlens_k, cupy.int32),
             (masks.alibi_slopes, cupy.float32))]
    cu_q, cu_k, slopes = side
    return dict(cu_seqlens_q=ptr(cu_q), cu_seqlens_k=ptr(cu_k), alibi_slopes=ptr(slopes),
                alibi_b=0 if slopes is None or slopes.ndim == 1 else heads,
                window_left=masks.window[0], window_right=masks.window[1],
                softcap_raw=masks.softcap / softmax_scale if masks.softcap > 0 else 0.0,
                inv_scale=1.0 / softmax_scale if softmax_scale != 0 else 0.0), side
