"""ggml block layouts: hand-built blocks decoded by element-wise readings of the published block
definitions, quantise -> dequantise round trips, and the `gguf` package (by the ggml authors) as
an independent oracle where installed."""

import struct

import numpy as np
import pytest

from poot.formats.quants import GGML_TYPES, QUANTS, dequantize, quantize

QUANT_NAMES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K",
               "IQ4_NL", "IQ4_XS"]
F32 = np.float32


def rng_and_seed():
    seed = np.random.SeedSequence().entropy
    return np.random.default_rng(seed), seed


def f16(x):
    return struct.pack("<e", x)


def f16_value(rng):
    """A random float16 scale (as float32), never zero."""
    return F32(np.float16(rng.uniform(0.001, 0.1) * rng.choice([-1, 1])))


# --- element-wise references, transcribed from the block definitions -----------------------

def ref_q8_0(block):
    d = F32(struct.unpack_from("<e", block, 0)[0])
    return [d * F32(q) for q in struct.unpack_from("<32b", block, 2)]


def ref_q4_0(block):
    d = F32(struct.unpack_from("<e", block, 0)[0])
    qs = block[2:18]
    return [F32((qs[j] & 15) - 8) * d for j in range(16)] + \
           [F32((qs[j] >> 4) - 8) * d for j in range(16)]


def ref_q4_1(block):
    d, m = (F32(v) for v in struct.unpack_from("<2e", block, 0))
    qs = block[4:20]
    return [F32(qs[j] & 15) * d + m for j in range(16)] + \
           [F32(qs[j] >> 4) * d + m for j in range(16)]


def ref_q5_0(block):
    d = F32(struct.unpack_from("<e", block, 0)[0])
    (qh,) = struct.unpack_from("<I", block, 2)
    qs = block[6:22]
    lo = [F32(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - 16) * d for j in range(16)]
    hi = [F32(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16) * d for j in range(16)]
    return lo + hi


