"""A draft model for speculative decoding cut from its target: the target's first layers (a layer-skip draft).

`make_truncated_draft(target, out, num_layers)` writes a checkpoint with the target's embeddings, its first
`num_layers` decoder layers, its final norm and lm_head, and its tokenizer files: the same tokenizer by
construction, and no training needed, which is what a benchmark of the draft_model method wants of the demo model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors.torch import save_file

from loraplex.engine.model.weights import CheckpointTensors

# Every file of a model folder that is not config.json or weights: the tokenizer and generation settings.
_COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
_LAYERS_PREFIX = "model.layers."


def make_truncated_draft(target_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], num_layers: int) -> Path:
    """Write the layer-skip draft of the checkpoint in `target_dir` into `out_dir` (created if need be); returns
    `out_dir`. Raises ValueError unless 1 <= num_layers <= the target's layers."""
    target, out = Path(target_dir), Path(out_dir)
    config = json.loads((target / "config.json").read_text())
    num_target_layers = int(config["num_hidden_layers"])
    if not 1 <= num_layers <= num_target_layers:
        raise ValueError(f"num_layers must be between 1 and the target's {num_target_layers} layers, not {num_layers}")
    tensors = CheckpointTensors(target)
    kept = {}
    for name in sorted(tensors.names):
        if name.startswith(_LAYERS_PREFIX) and int(name[len(_LAYERS_PREFIX) :].split(".", 1)[0]) >= num_layers:
            continue
        kept[name] = tensors.get(name).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in _COPIED_FILES:
        if (target / name).is_file():
            shutil.copyfile(target / name, out / name)
    return out
