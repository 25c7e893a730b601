"""A GGUF file's header: its key/value metadata and tensor table, read without the tensors.

Every part of duet that needs a GGUF file's metadata reads it here: the render tier's
tokenizer, the tokenizer digest both tiers compare, the worker's model config and its
structured-output vocabulary. `gguf.GGUFReader` would take seconds for this: it builds a
numpy view per array element, and a vocabulary is ~100k of them. This walks the header
once with `struct` over an mmap, and never touches tensor data.

Values come back as plain Python objects, the same ones `GGUFReader`'s `contents()`
gives: str, int, float, bool, and lists of them. The tokenizer digest is computed over
them, so that sameness is a contract.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, overload

_T = TypeVar("_T")

# GGUF value type -> struct format of a scalar; 8 is a string and 9 an array.
_SCALARS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"
}  # fmt: skip
_STRING = 8
_ARRAY = 9
_DEFAULT_ALIGNMENT = 32


class GGUFError(ValueError):
    """A file that is not GGUF, or whose header is malformed or of an unsupported version."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table: what a tensor is and where its bytes lie."""

    name: str
    shape: tuple[int, ...]
    """Dimensions innermost first, as GGUF stores them (numpy's order reversed)."""
    ggml_type: int
    """`gguf.GGMLQuantizationType` value: F32, F16, Q4_1, ..."""
    offset: int
    """Byte offset of the tensor's data from the start of the file."""


@dataclass(frozen=True)
class GGUFMetadata:
    """The header of one GGUF file, with typed accessors over its metadata."""

    path: Path
    version: int
    fields: Mapping[str, Any]
    """Every key read, in file order; values as plain Python objects."""
    tensors: Mapping[str, GGUFTensorInfo]
    """The tensor table by name; empty when only some keys were asked for."""

    def get(self, key: str, default: Any = None) -> Any:
        """The value of `key` as stored (scalar or list), or `default`."""
        return self.fields.get(key, default)

    @overload
    def integer(self, key: str) -> int | None: ...
    @overload
    def integer(self, key: str, default: _T) -> int | _T: ...
    def integer(self, key: str, default: object = None) -> object:
        """An integer (or bool) field, or `default` when absent."""
        return self._typed(key, int, default)

    @overload
    def number(self, key: str) -> float | None: ...
    @overload
    def number(self, key: str, default: _T) -> float | _T: ...
    def number(self, key: str, default: object = None) -> object:
        """A numeric field as a float, or `default` when absent."""
        value = self._typed(key, (int, float), default)
        return float(value) if key in self.fields else value

    @overload
    def string(self, key: str) -> str | None: ...
    @overload
    def string(self, key: str, default: _T) -> str | _T: ...
    def string(self, key: str, default: object = None) -> object:
        """A string field, or `default` when absent."""
        return self._typed(key, str, default)

    def strings(self, key: str) -> list[str]:
        """A string-array field; empty when absent."""
        return self._typed_list(key, str)

    def integers(self, key: str) -> list[int]:
        """An integer-array field; empty when absent."""
        return self._typed_list(key, int)

    def _typed(self, key: str, kind: type | tuple[type, ...], default: object) -> Any:
        if key not in self.fields:
            return default
        value = self.fields[key]
        if not isinstance(value, kind):
            raise GGUFError(f"{self.path.name}: {key} is {type(value).__name__}, not {kind}")
        return value

    def _typed_list(self, key: str, kind: type) -> list[Any]:
        value = self.fields.get(key, [])
        if not isinstance(value, list) or not all(isinstance(item, kind) for item in value):
            raise GGUFError(f"{self.path.name}: {key} is not a list of {kind.__name__}")
        return value


def read_gguf_metadata(path: str | Path, keys: Collection[str] | None = None) -> GGUFMetadata:
    """Read the header of the GGUF file at `path`.

    With `keys`, only those values are decoded (the rest are stepped over) and reading stops
    once all are found, so the tensor table is not read: the fast path for a few fields.
    """
    path = Path(path)
    try:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _HeaderReader(data, path).read(keys)
    except GGUFError:
        raise
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        # A truncated or corrupt header; an empty file cannot even be mapped (ValueError).
        raise GGUFError(f"{path.name}: malformed GGUF header ({exc})") from exc


class _HeaderReader:
    """A cursor over the header bytes; `order` is struct's byte-order prefix."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data = data
        self.path = path
        self.at = 0
        self.order = "<"

    def read(self, keys: Collection[str] | None) -> GGUFMetadata:
        if self.data[:4] != b"GGUF":
            raise GGUFError(f"{self.path.name} is not a GGUF file")
        (version,) = struct.unpack_from("<I", self.data, 4)
        if version & 0xFFFF == 0:  # written on a big-endian machine
            self.order = ">"
            (version,) = struct.unpack_from(">I", self.data, 4)
        if version < 2:
            raise GGUFError(f"{self.path.name}: GGUF v{version} is not supported")
        self.at = 8
        num_tensors, num_kv = self.unpack("QQ")
        fields = self.read_fields(num_kv, keys)
        tensors: dict[str, GGUFTensorInfo] = {}
        if keys is None:
            tensors = self.read_tensor_table(num_tensors, fields)
        return GGUFMetadata(path=self.path, version=version, fields=fields, tensors=tensors)

    def read_fields(self, num_kv: int, keys: Collection[str] | None) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        wanted = None if keys is None else set(keys)
        for _ in range(num_kv):
            key = self.string()
            (kind,) = self.unpack("I")
            keep = wanted is None or key in wanted
            value = self.value(kind, keep)
            if not keep:
                continue
            if key in fields:
                raise GGUFError(f"{self.path.name}: duplicate metadata key {key!r}")
            fields[key] = value
            if wanted is not None and len(fields) == len(wanted):
                break
        return fields

    def read_tensor_table(self, count: int, fields: Mapping[str, Any]) -> dict[str, GGUFTensorInfo]:
        entries = []
        for _ in range(count):
            name = self.string()
            (num_dims,) = self.unpack("I")
            shape = self.unpack(f"{num_dims}Q")
            ggml_type, offset = self.unpack("IQ")
            entries.append((name, shape, ggml_type, offset))
        alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
        data_start = -(-self.at // alignment) * alignment  # tensor data begins aligned
        return {
            name: GGUFTensorInfo(name, tuple(shape), ggml_type, data_start + offset)
            for name, shape, ggml_type, offset in entries
        }

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        fmt = self.order + fmt
        values = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        start, self.at = self.at, self.at + length
        return self.data[start : self.at].decode("utf-8")

    def skip_string(self) -> None:
        (length,) = self.unpack("Q")
        self.at += length

    def value(self, kind: int, keep: bool) -> Any:
        """The value of type `kind` at the cursor; None when stepped over (`keep` false)."""
        if kind == _ARRAY:
            return self.array(keep)
        if kind == _STRING:
            if keep:
                return self.string()
            self.skip_string()
            return None
        if kind not in _SCALARS:
            raise GGUFError(f"{self.path.name}: unknown GGUF value type {kind}")
        return self.unpack(_SCALARS[kind])[0]

    def array(self, keep: bool) -> list[Any] | None:
        item_kind, count = self.unpack("IQ")
        if item_kind in _SCALARS:
            fmt = f"{count}{_SCALARS[item_kind]}"
            if not keep:  # a scalar array is stepped over in one move
                self.at += struct.calcsize(self.order + fmt)
                return None
            return list(self.unpack(fmt))
        items = [self.value(item_kind, keep) for _ in range(count)]
        return items if keep else None