def ref_q5_1(block):
    d, m = (F32(v) for v in struct.unpack_from("<2e", block, 0))
    (qh,) = struct.unpack_from("<I", block, 4)
    qs = block[8:24]
    lo = [F32((qs[j] & 15) | (((qh >> j) & 1) << 4)) * d + m for j in range(16)]
    hi = [F32((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) * d + m for j in range(16)]
    return lo + hi


def scale_min_k4(j, s):
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


def ref_q4_k(block, five_bit=False):
    d, dmin = (F32(v) for v in struct.unpack_from("<2e", block, 0))
    scales = block[4:16]
    qh = block[16:48] if five_bit else bytes(32)
    qs = block[48:176] if five_bit else block[16:144]
    out = []
    for c in range(4):                       # 64 elements: two sub-blocks share 32 bytes
        for half in range(2):
            j = 2 * c + half
            sc, m = scale_min_k4(j, scales)
            d1, m1 = d * F32(sc), dmin * F32(m)
            for l in range(32):
                q = (qs[32 * c + l] >> (4 * half)) & 15
                q += 16 if qh[l] & (1 << j) else 0
                out.append(d1 * F32(q) - m1)
    return out


def ref_q5_k(block):
    return ref_q4_k(block, five_bit=True)


def ref_q6_k(block):
    ql, qh = block[0:128], block[128:192]
    sc = struct.unpack_from("<16b", block, 192)
    d = F32(struct.unpack_from("<e", block, 208)[0])
    y = [None] * 256
    for n in range(2):
        for l in range(32):
            i = l // 16
            b_ql, b_qh, b_sc, base = ql[64 * n:], qh[32 * n:], sc[8 * n:], 128 * n
            q1 = ((b_ql[l] & 0xF) | (((b_qh[l] >> 0) & 3) << 4)) - 32
            q2 = ((b_ql[l + 32] & 0xF) | (((b_qh[l] >> 2) & 3) << 4)) - 32
            q3 = ((b_ql[l] >> 4) | (((b_qh[l] >> 4) & 3) << 4)) - 32
            q4 = ((b_ql[l + 32] >> 4) | (((b_qh[l] >> 6) & 3) << 4)) - 32
            y[base + l] = d * F32(b_sc[i]) * F32(q1)
            y[base + l + 32] = d * F32(b_sc[i + 2]) * F32(q2)
            y[base + l + 64] = d * F32(b_sc[i + 4]) * F32(q3)
            y[base + l + 96] = d * F32(b_sc[i + 6]) * F32(q4)
    return y


def ref_q3_k(block):
    hmask, qs, raw = block[0:32], block[32:96], block[96:108]
    d = F32(struct.unpack_from("<e", block, 108)[0])
    # 16 scales of 6 bits: the low nibbles of bytes 0..7, then their high nibbles; the top 2
    # bits of scale i in bits 2 (i // 4) of byte 8 + i % 4
    low = [b & 15 for b in raw[0:8]] + [b >> 4 for b in raw[0:8]]
    scales = [low[i] | (((raw[8 + i % 4] >> (2 * (i // 4))) & 3) << 4) for i in range(16)]
    out, m, i = [], 1, 0
    for n in range(2):
        q = qs[32 * n:]
        for shift in (0, 2, 4, 6):
            for half in range(2):
                dl = d * F32(scales[i] - 32)
                i += 1
                for l in range(16 * half, 16 * half + 16):
                    out.append(dl * F32(((q[l] >> shift) & 3) - (0 if hmask[l] & m else 4)))
            m <<= 1
    return out


def ref_q2_k(block):
    scales, qs = block[0:16], block[16:80]
    d, dmin = (F32(v) for v in struct.unpack_from("<2e", block, 80))
    out, i = [], 0
    for n in range(2):
        q = qs[32 * n:]
        for shift in (0, 2, 4, 6):
            for half in range(2):
                dl, ml = d * F32(scales[i] & 15), dmin * F32(scales[i] >> 4)
                i += 1
                out += [dl * F32((q[l] >> shift) & 3) - ml for l in range(16 * half, 16 * half + 16)]
    return out


KVALUES = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]


def ref_iq4_nl(block):
    d = F32(struct.unpack_from("<e", block, 0)[0])
    qs = block[2:18]
    return [d * F32(KVALUES[qs[j] & 15]) for j in range(16)] + \
           [d * F32(KVALUES[qs[j] >> 4]) for j in range(16)]


def ref_iq4_xs(block):
    d = F32(struct.unpack_from("<e", block, 0)[0])
    (scales_h,) = struct.unpack_from("<H", block, 2)
    scales_l, qs = block[4:8], block[8:136]
    out = []
    for ib in range(8):
        ls = ((scales_l[ib // 2] >> (4 * (ib % 2))) & 15) | (((scales_h >> (2 * ib)) & 3) << 4)
        dl = d * F32(ls - 32)
        q = qs[16 * ib:]
        out += [dl * F32(KVALUES[q[j] & 15]) for j in range(16)]
        out += [dl * F32(KVALUES[q[j] >> 4]) for j in range(16)]
    return out


REFERENCES = {"Q8_0": ref_q8_0, "Q4_0": ref_q4_0, "Q4_1": ref_q4_1, "Q5_0": ref_q5_0,
              "Q5_1": ref_q5_1, "Q4_K": ref_q4_k, "Q5_K": ref_q5_k, "Q6_K": ref_q6_k,
              "Q3_K": ref_q3_k, "Q2_K": ref_q2_k, "IQ4_NL": ref_iq4_nl, "IQ4_XS": ref_iq4_xs}


def random_block(name, rng):
    """A valid block: random f16 scales at their offsets, random bytes everywhere else."""
    qt = QUANTS[name]
    block = bytearray(rng.integers(0, 256, qt.block_bytes, dtype=np.uint8).tobytes())
    scale_offsets = {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2],
                     "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q3_K": [108],
                     "Q2_K": [80, 82], "IQ4_NL": [0], "IQ4_XS": [0]}[name]
    for at in scale_offsets:
        block[at:at + 2] = f16(float(f16_value(rng)))
    return bytes(block)


# --- tests -----------------------------------------------------------------------------------

def test_block_sizes_match_the_definitions():
    sizes = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 2 + 32),
             "Q4_0": (32, 2 + 16), "Q4_1": (32, 4 + 16), "Q5_0": (32, 2 + 4 + 16),
             "Q5_1": (32, 4 + 4 + 16), "Q4_K": (256, 4 + 12 + 128),
             "Q5_K": (256, 4 + 12 + 32 + 128), "Q6_K": (256, 128 + 64 + 16 + 2),
             "Q3_K": (256, 32 + 64 + 12 + 2), "Q2_K": (256, 16 + 64 + 4),
             "IQ4_NL": (32, 2 + 16), "IQ4_XS": (256, 2 + 2 + 4 + 128)}
    assert {n: (q.block_elems, q.block_bytes) for n, q in QUANTS.items()} == sizes
    for name, qt in QUANTS.items():
        assert GGML_TYPES[qt.ggml_type] == name
    assert GGML_TYPES[16] == "IQ2_XXS" and "IQ2_XXS" not in QUANTS
    assert QUANTS["Q4_K"].nbytes(512) == 288
    with pytest.raises(ValueError, match="not a whole number"):
        QUANTS["Q4_0"].nbytes(33)


@pytest.mark.parametrize("name", QUANT_NAMES)
def test_random_blocks_decode_as_the_definition_says(name):
    rng, seed = rng_and_seed()
    blocks = [random_block(name, rng) for _ in range(3)]
    expected = np.array(sum((REFERENCES[name](b) for b in blocks), []), dtype=np.float32)
    raw = np.frombuffer(b"".join(blocks), np.uint8)
    n = QUANTS[name].block_elems
    got = dequantize(name, raw, (3, n))
    np.testing.assert_array_equal(got.reshape(-1), expected, err_msg=f"seed {seed}")


def test_q4_0_pinned_values():
    # d = 0.5; byte j holds element j in its low nibble and element j+16 in its high nibble.
    block = f16(0.5) + bytes([0x1F] + [0x88] * 15)
    y = dequantize("Q4_0", np.frombuffer(block, np.uint8), (32,))
    assert y[0] == (15 - 8) * 0.5 and y[16] == (1 - 8) * 0.5
    assert np.all(y[1:16] == 0) and np.all(y[17:] == 0)


def test_q4_1_pinned_values():
    block = f16(0.25) + f16(-1.0) + bytes([0xF0] + [0] * 15)
    y = dequantize("Q4_1", np.frombuffer(block, np.uint8), (32,))
    assert y[0] == -1.0 and y[16] == 15 * 0.25 - 1.0 and y[1] == -1.0


def test_q5_0_high_bits_come_from_qh():
    # Bit 3 of qh is the fifth bit of element 3; bit 20 that of element 20.
    qh = (1 << 3) | (1 << 20)
    block = f16(1.0) + struct.pack("<I", qh) + bytes([0x00] * 16)
    y = dequantize("Q5_0", np.frombuffer(block, np.uint8), (32,))
    assert y[3] == 0 and y[20] == 0          # (0 | 16) - 16
    assert y[0] == -16 and y[31] == -16


def test_q5_1_pinned_values():
    block = f16(2.0) + f16(0.5) + struct.pack("<I", 1 << 31) + bytes([0xF0] * 16)
    y = dequantize("Q5_1", np.frombuffer(block, np.uint8), (32,))
    assert y[31] == (15 | 16) * 2.0 + 0.5 and y[30] == 15 * 2.0 + 0.5 and y[0] == 0.5


def test_q8_0_pinned_values():
    block = f16(0.125) + struct.pack("<32b", *range(-16, 16))
    y = dequantize("Q8_0", np.frombuffer(block, np.uint8), (32,))
    np.testing.assert_array_equal(y, np.arange(-16, 16) * 0.125)


def test_q4_k_scale_unpacking_of_an_upper_sub_block():
    # Sub-block 5: scale = low nibble of byte 9 | top 2 bits of byte 1 << 4;
    #              min   = high nibble of byte 9 | top 2 bits of byte 5 << 4.
    scales = bytearray(12)
    scales[9] = 0x3A            # scale low 4 bits = 10, min low 4 bits = 3
    scales[1] = 0b10 << 6       # scale high bits = 2 -> scale = 42
    scales[5] = 0b01 << 6       # min high bits = 1 -> min = 19
    qs = bytearray(128)
    qs[64 + 0] = 0x70           # chunk 2 holds sub-blocks 4 (low) and 5 (high nibble): q = 7
    block = f16(0.5) + f16(0.25) + bytes(scales) + bytes(qs)
    y = dequantize("Q4_K", np.frombuffer(block, np.uint8), (256,))
    assert y[5 * 32] == 0.5 * 42 * 7 - 0.25 * 19
    assert y[5 * 32 + 1] == -0.25 * 19
    assert y[4 * 32] == 0.0     # sub-block 4 has scale and min 0


def test_q6_k_pinned_values():
    ql, qh, sc = bytearray(128), bytearray(64), bytearray(16)
    ql[0] = 0x21                # element 0 low bits 1, element 64 low bits 2
    qh[0] = 0b11_00_00_10       # element 0 high bits 2, element 96 high bits 3
    sc[0], sc[4], sc[6] = 3, 0xFE, 1   # scale of elements 0..15, 64..79 (-2), 96..111
    block = bytes(ql) + bytes(qh) + bytes(sc) + f16(0.5)
    y = dequantize("Q6_K", np.frombuffer(block, np.uint8), (256,))
    assert y[0] == 0.5 * 3 * ((1 | 2 << 4) - 32)
    assert y[64] == 0.5 * -2 * (2 - 32)
    assert y[96] == 0.5 * 1 * ((0 | 3 << 4) - 32)


# Worst-case error of one value, as a fraction of its block's largest magnitude (or range):
# half a quantisation step, plus slack for the f16 scale and the 6/8-bit sub-block scales.
# IQ4's codes are uneven: half its widest gap (127 to 104) and its positive end (113 for 127).
STEP_BOUND = {"Q8_0": 0.5 / 127, "Q4_0": 1 / 8, "Q5_0": 1 / 16, "Q4_1": 0.5 / 15,
              "Q5_1": 0.5 / 31, "Q4_K": 1 / 15, "Q5_K": 1 / 31, "Q6_K": 1 / 31, "Q3_K": 1 / 3,
              "Q2_K": 1 / 3, "IQ4_NL": 14 / 127, "IQ4_XS": 2 * 14 / 127}


@pytest.mark.parametrize("name", QUANT_NAMES)
def test_round_trip_error_is_within_half_a_step(name):
    rng, seed = rng_and_seed()
    qt = QUANTS[name]
    x = (rng.standard_normal((6, 2 * qt.block_elems)) * rng.uniform(0.01, 10)).astype(np.float32)
    x[0] += 3.0                                        # an offset row (all positive-ish)
    raw = quantize(name, x)
    assert raw.dtype == np.uint8 and raw.size == qt.nbytes(x.size)
    y = dequantize(name, raw, x.shape)
    blocks_x = x.reshape(-1, qt.block_elems)
    err = np.abs(y.reshape(-1, qt.block_elems) - blocks_x).max(axis=1)
    span = np.abs(blocks_x).max(axis=1)
    if name in ("Q4_1", "Q5_1"):
        span = blocks_x.max(axis=1) - blocks_x.min(axis=1)
    if name in ("Q4_K", "Q5_K", "Q2_K"):
        span = 2 * np.abs(blocks_x).max(axis=1)
    assert np.all(err <= span * STEP_BOUND[name] * 1.01 + 1e-6), f"seed {seed}"
    rel_rms = np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2))
    assert rel_rms < {"Q8_0": 0.01, "Q6_K": 0.03, "Q2_K": 0.45, "Q3_K": 0.3}.get(name, 0.2), \
        f"seed {seed}"


@pytest.mark.parametrize("name", QUANT_NAMES)
def test_awkward_blocks_stay_valid(name):
    n = QUANTS[name].block_elems
    rows = np.stack([
        np.zeros(n),                                   # all zero: scales 0
        np.full(n, -2.5),                              # constant negative
        np.full(n, 7.0),                               # constant positive
        np.linspace(1e-6, 3e-6, n),                    # tiny: subnormal f16 scales
        np.where(np.arange(n) % 2, 1000.0, -0.001),    # wide dynamic range
    ]).astype(np.float32)
    y = dequantize(name, quantize(name, rows), rows.shape)
    assert np.all(np.isfinite(y))
    np.testing.assert_array_equal(y[0], 0)
    span = np.abs(rows).max(axis=1, keepdims=True)
    bound = {"Q3_K": 1 / 6, "Q2_K": 1 / 3, "IQ4_NL": 0.12, "IQ4_XS": 0.12}.get(name, 0.08)
    # IQ4's scale of the tiny block is f16's smallest step (below its ideal 3e-6 / 127), its
    # values up to half the widest gap of its codes (23) from their nearest
    slack = 12 * 2.0 ** -24 if name.startswith("IQ4") else 1e-9
    assert np.all(np.abs(y - rows) <= span * bound + slack)


@pytest.mark.parametrize("name", QUANT_NAMES + ["F16", "BF16"])
def test_gguf_package_decodes_our_blocks_identically(name):
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf.constants import GGMLQuantizationType

    rng, seed = rng_and_seed()
    x = rng.standard_normal((4, 512)).astype(np.float32)
    raw = quantize(name, x)
    theirs = gguf_quants.dequantize(raw.reshape(4, -1), GGMLQuantizationType[name])
    np.testing.assert_array_equal(dequantize(name, raw, x.shape), theirs, err_msg=f"seed {seed}")


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16"])
def test_we_decode_the_gguf_packages_blocks_identically(name):
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf.constants import GGMLQuantizationType

    rng, seed = rng_and_seed()
    x = rng.standard_normal((4, 256)).astype(np.float32)
    raw = gguf_quants.quantize(x, GGMLQuantizationType[name])
    np.testing.assert_array_equal(dequantize(name, raw.reshape(-1), x.shape),
                                  gguf_quants.dequantize(raw, GGMLQuantizationType[name]),
                                  err_msg=f"seed {seed}")


def test_plain_float_types():
    rng, seed = rng_and_seed()
    x = rng.standard_normal((3, 5)).astype(np.float32)
    raw = quantize("F32", x)
    y = dequantize("F32", raw, x.shape)
    np.testing.assert_array_equal(y, x)
    assert np.shares_memory(y, raw)                    # F32 decodes to a view
    np.testing.assert_array_equal(dequantize("F16", quantize("F16", x), x.shape),
                                  x.astype(np.float16).astype(np.float32))
    b = dequantize("BF16", quantize("BF16", x), x.shape)
    assert np.all(np.abs(b - x) <= np.abs(x) * 2 ** -8), f"seed {seed}"


def test_bf16_rounds_to_nearest_even():
    one_ulp = 2 ** -7                                  # bf16 ulp at 1.0
    x = np.array([1 + one_ulp / 2, 1 + 3 * one_ulp / 2, 1 + one_ulp / 4, -2.0, np.inf, np.nan],
                 np.float32)
    bits = quantize("BF16", x).view("<u2")
    assert list(bits[:5]) == [0x3F80, 0x3F82, 0x3F80, 0xC000, 0x7F80]
    assert np.isnan(dequantize("BF16", quantize("BF16", x), x.shape)[5])


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="unsupported dtype 'IQ2_XXS'"):
        dequantize("IQ2_XXS", np.zeros(66, np.uint8), (256,))
    with pytest.raises(ValueError, match="bytes given"):
        dequantize("Q8_0", np.zeros(33, np.uint8), (32,))
    with pytest.raises(ValueError, match="row length 48"):
        dequantize("Q8_0", np.zeros(51, np.uint8), (48,))
    with pytest.raises(ValueError, match="row length 100"):
        quantize("Q4_K", np.ones((2, 100), np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        quantize("Q4_0", np.full(32, np.nan, np.float32))
    with pytest.raises(ValueError, match="overflows float16"):
        quantize("Q8_0", np.full(32, 1e10, np.float32))


@pytest.mark.parametrize("dtype", ["F16", "Q4_0", "Q4_K"])
def test_device_planes_hold_the_file_bytes(dtype):
    """kernels.quant.planes: each plane the file's bytes of its part of every block, whole words
    a row (zero-padded); an F16 weight's one plane is a view of the file's bytes (no copy of
    gigabytes at startup), read-only ones included."""
    from poot.kernels.quant import LAYOUTS, planes
    rows, cols = 6, 512
    raw = quantize(dtype, np.random.default_rng().standard_normal((rows, cols), np.float32))
    raw = np.frombuffer(raw.tobytes(), np.uint8)             # read-only, as a mapped file's
    got = planes(dtype, raw, (rows, cols))
    blocks = raw.reshape(rows, -1, QUANTS[dtype].block_bytes)
    for name, start, end in LAYOUTS[dtype][0]:
        part = blocks[:, :, start:end].reshape(rows, -1)
        words = got[name].view(np.uint8).reshape(rows, -1)
        assert np.array_equal(words[:, :part.shape[1]], part) and not words[:, part.shape[1]:].any()
    if dtype == "F16":
        assert np.shares_memory(got["values"], raw)
