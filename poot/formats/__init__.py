"""Model files -> memory-mapped numpy arrays plus metadata.

`open_model` picks the reader: a GGUF file (`gguf.GGUFFile`) or a Hugging Face folder of
safetensors (`safetensors.HFModelFolder`). Both expose `.kind`, `.path`, `.tensors` (name ->
`TensorInfo`, in file order), `.info(name)` (one of those, or a ModelFileError naming the
missing tensor), `.raw(name)` (the stored bytes, zero-copy), `.array(name)` (values) and
`.close()` / `with`. What the tensors mean is the business of `poot.models`, not of this
package; quantisation block layouts live in `quants`.
"""

import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from poot.errors import ModelFileError


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor's bytes are: `shape` in numpy order (last axis contiguous, so a weight is
    [out_features, in_features]), `dtype` a name from `quants.QUANTS` (GGUF) or a safetensors
    dtype, `offset` absolute in `path`."""
    name: str
    dtype: str
    shape: tuple
    offset: int
    nbytes: int
    path: str


class MappedFile:
    """A file read through one read-only memory map (`_mm`, viewed as bytes in `_bytes`), whose
    `tensors` (name -> TensorInfo) are spans of those bytes."""

    def _map(self, path, least, too_short):
        """Maps the file at `path`; one of fewer than `least` bytes is refused with the reason
        `too_short` (formatted with its `size`). Returns its size."""
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, 2)
                if size < least:
                    raise ModelFileError(self.path, too_short.format(size=size))
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ModelFileError(self.path, f"cannot open: {e.strerror or e}") from None
        self._bytes = np.frombuffer(self._mm, np.uint8)
        return size

    def _check_overlaps(self):
        """A ModelFileError where a tensor's bytes start inside another's."""
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values()
                       if t.nbytes)
        for (_, end, prev), (start, _, name) in zip(spans, spans[1:]):
            if start < end:
                raise ModelFileError(self.path, f"data overlaps tensor {prev!r}, which ends at "
                                                f"{end}", tensor=name, offset=start)

    def info(self, name):
        if name not in self.tensors:
            raise ModelFileError(self.path, "no such tensor in the file", tensor=name)
        return self.tensors[name]

    def raw(self, name):
        """The tensor's stored bytes: a read-only uint8 view of the mapping."""
        t = self.info(name)
        return self._bytes[t.offset:t.offset + t.nbytes]

    def close(self):
        """Release the mapping. Arrays already handed out keep it alive until they go."""
        self._bytes = None
        try:
            self._mm.close()
        except BufferError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


from poot.formats.gguf import GGUFFile  # noqa: E402  (the readers use TensorInfo)
from poot.formats.safetensors import HFModelFolder  # noqa: E402


def _starts_with(path, magic):
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError as e:
        raise ModelFileError(path, f"cannot open: {e.strerror or e}") from None


def open_model(path):
    """A `.gguf` file (or any file starting with the GGUF magic) -> GGUFFile; a folder with
    config.json, or a `.safetensors` file next to one -> HFModelFolder."""
    path = Path(path)
    if path.is_dir():
        return HFModelFolder(path)
    if not path.exists():
        raise ModelFileError(path, "no such file or folder")
    if path.suffix == ".gguf" or _starts_with(path, b"GGUF"):
        return GGUFFile(path)
    if path.suffix == ".safetensors":
        return HFModelFolder(path)
    raise ModelFileError(path, "expected a .gguf file, a folder with config.json and "
                               "safetensors weights, or a .safetensors file next to a config.json")
