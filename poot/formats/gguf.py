"""GGUF files (v2 and v3, little-endian): a validating, memory-mapped reader and a streaming writer.

Layout (ggml docs/gguf.md): magic "GGUF", u32 version, u64 tensor count, u64 metadata count;
metadata as (string key, u32 value type, value); tensor infos as (string name, u32 n_dims,
u64 ne[n_dims] fastest axis first, u32 ggml type, u64 offset relative to the data section);
the data section starts at the next multiple of `general.alignment` (default 32), and each
tensor's offset is a multiple of it. Strings are a u64 byte length and UTF-8 bytes.

The reader checks everything before a byte of tensor data is used, and every defect becomes a
`ModelFileError` naming the file (and tensor and offset where there is one). Metadata values
come back as Python values: strings as `str`, decoded with 'surrogateescape' so that the rare
token that is not valid UTF-8 survives (`s.encode('utf-8', 'surrogateescape')` gives the exact
bytes back); numeric and bool arrays as 1-D numpy arrays of the stored type; string arrays as
`list[str]`; arrays of arrays as lists. The file is mapped once; `raw` and `array` hand out
views of that mapping. This module does not interpret keys beyond `general.alignment`.
"""

import struct
from dataclasses import dataclass

import numpy as np

from poot.errors import ModelFileError
from poot.formats import MappedFile, TensorInfo
from poot.formats.quants import GGML_TYPES, QUANTS, dequantize, quantize

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                    # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 8           # far deeper than any real file; bounds recursion on a bad one

# GGUF metadata value types: code -> (name, struct format of one scalar).
_STRING, _ARRAY = 8, 9
VALUE_TYPES = {
    0: ("u8", "<B"), 1: ("i8", "<b"), 2: ("u16", "<H"), 3: ("i16", "<h"), 4: ("u32", "<I"),
    5: ("i32", "<i"), 6: ("f32", "<f"), 7: ("bool", "<B"), 8: ("string", None),
    9: ("array", None), 10: ("u64", "<Q"), 11: ("i64", "<q"), 12: ("f64", "<d"),
}
_CODE = {name: code for code, (name, _) in VALUE_TYPES.items()}

# Smallest possible encodings, to refuse counts the rest of the file cannot hold.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8


class _Cursor:
    """Bounds-checked little-endian reads from the mapped file."""

    def __init__(self, path, mm):
        self.path, self.mm, self.pos, self.size = path, mm, 0, len(mm)

    def fail(self, reason, tensor=None, offset=None):
        raise ModelFileError(self.path, reason, tensor=tensor,
                             offset=self.pos if offset is None else offset)

    def need(self, n, what, tensor=None):
        if n > self.size - self.pos:
            self.fail(f"truncated: {what} needs {n} bytes but the file ends at "
                      f"{self.size}", tensor)

    def scalar(self, fmt, what, tensor=None):
        n = struct.calcsize(fmt)
        self.need(n, what, tensor)
        (value,) = struct.unpack_from(fmt, self.mm, self.pos)
        self.pos += n
        return value

    def string(self, what, tensor=None):
        n = self.scalar("<Q", f"length of {what}", tensor)
        self.need(n, f"{what} (a string of {n} bytes)", tensor)
        raw = self.mm[self.pos:self.pos + n]
        self.pos += n
        return raw.decode("utf-8", "surrogateescape")

    def count(self, what, min_bytes, tensor=None):
        n = self.scalar("<Q", f"count of {what}", tensor)
        if n * min_bytes > self.size - self.pos:
            self.fail(f"{what} count {n} cannot fit in the {self.size - self.pos} bytes left "
                      f"in the file", tensor)
        return n


