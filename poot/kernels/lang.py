"""The kernel language: GPU kernels written once, in Python, for every target.

A kernel is built by calling a `KernelBuilder`: builder methods and Python operators on `Value`s
append statements to the current block, so a kernel is a flat list of single operations
(`Let`: one result each) nested in structured control flow (`If`, `For`): statements.py's
statements. Every value is defined once, before its uses, in the block where it is visible -
the shape PTX registers, SPIR-V SSA ids and C locals all accept. Mutable state lives in `Var`s. The finished `Kernel` is plain
data: parameters, shared arrays, workgroup size, body, and the capabilities it uses, which a
device compares with what it has. Renderers (codegen/) turn it into target code; this module
knows no target.
"""
import re
from contextlib import contextmanager
from dataclasses import dataclass

from poot.errors import ModelRefused
# the statements a body holds (statements.py), named here too, where the renderers take them
from .statements import (  # noqa: F401
    AsyncProxyFence, Assign, Barrier, BarrierExpect, BarrierInit, BarrierWait, CopyAsync,
    CopyCommit, CopyWait, For, If, Let, Return, Store, TensorLoad, VarDecl, Wgmma, WgmmaCommit,
    WgmmaFence, WgmmaWait, walk)


@dataclass(frozen=True)
class DType:
    name: str
    kind: str        # "f" float, "bf" bfloat (storage and conversion only), "i", "u", "b" bool
    bits: int

    @property
    def bytes(self):
        return self.bits // 8

    def __repr__(self):
        return self.name


F32, F16, BF16 = DType("f32", "f", 32), DType("f16", "f", 16), DType("bf16", "bf", 16)
I8, U8, I16, U16 = DType("i8", "i", 8), DType("u8", "u", 8), DType("i16", "i", 16), DType("u16", "u", 16)
I32, U32, I64, U64 = DType("i32", "i", 32), DType("u32", "u", 32), DType("i64", "i", 64), DType("u64", "u", 64)
BOOL = DType("bool", "b", 1)
DTYPES = {t.name: t for t in (F32, F16, BF16, I8, U8, I16, U16, I32, U32, I64, U64, BOOL)}

# Operations of a Let, by family. Arithmetic takes operands of one dtype; comparisons give BOOL.
BINARY = {"add", "sub", "mul", "div", "rem", "min", "max", "and", "or", "xor", "shl", "shr"}
COMPARE = {"lt", "le", "gt", "ge", "eq", "ne"}
UNARY = {"neg", "not", "abs", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sin", "cos", "tanh",
         "floor"}
FLOAT_ONLY = {"exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sin", "cos", "tanh", "floor"}
SPECIAL = {"thread_id", "block_id", "num_blocks", "lane_id", "subgroup_id"}
SUBGROUP = {"subgroup_add", "subgroup_max", "subgroup_min", "shuffle_xor", "shuffle"}
# Matrix operations of a subgroup of 32 lanes (their layouts: KernelBuilder.fragment_load and
# mma), and the capability each operand type of mma declares.
MATRIX = {"fragment_load", "mma"}
MMA_CAPS = {"f16": "mma_f16", "bf16": "mma_bf16"}
# The capability of copy_async, copy_commit and copy_wait (KernelBuilder.copy_async).
ASYNC_COPY = "async_copy"
# The capability of the warpgroup matrix operations (KernelBuilder.wgmma and its fences).
WGMMA = "wgmma"
# The capability of Hopper's tensor copies: tensor_map, tensor_load and the transaction barriers
# they complete (KernelBuilder.barrier_init, barrier_expect, barrier_wait).
TENSOR_COPY = "tensor_copy"
# Arithmetic on two f16 lanes of a u32 word (KernelBuilder.half2), and its capability.
HALF2 = {"sub": 2, "mul": 2, "fma": 3}
HALF2_ARITH = "half2_arith"
# Kernels, parameters and shared arrays are named in the target's code: identifiers in every one.
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _named(name, dtype=None):
    """`name`, checked as an identifier, of something that holds `dtype` values in memory."""
    if not _IDENTIFIER.match(name):
        raise ValueError(f"{name!r} is not an identifier")
    if dtype is not None and dtype.kind == "b":
        raise TypeError(f"{name}: bool has no memory layout")
    return name


