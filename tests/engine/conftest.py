"""Fixtures for engine tests: random checkpoints (made once per session) and their transformers twins."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _support.checkpoints import make_checkpoint, make_trained_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """checkpoint(variant, dtype=torch.float32) -> folder, made once per session."""
    made: dict[tuple[str, torch.dtype], Path] = {}

    def get(variant: str, dtype: torch.dtype = torch.float32) -> Path:
        key = (variant, dtype)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"{variant}-{str(dtype).removeprefix('torch.')}")
            made[key] = make_checkpoint(folder, variant, dtype=dtype)
        return made[key]

    return get


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """trained_checkpoint(variant) -> folder: the random checkpoint after a short training on a bigram language
    (_support/checkpoints.py), for tests that need a model whose predictions mean something. Made once."""
    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            made[variant] = make_trained_checkpoint(tmp_path_factory.mktemp(f"{variant}-trained"), variant)
        return made[variant]

    return get


@pytest.fixture(scope="session")
def hf_model() -> Callable[[Path], Any]:
    """The transformers model for a checkpoint folder, in float32 eval mode (cached)."""
    from transformers import AutoModelForCausalLM

    loaded: dict[Path, Any] = {}

    def get(path: Path) -> Any:
        if path not in loaded:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
            loaded[path] = model.eval()
        return loaded[path]

    return get