class GGUFFile(MappedFile):
    """One GGUF file, memory-mapped. `.tensors` maps names to `TensorInfo` in file order."""

    kind = "gguf"

    def __init__(self, path):
        self._map(path, 1, "empty file, expected a GGUF model")
        cur = _Cursor(self.path, self._mm)
        self._read_header(cur)
        self.metadata = self._read_metadata(cur)
        self.alignment = self._alignment(cur)
        infos = self._read_tensor_infos(cur)
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors = self._place_tensors(cur, infos)
        self._check_overlaps()

    def _read_header(self, cur):
        cur.need(4, "magic")
        magic = bytes(self._mm[0:4])
        if magic != MAGIC:
            cur.fail(f"bad magic {magic!r}, expected {MAGIC!r}: not a GGUF file", offset=0)
        cur.pos = 4
        version = cur.scalar("<I", "version")
        if version in (2 << 24, 3 << 24):
            cur.fail("big-endian GGUF files are not supported", offset=4)
        if version not in (2, 3):
            cur.fail(f"unsupported GGUF version {version} (2 and 3 are read)", offset=4)
        self.version = version
        self._n_tensors = cur.count("tensor", _MIN_TENSOR_INFO_BYTES)
        self._n_kv = cur.count("metadata key-value", _MIN_KV_BYTES)

    def _read_metadata(self, cur):
        metadata = {}
        for _ in range(self._n_kv):
            at = cur.pos
            key = cur.string("metadata key")
            if key in metadata:
                cur.fail(f"duplicate metadata key {key!r}", offset=at)
            vtype = cur.scalar("<I", f"type of metadata {key!r}")
            metadata[key] = self._read_value(cur, vtype, key, 0)
        return metadata

    def _read_value(self, cur, vtype, key, depth):
        if vtype not in VALUE_TYPES:
            cur.fail(f"metadata {key!r}: unknown value type {vtype}")
        name, fmt = VALUE_TYPES[vtype]
        if vtype == _STRING:
            return cur.string(f"metadata {key!r}")
        if vtype == _ARRAY:
            return self._read_array(cur, key, depth)
        at = cur.pos
        value = cur.scalar(fmt, f"metadata {key!r} ({name})")
        if name == "bool":
            if value > 1:
                cur.fail(f"metadata {key!r}: bool byte is {value}, not 0 or 1", offset=at)
            return bool(value)
        return value

    def _read_array(self, cur, key, depth):
        if depth >= MAX_ARRAY_NESTING:
            cur.fail(f"metadata {key!r}: arrays nested deeper than {MAX_ARRAY_NESTING}")
        etype = cur.scalar("<I", f"element type of metadata {key!r}")
        if etype not in VALUE_TYPES:
            cur.fail(f"metadata {key!r}: unknown array element type {etype}")
        name, fmt = VALUE_TYPES[etype]
        if etype == _STRING:
            n = cur.count(f"metadata {key!r} array element", 8)
            return [cur.string(f"metadata {key!r} element {i}") for i in range(n)]
        if etype == _ARRAY:
            n = cur.count(f"metadata {key!r} array element", 4 + 8)
            return [self._read_array(cur, key, depth + 1) for _ in range(n)]
        dtype = np.dtype(fmt)
        n = cur.count(f"metadata {key!r} array element", dtype.itemsize)
        at = cur.pos
        values = np.frombuffer(self._mm, dtype, n, at).copy()
        cur.pos += n * dtype.itemsize
        if name == "bool":
            if np.any(values > 1):
                cur.fail(f"metadata {key!r}: bool array holds a byte that is not 0 or 1",
                         offset=at)
            values = values.astype(bool)
        return values

    def _alignment(self, cur):
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (isinstance(alignment, (bool, float, str, list, np.ndarray)) or alignment <= 0
                or alignment & (alignment - 1)):
            cur.fail(f"general.alignment {alignment!r} is not a positive power of two")
        return int(alignment)

    def _read_tensor_infos(self, cur):
        infos = []
        seen = set()
        for _ in range(self._n_tensors):
            at = cur.pos
            name = cur.string("tensor name")
            if name in seen:
                cur.fail("duplicate tensor name", tensor=name, offset=at)
            seen.add(name)
            n_dims = cur.scalar("<I", "tensor n_dims", name)
            if n_dims > MAX_DIMS:
                cur.fail(f"{n_dims} dimensions, at most {MAX_DIMS} allowed", name, at)
            ne = [cur.scalar("<Q", "tensor dimension", name) for _ in range(n_dims)]
            if any(n >= 1 << 62 for n in ne):
                cur.fail(f"dimension sizes {ne} out of range", name, at)
            type_id = cur.scalar("<I", "tensor type", name)
            rel = cur.scalar("<Q", "tensor data offset", name)
            infos.append((name, tuple(reversed(ne)), type_id, rel, at))
        return infos

    def _place_tensors(self, cur, infos):
        tensors = {}
        for name, shape, type_id, rel, at in infos:
            if type_id not in GGML_TYPES:
                cur.fail(f"unknown ggml type {type_id}", name, at)
            dtype = GGML_TYPES[type_id]
            if dtype not in QUANTS:
                cur.fail(f"unsupported dtype {dtype} (supported: {', '.join(QUANTS)})", name, at)
            qt = QUANTS[dtype]
            row = shape[-1] if shape else 1
            if row % qt.block_elems:
                cur.fail(f"row length {row} is not a multiple of the {dtype} block size "
                         f"{qt.block_elems}", name, at)
            n_elems = int(np.prod(shape, dtype=object)) if shape else 1
            nbytes = qt.nbytes(n_elems)
            offset = self.data_offset + rel
            if rel % self.alignment:
                cur.fail(f"data offset {rel} (relative to the data section at "
                         f"{self.data_offset}) is not a multiple of the alignment "
                         f"{self.alignment}", name, offset)
            if offset + nbytes > cur.size:
                cur.fail(f"data [{offset}, {offset + nbytes}) lies outside the file of "
                         f"{cur.size} bytes", name, offset)
            tensors[name] = TensorInfo(name, dtype, shape, offset, nbytes, str(self.path))
        return tensors

    def array(self, name):
        """The tensor's values as float32 of its shape (F32: a read-only view, no copy)."""
        t = self.info(name)
        return dequantize(t.dtype, self.raw(name), t.shape)


