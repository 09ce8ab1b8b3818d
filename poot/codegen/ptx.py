"""PTX text from a kernel of the kernel language, for NVIDIA GPUs of sm_80 and newer.

`render_ptx(kernel, sm)` gives one module holding one `.visible .entry` named after the kernel;
the driver JIT-compiles it. `kernel_params(kernel)` lists what a launcher packs, in order. This
module only writes text: it never touches a driver. It keeps to the semantics lang.py defines,
so a kernel computes here what it computes through the SPIR-V renderer.

Registers: one per value, named after the value's id and its register class: %p (bool, .pred),
%h (16 bits), %r (32 bits), %rd (64 bits). PTX has no 8-bit registers: i8/u8 values live in
16-bit registers, sign- or zero-extended, and are renormalised after every operation that can
carry out of 8 bits. A Var is a register named after its id; temporaries are %t<class><n>.

Statements and memory (the operations on values, and their numerics, are ptx_ops.py's):
- For loops: `unroll` adds nothing; ptxas unrolls counted loops as it judges.
- fragment_load is ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16; mma is
  mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32, whose fragment layouts are
  the ones lang.py documents. Both need the whole warp.
- wgmma is wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16} on the Vars'
  registers in place (accumulating; both operands by shared-memory descriptor, K-major), with
  wgmma.fence / commit_group / wait_group and fence.proxy.async.shared::cta: sm_90a only
  (ptx_caps), the module then .target sm_90a, PTX ISA 8.0.
- copy_async is cp.async.cg (16 bytes, L2 only; a src-size of 0 where it is outside), commit
  and wait are cp.async.commit_group and cp.async.wait_group.
- tensor_load is cp.async.bulk.tensor.2d (the tensor copy unit, sm_90a) completing bytes of an
  mbarrier (barrier_init, barrier_expect and barrier_wait: mbarrier.init, arrive.expect_tx and
  a try_wait.parity loop). A TensorMap is a trailing `.param .align 64 .b8 [128]` whose generic
  address (cvta.param) the copies name; the launcher fills it (CUtensorMap).
- A kernel's `resident` workgroups a multiprocessor become `.minnctapersm`: ptxas keeps each
  thread's registers within what lets that many run at once.

Shared arrays of up to 48 KiB in all are static `.shared` arrays; past that they are offsets into
one `.extern .shared` array, whose size the launch passes (dynamic_shared_bytes) after the
function is allowed it (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES), up to the target's
SHARED_LIMIT.
"""
from poot.codegen.ptx_ops import Instructions, int_type, reg_bits, reg_class
from poot.errors import ModelRefused
from poot.kernels.lang import (ASYNC_COPY, BINARY, BOOL, COMPARE, F32, HALF2_ARITH, SPECIAL,
                               TENSOR_COPY, UNARY, WGMMA, AsyncProxyFence, Assign, Barrier,
                               BarrierExpect, BarrierInit, BarrierWait, CopyAsync, CopyCommit,
                               CopyWait, For, If, Let, Return, Store, TensorLoad, VarDecl, Wgmma,
                               WgmmaCommit, WgmmaFence, WgmmaWait)

# What every sm_80+ device offers, in lang.py's capability names: the matrix operations are
# ldmatrix (sm_75) and mma.sync m16n8k16 with f16 or bf16 operands (sm_80); cp.async (sm_80).
PTX_CAPS = frozenset({"storage16", "storage8", "float16", "int16", "int64", "subgroup",
                      "subgroup_arith", "subgroup_shuffle", "shared", "fragment_load", "mma_f16",
                      "mma_bf16", ASYNC_COPY, HALF2_ARITH})

# sm_90a adds the warpgroup matrix operations (wgmma and the fences around it) and the tensor
# copies with their mbarriers, PTX ISA 8.0: a kernel that uses them is rendered for sm_90a,
# which only an sm_90 device runs.
WGMMA_SM, WGMMA_VERSION = 90, "8.0"
HOPPER_CAPS = frozenset({WGMMA, TENSOR_COPY})
# A TensorMap parameter: the driver's opaque CUtensorMap, 128 bytes aligned to 64.
TENSOR_MAP_BYTES, TENSOR_MAP_ALIGN = 128, 64


def ptx_caps(sm):
    """What PTX offers a device of sm_`sm` (lang.py's capability names)."""
    return PTX_CAPS | HOPPER_CAPS if sm == WGMMA_SM else PTX_CAPS


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

_PREFIX = {"pred": "p", "b16": "h", "b32": "r", "b64": "rd"}
_SCALAR_PARAM = {"i32": "s32", "u32": "u32", "f32": "f32"}
# The statements that are one instruction whatever they hold (their fields formatted in).
_ONE_INSTRUCTION = {
    Barrier: "bar.sync 0;", CopyCommit: "cp.async.commit_group;",
    CopyWait: "cp.async.wait_group {0.pending};", AsyncProxyFence: "fence.proxy.async.shared::cta;",
    WgmmaFence: "wgmma.fence.sync.aligned;", WgmmaCommit: "wgmma.commit_group.sync.aligned;",
    WgmmaWait: "wgmma.wait_group.sync.aligned {0.pending};"}


