"""The CUDA Device: libcuda through drivers/cuda.py, kernels rendered to PTX by codegen/ptx.py.

Opens one device by ordinal on its primary context and one stream; buffers, PTX modules (cached
by kernel name), launches in stream order, and the driver's own memory figures. Nothing here
chooses a device or retries: a device that cannot open raises BackendUnavailable with the
driver's words.

PtxGroup opens several devices in one process for a placement over them (engine/group.py):
peer access between every pair, peer copies on the streams, cross-device ordering by events
(never a host round trip), and one CUDA graph capturing a step over all of them.
"""
import copy
import threading
from dataclasses import dataclass

import numpy as np

from drivers import DriverError, LibraryNotFound
from drivers import cuda

from ..codegen.ptx import dynamic_shared_bytes, ptx_caps, render_ptx
from ..kernels.lang import BOX_COLS
from . import Device, DeviceGroup, workgroups
from ..errors import BackendUnavailable, NoSuchDevice, PlacementRefused

SCALAR_CTYPES = {"i32": "int32_t", "u32": "uint32_t", "f32": "float"}
# cuda.h documents no rounding rule for cuMemAlloc; the driver maps device memory in 2 MiB pages
# (what cuMemGetAllocationGranularity reports for device memory on current GPUs), so the plan
# counts every buffer as whole pages: an upper bound, which the post-allocation check
# (engine/plan.py) compares with what cuMemGetInfo says was taken.
ALLOCATION_GRANULARITY = 2 << 20
# Tensor maps encoded once and kept (a map is 128 bytes; a prefill's matmuls make a few per
# weight and token count).
TENSOR_MAPS_KEPT = 4096
_thread = threading.local()     # .context: the context current on this thread, as poot set it


@dataclass(frozen=True)
class DeviceBuffer:
    pointer: int
    nbytes: int