@dataclass(frozen=True)
class GGUFValue:
    """An explicitly typed metadata value for `write_gguf`. `type` is a GGUF type name: u8 i8
    u16 i16 u32 i32 u64 i64 f32 f64 bool string. A list or 1-D array `value` is written as an
    array of `type` (a list of lists as an array of arrays); anything else as one scalar."""
    type: str
    value: object


@dataclass(frozen=True)
class Encoded:
    """Tensor bytes already in the target dtype (e.g. from `quantize` or another file), for
    `write_gguf`: written as they are, with `shape` in numpy order."""
    shape: tuple
    data: np.ndarray


def _pack_scalar(tname, value):
    if tname == "string":
        raw = value.encode("utf-8", "surrogateescape")
        return struct.pack("<Q", len(raw)) + raw
    if tname == "bool":
        return struct.pack("<B", 1 if value else 0)
    if tname not in _CODE or tname == "array":
        raise ValueError(f"unknown GGUF value type {tname!r}")
    try:
        return struct.pack(VALUE_TYPES[_CODE[tname]][1], value)
    except struct.error:
        raise ValueError(f"{value!r} does not fit in a GGUF {tname}") from None


def _pack_array(tname, values):
    """Body of an array (element type, count, elements) of `tname` elements."""
    values = list(values) if not isinstance(values, np.ndarray) else values
    if len(values) and isinstance(values[0], (list, tuple, np.ndarray)):
        body = b"".join(_pack_array(tname, v) for v in values)
        return struct.pack("<IQ", _ARRAY, len(values)) + body
    if tname == "string":
        body = b"".join(_pack_scalar("string", v) for v in values)
    elif tname in _CODE and tname not in ("array", "string"):
        dtype = np.dtype("<u1" if tname == "bool" else VALUE_TYPES[_CODE[tname]][1])
        values = np.asarray(values)
        if dtype.kind in "iu" and values.size and (values.min() < np.iinfo(dtype).min
                                                   or values.max() > np.iinfo(dtype).max):
            raise ValueError(f"values from {values.min()} to {values.max()} do not fit in a "
                             f"GGUF {tname} array")
        body = values.astype(dtype).tobytes()
    else:
        raise ValueError(f"unknown GGUF value type {tname!r}")
    return struct.pack("<IQ", _CODE[tname], len(values)) + body


