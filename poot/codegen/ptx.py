"""PTX text from a kernel of the kernel language, for NVIDIA GPUs of sm_80 and newer.

`render_ptx(kernel, sm)` gives one module holding one `.visible .entry` named after the kernel;
the driver JIT-compiles it. `kernel_params(kernel)` lists what a launcher packs, in order. This
module only writes text: it never touches a driver. It keeps to the semantics lang.py defines,
so a kernel computes here what it computes through the SPIR-V renderer.

Registers: one per value, named after the value's id and its register class: %p (bool, .pred),
%h (16 bits), %r (32 bits), %rd (64 bits). PTX has no 8-bit registers: i8/u8 values live in
16-bit registers, sign- or zero-extended, and are renormalised after every operation that can
carry out of 8 bits. A Var is a register named after its id; temporaries are %t<class><n>.

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
- For loops: `unroll` adds nothing; ptxas unrolls counted loops as it judges.
- fragment_load is ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16; mma is
  mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32, whose fragment layouts are
  the ones lang.py documents. Both need the whole warp.
- wgmma is wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16} on the Vars'
  registers in place (accumulating; both operands by shared-memory descriptor, K-major), with
  wgmma.fence / commit_group / wait_group and fence.proxy.async.shared::cta: sm_90a only
  (ptx_caps), the module then .target sm_90a, PTX ISA 8.0.
- half2 is {sub,mul,fma}.rn.f16x2 on b32 registers (sm_53 and later).
- copy_async is cp.async.cg (16 bytes, L2 only; a src-size of 0 where it is outside), commit
  and wait are cp.async.commit_group and cp.async.wait_group.
- A kernel's `resident` workgroups a multiprocessor become `.minnctapersm`: ptxas keeps each
  thread's registers within what lets that many run at once.

Shared arrays of up to 48 KiB in all are static `.shared` arrays; past that they are offsets into
one `.extern .shared` array, whose size the launch passes (dynamic_shared_bytes) after the
function is allowed it (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES), up to the target's
SHARED_LIMIT.
"""
import re

import numpy as np

from poot.codegen import bf16_bits, f16_bits, f32_bits
from poot.errors import ModelRefused
from poot.kernels.lang import (ASYNC_COPY, BF16, BINARY, BOOL, COMPARE, F16, F32, HALF2_ARITH,
                               I32, SPECIAL, UNARY, WGMMA, AsyncProxyFence, Assign, Barrier,
                               CopyAsync, CopyCommit, CopyWait, For, If, Let, Return, Store,
                               VarDecl, Wgmma, WgmmaCommit, WgmmaFence, WgmmaWait)

# What every sm_80+ device offers, in lang.py's capability names: the matrix operations are
# ldmatrix (sm_75) and mma.sync m16n8k16 with f16 or bf16 operands (sm_80); cp.async (sm_80).
PTX_CAPS = frozenset({"storage16", "storage8", "float16", "int16", "int64", "subgroup",
                      "subgroup_arith", "subgroup_shuffle", "shared", "fragment_load", "mma_f16",
                      "mma_bf16", ASYNC_COPY, HALF2_ARITH})

# sm_90a adds the warpgroup matrix operations (wgmma and the fences around it), PTX ISA 8.0: a
# kernel that uses them is rendered for sm_90a, which only an sm_90 device runs.
WGMMA_SM, WGMMA_VERSION = 90, "8.0"


def ptx_caps(sm):
    """What PTX offers a device of sm_`sm` (lang.py's capability names)."""
    return PTX_CAPS | {WGMMA} if sm == WGMMA_SM else PTX_CAPS


# The lowest PTX ISA version that names each target; the instructions rendered here need 7.0
# (sm_80: cvt.rn.bf16.f32, min/max.NaN, min/max.f16, tanh.approx), which every entry covers.
PTX_VERSION = {80: "7.0", 86: "7.1", 87: "7.4", 89: "7.8", 90: "7.8", 100: "8.6", 101: "8.6",
               103: "8.8", 110: "9.0", 120: "8.7", 121: "8.8"}

