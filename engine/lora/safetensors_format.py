"""A strict reader of the safetensors format for untrusted bytes (an uploaded adapter).

Layout: 8 bytes little-endian u64 N, then N bytes of JSON header, then the data section. The header maps each
tensor name to {"dtype", "shape", "data_offsets": [start, end]} (offsets relative to the data section), plus an
optional "__metadata__" object of string values. We check more than the safetensors library does when it opens
a file (duplicate keys, unknown fields) and we never hand the bytes to native code before they pass: every
failure is an AdapterFormatError whose message names the file and, where there is one, the tensor.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.engine.lora.errors import AdapterFormatError, shorten

DEFAULT_MAX_HEADER_BYTES = 1 << 20
METADATA_KEY = "__metadata__"
_HEADER_LENGTH_BYTES = 8
_ENTRY_FIELDS = frozenset({"dtype", "shape", "data_offsets"})

# safetensors dtype name -> (bytes per element, torch dtype).
DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "BOOL": (1, torch.bool),
    "U8": (1, torch.uint8),
    "I8": (1, torch.int8),
    "F8_E5M2": (1, torch.float8_e5m2),
    "F8_E4M3": (1, torch.float8_e4m3fn),
    "I16": (2, torch.int16),
    "U16": (2, torch.uint16),
    "F16": (2, torch.float16),
    "BF16": (2, torch.bfloat16),
    "I32": (4, torch.int32),
    "U32": (4, torch.uint32),
    "F32": (4, torch.float32),
    "F64": (8, torch.float64),
    "I64": (8, torch.int64),
    "U64": (8, torch.uint64),
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lies. start and end are absolute offsets into the file's bytes (header included)."""

    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def num_bytes(self) -> int:
        return self.end - self.start


def parse_safetensors(
    data: bytes, *, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES, file_name: str = "adapter_model.safetensors"
) -> dict[str, TensorInfo]:
    """Validate the structure of a safetensors file and return its tensors by name (without reading them).

    Guarantees on return: every tensor's dtype is known, its shape's byte size equals its byte range, and the
    byte ranges tile the data section exactly (no gap, no overlap, nothing after the last tensor).
    """
    if len(data) < _HEADER_LENGTH_BYTES:
        raise AdapterFormatError(
            f"{file_name} is {len(data)} bytes long, too short for a safetensors file (at least 8)", field=file_name
        )
    (header_length,) = struct.unpack("<Q", data[:_HEADER_LENGTH_BYTES])
    if header_length > max_header_bytes:
        raise AdapterFormatError(
            f"{file_name} declares a {header_length}-byte header; at most {max_header_bytes} bytes are accepted",
            field=file_name,
        )
    data_start = _HEADER_LENGTH_BYTES + header_length
    if data_start > len(data):
        raise AdapterFormatError(
            f"{file_name} declares a {header_length}-byte header but only {len(data) - 8} bytes follow: "
            "the file is truncated or not safetensors",
            field=file_name,
        )
    header = _decode_header(data[_HEADER_LENGTH_BYTES:data_start], file_name)
    data_length = len(data) - data_start

    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == METADATA_KEY:
            _check_metadata(entry, file_name)
            continue
        info = _tensor_info(name, entry, data_length, file_name)
        infos[name] = TensorInfo(info.dtype, info.shape, info.start + data_start, info.end + data_start)
    _check_tiling(infos, data_start, len(data), file_name)
    return infos


