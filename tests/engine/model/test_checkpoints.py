"""A checkpoint the engine cannot serve is refused with an error that names the file or field."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.engine import LLM
from loraplex.engine.errors import CheckpointError

pytestmark = pytest.mark.unit


@pytest.fixture
def folder(checkpoint: Callable[..., Path], tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(checkpoint("llama-gqa"), copy)
    return copy


def _edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _load(folder: Path) -> LLM:
    return LLM(folder, device="cpu", kv_budget=4 * 2**20)


def test_unsupported_architecture(folder: Path) -> None:
    _edit_config(folder, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(CheckpointError, match=r"'architectures' is GPT2LMHeadModel"):
        _load(folder)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", -1, "'hidden_size' must be a positive integer"),
        ("num_key_value_heads", 3, "multiple of num_key_value_heads"),
        ("hidden_act", "gelu", "'hidden_act'"),
        (
            "rope_parameters",
            {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
            "'rope_scaling' has type 'dynamic'",
        ),
        ("torch_dtype", "float8", "'torch_dtype'"),
    ],
)
def test_bad_config_fields(folder: Path, field: str, value: object, message: str) -> None:
    _edit_config(folder, **{field: value})
    if field == "torch_dtype":
        _edit_config(folder, dtype="float8")
    with pytest.raises(CheckpointError, match=message):
        _load(folder)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file_is_named(folder: Path, name: str) -> None:
    (folder / name).unlink()
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        _load(folder)


def test_pickle_checkpoints_are_refused(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(CheckpointError, match="pickle"):
        _load(folder)


def test_missing_and_misshapen_tensors(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        _load(folder)
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"has shape \(3, 3\)"):
        _load(folder)


def test_sharded_index(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    llm = _load(folder)
    assert llm.engine.model.weight_bytes() > 0
    weight_map[names[0]] = "../elsewhere.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"not a \.safetensors file beside it"):
        _load(folder)