# Static .shared arrays beyond 48 KiB need dynamic shared memory and an opt-in at launch, up to
# the target's limit of a workgroup (the CUDA programming guide's "maximum amount of shared memory
# per thread block", opt-in, by compute capability).
STATIC_SHARED_LIMIT = 48 * 1024
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024,
                100: 227 * 1024, 101: 227 * 1024, 103: 227 * 1024, 110: 227 * 1024,
                120: 99 * 1024, 121: 99 * 1024}
DYNAMIC_SHARED = "sh_dynamic"

FULL_MASK = "0xffffffff"
WARP_LOG2 = 5
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PREFIX = {"pred": "p", "b16": "h", "b32": "r", "b64": "rd"}
_SPECIAL_REGISTER = {"thread_id": "%tid", "block_id": "%ctaid", "num_blocks": "%nctaid"}
_UNSIGNED_COMPARE = {"lt": "lo", "le": "ls", "gt": "hi", "ge": "hs", "eq": "eq", "ne": "ne"}
_SCALAR_PARAM = {"i32": "s32", "u32": "u32", "f32": "f32"}

LOG2E = float(np.log2(np.e))
LN2 = float(np.log(2.0))
TWO_PI = 2.0 * float(np.pi)


def kernel_params(kernel):
    """(name, ctype) per kernel parameter, in order: buffers are u64 device pointers, scalars
    i32/u32/f32."""
    return [(p.name, "u64" if p.kind == "buffer" else p.dtype.name) for p in kernel.params]


