"""Renderers: the kernel language (poot/kernels/lang.py) turned into target code, one module per
target. They produce text or words and never touch a driver. This module holds what they share:
the bit patterns of floating-point constants."""
import numpy as np


def f32_bits(x):
    with np.errstate(over="ignore"):
        return int(np.array(x, np.float32).view(np.uint32))


def f16_bits(x):
    with np.errstate(over="ignore"):
        return int(np.array(x, np.float16).view(np.uint16))


def bf16_bits(x):
    """f32 -> bf16, round to nearest even (NaN stays a quiet NaN)."""
    bits = f32_bits(x)
    if (bits & 0x7FFFFFFF) > 0x7F800000:
        return (bits >> 16) | 0x0040
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
