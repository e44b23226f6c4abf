"""Reading a checkpoint's tensors: safetensors only (one file or a sharded index), never pickle."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.engine.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth", "consolidated.00.pth")


class CheckpointTensors:
    """Name -> tensor access over a checkpoint's safetensors files, opened lazily, one tensor at a time."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._files = _tensor_files(path)

    @property
    def names(self) -> set[str]:
        return set(self._files)

    def file_of(self, name: str) -> str:
        return self._files[name].name

    def get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise CheckpointError(f"the checkpoint in {self._path} has no tensor '{name}'")
        with safe_open(str(self._files[name]), framework="pt") as handle:
            tensor: torch.Tensor = handle.get_tensor(name)
        return tensor

    def get_shaped(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """`name`, which must exist and have `shape` (what config.json implies); else a CheckpointError."""
        if name not in self._files:
            raise CheckpointError(f"the checkpoint has no tensor '{name}'")
        tensor = self.get(name)
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"tensor '{name}' in {self.file_of(name)} has shape {tuple(tensor.shape)}, "
                f"but config.json implies {shape}"
            )
        return tensor

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        by_file: dict[Path, list[str]] = {}
        for name, file in self._files.items():
            by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt") as handle:
                for name in names:
                    yield name, handle.get_tensor(name)


def _tensor_files(path: Path) -> dict[str, Path]:
    index = path / INDEX_FILE
    single = path / SINGLE_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{INDEX_FILE} in {path} is not a valid index: {exc}") from None
        files: dict[str, Path] = {}
        for name, file_name in weight_map.items():
            file = (path / str(file_name)).resolve()
            if file.parent != path.resolve() or not file.name.endswith(".safetensors"):
                raise CheckpointError(f"{INDEX_FILE} names '{file_name}', which is not a .safetensors file beside it")
            if not file.is_file():
                raise CheckpointError(f"{INDEX_FILE} names '{file_name}', which is missing from {path}")
            files[str(name)] = file
        return files
    if single.is_file():
        return {name: single for name in _names_in(single)}
    pickled = [name for name in _PICKLE_FILES if (path / name).exists()]
    if pickled:
        raise CheckpointError(
            f"{path} holds {pickled[0]}, a pickle checkpoint; loraplex loads only safetensors "
            f"({SINGLE_FILE} or {INDEX_FILE}): convert it first"
        )
    raise CheckpointError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def _names_in(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{file.name} is not a valid safetensors file: {exc}") from None
