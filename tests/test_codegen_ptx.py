"""poot/codegen/ptx.py: kernels of the kernel language rendered to PTX, assembled, and run.

Each test kernel below comes with its numpy reference. Together they use every op of lang.py,
every dtype and every cast pair, vector loads and stores of widths 1/2/4 in global and shared
memory, nested if/else/for, vars, subgroup operations, barriers and early returns.

- `ptxas -arch=sm_XX` assembles every kernel for sm_80/86/89/90 (skipped, saying why, without
  ptxas); an error fails with ptxas's message and the PTX lines it names. The matrix operations,
  asynchronous copies and f16x2 arithmetic have cases of their own (PTX_ONLY_CASES: the other
  renderers refuse them), and the tensor-core matmul's pipelines under measurement must
  assemble without spilling registers (the runner's own tensor-core kernels are held to their
  spill bounds by test_kernel_sources.py, which assembles each of them once).
- With libcuda and a device, every kernel runs on fresh random inputs, its outputs poisoned with
  0xFF bytes first, and is compared with numpy: exact for integers and correctly rounded float
  operations, per-op bounds for the approximate math functions (see TOLERANCES).

    python -m pytest tests/test_codegen_ptx.py
"""

import os
import re
import secrets
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pytest

from poot.codegen.ptx import (PTX_CAPS, PTX_VERSION, SHARED_LIMIT, _shared_offsets,
                              dynamic_shared_bytes, kernel_params, ptx_caps, render_ptx)
from poot.errors import ModelRefused
from poot.kernels import lang, matmul
from poot.kernels.lang import (BF16, BOOL, F16, F32, I8, I16, I32, I64, U8, U16, U32, U64,
                               Kernel, KernelBuilder)
from poot.kernels.quant import DEVICE_DTYPES
from tests.test_kernel_sources import mma_variant_kernels, spilled_past_bound

SMS = (80, 86, 89, 90)
NUMERIC = (F32, F16, BF16, I8, U8, I16, U16, I32, U32, I64, U64)
INTEGERS = (I8, U8, I16, U16, I32, U32, I64, U64)
NP = {F32: np.float32, F16: np.float16, BF16: np.uint16, I8: np.int8, U8: np.uint8,
      I16: np.int16, U16: np.uint16, I32: np.int32, U32: np.uint32, I64: np.int64,
      U64: np.uint64}
CTYPE = {"u64": "CUdeviceptr", "i32": "int32_t", "u32": "uint32_t", "f32": "float"}
THREADS = 256
BLOCKS = 2
N = THREADS * BLOCKS

# Accuracy of the approximate f32 functions as rendered (relative, absolute), from the PTX ISA's
# documented bounds for ex2/lg2/rsqrt/sin/cos/tanh.approx, with a margin.
TOLERANCES = {
    "exp": (2e-6, 0.0),       # ex2.approx with an exactly split argument: ~2 ulp
    "exp2": (2e-6, 0.0),
    "log": (2e-6, 3e-7),      # lg2.approx: absolute error near 1
    "log2": (2e-6, 3e-7),
    "sqrt": (0.0, 0.0),       # sqrt.rn: correctly rounded
    "rsqrt": (1e-6, 0.0),
    "sin": (0.0, 2e-6),       # sin/cos.approx after reduction to [-pi, pi]: absolute
    "cos": (0.0, 2e-6),
    "tanh": (6e-4, 1e-6),     # tanh.approx: 2^-11 relative
}


