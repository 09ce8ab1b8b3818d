"""poot/codegen/amdgpu.py: kernels of the kernel language as OpenCL C, built by comgr.

These run here, for real, wherever libamd_comgr is installed (Debian's libamd-comgr2; skipped,
saying so, elsewhere): every kernel the device runner launches is compiled into an executable
code object, by as many processes as there are cores: for gfx1030 at wavefront 32, and at
wavefront 64 for gfx90a or gfx908 in turn (the source is the same for both, so each builds
half), and the symbol, kernel-argument layout and LDS size read back from the object's metadata
are checked against the kernel. The every-op kernels of
tests/test_codegen_ptx.py (every op, dtype, cast, vector width, control statement) compile for
both wavefront sizes, and the disassembly shows the instructions the renderer meant. Running
kernels needs an AMD GPU: tests/test_kernels.py with "rocm".

    python -m pytest tests/test_codegen_amdgpu.py
"""
import multiprocessing
import os
import re

import numpy as np
import pytest

from drivers import DriverError, LibraryNotFound, comgr
from poot.codegen.amdgpu import (AMDGPU_CAPS, build_code_object, compiler_isas, full_isa_name,
                                 isa_family, render_opencl)
from poot.errors import ModelRefused
from poot.kernels import choice, ops
from poot.kernels.lang import F16, F32, I64, U32, Kernel, KernelBuilder
from poot.kernels.quant import DEVICE_DTYPES
from tests.test_codegen_ptx import CASES, MMA_CASES, PTX_ONLY_CASES
from tests.test_kernel_sources import runner_matvecs

TARGETS = (("gfx90a", 64), ("gfx1030", 32), ("gfx908", 64))


@pytest.fixture(scope="module", autouse=True)
def installed_comgr():
    try:
        return compiler_isas()
    except LibraryNotFound as error:
        pytest.skip(f"libamd_comgr not found (tried {', '.join(p for p, _ in error.tried)})")


def runner_kernels(wavefront):
    """Every kernel engine/device_runner.py launches, for a subgroup of `wavefront` lanes."""
    kernels = runner_matvecs(wavefront)
    kernels += [ops.embedding(dtype) for dtype in DEVICE_DTYPES]
    kernels += [ops.rms_norm(wavefront), ops.rms_norm(wavefront, residual=True),
                ops.elementwise("add"), ops.elementwise("glu", "silu"),
                ops.gather_rows(), ops.scale(), ops.rope("normal"), ops.rope("neox"),
                ops.store_kv(), ops.rope_store_kv("normal"), ops.rope_store_kv("neox"),
                ops.norm_rope_store_kv("normal", wavefront),
                ops.norm_rope_store_kv("neox", wavefront),
                ops.attention(wavefront, 64), ops.attention(wavefront, 128),
                ops.attention_split(wavefront, 64), ops.attention_split(wavefront, 128),
            ops.attention(wavefront, 128, 4), ops.attention_split(wavefront, 128, 4),
                ops.attention_combine(64), ops.attention_combine(128), choice.argmax(wavefront),
                choice.argmax_chunks(wavefront), choice.top_candidates(wavefront),
                choice.logit_edits(), choice.feed_tokens(), choice.draw(wavefront)]
    kernels += [ops.all_reduce(w, r) for w in (2, 8) for r in (False, True)]
    kernels += [ops.all_gather(w) for w in (2, 8)]
    return kernels


