"""Thin cffi binding of the NVIDIA driver API, libcuda.so.1 (declarations, loader, errors).

What it is: the part of cuda.h that poot uses (devices, primary contexts, memory, PTX modules,
launches, streams, events, stream capture into graphs, peer access), declared for cffi's ABI mode
under the `_v2` symbol names wherever cuda.h #defines the plain name to one, and `Driver`, whose
methods are one driver call each with the out-parameters returned. Every non-zero CUresult becomes
a `DriverError` carrying the driver's own name and text (cuGetErrorName / cuGetErrorString); a PTX
module that fails to load adds the JIT compiler's error log. What it is not: device choice,
caching, retries or allocation plans — that is poot/backends/ptx.py.

Device pointers are ints (CUdeviceptr); handles (contexts, modules, streams, ...) are cdata; a
stream of None is the legacy default stream. Host memory is a buffer (a numpy array, bytes), a
cdata pointer (pinned memory from `mem_alloc_host`) or an int address.
"""

import ctypes

import cffi

from drivers import DriverError, address, held_functions, load_library

LIBRARY = "libcuda"
CANDIDATES = ("libcuda.so.1", "libcuda.so", "/usr/local/nvidia/lib64/libcuda.so.1",
              "/usr/lib/x86_64-linux-gnu/libcuda.so.1")
ENV_VAR = "POOT_CUDA_LIB"

ffi = cffi.FFI()
ffi.cdef("""
typedef int CUresult;                 /* enum cudaError_enum: names come from cuGetErrorName */
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;

typedef enum CUdevice_attribute_enum {
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK = 8,
    CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10,
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
    CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE = 36,
    CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37,
    CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38,
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR = 39,
    CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81,
    CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR = 82,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97,
    CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK = 111,
} CUdevice_attribute;

typedef enum CUjit_option_enum {
    CU_JIT_INFO_LOG_BUFFER = 3,
    CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES = 4,
    CU_JIT_ERROR_LOG_BUFFER = 5,
    CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6,
    CU_JIT_LOG_VERBOSE = 12,
} CUjit_option;

typedef enum CUfunction_attribute_enum {
    CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0,
    CU_FUNC_ATTRIBUTE_NUM_REGS = 4,
    CU_FUNC_ATTRIBUTE_PTX_VERSION = 5,
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8,
} CUfunction_attribute;

typedef enum CUstream_flags_enum {
    CU_STREAM_DEFAULT = 0x0,
    CU_STREAM_NON_BLOCKING = 0x1,
} CUstream_flags;

typedef enum CUevent_flags_enum {
    CU_EVENT_DEFAULT = 0x0,
    CU_EVENT_BLOCKING_SYNC = 0x1,
    CU_EVENT_DISABLE_TIMING = 0x2,
    CU_EVENT_INTERPROCESS = 0x4,
} CUevent_flags;

typedef enum CUstreamCaptureMode_enum {
    CU_STREAM_CAPTURE_MODE_GLOBAL = 0,
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1,
    CU_STREAM_CAPTURE_MODE_RELAXED = 2,
} CUstreamCaptureMode;

typedef enum CUgraphInstantiate_flags_enum {
    CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH = 1,
    CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD = 2,
    CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH = 4,
    CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY = 8,
} CUgraphInstantiate_flags;

CUresult cuGetErrorName(CUresult error, const char **pStr);
CUresult cuGetErrorString(CUresult error, const char **pStr);
CUresult cuInit(unsigned int Flags);
CUresult cuDriverGetVersion(int *driverVersion);

CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDeviceGetCount(int *count);
CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev);
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev);

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxGetCurrent(CUcontext *pctx);
CUresult cuCtxSynchronize(void);
CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags);

CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemAllocHost_v2(void **pp, size_t bytesize);
CUresult cuMemFreeHost(void *p);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);
CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                              CUstream hStream);
CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                              CUstream hStream);
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                              CUstream hStream);
CUresult cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                           CUcontext srcContext, size_t ByteCount, CUstream hStream);
CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N);
CUresult cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int ui, size_t N);
CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream);
CUresult cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream);

CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                            CUjit_option *options, void **optionValues);
CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name);
CUresult cuModuleUnload(CUmodule hmod);
CUresult cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc);
CUresult cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value);
CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra);

/* cuLaunchKernelEx's configuration: only the attribute poot sets is named in the value union
   (64 bytes in cuda.h; the attribute's 4 padding bytes put the value at offset 8). */
typedef enum CUlaunchAttributeID_enum {
    CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
} CUlaunchAttributeID;
typedef union CUlaunchAttributeValue_union {
    char pad[64];
    int programmaticStreamSerializationAllowed;
} CUlaunchAttributeValue;
typedef struct CUlaunchAttribute_st {
    CUlaunchAttributeID id;
    char pad[4];
    CUlaunchAttributeValue value;
} CUlaunchAttribute;
typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;
CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra);

/* Tensor maps (sm_90): the opaque CUtensorMap and the enums cuTensorMapEncodeTiled takes, with
   the values poot passes named. */
typedef struct CUtensorMap_st { unsigned long long opaque[16]; } CUtensorMap;
typedef enum CUtensorMapDataType_enum { CU_TENSOR_MAP_DATA_TYPE_UINT16 = 1 } CUtensorMapDataType;
typedef enum CUtensorMapInterleave_enum {
    CU_TENSOR_MAP_INTERLEAVE_NONE = 0
} CUtensorMapInterleave;
typedef enum CUtensorMapSwizzle_enum { CU_TENSOR_MAP_SWIZZLE_128B = 3 } CUtensorMapSwizzle;
typedef enum CUtensorMapL2promotion_enum {
    CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3
} CUtensorMapL2promotion;
typedef enum CUtensorMapFloatOOBfill_enum {
    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0
} CUtensorMapFloatOOBfill;
CUresult cuTensorMapEncodeTiled(CUtensorMap *tensorMap, CUtensorMapDataType tensorDataType,
                                unsigned int tensorRank, void *globalAddress,
                                const unsigned long long *globalDim,
                                const unsigned long long *globalStrides,
                                const unsigned int *boxDim, const unsigned int *elementStrides,
                                CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                CUtensorMapL2promotion l2Promotion,
                                CUtensorMapFloatOOBfill oobFill);

CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags);
CUresult cuStreamDestroy_v2(CUstream hStream);
CUresult cuStreamSynchronize(CUstream hStream);
CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags);
CUresult cuEventRecord(CUevent hEvent, CUstream hStream);
CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags);
CUresult cuEventSynchronize(CUevent hEvent);
CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd);
CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd);
CUresult cuEventDestroy_v2(CUevent hEvent);

CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode);
CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                     unsigned long long flags);
CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream);
CUresult cuGraphExecDestroy(CUgraphExec hGraphExec);
CUresult cuGraphDestroy(CUgraph hGraph);
""")

