"""PTX instructions for the kernel language's operations on values: constants, arithmetic,
comparisons, math functions, conversions and subgroup reductions and shuffles. `Instructions` is
the part of ptx.py's renderer that picks them; it writes through the renderer's `emit` and takes
temporaries from its `temp`.

Numerics (tests/test_codegen_ptx.py checks each against numpy; "measured" is the largest error
seen on an H200 over 2^20 random arguments):
- f32 add/sub/mul carry `.rn`, so ptxas never contracts them into an fma the kernel did not ask
  for; div is div.rn and sqrt is sqrt.rn (both correctly rounded).
- f16 add/sub/mul/fma/min/max/neg/abs/floor use the .f16 instructions. f16 div, rem and the math
  functions go through f32 and round once at the end (div and sqrt stay correctly rounded: f32
  carries more than 2*11+2 bits).
- exp(x) = 2^t * (1 + e*ln2), where t + e = x*log2(e) is split exactly with an fma: a plain
  ex2.approx(x*log2e) loses |x*log2e|*2^-24 relative to the rounding of the product (5e-6 at
  x = 80); this keeps exp at the accuracy of ex2.approx itself (measured 2.4 ulp, 2e-7
  relative, over [-87, 88]). x is first clamped to [-104, 89] (NaN kept): -inf/inf give 0/inf;
  where 2^t overflows the result is that inf (the fma alone would give NaN for e < 0).
- exp2, rsqrt: ex2/rsqrt.approx.f32 (not .ftz: subnormals kept), measured 2.1 and 1.5 ulp.
- log2: lg2.approx.f32; log = lg2.approx * ln2. Their error is absolute near x = 1 (measured
  2.2e-7) and about 1e-7 relative elsewhere.
- sin, cos: the argument is first reduced to [-pi, pi] (x - k*2pi by two fmas with a split 2pi),
  then sin/cos.approx: absolute error measured 6e-7 for |x| up to 1e4.
- tanh: tanh.approx.f32; the PTX ISA bounds its relative error by 2^-11 (~5e-4); measured
  1.1e-5 on the H200.
- float rem is C's fmod (the sign of the dividend), exact while |a/b| < 2^23 and b is finite.
- float -> int rounds toward zero and saturates (NaN -> 0), as cvt.rzi does; int -> float rounds
  to nearest even; int -> bf16 rounds through f32; f32 -> bf16 is cvt.rn.bf16.f32 (nearest
  even) and bf16 -> f32 moves the bits into the high half.
- `ne` on floats is unordered (NaN != x is true, as in C); the other comparisons are ordered.
- Shifts take their amount as u32 (PTX clamps amounts past the width: shl gives 0, shr fills).
- subgroup_add/max/min: a butterfly (shfl.sync.bfly) over the 32 lanes of a warp, every lane of
  which must be active; the result is in every lane. 8/16-bit integers reduce in 32 bits (the
  sum wraps as in the type); f16 and bf16 reduce in f32 and round once at the end. On bool, max
  is "any lane" and min is "all lanes".
- half2 is {sub,mul,fma}.rn.f16x2 on b32 registers (sm_53 and later).
"""
import numpy as np

from poot.codegen import bf16_bits, f16_bits, f32_bits
from poot.kernels.lang import BF16, F16, F32

FULL_MASK = "0xffffffff"
WARP_LOG2 = 5
_SPECIAL_REGISTER = {"thread_id": "%tid", "block_id": "%ctaid", "num_blocks": "%nctaid"}
_UNSIGNED_COMPARE = {"lt": "lo", "le": "ls", "gt": "hi", "ge": "hs", "eq": "eq", "ne": "ne"}

LOG2E = float(np.log2(np.e))
LN2 = float(np.log(2.0))
TWO_PI = 2.0 * float(np.pi)


# -- numbers as PTX writes them ------------------------------------------------------------------
def _f32(x):
    return f"0f{f32_bits(x):08X}"


