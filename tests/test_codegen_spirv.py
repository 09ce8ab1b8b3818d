"""poot/codegen/spirv.py: kernels of the kernel language rendered to SPIR-V, validated, and run.

Every kernel below is written with the KernelBuilder; together they use every op of lang.py,
every dtype and every cast pair, load/store widths 1/2/4, shared memory and barriers, nested
if/else/for with vars, returns (inside loops, from both arms of an if), and the subgroup ops.
Each module must pass `spirv-val --target-env vulkan1.1`; each kernel then runs on the Vulkan
device (lavapipe on a machine without a GPU) with the Khronos validation layer on, on fresh random
inputs with its outputs poisoned, against a numpy reference; the kernels naga accepts (no 8-bit
types, no 16-bit integers) run through wgpu as well.

Error bounds (float results; integer results are always exact):
- add, sub, mul, min, max, neg, abs, floor, casts, bf16 rounding: exact (Vulkan requires
  correct rounding for these; numpy rounds to nearest even too).
- rem: 2 ulp of |x| (Vulkan defines it as x - y*trunc(x/y), and lavapipe computes it so);
  not compared where x/y lies within 4 ulp of a nonzero integer (trunc may go either way).
- div: 3 ulp (Vulkan: 2.5 ulp). fma: 1 ulp of |a*b| + 1 ulp of the result (Vulkan lets it be
  a rounded multiply then a rounded add).
- exp, exp2: (3 + 2|x|) ulp; log, log2: 3 ulp, or 2^-21 absolute (f16: 2^-7) for x in [0.5, 2];
  sqrt: 3 ulp; rsqrt: 2 ulp; sin, cos: 2^-11 absolute on [-pi, pi] (f16: 2^-7); tanh: 2^-11
  absolute plus 5 ulp (Vulkan inherits it from sinh/cosh; no tighter bound exists).
  f16 ulps are counted in f16, with the same counts.
- subgroup_add of f32: 8 ulp of the sum of |x| over the subgroup (the order is the device's).
"""

import shutil
import struct
import subprocess
from dataclasses import dataclass, field

import numpy as np
import pytest

from poot.codegen.spirv import binding_layout, render_spirv, spirv_capabilities
from poot.kernels import matmul
from poot.kernels.lang import (BF16, BOOL, F16, F32, I8, I16, I32, I64, U8, U16, U32, U64,
                               KernelBuilder)

NP = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "i8": np.int8, "u8": np.uint8,
      "i16": np.int16, "u16": np.uint16, "i32": np.int32, "u32": np.uint32, "i64": np.int64,
      "u64": np.uint64}
NUMERIC = (F32, F16, BF16, I8, U8, I16, U16, I32, U32, I64, U64)
INTS = (I8, U8, I16, U16, I32, U32, I64, U64)
POISON = 0xA5           # every output byte before the dispatch
PAD = 16                # elements past each output's end that must stay poisoned
SUBGROUP_SIZES = (8, 32)  # lavapipe's and NVIDIA's, for the modules validated without a device


# -- cases: a kernel, its inputs, and what its outputs must be ------------------------------------
@dataclass
class Expect:
    want: np.ndarray
    ulps: object = 0            # float tolerance in ulps of the result (a number or an array)
    atol: object = 0.0          # plus an absolute tolerance
    mask: np.ndarray = None     # where the result is defined (elsewhere it is not compared)


@dataclass
class Case:
    kernel: object
    grid: tuple
    inputs: dict                # buffer name -> initial contents (numpy, in the param's dtype)
    outputs: dict               # buffer name -> element count (poisoned, then written)
    expect: dict                # buffer name -> Expect
    scalars: dict = field(default_factory=dict)


def randoms(rng, dtype, n, low=None, high=None, nonzero=False):
    """Random values of a numeric dtype: ints over their full range by default, floats
    uniform in [low, high); bf16 as rounded bits."""
    if dtype.kind in ("f", "bf"):
        x = rng.uniform(low, high, n).astype(np.float32)
        if nonzero:
            x[np.abs(x) < 0.01] = 0.5
        return bf16_bits(x) if dtype.kind == "bf" else x.astype(NP[dtype.name])
    info = np.iinfo(NP[dtype.name])
    low = info.min if low is None else low
    high = info.max if high is None else high
    x = rng.integers(low, high, n, dtype=NP[dtype.name], endpoint=True)
    if nonzero:
        x[x == 0] = 1
    return x


