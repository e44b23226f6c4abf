"""Embedding-model checkpoints as sentence-transformers saves them (a bare decoder, modules.json, the Pooling
module's config, Normalize), made from a random test checkpoint, for the engine's and the platform's tests."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Literal

import torch

from _support.checkpoints import make_checkpoint

_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def make_embedding_checkpoint(
    path: Path,
    variant: str = "qwen3",
    *,
    pooling: Literal["last", "mean", "cls"] = "last",
    normalize: bool = True,
    headless: bool = True,
) -> Path:
    """A random `variant` checkpoint as an embedding model: with `headless`, its bare decoder (transformers' AutoModel,
    tensor names without `model.`, no lm_head: what sentence-transformers writes for Qwen3-Embedding), else the
    causal LM; then modules.json with Transformer, Pooling (`pooling`) and, with `normalize`, Normalize."""
    from transformers import AutoModel

    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        source = make_checkpoint(Path(scratch), variant)
        if headless:
            AutoModel.from_pretrained(source, dtype=torch.float32, local_files_only=True).save_pretrained(path)
            for file in source.iterdir():
                if file.is_file() and not file.name.endswith(".safetensors") and file.name != "config.json":
                    (path / file.name).write_bytes(file.read_bytes())
        else:
            for file in source.iterdir():
                if file.is_file():
                    (path / file.name).write_bytes(file.read_bytes())
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {f"pooling_mode_{m}": False for m in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")}
    flags |= {"pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False, _MODES[pooling]: True}
    pooling_config = {"word_embedding_dimension": hidden, **flags, "include_prompt": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config, indent=2))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    return path
