"""Thin cffi binding of AMD's code object manager, libamd_comgr (declarations, loader, errors).

What it is: the part of amd_comgr.h that turns OpenCL C or AMDGCN assembly into an executable code
object and reads that object's metadata back, declared for cffi's ABI mode, and `Comgr`, whose
methods are one library call each with the out-parameters returned. A failed call raises
`DriverError` with the status name and `amd_comgr_status_string`'s text; a failed action adds the
compiler's log. What it is not: which ISA, which options, which pipeline of actions — that is
poot/codegen's job.

The action and language numbers were renumbered between interface 2.x (ROCm 5, the header this
follows) and 3.x (ROCm 6.2 on), so those two are named by strings and looked up for the interface
the opened library reports; every other number is the same in both.
"""

import cffi

from drivers import DriverError, load_library

LIBRARY = "libamd_comgr"
CANDIDATES = ("libamd_comgr.so.3", "libamd_comgr.so.2", "libamd_comgr.so",
              "/opt/rocm/lib/libamd_comgr.so")
ENV_VAR = "POOT_COMGR_LIB"

ffi = cffi.FFI()
ffi.cdef("""
typedef enum amd_comgr_status_s {
  AMD_COMGR_STATUS_SUCCESS = 0x0,
  AMD_COMGR_STATUS_ERROR = 0x1,
  AMD_COMGR_STATUS_ERROR_INVALID_ARGUMENT = 0x2,
  AMD_COMGR_STATUS_ERROR_OUT_OF_RESOURCES = 0x3,
} amd_comgr_status_t;

typedef int amd_comgr_language_t;     /* enum amd_comgr_language_s: see LANGUAGES */
typedef int amd_comgr_action_kind_t;  /* enum amd_comgr_action_kind_s: see ACTIONS */

typedef enum amd_comgr_data_kind_s {
  AMD_COMGR_DATA_KIND_UNDEF = 0x0,
  AMD_COMGR_DATA_KIND_SOURCE = 0x1,
  AMD_COMGR_DATA_KIND_INCLUDE = 0x2,
  AMD_COMGR_DATA_KIND_PRECOMPILED_HEADER = 0x3,
  AMD_COMGR_DATA_KIND_DIAGNOSTIC = 0x4,
  AMD_COMGR_DATA_KIND_LOG = 0x5,
  AMD_COMGR_DATA_KIND_BC = 0x6,
  AMD_COMGR_DATA_KIND_RELOCATABLE = 0x7,
  AMD_COMGR_DATA_KIND_EXECUTABLE = 0x8,
  AMD_COMGR_DATA_KIND_BYTES = 0x9,
  AMD_COMGR_DATA_KIND_FATBIN = 0x10,
} amd_comgr_data_kind_t;

typedef enum amd_comgr_metadata_kind_s {
  AMD_COMGR_METADATA_KIND_NULL = 0x0,
  AMD_COMGR_METADATA_KIND_STRING = 0x1,
  AMD_COMGR_METADATA_KIND_MAP = 0x2,
  AMD_COMGR_METADATA_KIND_LIST = 0x3,
} amd_comgr_metadata_kind_t;

typedef struct amd_comgr_data_s { uint64_t handle; } amd_comgr_data_t;
typedef struct amd_comgr_data_set_s { uint64_t handle; } amd_comgr_data_set_t;
typedef struct amd_comgr_action_info_s { uint64_t handle; } amd_comgr_action_info_t;
typedef struct amd_comgr_metadata_node_s { uint64_t handle; } amd_comgr_metadata_node_t;

amd_comgr_status_t amd_comgr_status_string(amd_comgr_status_t status, const char **status_string);
void amd_comgr_get_version(size_t *major, size_t *minor);
amd_comgr_status_t amd_comgr_get_isa_count(size_t *count);
amd_comgr_status_t amd_comgr_get_isa_name(size_t index, const char **isa_name);

amd_comgr_status_t amd_comgr_create_data(amd_comgr_data_kind_t kind, amd_comgr_data_t *data);
amd_comgr_status_t amd_comgr_release_data(amd_comgr_data_t data);
amd_comgr_status_t amd_comgr_get_data_kind(amd_comgr_data_t data, amd_comgr_data_kind_t *kind);
amd_comgr_status_t amd_comgr_set_data(amd_comgr_data_t data, size_t size, const char *bytes);
amd_comgr_status_t amd_comgr_set_data_name(amd_comgr_data_t data, const char *name);
amd_comgr_status_t amd_comgr_get_data(amd_comgr_data_t data, size_t *size, char *bytes);
amd_comgr_status_t amd_comgr_get_data_name(amd_comgr_data_t data, size_t *size, char *name);
amd_comgr_status_t amd_comgr_get_data_metadata(amd_comgr_data_t data,
                                               amd_comgr_metadata_node_t *metadata);
amd_comgr_status_t amd_comgr_destroy_metadata(amd_comgr_metadata_node_t metadata);

amd_comgr_status_t amd_comgr_create_data_set(amd_comgr_data_set_t *data_set);
amd_comgr_status_t amd_comgr_destroy_data_set(amd_comgr_data_set_t data_set);
amd_comgr_status_t amd_comgr_data_set_add(amd_comgr_data_set_t data_set, amd_comgr_data_t data);
amd_comgr_status_t amd_comgr_action_data_count(amd_comgr_data_set_t data_set,
                                               amd_comgr_data_kind_t data_kind, size_t *count);
amd_comgr_status_t amd_comgr_action_data_get_data(amd_comgr_data_set_t data_set,
                                                  amd_comgr_data_kind_t data_kind, size_t index,
                                                  amd_comgr_data_t *data);

amd_comgr_status_t amd_comgr_create_action_info(amd_comgr_action_info_t *action_info);
amd_comgr_status_t amd_comgr_destroy_action_info(amd_comgr_action_info_t action_info);
amd_comgr_status_t amd_comgr_action_info_set_isa_name(amd_comgr_action_info_t action_info,
                                                      const char *isa_name);
amd_comgr_status_t amd_comgr_action_info_set_language(amd_comgr_action_info_t action_info,
                                                      amd_comgr_language_t language);
amd_comgr_status_t amd_comgr_action_info_set_option_list(amd_comgr_action_info_t action_info,
                                                         const char *options[], size_t count);
amd_comgr_status_t amd_comgr_action_info_set_logging(amd_comgr_action_info_t action_info,
                                                     bool logging);
amd_comgr_status_t amd_comgr_do_action(amd_comgr_action_kind_t kind, amd_comgr_action_info_t info,
                                       amd_comgr_data_set_t input, amd_comgr_data_set_t result);

amd_comgr_status_t amd_comgr_get_metadata_kind(amd_comgr_metadata_node_t metadata,
                                               amd_comgr_metadata_kind_t *kind);
amd_comgr_status_t amd_comgr_get_metadata_string(amd_comgr_metadata_node_t metadata,
                                                 size_t *size, char *string);
amd_comgr_status_t amd_comgr_get_metadata_map_size(amd_comgr_metadata_node_t metadata,
                                                   size_t *size);
amd_comgr_status_t amd_comgr_metadata_lookup(amd_comgr_metadata_node_t metadata, const char *key,
                                             amd_comgr_metadata_node_t *value);
amd_comgr_status_t amd_comgr_get_metadata_list_size(amd_comgr_metadata_node_t metadata,
                                                    size_t *size);
amd_comgr_status_t amd_comgr_index_list_metadata(amd_comgr_metadata_node_t metadata, size_t index,
                                                 amd_comgr_metadata_node_t *value);
""")

