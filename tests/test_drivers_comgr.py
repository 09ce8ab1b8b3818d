"""drivers/comgr.py against the real libamd_comgr: OpenCL C and AMDGCN assembly to code objects.

`build_opencl` and `kernel_metadata` are the calling pattern poot/codegen follows; the HSA tests
import them to build the kernel they dispatch.
"""

import pytest

from drivers import DriverError, LibraryNotFound, comgr

# No opencl-c.h is reachable without a clang resource directory, so the source declares the
# builtins it uses; `overloadable` gives them the mangled names the device libraries define.
AFFINE_CL = """
typedef unsigned int uint;
typedef __SIZE_TYPE__ size_t;
size_t __attribute__((overloadable)) get_global_id(uint dim);
size_t __attribute__((overloadable)) get_local_id(uint dim);
void __attribute__((overloadable)) barrier(uint flags);

__kernel void affine(__global float *y, __global const float *x, float a, float b, uint n) {
    __local float tile[64];
    size_t i = get_global_id(0);
    tile[get_local_id(0)] = i < n ? x[i] : 0.0f;
    barrier(1);
    if (i < n) y[i] = a * tile[get_local_id(0)] + b;
}
"""
AFFINE_LDS_BYTES = 64 * 4
# (offset, size) of y, x, a, b, n
AFFINE_EXPLICIT_ARGS = [(0, 8), (8, 8), (16, 4), (20, 4), (24, 4)]

# One work-group writes `value` to out[local id]; the kernel descriptor and metadata by hand.
FILL_ASM = """
.amdgcn_target "amdgcn-amd-amdhsa--gfx90a"
.text
.globl fill
.p2align 8
.type fill,@function
fill:
    s_load_dwordx2 s[2:3], s[0:1], 0x0
    s_load_dword s4, s[0:1], 0x8
    v_lshlrev_b32 v0, 2, v0
    s_waitcnt lgkmcnt(0)
    v_mov_b32 v1, s4
    global_store_dword v0, v1, s[2:3]
    s_endpgm
.rodata
.p2align 6
.amdhsa_kernel fill
    .amdhsa_user_sgpr_kernarg_segment_ptr 1
    .amdhsa_group_segment_fixed_size 128
    .amdhsa_next_free_vgpr 2
    .amdhsa_next_free_sgpr 5
    .amdhsa_accum_offset 4
.end_amdhsa_kernel
.amdgpu_metadata
---
amdhsa.version: [ 1, 1 ]
amdhsa.kernels:
  - .name: fill
    .symbol: fill.kd
    .kernarg_segment_size: 12
    .kernarg_segment_align: 8
    .group_segment_fixed_size: 128
    .private_segment_fixed_size: 0
    .wavefront_size: 64
    .sgpr_count: 5
    .vgpr_count: 2
    .max_flat_workgroup_size: 256
    .args:
      - { .size: 8, .offset: 0, .value_kind: global_buffer, .address_space: global }
      - { .size: 4, .offset: 8, .value_kind: by_value }
.end_amdgpu_metadata
"""


@pytest.fixture(scope="module")
def cg():
    try:
        return comgr.Comgr()
    except LibraryNotFound as error:
        pytest.skip(f"libamd_comgr not found (tried {', '.join(path for path, _ in error.tried)})")


def _source_set(cg, name, text):
    data_set = cg.create_data_set()
    data = cg.create_data(comgr.AMD_COMGR_DATA_KIND_SOURCE)
    cg.set_data(data, text)
    cg.set_data_name(data, name)
    assert cg.get_data_kind(data) == comgr.AMD_COMGR_DATA_KIND_SOURCE
    assert cg.get_data_name(data) == name
    cg.data_set_add(data_set, data)
    cg.release_data(data)  # the set holds its own reference
    return data_set


def _run(cg, steps, info, data_set):
    """Run actions in sequence, each one's result feeding the next; return the last result set."""
    for action in steps:
        result = cg.create_data_set()
        try:
            cg.do_action(action, info, data_set, result)
        except DriverError:
            cg.destroy_data_set(result)
            raise
        finally:
            cg.destroy_data_set(data_set)
        data_set = result
    return data_set


def _executable_bytes(cg, data_set):
    try:
        assert cg.action_data_count(data_set, comgr.AMD_COMGR_DATA_KIND_EXECUTABLE) == 1
        data = cg.action_data_get_data(data_set, comgr.AMD_COMGR_DATA_KIND_EXECUTABLE, 0)
        try:
            return cg.get_data(data)
        finally:
            cg.release_data(data)
    finally:
        cg.destroy_data_set(data_set)


def _action_info(cg, isa, language=None, options=()):
    info = cg.create_action_info()
    cg.action_info_set_isa_name(info, f"amdgcn-amd-amdhsa--{isa}")
    if language:
        cg.action_info_set_language(info, language)
    cg.action_info_set_option_list(info, list(options))
    cg.action_info_set_logging(info, True)
    return info


def build_opencl(cg, isa, source, name="kernel.cl"):
    """OpenCL C -> bitcode with the device libraries -> linked -> relocatable -> executable."""
    info = _action_info(cg, isa, "OPENCL_1_2", ["-O3"])
    try:
        steps = ["COMPILE_SOURCE_WITH_DEVICE_LIBS_TO_BC", "LINK_BC_TO_BC",
                 "CODEGEN_BC_TO_RELOCATABLE", "LINK_RELOCATABLE_TO_EXECUTABLE"]
        return _executable_bytes(cg, _run(cg, steps, info, _source_set(cg, name, source)))
    finally:
        cg.destroy_action_info(info)