def load_tensors(
    data: bytes, infos: dict[str, TensorInfo], names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """Copy the named tensors (all by default) out of `data`; `infos` must come from parse_safetensors(data).

    Each tensor owns its memory (a copy), so `data` can be dropped afterwards. safetensors stores little-endian
    values, the byte order of every machine torch supports.
    """
    tensors: dict[str, torch.Tensor] = {}
    for name in infos if names is None else names:
        info = infos[name]
        torch_dtype = DTYPES[info.dtype][1]
        if info.num_bytes == 0:
            # torch.frombuffer refuses an empty buffer.
            tensors[name] = torch.empty(info.shape, dtype=torch_dtype)
            continue
        # bytearray: torch.frombuffer wants a writable buffer, and the copy frees the tensor from `data`.
        flat = torch.frombuffer(bytearray(data[info.start : info.end]), dtype=torch_dtype)
        tensors[name] = flat.reshape(info.shape)
    return tensors


def _decode_header(raw: bytes, file_name: str) -> dict[str, Any]:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise AdapterFormatError(f"{file_name}'s header names '{shorten(key)}' twice", field=shorten(key))
            result[key] = value
        return result

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except AdapterFormatError:
        raise
    # RecursionError: deeply nested arrays; ValueError covers bad UTF-8, bad JSON and over-long integers.
    except (ValueError, RecursionError) as exc:
        reason = str(exc) if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
        raise AdapterFormatError(f"{file_name}'s header is not valid UTF-8 JSON ({reason})", field=file_name) from None
    if not isinstance(header, dict):
        raise AdapterFormatError(f"{file_name}'s header must be a JSON object", field=file_name)
    return header


def _check_metadata(entry: object, file_name: str) -> None:
    if not isinstance(entry, dict) or not all(isinstance(value, str) for value in entry.values()):
        raise AdapterFormatError(
            f"{file_name}'s '{METADATA_KEY}' must be an object of string values", field=METADATA_KEY
        )


def _tensor_info(name: str, entry: object, data_length: int, file_name: str) -> TensorInfo:
    where = f"{file_name}: tensor '{shorten(name)}'"
    if not isinstance(entry, dict) or set(entry) != _ENTRY_FIELDS:
        raise AdapterFormatError(
            f"{where} must be described by exactly 'dtype', 'shape' and 'data_offsets'", field=name
        )
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise AdapterFormatError(
            f"{where} has unknown dtype {shorten(repr(dtype))}; known: {', '.join(DTYPES)}", field=name
        )
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_int(dim) and dim >= 0 for dim in shape):
        raise AdapterFormatError(
            f"{where} has shape {shorten(repr(shape))}; expected a list of non-negative integers", field=name
        )
    offsets = entry["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(offset) for offset in offsets)):
        raise AdapterFormatError(
            f"{where} has data_offsets {shorten(repr(offsets))}; expected [start, end]", field=name
        )
    start, end = offsets
    if not 0 <= start <= end <= data_length:
        raise AdapterFormatError(
            f"{where} has data_offsets [{start}, {end}] outside the {data_length}-byte data section", field=name
        )
    itemsize = DTYPES[dtype][0]
    if _byte_size(shape, itemsize, limit=data_length) != end - start:
        raise AdapterFormatError(
            f"{where}: shape {shorten(repr(shape))} of {dtype} ({itemsize} bytes each) does not fill its "
            f"{end - start} bytes",
            field=name,
        )
    return TensorInfo(dtype, tuple(shape), start, end)


def _byte_size(shape: list[int], itemsize: int, *, limit: int) -> int:
    """Bytes of a tensor of this shape, or limit + 1 once it is larger (so a hostile shape stays cheap)."""
    if 0 in shape:
        return 0
    size = itemsize
    for dim in shape:
        size *= dim
        if size > limit:
            return limit + 1
    return size


def _check_tiling(infos: dict[str, TensorInfo], data_start: int, file_length: int, file_name: str) -> None:
    # Gaps could hide bytes nobody checks; overlaps would let two tensors alias. Sorting by (start, end) puts
    # empty tensors before a non-empty one at the same offset, where they fit.
    position = data_start
    for name, info in sorted(infos.items(), key=lambda item: (item[1].start, item[1].end)):
        if info.start != position:
            kind = "overlaps the tensor before it" if info.start < position else "leaves a gap before it"
            raise AdapterFormatError(
                f"{file_name}: tensor '{shorten(name)}' starts at data offset {info.start - data_start}, which {kind} "
                f"(expected {position - data_start}); tensors must tile the data section exactly",
                field=name,
            )
        position = info.end
    if position != file_length:
        raise AdapterFormatError(
            f"{file_name} has {file_length - position} bytes after its last tensor", field=file_name
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
