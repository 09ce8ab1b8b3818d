"""The raw Vulkan Device: libvulkan through drivers/vulkan.py, kernels rendered to SPIR-V.

Opens one physical device (by ordinal among those with a compute queue) with exactly the
features its capabilities stand for, one compute queue, and records every write, copy and
launch into one command buffer in issue order, a full memory barrier before each command; a
synchronize submits it and waits on a fence. Buffers are device-local: writes and reads go
through a host-visible staging ring, or straight through the mapping when the memory is
host-visible and no recorded work could still touch it. A capture records launches into a
command buffer of their own that replay() resubmits. Free memory comes from
VK_EXT_memory_budget, and a driver without it is an error, never a guess. Nothing here chooses
a device or retries.
"""
import os
import time
from dataclasses import dataclass, field
from itertools import count

import numpy as np

from drivers import DriverError, LibraryNotFound, address, held_functions, parse_types
from drivers import vulkan as vk

from ..codegen.spirv import TARGET, binding_layout, render_spirv
from ..errors import BackendUnavailable, CapacityError, ModelRefused, NoSuchDevice
from . import Device, workgroups
from .vulkan_instance import (BUDGET_EXTENSION, VALIDATION_LAYER, compute_devices,
                              device_extensions, heap_budget, heap_usage, open_instance,
                              queue_timestamp_bits)

ffi = vk.ffi
VALIDATION_ENV = "POOT_VULKAN_VALIDATION"
STAGING_ENV = "POOT_VULKAN_STAGING"
STAGING_BYTES = 64 << 20
# Poll a fence this long before sleeping in vkWaitForFences. On a GPU the host has nothing else
# to do while a step runs, and waking from the sleep costs a decode step much of its time; on a
# CPU device (lavapipe) the polling thread would take a core from the device's own threads.
SPIN_SECONDS = {"gpu": 0.05, "cpu": 100e-6}
SETS_PER_POOL = 256
TIMED_LAUNCHES = 4096         # launches one start_timing/stop_timing may time
# The C types a step's launches, copies and submissions name (descriptor sets, command
# buffers, fences), parsed when the device opens (drivers.parse_types)
STEP_TYPES = (
    "VkDescriptorSet[1]", "VkDescriptorPool *", "VkDescriptorPoolSize *",
    "VkDescriptorPoolCreateInfo", "VkDescriptorPoolCreateInfo *", "VkDescriptorSetAllocateInfo",
    "VkDescriptorSetAllocateInfo *", "VkDescriptorBufferInfo *", "VkWriteDescriptorSet",
    "VkWriteDescriptorSet[]", "VkCommandBuffer[1]", "VkCommandBuffer[]",
    "VkCommandBufferAllocateInfo", "VkCommandBufferAllocateInfo *", "VkCommandBufferBeginInfo",
    "VkCommandBufferBeginInfo *", "VkFence[1]", "VkFenceCreateInfo", "VkFenceCreateInfo *",
    "VkSubmitInfo", "VkSubmitInfo *", "VkBufferCopy *")
# VkPhysicalDeviceMaintenance3Properties (core 1.1) is not among the binding's declarations: it
# is read as raw words {sType, pad, pNext, maxPerSetDescriptors, pad, maxMemoryAllocationSize}.
MAINTENANCE_3_PROPERTIES = 1000168000


@dataclass(eq=False)
class DeviceBuffer:
    handle: object
    memory: object
    nbytes: int
    mapped: object            # host pointer of a host-visible allocation, else None
    serial: int
    allocation: int           # bytes of device memory behind it, as the driver takes it


@dataclass(eq=False)
class Program:
    name: str
    pipeline: object
    layout: object
    set_layout: object
    push_size: int
    pack: object              # scalars -> push-constant bytes
    sets: dict = field(default_factory=dict)   # buffer serials -> (set array, pool, address)

    def __post_init__(self):  # the handles' addresses, as the held commands take them
        self.pipeline_at, self.layout_at = address(ffi, self.pipeline), address(ffi, self.layout)


@dataclass(eq=False)
class Recording:
    commands: object          # VkCommandBuffer[1], recorded once, resubmitted by replay()