# -- numpy helpers -------------------------------------------------------------------------------
def bf16_to_f32(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def as_f32(x, dtype):
    return bf16_to_f32(x) if dtype == BF16 else np.asarray(x).astype(np.float32)


def from_f32(x, dtype):
    return f32_to_bf16(x) if dtype == BF16 else np.asarray(x, np.float32).astype(NP[dtype])


def random(rng, dtype, n, low=-10.0, high=10.0):
    if dtype in (F32, F16):
        return rng.uniform(low, high, n).astype(NP[dtype])
    if dtype == BF16:
        return f32_to_bf16(rng.uniform(low, high, n))
    info = np.iinfo(NP[dtype])
    return rng.integers(info.min, info.max, n, dtype=NP[dtype], endpoint=True)


def trunc_div(a, b):
    """Integer division rounding toward zero (numpy's // floors), in the operands' type."""
    q = a // b
    fix = ((a - q * b) != 0) & ((a < 0) != (b < 0))
    return q + fix.astype(q.dtype)


def wide(dtype):
    return np.uint64 if dtype.kind == "u" else np.int64


def shift(a, amount, dtype, left):
    w = wide(dtype)
    x, s = a.astype(w), np.asarray(amount).astype(w)
    return (x << s if left else x >> s).astype(NP[dtype])


def cast_reference(x, src, dst):
    """lang.py's numeric conversion, as rendered for PTX (float -> int truncates, saturating)."""
    if dst == BOOL:
        return ((x & 0x7FFF) != 0) if src == BF16 else (x != 0)
    if src == BOOL:
        ones = {F32: np.float32(1), F16: np.float16(1), BF16: np.uint16(0x3F80)}
        return np.where(x, ones.get(dst, 1), 0).astype(NP[dst])
    if src.kind in ("f", "bf") and dst.kind in ("f", "bf"):
        return from_f32(as_f32(x, src), dst)
    if src.kind in ("f", "bf"):
        info = np.iinfo(NP[dst])
        t = np.trunc(as_f32(x, src).astype(np.float64))
        return np.clip(t, float(info.min), float(info.max)).astype(NP[dst])
    if dst == BF16:
        return f32_to_bf16(x.astype(np.float32))
    return x.astype(NP[dst])


# -- cases ---------------------------------------------------------------------------------------
@dataclass
class Case:
    """A kernel, its launch grid, its inputs and the outputs numpy expects."""
    kernel: Kernel
    grid: tuple
    inputs: dict                                   # buffer or scalar name -> array or number
    expected: dict                                 # output buffer name -> array
    tolerance: dict = field(default_factory=dict)  # output name -> (rtol, atol) where not exact


def global_id(k, threads=THREADS):
    return k.block_id() * threads + k.thread_id()


ARITH_FLOAT = ("add", "sub", "mul", "div", "rem", "min", "max", "neg", "abs", "floor", "select",
               "and", "or", "xor", "not")
ARITH_INT = ("add", "sub", "mul", "div", "rem", "min", "max", "neg", "abs", "select", "and", "or",
             "xor", "not", "shl", "shr", "shl_const", "shr_const")


def arith_case(dtype, rng):
    """Every binary, compare, select, fma and the non-transcendental unary ops on one dtype.
    `out` is exact (bit for bit, for floats too); `fused` holds fma."""
    ops = ARITH_FLOAT if dtype.kind == "f" else ARITH_INT
    k = KernelBuilder(f"arith_{dtype.name}", (THREADS,))
    bufs = [k.buffer(name, dtype) for name in "abc"]
    amounts = k.buffer("s", U32)
    out, cmp = k.buffer("out", dtype, "w"), k.buffer("cmp", U8, "w")
    fused = k.buffer("fused", dtype, "w")
    i = global_id(k)
    a, b, c = (buf[i] for buf in bufs)
    bits = dtype.bits
    results = {
        "add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b, "div": lambda: a / b,
        "rem": lambda: a % b, "min": lambda: k.min(a, b), "max": lambda: k.max(a, b),
        "neg": lambda: -a, "abs": lambda: k.abs(a),
        "floor": lambda: k.floor(a), "select": lambda: k.select(a < b, a, c),
        "and": lambda: a & b, "or": lambda: a | b, "xor": lambda: a ^ b, "not": lambda: ~a,
        "shl": lambda: a << (b & (bits - 1)), "shr": lambda: a >> amounts[i],
        "shl_const": lambda: a << 3, "shr_const": lambda: a >> 2,
    }
    for j, op in enumerate(ops):
        out[i * len(ops) + j] = results[op]()
    fused[i] = k.fma(a, b, c)
    for j, r in enumerate((a < b, a <= b, a > b, a >= b, a.eq(b), a.ne(b))):
        cmp[i * 6 + j] = r.to(U8)

    if dtype.kind == "f":
        a_, b_, c_ = (random(rng, dtype, N) for _ in range(3))
        b_ = np.where(np.abs(b_) < 0.25, np.asarray(0.5, NP[dtype]), b_)
    else:
        a_, b_, c_ = (random(rng, dtype, N) for _ in range(3))
    b_[::7] = a_[::7]                       # some equal pairs for the comparisons
    if dtype.kind != "f":
        b_[b_ == 0] = 3
        if dtype.kind == "i":
            b_[b_ == -1] = 2                # MIN / -1 overflows
    s_ = rng.integers(0, bits, N).astype(np.uint32)
    T = NP[dtype]
    u = {2: np.uint16, 4: np.uint32}.get(np.dtype(T).itemsize)
    with np.errstate(all="ignore"):
        ref = {
            "add": a_ + b_, "sub": a_ - b_, "mul": a_ * b_, "min": np.minimum(a_, b_),
            "max": np.maximum(a_, b_), "neg": -a_, "select": np.where(a_ < b_, a_, c_),
        }
        if dtype.kind == "f":
            ref.update({
                "div": a_ / b_, "rem": np.fmod(a_, b_), "abs": np.abs(a_), "floor": np.floor(a_),
                "and": (a_.view(u) & b_.view(u)).view(T), "or": (a_.view(u) | b_.view(u)).view(T),
                "xor": (a_.view(u) ^ b_.view(u)).view(T), "not": (~a_.view(u)).view(T)})
        else:
            ref.update({
                "div": trunc_div(a_, b_), "rem": a_ - trunc_div(a_, b_) * b_,
                "abs": a_ if dtype.kind == "u" else np.abs(a_),
                "and": a_ & b_, "or": a_ | b_, "xor": a_ ^ b_, "not": ~a_,
                "shl": shift(a_, b_ & (bits - 1), dtype, True), "shr": shift(a_, s_, dtype, False),
                "shl_const": shift(a_, 3, dtype, True), "shr_const": shift(a_, 2, dtype, False)})
    expected_out = np.stack([np.asarray(ref[op], T) for op in ops], axis=1).reshape(-1)
    compares = np.stack([a_ < b_, a_ <= b_, a_ > b_, a_ >= b_, a_ == b_, a_ != b_], axis=1)
    expected = {"out": expected_out, "cmp": compares.astype(np.uint8).reshape(-1)}
    tolerance = {}
    if dtype.kind == "f":
        # The reference rounds twice (f64, then the type): one ulp.
        expected["fused"] = (a_.astype(np.float64) * b_ + c_).astype(T)
        tolerance["fused"] = (2.0 ** -23 if dtype == F32 else 2.0 ** -10, 0.0)
    else:
        with np.errstate(all="ignore"):
            expected["fused"] = a_ * b_ + c_
    return Case(k.build(), (BLOCKS,), {"a": a_, "b": b_, "c": c_, "s": s_}, expected, tolerance)


MATH_DOMAINS = {  # f32 and f16 input ranges per function
    "exp": ((-80, 80), (-10, 10)), "exp2": ((-120, 120), (-14, 15)),
    "log": ((-7, 9), (-4, 6)), "log2": ((-7, 9), (-4, 6)),      # exponents of e
    "sqrt": ((0, 1e4), (0, 1e4)), "rsqrt": ((1e-3, 1e4), (1e-2, 1e4)),
    "sin": ((-100, 100), (-30, 30)), "cos": ((-100, 100), (-30, 30)), "tanh": ((-5, 5), (-5, 5)),
}


def math_case(dtype, rng):
    """The transcendental unary functions, each on its own domain."""
    names = tuple(MATH_DOMAINS)
    k = KernelBuilder(f"math_{dtype.name}", (THREADS,))
    x, out = k.buffer("x", dtype), k.buffer("out", dtype, "w")
    i = global_id(k)
    for j, name in enumerate(names):
        index = i * len(names) + j
        out[index] = getattr(k, name)(x[index])
    columns = []
    for name in names:
        low, high = MATH_DOMAINS[name][dtype != F32]
        values = rng.uniform(low, high, N)
        if name == "exp" and dtype == F32:      # around and past overflow: inf, never NaN
            values[::7] = rng.uniform(88.0, 89.5, len(values[::7]))
            values[3::29] = rng.uniform(89.5, 300.0, len(values[3::29]))
        if name in ("log", "log2"):
            values = np.exp(values)
            values[::5] = rng.uniform(0.5, 2.0, len(values[::5]))   # around 1
        columns.append(values)
    x_ = np.stack(columns, axis=1).reshape(-1).astype(NP[dtype])
    xs = x_.astype(np.float64).reshape(N, len(names))
    fns = {"exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2, "sqrt": np.sqrt,
           "rsqrt": lambda v: 1 / np.sqrt(v), "sin": np.sin, "cos": np.cos, "tanh": np.tanh}
    ref = np.stack([fns[name](xs[:, j]) for j, name in enumerate(names)], axis=1)
    if dtype == F32:
        rtol = np.array([TOLERANCES[name][0] for name in names])
        atol = np.array([TOLERANCES[name][1] for name in names])
    else:   # f16: the f32 result rounded once more, ~1 ulp of f16
        rtol = np.full(len(names), 2.0 ** -10)
        atol = np.full(len(names), 2e-6)
    tolerance = {"out": (np.tile(rtol, N), np.tile(atol, N))}
    with np.errstate(over="ignore"):            # exp past f32's range: inf is the answer
        want = ref.reshape(-1).astype(NP[dtype])
    return Case(k.build(), (BLOCKS,), {"x": x_}, {"out": want}, tolerance)


def cast_case(src, rng):
    """src -> every numeric dtype, src -> bool, and bool -> every numeric dtype."""
    k = KernelBuilder(f"cast_from_{src.name}", (THREADS,))
    x = k.buffer("x", src)
    to = {d: k.buffer(f"to_{d.name}", d, "w") for d in NUMERIC}
    from_bool = {d: k.buffer(f"bool_to_{d.name}", d, "w") for d in NUMERIC}
    i = global_id(k)
    value = x[i]
    flag = value.to(BOOL)
    for d in NUMERIC:
        to[d][i] = value.to(d)
        from_bool[d][i] = flag.to(d)
    if src.kind in ("f", "bf"):
        x_ = random(rng, F32, N, -120.0, 120.0)
        x_[::11] = np.round(x_[::11])             # exact integers
        x_[5::13] = 1000.5                        # past the 8-bit ranges: saturates
        x_[6::13] = -70000.25                     # past the 16-bit ranges (f16: -inf)
    else:
        x_ = random(rng, src, N)
    x_[::9] = 0                                   # false, for the bool casts
    with np.errstate(over="ignore"):              # values past 65504 become f16 inf, as meant
        x_ = from_f32(x_, src) if src.kind in ("f", "bf") else x_
        expected = {f"to_{d.name}": cast_reference(x_, src, d) for d in NUMERIC}
    flag_ = cast_reference(x_, src, BOOL)
    expected.update({f"bool_to_{d.name}": cast_reference(flag_, BOOL, d) for d in NUMERIC})
    return Case(k.build(), (BLOCKS,), {"x": x_}, expected)


BITCASTS = ((F32, I32), (I32, U32), (U32, F32), (F16, I16), (I16, U16), (U16, F16), (BF16, U16),
            (U16, BF16), (BF16, F16), (I8, U8), (U8, I8), (I64, U64), (U64, I64))


def bitcast_case(rng):
    k = KernelBuilder("bitcasts", (THREADS,))
    i = global_id(k)
    inputs, expected = {}, {}
    for n, (src, dst) in enumerate(BITCASTS):
        x, out = k.buffer(f"x{n}", src), k.buffer(f"y{n}", dst, "w")
        out[i] = x[i].bitcast(dst)
        inputs[f"x{n}"] = random(rng, src, N)
        expected[f"y{n}"] = inputs[f"x{n}"].view(NP[dst])
    return Case(k.build(), (BLOCKS,), inputs, expected)


def memory_case(dtype, rng):
    """Global loads (read-only: ld.global.nc; read-write: ld.global) and stores of width 4, 2 and
    1, through a shared array with vector and scalar accesses and a barrier."""
    k = KernelBuilder(f"memory_{dtype.name}", (THREADS,))
    src, inout, dst = k.buffer("src", dtype), k.buffer("inout", dtype, "rw"), \
        k.buffer("dst", dtype, "w")
    back = k.buffer("back", dtype, "w")
    tile = k.shared("tile", dtype, 4 * THREADS)
    t = k.thread_id()
    base = global_id(k) * 4
    tile.store(t * 4, *src.load(base, 4))
    k.barrier()
    neighbour = ((t + 1) % THREADS) * 4
    first = tile.load(neighbour, 2)
    second = tile.load(neighbour + 2, 2)
    far = tile.load(((t + 3) % THREADS) * 4 + 1)
    dst.store(base, *first)
    dst.store(base + 2, second[1])
    dst[base + 3] = far
    k.barrier()
    tile.store(t * 4, first[1], first[0])
    tile[t * 4 + 2] = far
    k.barrier()
    back.store(base, *tile.load(t * 4, 4))
    row = inout.load(base, 4)
    pair = inout.load(base, 2)
    inout.store(base, row[3], row[2], row[1], pair[0])
    inout.store(base, row[3], pair[1])

    src_, inout_ = random(rng, dtype, 4 * N), random(rng, dtype, 4 * N)
    s = src_.reshape(BLOCKS, THREADS, 4)
    d = np.empty_like(s)
    d[:, :, 0:2] = np.roll(s, -1, axis=1)[:, :, 0:2]
    d[:, :, 2] = np.roll(s, -1, axis=1)[:, :, 3]
    d[:, :, 3] = np.roll(s, -3, axis=1)[:, :, 1]
    b = np.stack([d[:, :, 1], d[:, :, 0], d[:, :, 3], s[:, :, 3]], axis=2)
    r = inout_.reshape(-1, 4)
    after = np.stack([r[:, 3], r[:, 1], r[:, 1], r[:, 0]], axis=1)
    return Case(k.build(), (BLOCKS,), {"src": src_, "inout": inout_},
                {"dst": d.reshape(-1), "inout": after.reshape(-1), "back": b.reshape(-1)})


def control_case(rng):
    """Nested if/else and for (int and Value steps, unrolled or not), vars of i32 and bool, an
    integer used as a condition, scalar parameters and an early return."""
    threads = 64
    k = KernelBuilder("control", (threads,))
    x, out = k.buffer("x", I32), k.buffer("out", I32, "w")
    count, step = k.scalar("count", I32), k.scalar("step", I32)
    scale, offset = k.scalar("scale", F32), k.scalar("offset", U32)
    fout = k.buffer("fout", F32, "w")
    i = global_id(k, threads)
    with k.if_(i >= count):
        k.return_()
    # Initial values as Values: lang.py's var() numbers a Python-number init wrongly (see report).
    acc, flag = k.var(I32, k.const(1, I32)), k.var(BOOL, k.const(False, BOOL))
    xi = x[i]
    limit = (xi & 15) + 1
    with k.for_(0, limit) as j:
        with k.if_((j % 3).eq(0)) as branch:
            acc.set(acc.get() + j * xi)
        with k.else_(branch):
            with k.if_(j > 4):
                with k.for_(j, limit + 3, step) as m:
                    acc.set(acc.get() ^ (m + 1))
                flag.set(~flag.get())
            with k.for_(0, 6, 2, unroll=True) as u:
                acc.set(acc.get() - u)
    with k.if_(xi & 16):
        acc.set(acc.get() * 3)
    out[2 * i] = acc.get()
    out[2 * i + 1] = k.select(flag.get(), k.const(1, I32), -1)
    fout[i] = xi.to(F32) * scale + offset.to(F32)

    blocks, count_, step_ = 4, 4 * threads - 37, 2
    x_ = rng.integers(-1000, 1000, blocks * threads, dtype=np.int32)
    out_ = np.full(2 * blocks * threads, -1, np.int32)     # the poison: threads that returned
    fout_ = np.full(blocks * threads, 0xFFFFFFFF, np.uint32).view(np.float32)
    scale_, offset_ = np.float32(rng.uniform(0.5, 2.0)), int(rng.integers(1, 100))
    for n in range(count_):
        v = int(x_[n])
        total, toggled = 1, False
        for j in range(0, (v & 15) + 1):
            if j % 3 == 0:
                total += j * v
            else:
                if j > 4:
                    for m in range(j, (v & 15) + 1 + 3, step_):
                        total ^= m + 1
                    toggled = not toggled
                for u in range(0, 6, 2):
                    total -= u
        if v & 16:
            total *= 3
        out_[2 * n] = np.int64(total).astype(np.int32)
        out_[2 * n + 1] = 1 if toggled else -1
        fout_[n] = np.float32(v) * scale_ + np.float32(offset_)
    inputs = {"x": x_, "count": count_, "step": step_, "scale": float(scale_), "offset": offset_}
    return Case(k.build(), (blocks,), inputs, {"out": out_, "fout": fout_})


SUBGROUP_TYPES = (F32, F16, BF16, I8, U8, I16, U16, I32, U32, I64, U64)


def subgroup_case(dtype, rng):
    """subgroup_add/max/min (butterflies), shuffle_xor and shuffle, per warp of 32 lanes."""
    k = KernelBuilder(f"subgroup_{dtype.name}", (THREADS,))
    x = k.buffer("x", dtype)
    outs = {name: k.buffer(name, dtype, "w") for name in ("sum", "max", "min", "xor", "idx")}
    i = global_id(k)
    v, lane = x[i], k.lane_id()
    outs["sum"][i] = k.subgroup_add(v)
    outs["max"][i] = k.subgroup_max(v)
    k.caps.add("subgroup_arith")
    outs["min"][i] = k.let("subgroup_min", dtype, (v,))    # no builder method in lang.py yet
    outs["xor"][i] = k.shuffle_xor(v, 5)
    outs["idx"][i] = k.shuffle(v, (lane * 7 + 3) & 31)

    if dtype.kind in ("f", "bf"):
        x_ = random(rng, dtype, N, -4.0, 4.0)
    else:
        x_ = random(rng, dtype, N)
    lanes = np.arange(N) % 32
    warps = np.arange(N) // 32
    f = as_f32(x_, dtype).astype(np.float64) if dtype.kind in ("f", "bf") else x_
    groups = f.reshape(-1, 32)
    if dtype.kind in ("f", "bf"):
        total = groups.sum(axis=1)
        sums = from_f32(total.astype(np.float32), dtype)[warps]
    else:
        sums = groups.sum(axis=1, dtype=x_.dtype)[warps]    # wraps like the type
    maxs = x_.reshape(-1, 32)[np.arange(N // 32), np.argmax(groups, axis=1)][warps]
    mins = x_.reshape(-1, 32)[np.arange(N // 32), np.argmin(groups, axis=1)][warps]
    expected = {"sum": sums, "max": maxs, "min": mins, "xor": x_[warps * 32 + (lanes ^ 5)],
                "idx": x_[warps * 32 + ((lanes * 7 + 3) & 31)]}
    tolerance = {}
    if dtype.kind in ("f", "bf"):
        # The butterfly adds in another order than numpy; f16/bf16 round once at the end.
        ulp = {F32: 2.0 ** -23, F16: 2.0 ** -10, BF16: 2.0 ** -7}[dtype]
        magnitude = np.abs(groups).sum(axis=1)[warps]
        tolerance["sum"] = (ulp, 32 * 2.0 ** -24 * magnitude)
    return Case(k.build(), (BLOCKS,), {"x": x_}, expected, tolerance)


def subgroup_bool_case(rng):
    """On bool: max is any lane, min is all lanes; shuffles move predicates."""
    k = KernelBuilder("subgroup_bool", (THREADS,))
    x, out = k.buffer("x", I32), k.buffer("out", U8, "w")
    i = global_id(k)
    flag = (x[i] & 1).eq(1)
    lane = k.lane_id()
    k.caps.add("subgroup_arith")
    results = (k.subgroup_max(flag), k.let("subgroup_min", BOOL, (flag,)),
               k.shuffle_xor(flag, 9), k.shuffle(flag, 31 - lane))
    for j, r in enumerate(results):
        out[i * 4 + j] = r.to(U8)
    x_ = rng.integers(-1000, 1000, N, dtype=np.int32)
    x_[:32] |= 1                      # a warp where every lane is true
    x_[32:64] &= ~1                   # and one where none is
    flags = (x_ & 1) == 1
    lanes, warps = np.arange(N) % 32, np.arange(N) // 32
    groups = flags.reshape(-1, 32)
    ref = np.stack([groups.any(axis=1)[warps], groups.all(axis=1)[warps],
                    flags[warps * 32 + (lanes ^ 9)], flags[warps * 32 + 31 - lanes]], axis=1)
    return Case(k.build(), (BLOCKS,), {"x": x_}, {"out": ref.astype(np.uint8).reshape(-1)})


def ids_case(rng):
    """thread_id/block_id/num_blocks on every axis, lane_id and subgroup_id in a 3-D workgroup."""
    workgroup, grid = (32, 2, 4), (2, 3, 2)
    k = KernelBuilder("ids", workgroup)
    out = k.buffer("out", I32, "w")
    tx, ty, tz = (k.thread_id(a) for a in range(3))
    bx, by, bz = (k.block_id(a) for a in range(3))
    gx, gy, gz = (k.num_blocks(a) for a in range(3))
    linear = tx + 32 * (ty + 2 * tz)
    block = bx + gx * (by + gy * bz)
    g = block * 256 + linear
    for j, v in enumerate((k.lane_id(), k.subgroup_id(), tx, ty, tz, bx, by, bz, gx, gy, gz)):
        out[g * 11 + j] = v
    rows = []
    for b in range(12):
        bx_, by_, bz_ = b % 2, (b // 2) % 3, b // 6
        for t in range(256):
            rows.append((t % 32, t // 32, t % 32, (t // 32) % 2, t // 64, bx_, by_, bz_, 2, 3, 2))
    return Case(k.build(), grid, {}, {"out": np.array(rows, np.int32).reshape(-1)})


def constants_case(rng):
    """Constants needing exact bits (inf, NaN, -0, subnormals, wrapped integers), NaN compares,
    bool constants and bool select/compare/logic."""
    k = KernelBuilder("constants", (32,))
    outs = {t: k.buffer(f"o_{t.name}", t, "w")
            for t in (F32, F16, BF16, I8, U8, I16, U16, I64, U64)}
    flags = k.buffer("flags", U8, "w")
    inputs = k.buffer("x", I32)
    t = k.thread_id()
    f32 = [float("inf"), -float("inf"), float("nan"), -0.0, 1e-45, 3.4e38, 0.1, -2.5]
    f16 = [65504.0, -0.0, 6e-8, float("inf"), 0.1]
    values = {F32: f32, F16: f16, BF16: [1.5, 3.14159, -1e30], I8: [-128, 200, 127],
              U8: [300, 255, 7], I16: [-32768, 40000], U16: [65535, -1],
              I64: [2**62 + 5, -3, -2**63], U64: [2**64 - 1, 2**63 + 11]}
    for dtype, vals in values.items():
        with k.if_(t.eq(0)):
            for j, v in enumerate(vals):
                # k.const() would truncate a bf16 constant to an integer (lang.py, see report).
                outs[dtype][j] = k.let("const", dtype, (), value=v) if dtype == BF16 else \
                    k.const(v, dtype)
    nan, one = k.const(float("nan"), F32), k.const(1.0, F32)
    yes, no = k.const(True, BOOL), k.const(False, BOOL)
    odd = (inputs[t] & 1).eq(1)
    logic = (nan.ne(nan), nan.eq(nan), nan < one, one.ne(one), yes, no, yes & odd, no | odd,
             yes ^ odd, ~odd, k.select(odd, no, yes), odd < yes, odd <= no, odd > no, odd >= yes,
             odd.eq(yes), odd.ne(no), k.min(odd, yes), k.max(odd, no), -odd, k.abs(odd))
    for j, v in enumerate(logic):
        flags[t * len(logic) + j] = v.to(U8)

    x_ = rng.integers(-100, 100, 32, dtype=np.int32)
    o = (x_ & 1) == 1
    expected = {}
    for dtype, vals in values.items():
        if dtype == BF16:
            expected[f"o_{dtype.name}"] = f32_to_bf16(np.array(vals, np.float32))
        elif dtype.kind == "f":
            expected[f"o_{dtype.name}"] = np.array(vals, NP[dtype])
        else:
            expected[f"o_{dtype.name}"] = np.array([v % 2**dtype.bits for v in vals],
                                                   np.uint64).astype(NP[dtype])
    ref = np.stack([np.full(32, True), np.full(32, False), np.full(32, False), np.full(32, False),
                    np.full(32, True), np.full(32, False), o, o, ~o, ~o, ~o, ~o, ~o, o, o,
                    o, o, o, o, o, o], axis=1)
    expected["flags"] = ref.astype(np.uint8).reshape(-1)
    return Case(k.build(), (1,), {"x": x_}, expected)


CASES = {}
for _t in (F32, F16) + INTEGERS:
    CASES[f"arith_{_t.name}"] = lambda rng, t=_t: arith_case(t, rng)
for _t in (F32, F16):
    CASES[f"math_{_t.name}"] = lambda rng, t=_t: math_case(t, rng)
for _t in NUMERIC:
    CASES[f"cast_from_{_t.name}"] = lambda rng, t=_t: cast_case(t, rng)
    CASES[f"memory_{_t.name}"] = lambda rng, t=_t: memory_case(t, rng)
for _t in SUBGROUP_TYPES:
    CASES[f"subgroup_{_t.name}"] = lambda rng, t=_t: subgroup_case(t, rng)
CASES.update({"subgroup_bool": subgroup_bool_case, "bitcasts": bitcast_case,
              "control": control_case, "ids": ids_case, "constants": constants_case})


def mma_case(dtype, rng):
    """One subgroup: A [16 x 16] by rows and B [16 x 16] by columns (two n-tiles of 8) staged
    from global to shared memory as words, each read by one fragment_load, D = A B + C by two
    mma, stored by the documented accumulator layout. Exact products, f32 sums: a wrong lane or
    word in a layout gives errors of order one."""
    k = KernelBuilder(f"mma_{dtype.name}", (32,))
    a_in, b_in, c_in = k.buffer("a", U32), k.buffer("b", U32), k.buffer("c", F32)
    d_out = k.buffer("d", F32, "w")
    sa, sb = k.shared("sa", U32, 16 * 8), k.shared("sb", U32, 16 * 8)
    lane = k.lane_id()
    for part in range(4):
        sa[lane + 32 * part] = a_in[lane + 32 * part]
        sb[lane + 32 * part] = b_in[lane + 32 * part]
    k.barrier()
    g, q = lane >> 2, lane & 3
    a = k.fragment_load(sa, (lane & 15) * 8 + (lane >> 4) * 4)
    b = k.fragment_load(sb, ((lane & 7) + (lane >> 4) * 8) * 8 + ((lane >> 3) & 1) * 4)
    for n, words in enumerate((b[:2], b[2:])):
        at = [(g + 8 * (j >> 1)) * 16 + 8 * n + 2 * q + (j & 1) for j in range(4)]
        d = k.mma(dtype, a, words, [c_in[i] for i in at])
        for i, value in zip(at, d):
            d_out[i] = value
    a_, b_ = random(rng, dtype, (16, 16), -2, 2), random(rng, dtype, (16, 16), -2, 2)  # b_: [n, k]
    c_ = rng.uniform(-4, 4, (16, 16)).astype(np.float32)
    want = (as_f32(a_, dtype).astype(np.float64) @ as_f32(b_, dtype).T.astype(np.float64)
            + c_).astype(np.float32)
    words = lambda m: np.ascontiguousarray(m).view(np.uint32).reshape(-1)  # noqa: E731
    return Case(k.build(), (1,), {"a": words(a_), "b": words(b_), "c": c_.reshape(-1)},
                {"d": want.reshape(-1)}, {"d": (1e-5, 1e-4)})


def async_copy_case(rng):
    """Asynchronous copies into dynamic shared memory (two arrays, 80 KiB: past the 48 KiB of
    static ones): each thread starts two 16-byte copies in two batches, a third of them outside
    (zeros), waits for the first batch only and, after a barrier, reads what another thread's
    first copy brought; then the same for the second batch."""
    k = KernelBuilder("async_copy", (THREADS,))
    src, out, ids = k.buffer("src", U32), k.buffer("out", U32, "w"), k.buffer("ids", I32, "w")
    pad = k.shared("pad", I32, 4 * 1024)           # 16 KiB before the ring: its offset counts
    ring = k.shared("ring", U32, 16 * 1024)         # 64 KiB
    t = k.thread_id()
    pad[t] = t * 3
    slot = lambda thread, batch: ((thread * 37) % THREADS + batch * THREADS) * 32  # noqa: E731
    for batch in range(2):
        chunk = t + batch * THREADS
        k.copy_async(ring, slot(t, batch), src, chunk * 4, (chunk % 3).ne(0))
        k.copy_commit()
    neighbour = (t + 1) % THREADS
    for batch in range(2):
        k.copy_wait(1 - batch)
        k.barrier()
        words = ring.load(slot(neighbour, batch), 4)
        out.store((neighbour + batch * THREADS) * 4, *words)
    ids[t] = pad[neighbour]
    chunks = 2 * THREADS
    words = rng.integers(1, 2 ** 32, (chunks, 4), dtype=np.uint32)
    want = np.where((np.arange(chunks) % 3 != 0)[:, None], words, 0).astype(np.uint32)
    return Case(k.build(), (1,), {"src": words.reshape(-1)},
                {"out": want.reshape(-1), "ids": ((np.arange(THREADS) + 1) % THREADS * 3)
                 .astype(np.int32)}, {})


def half2_case(rng):
    """f16x2 sub, mul and fma on words of two f16 values (lang.half2), against numpy's f16
    arithmetic (each lane rounded to nearest once: numpy computes in f64, exact for f16
    operands, then rounds to f16)."""
    k = KernelBuilder("half2", (THREADS,))
    i = global_id(k)
    a, b, c = (k.buffer(n, U32) for n in "abc")
    outs = {op: k.buffer(op, U32, "w") for op in ("sub", "mul", "fma")}
    outs["sub"][i] = k.half2("sub", a[i], b[i])
    outs["mul"][i] = k.half2("mul", a[i], b[i])
    outs["fma"][i] = k.half2("fma", a[i], b[i], c[i])
    halves = {n: rng.uniform(-30, 30, 2 * N).astype(np.float16) for n in "abc"}
    x, y, z = (halves[n].astype(np.float64) for n in "abc")
    want = {"sub": (x - y).astype(np.float16), "mul": (x * y).astype(np.float16),
            "fma": (x * y + z).astype(np.float16)}
    return Case(k.build(), (BLOCKS,), {n: v.view(np.uint32) for n, v in halves.items()},
                {n: v.view(np.uint32) for n, v in want.items()})


# Kernels of the matrix operations, asynchronous copies and f16x2 arithmetic: PTX only (the
# other renderers refuse them).
MMA_CASES = {f"mma_{t.name}": lambda rng, t=t: mma_case(t, rng) for t in (F16, BF16)}
PTX_ONLY_CASES = {**MMA_CASES, "async_copy": async_copy_case, "half2": half2_case}


# -- rendering -----------------------------------------------------------------------------------
def test_cases_use_every_op_and_dtype():
    ops, dtypes, statements = set(), set(), set()
    for make in CASES.values():
        kernel = make(np.random.default_rng(0)).kernel
        for stmt in lang.walk(kernel.body):
            statements.add(type(stmt).__name__)
            if isinstance(stmt, lang.Let):
                ops.add(stmt.op)
                dtypes.add(stmt.dtype)
                if stmt.op == "load":
                    ops.add(f"load{stmt.attr('width')}{'s' if stmt.attr('shared') else 'g'}")
            if isinstance(stmt, lang.Store):
                ops.add(f"store{len(stmt.values)}{'s' if stmt.shared else 'g'}")
    every = (lang.BINARY | lang.COMPARE | lang.UNARY | lang.SPECIAL | lang.SUBGROUP
             | {"const", "param", "select", "fma", "cast", "bitcast", "var_get", "load", "extract"}
             | {f"{verb}{w}{space}" for verb in ("load", "store") for w in (1, 2, 4)
                for space in "sg"})
    assert every - ops == set()
    assert set(lang.DTYPES.values()) - dtypes == set()
    assert {"If", "For", "VarDecl", "Assign", "Barrier", "Return", "Store"} <= statements


def test_mma_cases_use_every_matrix_op_and_operand_type():
    caps, ops = set(), set()
    for make in MMA_CASES.values():
        kernel = make(np.random.default_rng(0)).kernel
        caps |= kernel.caps
        ops |= {s.op for s in lang.walk(kernel.body) if isinstance(s, lang.Let)}
    assert lang.MATRIX <= ops
    assert set(lang.MMA_CAPS.values()) | {"fragment_load"} <= caps <= PTX_CAPS
    text = render_ptx(MMA_CASES["mma_bf16"](np.random.default_rng(0)).kernel)
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in text
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text


def test_async_copies_into_dynamic_shared_memory():
    kernel = async_copy_case(np.random.default_rng(0)).kernel
    assert lang.ASYNC_COPY in kernel.caps
    statements = {type(s).__name__ for s in lang.walk(kernel.body)}
    assert {"CopyAsync", "CopyCommit", "CopyWait"} <= statements
    text = render_ptx(kernel)
    assert "cp.async.cg.shared.global" in text and "cp.async.commit_group;" in text
    assert "cp.async.wait_group 1;" in text and "cp.async.wait_group 0;" in text
    assert ".extern .shared .align 16 .b8 sh_dynamic[];" in text and "sh_pad" not in text
    assert dynamic_shared_bytes(kernel) == kernel.shared_bytes == 80 * 1024
    assert dynamic_shared_bytes(MMA_CASES["mma_f16"](np.random.default_rng(0)).kernel) == 0


def test_tensor_copies_render_with_their_maps_and_barriers():
    """mma_tiled's tensor-copy pipeline: its maps are trailing 128-byte parameters aligned to
    64 whose generic addresses the copies name, each ring slot's barrier is set up once and
    waited on by parity, W's two boxes and x's complete the expected bytes of a step (128 rows
    of W and `tokens` of x, 128 bytes each), and only sm_90a renders it."""
    kernel = matmul.mma_tiled("BF16", tokens=64, stages=4, x16=True, wgmma=True, in_flight=1,
                              tensor_copy=True)
    assert [(m.buffer, m.cols, m.rows, m.box_rows) for m in kernel.maps] == \
        [("w_values", "cols", "rows", 64), ("x16", "cols", "n_tokens", 64)]
    assert kernel_params(kernel)[-2:] == [("w_map", "tensor_map"), ("x_map", "tensor_map")]
    text = render_ptx(kernel, 90)
    assert ".param .align 64 .b8 param_w_map[128],\n    .param .align 64 .b8 param_x_map[128]\n" \
        in text
    assert "cvta.param.u64 %map_x_map, %map_x_map;" in text
    assert text.count("mbarrier.init.shared::cta.b64") == 4          # a slot each
    assert "mbarrier.arrive.expect_tx.shared::cta.b64" in text
    assert f"], {(128 + 64) * 128};" in text
    # three boxes a step: the two steps started before the loop and the one in it
    assert text.count("cp.async.bulk.tensor.2d.shared::cluster.global.tile") == 9
    assert "mbarrier.try_wait.parity.shared::cta.b64" in text and "cp.async.cg" not in text
    for sm in (80, 100):
        with pytest.raises(ModelRefused, match=f"needs tensor_copy, wgmma, which PTX for sm_{sm}"):
            render_ptx(kernel, sm)
    with pytest.raises(ValueError, match="in_flight"):
        matmul.mma_tiled("F16", stages=4, x16=True, wgmma=True, tensor_copy=True)


def test_wgmma_is_sm_90a_only_and_its_tiles_aligned():
    """A kernel with warpgroup matrix operations renders for sm_90a (PTX ISA 8.0) and is
    refused elsewhere; its shared arrays start at their alignment (1024: wgmma's swizzle)
    statically and in the dynamic array, whose own alignment is the largest."""
    assert ptx_caps(90) == PTX_CAPS | {lang.WGMMA, lang.TENSOR_COPY}
    assert ptx_caps(80) == ptx_caps(100) == PTX_CAPS
    kernel = matmul.mma_tiled("F16", tokens=32, stages=4, x16=True, wgmma=True)
    text = render_ptx(kernel, 90)
    assert ".version 8.0\n.target sm_90a\n" in text
    assert ".extern .shared .align 1024 .b8 sh_dynamic[];" in text
    assert "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {" in text
    for line in ("fence.proxy.async.shared::cta;", "wgmma.fence.sync.aligned;",
                 "wgmma.commit_group.sync.aligned;", "wgmma.wait_group.sync.aligned 0;"):
        assert line in text
    assert "wgmma" not in render_ptx(matmul.mma_tiled("F16", tokens=32, stages=4, x16=True), 90)
    for sm in (80, 100):
        with pytest.raises(ModelRefused, match=f"needs wgmma, which PTX for sm_{sm}"):
            render_ptx(kernel, sm)
    k = KernelBuilder("aligned")
    k.shared("a", U32, 5)
    k.shared("b", U32, 40 * 1024, align=1024)
    offsets, size = _shared_offsets(k.build())
    assert offsets == {"a": 0, "b": 1024} and size == 1024 + 160 * 1024
    k = KernelBuilder("aligned_static")
    k.shared("a", U32, 5)
    k.shared("b", U32, 256, align=1024)
    assert ".shared .align 1024 .b8 sh_b[1024];" in render_ptx(k.build())
    with pytest.raises(ValueError, match="power of two"):
        KernelBuilder("odd").shared("c", U32, 4, align=48)


def test_module_header_entry_and_params():
    k = KernelBuilder("scale", (128, 2))
    y, x = k.buffer("y", F32, "w"), k.buffer("x", F16)
    a, n = k.scalar("a", F32), k.scalar("n", U32)
    i = k.thread_id()
    with k.if_(i.to(U32) < n):
        y[i] = x[i].to(F32) * a
    kernel = k.build()
    assert kernel_params(kernel) == [("y", "u64"), ("x", "u64"), ("a", "f32"), ("n", "u32")]
    for sm, version in ((80, "7.0"), (86, "7.1"), (89, "7.8"), (90, "7.8"), (100, "8.6"),
                        (120, "8.7")):
        text = render_ptx(kernel, sm)
        assert f".version {version}\n.target sm_{sm}\n.address_size 64\n" in text
    text = render_ptx(kernel)
    assert ".visible .entry scale(" in text and ".reqntid 128, 2, 1" in text
    assert "ld.global.nc.b16" in text and "st.global.b32" in text
    assert "mul.wide.s32" in text                  # 32-bit indices reach past 2 GiB
    assert re.search(r"// %\d+ = cast", text)      # readable: each value names its Let


def test_capabilities_and_refusals():
    assert PTX_CAPS == {"storage16", "storage8", "float16", "int16", "int64", "subgroup",
                        "subgroup_arith", "subgroup_shuffle", "shared", "fragment_load",
                        "mma_f16", "mma_bf16", "async_copy", "half2_arith"}
    base = CASES["ids"](np.random.default_rng(0)).kernel
    with pytest.raises(ModelRefused, match="matrix"):
        render_ptx(Kernel(base.name, base.params, base.shared, base.workgroup, base.body,
                          base.caps | {"matrix"}, base.n_values))
    k = KernelBuilder("big")
    k.shared("tile", F32, 25 * 1024)                # 100 KiB: dynamic, past what sm_86 has
    assert ".extern .shared" in render_ptx(k.build(), 90)
    with pytest.raises(ModelRefused, match="at most 101376"):
        render_ptx(k.build(), 86)
    k = KernelBuilder("bigger")
    k.shared("tile", U32, SHARED_LIMIT[90] // 4 + 1)
    with pytest.raises(ModelRefused, match="shared"):
        render_ptx(k.build())
    k = KernelBuilder("resident", (256,), resident=2)
    assert ".reqntid 256, 1, 1\n.minnctapersm 2\n" in render_ptx(k.build())
    with pytest.raises(ValueError, match="sm_75"):
        render_ptx(base, 75)


def _ptxas(tmp_path, text, sm, *flags):
    """Assembles `text` for sm_`sm`; fails with ptxas's message and the lines it names. Returns
    ptxas's report (what -v prints)."""
    ptxas = shutil.which("ptxas") or next(
        (path for path in ("/usr/local/bin/ptxas", "/usr/local/cuda/bin/ptxas")
         if os.path.exists(path)), None)
    if ptxas is None:
        pytest.skip("ptxas is not installed (it comes with the CUDA toolkit)")
    source = tmp_path / "kernel.ptx"
    source.write_text(text)
    arch = f"sm_{sm}" + "a" * (f".target sm_{sm}a" in text)
    run = subprocess.run([ptxas, f"-arch={arch}", *flags, str(source), "-o",
                          str(tmp_path / "k.cubin")], capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        lines = text.splitlines()
        shown = []
        for number in sorted({int(n) for n in re.findall(r"line (\d+)", run.stderr)}):
            shown += [f"{n:5d}: {lines[n - 1]}" for n in range(max(1, number - 2),
                                                                min(len(lines), number + 2) + 1)]
        pytest.fail(f"ptxas -arch=sm_{sm} failed:\n{run.stderr}\n" + "\n".join(shown))
    return run.stdout + run.stderr


def _ptxas_each(tmp_path, texts, sm, *flags):
    """_ptxas of each text, as many at once as there are cores; their reports, in order."""
    def one(item):
        i, text = item
        folder = tmp_path / str(i)
        folder.mkdir()
        return _ptxas(folder, text, sm, *flags)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return list(pool.map(one, enumerate(texts)))


@pytest.mark.parametrize("sm", SMS)
@pytest.mark.parametrize("name", list(CASES) + list(PTX_ONLY_CASES))
def test_ptxas_assembles(tmp_path, name, sm):
    make = CASES.get(name) or PTX_ONLY_CASES[name]
    _ptxas(tmp_path, render_ptx(make(np.random.default_rng(0)).kernel, sm), sm)


@pytest.mark.parametrize("sm", (80, 90))
@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
def test_mma_tiled_pipelines_under_measurement_assemble_without_spills(tmp_path, dtype, sm):
    """The tensor-core matmul keeps its accumulators and prefetched tiles in registers in every
    pipeline under measurement that fits the target's shared memory (mma_variant_kernels).
    The kernels the runner launches (mma_tiled, mma_vec, attention_flash) are held to their
    bounds by test_kernel_sources' sweep, which assembles each of them once."""
    kernels = [k for k in mma_variant_kernels([dtype])
               if dynamic_shared_bytes(k) <= SHARED_LIMIT[sm] and k.caps <= ptx_caps(sm)]
    assert kernels
    reports = _ptxas_each(tmp_path, [render_ptx(k, sm) for k in kernels], sm, "-v")
    assert all(k.name.startswith("mma_tiled") for k in kernels)     # held to SPILL_BYTES' 0
    for kernel, report in zip(kernels, reports):
        wrong = spilled_past_bound(kernel.name, report)
        assert wrong is None, f"{kernel.name}: {wrong}"


# -- execution -----------------------------------------------------------------------------------
@dataclass
class Gpu:
    driver: object
    sm: int            # the newest target the renderer knows that the device runs
    params: type       # drivers.cuda.KernelParams


@pytest.fixture(scope="module")
def gpu():
    cuda = pytest.importorskip("drivers.cuda", reason="cffi is needed to bind libcuda")
    from drivers import LibraryNotFound
    try:
        driver = cuda.Driver()
    except LibraryNotFound as error:
        pytest.skip(f"libcuda not found (tried {', '.join(path for path, _ in error.tried)})")
    driver.init()
    if driver.device_get_count() == 0:
        pytest.skip("libcuda found no CUDA device")
    device = driver.device_get(0)
    driver.ctx_set_current(driver.device_primary_ctx_retain(device))
    major = driver.device_get_attribute(cuda.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)
    minor = driver.device_get_attribute(cuda.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)
    capability = 10 * major + minor
    if capability < min(PTX_VERSION):
        pytest.skip(f"device is sm_{capability}; the PTX renderer targets sm_80 and newer")
    yield Gpu(driver, max(sm for sm in PTX_VERSION if sm <= capability), cuda.KernelParams)
    driver.ctx_synchronize()
    driver.device_primary_ctx_release(device)


def run_case(gpu, case):
    """Launch the case's kernel; return its output buffers (poisoned with 0xFF before the run)."""
    kernel, cu = case.kernel, gpu.driver
    module, _ = cu.module_load_data(render_ptx(kernel, gpu.sm))
    try:
        function = cu.module_get_function(module, kernel.name)
        shared = dynamic_shared_bytes(kernel)
        if shared:                          # past 48 KiB a function opts in
            from drivers.cuda import CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as most
            cu.func_set_attribute(function, most, shared)
        host, pointers, values = {}, [], []
        try:
            for (name, ctype), param in zip(kernel_params(kernel), kernel.params):
                if param.kind == "scalar":
                    values.append((CTYPE[ctype], case.inputs[name]))
                    continue
                if name in case.inputs:
                    array = np.ascontiguousarray(case.inputs[name]).copy()
                else:
                    want = case.expected[name]
                    array = np.full(want.nbytes, 0xFF, np.uint8).view(want.dtype)
                pointer = cu.mem_alloc(max(array.nbytes, 1))
                pointers.append(pointer)
                cu.memcpy_htod(pointer, array, array.nbytes)
                host[name] = (pointer, array)
                values.append(("CUdeviceptr", pointer))
            params = gpu.params(*values)
            cu.launch_kernel(function, case.grid, kernel.workgroup, params, shared)
            cu.ctx_synchronize()
            for name in case.expected:
                pointer, array = host[name]
                cu.memcpy_dtoh(array, pointer, array.nbytes)
            return {name: host[name][1] for name in case.expected}
        finally:
            for pointer in pointers:
                cu.mem_free(pointer)
    finally:
        cu.module_unload(module)


def check(name, got, want, tolerance, seed):
    where = f"{name} (seed {seed})"
    if tolerance is None:
        if want.dtype.kind == "f":   # bit patterns: NaN and -0 count
            width = {2: np.uint16, 4: np.uint32}[want.dtype.itemsize]
            got, want = got.view(width), want.view(width)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (f"{where}: {bad.size} of {want.size} differ; first at {bad[0]}: "
                               f"got {got[bad[0]]!r}, want {want[bad[0]]!r}")
        return
    rtol, atol = tolerance
    if want.dtype == np.uint16:                   # bf16 bits
        got, want = bf16_to_f32(got), bf16_to_f32(want)
    got, want = got.astype(np.float64), want.astype(np.float64)
    with np.errstate(invalid="ignore"):    # inf - inf where both are inf: equal, caught below
        error = np.abs(got - want)
        inside = error <= atol + rtol * np.abs(want)
    bad = np.flatnonzero(~inside & ~((got == want) | (np.isnan(got) & np.isnan(want))))
    assert bad.size == 0, (f"{where}: {bad.size} of {want.size} outside bounds; first at "
                           f"{bad[0]}: got {got[bad[0]]!r}, want {want[bad[0]]!r}")


@pytest.mark.parametrize("name", list(CASES) + list(PTX_ONLY_CASES))
def test_runs_like_numpy(gpu, name):
    seed = secrets.randbits(32)
    case = (CASES.get(name) or PTX_ONLY_CASES[name])(np.random.default_rng(seed))
    outputs = run_case(gpu, case)
    for output, want in case.expected.items():
        check(output, outputs[output], want, case.tolerance.get(output), seed)