# The declared enums' names, as module constants (CU_DEVICE_ATTRIBUTE_WARP_SIZE, ...).
for _enum in ("CUdevice_attribute", "CUjit_option", "CUfunction_attribute", "CUstream_flags",
              "CUevent_flags", "CUstreamCaptureMode", "CUgraphInstantiate_flags",
              "CUlaunchAttributeID", "CUtensorMapDataType", "CUtensorMapInterleave",
              "CUtensorMapSwizzle", "CUtensorMapL2promotion", "CUtensorMapFloatOOBfill"):
    globals().update(ffi.typeof(_enum).relements)


_P, _U = ctypes.c_void_p, ctypes.c_uint
# The launches, for drivers.held_functions: a step makes hundreds. A launch returns once it is
# queued; it would wait only on a full queue (about a thousand launches), which a runner a step
# or two ahead of the device does not fill.
LAUNCHES = {
    "cuLaunchKernel": (ctypes.c_int, _P, *[_U] * 7, _P, _P, _P),
    "cuLaunchKernelEx": (ctypes.c_int, _P, _P, _P, _P),
}


class KernelParams:
    """cuLaunchKernel's `void **kernelParams`, built from (C type, value) pairs.

    Each value is stored as the C type named, in the order of the kernel's parameters:
    KernelParams(("CUdeviceptr", y), ("float", 2.0), ("uint32_t", n)). The object keeps the
    values alive; `array` is what the driver reads.
    """

    def __init__(self, *typed_values):
        self.values = [ffi.new(ctype + " *", value) for ctype, value in typed_values]
        self.array = ffi.new("void *[]", self.values) if self.values else ffi.NULL


def _host(pointer):
    if isinstance(pointer, int):
        return ffi.cast("void *", pointer)
    if isinstance(pointer, ffi.CData):
        return pointer
    return ffi.from_buffer(pointer)


def _stream(stream):
    return ffi.NULL if stream is None else stream


def _dim3(dims):
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    return dims + (1,) * (3 - len(dims))


