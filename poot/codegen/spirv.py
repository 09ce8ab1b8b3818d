"""SPIR-V renderer: a `Kernel` of the kernel language -> a Vulkan compute module (binary words).

`render_spirv` emits a SPIR-V 1.3 module (Vulkan 1.1) with one GLCompute entry point named after
the kernel, in structured control flow, for the raw Vulkan and wgpu backends alike (wgpu's
translator, naga, reads the same words). `binding_layout` says where each parameter goes: buffers
are storage buffers at set 0, bindings 0.. in parameter order; scalars are one push-constant block,
4 bytes each, in parameter order. `spirv_capabilities` names every capability and extension the
module declares, so a device lacking one refuses the kernel by that name.

The module declares exactly what it uses. 8- and 16-bit values that only move between memory
and 32-bit registers (loads, stores, widening and narrowing conversions) need only the storage
capabilities; comparisons, selects and variables of such values are done at 32 bits so that no
arithmetic capability is needed for them. Anything else on an 8/16-bit type (arithmetic,
constants, shared arrays, bitcasts) declares Int8 / Int16 / Float16. bf16 is a 16-bit unsigned
integer to SPIR-V; its conversions are bit work at 32 bits (round to nearest even on the way
down). Signed rem is a - (a/b)*b: Vulkan leaves OpSRem undefined for negative operands (NVIDIA's
driver does give other results). The matrix operations (lang.MATRIX: fragment_load, mma) are
not rendered, nor are asynchronous copies (copy_async): a kernel using them is refused by its
capability. This module lowers a kernel's statements and operations; the module they fill (ids,
types, constants, capabilities, the words) is spirv_module.py's. Neither knows a driver.
"""
import struct
from dataclasses import dataclass

from poot.codegen.spirv_module import (ACQUIRE_RELEASE_WORKGROUP_MEMORY, BLOCK, BUILTINS, GLSL,
                                       GROUP_REDUCE, LOOP_UNROLL, NON_WRITABLE, OFFSET, OP,
                                       PUSH_CONSTANT, SCOPE_SUBGROUP, SCOPE_WORKGROUP,
                                       STORAGE_BUFFER, VERSION_1_3, WORKGROUP, ModuleBuilder, inst,
                                       spv_dtype)
from poot.errors import ModelRefused
from poot.kernels.lang import (ASYNC_COPY, BOOL, F32, HALF2_ARITH, I32, MMA_CAPS, U16, U32, U64,
                               WGMMA, Assign, Barrier, For, If, Let, Return, Store, VarDecl)

TARGET = f"SPIR-V {VERSION_1_3 >> 16}.{VERSION_1_3 >> 8 & 0xFF}"

INT_BINARY = {"add": "IAdd", "sub": "ISub", "mul": "IMul", "and": "BitwiseAnd",
              "or": "BitwiseOr", "xor": "BitwiseXor", "shl": "ShiftLeftLogical"}
FLOAT_BINARY = {"add": "FAdd", "sub": "FSub", "mul": "FMul", "div": "FDiv", "rem": "FRem"}
BOOL_BINARY = {"and": "LogicalAnd", "or": "LogicalOr", "xor": "LogicalNotEqual",
               "min": "LogicalAnd", "max": "LogicalOr"}
FLOAT_COMPARE = {"lt": "FOrdLessThan", "le": "FOrdLessThanEqual", "gt": "FOrdGreaterThan",
                 "ge": "FOrdGreaterThanEqual", "eq": "FOrdEqual", "ne": "FUnordNotEqual"}
SIGNED_COMPARE = {"lt": "SLessThan", "le": "SLessThanEqual", "gt": "SGreaterThan",
                  "ge": "SGreaterThanEqual", "eq": "IEqual", "ne": "INotEqual"}
UNSIGNED_COMPARE = {"lt": "ULessThan", "le": "ULessThanEqual", "gt": "UGreaterThan",
                    "ge": "UGreaterThanEqual", "eq": "IEqual", "ne": "INotEqual"}
