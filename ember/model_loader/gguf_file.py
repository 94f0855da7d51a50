"""A GGUF file's header, read lazily: metadata values as they are asked for, tensors as memory-mapped views.

The `gguf` package's ``GGUFReader`` builds every field of the file at construction, including one numpy view per
entry of the vocabulary arrays (147k views for the default model's 49k tokens and merges): 2-4 s before the first
weight is read. Here an array is only walked to find where the next value starts (its strings' lengths), and
decoded when asked for. The tensor types ember loads are named here (importing the `gguf` package's tables takes
0.1 s, a twentieth of a CLI start-up); any other type, and dequantization, come from the `gguf` package.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
# GGUF value types -> struct format (little-endian); 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}
# tensor types numpy reads as typed values (as GGUFReader does); every other type comes as its raw bytes
_TYPED = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}


class GGMLType(enum.IntEnum):
    """ggml's tensor type ids that ember loads (the `gguf` package's GGMLQuantizationType: equal ids and names)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


# (values a block, bytes a block) of those types, as ggml defines them (tests check them against the gguf package)
BLOCK_SIZES = {GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.BF16: (1, 2), GGMLType.Q4_0: (32, 18),
               GGMLType.Q4_1: (32, 20), GGMLType.Q5_0: (32, 22), GGMLType.Q5_1: (32, 24), GGMLType.Q8_0: (32, 34),
               GGMLType.Q4_K: (256, 144), GGMLType.Q5_K: (256, 176), GGMLType.Q6_K: (256, 210)}

_BY_ID = {int(kind): kind for kind in GGMLType}  # a dict lookup: calling the enum costs ~0.1 ms a tensor


def _tensor_type(ttype: int) -> tuple[Any, int, int]:
    """(type, values a block, bytes a block): ember's GGMLType where it names it, else the gguf package's."""
    kind = _BY_ID.get(ttype)
    if kind is not None:
        return kind, *BLOCK_SIZES[kind]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    kind = GGMLQuantizationType(ttype)
    return kind, *GGML_QUANT_SIZES[kind]


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor's entry: ``shape`` innermost dimension first (GGUF's order), ``data`` a read-only map."""

    name: str
    tensor_type: Any  # GGMLType, or the gguf package's GGMLQuantizationType for other types (equal ids and names)
    shape: tuple[int, ...]
    data: np.ndarray
    block: int  # values a block
    block_bytes: int  # bytes a block


class GGUFFile:
    """``fields``: key -> value for scalars and strings; arrays stay (offset, item type, count) until ``value``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.buf = np.memmap(path, dtype=np.uint8, mode="r")
        mv = memoryview(self.buf)
        if bytes(mv[:4]) != _MAGIC:
            raise ValueError("not a GGUF file (wrong magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", mv, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are; a big-endian file reads as a "
                             "huge version)")
        pos = 24
        self._raw: dict[str, tuple[int, int]] = {}  # key -> (offset of the value, value type)
        for _ in range(n_kv):
            key, pos = _string(mv, pos)
            (vtype,) = struct.unpack_from("<I", mv, pos)
            self._raw[key] = (pos + 4, vtype)
            pos = _skip(mv, pos + 4, vtype)
        infos = []
        for _ in range(n_tensors):
            name, pos = _string(mv, pos)
            (n_dims,) = struct.unpack_from("<I", mv, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", mv, pos + 4)
            ttype, offset = struct.unpack_from("<IQ", mv, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, ttype, offset))
        align = int(self.value("general.alignment", 32))
        start = -(-pos // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, ttype, offset in infos:
            kind, block, size = _tensor_type(ttype)
            np_dims = tuple(reversed(dims))
            n = int(np.prod(dims))
            lo = start + offset
            if kind.name in _TYPED:
                dt = np.dtype(_TYPED[kind.name])
                data = self.buf[lo:lo + n * dt.itemsize].view(dt).reshape(np_dims)
            else:
                data = self.buf[lo:lo + n // block * size].reshape(*np_dims[:-1], np_dims[-1] // block * size)
            self.tensors.append(GGUFTensor(name, kind, dims, data, block, size))

    @property
    def keys(self) -> list[str]:
        return list(self._raw)

    def __contains__(self, key: str) -> bool:
        return key in self._raw

    def value(self, key: str, default: Any = None) -> Any:
        """The decoded value: a Python scalar, str, or list (arrays of numbers come as lists of Python numbers)."""
        if key not in self._raw:
            return default
        pos, vtype = self._raw[key]
        return _decode(memoryview(self.buf), pos, vtype)

    def array_len(self, key: str) -> int:
        """The number of entries of an array value, without decoding it."""
        pos, vtype = self._raw[key]
        if vtype != _ARRAY:
            raise ValueError(f"GGUF field {key} is not an array")
        return struct.unpack_from("<Q", memoryview(self.buf), pos + 4)[0]


def _string(mv: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", mv, pos)
    return bytes(mv[pos + 8:pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _skip(mv: memoryview, pos: int, vtype: int) -> int:
    """The offset just past a value of vtype starting at pos."""
    if vtype in _SCALARS:
        return pos + struct.calcsize(_SCALARS[vtype])
    if vtype == _STRING:
        return pos + 8 + struct.unpack_from("<Q", mv, pos)[0]
    if vtype != _ARRAY:
        raise ValueError(f"GGUF value type {vtype} is unknown")
    itype, count = struct.unpack_from("<IQ", mv, pos)
    pos += 12
    if itype in _SCALARS:
        return pos + count * struct.calcsize(_SCALARS[itype])
    for _ in range(count):  # strings or nested arrays: each says its own length
        pos = _skip(mv, pos, itype)
    return pos


def _decode(mv: memoryview, pos: int, vtype: int) -> Any:
    if vtype in _SCALARS:
        return struct.unpack_from(_SCALARS[vtype], mv, pos)[0]
    if vtype == _STRING:
        return _string(mv, pos)[0]
    itype, count = struct.unpack_from("<IQ", mv, pos)
    pos += 12
    if itype in _NUMPY:
        return np.frombuffer(mv, dtype=_NUMPY[itype], count=count, offset=pos).tolist()
    out = []
    for _ in range(count):
        out.append(_decode(mv, pos, itype))
        pos = _skip(mv, pos, itype)
    return out
