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
capability. This module knows no driver.
"""
import struct
from dataclasses import dataclass

from poot.errors import ModelRefused
from poot.kernels.lang import (ASYNC_COPY, BOOL, F32, HALF2_ARITH, I32, MMA_CAPS, U16, U32, U64,
                               WGMMA, Assign, Barrier, For, If, Let, Return, Store, VarDecl)

MAGIC, VERSION_1_3 = 0x07230203, 0x00010300
TARGET = f"SPIR-V {VERSION_1_3 >> 16}.{VERSION_1_3 >> 8 & 0xFF}"

# Opcodes (SPIR-V specification, section 3.52).
OP = dict(
    Name=5, Extension=10, ExtInstImport=11, ExtInst=12, MemoryModel=14, EntryPoint=15,
    ExecutionMode=16, Capability=17, TypeVoid=19, TypeBool=20, TypeInt=21, TypeFloat=22,
    TypeVector=23, TypeArray=28, TypeRuntimeArray=29, TypeStruct=30, TypePointer=32,
    TypeFunction=33, ConstantTrue=41, ConstantFalse=42, Constant=43, Function=54,
    FunctionEnd=56, Variable=59, Load=61, Store=62, AccessChain=65, Decorate=71,
    MemberDecorate=72, CompositeConstruct=80, CompositeExtract=81, ConvertFToU=109,
    ConvertFToS=110, ConvertSToF=111,
    ConvertUToF=112, UConvert=113, SConvert=114, FConvert=115, Bitcast=124, SNegate=126,
    FNegate=127, IAdd=128, FAdd=129, ISub=130, FSub=131, IMul=132, FMul=133, UDiv=134, SDiv=135,
    FDiv=136, UMod=137, FRem=140, IsNan=156, LogicalEqual=164, LogicalNotEqual=165,
    LogicalOr=166, LogicalAnd=167, LogicalNot=168, Select=169, IEqual=170, INotEqual=171,
    UGreaterThan=172, SGreaterThan=173, UGreaterThanEqual=174, SGreaterThanEqual=175,
    ULessThan=176, SLessThan=177, ULessThanEqual=178, SLessThanEqual=179, FOrdEqual=180,
    FUnordNotEqual=183, FOrdLessThan=184, FOrdGreaterThan=186, FOrdLessThanEqual=188,
    FOrdGreaterThanEqual=190, ShiftRightLogical=194, ShiftRightArithmetic=195,
    ShiftLeftLogical=196, BitwiseOr=197, BitwiseXor=198, BitwiseAnd=199, Not=200,
    ControlBarrier=224, LoopMerge=246, SelectionMerge=247, Label=248, Branch=249,
    BranchConditional=250, Return=253, Unreachable=255, GroupNonUniformShuffle=345,
    GroupNonUniformShuffleXor=346, GroupNonUniformIAdd=349, GroupNonUniformFAdd=350,
    GroupNonUniformSMin=353, GroupNonUniformUMin=354, GroupNonUniformFMin=355,
    GroupNonUniformSMax=356, GroupNonUniformUMax=357, GroupNonUniformFMax=358,
)
CAPABILITY = dict(Shader=1, Float16=9, Int64=11, Int16=22, Int8=39, GroupNonUniform=61,
                  GroupNonUniformArithmetic=63, GroupNonUniformShuffle=65,
                  StorageBuffer16BitAccess=4433, StorageBuffer8BitAccess=4448)
EXTENSION_OF = {"StorageBuffer16BitAccess": "SPV_KHR_16bit_storage",
                "StorageBuffer8BitAccess": "SPV_KHR_8bit_storage"}
INPUT, WORKGROUP, FUNCTION, PUSH_CONSTANT, STORAGE_BUFFER = 1, 4, 7, 9, 12
BLOCK, ARRAY_STRIDE, BUILTIN, NON_WRITABLE, BINDING, DESCRIPTOR_SET, OFFSET = (
    2, 6, 11, 24, 33, 34, 35)
BUILTINS = {"num_blocks": 24, "block_id": 26, "thread_id": 27, "subgroup_id": 40, "lane_id": 41}
SCOPE_WORKGROUP, SCOPE_SUBGROUP = 2, 3
ACQUIRE_RELEASE_WORKGROUP_MEMORY = 0x8 | 0x100
GROUP_REDUCE = 0
LOOP_UNROLL = 0x1
# GLSL.std.450 extended instructions.
GLSL = dict(fabs=4, sabs=5, floor=8, sin=13, cos=14, tanh=21, exp=27, log=28, exp2=29, log2=30,
            sqrt=31, rsqrt=32, fmin=37, umin=38, smin=39, fmax=40, umax=41, smax=42, fma=50,
            pack_half2=58, unpack_half2=62)

# On an 8/16-bit type these need only the storage capability; anything else needs arithmetic.
STORAGE_ONLY_OPS = {OP["Load"], OP["Store"], OP["AccessChain"], OP["UConvert"], OP["SConvert"],
                    OP["FConvert"]}

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
            if param.dtype.kind == "b":
                raise TypeError(f"buffer {param.name}: bool has no memory layout")
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


def _string_words(text):
    data = text.encode() + b"\0"
    data += b"\0" * (-len(data) % 4)
    return list(struct.unpack(f"<{len(data) // 4}I", data))


def _inst(opcode, *operands):
    words = []
    for operand in operands:
        if isinstance(operand, str):
            words += _string_words(operand)
        else:
            words.append(operand)
    return [(len(words) + 1) << 16 | opcode] + words


def _small(dtype):
    """The arithmetic capability an 8/16-bit type needs beyond storage, or None."""
    if dtype.kind == "b" or dtype.bits > 16:
        return None
    if dtype.kind == "f":
        return "Float16"
    return "Int8" if dtype.bits == 8 else "Int16"


def _wide(dtype):
    """The 32-bit (or 64-bit) type a value is converted through."""
    if dtype.kind in ("f", "bf"):
        return F32
    if dtype.bits < 32:
        return I32 if dtype.kind == "i" else U32
    return dtype


def _spv(dtype):
    """The SPIR-V-level dtype: bf16 is held as a 16-bit unsigned integer."""
    return U16 if dtype.kind == "bf" else dtype


# lang.py capabilities that SPIR-V (as rendered here) has no rendering of.
UNRENDERED_CAPS = frozenset({"fragment_load", *MMA_CAPS.values(), ASYNC_COPY, HALF2_ARITH, WGMMA})


class _Renderer:
    def __init__(self, kernel, subgroup_size, vector_loads=False):
        unrendered = kernel.caps & UNRENDERED_CAPS
        if unrendered:
            raise ModelRefused(f"kernel {kernel.name} needs {', '.join(sorted(unrendered))}, "
                               f"which the SPIR-V renderer does not render")
        self.kernel, self.subgroup_size, self.vector_loads = kernel, subgroup_size, vector_loads
        self.vector_views = {}     # (buffer, width) -> (variable, pointer type) of its vectors
        self.lang_caps = kernel.caps
        buffer_bits = {p.dtype.bits for p in kernel.params if p.kind == "buffer"}
        self.caps = {"Shader"}
        if 16 in buffer_bits:
            self.caps.add("StorageBuffer16BitAccess")
        if 8 in buffer_bits:
            self.caps.add("StorageBuffer8BitAccess")
        self._bound = 1
        self.names, self.decorations, self.globals, self.code, self.locals = [], [], [], [], []
        self.interface = []
        self._types, self._consts, self._builtins = {}, {}, {}
        self._glsl = None
        self.dtype_of = {}         # SPIR-V id -> SPIR-V-level dtype, for every value produced
        self.values = {}           # lang value id -> SPIR-V id (a tuple for a load of width > 1)
        self.vars = {}             # lang var id -> (pointer id, dtype held in it)
        self.buffers, self.shared, self.bindings = {}, {}, {}
        self.push = None
        self.terminated = False

    # -- ids, types, constants -------------------------------------------------------------------
    def new_id(self):
        self._bound += 1
        return self._bound - 1

    def type_id(self, key, *operands, opcode=None, decorate=()):
        if key not in self._types:
            tid = self.new_id()
            self.globals += _inst(opcode, tid, *operands)
            for decoration in decorate:
                self.decorations += _inst(OP["Decorate"], tid, *decoration)
            self._types[key] = tid
        return self._types[key]

    def ty(self, dtype):
        dtype = _spv(dtype)
        if dtype.kind == "b":
            return self.type_id("bool", opcode=OP["TypeBool"])
        self.declare_width(dtype)
        if dtype.kind == "f":
            return self.type_id(dtype, dtype.bits, opcode=OP["TypeFloat"])
        return self.type_id(dtype, dtype.bits, int(dtype.kind == "i"), opcode=OP["TypeInt"])

    def declare_width(self, dtype):
        """Capabilities that declaring an 8/16/64-bit type needs by itself."""
        if dtype.bits == 64:
            self.caps.add("Int64")
        elif dtype.bits == 16 and "StorageBuffer16BitAccess" not in self.caps:
            self.caps.add(_small(dtype))
        elif dtype.bits == 8 and "StorageBuffer8BitAccess" not in self.caps:
            self.caps.add("Int8")

    def pointer(self, storage, type_id):
        return self.type_id(("ptr", storage, type_id), storage, type_id, opcode=OP["TypePointer"])

    def void(self):
        return self.type_id("void", opcode=OP["TypeVoid"])

    def const(self, value, dtype):
        dtype = _spv(dtype)
        key = (dtype, value if dtype.kind == "b" else tuple(_literal(value, dtype)))
        if key in self._consts:
            return self._consts[key]
        cid = self.new_id()
        tid = self.ty(dtype)
        if dtype.kind == "b":
            self.globals += _inst(OP["ConstantTrue" if value else "ConstantFalse"], tid, cid)
        else:
            self.need_arithmetic(dtype)
            self.globals += _inst(OP["Constant"], tid, cid, *_literal(value, dtype))
        self._consts[key] = cid
        self.dtype_of[cid] = dtype
        return cid

    def need_arithmetic(self, dtype):
        cap = _small(_spv(dtype))
        if cap:
            self.caps.add(cap)

    def has_arithmetic(self, dtype):
        """Whether the kernel declared arithmetic on this 8/16-bit type (lang's own caps)."""
        dtype = _spv(dtype)
        if dtype.bits == 16 and dtype.kind in "fiu":
            return ("float16" if dtype.kind == "f" else "int16") in self.lang_caps
        return dtype.bits != 8

    # -- instructions ----------------------------------------------------------------------------
    def value(self, opcode, dtype, *operands, reads=None):
        """Emit an instruction producing a value of `dtype`; `reads` are its value operands."""
        dtype = _spv(dtype)
        reads = operands if reads is None else reads
        if opcode not in STORAGE_ONLY_OPS:
            self.need_arithmetic(dtype)
            for rid in reads:
                if rid in self.dtype_of:        # pointers are not values
                    self.need_arithmetic(self.dtype_of[rid])
        rid = self.new_id()
        self.code += _inst(opcode, self.ty(dtype), rid, *operands)
        self.dtype_of[rid] = dtype
        return rid

    def op(self, name, dtype, *operands):
        return self.value(OP[name], dtype, *operands)

    def glsl(self):
        if self._glsl is None:
            self._glsl = self.new_id()
        return self._glsl

    def ext(self, name, dtype, *operands):
        return self.value(OP["ExtInst"], dtype, self.glsl(), GLSL[name], *operands, reads=operands)

    def vec2(self):
        """The type of two f32 lanes (unpack_half2's pair)."""
        return self.type_id(("vec2",), self.ty(F32), 2, opcode=OP["TypeVector"])

    def extract(self, composite, lane):
        rid = self.new_id()
        self.emit(OP["CompositeExtract"], self.ty(F32), rid, composite, lane)
        self.dtype_of[rid] = F32
        return rid

    def emit(self, opcode, *operands):
        self.code += _inst(opcode, *operands)

    def label(self, lid):
        self.emit(OP["Label"], lid)
        self.terminated = False

    def branch(self, target):
        self.emit(OP["Branch"], target)
        self.terminated = True

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
        self.code += _inst(OP["Function"], self.void(), entry, 0, fn_type)
        first = self.new_id()
        self.code += _inst(OP["Label"], first)
        body_start = len(self.code)
        self.block(kernel.body)
        if not self.terminated:
            self.emit(OP["Return"])
        self.emit(OP["FunctionEnd"])
        self.code[body_start:body_start] = self.locals
        self.names = _inst(OP["Name"], entry, kernel.name) + self.names

        head = []
        for cap in sorted(self.caps, key=CAPABILITY.__getitem__):
            head += _inst(OP["Capability"], CAPABILITY[cap])
        for extension in self.extensions():
            head += _inst(OP["Extension"], extension)
        if self._glsl is not None:
            head += _inst(OP["ExtInstImport"], self._glsl, "GLSL.std.450")
        head += _inst(OP["MemoryModel"], 0, 1)                                 # Logical GLSL450
        head += _inst(OP["EntryPoint"], 5, entry, kernel.name, *self.interface)  # GLCompute
        head += _inst(OP["ExecutionMode"], entry, 17, *kernel.workgroup)        # LocalSize
        body = head + self.names + self.decorations + self.globals + self.code
        return [MAGIC, VERSION_1_3, 0, self._bound, 0] + body

    def extensions(self):
        return sorted(EXTENSION_OF[cap] for cap in self.caps if cap in EXTENSION_OF)

    def declare_resources(self):
        layout = binding_layout(self.kernel)
        for buffer in layout.buffers:
            elem = self.ty(buffer.dtype)
            var = self.block_variable(buffer, buffer.name, elem, buffer.dtype.bytes)
            # Read-only buffers are NonWritable. Write-only ones are not marked NonReadable:
            # naga refuses write-only storage buffers, and drivers gain nothing from it.
            if buffer.access == "r":
                self.decorations += _inst(OP["Decorate"], var, NON_WRITABLE)
            self.buffers[buffer.name] = (var, self.pointer(STORAGE_BUFFER, elem))
            self.bindings[buffer.name] = buffer
        if layout.push_constants:
            members = [self.ty(p.dtype) for p in layout.push_constants]
            block = self.new_id()
            self.globals += _inst(OP["TypeStruct"], block, *members)
            self.decorations += _inst(OP["Decorate"], block, BLOCK)
            for i, p in enumerate(layout.push_constants):
                self.decorations += _inst(OP["MemberDecorate"], block, i, OFFSET, p.offset)
            var = self.new_id()
            self.globals += _inst(OP["Variable"], self.pointer(PUSH_CONSTANT, block), var,
                                  PUSH_CONSTANT)
            self.names += _inst(OP["Name"], var, "scalars")
            self.push = (var, {p.name: i for i, p in enumerate(layout.push_constants)})
        for array in self.kernel.shared:
            self.need_arithmetic(array.dtype)
            elem = self.ty(array.dtype)
            typ = self.type_id(("array", elem, array.size), elem, self.const(array.size, U32),
                               opcode=OP["TypeArray"])
            var = self.new_id()
            self.globals += _inst(OP["Variable"], self.pointer(WORKGROUP, typ), var, WORKGROUP)
            self.names += _inst(OP["Name"], var, array.name)
            self.shared[array.name] = (var, self.pointer(WORKGROUP, elem))

    def builtin(self, name):
        if name not in self._builtins:
            scalar = name in ("lane_id", "subgroup_id")
            if scalar:
                self.caps.add("GroupNonUniform")
            typ = self.ty(U32)
            if not scalar:
                typ = self.type_id(("uvec3",), typ, 3, opcode=OP["TypeVector"])
            var = self.new_id()
            self.globals += _inst(OP["Variable"], self.pointer(INPUT, typ), var, INPUT)
            self.decorations += _inst(OP["Decorate"], var, BUILTIN, BUILTINS[name])
            self.interface.append(var)
            self._builtins[name] = (var, typ, scalar)
        return self._builtins[name]

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

    def local(self, dtype):
        """A Function-storage variable; declared at the top of the entry block."""
        vid = self.new_id()
        self.locals += _inst(OP["Variable"], self.pointer(FUNCTION, self.ty(dtype)), vid, FUNCTION)
        return vid

    def declare_var(self, stmt):
        # An 8/16-bit var is held at 32 bits unless the kernel does arithmetic on its type anyway.
        held = _spv(stmt.dtype) if self.has_arithmetic(stmt.dtype) else _wide(stmt.dtype)
        self.need_arithmetic(held)
        self.vars[stmt.id] = (self.local(held), held)
        self.assign(stmt.id, self.values[stmt.init.id], stmt.init.dtype)

    def assign(self, var_id, vid, dtype):
        pointer, held = self.vars[var_id]
        if held != _spv(dtype):
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
            if held != _spv(dtype):
                result = self.narrow(result, dtype)
        elif op == "load":
            result = self.load(let, args[0])
        elif op == "extract":
            result = args[0][let.attr("lane")]
        elif op == "unpack_half2":
            pair = self.new_id()
            self.code += _inst(OP["ExtInst"], self.vec2(), pair, self.glsl(),
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
            same = _spv(types[0]) == _spv(dtype)
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

    def subgroup_caps(self, cap):
        self.caps.update(("GroupNonUniform", cap))

    def chain(self, pointer_type, base, *indices):
        cid = self.new_id()
        self.emit(OP["AccessChain"], pointer_type, cid, base, *indices)
        return cid

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

    def block_variable(self, buffer, name, elem, stride):
        """A storage-buffer variable at `buffer`'s binding: a block of one runtime array of
        `elem` strided `stride` bytes."""
        array = self.type_id(("rta", elem), elem, opcode=OP["TypeRuntimeArray"],
                             decorate=[(ARRAY_STRIDE, stride)])
        block = self.new_id()
        self.globals += _inst(OP["TypeStruct"], block, array)
        self.decorations += _inst(OP["Decorate"], block, BLOCK)
        self.decorations += _inst(OP["MemberDecorate"], block, 0, OFFSET, 0)
        var = self.new_id()
        self.globals += _inst(OP["Variable"], self.pointer(STORAGE_BUFFER, block), var,
                              STORAGE_BUFFER)
        self.names += _inst(OP["Name"], var, name)
        self.decorations += _inst(OP["Decorate"], var, DESCRIPTOR_SET, buffer.set)
        self.decorations += _inst(OP["Decorate"], var, BINDING, buffer.binding)
        return var

    def vector_view(self, name, width):
        """(variable, element pointer type) of a read-only buffer seen as `width`-vectors: a
        second block variable at the buffer's binding, its runtime array strided width * 4."""
        if (name, width) not in self.vector_views:
            buffer = self.bindings[name]
            elem = self.ty(buffer.dtype)
            vector = self.type_id(("vec", elem, width), elem, width, opcode=OP["TypeVector"])
            var = self.block_variable(buffer, f"{name}_x{width}", vector, 4 * width)
            self.decorations += _inst(OP["Decorate"], var, NON_WRITABLE)
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
        if self.has_arithmetic(dtype) or _spv(dtype).bits >= 32 or dtype.kind == "b":
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


def _literal(value, dtype):
    """The words of a constant: the low-order bits first, narrow integers sign- or zero-extended."""
    if dtype.kind == "f":
        code = "<e" if dtype.bits == 16 else "<f"
        try:
            bits = struct.unpack("<H" if dtype.bits == 16 else "<I", struct.pack(code, value))[0]
        except OverflowError:
            bits = struct.unpack("<H" if dtype.bits == 16 else "<I",
                                 struct.pack(code, float("inf") if value > 0 else float("-inf")))[0]
        return [bits]
    value = int(value) & ((1 << dtype.bits) - 1)
    if dtype.kind == "i" and dtype.bits < 32 and value >> (dtype.bits - 1):
        value |= 0xFFFFFFFF ^ ((1 << dtype.bits) - 1)
    if dtype.bits == 64:
        return [value & 0xFFFFFFFF, value >> 32]
    return [value]
