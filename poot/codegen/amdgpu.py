"""AMD GPU code objects from kernels of the kernel language: OpenCL C compiled by comgr.

`render_opencl(kernel, wavefront)` writes one OpenCL C 2.0 translation unit holding the kernel;
`build_code_object(kernel, isa_name, wavefront)` compiles it with libamd_comgr (drivers/comgr.py)
into an executable code object for one ISA and reads the kernel's symbol, argument layout and
segment sizes back from the object's own metadata. This module never touches the HSA runtime.

Why OpenCL C and not LLVM IR: comgr compiles OpenCL C, with its built-in device libraries, on
every ROCm version (comgr 2.4 of ROCm 5.2 does not take LLVM IR at all, and textual IR changes
between LLVM releases while OpenCL C does not); the source reads like the kernel it came from, so
a line in comgr's log is a line a person can follow; and clang does the register allocation,
scheduling and wavefront-size handling an IR or assembly writer would redo for each ISA. comgr
finds no opencl-c.h, so the source declares what it uses: the unsigned type names, vector types,
OpenCL builtins (`overloadable`, so they get the names the device libraries define) and clang's
AMDGPU builtins, which need no declaration.

Semantics are lang.py's, as the PTX and SPIR-V renderers render them:
- Integer add/sub/mul/neg/abs/fma wrap in the type (computed in unsigned types: C leaves signed
  overflow undefined); div truncates and rem takes the dividend's sign (C's own). Shift amounts
  are read as u32; past the width, shl and an unsigned shr give 0 and a signed shr fills with the
  sign (PTX's clamping; OpenCL alone would mask the amount).
- Each Let is its own statement and FP_CONTRACT is off: no fma the kernel did not ask for. f32
  division is correctly rounded (-cl-fp32-correctly-rounded-divide-sqrt); min/max are fmin/fmax
  (the non-NaN operand); rem is fmod; exp, log, sin, tanh, ... are the device libraries' (ocml)
  within OpenCL's full-profile bounds; sqrt is v_sqrt_f32 (1 ulp).
- f16 is `half` (cl_khr_fp16): add/sub/mul/fma/neg in half; div, rem, min/max, abs, floor and the
  math functions in f32, rounded once. f16 pairs in u32 words go through as_half2 bit casts.
- bf16 is storage only: ushort bits, converted through f32 bits (nearest even, NaN kept quiet).
- float -> int truncates and saturates (NaN -> 0), as PTX's cvt.rzi; int -> float is nearest
  even. `ne` on floats is unordered, the other comparisons ordered.
- Subgroups are wavefronts (32 lanes on gfx10/gfx11, 64 on gfx9): subgroup_add/max/min are the
  device libraries' sub_group_reduce_* (DPP across the wavefront, the result in every lane;
  8/16-bit integers reduce in 32 bits, f16/bf16 in f32 rounded once, bool max = any, min = all).
  Shuffles are `__builtin_amdgcn_ds_bpermute` (this comgr's device libraries have no
  sub_group_shuffle); the lane is taken modulo the wavefront. lane_id is mbcnt, subgroup_id the
  linear work-item id over the wavefront size (wavefronts are cut x fastest).
- thread_id/block_id are the workitem/workgroup id builtins; num_blocks divides the dispatch
  packet's grid size by the workgroup size, so no hidden kernel argument is read. Barrier is
  OpenCL's barrier(CLK_LOCAL_MEM_FENCE): shared (LDS) writes before it are visible after.
- Matrix instructions (MFMA, WMMA): none of the current kernels asks for them (no "matrix" cap),
  so none are rendered and a kernel that needs them is refused.
"""
import re
from dataclasses import dataclass
from functools import cache

import numpy as np

from drivers import comgr as comgr_driver

from ..errors import ModelRefused
from ..kernels.lang import (BINARY, BOOL, COMPARE, F16, F32, SPECIAL, UNARY, Assign, Barrier, For,
                            If, Let, Return, Store, VarDecl, walk)
from . import bf16_bits, f16_bits, f32_bits

# What every gfx9/gfx10/gfx11 ISA offers, in lang.py's capability names.
AMDGPU_CAPS = frozenset({"storage16", "storage8", "float16", "int16", "int64", "subgroup",
                         "subgroup_arith", "subgroup_shuffle", "shared"})
# LDS a workgroup may use, by ISA family (gfx9 MI100/MI200/MI300, gfx10 and gfx11 RDNA).
LDS_BYTES = {"9": 64 * 1024, "10": 64 * 1024, "11": 64 * 1024}
# The wavefront size kernels are built for, by family: the size the HSA agent reports. RDNA's
# wave64 mode is not used: ds_bpermute reaches only 32 lanes there.
WAVEFRONT = {"9": 64, "10": 32, "11": 32}
MAX_WORKGROUP = 1024
COMPILE_OPTIONS = ("-O3", "-cl-fp32-correctly-rounded-divide-sqrt")
COMPILE_STEPS = ("COMPILE_SOURCE_WITH_DEVICE_LIBS_TO_BC", "LINK_BC_TO_BC",
                 "CODEGEN_BC_TO_RELOCATABLE", "LINK_RELOCATABLE_TO_EXECUTABLE")

