"""Thin cffi binding of the ROCm runtime, libhsa-runtime64 (declarations, loader, errors).

What it is: the part of hsa.h and hsa_ext_amd.h that finds GPU agents, reads their properties and
memory pools, allocates and copies memory, creates signals and AQL queues, loads code objects and
times dispatches, declared for cffi's ABI mode, plus `Runtime`, whose methods are one runtime call
each with the out-parameters returned. A failed call raises `DriverError` with the name and text
that `hsa_status_string` gives (it answers before `hsa_init`, too). What it is not: choosing an
agent or a pool, packet scheduling, kernel argument layout — that is poot/backends/.

AQL packets are written straight into the queue's ring: fill the body, then publish the header and
setup together with one aligned 32-bit store (`publish_packet`), the last write the packet
processor may see, then ring the doorbell with the packet's index.
"""

import os

import cffi

from drivers import DriverError, load_library

LIBRARY = "libhsa-runtime64"
CANDIDATES = ("libhsa-runtime64.so.1", "/opt/rocm/lib/libhsa-runtime64.so.1")
ENV_VAR = "POOT_HSA_LIB"

ffi = cffi.FFI()
ffi.cdef("""
typedef enum {
  HSA_STATUS_SUCCESS = 0x0,
  HSA_STATUS_INFO_BREAK = 0x1,
  HSA_STATUS_ERROR = 0x1000,
  HSA_STATUS_ERROR_INVALID_ARGUMENT = 0x1001,
  HSA_STATUS_ERROR_OUT_OF_RESOURCES = 0x1008,
  HSA_STATUS_ERROR_NOT_INITIALIZED = 0x100B,
} hsa_status_t;

typedef struct hsa_dim3_s { uint32_t x; uint32_t y; uint32_t z; } hsa_dim3_t;
typedef struct hsa_agent_s { uint64_t handle; } hsa_agent_t;
typedef struct hsa_signal_s { uint64_t handle; } hsa_signal_t;
typedef struct hsa_region_s { uint64_t handle; } hsa_region_t;
typedef struct hsa_isa_s { uint64_t handle; } hsa_isa_t;
typedef struct hsa_code_object_reader_s { uint64_t handle; } hsa_code_object_reader_t;
typedef struct hsa_executable_s { uint64_t handle; } hsa_executable_t;
typedef struct hsa_loaded_code_object_s { uint64_t handle; } hsa_loaded_code_object_t;
typedef struct hsa_executable_symbol_s { uint64_t handle; } hsa_executable_symbol_t;
typedef struct hsa_amd_memory_pool_s { uint64_t handle; } hsa_amd_memory_pool_t;
typedef int64_t hsa_signal_value_t;   /* HSA_LARGE_MODEL */

typedef enum { HSA_DEVICE_TYPE_CPU = 0, HSA_DEVICE_TYPE_GPU = 1, HSA_DEVICE_TYPE_DSP = 2
} hsa_device_type_t;
typedef enum { HSA_PROFILE_BASE = 0, HSA_PROFILE_FULL = 1 } hsa_profile_t;
typedef enum {
  HSA_DEFAULT_FLOAT_ROUNDING_MODE_DEFAULT = 0,
  HSA_DEFAULT_FLOAT_ROUNDING_MODE_ZERO = 1,
  HSA_DEFAULT_FLOAT_ROUNDING_MODE_NEAR = 2
} hsa_default_float_rounding_mode_t;

typedef enum {
  HSA_SYSTEM_INFO_VERSION_MAJOR = 0,
  HSA_SYSTEM_INFO_VERSION_MINOR = 1,
  HSA_SYSTEM_INFO_TIMESTAMP_FREQUENCY = 3,
} hsa_system_info_t;

typedef enum {
  HSA_AGENT_INFO_NAME = 0,
  HSA_AGENT_INFO_PROFILE = 4,
  HSA_AGENT_INFO_WAVEFRONT_SIZE = 6,
  HSA_AGENT_INFO_WORKGROUP_MAX_SIZE = 8,
  HSA_AGENT_INFO_QUEUE_MAX_SIZE = 14,
  HSA_AGENT_INFO_DEVICE = 17,
  /* hsa_amd_agent_info_t (hsa_ext_amd.h), queried through the same call */
  HSA_AMD_AGENT_INFO_COMPUTE_UNIT_COUNT = 0xA002,
  HSA_AMD_AGENT_INFO_PRODUCT_NAME = 0xA009,
  HSA_AMD_AGENT_INFO_MEMORY_AVAIL = 0xA015,         /* newer runtimes only (not 5.2) */
} hsa_agent_info_t;

typedef enum {
  HSA_ISA_INFO_NAME_LENGTH = 0,
  HSA_ISA_INFO_NAME = 1,
} hsa_isa_info_t;

typedef enum {
  HSA_AMD_SEGMENT_GLOBAL = 0,
  HSA_AMD_SEGMENT_READONLY = 1,
  HSA_AMD_SEGMENT_PRIVATE = 2,
  HSA_AMD_SEGMENT_GROUP = 3,
} hsa_amd_segment_t;
typedef enum {
  HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_KERNARG_INIT = 1,
  HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_FINE_GRAINED = 2,
  HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_COARSE_GRAINED = 4
} hsa_amd_memory_pool_global_flag_t;
typedef enum {
  HSA_AMD_MEMORY_POOL_INFO_SEGMENT = 0,
  HSA_AMD_MEMORY_POOL_INFO_GLOBAL_FLAGS = 1,
  HSA_AMD_MEMORY_POOL_INFO_SIZE = 2,
  HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_ALLOWED = 5,
  HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_GRANULE = 6,
} hsa_amd_memory_pool_info_t;

typedef enum {
  HSA_SIGNAL_CONDITION_EQ = 0,
  HSA_SIGNAL_CONDITION_NE = 1,
  HSA_SIGNAL_CONDITION_LT = 2,
  HSA_SIGNAL_CONDITION_GTE = 3
} hsa_signal_condition_t;
typedef enum { HSA_WAIT_STATE_BLOCKED = 0, HSA_WAIT_STATE_ACTIVE = 1 } hsa_wait_state_t;

typedef enum {
  HSA_QUEUE_TYPE_MULTI = 0,
  HSA_QUEUE_TYPE_SINGLE = 1,
  HSA_QUEUE_TYPE_COOPERATIVE = 2
} hsa_queue_type_t;
typedef uint32_t hsa_queue_type32_t;
typedef struct hsa_queue_s {
  hsa_queue_type32_t type;
  uint32_t features;
  void *base_address;                  /* HSA_LARGE_MODEL */
  hsa_signal_t doorbell_signal;
  uint32_t size;
  uint32_t reserved1;
  uint64_t id;
} hsa_queue_t;

typedef enum {
  HSA_PACKET_TYPE_VENDOR_SPECIFIC = 0,
  HSA_PACKET_TYPE_INVALID = 1,
  HSA_PACKET_TYPE_KERNEL_DISPATCH = 2,
  HSA_PACKET_TYPE_BARRIER_AND = 3,
  HSA_PACKET_TYPE_AGENT_DISPATCH = 4,
  HSA_PACKET_TYPE_BARRIER_OR = 5
} hsa_packet_type_t;
typedef enum {
  HSA_FENCE_SCOPE_NONE = 0,
  HSA_FENCE_SCOPE_AGENT = 1,
  HSA_FENCE_SCOPE_SYSTEM = 2
} hsa_fence_scope_t;
typedef enum {
  HSA_PACKET_HEADER_TYPE = 0,
  HSA_PACKET_HEADER_BARRIER = 8,
  HSA_PACKET_HEADER_SCACQUIRE_FENCE_SCOPE = 9,
  HSA_PACKET_HEADER_SCRELEASE_FENCE_SCOPE = 11,
} hsa_packet_header_t;
typedef enum {
  HSA_PACKET_HEADER_WIDTH_TYPE = 8,
  HSA_PACKET_HEADER_WIDTH_BARRIER = 1,
  HSA_PACKET_HEADER_WIDTH_SCACQUIRE_FENCE_SCOPE = 2,
  HSA_PACKET_HEADER_WIDTH_SCRELEASE_FENCE_SCOPE = 2,
} hsa_packet_header_width_t;
typedef enum { HSA_KERNEL_DISPATCH_PACKET_SETUP_DIMENSIONS = 0 } hsa_kernel_dispatch_packet_setup_t;
typedef enum {
  HSA_KERNEL_DISPATCH_PACKET_SETUP_WIDTH_DIMENSIONS = 2
} hsa_kernel_dispatch_packet_setup_width_t;

typedef struct hsa_kernel_dispatch_packet_s {
  uint16_t header;
  uint16_t setup;
  uint16_t workgroup_size_x;
  uint16_t workgroup_size_y;
  uint16_t workgroup_size_z;
  uint16_t reserved0;
  uint32_t grid_size_x;
  uint32_t grid_size_y;
  uint32_t grid_size_z;
  uint32_t private_segment_size;
  uint32_t group_segment_size;
  uint64_t kernel_object;
  void *kernarg_address;               /* HSA_LARGE_MODEL */
  uint64_t reserved2;
  hsa_signal_t completion_signal;
} hsa_kernel_dispatch_packet_t;
typedef struct hsa_barrier_and_packet_s {
  uint16_t header;
  uint16_t reserved0;
  uint32_t reserved1;
  hsa_signal_t dep_signal[5];
  uint64_t reserved2;
  hsa_signal_t completion_signal;
} hsa_barrier_and_packet_t;

typedef enum {
  HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_KERNARG_SEGMENT_SIZE = 11,
  HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_GROUP_SEGMENT_SIZE = 13,
  HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_PRIVATE_SEGMENT_SIZE = 14,
  HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_OBJECT = 22,
} hsa_executable_symbol_info_t;

typedef struct hsa_amd_profiling_dispatch_time_s {
  uint64_t start;
  uint64_t end;
} hsa_amd_profiling_dispatch_time_t;

hsa_status_t hsa_status_string(hsa_status_t status, const char **status_string);
hsa_status_t hsa_init(void);
hsa_status_t hsa_shut_down(void);
hsa_status_t hsa_system_get_info(hsa_system_info_t attribute, void *value);

hsa_status_t hsa_iterate_agents(hsa_status_t (*callback)(hsa_agent_t agent, void *data),
                                void *data);
hsa_status_t hsa_agent_get_info(hsa_agent_t agent, hsa_agent_info_t attribute, void *value);
hsa_status_t hsa_agent_iterate_isas(hsa_agent_t agent,
                                    hsa_status_t (*callback)(hsa_isa_t isa, void *data),
                                    void *data);
hsa_status_t hsa_isa_get_info_alt(hsa_isa_t isa, hsa_isa_info_t attribute, void *value);

hsa_status_t hsa_amd_agent_iterate_memory_pools(
    hsa_agent_t agent, hsa_status_t (*callback)(hsa_amd_memory_pool_t memory_pool, void *data),
    void *data);
hsa_status_t hsa_amd_memory_pool_get_info(hsa_amd_memory_pool_t memory_pool,
                                          hsa_amd_memory_pool_info_t attribute, void *value);
hsa_status_t hsa_amd_memory_pool_allocate(hsa_amd_memory_pool_t memory_pool, size_t size,
                                          uint32_t flags, void **ptr);
hsa_status_t hsa_amd_memory_pool_free(void *ptr);
hsa_status_t hsa_amd_agents_allow_access(uint32_t num_agents, const hsa_agent_t *agents,
                                         const uint32_t *flags, const void *ptr);
hsa_status_t hsa_memory_copy(void *dst, const void *src, size_t size);
hsa_status_t hsa_amd_memory_async_copy(void *dst, hsa_agent_t dst_agent, const void *src,
                                       hsa_agent_t src_agent, size_t size,
                                       uint32_t num_dep_signals, const hsa_signal_t *dep_signals,
                                       hsa_signal_t completion_signal);

hsa_status_t hsa_signal_create(hsa_signal_value_t initial_value, uint32_t num_consumers,
                               const hsa_agent_t *consumers, hsa_signal_t *signal);
hsa_status_t hsa_signal_destroy(hsa_signal_t signal);
hsa_signal_value_t hsa_signal_load_scacquire(hsa_signal_t signal);
void hsa_signal_store_relaxed(hsa_signal_t signal, hsa_signal_value_t value);
void hsa_signal_store_screlease(hsa_signal_t signal, hsa_signal_value_t value);
hsa_signal_value_t hsa_signal_wait_scacquire(hsa_signal_t signal,
                                             hsa_signal_condition_t condition,
                                             hsa_signal_value_t compare_value,
                                             uint64_t timeout_hint,
                                             hsa_wait_state_t wait_state_hint);

hsa_status_t hsa_queue_create(hsa_agent_t agent, uint32_t size, hsa_queue_type32_t type,
                              void (*callback)(hsa_status_t status, hsa_queue_t *source,
                                               void *data),
                              void *data, uint32_t private_segment_size,
                              uint32_t group_segment_size, hsa_queue_t **queue);
hsa_status_t hsa_queue_destroy(hsa_queue_t *queue);
uint64_t hsa_queue_load_read_index_scacquire(const hsa_queue_t *queue);
uint64_t hsa_queue_add_write_index_scacq_screl(const hsa_queue_t *queue, uint64_t value);

hsa_status_t hsa_code_object_reader_create_from_memory(
    const void *code_object, size_t size, hsa_code_object_reader_t *code_object_reader);
hsa_status_t hsa_code_object_reader_destroy(hsa_code_object_reader_t code_object_reader);
hsa_status_t hsa_executable_create_alt(
    hsa_profile_t profile, hsa_default_float_rounding_mode_t default_float_rounding_mode,
    const char *options, hsa_executable_t *executable);
hsa_status_t hsa_executable_destroy(hsa_executable_t executable);
hsa_status_t hsa_executable_load_agent_code_object(
    hsa_executable_t executable, hsa_agent_t agent, hsa_code_object_reader_t code_object_reader,
    const char *options, hsa_loaded_code_object_t *loaded_code_object);
hsa_status_t hsa_executable_freeze(hsa_executable_t executable, const char *options);
hsa_status_t hsa_executable_get_symbol_by_name(hsa_executable_t executable,
                                               const char *symbol_name, const hsa_agent_t *agent,
                                               hsa_executable_symbol_t *symbol);
hsa_status_t hsa_executable_symbol_get_info(hsa_executable_symbol_t executable_symbol,
                                            hsa_executable_symbol_info_t attribute, void *value);

hsa_status_t hsa_amd_profiling_set_profiler_enabled(hsa_queue_t *queue, int enable);
hsa_status_t hsa_amd_profiling_get_dispatch_time(hsa_agent_t agent, hsa_signal_t signal,
                                                 hsa_amd_profiling_dispatch_time_t *time);
""")