_NUMPY_TYPES = {np.dtype(t): n for t, n in [
    ("u1", "u8"), ("i1", "i8"), ("u2", "u16"), ("i2", "i16"), ("u4", "u32"), ("i4", "i32"),
    ("u8", "u64"), ("i8", "i64"), ("f4", "f32"), ("f8", "f64"), ("?", "bool")]}


def _int_type(values, unsigned_first):
    lo, hi = min(values), max(values)
    order = ["u32", "i32", "u64", "i64"] if unsigned_first else ["i32", "i64", "u64"]
    limits = {"u32": (0, 2**32 - 1), "i32": (-2**31, 2**31 - 1), "u64": (0, 2**64 - 1),
              "i64": (-2**63, 2**63 - 1)}
    for t in order:
        if limits[t][0] <= lo and hi <= limits[t][1]:
            return t
    raise ValueError(f"integer {hi if hi > 0 else lo} does not fit in 64 bits")


def _element_type(values, key):
    """The GGUF element type of a plain list (see write_gguf for the rules)."""
    if all(isinstance(v, str) for v in values):
        return "string"
    if all(isinstance(v, (bool, np.bool_)) for v in values):
        return "bool"
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
           for v in values):
        return _int_type([int(v) for v in values], unsigned_first=False)
    if all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
           for v in values):
        return "f32"
    raise ValueError(f"metadata {key!r}: cannot infer one GGUF type for a list of "
                     f"{sorted({type(v).__name__ for v in values})}; use GGUFValue")


def _pack_value(key, value):
    """-> (value type code, bytes) of one metadata value."""
    if isinstance(value, GGUFValue):
        if isinstance(value.value, (list, tuple, np.ndarray)):
            return _ARRAY, _pack_array(value.type, value.value)
        return _CODE.get(value.type, -1), _pack_scalar(value.type, value.value)
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype not in _NUMPY_TYPES:
            raise ValueError(f"metadata {key!r}: arrays must be 1-D of a numeric or bool "
                             f"dtype, got {value.ndim}-D {value.dtype}")
        return _ARRAY, _pack_array(_NUMPY_TYPES[value.dtype], value)
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"metadata {key!r}: an empty list has no element type; "
                             f"use GGUFValue(type, [])")
        if all(isinstance(v, (list, tuple, np.ndarray)) for v in value):
            parts = [_pack_value(key, v) for v in value]
            return _ARRAY, struct.pack("<IQ", _ARRAY, len(parts)) + b"".join(p for _, p in parts)
        return _ARRAY, _pack_array(_element_type(value, key), value)
    if isinstance(value, np.generic) and value.dtype in _NUMPY_TYPES:
        tname = _NUMPY_TYPES[value.dtype]
        return _CODE[tname], _pack_scalar(tname, value.item())
    if isinstance(value, bool):
        return _CODE["bool"], _pack_scalar("bool", value)
    if isinstance(value, int):
        tname = _int_type([value], unsigned_first=True)
        return _CODE[tname], _pack_scalar(tname, value)
    if isinstance(value, float):
        return _CODE["f32"], _pack_scalar("f32", value)
    if isinstance(value, str):
        return _STRING, _pack_scalar("string", value)
    raise ValueError(f"metadata {key!r}: cannot store a {type(value).__name__} in GGUF")


_ROWS_PER_CHUNK_ELEMS = 1 << 22     # quantise and write about 4M values at a time


