"""The wgpu Device: wgpu-native (Vulkan underneath) through drivers/wgpu.py, running the SPIR-V
of codegen/spirv.py through wgpu's translator (naga).

Opens one Vulkan adapter by ordinal and requests a device with the adapter's own limits (the
immediates limit that carries push constants included) and the features poot's capabilities
stand for. Launches are encoded into one compute pass; the encoder is submitted before a queue
write (so the write lands after the launches issued before it), before a read, and at
synchronize. Every object that could be invalid is made inside error scopes, and an encoder is
finished inside one, so an error is raised here and never reaches wgpuQueueSubmit (where
wgpu-native aborts the process). Free memory and the subgroup size come from raw Vulkan on the
same physical device, since wgpu offers neither. wgpu command buffers are used once, so there
is no capture/replay: the runner launches every step.
"""
import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass, field
from itertools import count

import numpy as np

from drivers import DriverError, LibraryNotFound, address, held_functions, parse_types
from drivers import wgpu

from ..codegen.spirv import TARGET, binding_layout, render_spirv
from ..errors import BackendUnavailable, CapacityError, ModelRefused, NoSuchDevice
from . import Device, workgroups
from .vulkan_instance import BUDGET_EXTENSION, PhysicalDeviceView

ffi = wgpu.ffi
# The C types a step's launches and read-backs name (bind groups, command buffers, the map
# callback), parsed when the device opens (drivers.parse_types)
STEP_TYPES = ("WGPUBindGroupDescriptor", "WGPUBindGroupDescriptor *", "WGPUBindGroupEntry",
              "WGPUBindGroupEntry[]", "WGPUBufferMapCallback", "WGPUBufferMapCallbackInfo *",
              "WGPUCommandBuffer[]")


@dataclass(eq=False)
class DeviceBuffer:
    handle: object
    nbytes: int
    size: int                 # nbytes rounded up to whole 4-byte words, as wgpu copies them
    serial: int


@dataclass(eq=False)
class Program:
    name: str
    pipeline: object
    group_layout: object
    push_size: int
    pack: object              # scalars -> immediate (push-constant) bytes
    groups: dict = field(default_factory=dict)    # buffer serials -> bind group

    def __post_init__(self):  # the pipeline's address, as the held calls take it
        self.pipeline_at = address(ffi, self.pipeline)


