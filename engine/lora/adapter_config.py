"""adapter_config.json of a PEFT LoRA adapter: read, type-checked, and refused where it asks for more than LoRA.

Every field of peft 0.21.2's LoraConfig (peft/tuners/lora/config.py) falls in one of four groups: the ones that
decide the math (read here), the ones that only matter while training or for locating the base model (ignored:
loraplex never follows base_model_name_or_path), features that change the math at inference (refused by name),
and fields this version does not know: those are accepted only while unset (null, false or empty), since a set
one may be a newer PEFT feature that changes the math. Missing fields take LoraConfig's defaults, as PEFT does.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.lora import peft_matching
from loraplex.engine.lora.base_modules import ALL_MODULES, EMBEDDING_MODULES
from loraplex.engine.lora.errors import AdapterConfigError, AdapterFormatError, UnsupportedAdapterFeature, shorten

CONFIG_FILE = "adapter_config.json"
MAX_CONFIG_BYTES = 1 << 20
MAX_PATTERN_ENTRIES = 2048
# Bounds the regex work of one config (see peft_matching's bound per pattern; decision 0019 has the cost).
MAX_TOTAL_REGEX_REPEATS = 32
# PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for llama, mistral, qwen2/3 and gemma
# (peft/utils/constants.py); peft has none for phi3 (it needs target_modules there).
DEFAULT_TARGET_MODULES = ("q_proj", "v_proj")
# PEFT condenses a target_modules list this long into suffixes (MIN_TARGET_MODULES_FOR_OPTIMIZATION), which
# changes how layers_to_transform applies to full module names.
_PEFT_CONDENSE_AT = 20

_IGNORED = frozenset(
    {
        "base_model_name_or_path",  # a path on the trainer's machine: never followed
        "revision",
        "inference_mode",
        "task_type",
        "lora_dropout",  # training only
        "peft_version",
        "megatron_core",  # a module name used only with megatron_config, which is refused
        "qalora_group_size",  # used only with use_qalora, which is refused
        "ensure_weight_tying",  # ties embedding adapters, which are refused
        "eva_config",  # EVA initialises A from data; the saved weights are plain LoRA
        "corda_config",  # used only with init_lora_weights="corda", which is refused
        "lora_ga_config",  # used only with init_lora_weights="lora_ga", which is refused
        "loftq_config",  # used only with init_lora_weights="loftq", which is refused
        "runtime_config",
    }
)
_READ = frozenset(
    {
        "peft_type",
        "r",
        "lora_alpha",
        "use_rslora",
        "target_modules",
        "exclude_modules",
        "layers_to_transform",
        "layers_pattern",
        "rank_pattern",
        "alpha_pattern",
        "target_parameters",
        "fan_in_fan_out",
        "bias",
        "init_lora_weights",
        "auto_mapping",
    }
)
# Fields that, once set, need math loraplex does not do.
_REFUSED_WHEN_SET = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "fully trained copies of modules (modules_to_save)",
    "lora_bias": "LoRA bias vectors (lora_bias)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "layer_replication": "layer replication (layer_replication)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "megatron_config": "Megatron-parallel LoRA layers (megatron_config)",
    "velora_config": "the VeLoRA variant (velora_config)",
    "monteclora_config": "the MonteCLoRA variant (monteclora_config)",
    "kasa_config": "the KaSA variant (kasa_config), which also changes the base weights",
    "arrow_config": "Arrow routing between adapters (arrow_config)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
}
_PLAIN_INITS = frozenset({"gaussian", "eva", "orthogonal", "mica"})
# These initialisations subtract the adapter's start from the base weights, so the adapter is only right on
# top of a modified base model, unless it was saved with path_initial_model_for_weight_conversion.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


@dataclass(frozen=True, slots=True)
class LoraAdapterConfig:
    """The parts of adapter_config.json that decide which modules are adapted and how they are scaled."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str  # names matched by suffix, or one regex matched with re.fullmatch
    exclude_modules: tuple[str, ...] | str | None
    layers_to_transform: tuple[int, ...] | None
    layers_pattern: tuple[str, ...] | None
    rank_pattern: tuple[tuple[str, int], ...]  # in the file's order: the first match wins
    alpha_pattern: tuple[tuple[str, float], ...]
    # Parameters adapted whole (peft's target_parameters: MoE experts), matched as peft matches them: a parameter's
    # full name equals an entry or ends with "." + one; layers_to_transform and exclude_modules do not apply.
    target_parameters: tuple[str, ...] = ()
    # The regexes PEFT builds from layers_pattern and the pattern keys, compiled once (there can be thousands).
    _layer_regexes: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)
    _rank_regexes: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)
    _alpha_regexes: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        compiled = {
            "_layer_regexes": _compile(
                "layers_pattern", self.layers_pattern or (), peft_matching.compile_layers_pattern
            ),
            "_rank_regexes": _compile(
                "rank_pattern", [k for k, _ in self.rank_pattern], peft_matching.compile_pattern_key
            ),
            "_alpha_regexes": _compile(
                "alpha_pattern", [k for k, _ in self.alpha_pattern], peft_matching.compile_pattern_key
            ),
        }
        for name, regexes in compiled.items():
            object.__setattr__(self, name, regexes)

    @classmethod
    def parse(cls, raw: bytes) -> LoraAdapterConfig:
        """Read adapter_config.json's bytes; raise an AdapterError naming the first field at fault."""
        if len(raw) > MAX_CONFIG_BYTES:
            raise AdapterFormatError(
                f"{CONFIG_FILE} is {len(raw)} bytes; at most {MAX_CONFIG_BYTES} are accepted", field=CONFIG_FILE
            )
        try:
            values = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise AdapterFormatError(
                f"{CONFIG_FILE} is not valid UTF-8 JSON ({type(exc).__name__}: {exc})", field=CONFIG_FILE
            ) from None
        if not isinstance(values, dict):
            raise AdapterFormatError(f"{CONFIG_FILE} must hold a JSON object", field=CONFIG_FILE)
        return _Reader(values).config()

    def targets(self, key: str) -> bool:
        """Whether PEFT adapts the module named `key` (e.g. "model.layers.0.self_attn.q_proj")."""
        return peft_matching.is_targeted(
            key,
            target_modules=self.target_modules,
            exclude_modules=self.exclude_modules,
            layers_to_transform=self.layers_to_transform,
            layer_regexes=self._layer_regexes,
        )

    def targets_parameter(self, key: str) -> bool:
        """Whether PEFT adapts the parameter named `key` (e.g. "model.layers.0.mlp.experts.gate_up_proj")."""
        return any(key == name or key.endswith("." + name) for name in self.target_parameters)

    def rank_for(self, key: str) -> int:
        index = peft_matching.first_matching(self._rank_regexes, key)
        return self.r if index is None else self.rank_pattern[index][1]

    def alpha_for(self, key: str) -> float:
        index = peft_matching.first_matching(self._alpha_regexes, key)
        return self.lora_alpha if index is None else self.alpha_pattern[index][1]

    def scaling_for(self, key: str) -> float:
        """alpha / r, or alpha / sqrt(r) with rsLoRA, from the module's own r and alpha (as LoraLayer does)."""
        rank = self.rank_for(key)
        return self.alpha_for(key) / (math.sqrt(rank) if self.use_rslora else rank)


