"""x rounded to the tensor cores' 16-bit operand, as mma_vec's and mma_tiled's B words take
it: the operand type of a weight format, two values in a word, the order of a run's values in
mma_vec's words, and a token's row normed (the RMSNorm before a matmul, made once a step).
"""
from .lang import BF16, F16, F32, U16, U32
from .ops import block_reduce
from .quant import reader


def mma_operand(dtype):
    """The 16-bit type W (and x) are rounded to for the tensor cores: bf16 for BF16 weights
    (f16 could not hold their range), f16 for the others (F32 and block-quant weights rounded)."""
    reader(dtype)
    return BF16 if dtype == "BF16" else F16


def pack(k, operand, lo, hi):
    """One u32 word of two f32 values rounded to the operand type, lo in the low half."""
    if operand == F16:
        return k.pack_half2(lo, hi)
    bits = lambda v: v.to(BF16).bitcast(U16).to(U32)  # noqa: E731
    return bits(lo) | (bits(hi) << 16)


def quant_pairs(dtype):
    """Whether mma_vec pairs a 4-value run (a, b, c, d) of x as (a, c), (b, d) in its B words
    (block quants: a quant word's nibbles or bytes 0 and 2 make one f16 pair), else (a, b),
    (c, d)."""
    return dtype not in ("F16", "BF16")


def normed_row(k, dtype, subgroup_size, gain, x16, first_read, second_read, base, cols, eps,
               scratch):
    """norm_x16's words of the token whose row starts at `base`, by the whole workgroup
    (every thread calls it: it waits at barriers), summing through `scratch` (f32, a word a
    subgroup)."""
    operand, pairs = mma_operand(dtype), quant_pairs(dtype)
    first = k.thread_id() * 4
    square = k.var(F32, 0.0)
    with k.for_(first, cols, k.workgroup[0] * 4) as i:
        for v in first_read(base, i):
            square.set(k.fma(v, v, square.get()))
    total = block_reduce(k, square.get(), subgroup_size, scratch)
    scale = k.rsqrt(total / cols.to(F32) + eps)
    with k.for_(first, cols, k.workgroup[0] * 4) as i:
        a, b, c, d = [v * scale * w for v, w in zip(second_read(base, i), gain.load(i, 4))]
        lo, hi = ((a, c), (b, d)) if pairs else ((a, b), (c, d))
        x16.store((base + i) >> 1, pack(k, operand, *lo), pack(k, operand, *hi))
