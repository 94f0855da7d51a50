"""A GGUF file's header, read lazily: metadata values as they are asked for, tensors as memory-mapped views.

The `gguf` package's ``GGUFReader`` builds every field of the file at construction, including one numpy view per
entry of the vocabulary arrays (147k views for the default model's 49k tokens and merges): 2-4 s before the first
weight is read. Here an array is only walked to find where the next value starts (its strings' lengths), and
decoded when asked for. The tensor types ember loads are named here (importing the `gguf` package's tables takes
0.1 s, a twentieth of a CLI start-up); any other type, and dequantization, come from the `gguf` package.
"""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ember.errors import ConfigError

_MAGIC = b"GGUF"
# GGUF value types -> struct format (little-endian); 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SCALAR_SIZES = {k: struct.calcsize(f) for k, f in _SCALARS.items()}
_U64 = struct.Struct("<Q")  # a string's length
_STRING, _ARRAY = 8, 9
# bounds a hostile header meets before anything is sized from it: ggml's GGML_MAX_DIMS; arrays of arrays (llama.cpp
# has none; the gguf package reads them) at most this deep; the smallest metadata entry (a 0-length key, its type,
# a 1-byte value) and tensor entry (a 0-length name, one dim, its type and offset)
_MAX_DIMS, _MAX_NESTING = 4, 3
_MIN_KV, _MIN_TENSOR = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8
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


