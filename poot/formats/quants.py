"""Quantisation block layouts of ggml: sizes, dequantisation and a plain quantiser.

A tensor is quantised row by row along its last (contiguous) axis, in blocks of `block_elems`
values stored in `block_bytes` bytes; all fields are little-endian. The layouts are ggml's
(ggml-common.h, ggml-quants.c):

  Q8_0  f16 d, i8 qs[32]                         x = q*d
  Q4_0  f16 d, u8 qs[16]                         x = (q-8)*d     low nibbles: elems 0..15,
  Q4_1  f16 d, f16 m, u8 qs[16]                  x = q*d + m     high nibbles: elems 16..31
  Q5_0  f16 d, u32 qh, u8 qs[16]                 x = (q-16)*d    bit i of qh is bit 4 of elem i
  Q5_1  f16 d, f16 m, u32 qh, u8 qs[16]          x = q*d + m
  Q4_K  f16 d, f16 dmin, u8 scales[12], u8 qs[128]             8 sub-blocks of 32 with 6-bit
  Q5_K  f16 d, f16 dmin, u8 scales[12], u8 qh[32], u8 qs[128]  scale sc and min m:
                                                               x = d*sc*q - dmin*m
  Q6_K  u8 ql[128], u8 qh[64], i8 scales[16], f16 d            16 sub-blocks of 16: x = d*sc*(q-32)
  Q3_K  u8 hmask[32], u8 qs[64], u8 scales[12], f16 d          16 sub-blocks of 16, 6-bit sc:
                                                               x = d*(sc-32)*(q-4), q of 3 bits
  Q2_K  u8 scales[16], u8 qs[64], f16 d, f16 dmin              16 sub-blocks of 16, 4-bit sc, m:
                                                               x = d*sc*q - dmin*m, q of 2 bits
  IQ4_NL f16 d, u8 qs[16]                        x = d*IQ4_VALUES[q] (nibbles as Q4_0's)
  IQ4_XS f16 d, u16 scales_h, u8 scales_l[4], u8 qs[128]       8 sub-blocks of 32, 6-bit ls:
                                                               x = d*(ls-32)*IQ4_VALUES[q]

Dequantisation is vectorised over blocks and bit-exact with ggml's reference code: every
product below is exact in float32 (an f16 times a small integer), so the operation order cannot
change a result. The quantiser is a straightforward one (round to nearest within a range that
covers the block), good for building test and benchmark models, not tuned like llama.cpp's.
This module knows nothing about files.
"""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class QuantType:
    name: str
    ggml_type: int
    block_elems: int
    block_bytes: int

    def nbytes(self, n_elems):
        if n_elems % self.block_elems:
            raise ValueError(f"{n_elems} elements are not a whole number of {self.name} blocks "
                             f"of {self.block_elems}")
        return n_elems // self.block_elems * self.block_bytes


QUANTS = {q.name: q for q in (
    QuantType("F32", 0, 1, 4),
    QuantType("F16", 1, 1, 2),
    QuantType("BF16", 30, 1, 2),
    QuantType("Q4_0", 2, 32, 18),
    QuantType("Q4_1", 3, 32, 20),
    QuantType("Q5_0", 6, 32, 22),
    QuantType("Q5_1", 7, 32, 24),
    QuantType("Q8_0", 8, 32, 34),
    QuantType("Q4_K", 12, 256, 144),
    QuantType("Q5_K", 13, 256, 176),
    QuantType("Q6_K", 14, 256, 210),
    QuantType("Q2_K", 10, 256, 84),
    QuantType("Q3_K", 11, 256, 110),
    QuantType("IQ4_NL", 20, 32, 18),
    QuantType("IQ4_XS", 23, 256, 136),
)}

# The 16 values a 4-bit code of IQ4_NL and IQ4_XS stands for (ggml's kvalues_iq4nl).
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      np.int8)

# Every ggml type id we know a name for, so a file using one we cannot decode is refused by name.
GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
    34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}


