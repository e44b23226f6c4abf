"""A draft model for speculative decoding cut from its target: the target's first layers (a layer-skip draft).

`make_truncated_draft(target, out, num_layers)` writes a checkpoint with the target's embeddings, its first
`num_layers` decoder layers, its final norm and lm_head, and its tokenizer files: the same tokenizer by
construction, and no training needed, which is what a benchmark of the draft_model method wants of the demo model.

`make_truncated_draft_adapter(adapter, out, num_layers)` cuts an adapter of the target the same way: its modules of
the first `num_layers` layers, the draft counterpart (engine/core/draft_adapters.py) that matches such a draft.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from loraplex.engine.lora import CONFIG_FILE, WEIGHTS_FILE
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
_ADAPTER_LAYERS_PREFIX = "base_model.model.model.layers."  # PEFT's saved keys


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


def make_truncated_draft_adapter(
    adapter_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], num_layers: int
) -> Path:
    """Write the modules of layers < `num_layers` of the PEFT adapter in `adapter_dir` into `out_dir` (created if need
    be), with its config (`layers_to_transform`, if it lists layers, cut the same way); returns `out_dir`. Put there
    as the adapter's `draft/` folder, it is the counterpart a `make_truncated_draft` draft of as many layers runs.
    Raises ValueError unless num_layers >= 1 and the adapter has a module in those layers."""
    adapter, out = Path(adapter_dir), Path(out_dir)
    if num_layers < 1:
        raise ValueError(f"num_layers must be at least 1, not {num_layers}")
    config = json.loads((adapter / CONFIG_FILE).read_text())
    tensors = load_file(str(adapter / WEIGHTS_FILE))
    kept = {
        name: tensor.contiguous()
        for name, tensor in sorted(tensors.items())
        if not name.startswith(_ADAPTER_LAYERS_PREFIX)
        or int(name[len(_ADAPTER_LAYERS_PREFIX) :].split(".", 1)[0]) < num_layers
    }
    if not any(name.startswith(_ADAPTER_LAYERS_PREFIX) for name in kept):
        raise ValueError(f"the adapter {adapter} adapts no module in the first {num_layers} layers")
    layers = config.get("layers_to_transform")
    if isinstance(layers, list):
        config["layers_to_transform"] = [layer for layer in layers if layer < num_layers]
    out.mkdir(parents=True, exist_ok=True)
    save_file(kept, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out
