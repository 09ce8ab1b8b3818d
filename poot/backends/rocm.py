"""The ROCm Device: libhsa-runtime64 through drivers/hsa.py, kernels built by codegen/amdgpu.py.

Opens the ordinal-th GPU agent the runtime lists, with one AQL queue. Buffers come from the
agent's coarse-grained global pool; host data crosses through a fine-grained system staging buffer
with hsa_amd_memory_async_copy. A kernel is a code object comgr builds for the agent's ISA and
wavefront, loaded into an executable of its own. Nothing here chooses a backend or retries: a
device that cannot open raises BackendUnavailable with the runtime's words and what the host lacks.

Order: every dispatch packet carries the barrier bit, so a kernel starts once the packets before
it completed, with agent-scope fences between kernels. Copies join that one order through
signals: a copy waits on a barrier-AND packet whose system-scope release makes the kernels'
writes visible beyond the GPU's caches, and the next packet after a copy is a barrier-AND packet
waiting on the copy's signal, with a system-scope acquire. The last operation's signal is what
`synchronize` waits on. A captured step is its dispatch packets' bytes (kernel arguments in a
block of their own); `replay` writes them into the ring in bulk and rings the doorbell once.
"""
import os
import struct
import time
from dataclasses import dataclass

import numpy as np

from drivers import DriverError, hsa

from ..codegen.amdgpu import (AMDGPU_CAPS, WAVEFRONT, CodeObject, build_code_object,
                              compiler_isas, full_isa_name, isa_family)
from ..errors import BackendUnavailable, NoSuchDevice
from . import Device, workgroups

ffi = hsa.ffi
QUEUE_PACKETS = 1024        # ring slots (64 KiB); longer submissions go in ring-sized pieces
SIGNALS = 128               # completion signals reused round robin, in completion order
KERNARG_ARENA = 1 << 20     # kernel arguments of launches not yet synchronized
STAGING_ARENA = 32 << 20    # host <-> device copies pass through this much pinned memory at a time
ALIGN = 64
DISPATCH = struct.Struct("<HHHHHHIIIIIQQQQ")    # hsa_kernel_dispatch_packet_t
BARRIER_AND = struct.Struct("<HHI5QQQ")         # hsa_barrier_and_packet_t
DIMENSIONS = 3 << hsa.HSA_KERNEL_DISPATCH_PACKET_SETUP_DIMENSIONS
KERNEL_HEADER = hsa.packet_header(hsa.HSA_PACKET_TYPE_KERNEL_DISPATCH, barrier=True,
                                  acquire=hsa.HSA_FENCE_SCOPE_AGENT,
                                  release=hsa.HSA_FENCE_SCOPE_AGENT)
FENCE_HEADER = hsa.packet_header(hsa.HSA_PACKET_TYPE_BARRIER_AND, barrier=True)   # system scope
SCALAR_FORMAT = {"i32": "<i", "u32": "<I", "f32": "<f"}
MEMORY_AVAILABLE = "HSA_AMD_AGENT_INFO_MEMORY_AVAIL"
MEMORY_BY_POOL = "global pool size minus poot's allocations"


@dataclass(frozen=True)
class DeviceBuffer:
    pointer: int
    nbytes: int


@dataclass(frozen=True)
class Program:
    """A kernel loaded on the agent: its code object, executable and descriptor."""
    code: CodeObject
    executable: object
    reader: object
    kernel_object: int
    kernarg_size: int
    group_segment_size: int
    private_segment_size: int


@dataclass(frozen=True)
class Recording:
    """Dispatch packets of a captured step: images with INVALID headers, and the header|setup
    word each is published with; their kernel arguments live at `kernargs`."""
    packets: bytes
    words: tuple
    kernargs: int