def _f32_split(x):
    """x as an f32 plus the f32 nearest to what the first one leaves out."""
    high = float(np.float32(x))
    return high, float(np.float32(x - high))


# -- types ---------------------------------------------------------------------------------------
def reg_class(dtype):
    if dtype.kind == "b":
        return "pred"
    return f"b{reg_bits(dtype)}"


def reg_bits(dtype):
    """Bits of the register a value of `dtype` lives in."""
    return max(dtype.bits, 16)


def int_type(dtype, bits=None):
    """The instruction type of an integer in its register: s16 (i8, i16), u32, s64, ..."""
    return ("s" if dtype.kind == "i" else "u") + str(bits or reg_bits(dtype))


class Instructions:
    def mov(self, d, a, dtype):
        self.emit(f"mov.{reg_class(dtype)} {d}, {a};")

    def narrow8(self, reg, dtype):
        """Renormalise an 8-bit integer held in a 16-bit register."""
        if dtype.bits == 8:
            if dtype.kind == "i":
                self.emit(f"cvt.s16.s8 {reg}, {reg};")
            else:
                self.emit(f"and.b16 {reg}, {reg}, 0xFF;")

    def to_f32(self, reg, dtype):
        """A b32 register holding the f32 value of a float register (f32, f16 or bf16)."""
        if dtype == F32:
            return reg
        wide = self.temp("b32")
        if dtype == F16:
            self.emit(f"cvt.f32.f16 {wide}, {reg};")
        else:
            self.emit(f"cvt.u32.u16 {wide}, {reg};")
            self.emit(f"shl.b32 {wide}, {wide}, 16;")
        return wide

    def from_f32(self, d, reg, dtype):
        if dtype == F32:
            self.emit(f"mov.b32 {d}, {reg};")
        elif dtype == F16:
            self.emit(f"cvt.rn.f16.f32 {d}, {reg};")
        else:
            self.emit(f"cvt.rn.bf16.f32 {d}, {reg};")

    def u32(self, reg, dtype):
        """A shift amount: PTX takes it as a u32."""
        if dtype.kind not in "iu":
            raise TypeError(f"shift amount of {dtype}")
        if reg_bits(dtype) == 32:
            return reg
        amount = self.temp("b32")
        self.emit(f"cvt.u32.u{reg_bits(dtype)} {amount}, {reg};")
        return amount

    def const(self, d, t, value):
        if t.kind == "b":
            self.emit(f"setp.ne.u32 {d}, {int(bool(value))}, 0;")
        elif t == F32:
            self.emit(f"mov.b32 {d}, {_f32(value)};")
        elif t == F16:
            self.emit(f"mov.b16 {d}, 0x{f16_bits(value):04X};")
        elif t == BF16:
            self.emit(f"mov.b16 {d}, 0x{bf16_bits(value):04X};")
        else:
            value = int(value) & ((1 << t.bits) - 1)
            if t.kind == "i" and value >> (t.bits - 1):
                value -= 1 << t.bits
            bits = value & ((1 << reg_bits(t)) - 1)
            literal = value if -65536 < value < 65536 else hex(bits)
            self.emit(f"mov.b{reg_bits(t)} {d}, {literal};")

    def special(self, op, d, axis):
        if op in _SPECIAL_REGISTER:
            self.emit(f"mov.u32 {d}, {_SPECIAL_REGISTER[op]}.{'xyz'[axis]};")
        elif op == "lane_id":
            self.emit(f"mov.u32 {d}, %laneid;")
        else:
            # Warps are cut from the linear thread id, x fastest.
            wx, wy, wz = self.kernel.workgroup
            linear = self.temp("b32")
            self.emit(f"mov.u32 {linear}, %tid.x;")
            if wy * wz > 1:
                y, z = self.temp("b32"), self.temp("b32")
                self.emit(f"mov.u32 {y}, %tid.y;")
                self.emit(f"mov.u32 {z}, %tid.z;")
                self.emit(f"mad.lo.u32 {y}, {z}, {wy}, {y};")
                self.emit(f"mad.lo.u32 {linear}, {y}, {wx}, {linear};")
            self.emit(f"shr.u32 {d}, {linear}, {WARP_LOG2};")

    def binary(self, op, t, d, a, b, b_type):
        if t.kind == "bf":
            raise TypeError(f"{op} on bf16: convert to f32 first")
        if t.kind == "b":
            logic = {"and": "and", "or": "or", "xor": "xor", "min": "and", "max": "or"}
            if op not in logic:
                raise TypeError(f"{op} on bool")
            return self.emit(f"{logic[op]}.pred {d}, {a}, {b};")
        bits = reg_bits(t)
        if op in ("and", "or", "xor"):
            return self.emit(f"{op}.b{bits} {d}, {a}, {b};")
        if op in ("shl", "shr"):
            if t.kind == "f":
                raise TypeError(f"{op} of {t}")
            amount = self.u32(b, b_type)
            kind = f"b{bits}" if op == "shl" else int_type(t)
            self.emit(f"{op}.{kind} {d}, {a}, {amount};")
            return self.narrow8(d, t)
        if t.kind == "f":
            return self.float_binary(op, t, d, a, b)
        instr = {"mul": "mul.lo"}.get(op, op)
        self.emit(f"{instr}.{int_type(t)} {d}, {a}, {b};")
        if op in ("add", "sub", "mul", "div"):
            self.narrow8(d, t)

    def float_binary(self, op, t, d, a, b):
        if op in ("add", "sub", "mul"):
            self.emit(f"{op}.rn.{t.name} {d}, {a}, {b};")
        elif op in ("min", "max"):
            self.emit(f"{op}.{t.name} {d}, {a}, {b};")
        elif op == "div" and t == F32:
            self.emit(f"div.rn.f32 {d}, {a}, {b};")
        else:
            x, y = self.to_f32(a, t), self.to_f32(b, t)
            result = d if t == F32 else self.temp("b32")
            if op == "div":
                self.emit(f"div.rn.f32 {result}, {x}, {y};")
            else:
                self.fmod(result, x, y)
            if t != F32:
                self.from_f32(d, result, t)

    def fmod(self, d, a, b):
        """d = a - b * trunc(a / b), the sign of a (C's fmod)."""
        q, step, signs = self.temp("b32"), self.temp("b32"), self.temp("b32")
        wrong = self.temp("pred")
        self.emit(f"div.rn.f32 {q}, {a}, {b};")
        self.emit(f"cvt.rzi.f32.f32 {q}, {q};")
        self.emit(f"neg.f32 {q}, {q};")
        self.emit(f"fma.rn.f32 {d}, {q}, {b}, {a};")
        # a/b rounded up to the next integer leaves d with the other sign: step back by |b|.
        self.emit(f"abs.f32 {step}, {b};")
        self.emit(f"copysign.f32 {step}, {a}, {step};")
        self.emit(f"xor.b32 {signs}, {d}, {a};")
        self.emit(f"setp.lt.s32 {wrong}, {signs}, 0;")
        self.emit(f"setp.ne.and.f32 {wrong}, {d}, 0f00000000, {wrong};")
        self.emit(f"@{wrong} add.rn.f32 {d}, {d}, {step};")
        self.emit(f"copysign.f32 {d}, {a}, {d};")    # a zero result keeps the sign of a too

    def compare(self, op, t, d, a, b):
        if t.kind == "b":
            self.bool_compare(op, d, a, b)
        elif t.kind == "bf":
            raise TypeError(f"{op} on bf16: convert to f32 first")
        elif t.kind == "f":
            self.emit(f"setp.{'neu' if op == 'ne' else op}.{t.name} {d}, {a}, {b};")
        elif t.kind == "i":
            self.emit(f"setp.{op}.{int_type(t)} {d}, {a}, {b};")
        else:
            self.emit(f"setp.{_UNSIGNED_COMPARE[op]}.{int_type(t)} {d}, {a}, {b};")

    def bool_compare(self, op, d, a, b):
        if op in ("eq", "ne"):
            self.emit(f"xor.pred {d}, {a}, {b};")
            if op == "eq":
                self.emit(f"not.pred {d}, {d};")
            return
        # false < true: a < b is !a & b, a <= b is !a | b, and the mirror images.
        first, second = (a, b) if op in ("lt", "le") else (b, a)
        negated = self.temp("pred")
        self.emit(f"not.pred {negated}, {first};")
        self.emit(f"{'and' if op in ('lt', 'gt') else 'or'}.pred {d}, {negated}, {second};")

    def unary(self, op, t, d, a):
        if t.kind == "b":
            if op not in ("not", "neg", "abs"):
                raise TypeError(f"{op} on bool")
            return self.emit(f"{'not' if op == 'not' else 'mov'}.pred {d}, {a};")
        if t.kind == "bf":
            raise TypeError(f"{op} on bf16: convert to f32 first")
        if op == "not":
            self.emit(f"not.b{reg_bits(t)} {d}, {a};")
            return self.narrow8(d, t)
        if t.kind in "iu":
            if op == "neg" or (op == "abs" and t.kind == "i"):
                self.emit(f"{op}.s{reg_bits(t)} {d}, {a};")
                return self.narrow8(d, t)
            if op == "abs":
                return self.mov(d, a, t)
            raise TypeError(f"{op} needs a float operand, got {t}")
        if op in ("neg", "abs"):
            self.emit(f"{op}.{t.name} {d}, {a};")
        elif op == "floor":
            self.emit(f"cvt.rmi.{t.name}.{t.name} {d}, {a};")
        else:
            x = self.to_f32(a, t)
            result = d if t == F32 else self.temp("b32")
            self.math(op, result, x)
            if t != F32:
                self.from_f32(d, result, t)

    def math(self, op, d, x):
        """An f32 math function, d = op(x) (d and x distinct registers)."""
        if op in ("exp2", "log2", "rsqrt", "tanh"):
            instr = {"exp2": "ex2", "log2": "lg2"}.get(op, op)
            self.emit(f"{instr}.approx.f32 {d}, {x};")
        elif op == "sqrt":
            self.emit(f"sqrt.rn.f32 {d}, {x};")
        elif op == "log":
            log2 = self.temp("b32")
            self.emit(f"lg2.approx.f32 {log2}, {x};")
            self.emit(f"mul.rn.f32 {d}, {log2}, {_f32(LN2)};")
        elif op == "exp":
            self.exp(d, x)
        elif op in ("sin", "cos"):
            self.sincos(op, d, x)
        else:
            raise TypeError(f"unknown math function {op!r}")

    def exp(self, d, x):
        high, low = _f32_split(LOG2E)
        clamped, t, minus_t, e, power = (self.temp("b32") for _ in range(5))
        self.emit(f"max.NaN.f32 {clamped}, {x}, {_f32(-104.0)};")
        self.emit(f"min.NaN.f32 {clamped}, {clamped}, {_f32(89.0)};")
        self.emit(f"mul.rn.f32 {t}, {clamped}, {_f32(high)};")
        self.emit(f"neg.f32 {minus_t}, {t};")
        # e = x*log2(e) - t, exactly from the fma, plus x times the low part of log2(e).
        self.emit(f"fma.rn.f32 {e}, {clamped}, {_f32(high)}, {minus_t};")
        self.emit(f"fma.rn.f32 {e}, {clamped}, {_f32(low)}, {e};")
        self.emit(f"mul.rn.f32 {e}, {e}, {_f32(LN2)};")
        self.emit(f"ex2.approx.f32 {power}, {t};")
        # past ln(FLT_MAX) the power is inf, and inf * e + inf is NaN for e < 0: keep the inf
        fused, overflow = self.temp("b32"), self.temp("pred")
        self.emit(f"fma.rn.f32 {fused}, {power}, {e}, {power};")
        self.emit(f"setp.eq.f32 {overflow}, {power}, 0f7F800000;")
        self.emit(f"selp.f32 {d}, {power}, {fused}, {overflow};")

    def sincos(self, op, d, x):
        high, low = _f32_split(TWO_PI)
        k, r = self.temp("b32"), self.temp("b32")
        self.emit(f"mul.rn.f32 {k}, {x}, {_f32(1.0 / TWO_PI)};")
        self.emit(f"cvt.rni.f32.f32 {k}, {k};")
        self.emit(f"neg.f32 {k}, {k};")
        self.emit(f"fma.rn.f32 {r}, {k}, {_f32(high)}, {x};")
        self.emit(f"fma.rn.f32 {r}, {k}, {_f32(low)}, {r};")
        self.emit(f"{op}.approx.f32 {d}, {r};")

    def select(self, t, d, cond, a, b):
        if t.kind != "b":
            return self.emit(f"selp.b{reg_bits(t)} {d}, {a}, {b}, {cond};")
        chosen, other, not_cond = self.temp("pred"), self.temp("pred"), self.temp("pred")
        self.emit(f"and.pred {chosen}, {a}, {cond};")
        self.emit(f"not.pred {not_cond}, {cond};")
        self.emit(f"and.pred {other}, {b}, {not_cond};")
        self.emit(f"or.pred {d}, {chosen}, {other};")

    def fma(self, t, d, a, b, c):
        if t.kind == "f":
            self.emit(f"fma.rn.{t.name} {d}, {a}, {b}, {c};")
        elif t.kind in "iu":
            self.emit(f"mad.lo.{int_type(t)} {d}, {a}, {b}, {c};")
            self.narrow8(d, t)
        else:
            raise TypeError(f"fma on {t}")

    def cast(self, d, dst, a, src):
        if src == dst:
            return self.mov(d, a, dst)
        floats = ("f", "bf")
        if dst.kind == "b":
            if src.kind == "bf":
                magnitude = self.temp("b16")
                self.emit(f"and.b16 {magnitude}, {a}, 0x7FFF;")
                self.emit(f"setp.ne.b16 {d}, {magnitude}, 0;")
            elif src == F16:
                zero = self.temp("b16")
                self.emit(f"mov.b16 {zero}, 0;")
                self.emit(f"setp.neu.f16 {d}, {a}, {zero};")
            elif src == F32:
                self.emit(f"setp.neu.f32 {d}, {a}, 0f00000000;")
            else:
                self.emit(f"setp.ne.{int_type(src)} {d}, {a}, 0;")
        elif src.kind == "b":
            one = {F32: _f32(1.0), F16: "0x3C00", BF16: "0x3F80"}.get(dst, "1")
            self.emit(f"selp.b{reg_bits(dst)} {d}, {one}, 0, {a};")
        elif src.kind in floats and dst.kind in floats:
            if dst == F32 and src == F16:
                self.emit(f"cvt.f32.f16 {d}, {a};")
            elif dst == F32:
                self.emit(f"cvt.u32.u16 {d}, {a};")
                self.emit(f"shl.b32 {d}, {d}, 16;")
            else:
                self.from_f32(d, self.to_f32(a, src), dst)
        elif src.kind in floats:
            x = a if src.kind == "f" else self.to_f32(a, src)
            ftype = "f16" if src == F16 else "f32"
            itype = int_type(dst, dst.bits if dst.bits == 8 else None)
            # Saturates to the range of the destination type, 8-bit ones included.
            self.emit(f"cvt.rzi.{itype}.{ftype} {d}, {x};")
            self.narrow8(d, dst)
        elif dst.kind in floats:
            if dst == BF16:
                wide = self.temp("b32")
                self.emit(f"cvt.rn.f32.{int_type(src)} {wide}, {a};")
                self.emit(f"cvt.rn.bf16.f32 {d}, {wide};")
            else:
                self.emit(f"cvt.rn.{dst.name}.{int_type(src)} {d}, {a};")
        else:
            source, target = reg_bits(src), reg_bits(dst)
            if target > source:     # extend by the source's signedness
                self.emit(f"cvt.{int_type(src, target)}.{int_type(src)} {d}, {a};")
            elif target < source:   # keep the low bits
                self.emit(f"cvt.u{target}.u{source} {d}, {a};")
            else:
                self.mov(d, a, dst)
            self.narrow8(d, dst)

    def bitcast(self, d, dst, a, src):
        if dst.bits != src.bits:
            raise TypeError(f"bitcast {src} -> {dst}: sizes differ")
        self.mov(d, a, dst)
        self.narrow8(d, dst)

    # -- subgroups -------------------------------------------------------------------------------
    def shfl(self, mode, reg, lane, cls):
        """shfl.sync of a b32 or b64 register over the full warp."""
        if cls == "b32":
            out = self.temp("b32")
            self.emit(f"shfl.sync.{mode}.b32 {out}, {reg}, {lane}, 0x1f, {FULL_MASK};")
            return out
        low, high, low_out, high_out = (self.temp("b32") for _ in range(4))
        out = self.temp("b64")
        self.emit(f"mov.b64 {{{low}, {high}}}, {reg};")
        self.emit(f"shfl.sync.{mode}.b32 {low_out}, {low}, {lane}, 0x1f, {FULL_MASK};")
        self.emit(f"shfl.sync.{mode}.b32 {high_out}, {high}, {lane}, 0x1f, {FULL_MASK};")
        self.emit(f"mov.b64 {out}, {{{low_out}, {high_out}}};")
        return out

    def reduce(self, kind, t, d, x):
        if t.kind == "b":
            if kind == "add":
                raise TypeError("subgroup_add on bool")
            vote = "any" if kind == "max" else "all"
            return self.emit(f"vote.sync.{vote}.pred {d}, {x}, {FULL_MASK};")
        if t.kind in ("f", "bf"):
            cls, combine = "b32", ("add.rn.f32" if kind == "add" else f"{kind}.f32")
            source = self.to_f32(x, t)
        else:
            cls = "b64" if t.bits == 64 else "b32"
            combine = f"{kind}.{int_type(t, 64 if t.bits == 64 else 32)}"
            source = x
            if reg_bits(t) == 16:
                source = self.temp("b32")
                self.emit(f"cvt.{int_type(t, 32)}.{int_type(t)} {source}, {x};")
        total = self.temp(cls)
        self.emit(f"mov.{cls} {total}, {source};")
        for offset in (16, 8, 4, 2, 1):
            other = self.shfl("bfly", total, str(offset), cls)
            self.emit(f"{combine} {total}, {total}, {other};")
        if t.kind in ("f", "bf"):
            self.from_f32(d, total, t)
        elif reg_bits(t) == 16:
            self.emit(f"cvt.u16.u32 {d}, {total};")
            self.narrow8(d, t)
        else:
            self.mov(d, total, t)

    def shuffle(self, mode, t, d, x, lane):
        if t.kind == "b":
            bits = self.temp("b32")
            self.emit(f"selp.u32 {bits}, 1, 0, {x};")
            self.emit(f"setp.ne.u32 {d}, {self.shfl(mode, bits, lane, 'b32')}, 0;")
        elif reg_bits(t) == 16:
            bits = self.temp("b32")
            self.emit(f"cvt.u32.u16 {bits}, {x};")
            self.emit(f"cvt.u16.u32 {d}, {self.shfl(mode, bits, lane, 'b32')};")
        else:
            self.mov(d, self.shfl(mode, x, lane, reg_class(t)), t)