@dataclass(frozen=True)
class Param:
    """A kernel argument: a buffer of `dtype` elements (`access` "r", "w" or "rw"), or a scalar."""
    name: str
    dtype: DType
    kind: str            # "buffer" or "scalar"
    access: str = "r"


@dataclass(frozen=True)
class TensorMap:
    """A buffer of 16-bit values seen as a matrix of `rows` x `cols` (the names of two scalar
    parameters; a row `cols` values long) for tensor_load, which copies boxes of `box_rows`
    rows x BOX_COLS values. It is no parameter the caller passes: the launcher builds it from
    the buffer's and the scalars' arguments."""
    name: str
    buffer: str
    cols: str
    rows: str
    box_rows: int


# A tensor_load box's row: 64 16-bit values, 128 bytes, the span of wgmma's 128-byte swizzle.
BOX_COLS = 64


@dataclass(frozen=True)
class Shared:
    name: str
    dtype: DType
    size: int            # elements
    align: int = 16      # bytes its start is a multiple of


class Value:
    """The result of one Let; Python operators on Values append Lets to the builder's block.

    Integer `/` and `//` divide as C does, truncating toward zero (not Python's floor), and `%`
    keeps the dividend's sign: write ceilings as (a + b - 1) // b.
    """

    def __init__(self, builder, vid, dtype):
        self.b, self.id, self.dtype = builder, vid, dtype

    def __repr__(self):
        return f"%{self.id}:{self.dtype}"

    def _bin(self, op, other, swap=False):
        other = self.b.coerce(other, self.dtype)
        a, b = (other, self) if swap else (self, other)
        return self.b.op(op, a, b)

    __add__ = lambda s, o: s._bin("add", o)
    __radd__ = lambda s, o: s._bin("add", o, True)
    __sub__ = lambda s, o: s._bin("sub", o)
    __rsub__ = lambda s, o: s._bin("sub", o, True)
    __mul__ = lambda s, o: s._bin("mul", o)
    __rmul__ = lambda s, o: s._bin("mul", o, True)
    __truediv__ = lambda s, o: s._bin("div", o)
    __rtruediv__ = lambda s, o: s._bin("div", o, True)
    __floordiv__ = lambda s, o: s._bin("div", o)
    __mod__ = lambda s, o: s._bin("rem", o)
    __and__ = lambda s, o: s._bin("and", o)
    __rand__ = lambda s, o: s._bin("and", o, True)
    __or__ = lambda s, o: s._bin("or", o)
    __ror__ = lambda s, o: s._bin("or", o, True)
    __xor__ = lambda s, o: s._bin("xor", o)
    __lshift__ = lambda s, o: s._bin("shl", o)
    __rshift__ = lambda s, o: s._bin("shr", o)
    __lt__ = lambda s, o: s._bin("lt", o)
    __le__ = lambda s, o: s._bin("le", o)
    __gt__ = lambda s, o: s._bin("gt", o)
    __ge__ = lambda s, o: s._bin("ge", o)
    __neg__ = lambda s: s.b.op("neg", s)
    __invert__ = lambda s: s.b.op("not", s)

    def eq(self, other):
        return self._bin("eq", other)

    def ne(self, other):
        return self._bin("ne", other)

    def to(self, dtype):
        """Numeric conversion (float <-> int round toward zero, float widths, bf16 <-> f32)."""
        return self if dtype == self.dtype else self.b.let("cast", dtype, (self,))

    def bitcast(self, dtype):
        if dtype.bits != self.dtype.bits:
            raise TypeError(f"bitcast {self.dtype} -> {dtype}: sizes differ")
        return self.b.let("bitcast", dtype, (self,))