class Driver:
    """libcuda, opened: one method per driver call, out-parameters returned."""

    def __init__(self):
        self.lib, self.path = load_library(ffi, LIBRARY, CANDIDATES, ENV_VAR)
        # cuda.h 12.8+ #defines cuEventElapsedTime to _v2; older drivers have only the first.
        try:
            self._event_elapsed_time = self.lib.cuEventElapsedTime_v2
        except AttributeError:
            self._event_elapsed_time = self.lib.cuEventElapsedTime
        self._held = held_functions(ffi, self.lib, LAUNCHES)

    def _check(self, call, result, log=""):
        if result == 0:
            return
        name, text = self.error_name(result), self.error_string(result)
        raise DriverError(LIBRARY, call, result, name, f"{text}; JIT log: {log}" if log else text)

    def _out(self, ctype, call, *args, label=None):
        """Driver call `call` with a new `ctype` out-parameter before `args`, checked (an
        error names `label`, else the call); the value it wrote."""
        value = ffi.new(ctype + " *")
        self._check(label or call, getattr(self.lib, call)(value, *args))
        return value[0]

    def error_name(self, result):
        string = ffi.new("const char **")
        if self.lib.cuGetErrorName(result, string) != 0 or not string[0]:
            return f"CUresult {result}"
        return ffi.string(string[0]).decode()

    def error_string(self, result):
        string = ffi.new("const char **")
        if self.lib.cuGetErrorString(result, string) != 0 or not string[0]:
            return "unknown error"
        return ffi.string(string[0]).decode()

    def init(self, flags=0):
        self._check("cuInit", self.lib.cuInit(flags))

    def driver_get_version(self):
        return self._out("int", "cuDriverGetVersion")

    # Devices.
    def device_get_count(self):
        return self._out("int", "cuDeviceGetCount")

    def device_get(self, ordinal):
        return self._out("CUdevice", "cuDeviceGet", ordinal)

    def device_get_name(self, device):
        name = ffi.new("char[256]")
        self._check("cuDeviceGetName", self.lib.cuDeviceGetName(name, len(name), device))
        return ffi.string(name).decode()

    def device_get_attribute(self, attribute, device):
        return self._out("int", "cuDeviceGetAttribute", attribute, device,
                         label=f"cuDeviceGetAttribute({attribute})")

    def device_total_mem(self, device):
        return self._out("size_t", "cuDeviceTotalMem_v2", device)

    def device_can_access_peer(self, device, peer):
        can = ffi.new("int *")
        self._check("cuDeviceCanAccessPeer", self.lib.cuDeviceCanAccessPeer(can, device, peer))
        return bool(can[0])

    # Contexts.
    def device_primary_ctx_retain(self, device):
        return self._out("CUcontext", "cuDevicePrimaryCtxRetain", device)

    def device_primary_ctx_release(self, device):
        self._check("cuDevicePrimaryCtxRelease_v2", self.lib.cuDevicePrimaryCtxRelease_v2(device))

    def ctx_set_current(self, context):
        self._check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(context))

    def ctx_get_current(self):
        return self._out("CUcontext", "cuCtxGetCurrent")

    def ctx_synchronize(self):
        self._check("cuCtxSynchronize", self.lib.cuCtxSynchronize())

    def ctx_enable_peer_access(self, peer_context, flags=0):
        self._check("cuCtxEnablePeerAccess", self.lib.cuCtxEnablePeerAccess(peer_context, flags))

    # Memory.
    def mem_get_info(self):
        """(free, total) bytes of the current context's device."""
        free, total = ffi.new("size_t *"), ffi.new("size_t *")
        self._check("cuMemGetInfo_v2", self.lib.cuMemGetInfo_v2(free, total))
        return free[0], total[0]

    def mem_alloc(self, size):
        return self._out("CUdeviceptr", "cuMemAlloc_v2", size)

    def mem_free(self, pointer):
        self._check("cuMemFree_v2", self.lib.cuMemFree_v2(pointer))

    def mem_alloc_host(self, size):
        """Page-locked host memory: a void * cdata (see `ffi.buffer` to view it)."""
        pointer = ffi.new("void **")
        self._check("cuMemAllocHost_v2", self.lib.cuMemAllocHost_v2(pointer, size))
        return pointer[0]

    def mem_free_host(self, pointer):
        self._check("cuMemFreeHost", self.lib.cuMemFreeHost(pointer))

    def memcpy_htod(self, dst, src, size):
        self._check("cuMemcpyHtoD_v2", self.lib.cuMemcpyHtoD_v2(dst, _host(src), size))

    def memcpy_dtoh(self, dst, src, size):
        self._check("cuMemcpyDtoH_v2", self.lib.cuMemcpyDtoH_v2(_host(dst), src, size))

    def memcpy_dtod(self, dst, src, size):
        self._check("cuMemcpyDtoD_v2", self.lib.cuMemcpyDtoD_v2(dst, src, size))

    def memcpy_htod_async(self, dst, src, size, stream=None):
        self._check("cuMemcpyHtoDAsync_v2",
                    self.lib.cuMemcpyHtoDAsync_v2(dst, _host(src), size, _stream(stream)))

    def memcpy_dtoh_async(self, dst, src, size, stream=None):
        self._check("cuMemcpyDtoHAsync_v2",
                    self.lib.cuMemcpyDtoHAsync_v2(_host(dst), src, size, _stream(stream)))

    def memcpy_dtod_async(self, dst, src, size, stream=None):
        self._check("cuMemcpyDtoDAsync_v2",
                    self.lib.cuMemcpyDtoDAsync_v2(dst, src, size, _stream(stream)))

    def memcpy_peer_async(self, dst, dst_context, src, src_context, size, stream=None):
        self._check("cuMemcpyPeerAsync",
                    self.lib.cuMemcpyPeerAsync(dst, dst_context, src, src_context, size,
                                               _stream(stream)))

    def memset_d8(self, dst, value, count):
        self._check("cuMemsetD8_v2", self.lib.cuMemsetD8_v2(dst, value, count))

    def memset_d32(self, dst, value, count):
        self._check("cuMemsetD32_v2", self.lib.cuMemsetD32_v2(dst, value, count))

    def memset_d8_async(self, dst, value, count, stream=None):
        self._check("cuMemsetD8Async", self.lib.cuMemsetD8Async(dst, value, count, _stream(stream)))

    def memset_d32_async(self, dst, value, count, stream=None):
        self._check("cuMemsetD32Async",
                    self.lib.cuMemsetD32Async(dst, value, count, _stream(stream)))

    # Modules and kernels.
    def module_load_data(self, image, log_size=1 << 16, verbose=False):
        """cuModuleLoadDataEx with the JIT's logs captured; return (module, info log).

        `image` is PTX text (str or bytes) or a cubin. When loading fails, the DriverError's
        text ends with the JIT error log, which names the offending PTX line.
        """
        image = image.encode() if isinstance(image, str) else bytes(image)
        info_log, error_log = ffi.new("char[]", log_size), ffi.new("char[]", log_size)
        options = [(CU_JIT_INFO_LOG_BUFFER, info_log),
                   (CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES, ffi.cast("void *", log_size)),
                   (CU_JIT_ERROR_LOG_BUFFER, error_log),
                   (CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, ffi.cast("void *", log_size)),
                   (CU_JIT_LOG_VERBOSE, ffi.cast("void *", int(verbose)))]
        keys = ffi.new("CUjit_option[]", [key for key, _ in options])
        values = ffi.new("void *[]", [value for _, value in options])
        module = ffi.new("CUmodule *")
        result = self.lib.cuModuleLoadDataEx(module, ffi.new("char[]", image), len(options),
                                             keys, values)
        self._check("cuModuleLoadDataEx", result, ffi.string(error_log).decode(errors="replace"))
        return module[0], ffi.string(info_log).decode(errors="replace")

    def module_get_function(self, module, name):
        return self._out("CUfunction", "cuModuleGetFunction", module, name.encode(),
                         label=f"cuModuleGetFunction({name!r})")

    def module_unload(self, module):
        self._check("cuModuleUnload", self.lib.cuModuleUnload(module))

    def func_get_attribute(self, attribute, function):
        return self._out("int", "cuFuncGetAttribute", attribute, function,
                         label=f"cuFuncGetAttribute({attribute})")

    def func_set_attribute(self, function, attribute, value):
        self._check(f"cuFuncSetAttribute({attribute})",
                    self.lib.cuFuncSetAttribute(function, attribute, value))

    def launch_kernel(self, function, grid, block, params, shared_bytes=0, stream=None):
        """Launch `function` over grid x block (ints or up-to-3 tuples) with KernelParams."""
        (gx, gy, gz), (bx, by, bz) = _dim3(grid), _dim3(block)
        self._check("cuLaunchKernel", self._held.cuLaunchKernel(
            address(ffi, function), gx, gy, gz, bx, by, bz, shared_bytes,
            address(ffi, _stream(stream)), address(ffi, params.array), None))

    def launch_kernel_programmatic(self, function, grid, block, params, shared_bytes=0,
                                   stream=None):
        """launch_kernel, allowed to start before the previous kernel of the stream completes
        (programmatic stream serialisation, sm_90+): the kernel's `griddepcontrol.wait` is
        where it waits for that kernel's results."""
        attribute = ffi.new("CUlaunchAttribute *")
        attribute.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        config = ffi.new("CUlaunchConfig *")
        (config.gridDimX, config.gridDimY, config.gridDimZ) = _dim3(grid)
        (config.blockDimX, config.blockDimY, config.blockDimZ) = _dim3(block)
        config.sharedMemBytes = shared_bytes
        config.hStream = _stream(stream)
        config.attrs, config.numAttrs = attribute, 1
        self._check("cuLaunchKernelEx", self._held.cuLaunchKernelEx(
            address(ffi, config), address(ffi, function), address(ffi, params.array), None))

    def tensor_map_encode_tiled(self, data_type, address, dims, strides, box, swizzle,
                                l2_promotion):
        """A CUtensorMap (16 u64 words, a launch parameter as they are) of the tiled tensor at
        device `address`: `dims` elements innermost first, `strides` bytes between the rows of
        each dimension past the first, read in boxes of `box`; no interleave, zeros past the
        tensor."""
        rank = len(dims)
        room = ffi.new("char[]", 128 + 64)          # the map is aligned to 64 bytes in cuda.h
        start = int(ffi.cast("uintptr_t", room))
        tensor_map = ffi.cast("CUtensorMap *", start + -start % 64)
        self._check("cuTensorMapEncodeTiled", self.lib.cuTensorMapEncodeTiled(
            tensor_map, data_type, rank, ffi.cast("void *", address),
            ffi.new("unsigned long long[]", list(dims)),
            ffi.new("unsigned long long[]", list(strides)),
            ffi.new("unsigned int[]", list(box)), ffi.new("unsigned int[]", [1] * rank),
            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, l2_promotion,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
        return tuple(tensor_map.opaque)

    # Streams and events.
    def stream_create(self, flags=CU_STREAM_DEFAULT):
        return self._out("CUstream", "cuStreamCreate", flags)

    def stream_destroy(self, stream):
        self._check("cuStreamDestroy_v2", self.lib.cuStreamDestroy_v2(stream))

    def stream_synchronize(self, stream=None):
        self._check("cuStreamSynchronize", self.lib.cuStreamSynchronize(_stream(stream)))

    def event_create(self, flags=CU_EVENT_DEFAULT):
        return self._out("CUevent", "cuEventCreate", flags)

    def event_record(self, event, stream=None):
        self._check("cuEventRecord", self.lib.cuEventRecord(event, _stream(stream)))

    def stream_wait_event(self, stream, event):
        """Later work on `stream` waits for the work `event` last recorded (any device's)."""
        self._check("cuStreamWaitEvent", self.lib.cuStreamWaitEvent(_stream(stream), event, 0))

    def event_synchronize(self, event):
        self._check("cuEventSynchronize", self.lib.cuEventSynchronize(event))

    def event_elapsed_time(self, start, end):
        """Milliseconds between two recorded events."""
        milliseconds = ffi.new("float *")
        self._check("cuEventElapsedTime", self._event_elapsed_time(milliseconds, start, end))
        return milliseconds[0]

    def event_destroy(self, event):
        self._check("cuEventDestroy_v2", self.lib.cuEventDestroy_v2(event))

    # Stream capture and graphs.
    def stream_begin_capture(self, stream, mode=CU_STREAM_CAPTURE_MODE_GLOBAL):
        self._check("cuStreamBeginCapture_v2", self.lib.cuStreamBeginCapture_v2(stream, mode))

    def stream_end_capture(self, stream):
        graph = ffi.new("CUgraph *")
        self._check("cuStreamEndCapture", self.lib.cuStreamEndCapture(stream, graph))
        return graph[0]

    def graph_instantiate(self, graph, flags=0):
        return self._out("CUgraphExec", "cuGraphInstantiateWithFlags", graph, flags)

    def graph_launch(self, executable, stream=None):
        self._check("cuGraphLaunch", self.lib.cuGraphLaunch(executable, _stream(stream)))

    def graph_exec_destroy(self, executable):
        self._check("cuGraphExecDestroy", self.lib.cuGraphExecDestroy(executable))

    def graph_destroy(self, graph):
        self._check("cuGraphDestroy", self.lib.cuGraphDestroy(graph))
