"""Everything LoRA: the PEFT format and its validation (adapter, adapter_config, adapter_files, safetensors_format,
peft_matching, base_modules, errors), an adapter's reference and digest (ref), its layout in pool pages (layout),
the tiers it is loaded through and its residency (manager), and one step's segments and deltas (batch).

May import: engine.model (the model's config and RoPE layout), engine.memory (the pages adapters live in),
engine.errors, kernels. Never engine.core or engine.serve.

The names below are the public face, the one implementation of PEFT reading the engine (on load) and the platform
(on upload) share: `parse_adapter` returns a servable `LoraAdapter` or raises an `AdapterError` whose message
names the file, config field or tensor at fault.
"""

from loraplex.engine.lora.adapter import DEFAULT_MAX_RANK, LoraAdapter, LoraModule, parse_adapter
from loraplex.engine.lora.adapter_config import CONFIG_FILE, MAX_CONFIG_BYTES, LoraAdapterConfig
from loraplex.engine.lora.adapter_files import (
    DRAFT_FOLDER,
    FORBIDDEN_SUFFIXES,
    WEIGHTS_FILE,
    adapter_digest,
    read_adapter_dir,
)
from loraplex.engine.lora.base_modules import MODULES, module_key, module_shape
from loraplex.engine.lora.errors import (
    AdapterConfigError,
    AdapterError,
    AdapterFormatError,
    AdapterRankError,
    AdapterShapeError,
    AdapterValueError,
    UnsupportedAdapterFeature,
    shorten,
)
from loraplex.engine.lora.safetensors_format import TensorInfo, load_tensors, parse_safetensors

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_MAX_RANK",
    "DRAFT_FOLDER",
    "FORBIDDEN_SUFFIXES",
    "MAX_CONFIG_BYTES",
    "MODULES",
    "WEIGHTS_FILE",
    "AdapterConfigError",
    "AdapterError",
    "AdapterFormatError",
    "AdapterRankError",
    "AdapterShapeError",
    "AdapterValueError",
    "LoraAdapter",
    "LoraAdapterConfig",
    "LoraModule",
    "TensorInfo",
    "UnsupportedAdapterFeature",
    "adapter_digest",
    "load_tensors",
    "module_key",
    "module_shape",
    "parse_adapter",
    "parse_safetensors",
    "read_adapter_dir",
    "shorten",
]