class Var:
    """A mutable variable: `.get()` reads it where it is called, `.set(v)` writes it."""

    def __init__(self, builder, vid, dtype):
        self.b, self.id, self.dtype = builder, vid, dtype

    def get(self):
        return self.b.let("var_get", self.dtype, (), var=self.id)

    def set(self, value):
        value = self.b.coerce(value, self.dtype)
        if value.dtype != self.dtype:
            raise TypeError(f"var %{self.id} is {self.dtype}, assigned a {value.dtype}")
        self.b.emit(Assign(self.id, value))


class Buffer:
    """A buffer parameter: `buf[i]` loads one element, `buf[i] = v` stores one."""

    def __init__(self, builder, param):
        self.b, self.param = builder, param

    def __getitem__(self, index):
        return self.load(index)

    def __setitem__(self, index, value):
        self.store(index, value)

    def load(self, index, width=1):
        """One element, or `width` consecutive ones (a tuple) from an index divisible by width."""
        return self.b.load(self.param.name, False, self.param.dtype, index, width)

    def store(self, index, *values):
        self.b.store(self.param.name, False, self.param.dtype, index, values)


class SharedArray(Buffer):
    def __init__(self, builder, shared):
        self.b, self.param = builder, shared

    def load(self, index, width=1):
        return self.b.load(self.param.name, True, self.param.dtype, index, width)

    def store(self, index, *values):
        self.b.store(self.param.name, True, self.param.dtype, index, values)


@dataclass(frozen=True)
class Kernel:
    name: str
    params: tuple
    shared: tuple
    workgroup: tuple
    body: tuple
    caps: frozenset
    n_values: int
    resident: int = 1    # workgroups a multiprocessor should hold at once (a register budget)
    maps: tuple = ()     # TensorMaps, after the parameters

    @property
    def shared_bytes(self):
        return sum(s.size * s.dtype.bytes for s in self.shared)

    def require(self, offered, holder, where=""):
        """The one capability check: ModelRefused naming this kernel and each capability it
        needs beyond `offered`, what `holder` (a device, a renderer's target) has."""
        missing = self.caps - offered
        if missing:
            raise ModelRefused(f"{where}kernel {self.name} needs {', '.join(sorted(missing))}, "
                               f"which {holder} lacks")

    def param(self, name):
        return next(p for p in self.params if p.name == name)

    def array(self, name, shared):
        """The buffer parameter or shared array a load or store names."""
        found = [a for a in (self.shared if shared else self.params)
                 if a.name == name and (shared or a.kind == "buffer")]
        if not found:
            raise ValueError(f"{name!r} is no {'shared array' if shared else 'buffer'} of "
                             f"kernel {self.name}")
        return found[0]


