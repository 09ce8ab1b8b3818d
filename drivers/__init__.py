"""Thin cffi (ABI mode) bindings to the vendors' driver libraries, one module per library.

This package holds what every binding shares: `DriverError`, the one exception a failed driver
call becomes, `load_library`, which finds a library and lets an environment variable name
another copy (the seam tests use to make a library absent), `held_functions`, which calls a
binding's short, frequent functions without giving up the interpreter lock, and `Structs`,
which fills a binding's structs from keyword fields. It holds no policy: which device, which
memory, whether to retry, all belong to `poot/backends/`.
"""

import ctypes
import os
import sys
import weakref
from types import SimpleNamespace


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


def holding_the_lock(ffi, function, restype, *argtypes):
    """cffi `function` of an opened library, called through ctypes (PYFUNCTYPE) so that the
    interpreter lock stays held: for calls that return in microseconds and come hundreds at a
    time, a step's launches. cffi gives the lock up around every call, and each time the
    calling thread must win it back from every runnable thread (a burst of request handlers,
    say), so a step's launches would wait on all of them. Arguments are ctypes values or
    ints; a cdata pointer goes as its address (`address`)."""
    return ctypes.PYFUNCTYPE(restype, *argtypes)(address(ffi, function))


def held_functions(ffi, lib, signatures):
    """The functions of opened `lib` that `signatures` names ({name: (restype, argtypes...)},
    ctypes types), as attributes, each holding the lock (holding_the_lock). A signature that
    disagrees with the function's cffi declaration (a pointer for an integer, another size, a
    parameter more or less) is a TypeError: ctypes would pass the arguments wrongly."""
    for name, signature in signatures.items():
        declared = _shape(ffi, ffi.typeof(getattr(lib, name)))
        if declared != tuple(_ctype_shape(t) for t in signature):
            raise TypeError(f"{name}: {signature} for ctypes, but {declared} declared to cffi "
                            "(pointer 'p', integers by size)")
    return SimpleNamespace(**{name: holding_the_lock(ffi, getattr(lib, name), *signature)
                              for name, signature in signatures.items()})


def _shape(ffi, function):
    """A cffi function type's result and parameters as 'p' (pointer), None (void) or bytes
    (an integer or enum: the calling convention passes any of one size alike)."""
    def one(t):
        return "p" if t.kind == "pointer" else None if t.kind == "void" else ffi.sizeof(t)
    return (one(function.result), *map(one, function.args))


def _ctype_shape(t):
    return None if t is None else "p" if t is ctypes.c_void_p else ctypes.sizeof(t)


def parse_types(ffi, types):
    """Parses C types ahead of the calls that name them. cffi parses a type the first time a
    call names it, against every declaration of its binding (milliseconds a type for
    Vulkan's), so a backend has its steps' types parsed when its device opens, not in the time
    of its first request."""
    for t in types:
        ffi.typeof(t)


def address(ffi, pointer):
    """A cdata pointer as the int ctypes passes for a void *."""
    return int(ffi.cast("uintptr_t", pointer))


# What a struct made by a binding's helpers points to (strings, arrays, other structs), kept
# alive with it: cffi frees an owned cdata with its last Python reference.
_KEEP_ALIVE = weakref.WeakKeyDictionary()


def keep_alive(owner, *owned):
    """Holds the cdata `owned` for as long as the cdata `owner` lives."""
    _KEEP_ALIVE.setdefault(owner, []).extend(owned)


class Structs:
    """Zeroed structs of one binding, filled from keyword fields: a dict fills a nested struct in
    place, and every cdata given is kept alive as long as the struct. The binding says how its
    structs name their own type (`tag(item, struct)`) and which Python values stand for another
    field value (`convert(field type, value, owner)`, keeping what it makes alive with `owner`).
    Fields read back are views into the struct: keep the struct while reading them."""

    def __init__(self, ffi, tag, convert):
        self.ffi, self.tag, self.convert = ffi, tag, convert

    def new(self, struct, **fields):
        """`ffi.new` one zeroed struct, tagged, with `fields` set."""
        value = self.ffi.new(f"{struct} *")
        self._fill(value[0], struct, fields, value)
        return value

    def new_array(self, struct, items):
        """An array of structs, one per dict of fields in `items`, each filled as by `new`."""
        value = self.ffi.new(f"{struct}[]", len(items))
        for item, fields in zip(value, items):
            self._fill(item, struct, fields, value)
        return value

    def _fill(self, item, struct, fields, owner):
        self.tag(item, struct)
        types = dict(self.ffi.typeof(struct).fields)
        for name, field in fields.items():
            kind = types[name].type
            if isinstance(field, dict) and kind.kind == "struct":  # a nested struct, filled in place
                self._fill(getattr(item, name), kind.cname, field, owner)
                continue
            field = self.convert(kind, field, owner)
            if isinstance(field, self.ffi.CData):
                keep_alive(owner, field)
            setattr(item, name, field)
