"""The CUDA Device: libcuda through drivers/cuda.py, kernels rendered to PTX by codegen/ptx.py.

Opens one device by ordinal on its primary context and one stream; buffers, PTX modules (cached
by kernel name), launches in stream order, and the driver's own memory figures. Nothing here
chooses a device or retries: a device that cannot open raises BackendUnavailable with the
driver's words.
"""
import threading
from dataclasses import dataclass

import numpy as np

from drivers import DriverError, LibraryNotFound
from drivers import cuda

from ..codegen.ptx import PTX_CAPS, render_ptx
from ..errors import BackendUnavailable, NoSuchDevice

SCALAR_CTYPES = {"i32": "int32_t", "u32": "uint32_t", "f32": "float"}
# cuda.h documents no rounding rule for cuMemAlloc; the driver maps device memory in 2 MiB pages
# (what cuMemGetAllocationGranularity reports for device memory on current GPUs), so the plan
# counts every buffer as whole pages: an upper bound, which the post-allocation check
# (engine/plan.py) compares with what cuMemGetInfo says was taken.
ALLOCATION_GRANULARITY = 2 << 20


@dataclass(frozen=True)
class DeviceBuffer:
    pointer: int
    nbytes: int


class PtxDevice:
    backend = "ptx"
    memory_source = "cuMemGetInfo"
    max_buffer = None           # one cuMemAlloc may take any amount the device has

    def __init__(self, ordinal=0):
        try:
            self.cu = cuda.Driver()
            self.cu.init()
            count = self.cu.device_get_count()
            if not 0 <= ordinal < count:
                error = NoSuchDevice if count else BackendUnavailable
                raise error(f"ptx: no CUDA device {ordinal} (the driver sees {count})")
            self.handle = self.cu.device_get(ordinal)
            self.context = self.cu.device_primary_ctx_retain(self.handle)
            self.cu.ctx_set_current(self.context)
            attr = lambda a: self.cu.device_get_attribute(a, self.handle)  # noqa: E731
            self.sm = (10 * attr(cuda.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
                       + attr(cuda.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
            self.subgroup_size = attr(cuda.CU_DEVICE_ATTRIBUTE_WARP_SIZE)
            self.multiprocessors = attr(cuda.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            self.name = f"{self.cu.device_get_name(self.handle)} (cuda:{ordinal}, sm_{self.sm})"
            self.stream = self.cu.stream_create()
        except LibraryNotFound as e:
            raise BackendUnavailable(f"ptx: the NVIDIA driver library is not installed: {e}") \
                from None
        except AttributeError as e:     # cffi: a symbol the library does not export
            raise BackendUnavailable(f"ptx: the library loaded as libcuda is not the NVIDIA "
                                     f"driver: {e}") from None
        except DriverError as e:
            raise BackendUnavailable(f"ptx: cannot open CUDA device {ordinal}: {e}") from None
        if self.sm < 80:
            raise BackendUnavailable(f"ptx: {self.name} is sm_{self.sm}; poot's PTX needs sm_80+")
        self._threads = threading.local()
        self._threads.current = True
        self.ordinal = ordinal
        self.caps = PTX_CAPS
        self.allocated = 0
        self._programs = {}
        self._timed = None

    def _current(self):
        """Makes the device's context current on the calling thread (the engine runs steps on a
        thread of its own; a CUDA context is current per thread)."""
        if not getattr(self._threads, "current", False):
            self.cu.ctx_set_current(self.context)
            self._threads.current = True

    def memory(self):
        """(free, total) bytes, from cuMemGetInfo."""
        self._current()
        return self.cu.mem_get_info()

    def allocation_bytes(self, nbytes):
        """The device memory one buffer of `nbytes` takes: whole 2 MiB pages."""
        return -(-max(int(nbytes), 1) // ALLOCATION_GRANULARITY) * ALLOCATION_GRANULARITY

    def alloc(self, nbytes):
        self._current()
        pointer = self.cu.mem_alloc(max(int(nbytes), 1))
        self.allocated += nbytes
        return DeviceBuffer(int(pointer), int(nbytes))

    def free(self, buffer):
        self._current()
        self.cu.mem_free(buffer.pointer)
        self.allocated -= buffer.nbytes

    def write(self, buffer, array, offset=0):
        self._current()
        data = np.ascontiguousarray(array)
        if offset + data.nbytes > buffer.nbytes:
            raise ValueError(f"write of {data.nbytes} bytes at {offset} into {buffer.nbytes}")
        self.cu.memcpy_htod_async(buffer.pointer + offset, data, data.nbytes, self.stream)

    def read(self, buffer, nbytes=None, offset=0):
        self._current()
        nbytes = buffer.nbytes if nbytes is None else nbytes
        out = bytearray(nbytes)
        self.cu.memcpy_dtoh_async(out, buffer.pointer + offset, nbytes, self.stream)
        self.cu.stream_synchronize(self.stream)
        return bytes(out)

    def copy(self, dst, src, nbytes):
        self._current()
        self.cu.memcpy_dtod_async(dst.pointer, src.pointer, nbytes, self.stream)

    def program(self, kernel):
        """The loaded function of a kernel (rendered, JIT-compiled by the driver, cached)."""
        self._current()
        function = self._programs.get(kernel.name)
        if function is None:
            module, _ = self.cu.module_load_data(render_ptx(kernel, self.sm))
            function = self.cu.module_get_function(module, kernel.name)
            self._programs[kernel.name] = function
        return function

    def launch(self, function, kernel, grid, args):
        """One launch in stream order; args follow kernel.params (buffers, then Python scalars)."""
        self._current()
        typed = []
        for param, arg in zip(kernel.params, args, strict=True):
            if param.kind == "buffer":
                typed.append(("CUdeviceptr", arg.pointer))
            else:
                typed.append((SCALAR_CTYPES[param.dtype.name], arg))
        params = cuda.KernelParams(*typed)
        if self._timed is None:
            self.cu.launch_kernel(function, grid, kernel.workgroup, params, 0, self.stream)
            return
        start, end = self.cu.event_create(), self.cu.event_create()
        self.cu.event_record(start, self.stream)
        self.cu.launch_kernel(function, grid, kernel.workgroup, params, 0, self.stream)
        self.cu.event_record(end, self.stream)
        self._timed.append((kernel.name, start, end))

    def start_timing(self):
        """Times every launch from now on with a pair of events (--device-timing)."""
        self._current()
        self._timed = []

    def stop_timing(self):
        """[(kernel name, seconds)] of the launches since start_timing, in launch order."""
        self._current()
        self.synchronize()
        out = []
        for name, start, end in self._timed:
            out.append((name, self.cu.event_elapsed_time(start, end) / 1e3))
            self.cu.event_destroy(start)
            self.cu.event_destroy(end)
        self._timed = None
        return out

    def synchronize(self):
        self._current()
        self.cu.stream_synchronize(self.stream)

    def capture(self, issue):
        """A CUDA graph of the launches `issue()` makes, to replay as one launch."""
        self._current()
        # thread-local: HTTP threads may still ask the driver things while the engine captures
        self.cu.stream_begin_capture(self.stream, cuda.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        try:
            issue()
        finally:
            graph = self.cu.stream_end_capture(self.stream)
        executable = self.cu.graph_instantiate(graph)
        self.cu.graph_destroy(graph)
        return executable

    def replay(self, executable):
        self._current()
        self.cu.graph_launch(executable, self.stream)