# The declared enums' names, as module constants (HSA_AGENT_INFO_NAME, HSA_PACKET_TYPE_..., ...).
for _enum in ("hsa_status_t", "hsa_device_type_t", "hsa_profile_t",
              "hsa_default_float_rounding_mode_t", "hsa_system_info_t", "hsa_agent_info_t",
              "hsa_isa_info_t", "hsa_amd_segment_t", "hsa_amd_memory_pool_global_flag_t",
              "hsa_amd_memory_pool_info_t", "hsa_signal_condition_t", "hsa_wait_state_t",
              "hsa_queue_type_t", "hsa_packet_type_t", "hsa_fence_scope_t", "hsa_packet_header_t",
              "hsa_packet_header_width_t", "hsa_kernel_dispatch_packet_setup_t",
              "hsa_kernel_dispatch_packet_setup_width_t", "hsa_executable_symbol_info_t"):
    globals().update(ffi.typeof(_enum).relements)

HSA_STATUS_ERROR_INVALID_MEMORY_POOL = 40  # hsa_ext_amd.h's anonymous enum of AMD statuses
UINT32_MAX, UINT64_MAX = 2**32 - 1, 2**64 - 1

# The C type each attribute's value has, as the headers document it.
AGENT_INFO_TYPES = {
    HSA_AGENT_INFO_NAME: "char[64]", HSA_AGENT_INFO_PROFILE: "uint32_t",
    HSA_AGENT_INFO_WAVEFRONT_SIZE: "uint32_t", HSA_AGENT_INFO_WORKGROUP_MAX_SIZE: "uint32_t",
    HSA_AGENT_INFO_QUEUE_MAX_SIZE: "uint32_t", HSA_AGENT_INFO_DEVICE: "uint32_t",
    HSA_AMD_AGENT_INFO_COMPUTE_UNIT_COUNT: "uint32_t", HSA_AMD_AGENT_INFO_PRODUCT_NAME: "char[64]",
    HSA_AMD_AGENT_INFO_MEMORY_AVAIL: "uint64_t",
}
MEMORY_POOL_INFO_TYPES = {
    HSA_AMD_MEMORY_POOL_INFO_SEGMENT: "uint32_t", HSA_AMD_MEMORY_POOL_INFO_GLOBAL_FLAGS: "uint32_t",
    HSA_AMD_MEMORY_POOL_INFO_SIZE: "size_t", HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_ALLOWED: "bool",
    HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_GRANULE: "size_t",
}
SYMBOL_INFO_TYPES = {
    HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_KERNARG_SEGMENT_SIZE: "uint32_t",
    HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_GROUP_SEGMENT_SIZE: "uint32_t",
    HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_PRIVATE_SEGMENT_SIZE: "uint32_t",
    HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_OBJECT: "uint64_t",
}
SYSTEM_INFO_TYPES = {
    HSA_SYSTEM_INFO_VERSION_MAJOR: "uint16_t", HSA_SYSTEM_INFO_VERSION_MINOR: "uint16_t",
    HSA_SYSTEM_INFO_TIMESTAMP_FREQUENCY: "uint64_t",
}


