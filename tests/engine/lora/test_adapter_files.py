"""Reading an adapter folder (safetensors only, no pickle or code beside it) and the content digest."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.engine.lora import AdapterFormatError, adapter_digest, parse_adapter, read_adapter_dir

pytestmark = pytest.mark.unit

PeftAdapter = Any  # fixture type from conftest.py
Base = Any


@pytest.fixture
def folder(reference_adapter: PeftAdapter, tmp_path: Path) -> Path:
    copy = tmp_path / "adapter"
    shutil.copytree(reference_adapter.path, copy)
    return copy


def test_a_save_pretrained_folder_reads_as_its_two_files(folder: Path) -> None:
    config_bytes, weights_bytes = read_adapter_dir(folder)
    assert config_bytes == (folder / "adapter_config.json").read_bytes()
    assert weights_bytes == (folder / "adapter_model.safetensors").read_bytes()


@pytest.mark.parametrize(
    "name", ["adapter_model.bin", "training_args.bin", "optimizer.pt", "model.pth", "x.pkl", "modeling.py"]
)
def test_pickle_or_code_beside_the_adapter_is_refused_by_name(name: str, folder: Path) -> None:
    (folder / name).write_bytes(b"\x80\x04")
    with pytest.raises(AdapterFormatError) as caught:
        read_adapter_dir(folder)
    assert f"'{name}'" in str(caught.value)
    assert caught.value.field == name


@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_missing_file_is_named(name: str, folder: Path) -> None:
    (folder / name).unlink()
    with pytest.raises(AdapterFormatError, match=name.replace(".", r"\.")):
        read_adapter_dir(folder)


def test_a_symlinked_weights_file_is_refused(folder: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.safetensors"
    (folder / "adapter_model.safetensors").rename(target)
    (folder / "adapter_model.safetensors").symlink_to(target)
    with pytest.raises(AdapterFormatError, match=r"adapter_model\.safetensors.*not a regular file"):
        read_adapter_dir(folder)


def test_an_oversized_weights_file_is_refused_before_reading(folder: Path) -> None:
    with pytest.raises(AdapterFormatError, match="at most 100 are accepted"):
        read_adapter_dir(folder, max_weights_bytes=100)


def test_a_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AdapterFormatError, match="does not exist"):
        read_adapter_dir(tmp_path / "nope")


def test_the_digest_is_sha256_and_stable(folder: Path, base: Base) -> None:
    config_bytes, weights_bytes = read_adapter_dir(folder)
    digest = adapter_digest(config_bytes, weights_bytes)
    assert digest.startswith("sha256:") and len(digest) == len("sha256:") + 64
    assert adapter_digest(bytes(config_bytes), bytes(weights_bytes)) == digest
    assert parse_adapter(config_bytes, weights_bytes, base.config).digest == digest


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.binary(max_size=64), st.binary(max_size=64), st.binary(max_size=64))
def test_different_files_give_different_digests(
    config_a: bytes, weights_a: bytes, config_b: bytes, weights_b: bytes
) -> None:
    same = (config_a, weights_a) == (config_b, weights_b)
    assert (adapter_digest(config_a, weights_a) == adapter_digest(config_b, weights_b)) == same


@pytest.mark.parametrize("which", ["config", "weights"])
def test_one_changed_byte_in_either_file_changes_the_digest(which: str, folder: Path) -> None:
    config_bytes, weights_bytes = read_adapter_dir(folder)
    digest = adapter_digest(config_bytes, weights_bytes)
    if which == "config":
        config_bytes = config_bytes.replace(b'"r": 8', b'"r": 9')
    else:
        weights_bytes = weights_bytes[:-1] + bytes([weights_bytes[-1] ^ 1])
    assert adapter_digest(config_bytes, weights_bytes) != digest


def test_moving_bytes_between_the_files_changes_the_digest() -> None:
    assert adapter_digest(b"ab", b"c") != adapter_digest(b"a", b"bc")