SUBGROUP_REDUCE = {("subgroup_add", "f"): "FAdd", ("subgroup_add", "i"): "IAdd",
                   ("subgroup_add", "u"): "IAdd", ("subgroup_max", "f"): "FMax",
                   ("subgroup_max", "i"): "SMax", ("subgroup_max", "u"): "UMax",
                   ("subgroup_min", "f"): "FMin", ("subgroup_min", "i"): "SMin",
                   ("subgroup_min", "u"): "UMin"}


@dataclass(frozen=True)
class BufferBinding:
    name: str
    dtype: object
    access: str
    set: int
    binding: int


@dataclass(frozen=True)
class PushConstant:
    name: str
    dtype: object
    offset: int


@dataclass(frozen=True)
class BindingLayout:
    """Where a launcher puts each argument: storage buffers, then the push-constant bytes."""
    buffers: tuple
    push_constants: tuple

    @property
    def push_constant_size(self):
        return 4 * len(self.push_constants)

    def pack_push_constants(self, values):
        """The push-constant bytes for scalar `values` (a dict by name, or a sequence in order)."""
        if isinstance(values, dict):
            values = [values[p.name] for p in self.push_constants]
        if len(values) != len(self.push_constants):
            raise ValueError(f"{len(self.push_constants)} scalars expected, got {len(values)}")
        codes = {"i32": "i", "u32": "I", "f32": "f"}
        return b"".join(struct.pack("<" + codes[p.dtype.name], v)
                        for p, v in zip(self.push_constants, values))


def binding_layout(kernel):
    buffers, scalars = [], []
    for param in kernel.params:
        if param.kind == "buffer":
            buffers.append(BufferBinding(param.name, param.dtype, param.access, 0, len(buffers)))
        else:
            scalars.append(PushConstant(param.name, param.dtype, 4 * len(scalars)))
    return BindingLayout(tuple(buffers), tuple(scalars))


def render_spirv(kernel, subgroup_size=None, vector_loads=False):
    """The SPIR-V module of `kernel` as little-endian bytes.

    `subgroup_size`, when the device's is known, is checked against the kernel: a shuffle_xor
    mask must name a lane inside the subgroup. `vector_loads`: a load of 2 or 4 consecutive
    32-bit elements of a read-only buffer is one load of a vector, through a second variable
    of the same binding whose elements are those vectors (Vulkan allows descriptors to alias,
    and naga takes the aliased variables for wgpu; NVIDIA's driver issues 4 scalar loads as 4
    loads); else one scalar load an element.
    """
    words = _Renderer(kernel, subgroup_size, vector_loads).render()
    return struct.pack(f"<{len(words)}I", *words)


def spirv_capabilities(kernel):
    """The SPIR-V capabilities and extensions (`SPV_...`) the kernel's module declares."""
    renderer = _Renderer(kernel, None)
    renderer.render()
    return frozenset(renderer.caps) | frozenset(renderer.extensions())


def _wide(dtype):
    """The 32-bit (or 64-bit) type a value is converted through."""
    if dtype.kind in ("f", "bf"):
        return F32
    if dtype.bits < 32:
        return I32 if dtype.kind == "i" else U32
    return dtype


# lang.py capabilities that SPIR-V (as rendered here) has no rendering of.
UNRENDERED_CAPS = frozenset({"fragment_load", *MMA_CAPS.values(), ASYNC_COPY, HALF2_ARITH, WGMMA})


