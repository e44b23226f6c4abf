"""The strict safetensors reader: valid files read back exactly; anything malformed is an AdapterFormatError."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from loraplex.engine.lora import AdapterFormatError, load_tensors, parse_safetensors

pytestmark = pytest.mark.unit


def build(header: dict[str, Any], data: bytes, *, header_length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_length is None else header_length) + raw + data


def entry(dtype: str, shape: list[int], start: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


VALID = save(
    {
        "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "c": torch.tensor([[0.25]], dtype=torch.float16),
        "empty": torch.zeros(0, 5),
    },
    metadata={"format": "pt"},
)


def test_a_file_written_by_safetensors_reads_back_exactly() -> None:
    infos = parse_safetensors(VALID)
    assert set(infos) == {"a", "b", "c", "empty"}
    tensors = load_tensors(VALID, infos)
    assert torch.equal(tensors["a"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert tensors["b"].dtype == torch.bfloat16 and tensors["b"].tolist() == [1.5, -2.0]
    assert tensors["c"].dtype == torch.float16 and tensors["c"].shape == (1, 1)
    assert tensors["empty"].shape == (0, 5)
    assert set(load_tensors(VALID, infos, ["b"])) == {"b"}


def test_loaded_tensors_own_their_memory() -> None:
    data = bytearray(VALID)
    infos = parse_safetensors(bytes(data))
    tensor = load_tensors(bytes(data), infos, ["a"])["a"]
    data[infos["a"].start : infos["a"].end] = bytes(infos["a"].num_bytes)
    assert tensor[2, 3] == 11.0


_X = b'{"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
_DUPLICATE = b'{"x": ' + _X + b', "x": ' + _X + b"}"

MALFORMED: dict[str, tuple[bytes, str]] = {
    "shorter than 8 bytes": (b"\x01\x00\x00", "too short"),
    "header length beyond the file": (build({}, b"", header_length=1000), "truncated"),
    "header length over the cap": (struct.pack("<Q", 2 << 20) + b"{}", "at most"),
    "header not JSON": (struct.pack("<Q", 5) + b'{"a":', "not valid"),
    "header not an object": (struct.pack("<Q", 2) + b"[]", "JSON object"),
    "header not UTF-8": (struct.pack("<Q", 2) + b"\xff\xfe", "UTF-8"),
    "duplicate keys": (struct.pack("<Q", len(_DUPLICATE)) + _DUPLICATE + b"a", "'x' twice"),
    "unknown dtype": (build({"x": entry("F17", [2], 0, 2)}, b"ab"), "'F17'"),
    "negative shape": (build({"x": entry("U8", [-2], 0, 2)}, b"ab"), "[-2]"),
    "float shape": (build({"x": entry("U8", [2.0], 0, 2)}, b"ab"), "[2.0]"),
    "shape does not fill its bytes": (build({"x": entry("F32", [2], 0, 4)}, b"abcd"), "does not fill"),
    "huge shape": (build({"x": entry("F32", [2**62, 2**62], 0, 4)}, b"abcd"), "does not fill"),
    "offsets beyond the data": (build({"x": entry("U8", [4], 0, 4)}, b"ab"), "outside"),
    "offsets reversed": (build({"x": entry("U8", [0], 2, 0)}, b"ab"), "outside"),
    "gap between tensors": (
        build({"x": entry("U8", [1], 0, 1), "y": entry("U8", [1], 2, 3)}, b"abc"),
        "gap",
    ),
    "overlapping tensors": (
        build({"x": entry("U8", [2], 0, 2), "y": entry("U8", [2], 1, 3)}, b"abc"),
        "overlaps",
    ),
    "bytes after the last tensor": (build({"x": entry("U8", [1], 0, 1)}, b"ab"), "after its last tensor"),
    "gap before the first tensor": (build({"x": entry("U8", [1], 1, 2)}, b"ab"), "gap"),
    "extra entry field": (
        build({"x": {**entry("U8", [1], 0, 1), "endian": "big"}}, b"a"),
        "exactly",
    ),
    "metadata not strings": (build({"__metadata__": {"format": 1}}, b""), "__metadata__"),
    "deeply nested JSON": (struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000, "not valid"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_files_are_refused_with_a_reason(case: str) -> None:
    data, reason = MALFORMED[case]
    with pytest.raises(AdapterFormatError) as caught:
        parse_safetensors(data, file_name="upload.safetensors")
    assert "upload.safetensors" in str(caught.value)
    assert reason in str(caught.value)


def test_errors_about_one_tensor_name_it() -> None:
    with pytest.raises(AdapterFormatError) as caught:
        parse_safetensors(build({"lora.weight": entry("F17", [2], 0, 2)}, b"ab"))
    assert caught.value.field == "lora.weight"
    assert "'lora.weight'" in str(caught.value)


def test_the_header_cap_is_configurable() -> None:
    with pytest.raises(AdapterFormatError, match="at most 16 bytes"):
        parse_safetensors(VALID, max_header_bytes=16)


def test_empty_tensors_may_sit_anywhere_in_the_tiling() -> None:
    data = build({"x": entry("U8", [1], 0, 1), "e": entry("F32", [0], 1, 1), "y": entry("U8", [1], 1, 2)}, b"ab")
    assert load_tensors(data, parse_safetensors(data))["y"].tolist() == [ord("b")]


def parse_or_refuse(data: bytes) -> None:
    """The property: a parse either succeeds (and every tensor then loads) or raises AdapterFormatError."""
    try:
        infos = parse_safetensors(data, max_header_bytes=4096)
    except AdapterFormatError:
        return
    tensors = load_tensors(data, infos)
    for name, info in infos.items():
        assert tuple(tensors[name].shape) == info.shape


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_arbitrary_bytes_only_ever_raise_adapter_format_errors(data: bytes) -> None:
    parse_or_refuse(data)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_headers_only_ever_raise_adapter_format_errors(header: bytes) -> None:
    parse_or_refuse(struct.pack("<Q", len(header)) + header + bytes(16))


@settings(max_examples=600, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=6),
    st.integers(0, len(VALID)),
)
def test_mutated_valid_files_only_ever_raise_adapter_format_errors(flips: list[tuple[int, int]], keep: int) -> None:
    data = bytearray(VALID)
    for position, value in flips:
        data[position] = value
    parse_or_refuse(bytes(data[:keep]) if keep % 3 == 0 else bytes(data))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=500, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["a", "b", "__metadata__"]) | st.text(max_size=4),
        st.fixed_dictionaries(
            {
                "dtype": st.sampled_from(["F32", "BF16", "U8", "F17", ""]) | JSON_VALUES,
                "shape": st.lists(st.integers(-2, 5), max_size=3) | JSON_VALUES,
                "data_offsets": st.lists(st.integers(-2, 40), min_size=2, max_size=2) | JSON_VALUES,
            }
        )
        | JSON_VALUES,
        max_size=4,
    ),
    st.integers(0, 40),
)
def test_structured_headers_only_ever_raise_adapter_format_errors(header: dict[str, Any], data_length: int) -> None:
    try:
        raw = json.dumps(header).encode()
    except ValueError:
        return
    parse_or_refuse(struct.pack("<Q", len(raw)) + raw + bytes(range(data_length)))