C_TYPE = {"f32": "float", "f16": "half", "bf16": "ushort", "i8": "char", "u8": "uchar",
          "i16": "short", "u16": "ushort", "i32": "int", "u32": "uint", "i64": "long",
          "u64": "ulong", "bool": "bool"}
PRELUDE = """typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
#pragma OPENCL FP_CONTRACT OFF"""
_RESERVED = re.compile(r"v\d+(_\d+)?\Z|sh_|poot_")     # the renderer's own names
_ARITH = {"add": "+", "sub": "-", "mul": "*", "div": "/", "rem": "%", "and": "&", "or": "|",
          "xor": "^"}
_COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_BOOL_LOGIC = {"and": "&&", "or": "||", "xor": "!=", "min": "&&", "max": "||"}
_MATH = {"exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sin", "cos", "tanh", "floor"}
_XYZ = "xyz"


@dataclass(frozen=True)
class KernelArg:
    """One entry of the code object's argument list: where a launcher writes it."""
    offset: int
    size: int
    kind: str        # the metadata's .value_kind: global_buffer, by_value, hidden_...


@dataclass(frozen=True)
class CodeObject:
    """An executable code object holding one kernel, with what its metadata says about it."""
    image: bytes                 # the ELF bytes the HSA loader takes
    isa: str
    symbol: str                  # the kernel descriptor's symbol, "<name>.kd"
    kernarg_size: int            # explicit arguments plus the hidden ones the metadata declares
    kernarg_align: int
    group_segment_size: int      # static LDS bytes
    private_segment_size: int    # scratch bytes per work-item
    wavefront_size: int
    args: tuple                  # KernelArg per argument: the kernel's params in order, then hidden

    @property
    def explicit_args(self):
        return tuple(a for a in self.args if not a.kind.startswith("hidden"))


def isa_family(isa_name):
    """"9", "10" or "11" for amdgcn-amd-amdhsa--gfx90a:xnack-, gfx1030, ..."""
    processor = full_isa_name(isa_name).split("--")[1].split(":")[0]
    return processor[3:-2]


def full_isa_name(isa_name):
    """The target ID comgr takes: "gfx90a" -> "amdgcn-amd-amdhsa--gfx90a"; full names unchanged."""
    return isa_name if isa_name.startswith("amdgcn-") else f"amdgcn-amd-amdhsa--{isa_name}"


def check_target(kernel, isa_name, wavefront):
    """The refusals of a kernel on an ISA: capabilities, LDS size; and the wavefront it needs."""
    family = isa_family(isa_name)
    if family not in LDS_BYTES:
        raise ValueError(f"{isa_name}: the AMDGPU renderer knows gfx9, gfx10 and gfx11")
    if WAVEFRONT[family] != wavefront:
        raise ValueError(f"{isa_name}: kernels are built for wavefront {WAVEFRONT[family]}, "
                         f"not {wavefront}")
    kernel.require(AMDGPU_CAPS, "the AMDGPU target")
    if kernel.shared_bytes > LDS_BYTES[family]:
        raise ModelRefused(f"kernel {kernel.name} needs {kernel.shared_bytes} bytes of shared "
                           f"memory; a workgroup on {isa_name} has {LDS_BYTES[family]} of LDS")


def render_opencl(kernel, wavefront):
    """The OpenCL C source of `kernel` for wavefronts of `wavefront` (32 or 64) lanes."""
    return _Renderer(kernel, wavefront).source()


def build_code_object(kernel, isa_name, wavefront):
    """`kernel` compiled by comgr into an executable code object for `isa_name` (gfx90a, or the
    agent's full target ID such as amdgcn-amd-amdhsa--gfx90a:sramecc+:xnack-).

    Refuses (ModelRefused) a kernel needing a capability or more LDS than the ISA has. A compile
    failure raises comgr's DriverError carrying the compiler log, whose lines name
    `<kernel>.cl` and the line of the rendered source.
    """
    isa = full_isa_name(isa_name)
    check_target(kernel, isa, wavefront)
    source = render_opencl(kernel, wavefront)
    cg = _comgr()
    image = _compile(cg, source, f"{kernel.name}.cl", isa)
    meta = _kernel_metadata(cg, image, kernel.name)
    args = tuple(KernelArg(int(a[".offset"]), int(a[".size"]), a[".value_kind"])
                 for a in meta[".args"])
    code = CodeObject(image, isa, meta[".symbol"], int(meta[".kernarg_segment_size"]),
                      int(meta[".kernarg_segment_align"]), int(meta[".group_segment_fixed_size"]),
                      int(meta[".private_segment_fixed_size"]), int(meta[".wavefront_size"]), args)
    if code.wavefront_size != wavefront or len(code.explicit_args) != len(kernel.params):
        raise RuntimeError(f"{kernel.name} on {isa}: the code object says wavefront "
                           f"{code.wavefront_size} and {len(code.explicit_args)} arguments; "
                           f"the kernel has {wavefront} and {len(kernel.params)}")
    return code