def bf16_bits(f32):
    """f32 -> bf16 bits, rounding to nearest even (NaN stays a quiet NaN)."""
    bits = np.asarray(f32, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet = (bits >> 16) | 0x40
    return np.where(np.isnan(f32), quiet, rounded).astype(np.uint16)


def bf16_value(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def as_f32(x, dtype):
    return bf16_value(x) if dtype.kind == "bf" else x.astype(np.float32)


def wrap(values, dtype):
    """Python/numpy integers wrapped to dtype, as two's complement does."""
    bits = dtype.bits
    v = np.asarray(values, dtype=object) % (1 << bits)
    if dtype.kind == "i":
        v = np.where(v >= 1 << (bits - 1), v - (1 << bits), v)
    return np.array(v.tolist(), dtype=NP[dtype.name])


def reference_cast(x, src, dst):
    """(values, defined) of lang's numeric conversion; ints <-> floats go through f32."""
    n = len(x)
    defined = np.ones(n, bool)
    if src == BOOL:
        x = x.astype(bool)
        if dst == BOOL:
            return x.astype(np.uint32), defined
        if dst.kind == "bf":
            return bf16_bits(x.astype(np.float32)), defined
        return x.astype(NP[dst.name]), defined
    if dst == BOOL:
        value = as_f32(x, src) if src.kind in ("f", "bf") else x
        return (value != 0).astype(np.uint32), defined
    if src.kind in ("f", "bf"):
        f = as_f32(x, src)
        if dst.kind in ("f", "bf"):
            return (bf16_bits(f) if dst.kind == "bf" else f.astype(NP[dst.name])), defined
        info = np.iinfo(NP[dst.name])
        t = np.trunc(f.astype(np.float64))
        defined = (t >= info.min) & (t <= info.max)
        return np.where(defined, t, 0).astype(NP[dst.name]), defined
    if dst.kind in ("f", "bf"):
        f = x.astype(np.float32)
        with np.errstate(over="ignore"):    # past f16's range is inf, on the device too
            return (bf16_bits(f) if dst.kind == "bf" else f.astype(NP[dst.name])), defined
    return wrap(x.astype(object), dst), defined


# -- the kernels ----------------------------------------------------------------------------------
WG = 64


def global_index(k):
    return k.block_id() * WG + k.thread_id()


def arith_case(rng, dtype, n=256):
    """Every binary, comparison, bool, select and fma op (plus neg/not/abs) on one dtype."""
    is_float = dtype.kind == "f"
    k = KernelBuilder(f"arith_{dtype.name}", (WG, 1, 1))
    a_buf, b_buf = k.buffer("a", dtype), k.buffer("b", dtype)
    out, flags = k.buffer("out", dtype, "w"), k.buffer("flags", U32, "w")
    count = k.scalar("n", I32)
    i = global_index(k)
    with k.if_(i < count):
        a, b = a_buf[i], b_buf[i]
        results = [a + b, a - b, a * b, a / b, a % b, k.min(a, b), k.max(a, b), -a, k.abs(a),
                   k.fma(a, b, a), k.select(a < b, a, b)]
        if not is_float:
            amount = b & (dtype.bits - 1)
            results += [a & b, a | b, a ^ b, a << amount, a >> amount, ~a]
        for slot, value in enumerate(results):
            out[i + slot * count] = value
        lt, ne = a < b, a.ne(b)
        conditions = [lt, a <= b, a > b, a >= b, a.eq(b), ne, lt & ne, lt | ne, lt ^ ne, ~lt,
                      lt.eq(ne), lt.ne(ne), k.min(lt, ne), k.max(lt, ne), lt < ne, lt >= ne]
        for slot, value in enumerate(conditions):
            flags[i + slot * count] = value.to(U32)
    kernel = k.build()

    if is_float:
        a = randoms(rng, dtype, n, -50, 50, nonzero=True)
        b = randoms(rng, dtype, n, -50, 50, nonzero=True)
    else:
        a, b = randoms(rng, dtype, n, nonzero=True), randoms(rng, dtype, n, nonzero=True)
        if dtype.kind == "i":     # keep MIN out: MIN / -1 and abs(MIN) overflow
            a[a == np.iinfo(a.dtype).min] += 1
    b[::5] = a[::5]                                 # some equal pairs
    if is_float:
        wide, bw = a.astype(np.float64), b.astype(np.float64)
        t = NP[dtype.name]
        want = [wide + bw, wide - bw, wide * bw, wide / bw, np.fmod(wide, bw),
                np.minimum(wide, bw), np.maximum(wide, bw), -wide, np.abs(wide),
                wide * bw + wide, np.where(wide < bw, wide, bw)]
        want = [w.astype(t) for w in want]
        ulps = [0, 0, 0, 3, 0, 0, 0, 0, 0, 1, 0]
        # rem is x - y*trunc(x/y) to Vulkan (lavapipe computes it so): 2 ulp of |x| besides.
        scale = [None] * 4 + [2 * _ulp(a)] + [None] * 4 + [_ulp(np.abs(wide * bw).astype(t)),
                                                           None]
    else:
        ao, bo = a.astype(object), b.astype(object)
        q = np.array([_trunc_div(x, y) for x, y in zip(ao, bo)], dtype=object)
        amount = bo & (dtype.bits - 1)
        want = [ao + bo, ao - bo, ao * bo, q, ao - bo * q, np.minimum(ao, bo), np.maximum(ao, bo),
                -ao, np.abs(ao), ao * bo + ao, np.where(ao < bo, ao, bo),
                ao & bo, ao | bo, ao ^ bo, ao << amount, ao >> amount, ~ao]
        want = [wrap(w, dtype) for w in want]
        ulps, scale = [0] * len(want), [None] * len(want)
    expect_out = np.concatenate(want)
    ulps_out = np.concatenate([np.full(n, u, np.float64) for u in ulps])
    atol_out = np.concatenate([np.zeros(n) if s is None else s for s in scale])
    defined = np.ones(len(expect_out), bool)
    if is_float:    # trunc(x/y) may go either way where x/y is within 4 ulp of an integer
        quotient = (a.astype(np.float64) / b.astype(np.float64)).astype(a.dtype)
        near = np.abs(quotient - np.round(quotient)) <= 4 * _ulp(quotient)
        defined[4 * n:5 * n] = ~(near & (np.round(quotient) != 0))
    lt, ne = a < b, a != b
    conditions = [lt, a <= b, a > b, a >= b, a == b, ne, lt & ne, lt | ne, lt ^ ne, ~lt,
                  lt == ne, lt != ne, lt & ne, lt | ne, lt < ne, lt >= ne]
    return Case(kernel, (n // WG, 1, 1), {"a": a, "b": b},
                {"out": len(expect_out), "flags": n * len(conditions)},
                {"out": Expect(expect_out, ulps_out, atol_out, defined),
                 "flags": Expect(np.concatenate(conditions).astype(np.uint32))},
                {"n": n})


def _trunc_div(x, y):
    q = abs(x) // abs(y)
    return q if (x < 0) == (y < 0) else -q


def _ulp(x):
    """The spacing of |x| in its own float dtype, as float64 (inf past the largest finite value,
    whose spacing overflows)."""
    x = np.abs(np.asarray(x))
    with np.errstate(over="ignore"):
        return np.spacing(x).astype(np.float64)


MATH = {  # op: (low, high, ulps(x), absolute tolerance for f32, for f16)
    "exp": (-9, 9, lambda x: 3 + 2 * np.abs(x), 0, 0),
    "exp2": (-14, 14, lambda x: 3 + 2 * np.abs(x), 0, 0),
    "log": (0.01, 1000, lambda x: 3, 2.0**-21, 2.0**-7),
    "log2": (0.01, 1000, lambda x: 3, 2.0**-21, 2.0**-7),
    "sqrt": (0, 10000, lambda x: 3, 0, 0),
    "rsqrt": (0.01, 10000, lambda x: 2, 0, 0),
    "sin": (-np.pi, np.pi, lambda x: 0, 2.0**-11, 2.0**-7),
    "cos": (-np.pi, np.pi, lambda x: 0, 2.0**-11, 2.0**-7),
    "tanh": (-10, 10, lambda x: 5, 2.0**-11, 2.0**-7),
    "floor": (-100, 100, lambda x: 0, 0, 0),
}
NUMPY_MATH = {"exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2, "sqrt": np.sqrt,
              "rsqrt": lambda x: 1 / np.sqrt(x), "sin": np.sin, "cos": np.cos, "tanh": np.tanh,
              "floor": np.floor}


def math_case(rng, dtype, n=128):
    """The GLSL.std.450 functions: each op reads its own slice of x, in its own range."""
    k = KernelBuilder(f"math_{dtype.name}", (WG, 1, 1))
    x_buf, y_buf = k.buffer("x", dtype), k.buffer("y", dtype, "w")
    i = global_index(k)
    for slot, name in enumerate(MATH):
        y_buf[i + slot * n] = getattr(k, name)(x_buf[i + slot * n])
    kernel = k.build()
    xs, want, ulps, atol = [], [], [], []
    for name, (low, high, ulp_count, atol32, atol16) in MATH.items():
        x = randoms(rng, dtype, n, low, high)
        if name in ("log", "log2", "sqrt", "rsqrt"):
            x = np.abs(x) + NP[dtype.name](0.01)
        xs.append(x)
        wide = x.astype(np.float64)
        want.append(NUMPY_MATH[name](wide).astype(NP[dtype.name]))
        ulps.append(np.broadcast_to(ulp_count(wide), (n,)).astype(np.float64))
        absolute = atol16 if dtype == F16 else atol32
        if name in ("log", "log2"):
            absolute = np.where((wide >= 0.5) & (wide <= 2), absolute, 0.0)
        atol.append(np.broadcast_to(absolute, (n,)).astype(np.float64))
    return Case(kernel, (n // WG, 1, 1), {"x": np.concatenate(xs)}, {"y": n * len(MATH)},
                {"y": Expect(np.concatenate(want), np.concatenate(ulps), np.concatenate(atol))})


def cast_case(rng, src, dsts, n=256):
    """Every conversion from `src` to each of `dsts` (bool is read from, and written as, u32)."""
    k = KernelBuilder(f"cast_{src.name}", (WG, 1, 1))
    x_buf = k.buffer("x", U32 if src == BOOL else src)
    outs = {d: k.buffer(f"to_{d.name}", U32 if d == BOOL else d, "w") for d in dsts}
    i = global_index(k)
    x = x_buf[i]
    if src == BOOL:
        x = x.to(BOOL)
    for d, buf in outs.items():
        value = x.to(d)
        buf[i] = value.to(U32) if d == BOOL else value
    kernel = k.build()
    if src == BOOL:
        x = (rng.integers(0, 2, n) * rng.integers(1, 2**32, n)).astype(np.uint32)
        source = x.astype(bool)
    elif src.kind in ("f", "bf"):
        x = randoms(rng, src, n, -300, 300)
        x[::7] = 0
        source = x
    else:
        x = randoms(rng, src, n)
        x[::7] = 0
        source = x
    expect = {}
    for d in dsts:
        want, defined = reference_cast(source, BOOL if src == BOOL else src, d)
        expect[f"to_{d.name}"] = Expect(want, mask=defined)
    return Case(kernel, (n // WG, 1, 1), {"x": x}, {f"to_{d.name}": n for d in dsts}, expect)


def bitcast_case(rng, n=128):
    """bitcast between every same-width pair (bf16 <-> u16 is free: bf16 is held as u16)."""
    pairs = [(F32, U32), (U32, I32), (I32, F32), (F16, U16), (U16, I16), (I16, F16),
             (BF16, U16), (U16, BF16), (I64, U64), (U64, I64), (I8, U8), (U8, I8)]
    k = KernelBuilder("bitcast", (WG, 1, 1))
    ins = {t: k.buffer(f"x_{t.name}", t) for t in dict.fromkeys(s for s, _ in pairs)}
    outs = {(s, d): k.buffer(f"{s.name}_as_{d.name}", d, "w") for s, d in pairs}
    i = global_index(k)
    for (s, d), buf in outs.items():
        buf[i] = ins[s][i].bitcast(d)
    kernel = k.build()
    inputs = {}
    for t in ins:
        if t.kind in ("f", "bf"):
            inputs[f"x_{t.name}"] = randoms(rng, t, n, -1000, 1000)
        else:
            inputs[f"x_{t.name}"] = randoms(rng, t, n)
    expect = {f"{s.name}_as_{d.name}": Expect(inputs[f"x_{s.name}"].view(NP[d.name]))
              for s, d in pairs}
    return Case(kernel, (n // WG, 1, 1), inputs, {name: n for name in expect}, expect)


def memory_case(rng, dtype, width, n=256):
    """Loads and stores of `width` elements, through shared memory across a barrier: each
    workgroup writes its chunks back in reverse thread order."""
    k = KernelBuilder(f"memory_{dtype.name}_x{width}", (WG, 1, 1))
    x_buf, y_buf = k.buffer("x", dtype), k.buffer("y", dtype, "w")
    tile = k.shared("tile", dtype, WG * width)
    t = k.thread_id()
    base = global_index(k) * width
    values = x_buf.load(base, width) if width > 1 else (x_buf[base],)
    tile.store(t * width, *values)
    k.barrier()
    mirrored = (WG - 1 - t) * width
    back = tile.load(mirrored, width) if width > 1 else (tile[mirrored],)
    y_buf.store(base, *back)
    kernel = k.build()
    x = randoms(rng, dtype, n * width, -100, 100) if dtype.kind in ("f", "bf") else \
        randoms(rng, dtype, n * width)
    want = x.reshape(n // WG, WG, width)[:, ::-1, :].reshape(-1)
    return Case(kernel, (n // WG, 1, 1), {"x": x}, {"y": n * width}, {"y": Expect(want)})


def control_case(rng, n=200):
    """Nested if/else/for, vars, a Value loop step, an unrolled loop, a read-write buffer, a
    return inside a loop and an if whose two arms both return."""
    k = KernelBuilder("control", (WG, 1, 1))
    x_buf, acc_buf = k.buffer("x", I32), k.buffer("acc", I32, "rw")
    z_buf = k.buffer("z", F32, "w")
    count, step, scale = k.scalar("n", I32), k.scalar("step", I32), k.scalar("scale", F32)
    i = global_index(k)
    with k.if_(i >= count):
        k.return_()
    v = x_buf[i]
    acc = k.var(I32, k.const(0, I32))  # Values: lang's var() misnumbers a constant init
    with k.for_(0, v & 15) as j:
        with k.if_((j & 1).eq(0)) as branch:
            acc.set(acc.get() + j)
        with k.else_(branch):
            with k.for_(0, 3, unroll=True) as t:
                acc.set(acc.get() + t * j)
    with k.for_(1, 40, step) as j:
        acc.set(acc.get() ^ j)
    hit = k.var(BOOL, k.const(False, BOOL))
    with k.for_(0, 8) as j:
        with k.if_(((v >> 4) & 7).eq(j)):
            hit.set(True)
    with k.if_(hit.get()):
        acc_buf[i] = acc_buf[i] + acc.get()
    with k.if_(v < 0) as sign:
        with k.for_(0, v & 7) as j:
            with k.if_(j.eq(5)):
                z_buf[i] = scale * j.to(F32)
                k.return_()
    with k.else_(sign):
        with k.if_((v & 1).eq(1)) as odd:
            z_buf[i] = acc.get().to(F32) * scale
            k.return_()
        with k.else_(odd):
            z_buf[i] = -acc.get().to(F32)
            k.return_()
    z_buf[i] = scale + 0.5
    kernel = k.build()

    x = randoms(rng, I32, n, -1000, 1000)
    start = randoms(rng, I32, n + WG, -10**6, 10**6)
    stride = int(rng.integers(1, 7))
    scale_value = float(np.float32(rng.uniform(0.5, 2)))
    acc_want, z_want = start.copy(), np.zeros(n + WG, np.float32)
    for index, value in enumerate(x.tolist()):
        acc = 0
        for j in range(value & 15):
            acc += j if j % 2 == 0 else sum(t * j for t in range(3))
        for j in range(1, 40, stride):
            acc ^= j
        acc_want[index] += acc       # (v >> 4) & 7 is always in 0..7: hit is always set
        if value < 0:
            z_want[index] = np.float32(scale_value) * 5 if value & 7 > 5 else np.float32(
                scale_value) + np.float32(0.5)
        elif value & 1:
            z_want[index] = np.float32(acc) * np.float32(scale_value)
        else:
            z_want[index] = -np.float32(acc)
    z_mask = np.arange(n + WG) < n            # threads past n returned before writing z
    return Case(kernel, (-(-n // WG), 1, 1), {"x": x, "acc": start}, {"z": n + WG},
                {"acc": Expect(acc_want), "z": Expect(z_want, mask=z_mask)},
                {"n": n, "step": stride, "scale": scale_value})


def var_case(rng, n=128):
    """Vars of storage-only types (bf16, u8: held at 32 bits) and of f16 with arithmetic,
    select on bf16, set in a loop."""
    k = KernelBuilder("vars", (WG, 1, 1))
    h_buf, b_buf, u_buf = k.buffer("h", F16), k.buffer("b", BF16), k.buffer("u", U8)
    h_out, b_out, u_out = k.buffer("h_out", F16, "w"), k.buffer("b_out", BF16, "w"), \
        k.buffer("u_out", U8, "w")
    i = global_index(k)
    h, b, u = k.var(F16, h_buf[i]), k.var(BF16, b_buf[i]), k.var(U8, u_buf[i])
    with k.for_(0, 3) as j:
        h.set(h.get() * 2.0)
        larger = b.get().to(F32) < b_buf[(i + j + 1) & (n - 1)].to(F32)
        b.set(k.select(larger, b_buf[(i + j + 1) & (n - 1)], b.get()))
        u.set((u.get().to(U32) + u_buf[(i + j + 1) & (n - 1)].to(U32)).to(U8))
    h_out[i], b_out[i], u_out[i] = h.get(), b.get(), u.get()
    kernel = k.build()
    h = randoms(rng, F16, n, -100, 100)
    b = randoms(rng, BF16, n, -100, 100)
    u = randoms(rng, U8, n)
    b_want, u_want = b.copy(), u.astype(np.uint32)
    for j in range(3):
        other = np.roll(np.arange(n), -(j + 1))
        b_want = np.where(bf16_value(b_want) < bf16_value(b[other]), b[other], b_want)
        u_want = (u_want + u[other]) & 0xFF
    return Case(kernel, (n // WG, 1, 1), {"h": h, "b": b, "u": u},
                {"h_out": n, "b_out": n, "u_out": n},
                {"h_out": Expect((h.astype(np.float32) * 8).astype(np.float16)),
                 "b_out": Expect(b_want), "u_out": Expect(u_want.astype(np.uint8))})


def ids_case(rng):
    """thread_id, block_id and num_blocks on every axis of a 3-D launch."""
    local, grid = (4, 2, 2), (3, 2, 2)
    k = KernelBuilder("ids", local)
    out = k.buffer("ids", I32, "w")
    tx, ty, tz = (k.thread_id(a) for a in range(3))
    bx, by, bz = (k.block_id(a) for a in range(3))
    nx, ny, nz = (k.num_blocks(a) for a in range(3))
    linear = ((bz * ny + by) * nx + bx) * 16 + (tz * 2 + ty) * 4 + tx
    for slot, value in enumerate((tx, ty, tz, bx, by, bz, nx, ny, nz)):
        out[linear * 9 + slot] = value
    kernel = k.build()
    rows = []
    for bz, by, bx, tz, ty, tx in np.ndindex(grid[2], grid[1], grid[0], 2, 2, 4):
        rows.append((tx, ty, tz, bx, by, bz) + grid)
    want = np.array(rows, np.int32).reshape(-1)
    return Case(kernel, grid, {}, {"ids": len(want)}, {"ids": Expect(want)})


def subgroup_case(rng, subgroup_size, n=128):
    """Reductions, shuffles and the lane/subgroup ids; the reference groups threads by the ids
    the device reported (and checks that they form whole subgroups)."""
    k = KernelBuilder("subgroups", (WG, 1, 1))
    xf, xi, xu = k.buffer("xf", F32), k.buffer("xi", I32), k.buffer("xu", U32)
    ids, of, oi, ou = (k.buffer(name, t, "w") for name, t in
                       (("ids", I32), ("of", F32), ("oi", I32), ("ou", U32)))
    lanes = k.scalar("lanes", I32)
    i = global_index(k)
    ids[i * 2] = k.lane_id()
    ids[i * 2 + 1] = k.subgroup_id()
    masks = [m for m in (1, 2, subgroup_size // 2) if m < subgroup_size]
    for buf, out in ((xf, of), (xi, oi), (xu, ou)):
        x = buf[i]
        minimum = k.let("subgroup_min", x.dtype, (x,))   # lang has no builder call for it yet
        results = [k.subgroup_add(x), k.subgroup_max(x), minimum,
                   k.shuffle(x, (k.lane_id() + 3) & (lanes - 1))]
        results += [k.shuffle_xor(x, m) for m in masks]
        for slot, value in enumerate(results):
            out[i * 8 + slot] = value
    k.caps.add("subgroup_arith")
    kernel = k.build()
    inputs = {"xf": randoms(rng, F32, n, -10, 10), "xi": randoms(rng, I32, n, -1000, 1000),
              "xu": randoms(rng, U32, n, 0, 1000)}

    def check(outputs):
        ids_out = outputs["ids"][:2 * n].reshape(n, 2)
        block = np.arange(n) // WG
        groups = {}
        for thread, (lane, sg) in enumerate(ids_out):
            groups.setdefault((block[thread], sg), {})[lane] = thread
        for members in groups.values():
            assert sorted(members) == list(range(subgroup_size)), "not whole subgroups"
        for name, out_name in (("xf", "of"), ("xi", "oi"), ("xu", "ou")):
            x = inputs[name]
            got = outputs[out_name][:8 * n].reshape(n, 8)
            for members in groups.values():
                threads = [members[lane] for lane in range(subgroup_size)]
                values = x[threads]
                rows = got[threads]
                if name == "xf":
                    total = values.astype(np.float64).sum()
                    bound = 8 * np.spacing(np.float32(np.abs(values).sum()))
                    assert np.all(np.abs(rows[:, 0] - total) <= bound), "subgroup_add f32"
                else:
                    assert np.all(rows[:, 0] == values.sum(dtype=values.dtype)), "subgroup_add"
                assert np.all(rows[:, 1] == values.max()) and np.all(rows[:, 2] == values.min())
                lane = np.arange(subgroup_size)
                assert np.array_equal(rows[:, 3], values[(lane + 3) % subgroup_size]), "shuffle"
                for slot, m in enumerate(masks):
                    assert np.array_equal(rows[:, 4 + slot], values[lane ^ m]), f"xor {m}"

    case = Case(kernel, (n // WG, 1, 1), inputs, {"ids": 2 * n, "of": 8 * n, "oi": 8 * n,
                                                   "ou": 8 * n}, {}, {"lanes": subgroup_size})
    case.check = check
    return case


ALL_TYPES_CAST = (BOOL,) + NUMERIC
WGPU_TYPES = (BOOL, F32, F16, I32, U32)


def cases(rng, subgroup_size):
    """name -> a function making that case with fresh inputs."""
    made = {}
    for t in (F32, F16) + INTS:
        made[f"arith_{t.name}"] = lambda t=t: arith_case(rng, t)
    for t in (F32, F16):
        made[f"math_{t.name}"] = lambda t=t: math_case(rng, t)
    for src in ALL_TYPES_CAST:
        made[f"cast_{src.name}"] = lambda src=src: cast_case(
            rng, src, [d for d in ALL_TYPES_CAST if d != src])
    for t, width in [(F32, 1), (F32, 2), (F32, 4), (F16, 2), (BF16, 4), (U8, 4), (I16, 1),
                     (I64, 2), (U32, 4)]:
        made[f"memory_{t.name}_x{width}"] = lambda t=t, w=width: memory_case(rng, t, w)
    made["bitcast"] = lambda: bitcast_case(rng)
    made["control"] = lambda: control_case(rng)
    made["vars"] = lambda: var_case(rng)
    made["ids"] = lambda: ids_case(rng)
    made["subgroups"] = lambda: subgroup_case(rng, subgroup_size)
    return made


def wgpu_cases(rng, subgroup_size):
    """What naga accepts: no 8-bit types, no 16-bit integers (bf16 included), no 64-bit here."""
    made = {name: make for name, make in cases(rng, subgroup_size).items()
            if name in ("arith_f32", "arith_f16", "arith_i32", "arith_u32", "math_f32",
                        "math_f16", "memory_f32_x1", "memory_f32_x2", "memory_f32_x4",
                        "memory_f16_x2", "memory_u32_x4", "control", "ids", "subgroups")}
    for src in WGPU_TYPES:
        made[f"cast_{src.name}"] = lambda src=src: cast_case(
            rng, src, [d for d in WGPU_TYPES if d != src])
    return made


CASE_NAMES = list(cases(None, 8))
WGPU_CASE_NAMES = list(wgpu_cases(None, 8))


# -- checking outputs -----------------------------------------------------------------------------
def check_outputs(case, outputs):
    for name, count in case.outputs.items():
        raw = outputs[name].view(np.uint8)
        tail = raw[count * outputs[name].itemsize:]
        assert (tail == POISON).all(), f"{case.kernel.name}: {name} written past its end"
    if hasattr(case, "check"):
        case.check(outputs)
    for name, expect in case.expect.items():
        got = outputs[name][:len(expect.want)]
        want = expect.want
        if got.dtype.kind == "f":
            with np.errstate(invalid="ignore"):     # inf and NaN results compare by equality
                g, w = got.astype(np.float64), want.astype(np.float64)
                bound = expect.atol + expect.ulps * _ulp(want)
                ok = (g == w) | (np.abs(g - w) <= bound) | (np.isnan(g) & np.isnan(w))
        else:
            ok = got == want
        if expect.mask is not None:
            ok |= ~expect.mask
        if not ok.all():
            bad = np.flatnonzero(~ok)[:8]
            lines = [f"[{j}] got {got[j]!r} want {want[j]!r}" for j in bad]
            pytest.fail(f"{case.kernel.name}: {name}: {len(np.flatnonzero(~ok))} of {len(ok)} "
                        f"wrong:\n" + "\n".join(lines))


# -- spirv-val ------------------------------------------------------------------------------------
def spirv_tool(name):
    if shutil.which(name) is None:
        pytest.skip(f"{name} not installed (Debian package spirv-tools)")
    return name


def validate(code, tmp_path, label):
    path = tmp_path / f"{label}.spv"
    path.write_bytes(code)
    result = subprocess.run([spirv_tool("spirv-val"), "--target-env", "vulkan1.1", str(path)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        listing = subprocess.run(["spirv-dis", str(path)], capture_output=True, text=True).stdout
        pytest.fail(f"spirv-val rejected {label}:\n{result.stdout}{result.stderr}\n{listing}")


def disassemble(code, tmp_path):
    path = tmp_path / "module.spv"
    path.write_bytes(code)
    return subprocess.run([spirv_tool("spirv-dis"), "--raw-id", str(path)], capture_output=True,
                          text=True, check=True).stdout


@pytest.mark.parametrize("subgroup_size", SUBGROUP_SIZES)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_module_passes_spirv_val(name, subgroup_size, tmp_path):
    case = cases(np.random.default_rng(), subgroup_size)[name]()
    validate(render_spirv(case.kernel, subgroup_size), tmp_path, name)


# -- the module's shape ---------------------------------------------------------------------------
def axpy():
    k = KernelBuilder("axpy", (128, 1, 1))
    x, y = k.buffer("x", F32), k.buffer("y", F32, "rw")
    a, n = k.scalar("a", F32), k.scalar("n", I32)
    scratch = k.buffer("scratch", U32, "w")
    bias = k.scalar("bias", U32)
    i = global_index(k)
    with k.if_(i < n):
        y[i] = k.fma(a, x[i], y[i])
        scratch[i] = bias
    return k.build()


def test_header_entry_point_and_local_size(tmp_path):
    code = render_spirv(axpy())
    magic, version, _, bound, schema = struct.unpack("<5I", code[:20])
    assert (magic, version, schema) == (0x07230203, 0x00010300, 0) and bound > 1
    assert len(code) % 4 == 0
    listing = disassemble(code, tmp_path)
    assert 'OpEntryPoint GLCompute %' in listing and '"axpy"' in listing
    assert "OpExecutionMode" in listing and "LocalSize 128 1 1" in listing


def test_builtins_are_decorated_and_in_the_interface(tmp_path):
    listing = disassemble(render_spirv(subgroup_case(np.random.default_rng(), 8).kernel), tmp_path)
    decorated = {}
    for line in listing.splitlines():
        words = line.split()
        if words[:1] == ["OpDecorate"] and words[2] == "BuiltIn":
            decorated[words[3]] = words[1]
    assert set(decorated) == {"LocalInvocationId", "WorkgroupId", "SubgroupLocalInvocationId",
                              "SubgroupId"}
    entry = next(line for line in listing.splitlines() if "OpEntryPoint" in line)
    assert all(var in entry.split() for var in decorated.values())


def test_binding_layout_and_push_constants(tmp_path):
    kernel = axpy()
    layout = binding_layout(kernel)
    assert [(b.name, b.set, b.binding, b.access) for b in layout.buffers] == [
        ("x", 0, 0, "r"), ("y", 0, 1, "rw"), ("scratch", 0, 2, "w")]
    assert [(p.name, p.dtype, p.offset) for p in layout.push_constants] == [
        ("a", F32, 0), ("n", I32, 4), ("bias", U32, 8)]
    assert layout.push_constant_size == 12
    assert layout.pack_push_constants({"a": 1.5, "n": -3, "bias": 7}) == struct.pack(
        "<fiI", 1.5, -3, 7) == layout.pack_push_constants([1.5, -3, 7])
    listing = disassemble(render_spirv(kernel), tmp_path)
    assert "ArrayStride 4" in listing and " Block" in listing
    assert listing.count("NonWritable") == 1 and "NonReadable" not in listing  # naga: no "w"-only
    for binding in (0, 1, 2):
        assert f"Binding {binding}" in listing
    assert all(f"Offset {offset}" in listing for offset in (0, 4, 8))
    assert "PushConstant" in listing and "StorageBuffer" in listing


def test_bool_buffer_is_refused():
    """A buffer of bool has no memory layout: the kernel language refuses it where it is
    declared, before any renderer sees it."""
    with pytest.raises(TypeError, match="bool"):
        KernelBuilder("flags").buffer("flags", BOOL)


def test_matrix_operations_are_refused_by_name():
    from poot.errors import ModelRefused
    from tests.test_codegen_ptx import MMA_CASES, PTX_ONLY_CASES
    for name, capability in (("mma_f16", "mma_f16"), ("mma_bf16", "mma_bf16")):
        kernel = MMA_CASES[name](np.random.default_rng(0)).kernel
        with pytest.raises(ModelRefused, match=rf"kernel {name} needs fragment_load, {capability}, "
                                               r"which the SPIR-V renderer does not render"):
            render_spirv(kernel, 32)
        with pytest.raises(ModelRefused, match=capability):
            spirv_capabilities(kernel)
    kernel = PTX_ONLY_CASES["async_copy"](np.random.default_rng(0)).kernel
    with pytest.raises(ModelRefused, match="kernel async_copy needs async_copy, which the SPIR-V"):
        render_spirv(kernel, 32)
    kernel = matmul.mma_tiled("F16", stages=4, x16=True, wgmma=True)
    with pytest.raises(ModelRefused, match=f"kernel {kernel.name} needs async_copy, wgmma, which"):
        render_spirv(kernel, 32)


def test_shuffle_mask_must_fit_the_subgroup():
    k = KernelBuilder("wide_shuffle", (64, 1, 1))
    x = k.buffer("x", F32, "rw")
    x[k.thread_id()] = k.shuffle_xor(x[k.thread_id()], 16)
    kernel = k.build()
    assert render_spirv(kernel, 32)
    with pytest.raises(ValueError, match="mask 16"):
        render_spirv(kernel, 8)


# -- capabilities: exactly what is used -----------------------------------------------------------
def one_kernel(body, *buffers):
    k = KernelBuilder("caps", (64, 1, 1))
    bufs = [k.buffer(f"b{j}", t, "rw") for j, t in enumerate(buffers)]
    body(k, bufs, k.thread_id())
    return k.build()


STORAGE16 = {"StorageBuffer16BitAccess", "SPV_KHR_16bit_storage"}
STORAGE8 = {"StorageBuffer8BitAccess", "SPV_KHR_8bit_storage"}


@pytest.mark.parametrize("label, kernel, declared", [
    ("f32 only", one_kernel(lambda k, b, i: b[0].store(i, b[0][i] * 2.0), F32), set()),
    ("f16 storage, f32 math", one_kernel(
        lambda k, b, i: b[0].store(i, (b[0][i].to(F32) * 2.0).to(F16)), F16), STORAGE16),
    ("f16 compared (at 32 bits)", one_kernel(
        lambda k, b, i: b[1].store(i, (b[0][i] < b[0][i + 1]).to(U32)), F16, U32), STORAGE16),
    ("f16 math", one_kernel(lambda k, b, i: b[0].store(i, b[0][i] * 2.0), F16),
     STORAGE16 | {"Float16"}),
    ("bf16 round trip", one_kernel(
        lambda k, b, i: b[0].store(i, (b[0][i].to(F32) * 3.0).to(BF16)), BF16), STORAGE16),
    ("bf16 select (at 32 bits)", one_kernel(
        lambda k, b, i: b[0].store(i, k.select(i < 3, b[0][i], b[0][i + 1])), BF16), STORAGE16),
    ("u16 math", one_kernel(lambda k, b, i: b[0].store(i, b[0][i] + 1), U16),
     STORAGE16 | {"Int16"}),
    ("u8 storage", one_kernel(
        lambda k, b, i: b[1].store(i, b[0][i].to(U32) + 1), U8, U32), STORAGE8),
    ("u8 math", one_kernel(lambda k, b, i: b[0].store(i, b[0][i] + 1), U8), STORAGE8 | {"Int8"}),
    ("i64", one_kernel(lambda k, b, i: b[0].store(i, b[0][i] + 1), I64), {"Int64"}),
    ("f16 shared", one_kernel(lambda k, b, i: k.shared("s", F16, 64).store(i, b[0][i]), F16),
     STORAGE16 | {"Float16"}),
    ("lane id", one_kernel(lambda k, b, i: b[0].store(i, k.lane_id()), I32),
     {"GroupNonUniform"}),
    ("subgroup add", one_kernel(lambda k, b, i: b[0].store(i, k.subgroup_add(b[0][i])), F32),
     {"GroupNonUniform", "GroupNonUniformArithmetic"}),
    ("shuffle", one_kernel(lambda k, b, i: b[0].store(i, k.shuffle_xor(b[0][i], 1)), F32),
     {"GroupNonUniform", "GroupNonUniformShuffle"}),
])
def test_capabilities_are_exactly_those_used(label, kernel, declared, tmp_path):
    assert spirv_capabilities(kernel) == frozenset({"Shader"} | declared), label
    code = render_spirv(kernel)
    validate(code, tmp_path, "caps")
    listing = disassemble(code, tmp_path)
    in_module = {line.split()[1] for line in listing.splitlines()
                 if line.split()[:1] == ["OpCapability"]}
    in_module |= {line.split()[1].strip('"') for line in listing.splitlines()
                  if line.split()[:1] == ["OpExtension"]}
    assert in_module == set(spirv_capabilities(kernel))


LANG_TO_SPIRV = {"float16": "Float16", "int16": "Int16", "int64": "Int64",
                 "storage16": "StorageBuffer16BitAccess", "storage8": "StorageBuffer8BitAccess",
                 "subgroup": "GroupNonUniform", "subgroup_arith": "GroupNonUniformArithmetic",
                 "subgroup_shuffle": "GroupNonUniformShuffle"}


@pytest.mark.parametrize("name", CASE_NAMES)
def test_capabilities_cover_the_kernel_caps(name):
    kernel = cases(np.random.default_rng(), 8)[name]().kernel
    declared = spirv_capabilities(kernel)
    assert {LANG_TO_SPIRV[c] for c in kernel.caps if c in LANG_TO_SPIRV} <= declared


# -- running on Vulkan ----------------------------------------------------------------------------
VALIDATION_LAYER = "VK_LAYER_KHRONOS_validation"


class VulkanRunner:
    """A device with every feature the kernels may need that the physical device offers, the
    validation layer on when installed, and `run(case)`: buffers in, dispatch, buffers out."""

    def __init__(self, vk):
        self.vk, self.ffi = vk, vk.ffi
        self.lib = lib = vk.load()[0]
        ffi = vk.ffi
        layers = {vk.text(layer.layerName) for layer in vk.enumerate_all(
            lib.vkEnumerateInstanceLayerProperties, "VkLayerProperties")}
        self.validated = VALIDATION_LAYER in layers
        self.messages = []
        self.callback = ffi.callback("PFN_vkDebugUtilsMessengerCallbackEXT", self.on_message)
        messenger = vk.new("VkDebugUtilsMessengerCreateInfoEXT",
                           messageSeverity=lib.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT,
                           messageType=lib.VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT
                           | lib.VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT,
                           pfnUserCallback=self.callback)
        layer_names = [VALIDATION_LAYER] if self.validated else []
        extensions = ["VK_EXT_debug_utils"] if self.validated else []
        application = vk.new("VkApplicationInfo", apiVersion=vk.make_version(1, 3))
        info = vk.new("VkInstanceCreateInfo", pNext=messenger if self.validated else ffi.NULL,
                      pApplicationInfo=application, enabledLayerCount=len(layer_names),
                      ppEnabledLayerNames=vk.strings(layer_names),
                      enabledExtensionCount=len(extensions),
                      ppEnabledExtensionNames=vk.strings(extensions))
        handle = ffi.new("VkInstance *")
        vk.check(lib.vkCreateInstance(info, ffi.NULL, handle), "vkCreateInstance")
        self.instance = handle[0]
        self.messenger = None
        if self.validated:
            out = ffi.new("VkDebugUtilsMessengerEXT *")
            create = vk.instance_function(lib, self.instance, "vkCreateDebugUtilsMessengerEXT")
            vk.check(create(self.instance, messenger, ffi.NULL, out), "vkCreateDebugUtils...")
            self.messenger = out[0]
        devices = vk.enumerate_all(lib.vkEnumeratePhysicalDevices, "VkPhysicalDevice",
                                   self.instance)
        if len(devices) == 0:
            self.destroy()
            pytest.skip("no Vulkan device (install mesa-vulkan-drivers for lavapipe)")
        self.physical = devices[0]
        subgroup = vk.new("VkPhysicalDeviceSubgroupProperties")
        properties = vk.chain(vk.new("VkPhysicalDeviceProperties2"), subgroup)
        lib.vkGetPhysicalDeviceProperties2(self.physical, properties)
        self.name = vk.text(properties.properties.deviceName)
        self.subgroup_size = subgroup.subgroupSize
        operations = subgroup.supportedOperations
        o11, o12 = vk.new("VkPhysicalDeviceVulkan11Features"), vk.new(
            "VkPhysicalDeviceVulkan12Features")
        offered = vk.chain(vk.new("VkPhysicalDeviceFeatures2"), o11, o12)
        lib.vkGetPhysicalDeviceFeatures2(self.physical, offered)
        self.has = {
            "Shader": True, "Float16": o12.shaderFloat16, "Int8": o12.shaderInt8,
            "Int16": offered.features.shaderInt16, "Int64": offered.features.shaderInt64,
            "StorageBuffer16BitAccess": o11.storageBuffer16BitAccess,
            "StorageBuffer8BitAccess": o12.storageBuffer8BitAccess,
            "GroupNonUniform": operations & lib.VK_SUBGROUP_FEATURE_BASIC_BIT,
            "GroupNonUniformArithmetic": operations & lib.VK_SUBGROUP_FEATURE_ARITHMETIC_BIT,
            "GroupNonUniformShuffle": operations & lib.VK_SUBGROUP_FEATURE_SHUFFLE_BIT}
        v11 = vk.new("VkPhysicalDeviceVulkan11Features",
                     storageBuffer16BitAccess=o11.storageBuffer16BitAccess)
        v12 = vk.new("VkPhysicalDeviceVulkan12Features",
                     storageBuffer8BitAccess=o12.storageBuffer8BitAccess,
                     shaderFloat16=o12.shaderFloat16, shaderInt8=o12.shaderInt8)
        features = vk.chain(vk.new("VkPhysicalDeviceFeatures2"), v11, v12)
        features.features.shaderInt16 = offered.features.shaderInt16
        features.features.shaderInt64 = offered.features.shaderInt64
        families = vk.enumerate_all(lib.vkGetPhysicalDeviceQueueFamilyProperties,
                                    "VkQueueFamilyProperties", self.physical)
        self.family = next(j for j, f in enumerate(families)
                           if f.queueFlags & lib.VK_QUEUE_COMPUTE_BIT)
        queue = vk.new("VkDeviceQueueCreateInfo", queueFamilyIndex=self.family, queueCount=1,
                       pQueuePriorities=ffi.new("float[]", [1.0]))
        device = ffi.new("VkDevice *")
        vk.check(lib.vkCreateDevice(self.physical, vk.new(
            "VkDeviceCreateInfo", pNext=features, queueCreateInfoCount=1, pQueueCreateInfos=queue),
            ffi.NULL, device), "vkCreateDevice")
        self.device = device[0]
        out = ffi.new("VkQueue *")
        lib.vkGetDeviceQueue(self.device, self.family, 0, out)
        self.queue = out[0]
        self.memory = vk.new("VkPhysicalDeviceMemoryProperties2")
        lib.vkGetPhysicalDeviceMemoryProperties2(self.physical, self.memory)

    def on_message(self, severity, types, data, user):
        name = self.ffi.string(data.pMessageIdName).decode() if data.pMessageIdName else ""
        self.messages.append(f"{name}: {self.ffi.string(data.pMessage).decode()}")
        return 0

    def missing(self, kernel):
        return sorted(c for c in spirv_capabilities(kernel)
                      if not c.startswith("SPV_") and not self.has[c])

    def run(self, case):
        lib, ffi, vk = self.lib, self.ffi, self.vk
        kernel, cleanup = case.kernel, []

        def create(kind, info):
            handle = ffi.new(f"Vk{kind} *")
            vk.check(getattr(lib, f"vkCreate{kind}")(self.device, info, ffi.NULL, handle),
                     f"vkCreate{kind}")
            destroy = getattr(lib, f"vkDestroy{kind}")
            cleanup.append(lambda: destroy(self.device, handle[0], ffi.NULL))
            return handle[0]

        try:
            layout = binding_layout(kernel)
            code = render_spirv(kernel, self.subgroup_size)
            module = create("ShaderModule", vk.new("VkShaderModuleCreateInfo", codeSize=len(code),
                                                   pCode=ffi.from_buffer("uint32_t[]", code)))
            n_buffers = len(layout.buffers)
            bindings = ffi.new("VkDescriptorSetLayoutBinding[]", [
                {"binding": b.binding, "descriptorType": lib.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                 "descriptorCount": 1, "stageFlags": lib.VK_SHADER_STAGE_COMPUTE_BIT}
                for b in layout.buffers])
            set_layout = create("DescriptorSetLayout", vk.new(
                "VkDescriptorSetLayoutCreateInfo", bindingCount=n_buffers, pBindings=bindings))
            set_layouts = ffi.new("VkDescriptorSetLayout[]", [set_layout])
            push = ffi.new("VkPushConstantRange *", {
                "stageFlags": lib.VK_SHADER_STAGE_COMPUTE_BIT, "offset": 0,
                "size": layout.push_constant_size})
            pipeline_layout = create("PipelineLayout", vk.new(
                "VkPipelineLayoutCreateInfo", setLayoutCount=1, pSetLayouts=set_layouts,
                pushConstantRangeCount=1 if layout.push_constants else 0, pPushConstantRanges=push))
            pipeline, entry = ffi.new("VkPipeline *"), ffi.new("char[]", kernel.name.encode())
            vk.check(lib.vkCreateComputePipelines(self.device, ffi.NULL, 1, vk.new(
                "VkComputePipelineCreateInfo", layout=pipeline_layout, stage={
                    "stage": lib.VK_SHADER_STAGE_COMPUTE_BIT, "module": module,
                    "pName": entry}), ffi.NULL, pipeline),
                "vkCreateComputePipelines")
            cleanup.append(lambda: lib.vkDestroyPipeline(self.device, pipeline[0], ffi.NULL))

            hosts, buffers = {}, []
            for b in layout.buffers:
                contents = self.contents(case, b)
                buffer, pointer = self.buffer(contents.nbytes, create, cleanup)
                ffi.memmove(pointer, contents.tobytes(), contents.nbytes)
                hosts[b.name] = (pointer, contents.dtype, len(contents))
                buffers.append(buffer)
            pool_size = ffi.new("VkDescriptorPoolSize *", {
                "type": lib.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, "descriptorCount": n_buffers})
            pool = create("DescriptorPool", vk.new("VkDescriptorPoolCreateInfo", maxSets=1,
                                                   poolSizeCount=1, pPoolSizes=pool_size))
            descriptor_set = ffi.new("VkDescriptorSet *")
            vk.check(lib.vkAllocateDescriptorSets(self.device, vk.new(
                "VkDescriptorSetAllocateInfo", descriptorPool=pool, descriptorSetCount=1,
                pSetLayouts=set_layouts), descriptor_set), "vkAllocateDescriptorSets")
            infos = [ffi.new("VkDescriptorBufferInfo *", {"buffer": buffer, "offset": 0,
                                                          "range": lib.VK_WHOLE_SIZE})
                     for buffer in buffers]
            writes = vk.new_array("VkWriteDescriptorSet", [
                {"dstSet": descriptor_set[0], "dstBinding": j, "descriptorCount": 1,
                 "descriptorType": lib.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, "pBufferInfo": info}
                for j, info in enumerate(infos)])
            lib.vkUpdateDescriptorSets(self.device, n_buffers, writes, 0, ffi.NULL)

            command_pool = create("CommandPool", vk.new("VkCommandPoolCreateInfo",
                                                        queueFamilyIndex=self.family))
            commands = ffi.new("VkCommandBuffer *")
            vk.check(lib.vkAllocateCommandBuffers(self.device, vk.new(
                "VkCommandBufferAllocateInfo", commandPool=command_pool,
                level=lib.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1), commands),
                "vkAllocateCommandBuffers")
            cb = commands[0]
            vk.check(lib.vkBeginCommandBuffer(cb, vk.new("VkCommandBufferBeginInfo")),
                     "vkBeginCommandBuffer")
            lib.vkCmdBindPipeline(cb, lib.VK_PIPELINE_BIND_POINT_COMPUTE, pipeline[0])
            lib.vkCmdBindDescriptorSets(cb, lib.VK_PIPELINE_BIND_POINT_COMPUTE, pipeline_layout,
                                        0, 1, descriptor_set, 0, ffi.NULL)
            if layout.push_constants:
                data = layout.pack_push_constants(case.scalars)
                lib.vkCmdPushConstants(cb, pipeline_layout, lib.VK_SHADER_STAGE_COMPUTE_BIT, 0,
                                       len(data), ffi.from_buffer(data))
            lib.vkCmdDispatch(cb, *case.grid)
            barrier = vk.new("VkMemoryBarrier", srcAccessMask=lib.VK_ACCESS_SHADER_WRITE_BIT,
                             dstAccessMask=lib.VK_ACCESS_HOST_READ_BIT)
            lib.vkCmdPipelineBarrier(cb, lib.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                                     lib.VK_PIPELINE_STAGE_HOST_BIT, 0, 1, barrier, 0, ffi.NULL,
                                     0, ffi.NULL)
            vk.check(lib.vkEndCommandBuffer(cb), "vkEndCommandBuffer")
            fence = create("Fence", vk.new("VkFenceCreateInfo"))
            vk.check(lib.vkQueueSubmit(self.queue, 1, vk.new(
                "VkSubmitInfo", commandBufferCount=1, pCommandBuffers=commands), fence),
                "vkQueueSubmit")
            vk.check(lib.vkWaitForFences(self.device, 1, ffi.new("VkFence[]", [fence]), 1,
                                         60 * 10**9), "vkWaitForFences")
            return {name: np.frombuffer(ffi.buffer(pointer, count * np.dtype(dtype).itemsize),
                                        dtype=dtype).copy()
                    for name, (pointer, dtype, count) in hosts.items()}
        finally:
            lib.vkDeviceWaitIdle(self.device)
            for undo in reversed(cleanup):
                undo()

    @staticmethod
    def contents(case, binding):
        """Inputs as given; outputs poisoned, with PAD elements more to catch strays."""
        dtype = NP[binding.dtype.name]
        if binding.name in case.outputs and binding.name not in case.inputs:
            return np.full((case.outputs[binding.name] + PAD) * np.dtype(dtype).itemsize, POISON,
                           np.uint8).view(dtype)
        given = np.asarray(case.inputs[binding.name], dtype)
        if binding.name in case.outputs:
            pad = np.full(PAD * given.itemsize, POISON, np.uint8).view(dtype)
            given = np.concatenate([given, pad])
        return given

    def buffer(self, size, create, cleanup):
        lib, ffi, vk = self.lib, self.ffi, self.vk
        buffer = create("Buffer", vk.new("VkBufferCreateInfo", size=max(size, 4),
                                         usage=lib.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT,
                                         sharingMode=lib.VK_SHARING_MODE_EXCLUSIVE))
        requirements = ffi.new("VkMemoryRequirements *")
        lib.vkGetBufferMemoryRequirements(self.device, buffer, requirements)
        wanted = lib.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | lib.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
        types = self.memory.memoryProperties
        index = next(j for j in range(types.memoryTypeCount)
                     if requirements.memoryTypeBits & (1 << j)
                     and types.memoryTypes[j].propertyFlags & wanted == wanted)
        memory = ffi.new("VkDeviceMemory *")
        vk.check(lib.vkAllocateMemory(self.device, vk.new(
            "VkMemoryAllocateInfo", allocationSize=requirements.size, memoryTypeIndex=index),
            ffi.NULL, memory), "vkAllocateMemory")
        cleanup.append(lambda: lib.vkFreeMemory(self.device, memory[0], ffi.NULL))
        vk.check(lib.vkBindBufferMemory(self.device, buffer, memory[0], 0), "vkBindBufferMemory")
        pointer = ffi.new("void **")
        vk.check(lib.vkMapMemory(self.device, memory[0], 0, lib.VK_WHOLE_SIZE, 0, pointer),
                 "vkMapMemory")
        return buffer, pointer[0]

    def destroy(self):
        if getattr(self, "device", None) is not None:
            self.lib.vkDestroyDevice(self.device, self.ffi.NULL)
        if self.messenger is not None:
            destroy = self.vk.instance_function(self.lib, self.instance,
                                                "vkDestroyDebugUtilsMessengerEXT")
            destroy(self.instance, self.messenger, self.ffi.NULL)
        self.lib.vkDestroyInstance(self.instance, self.ffi.NULL)


@pytest.fixture(scope="module")
def vulkan():
    try:
        from drivers import vulkan as vk
        vk.load()
    except Exception as error:      # the module or the loader is missing: say which
        pytest.skip(f"Vulkan loader not available: {error}")
    runner = VulkanRunner(vk)
    yield runner
    runner.destroy()
    assert runner.messages == []


@pytest.mark.parametrize("name", CASE_NAMES)
def test_runs_on_vulkan(vulkan, name):
    case = cases(np.random.default_rng(), vulkan.subgroup_size)[name]()
    missing = vulkan.missing(case.kernel)
    if missing:
        pytest.skip(f"{vulkan.name} lacks {', '.join(missing)}")
    seen = len(vulkan.messages)
    outputs = vulkan.run(case)
    assert vulkan.messages[seen:] == [], "the validation layer reported errors"
    check_outputs(case, outputs)


# -- running through wgpu (naga) ------------------------------------------------------------------
class WgpuRunner:
    """A wgpu device on the Vulkan adapter with its own limits and the features the kernels use
    (f16, subgroups, immediates = push constants) where offered."""

    def __init__(self, wgpu):
        self.wgpu, self.ffi = wgpu, wgpu.ffi
        self.lib = lib = wgpu.load()[0]
        ffi = wgpu.ffi
        extras = wgpu.new("WGPUInstanceExtras", backends=lib.WGPUInstanceBackend_Vulkan)
        self.instance = lib.wgpuCreateInstance(wgpu.chain(wgpu.new("WGPUInstanceDescriptor"),
                                                          extras))
        options = wgpu.new("WGPURequestAdapterOptions", backendType=lib.WGPUBackendType_Vulkan)
        self.adapter = wgpu.request_adapter(lib, self.instance, options)
        self.limits = wgpu.new("WGPULimits")
        lib.wgpuAdapterGetLimits(self.adapter, self.limits)
        wanted = {"f16": lib.WGPUFeatureName_ShaderF16, "subgroup": lib.WGPUNativeFeature_Subgroup,
                  "push": lib.WGPUNativeFeature_Immediates}
        self.has = {name: bool(lib.wgpuAdapterHasFeature(self.adapter, feature))
                    for name, feature in wanted.items()}
        features = [wanted[name] for name, offered in self.has.items() if offered]
        info = wgpu.new("WGPUAdapterInfo")
        lib.wgpuAdapterGetInfo(self.adapter, info)
        sizes = (info.subgroupMinSize, info.subgroupMaxSize)
        self.subgroup_size = sizes[0] if sizes[0] == sizes[1] and sizes[0] else None
        lib.wgpuAdapterInfoFreeMembers(info[0])
        self.errors = []
        self.callback = wgpu.uncaptured_error_callback(self.errors)
        self.device = wgpu.request_device(lib, self.instance, self.adapter, wgpu.new(
            "WGPUDeviceDescriptor", requiredFeatureCount=len(features),
            requiredFeatures=ffi.new("WGPUFeatureName[]", features), requiredLimits=self.limits,
            uncapturedErrorCallbackInfo={"callback": self.callback}))
        self.queue = lib.wgpuDeviceGetQueue(self.device)

    def missing(self, kernel):
        caps, need = spirv_capabilities(kernel), set()
        if caps & {"Float16", "StorageBuffer16BitAccess"}:
            need.add("f16")
        if "GroupNonUniform" in caps:
            need.add("subgroup")
        if binding_layout(kernel).push_constants:
            need.add("push")
        return sorted(n for n in need if not self.has[n])

    def run(self, case):
        lib, ffi, wgpu = self.lib, self.ffi, self.wgpu
        kernel, releases = case.kernel, []

        def make(kind, descriptor):
            call, release = f"wgpuDeviceCreate{kind}", getattr(lib, f"wgpu{kind}Release")
            with wgpu.error_scope(lib, self.instance, self.device, call):
                made = getattr(lib, call)(self.device, descriptor)
                releases.append(lambda: release(made))
            return made

        try:
            layout = binding_layout(kernel)
            code = render_spirv(kernel, self.subgroup_size)
            source = wgpu.new("WGPUShaderSourceSPIRV", codeSize=len(code) // 4,
                              code=ffi.from_buffer("uint32_t[]", code))
            module = make("ShaderModule", wgpu.chain(
                wgpu.new("WGPUShaderModuleDescriptor", label=kernel.name), source))
            entries = wgpu.new_array("WGPUBindGroupLayoutEntry", [
                {"binding": b.binding, "visibility": lib.WGPUShaderStage_Compute,
                 "buffer": {"type": lib.WGPUBufferBindingType_ReadOnlyStorage if b.access == "r"
                            else lib.WGPUBufferBindingType_Storage}} for b in layout.buffers])
            group_layout = make("BindGroupLayout", wgpu.new(
                "WGPUBindGroupLayoutDescriptor", entryCount=len(layout.buffers), entries=entries))
            group_layouts = ffi.new("WGPUBindGroupLayout[]", [group_layout])
            pipeline_layout = make("PipelineLayout", wgpu.new(
                "WGPUPipelineLayoutDescriptor", bindGroupLayoutCount=1,
                bindGroupLayouts=group_layouts, immediateSize=layout.push_constant_size))
            pipeline = make("ComputePipeline", wgpu.new(
                "WGPUComputePipelineDescriptor", label=kernel.name, layout=pipeline_layout,
                compute={"module": module, "entryPoint": kernel.name}))
            usage = (lib.WGPUBufferUsage_Storage | lib.WGPUBufferUsage_CopySrc
                     | lib.WGPUBufferUsage_CopyDst)
            buffers, sizes, group_entries = {}, {}, []
            for b in layout.buffers:
                contents = VulkanRunner.contents(case, b)
                size = -(-contents.nbytes // 4) * 4
                data = np.zeros(size, np.uint8)
                data[:contents.nbytes] = contents.view(np.uint8)
                buffer = make("Buffer", wgpu.new("WGPUBufferDescriptor", size=size, usage=usage))
                lib.wgpuQueueWriteBuffer(self.queue, buffer, 0, ffi.from_buffer(data), size)
                buffers[b.name], sizes[b.name] = buffer, (size, contents.dtype, len(contents))
                group_entries.append({"binding": b.binding, "buffer": buffer, "offset": 0,
                                      "size": size})
            group = make("BindGroup", wgpu.new(
                "WGPUBindGroupDescriptor", layout=group_layout, entryCount=len(group_entries),
                entries=wgpu.new_array("WGPUBindGroupEntry", group_entries)))
            readbacks = {name: make("Buffer", wgpu.new(
                "WGPUBufferDescriptor", size=size,
                usage=lib.WGPUBufferUsage_MapRead | lib.WGPUBufferUsage_CopyDst))
                for name, (size, _, _) in sizes.items()}
            with wgpu.error_scope(lib, self.instance, self.device, f"encoding {kernel.name}"):
                encoder = lib.wgpuDeviceCreateCommandEncoder(self.device, ffi.NULL)
                compute = lib.wgpuCommandEncoderBeginComputePass(encoder, ffi.NULL)
                lib.wgpuComputePassEncoderSetPipeline(compute, pipeline)
                lib.wgpuComputePassEncoderSetBindGroup(compute, 0, group, 0, ffi.NULL)
                if layout.push_constants:
                    data = layout.pack_push_constants(case.scalars)
                    lib.wgpuComputePassEncoderSetImmediates(compute, 0, ffi.from_buffer(data),
                                                            len(data))
                lib.wgpuComputePassEncoderDispatchWorkgroups(compute, *case.grid)
                lib.wgpuComputePassEncoderEnd(compute)
                lib.wgpuComputePassEncoderRelease(compute)
                for name, (size, _, _) in sizes.items():
                    lib.wgpuCommandEncoderCopyBufferToBuffer(encoder, buffers[name], 0,
                                                             readbacks[name], 0, size)
                commands = lib.wgpuCommandEncoderFinish(encoder, ffi.NULL)
                lib.wgpuCommandEncoderRelease(encoder)
            lib.wgpuQueueSubmit(self.queue, 1, ffi.new("WGPUCommandBuffer[]", [commands]))
            lib.wgpuCommandBufferRelease(commands)
            outputs = {}
            for name, (size, dtype, count) in sizes.items():
                wgpu.map_buffer(lib, self.instance, self.device, readbacks[name],
                                lib.WGPUMapMode_Read, 0, size)
                mapped = lib.wgpuBufferGetConstMappedRange(readbacks[name], 0, size)
                outputs[name] = np.frombuffer(ffi.buffer(mapped, count * dtype.itemsize),
                                              dtype=dtype).copy()
                lib.wgpuBufferUnmap(readbacks[name])
            return outputs
        finally:
            for release in reversed(releases):
                release()

    def release(self):
        self.lib.wgpuQueueRelease(self.queue)
        self.lib.wgpuDeviceRelease(self.device)
        self.lib.wgpuAdapterRelease(self.adapter)
        self.lib.wgpuInstanceRelease(self.instance)


@pytest.fixture(scope="module")
def wgpu_device():
    try:
        from drivers import wgpu
        wgpu.load()
        runner = WgpuRunner(wgpu)
    except Exception as error:      # the binding, the library or an adapter is missing
        pytest.skip(f"wgpu-native not available: {error}")
    yield runner
    runner.release()
    assert [str(e) for e in runner.errors] == []


@pytest.mark.parametrize("name", WGPU_CASE_NAMES)
def test_runs_through_wgpu(wgpu_device, name, request):
    subgroup_size = wgpu_device.subgroup_size
    if subgroup_size is None and name == "subgroups":
        # wgpu-native reports no size here; the Vulkan device is the same hardware (the
        # reference checks the lane ids the kernel reports, so a mismatch fails, not passes).
        subgroup_size = request.getfixturevalue("vulkan").subgroup_size
    case = wgpu_cases(np.random.default_rng(), subgroup_size)[name]()
    missing = wgpu_device.missing(case.kernel)
    if missing:
        pytest.skip(f"the wgpu adapter lacks {', '.join(missing)}")
    check_outputs(case, wgpu_device.run(case))
    assert [str(e) for e in wgpu_device.errors] == []