def packet_header(packet_type, barrier=False, acquire=HSA_FENCE_SCOPE_SYSTEM,
                  release=HSA_FENCE_SCOPE_SYSTEM):
    """The 16-bit AQL header: type, barrier bit, acquire and release fence scopes."""
    return (packet_type << HSA_PACKET_HEADER_TYPE
            | int(barrier) << HSA_PACKET_HEADER_BARRIER
            | acquire << HSA_PACKET_HEADER_SCACQUIRE_FENCE_SCOPE
            | release << HSA_PACKET_HEADER_SCRELEASE_FENCE_SCOPE)


def queue_slot(queue, index, packet_type="hsa_kernel_dispatch_packet_t"):
    """The 64-byte ring slot of packet `index`, typed as `packet_type`."""
    slot = ffi.cast("char *", queue.base_address) + 64 * (index % queue.size)
    return ffi.cast(packet_type + " *", slot)


def publish_packet(slot, header, setup=0):
    """Write header and setup in one aligned 32-bit store, after the body (x86 keeps the order)."""
    ffi.cast("uint32_t *", slot)[0] = header | setup << 16


def _pointer(address):
    """A void * for an int address, a cdata pointer, or a writable buffer (numpy array, ...)."""
    if isinstance(address, int):
        return ffi.cast("void *", address)
    if isinstance(address, ffi.CData):
        return address
    return ffi.from_buffer(address)


