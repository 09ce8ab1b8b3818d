"""The SPIR-V module a renderer builds (spirv.py lowers a kernel into one): the specification's
numbers, instructions encoded as words, ids handed out in order, each type and constant declared
once, the capabilities what is declared needs, variables and built-ins, and the assembled
module. It knows the kernel only for its buffers' widths and the capabilities it declared.
"""
import struct

from poot.codegen import f16_bits, f32_bits
from poot.kernels.lang import F32, U16, U32

MAGIC, VERSION_1_3 = 0x07230203, 0x00010300

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
    ControlBarrier=224, AtomicIAdd=234, LoopMerge=246, SelectionMerge=247, Label=248, Branch=249,
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


def _string_words(text):
    data = text.encode() + b"\0"
    data += b"\0" * (-len(data) % 4)
    return list(struct.unpack(f"<{len(data) // 4}I", data))


def inst(opcode, *operands):
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


def spv_dtype(dtype):
    """The SPIR-V-level dtype: bf16 is held as a 16-bit unsigned integer."""
    return U16 if dtype.kind == "bf" else dtype


def literal_words(value, dtype):
    """The words of a constant: the low-order bits first, narrow integers sign- or zero-extended."""
    if dtype.kind == "f":
        return [f16_bits(value) if dtype.bits == 16 else f32_bits(value)]
    value = int(value) & ((1 << dtype.bits) - 1)
    if dtype.kind == "i" and dtype.bits < 32 and value >> (dtype.bits - 1):
        value |= 0xFFFFFFFF ^ ((1 << dtype.bits) - 1)
    if dtype.bits == 64:
        return [value & 0xFFFFFFFF, value >> 32]
    return [value]


class ModuleBuilder:
    def __init__(self, kernel):
        self.kernel, self.lang_caps = kernel, kernel.caps
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
        self.terminated = False

    # -- ids, types, constants ---------------------------------------------------------------------
    def new_id(self):
        self._bound += 1
        return self._bound - 1

    def type_id(self, key, *operands, opcode=None, decorate=()):
        if key not in self._types:
            tid = self.new_id()
            self.globals += inst(opcode, tid, *operands)
            for decoration in decorate:
                self.decorations += inst(OP["Decorate"], tid, *decoration)
            self._types[key] = tid
        return self._types[key]

    def ty(self, dtype):
        dtype = spv_dtype(dtype)
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
        dtype = spv_dtype(dtype)
        key = (dtype, value if dtype.kind == "b" else tuple(literal_words(value, dtype)))
        if key in self._consts:
            return self._consts[key]
        cid = self.new_id()
        tid = self.ty(dtype)
        if dtype.kind == "b":
            self.globals += inst(OP["ConstantTrue" if value else "ConstantFalse"], tid, cid)
        else:
            self.need_arithmetic(dtype)
            self.globals += inst(OP["Constant"], tid, cid, *literal_words(value, dtype))
        self._consts[key] = cid
        self.dtype_of[cid] = dtype
        return cid

    def need_arithmetic(self, dtype):
        cap = _small(spv_dtype(dtype))
        if cap:
            self.caps.add(cap)

    def has_arithmetic(self, dtype):
        """Whether the kernel declared arithmetic on this 8/16-bit type (lang's own caps)."""
        dtype = spv_dtype(dtype)
        if dtype.bits == 16 and dtype.kind in "fiu":
            return ("float16" if dtype.kind == "f" else "int16") in self.lang_caps
        return dtype.bits != 8

    # -- instructions ------------------------------------------------------------------------------
    def value(self, opcode, dtype, *operands, reads=None):
        """Emit an instruction producing a value of `dtype`; `reads` are its value operands."""
        dtype = spv_dtype(dtype)
        reads = operands if reads is None else reads
        if opcode not in STORAGE_ONLY_OPS:
            self.need_arithmetic(dtype)
            for rid in reads:
                if rid in self.dtype_of:        # pointers are not values
                    self.need_arithmetic(self.dtype_of[rid])
        rid = self.new_id()
        self.code += inst(opcode, self.ty(dtype), rid, *operands)
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
        self.code += inst(opcode, *operands)

    def label(self, lid):
        self.emit(OP["Label"], lid)
        self.terminated = False

    def branch(self, target):
        self.emit(OP["Branch"], target)
        self.terminated = True

    # -- variables ---------------------------------------------------------------------------------
    def chain(self, pointer_type, base, *indices):
        cid = self.new_id()
        self.emit(OP["AccessChain"], pointer_type, cid, base, *indices)
        return cid

    def local(self, dtype):
        """A Function-storage variable; declared at the top of the entry block."""
        vid = self.new_id()
        self.locals += inst(OP["Variable"], self.pointer(FUNCTION, self.ty(dtype)), vid, FUNCTION)
        return vid

    def block_variable(self, buffer, name, elem, stride):
        """A storage-buffer variable at `buffer`'s binding: a block of one runtime array of
        `elem` strided `stride` bytes."""
        array = self.type_id(("rta", elem), elem, opcode=OP["TypeRuntimeArray"],
                             decorate=[(ARRAY_STRIDE, stride)])
        block = self.new_id()
        self.globals += inst(OP["TypeStruct"], block, array)
        self.decorations += inst(OP["Decorate"], block, BLOCK)
        self.decorations += inst(OP["MemberDecorate"], block, 0, OFFSET, 0)
        var = self.new_id()
        self.globals += inst(OP["Variable"], self.pointer(STORAGE_BUFFER, block), var,
                             STORAGE_BUFFER)
        self.names += inst(OP["Name"], var, name)
        self.decorations += inst(OP["Decorate"], var, DESCRIPTOR_SET, buffer.set)
        self.decorations += inst(OP["Decorate"], var, BINDING, buffer.binding)
        return var

    def builtin(self, name):
        if name not in self._builtins:
            scalar = name in ("lane_id", "subgroup_id")
            if scalar:
                self.caps.add("GroupNonUniform")
            typ = self.ty(U32)
            if not scalar:
                typ = self.type_id(("uvec3",), typ, 3, opcode=OP["TypeVector"])
            var = self.new_id()
            self.globals += inst(OP["Variable"], self.pointer(INPUT, typ), var, INPUT)
            self.decorations += inst(OP["Decorate"], var, BUILTIN, BUILTINS[name])
            self.interface.append(var)
            self._builtins[name] = (var, typ, scalar)
        return self._builtins[name]

    def subgroup_caps(self, cap):
        self.caps.update(("GroupNonUniform", cap))

    def extensions(self):
        return sorted(EXTENSION_OF[cap] for cap in self.caps if cap in EXTENSION_OF)

    # -- the module --------------------------------------------------------------------------------
    def words(self, entry):
        """The module's words, its entry point the function `entry` named after the kernel."""
        kernel = self.kernel
        head = []
        for cap in sorted(self.caps, key=CAPABILITY.__getitem__):
            head += inst(OP["Capability"], CAPABILITY[cap])
        for extension in self.extensions():
            head += inst(OP["Extension"], extension)
        if self._glsl is not None:
            head += inst(OP["ExtInstImport"], self._glsl, "GLSL.std.450")
        head += inst(OP["MemoryModel"], 0, 1)                                 # Logical GLSL450
        head += inst(OP["EntryPoint"], 5, entry, kernel.name, *self.interface)  # GLCompute
        head += inst(OP["ExecutionMode"], entry, 17, *kernel.workgroup)        # LocalSize
        body = head + self.names + self.decorations + self.globals + self.code
        return [MAGIC, VERSION_1_3, 0, self._bound, 0] + body