# -- comgr ---------------------------------------------------------------------------------------
@cache
def _comgr():
    return comgr_driver.Comgr()


def compiler_isas():
    """The target IDs the installed comgr compiles for (amdgcn-amd-amdhsa--gfx90a, ...)."""
    return frozenset(_comgr().isa_names())


def _compile(cg, source, name, isa):
    """OpenCL C -> bitcode with the device libraries -> linked -> relocatable -> executable."""
    info = cg.create_action_info()
    data_set = cg.create_data_set()
    try:
        cg.action_info_set_isa_name(info, isa)
        cg.action_info_set_language(info, "OPENCL_2_0")
        cg.action_info_set_option_list(info, list(COMPILE_OPTIONS))
        cg.action_info_set_logging(info, True)
        data = cg.create_data(comgr_driver.AMD_COMGR_DATA_KIND_SOURCE)
        try:
            cg.set_data(data, source)
            cg.set_data_name(data, name)
            cg.data_set_add(data_set, data)
        finally:
            cg.release_data(data)
        for action in COMPILE_STEPS:
            result = cg.create_data_set()
            try:
                cg.do_action(action, info, data_set, result)
            except BaseException:
                cg.destroy_data_set(result)
                raise
            cg.destroy_data_set(data_set)
            data_set = result
        data = cg.action_data_get_data(data_set, comgr_driver.AMD_COMGR_DATA_KIND_EXECUTABLE, 0)
        try:
            return cg.get_data(data)
        finally:
            cg.release_data(data)
    finally:
        cg.destroy_data_set(data_set)
        cg.destroy_action_info(info)


_KERNEL_KEYS = (".name", ".symbol", ".kernarg_segment_size", ".kernarg_segment_align",
                ".group_segment_fixed_size", ".private_segment_fixed_size", ".wavefront_size")
_ARG_KEYS = (".offset", ".size", ".value_kind")


def _kernel_metadata(cg, image, name):
    """The metadata map of kernel `name` in a code object, as strings (and .args as a list)."""
    data = cg.create_data(comgr_driver.AMD_COMGR_DATA_KIND_EXECUTABLE)
    nodes = []

    def keep(node):
        nodes.append(node)
        return node

    try:
        cg.set_data(data, image)
        root = keep(cg.get_data_metadata(data))
        kernels = keep(cg.metadata_lookup(root, "amdhsa.kernels"))
        for index in range(cg.get_metadata_list_size(kernels)):
            node = keep(cg.index_list_metadata(kernels, index))
            meta = {key: cg.get_metadata_string(keep(cg.metadata_lookup(node, key)))
                    for key in _KERNEL_KEYS}
            if meta[".name"] != name:
                continue
            args = keep(cg.metadata_lookup(node, ".args"))
            meta[".args"] = [
                {key: cg.get_metadata_string(keep(cg.metadata_lookup(arg, key)))
                 for key in _ARG_KEYS}
                for arg in (keep(cg.index_list_metadata(args, i))
                            for i in range(cg.get_metadata_list_size(args)))]
            return meta
        raise RuntimeError(f"the code object holds no kernel named {name}")
    finally:
        for node in reversed(nodes):
            cg.destroy_metadata(node)
        cg.release_data(data)


# -- numbers as C writes them --------------------------------------------------------------------
def _ctype(dtype):
    return C_TYPE[dtype.name]


def _wrapping(dtype):
    """The unsigned type integer arithmetic of `dtype` wraps in."""
    return "ulong" if dtype.bits == 64 else "uint"


def _literal(value, dtype):
    if dtype.kind == "b":
        return "true" if value else "false"
    if dtype == F32:
        bits = f32_bits(value)
        if (bits & 0x7F800000) == 0x7F800000:            # inf, NaN: by their bits
            return f"__builtin_astype(0x{bits:08x}u, float)"
        return float(np.array(bits, np.uint32).view(np.float32)).hex() + "f"
    if dtype == F16:
        return f"__builtin_astype((ushort)0x{f16_bits(value):04x}, half)"
    if dtype.kind == "bf":
        return f"((ushort)0x{bf16_bits(value):04x})"
    bits = int(value) & ((1 << dtype.bits) - 1)
    number = bits - (1 << dtype.bits) if dtype.kind == "i" and bits >> (dtype.bits - 1) else bits
    if -65536 < number < 65536:
        return f"(({_ctype(dtype)}){number})"
    return f"(({_ctype(dtype)})0x{bits:x}{'ul' if dtype.bits == 64 else 'u'})"