class _Renderer(ModuleBuilder):
    def __init__(self, kernel, subgroup_size, vector_loads=False):
        unrendered = kernel.caps & UNRENDERED_CAPS
        if unrendered:
            raise ModelRefused(f"kernel {kernel.name} needs {', '.join(sorted(unrendered))}, "
                               f"which the SPIR-V renderer does not render")
        super().__init__(kernel)
        self.subgroup_size, self.vector_loads = subgroup_size, vector_loads
        self.vector_views = {}     # (buffer, width) -> (variable, pointer type) of its vectors
        self.values = {}           # lang value id -> SPIR-V id (a tuple for a load of width > 1)
        self.vars = {}             # lang var id -> (pointer id, dtype held in it)
        self.buffers, self.shared, self.bindings = {}, {}, {}
        self.push = None

    # -- conversions -----------------------------------------------------------------------------
    def widen(self, vid, dtype):
        """A value of an 8/16-bit type (or bf16) converted exactly to its 32-bit type."""
        if dtype.kind == "bf":
            bits = self.op("UConvert", U32, vid)
            bits = self.op("ShiftLeftLogical", U32, bits, self.const(16, U32))
            return self.op("Bitcast", F32, bits)
        if dtype.bits >= 32 or dtype.kind == "b":
            return vid
        if dtype.kind == "f":
            return self.op("FConvert", F32, vid)
        return self.op("SConvert" if dtype.kind == "i" else "UConvert", _wide(dtype), vid)

    def narrow(self, vid, dtype):
        """A value of `_wide(dtype)` converted to `dtype` (floats rounded, integers truncated)."""
        if dtype.kind == "bf":
            bits = self.op("Bitcast", U32, vid)
            lsb = self.op("BitwiseAnd", U32, self.op("ShiftRightLogical", U32, bits,
                                                     self.const(16, U32)), self.const(1, U32))
            rounded = self.op("IAdd", U32, bits, self.op("IAdd", U32, lsb, self.const(0x7FFF, U32)))
            rounded = self.op("ShiftRightLogical", U32, rounded, self.const(16, U32))
            quiet = self.op("BitwiseOr", U32, self.op("ShiftRightLogical", U32, bits,
                                                      self.const(16, U32)), self.const(0x40, U32))
            bits = self.op("Select", U32, self.op("IsNan", BOOL, vid), quiet, rounded)
            return self.op("UConvert", U16, bits)
        if dtype.bits >= 32 or dtype.kind == "b":
            return vid
        if dtype.kind == "f":
            return self.op("FConvert", dtype, vid)
        return self.op("SConvert" if dtype.kind == "i" else "UConvert", dtype, vid)

    def convert_wide(self, vid, src, dst):
        """Between the 32/64-bit types: f32, i32, u32, i64, u64."""
        if src == dst:
            return vid
        if src.kind == "f":
            return self.op("ConvertFToS" if dst.kind == "i" else "ConvertFToU", dst, vid)
        if dst.kind == "f":
            return self.op("ConvertSToF" if src.kind == "i" else "ConvertUToF", dst, vid)
        if src.bits == dst.bits:
            return self.op("Bitcast", dst, vid)
        if src.kind == "i" or dst.bits < src.bits and dst.kind == "i":
            return self.op("SConvert", dst, vid)      # sign-extends, or truncates
        unsigned = U64 if dst.bits == 64 else U32
        vid = self.op("UConvert", unsigned, vid)      # zero-extends, or truncates
        return vid if unsigned == dst else self.op("Bitcast", dst, vid)

    def cast(self, vid, src, dst):
        if dst.kind == "b":
            wide = _wide(src)
            vid = self.widen(vid, src)
            if wide.kind == "f":
                return self.op("FUnordNotEqual", BOOL, vid, self.const(0.0, F32))
            return self.op("INotEqual", BOOL, vid, self.const(0, wide))
        wide = _wide(dst)
        if src.kind == "b":
            one, zero = (1.0, 0.0) if wide.kind == "f" else (1, 0)
            vid = self.op("Select", wide, vid, self.const(one, wide), self.const(zero, wide))
        else:
            vid = self.convert_wide(self.widen(vid, src), _wide(src), wide)
        return self.narrow(vid, dst)

    # -- module ----------------------------------------------------------------------------------
    def render(self):
        kernel = self.kernel
        fn_type = self.type_id("fn", self.void(), opcode=OP["TypeFunction"])
        self.declare_resources()
        entry = self.new_id()
        self.code += inst(OP["Function"], self.void(), entry, 0, fn_type)
        first = self.new_id()
        self.code += inst(OP["Label"], first)
        body_start = len(self.code)
        self.block(kernel.body)
        if not self.terminated:
            self.emit(OP["Return"])
        self.emit(OP["FunctionEnd"])
        self.code[body_start:body_start] = self.locals
        self.names = inst(OP["Name"], entry, kernel.name) + self.names
        return self.words(entry)

    def declare_resources(self):
        layout = binding_layout(self.kernel)
        for buffer in layout.buffers:
            elem = self.ty(buffer.dtype)
            var = self.block_variable(buffer, buffer.name, elem, buffer.dtype.bytes)
            # Read-only buffers are NonWritable. Write-only ones are not marked NonReadable:
            # naga refuses write-only storage buffers, and drivers gain nothing from it.
            if buffer.access == "r":
                self.decorations += inst(OP["Decorate"], var, NON_WRITABLE)
            self.buffers[buffer.name] = (var, self.pointer(STORAGE_BUFFER, elem))
            self.bindings[buffer.name] = buffer
        if layout.push_constants:
            members = [self.ty(p.dtype) for p in layout.push_constants]
            block = self.new_id()
            self.globals += inst(OP["TypeStruct"], block, *members)
            self.decorations += inst(OP["Decorate"], block, BLOCK)
            for i, p in enumerate(layout.push_constants):
                self.decorations += inst(OP["MemberDecorate"], block, i, OFFSET, p.offset)
            var = self.new_id()
            self.globals += inst(OP["Variable"], self.pointer(PUSH_CONSTANT, block), var,
                                 PUSH_CONSTANT)
            self.names += inst(OP["Name"], var, "scalars")
            self.push = (var, {p.name: i for i, p in enumerate(layout.push_constants)})
        for array in self.kernel.shared:
            self.need_arithmetic(array.dtype)
            elem = self.ty(array.dtype)
            typ = self.type_id(("array", elem, array.size), elem, self.const(array.size, U32),
                               opcode=OP["TypeArray"])
            var = self.new_id()
            self.globals += inst(OP["Variable"], self.pointer(WORKGROUP, typ), var, WORKGROUP)
            self.names += inst(OP["Name"], var, array.name)
            self.shared[array.name] = (var, self.pointer(WORKGROUP, elem))

    # -- statements ------------------------------------------------------------------------------
    def block(self, stmts):
        for stmt in stmts:
            if self.terminated:
                return      # after a Return: the rest of the block never runs
            if isinstance(stmt, Let):
                self.let(stmt)
            elif isinstance(stmt, Store):
                self.store(stmt)
            elif isinstance(stmt, VarDecl):
                self.declare_var(stmt)
            elif isinstance(stmt, Assign):
                self.assign(stmt.var, self.values[stmt.value.id], stmt.value.dtype)
            elif isinstance(stmt, If):
                self.if_(stmt)
            elif isinstance(stmt, For):
                self.for_(stmt)
            elif isinstance(stmt, Barrier):
                self.emit(OP["ControlBarrier"], self.const(SCOPE_WORKGROUP, U32),
                          self.const(SCOPE_WORKGROUP, U32),
                          self.const(ACQUIRE_RELEASE_WORKGROUP_MEMORY, U32))
            elif isinstance(stmt, Return):
                self.emit(OP["Return"])
                self.terminated = True
            else:
                raise TypeError(f"unknown statement {stmt!r}")

    def if_(self, stmt):
        then, merge = self.new_id(), self.new_id()
        orelse = self.new_id() if stmt.orelse else merge
        self.emit(OP["SelectionMerge"], merge, 0)
        self.emit(OP["BranchConditional"], self.values[stmt.cond.id], then, orelse)
        self.terminated = True
        reached = False
        for label, body in ((then, stmt.then), (orelse, stmt.orelse)):
            if label == merge:
                reached = True
                continue
            self.label(label)
            self.block(body)
            if not self.terminated:
                self.branch(merge)
                reached = True
        self.label(merge)
        if not reached:     # both arms returned: the merge block is dead
            self.emit(OP["Unreachable"])
            self.terminated = True

    def for_(self, stmt):
        header, check, body, cont, merge = (self.new_id() for _ in range(5))
        counter = self.local(I32)
        self.emit(OP["Store"], counter, self.values[stmt.start.id])
        self.branch(header)
        self.label(header)
        self.emit(OP["LoopMerge"], merge, cont, LOOP_UNROLL if stmt.unroll else 0)
        self.branch(check)
        self.label(check)
        index = self.op("Load", I32, counter)
        more = self.op("SLessThan", BOOL, index, self.values[stmt.stop.id])
        self.emit(OP["BranchConditional"], more, body, merge)
        self.label(body)
        self.values[stmt.index.id] = self.op("Load", I32, counter)
        self.block(stmt.body)
        live = not self.terminated      # lang has no `continue`: only the body's end reaches it
        if live:
            self.branch(cont)
        self.label(cont)
        if live:
            step = stmt.step
            step = self.const(step, I32) if isinstance(step, int) else self.values[step.id]
            index = self.op("Load", I32, counter)
            self.emit(OP["Store"], counter, self.op("IAdd", I32, index, step))
        self.branch(header)         # a continue block nobody reaches stays bare, as required
        self.label(merge)

    def declare_var(self, stmt):
        # An 8/16-bit var is held at 32 bits unless the kernel does arithmetic on its type anyway.
        held = spv_dtype(stmt.dtype) if self.has_arithmetic(stmt.dtype) else _wide(stmt.dtype)
        self.need_arithmetic(held)
        self.vars[stmt.id] = (self.local(held), held)
        self.assign(stmt.id, self.values[stmt.init.id], stmt.init.dtype)

    def assign(self, var_id, vid, dtype):
        pointer, held = self.vars[var_id]
        if held != spv_dtype(dtype):
            vid = self.widen(vid, dtype)
        self.emit(OP["Store"], pointer, vid)

    # -- lets ------------------------------------------------------------------------------------
    def let(self, let):
        args = [self.values[a.id] for a in let.args]
        types = [a.dtype for a in let.args]
        op, dtype = let.op, let.dtype
        if op == "const":
            result = self.const(let.attr("value"), dtype)
        elif op == "param":
            var, index = self.push
            pointer = self.pointer(PUSH_CONSTANT, self.ty(dtype))
            chain = self.chain(pointer, var, self.const(index[let.attr("name")], U32))
            result = self.op("Load", dtype, chain)
        elif op in BUILTINS:
            var, typ, scalar = self.builtin(op)
            loaded = self.new_id()
            self.emit(OP["Load"], typ, loaded, var)
            if not scalar:
                extracted = self.new_id()
                self.emit(OP["CompositeExtract"], self.ty(U32), extracted, loaded, let.attr("axis"))
                loaded = extracted
            self.dtype_of[loaded] = U32
            result = self.op("Bitcast", I32, loaded)
        elif op == "var_get":
            pointer, held = self.vars[let.attr("var")]
            result = self.op("Load", held, pointer)
            if held != spv_dtype(dtype):
                result = self.narrow(result, dtype)
        elif op == "load":
            result = self.load(let, args[0])
        elif op == "atomic_add":         # relaxed: the barrier after orders it
            result = self.value(OP["AtomicIAdd"], U32, self.access(let.attr("target"), True,
                                                                   args[0]),
                                self.const(SCOPE_WORKGROUP, U32), self.const(0, U32), args[1],
                                reads=args[1:])
        elif op == "extract":
            result = args[0][let.attr("lane")]
        elif op == "unpack_half2":
            pair = self.new_id()
            self.code += inst(OP["ExtInst"], self.vec2(), pair, self.glsl(),
                              GLSL["unpack_half2"], args[0])
            result = [self.extract(pair, lane) for lane in (0, 1)]
        elif op == "pack_half2":
            pair = self.new_id()
            self.emit(OP["CompositeConstruct"], self.vec2(), pair, *args)
            result = self.value(OP["ExtInst"], U32, self.glsl(), GLSL["pack_half2"], pair,
                                reads=args)
        elif op == "cast":
            result = self.cast(args[0], types[0], dtype)
        elif op == "bitcast":
            same = spv_dtype(types[0]) == spv_dtype(dtype)
            result = args[0] if same else self.op("Bitcast", dtype, args[0])
        elif op == "select":
            result = self.select(args, dtype)
        elif op == "fma":
            if dtype.kind == "f":
                result = self.ext("fma", dtype, *args)
            else:
                result = self.op("IAdd", dtype, self.op("IMul", dtype, args[0], args[1]), args[2])
        elif op in ("lt", "le", "gt", "ge", "eq", "ne"):
            result = self.compare(op, args, types[0])
        elif op in ("subgroup_add", "subgroup_max", "subgroup_min"):
            name = SUBGROUP_REDUCE.get((op, dtype.kind))
            if name is None:
                raise TypeError(f"{op} on {dtype}")
            self.subgroup_caps("GroupNonUniformArithmetic")
            result = self.value(OP["GroupNonUniform" + name], dtype,
                                self.const(SCOPE_SUBGROUP, U32), GROUP_REDUCE, args[0], reads=args)
        elif op == "shuffle_xor":
            mask = let.attr("mask")
            if self.subgroup_size is not None and not 0 <= mask < self.subgroup_size:
                raise ValueError(f"shuffle_xor mask {mask} outside a subgroup of "
                                 f"{self.subgroup_size}")
            self.subgroup_caps("GroupNonUniformShuffle")
            result = self.op("GroupNonUniformShuffleXor", dtype, self.const(SCOPE_SUBGROUP, U32),
                             args[0], self.const(mask, U32))
        elif op == "shuffle":
            self.subgroup_caps("GroupNonUniformShuffle")
            lane = self.op("Bitcast", U32, args[1])
            result = self.op("GroupNonUniformShuffle", dtype, self.const(SCOPE_SUBGROUP, U32),
                             args[0], lane)
        elif len(args) == 1:
            result = self.unary(op, args[0], dtype)
        else:
            result = self.binary(op, args, dtype)
        self.values[let.id] = result

    def access(self, target, shared, index):
        """A pointer to element `index` of a shared array or (member 0 of) a buffer block."""
        if shared:
            var, pointer = self.shared[target]
            return self.chain(pointer, var, index)
        var, pointer = self.buffers[target]
        return self.chain(pointer, var, self.const(0, U32), index)

    def lanes(self, index, width):
        return [index] + [self.op("IAdd", I32, index, self.const(lane, I32))
                          for lane in range(1, width)]

    def vector_view(self, name, width):
        """(variable, element pointer type) of a read-only buffer seen as `width`-vectors: a
        second block variable at the buffer's binding, its runtime array strided width * 4."""
        if (name, width) not in self.vector_views:
            buffer = self.bindings[name]
            elem = self.ty(buffer.dtype)
            vector = self.type_id(("vec", elem, width), elem, width, opcode=OP["TypeVector"])
            var = self.block_variable(buffer, f"{name}_x{width}", vector, 4 * width)
            self.decorations += inst(OP["Decorate"], var, NON_WRITABLE)
            self.vector_views[name, width] = (var, self.pointer(STORAGE_BUFFER, vector), vector)
        return self.vector_views[name, width]

    def load(self, let, index):
        target, shared, width = let.attr("target"), let.attr("shared"), let.attr("width")
        if self.vector_loads and width in (2, 4) and not shared and \
                self.bindings[target].access == "r" and self.bindings[target].dtype.bits == 32:
            var, pointer, vector = self.vector_view(target, width)
            at = self.op("ShiftRightArithmetic", I32, index, self.const(width // 2, I32))
            whole = self.new_id()
            self.emit(OP["Load"], vector, whole,
                      self.chain(pointer, var, self.const(0, U32), at))
            loaded = []
            for lane in range(width):
                rid = self.new_id()
                self.emit(OP["CompositeExtract"], self.ty(let.dtype), rid, whole, lane)
                self.dtype_of[rid] = let.dtype
                loaded.append(rid)
            return tuple(loaded)
        loaded = []
        for lane_index in self.lanes(index, width):
            loaded.append(self.op("Load", let.dtype, self.access(target, shared, lane_index)))
        return loaded[0] if width == 1 else tuple(loaded)

    def store(self, stmt):
        index = self.values[stmt.index.id]
        for lane_index, value in zip(self.lanes(index, len(stmt.values)), stmt.values):
            self.emit(OP["Store"], self.access(stmt.target, stmt.shared, lane_index),
                      self.values[value.id])

    def select(self, args, dtype):
        if self.has_arithmetic(dtype) or spv_dtype(dtype).bits >= 32 or dtype.kind == "b":
            return self.op("Select", dtype, *args)
        a, b = (self.widen(x, dtype) for x in args[1:])
        return self.narrow(self.op("Select", _wide(dtype), args[0], a, b), dtype)

    def compare(self, op, args, dtype):
        if dtype.kind == "b":
            if op in ("eq", "ne"):
                return self.op("LogicalEqual" if op == "eq" else "LogicalNotEqual", BOOL, *args)
            args = [self.cast(a, BOOL, U32) for a in args]
            dtype = U32
        elif not self.has_arithmetic(dtype):
            args = [self.widen(a, dtype) for a in args]
            dtype = _wide(dtype)
        table = {"f": FLOAT_COMPARE, "i": SIGNED_COMPARE, "u": UNSIGNED_COMPARE}[dtype.kind]
        return self.op(table[op], BOOL, *args)

    def unary(self, op, a, dtype):
        kind = dtype.kind
        if op == "neg" and kind == "f":
            return self.op("FNegate", dtype, a)
        if op == "neg" and kind in "iu":    # 0 - a: naga refuses SNegate on unsigned types
            return self.op("ISub", dtype, self.const(0, dtype), a)
        if op == "not" and kind in "iub":
            return self.op("LogicalNot" if kind == "b" else "Not", dtype, a)
        if op == "abs" and kind in "fiu":
            return a if kind == "u" else self.ext("fabs" if kind == "f" else "sabs", dtype, a)
        if op in GLSL and kind == "f":
            return self.ext(op, dtype, a)
        raise TypeError(f"{op} on {dtype}")

    def binary(self, op, args, dtype):
        kind = dtype.kind
        if kind == "b" and op in BOOL_BINARY:
            return self.op(BOOL_BINARY[op], dtype, *args)
        if kind == "f" and op in FLOAT_BINARY:
            return self.op(FLOAT_BINARY[op], dtype, *args)
        if kind in "fiu" and op in ("min", "max"):
            return self.ext({"f": "f", "i": "s", "u": "u"}[kind] + op, dtype, *args)
        if kind in "iu":
            signed = kind == "i"
            if op in INT_BINARY:
                return self.op(INT_BINARY[op], dtype, *args)
            if op == "div":
                return self.op("SDiv" if signed else "UDiv", dtype, *args)
            if op == "shr":
                return self.op("ShiftRightArithmetic" if signed else "ShiftRightLogical", dtype,
                               *args)
            if op == "rem" and not signed:
                return self.op("UMod", dtype, *args)
            if op == "rem":     # a - (a/b)*b: Vulkan leaves OpSRem undefined for negative operands
                quotient = self.op("SDiv", dtype, *args)
                return self.op("ISub", dtype, args[0], self.op("IMul", dtype, quotient, args[1]))
        raise TypeError(f"{op} on {dtype}")