@contextlib.contextmanager
def native_stderr(into):
    """Collects what native code writes to file descriptor 2 meanwhile into `into`. Listing
    adapters has libwayland complain there about XDG_RUNTIME_DIR on a headless host (wgpu
    probes presentation support), which would break the one-line messages of startup."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            into.append(" ".join(sink.read().decode("utf-8", "replace").split()))


class WgpuDevice(Device):
    backend = "wgpu"
    target = TARGET

    def __init__(self, ordinal=0):
        super().__init__()
        try:
            self.lib, _ = wgpu.load()
        except LibraryNotFound as e:
            raise BackendUnavailable(f"wgpu: wgpu-native is not installed (scripts/setup "
                                     f"installs it: pip install --no-deps '{wgpu.WHEEL}'): "
                                     f"{e}") from None
        except DriverError as e:
            raise BackendUnavailable(f"wgpu: {e}") from None
        lib = self.lib
        self._held = held_functions(ffi, lib, wgpu.RECORDED)
        self.instance = lib.wgpuCreateInstance(wgpu.chain(
            wgpu.new("WGPUInstanceDescriptor"),
            wgpu.new("WGPUInstanceExtras", backends=lib.WGPUInstanceBackend_Vulkan)))
        if self.instance == ffi.NULL:
            raise BackendUnavailable("wgpu: wgpuCreateInstance failed")
        options = wgpu.new("WGPUInstanceEnumerateAdapterOptions",
                           backends=lib.WGPUInstanceBackend_Vulkan)
        said = []
        with native_stderr(said):
            adapters = ffi.new("WGPUAdapter[]", lib.wgpuInstanceEnumerateAdapters(
                self.instance, options, ffi.NULL))
            lib.wgpuInstanceEnumerateAdapters(self.instance, options, adapters)
        if not 0 <= ordinal < len(adapters):
            if len(adapters):
                raise NoSuchDevice(f"wgpu: no Vulkan adapter {ordinal} (wgpu sees "
                                   f"{len(adapters)})")
            raise BackendUnavailable("wgpu: no Vulkan adapter (mesa-vulkan-drivers gives "
                                     "lavapipe)"
                                     + (f"; the driver said: {said[0]}" if said[0] else ""))
        self.adapter, self.ordinal = adapters[ordinal], ordinal
        try:
            described = [self._describe(adapter) for adapter in adapters]
            name, ids, subgroup_sizes, kind = described[ordinal]
            self.name = f"{name} (wgpu:{ordinal})"
            self.on_cpu = kind == lib.WGPUAdapterType_CPU     # lavapipe: no GPU underneath
            twins = sum(1 for _, other, _, _ in described[:ordinal] if other == ids)
            self._open(ids, twins, subgroup_sizes)
        except DriverError as e:
            raise BackendUnavailable(f"wgpu: cannot open adapter {ordinal}: {e}") from None
        finally:
            for i, other in enumerate(adapters):
                if i != ordinal:
                    lib.wgpuAdapterRelease(other)
        self.allocated = 0
        self._serials = count()
        self._groups_of = {}          # buffer serial -> programs holding a group that binds it
        self._encoder = self._pass = None
        self._readback = None
        parse_types(ffi, STEP_TYPES)

    def _describe(self, adapter):
        """(device name, (vendor id, device id), (min, max subgroup size), adapter type) of an
        adapter."""
        lib = self.lib
        info = wgpu.new("WGPUAdapterInfo")
        if lib.wgpuAdapterGetInfo(adapter, info) != lib.WGPUStatus_Success:
            raise DriverError("wgpu", "wgpuAdapterGetInfo", None, "failed", "no adapter info")
        try:
            return (wgpu.text(info.device), (info.vendorID, info.deviceID),
                    (info.subgroupMinSize, info.subgroupMaxSize), info.adapterType)
        finally:
            lib.wgpuAdapterInfoFreeMembers(info[0])

    def _open(self, ids, twins, subgroup_sizes):
        """The device, after what wgpu cannot say is read from Vulkan on the same physical
        device (the `twins`-th one with these PCI ids, as wgpu lists them in Vulkan's order):
        the free memory, and the subgroup size when wgpu reports a range, or 0 as on
        lavapipe."""
        lib, adapter = self.lib, self.adapter
        try:
            self._view, self._no_view = PhysicalDeviceView(*ids, twins), None
        except (DriverError, LookupError) as e:
            self._view, self._no_view = None, str(e)
        low, high = subgroup_sizes
        if low == high and low:
            self.subgroup_size = low
        else:
            self.subgroup_size = self._view.subgroup_size if self._view else 0

        def offered(feature):
            return bool(lib.wgpuAdapterHasFeature(adapter, feature))
        wanted = {"f16": lib.WGPUFeatureName_ShaderF16,
                  "immediates": lib.WGPUNativeFeature_Immediates,
                  "subgroup": lib.WGPUNativeFeature_Subgroup,
                  "int64": lib.WGPUNativeFeature_ShaderInt64}
        features = {name: f for name, f in wanted.items() if offered(f)}
        # naga rejects 8-bit storage and 16-bit integers (PLATFORM-NOTES): no storage8, int16;
        # storage16 is f16 buffers only (program() refuses 16-bit integer buffers).
        caps = {"shared"}
        if "f16" in features:
            caps |= {"float16", "storage16"}
        if "int64" in features:
            caps.add("int64")
        if "subgroup" in features and self.subgroup_size:
            caps |= {"subgroup", "subgroup_arith", "subgroup_shuffle"}
        self.caps = frozenset(caps)
        self.limits = wgpu.new("WGPULimits")
        if lib.wgpuAdapterGetLimits(adapter, self.limits) != lib.WGPUStatus_Success:
            raise DriverError("wgpu", "wgpuAdapterGetLimits", None, "failed", "no limits")
        self.errors = []              # errors outside any scope; raised at synchronize
        self._on_error = wgpu.uncaptured_error_callback(self.errors)
        required = list(features.values())
        self.device = wgpu.request_device(lib, self.instance, adapter, wgpu.new(
            "WGPUDeviceDescriptor", label="poot", requiredFeatureCount=len(required),
            requiredFeatures=ffi.new("WGPUFeatureName[]", required), requiredLimits=self.limits,
            uncapturedErrorCallbackInfo={"callback": self._on_error}))
        self.queue = lib.wgpuDeviceGetQueue(self.device)

    def _scope(self, call):
        return wgpu.error_scope(self.lib, self.instance, self.device, call)

    # -- memory --------------------------------------------------------------------------------
    @property
    def memory_source(self):
        if self._view is None:
            return "no budget (raw Vulkan does not show this device): --memory-limit needed"
        if BUDGET_EXTENSION not in self._view.extensions:
            return f"no budget (no {BUDGET_EXTENSION}): --memory-limit needed"
        return f"{BUDGET_EXTENSION} (through raw Vulkan)"

    @property
    def max_buffer(self):
        """The most bytes one buffer may hold: each is bound whole as one storage binding."""
        return min(self.limits.maxStorageBufferBindingSize, self.limits.maxBufferSize)

    def allocation_bytes(self, nbytes):
        """The bytes one buffer of `nbytes` asks wgpu for: whole 4-byte words, at least one.
        (wgpu sub-allocates its Vulkan memory in blocks of its own, which it does not show.)"""
        return max(-(-int(nbytes) // 4) * 4, 4)

    def held(self):
        """(bytes held, where the figure comes from): this device's count of its allocations.
        wgpu takes Vulkan memory in blocks of its own, which a budget would show but the plan
        cannot count."""
        return self.allocated, "the wgpu device's count of its allocations"

    def memory(self):
        """(free, total) bytes of the device-local heaps, from VK_EXT_memory_budget read
        through raw Vulkan on the same physical device."""
        if self._view is None:
            raise CapacityError(f"wgpu: {self.name}: no memory budget can be read (raw Vulkan "
                                f"does not show this device: {self._no_view}); --memory-limit "
                                "sets one")
        return self._view.budget(f"wgpu: {self.name}")

    def alloc(self, nbytes):
        """A storage buffer; one buffer is bounded by maxStorageBufferBindingSize (each is
        bound whole)."""
        nbytes = int(nbytes)
        limit = self.max_buffer
        if nbytes > limit:
            raise ModelRefused(f"wgpu: {self.name}: a buffer of {nbytes} bytes is over the "
                               f"adapter's limit for one storage binding ({limit} bytes)")
        lib, size = self.lib, self.allocation_bytes(nbytes)
        usage = lib.WGPUBufferUsage_Storage | lib.WGPUBufferUsage_CopySrc \
            | lib.WGPUBufferUsage_CopyDst
        try:
            with self._scope("wgpuDeviceCreateBuffer"):
                handle = lib.wgpuDeviceCreateBuffer(self.device, wgpu.new(
                    "WGPUBufferDescriptor", size=size, usage=usage))
        except DriverError as e:
            lib.wgpuBufferRelease(handle)
            raise CapacityError(f"wgpu: {self.name}: cannot allocate {nbytes} bytes: {e}") \
                from None
        self.allocated += size
        return DeviceBuffer(handle, nbytes, size, next(self._serials))

    def free(self, buffer):
        if self._encoder is not None:       # a destroyed buffer must not reach a submit
            self._submit()
        for program in self._groups_of.pop(buffer.serial, ()):
            for key in [k for k in program.groups if buffer.serial in k]:
                self.lib.wgpuBindGroupRelease(program.groups.pop(key))
        self.lib.wgpuBufferDestroy(buffer.handle)
        self.lib.wgpuBufferRelease(buffer.handle)
        self.allocated -= buffer.size

    # -- host <-> device -----------------------------------------------------------------------
    def write(self, buffer, array, offset=0):
        """Host -> device through the queue, after every launch issued before it."""
        data = np.ascontiguousarray(array)
        if offset + data.nbytes > buffer.nbytes:
            raise ValueError(f"write of {data.nbytes} bytes at {offset} into {buffer.nbytes}")
        if offset % 4 or data.nbytes % 4:
            raise ValueError(f"wgpu writes whole 4-byte words: {data.nbytes} bytes at {offset}")
        if self._encoder is not None:
            self._submit()
        self.lib.wgpuQueueWriteBuffer(self.queue, buffer.handle, offset,
                                      ffi.from_buffer(data), data.nbytes)

    def read(self, buffer, nbytes=None, offset=0):
        """Device -> host, after everything issued before it, through a mappable buffer."""
        nbytes = buffer.nbytes - offset if nbytes is None else nbytes
        if offset + nbytes > buffer.nbytes:
            raise ValueError(f"read of {nbytes} bytes at {offset} from {buffer.nbytes}")
        lib = self.lib
        start = offset // 4 * 4
        size = max(-(-(offset + nbytes) // 4) * 4 - start, 4)
        if self._readback is None or self._readback.size < size:
            if self._readback is not None:
                self.synchronize()
                lib.wgpuBufferDestroy(self._readback.handle)
                lib.wgpuBufferRelease(self._readback.handle)
            with self._scope("wgpuDeviceCreateBuffer"):
                handle = lib.wgpuDeviceCreateBuffer(self.device, wgpu.new(
                    "WGPUBufferDescriptor", size=size,
                    usage=lib.WGPUBufferUsage_MapRead | lib.WGPUBufferUsage_CopyDst))
            self._readback = DeviceBuffer(handle, size, size, -1)
        lib.wgpuCommandEncoderCopyBufferToBuffer(self._encoding(), buffer.handle, start,
                                                 self._readback.handle, 0, size)
        self._submit()
        wgpu.map_buffer(lib, self.instance, self.device, self._readback.handle,
                        lib.WGPUMapMode_Read, 0, size)
        try:
            mapped = lib.wgpuBufferGetConstMappedRange(self._readback.handle, 0, size)
            return ffi.buffer(mapped, size)[offset - start:offset - start + nbytes]
        finally:
            lib.wgpuBufferUnmap(self._readback.handle)

    def copy(self, dst, src, nbytes):
        if nbytes > min(dst.nbytes, src.nbytes) or nbytes % 4:
            raise ValueError(f"copy of {nbytes} bytes between {src.nbytes} and {dst.nbytes} "
                             "(wgpu copies whole 4-byte words)")
        self.lib.wgpuCommandEncoderCopyBufferToBuffer(self._encoding(), src.handle, 0,
                                                      dst.handle, 0, nbytes)

    # -- programs and launches -----------------------------------------------------------------
    def build(self, kernel):
        """The compute pipeline of a kernel (its SPIR-V translated by naga); a kernel needing
        what the device lacks, or that wgpu rejects, is refused with the reason."""
        limits, layout = self.limits, binding_layout(kernel)
        self.require(kernel, [
            (kernel.shared_bytes, limits.maxComputeWorkgroupStorageSize, "bytes of shared memory"),
            (layout.push_constant_size, limits.maxImmediateSize,
             "bytes of push constants (immediates)"),
            (len(layout.buffers), limits.maxStorageBuffersPerShaderStage, "storage buffers"),
            (int(np.prod(kernel.workgroup)), limits.maxComputeInvocationsPerWorkgroup,
             "invocations per workgroup")])
        narrow = [p.name for p in kernel.params
                  if p.kind == "buffer" and p.dtype.bits == 16 and p.dtype.kind != "f"]
        if narrow:      # bf16 is a 16-bit integer to SPIR-V, and naga has no 16-bit integers
            raise ModelRefused(f"wgpu: {self.name}: kernel {kernel.name} needs int16 (for its "
                               f"16-bit integer buffers {', '.join(narrow)}), which the device "
                               "lacks")
        try:
            return self._pipeline(kernel, layout)
        except DriverError as e:
            raise ModelRefused(f"wgpu: {self.name}: wgpu rejects kernel {kernel.name}: "
                               f"{e}") from None

    def _pipeline(self, kernel, layout):
        lib, dev = self.lib, self.device
        code = render_spirv(kernel, self.subgroup_size, vector_loads=True)
        source = wgpu.new("WGPUShaderSourceSPIRV", codeSize=len(code) // 4,
                          code=ffi.from_buffer("uint32_t[]", code))
        with self._scope("wgpuDeviceCreateShaderModule"):
            module = lib.wgpuDeviceCreateShaderModule(dev, wgpu.chain(
                wgpu.new("WGPUShaderModuleDescriptor", label=kernel.name), source))
        # (a module whose scope raised is never used: a pipeline from it aborts the process)
        try:
            entries = wgpu.new_array("WGPUBindGroupLayoutEntry", [
                {"binding": b.binding, "visibility": lib.WGPUShaderStage_Compute,
                 "buffer": {"type": lib.WGPUBufferBindingType_ReadOnlyStorage
                            if b.access == "r" else lib.WGPUBufferBindingType_Storage}}
                for b in layout.buffers])
            with self._scope("wgpuDeviceCreateBindGroupLayout"):
                group_layout = lib.wgpuDeviceCreateBindGroupLayout(dev, wgpu.new(
                    "WGPUBindGroupLayoutDescriptor", entryCount=len(layout.buffers),
                    entries=entries))
            with self._scope("wgpuDeviceCreatePipelineLayout"):
                pipeline_layout = lib.wgpuDeviceCreatePipelineLayout(dev, wgpu.new(
                    "WGPUPipelineLayoutDescriptor", bindGroupLayoutCount=1,
                    bindGroupLayouts=ffi.new("WGPUBindGroupLayout[]", [group_layout]),
                    immediateSize=layout.push_constant_size))
            try:
                with self._scope("wgpuDeviceCreateComputePipeline"):
                    pipeline = lib.wgpuDeviceCreateComputePipeline(dev, wgpu.new(
                        "WGPUComputePipelineDescriptor", label=kernel.name,
                        layout=pipeline_layout,
                        compute={"module": module, "entryPoint": kernel.name}))
            finally:
                lib.wgpuPipelineLayoutRelease(pipeline_layout)
        finally:
            lib.wgpuShaderModuleRelease(module)
        return Program(kernel.name, pipeline, group_layout, layout.push_constant_size,
                       layout.pack_push_constants)

    def _bind_group(self, program, buffers):
        """The bind group of `buffers` for `program`, made once and kept until one of them is
        freed (the runner launches the same buffers every step)."""
        key = tuple(b.serial for b in buffers)
        group = program.groups.get(key)
        if group is None:
            entries = wgpu.new_array("WGPUBindGroupEntry", [
                {"binding": i, "buffer": b.handle, "offset": 0, "size": b.size}
                for i, b in enumerate(buffers)])
            with self._scope("wgpuDeviceCreateBindGroup"):
                group = self.lib.wgpuDeviceCreateBindGroup(self.device, wgpu.new(
                    "WGPUBindGroupDescriptor", layout=program.group_layout,
                    entryCount=len(buffers), entries=entries))
            program.groups[key] = group
            for serial in set(key):
                self._groups_of.setdefault(serial, set()).add(program)
        return group

    def launch(self, program, kernel, grid, args):
        """One dispatch in the open compute pass (wgpu orders dispatches that share a buffer);
        args follow kernel.params (buffers, then Python scalars, which become immediates).
        Made through the calls that keep the interpreter lock (wgpu.RECORDED)."""
        buffers, scalars = [], []
        for param, arg in zip(kernel.params, args, strict=True):
            (buffers if param.kind == "buffer" else scalars).append(arg)
        groups = workgroups(kernel, grid, (self.limits.maxComputeWorkgroupsPerDimension,) * 3)
        group = self._bind_group(program, buffers)
        held, compute = self._held, address(ffi, self._compute_pass())
        held.wgpuComputePassEncoderSetPipeline(compute, program.pipeline_at)
        held.wgpuComputePassEncoderSetBindGroup(compute, 0, address(ffi, group), 0, None)
        if program.push_size:
            values = program.pack(scalars)
            held.wgpuComputePassEncoderSetImmediates(compute, 0, values, len(values))
        held.wgpuComputePassEncoderDispatchWorkgroups(compute, *groups)

    # -- encoding and submission ---------------------------------------------------------------
    def _encoding(self):
        """The open command encoder, its compute pass ended (for copies)."""
        lib = self.lib
        if self._pass is not None:
            lib.wgpuComputePassEncoderEnd(self._pass)
            lib.wgpuComputePassEncoderRelease(self._pass)
            self._pass = None
        if self._encoder is None:
            self._encoder = lib.wgpuDeviceCreateCommandEncoder(self.device, ffi.NULL)
        return self._encoder

    def _compute_pass(self):
        if self._pass is None:
            self._pass = self.lib.wgpuCommandEncoderBeginComputePass(self._encoding(), ffi.NULL)
        return self._pass

    def _submit(self):
        """Finishes the encoder inside an error scope and submits it when it is valid."""
        if self._encoder is None:
            return
        lib = self.lib
        encoder, self._encoder, commands = self._encoding(), None, None
        try:
            with self._scope("wgpuCommandEncoderFinish"):
                commands = lib.wgpuCommandEncoderFinish(encoder, ffi.NULL)
            lib.wgpuQueueSubmit(self.queue, 1, ffi.new("WGPUCommandBuffer[]", [commands]))
        finally:
            if commands is not None:
                lib.wgpuCommandBufferRelease(commands)
            lib.wgpuCommandEncoderRelease(encoder)

    def synchronize(self):
        """Submits what is encoded and waits for the queue; raises an error wgpu reported
        outside any scope meanwhile."""
        self._submit()
        self.lib.wgpuDevicePoll(self.device, 1, ffi.NULL)
        if self.errors:
            error = self.errors[0]
            self.errors.clear()
            raise error