def explicit_layout(kernel):
    """(offset, size) of each parameter as OpenCL lays them out: pointers 8, scalars 4, each
    aligned to its size."""
    layout, offset = [], 0
    for param in kernel.params:
        size = 8 if param.kind == "buffer" else 4
        offset = -(-offset // size) * size
        layout.append((offset, size))
        offset += size
    return layout


# (kernel, isa, wavefront) of each build a worker process takes by its index (_built)
_BUILDS = []


def _built(i):
    """Build i of _BUILDS in a worker process: (i, its code object or the error's text)."""
    kernel, isa, wavefront = _BUILDS[i]
    try:
        return i, build_code_object(kernel, isa, wavefront)
    except Exception as error:          # (the parent names the kernel)
        return i, f"{type(error).__name__}: {error}"


def build_all(kernels, isa, wavefront):
    """Each kernel's code object, built by as many processes as there are cores (comgr's
    LLVM runs one compile a call): forked, they take the kernels as built here."""
    _BUILDS[:] = [(kernel, isa, wavefront) for kernel in kernels]
    try:
        with multiprocessing.get_context("fork").Pool(os.cpu_count() or 1) as pool:
            built = dict(pool.imap_unordered(_built, range(len(kernels)), chunksize=4))
    finally:
        _BUILDS.clear()
    failed = [f"{kernels[i].name}: {code}" for i, code in built.items() if isinstance(code, str)]
    assert not failed, "\n".join(failed)
    return [built[i] for i in range(len(kernels))]


def dealt(isa, wavefront):
    """The runner's kernels for `wavefront`, dealt in turn among the targets of that wavefront
    size: their OpenCL source is the same (gfx90a's and gfx908's), so each source is built
    once, for one of those ISAs, and every ISA builds a share."""
    peers = [target for target, size in TARGETS if size == wavefront]
    return runner_kernels(wavefront)[peers.index(isa)::len(peers)]


@pytest.mark.parametrize("isa,wavefront", TARGETS)
def test_every_runner_kernel_builds_with_its_layout_and_lds(isa, wavefront):
    kernels = dealt(isa, wavefront)
    for kernel, code in zip(kernels, build_all(kernels, isa, wavefront)):
        assert code.image[:4] == b"\x7fELF"
        assert code.symbol == f"{kernel.name}.kd"
        assert code.wavefront_size == wavefront
        explicit = [(a.offset, a.size) for a in code.explicit_args]
        assert explicit == explicit_layout(kernel), kernel.name
        assert [a.kind for a in code.explicit_args] == [
            "global_buffer" if p.kind == "buffer" else "by_value" for p in kernel.params]
        # The segment is the explicit arguments plus the hidden ones the metadata declares.
        hidden = code.args[len(explicit):]
        assert all(a.kind.startswith("hidden") for a in hidden)
        end = explicit[-1][0] + explicit[-1][1]
        assert code.kernarg_size == max([end] + [a.offset + a.size for a in hidden]), kernel.name
        assert code.group_segment_size == kernel.shared_bytes, kernel.name
        assert code.private_segment_size == 0, f"{kernel.name} spills to scratch"


@pytest.mark.parametrize("name", list(CASES))
def test_every_op_builds_for_both_wavefront_sizes(name):
    kernel = CASES[name](np.random.default_rng(0)).kernel
    for isa, wavefront in TARGETS[:2]:
        code = build_code_object(kernel, isa, wavefront)
        assert code.symbol == f"{kernel.name}.kd"
        assert code.group_segment_size >= kernel.shared_bytes


def disassemble(image, isa):
    cg = comgr.Comgr()
    info = cg.create_action_info()
    inputs, result = cg.create_data_set(), cg.create_data_set()
    try:
        cg.action_info_set_isa_name(info, full_isa_name(isa))
        data = cg.create_data(comgr.AMD_COMGR_DATA_KIND_EXECUTABLE)
        cg.set_data(data, image)
        cg.set_data_name(data, "kernel.so")     # a set takes named data only
        cg.data_set_add(inputs, data)
        cg.release_data(data)
        cg.do_action("DISASSEMBLE_EXECUTABLE_TO_SOURCE", info, inputs, result)
        text = cg.action_data_get_data(result, comgr.AMD_COMGR_DATA_KIND_SOURCE, 0)
        try:
            return cg.get_data(text).decode()
        finally:
            cg.release_data(text)
    finally:
        cg.destroy_data_set(inputs)
        cg.destroy_data_set(result)
        cg.destroy_action_info(info)


def subgroup_kernel():
    k = KernelBuilder("lanes", (256,))
    x, y = k.buffer("x", F32), k.buffer("y", F32, "w")
    tile = k.shared("tile", F32, 256)
    t = k.thread_id()
    v = x.load(t * 4 - (t & 3) * 4, 4)[0]
    tile[t] = k.subgroup_add(v) + k.shuffle_xor(v, 1)
    k.barrier()
    y[t] = tile[255 - t] + k.subgroup_id().to(F32)
    return k.build()


@pytest.mark.parametrize("isa,wavefront", TARGETS[:2])
def test_source_and_instructions_show_the_builtins(isa, wavefront):
    kernel = subgroup_kernel()
    source = render_opencl(kernel, wavefront)
    assert "__kernel __attribute__((reqd_work_group_size(256, 1, 1)))" in source
    assert "void lanes(__global const float *restrict x, __global float *y)" in source
    assert "__local float sh_tile[256];" in source
    assert "float __attribute__((overloadable)) sub_group_reduce_add(float);" in source
    assert f"__builtin_amdgcn_ds_bpermute((lane & {wavefront - 1}) << 2" in source
    assert ("__builtin_amdgcn_mbcnt_hi" in source) == (wavefront == 64)
    assert f"/ {wavefront}u" in source                          # subgroup_id
    assert "barrier(CLK_LOCAL_MEM_FENCE);" in source
    assert re.search(r"const float4 v\d+ = \*\(__global const float4 \*\)\(x \+ v\d+\);", source)
    text = disassemble(build_code_object(kernel, isa, wavefront).image, isa)
    assert "ds_bpermute_b32" in text                            # the shuffle
    assert "_dpp" in text                                       # the reduction's DPP moves
    assert "s_barrier" in text
    assert "global_load_dwordx4" in text                        # the vector load


def test_numbers_and_conversions_render_exactly():
    k = KernelBuilder("numbers", (64,))
    out, wide = k.buffer("out", F32, "w"), k.buffer("wide", I64, "w")
    t = k.thread_id()
    out[t] = k.const(float("nan"), F32) + k.const(-0.0, F32) + k.const(0.1, F32)
    wide[t] = k.const(-2**63, I64) + (k.const(1.5, F32) * t.to(F32)).to(I64)
    source = render_opencl(k.build(), 64)
    assert "__builtin_astype(0x7fc00000u, float)" in source     # NaN by its bits
    assert "-0x0.0p+0f" in source and "0x1.99999a0000000p-4f" in source
    assert "((long)0x8000000000000000ul)" in source
    assert "static inline long poot_f32_to_long(float x)" in source   # saturating truncation
    assert "#pragma OPENCL FP_CONTRACT OFF" in source


def test_capabilities_and_refusals():
    assert AMDGPU_CAPS == {"storage16", "storage8", "float16", "int16", "int64", "subgroup",
                           "subgroup_arith", "subgroup_shuffle", "shared"}
    base = choice.argmax(64)
    matrix = Kernel(base.name, base.params, base.shared, base.workgroup, base.body,
                    base.caps | {"matrix"}, base.n_values)
    with pytest.raises(ModelRefused, match=r"kernel argmax_s64 needs matrix"):
        build_code_object(matrix, "gfx90a", 64)
    k = KernelBuilder("too_much_lds", (64,))
    tile = k.shared("tile", F32, 16 * 1024 + 1)
    tile[k.thread_id()] = 1.0
    with pytest.raises(ModelRefused, match=r"kernel too_much_lds needs 65540 bytes .* 65536"):
        build_code_object(k.build(), "gfx1030", 32)
    with pytest.raises(ValueError, match="wavefront 64"):
        build_code_object(base, "gfx90a", 32)
    for name, capability in (("mma_f16", "mma_f16"), ("mma_bf16", "mma_bf16")):
        kernel = MMA_CASES[name](np.random.default_rng(0)).kernel
        with pytest.raises(ModelRefused, match=rf"kernel {name} needs fragment_load, {capability}, "
                                               r"which the AMDGPU target lacks"):
            render_opencl(kernel, 32)
        with pytest.raises(ModelRefused, match=capability):
            build_code_object(kernel, "gfx90a", 64)
    with pytest.raises(ModelRefused, match="kernel async_copy needs async_copy, which the AMDGPU"):
        render_opencl(PTX_ONLY_CASES["async_copy"](np.random.default_rng(0)).kernel, 32)
    with pytest.raises(ValueError, match="gfx9, gfx10 and gfx11"):
        build_code_object(base, "gfx803", 64)


def test_all_of_lds_is_usable():
    k = KernelBuilder("all_lds", (256,))
    x, y = k.buffer("x", F16), k.buffer("y", F16, "w")
    tile = k.shared("tile", F16, 32 * 1024)
    t = k.thread_id()
    with k.for_(t, 32 * 1024, 256) as i:
        tile[i] = x[i]
    k.barrier()
    y[t] = tile[32 * 1024 - 1 - t]
    assert build_code_object(k.build(), "gfx90a", 64).group_segment_size == 64 * 1024


def test_shuffle_mask_must_name_a_lane_of_the_wavefront():
    k = KernelBuilder("far", (64,))
    x = k.buffer("x", U32, "rw")
    x[k.thread_id()] = k.shuffle_xor(x[k.thread_id()], 32)
    kernel = k.build()
    assert "^ 32)" in render_opencl(kernel, 64)
    with pytest.raises(ValueError, match="mask 32 outside a wavefront of 32"):
        render_opencl(kernel, 32)


def test_compile_error_carries_comgr_log():
    k = KernelBuilder("keyword_param", (64,))
    x = k.buffer("global", F32, "w")                # an OpenCL keyword: clang rejects the source
    x[k.thread_id()] = 1.0
    with pytest.raises(DriverError) as caught:
        build_code_object(k.build(), "gfx90a", 64)
    error = caught.value
    assert error.library == "libamd_comgr" and "COMPILE_SOURCE_WITH_DEVICE_LIBS_TO_BC" in error.call
    assert re.search(r"keyword_param\.cl:\d+:\d+: error:", error.text)


def test_isa_names():
    assert full_isa_name("gfx90a") == "amdgcn-amd-amdhsa--gfx90a"
    full = "amdgcn-amd-amdhsa--gfx90a:sramecc+:xnack-"
    assert full_isa_name(full) == full
    assert [isa_family(n) for n in (full, "gfx908", "gfx1030", "gfx1100", "gfx942")] == \
        ["9", "9", "10", "11", "9"]
    # The agent's target ID, features included, is what the device passes.
    assert build_code_object(ops.gather_rows(), full, 64).isa == full


def test_known_isas(installed_comgr):
    for isa in ("gfx908", "gfx90a", "gfx1030"):
        assert full_isa_name(isa) in installed_comgr