def _tensor_type(ttype: int, name: str) -> tuple[Any, int, int]:
    """(type, values a block, bytes a block): ember's GGMLType where it names it, else the gguf package's."""
    kind = _BY_ID.get(ttype)
    if kind is not None:
        return kind, *BLOCK_SIZES[kind]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        kind = GGMLQuantizationType(ttype)
        return kind, *GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise _Bad(f"tensor {name!r} has ggml type {ttype}: unknown (ggml's types are "
                   f"{sorted(int(k) for k in GGML_QUANT_SIZES)})") from None


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
    """``fields``: key -> value for scalars and strings; arrays stay (offset, item type, count) until ``value``.

    Every count, length, offset and shape the header states is checked against the file's size as it is read, so
    that a truncated or hand-crafted file is refused (ConfigError naming it) before anything is sized from it."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.buf = np.memmap(path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:  # a missing, unreadable or empty file
            raise ConfigError(f"model file {path!r} cannot be read as a GGUF file: {e}") from None
        try:
            self._parse(memoryview(self.buf))
        except _Bad as e:
            raise ConfigError(f"model file {path!r} is not a valid GGUF file: {e}") from None
        except (struct.error, ValueError, OverflowError, UnicodeDecodeError) as e:  # a check missed: still named
            raise ConfigError(f"model file {path!r} is not a valid GGUF file: {e}") from None

    def _parse(self, mv: memoryview) -> None:
        size = len(mv)
        if size < 24 or bytes(mv[:4]) != _MAGIC:
            raise _Bad("wrong magic or shorter than a GGUF header (24 bytes)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", mv, 4)
        if version not in (2, 3):
            raise _Bad(f"version {version} is not supported (2 and 3 are; a big-endian file reads as a huge "
                       "version)")
        # each entry takes at least its smallest encoding: the counts cannot promise more entries than bytes
        if n_kv > (size - 24) // _MIN_KV:
            raise _Bad(f"n_kv={n_kv} metadata entries cannot fit in its {size} bytes")
        if n_tensors > (size - 24) // _MIN_TENSOR:
            raise _Bad(f"n_tensors={n_tensors} tensor entries cannot fit in its {size} bytes")
        pos = 24
        self._raw: dict[str, tuple[int, int]] = {}  # key -> (offset of the value, value type)
        for _ in range(n_kv):
            key, pos = _string(mv, pos, "metadata key")
            if key in self._raw:
                raise _Bad(f"metadata key {key!r} appears twice")
            (vtype,) = struct.unpack_from("<I", _need(mv, pos, 4, key), pos)
            self._raw[key] = (pos + 4, vtype)
            pos = _skip(mv, pos + 4, vtype, key)
        infos = []
        for _ in range(n_tensors):
            name, pos = _string(mv, pos, "tensor name")
            (n_dims,) = struct.unpack_from("<I", _need(mv, pos, 4, name), pos)
            if not 1 <= n_dims <= _MAX_DIMS:
                raise _Bad(f"tensor {name!r} has n_dims={n_dims}: allowed 1..{_MAX_DIMS}")
            dims = struct.unpack_from(f"<{n_dims}Q", _need(mv, pos + 4, 8 * n_dims + 12, name), pos + 4)
            ttype, offset = struct.unpack_from("<IQ", mv, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, ttype, offset))
        if len({i[0] for i in infos}) != len(infos):
            raise _Bad("a tensor name appears twice")
        align = self.value("general.alignment", 32)
        if not isinstance(align, int) or isinstance(align, bool) or not 1 <= align <= 1 << 16 or align & (align - 1):
            raise _Bad(f"general.alignment={align!r}: allowed a power of two in 1..65536")
        start = -(-pos // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, ttype, offset in infos:
            kind, block, nbytes = _tensor_type(ttype, name)
            n = math.prod(dims)
            if dims[0] % block:
                raise _Bad(f"tensor {name!r} ({kind.name}) has {dims[0]} values a row: not whole blocks of {block}")
            length = n // block * nbytes
            lo = start + offset
            if offset % align or lo + length > size:
                raise _Bad(f"tensor {name!r} (shape {list(dims)}, {kind.name}) needs bytes {lo}..{lo + length} "
                           f"(offset {offset}, aligned to {align}); the file has {size}")
            np_dims = tuple(reversed(dims))
            if kind.name in _TYPED:
                dt = np.dtype(_TYPED[kind.name])
                data = self.buf[lo:lo + length].view(dt).reshape(np_dims)
            else:
                data = self.buf[lo:lo + length].reshape(*np_dims[:-1], np_dims[-1] // block * nbytes)
            self.tensors.append(GGUFTensor(name, kind, dims, data, block, nbytes))

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
        try:
            return _decode(memoryview(self.buf), pos, vtype)
        except UnicodeDecodeError as e:  # strings are decoded only when asked for
            raise ConfigError(f"model file {self.path!r}: metadata {key} holds a string that is not UTF-8 ({e})"
                              ) from None

    def array_len(self, key: str) -> int:
        """The number of entries of an array value, without decoding it."""
        pos, vtype = self._raw[key]
        if vtype != _ARRAY:
            raise ConfigError(f"model file {self.path!r}: GGUF field {key} is not an array")
        return struct.unpack_from("<Q", memoryview(self.buf), pos + 4)[0]


class _Bad(Exception):
    """What is wrong with the header; GGUFFile names the file."""


def _need(mv: memoryview, pos: int, n: int, what: str) -> memoryview:
    """mv, when it holds n bytes at pos."""
    if pos + n > len(mv):
        raise _Bad(f"{what}: {n} bytes at offset {pos} run past the end of the file ({len(mv)} bytes)")
    return mv


def _string(mv: memoryview, pos: int, what: str) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", _need(mv, pos, 8, what), pos)
    _need(mv, pos + 8, n, f"{what} of length {n}")
    return bytes(mv[pos + 8:pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _skip(mv: memoryview, pos: int, vtype: int, key: str, depth: int = 0) -> int:
    """The offset just past a value of vtype starting at pos, every length in it checked against the file."""
    if vtype in _SCALARS:
        _need(mv, pos, _SCALAR_SIZES[vtype], key)
        return pos + _SCALAR_SIZES[vtype]
    if vtype == _STRING:
        (n,) = struct.unpack_from("<Q", _need(mv, pos, 8, key), pos)
        _need(mv, pos + 8, n, f"{key}: a string of length {n}")
        return pos + 8 + n
    if vtype != _ARRAY:
        raise _Bad(f"metadata {key} has value type {vtype}: allowed 0..12")
    if depth >= _MAX_NESTING:
        raise _Bad(f"metadata {key} nests arrays deeper than {_MAX_NESTING} levels")
    itype, count = struct.unpack_from("<IQ", _need(mv, pos, 12, key), pos)
    pos += 12
    smallest = _SCALAR_SIZES.get(itype, 8 if itype == _STRING else 12)
    if count > (len(mv) - pos) // smallest:
        raise _Bad(f"metadata {key} declares {count} array entries: they cannot fit in the {len(mv) - pos} bytes "
                   "left in the file")
    if itype in _SCALARS:
        return pos + count * smallest
    if itype == _STRING:  # a vocabulary: tens of thousands of strings, one bound check each, no call per string
        end, length = len(mv), _U64.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                _need(mv, pos, 8, key)
            (n,) = length(mv, pos)
            pos += 8 + n
            if pos > end:
                raise _Bad(f"metadata {key}: a string of length {n} at offset {pos - 8 - n} runs past the end of "
                           f"the file ({end} bytes)")
        return pos
    for _ in range(count):  # nested arrays: each says its own length
        pos = _skip(mv, pos, itype, key, depth + 1)
    return pos


def _decode(mv: memoryview, pos: int, vtype: int) -> Any:
    if vtype in _SCALARS:
        return struct.unpack_from(_SCALARS[vtype], mv, pos)[0]
    if vtype == _STRING:
        return _string(mv, pos, "string value")[0]
    itype, count = struct.unpack_from("<IQ", mv, pos)
    pos += 12
    if itype in _NUMPY:
        return np.frombuffer(mv, dtype=_NUMPY[itype], count=count, offset=pos).tolist()
    out = []
    for _ in range(count):
        out.append(_decode(mv, pos, itype))
        pos = _skip(mv, pos, itype, "array entry")
    return out
