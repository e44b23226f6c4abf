"""Reading and validating PEFT LoRA adapters: the one implementation the engine (on load) and the platform
(on upload) share. `parse_adapter` returns a servable `LoraAdapter` or raises an `AdapterError` whose message
names the file, config field or tensor at fault.
"""

from loraplex.engine.lora.adapter import DEFAULT_MAX_RANK, LoraAdapter, LoraModule, parse_adapter
from loraplex.engine.lora.adapter_config import CONFIG_FILE, LoraAdapterConfig
from loraplex.engine.lora.adapter_files import WEIGHTS_FILE, adapter_digest, read_adapter_dir
from loraplex.engine.lora.base_modules import MODULES, module_key, module_shape
from loraplex.engine.lora.errors import (
    AdapterConfigError,
    AdapterError,
    AdapterFormatError,
    AdapterRankError,
    AdapterShapeError,
    AdapterValueError,
    UnsupportedAdapterFeature,
)
from loraplex.engine.lora.safetensors_format import TensorInfo, load_tensors, parse_safetensors

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_MAX_RANK",
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
]
