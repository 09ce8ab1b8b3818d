"""Weight layouts on the device, and how kernels read them.

A weight matrix [rows, cols] stays in its file's number format (F16, BF16, F32 or a block
quantisation) but is stored as 32-bit words in "planes", so every target can read it with
aligned 32-bit loads (wgpu's shader translator has no 8- or 16-bit storage): each field of the
format's block (scales, quants, high bits...) goes to its own plane, each row of a plane padded
to whole words. `planes(dtype, raw)` makes them on the host from the file's bytes; a
`BlockReader` emits the kernel code that turns one unit of a row (8 to 64 values) into float32
values. Both follow the ggml block definitions (see poot/formats/quants.py). Formats beyond the
first eight are one entry each of UNIT_FORMATS (below): the words a unit of 32 values loads and
how they become values and scales, which every weight-reading kernel takes from the reader.
"""
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..formats.quants import IQ4_VALUES, QUANTS
from .lang import F32, I32, U32

# dtype -> the planes of its file block: (name, first byte, end byte), and the values one
# decode unit yields.
LAYOUTS = {
    "F32": ((("values", 0, 4),), 8),
    "F16": ((("values", 0, 2),), 8),
    "BF16": ((("values", 0, 2),), 8),
    "Q8_0": ((("scales", 0, 2), ("quants", 2, 34)), 32),          # f16 d, 32 x i8
    "Q4_0": ((("scales", 0, 2), ("quants", 2, 18)), 32),          # f16 d, 32 nibbles
    "Q4_1": ((("scales", 0, 4), ("quants", 4, 20)), 32),          # f16 d, f16 m, 32 nibbles
    "Q4_K": ((("head", 0, 16), ("quants", 16, 144)), 64),         # d, dmin, 12 B scales; 256 nibbles
    "Q6_K": ((("ql", 0, 128), ("qh", 128, 192), ("scales", 192, 208), ("d", 208, 210)), 32),
    # the formats of UNIT_FORMATS (below): a unit is 32 consecutive values
    "Q5_0": ((("scales", 0, 2), ("high", 2, 6), ("quants", 6, 22)), 32),     # f16 d, u32 qh
    "Q5_1": ((("scales", 0, 4), ("high", 4, 8), ("quants", 8, 24)), 32),     # d, m, u32 qh
    "Q5_K": ((("head", 0, 16), ("high", 16, 48), ("quants", 48, 176)), 32),  # Q4_K's + qh[32]
    "Q3_K": ((("high", 0, 32), ("quants", 32, 96), ("scales", 96, 108), ("d", 108, 110)), 32),
    "Q2_K": ((("scales", 0, 16), ("quants", 16, 80), ("dm", 80, 84)), 32),
    "IQ4_NL": ((("scales", 0, 2), ("quants", 2, 18)), 32),
    "IQ4_XS": ((("head", 0, 8), ("quants", 8, 136)), 32),   # d, scales_h, scales_l[4]
}
DEVICE_DTYPES = tuple(LAYOUTS)