# The declared enums' names, as module constants (AMD_COMGR_DATA_KIND_EXECUTABLE, ...).
for _enum in ("amd_comgr_status_t", "amd_comgr_data_kind_t", "amd_comgr_metadata_kind_t"):
    globals().update(ffi.typeof(_enum).relements)

# amd_comgr_language_s and amd_comgr_action_kind_s, by interface major version.
LANGUAGES = {
    # LLVM_IR arrived in a later 2.x: interface 2.4 (ROCm 5.2) answers it with INVALID_ARGUMENT.
    2: {"NONE": 0x0, "OPENCL_1_2": 0x1, "OPENCL_2_0": 0x2, "HC": 0x3, "HIP": 0x4, "LLVM_IR": 0x5},
    3: {"NONE": 0x0, "OPENCL_1_2": 0x1, "OPENCL_2_0": 0x2, "HIP": 0x3, "LLVM_IR": 0x4},
}
ACTIONS = {
    2: {
        "SOURCE_TO_PREPROCESSOR": 0x0, "ADD_PRECOMPILED_HEADERS": 0x1,
        "COMPILE_SOURCE_TO_BC": 0x2, "ADD_DEVICE_LIBRARIES": 0x3, "LINK_BC_TO_BC": 0x4,
        "OPTIMIZE_BC_TO_BC": 0x5, "CODEGEN_BC_TO_RELOCATABLE": 0x6,
        "CODEGEN_BC_TO_ASSEMBLY": 0x7, "LINK_RELOCATABLE_TO_RELOCATABLE": 0x8,
        "LINK_RELOCATABLE_TO_EXECUTABLE": 0x9, "ASSEMBLE_SOURCE_TO_RELOCATABLE": 0xA,
        "DISASSEMBLE_RELOCATABLE_TO_SOURCE": 0xB, "DISASSEMBLE_EXECUTABLE_TO_SOURCE": 0xC,
        "DISASSEMBLE_BYTES_TO_SOURCE": 0xD, "COMPILE_SOURCE_TO_FATBIN": 0xE,
        "COMPILE_SOURCE_WITH_DEVICE_LIBS_TO_BC": 0xF,
    },
    3: {
        "SOURCE_TO_PREPROCESSOR": 0x0, "ADD_PRECOMPILED_HEADERS": 0x1,
        "COMPILE_SOURCE_TO_BC": 0x2, "LINK_BC_TO_BC": 0x3, "CODEGEN_BC_TO_RELOCATABLE": 0x4,
        "CODEGEN_BC_TO_ASSEMBLY": 0x5, "LINK_RELOCATABLE_TO_RELOCATABLE": 0x6,
        "LINK_RELOCATABLE_TO_EXECUTABLE": 0x7, "ASSEMBLE_SOURCE_TO_RELOCATABLE": 0x8,
        "DISASSEMBLE_RELOCATABLE_TO_SOURCE": 0x9, "DISASSEMBLE_EXECUTABLE_TO_SOURCE": 0xA,
        "DISASSEMBLE_BYTES_TO_SOURCE": 0xB, "COMPILE_SOURCE_WITH_DEVICE_LIBS_TO_BC": 0xC,
        "COMPILE_SOURCE_TO_RELOCATABLE": 0xD, "COMPILE_SOURCE_TO_EXECUTABLE": 0xE,
        "UNBUNDLE": 0xF,
    },
}