def write_gguf(path, metadata, tensors, version=3, alignment=DEFAULT_ALIGNMENT):
    """Write a GGUF file. Tensor data is produced and written one tensor (and for large ones one
    chunk of rows) at a time, so the file never exists in memory.

    `tensors` is a list of (name, dtype, values): `dtype` a name from `QUANTS`; `values` an array
    of float values in numpy order (or any object with `.shape` that `np.asarray` turns into
    one, so huge tensors can be produced on demand) which is converted or quantised to `dtype`,
    or an `Encoded(shape, data)` whose bytes are already in `dtype`.

    Metadata values are typed as llama.cpp expects: bool -> bool; int -> u32 (negative: i32,
    beyond 32 bits: u64/i64); float -> f32; str -> string; numpy scalars and 1-D arrays keep
    their dtype; a list of str -> string array, of bools -> bool array, of ints -> i32 array
    (i64/u64 if out of range), of numbers -> f32 array, of lists -> array of arrays. Use
    `GGUFValue(type, value)` for anything else (u8 scalars, f64, empty arrays...). A
    non-default `alignment` is recorded as `general.alignment` (u32).
    """
    if version not in (2, 3):
        raise ValueError(f"can write GGUF version 2 or 3, not {version}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment {alignment} is not a positive power of two")
    metadata = dict(metadata)
    if alignment != DEFAULT_ALIGNMENT or "general.alignment" in metadata:
        given = metadata.get("general.alignment", alignment)
        given = given.value if isinstance(given, GGUFValue) else given
        if given != alignment:
            raise ValueError(f"general.alignment {given} in metadata disagrees with "
                             f"alignment={alignment}")
        metadata["general.alignment"] = GGUFValue("u32", alignment)

    header = [MAGIC, struct.pack("<IQQ", version, len(tensors), len(metadata))]
    for key, value in metadata.items():
        code, body = _pack_value(key, value)
        header += [_pack_scalar("string", key), struct.pack("<I", code), body]

    plan = []
    offset = 0
    names = set()
    for name, dtype, values in tensors:
        if name in names:
            raise ValueError(f"duplicate tensor name {name!r}")
        names.add(name)
        if dtype not in QUANTS:
            raise ValueError(f"tensor {name!r}: unsupported dtype {dtype!r}")
        qt = QUANTS[dtype]
        shape = tuple(int(n) for n in values.shape)
        if not 1 <= len(shape) <= MAX_DIMS:
            raise ValueError(f"tensor {name!r}: {len(shape)} dimensions, GGUF takes 1 to "
                             f"{MAX_DIMS}")
        if shape[-1] % qt.block_elems:
            raise ValueError(f"tensor {name!r}: row length {shape[-1]} is not a multiple of "
                             f"the {dtype} block size {qt.block_elems}")
        nbytes = qt.nbytes(int(np.prod(shape, dtype=object)))
        if isinstance(values, Encoded) and np.asarray(values.data).nbytes != nbytes:
            raise ValueError(f"tensor {name!r}: {np.asarray(values.data).nbytes} encoded bytes "
                             f"for a {dtype} tensor of shape {shape}, which takes {nbytes}")
        header += [_pack_scalar("string", name), struct.pack("<I", len(shape)),
                   struct.pack(f"<{len(shape)}Q", *reversed(shape)),
                   struct.pack("<IQ", qt.ggml_type, offset)]
        plan.append((dtype, shape, values, offset))
        offset += -(-nbytes // alignment) * alignment

    head = b"".join(header)
    data_start = -(-len(head) // alignment) * alignment
    with open(path, "wb") as f:
        f.write(head)
        for dtype, shape, values, rel in plan:
            f.write(bytes(data_start + rel - f.tell()))
            if isinstance(values, Encoded):
                f.write(np.ascontiguousarray(values.data, dtype=np.uint8))
                continue
            rows = np.asarray(values).reshape(-1, shape[-1])
            step = max(1, _ROWS_PER_CHUNK_ELEMS // shape[-1])
            for i in range(0, rows.shape[0], step):
                f.write(quantize(dtype, rows[i:i + step]))
