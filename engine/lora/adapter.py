"""A PEFT LoRA adapter checked against its base model and prepared for serving.

`parse_adapter` is the one place an adapter is validated: the engine calls it when it loads an adapter and the
platform calls it on upload, so an adapter that passes here is servable, and one that fails gets one message
naming the file, field or tensor at fault. Nothing is returned until every check has passed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from loraplex.engine.lora.adapter_config import CONFIG_FILE, LoraAdapterConfig
from loraplex.engine.lora.adapter_files import DEFAULT_MAX_WEIGHTS_BYTES, WEIGHTS_FILE, adapter_digest, read_adapter_dir
from loraplex.engine.lora.base_modules import (
    ALL_MODULES,
    BLOCK_OF,
    EXPERT_MODULES,
    MODULES,
    adaptable_modules,
    expert_modules,
    module_key,
    module_shape,
)
from loraplex.engine.lora.errors import (
    AdapterConfigError,
    AdapterFormatError,
    AdapterRankError,
    AdapterShapeError,
    AdapterValueError,
    shorten,
)
from loraplex.engine.lora.safetensors_format import TensorInfo, load_tensors, parse_safetensors
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.decoder_weights import qkv_row_order
from loraplex.engine.model.layers.rope import interleave_rotary_rows

# adapter_digest and read_adapter_dir live in adapter_files; they are part of this module's API too.
__all__ = [
    "MODULES",
    "LoraAdapter",
    "LoraModule",
    "ModuleId",
    "adapter_digest",
    "module_shape",
    "parse_adapter",
    "read_adapter_dir",
]

DEFAULT_MAX_RANK = 128
LORA_DTYPES = frozenset({"F32", "F16", "BF16"})

# PEFT's save_pretrained writes "...q_proj.lora_A.weight"; some tools keep the adapter name ("lora_A.default").
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(?P<layer>0|[1-9][0-9]{0,5})\.(?P<block>[a-z_]{1,32})"
    r"\.(?P<module>[A-Za-z0-9_]{1,64})"
    r"\.lora_(?P<half>[AB])(?P<spelling>(?:\.default)?\.weight)"
)
_EXAMPLE_KEY = "base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight"
# peft's target_parameters on a sparse layer's experts: one pair per parameter, the second parameter's wrapper around
# the first's ("experts.base_layer.lora_A" is the inner one). Which parameter a pair adapts follows from its shapes.
_EXPERT_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(?P<layer>0|[1-9][0-9]{0,5})\.mlp\.experts(?P<nest>(?:\.base_layer){0,3})"
    r"\.lora_(?P<half>[AB])(?P<spelling>(?:\.default)?\.weight)"
)

ModuleId = tuple[int, str]  # (layer index, module name from the base's adaptable_modules)


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One adapted linear module, ready to serve: its delta is x @ a.T @ b.T (= x @ (b @ a).T).

    b already carries the scaling (lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA, from this module's own r
    and alpha after rank_pattern / alpha_pattern), so serving never multiplies by it. For q_proj, k_proj and a fused
    qkv_proj, b's rows are in the engine's interleaved rotary order (`interleave_rotary_rows`, `qkv_row_order`), the
    order in which the engine stores those projections' output rows.
    """

    layer: int
    module: str  # one of the base's adaptable_modules
    rank: int
    scaling: float
    a: torch.Tensor  # [rank, in_features]; for experts [experts * rank, in]: expert e's A in rows e * rank ...
    b: torch.Tensor  # [out_features, rank], scaled, q/k rows interleaved; for experts [out, experts * rank]
    experts: int = 1  # an expert parameter's: one LoRA of `rank` per expert, stacked expert by expert

    @property
    def key(self) -> str:
        return module_key(self.layer, self.module)


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A validated adapter: its config, its modules by (layer, module), its content digest and its size.

    num_bytes: what the prepared a and b tensors take in memory (in the dtype parse_adapter was given).
    """

    config: LoraAdapterConfig
    modules: dict[ModuleId, LoraModule]
    digest: str
    num_bytes: int

    @property
    def max_rank(self) -> int:
        return max(module.rank for module in self.modules.values())

    @property
    def ranks(self) -> dict[ModuleId, int]:
        return {module_id: module.rank for module_id, module in self.modules.items()}

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({layer for layer, _ in self.modules}))


def parse_adapter(
    config_bytes: bytes,
    weights_bytes: bytes,
    base: ModelConfig,
    *,
    max_rank: int = DEFAULT_MAX_RANK,
    dtype: torch.dtype = torch.float32,
    max_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES,
) -> LoraAdapter:
    """Validate adapter_config.json and adapter_model.safetensors against `base` and prepare every module.

    Checks, in order: size; the config; the safetensors structure; tensor names (PEFT's, for the seven
    projections of a decoder layer in range); A and B present together; the modules present are exactly those
    the config targets; per module: rank within max_rank, dtype f32/f16/bf16, A [r, in] and B [out, r] with the
    config's r for that module; then, reading the values, finite values that stay finite in `dtype`.
    """
    if len(weights_bytes) > max_bytes:
        raise AdapterFormatError(
            f"{WEIGHTS_FILE} is {len(weights_bytes)} bytes; at most {max_bytes} are accepted", field=WEIGHTS_FILE
        )
    config = LoraAdapterConfig.parse(config_bytes)
    infos = parse_safetensors(weights_bytes, file_name=WEIGHTS_FILE)
    pairs = _pair_tensors(infos, base)
    _check_targets(config, pairs, base)

    module_ids = sorted(pairs, key=_order)
    # Every structural check before any tensor is read, so a bad upload costs no tensor copies.
    for module_id in module_ids:
        _check_module(module_id, pairs[module_id], infos, config, base, max_rank=max_rank)
    modules = {
        module_id: _load_module(module_id, pairs[module_id], infos, weights_bytes, config, base, dtype=dtype)
        for module_id in module_ids
    }
    num_bytes = sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in modules.values())
    return LoraAdapter(config, modules, adapter_digest(config_bytes, weights_bytes), num_bytes)


def _pair_tensors(infos: dict[str, TensorInfo], base: ModelConfig) -> dict[ModuleId, tuple[str, str]]:
    """(layer, module) -> (A's name, B's name); refuses any other tensor, naming it."""
    halves: dict[ModuleId, dict[str, str]] = {}
    spelling: dict[ModuleId, str] = {}
    nested: dict[tuple[int, str], dict[str, str]] = {}  # (layer, nesting) -> half -> name, of expert pairs
    for name in infos:
        expert = _EXPERT_KEY.fullmatch(name) if base.moe is not None else None
        if expert is not None:
            nested.setdefault((int(expert["layer"]), expert["nest"] + expert["spelling"]), {})[expert["half"]] = name
            continue
        match = _KEY.fullmatch(name)
        if match is None:
            raise AdapterFormatError(
                f"{WEIGHTS_FILE} holds tensor '{shorten(name)}': {_why_not_lora(name)}", field=name
            )
        layer, block, module = int(match["layer"]), match["block"], match["module"]
        modules = adaptable_modules(base)
        if base.moe is not None and block == "mlp":
            why = _why_not_lora(name) if module == "gate" else _MOE_MLP
            raise AdapterFormatError(f"{WEIGHTS_FILE} holds tensor '{shorten(name)}': {why}", field=name)
        if BLOCK_OF.get(module) != block or module not in modules:
            raise AdapterFormatError(
                f"{WEIGHTS_FILE} holds tensor '{name}' for module '{block}.{module}', which is not one of the "
                f"adaptable modules of this {base.architecture} base "
                f"({', '.join(f'{BLOCK_OF[m]}.{m}' for m in modules)})",
                field=name,
            )
        if layer >= base.num_layers:
            raise AdapterShapeError(
                f"{WEIGHTS_FILE} holds tensor '{name}' for layer {layer}, but the base model has "
                f"{base.num_layers} layers (0 to {base.num_layers - 1})",
                field=name,
            )
        module_id: ModuleId = (layer, module)
        if spelling.setdefault(module_id, match["spelling"]) != match["spelling"]:
            raise AdapterFormatError(
                f"{WEIGHTS_FILE} holds tensor '{name}' and the same module under another spelling "
                "('.lora_A.weight' and '.lora_A.default.weight'); keep one",
                field=name,
            )
        halves.setdefault(module_id, {})[match["half"]] = name
    for (layer, _), found in sorted(nested.items()):
        module_id = (layer, _expert_module(found, infos, base))
        if module_id in halves:
            raise AdapterFormatError(
                f"{WEIGHTS_FILE} holds two LoRA pairs for {module_key(*module_id)} ('{found.get('A', found.get('B'))}' "
                "and another)",
                field=found.get("A", found.get("B", "")),
            )
        halves[module_id] = found
    pairs: dict[ModuleId, tuple[str, str]] = {}
    for module_id, found in halves.items():
        for half, other in (("A", "B"), ("B", "A")):
            if half not in found:
                missing = found[other].replace(f".lora_{other}.", f".lora_{half}.")
                raise AdapterFormatError(
                    f"{WEIGHTS_FILE} holds '{found[other]}' but not its partner '{missing}'", field=missing
                )
        pairs[module_id] = (found["A"], found["B"])
    return pairs


_MOE_MLP = (
    "LoRA on the dense MLP modules or on each expert's own modules of a mixture-of-experts base is not supported "
    "yet; adapt its attention (q_proj, k_proj, v_proj, o_proj) and its experts as peft's target_parameters does "
    "('mlp.experts.gate_up_proj', 'mlp.experts.down_proj')"
)


def _expert_module(found: dict[str, str], infos: dict[str, TensorInfo], base: ModelConfig) -> str:
    """Which expert parameter one nested LoRA pair adapts, from its shapes: A [experts * r, in] and B [out,
    experts * r], where gate_up_proj's `in` is the hidden size and down_proj's the experts' intermediate size (and
    their `out` the other way round, so no two shapes are alike)."""
    assert base.moe is not None
    name = found.get("A") or found["B"]
    layer = int(name.split(".")[4])
    if not base.moe.is_sparse(layer):
        raise AdapterFormatError(
            f"{WEIGHTS_FILE} holds tensor '{name}' for the experts of layer {layer}, which is a dense layer of this "
            f"{base.architecture} base",
            field=name,
        )
    for module in EXPERT_MODULES:
        in_features, out_features = module_shape(base, module)
        a, b = found.get("A"), found.get("B")
        if (a is None or tuple(infos[a].shape[1:]) == (in_features,)) and (
            b is None or tuple(infos[b].shape[:1]) == (out_features,)
        ):
            return module
    raise AdapterShapeError(
        f"tensor '{name}' has shape {list(infos[name].shape)}, which fits neither expert parameter of this base "
        f"(gate_up_proj: A [experts * r, {base.hidden_size}], B [{2 * base.moe.intermediate_size}, experts * r]; "
        f"down_proj: A [experts * r, {base.moe.intermediate_size}], B [{base.hidden_size}, experts * r])",
        field=name,
    )


def _why_not_lora(name: str) -> str:
    if ".mlp.gate." in name or ".block_sparse_moe.gate." in name:
        return "LoRA on a mixture-of-experts router (mlp.gate) is not supported"
    if ".experts." in name or "block_sparse_moe" in name:
        return _MOE_MLP
    if "lora_embedding_" in name or "embed_tokens" in name or "lm_head" in name:
        return "LoRA on embeddings or the output layer is not supported"
    if "lora_magnitude_vector" in name:
        return "DoRA magnitude vectors are not supported"
    if ".lora_" in name and name.endswith(".bias"):
        return "LoRA biases are not supported"
    return f"not a LoRA weight of a decoder-layer projection (expected names like '{_EXAMPLE_KEY}')"


def _check_targets(config: LoraAdapterConfig, pairs: dict[ModuleId, tuple[str, str]], base: ModelConfig) -> None:
    """The modules with tensors must be exactly the modules adapter_config.json selects, as PEFT selects them."""
    targeted = {
        (layer, module)
        for layer in range(base.num_layers)
        for module in adaptable_modules(base)
        if config.targets(module_key(layer, module)) and not (base.moe is not None and BLOCK_OF[module] == "mlp")
    }
    experts = {
        (layer, module)
        for layer in range(base.num_layers)
        for module in expert_modules(base)
        if base.moe is not None and base.moe.is_sparse(layer) and config.targets_parameter(module_key(layer, module))
    }
    if config.target_parameters and not experts:
        raise AdapterConfigError(
            f"{CONFIG_FILE} field 'target_parameters' ({', '.join(config.target_parameters)}) selects no parameter "
            f"of this {base.architecture} base; adaptable are the experts' "
            + (", ".join(f"'mlp.{m}'" for m in EXPERT_MODULES) if base.moe is not None else "(it has none)"),
            field="target_parameters",
        )
    targeted |= experts
    if not targeted:
        raise AdapterConfigError(
            f"{CONFIG_FILE} field 'target_modules' (with exclude_modules and layers_to_transform) selects no "
            f"module of the base model; adaptable are {', '.join(adaptable_modules(base))} in layers 0 to "
            f"{base.num_layers - 1}",
            field="target_modules",
        )
    untargeted = sorted(pairs.keys() - targeted, key=_order)
    if untargeted:
        a_name = pairs[untargeted[0]][0]
        raise AdapterFormatError(
            f"{WEIGHTS_FILE} holds tensor '{a_name}' for {module_key(*untargeted[0])}, which {CONFIG_FILE}'s "
            "target_modules (with exclude_modules and layers_to_transform) does not select",
            field=a_name,
        )
    if not pairs:
        raise AdapterFormatError(f"{WEIGHTS_FILE} holds no LoRA tensors: the adapter is empty", field=WEIGHTS_FILE)
    missing = sorted(targeted - pairs.keys(), key=_order)
    if missing:
        expected = f"base_model.model.{module_key(*missing[0])}.lora_A.weight"
        raise AdapterFormatError(
            f"{CONFIG_FILE} selects {module_key(*missing[0])} but {WEIGHTS_FILE} has no tensor for it "
            f"(expected '{expected}' and its lora_B)",
            field=expected,
        )


def _order(module_id: ModuleId) -> tuple[int, int]:
    return module_id[0], (*ALL_MODULES, *EXPERT_MODULES).index(module_id[1])


def _check_module(
    module_id: ModuleId,
    names: tuple[str, str],
    infos: dict[str, TensorInfo],
    config: LoraAdapterConfig,
    base: ModelConfig,
    *,
    max_rank: int,
) -> None:
    """One module's rank against the limit, and its A and B (names) against the config's rank and the base."""
    (layer, module), (a_name, b_name) = module_id, names
    key = module_key(layer, module)
    rank = config.rank_for(key)
    if rank > max_rank:
        raise AdapterRankError(
            f"{key} has rank {rank} (from {CONFIG_FILE}); this server accepts ranks up to {max_rank}", field=key
        )
    in_features, out_features = module_shape(base, module)
    if module in EXPERT_MODULES:  # one LoRA per expert, stacked as peft's ParamWrapper holds them
        assert base.moe is not None
        stacked = base.moe.num_experts * rank
        expectations = (
            (a_name, (stacked, in_features), "[experts * rank, in_features]"),
            (b_name, (out_features, stacked), "[out_features, experts * rank]"),
        )
    else:
        expectations = (
            (a_name, (rank, in_features), "[rank, in_features]"),
            (b_name, (out_features, rank), "[out_features, rank]"),
        )
    for name, expected, layout in expectations:
        info = infos[name]
        if info.dtype not in LORA_DTYPES:
            raise AdapterFormatError(
                f"tensor '{name}' is {info.dtype}; LoRA weights must be F32, F16 or BF16", field=name
            )
        if info.shape != expected:
            raise AdapterShapeError(
                f"tensor '{name}' has shape {list(info.shape)}; expected {list(expected)} = {layout}, with rank "
                f"{rank} from {CONFIG_FILE} (r / rank_pattern) and the base model's {key} "
                f"({in_features} in, {out_features} out)",
                field=name,
            )


def _load_module(
    module_id: ModuleId,
    names: tuple[str, str],
    infos: dict[str, TensorInfo],
    data: bytes,
    config: LoraAdapterConfig,
    base: ModelConfig,
    *,
    dtype: torch.dtype,
) -> LoraModule:
    """A checked module's A and B (names) read, checked for finite values, scaled, reordered and cast."""
    (layer, module), (a_name, b_name) = module_id, names
    key = module_key(layer, module)
    tensors = load_tensors(data, infos, names)
    for name, tensor in tensors.items():
        if not torch.isfinite(tensor).all():
            raise AdapterValueError(f"tensor '{name}' holds NaN or infinite values", field=name)

    scaling = config.scaling_for(key)
    a = tensors[a_name].to(torch.float32)
    b = tensors[b_name].to(torch.float32) * scaling
    rotary_dim = base.rope.rotary_dim
    if module == "q_proj":
        b = interleave_rotary_rows(b, base.num_heads, base.head_dim, rotary_dim)
    elif module == "k_proj":
        b = interleave_rotary_rows(b, base.num_kv_heads, base.head_dim, rotary_dim)
    elif module == "qkv_proj":
        b = b.index_select(0, qkv_row_order(base))
    experts = 1
    if module in EXPERT_MODULES:
        # peft's B columns run rank-major (column j * experts + e is expert e's j-th); ours expert by expert, as A's
        # rows, so each expert's B is one block of columns.
        assert base.moe is not None
        experts = base.moe.num_experts
        rank = a.shape[0] // experts
        b = b.view(b.shape[0], rank, experts).transpose(1, 2).reshape(b.shape[0], experts * rank)
    prepared = {a_name: a.to(dtype).contiguous(), b_name: b.to(dtype).contiguous()}
    for name, tensor in prepared.items():
        if not torch.isfinite(tensor).all():
            raise AdapterValueError(
                f"tensor '{name}' (scaled by {scaling:g}) overflows {str(dtype).removeprefix('torch.')}", field=name
            )
    return LoraModule(layer, module, a.shape[0] // experts, scaling, prepared[a_name], prepared[b_name], experts)
