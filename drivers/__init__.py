"""Thin cffi (ABI mode) bindings to the vendors' driver libraries, one module per library.

This package holds what every binding shares: `DriverError`, the one exception a failed driver
call becomes, and `load_library`, which finds a library and lets an environment variable name
another copy (the seam tests use to make a library absent). It holds no policy: which device,
which memory, whether to retry, all belong to `poot/backends/`.
"""

import os


class DriverError(Exception):
    """A native call failed: which library and call, the status code, its name and its meaning."""

    def __init__(self, library, call, code, name, text):
        self.library, self.call, self.code, self.name, self.text = library, call, code, name, text
        words = " ".join(str(text).split())  # drivers write several lines; a message is one
        status = name if code is None else f"{name} ({code})"
        super().__init__(f"{call} failed: {status}: {words}")


class LibraryNotFound(DriverError):
    """No candidate path of a library could be opened; `tried` pairs each path with the reason."""

    def __init__(self, library, tried):
        self.tried = list(tried)
        paths = "; ".join(f"{path} ({reason})" for path, reason in self.tried)
        paths = paths or "no candidate path"
        super().__init__(library, "dlopen", None, "library not found", f"{library}: tried {paths}")


def load_library(ffi, library, candidates, env_var):
    """Open `library` with `ffi.dlopen`; return (lib, path).

    When the environment variable `env_var` is set, its value is the only path tried, so a test can
    make the library absent (`POOT_VULKAN_LIB=/nonexistent`). Otherwise each candidate (a bare
    soname searched by the dynamic loader, or a full path) is tried in order.
    """
    override = os.environ.get(env_var)
    paths = [override] if override else list(candidates)
    tried = []
    for path in paths:
        try:
            return ffi.dlopen(path), path
        except OSError as error:
            # cffi appends a sentence about ctypes.util.find_library to the loader's own words
            reason = str(error).split("  Additionally, ctypes.util")[0].strip()
            tried.append((f"{path} (from {env_var})" if override else path, reason))
    raise LibraryNotFound(library, tried)