def _buffer_bytes(nbytes):
    """The size of the storage buffer that holds `nbytes`: whole 4-byte words, at least one."""
    return max(-(-int(nbytes) // 4) * 4, 4)


class VulkanDevice(Device):
    backend = "vulkan"
    target = TARGET
    features = frozenset({"capture", "timing", "staging", "marks"})

    def __init__(self, ordinal=0):
        super().__init__()
        validate = os.environ.get(VALIDATION_ENV) == "1"
        try:
            self.lib, _ = vk.load()
            self.instance, self._keep, self.messages = open_instance(self.lib, validate)
            devices = compute_devices(self.lib, self.instance)
            if not 0 <= ordinal < len(devices):
                error = NoSuchDevice if devices else BackendUnavailable
                raise error(f"vulkan: no Vulkan device {ordinal} with a compute queue (the "
                            f"loader sees {len(devices)})")
            self.physical, self.family = devices[ordinal]
            self._describe(ordinal)
            self.timestamp_bits = queue_timestamp_bits(self.lib, self.physical, self.family)
            self._open()
        except LibraryNotFound as e:
            raise BackendUnavailable(f"vulkan: the Vulkan loader is not installed: {e}") from None
        except DriverError as e:
            raise BackendUnavailable(f"vulkan: cannot open Vulkan device {ordinal}: {e}") from None
        self.ordinal = ordinal
        self.allocated = 0            # bytes of device memory allocated, as the driver takes it
        self._sizes = {}              # buffer bytes -> the allocation the driver requires
        self._serials = count()
        self._host_arrays = []        # (address, bytes, staging buffer) of host_array's
        self._sets_of = {}            # buffer serial -> programs holding a set that binds it
        self._pools = []
        self._free_commands, self._free_fences, self._in_flight = [], [], []
        self._commands = None         # the command buffer being recorded, begun lazily
        self._capturing = None
        self._staging, self._staged = None, 0
        self._timed, self._queries = None, None
        self.page = self._page()
        parse_types(ffi, STEP_TYPES)

    # -- opening -------------------------------------------------------------------------------
    def _describe(self, ordinal):
        lib = self.lib
        subgroup = vk.new("VkPhysicalDeviceSubgroupProperties")
        maintenance = ffi.new("uint64_t[4]", [MAINTENANCE_3_PROPERTIES, 0, 0, 0])
        self._properties = vk.chain(vk.new("VkPhysicalDeviceProperties2"), subgroup, maintenance)
        lib.vkGetPhysicalDeviceProperties2(self.physical, self._properties)
        props = self._properties.properties
        if props.apiVersion < vk.make_version(1, 2):
            raise BackendUnavailable(f"vulkan: {vk.text(props.deviceName)} is Vulkan "
                                     f"{vk.version_string(props.apiVersion)}; poot needs 1.2+")
        self.name = f"{vk.text(props.deviceName)} (vulkan:{ordinal})"
        self.limits = props.limits
        self.max_allocation = maintenance[3] or (1 << 62)
        self.max_buffer = min(self.limits.maxStorageBufferRange, self.max_allocation)
        self.subgroup_size = subgroup.subgroupSize
        self._uma = props.deviceType in (lib.VK_PHYSICAL_DEVICE_TYPE_CPU,
                                         lib.VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU)
        self._spin = SPIN_SECONDS["cpu" if props.deviceType == lib.VK_PHYSICAL_DEVICE_TYPE_CPU
                                  else "gpu"]
        # A device runner stages its steps' inputs and tokens in host_array memory (recorded
        # copies) on a discrete GPU. On a CPU or integrated device that memory would come out
        # of the heap the plan measures, and its buffers are mapped for direct writes anyway;
        # STAGING_ENV=1 stages there too, so that lavapipe runs a discrete GPU's path (tests,
        # scripts/serve-check)
        self.step_staging = not self._uma or os.environ.get(STAGING_ENV) == "1"
        v11, v12 = vk.new("VkPhysicalDeviceVulkan11Features"), vk.new(
            "VkPhysicalDeviceVulkan12Features")
        features = vk.chain(vk.new("VkPhysicalDeviceFeatures2"), v11, v12)
        lib.vkGetPhysicalDeviceFeatures2(self.physical, features)
        caps = {"shared"}
        offered = {"storage16": v11.storageBuffer16BitAccess,
                   "storage8": v12.storageBuffer8BitAccess, "float16": v12.shaderFloat16,
                   "int16": features.features.shaderInt16, "int64": features.features.shaderInt64}
        caps |= {cap for cap, on in offered.items() if on}
        if subgroup.supportedStages & lib.VK_SHADER_STAGE_COMPUTE_BIT:
            ops = subgroup.supportedOperations
            for cap, bit in (("subgroup", lib.VK_SUBGROUP_FEATURE_BASIC_BIT),
                             ("subgroup_arith", lib.VK_SUBGROUP_FEATURE_ARITHMETIC_BIT),
                             ("subgroup_shuffle", lib.VK_SUBGROUP_FEATURE_SHUFFLE_BIT)):
                if ops & bit:
                    caps.add(cap)
        self.caps = frozenset(caps)
        self.extensions = device_extensions(lib, self.physical)

    def _open(self):
        """The device with exactly the features behind `caps` enabled (lavapipe runs kernels
        whose features were never enabled; other drivers reject them), and the budget
        extension where offered."""
        lib, caps = self.lib, self.caps
        v11 = vk.new("VkPhysicalDeviceVulkan11Features",
                     storageBuffer16BitAccess="storage16" in caps)
        v12 = vk.new("VkPhysicalDeviceVulkan12Features",
                     storageBuffer8BitAccess="storage8" in caps, shaderFloat16="float16" in caps)
        features = vk.chain(vk.new("VkPhysicalDeviceFeatures2"), v11, v12)
        features.features.shaderInt16 = "int16" in caps
        features.features.shaderInt64 = "int64" in caps
        extensions = [BUDGET_EXTENSION] if BUDGET_EXTENSION in self.extensions else []
        queue = vk.new("VkDeviceQueueCreateInfo", queueFamilyIndex=self.family, queueCount=1,
                       pQueuePriorities=ffi.new("float[]", [1.0]))
        info = vk.new("VkDeviceCreateInfo", pNext=features, queueCreateInfoCount=1,
                      pQueueCreateInfos=queue, enabledExtensionCount=len(extensions),
                      ppEnabledExtensionNames=vk.strings(extensions))
        handle = ffi.new("VkDevice *")
        vk.check(lib.vkCreateDevice(self.physical, info, ffi.NULL, handle), "vkCreateDevice")
        self.device = handle[0]
        queue_handle = ffi.new("VkQueue *")
        lib.vkGetDeviceQueue(self.device, self.family, 0, queue_handle)
        self.queue = queue_handle[0]
        self._memory = vk.new("VkPhysicalDeviceMemoryProperties2")
        lib.vkGetPhysicalDeviceMemoryProperties2(self.physical, self._memory)
        pool = ffi.new("VkCommandPool *")
        vk.check(lib.vkCreateCommandPool(self.device, vk.new(
            "VkCommandPoolCreateInfo", queueFamilyIndex=self.family,
            flags=lib.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT), ffi.NULL, pool),
            "vkCreateCommandPool")
        self._command_pool = pool[0]
        stages = lib.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | lib.VK_PIPELINE_STAGE_TRANSFER_BIT
        self._stages = stages
        self._barrier = vk.new(
            "VkMemoryBarrier",
            srcAccessMask=lib.VK_ACCESS_SHADER_WRITE_BIT | lib.VK_ACCESS_TRANSFER_WRITE_BIT,
            dstAccessMask=lib.VK_ACCESS_SHADER_READ_BIT | lib.VK_ACCESS_SHADER_WRITE_BIT
            | lib.VK_ACCESS_TRANSFER_READ_BIT | lib.VK_ACCESS_TRANSFER_WRITE_BIT)
        self._barrier_at = address(ffi, self._barrier)
        self._held = held_functions(ffi, lib, vk.RECORDED)
        self._host_barrier = vk.new(
            "VkMemoryBarrier",
            srcAccessMask=lib.VK_ACCESS_SHADER_WRITE_BIT | lib.VK_ACCESS_TRANSFER_WRITE_BIT,
            dstAccessMask=lib.VK_ACCESS_HOST_READ_BIT)

    # -- memory --------------------------------------------------------------------------------
    @property
    def memory_source(self):
        if BUDGET_EXTENSION in self.extensions:
            return BUDGET_EXTENSION
        return f"no budget (no {BUDGET_EXTENSION}): --memory-limit needed"

    def memory(self):
        """(free, total) bytes of the device-local heaps, from VK_EXT_memory_budget."""
        return heap_budget(self.lib, self.physical, self.extensions, f"vulkan: {self.name}")

    def held(self):
        """(bytes of device memory this process holds, where the figure comes from): the
        device-local heaps' usage where the driver reports it, else this device's count."""
        if BUDGET_EXTENSION in self.extensions:
            return heap_usage(self.lib, self.physical), f"{BUDGET_EXTENSION} heapUsage"
        return self.allocated, "the vulkan device's count of its allocations"

    def _page(self):
        """The unit in which the driver takes device memory, as its own accounting shows it:
        the heaps' usage grows by whole pages (NVIDIA's driver: 64 KiB, so a buffer of 4 KiB
        takes 64 KiB), read once by allocating the smallest buffer. 1 where no budget shows
        the usage, or its growth is no power of two: each buffer then counts as the size
        VkMemoryRequirements gives, and the post-allocation check (engine/plan.py) judges."""
        if BUDGET_EXTENSION not in self.extensions:
            return 1
        before = heap_usage(self.lib, self.physical)
        local = self.lib.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT
        probe = self._buffer(4, self._storage_usage(), [local], host_access=False)
        growth = heap_usage(self.lib, self.physical) - before
        self.lib.vkDestroyBuffer(self.device, probe.handle, ffi.NULL)
        self.lib.vkFreeMemory(self.device, probe.memory, ffi.NULL)
        return growth if growth >= probe.allocation and growth & (growth - 1) == 0 else 1

    def allocation_bytes(self, nbytes):
        """The device memory one buffer of `nbytes` takes: the size the driver's
        VkMemoryRequirements asks for a storage buffer of that many bytes (each buffer has an
        allocation of its own), read from a buffer created and destroyed for the question, in
        whole pages of the driver's (_page)."""
        size = _buffer_bytes(nbytes)
        if size not in self._sizes:
            lib = self.lib
            handle = ffi.new("VkBuffer *")
            vk.check(lib.vkCreateBuffer(self.device, vk.new(
                "VkBufferCreateInfo", size=size, usage=self._storage_usage(),
                sharingMode=lib.VK_SHARING_MODE_EXCLUSIVE), ffi.NULL, handle), "vkCreateBuffer")
            needs = ffi.new("VkMemoryRequirements *")
            lib.vkGetBufferMemoryRequirements(self.device, handle[0], needs)
            lib.vkDestroyBuffer(self.device, handle[0], ffi.NULL)
            self._sizes[size] = -(-needs.size // self.page) * self.page
        return self._sizes[size]

    def _storage_usage(self):
        lib = self.lib
        return (lib.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | lib.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
                | lib.VK_BUFFER_USAGE_TRANSFER_DST_BIT)

    def _memory_type(self, type_bits, preferences):
        """The first memory type allowed by `type_bits` whose flags include one of
        `preferences` (flag sets, best first)."""
        props = self._memory.memoryProperties
        for wanted in preferences:
            for i in range(props.memoryTypeCount):
                if type_bits >> i & 1 and props.memoryTypes[i].propertyFlags & wanted == wanted:
                    return i, props.memoryTypes[i].propertyFlags
        raise DriverError("vulkan", "choosing a memory type", None, "no memory type",
                          f"{self.name} offers no memory type for this buffer")

    def _buffer(self, nbytes, usage, preferences, host_access):
        """A buffer bound to its own allocation, mapped when `host_access` and its memory
        is host-visible and coherent."""
        lib = self.lib
        info = vk.new("VkBufferCreateInfo", size=nbytes, usage=usage,
                      sharingMode=lib.VK_SHARING_MODE_EXCLUSIVE)
        handle = ffi.new("VkBuffer *")
        vk.check(lib.vkCreateBuffer(self.device, info, ffi.NULL, handle), "vkCreateBuffer")
        needs = ffi.new("VkMemoryRequirements *")
        lib.vkGetBufferMemoryRequirements(self.device, handle[0], needs)
        memory = ffi.new("VkDeviceMemory *")
        try:
            if needs.size > self.max_allocation:
                raise ModelRefused(f"vulkan: {self.name}: a buffer of {nbytes} bytes needs an "
                                   f"allocation of {needs.size}, over the device's "
                                   f"maxMemoryAllocationSize ({self.max_allocation})")
            index, flags = self._memory_type(needs.memoryTypeBits, preferences)
            vk.check(lib.vkAllocateMemory(self.device, vk.new(
                "VkMemoryAllocateInfo", allocationSize=needs.size, memoryTypeIndex=index),
                ffi.NULL, memory), "vkAllocateMemory")
        except BaseException:
            lib.vkDestroyBuffer(self.device, handle[0], ffi.NULL)
            raise
        vk.check(lib.vkBindBufferMemory(self.device, handle[0], memory[0], 0),
                 "vkBindBufferMemory")
        mapped = None
        host = lib.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | lib.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
        if host_access and flags & host == host:
            pointer = ffi.new("void **")
            vk.check(lib.vkMapMemory(self.device, memory[0], 0, lib.VK_WHOLE_SIZE, 0, pointer),
                     "vkMapMemory")
            mapped = pointer[0]
        return DeviceBuffer(handle[0], memory[0], nbytes, mapped, next(self._serials),
                            needs.size)

    def alloc(self, nbytes):
        """A device-local storage buffer; one buffer is bounded by maxStorageBufferRange and
        maxMemoryAllocationSize (the runner allocates each tensor plane on its own)."""
        nbytes = int(nbytes)
        if nbytes > self.max_buffer:
            raise ModelRefused(
                f"vulkan: {self.name}: a buffer of {nbytes} bytes is over the device's limit "
                f"for one storage buffer ({self.max_buffer} bytes: maxStorageBufferRange "
                f"{self.limits.maxStorageBufferRange}, maxMemoryAllocationSize "
                f"{self.max_allocation})")
        lib = self.lib
        local, host = (lib.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT,
                       lib.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT
                       | lib.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT)
        # On a CPU or integrated device the local memory is host memory: map it. A discrete
        # GPU's host-visible local memory (the PCIe BAR) is small or slow to read: use staging.
        preferences = [local | host, local] if self._uma else [local]
        try:
            buffer = self._buffer(_buffer_bytes(nbytes), self._storage_usage(), preferences,
                                  self._uma)
        except DriverError as e:
            raise CapacityError(f"vulkan: {self.name}: cannot allocate {nbytes} bytes: {e}") \
                from None
        buffer.nbytes = nbytes
        buffer.allocation = -(-buffer.allocation // self.page) * self.page
        self.allocated += buffer.allocation
        return buffer

    def free(self, buffer):
        if not self._idle():
            self.synchronize()
        for program in self._sets_of.pop(buffer.serial, ()):
            for key in [k for k in program.sets if buffer.serial in k]:
                sets, pool, _ = program.sets.pop(key)
                vk.check(self.lib.vkFreeDescriptorSets(self.device, pool, 1, sets),
                         "vkFreeDescriptorSets")
        self.lib.vkDestroyBuffer(self.device, buffer.handle, ffi.NULL)
        self.lib.vkFreeMemory(self.device, buffer.memory, ffi.NULL)
        self.allocated -= buffer.allocation

    # -- host <-> device -----------------------------------------------------------------------
    def _idle(self):
        """No recorded or submitted work that could still touch a buffer."""
        return self._commands is None and not self._in_flight

    def _stage(self, nbytes):
        """An offset of `nbytes` (at most STAGING_BYTES) in the staging ring, free until the
        next synchronize (which empties the ring)."""
        if self._staging is None:
            lib = self.lib
            host = (lib.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT
                    | lib.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT)
            self._staging = self._buffer(
                STAGING_BYTES, lib.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
                | lib.VK_BUFFER_USAGE_TRANSFER_DST_BIT,
                [host | lib.VK_MEMORY_PROPERTY_HOST_CACHED_BIT, host], host_access=True)
        if self._staged + nbytes > STAGING_BYTES:
            self.synchronize()
        offset = self._staged
        self._staged += -(-nbytes // 16) * 16
        return offset

    def _copy(self, src, src_offset, dst, dst_offset, nbytes):
        if nbytes == 0:          # nothing to copy, and a region's size must be above 0
            return
        cb = self._record()
        region = ffi.new("VkBufferCopy *", {"srcOffset": src_offset, "dstOffset": dst_offset,
                                            "size": nbytes})
        self.lib.vkCmdCopyBuffer(cb, src.handle, dst.handle, 1, region)

    def host_array(self, nbytes):
        """A uint8 array of `nbytes` in a host-visible buffer of its own, held while the
        process runs (a runner's, like its device buffers): write and download copy it with
        recorded copies, which a recording (capture) may hold, each replay reading or writing
        it anew."""
        lib = self.lib
        host = lib.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | lib.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
        staging = self._buffer(_buffer_bytes(nbytes), lib.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
                               | lib.VK_BUFFER_USAGE_TRANSFER_DST_BIT,
                               [host | lib.VK_MEMORY_PROPERTY_HOST_CACHED_BIT, host],
                               host_access=True)
        array = np.frombuffer(ffi.buffer(staging.mapped, nbytes), np.uint8)
        self._host_arrays.append((array.ctypes.data, nbytes, staging))
        return array

    def _in_host_array(self, data):
        """(staging buffer, offset) of an array lying in one of host_array's, else None."""
        address = data.ctypes.data
        for base, nbytes, staging in self._host_arrays:
            if base <= address and address + data.nbytes <= base + nbytes:
                return staging, address - base
        return None

    def download(self, host, buffer, nbytes):
        """Copies nbytes of `buffer` into `host` (from host_array) in order with launches, in a
        recording too; they are there after the next synchronize."""
        found = self._in_host_array(host[:nbytes])
        if found is None:
            raise TypeError("download: into an array from host_array")
        self._copy(buffer, 0, found[0], found[1], nbytes)

    def write(self, buffer, array, offset=0):
        """Host -> device, in order with launches: from a host_array, a recorded copy (in a
        recording too); otherwise straight into mapped memory when nothing recorded could read
        the old contents, else through staging and a recorded copy."""
        data = np.ascontiguousarray(array)
        if offset + data.nbytes > buffer.nbytes:
            raise ValueError(f"write of {data.nbytes} bytes at {offset} into {buffer.nbytes}")
        found = self._in_host_array(data)
        if found is not None:
            self._copy(found[0], found[1], buffer, offset, data.nbytes)
            return
        self._not_capturing("write")
        source = ffi.from_buffer("char[]", data)
        if buffer.mapped is not None and self._idle():
            ffi.memmove(ffi.cast("char *", buffer.mapped) + offset, source, data.nbytes)
            return
        done = 0
        while done < data.nbytes:
            n = min(data.nbytes - done, STAGING_BYTES)
            at = self._stage(n)
            ffi.memmove(ffi.cast("char *", self._staging.mapped) + at, source + done, n)
            self._copy(self._staging, at, buffer, offset + done, n)
            done += n

    def read(self, buffer, nbytes=None, offset=0):
        """Device -> host, after everything issued before it."""
        nbytes = buffer.nbytes - offset if nbytes is None else nbytes
        if offset + nbytes > buffer.nbytes:
            raise ValueError(f"read of {nbytes} bytes at {offset} from {buffer.nbytes}")
        self._not_capturing("read")
        if buffer.mapped is not None:
            self.synchronize()
            return ffi.buffer(ffi.cast("char *", buffer.mapped) + offset, nbytes)[:]
        out = bytearray(nbytes)
        done = 0
        while done < nbytes:
            n = min(nbytes - done, STAGING_BYTES)
            at = self._stage(n)
            self._copy(buffer, offset + done, self._staging, at, n)
            self.synchronize()
            out[done:done + n] = ffi.buffer(ffi.cast("char *", self._staging.mapped) + at, n)
            done += n
        return bytes(out)

    def copy(self, dst, src, nbytes):
        if nbytes > min(dst.nbytes, src.nbytes):
            raise ValueError(f"copy of {nbytes} bytes between {src.nbytes} and {dst.nbytes}")
        self._copy(src, 0, dst, 0, nbytes)

    def _not_capturing(self, what):
        if self._capturing is not None:
            raise RuntimeError(f"{what} during capture: a recording holds launches only; "
                               "write before replay, read after it")

    # -- programs and launches -----------------------------------------------------------------
    def build(self, kernel):
        """The compute pipeline of a kernel, rendered to SPIR-V; a kernel needing what the
        device lacks is refused, naming the capability or the limit."""
        limits, layout = self.limits, binding_layout(kernel)
        self.require(kernel, [
            (kernel.shared_bytes, limits.maxComputeSharedMemorySize, "bytes of shared memory"),
            (layout.push_constant_size, limits.maxPushConstantsSize, "bytes of push constants"),
            (len(layout.buffers), limits.maxPerStageDescriptorStorageBuffers, "storage buffers"),
            (int(np.prod(kernel.workgroup)), limits.maxComputeWorkGroupInvocations,
             "invocations per workgroup")])
        lib, dev = self.lib, self.device
        code = render_spirv(kernel, self.subgroup_size, vector_loads=True)
        module = ffi.new("VkShaderModule *")
        vk.check(lib.vkCreateShaderModule(dev, vk.new(
            "VkShaderModuleCreateInfo", codeSize=len(code),
            pCode=ffi.from_buffer("uint32_t[]", code)), ffi.NULL, module), "vkCreateShaderModule")
        try:
            bindings = ffi.new("VkDescriptorSetLayoutBinding[]", [
                {"binding": b.binding, "descriptorType": lib.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                 "descriptorCount": 1, "stageFlags": lib.VK_SHADER_STAGE_COMPUTE_BIT}
                for b in layout.buffers])
            set_layout = ffi.new("VkDescriptorSetLayout[1]")
            vk.check(lib.vkCreateDescriptorSetLayout(dev, vk.new(
                "VkDescriptorSetLayoutCreateInfo", bindingCount=len(layout.buffers),
                pBindings=bindings), ffi.NULL, set_layout), "vkCreateDescriptorSetLayout")
            push = ffi.new("VkPushConstantRange *", {
                "stageFlags": lib.VK_SHADER_STAGE_COMPUTE_BIT, "offset": 0,
                "size": layout.push_constant_size})
            pipeline_layout = ffi.new("VkPipelineLayout *")
            vk.check(lib.vkCreatePipelineLayout(dev, vk.new(
                "VkPipelineLayoutCreateInfo", setLayoutCount=1, pSetLayouts=set_layout,
                pushConstantRangeCount=int(layout.push_constant_size > 0),
                pPushConstantRanges=push), ffi.NULL, pipeline_layout), "vkCreatePipelineLayout")
            pipeline = ffi.new("VkPipeline *")
            vk.check(lib.vkCreateComputePipelines(dev, ffi.NULL, 1, vk.new(
                "VkComputePipelineCreateInfo", layout=pipeline_layout[0], stage={
                    "stage": lib.VK_SHADER_STAGE_COMPUTE_BIT, "module": module[0],
                    "pName": kernel.name.encode()}), ffi.NULL, pipeline),
                "vkCreateComputePipelines")
        finally:
            lib.vkDestroyShaderModule(dev, module[0], ffi.NULL)
        return Program(kernel.name, pipeline[0], pipeline_layout[0], set_layout,
                       layout.push_constant_size, layout.pack_push_constants)

    def _descriptor_set(self, program, buffers):
        """The address of the set binding `buffers` for `program`, written once and kept until
        one of the buffers is freed (the runner launches the same buffers every step)."""
        key = tuple(b.serial for b in buffers)
        entry = program.sets.get(key)
        if entry is not None:
            return entry[2]
        lib = self.lib
        sets, pool = self._allocate_set(program.set_layout)
        infos = [ffi.new("VkDescriptorBufferInfo *", {"buffer": b.handle, "offset": 0,
                                                      "range": lib.VK_WHOLE_SIZE})
                 for b in buffers]
        writes = vk.new_array("VkWriteDescriptorSet", [
            {"dstSet": sets[0], "dstBinding": i, "descriptorCount": 1,
             "descriptorType": lib.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, "pBufferInfo": info}
            for i, info in enumerate(infos)])
        lib.vkUpdateDescriptorSets(self.device, len(infos), writes, 0, ffi.NULL)
        program.sets[key] = (sets, pool, address(ffi, sets))
        for serial in set(key):
            self._sets_of.setdefault(serial, set()).add(program)
        return program.sets[key][2]

    def _allocate_set(self, set_layout):
        """A descriptor set from the newest pool, or from a new pool when that one is full."""
        lib = self.lib
        sets = ffi.new("VkDescriptorSet[1]")
        if self._pools:
            result = lib.vkAllocateDescriptorSets(self.device, vk.new(
                "VkDescriptorSetAllocateInfo", descriptorPool=self._pools[-1],
                descriptorSetCount=1, pSetLayouts=set_layout), sets)
            if result == lib.VK_SUCCESS:
                return sets, self._pools[-1]
            if result not in (lib.VK_ERROR_OUT_OF_POOL_MEMORY, lib.VK_ERROR_FRAGMENTED_POOL):
                vk.check(result, "vkAllocateDescriptorSets")
        pool = self._new_pool()
        vk.check(lib.vkAllocateDescriptorSets(self.device, vk.new(
            "VkDescriptorSetAllocateInfo", descriptorPool=pool, descriptorSetCount=1,
            pSetLayouts=set_layout), sets), "vkAllocateDescriptorSets")
        return sets, pool

    def _new_pool(self):
        lib = self.lib
        sizes = ffi.new("VkDescriptorPoolSize *", {"type": lib.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                                   "descriptorCount": SETS_PER_POOL * 8})
        pool = ffi.new("VkDescriptorPool *")
        vk.check(lib.vkCreateDescriptorPool(self.device, vk.new(
            "VkDescriptorPoolCreateInfo",
            flags=lib.VK_DESCRIPTOR_POOL_CREATE_FREE_DESCRIPTOR_SET_BIT, maxSets=SETS_PER_POOL,
            poolSizeCount=1, pPoolSizes=sizes), ffi.NULL, pool), "vkCreateDescriptorPool")
        self._pools.append(pool[0])
        return pool[0]

    def launch(self, program, kernel, grid, args):
        """One dispatch recorded in issue order; args follow kernel.params (buffers, then
        Python scalars, which become the push constants). Recorded through the commands that
        keep the interpreter lock (vk.RECORDED)."""
        buffers, scalars = [], []
        for param, arg in zip(kernel.params, args, strict=True):
            (buffers if param.kind == "buffer" else scalars).append(arg)
        groups = workgroups(kernel, grid, self.limits.maxComputeWorkGroupCount)
        sets = self._descriptor_set(program, buffers)
        lib, cmd = self.lib, self._held
        recorded = self._record()
        cb = address(ffi, recorded)
        compute, layout = lib.VK_PIPELINE_BIND_POINT_COMPUTE, program.layout_at
        cmd.vkCmdBindPipeline(cb, compute, program.pipeline_at)
        cmd.vkCmdBindDescriptorSets(cb, compute, layout, 0, 1, sets, 0, None)
        if program.push_size:
            values = program.pack(scalars)
            cmd.vkCmdPushConstants(cb, layout, lib.VK_SHADER_STAGE_COMPUTE_BIT, 0, len(values),
                                   values)
        if self._timed is None:
            cmd.vkCmdDispatch(cb, *groups)
            return
        first = 2 * len(self._timed)
        if first + 2 > TIMED_LAUNCHES * 2:
            raise RuntimeError(f"vulkan: more than {TIMED_LAUNCHES} launches timed at once")
        stage = lib.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT
        lib.vkCmdWriteTimestamp(recorded, stage, self._queries, first)
        cmd.vkCmdDispatch(cb, *groups)
        lib.vkCmdWriteTimestamp(recorded, stage, self._queries, first + 1)
        self._timed.append(kernel.name)

    def start_timing(self):
        """Times every launch from now on with a pair of timestamps (--device-timing)."""
        self._not_capturing("timing")
        lib = self.lib
        if not self.timestamp_bits:
            raise ValueError(f"vulkan: {self.name} has no timestamps on its compute queue")
        if self._queries is None:
            pool = ffi.new("VkQueryPool *")
            vk.check(lib.vkCreateQueryPool(self.device, vk.new(
                "VkQueryPoolCreateInfo", queryType=lib.VK_QUERY_TYPE_TIMESTAMP,
                queryCount=2 * TIMED_LAUNCHES), ffi.NULL, pool), "vkCreateQueryPool")
            self._queries = pool[0]
        self._record()
        lib.vkCmdResetQueryPool(self._commands[0], self._queries, 0, 2 * TIMED_LAUNCHES)
        self._timed = []

    def stop_timing(self):
        """[(kernel name, seconds)] of the launches since start_timing, in launch order."""
        timed, self._timed = self._timed, None
        self.synchronize()
        if not timed:
            return []
        ticks = ffi.new("uint64_t[]", 2 * len(timed))
        lib = self.lib
        vk.check(lib.vkGetQueryPoolResults(
            self.device, self._queries, 0, 2 * len(timed), ffi.sizeof(ticks), ticks, 8,
            lib.VK_QUERY_RESULT_64_BIT | lib.VK_QUERY_RESULT_WAIT_BIT), "vkGetQueryPoolResults")
        mask = (1 << self.timestamp_bits) - 1 if self.timestamp_bits < 64 else (1 << 64) - 1
        period = self.limits.timestampPeriod * 1e-9           # seconds per tick
        return [(name, ((ticks[2 * i + 1] - ticks[2 * i]) & mask) * period)
                for i, name in enumerate(timed)]

    # -- command buffers and submission --------------------------------------------------------
    def _command_buffer(self, flags):
        lib = self.lib
        if self._free_commands:
            commands = self._free_commands.pop()
        else:
            commands = ffi.new("VkCommandBuffer[1]")
            vk.check(lib.vkAllocateCommandBuffers(self.device, vk.new(
                "VkCommandBufferAllocateInfo", commandPool=self._command_pool,
                level=lib.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1), commands),
                "vkAllocateCommandBuffers")
        vk.check(lib.vkBeginCommandBuffer(commands[0], vk.new(
            "VkCommandBufferBeginInfo", flags=flags)), "vkBeginCommandBuffer")
        return commands

    def _record(self):
        """The command buffer a command goes into (the capture's, or the eager one), with a
        barrier recorded first: every command may depend on all before it, in this buffer or
        in any submitted earlier."""
        if self._capturing is not None:
            commands = self._capturing
        else:
            if self._commands is None:
                self._commands = self._command_buffer(
                    self.lib.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT)
            commands = self._commands
        self._held.vkCmdPipelineBarrier(address(ffi, commands[0]), self._stages, self._stages, 0,
                                        1, self._barrier_at, 0, None, 0, None)
        return commands[0]

    def _end(self, commands):
        """Close a command buffer, its writes made available to the host that reads them."""
        lib = self.lib
        lib.vkCmdPipelineBarrier(commands[0], self._stages, lib.VK_PIPELINE_STAGE_HOST_BIT, 0, 1,
                                 self._host_barrier, 0, ffi.NULL, 0, ffi.NULL)
        vk.check(lib.vkEndCommandBuffer(commands[0]), "vkEndCommandBuffer")

    def _submit(self, *recorded):
        """Submits what is recorded eagerly, then `recorded` buffers, as one batch."""
        lib = self.lib
        batch, recycle = [], []
        if self._commands is not None:
            self._end(self._commands)
            batch.append(self._commands[0])
            recycle.append(self._commands)
            self._commands = None
        batch += [r[0] for r in recorded]
        if not batch:
            return
        if self._free_fences:
            fence = self._free_fences.pop()
        else:
            fence = ffi.new("VkFence[1]")
            vk.check(lib.vkCreateFence(self.device, vk.new("VkFenceCreateInfo"), ffi.NULL,
                                       fence), "vkCreateFence")
        handles = ffi.new("VkCommandBuffer[]", batch)
        vk.check(lib.vkQueueSubmit(self.queue, 1, vk.new(
            "VkSubmitInfo", commandBufferCount=len(batch), pCommandBuffers=handles), fence[0]),
            "vkQueueSubmit")
        self._in_flight.append((fence, recycle))

    def _wait(self, fence):
        lib = self.lib
        start = time.perf_counter()
        while time.perf_counter() - start < self._spin:
            if vk.check(lib.vkGetFenceStatus(self.device, fence[0]), "vkGetFenceStatus") == 0:
                return
        while vk.check(lib.vkWaitForFences(self.device, 1, fence, 1, 10**9),
                       "vkWaitForFences") == lib.VK_TIMEOUT:
            pass

    def synchronize(self):
        """Submits what is recorded and waits for everything submitted; raises what the
        validation layer reported as an error meanwhile."""
        self._submit()
        self._retire(len(self._in_flight))

    def mark(self):
        """The submission of everything issued so far (what is recorded is submitted now):
        wait_mark waits for it, not for what is submitted after it."""
        self._not_capturing("mark")
        self._submit()
        return self._in_flight[-1] if self._in_flight else None

    def wait_mark(self, mark):
        """Returns once the work issued before `mark` is done (later work may still run)."""
        for i, submitted in enumerate(self._in_flight):
            if submitted is mark:
                self._retire(i + 1)
                return              # else it was waited for already

    def _retire(self, n):
        """Waits for the first n submissions in flight (the queue runs them in order) and
        recycles their fences and command buffers; the staging ring empties with the last."""
        lib = self.lib
        for fence, recycle in self._in_flight[:n]:
            self._wait(fence)
            vk.check(lib.vkResetFences(self.device, 1, fence), "vkResetFences")
            self._free_fences.append(fence)
            for commands in recycle:
                vk.check(lib.vkResetCommandBuffer(commands[0], 0), "vkResetCommandBuffer")
                self._free_commands.append(commands)
        del self._in_flight[:n]
        if not self._in_flight:
            self._staged = 0
        self._raise_validation_errors()

    def _raise_validation_errors(self):
        if not self.messages:
            return
        bit = self.lib.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT
        errors = [f"{name}: {text}" for severity, name, text in self.messages if severity & bit]
        self.messages.clear()
        if errors:
            raise DriverError("vulkan", VALIDATION_LAYER, None, f"{len(errors)} error(s)",
                              " | ".join(errors))

    # -- recordings ----------------------------------------------------------------------------
    def capture(self, issue):
        """The launches `issue()` makes, recorded once into a command buffer of their own
        (descriptor sets and push constants baked in) that replay() submits again."""
        if self._capturing is not None:
            raise RuntimeError("capture inside a capture")
        commands = self._command_buffer(self.lib.VK_COMMAND_BUFFER_USAGE_SIMULTANEOUS_USE_BIT)
        self._capturing = commands
        try:
            issue()
        except BaseException:
            self.lib.vkEndCommandBuffer(commands[0])
            self.lib.vkFreeCommandBuffers(self.device, self._command_pool, 1, commands)
            raise
        finally:
            self._capturing = None
        self._end(commands)
        return Recording(commands)

    def replay(self, recording):
        """Submits a recording after everything issued before it (writes included)."""
        self._not_capturing("replay")
        self._submit(recording.commands)
