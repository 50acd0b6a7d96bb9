"""The Python mirror of the kernels' parameter structs (cuda_src/common/params.cuh), and their packing.

Each struct is a field list here and in C++. ``layout_header()`` turns the list into static_asserts of the
struct's size and of every field's offset; jit.py compiles it into every source that includes params.cuh (as
``generated/param_layout.cuh``), so a field added, removed, reordered or retyped on one side only fails
NVRTC compilation, in CI, with no GPU, instead of corrupting a launch.

A launch packs the struct once per plan (``pack``) and, per call, writes only the leading pointer fields
(``pointers_format``) into a copy of those bytes.
"""
from __future__ import annotations

import dataclasses
import struct

import numpy as np

# C++ type of each field kind, and the NumPy type with the same size and alignment.
_KINDS = {"ptr": ("const void*", np.uint64), "i64": ("long long", np.int64), "int": ("int", np.int32),
          "float": ("float", np.float32)}


@dataclasses.dataclass(frozen=True)
class ParamStruct:
    name: str
    fields: tuple[tuple[str, str], ...]   # (field, kind), in declaration order

    @property
    def dtype(self) -> np.dtype:
        """C layout (natural alignment, tail padding): what the compiler does with the C++ struct."""
        return np.dtype([(f, _KINDS[kind][1]) for f, kind in self.fields], align=True)

    @property
    def size(self) -> int:
        return self.dtype.itemsize

    def offset(self, field: str) -> int:
        return self.dtype.fields[field][1]

    @property
    def pointers(self) -> tuple[str, ...]:
        """The leading pointer fields: the ones a call fills in."""
        out = []
        for f, kind in self.fields:
            if kind != "ptr":
                break
            out.append(f)
        return tuple(out)

    @property
    def pointers_format(self) -> str:
        return "<" + "Q" * len(self.pointers)

    def pack(self, **values) -> bytes:
        """The struct's bytes; every field must be given (pointers as ints, 0 for null)."""
        missing = [f for f, _ in self.fields if f not in values]
        unknown = sorted(set(values) - {f for f, _ in self.fields})
        if missing or unknown:
            raise ValueError(f"{self.name}: missing fields {missing}, unknown fields {unknown}")
        rec = np.zeros((), dtype=self.dtype)
        for f, _ in self.fields:
            rec[f] = values[f]
        return rec.tobytes()

    def static_asserts(self) -> str:
        lines = [f"static_assert(sizeof(fav::{self.name}) == {self.size}, "
                 f"\"{self.name}: size differs from fa_variants/kernels/params.py\");"]
        lines += [f"static_assert(FAV_OFFSETOF(fav::{self.name}, {f}) == {self.offset(f)} && "
                  f"sizeof(((fav::{self.name}*)0)->{f}) == {np.dtype(_KINDS[kind][1]).itemsize}, "
                  f"\"{self.name}.{f}: offset or size differs from fa_variants/kernels/params.py\");"
                  for f, kind in self.fields]
        return "\n".join(lines)


def _fields(text: str, kind: str):
    return tuple((f, kind) for f in text.split())


FWD = ParamStruct("FwdParams", (
    *_fields("q k v o lse o_ws l_ws m_ws", "ptr"),
    *_fields("q_b q_n q_h k_b k_n k_h v_b v_n v_h o_b o_n o_h", "i64"),
    *_fields("batch seqlen_q seqlen_k heads group head_dim kv_block_begin kv_block_end", "int"),
    ("scale_log2", "float"), ("causal", "int"),
))

# The split tail's fields, fa3's extension of a forward's struct (its fields start at the base's size: no tail
# padding in either base).
SPLIT_TAIL = _fields("tail_tiles tail_blocks tail_ranges", "int")

# fa3's (derived from FwdParams in C++)
FA3_FWD = ParamStruct("Fa3FwdParams", (*FWD.fields, *SPLIT_TAIL))

# fa2's masked forward (derived from FwdParams in C++)
MASKED_FWD = ParamStruct("MaskedFwdParams", (
    *FWD.fields, *_fields("cu_seqlens_q cu_seqlens_k alibi_slopes sinks", "ptr"), ("lse_h", "i64"),
    *_fields("alibi_b window_left window_right", "int"), *_fields("softcap_raw inv_scale", "float"),
))