def _align(n):
    return -(-n // ALIGN) * ALIGN


def _kfd_access():
    """What the host lacks about /dev/kfd beyond what the runtime's own error says."""
    if os.path.exists("/dev/kfd") and not os.access("/dev/kfd", os.R_OK | os.W_OK):
        return " (/dev/kfd exists but this user cannot open it: the render/video group grants it)"
    return ""


def kernel_arguments(code, kernel, grid, args):
    """The kernarg segment of a launch: explicit arguments where the code object's metadata
    puts them (pointers 8 bytes, scalars 4), then the hidden ones it declares: workgroup counts
    and sizes and the grid's dimension count where declared (code object v5 reads them), zeros
    elsewhere (global offsets, printf and queue pointers: unused by poot's kernels)."""
    data = bytearray(code.kernarg_size)
    explicit = code.explicit_args
    for param, arg, slot in zip(kernel.params, args, explicit, strict=True):
        if param.kind == "buffer":
            struct.pack_into("<Q", data, slot.offset, arg.pointer)
        else:
            struct.pack_into(SCALAR_FORMAT[param.dtype.name], data, slot.offset, arg)
    for slot in code.args[len(explicit):]:
        fmt = {2: "<H", 4: "<I"}.get(slot.size)
        axis = "xyz".find(slot.kind[-1])
        if slot.kind.startswith("hidden_block_count_") and fmt:
            struct.pack_into(fmt, data, slot.offset, grid[axis])
        elif slot.kind.startswith("hidden_group_size_") and fmt:
            struct.pack_into(fmt, data, slot.offset, kernel.workgroup[axis])
        elif slot.kind == "hidden_grid_dims" and fmt:
            struct.pack_into(fmt, data, slot.offset, 3)
    return bytes(data)


def dispatch_packet(program, kernel, grid, kernargs, signal):
    """The 64 bytes of a kernel-dispatch packet with an INVALID header (published later):
    `grid` in workgroups, `kernargs` and `signal` (0 for none) as addresses/handles."""
    wx, wy, wz = kernel.workgroup
    return DISPATCH.pack(hsa.HSA_PACKET_TYPE_INVALID, DIMENSIONS, wx, wy, wz, 0,
                         grid[0] * wx, grid[1] * wy, grid[2] * wz, program.private_segment_size,
                         program.group_segment_size, program.kernel_object, kernargs, 0, signal)


class RocmDevice(Device):
    backend = "rocm"
    features = frozenset({"capture", "timing"})
    max_buffer = None           # one pool allocation may take any amount the pool has

    def __init__(self, ordinal=0):
        super().__init__()
        try:
            self.rt = hsa.Runtime()
            self.rt.init()
        except DriverError as e:
            raise BackendUnavailable(f"rocm: {e}{_kfd_access()}") from None
        try:
            self._open_agent(ordinal)
            self._signals = [self.rt.signal_create(0) for _ in range(SIGNALS)]
            self._kernargs = self._host_block(self.kernarg_pool, KERNARG_ARENA)
            self._staging = self._host_block(self.staging_pool, STAGING_ARENA)
        except DriverError as e:
            self.rt.shut_down()
            raise BackendUnavailable(f"rocm: cannot open GPU agent {ordinal}: {e}") from None
        except (BackendUnavailable, NoSuchDevice):
            self.rt.shut_down()
            raise
        self.ordinal = ordinal
        self.caps = AMDGPU_CAPS
        self.allocated = 0
        self._next_signal = 0
        self._tail = None           # ("queue" or "copy", signal) of the last operation issued
        self._kernargs_used = self._staging_used = 0
        self._ring_words = ffi.cast("uint32_t *", self.queue.base_address)
        self._recording = None
        self._timed = None

    def _open_agent(self, ordinal):
        rt = self.rt
        agents = rt.agents()
        kinds = [rt.agent_get_info(a, hsa.HSA_AGENT_INFO_DEVICE) for a in agents]
        gpus = [a for a, kind in zip(agents, kinds) if kind == hsa.HSA_DEVICE_TYPE_GPU]
        cpus = [a for a, kind in zip(agents, kinds) if kind == hsa.HSA_DEVICE_TYPE_CPU]
        if not gpus:
            names = ", ".join(rt.agent_get_info(a, hsa.HSA_AGENT_INFO_NAME) for a in agents)
            raise BackendUnavailable(f"rocm: the HSA runtime ({rt.path}) started but lists no GPU "
                                     f"agent (agents: {names or 'none'})")
        if not 0 <= ordinal < len(gpus):
            raise NoSuchDevice(f"rocm: no GPU agent {ordinal} (the runtime sees {len(gpus)})")
        self.agent, self.cpu = gpus[ordinal], cpus[0]
        info = lambda attribute: rt.agent_get_info(self.agent, attribute)  # noqa: E731
        self.isa = rt.isa_name(rt.agent_isas(self.agent)[0])
        self.target = f"AMD code object for {self.isa}"
        processor = full_isa_name(self.isa).split("--")[1].split(":")[0]
        family = isa_family(self.isa)
        self.name = f"{info(hsa.HSA_AMD_AGENT_INFO_PRODUCT_NAME)} (rocm:{ordinal}, {processor})"
        if family not in WAVEFRONT:
            raise BackendUnavailable(f"rocm: {self.name} is {processor}; poot's AMDGPU kernels "
                                     f"need gfx9, gfx10 or gfx11")
        self.subgroup_size = info(hsa.HSA_AGENT_INFO_WAVEFRONT_SIZE)
        if self.subgroup_size != WAVEFRONT[family]:
            raise BackendUnavailable(f"rocm: {self.name} reports wavefront {self.subgroup_size}; "
                                     f"kernels for {processor} are built for {WAVEFRONT[family]}")
        try:
            known = compiler_isas()
        except DriverError as e:
            raise BackendUnavailable(f"rocm: no AMD code object compiler: {e}") from None
        if full_isa_name(processor) not in known:
            raise BackendUnavailable(f"rocm: {self.name}: the installed libamd_comgr cannot "
                                     f"compile for {processor}")
        self.multiprocessors = info(hsa.HSA_AMD_AGENT_INFO_COMPUTE_UNIT_COUNT)
        self.profile = info(hsa.HSA_AGENT_INFO_PROFILE)
        self.pool = self._pool(self.agent, hsa.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_COARSE_GRAINED)
        self.kernarg_pool = self._pool(self.cpu, hsa.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_KERNARG_INIT)
        self.staging_pool = self._pool(self.cpu, hsa.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_FINE_GRAINED)
        self.total = rt.memory_pool_get_info(self.pool, hsa.HSA_AMD_MEMORY_POOL_INFO_SIZE)
        self.granule = rt.memory_pool_get_info(self.pool,
                                               hsa.HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_GRANULE)
        try:
            info(hsa.HSA_AMD_AGENT_INFO_MEMORY_AVAIL)
            self.memory_source = MEMORY_AVAILABLE
        except DriverError:         # runtimes before ROCm 5.7 do not know the attribute
            self.memory_source = MEMORY_BY_POOL
        size = min(QUEUE_PACKETS, info(hsa.HSA_AGENT_INFO_QUEUE_MAX_SIZE))
        self.queue = rt.queue_create(self.agent, size)
        self.timestamp_frequency = rt.system_get_info(hsa.HSA_SYSTEM_INFO_TIMESTAMP_FREQUENCY)

    def _pool(self, agent, flag):
        """The agent's first global pool with `flag` that the runtime allocates from."""
        get = self.rt.memory_pool_get_info
        for pool in self.rt.memory_pools(agent):
            if (get(pool, hsa.HSA_AMD_MEMORY_POOL_INFO_SEGMENT) == hsa.HSA_AMD_SEGMENT_GLOBAL
                    and get(pool, hsa.HSA_AMD_MEMORY_POOL_INFO_GLOBAL_FLAGS) & flag
                    and get(pool, hsa.HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_ALLOWED)):
                return pool
        raise BackendUnavailable(f"rocm: {self.name}: no allocatable global memory pool with "
                                 f"flag {flag} on agent {agent.handle:#x}")

    def _host_block(self, pool, nbytes):
        """Host memory the GPU agent may read and write."""
        address = self.rt.memory_pool_allocate(pool, nbytes)
        self.rt.agents_allow_access([self.agent], address)
        return address

    # -- memory ----------------------------------------------------------------------------------
    def memory(self):
        """(free, total) bytes: free from the agent's available memory where the runtime has it,
        else the pool size minus what this device allocated (`memory_source` says which)."""
        if self.memory_source == MEMORY_AVAILABLE:
            free = self.rt.agent_get_info(self.agent, hsa.HSA_AMD_AGENT_INFO_MEMORY_AVAIL)
            return free, self.total
        return self.total - self.allocated, self.total

    def held(self):
        """(bytes of device memory held, where the figure comes from): total minus free, by
        the figure memory() reads."""
        free, total = self.memory()
        return total - free, self.memory_source

    def allocation_bytes(self, nbytes):
        """The device memory one buffer of `nbytes` takes: whole allocation granules of the
        pool (HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_GRANULE)."""
        return -(-max(int(nbytes), 1) // self.granule) * self.granule

    def alloc(self, nbytes):
        pointer = self.rt.memory_pool_allocate(self.pool, max(int(nbytes), 1))
        self.allocated += nbytes
        return DeviceBuffer(pointer, int(nbytes))

    def free(self, buffer):
        self.synchronize()          # work in flight may still use it
        self.rt.memory_pool_free(buffer.pointer)
        self.allocated -= buffer.nbytes

    def write(self, buffer, array, offset=0):
        """Host -> device in order with launches; the data is staged before this returns."""
        self._not_recording("write")
        data = np.ascontiguousarray(array)
        if offset + data.nbytes > buffer.nbytes:
            raise ValueError(f"write of {data.nbytes} bytes at {offset} into {buffer.nbytes}")
        source = ffi.from_buffer("char[]", data)
        for start in range(0, data.nbytes, STAGING_ARENA):
            piece = min(STAGING_ARENA, data.nbytes - start)
            staging = self._staging_space(piece)
            ffi.memmove(ffi.cast("char *", staging), source + start, piece)
            self._copy(buffer.pointer + offset + start, self.agent, staging, self.cpu, piece)

    def read(self, buffer, nbytes=None, offset=0):
        """Device -> host, after everything issued before it."""
        self._not_recording("read")
        nbytes = buffer.nbytes if nbytes is None else nbytes
        out = bytearray(nbytes)
        target = ffi.from_buffer("char[]", out)
        for start in range(0, nbytes, STAGING_ARENA):
            piece = min(STAGING_ARENA, nbytes - start)
            staging = self._staging_space(piece)
            self._copy(staging, self.cpu, buffer.pointer + offset + start, self.agent, piece)
            self.synchronize()
            ffi.memmove(target + start, ffi.cast("char *", staging), piece)
        return bytes(out)

    def copy(self, dst, src, nbytes):
        self._not_recording("copy")
        self._copy(dst.pointer, self.agent, src.pointer, self.agent, nbytes)

    def _copy(self, dst, dst_agent, src, src_agent, nbytes):
        dependencies = self._before_copy()
        signal = self._signal()
        self.rt.memory_async_copy(dst, dst_agent, src, src_agent, nbytes, signal, dependencies)
        self._tail = ("copy", signal)

    def _before_copy(self):
        """The signals a copy waits on: the last copy, or a system-scope fence after kernels."""
        if self._tail is None:
            return ()
        kind, signal = self._tail
        if kind == "copy":
            return (signal,)
        fence = self._signal()
        self._submit(BARRIER_AND.pack(hsa.HSA_PACKET_TYPE_INVALID, 0, 0, 0, 0, 0, 0, 0, 0,
                                      fence.handle), [FENCE_HEADER])
        return (fence,)

    def _before_packets(self):
        """Packets after a copy wait for it behind a barrier-AND packet (system-scope acquire)."""
        if self._tail is not None and self._tail[0] == "copy":
            self._submit(BARRIER_AND.pack(hsa.HSA_PACKET_TYPE_INVALID, 0, 0,
                                          self._tail[1].handle, 0, 0, 0, 0, 0, 0), [FENCE_HEADER])

    def _staging_space(self, nbytes):
        if self._staging_used + nbytes > STAGING_ARENA:
            self.synchronize()
        address = self._staging + self._staging_used
        self._staging_used += _align(nbytes)
        return address

    def _kernarg_space(self, nbytes):
        if self._kernargs_used + nbytes > KERNARG_ARENA:
            self.synchronize()
        address = self._kernargs + self._kernargs_used
        self._kernargs_used += _align(nbytes)
        return address

    # -- signals and the queue -------------------------------------------------------------------
    def _signal(self):
        """The next completion signal of the ring, set to 1 once its last use completed."""
        signal = self._signals[self._next_signal % SIGNALS]
        self._next_signal += 1
        self._wait(signal)
        self.rt.signal_store_relaxed(signal, 1)
        return signal

    def _wait(self, signal):
        # hsa_signal_wait may return before the condition holds: the value decides.
        while self.rt.signal_wait(signal, hsa.HSA_SIGNAL_CONDITION_EQ, 0) != 0:
            pass

    def _submit(self, images, words):
        """Publishes packets in order: all bodies (their headers INVALID) first, then each
        header|setup word, then one doorbell per ring's worth of packets."""
        size = self.queue.size
        for first in range(0, len(words), size):
            count = min(size, len(words) - first)
            index = self.rt.queue_add_write_index(self.queue, count)
            while index + count - self.rt.queue_load_read_index(self.queue) > size:
                time.sleep(0)
            body = memoryview(images)[first * 64:(first + count) * 64]
            slot = index % size
            head = min(count, size - slot)          # up to the end of the ring, then from its start
            base = ffi.cast("char *", self.queue.base_address)
            ffi.memmove(base + slot * 64, ffi.from_buffer(body[:head * 64]), head * 64)
            if count > head:
                ffi.memmove(base, ffi.from_buffer(body[head * 64:]), (count - head) * 64)
            for i in range(count):      # x86 keeps store order: each body is visible first
                self._ring_words[((index + i) % size) * 16] = words[first + i]
            self.rt.ring_doorbell(self.queue, index + count - 1)

    # -- programs and launches -------------------------------------------------------------------
    def build(self, kernel):
        """The loaded kernel (built by comgr for this agent's ISA)."""
        rt = self.rt
        code = build_code_object(kernel, self.isa, self.subgroup_size)
        reader = rt.code_object_reader_create_from_memory(code.image)
        executable = rt.executable_create(self.profile)
        rt.executable_load_agent_code_object(executable, self.agent, reader)
        rt.executable_freeze(executable)
        symbol = rt.executable_get_symbol_by_name(executable, code.symbol, self.agent)
        info = lambda what: rt.executable_symbol_get_info(  # noqa: E731
            symbol, getattr(hsa, "HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_" + what))
        program = Program(code, executable, reader, info("OBJECT"),
                          info("KERNARG_SEGMENT_SIZE"), info("GROUP_SEGMENT_SIZE"),
                          info("PRIVATE_SEGMENT_SIZE"))
        if program.kernarg_size != code.kernarg_size:
            raise RuntimeError(f"{kernel.name}: the loader says {program.kernarg_size} bytes of "
                               f"kernel arguments, the metadata {code.kernarg_size}")
        return program

    def launch(self, program, kernel, grid, args):
        """One dispatch in order after everything issued before; args follow kernel.params."""
        grid = workgroups(kernel, grid)
        arguments = kernel_arguments(program.code, kernel, grid, args)
        if self._recording is not None:
            self._recording.append((program, kernel, grid, arguments))
            return
        address = self._kernarg_space(len(arguments))
        ffi.memmove(ffi.cast("char *", address), arguments, len(arguments))
        if self._timed is None:
            signal = self._signal()
        else:
            signal = self.rt.signal_create(1)
            self._timed.append((kernel.name, signal))
        self._before_packets()
        self._submit(dispatch_packet(program, kernel, grid, address, signal.handle),
                     [KERNEL_HEADER | DIMENSIONS << 16])
        self._tail = ("queue", signal)

    def synchronize(self):
        """Waits for the last operation's signal; everything before it has completed too."""
        if self._tail is not None:
            self._wait(self._tail[1])
        self._kernargs_used = self._staging_used = 0

    def _not_recording(self, what):
        if self._recording is not None:
            raise RuntimeError(f"rocm: a {what} inside capture(); only launches are recorded")

    # -- timing ----------------------------------------------------------------------------------
    def start_timing(self):
        """Times every launch from now on by its completion signal (--device-timing)."""
        self.rt.profiling_set_profiler_enabled(self.queue, True)
        self._timed = []

    def stop_timing(self):
        """[(kernel name, seconds)] of the launches since start_timing, in launch order."""
        self.synchronize()
        out = []
        for name, signal in self._timed:
            start, end = self.rt.profiling_get_dispatch_time(self.agent, signal)
            out.append((name, (end - start) / self.timestamp_frequency))
            self.rt.signal_destroy(signal)
        self._timed, self._tail = None, None     # everything completed; those signals are gone
        self.rt.profiling_set_profiler_enabled(self.queue, False)
        return out

    # -- captured steps --------------------------------------------------------------------------
    def capture(self, issue):
        """The dispatch packets of the launches `issue()` makes, with their kernel arguments
        in a block of their own; nothing runs until `replay`."""
        if self._timed is not None:
            raise RuntimeError("rocm: capture while timing launches one by one")
        self._recording = []
        try:
            issue()
        finally:
            launches, self._recording = self._recording, None
        block = self._host_block(self.kernarg_pool,
                                 max(sum(_align(len(a)) for *_, a in launches), ALIGN))
        packets, address = bytearray(), block
        for program, kernel, grid, arguments in launches:
            ffi.memmove(ffi.cast("char *", address), arguments, len(arguments))
            packets += dispatch_packet(program, kernel, grid, address, 0)
            address += _align(len(arguments))
        words = (KERNEL_HEADER | DIMENSIONS << 16,) * len(launches)
        return Recording(bytes(packets), words, block)

    def replay(self, recording):
        """The recorded packets, published in bulk; the last one signals completion."""
        if not recording.words:
            return
        signal = self._signal()
        packets = bytearray(recording.packets)
        struct.pack_into("<Q", packets, len(packets) - 8, signal.handle)
        self._before_packets()
        self._submit(packets, recording.words)
        self._tail = ("queue", signal)
