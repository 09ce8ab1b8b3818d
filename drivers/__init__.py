"""Thin cffi (ABI mode) bindings to the vendors' driver libraries, one module per library.

This package holds what every binding shares: `DriverError`, the one exception a failed driver
call becomes, and `load_library`, which finds a library and lets an environment variable name
another copy (the seam tests use to make a library absent). It holds no policy: which device,
which memory, whether to retry, all belong to `poot/backends/`.
"""

import os
import sys


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
        if not self.tried:
            text = f"{library}: no candidate path"
        else:           # the paths, and the loader's words for the first (the usual soname)
            text = (f"{library}: tried {', '.join(path for path, _ in self.tried)} "
                    f"({self.tried[0][1]})")
        super().__init__(library, "dlopen", None, "library not found", text)


def load_library(ffi, library, candidates, env_var):
    """Open `library` with `ffi.dlopen`; return (lib, path).

    When the environment variable `env_var` is set, its value is the only path tried, so a test can
    make the library absent (`POOT_VULKAN_LIB=/nonexistent`). Otherwise each candidate (a bare
    soname searched by the dynamic loader, or a full path) is tried in order.
    """
    override = os.environ.get(env_var)
    # names of another system's libraries are not worth a dlopen (nor a line in the error)
    foreign = {"linux": (".dylib", ".dll"), "darwin": (".so", ".dll"), "win32": (".so", ".dylib")}
    skip = foreign.get(sys.platform, ())
    paths = [override] if override else [c for c in candidates
                                         if not any(c.endswith(s) or f"{s}." in c for s in skip)]
    tried = []
    for path in paths:
        try:
            return ffi.dlopen(path), path
        except OSError as error:
            # cffi appends a sentence about ctypes.util.find_library to the loader's own words
            reason = str(error).split("  Additionally, ctypes.util")[0].strip()
            tried.append((f"{path} (from {env_var})" if override else path, reason))
    raise LibraryNotFound(library, tried)
