"""Weight layouts on the device, and how kernels read them.

A weight matrix [rows, cols] stays in its file's number format (F16, BF16, F32 or a block
quantisation) but is stored as 32-bit words in "planes", so every target can read it with
aligned 32-bit loads (wgpu's shader translator has no 8- or 16-bit storage): a block format's
scales go to one plane and its quants to another, each row of a plane padded to whole words.
`planes(dtype, raw)` makes the planes on the host from the file's bytes; `BlockReader` emits the
kernel code that turns one block of a row into float32 values. Both follow the ggml block
definitions (see poot/formats/quants.py).
"""
from dataclasses import dataclass

import numpy as np

from ..formats.quants import QUANTS
from .lang import F32, I32, U32

DEVICE_DTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


def _words(rows_bytes):
    """uint8 [rows, n] -> uint32 [rows, ceil(n/4)] (zero-padded), little-endian."""
    rows, n = rows_bytes.shape
    padded = np.zeros((rows, -(-n // 4) * 4), np.uint8)
    padded[:, :n] = rows_bytes
    return padded.view("<u4")


def planes(dtype, raw, shape):
    """Device planes (name -> uint32 [rows, words]) of a weight stored as `raw` file bytes."""
    rows, cols = shape
    if dtype not in DEVICE_DTYPES:
        raise ValueError(f"no device layout for {dtype}")
    q = QUANTS[dtype]
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // q.block_elems, q.block_bytes)
    if dtype in ("F32", "F16", "BF16"):
        return {"values": _words(blocks.reshape(rows, -1))}
    if dtype == "Q8_0":                       # f16 d, 32 x i8
        return {"scales": _words(blocks[:, :, :2].reshape(rows, -1)),
                "quants": _words(blocks[:, :, 2:].reshape(rows, -1))}
    if dtype == "Q4_0":                       # f16 d, 16 bytes of nibbles
        return {"scales": _words(blocks[:, :, :2].reshape(rows, -1)),
                "quants": _words(blocks[:, :, 2:].reshape(rows, -1))}
    # Q4_1: f16 d, f16 m (one word per block), 16 bytes of nibbles
    return {"scales": _words(blocks[:, :, :4].reshape(rows, -1)),
            "quants": _words(blocks[:, :, 4:].reshape(rows, -1))}


@dataclass(frozen=True)
class BlockReader:
    """Kernel-side decoding of one block of a weight row.

    `block_elems` values per block, read as `quant_words` u32 words of the quants plane (or of
    the values plane for plain floats). `decode(k, buffers, row_words, block)` returns the
    block's values as a list of f32 Values in element order.
    """
    dtype: str
    block_elems: int
    quant_words: int

    @property
    def plane_names(self):
        return ("values",) if self.dtype in ("F32", "F16", "BF16") else ("scales", "quants")

    def row_words(self, plane, cols):
        """u32 words per row of a plane for a row of `cols` values."""
        nb = cols // QUANTS[self.dtype].block_elems
        per_block = {"values": QUANTS[self.dtype].block_bytes, "quants": self.quant_words * 4,
                     "scales": 4 if self.dtype == "Q4_1" else 2}[plane]
        return -(-nb * per_block // 4)

    def decode(self, k, buf, row, block, cols):
        """The f32 values of block `block` of row `row`; `buf` maps plane name -> Buffer."""
        n_words = self.quant_words
        plane = "values" if "values" in buf else "quants"
        base = row * self.row_words(plane, cols) + block * n_words
        words = []
        for i in range(0, n_words, 4):
            width = 4 if n_words - i >= 4 else (2 if n_words - i >= 2 else 1)
            got = buf[plane].load(base + i, width) if width > 1 else (buf[plane][base + i],)
            words += list(got)
        if self.dtype == "F32":
            return [w.bitcast(F32) for w in words]
        if self.dtype == "F16":
            return [h for w in words for h in k.unpack_half2(w)]
        if self.dtype == "BF16":
            return [v for w in words for v in ((w << 16).bitcast(F32),
                                               (w & 0xFFFF0000).bitcast(F32))]
        srow = row * self.row_words("scales", cols)
        if self.dtype == "Q4_1":
            d, m = k.unpack_half2(buf["scales"][srow + block])
        else:                                   # two f16 scales per word
            pair = k.unpack_half2(buf["scales"][srow + (block >> 1)])
            d = k.select((block & 1).eq(0), pair[0], pair[1])
        if self.dtype == "Q8_0":
            return [((w.bitcast(I32) << (24 - 8 * j)) >> 24).to(F32) * d
                    for w in words for j in range(4)]
        low = [((w >> (8 * j)) & 0xF).to(F32) for w in words for j in range(4)]
        high = [((w >> (8 * j + 4)) & 0xF).to(F32) for w in words for j in range(4)]
        if self.dtype == "Q4_0":
            return [(q - 8.0) * d for q in low + high]
        return [k.fma(q, d, m) for q in low + high]


def reader(dtype, block_for_float=8):
    """The BlockReader of a device dtype. Plain floats are read `block_for_float` at a time."""
    if dtype == "F32":
        return BlockReader(dtype, block_for_float, block_for_float)
    if dtype in ("F16", "BF16"):
        return BlockReader(dtype, block_for_float, block_for_float // 2)
    if dtype == "Q8_0":
        return BlockReader(dtype, 32, 8)
    if dtype in ("Q4_0", "Q4_1"):
        return BlockReader(dtype, 32, 4)
    raise ValueError(f"no device layout for {dtype}")
