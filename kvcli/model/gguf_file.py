"""A GGUF file's header (metadata and tensor directory) parsed in one pass over a memory map.

gguf-py's GGUFReader builds a numpy view per array element: for a 49k-token vocabulary and its 48k
merges that is ~1M views and 3-4 s, more than the rest of a model load. This reader decodes the same
format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) with struct and hands out tensor
data as views of the memory map, typed as GGUFReader types them, so the loader's decoding is shared.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Metadata value types: id -> (struct code, numpy dtype) for the fixed-size ones.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("B", "<u1"), 1: ("b", "<i1"), 2: ("H", "<u2"), 3: ("h", "<i2"), 4: ("I", "<u4"), 5: ("i", "<i4"),
    6: ("f", "<f4"), 7: ("?", "?"), 10: ("Q", "<u8"), 11: ("q", "<i8"), 12: ("d", "<f8"),
}
_STRING, _ARRAY = 8, 9

# Dense tensor types (GGMLQuantizationType ids) and the numpy type GGUFReader gives their data;
# every other type is handed out as raw bytes, one row of blocks per tensor row.
_DENSE = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


class GGUFFormatError(ValueError):
    pass


@dataclass
class GGUFTensor:
    name: str
    shape: list[int]  # GGUF order: ne0 (the contiguous dimension, in_features) first
    type_id: int
    offset: int  # absolute byte offset in the file
    nbytes: int
    _mm: np.memmap

    @property
    def tensor_type(self):
        import gguf

        return gguf.GGMLQuantizationType(self.type_id)

    @property
    def data(self) -> np.ndarray:
        """A read-only view of the file: numpy-typed for dense types, uint8 rows of blocks otherwise."""
        raw = self._mm[self.offset:self.offset + self.nbytes]
        dims = list(reversed(self.shape))  # numpy order: outermost first
        if self.type_id in _DENSE:
            return raw.view(_DENSE[self.type_id]).reshape(dims)
        return raw.reshape(dims[:-1] + [self.nbytes // max(1, int(np.prod(dims[:-1])))])


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


class _Cursor:
    def __init__(self, buf: np.memmap) -> None:
        self.buf = buf
        self.mv = memoryview(buf)
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        try:
            (v,) = struct.unpack_from("<" + fmt, self.mv, self.pos)
        except struct.error:
            raise GGUFFormatError("truncated header") from None
        self.pos += struct.calcsize("<" + fmt)
        return v

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.mv):
            raise GGUFFormatError("truncated string")
        s = bytes(self.mv[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("I"), self.unpack("Q")
            if etype in _SCALARS:
                dt = np.dtype(_SCALARS[etype][1])
                end = self.pos + count * dt.itemsize
                if end > len(self.mv):
                    raise GGUFFormatError("truncated array")
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).tolist()
                self.pos = end
                return arr
            return [self.value(etype) for _ in range(count)]
        raise GGUFFormatError(f"unknown metadata value type {vtype}")


def _type_size(type_id: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a GGML tensor type."""
    import gguf

    try:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        raise GGUFFormatError(f"unknown GGML tensor type id {type_id}") from None


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor directory; tensor data stays in the memory map."""
    path = Path(path)
    if path.is_file() and path.stat().st_size == 0:
        raise GGUFFormatError("the file is empty")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    head = bytes(mm[:4])
    if head != GGUF_MAGIC[:len(head)]:
        raise GGUFFormatError(f"bad magic: it starts with {head!r}, a GGUF file with {GGUF_MAGIC!r}")
    if len(mm) < 24:
        raise GGUFFormatError(f"truncated header: {len(mm)} bytes")
    c = _Cursor(mm)
    c.pos = 4
    version = c.unpack("I")
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = c.unpack("Q"), c.unpack("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        metadata[key] = c.value(c.unpack("I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.unpack("I")
        shape = [c.unpack("Q") for _ in range(n_dims)]
        infos.append((name, shape, c.unpack("I"), c.unpack("Q")))
    align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if align <= 0 or align & (align - 1):
        raise GGUFFormatError(f"invalid alignment {align}")
    data_start = (c.pos + align - 1) // align * align
    tensors = []
    for name, shape, type_id, rel in infos:
        block, size = _type_size(type_id)
        n = int(np.prod(shape)) if shape else 1
        if shape and shape[0] % block:
            raise GGUFFormatError(f"tensor {name}: row of {shape[0]} is not a multiple of its block size {block}")
        nbytes = n // block * size
        if data_start + rel + nbytes > len(mm):
            raise GGUFFormatError(f"tensor {name} runs past the end of the file (truncated download?)")
        tensors.append(GGUFTensor(name, shape, type_id, data_start + rel, nbytes, mm))
    return GGUFFile(path, version, metadata, tensors)