def kernel_params(kernel):
    """(name, ctype) per kernel parameter, in order: buffers are u64 device pointers, scalars
    i32/u32/f32, then the tensor maps (CUtensorMap)."""
    return [(p.name, "u64" if p.kind == "buffer" else p.dtype.name) for p in kernel.params] + \
        [(m.name, "tensor_map") for m in kernel.maps]


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


def _memory(dtype):
    """The ld/st type: sign- or zero-extending for 8 bits, plain bits otherwise."""
    if dtype.bits == 8:
        return int_type(dtype, 8)
    return f"b{dtype.bits}"


class _Renderer(Instructions):
    def __init__(self, kernel, sm):
        if sm not in PTX_VERSION:
            raise ValueError(f"sm_{sm}: the PTX renderer knows "
                             f"{', '.join(f'sm_{s}' for s in PTX_VERSION)}")
        kernel.require(ptx_caps(sm), f"PTX for sm_{sm}")
        if dynamic_shared_bytes(kernel) > SHARED_LIMIT[sm]:
            raise ModelRefused(f"kernel {kernel.name} needs {kernel.shared_bytes} bytes of shared "
                               f"memory; a workgroup of sm_{sm} has at most {SHARED_LIMIT[sm]}")
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
        for m in k.maps:
            self.registers[f"%map_{m.name}"] = "b64"
            self.emit(f"mov.b64 %map_{m.name}, param_{m.name};")
            self.emit(f"cvta.param.u64 %map_{m.name}, %map_{m.name};")
        self.block(k.body)
        self.ret()

        params = [f"    .param .{'u64' if p.kind == 'buffer' else _SCALAR_PARAM[p.dtype.name]} "
                  f"param_{p.name}" for p in k.params]
        params += [f"    .param .align {TENSOR_MAP_ALIGN} .b8 param_{m.name}[{TENSOR_MAP_BYTES}]"
                   for m in k.maps]
        wgmma = bool(HOPPER_CAPS & k.caps)
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
        cls = reg_class(dtype)
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

    # -- statements ------------------------------------------------------------------------------
    def block(self, body):
        for stmt in body:
            if type(stmt) in _ONE_INSTRUCTION:
                self.emit(_ONE_INSTRUCTION[type(stmt)].format(stmt))
            elif isinstance(stmt, Let):
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
            elif isinstance(stmt, CopyAsync):
                self.copy_async(stmt)
            elif isinstance(stmt, Return):
                self.ret()
            elif isinstance(stmt, Wgmma):
                self.wgmma(stmt)
            elif isinstance(stmt, (BarrierInit, BarrierExpect, BarrierWait, TensorLoad)):
                self.tensor_copy(stmt)
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
        step = str(stmt.step) if isinstance(stmt.step, int) else self.val(stmt.step)
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
            if reg_bits(dtype) != 32:
                narrow = self.temp("b32")
                self.emit(f"cvt.{int_type(dtype, 32)}.{int_type(dtype)} {narrow}, {reg};")
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
        if reg_bits(dtype) == 64:
            self.emit(f"mul.lo.s64 {offset}, {reg}, {size};")
        else:
            if reg_bits(dtype) == 16:
                wide = self.temp("b32")
                self.emit(f"cvt.{int_type(dtype, 32)}.{int_type(dtype)} {wide}, {reg};")
                reg = wide
            # 32-bit indices widen here, so a buffer may pass 2 GiB.
            self.emit(f"mul.wide.{int_type(dtype, 32)} {offset}, {reg}, {size};")
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

    def tensor_copy(self, stmt):
        """The tensor copies and their transaction barriers (mbarrier.*, .shared::cta)."""
        if isinstance(stmt, TensorLoad):
            to = self.address(stmt.target, True, stmt.index)
            bar = self.address(stmt.barrier, True, stmt.barrier_index)
            self.emit(f"cp.async.bulk.tensor.2d.shared::cluster.global.tile"
                      f".mbarrier::complete_tx::bytes [{to}], [%map_{stmt.map}, "
                      f"{{{self.val(stmt.col)}, {self.val(stmt.row)}}}], [{bar}];")
            return
        bar = self.address(stmt.target, True, stmt.index)
        if isinstance(stmt, BarrierInit):
            self.emit(f"mbarrier.init.shared::cta.b64 [{bar}], {stmt.count};")
            # the barrier as set up is what the copy unit (the async proxy) sees too
            self.emit("fence.mbarrier_init.release.cluster;")
            self.emit("fence.proxy.async.shared::cta;")
        elif isinstance(stmt, BarrierExpect):
            state = self.temp("b64")
            self.emit(f"mbarrier.arrive.expect_tx.shared::cta.b64 {state}, [{bar}], "
                      f"{stmt.nbytes};")
        else:
            self.labels += 1
            done = self.temp("pred")
            self.label(f"$L{self.labels}_wait")
            self.emit(f"mbarrier.try_wait.parity.shared::cta.b64 {done}, [{bar}], "
                      f"{self.val(stmt.parity)};")
            self.emit(f"@!{done} bra $L{self.labels}_wait;")

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
        if op == "atomic_add":
            address = self.address(let.attr("target"), True, let.args[0])
            return self.emit(f"atom.shared.add.u32 {d}, [{address}], {self.val(let.args[1])};")
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
            self.emit(f"ld.param.{reg_class(t)} {d}, [param_{let.attr('name')}];")
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