def _words(rows_bytes):
    """uint8 [rows, n] -> uint32 [rows, ceil(n/4)] (zero-padded), little-endian: a view of
    rows_bytes where it is whole words in one piece (an F16 weight's file bytes: no copy of
    gigabytes at startup)."""
    rows, n = rows_bytes.shape
    if n % 4 == 0 and rows_bytes.flags.c_contiguous and rows_bytes.ctypes.data % 4 == 0:
        return rows_bytes.view("<u4")
    padded = np.zeros((rows, -(-n // 4) * 4), np.uint8)
    padded[:, :n] = rows_bytes
    return padded.view("<u4")


def planes(dtype, raw, shape):
    """Device planes (name -> uint32 [rows, words]) of a weight stored as `raw` file bytes."""
    rows, cols = shape
    if dtype not in LAYOUTS:
        raise ValueError(f"no device layout for {dtype}")
    q = QUANTS[dtype]
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // q.block_elems, q.block_bytes)
    return {name: _words(blocks[:, :, start:end].reshape(rows, -1))
            for name, start, end in LAYOUTS[dtype][0]}


@dataclass(frozen=True)
class BlockReader:
    """Kernel-side decoding of a weight row, `block_elems` values (one unit) at a time."""
    dtype: str

    @property
    def block_elems(self):
        return LAYOUTS[self.dtype][1]

    @property
    def plane_names(self):
        return tuple(name for name, _, _ in LAYOUTS[self.dtype][0])

    def row_words(self, plane, cols):
        """u32 words per row of a plane, for a row of `cols` values (an int, or an i32 Value in
        a kernel: the rounding up is written so both divide the same way)."""
        q = QUANTS[self.dtype]
        start, end = next((s, e) for name, s, e in LAYOUTS[self.dtype][0] if name == plane)
        return (cols // q.block_elems * (end - start) + 3) // 4

    def _words(self, k, buf, plane, row, cols, first, count):
        """`count` consecutive words of a row of a plane, from word `first`, in wide loads."""
        base = row * self.row_words(plane, cols) + first
        words = []
        for i in range(0, count, 4):
            width = min(4, count - i)
            got = buf[plane].load(base + i, width) if width > 1 else (buf[plane][base + i],)
            words += list(got)
        return words

    @property
    def scales_per_unit(self):
        """Scales a unit's values take (decode_scaled's segments): 2 for Q4_K and Q6_K."""
        return UNIT_FORMATS[self.dtype].scales if self.dtype in UNIT_FORMATS else \
            2 if self.dtype in ("Q4_K", "Q6_K") else 1

    def unit_words(self, k, buf, row, unit, cols):
        """The words a unit of a UNIT_FORMATS format reads, in its loads' order (flat)."""
        return [w for plane, first, n in UNIT_FORMATS[self.dtype].loads(unit)
                for w in self._words(k, buf, plane, row, cols, first, n)]

    def unit_segments(self, k, words, unit):
        """decode_scaled's segments of a UNIT_FORMATS unit from its unit_words."""
        return UNIT_FORMATS[self.dtype].segments(k, words, unit)

    def decode(self, k, buf, row, unit, cols):
        """The f32 values of unit `unit` of row `row`; `buf` maps plane name -> Buffer."""
        out = []
        for values, scale, low in self.decode_scaled(k, buf, row, unit, cols):
            if scale is None:
                out += values
            elif low is None:
                out += [v * scale for v in values]
            else:
                out += [k.fma(v, scale, low) for v in values]
        return out

    def decode_scaled(self, k, buf, row, unit, cols):
        """Unit `unit` of row `row` as segments [(values, scale, low)] of consecutive values,
        whose f32 values are value * scale + low (scale and low None where they do not apply),
        so a dot product scales once per segment: sum(v * x) * scale + low * sum(x). Block
        quants give their bare quants, a segment a scale (Q4_K two of 32, Q6_K two of 16);
        float formats their values, one segment."""
        d = self.dtype
        if d in UNIT_FORMATS:
            return self.unit_segments(k, self.unit_words(k, buf, row, unit, cols), unit)
        words = lambda plane, first, n: self._words(k, buf, plane, row, cols, first, n)  # noqa
        if d in ("F32", "F16", "BF16"):
            per_unit = 8 if d == "F32" else 4
            ws = words("values", unit * per_unit, per_unit)
            if d == "F32":
                return [([w.bitcast(F32) for w in ws], None, None)]
            if d == "F16":
                return [([h for w in ws for h in k.unpack_half2(w)], None, None)]
            return [([v for w in ws for v in ((w << 16).bitcast(F32),
                                              (w & 0xFFFF0000).bitcast(F32))], None, None)]
        if d in ("Q8_0", "Q4_0", "Q4_1"):
            qs = words("quants", unit * (8 if d == "Q8_0" else 4), 8 if d == "Q8_0" else 4)
            srow = row * self.row_words("scales", cols)
            if d == "Q4_1":
                scale, low = k.unpack_half2(buf["scales"][srow + unit])
            else:                                     # two f16 scales per word
                pair = k.unpack_half2(buf["scales"][srow + (unit >> 1)])
                scale = k.select((unit & 1).eq(0), pair[0], pair[1])
            if d == "Q8_0":
                return [([_small_int(w >> (8 * j), 0xFF, 128) for w in qs for j in range(4)],
                         scale, None)]
            bias = 8 if d == "Q4_0" else 0
            nibbles = _nibbles(qs, 0, bias) + _nibbles(qs, 4, bias)
            return [(nibbles, scale, None if d == "Q4_0" else low)]
        if d == "Q4_K":
            return self._q4_k(k, words, unit)
        return self._q6_k(k, buf, words, row, unit, cols)

    def _q4_k(self, k, words, unit):
        """Unit = the pair of 32-value sub-blocks (2p, 2p+1) of super-block b: the low then the
        high nibbles of 32 quant bytes, each sub-block x = d*sc*q - dmin*m with 6-bit sc, m."""
        b, p = unit >> 2, unit & 3
        head = words("head", b * 4, 4)
        d, dmin = k.unpack_half2(head[0])
        byte = lambda i: (head[1 + i // 4] >> (8 * (i % 4))) & 0xFF  # noqa: E731
        scale, minimum = [], []                      # 6-bit (sc, m) of sub-blocks 0..7
        for j in range(8):
            if j < 4:
                scale.append(byte(j) & 63)
                minimum.append(byte(j + 4) & 63)
            else:
                scale.append((byte(j + 4) & 0xF) | ((byte(j - 4) >> 6) << 4))
                minimum.append((byte(j + 4) >> 4) | ((byte(j) >> 6) << 4))
        qs = words("quants", b * 32 + p * 8, 8)
        segments = []
        for half, shift in ((0, 0), (1, 4)):
            j = _pick(k, p, [scale[2 * i + half] for i in range(4)])
            m = _pick(k, p, [minimum[2 * i + half] for i in range(4)])
            factor, offset = d * _small_int(j, 63, 0), dmin * _small_int(m, 63, 0)
            segments.append((_nibbles(qs, shift), factor, -offset))
        return segments

    def _q6_k(self, k, buf, words, row, unit, cols):
        """Unit = 32 values of super-block b, half h, group g: 4 low bits from ql (low or high
        nibbles of 32 bytes), 2 high bits from qh, x = d * sc * (q - 32), an int8 scale per 16."""
        b, h, g = unit >> 3, (unit >> 2) & 1, unit & 3
        ql = words("ql", b * 32 + h * 16 + (g & 1) * 8, 8)
        qh = words("qh", b * 16 + h * 8, 8)
        low_shift, high_shift = (g >> 1) * 4, g * 2
        pair = k.unpack_half2(buf["d"][row * self.row_words("d", cols) + (b >> 1)])
        d = k.select((b & 1).eq(0), pair[0], pair[1])
        segments = []
        for part in range(2):                        # values 0..15 and 16..31 of the unit
            index = h * 8 + g * 2 + part
            word = words("scales", b * 4 + (index >> 2), 1)[0]
            sc = ((word.bitcast(I32) << (24 - 8 * (index & 3))) >> 24).to(F32) * d
            values = []
            for w_low, w_high in zip(ql[part * 4:part * 4 + 4], qh[part * 4:part * 4 + 4]):
                for j in range(4):
                    low = (w_low >> (8 * j + low_shift)) & 0xF
                    high = (w_high >> (8 * j + high_shift)) & 3
                    values.append(_small_int(low | (high << 4), 0x3F, 32))
            segments.append((values, sc, None))
        return segments


MAGIC = 0x4B000000      # the f32 2^23: OR-ed into the low bits, an integer below 2^23 is added


def _small_int(bits, mask, bias):
    """(bits & mask) - bias as f32 for a mask below 2^23, without an integer-to-float
    conversion (a quarter-rate instruction on NVIDIA GPUs, which the dequantising matvecs
    would otherwise be bound by): 2^23 + (bits & mask) is the f32 of those bits OR-ed under
    2^23's, and subtracting 2^23 + bias is exact. For a signed byte (mask 0xFF, bias 128),
    the sign bit is flipped first."""
    flip = 0x80 if (mask, bias) == (0xFF, 128) else 0
    return ((bits & mask) ^ (MAGIC | flip)).bitcast(F32) - float(2 ** 23 + bias)


def _nibbles(words, shift, bias=0):
    """The 4-bit values at `shift` of every byte of `words`, byte order, less `bias`, as f32."""
    return [_small_int(w >> (8 * j + shift), 0xF, bias) for w in words for j in range(4)]


def _pick(k, index, choices):
    """choices[index] for a small run-time index, by selects."""
    out = choices[-1]
    for i in range(len(choices) - 2, -1, -1):
        out = k.select(index.eq(i), choices[i], out)
    return out


# -- formats decoded 32 consecutive values a unit, in two phases ---------------------------------
@dataclass(frozen=True)
class UnitFormat:
    """A block format read a unit of 32 consecutive values at a time, its loads apart from its
    arithmetic so that a kernel may load units ahead (mma_vec's pipeline) and any kernel decodes
    them alike: `loads(unit)` -> [(plane, first word, words)] relative to the row; `segments(k,
    words, unit)` -> decode_scaled's [(values, scale, low)] from those words, flat in order;
    `scales`: the segments a unit has."""
    loads: Callable
    segments: Callable
    scales: int = 1


def _half_of(k, word, odd):
    """The f16 of a word's high half where `odd` is 1, else of its low half, as f32."""
    pair = k.unpack_half2(word)
    return k.select(odd.eq(0), pair[0], pair[1])


def _five_bit(words, high, bias):
    """Q5_0/Q5_1 values: the nibbles of 4 words (low ones values 0..15, high ones 16..31) with
    bit i of the word `high` as bit 4 of value i, less `bias`, as f32."""
    out = []
    for shift in (0, 4):
        for i, w in enumerate(words):
            for e in range(4):
                n = shift * 4 + 4 * i + e             # the value's index in the block
                bit = (high >> (n - 4)) & 0x10 if n >= 4 else (high << (4 - n)) & 0x10
                out.append(_small_int(((w >> (8 * e + shift)) & 0xF) | bit, 0x1F, bias))
    return out


def _q5_0(k, words, unit):
    """x = (q - 16) * d."""
    pair, high, *qs = words
    return [(_five_bit(qs, high, 16), _half_of(k, pair, unit & 1), None)]


def _q5_1(k, words, unit):
    """x = q * d + m."""
    dm, high, *qs = words
    d, m = k.unpack_half2(dm)
    return [(_five_bit(qs, high, 0), d, m)]


def _k_scale_min(k, head, j):
    """The 6-bit (scale, min) of sub-block j (a run-time 0..7) of a Q4_K/Q5_K super-block from
    its head words (d and dmin, then 12 bytes; formats/quants.py's _k_scales), as f32."""
    shift = (j & 3) * 8
    a, b, c = [(w >> shift) & 0xFF for w in head[1:]]    # bytes j%4, 4 + j%4, 8 + j%4
    first = j < 4
    sc = k.select(first, a & 63, (c & 0xF) | ((a >> 6) << 4))
    m = k.select(first, b & 63, (c >> 4) | ((b >> 6) << 4))
    return _small_int(sc, 63, 0), _small_int(m, 63, 0)


def _q5_k_loads(unit):
    b, j = unit >> 3, unit & 7
    return [("head", b * 4, 4), ("high", b * 8, 8), ("quants", b * 32 + (j >> 1) * 8, 8)]


def _q5_k(k, words, unit):
    """Unit = sub-block j of super-block b: the low (j even) or high nibbles of its pair's 32
    quant bytes, bit j of the 32 qh bytes as bit 4; x = d*sc*q - dmin*m."""
    head, high, qs = words[:4], words[4:12], words[12:]
    j = unit & 7
    shift = (j & 1) * 4
    values = []
    for w, h in zip(qs, high):
        q = ((w >> shift) & 0x0F0F0F0F) | (((h >> j) & 0x01010101) << 4)
        values += [_small_int(q >> (8 * e), 0x1F, 0) for e in range(4)]
    d, dmin = k.unpack_half2(head[0])
    sc, m = _k_scale_min(k, head, j)
    return [(values, d * sc, -(dmin * m))]


def _two_bit_loads(unit):
    """Q3_K/Q2_K: unit u is 32 values of super-block b = u // 8, its half h = u // 4 % 2 and
    2-bit position j = u % 4: bits 2j of the 32 quant bytes of the half."""
    return unit >> 3, (unit >> 2) & 1, unit & 3


def _q3_k(k, words, unit):
    """x = d * (sc - 32) * (q - 4): q's low 2 bits from qs, bit u % 8 of the 32 hmask bytes its
    bit 2; a 6-bit scale per 16 values (formats/quants.py's _q3_k_scales)."""
    high, qs, low_word, high_word, pair = words[:8], words[8:16], words[16], words[17], words[18]
    b, h, j = _two_bit_loads(unit)
    shift, bit = j * 2, unit & 7
    values = []
    for w, hw in zip(qs, high):
        q = ((w >> shift) & 0x03030303) | (((hw >> bit) & 0x01010101) << 2)
        values += [_small_int(q >> (8 * e), 7, 4) for e in range(4)]
    d = _half_of(k, pair, b & 1)
    segments = []
    for part in range(2):                        # scale 8h + 2j + part: byte (2j + part) % 4
        byte = (j & 1) * 16 + 8 * part           # ... of word j // 2 (low), of word 2 (high)
        sc = ((low_word >> (byte + h * 4)) & 0xF) | \
            (((high_word >> (byte + h * 4 + (j >> 1) * 2)) & 3) << 4)
        segments.append((values[16 * part:16 * part + 16], d * _small_int(sc, 63, 32), None))
    return segments


def _q2_k(k, words, unit):
    """x = d * sc * q - dmin * m: q the bits 2j of the half's 32 quant bytes; a byte of 4-bit
    scale and min per 16 values."""
    scales, qs, dm = words[0], words[1:9], words[9]
    _, _, j = _two_bit_loads(unit)
    shift = j * 2
    values = [_small_int(((w >> shift) & 0x03030303) >> (8 * e), 3, 0) for w in qs
              for e in range(4)]
    d, dmin = k.unpack_half2(dm)
    segments = []
    for part in range(2):                        # scale byte (2j + part) % 4 of the word
        sc = scales >> ((j & 1) * 16 + 8 * part)
        segments.append((values[16 * part:16 * part + 16], d * _small_int(sc, 0xF, 0),
                         -(dmin * _small_int(sc >> 4, 0xF, 0))))
    return segments


# IQ4_VALUES[i] = 16 i - 12 (i // 8) - 127 + c_i, c_i in 0..14: the c_i, 4 bits each, of codes
# 0..7 in one word and of 8..15 in another (a lookup of one select and shifts, fewer registers
# than one among four words of the values themselves)
IQ4_OFFSETS = [sum((int(IQ4_VALUES[8 * h + j]) - 16 * (8 * h + j) + 12 * h + 127) << (4 * j)
                   for j in range(8)) for h in range(2)]


def _iq4(k, words):
    """The IQ4_VALUES of the codes in 4 words (nibbles as Q4_0's: low ones values 0..15), as
    f32, by IQ4_OFFSETS."""
    out = []
    for shift in (0, 4):
        for w in words:
            for e in range(4):
                code = (w >> (8 * e + shift)) & 0xF
                high = code >> 3
                offsets = k.select(high.eq(0), k.const(IQ4_OFFSETS[0], U32),
                                   k.const(IQ4_OFFSETS[1], U32))
                bits = (code << 4) - high * 12 + ((offsets >> ((code & 7) << 2)) & 0xF)
                out.append(_small_int(bits, 0xFF, 127))
    return out


def _iq4_xs(k, words, unit):
    """Sub-block i = u % 8: x = d * (ls - 32) * IQ4_VALUES[q], ls's low 4 bits in nibble i % 2
    of byte i // 2 of scales_l, its top 2 in bits 2i of scales_h."""
    head, qs = words[:2], words[2:]
    i = unit & 7
    d = k.unpack_half2(head[0])[0]
    ls = ((head[1] >> (i << 2)) & 0xF) | (((head[0] >> ((i << 1) + 16)) & 3) << 4)
    return [(_iq4(k, qs), d * _small_int(ls, 63, 32), None)]


UNIT_FORMATS = {
    "Q5_0": UnitFormat(lambda u: [("scales", u >> 1, 1), ("high", u, 1), ("quants", u * 4, 4)],
                       _q5_0),
    "Q5_1": UnitFormat(lambda u: [("scales", u, 1), ("high", u, 1), ("quants", u * 4, 4)],
                       _q5_1),
    "Q5_K": UnitFormat(_q5_k_loads, _q5_k),
    "Q3_K": UnitFormat(lambda u: [("high", (u >> 3) * 8, 8),
                                  ("quants", (u >> 3) * 16 + ((u >> 2) & 1) * 8, 8),
                                  ("scales", (u >> 3) * 3 + ((u & 3) >> 1), 1),
                                  ("scales", (u >> 3) * 3 + 2, 1), ("d", u >> 4, 1)],
                       _q3_k, scales=2),
    "Q2_K": UnitFormat(lambda u: [("scales", (u >> 3) * 4 + ((u >> 2) & 1) * 2 + ((u & 3) >> 1),
                                   1), ("quants", (u >> 3) * 16 + ((u >> 2) & 1) * 8, 8),
                                  ("dm", u >> 3, 1)],
                       _q2_k, scales=2),
    "IQ4_NL": UnitFormat(lambda u: [("scales", u >> 1, 1), ("quants", u * 4, 4)],
                         lambda k, words, u: [(_iq4(k, words[1:]), _half_of(k, words[0], u & 1),
                                               None)]),
    "IQ4_XS": UnitFormat(lambda u: [("head", (u >> 3) * 2, 2), ("quants", u * 4, 4)], _iq4_xs),
}


def reader(dtype):
    if dtype not in LAYOUTS:
        raise ValueError(f"no device layout for {dtype}")
    return BlockReader(dtype)