class Runtime:
    """libhsa-runtime64, opened: one method per runtime call, out-parameters returned."""

    def __init__(self):
        self.lib, self.path = load_library(ffi, LIBRARY, CANDIDATES, ENV_VAR)
        self._reader_images = {}  # reader handle -> its bytes, which must outlive the reader

    def _check(self, call, status):
        if status in (HSA_STATUS_SUCCESS, HSA_STATUS_INFO_BREAK):
            return
        name, text = self._status_parts(status)
        if call == "hsa_init" and not os.path.exists("/dev/kfd"):
            text += " (/dev/kfd, the ROCm kernel driver's device, is absent on this machine)"
        raise DriverError(LIBRARY, call, status, name, text)

    def _out(self, ctype, call, *args, label=None):
        """Runtime call `call` with `args` and a new `ctype` out-parameter last, checked (an
        error names `label`, else the call); the value it wrote."""
        value = ffi.new(ctype + " *")
        self._check(label or call, getattr(self.lib, call)(*args, value))
        return value[0]

    def _status_parts(self, status):
        """hsa_status_string's "HSA_STATUS_ERROR_X: meaning", split into name and meaning."""
        string = ffi.new("const char **")
        if self.lib.hsa_status_string(status, string) != HSA_STATUS_SUCCESS or not string[0]:
            return f"hsa_status_t {status:#x}", "unknown status"
        name, _, text = ffi.string(string[0]).decode().partition(": ")
        return name, text or name

    def status_string(self, status):
        string = ffi.new("const char **")
        self._check("hsa_status_string", self.lib.hsa_status_string(status, string))
        return ffi.string(string[0]).decode()

    def init(self):
        self._check("hsa_init", self.lib.hsa_init())

    def shut_down(self):
        self._check("hsa_shut_down", self.lib.hsa_shut_down())

    def _get_info(self, call, types, attribute, *handle):
        """hsa_*_get_info of one attribute, of the C type `types` gives it, as Python: str for
        names, list for arrays, int otherwise."""
        ctype = types[attribute]
        value = ffi.new(ctype) if "[" in ctype else ffi.new(ctype + " *")
        self._check(f"{call}({attribute:#x})", getattr(self.lib, call)(*handle, attribute, value))
        if ctype.startswith("char["):
            return ffi.string(value).decode()
        return list(value) if "[" in ctype else value[0]

    def system_get_info(self, attribute):
        return self._get_info("hsa_system_get_info", SYSTEM_INFO_TYPES, attribute)

    # Agents and their ISAs.
    def _collect(self, call, iterate, handle_type, *leading):
        """Run an hsa_*_iterate_* call, returning every handle its callback was given."""
        handles = []

        @ffi.callback(f"hsa_status_t({handle_type}, void *)")
        def visit(handle, _data):
            handles.append(ffi.new(handle_type + " *", handle)[0])
            return HSA_STATUS_SUCCESS

        self._check(call, iterate(*leading, visit, ffi.NULL))
        return handles

    def agents(self):
        return self._collect("hsa_iterate_agents", self.lib.hsa_iterate_agents, "hsa_agent_t")

    def agent_get_info(self, agent, attribute):
        return self._get_info("hsa_agent_get_info", AGENT_INFO_TYPES, attribute, agent)

    def agent_isas(self, agent):
        return self._collect("hsa_agent_iterate_isas", self.lib.hsa_agent_iterate_isas,
                             "hsa_isa_t", agent)

    def isa_name(self, isa):
        length = ffi.new("uint32_t *")
        self._check("hsa_isa_get_info_alt",
                    self.lib.hsa_isa_get_info_alt(isa, HSA_ISA_INFO_NAME_LENGTH, length))
        name = ffi.new("char[]", length[0] + 1)
        self._check("hsa_isa_get_info_alt",
                    self.lib.hsa_isa_get_info_alt(isa, HSA_ISA_INFO_NAME, name))
        return ffi.string(name).decode()

    # Memory.
    def memory_pools(self, agent):
        return self._collect("hsa_amd_agent_iterate_memory_pools",
                             self.lib.hsa_amd_agent_iterate_memory_pools, "hsa_amd_memory_pool_t",
                             agent)

    def memory_pool_get_info(self, pool, attribute):
        return self._get_info("hsa_amd_memory_pool_get_info", MEMORY_POOL_INFO_TYPES, attribute,
                              pool)

    def memory_pool_allocate(self, pool, size, flags=0):
        """Allocate from the pool; return the address as an int."""
        pointer = ffi.new("void **")
        self._check("hsa_amd_memory_pool_allocate",
                    self.lib.hsa_amd_memory_pool_allocate(pool, size, flags, pointer))
        return int(ffi.cast("uintptr_t", pointer[0]))

    def memory_pool_free(self, address):
        self._check("hsa_amd_memory_pool_free",
                    self.lib.hsa_amd_memory_pool_free(_pointer(address)))

    def agents_allow_access(self, agents, address):
        array = ffi.new("hsa_agent_t[]", list(agents))
        self._check("hsa_amd_agents_allow_access",
                    self.lib.hsa_amd_agents_allow_access(len(array), array, ffi.NULL,
                                                         _pointer(address)))

    def memory_copy(self, dst, src, size):
        """Copy `size` bytes; each side an int address, a cdata pointer or a buffer."""
        self._check("hsa_memory_copy", self.lib.hsa_memory_copy(_pointer(dst), _pointer(src), size))

    def memory_async_copy(self, dst, dst_agent, src, src_agent, size, completion_signal,
                          dependencies=()):
        deps = ffi.new("hsa_signal_t[]", list(dependencies)) if dependencies else ffi.NULL
        self._check("hsa_amd_memory_async_copy",
                    self.lib.hsa_amd_memory_async_copy(_pointer(dst), dst_agent, _pointer(src),
                                                       src_agent, size, len(dependencies), deps,
                                                       completion_signal))

    # Signals.
    def signal_create(self, initial_value, consumers=()):
        array = ffi.new("hsa_agent_t[]", list(consumers)) if consumers else ffi.NULL
        return self._out("hsa_signal_t", "hsa_signal_create", initial_value, len(consumers), array)

    def signal_destroy(self, signal):
        self._check("hsa_signal_destroy", self.lib.hsa_signal_destroy(signal))

    def signal_load(self, signal):
        return self.lib.hsa_signal_load_scacquire(signal)

    def signal_store(self, signal, value):
        self.lib.hsa_signal_store_screlease(signal, value)

    def signal_store_relaxed(self, signal, value):
        self.lib.hsa_signal_store_relaxed(signal, value)

    def signal_wait(self, signal, condition, compare_value, timeout_hint=UINT64_MAX,
                    wait_state=HSA_WAIT_STATE_BLOCKED):
        """hsa_signal_wait_scacquire: the value once the condition held (or the time ran out)."""
        return self.lib.hsa_signal_wait_scacquire(signal, condition, compare_value, timeout_hint,
                                                  wait_state)

    # Queues.
    def queue_create(self, agent, size, queue_type=HSA_QUEUE_TYPE_MULTI,
                     private_segment_size=UINT32_MAX, group_segment_size=UINT32_MAX):
        """A user-mode AQL queue of `size` packets (a power of two); UINT32_MAX means no hint."""
        return self._out("hsa_queue_t *", "hsa_queue_create", agent, size, queue_type, ffi.NULL,
                         ffi.NULL, private_segment_size, group_segment_size)

    def queue_destroy(self, queue):
        self._check("hsa_queue_destroy", self.lib.hsa_queue_destroy(queue))

    def queue_load_read_index(self, queue):
        return self.lib.hsa_queue_load_read_index_scacquire(queue)

    def queue_add_write_index(self, queue, count):
        """Reserve `count` slots; return the index of the first."""
        return self.lib.hsa_queue_add_write_index_scacq_screl(queue, count)

    def ring_doorbell(self, queue, index):
        """Tell the packet processor that packets up to `index` are published."""
        self.lib.hsa_signal_store_screlease(queue.doorbell_signal, index)

    # Code objects.
    def code_object_reader_create_from_memory(self, image):
        image = bytes(image)
        reader = self._out("hsa_code_object_reader_t", "hsa_code_object_reader_create_from_memory",
                           image, len(image))
        self._reader_images[reader.handle] = image
        return reader

    def code_object_reader_destroy(self, reader):
        self._check("hsa_code_object_reader_destroy",
                    self.lib.hsa_code_object_reader_destroy(reader))
        self._reader_images.pop(reader.handle, None)

    def executable_create(self, profile, rounding=HSA_DEFAULT_FLOAT_ROUNDING_MODE_DEFAULT):
        return self._out("hsa_executable_t", "hsa_executable_create_alt", profile, rounding,
                         ffi.NULL)

    def executable_destroy(self, executable):
        self._check("hsa_executable_destroy", self.lib.hsa_executable_destroy(executable))

    def executable_load_agent_code_object(self, executable, agent, reader):
        return self._out("hsa_loaded_code_object_t", "hsa_executable_load_agent_code_object",
                         executable, agent, reader, ffi.NULL)

    def executable_freeze(self, executable):
        self._check("hsa_executable_freeze", self.lib.hsa_executable_freeze(executable, ffi.NULL))

    def executable_get_symbol_by_name(self, executable, name, agent):
        return self._out("hsa_executable_symbol_t", "hsa_executable_get_symbol_by_name",
                         executable, name.encode(), ffi.new("hsa_agent_t *", agent),
                         label=f"hsa_executable_get_symbol_by_name({name!r})")

    def executable_symbol_get_info(self, symbol, attribute):
        return self._get_info("hsa_executable_symbol_get_info", SYMBOL_INFO_TYPES, attribute,
                              symbol)

    # Profiling.
    def profiling_set_profiler_enabled(self, queue, enable):
        self._check("hsa_amd_profiling_set_profiler_enabled",
                    self.lib.hsa_amd_profiling_set_profiler_enabled(queue, int(bool(enable))))

    def profiling_get_dispatch_time(self, agent, signal):
        """(start, end) of the dispatch whose completion signal this is, in agent ticks."""
        time = ffi.new("hsa_amd_profiling_dispatch_time_t *")
        self._check("hsa_amd_profiling_get_dispatch_time",
                    self.lib.hsa_amd_profiling_get_dispatch_time(agent, signal, time))
        return time.start, time.end