def assemble(cg, isa, source, name="kernel.s"):
    """AMDGCN assembly -> relocatable -> executable."""
    info = _action_info(cg, isa)
    try:
        steps = ["ASSEMBLE_SOURCE_TO_RELOCATABLE", "LINK_RELOCATABLE_TO_EXECUTABLE"]
        return _executable_bytes(cg, _run(cg, steps, info, _source_set(cg, name, source)))
    finally:
        cg.destroy_action_info(info)


def kernel_metadata(cg, executable):
    """Each kernel's symbol, sizes and arguments, read from the code object's metadata."""
    data = cg.create_data(comgr.AMD_COMGR_DATA_KIND_EXECUTABLE)
    cg.set_data(data, executable)
    nodes = [cg.get_data_metadata(data)]

    def lookup(node, key):
        nodes.append(cg.metadata_lookup(node, key))
        return nodes[-1]

    def item(node, index):
        nodes.append(cg.index_list_metadata(node, index))
        return nodes[-1]

    try:
        kernels_node = lookup(nodes[0], "amdhsa.kernels")
        assert cg.get_metadata_kind(kernels_node) == comgr.AMD_COMGR_METADATA_KIND_LIST
        kernels = []
        for index in range(cg.get_metadata_list_size(kernels_node)):
            node = item(kernels_node, index)
            assert cg.get_metadata_kind(node) == comgr.AMD_COMGR_METADATA_KIND_MAP
            assert cg.get_metadata_map_size(node) > 5
            kernel = {key: cg.get_metadata_string(lookup(node, key))
                      for key in (".name", ".symbol", ".kernarg_segment_size",
                                  ".group_segment_fixed_size", ".private_segment_fixed_size")}
            args_node = lookup(node, ".args")
            kernel[".args"] = [
                {key: cg.get_metadata_string(lookup(item(args_node, arg), key))
                 for key in (".offset", ".size", ".value_kind")}
                for arg in range(cg.get_metadata_list_size(args_node))]
            kernels.append(kernel)
        return kernels
    finally:
        for node in reversed(nodes):
            cg.destroy_metadata(node)
        cg.release_data(data)


def test_missing_library_names_the_path(monkeypatch):
    monkeypatch.setenv(comgr.ENV_VAR, "/nonexistent/libamd_comgr.so")
    with pytest.raises(LibraryNotFound) as caught:
        comgr.Comgr()
    assert "/nonexistent/libamd_comgr.so" in str(caught.value)


def test_version_and_isas(cg):
    assert cg.version[0] in comgr.ACTIONS
    isas = cg.isa_names()
    for isa in ("gfx908", "gfx90a", "gfx1030"):
        assert f"amdgcn-amd-amdhsa--{isa}" in isas


def test_status_string(cg):
    assert cg.status_string(comgr.AMD_COMGR_STATUS_ERROR_INVALID_ARGUMENT) == "INVALID_ARGUMENT"


@pytest.mark.parametrize("isa", ["gfx908", "gfx90a", "gfx1030"])
def test_opencl_kernel_builds_with_expected_metadata(cg, isa):
    executable = build_opencl(cg, isa, AFFINE_CL, "affine.cl")
    assert executable[:4] == b"\x7fELF"
    [kernel] = kernel_metadata(cg, executable)
    assert kernel[".name"] == "affine"
    assert kernel[".symbol"] == "affine.kd"
    assert int(kernel[".group_segment_fixed_size"]) == AFFINE_LDS_BYTES
    assert int(kernel[".private_segment_fixed_size"]) == 0
    args = [(int(arg[".offset"]), int(arg[".size"])) for arg in kernel[".args"]]
    explicit = [arg for arg in kernel[".args"] if not arg[".value_kind"].startswith("hidden")]
    assert [(int(a[".offset"]), int(a[".size"])) for a in explicit] == AFFINE_EXPLICIT_ARGS
    # The segment holds every argument, the hidden ones OpenCL appends included, and no more.
    assert int(kernel[".kernarg_segment_size"]) == max(offset + size for offset, size in args)


def test_syntax_error_carries_the_compiler_log(cg):
    broken = "__kernel void k(__global float *y) {\n    y[0] = 1.0f\n}\n"
    with pytest.raises(DriverError) as caught:
        build_opencl(cg, "gfx90a", broken, "broken.cl")
    error = caught.value
    assert error.library == "libamd_comgr"
    assert error.name == "AMD_COMGR_STATUS_ERROR"
    assert "COMPILE_SOURCE_WITH_DEVICE_LIBS_TO_BC" in error.call
    assert "broken.cl:2:16: error: expected ';' after expression" in error.text


def test_assembly_kernel_assembles_and_links(cg):
    executable = assemble(cg, "gfx90a", FILL_ASM, "fill.s")
    [kernel] = kernel_metadata(cg, executable)
    assert kernel[".symbol"] == "fill.kd"
    assert int(kernel[".kernarg_segment_size"]) == 12
    assert int(kernel[".group_segment_fixed_size"]) == 128
    assert [arg[".value_kind"] for arg in kernel[".args"]] == ["global_buffer", "by_value"]


def test_bad_assembly_carries_the_assembler_log(cg):
    with pytest.raises(DriverError) as caught:
        assemble(cg, "gfx90a", FILL_ASM.replace("s_endpgm", "s_endpgm_bogus"), "bad.s")
    assert "bad.s" in caught.value.text and "s_endpgm_bogus" in str(caught.value)