class KernelBuilder:
    """Builds one Kernel. Use `with k.if_(c):`, `with k.for_(start, stop) as i:` for control."""

    def __init__(self, name, workgroup=(256, 1, 1), resident=1):
        """`resident`: how many workgroups of this kernel a multiprocessor should run at once,
        which a renderer that can meets by giving each thread fewer registers (PTX) and the
        others ignore."""
        self.name = _named(name)
        self.workgroup = tuple(workgroup) + (1,) * (3 - len(workgroup))
        self.resident = resident
        self.params, self.shared_arrays, self.maps = [], [], []
        self.caps = set()
        self._blocks = [[]]
        self._next = 0

    # -- declarations ----------------------------------------------------------------------------
    def buffer(self, name, dtype, access="r"):
        param = Param(_named(name, dtype), dtype, "buffer", access)
        self._add_param(param)
        if dtype.bits == 16:
            self.caps.add("storage16")
        elif dtype.bits == 8:
            self.caps.add("storage8")
        return Buffer(self, param)

    def scalar(self, name, dtype):
        if dtype not in (I32, U32, F32):
            raise TypeError(f"scalar parameter {name}: only i32, u32 and f32 are passed")
        self._add_param(Param(_named(name), dtype, "scalar"))
        return self.let("param", dtype, (), name=name)

    def shared(self, name, dtype, size, align=16):
        """A shared array of `size` elements whose start is a multiple of `align` bytes (a
        power of two from 16: wgmma's swizzled tiles need 1024)."""
        if any(s.name == name for s in self.shared_arrays):
            raise ValueError(f"shared array {name!r} declared twice")
        if align < 16 or align & (align - 1):
            raise ValueError(f"shared array {name!r}: align {align} is no power of two >= 16")
        array = Shared(_named(name, dtype), dtype, int(size), int(align))
        self.shared_arrays.append(array)
        return SharedArray(self, array)

    def _add_param(self, param):
        if any(p.name == param.name for p in self.params):
            raise ValueError(f"parameter {param.name!r} declared twice")
        self.params.append(param)

    # -- values ----------------------------------------------------------------------------------
    def emit(self, stmt):
        self._blocks[-1].append(stmt)

    def let(self, op, dtype, args, **attrs):
        self._next += 1
        self.emit(Let(self._next, op, dtype, tuple(args), tuple(sorted(attrs.items()))))
        if dtype.bits == 16 and dtype.kind in "fiu" and op not in ("load", "cast", "bitcast"):
            self.caps.add("float16" if dtype.kind == "f" else "int16")
        if dtype.bits == 64 and dtype.kind in "iu":
            self.caps.add("int64")
        return Value(self, self._next, dtype)

    def const(self, value, dtype):
        if dtype.kind in ("f", "bf"):
            value = float(value)
        elif dtype.kind == "b":
            value = bool(value)
        else:
            value = int(value)
        return self.let("const", dtype, (), value=value)

    def coerce(self, x, dtype):
        if isinstance(x, Value):
            if x.b is not self:
                raise ValueError("a value of another kernel")
            return x
        return self.const(x, dtype)

    def op(self, op, *args):
        a = args[0]
        args = tuple(self.coerce(x, a.dtype) for x in args)
        if any(x.dtype != a.dtype for x in args) and op not in ("shl", "shr"):
            raise TypeError(f"{op}: operands {[x.dtype for x in args]} differ")
        if a.dtype.kind == "bf":
            raise TypeError(f"{op} on bf16: convert to f32 first")
        if op in FLOAT_ONLY and a.dtype.kind != "f":
            raise TypeError(f"{op} needs a float operand, got {a.dtype}")
        return self.let(op, BOOL if op in COMPARE else a.dtype, args)

    def select(self, cond, a, b):
        """a where cond, else b (at least one of a, b a Value)."""
        dtype = a.dtype if isinstance(a, Value) else b.dtype
        return self.let("select", dtype, (cond, self.coerce(a, dtype), self.coerce(b, dtype)))

    def fma(self, a, b, c):
        """a * b + c (at least one operand a Value; the others take its dtype)."""
        dtype = next(x.dtype for x in (a, b, c) if isinstance(x, Value))
        return self.let("fma", dtype, tuple(self.coerce(x, dtype) for x in (a, b, c)))

    def min(self, a, b):
        return self.op("min", a, b)

    def max(self, a, b):
        return self.op("max", a, b)

    def var(self, dtype, init):
        init = self.coerce(init, dtype)
        if init.dtype != dtype:
            raise TypeError(f"a var of {dtype} initialised with a {init.dtype}")
        self._next += 1
        self.emit(VarDecl(self._next, dtype, init))
        return Var(self, self._next, dtype)

    # the unary math functions: k.exp(x), k.sqrt(x), ...
    def __getattr__(self, name):
        if name in UNARY:
            return lambda x: self.op(name, x)
        raise AttributeError(name)

    # -- indices ---------------------------------------------------------------------------------
    def thread_id(self, axis=0):
        return self.let("thread_id", I32, (), axis=axis)

    def block_id(self, axis=0):
        return self.let("block_id", I32, (), axis=axis)

    def num_blocks(self, axis=0):
        return self.let("num_blocks", I32, (), axis=axis)

    def lane_id(self):
        self.caps.add("subgroup")
        return self.let("lane_id", I32, ())

    def subgroup_id(self):
        self.caps.add("subgroup")
        return self.let("subgroup_id", I32, ())

    # -- memory ----------------------------------------------------------------------------------
    def load(self, name, shared, dtype, index, width):
        if width not in (1, 2, 4):
            raise ValueError(f"load width {width}: 1, 2 or 4")
        index = self.coerce(index, I32)
        vec = self.let("load", dtype, (index,), target=name, shared=shared, width=width)
        if width == 1:
            return vec
        return tuple(self.let("extract", dtype, (vec,), lane=i) for i in range(width))

    def store(self, name, shared, dtype, index, values):
        if len(values) not in (1, 2, 4):
            raise ValueError(f"store width {len(values)}: 1, 2 or 4")
        values = tuple(self.coerce(v, dtype) for v in values)
        if any(v.dtype != dtype for v in values):
            raise TypeError(f"store to {name} ({dtype}) of {[v.dtype for v in values]}")
        self.emit(Store(name, shared, self.coerce(index, I32), values))

    def atomic_add(self, array, index, value):
        """Adds a u32 `value` to element `index` of shared u32 `array` as one indivisible step,
        whatever other threads add to it at once; the element as it was before (wrapping
        around 2^32). A barrier orders the additions before it with the reads after it."""
        if not isinstance(array, SharedArray) or array.param.dtype != U32:
            raise TypeError("atomic_add: a shared u32 array")
        return self.let("atomic_add", U32, (self.coerce(index, I32), self.coerce(value, U32)),
                        target=array.param.name, shared=True)

    def barrier(self):
        self.emit(Barrier())

    def return_(self):
        self.emit(Return())

    # -- asynchronous copies ---------------------------------------------------------------------
    def copy_async(self, array, index, buffer, source, inside=None):
        """Starts copying 4 u32 words (16 bytes) from `buffer` at `source` into shared `array` at
        `index` (both multiples of 4) without waiting for them: shared memory filled while the
        thread goes on. Where `inside` is false it writes zeros and reads nothing (`source` must
        still name words of the buffer). The copy is complete for this thread once copy_wait
        has waited for its batch (copy_commit), and for the workgroup after a barrier that
        follows. A target could run it as a load and a store, commit and wait doing nothing;
        PTX has cp.async (sm_80), the other renderers refuse the capability."""
        if not isinstance(array, SharedArray) or array.param.dtype != U32:
            raise TypeError("copy_async writes a shared u32 array")
        if isinstance(buffer, SharedArray) or buffer.param.dtype != U32:
            raise TypeError("copy_async reads a u32 buffer")
        if inside is not None and inside.dtype != BOOL:
            raise TypeError(f"copy_async: inside is a bool, not {inside.dtype}")
        self.caps.add(ASYNC_COPY)
        self.emit(CopyAsync(array.param.name, self.coerce(index, I32), buffer.param.name,
                            self.coerce(source, I32), inside))

    def copy_commit(self):
        """Closes this thread's batch of copies: what copy_wait counts."""
        self.caps.add(ASYNC_COPY)
        self.emit(CopyCommit())

    def copy_wait(self, pending=0):
        """Waits until at most `pending` (an int) of this thread's committed batches, the
        newest ones, are still copying."""
        self.caps.add(ASYNC_COPY)
        self.emit(CopyWait(int(pending)))

    def unpack_half2(self, word):
        """The two f16 halves of a u32 word (low half first), as f32 values: how kernels read f16
        data from 32-bit words, which every target (wgpu's translator included) can load."""
        if word.dtype != U32:
            raise TypeError(f"unpack_half2 of {word.dtype}: a u32 word")
        pair = self.let("unpack_half2", F32, (word,))
        return self.let("extract", F32, (pair,), lane=0), self.let("extract", F32, (pair,), lane=1)

    def pack_half2(self, lo, hi):
        """A u32 word holding f32 values lo and hi rounded to f16 (low half first)."""
        if lo.dtype != F32 or hi.dtype != F32:
            raise TypeError("pack_half2 of f32 values")
        return self.let("pack_half2", U32, (lo, hi))

    def half2(self, op, *words):
        """Lane by lane arithmetic on two f16 values a u32 word (low half first), rounded to
        nearest f16: "sub" a - b, "mul" a * b, "fma" a * b + c. Where a kernel builds its mma
        operands from bits (quant nibbles under an f16 exponent) without leaving 16 bits."""
        if op not in HALF2 or len(words) != HALF2[op]:
            raise TypeError(f"half2 {op!r} of {len(words)} words: one of {HALF2}")
        words = tuple(self.coerce(w, U32) for w in words)
        if any(w.dtype != U32 for w in words):
            raise TypeError("half2 works on u32 words")
        self.caps.add(HALF2_ARITH)
        return self.let("half2", U32, words, arith=op)

    # -- subgroups -------------------------------------------------------------------------------
    def subgroup_add(self, x):
        self.caps.add("subgroup_arith")
        return self.let("subgroup_add", x.dtype, (x,))

    def subgroup_max(self, x):
        self.caps.add("subgroup_arith")
        return self.let("subgroup_max", x.dtype, (x,))

    def subgroup_min(self, x):
        self.caps.add("subgroup_arith")
        return self.let("subgroup_min", x.dtype, (x,))

    def shuffle_xor(self, x, mask):
        self.caps.add("subgroup_shuffle")
        return self.let("shuffle_xor", x.dtype, (x,), mask=int(mask))

    def shuffle(self, x, lane):
        self.caps.add("subgroup_shuffle")
        return self.let("shuffle", x.dtype, (x, self.coerce(lane, I32)))

    # -- matrices --------------------------------------------------------------------------------
    def fragment_load(self, array, index, trans=False):
        """Four 8 x 8 matrices of 16-bit elements from a shared u32 array (two elements a word,
        the lower column in the low half), as four u32 words per lane.

        Every lane of a subgroup of 32 takes part. Lane l names, by `index` (in words, a multiple
        of 4), the start of row l % 8 of matrix l // 8: 8 consecutive elements. Word j of lane l
        gets elements 2(l % 4) and 2(l % 4) + 1 of row l // 4 of matrix j: the lane's share of
        an mma operand. `trans`: of each matrix transposed instead, so elements (2(l % 4), l // 4)
        and (2(l % 4) + 1, l // 4): mma's `b` from B stored by rows (k-major)."""
        if not isinstance(array, SharedArray) or array.param.dtype != U32:
            raise TypeError("fragment_load reads a shared u32 array")
        self.caps.add("fragment_load")
        attrs = {"trans": True} if trans else {}
        vec = self.let("fragment_load", U32, (self.coerce(index, I32),), target=array.param.name,
                       **attrs)
        return tuple(self.let("extract", U32, (vec,), lane=i) for i in range(4))

    def mma(self, dtype, a, b, c):
        """D = A B + C for A 16 x 16 and B 16 x 8 of `dtype` (F16 or BF16), C and D 16 x 8 of
        f32, spread over the 32 lanes of a subgroup, every one of which takes part.

        With g = lane // 4 and q = lane % 4, a lane holds (a u32 word two elements, the lower
        column of A, the lower row of B, in the low half):
          a: 4 words, word j = A[g + 8 (j % 2)][2q + 8 (j // 2) + (0, 1)]
          b: 2 words, word j = B[2q + 8j + (0, 1)][g]
          c: 4 f32,   value j = C[g + 8 (j // 2)][2q + j % 2]; D (the result) alike.
        fragment_load gives `a` from A stored by rows (its matrices: rows 0-7 then 8-15 of
        columns 0-7, then the same of columns 8-15) and `b` from B stored by columns (B's
        column n as a row of 16 elements; matrices: k 0-7, then k 8-15)."""
        if dtype not in (F16, BF16):
            raise TypeError(f"mma of {dtype}: f16 or bf16")
        a, b = [self.coerce(v, U32) for v in a], [self.coerce(v, U32) for v in b]
        c = [self.coerce(v, F32) for v in c]
        if (len(a), len(b), len(c)) != (4, 2, 4) or any(v.dtype != U32 for v in a + b) \
                or any(v.dtype != F32 for v in c):
            raise TypeError("mma takes 4 u32 words of A, 2 of B and 4 f32 values of C")
        self.caps.add(MMA_CAPS[dtype.name])
        d = self.let("mma", F32, (*a, *b, *c), operand=dtype.name)
        return tuple(self.let("extract", F32, (d,), lane=i) for i in range(4))

    # -- warpgroup matrices (sm_90a) -------------------------------------------------------------
    def shared_address(self, array, index):
        """The shared-memory byte address (u32) of element `index` of a shared array: what a
        wgmma descriptor holds."""
        if not isinstance(array, SharedArray):
            raise TypeError("shared_address of a shared array")
        self.caps.add(WGMMA)
        return self.let("shared_address", U32, (self.coerce(index, I32),),
                        target=array.param.name)

    def async_proxy_fence(self):
        """See AsyncProxyFence: after a thread's shared stores (copy_async's too, once waited
        for) that wgmma reads next, before the barrier."""
        self.caps.add(WGMMA)
        self.emit(AsyncProxyFence())

    def wgmma_fence(self):
        self.caps.add(WGMMA)
        self.emit(WgmmaFence())

    def wgmma(self, dtype, desc_a, desc_b, accs):
        """accs += A B on the tensor cores of a warpgroup (4 subgroups, the first a multiple of
        4), every thread of which takes part, asynchronously: the accumulators are read only
        after wgmma_wait. A is 64 x 16 and B 16 x n (n = 2 len(accs), a multiple of 8, at most
        256) of `dtype` (F16 or BF16), each stored K-major in shared memory (a row of A, a
        column of B, 16 contiguous values) in 128-byte rows swizzled as the descriptors say
        (matmul.wgmma_descriptor). With w = subgroup % 4, g = lane // 4, q = lane % 4, a thread's
        accs[j] is D[16 w + g + 8 ((j // 2) % 2)][8 (j // 4) + 2 q + j % 2]."""
        if dtype not in (F16, BF16):
            raise TypeError(f"wgmma of {dtype}: f16 or bf16")
        n = 2 * len(accs)
        if n % 8 or not 8 <= n <= 256 or any(v.dtype != F32 for v in accs):
            raise TypeError(f"wgmma takes n/2 f32 accumulators for n a multiple of 8 up to 256, "
                            f"not {len(accs)}")
        if desc_a.dtype != U64 or desc_b.dtype != U64:
            raise TypeError("wgmma descriptors are u64 values")
        self.caps.add(WGMMA)
        self.emit(Wgmma(dtype.name, n, desc_a, desc_b, tuple(v.id for v in accs)))

    def wgmma_commit(self):
        self.caps.add(WGMMA)
        self.emit(WgmmaCommit())

    def wgmma_wait(self, pending=0):
        self.caps.add(WGMMA)
        self.emit(WgmmaWait(int(pending)))

    # -- tensor copies (sm_90) -------------------------------------------------------------------
    def tensor_map(self, name, buffer, cols, rows, box_rows):
        """A TensorMap of `buffer` (16-bit values in u32 words) whose shape is the scalar
        parameters named `cols` and `rows`, read in boxes of `box_rows` rows (at most 256)."""
        scalars = {p.name for p in self.params if p.kind == "scalar"}
        if cols not in scalars or rows not in scalars:
            raise ValueError(f"tensor_map {name}: {cols} and {rows} must be scalar parameters")
        if not 1 <= box_rows <= 256:
            raise ValueError(f"tensor_map {name}: a box has 1 to 256 rows, not {box_rows}")
        if any(m.name == name for m in self.maps) or any(p.name == name for p in self.params):
            raise ValueError(f"tensor map {name!r} declared twice")
        self.caps.add(TENSOR_COPY)
        tensor_map = TensorMap(_named(name), buffer.param.name, cols, rows, int(box_rows))
        self.maps.append(tensor_map)
        return tensor_map

    def _barrier_slot(self, array, index):
        if not isinstance(array, SharedArray) or array.param.dtype != U64:
            raise TypeError("a transaction barrier is an element of a shared u64 array")
        self.caps.add(TENSOR_COPY)
        return array.param.name, self.coerce(index, I32)

    def barrier_init(self, array, index, count):
        """Sets up the transaction barrier at array[index] for `count` arrivals a phase; the
        workgroup uses it after a barrier() that follows."""
        self.emit(BarrierInit(*self._barrier_slot(array, index), int(count)))

    def barrier_expect(self, array, index, nbytes):
        """This thread arrives at the barrier, which also waits for `nbytes` more bytes of
        tensor_load before its phase completes."""
        self.emit(BarrierExpect(*self._barrier_slot(array, index), int(nbytes)))

    def barrier_wait(self, array, index, parity):
        """Waits until the barrier's phase of `parity` (an i32 Value, 0 or 1: phases alternate,
        the first is 0) has completed; what its tensor_loads wrote is then visible to wgmma."""
        name, at = self._barrier_slot(array, index)
        self.emit(BarrierWait(name, at, self.coerce(parity, I32)))

    def tensor_load(self, tensor_map, array, index, col, row, barrier, barrier_index):
        """Starts copying the box of `tensor_map` at (row, col) into shared u32 `array` from
        element `index` (1024-byte aligned): box_rows rows of 128 bytes, 16-byte parts swizzled
        as wgmma reads them (part p of row r at p ^ (r % 8)), zeros past the matrix. Its bytes
        count toward the barrier's expected ones (barrier_expect)."""
        if not isinstance(array, SharedArray) or array.param.dtype != U32:
            raise TypeError("tensor_load writes a shared u32 array")
        name, at = self._barrier_slot(barrier, barrier_index)
        self.emit(TensorLoad(tensor_map.name, array.param.name, self.coerce(index, I32),
                             self.coerce(col, I32), self.coerce(row, I32), name, at))

    # -- control ---------------------------------------------------------------------------------
    @contextmanager
    def _block(self, block):
        self._blocks.append(block)
        try:
            yield
        finally:
            self._blocks.pop()

    @contextmanager
    def if_(self, cond):
        stmt = If(cond)
        self.emit(stmt)
        with self._block(stmt.then):
            yield stmt

    @contextmanager
    def else_(self, stmt):
        with self._block(stmt.orelse):
            yield

    @contextmanager
    def for_(self, start, stop, step=1, unroll=False):
        if isinstance(step, int) and step < 1:
            raise ValueError("for_: step must be positive")
        if isinstance(step, Value) and step.dtype != I32:
            raise TypeError(f"for_: step of {step.dtype}, not i32")
        start, stop = self.coerce(start, I32), self.coerce(stop, I32)
        self._next += 1
        stmt = For(Value(self, self._next, I32), start, stop, step, [], unroll)
        self.emit(stmt)
        with self._block(stmt.body):
            yield stmt.index

    def build(self):
        if len(self._blocks) != 1:
            raise RuntimeError("build() inside a block")
        caps = set(self.caps)
        if self.shared_arrays:
            caps.add("shared")
        return Kernel(self.name, tuple(self.params), tuple(self.shared_arrays), self.workgroup,
                      tuple(self._blocks[0]), frozenset(caps), self._next, self.resident,
                      tuple(self.maps))