class _Reader:
    """Checks one parsed JSON object field by field; raises on the first problem."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        self.num_repeats = 0

    def config(self) -> LoraAdapterConfig:
        self.check_peft_type()
        self.check_features()
        if self.values.get("fan_in_fan_out", False) is not False:
            raise UnsupportedAdapterFeature(
                f"{CONFIG_FILE} field 'fan_in_fan_out' is {_shown(self.values['fan_in_fan_out'])}; it is for "
                "GPT-2 style Conv1D layers, and Llama-family models need false",
                field="fan_in_fan_out",
            )
        bias = self.values.get("bias", "none")
        if bias != "none":
            raise UnsupportedAdapterFeature(
                f"{CONFIG_FILE} field 'bias' is {_shown(bias)}: trained base-model biases are not supported; "
                "only 'none' is",
                field="bias",
            )
        layers_to_transform = self.layers_to_transform()
        layers_pattern = self.names("layers_pattern", regex=True)
        if layers_pattern and layers_to_transform is None:
            raise AdapterConfigError(
                f"{CONFIG_FILE}: 'layers_pattern' needs 'layers_to_transform' (PEFT refuses this too)",
                field="layers_pattern",
            )
        target_parameters = self.names("target_parameters", regex=False) or ()
        target_modules = self.target_modules(layers_to_transform, bool(target_parameters))
        exclude_modules = self.exclude_modules()
        rank_pattern = self.pattern("rank_pattern", self.rank)
        alpha_pattern = self.pattern("alpha_pattern", self.alpha)
        if self.num_repeats > MAX_TOTAL_REGEX_REPEATS:
            raise AdapterConfigError(
                f"{CONFIG_FILE}'s regular expressions (target_modules, exclude_modules, layers_pattern, rank_pattern "
                f"and alpha_pattern) hold {self.num_repeats} repetitions in all; at most {MAX_TOTAL_REGEX_REPEATS} "
                "are accepted",
            )
        config = LoraAdapterConfig(
            r=self.rank("r", self.values.get("r", 8)),
            lora_alpha=self.alpha("lora_alpha", self.values.get("lora_alpha", 8)),
            use_rslora=self.boolean("use_rslora"),
            target_modules=target_modules,
            exclude_modules=exclude_modules,
            layers_to_transform=layers_to_transform or None,
            layers_pattern=layers_pattern or None,
            rank_pattern=rank_pattern,
            alpha_pattern=alpha_pattern,
            target_parameters=target_parameters,
        )
        for module in EMBEDDING_MODULES:
            if config.targets(module):
                raise UnsupportedAdapterFeature(
                    f"{CONFIG_FILE} field 'target_modules' selects '{module}'; LoRA on embeddings or the output "
                    "layer is not supported",
                    field="target_modules",
                )
        return config

    def check_peft_type(self) -> None:
        peft_type = self.values.get("peft_type")
        if peft_type is None:
            raise AdapterConfigError(f"{CONFIG_FILE} has no 'peft_type' field (expected \"LORA\")", field="peft_type")
        if peft_type != "LORA":
            raise UnsupportedAdapterFeature(
                f"{CONFIG_FILE} field 'peft_type' is {_shown(peft_type)}; only \"LORA\" adapters are supported",
                field="peft_type",
            )

    def check_features(self) -> None:
        for name, value in self.values.items():
            if name in _REFUSED_WHEN_SET and _is_set(value):
                raise UnsupportedAdapterFeature(
                    f"{CONFIG_FILE} field '{name}' is set: {_REFUSED_WHEN_SET[name]} is not supported", field=name
                )
            if name not in _REFUSED_WHEN_SET and name not in _READ and name not in _IGNORED and _is_set(value):
                raise UnsupportedAdapterFeature(
                    f"{CONFIG_FILE} field '{shorten(name)}' is unknown to loraplex (written by a newer PEFT?) and is "
                    "set; it may change the adapter's math, so the adapter is refused",
                    field=name,
                )
        init = self.values.get("init_lora_weights", True)
        if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
            raise UnsupportedAdapterFeature(
                f"{CONFIG_FILE} field 'init_lora_weights' is {_shown(init)}: that initialisation changes the base "
                "model's weights, so this adapter is wrong on the original base. Save it with PEFT's "
                "save_pretrained(..., path_initial_model_for_weight_conversion=...) to get a plain LoRA adapter",
                field="init_lora_weights",
            )
        if not isinstance(init, bool) and not (isinstance(init, str) and init in _PLAIN_INITS):
            raise AdapterConfigError(
                f"{CONFIG_FILE} field 'init_lora_weights' is {_shown(init)}, which PEFT does not define",
                field="init_lora_weights",
            )
        auto_mapping = self.values.get("auto_mapping")
        # PEFT writes {"base_model_class", "parent_library"} when task_type is unset; only transformers' own
        # classes are acceptable, anything else names custom code.
        if auto_mapping is not None and not (
            isinstance(auto_mapping, dict)
            and isinstance(auto_mapping.get("base_model_class"), str)
            and isinstance(auto_mapping.get("parent_library"), str)
            and auto_mapping["parent_library"].startswith("transformers.")
        ):
            raise UnsupportedAdapterFeature(
                f"{CONFIG_FILE} field 'auto_mapping' is {_shown(auto_mapping)}, which points to code outside "
                "transformers; custom model code is not supported",
                field="auto_mapping",
            )

    def target_modules(
        self, layers_to_transform: tuple[int, ...] | None, has_parameters: bool
    ) -> tuple[str, ...] | str:
        value = self.values.get("target_modules")
        if value is None:
            # PEFT adapts no module when only target_parameters are given (and saves the defaults it filled in).
            return () if has_parameters else DEFAULT_TARGET_MODULES
        if isinstance(value, str):
            if self.values.get("layers_to_transform") is not None or self.values.get("layers_pattern") is not None:
                raise AdapterConfigError(
                    f"{CONFIG_FILE}: 'layers_to_transform' and 'layers_pattern' cannot be used when 'target_modules' "
                    "is a string (PEFT refuses this too)",
                    field="layers_to_transform",
                )
            if value.lower() == "all-linear":
                # Every linear module but the output layer: each decoder layer's projections, by any family's names.
                return ALL_MODULES
            self.num_repeats += peft_matching.check_regex(value, "target_modules")
            return value
        names = self.names("target_modules", regex=False) or ()
        if layers_to_transform and len(names) >= _PEFT_CONDENSE_AT and any("." in name for name in names):
            raise AdapterConfigError(
                f"{CONFIG_FILE} field 'target_modules' lists {len(names)} full module names together with "
                "'layers_to_transform'; PEFT resolves this combination inconsistently. List module names such as "
                "'q_proj', or drop 'layers_to_transform'",
                field="target_modules",
            )
        return names

    def exclude_modules(self) -> tuple[str, ...] | str | None:
        value = self.values.get("exclude_modules")
        if isinstance(value, str):
            self.num_repeats += peft_matching.check_regex(value, "exclude_modules")
            return value
        return self.names("exclude_modules", regex=False) or None

    def names(self, name: str, *, regex: bool) -> tuple[str, ...] | None:
        """A list of strings (or, for layers_pattern, one string) or null."""
        value = self.values.get(name)
        if value is None:
            return None
        if regex and isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise AdapterConfigError(
                f"{CONFIG_FILE} field '{name}' must be a list of strings or a string, got {_shown(value)}", field=name
            )
        if regex:
            for item in value:
                self.num_repeats += peft_matching.check_regex(item, name)
        return tuple(value)

    def layers_to_transform(self) -> tuple[int, ...] | None:
        value = self.values.get("layers_to_transform")
        if value is None:
            return None
        layers = [value] if _is_int(value) else value
        if not isinstance(layers, list) or not all(_is_int(layer) and layer >= 0 for layer in layers):
            raise AdapterConfigError(
                f"{CONFIG_FILE} field 'layers_to_transform' must be a layer index or a list of them, "
                f"got {_shown(value)}",
                field="layers_to_transform",
            )
        return tuple(layers)

    def pattern(self, name: str, read_value: Any) -> tuple[tuple[str, Any], ...]:
        value = self.values.get(name) or {}
        if not isinstance(value, dict):
            raise AdapterConfigError(f"{CONFIG_FILE} field '{name}' must be an object, got {_shown(value)}", field=name)
        if len(value) > MAX_PATTERN_ENTRIES:
            raise AdapterConfigError(
                f"{CONFIG_FILE} field '{name}' has {len(value)} entries; at most {MAX_PATTERN_ENTRIES} are accepted",
                field=name,
            )
        entries = []
        for key, item in value.items():
            self.num_repeats += peft_matching.check_regex(key, name)
            entries.append((key, read_value(f"{name}.{key}", item)))
        return tuple(entries)

    def rank(self, name: str, value: object) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        raise AdapterConfigError(
            f"{CONFIG_FILE} field '{name}' must be an integer >= 1, got {_shown(value)}", field=name
        )

    def alpha(self, name: str, value: object) -> float:
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise AdapterConfigError(
                f"{CONFIG_FILE} field '{name}' must be a finite number, got {_shown(value)}", field=name
            )
        return float(value)

    def boolean(self, name: str) -> bool:
        value = self.values.get(name, False)
        if not isinstance(value, bool):
            raise AdapterConfigError(
                f"{CONFIG_FILE} field '{name}' must be true or false, got {_shown(value)}", field=name
            )
        return value


def _is_set(value: object) -> bool:
    return value not in (None, False, "", [], {})


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _compile(name: str, patterns: Iterable[str], wrap: Callable[[str], re.Pattern[str]]) -> tuple[re.Pattern[str], ...]:
    """The regexes PEFT wraps around the patterns of field `name`; a pattern valid alone may break the wrapper."""
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(wrap(pattern))
        except (re.error, RecursionError, OverflowError) as exc:
            raise AdapterConfigError(
                f"{CONFIG_FILE} field '{name}' holds {_shown(pattern)}, which is not a usable regular "
                f"expression: {exc}",
                field=name,
            ) from None
    return tuple(compiled)


def _shown(value: object) -> str:
    return shorten(repr(value), 80)