class _Renderer:
    def __init__(self, kernel, wavefront):
        if wavefront not in (32, 64):
            raise ValueError(f"wavefront {wavefront}: 32 or 64")
        kernel.require(AMDGPU_CAPS, "the AMDGPU target")
        wx, wy, wz = kernel.workgroup
        if wx * wy * wz > MAX_WORKGROUP:
            raise ValueError(f"kernel {kernel.name}: workgroup {kernel.workgroup} exceeds "
                             f"{MAX_WORKGROUP} work-items")
        for p in kernel.params:
            if _RESERVED.match(p.name):
                raise ValueError(f"parameter {p.name!r}: names v<N>, sh_* and poot_* are the "
                                 f"renderer's own")
        self.kernel, self.wave = kernel, wavefront
        self.lines, self.depth = [], 1
        self.vector_types, self.declarations, self.helpers = {}, {}, {}
        self.vectors = {}        # id of a load of width > 1 or an unpack_half2 -> lane expressions
        self.vars = {}           # var id -> dtype

    # -- output ----------------------------------------------------------------------------------
    def emit(self, text):
        self.lines.append("    " * self.depth + text)

    def source(self):
        k = self.kernel
        for array in k.shared:
            self.emit(f"__local {_ctype(array.dtype)} sh_{array.name}[{array.size}]"
                      f"{self.shared_alignment(array)};")
        self.block(k.body)
        params = []
        for p in k.params:
            if p.kind == "scalar":
                params.append(f"{_ctype(p.dtype)} {p.name}")
            elif p.access == "r":       # read-only for the whole launch, like PTX's ld.global.nc
                params.append(f"__global const {_ctype(p.dtype)} *restrict {p.name}")
            else:
                params.append(f"__global {_ctype(p.dtype)} *{p.name}")
        head = [f"/* {k.name}: rendered by poot.codegen.amdgpu for wavefronts of {self.wave} */",
                PRELUDE]
        head += list(self.vector_types.values()) + list(self.declarations.values())
        head += list(self.helpers.values())
        signature = ("__kernel __attribute__((reqd_work_group_size({}, {}, {})))\n"
                     .format(*k.workgroup) + f"void {k.name}(" + ", ".join(params) + ")")
        return "\n".join(head + ["", signature, "{"] + self.lines + ["}", ""])

    def shared_alignment(self, array):
        """Aligned for the widest vector access the kernel makes to the array (16 bytes at most)."""
        widest = 1
        for stmt in walk(self.kernel.body):
            if isinstance(stmt, Let) and stmt.op == "load" and stmt.attr("shared") \
                    and stmt.attr("target") == array.name:
                widest = max(widest, stmt.attr("width", 1))
            elif isinstance(stmt, Store) and stmt.shared and stmt.target == array.name:
                widest = max(widest, len(stmt.values))
        align = array.dtype.bytes * min(widest, self.per_access(array.dtype))
        return f" __attribute__((aligned({align})))" if align > array.dtype.bytes else ""

    # -- declarations, on first use --------------------------------------------------------------
    def vector(self, ctype, n):
        name = f"{ctype}{n}"
        self.vector_types.setdefault(
            name, f"typedef {ctype} {name} __attribute__((ext_vector_type({n})));")
        return name

    def declare(self, name, declaration):
        """An OpenCL builtin the device libraries define, called `name` in the source."""
        self.declarations.setdefault(declaration, f"{declaration};")
        return name

    def builtin(self, name, ctype, arity=1):
        args = ", ".join([ctype] * arity)
        return self.declare(name, f"{ctype} __attribute__((overloadable)) {name}({args})")

    def helper(self, name, text):
        self.helpers.setdefault(name, text)
        return name

    # -- names -----------------------------------------------------------------------------------
    @staticmethod
    def name(value):
        return f"v{value.id}"

    def var(self, var):
        if var not in self.vars:
            raise ValueError(f"var %{var} is used but never declared in kernel {self.kernel.name}")
        return self.vars[var]

    # -- statements ------------------------------------------------------------------------------
    def block(self, body):
        for stmt in body:
            if isinstance(stmt, Let):
                self.let(stmt)
            elif isinstance(stmt, Store):
                self.store(stmt)
            elif isinstance(stmt, VarDecl):
                self.vars[stmt.id] = stmt.dtype
                self.emit(f"{_ctype(stmt.dtype)} v{stmt.id} = {self.name(stmt.init)};")
            elif isinstance(stmt, Assign):
                self.var(stmt.var)
                self.emit(f"v{stmt.var} = {self.name(stmt.value)};")
            elif isinstance(stmt, If):
                self.emit(f"if ({self.truth(stmt.cond)}) {{")
                self.nested(stmt.then)
                if stmt.orelse:
                    self.emit("} else {")
                    self.nested(stmt.orelse)
                self.emit("}")
            elif isinstance(stmt, For):
                self.for_(stmt)
            elif isinstance(stmt, Barrier):
                self.declare("barrier", "void __attribute__((overloadable)) barrier(uint flags)")
                self.helper("CLK_LOCAL_MEM_FENCE", "#define CLK_LOCAL_MEM_FENCE 1u")
                self.emit("barrier(CLK_LOCAL_MEM_FENCE);")
            elif isinstance(stmt, Return):
                self.emit("return;")
            else:
                raise TypeError(f"unknown statement {stmt!r}")

    def nested(self, body):
        self.depth += 1
        self.block(body)
        self.depth -= 1

    def truth(self, cond):
        if cond.dtype == BOOL:
            return self.name(cond)
        return self.cast(self.name(cond), cond.dtype, BOOL)

    def for_(self, stmt):
        index = self.name(stmt.index)
        step = str(stmt.step) if isinstance(stmt.step, int) else self.name(stmt.step)
        # `unroll` adds nothing: LLVM unrolls counted loops as it judges.
        self.emit(f"for (int {index} = {self.name(stmt.start)}; {index} < {self.name(stmt.stop)}; "
                  f"{index} += {step}) {{")
        self.nested(stmt.body)
        self.emit("}")

    # -- memory ----------------------------------------------------------------------------------
    @staticmethod
    def per_access(dtype):
        """Lanes per vector access: at most 4 and at most 16 bytes."""
        return min(4, 16 // dtype.bytes)

    def chunks(self, name, shared, index, width):
        """(pointer expression to lane `start`, start, lanes) per vector access of a width."""
        array = self.kernel.array(name, shared)
        base = f"sh_{name}" if shared else name
        per = self.per_access(array.dtype)
        for start in range(0, width, per):
            offset = f" + {start}" if start else ""
            yield f"{base} + {index}{offset}", start, min(per, width - start)

    def pointer_cast(self, name, shared, vtype):
        array = self.kernel.array(name, shared)
        const = "const " if not shared and array.access == "r" else ""
        return f"({'__local' if shared else '__global'} {const}{vtype} *)"

    def load(self, let):
        name, shared, width = let.attr("target"), let.attr("shared"), let.attr("width", 1)
        ctype = _ctype(self.kernel.array(name, shared).dtype)
        index = self.name(let.args[0])
        if width == 1:
            return self.emit(f"const {ctype} v{let.id} = {'sh_' if shared else ''}{name}[{index}];")
        lanes = []
        parts = list(self.chunks(name, shared, index, width))
        for n, (pointer, start, count) in enumerate(parts):
            local = f"v{let.id}" if len(parts) == 1 else f"v{let.id}_{n}"
            if count == 1:
                self.emit(f"const {ctype} {local} = *({pointer});")
                lanes.append(local)
                continue
            vtype = self.vector(ctype, count)
            self.emit(f"const {vtype} {local} = *{self.pointer_cast(name, shared, vtype)}"
                      f"({pointer});")
            lanes += [f"{local}.s{j}" for j in range(count)]
        self.vectors[let.id] = lanes

    def store(self, stmt):
        array = self.kernel.array(stmt.target, stmt.shared)
        ctype = _ctype(array.dtype)
        values = [self.name(v) for v in stmt.values]
        for value in stmt.values:
            if value.dtype != array.dtype:
                raise TypeError(f"store to {stmt.target} ({array.dtype}) of a {value.dtype}")
        index = self.name(stmt.index)
        for pointer, start, count in self.chunks(stmt.target, stmt.shared, index, len(values)):
            if count == 1:
                self.emit(f"*({pointer}) = {values[start]};")
                continue
            vtype = self.vector(ctype, count)
            lanes = ", ".join(values[start:start + count])
            self.emit(f"*{self.pointer_cast(stmt.target, stmt.shared, vtype)}({pointer}) = "
                      f"({vtype})({lanes});")

    # -- values ----------------------------------------------------------------------------------
    def let(self, let):
        op, t = let.op, let.dtype
        if op == "load":
            return self.load(let)
        args = [self.name(a) for a in let.args]
        types = [a.dtype for a in let.args]
        if op == "unpack_half2":
            if types[0].name != "u32":
                raise TypeError(f"unpack_half2 of {types[0]}: a u32 word")
            pair, halves = self.vector("float", 2), self.vector("half", 2)
            self.emit(f"const {pair} v{let.id} = __builtin_convertvector("
                      f"__builtin_astype({args[0]}, {halves}), {pair});")
            self.vectors[let.id] = [f"v{let.id}.x", f"v{let.id}.y"]
            return
        if op == "extract":
            expr = self.vectors[let.args[0].id][let.attr("lane")]
        elif op == "var_get":
            self.var(let.attr("var"))
            expr = f"v{let.attr('var')}"
        elif op == "const":
            expr = _literal(let.attr("value"), t)
        elif op == "param":
            expr = let.attr("name")
        elif op in SPECIAL:
            expr = self.special(op, let.attr("axis", 0))
        elif op in BINARY:
            expr = self.binary(op, t, args[0], args[1])
        elif op in COMPARE:
            if types[0].kind == "bf":
                raise TypeError(f"{op} on bf16: convert to f32 first")
            expr = f"({args[0]} {_COMPARE[op]} {args[1]})"
        elif op in UNARY:
            expr = self.unary(op, t, args[0])
        elif op == "select":
            expr = f"({_ctype(t)})({args[0]} ? {args[1]} : {args[2]})"
        elif op == "fma":
            expr = self.fma(t, *args)
        elif op == "cast":
            expr = self.cast(args[0], types[0], t)
        elif op == "bitcast":
            expr = self.bitcast(args[0], types[0], t)
        elif op in ("subgroup_add", "subgroup_max", "subgroup_min"):
            expr = self.reduce(op[len("subgroup_"):], t, args[0])
        elif op == "shuffle_xor":
            mask = let.attr("mask")
            if not 0 <= mask < self.wave:
                raise ValueError(f"shuffle_xor mask {mask} outside a wavefront of {self.wave}")
            expr = f"{self.shuffle(t)}({args[0]}, {self.lane_id()}() ^ {mask})"
        elif op == "shuffle":
            expr = f"{self.shuffle(t)}({args[0]}, (int){args[1]})"
        elif op == "atomic_add":        # relaxed: the barrier after orders it
            expr = (f"__opencl_atomic_fetch_add((volatile __local atomic_uint *)&sh_"
                    f"{let.attr('target')}[{args[0]}], {args[1]}, __ATOMIC_RELAXED, "
                    f"__OPENCL_MEMORY_SCOPE_WORK_GROUP)")
        elif op == "pack_half2":
            halves = self.vector("half", 2)
            expr = f"__builtin_astype(({halves})((half){args[0]}, (half){args[1]}), uint)"
        else:
            raise TypeError(f"unknown op {op!r}")
        self.emit(f"const {_ctype(t)} v{let.id} = {expr};")

    def special(self, op, axis):
        if op == "thread_id":
            return f"(int)__builtin_amdgcn_workitem_id_{_XYZ[axis]}()"
        if op == "block_id":
            return f"(int)__builtin_amdgcn_workgroup_id_{_XYZ[axis]}()"
        if op == "num_blocks":
            return f"{self.num_blocks()}({axis}u, {self.kernel.workgroup[axis]}u)"
        if op == "lane_id":
            return f"{self.lane_id()}()"
        return f"{self.subgroup_id()}()"

    def binary(self, op, t, a, b):
        ctype = _ctype(t)
        if t.kind == "bf":
            raise TypeError(f"{op} on bf16: convert to f32 first")
        if t.kind == "b":
            if op not in _BOOL_LOGIC:
                raise TypeError(f"{op} on bool")
            return f"({a} {_BOOL_LOGIC[op]} {b})"
        if t.kind == "f":
            return self.float_binary(op, t, a, b)
        wrap = _wrapping(t)
        if op in ("add", "sub", "mul"):
            return f"({ctype})(({wrap}){a} {_ARITH[op]} ({wrap}){b})"
        if op in ("div", "rem", "and", "or", "xor"):
            return f"({ctype})({a} {_ARITH[op]} {b})"
        if op in ("min", "max"):
            return f"({ctype})({a} {'<' if op == 'min' else '>'} {b} ? {a} : {b})"
        amount, bits = f"(uint){b}", t.bits
        if op == "shl":
            return f"({ctype})({amount} >= {bits}u ? 0 : ({wrap}){a} << {amount})"
        if t.kind == "u":
            return f"({ctype})({amount} >= {bits}u ? 0 : {a} >> {amount})"
        return f"({ctype})({a} >> ({amount} >= {bits}u ? {bits - 1}u : {amount}))"

    def float_binary(self, op, t, a, b):
        if op in ("add", "sub", "mul") or (op == "div" and t == F32):
            return f"({a} {_ARITH[op]} {b})"
        if op in ("and", "or", "xor"):             # on the bits, as PTX's and.b32
            bits = "uint" if t == F32 else "ushort"
            word = f"__builtin_astype({a}, {bits}) {_ARITH[op]} __builtin_astype({b}, {bits})"
            return f"__builtin_astype(({bits})({word}), {_ctype(t)})"
        x, y = (a, b) if t == F32 else (f"(float){a}", f"(float){b}")
        if op == "div":
            result = f"({x} / {y})"
        elif op in ("rem", "min", "max"):
            name = {"rem": "fmod", "min": "fmin", "max": "fmax"}[op]
            result = f"{self.builtin(name, 'float', 2)}({x}, {y})"
        else:
            raise TypeError(f"{op} on {t}")
        return result if t == F32 else f"(half){result}"

    def unary(self, op, t, a):
        ctype = _ctype(t)
        if t.kind == "b":
            if op not in ("not", "neg", "abs"):
                raise TypeError(f"{op} on bool")
            return f"!{a}" if op == "not" else a
        if t.kind == "bf":
            raise TypeError(f"{op} on bf16: convert to f32 first")
        if t.kind in "iu":
            wrap = _wrapping(t)
            if op == "not":
                return f"({ctype})~{a}"
            if op == "neg":
                return f"({ctype})(({wrap})0 - ({wrap}){a})"
            if op == "abs":
                return a if t.kind == "u" else \
                    f"({ctype})({a} < 0 ? ({wrap})0 - ({wrap}){a} : ({wrap}){a})"
            raise TypeError(f"{op} needs a float operand, got {t}")
        if op == "neg":
            return f"-{a}"
        if op == "not":
            bits = "uint" if t == F32 else "ushort"
            return f"__builtin_astype(({bits})~__builtin_astype({a}, {bits}), {ctype})"
        name = "fabs" if op == "abs" else op
        if name != "fabs" and name not in _MATH:
            raise TypeError(f"unknown math function {op!r}")
        call = self.builtin(name, "float")
        return f"{call}({a})" if t == F32 else f"(half){call}((float){a})"

    def fma(self, t, a, b, c):
        if t.kind == "f":
            return f"{self.builtin('fma', _ctype(t), 3)}({a}, {b}, {c})"
        if t.kind in "iu":
            wrap = _wrapping(t)
            return f"({_ctype(t)})(({wrap}){a} * ({wrap}){b} + ({wrap}){c})"
        raise TypeError(f"fma on {t}")

    def cast(self, a, src, dst):
        if src == dst:
            return a
        floats = ("f", "bf")
        if dst.kind == "b":
            if src.kind == "bf":
                return f"(({a} & 0x7fff) != 0)"
            return f"({self.to_f32(a, src)} != 0.0f)" if src.kind == "f" else f"({a} != 0)"
        if src.kind == "b":
            one = {"f32": "1.0f", "f16": "(half)1.0f", "bf16": "(ushort)0x3f80"}.get(dst.name, "1")
            return f"({_ctype(dst)})({a} ? {one} : 0)"
        if src.kind in floats:
            x = self.to_f32(a, src)
            return self.from_f32(x, dst) if dst.kind in floats else f"{self.float_to_int(dst)}({x})"
        if dst.kind in floats:
            return self.from_f32(f"(float){a}", dst)
        return f"({_ctype(dst)}){a}"    # extends by the source's signedness, or keeps low bits

    def to_f32(self, a, src):
        if src == F32:
            return a
        if src == F16:
            return f"(float){a}"
        return f"{self.bf16_to_f32()}({a})"

    def from_f32(self, x, dst):
        if dst == F32:
            return x
        if dst == F16:
            return f"(half){x}"
        return f"{self.f32_to_bf16()}({x})"

    def bitcast(self, a, src, dst):
        if src.bits != dst.bits:
            raise TypeError(f"bitcast {src} -> {dst}: sizes differ")
        s, d = _ctype(src), _ctype(dst)
        if s == d:
            return a
        if "half" in (s, d) or "float" in (s, d):
            return f"__builtin_astype({a}, {d})"
        return f"({d}){a}"

    # -- subgroups -------------------------------------------------------------------------------
    def reduce(self, kind, t, a):
        """sub_group_reduce_* of the device libraries, in a 32/64-bit type of the same meaning."""
        call = f"sub_group_reduce_{kind}"
        if t.kind == "b":
            if kind == "add":
                raise TypeError("subgroup_add on bool")
            return f"({self.builtin(call, 'uint')}({a} ? 1u : 0u) != 0u)"
        if t.kind in ("f", "bf"):
            return self.from_f32(f"{self.builtin(call, 'float')}({self.to_f32(a, t)})", t)
        carrier = ("long" if t.bits == 64 else "int") if t.kind == "i" else \
            ("ulong" if t.bits == 64 else "uint")
        return f"({_ctype(t)}){self.builtin(call, carrier)}(({carrier}){a})"

    def shuffle(self, t):
        """poot_shuffle_<t>(x, lane): x of lane `lane` (modulo the wavefront), by ds_bpermute,
        which moves 32-bit words: narrower types widen, 64-bit ones go as two halves."""
        name, ctype = f"poot_shuffle_{t.name}", _ctype(t)
        address = f"(lane & {self.wave - 1}) << 2"
        if t.bits == 64:
            halves = self.vector("int", 2)
            body = (f"    {halves} halves = __builtin_astype(x, {halves});\n"
                    f"    int address = {address};\n"
                    f"    halves.x = __builtin_amdgcn_ds_bpermute(address, halves.x);\n"
                    f"    halves.y = __builtin_amdgcn_ds_bpermute(address, halves.y);\n"
                    f"    return __builtin_astype(halves, {ctype});")
        else:
            if ctype == "float":
                word, back = "__builtin_astype(x, int)", "__builtin_astype(moved, float)"
            elif ctype == "half":
                word, back = "(int)__builtin_astype(x, ushort)", \
                    "__builtin_astype((ushort)moved, half)"
            elif ctype == "bool":
                word, back = "(int)x", "moved != 0"
            else:
                word, back = "(int)x", f"({ctype})moved"
            body = (f"    int moved = __builtin_amdgcn_ds_bpermute({address}, {word});\n"
                    f"    return {back};")
        return self.helper(name, f"static inline {ctype} {name}({ctype} x, int lane)\n{{\n"
                                 f"{body}\n}}")

    def lane_id(self):
        count = "__builtin_amdgcn_mbcnt_lo(~0u, 0u)"
        if self.wave == 64:
            count = f"__builtin_amdgcn_mbcnt_hi(~0u, {count})"
        return self.helper("poot_lane_id",
                           "/* The lanes of the wavefront below this one: its lane id. */\n"
                           "static inline int poot_lane_id(void)\n{\n"
                           f"    return (int){count};\n}}")

    def subgroup_id(self):
        wx, wy, wz = self.kernel.workgroup
        linear = "__builtin_amdgcn_workitem_id_x()"
        if wy * wz > 1:
            linear += (f" + {wx}u * (__builtin_amdgcn_workitem_id_y() + {wy}u * "
                       f"__builtin_amdgcn_workitem_id_z())")
        return self.helper("poot_subgroup_id",
                           "/* Wavefronts are cut from the linear work-item id, x fastest. */\n"
                           "static inline int poot_subgroup_id(void)\n{\n"
                           f"    return (int)(({linear}) / {self.wave}u);\n}}")

    def num_blocks(self):
        return self.helper(
            "poot_num_blocks",
            "/* Workgroups along an axis: the dispatch packet's grid size in work-items (bytes\n"
            "   12, 16, 20 of the AQL packet) over the workgroup size. */\n"
            "static inline int poot_num_blocks(uint axis, uint workgroup)\n{\n"
            "    __constant uint *packet = (__constant uint *)__builtin_amdgcn_dispatch_ptr();\n"
            "    return (int)((packet[3 + axis] + workgroup - 1) / workgroup);\n}")

    # -- conversions through f32 -----------------------------------------------------------------
    def bf16_to_f32(self):
        return self.helper("poot_bf16_to_f32",
                           "static inline float poot_bf16_to_f32(ushort bits)\n{\n"
                           "    return __builtin_astype((uint)bits << 16, float);\n}")

    def f32_to_bf16(self):
        return self.helper("poot_f32_to_bf16",
                           "/* Round to nearest even; a NaN stays a quiet NaN. */\n"
                           "static inline ushort poot_f32_to_bf16(float x)\n{\n"
                           "    uint bits = __builtin_astype(x, uint);\n"
                           "    if (x != x)\n"
                           "        return (ushort)((bits >> 16) | 0x40u);\n"
                           "    return (ushort)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);\n}")

    def float_to_int(self, dst):
        """poot_f32_to_<type>: truncates toward zero, saturates, NaN -> 0 (PTX's cvt.rzi)."""
        ctype, bits = _ctype(dst), dst.bits
        name = f"poot_f32_to_{ctype}"
        if dst.kind == "i":
            low = (f"    if (x < -0x1p{bits - 1}f)\n"
                   f"        return {_literal(-(1 << (bits - 1)), dst)};\n")
            high = f"0x1p{bits - 1}f"
        else:
            low = "    if (x < 0.0f)\n        return 0;\n"
            high = f"0x1p{bits}f"
        top = _literal((1 << (bits - (dst.kind == "i"))) - 1, dst)
        return self.helper(name, f"static inline {ctype} {name}(float x)\n{{\n"
                                 f"    if (x != x)\n        return 0;\n{low}"
                                 f"    if (x >= {high})\n        return {top};\n"
                                 f"    return ({ctype})x;\n}}")