class PtxDevice(Device):
    backend = "ptx"
    features = frozenset({"capture", "timing", "staging", "views", "lanes", "marks"})
    memory_source = "cuMemGetInfo"
    max_buffer = None           # one cuMemAlloc may take any amount the device has
    # a device runner stages its steps' inputs and tokens in page-locked host_array memory,
    # copied inside the step's graph
    step_staging = True

    def __init__(self, ordinal=0):
        super().__init__()
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
        _thread.context = self.context
        self.ordinal = ordinal
        self.caps = ptx_caps(self.sm)
        self.target = f"PTX for sm_{self.sm}"
        # sm_90 kernels wait for their predecessor in the kernel (render_ptx), so they may be
        # launched before it completes
        self.programmatic = self.sm >= 90
        self.allocated = 0
        self._pinned = []           # host_array memory
        self._timed = None
        self._events = []           # marks' events, free to record again
        self._tensor_maps = {}      # (pointer, cols, rows, box rows) -> CUtensorMap words

    def lane(self):
        """The device with a stream of its own (a pipeline lane, engine/group.py): work issued
        to it runs beside the work of the device's other streams; the context, programs and
        page-locked memory are shared."""
        self._current()
        other = copy.copy(self)
        other.stream = self.cu.stream_create()
        other._events = []
        return other

    def _current(self):
        """Makes the device's context current on the calling thread (the engine runs steps on a
        thread of its own, a group drives several devices from one; a CUDA context is current
        per thread)."""
        if getattr(_thread, "context", None) != self.context:
            self.cu.ctx_set_current(self.context)
            _thread.context = self.context

    def memory(self):
        """(free, total) bytes, from cuMemGetInfo."""
        self._current()
        return self.cu.mem_get_info()

    def held(self):
        """(bytes of device memory held, where the figure comes from): total minus free by
        cuMemGetInfo, the driver's only figure (other processes' allocations show in it too)."""
        free, total = self.memory()
        return total - free, self.memory_source

    def allocation_bytes(self, nbytes):
        """The device memory one buffer of `nbytes` takes: whole 2 MiB pages."""
        return -(-max(int(nbytes), 1) // ALLOCATION_GRANULARITY) * ALLOCATION_GRANULARITY

    def alloc(self, nbytes):
        self._current()
        pointer = self.cu.mem_alloc(max(int(nbytes), 1))
        self.allocated += nbytes
        return DeviceBuffer(int(pointer), int(nbytes))

    def view(self, buffer, offset):
        """The part of a buffer from byte `offset` on (a pipeline micro-batch's rows)."""
        return DeviceBuffer(buffer.pointer + offset, buffer.nbytes - offset)

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

    def host_array(self, nbytes):
        """A uint8 array of `nbytes` of page-locked host memory, held while the process runs
        (a runner's, like its device buffers): write and download copy it asynchronously, also
        inside a captured graph (where pageable memory may not be copied), each replay reading
        or writing it anew."""
        self._current()
        pointer = self.cu.mem_alloc_host(max(int(nbytes), 1))
        self._pinned.append(pointer)
        return np.frombuffer(cuda.ffi.buffer(pointer, nbytes), np.uint8)

    def download(self, host, buffer, nbytes):
        """Copies nbytes of `buffer` into host array `host` (from host_array) in stream order;
        they are there after the next synchronize."""
        self._current()
        self.cu.memcpy_dtoh_async(host, buffer.pointer, nbytes, self.stream)

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

    def build(self, kernel):
        """The loaded function of a kernel (rendered, JIT-compiled by the driver)."""
        self._current()
        module, _ = self.cu.module_load_data(render_ptx(kernel, self.sm))
        function = self.cu.module_get_function(module, kernel.name)
        if dynamic_shared_bytes(kernel):        # past 48 KiB a function opts in
            self.cu.func_set_attribute(
                function, cuda.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                dynamic_shared_bytes(kernel))
        return function

    def launch(self, function, kernel, grid, args):
        """One launch in stream order; args follow kernel.params (buffers, then Python scalars),
        and the kernel's tensor maps are made from them."""
        grid = workgroups(kernel, grid)
        self._current()
        typed = []
        for param, arg in zip(kernel.params, args, strict=True):
            if param.kind == "buffer":
                typed.append(("CUdeviceptr", arg.pointer))
            else:
                typed.append((SCALAR_CTYPES[param.dtype.name], arg))
        if kernel.maps:
            named = {param.name: arg for param, arg in zip(kernel.params, args)}
            typed += [("CUtensorMap", {"opaque": self._tensor_map(m, named)})
                      for m in kernel.maps]
        params = cuda.KernelParams(*typed)
        shared = dynamic_shared_bytes(kernel)
        if self._timed is None:
            launch = (self.cu.launch_kernel_programmatic if self.programmatic
                      else self.cu.launch_kernel)
            launch(function, grid, kernel.workgroup, params, shared, self.stream)
            return
        start, end = self.cu.event_create(), self.cu.event_create()
        self.cu.event_record(start, self.stream)
        self.cu.launch_kernel(function, grid, kernel.workgroup, params, shared, self.stream)
        self.cu.event_record(end, self.stream)
        self._timed.append((kernel.name, start, end))

    def _tensor_map(self, tensor_map, named):
        """The CUtensorMap words of a kernel's TensorMap (lang.py) over this launch's buffer: 16-bit
        values, rows `cols` values apart, boxes of BOX_COLS x box_rows swizzled in 128 bytes."""
        buffer = named[tensor_map.buffer]
        cols, rows = named[tensor_map.cols], named[tensor_map.rows]
        key = (buffer.pointer, cols, rows, tensor_map.box_rows)
        words = self._tensor_maps.get(key)
        if words is None:
            if buffer.pointer % 16 or cols % 8:
                raise ValueError(f"tensor map {tensor_map.name}: the buffer at {buffer.pointer:#x} "
                                 f"and its rows of {cols} values must be 16-byte aligned")
            words = self.cu.tensor_map_encode_tiled(
                cuda.CU_TENSOR_MAP_DATA_TYPE_UINT16, buffer.pointer, (cols, rows), (2 * cols,),
                (BOX_COLS, tensor_map.box_rows), cuda.CU_TENSOR_MAP_SWIZZLE_128B,
                cuda.CU_TENSOR_MAP_L2_PROMOTION_L2_256B)
            if len(self._tensor_maps) >= TENSOR_MAPS_KEPT:
                self._tensor_maps.clear()
            self._tensor_maps[key] = words
        return words

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

    def mark(self):
        """An event recorded after the work issued to the stream so far (wait_mark waits for
        it, and then records it again for a later mark)."""
        self._current()
        event = self._events.pop() if self._events else \
            self.cu.event_create(cuda.CU_EVENT_DISABLE_TIMING)
        self.cu.event_record(event, self.stream)
        return event

    def wait_mark(self, mark):
        """Returns once the work issued before `mark` is done (later work may still run)."""
        self._current()
        self.cu.event_synchronize(mark)
        self._events.append(mark)

    def capture(self, issue):
        """A CUDA graph of the launches `issue()` makes, to replay as one launch."""
        self._current()
        # thread-local: HTTP threads may still ask the driver things while the engine captures
        self.cu.stream_begin_capture(self.stream, cuda.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        try:
            issue()
        except BaseException:
            end_capture_after_error(self)
            raise
        graph = self.cu.stream_end_capture(self.stream)
        executable = self.cu.graph_instantiate(graph)
        self.cu.graph_destroy(graph)
        return executable

    def replay(self, executable):
        self._current()
        self.cu.graph_launch(executable, self.stream)


def end_capture_after_error(device):
    """Ends a capture that an error broke, so the error raised is the first one, not the
    driver's word that the capture was invalidated by it."""
    device._current()
    try:
        device.cu.graph_destroy(device.cu.stream_end_capture(device.stream))
    except DriverError:
        pass


class PtxGroup(DeviceGroup):
    """CUDA devices of one placement, opened in one process: a context and a stream each, peer
    access enabled between every pair (refused at startup, with the driver's words, where two
    cannot reach each other), an event per device for ordering across them."""
    backend = "ptx"
    features = frozenset({"capture", "lanes"})

    def __init__(self, ordinals):
        self.devices = [PtxDevice(o) for o in ordinals]
        self.name = ", ".join(d.name for d in self.devices)
        for a in self.devices:
            for b in self.devices:
                if a is b:
                    continue
                if not a.cu.device_can_access_peer(a.handle, b.handle):
                    raise PlacementRefused(f"ptx: {a.name} cannot access the memory of {b.name} "
                                           "(cuDeviceCanAccessPeer: 0)")
                a._current()
                try:
                    a.cu.ctx_enable_peer_access(b.context)
                except DriverError as e:
                    if e.name != "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED":
                        raise PlacementRefused(f"ptx: peer access from {a.name} to {b.name}: "
                                               f"{e}") from None
        self.events = []
        for d in self.devices:
            d._current()
            self.events.append(d.cu.event_create(cuda.CU_EVENT_DISABLE_TIMING))

    def lane(self):
        """The group over lanes of its devices (PtxDevice.lane) with events of its own: a
        pipeline lane's steps run beside the other lanes' (engine/group.py)."""
        other = copy.copy(self)
        other.devices = [d.lane() for d in self.devices]
        other.events = []
        for d in other.devices:
            d._current()
            other.events.append(d.cu.event_create(cuda.CU_EVENT_DISABLE_TIMING))
        return other

    def signal(self, i):
        """Records device i's event after the work issued so far on its stream."""
        d = self.devices[i]
        d._current()
        d.cu.event_record(self.events[i], d.stream)

    def wait(self, i, j):
        """Device i's later work waits for what device j's event last recorded."""
        d = self.devices[i]
        d._current()
        d.cu.stream_wait_event(d.stream, self.events[j])

    def barrier(self):
        """No device goes on until every device has done the work issued to it so far."""
        ranks = range(len(self.devices))
        for i in ranks:
            self.signal(i)
        for i in ranks:
            for j in ranks:
                if i != j:
                    self.wait(i, j)

    def copy(self, i, dst, j, src, nbytes):
        """Copies nbytes from device j's `src` into device i's `dst`, on device i's stream."""
        d = self.devices[i]
        d._current()        # unified addressing: a device-to-device copy reaches the peer
        d.cu.memcpy_dtod_async(dst.pointer, src.pointer, nbytes, d.stream)

    def capture(self, issue):
        """One CUDA graph of the work `issue()` gives every device: captured from device 0's
        stream, the others joined in by events (fork) and back (join) before it ends."""
        lead = self.devices[0]
        lead._current()
        lead.cu.stream_begin_capture(lead.stream, cuda.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        try:
            self.signal(0)
            for i in range(1, len(self.devices)):
                self.wait(i, 0)
            issue()
            for i in range(1, len(self.devices)):
                self.signal(i)
                self.wait(0, i)
        except BaseException:
            end_capture_after_error(lead)
            raise
        lead._current()
        graph = lead.cu.stream_end_capture(lead.stream)
        executable = lead.cu.graph_instantiate(graph)
        lead.cu.graph_destroy(graph)
        return executable

    def replay(self, executable):
        """Launches a captured step on device 0's stream, after what every device's stream
        holds (the step's inputs), and before what they are given next."""
        for i in range(1, len(self.devices)):
            self.signal(i)
            self.wait(0, i)
        lead = self.devices[0]
        lead._current()
        lead.cu.graph_launch(executable, lead.stream)
        self.signal(0)
        for i in range(1, len(self.devices)):
            self.wait(i, 0)

    def synchronize(self):
        for d in self.devices:
            d.synchronize()