class Comgr:
    """libamd_comgr, opened: one method per library call, out-parameters returned."""

    def __init__(self):
        self.lib, self.path = load_library(ffi, LIBRARY, CANDIDATES, ENV_VAR)
        major, minor = ffi.new("size_t *"), ffi.new("size_t *")
        self.lib.amd_comgr_get_version(major, minor)
        self.version = (major[0], minor[0])
        if major[0] not in ACTIONS:
            raise DriverError(LIBRARY, "amd_comgr_get_version", None, "unsupported interface",
                              f"{self.path} reports interface {major[0]}.{minor[0]}; "
                              f"this binding knows {sorted(ACTIONS)}")
        self.actions, self.languages = ACTIONS[major[0]], LANGUAGES[major[0]]

    def _check(self, call, status, log=""):
        if status == AMD_COMGR_STATUS_SUCCESS:
            return
        text = ffi.new("const char **")
        if self.lib.amd_comgr_status_string(status, text) == AMD_COMGR_STATUS_SUCCESS:
            words = ffi.string(text[0]).decode()
        else:
            words = "unknown status"
        name = ffi.typeof("amd_comgr_status_t").elements.get(status, f"amd_comgr_status_t {status}")
        raise DriverError(LIBRARY, call, status, name, f"{words}: {log}" if log else words)

    def _out(self, ctype, call, *args, label=None):
        """Library call `call` with `args` and a new `ctype` out-parameter last, checked (an
        error names `label`, else the call); the value it wrote."""
        value = ffi.new(ctype + " *")
        self._check(label or call, getattr(self.lib, call)(*args, value))
        return value[0]

    def status_string(self, status):
        text = ffi.new("const char **")
        self._check("amd_comgr_status_string", self.lib.amd_comgr_status_string(status, text))
        return ffi.string(text[0]).decode()

    def isa_names(self):
        """Every ISA this library can target (amd_comgr_get_isa_count / _get_isa_name)."""
        count = ffi.new("size_t *")
        self._check("amd_comgr_get_isa_count", self.lib.amd_comgr_get_isa_count(count))
        names = []
        for index in range(count[0]):
            name = ffi.new("const char **")
            self._check("amd_comgr_get_isa_name", self.lib.amd_comgr_get_isa_name(index, name))
            names.append(ffi.string(name[0]).decode())
        return names

    # Data objects.
    def create_data(self, kind):
        return self._out("amd_comgr_data_t", "amd_comgr_create_data", kind)

    def release_data(self, data):
        self._check("amd_comgr_release_data", self.lib.amd_comgr_release_data(data))

    def get_data_kind(self, data):
        return self._out("amd_comgr_data_kind_t", "amd_comgr_get_data_kind", data)

    def set_data(self, data, content):
        content = content.encode() if isinstance(content, str) else bytes(content)
        self._check("amd_comgr_set_data", self.lib.amd_comgr_set_data(data, len(content), content))

    def set_data_name(self, data, name):
        self._check("amd_comgr_set_data_name",
                    self.lib.amd_comgr_set_data_name(data, name.encode()))

    def get_data(self, data):
        """The data object's bytes (asks for the size first, as the header prescribes)."""
        return self._sized_bytes("amd_comgr_get_data", self.lib.amd_comgr_get_data, data)

    def get_data_name(self, data):
        name = self._sized_bytes("amd_comgr_get_data_name", self.lib.amd_comgr_get_data_name, data)
        return name.rstrip(b"\0").decode()

    def _sized_bytes(self, call, function, handle):
        size = ffi.new("size_t *")
        self._check(call, function(handle, size, ffi.NULL))
        buffer = ffi.new("char[]", size[0] or 1)
        self._check(call, function(handle, size, buffer))
        return ffi.buffer(buffer, size[0])[:]

    # Data sets.
    def create_data_set(self):
        return self._out("amd_comgr_data_set_t", "amd_comgr_create_data_set")

    def destroy_data_set(self, data_set):
        self._check("amd_comgr_destroy_data_set", self.lib.amd_comgr_destroy_data_set(data_set))

    def data_set_add(self, data_set, data):
        self._check("amd_comgr_data_set_add", self.lib.amd_comgr_data_set_add(data_set, data))

    def action_data_count(self, data_set, kind):
        return self._out("size_t", "amd_comgr_action_data_count", data_set, kind)

    def action_data_get_data(self, data_set, kind, index):
        """The index-th data object of `kind` in the set; the caller releases it."""
        return self._out("amd_comgr_data_t", "amd_comgr_action_data_get_data", data_set, kind,
                         index)

    # Action info and actions.
    def create_action_info(self):
        return self._out("amd_comgr_action_info_t", "amd_comgr_create_action_info")

    def destroy_action_info(self, info):
        self._check("amd_comgr_destroy_action_info", self.lib.amd_comgr_destroy_action_info(info))

    def action_info_set_isa_name(self, info, isa_name):
        self._check("amd_comgr_action_info_set_isa_name",
                    self.lib.amd_comgr_action_info_set_isa_name(info, isa_name.encode()))

    def action_info_set_language(self, info, language):
        """`language` by its header name without the prefix: "OPENCL_1_2", "LLVM_IR", ..."""
        self._check("amd_comgr_action_info_set_language",
                    self.lib.amd_comgr_action_info_set_language(info, self.languages[language]))

    def action_info_set_option_list(self, info, options):
        strings = [ffi.new("char[]", option.encode()) for option in options]
        array = ffi.new("const char *[]", strings) if strings else ffi.NULL
        self._check("amd_comgr_action_info_set_option_list",
                    self.lib.amd_comgr_action_info_set_option_list(info, array, len(strings)))

    def action_info_set_logging(self, info, logging):
        self._check("amd_comgr_action_info_set_logging",
                    self.lib.amd_comgr_action_info_set_logging(info, bool(logging)))

    def do_action(self, action, info, inputs, result):
        """Run `action` ("COMPILE_SOURCE_WITH_DEVICE_LIBS_TO_BC", ...) from `inputs` into `result`.

        On failure the DriverError's text carries the log objects the action left in `result`
        (present when logging was set on `info`).
        """
        status = self.lib.amd_comgr_do_action(self.actions[action], info, inputs, result)
        if status != AMD_COMGR_STATUS_SUCCESS:
            self._check(f"amd_comgr_do_action({action})", status, self.logs(result))

    def logs(self, data_set):
        """The text of every log object in the set, joined."""
        texts = []
        for index in range(self.action_data_count(data_set, AMD_COMGR_DATA_KIND_LOG)):
            data = self.action_data_get_data(data_set, AMD_COMGR_DATA_KIND_LOG, index)
            try:
                texts.append(self.get_data(data).decode(errors="replace").strip("\0 \n"))
            finally:
                self.release_data(data)
        return "\n".join(text for text in texts if text)

    # Metadata.
    def get_data_metadata(self, data):
        return self._out("amd_comgr_metadata_node_t", "amd_comgr_get_data_metadata", data)

    def destroy_metadata(self, node):
        self._check("amd_comgr_destroy_metadata", self.lib.amd_comgr_destroy_metadata(node))

    def get_metadata_kind(self, node):
        return self._out("amd_comgr_metadata_kind_t", "amd_comgr_get_metadata_kind", node)

    def get_metadata_string(self, node):
        text = self._sized_bytes("amd_comgr_get_metadata_string",
                                 self.lib.amd_comgr_get_metadata_string, node)
        return text.rstrip(b"\0").decode()

    def get_metadata_map_size(self, node):
        return self._out("size_t", "amd_comgr_get_metadata_map_size", node)

    def metadata_lookup(self, node, key):
        """The value under `key` in a map node; the caller destroys it."""
        return self._out("amd_comgr_metadata_node_t", "amd_comgr_metadata_lookup", node,
                         key.encode(), label=f"amd_comgr_metadata_lookup({key!r})")

    def get_metadata_list_size(self, node):
        return self._out("size_t", "amd_comgr_get_metadata_list_size", node)

    def index_list_metadata(self, node, index):
        """The index-th element of a list node; the caller destroys it."""
        return self._out("amd_comgr_metadata_node_t", "amd_comgr_index_list_metadata", node, index)