def _shared_offsets(kernel):
    """({shared array: byte offset}, bytes in all) of the arrays laid out in one, each at its
    alignment (16 bytes at least)."""
    offsets, at = {}, 0
    for array in kernel.shared:
        at = -(-at // array.align) * array.align
        offsets[array.name] = at
        at += -(-array.size * array.dtype.bytes // 16) * 16
    return offsets, at


def dynamic_shared_bytes(kernel):
    """The shared memory a launch of `kernel` passes: 0 where its arrays are static."""
    return _shared_offsets(kernel)[1] if kernel.shared_bytes > STATIC_SHARED_LIMIT else 0


def render_ptx(kernel, sm=90):
    """The PTX module (text) of `kernel` for target sm_`sm`."""
    return _Renderer(kernel, sm).module()


# -- numbers as PTX writes them ------------------------------------------------------------------
def _f32(x):
    return f"0f{f32_bits(x):08X}"


def _f32_split(x):
    """x as an f32 plus the f32 nearest to what the first one leaves out."""
    high = float(np.float32(x))
    return high, float(np.float32(x - high))


# -- types ---------------------------------------------------------------------------------------
def _class(dtype):
    if dtype.kind == "b":
        return "pred"
    return f"b{_width(dtype)}"


def _width(dtype):
    """Bits of the register a value of `dtype` lives in."""
    return max(dtype.bits, 16)


def _int(dtype, bits=None):
    """The instruction type of an integer in its register: s16 (i8, i16), u32, s64, ..."""
    return ("s" if dtype.kind == "i" else "u") + str(bits or _width(dtype))


def _memory(dtype):
    """The ld/st type: sign- or zero-extending for 8 bits, plain bits otherwise."""
    if dtype.bits == 8:
        return _int(dtype, 8)
    return f"b{dtype.bits}"


class _Renderer:
    def __init__(self, kernel, sm):
        if sm not in PTX_VERSION:
            raise ValueError(f"sm_{sm}: the PTX renderer knows "
                             f"{', '.join(f'sm_{s}' for s in PTX_VERSION)}")
        kernel.require(ptx_caps(sm), f"PTX for sm_{sm}")
        if dynamic_shared_bytes(kernel) > SHARED_LIMIT[sm]:
            raise ModelRefused(f"kernel {kernel.name} needs {kernel.shared_bytes} bytes of shared "
                               f"memory; a workgroup of sm_{sm} has at most {SHARED_LIMIT[sm]}")
        names = [kernel.name] + [p.name for p in kernel.params] + [s.name for s in kernel.shared]
        for name in names:
            if not _IDENTIFIER.match(name):
                raise ValueError(f"{name!r} is not a PTX identifier")
        arrays = [p for p in kernel.params if p.kind == "buffer"] + list(kernel.shared)
        for array in arrays:
            if array.dtype.kind == "b":
                raise TypeError(f"{array.name}: bool has no memory layout")
        self.kernel, self.sm = kernel, sm
        self.registers = {}      # name -> class, in order of first use
        self.lines = []
        self.vectors = {}        # vector load id -> its lanes' registers
        self.vars = {}           # var id -> dtype
        self.labels = self.temps = 0
        self.depth = 1
        # shared array -> its byte offset in the dynamic array (None: static arrays)
        self.offsets = _shared_offsets(kernel)[0] if dynamic_shared_bytes(kernel) else None

    # -- output ----------------------------------------------------------------------------------
    def emit(self, text):
        self.lines.append("    " * self.depth + text)

    def label(self, name):
        self.lines.append(f"{name}:")

    def module(self):
        k = self.kernel
        if self.sm >= 90:
            # Launched programmatically (PtxDevice.launch), a kernel may start before the one
            # before it in the stream has completed: it waits for that one's results here
            self.emit("griddepcontrol.wait;")
        for p in k.params:
            if p.kind == "buffer":
                pointer = f"%ptr_{p.name}"
                self.registers[pointer] = "b64"
                self.emit(f"ld.param.u64 {pointer}, [param_{p.name}];")
                self.emit(f"cvta.to.global.u64 {pointer}, {pointer};")
        self.block(k.body)
        self.ret()

        params = [f"    .param .{'u64' if p.kind == 'buffer' else _SCALAR_PARAM[p.dtype.name]} "
                  f"param_{p.name}" for p in k.params]
        wgmma = WGMMA in k.caps
        version = WGMMA_VERSION if wgmma else PTX_VERSION[self.sm]
        align = max((a.align for a in k.shared), default=16)
        out = [f"// {k.name}: rendered by poot.codegen.ptx",
               f".version {version}", f".target sm_{self.sm}{'a' * wgmma}", ".address_size 64",
               "", *([f".extern .shared .align {align} .b8 {DYNAMIC_SHARED}[];", ""]
                     if self.offsets else []),
               f".visible .entry {k.name}(" + ("\n" + ",\n".join(params) + "\n" if params else "")
               + ")", ".reqntid {}, {}, {}".format(*k.workgroup),
               *([f".minnctapersm {k.resident}"] if k.resident > 1 else []), "{"]
        for cls in ("pred", "b16", "b32", "b64"):
            names = [n for n, c in self.registers.items() if c == cls]
            for i in range(0, len(names), 12):
                out.append(f"    .reg .{cls} {', '.join(names[i:i + 12])};")
        for array in k.shared if self.offsets is None else ():
            size = array.size * array.dtype.bytes
            out.append(f"    .shared .align {array.align} .b8 sh_{array.name}[{size}];")
        out += self.lines
        out.append("}")
        return "\n".join(out) + "\n"

    # -- registers -------------------------------------------------------------------------------
    def named(self, vid, dtype, suffix=""):
        cls = _class(dtype)
        name = f"%{_PREFIX[cls]}{vid}{suffix}"
        self.registers.setdefault(name, cls)
        return name

    def val(self, value):
        return self.named(value.id, value.dtype)

    def temp(self, cls):
        self.temps += 1
        name = f"%t{_PREFIX[cls]}{self.temps}"
        self.registers[name] = cls
        return name

    def mov(self, d, a, dtype):
        self.emit(f"mov.{_class(dtype)} {d}, {a};")

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
        if _width(dtype) == 32:
            return reg
        amount = self.temp("b32")
        self.emit(f"cvt.u32.u{_width(dtype)} {amount}, {reg};")
        return amount

    # -- statements ------------------------------------------------------------------------------
    def block(self, body):
        for stmt in body:
            if isinstance(stmt, Let):
                start = len(self.lines)
                self.let(stmt)
                if len(self.lines) > start:
                    self.lines[start] += f"  // %{stmt.id} = {stmt.op}"
            elif isinstance(stmt, Store):
                self.store(stmt)
            elif isinstance(stmt, VarDecl):
                self.vars[stmt.id] = stmt.dtype
                self.assign(stmt.id, stmt.init)
            elif isinstance(stmt, Assign):
                self.assign(stmt.var, stmt.value)
            elif isinstance(stmt, If):
                self.if_(stmt)
            elif isinstance(stmt, For):
                self.for_(stmt)
            elif isinstance(stmt, Barrier):
                self.emit("bar.sync 0;")
            elif isinstance(stmt, CopyAsync):
                self.copy_async(stmt)
            elif isinstance(stmt, CopyCommit):
                self.emit("cp.async.commit_group;")
            elif isinstance(stmt, CopyWait):
                self.emit(f"cp.async.wait_group {stmt.pending};")
            elif isinstance(stmt, Return):
                self.ret()
            elif isinstance(stmt, AsyncProxyFence):
                self.emit("fence.proxy.async.shared::cta;")
            elif isinstance(stmt, WgmmaFence):
                self.emit("wgmma.fence.sync.aligned;")
            elif isinstance(stmt, Wgmma):
                self.wgmma(stmt)
            elif isinstance(stmt, WgmmaCommit):
                self.emit("wgmma.commit_group.sync.aligned;")
            elif isinstance(stmt, WgmmaWait):
                self.emit(f"wgmma.wait_group.sync.aligned {stmt.pending};")
            else:
                raise TypeError(f"unknown statement {stmt!r}")

    def ret(self):
        """A thread's end. On sm_90 it first lets the next kernel of the stream launch: once
        every thread of the grid has, that kernel's launch overlaps the end of this one (the
        writes reaching memory), and its griddepcontrol.wait holds it until they have. Placed
        at the start instead, the next kernel's workgroups wait on the multiprocessors while
        this one runs (measured slower on the H200). A no-op where launched the plain way."""
        if self.sm >= 90:
            self.emit("griddepcontrol.launch_dependents;")
        self.emit("ret;")

    def var(self, var):
        if var not in self.vars:
            raise ValueError(f"var %{var} is used but never declared in kernel {self.kernel.name}")
        return self.vars[var]

    def assign(self, var, value):
        dtype = self.var(var)
        if value.dtype != dtype:
            raise TypeError(f"var %{var} is {dtype}, assigned a {value.dtype}")
        self.mov(self.named(var, dtype), self.val(value), dtype)

    def if_(self, stmt):
        self.labels += 1
        n = self.labels
        cond = self.val(stmt.cond)
        if stmt.cond.dtype != BOOL:
            test = self.temp("pred")
            self.cast(test, BOOL, cond, stmt.cond.dtype)
            cond = test
        self.emit(f"@!{cond} bra $L{n}_{'else' if stmt.orelse else 'end'};")
        self.depth += 1
        self.block(stmt.then)
        if stmt.orelse:
            self.emit(f"bra $L{n}_end;")
            self.label(f"$L{n}_else")
            self.block(stmt.orelse)
        self.depth -= 1
        self.label(f"$L{n}_end")

    def for_(self, stmt):
        self.labels += 1
        n = self.labels
        index, stop = self.val(stmt.index), self.val(stmt.stop)
        if isinstance(stmt.step, int):
            step = str(stmt.step)
        elif stmt.step.dtype == I32:
            step = self.val(stmt.step)
        else:
            raise TypeError(f"for step of {stmt.step.dtype}: i32")
        self.emit(f"mov.b32 {index}, {self.val(stmt.start)};")
        self.label(f"$L{n}_loop")
        done = self.temp("pred")
        self.emit(f"setp.ge.s32 {done}, {index}, {stop};")
        self.emit(f"@{done} bra $L{n}_end;")
        self.depth += 1
        self.block(stmt.body)
        self.emit(f"add.s32 {index}, {index}, {step};")
        self.emit(f"bra $L{n}_loop;")
        self.depth -= 1
        self.label(f"$L{n}_end")

    # -- memory ----------------------------------------------------------------------------------
    def address(self, name, shared, index):
        """The address of element `index` (a Value) of a buffer or shared array."""
        size = self.kernel.array(name, shared).dtype.bytes
        reg, dtype = self.val(index), index.dtype
        if dtype.kind not in "iu":
            raise TypeError(f"index of {dtype}")
        if shared:
            if _width(dtype) != 32:
                narrow = self.temp("b32")
                self.emit(f"cvt.{_int(dtype, 32)}.{_int(dtype)} {narrow}, {reg};")
                reg = narrow
            base, address = self.temp("b32"), self.temp("b32")
            if self.offsets is None:
                self.emit(f"mov.u32 {base}, sh_{name};")
            else:
                self.emit(f"mov.u32 {base}, {DYNAMIC_SHARED};")
                self.emit(f"add.u32 {base}, {base}, {self.offsets[name]};")
            self.emit(f"mad.lo.s32 {address}, {reg}, {size}, {base};")
            return address
        offset, address = self.temp("b64"), self.temp("b64")
        if _width(dtype) == 64:
            self.emit(f"mul.lo.s64 {offset}, {reg}, {size};")
        else:
            if _width(dtype) == 16:
                wide = self.temp("b32")
                self.emit(f"cvt.{_int(dtype, 32)}.{_int(dtype)} {wide}, {reg};")
                reg = wide
            # 32-bit indices widen here, so a buffer may pass 2 GiB.
            self.emit(f"mul.wide.{_int(dtype, 32)} {offset}, {reg}, {size};")
        self.emit(f"add.s64 {address}, %ptr_{name}, {offset};")
        return address

    def access(self, verb, space, dtype, address, regs):
        """ld/st of consecutive elements, in vectors of at most 16 bytes and 4 lanes."""
        per = min(4, 16 // dtype.bytes)
        for start in range(0, len(regs), per):
            chunk = regs[start:start + per]
            vector = f".v{len(chunk)}" if len(chunk) > 1 else ""
            data = chunk[0] if len(chunk) == 1 else "{" + ", ".join(chunk) + "}"
            offset = start * dtype.bytes
            where = f"[{address}+{offset}]" if offset else f"[{address}]"
            operands = f"{data}, {where}" if verb == "ld" else f"{where}, {data}"
            self.emit(f"{verb}.{space}{vector}.{_memory(dtype)} {operands};")

    def copy_async(self, stmt):
        target, source = self.kernel.array(stmt.target, True), self.kernel.array(stmt.source, False)
        if target.dtype.bytes != 4 or source.dtype.bytes != 4:
            raise TypeError(f"copy_async {stmt.source} -> {stmt.target}: 32-bit arrays")
        to = self.address(stmt.target, True, stmt.index)
        at = self.address(stmt.source, False, stmt.source_index)
        size = "16"
        if stmt.inside is not None:
            size = self.temp("b32")
            self.emit(f"selp.u32 {size}, 16, 0, {self.val(stmt.inside)};")
        self.emit(f"cp.async.cg.shared.global [{to}], [{at}], 16, {size};")

    def wgmma(self, stmt):
        """The accumulators are the Vars' own registers, written in place: no copy of them may
        stand between a wgmma and the wait that ends it."""
        for vid in stmt.accs:
            self.var(vid)
        accs = ", ".join(self.named(vid, F32) for vid in stmt.accs)
        scale = self.temp("pred")
        self.emit(f"setp.ne.b32 {scale}, 1, 0;")
        kind = stmt.operand
        self.emit(f"wgmma.mma_async.sync.aligned.m64n{stmt.n}k16.f32.{kind}.{kind} {{{accs}}}, "
                  f"{self.val(stmt.desc_a)}, {self.val(stmt.desc_b)}, {scale}, 1, 1, 0, 0;")

    def load(self, let):
        name, shared, width = let.attr("target"), let.attr("shared"), let.attr("width", 1)
        array = self.kernel.array(name, shared)
        if width == 1:
            regs = [self.named(let.id, let.dtype)]
        else:
            regs = [self.named(let.id, let.dtype, f"_{lane}") for lane in range(width)]
            self.vectors[let.id] = regs
        address = self.address(name, shared, let.args[0])
        space = "shared" if shared else ("global.nc" if array.access == "r" else "global")
        self.access("ld", space, array.dtype, address, regs)

    def store(self, stmt):
        array = self.kernel.array(stmt.target, stmt.shared)
        values = [self.val(v) for v in stmt.values]
        address = self.address(stmt.target, stmt.shared, stmt.index)
        self.access("st", "shared" if stmt.shared else "global", array.dtype, address, values)

    # -- values ----------------------------------------------------------------------------------
    def let(self, let):
        op, t = let.op, let.dtype
        if op == "load":
            return self.load(let)
        if op == "unpack_half2":
            return self.unpack_half2(let)
        if op == "fragment_load":
            return self.fragment_load(let)
        if op == "mma":
            return self.mma(let)
        d = self.named(let.id, t)
        if op == "shared_address":
            return self.mov(d, self.address(let.attr("target"), True, let.args[0]), t)
        if op == "extract":
            return self.mov(d, self.vectors[let.args[0].id][let.attr("lane")], t)
        if op == "var_get":
            self.var(let.attr("var"))
            return self.mov(d, self.named(let.attr("var"), t), t)
        args = [self.val(a) for a in let.args]
        types = [a.dtype for a in let.args]
        if op == "const":
            self.const(d, t, let.attr("value"))
        elif op == "param":
            self.emit(f"ld.param.{_class(t)} {d}, [param_{let.attr('name')}];")
        elif op in SPECIAL:
            self.special(op, d, let.attr("axis", 0))
        elif op in BINARY:
            self.binary(op, t, d, args[0], args[1], types[1])
        elif op in COMPARE:
            self.compare(op, types[0], d, args[0], args[1])
        elif op in UNARY:
            self.unary(op, t, d, args[0])
        elif op == "select":
            self.select(t, d, *args)
        elif op == "fma":
            self.fma(t, d, *args)
        elif op == "cast":
            self.cast(d, t, args[0], types[0])
        elif op == "bitcast":
            self.bitcast(d, t, args[0], types[0])
        elif op in ("subgroup_add", "subgroup_max", "subgroup_min"):
            self.reduce(op[len("subgroup_"):], t, d, args[0])
        elif op == "shuffle_xor":
            self.shuffle("bfly", t, d, args[0], str(let.attr("mask")))
        elif op == "shuffle":
            self.shuffle("idx", t, d, args[0], self.u32(args[1], types[1]))
        elif op == "half2":
            self.emit(f"{let.attr('arith')}.rn.f16x2 {d}, {', '.join(args)};")
        elif op == "pack_half2":
            lo, hi = self.temp("b16"), self.temp("b16")
            self.emit(f"cvt.rn.f16.f32 {lo}, {args[0]};")
            self.emit(f"cvt.rn.f16.f32 {hi}, {args[1]};")
            self.emit(f"mov.b32 {d}, {{{lo}, {hi}}};")
        else:
            raise TypeError(f"unknown op {op!r}")

    def unpack_half2(self, let):
        """The two f16 halves of a b32 word as f32 lanes (low half first)."""
        lanes = [self.named(let.id, F32, f"_{lane}") for lane in range(2)]
        self.vectors[let.id] = lanes
        lo, hi = self.temp("b16"), self.temp("b16")
        self.emit(f"mov.b32 {{{lo}, {hi}}}, {self.val(let.args[0])};")
        self.emit(f"cvt.f32.f16 {lanes[0]}, {lo};")
        self.emit(f"cvt.f32.f16 {lanes[1]}, {hi};")

    def fragment_load(self, let):
        words = [self.named(let.id, let.dtype, f"_{lane}") for lane in range(4)]
        self.vectors[let.id] = words
        address = self.address(let.attr("target"), True, let.args[0])
        trans = ".trans" if let.attr("trans") else ""
        self.emit(f"ldmatrix.sync.aligned.m8n8.x4{trans}.shared.b16 {{{', '.join(words)}}}, "
                  f"[{address}];")

    def mma(self, let):
        d = [self.named(let.id, F32, f"_{lane}") for lane in range(4)]
        self.vectors[let.id] = d
        args = [self.val(a) for a in let.args]
        kind = let.attr("operand")
        self.emit(f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
                  f"{{{', '.join(d)}}}, {{{', '.join(args[:4])}}}, {{{', '.join(args[4:6])}}}, "
                  f"{{{', '.join(args[6:])}}};")

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
            bits = value & ((1 << _width(t)) - 1)
            literal = value if -65536 < value < 65536 else hex(bits)
            self.emit(f"mov.b{_width(t)} {d}, {literal};")

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
        bits = _width(t)
        if op in ("and", "or", "xor"):
            return self.emit(f"{op}.b{bits} {d}, {a}, {b};")
        if op in ("shl", "shr"):
            if t.kind == "f":
                raise TypeError(f"{op} of {t}")
            amount = self.u32(b, b_type)
            kind = f"b{bits}" if op == "shl" else _int(t)
            self.emit(f"{op}.{kind} {d}, {a}, {amount};")
            return self.narrow8(d, t)
        if t.kind == "f":
            return self.float_binary(op, t, d, a, b)
        instr = {"mul": "mul.lo"}.get(op, op)
        self.emit(f"{instr}.{_int(t)} {d}, {a}, {b};")
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
            self.emit(f"setp.{op}.{_int(t)} {d}, {a}, {b};")
        else:
            self.emit(f"setp.{_UNSIGNED_COMPARE[op]}.{_int(t)} {d}, {a}, {b};")

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
            self.emit(f"not.b{_width(t)} {d}, {a};")
            return self.narrow8(d, t)
        if t.kind in "iu":
            if op == "neg" or (op == "abs" and t.kind == "i"):
                self.emit(f"{op}.s{_width(t)} {d}, {a};")
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
            return self.emit(f"selp.b{_width(t)} {d}, {a}, {b}, {cond};")
        chosen, other, not_cond = self.temp("pred"), self.temp("pred"), self.temp("pred")
        self.emit(f"and.pred {chosen}, {a}, {cond};")
        self.emit(f"not.pred {not_cond}, {cond};")
        self.emit(f"and.pred {other}, {b}, {not_cond};")
        self.emit(f"or.pred {d}, {chosen}, {other};")

    def fma(self, t, d, a, b, c):
        if t.kind == "f":
            self.emit(f"fma.rn.{t.name} {d}, {a}, {b}, {c};")
        elif t.kind in "iu":
            self.emit(f"mad.lo.{_int(t)} {d}, {a}, {b}, {c};")
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
                self.emit(f"setp.ne.{_int(src)} {d}, {a}, 0;")
        elif src.kind == "b":
            one = {F32: _f32(1.0), F16: "0x3C00", BF16: "0x3F80"}.get(dst, "1")
            self.emit(f"selp.b{_width(dst)} {d}, {one}, 0, {a};")
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
            # Saturates to the range of the destination type, 8-bit ones included.
            self.emit(f"cvt.rzi.{_int(dst, dst.bits if dst.bits == 8 else None)}.{ftype} {d}, {x};")
            self.narrow8(d, dst)
        elif dst.kind in floats:
            if dst == BF16:
                wide = self.temp("b32")
                self.emit(f"cvt.rn.f32.{_int(src)} {wide}, {a};")
                self.emit(f"cvt.rn.bf16.f32 {d}, {wide};")
            else:
                self.emit(f"cvt.rn.{dst.name}.{_int(src)} {d}, {a};")
        else:
            source, target = _width(src), _width(dst)
            if target > source:     # extend by the source's signedness
                self.emit(f"cvt.{_int(src, target)}.{_int(src)} {d}, {a};")
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
            combine = f"{kind}.{_int(t, 64 if t.bits == 64 else 32)}"
            source = x
            if _width(t) == 16:
                source = self.temp("b32")
                self.emit(f"cvt.{_int(t, 32)}.{_int(t)} {source}, {x};")
        total = self.temp(cls)
        self.emit(f"mov.{cls} {total}, {source};")
        for offset in (16, 8, 4, 2, 1):
            other = self.shfl("bfly", total, str(offset), cls)
            self.emit(f"{combine} {total}, {total}, {other};")
        if t.kind in ("f", "bf"):
            self.from_f32(d, total, t)
        elif _width(t) == 16:
            self.emit(f"cvt.u16.u32 {d}, {total};")
            self.narrow8(d, t)
        else:
            self.mov(d, total, t)

    def shuffle(self, mode, t, d, x, lane):
        if t.kind == "b":
            bits = self.temp("b32")
            self.emit(f"selp.u32 {bits}, 1, 0, {x};")
            self.emit(f"setp.ne.u32 {d}, {self.shfl(mode, bits, lane, 'b32')}, 0;")
        elif _width(t) == 16:
            bits = self.temp("b32")
            self.emit(f"cvt.u32.u16 {bits}, {x};")
            self.emit(f"cvt.u16.u32 {d}, {self.shfl(mode, bits, lane, 'b32')};")
        else:
            self.mov(d, self.shfl(mode, x, lane, _class(t)), t)
