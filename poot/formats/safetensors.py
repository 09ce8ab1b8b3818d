"""safetensors files and Hugging Face model folders: validating, memory-mapped readers and a writer.

A `.safetensors` file is a u64 little-endian header length N, N bytes of JSON, then the data;
the JSON maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} with offsets
relative to the first byte after the header, and may hold a "__metadata__" dict of strings.
A model folder holds config.json, the weights as model.safetensors or as shards listed by
model.safetensors.index.json ("weight_map": tensor -> shard file), and optionally the tokenizer
and generation JSON files. Every defect becomes a `ModelFileError` naming the file (and tensor
and offset where there is one). Nothing here interprets the config.
"""

import json
from pathlib import Path

import numpy as np

from poot.errors import ModelFileError
from poot.formats import MappedFile, TensorInfo
from poot.formats.quants import quantize

# safetensors dtype -> numpy dtype of one stored element (BF16 is stored as its 16 bits).
DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_DTYPE_OF_NUMPY = {np.dtype(d): name for name, d in DTYPES.items() if name not in ("BF16",)}

HEADER_LIMIT = 100 << 20        # the reference implementation's cap on the JSON header


def _unique_keys(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


class SafetensorsFile(MappedFile):
    """One `.safetensors` file, memory-mapped. `.tensors` maps names to `TensorInfo` in header
    order; `.metadata` is the "__metadata__" dict (or {})."""

    kind = "safetensors"

    def __init__(self, path):
        size = self._map(path, 8, "truncated: {size} bytes, too short for the 8-byte header "
                                  "length")
        n = int.from_bytes(self._mm[0:8], "little")
        if n > size - 8 or n > HEADER_LIMIT:
            self._fail(f"header length {n} runs past the end of the file ({size} bytes)"
                       if n > size - 8 else f"header length {n} exceeds {HEADER_LIMIT}", 0)
        self.data_offset = 8 + n
        try:
            header = json.loads(bytes(self._mm[8:8 + n]).decode("utf-8"),
                                object_pairs_hook=_unique_keys)
        except (UnicodeDecodeError, ValueError) as e:
            self._fail(f"bad JSON header: {e}", 8)
        if not isinstance(header, dict):
            self._fail("JSON header is not an object", 8)
        self.metadata = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict) or not all(
                isinstance(v, str) for v in self.metadata.values()):
            self._fail("__metadata__ is not an object of strings", 8)
        self.tensors = {name: self._tensor_info(name, entry, size)
                        for name, entry in header.items()}
        self._check_overlaps()

    def _fail(self, reason, offset=None, tensor=None):
        raise ModelFileError(self.path, reason, tensor=tensor, offset=offset)

    def _tensor_info(self, name, entry, size):
        if not isinstance(entry, dict):
            self._fail("header entry is not an object", 8, name)
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPES:
            self._fail(f"unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})", 8, name)
        if (not isinstance(shape, list)
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                           for n in shape)):
            self._fail(f"shape {shape!r} is not a list of non-negative integers", 8, name)
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            self._fail(f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end",
                       8, name)
        begin, end = offsets
        expected = DTYPES[dtype].itemsize * int(np.prod(shape, dtype=object) if shape else 1)
        offset = self.data_offset + begin
        if end - begin != expected:
            self._fail(f"data_offsets span {end - begin} bytes but {dtype} {shape} takes "
                       f"{expected}", offset, name)
        if self.data_offset + end > size:
            self._fail(f"data [{offset}, {self.data_offset + end}) lies outside the file of "
                       f"{size} bytes", offset, name)
        return TensorInfo(name, dtype, tuple(shape), offset, expected, str(self.path))

    def array(self, name):
        """The tensor's values: float32 for F16/BF16/F32 (F32 a read-only view, no copy), the
        stored numpy type for every other dtype (a view)."""
        t = self.info(name)
        values = self.raw(name).view(DTYPES[t.dtype]).reshape(t.shape)
        if t.dtype == "F16":
            return values.astype(np.float32)
        if t.dtype == "BF16":
            return (values.astype(np.uint32) << 16).view(np.float32)
        return values