FP8_FWD = ParamStruct("Fp8FwdParams", (
    *_fields("q k vt sq sk sv o lse", "ptr"),
    *_fields("o_b o_n o_h", "i64"),
    *_fields("batch seqlen_q seqlen_k seqlen_k_pad heads group head_dim", "int"),
    ("scale_log2", "float"), ("causal", "int"), ("heads_kv", "int"),
))

# fa3_fp8's (derived from Fp8FwdParams in C++: its fields start at the base's size, which has no tail padding)
FA3_FP8_FWD = ParamStruct("Fa3Fp8FwdParams", (
    *FP8_FWD.fields, *SPLIT_TAIL, ("o_ws", "ptr"),
))

BWD = ParamStruct("BwdParams", (
    *_fields("q k v o dout lse delta dq dk dv", "ptr"),
    *_fields("q_b q_n q_h k_b k_n k_h v_b v_n v_h o_b o_n o_h do_b do_n do_h", "i64"),
    *_fields("seqlen_q seqlen_k heads group head_dim", "int"),
    ("scale_log2", "float"), ("scale", "float"), ("causal", "int"),
))

# fa2's masked backward (derived from BwdParams in C++)
MASKED_BWD = ParamStruct("MaskedBwdParams", (
    *BWD.fields, *_fields("cu_seqlens_q cu_seqlens_k alibi_slopes", "ptr"), ("lse_h", "i64"),
    *_fields("alibi_b window_left window_right", "int"), *_fields("softcap_raw inv_scale", "float"),
))

PAD = ParamStruct("PadParams", (
    *_fields("src dst", "ptr"),
    *_fields("s_b s_n s_h", "i64"),
    *_fields("rows seqlen heads head_dim width", "int"),
))

QUANT = ParamStruct("QuantParams", (
    *_fields("q k v qq kq vt sq sk sv amax", "ptr"),
    *_fields("q_b q_n q_h k_b k_n k_h v_b v_n v_h", "i64"),
    *_fields("heads heads_kv seqlen_q seqlen_k seqlen_k_pad q_items k_items", "int"),
))

DECODE = ParamStruct("DecodeParams", (
    *_fields("q k v cache_seqlens page_table k_descale v_descale o lse o_part lse_part sinks alibi_slopes", "ptr"),
    *_fields("q_b q_n q_h k_b k_n k_h v_b v_n v_h o_b o_n o_h", "i64"),
    *_fields("batch seqlen_q heads heads_kv group head_dim seqlen_new capacity page_size max_pages num_pages "
             "num_splits row_tiles", "int"),
    ("scale_log2", "float"), ("causal", "int"), ("window_left", "int"), ("window_right", "int"),
    ("softcap", "float"), ("inv_scale", "float"), ("alibi_b", "i64"),
))

APPEND = ParamStruct("AppendParams", (
    *_fields("k v k_cache v_cache cache_seqlens page_table", "ptr"),
    *_fields("kn_b kn_n kn_h vn_b vn_n vn_h k_b k_n k_h v_b v_n v_h", "i64"),
    *_fields("batch seqlen_new heads_kv head_dim capacity page_size max_pages num_pages", "int"),
))

MERGE = ParamStruct("MergeParams", (
    *_fields("o_parts lse_parts out lse", "ptr"),
    *_fields("p_s p_b p_n p_h l_s l_b l_h l_n o_b o_n o_h", "i64"),
    *_fields("states batch seqlen heads head_dim", "int"),
))

STRUCTS = (FWD, FA3_FWD, MASKED_FWD, FP8_FWD, FA3_FP8_FWD, BWD, MASKED_BWD, PAD, QUANT, DECODE, APPEND, MERGE)
KV_BLOCKS_ALL = 1 << 30   # kv_block_end when a launch visits every K/V block


def layout_header() -> str:
    """generated/param_layout.cuh: the static_asserts of every struct."""
    return "// generated by fa_variants/kernels/params.py: do not edit\n" + \
        "\n".join(s.static_asserts() for s in STRUCTS) + "\n"


GENERATED = {"generated/param_layout.cuh": layout_header}


def fill_pointers(template: bytes, fmt: str, *ptrs: int):
    """A fresh, writable copy of ``template`` with its leading pointers set: one per launch, so concurrent
    launches from several threads never share the bytes."""
    buf = bytearray(template)
    struct.pack_into(fmt, buf, 0, *ptrs)
    return buf
