"""TMA tensor maps (CUtensorMap) for fa3, made on the host by the CUDA driver's ``cuTensorMapEncodeTiled``.

Through ctypes on libcuda itself rather than NVIDIA's ``cuda-bindings``: the driver is what CuPy already loads, so
this adds no dependency and no import cost. A map describes one (batch, seqlen, heads, head_dim) tensor as a 4-d
tensor of 16-bit (or, for fa3_fp8, one-byte e4m3) elements, innermost first: (head_dim, seqlen, heads, batch), byte
strides of the three outer dims (any order, as the kernels take strides), a box of ``box_bytes`` (128, or 64 or 32 for
fa3_fp8's V^T rows of 192, 160 or 224 keys) x ``rows`` rows (one swizzled slab of common/wgmma.cuh's SwizzledTile), swizzled as wide as
the box, zero fill past the extents (the seqlen tails and the columns past head_dim of a padded template).

A map embeds the tensor's address. So that a warm call does not pay for three driver calls, ``MapTemplate`` encodes
once and patches the address into the bytes on each call: where the address lives in the opaque 128 bytes is
found by encoding the same tensor at two addresses and comparing; if the two encodings differ anywhere but in one
little-endian 8-byte field holding the address, the template re-encodes on every call instead.
"""
from __future__ import annotations

import ctypes
import struct

_DTYPE = {2: 6}          # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 (the bits are copied, so bf16 uses it too); 1: UINT8
_DTYPE_1B = 0            # CU_TENSOR_MAP_DATA_TYPE_UINT8, for e4m3
_SWIZZLE = {128: 3, 64: 2, 32: 1}  # CU_TENSOR_MAP_SWIZZLE_128B / _64B / _32B, by the box's inner bytes
_L2_256B = 3
_OOB_ZERO = 0
_INTERLEAVE_NONE = 0
BOX_BYTES = 128          # inner box extent: one swizzled slab row


def slab_bytes(row_bytes: int) -> int:
    """The bytes of a row that one slab (one TMA box) holds for a tile of ``row_bytes``-byte rows: common/wgmma.cuh's
    SwizzledTile::W, 128, or 64 (64-byte swizzle) where a row is not a multiple of 128 bytes, or 32 (32-byte
    swizzle) where it is not one of 64 (fa3_fp8's V^T over 160 or 224 keys)."""
    return 128 if row_bytes % 128 == 0 else 64 if row_bytes % 64 == 0 else 32

_ENCODE = None


def _encode_fn():
    global _ENCODE
    if _ENCODE is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
        u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        _ENCODE = fn
    return _ENCODE


def check(ptr: int, shape, strides_bytes, itemsize: int, rows: int, name: str = "tensor",
          box_bytes: int = BOX_BYTES) -> None:
    """The driver's preconditions, as clear errors: 16-byte aligned address and outer strides, extents < 2^32,
    a box of at most 256 rows. ``shape`` (batch, seqlen, heads, head_dim); ``strides_bytes`` of those dims."""
    if ptr % 16:
        raise ValueError(f"{name}: TMA needs a 16-byte aligned address, got {ptr:#x}")
    for dim, st in zip(("batch", "seqlen", "heads"), strides_bytes[:3]):
        if st % 16 or st >= 1 << 40:
            raise ValueError(f"{name}: TMA needs the {dim} stride in bytes to be a multiple of 16 below 2^40, "
                             f"got {st}")
    if any(x >= 1 << 32 for x in shape):
        raise ValueError(f"{name}: TMA takes extents below 2^32, got {tuple(shape)}")
    if not 0 < rows <= 256:
        raise ValueError(f"{name}: a TMA box has 1..256 rows, got {rows}")
    if box_bytes not in _SWIZZLE:
        raise ValueError(f"{name}: boxes of {sorted(_SWIZZLE)} bytes a row are swizzled, got {box_bytes}")


def encode(ptr: int, shape, strides_bytes, itemsize: int, rows: int, box_bytes: int = BOX_BYTES) -> bytes:
    """The 128-byte CUtensorMap of a (batch, seqlen, heads, head_dim) tensor at ``ptr``: boxes of
    (box_bytes / itemsize) columns x ``rows`` rows, box_bytes-wide swizzle, zero fill."""
    b, n, h, d = shape
    sb, sn, sh = strides_bytes[:3]
    out = (ctypes.c_uint64 * 16)()
    dims = (ctypes.c_uint64 * 4)(d, n, h, b)
    strides = (ctypes.c_uint64 * 3)(sn, sh, sb)
    box = (ctypes.c_uint32 * 4)(box_bytes // itemsize, rows, 1, 1)
    unit = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    dtype = _DTYPE.get(itemsize, _DTYPE_1B)
    rc = _encode_fn()(ctypes.addressof(out), dtype, 4, ctypes.c_void_p(ptr), dims, strides, box, unit,
                      _INTERLEAVE_NONE, _SWIZZLE[box_bytes], _L2_256B, _OOB_ZERO)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {rc} (shape {tuple(shape)}, byte strides "
                           f"{tuple(strides_bytes)}, box {box_bytes // itemsize}x{rows})")
    return bytes(out)


def address_field(a: bytes, b: bytes, addr_a: int, addr_b: int) -> int | None:
    """The byte offset of the 8-byte little-endian field holding the address, given encodings ``a`` and ``b`` of
    one tensor at ``addr_a`` and ``addr_b``; None when they differ in any other way."""
    diff = [i for i in range(len(a)) if a[i] != b[i]]
    if not diff:
        return None
    off = diff[0] - diff[0] % 8
    if diff[-1] >= off + 8 or off + 8 > len(a):
        return None
    if struct.unpack_from("<Q", a, off)[0] != addr_a or struct.unpack_from("<Q", b, off)[0] != addr_b:
        return None
    return off


class MapTemplate:
    """One tensor's map for a call signature; ``at(ptr)`` gives the map bytes for the tensor at ``ptr``."""

    def __init__(self, ptr: int, shape, strides_bytes, itemsize: int, rows: int, name: str = "tensor",
                 box_bytes: int = BOX_BYTES):
        check(ptr, shape, strides_bytes, itemsize, rows, name, box_bytes)
        self.args = (tuple(shape), tuple(strides_bytes), itemsize, rows, box_bytes)
        first = encode(ptr, *self.args)
        other = ptr + 1024 if ptr + 1024 < 1 << 63 else ptr - 1024
        self.offset = address_field(first, encode(other, *self.args), ptr, other)
        self.bytes = bytearray(first)

    def at(self, ptr: int) -> bytes:
        if self.offset is None:
            return encode(ptr, *self.args)
        buf = bytearray(self.bytes)
        struct.pack_into("<Q", buf, self.offset, ptr)
        return bytes(buf)