def slice_raw(dtype, raw, shape, rows=None, cols=None):
    """The stored bytes of rows/cols ((start, stop) or None for all) of a [rows, cols] tensor
    stored as `raw`; a column slice must fall on whole blocks."""
    q = _quant_type(dtype)
    n_rows, n_cols = shape
    r0, r1 = rows or (0, n_rows)
    c0, c1 = cols or (0, n_cols)
    if c0 % q.block_elems or c1 % q.block_elems:
        raise ValueError(f"columns {c0}:{c1} of a {dtype} tensor cut its blocks of "
                         f"{q.block_elems}")
    blocks = np.asarray(raw).reshape(n_rows, n_cols // q.block_elems, q.block_bytes)
    return np.ascontiguousarray(blocks[r0:r1, c0 // q.block_elems:c1 // q.block_elems]).reshape(-1)


def _quant_type(dtype):
    if dtype not in QUANTS:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(QUANTS)}")
    return QUANTS[dtype]


def _f16(cols):
    """A 2-byte column slice of a block array, read as float16 and widened: shape (n_blocks, 1)."""
    return np.ascontiguousarray(cols).view("<f2").astype(np.float32)


def _nibbles(qs):
    """(n, 16) packed bytes -> (n, 32): low nibbles are elements 0..15, high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _qh_bits(qh_bytes):
    """(n, 4) bytes of a little-endian u32 -> (n, 32) bits, bit i for element i."""
    qh = np.ascontiguousarray(qh_bytes).view("<u4")
    return ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(s):
    """The 12 packed bytes of Q4_K/Q5_K -> (scales, mins), each (n, 8) 6-bit values.

    Sub-blocks 0..3 keep their low 6 bits in bytes 0..3 (scale) and 4..7 (min); sub-blocks 4..7
    keep their low 4 bits in the nibbles of bytes 8..11 and their top 2 bits in the top 2 bits
    of bytes 0..3 (scale) and 4..7 (min).
    """
    sc = np.empty((s.shape[0], 8), np.uint8)
    mn = np.empty((s.shape[0], 8), np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def _k_nibbles(qs):
    """(n, 128) bytes -> (n, 8, 32): each 32 bytes hold sub-block 2c in the low nibbles and
    sub-block 2c+1 in the high nibbles."""
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)


def _two_bits(qs):
    """(n, 64) bytes of Q2_K/Q3_K -> (n, 16, 16) 2-bit values: element 128h + 32j + l of a
    super-block is bits 2j..2j+1 of byte 32h + l."""
    qs = qs.reshape(-1, 2, 1, 32)
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    return ((qs >> shifts) & 3).reshape(-1, 16, 16)


def _q3_k_scales(s):
    """The 12 scale bytes of Q3_K -> (n, 16) 6-bit scales: scale i keeps its low 4 bits in
    nibble i // 8 of byte i % 8 and its top 2 bits in bits 2 (i // 4) of byte 8 + i % 4."""
    low = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)
    high = (s[:, None, 8:12] >> (2 * np.arange(4, dtype=np.uint8))[None, :, None]) & 3
    return low | (high.reshape(-1, 16) << 4)


def _dequantize_blocks(name, b):
    """(n_blocks, block_bytes) uint8 -> (n_blocks, block_elems) float32."""
    if name == "Q8_0":
        return _f16(b[:, 0:2]) * np.ascontiguousarray(b[:, 2:34]).view(np.int8)
    if name == "Q4_0":
        return (_nibbles(b[:, 2:18]).astype(np.float32) - 8) * _f16(b[:, 0:2])
    if name == "Q4_1":
        return _nibbles(b[:, 4:20]) * _f16(b[:, 0:2]) + _f16(b[:, 2:4])
    if name == "Q5_0":
        q = _nibbles(b[:, 6:22]) | (_qh_bits(b[:, 2:6]) << 4)
        return (q.astype(np.float32) - 16) * _f16(b[:, 0:2])
    if name == "Q5_1":
        q = _nibbles(b[:, 8:24]) | (_qh_bits(b[:, 4:8]) << 4)
        return q * _f16(b[:, 0:2]) + _f16(b[:, 2:4])
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _k_scales(b[:, 4:16])
        if name == "Q4_K":
            q = _k_nibbles(b[:, 16:144])
        else:
            # Bit j of qh[l] is bit 4 of element l of sub-block j.
            qh = b[:, 16:48]
            high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            q = _k_nibbles(b[:, 48:176]) | (high << 4)
        scale = (d * sc)[:, :, None]
        offset = (dmin * mn)[:, :, None]
        return (scale * q - offset).reshape(-1, 256)
    if name == "Q6_K":
        # Each half of 128 elements uses 64 bytes of ql and 32 of qh. Element 32k + l of a half
        # takes its low 4 bits from nibble k//2 of ql[32*(k%2) + l] and its high 2 bits from
        # bits 2k..2k+1 of qh[l]; sub-block scale i covers elements 16i..16i+15 of the block.
        ql = b[:, 0:128].reshape(-1, 2, 1, 2, 32)
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 2, 4, 32)
        qh = b[:, 128:192].reshape(-1, 2, 1, 32)
        high = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
        q = (low | (high << 4)).astype(np.float32) - 32
        sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8)
        scale = _f16(b[:, 208:210]) * sc
        return (scale[:, :, None] * q.reshape(-1, 16, 16)).reshape(-1, 256)
    if name == "Q3_K":
        # Bit g of hmask[l] is bit 2 of element 32g + l.
        high = (b[:, None, 0:32] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
        q = (_two_bits(b[:, 32:96]) | (high.reshape(-1, 16, 16) << 2)).astype(np.float32) - 4
        scale = _f16(b[:, 108:110]) * (_q3_k_scales(b[:, 96:108]).astype(np.float32) - 32)
        return (scale[:, :, None] * q).reshape(-1, 256)
    if name == "Q2_K":
        sc = b[:, 0:16]
        scale = _f16(b[:, 80:82]) * (sc & 0x0F)
        offset = _f16(b[:, 82:84]) * (sc >> 4)
        return (scale[:, :, None] * _two_bits(b[:, 16:80]) - offset[:, :, None]).reshape(-1, 256)
    if name == "IQ4_NL":
        return _f16(b[:, 0:2]) * IQ4_VALUES[_nibbles(b[:, 2:18])].astype(np.float32)
    if name == "IQ4_XS":
        # Sub-block i: low 4 bits of its scale in nibble i % 2 of scales_l[i // 2], top 2 in
        # bits 2i of scales_h; its 16 bytes of codes as IQ4_NL's.
        low = np.concatenate([b[:, 4:8, None] & 0x0F, b[:, 4:8, None] >> 4], axis=2)
        high = np.ascontiguousarray(b[:, 2:4]).view("<u2") >> (2 * np.arange(8, dtype=np.uint16))
        ls = low.reshape(-1, 8) | ((high & 3).astype(np.uint8) << 4)
        scale = _f16(b[:, 0:2]) * (ls.astype(np.float32) - 32)
        codes = _nibbles(b[:, 8:136].reshape(-1, 16)).reshape(-1, 8, 32)
        return (scale[:, :, None] * IQ4_VALUES[codes].astype(np.float32)).reshape(-1, 256)
    raise AssertionError(name)


def dequantize(dtype, raw, shape):
    """Decode `raw` bytes of a `dtype` tensor to float32 of `shape`.

    F32 comes back as a zero-copy view of `raw` (read-only when `raw` is a read-only mapping).
    """
    qt = _quant_type(dtype)
    shape = tuple(int(n) for n in shape)
    n = int(np.prod(shape, dtype=np.int64))
    if shape and shape[-1] % qt.block_elems:
        raise ValueError(f"row length {shape[-1]} is not a multiple of the {dtype} block "
                         f"size {qt.block_elems}")
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise ValueError(f"raw data must be uint8, got {raw.dtype}")
    raw = raw.reshape(-1)
    if raw.size != qt.nbytes(n):
        raise ValueError(f"{raw.size} bytes given for {n} {dtype} elements, "
                         f"which take {qt.nbytes(n)}")
    if dtype == "F32":
        return raw.view("<f4").reshape(shape)
    if dtype == "F16":
        return raw.view("<f2").astype(np.float32).reshape(shape)
    if dtype == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    blocks = raw.reshape(-1, qt.block_bytes)
    return _dequantize_blocks(dtype, blocks).reshape(shape)


def _to_f16(x):
    """Round scales to float16, refusing values float16 cannot hold."""
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    if not np.all(np.isfinite(h)):
        raise ValueError("values too large: a block scale overflows float16")
    return h


def _div(x, d):
    """x / d, with 0 where d is 0 (an all-zero block)."""
    return np.divide(x, d, out=np.zeros(np.broadcast_shapes(x.shape, d.shape), np.float32),
                     where=d != 0)


def _pack_nibbles(q):
    """(n, 32) values 0..15 -> (n, 16) bytes, the inverse of _nibbles."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def _pack_qh(high):
    """(n, 32) bits -> (n, 4) bytes of a little-endian u32."""
    word = (high.astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return word.astype("<u4").view(np.uint8).reshape(-1, 4)


def _f16_bytes(h):
    return np.ascontiguousarray(h.astype("<f2")).view(np.uint8).reshape(-1, 2)


def _round_up_f16(x):
    """A float16 >= x: a scale or offset that never clips its block's range (and is not 0
    for a tiny block, where rounding to nearest would give 0)."""
    h = _to_f16(x)
    below = h.astype(np.float32) < x
    h[below] = np.nextafter(h[below], np.float16(np.inf))
    return h


def _quantize_sym(x, levels_neg, levels_pos):
    """Symmetric block: d = signed max / -levels_neg, as ggml's Q4_0/Q5_0 (the value of largest
    magnitude gets the lowest code), its magnitude rounded up to float16 so that a tiny block
    keeps a non-zero scale. Returns (d as f16, q as codes offset by levels_neg)."""
    i = np.argmax(np.abs(x), axis=1)
    vmax = x[np.arange(x.shape[0]), i][:, None]
    d = -np.sign(vmax).astype(np.float16) * _round_up_f16(np.abs(vmax) / levels_neg)
    q = np.clip(np.floor(_div(x, d.astype(np.float32)) + levels_neg + 0.5), 0,
                levels_neg + levels_pos)
    return d, q.astype(np.uint8)


def _quantize_affine(x, levels):
    """Min/scale block (Q4_1, Q5_1): x ~ q*d + m with q in 0..levels."""
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    m = -_round_up_f16(-lo)
    d = _round_up_f16((hi - m.astype(np.float32)) / levels)
    q = np.clip(np.round(_div(x - m.astype(np.float32), d.astype(np.float32))), 0, levels)
    return d, m, q.astype(np.uint8)


def _quantize_k(x, levels, top=63):
    """Q4_K / Q5_K super-blocks: x (n, 8, 32) -> d, dmin (n, 1), sc, mn (n, 8), q (n, 8, 32)
    (Q2_K's: x (n, 16, 16), its scales and mins of 4 bits: top 15).

    Each sub-block covers [-dmin*mn, -dmin*mn + levels*d*sc] with the min and scale rounded up
    to their grid of `top` steps, so the range always holds the sub-block and no value is
    clipped.
    """
    neg_lo = np.maximum(-x.min(axis=2), 0)                        # (n, 8), >= 0
    dmin = _round_up_f16(neg_lo.max(axis=1, keepdims=True) / top)
    mn = np.clip(np.ceil(_div(neg_lo, dmin.astype(np.float32))), 0, top)
    offset = dmin.astype(np.float32) * mn
    scale = (x.max(axis=2) + offset) / levels
    d = _round_up_f16(scale.max(axis=1, keepdims=True) / top)
    sc = np.clip(np.ceil(_div(scale, d.astype(np.float32))), 0, top)
    step = d.astype(np.float32) * sc
    q = np.clip(np.round(_div(x + offset[:, :, None], step[:, :, None])), 0, levels)
    return d, dmin, sc.astype(np.uint8), mn.astype(np.uint8), q.astype(np.uint8)


def _pack_k_scales(sc, mn):
    """(n, 8) scales and mins of 6 bits -> (n, 12) bytes, the inverse of _k_scales."""
    s = np.empty((sc.shape[0], 12), np.uint8)
    s[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    s[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return s


def _pack_k_nibbles(q):
    """(n, 8, 32) values 0..15 -> (n, 128) bytes, the inverse of _k_nibbles."""
    q = q.reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _pack_two_bits(q):
    """(n, 16, 16) values 0..3 -> (n, 64) bytes, the inverse of _two_bits."""
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (q << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(
        axis=2, dtype=np.uint8).reshape(-1, 64)


def _nearest_iq4(x, d):
    """The IQ4_VALUES codes nearest x / d ((n, k) values, d (n, 1)) as uint8."""
    return np.abs(_div(x, d)[..., None] - IQ4_VALUES.astype(np.float32)).argmin(axis=-1) \
        .astype(np.uint8)


def _quantize_blocks(name, x):
    """(n_blocks, block_elems) float32 -> (n_blocks, block_bytes) uint8."""
    if name == "Q8_0":
        amax = np.abs(x).max(axis=1, keepdims=True)
        d = _round_up_f16(amax / 127)
        q = np.clip(np.round(_div(x, d.astype(np.float32))), -127, 127).astype(np.int8)
        return np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=1)
    if name == "Q4_0":
        d, q = _quantize_sym(x, 8, 7)
        return np.concatenate([_f16_bytes(d), _pack_nibbles(q)], axis=1)
    if name == "Q5_0":
        d, q = _quantize_sym(x, 16, 15)
        return np.concatenate([_f16_bytes(d), _pack_qh(q >> 4), _pack_nibbles(q & 0x0F)], axis=1)
    if name == "Q4_1":
        d, m, q = _quantize_affine(x, 15)
        return np.concatenate([_f16_bytes(d), _f16_bytes(m), _pack_nibbles(q)], axis=1)
    if name == "Q5_1":
        d, m, q = _quantize_affine(x, 31)
        return np.concatenate([_f16_bytes(d), _f16_bytes(m), _pack_qh(q >> 4),
                               _pack_nibbles(q & 0x0F)], axis=1)
    if name == "Q4_K":
        d, dmin, sc, mn, q = _quantize_k(x.reshape(-1, 8, 32), 15)
        return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn),
                               _pack_k_nibbles(q)], axis=1)
    if name == "Q5_K":
        d, dmin, sc, mn, q = _quantize_k(x.reshape(-1, 8, 32), 31)
        qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1,
                                                                             dtype=np.uint8)
        return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), qh,
                               _pack_k_nibbles(q & 0x0F)], axis=1)
    if name == "Q6_K":
        # Symmetric 16-element sub-blocks on -31..31 (code 0 = -32 is valid but unused) with a
        # non-negative int8 sub-scale, rounded up so no value is clipped.
        sub = x.reshape(-1, 16, 16)
        scale = np.abs(sub).max(axis=2) / 31                          # (n, 16)
        d = _round_up_f16(scale.max(axis=1, keepdims=True) / 127)
        sc = np.clip(np.ceil(_div(scale, d.astype(np.float32))), 0, 127)
        step = (d.astype(np.float32) * sc)[:, :, None]
        q = (np.clip(np.round(_div(sub, step)), -31, 31) + 32).astype(np.uint8)
        q = q.reshape(-1, 2, 4, 32)                                   # half, k, l
        low, high = q & 0x0F, q >> 4
        ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(-1, 128)
        qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4)
              | (high[:, :, 3] << 6)).reshape(-1, 64)
        return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16_bytes(d)],
                              axis=1)
    if name == "Q2_K":
        d, dmin, sc, mn, q = _quantize_k(x.reshape(-1, 16, 16), 3, top=15)
        return np.concatenate([sc | (mn << 4), _pack_two_bits(q), _f16_bytes(d),
                               _f16_bytes(dmin)], axis=1)
    if name == "Q3_K":
        # Symmetric 16-element sub-blocks on -3..3 (code -4 is valid but unused) with a
        # non-negative scale (stored + 32), rounded up so no value is clipped, as Q6_K's.
        sub = x.reshape(-1, 16, 16)
        scale = np.abs(sub).max(axis=2) / 3
        d = _round_up_f16(scale.max(axis=1, keepdims=True) / 31)
        sc = np.clip(np.ceil(_div(scale, d.astype(np.float32))), 0, 31)
        step = (d.astype(np.float32) * sc)[:, :, None]
        q = (np.clip(np.round(_div(sub, step)), -3, 3) + 4).astype(np.uint8)     # 1..7
        hmask = ((q >> 2).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None]) \
            .sum(axis=1, dtype=np.uint8)
        s = (sc + 32).astype(np.uint8)
        high = ((s >> 4).reshape(-1, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[None, :, None]) \
            .sum(axis=1, dtype=np.uint8)
        scales = np.concatenate([(s[:, 0:8] & 0x0F) | ((s[:, 8:16] & 0x0F) << 4), high], axis=1)
        return np.concatenate([hmask, _pack_two_bits(q & 3), scales, _f16_bytes(d)], axis=1)
    if name == "IQ4_NL":
        # d = the value of largest magnitude / -127 (its magnitude rounded up, as Q4_0's), so
        # that value is about the code of -127.
        i = np.argmax(np.abs(x), axis=1)
        vmax = x[np.arange(x.shape[0]), i][:, None]
        d = -np.sign(vmax).astype(np.float16) * _round_up_f16(np.abs(vmax) / 127)
        return np.concatenate([_f16_bytes(d), _pack_nibbles(_nearest_iq4(x, d.astype(np.float32)))],
                              axis=1)
    if name == "IQ4_XS":
        # Each sub-block's IQ4_NL scale (signed), on a 6-bit grid of d around 32, its magnitude
        # rounded up (never 0 for a block that is not all zeros).
        sub = x.reshape(-1, 8, 32)
        i = np.argmax(np.abs(sub), axis=2)
        step = np.take_along_axis(sub, i[:, :, None], axis=2)[:, :, 0] / -127
        d = _round_up_f16(np.abs(step).max(axis=1, keepdims=True) / 31)
        grid = np.clip(np.ceil(_div(np.abs(step), d.astype(np.float32))), 0, 31)
        ls = (np.sign(step) * grid + 32).astype(np.uint8)
        dl = (d.astype(np.float32) * (ls.astype(np.float32) - 32)).reshape(-1, 1)
        codes = _nearest_iq4(sub.reshape(-1, 32), dl)
        scales_h = ((ls >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))).sum(
            axis=1, dtype=np.uint16).astype("<u2").view(np.uint8).reshape(-1, 2)
        scales_l = (ls[:, 0::2] & 0x0F) | ((ls[:, 1::2] & 0x0F) << 4)
        return np.concatenate([_f16_bytes(d), scales_h, scales_l,
                               _pack_nibbles(codes).reshape(-1, 128)], axis=1)
    raise AssertionError(name)


def quantize(dtype, x):
    """Encode float values `x` as `dtype`, row by row along the last axis -> 1-D uint8 bytes."""
    qt = _quant_type(dtype)
    x = np.asarray(x, dtype=np.float32)
    if x.ndim and x.shape[-1] % qt.block_elems:
        raise ValueError(f"row length {x.shape[-1]} is not a multiple of the {dtype} block "
                         f"size {qt.block_elems}")
    if dtype == "F32":
        return np.ascontiguousarray(x, dtype="<f4").reshape(-1).view(np.uint8)
    if dtype == "F16":
        return np.ascontiguousarray(x, dtype="<f2").reshape(-1).view(np.uint8)
    if dtype == "BF16":
        bits = np.ascontiguousarray(x).reshape(-1).view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
        rounded[np.isnan(x.reshape(-1))] = 0x7FC0
        return rounded.view(np.uint8)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"cannot quantize non-finite values to {dtype}")
    blocks = x.reshape(-1, qt.block_elems)
    return _quantize_blocks(dtype, blocks).reshape(-1)