def _read_json(path, required):
    if not path.exists():
        if required:
            raise ModelFileError(path, "missing; a model folder needs config.json")
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(path, f"bad JSON: {e}") from None
    if not isinstance(value, dict):
        raise ModelFileError(path, "JSON is not an object")
    return value


class HFModelFolder:
    """A Hugging Face model folder (or one `.safetensors` file in such a folder): its config,
    tokenizer and generation JSON as dicts (None when absent), and the tensors of all its
    weight files merged into one `.tensors`."""

    kind = "safetensors"

    def __init__(self, path):
        path = Path(path)
        self.path = path if path.is_dir() else path.parent
        self.config = _read_json(self.path / "config.json", required=True)
        self.tokenizer_json = _read_json(self.path / "tokenizer.json", False)
        self.tokenizer_config = _read_json(self.path / "tokenizer_config.json", False)
        self.generation_config = _read_json(self.path / "generation_config.json", False)
        self._files = {}
        self._where = {}
        try:
            if not path.is_dir():
                self._add(self._open(path))
            elif (self.path / "model.safetensors.index.json").exists():
                self._read_index(self.path / "model.safetensors.index.json")
            elif (self.path / "model.safetensors").exists():
                self._add(self._open(self.path / "model.safetensors"))
            else:
                raise ModelFileError(self.path, "no model.safetensors or "
                                                "model.safetensors.index.json in the folder")
        except ModelFileError:
            self.close()
            raise
        self.tensors = {name: f.tensors[name] for name, f in self._where.items()}

    def _open(self, path):
        if path not in self._files:
            self._files[path] = SafetensorsFile(path)
        return self._files[path]

    def _add(self, shard, names=None):
        for name in shard.tensors if names is None else names:
            self._where[name] = shard

    def _read_index(self, index_path):
        index = _read_json(index_path, required=True)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()):
            raise ModelFileError(index_path, "no weight_map object of tensor -> shard file")
        by_shard = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(shard, []).append(name)
        for shard_name, names in by_shard.items():
            shard_path = self.path / shard_name
            if Path(shard_name).name != shard_name or not shard_path.is_file():
                raise ModelFileError(index_path, f"names shard {shard_name!r}, which is not a "
                                                 f"file in the folder", tensor=names[0])
            shard = self._open(shard_path)
            missing = [n for n in names if n not in shard.tensors]
            if missing:
                raise ModelFileError(index_path, f"places the tensor in {shard_name}, which "
                                                 f"lacks it", tensor=missing[0])
            self._add(shard, names)

    def info(self, name):
        if name not in self.tensors:
            raise ModelFileError(self.path, "no such tensor in the model", tensor=name)
        return self.tensors[name]

    def raw(self, name):
        self.info(name)
        return self._where[name].raw(name)

    def array(self, name):
        self.info(name)
        return self._where[name].array(name)

    def close(self):
        for f in self._files.values():
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def write_safetensors(path, tensors, metadata=None, dtypes=None):
    """Write `tensors` (name -> numpy array, in order) as one `.safetensors` file.

    The dtype of each tensor follows its numpy dtype unless `dtypes` (name -> safetensors
    dtype) says otherwise; for "BF16" the array is either uint16 bit patterns, written as they
    are, or float values, rounded to nearest-even bfloat16. `metadata` is a dict of strings.
    Tensors are written one at a time after the header.
    """
    dtypes = dict(dtypes or {})
    plan = []
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, values in tensors.items():
        values = np.asarray(values)
        dtype = dtypes.pop(name, None) or _DTYPE_OF_NUMPY.get(values.dtype.newbyteorder("<"))
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name!r}: no safetensors dtype for {values.dtype}; "
                             f"give one in dtypes")
        nbytes = values.size * DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": list(values.shape),
                        "data_offsets": [offset, offset + nbytes]}
        plan.append((dtype, values))
        offset += nbytes
    if dtypes:
        raise ValueError(f"dtypes names tensors that are not given: {sorted(dtypes)}")
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for dtype, values in plan:
            if dtype == "BF16" and values.dtype != np.uint16:
                f.write(quantize("BF16", values))
            else:
                f.write(np.ascontiguousarray(values, dtype=DTYPES[dtype]).reshape(-1)
                        .view(np.uint8))
